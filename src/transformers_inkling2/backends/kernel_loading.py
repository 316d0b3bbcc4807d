"""The one place where the model meets its hub kernels.

The routed-expert kernel (`inkling2_moe`: routing, grouped GEMMs with fused NVFP4 / MXFP8 dequantization, the
softcapped SwiGLU and the combine) is a kernel package in kernel-builder's layout under `hub_kernels/inkling2_moe`,
loaded with the `kernels` library from its build (`build/torch-cpu`, `build/torch-cuda`). By default it is loaded
from the copy an installed wheel carries, built when the wheel was (setup.py), or from a checkout's folder, built
there on first use and whenever its sources changed (`python hub_kernels/build.py` does the same by hand). Set
`INKLING2_MOE_KERNEL` to another local kernel folder (with its `build/`), or to a Hub repo id (`owner/name`,
optionally `owner/name@revision`) to load a published build.
"""

import functools
import importlib.util
import os
from pathlib import Path

import torch

KERNEL_ENV = "INKLING2_MOE_KERNEL"
# "0": the kernel sums the experts' outputs itself even where a decode step's layer end would add them up
TERMS_ENV = "INKLING2_FUSED_EXPERT_SUM"
BUILD_COMMAND = "python hub_kernels/build.py"
_PACKAGE = Path(__file__).resolve().parents[1]  # transformers_inkling2/
# the built copy inside an installed wheel; or a checkout's kernel folder (next to src/) and the builder beside it
WHEEL_KERNEL = _PACKAGE / "hub_kernels" / "inkling2_moe"
CHECKOUT_KERNEL = _PACKAGE.parents[1] / "hub_kernels" / "inkling2_moe"
CHECKOUT_BUILDER = CHECKOUT_KERNEL.parent / "build.py"


def local_kernel() -> Path:
    """The default kernel folder, its `build/` current: an installed wheel's, or a checkout's (built here if needed)."""
    if (WHEEL_KERNEL / "build").is_dir():
        return WHEEL_KERNEL
    if CHECKOUT_BUILDER.is_file() and (CHECKOUT_KERNEL / "build.toml").is_file():
        spec = importlib.util.spec_from_file_location("_inkling2_hub_kernels_build", CHECKOUT_BUILDER)
        builder = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(builder)
        try:
            builder.ensure_built(CHECKOUT_KERNEL)
        except (OSError, builder.BuildError) as error:
            raise RuntimeError(f"Could not build the inkling2_moe kernel in {CHECKOUT_KERNEL}: {error}. Run "
                               f"`{BUILD_COMMAND}` in the checkout.") from error  # fmt: skip
        return CHECKOUT_KERNEL
    raise FileNotFoundError(
        f"The inkling2_moe kernel is neither built into this installation ({WHEEL_KERNEL / 'build'}) nor in a "
        f"checkout ({CHECKOUT_KERNEL}). Reinstall transformers-inkling2 (its wheel builds the kernel), run "
        f"`{BUILD_COMMAND}` in a checkout, or set {KERNEL_ENV} to the kernel's folder or Hub repo id."
    )


@functools.cache
def moe_kernel():
    """The loaded `inkling2_moe` kernel module (imported once per process)."""
    import kernels

    source = os.environ.get(KERNEL_ENV)
    if not source:
        return kernels.get_local_kernel(local_kernel())
    if Path(source).exists():
        if not (Path(source) / "build").is_dir():
            raise FileNotFoundError(
                f"{KERNEL_ENV}={source} has no `build/` folder. Build it (`{BUILD_COMMAND} {source}` for a "
                f"pure-Python kernel folder, kernel-builder otherwise), or unset {KERNEL_ENV}."
            )
        return kernels.get_local_kernel(Path(source))
    repo_id, _, revision = source.partition("@")
    return kernels.get_kernel(repo_id, revision=revision or None)


@torch.library.custom_op("inkling2::routed_experts", mutates_args=())
def routed_experts(
    x: torch.Tensor,
    expert_ids: torch.Tensor,
    routing_weights: torch.Tensor,
    w13: torch.Tensor,
    w2: torch.Tensor,
    fmt: str,
    gate_cap: float,
    up_cap: float,
    w13_scale: torch.Tensor | None = None,
    w2_scale: torch.Tensor | None = None,
    w13_outer: torch.Tensor | None = None,
    w2_outer: torch.Tensor | None = None,
    combine: bool = True,
) -> torch.Tensor:
    """`moe_kernel().moe_forward` (same arguments; bf16 [T, H] out, or with `combine=False` the sum's terms, fp32
    [parts, T, top_k, H]) as a custom op: `torch.compile` (the compiled decode steps) calls the kernel as it is.
    Traced into, its Gluon kernels (NVFP4 / MXFP8 decode) would be handed to Inductor's Triton compiler, which cannot
    build them."""
    terms = {} if combine else dict(combine=False)  # (a kernel build without the option takes the default call)
    return moe_kernel().moe_forward(x, expert_ids, routing_weights, w13, w2, fmt, w13_scale=w13_scale,
                                    w2_scale=w2_scale, w13_outer=w13_outer, w2_outer=w2_outer, gate_cap=gate_cap,
                                    up_cap=up_cap, **terms)  # fmt: skip


@routed_experts.register_fake
def _(x, expert_ids, routing_weights, w13, w2, fmt, gate_cap, up_cap, w13_scale=None, w2_scale=None, w13_outer=None,
      w2_outer=None, combine=True):
    if combine:
        return x.new_empty(x.shape, dtype=torch.bfloat16)
    parts = moe_kernel().slot_output_parts(x, expert_ids, w13, w2, fmt)  # from sizes and the device only
    return x.new_empty(parts, *expert_ids.shape, x.shape[-1], dtype=torch.float32)


@torch.compiler.assume_constant_result  # asked while `torch.compile` traces a step: a constant of the process
def kernel_returns_terms() -> bool:
    """Whether the loaded kernel has `moe_forward`'s `combine` option (a published build that `INKLING2_MOE_KERNEL`
    names may be older)."""
    return hasattr(moe_kernel(), "slot_output_parts")


def routed_expert_terms(x, expert_ids, routing_weights, w13, w2, fmt, gate_cap, up_cap, **scales):
    """`routed_experts(..., combine=False)`, or None from a kernel without the option or with
    `INKLING2_FUSED_EXPERT_SUM=0`: the caller then takes the kernel's sum."""
    if not kernel_returns_terms() or os.environ.get(TERMS_ENV, "1") == "0":
        return None
    return routed_experts(x, expert_ids, routing_weights, w13, w2, fmt, gate_cap, up_cap, **scales, combine=False)
