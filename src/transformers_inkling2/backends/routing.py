"""A decode step's router in two launches on CUDA.

Registered as the model's `"top_k_routing"` kernel (`modeling.interfaces.KERNELS`). The reference
(`Inkling2TopKRouter`) takes five kernels for a step: the fp32 GEMV, the sigmoid and bias, `torch.topk`, the gather
and the normalization, each a launch that costs more than its work. For CUDA steps of at most `MAX_ROWS` tokens
without gradients, `router_kernel` does the same in two (see there). Prompts keep the reference: there the GEMM is
cuBLAS's business and the launches are amortized. A tensor-parallel plan replicates the router, so it takes the
kernel too when its weight is an ordinary tensor; a DTensor keeps the reference.
"""

from __future__ import annotations

import torch

from ..modeling.tensors import differentiable, plain_contiguous

# tokens of a step (batch x step length), as `router_kernel` takes them; past that cuBLAS's GEMM wins
MAX_ROWS = 16
MAX_EXPERTS = 1024
FLOAT_DTYPES = (torch.float32, torch.bfloat16, torch.float16)


def top_k_routing(
    x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor, top_k: int, route_scale: float
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None:
    """`Inkling2TopKRouter`'s (logits, weights, chosen experts) for x [rows, K]; None where the reference runs (see
    the module docstring)."""
    rows, experts = x.shape[0], weight.shape[0]
    if not x.is_cuda or not 0 < rows <= MAX_ROWS or experts > MAX_EXPERTS or differentiable(x, weight, bias):
        return None
    if not (plain_contiguous(weight) and plain_contiguous(bias)):
        return None
    if x.dtype not in FLOAT_DTYPES or weight.dtype not in FLOAT_DTYPES:
        return None
    from .router_kernel import top_k_routing as routing_kernel  # Triton, imported where the kernel runs

    return routing_kernel(x.contiguous(), weight, bias, top_k, float(route_scale))


__all__ = ["MAX_ROWS", "top_k_routing"]
