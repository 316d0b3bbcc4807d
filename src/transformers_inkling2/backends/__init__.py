"""Fast paths registered into the model's registries: attention backends and their Triton / Gluon kernels
(`attention/`), the fused prompt convolution, the `inkling2_moe` hub kernel loader."""
