"""The short convolutions of a prefill as one fused kernel on CUDA.

The reference (`Inkling2ShortConvolution`) runs `F.conv1d` on the [batch, C, T + k - 1] context, then adds the
residual, scales and casts: over a long prompt, several passes through fp32 activations, one of them a transposing
copy. Written as a sum of k shifted products, the same computation compiles (`torch.compile`) into one kernel that
reads the context where it lies (time-major, `cache_inkling2.join_in_time`) and writes the output dtype. Decode
steps (at most `static_cache_inkling2.DEFAULT_MAX_QUERIES` tokens) keep the reference path, so that what CUDA graphs
capture stays as it was.
"""

import functools

import torch


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


def runs_fused(x: torch.Tensor, weight: torch.Tensor, min_tokens: int) -> bool:
    """Whether a convolution of x takes the compiled kernel: CUDA, more than `min_tokens` tokens, no gradients, not
    already inside a compiled graph."""
    differentiable = torch.is_grad_enabled() and (x.requires_grad or weight.requires_grad)
    return x.is_cuda and x.shape[1] > min_tokens and not differentiable and not torch.compiler.is_compiling()


__all__ = ["compiled_short_convolution", "runs_fused", "short_convolution_sum"]
