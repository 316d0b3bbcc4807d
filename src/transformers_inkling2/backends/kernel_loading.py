"""The one place where the model meets its hub kernels.

The routed-expert kernel (`inkling2_moe`: routing, grouped GEMMs with fused NVFP4 / MXFP8 dequantization, the
softcapped SwiGLU and the combine) is a kernel package in the Hub layout under `hub_kernels/inkling2_moe`, loaded
with the `kernels` library. By default it is loaded from that local folder; set `INKLING2_MOE_KERNEL` to another
local folder, or to a Hub repo id (`owner/name`, optionally `owner/name@revision`) to load a published build.
"""

import functools
import os
from pathlib import Path

import torch

KERNEL_ENV = "INKLING2_MOE_KERNEL"
# a checkout's `hub_kernels/`, or its copy inside an installed wheel
LOCAL_KERNEL = next(
    (
        path
        for path in (
            Path(__file__).resolve().parents[2] / "hub_kernels" / "inkling2_moe",
            Path(__file__).resolve().parent / "hub_kernels" / "inkling2_moe",
        )
        if path.is_dir()
    ),
    Path(__file__).resolve().parent / "hub_kernels" / "inkling2_moe",
)


@functools.cache
def moe_kernel():
    """The loaded `inkling2_moe` kernel module (imported once per process)."""
    import kernels

    source = os.environ.get(KERNEL_ENV)
    if source is None or Path(source).exists():
        path = Path(source) if source else LOCAL_KERNEL
        if not (path / "build").is_dir():
            raise FileNotFoundError(
                f"The inkling2_moe kernel is not at {path} (a `build/` folder is expected there). Reinstall "
                f"transformers-inkling2, or set {KERNEL_ENV} to the kernel's folder or Hub repo id."
            )
        return kernels.get_local_kernel(path)
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
) -> torch.Tensor:
    """`moe_kernel().moe_forward` (same arguments; bf16 [T, H] out) as a custom op: `torch.compile` (the compiled
    decode steps) calls the kernel as it is. Traced into, its Gluon kernels (NVFP4 / MXFP8 decode) would be handed
    to Inductor's Triton compiler, which cannot build them."""
    return moe_kernel().moe_forward(x, expert_ids, routing_weights, w13, w2, fmt, w13_scale=w13_scale,
                                    w2_scale=w2_scale, w13_outer=w13_outer, w2_outer=w2_outer, gate_cap=gate_cap,
                                    up_cap=up_cap)  # fmt: skip


@routed_experts.register_fake
def _(x, expert_ids, routing_weights, w13, w2, fmt, gate_cap, up_cap, w13_scale=None, w2_scale=None, w13_outer=None,
      w2_outer=None):
    return x.new_empty(x.shape, dtype=torch.bfloat16)
