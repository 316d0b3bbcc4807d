"""A decode step's router in two launches on CUDA.

Registered as the model's `"top_k_routing"` kernel (`modeling.interfaces.KERNELS`). The reference
(`Inkling2TopKRouter`) takes five kernels for a step: the fp32 GEMV, the sigmoid and bias, `torch.topk`, the gather
and the normalization, each a launch that costs more than its work. For CUDA steps without gradients whose rows the
kernels route faster (`kernel_takes`), `router_kernel` does the same in two (see there; its partial sums are Gluon,
so they need Triton 3.6, `triton_features.GLUON_API`, and NVIDIA's 32-lane warps: ROCm keeps the reference). Prompts
keep the reference: there the GEMM is cuBLAS's business and the launches are amortized. A tensor-parallel plan
replicates the router, so it takes the kernel too when its weight is an ordinary tensor; a DTensor keeps the
reference.
"""

from __future__ import annotations

import torch

from ..modeling.tensors import differentiable, plain_contiguous

# Where the kernels route faster than the reference (an H100, `benchmarks/router.py`, docs/dev/benchmark-history.md):
# every step measured, 1 to 64 rows (tokens of a step, batch x step length) at 96 and 384 experts; at 64 rows and 384
# experts 23.5 against 43.0 us.
MAX_ROWS = 64
MAX_EXPERTS = 1024
FLOAT_DTYPES = (torch.float32, torch.bfloat16, torch.float16)


def kernel_takes(rows: int, experts: int) -> bool:
    """Whether `router_kernel` routes `rows` tokens over `experts` faster than the reference (see above)."""
    return 0 < rows <= MAX_ROWS and experts <= MAX_EXPERTS


def top_k_routing(
    x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor, top_k: int, route_scale: float
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None:
    """`Inkling2TopKRouter`'s (logits, weights, chosen experts) for x [rows, K]; None where the reference runs (see
    the module docstring)."""
    rows, experts = x.shape[0], weight.shape[0]
    if not x.is_cuda or not kernel_takes(rows, experts) or differentiable(x, weight, bias):
        return None
    if not (plain_contiguous(weight) and plain_contiguous(bias)):
        return None
    if x.dtype not in FLOAT_DTYPES or weight.dtype not in FLOAT_DTYPES:
        return None
    from .triton_features import GLUON_API  # Triton, imported where the kernels run

    if not GLUON_API or torch.version.hip is not None:  # the partial sums' layout is one of 32-lane warps
        return None
    from .router_kernel import top_k_routing as routing_kernel

    return routing_kernel(x.contiguous(), weight, bias, top_k, float(route_scale))


__all__ = ["MAX_ROWS", "kernel_takes", "top_k_routing"]
