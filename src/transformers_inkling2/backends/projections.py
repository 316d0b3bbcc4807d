"""A decode step's six attention input projections in one launch on CUDA.

Registered as the model's `"input_projections"` kernel (`modeling.interfaces.KERNELS`). The reference
(`Inkling2Attention.projections`) runs six `nn.Linear` calls: at a decode step each is a read of its weight, and the
narrow ones are bound by their launches and split-K reductions rather than their bytes. On CUDA, for steps of at
most `MAX_ROWS` rows, the six (q, gate, relative, sink, k, v, each with its own input) run as one grouped GEMV
(`projection_kernel`). The output projection stays with cuBLAS: a GEMV of ours with the sigmoid gate in its
prologue had too few programs for its 4,608 outputs and ran at 12% of copy bandwidth (docs/benchmarks.md).

Only plain projections take the kernels: an `nn.Linear` without bias or hooks holding an ordinary half-precision
tensor, or the tensor-parallel plan's column split of one (`inkling2_colwise`: its forward is a plain linear over this
rank's block, which the kernel then reads). A PEFT LoRA layer, other hooked or DTensor weights, gradients, fp32
weights and the CPU keep the reference, which the functions signal by returning None.
"""

from __future__ import annotations

import torch
from torch import nn

from ..modeling.interfaces import has_forward_hooks
from ..modeling.tensors import LOCAL_BLOCK_LINEAR, differentiable, local_tensor, plain_contiguous

# batch x tokens of a step; at 64 rows cuBLAS was faster (docs/benchmarks.md), and prompts are GEMMs, its business
MAX_ROWS = 16
HALF_DTYPES = (torch.bfloat16, torch.float16)


def plain_weight(module: nn.Module, width: int, dtype: torch.dtype) -> torch.Tensor | None:
    """The weight of a bias-free, hook-free `nn.Linear` over `width` inputs as an ordinary contiguous tensor of
    `dtype` (this rank's block under `inkling2_colwise`), or None (anything else: a LoRA wrapper, another parallel
    style's hooks, DTensor or forward, a bias, another dtype)."""
    if type(module) is not nn.Linear or module.bias is not None or has_forward_hooks(module):
        return None
    if getattr(module, LOCAL_BLOCK_LINEAR, False):
        weight = local_tensor(module.weight)
    elif "forward" in module.__dict__:  # a forward of someone else's: what it computes is unknown
        return None
    else:
        weight = module.weight
    if not plain_contiguous(weight) or weight.dtype != dtype or weight.shape[1] != width:
        return None
    return weight


def step_rows(inputs: list[torch.Tensor]) -> list[torch.Tensor] | None:
    """The inputs as [rows, K] contiguous matrices, when they are CUDA half-precision activations of one shape and
    dtype without gradients and at most `MAX_ROWS` rows; else None."""
    first = inputs[0]
    if not first.is_cuda or first.dtype not in HALF_DTYPES or differentiable(*inputs):
        return None
    if any(x.shape != first.shape or x.dtype != first.dtype for x in inputs):
        return None
    rows = first.numel() // first.shape[-1]
    if not 0 < rows <= MAX_ROWS:
        return None
    return [x.reshape(rows, x.shape[-1]).contiguous() for x in inputs]


def input_projections(inputs: list[torch.Tensor], modules: list[nn.Module]) -> list[torch.Tensor] | None:
    """`[module(x) for x, module in zip(inputs, modules)]` as one grouped GEMV, outputs shaped as the modules' would
    be; None where the reference runs (see the module docstring)."""
    matrices = step_rows(inputs)
    if matrices is None:
        return None
    weights = [plain_weight(module, matrices[0].shape[1], matrices[0].dtype) for module in modules]
    if any(weight is None for weight in weights) or differentiable(*weights):
        return None
    from .projection_kernel import grouped_projections  # Triton, imported where the kernel runs

    outputs = grouped_projections(matrices, weights)
    return [y.view(*x.shape[:-1], y.shape[-1]) for x, y in zip(inputs, outputs, strict=True)]


__all__ = ["MAX_ROWS", "input_projections", "plain_weight", "step_rows"]
