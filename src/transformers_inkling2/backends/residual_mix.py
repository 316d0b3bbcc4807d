"""A decode step's attention-residual mixes and the RMS norms after them, two launches each.

Registered as the model's `"residual_mix"` and `"residual_mix_after_sublayer"` kernels (`modeling.interfaces.KERNELS`).
Before each sublayer and before the readout, the reference (`Inkling2BlockAttentionResidual`, then `Inkling2RMSNorm`)
RMS-normalizes the partial block, stacks it after the completed blocks, takes each query's softmax over the stack, sums
the weighted stack and normalizes the sum: in a decode step these are vectors of a few thousand channels, so the work is
nothing and the launches are everything (20 to 34 operations per mix and norms in an uncompiled step replayed as a CUDA
graph, docs/kernels.md; three or four reductions in a step compiled by inductor). `residual_mix_kernel` computes one mix
and its norms in two launches split over the width (the stack's per-chunk sums, then the mix). After attention it also
adds the attention's output to the partial block first, and where the step runs over the static cache's ring it
computes that output's short convolution too (`post_attention_convolution`), so the convolution's launch goes as
well. And at the layer's end, registered as `"residual_step_convolution"`, the post-MLP step convolution adds the
partial block to its output in its epilogue (`convolution_kernel.step_convolution`'s residual), where the reference
adds and rounds in launches of their own.

It takes the calls of at most `MAX_STEP_TOKENS` tokens (decode and verification steps, compiled or not) on CUDA
tensors (or under Triton's interpreter) without gradients, with the mix, norm and convolution modules as this package
defines them, without hooks; everything else gets None, and the model runs the reference.

On by default since 2026-12-05: its GPU tests passed on an H200, and with the full layers' fused key/value step it
took a 6-layer slice's uncompiled decode step (what plain `generate()`'s CUDA graphs replay) from 517 launches to 215
and 19-34% less time, with the first kernel (a program per token); the kernel split over the width and the step's
tokens since also makes the compiled step faster than inductor's reductions do (docs/dev/benchmark-history.md).
`INKLING2_FUSED_RESIDUAL_MIX=0` keeps the reference.
"""

from __future__ import annotations

import math
import os
from collections.abc import Callable, Sequence

import torch
from torch import nn

from ..cache.common import MAX_STEP_TOKENS
from ..modeling.experts import RouteTerms
from ..modeling.modeling_inkling2_text import Inkling2BlockAttentionResidual, Inkling2ShortConvolution
from ..modeling.norms import Inkling2RMSNorm
from ..modeling.tensors import differentiable, local_tensor
from .attention.step import kernel_runs_on, plain_module
from .convolution import step_ring

ENV = "INKLING2_FUSED_RESIDUAL_MIX"


def enabled() -> bool:
    """Whether the fused mixes are on (the default; `INKLING2_FUSED_RESIDUAL_MIX=0` switches them off)."""
    return os.environ.get(ENV, "1") != "0"


def runs_fused(mix: nn.Module, norms: Sequence[nn.Module], blocks: torch.Tensor, *stream: torch.Tensor) -> bool:
    """Whether the kernel may take this mix (see the module docstring); stream: the [batch, T, H] tensors it reads
    (the partial block, a sublayer's output), the first of them not None."""
    step = stream[0]
    if not enabled() or not kernel_runs_on(step) or step.shape[1] > MAX_STEP_TOKENS:
        return False
    if not plain_module(mix, Inkling2BlockAttentionResidual) or len(norms) != mix.query.numel() // step.shape[-1]:
        return False
    if not all(plain_module(norm, Inkling2RMSNorm) and norm.eps == norms[0].eps for norm in norms):
        return False
    tensors = [tensor for tensor in stream if tensor is not None]
    return not differentiable(blocks, *tensors, mix.query, *(norm.weight for norm in norms))


def kernel_arguments(mix: nn.Module, norms: Sequence[nn.Module], blocks: torch.Tensor, dtype: torch.dtype) -> tuple:
    """The mix's and norms' arguments of both kernels: blocks, queries [Q, H], norm weights, eps, dtype."""
    queries = local_tensor(mix.query).view(-1, blocks.shape[-1])
    return blocks, queries, [local_tensor(norm.weight) for norm in norms], norms[0].eps, dtype


def fused_residual_mix(
    mix: nn.Module,
    norms: Sequence[nn.Module],
    blocks: torch.Tensor,
    partial: torch.Tensor,
    dtype: torch.dtype,
    opens_block: bool = False,
) -> tuple[list[torch.Tensor], torch.Tensor] | None:
    """(`[norm(x).to(dtype) for norm, x in zip(norms, mix(blocks, partial))]`, the completed blocks as the layer
    goes on with them: `with_block(blocks, partial)` where it `opens_block`, else `blocks`) in one launch, for a call
    the kernel takes; None where the reference runs. blocks [batch, T, n, H] fp32, partial [batch, T, H]."""
    if not runs_fused(mix, norms, blocks, partial):
        return None
    from .residual_mix_kernel import residual_mix  # Triton, imported where the kernel runs

    normalized, stack = residual_mix(partial, *kernel_arguments(mix, norms, blocks, dtype), opens_block)
    return list(normalized.unbind(0)), stack if opens_block else blocks


def convolution_ring(convolution: nn.Module, output: torch.Tensor, cache, query_positions) -> tuple | None:
    """(ring, the step's `StepSlots`, weight [H, k] fp32, divisor) where the kernel may convolve `output` over the
    static cache's ring itself (`convolution.step_ring`, for the module as this package defines it), else None."""
    if not plain_module(convolution, Inkling2ShortConvolution):
        return None
    weight = local_tensor(convolution.conv1d.weight).float()  # [H, 1, k], this rank's channels under TP
    ring_and_step = step_ring(output, cache, convolution.layer_idx, convolution.conv_idx, query_positions, weight)
    if ring_and_step is None:
        return None
    return *ring_and_step, weight.squeeze(1), math.sqrt(convolution.kernel_size + 1)


def fused_residual_mix_after_sublayer(
    convolution: nn.Module,
    output: torch.Tensor,
    token_mask: torch.Tensor | None,
    cache,
    query_positions: torch.Tensor,
    partial: torch.Tensor | None,
    mix: nn.Module,
    norms: Sequence[nn.Module],
    blocks: torch.Tensor,
    dtype: torch.dtype,
) -> tuple[torch.Tensor, list[torch.Tensor]] | None:
    """After a sublayer: its output through `convolution` joins the partial block (`partial + convolved`, or the
    convolved output alone where `partial` is None), then `fused_residual_mix` of the new partial block. Returns
    (the new partial block [batch, T, H] fp32, the normalized inputs), or None where the reference runs. The
    convolution runs inside the kernel where the step reads its context from the static cache's ring, else as the
    module's own call before it."""
    if not runs_fused(mix, norms, blocks, output, partial):
        return None
    from .residual_mix_kernel import residual_mix_after_sublayer  # Triton, imported where the kernel runs

    ring = convolution_ring(convolution, output, cache, query_positions)
    if ring is None:
        output = convolution(output, token_mask, cache, query_positions)
        inputs = (None, None, None, None, None, None, 1.0)
    else:
        ring_buffer, step, weight, divisor = ring
        slots = (step.history_slots, step.history_held, step.conv_write)
        inputs = (token_mask, ring_buffer, *slots, weight, divisor)
    normalized, new_partial = residual_mix_after_sublayer(
        partial, output, *inputs, *kernel_arguments(mix, norms, blocks, dtype)
    )
    return new_partial, list(normalized.unbind(0))


def fused_residual_step_convolution(
    convolution: nn.Module,
    mlp_input: torch.Tensor,
    token_mask: torch.Tensor | None,
    cache,
    query_positions: torch.Tensor,
    partial: torch.Tensor,
    dtype: torch.dtype,
) -> Callable[[torch.Tensor | RouteTerms], torch.Tensor] | None:
    """A decoder layer's end, `(partial + convolution(mlp_output)).to(dtype)`, as one step convolution over the static
    cache's ring with the sum in its epilogue (`convolution_kernel.step_convolution`'s residual), where the fused
    mixes are on, the step reads its context from the ring and the MoE's input (so its output) comes in `dtype` (the
    kernel's output dtype is its input's): a function of the MoE's output, [batch, T, H] or its experts' `RouteTerms`
    (whose sum the kernel then makes in its prologue, in place of the experts' combine launch); None where the
    reference runs. Decided before the MoE runs, from its input [batch, T, H]; partial [batch, T, H] fp32."""
    if not enabled() or not kernel_runs_on(mlp_input) or mlp_input.dtype != dtype or differentiable(partial):
        return None
    ring = convolution_ring(convolution, mlp_input, cache, query_positions)  # the step's length and gradients too
    if ring is None:
        return None
    ring_buffer, step, weight, divisor = ring
    from .convolution_kernel import step_convolution  # Triton, imported where the kernel runs

    convolved = (token_mask, ring_buffer, step.history_slots, step.history_held, step.conv_write, weight, divisor)

    def end(mlp_output: torch.Tensor | RouteTerms) -> torch.Tensor:
        if isinstance(mlp_output, RouteTerms):  # the MoE's input gives the output's shape and dtype
            return step_convolution(mlp_input, *convolved, partial, *mlp_output)
        return step_convolution(mlp_output, *convolved, partial)

    return end


__all__ = [
    "ENV",
    "enabled",
    "fused_residual_mix",
    "fused_residual_mix_after_sublayer",
    "fused_residual_step_convolution",
    "runs_fused",
]
