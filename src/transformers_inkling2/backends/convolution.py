"""The short convolutions of a prefill as one fused kernel on CUDA.

Registered as the model's `"prompt_convolution"` kernel (`modeling.interfaces.KERNELS`). The reference
(`Inkling2ShortConvolution`) runs `F.conv1d` on the [batch, C, T + k - 1] context, then adds the
residual, scales and casts: over a long prompt, several passes through fp32 activations, one of them a transposing
copy. Written as a sum of k shifted products, the same computation compiles (`torch.compile`) into one kernel that
reads the context where it lies (time-major for a prompt, see `cache.common.join_convolution_context`) and writes the output
dtype. Decode and verification steps (at most `MAX_STEP_TOKENS` tokens, as for attention) keep the
reference path and its layout, so that what CUDA graphs capture stays as it was.
"""

import functools

import torch

from ..cache.common import MAX_STEP_TOKENS
from ..modeling.tensors import differentiable
from .attention.flex import on_cuda_outside_compile


def short_convolution_sum(context: torch.Tensor, x: torch.Tensor, weight: torch.Tensor, divisor: float):
    """`(conv(context) + x) / divisor` in fp32, cast to x's dtype. context [batch, C, T + k - 1] fp32 (the k - 1
    inputs before x, then x's), x [batch, T, C], weight [C, k] fp32 (weight[:, j] multiplies the input k - 1 - j
    steps back, as in `F.conv1d`)."""
    length, kernel_size = x.shape[1], weight.shape[-1]
    convolved = context[..., :length] * weight[:, :1]
    for tap in range(1, kernel_size):
        convolved = convolved + context[..., tap : tap + length] * weight[:, tap : tap + 1]
    return ((convolved.transpose(1, 2) + x.float()) / divisor).to(x.dtype)


@functools.cache
def compiled_short_convolution():
    return torch.compile(short_convolution_sum, dynamic=True, fullgraph=True)


def runs_fused(x: torch.Tensor, weight: torch.Tensor) -> bool:
    """Whether a convolution of x [batch, T, C] takes the compiled kernel: a prompt (more than `MAX_STEP_TOKENS`
    tokens) on CUDA, no gradients, not already inside a compiled graph."""
    return on_cuda_outside_compile(x) and x.shape[1] > MAX_STEP_TOKENS and not differentiable(x, weight)


def fused_prompt_convolution(context: torch.Tensor, x: torch.Tensor, weight: torch.Tensor, divisor: float):
    """`short_convolution_sum` compiled, for the convolutions that take it (`runs_fused`); None for the others, which
    the model computes itself. weight [C, 1, k] as `F.conv1d` takes it."""
    if not runs_fused(x, weight):
        return None
    return compiled_short_convolution()(context, x, weight.squeeze(1), divisor)


__all__ = ["compiled_short_convolution", "fused_prompt_convolution", "runs_fused", "short_convolution_sum"]
