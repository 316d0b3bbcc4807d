"""The short convolutions of a prefill, and of a decode step over the static cache, as one fused kernel each on CUDA.

Registered as the model's `"prompt_convolution"` and `"step_convolution"` kernels (`modeling.interfaces.KERNELS`).
The reference (`Inkling2ShortConvolution`) runs `F.conv1d` on the [batch, C, T + k - 1] context, then adds the
residual, scales and casts: over a long prompt, several passes through fp32 activations, one of them a transposing
copy. Written as a sum of k shifted products (`short_convolution_sum`, the readable form the tests hold the kernel
to), the same computation is one Triton kernel (`convolution_kernel`) that reads the context where it lies
(time-major for a prompt, see `cache.common.join_convolution_context`) and writes the output dtype.

A decode or verification step (at most `MAX_STEP_TOKENS` tokens, as for attention) over `Inkling2StaticCache` costs
the reference a ring write, a gather of its context, cuDNN's convolution and the residual's pass: one kernel
(`convolution_kernel.step_convolution`, a custom op the compiled steps capture) reads the history from the ring,
computes the same sum and writes the step's inputs into the ring. Other caches, and steps that do not read their
whole context from the ring, keep the reference.
"""

import torch

from ..cache.common import MAX_STEP_TOKENS
from ..cache.static import Inkling2StaticCache
from ..modeling.tensors import differentiable
from .attention.flex import on_cuda_outside_compile

MAX_KERNEL_SIZE = 8  # the kernel's taps are unrolled; larger kernels (none in the model, k = 4) keep the reference


def short_convolution_sum(context: torch.Tensor, x: torch.Tensor, weight: torch.Tensor, divisor: float):
    """`(conv(context) + x) / divisor` in fp32, cast to x's dtype. context [batch, C, T + k - 1] fp32 (the k - 1
    inputs before x, then x's), x [batch, T, C], weight [C, k] fp32 (weight[:, j] multiplies the input k - 1 - j
    steps back, as in `F.conv1d`)."""
    length, kernel_size = x.shape[1], weight.shape[-1]
    convolved = context[..., :length] * weight[:, :1]
    for tap in range(1, kernel_size):
        convolved = convolved + context[..., tap : tap + length] * weight[:, tap : tap + 1]
    return ((convolved.transpose(1, 2) + x.float()) / divisor).to(x.dtype)


def runs_fused(x: torch.Tensor, weight: torch.Tensor) -> bool:
    """Whether a convolution of x [batch, T, C] takes the fused kernel: a prompt (more than `MAX_STEP_TOKENS`
    tokens) on CUDA, no gradients, not already inside a compiled graph, at most `MAX_KERNEL_SIZE` taps."""
    fits = x.shape[1] > MAX_STEP_TOKENS and weight.shape[-1] <= MAX_KERNEL_SIZE
    return on_cuda_outside_compile(x) and fits and not differentiable(x, weight)


def fused_prompt_convolution(context: torch.Tensor, x: torch.Tensor, weight: torch.Tensor, divisor: float):
    """`short_convolution_sum` as one Triton kernel, for the convolutions that take it (`runs_fused`); None for the
    others, which the model computes itself. weight [C, 1, k] as `F.conv1d` takes it."""
    if not runs_fused(x, weight):
        return None
    from .convolution_kernel import short_convolution  # Triton, imported where the kernel runs

    return short_convolution(context, x, weight.squeeze(1), divisor)


def step_ring(x, cache, layer_idx, conv_idx, query_positions, weight) -> tuple | None:
    """(the ring [batch, C, slots] of this convolution's fp32 inputs in the static cache, the step's `StepSlots`)
    where a kernel may convolve the step x [batch, T, C] over it in one launch: an `Inkling2StaticCache`, at most
    `MAX_STEP_TOKENS` tokens whose whole context the ring holds, at most `MAX_KERNEL_SIZE` taps (weight [C, 1, k]), no
    gradients; else None. Which device runs the kernel is the caller's to decide."""
    if not isinstance(cache, Inkling2StaticCache) or x.shape[1] > MAX_STEP_TOKENS:
        return None
    if weight.shape[-1] > MAX_KERNEL_SIZE or differentiable(x, weight):
        return None
    batch, _, channels = x.shape
    shape_only = x.new_empty(batch, channels, 0, dtype=torch.float32)  # the ring's shape, dtype and device
    return cache.step_convolution_ring(layer_idx, conv_idx, shape_only, weight.shape[-1], query_positions)


def fused_step_convolution(x, token_mask, cache, layer_idx, conv_idx, query_positions, weight, divisor):
    """`Inkling2ShortConvolution`'s output for a CUDA step of x [batch, T, C] over a static cache, its inputs written
    into the cache's ring, in one launch; None where the reference runs (see the module docstring and `step_ring`).
    weight [C, 1, k] fp32 as `F.conv1d` takes it."""
    ring_and_step = step_ring(x, cache, layer_idx, conv_idx, query_positions, weight) if x.is_cuda else None
    if ring_and_step is None:
        return None
    ring, step = ring_and_step
    from .convolution_kernel import step_convolution  # Triton, imported where the kernel runs

    return step_convolution(
        x, token_mask, ring, step.history_slots, step.history_held, step.conv_write, weight.squeeze(1), divisor
    )


__all__ = [
    "MAX_KERNEL_SIZE",
    "fused_prompt_convolution",
    "fused_step_convolution",
    "runs_fused",
    "short_convolution_sum",
    "step_ring",
]
