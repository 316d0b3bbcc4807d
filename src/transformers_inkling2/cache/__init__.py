"""Decoding caches: `dynamic` (Inkling2Cache), `static` (Inkling2StaticCache, fixed buffers for CUDA graphs) and
`common`, what both share with the model and the drafter (the step limit, row shifts, the convolution context)."""
