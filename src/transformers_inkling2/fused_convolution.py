"""The short convolutions of a prefill as one fused kernel on CUDA.

The reference (`Inkling2ShortConvolution`) runs `F.conv1d` on the [batch, C, T + k - 1] context, then adds the
residual, scales and casts: over a long prompt, several passes through fp32 activations, one of them a transposing
copy. Written as a sum of k shifted products, the same computation compiles (`torch.compile`) into one kernel that
reads the context where it lies (time-major for a prompt, see `join_convolution_context`) and writes the output
dtype. Decode and verification steps (at most `attention_flex.DECODE_MAX_QUERIES` tokens, as for attention) keep the
reference path and its layout, so that what CUDA graphs capture stays as it was.
"""

import functools

import torch

from .attention_flex import DECODE_MAX_QUERIES, differentiable, on_cuda_outside_compile


def join_convolution_context(history: torch.Tensor, inputs: torch.Tensor) -> torch.Tensor:
    """`cat([history, inputs], -1)` of [batch, C, T] convolution inputs (the caches' and the reference's context).
    A prompt's is laid out time-major ([batch, T, C] in memory): its inputs arrive as a transposed view of [batch, T,
    C] activations, which that layout copies contiguously, and the fused convolution reads it so. A step's stays
    channel-major, the layout `F.conv1d` reads."""
    if inputs.shape[-1] <= DECODE_MAX_QUERIES:
        return torch.cat([history, inputs], dim=-1)
    return torch.cat([history.transpose(1, 2), inputs.transpose(1, 2)], dim=1).transpose(1, 2)


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
    """Whether a convolution of x [batch, T, C] takes the compiled kernel: a prompt (more than `DECODE_MAX_QUERIES`
    tokens) on CUDA, no gradients, not already inside a compiled graph."""
    return on_cuda_outside_compile(x) and x.shape[1] > DECODE_MAX_QUERIES and not differentiable(x, weight)


__all__ = [
    "compiled_short_convolution",
    "join_convolution_context",
    "runs_fused",
    "short_convolution_sum",
]
