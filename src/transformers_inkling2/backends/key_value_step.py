"""A sliding layer's decode-step keys and values in one launch, where the step runs over the static cache.

Registered as the model's `"key_value_step"` kernel (`modeling.interfaces.KERNELS`). The reference
(`Inkling2Attention.attended_keys`) convolves the raw k and v projections (one `step_convolution` launch each on
CUDA), L2-clips the keys and RMS-normalizes the values per head, and writes both into the cache's ring
(`Inkling2StaticLayerCache.write`; in a compiled step inductor makes the clip and the norm, each with its cache write,
one kernel each): four launches per sliding layer. `key_value_kernel.key_value_step` does all of it in one, with
the reference's roundings, and the cache then hands attention its whole ring as before (`attend_written_ring`).

It takes only the steps the reference would run through the step convolutions' rings: a sliding layer, an
`Inkling2StaticCache`, at most `MAX_STEP_TOKENS` tokens (and the cache's `max_queries`), CUDA tensors (or Triton's
interpreter) without gradients, the convolutions as this package defines them, without hooks. Everything else gets
None, and the model runs the reference. Full layers keep theirs: their convolutions take per-token taps.

On by default: its GPU tests pass on an H200 and, with the fused attention step, it makes the decode step faster
there (docs/benchmarks.md, "The fused decode steps"). `INKLING2_FUSED_KEY_VALUE_STEP=0` keeps the reference.
"""

from __future__ import annotations

import math
import os

import torch
from torch import nn

from ..cache.common import K_CONV, MAX_STEP_TOKENS, V_CONV
from ..cache.static import Inkling2StaticCache
from ..modeling.modeling_inkling2_text import Inkling2ShortConvolution
from ..modeling.tensors import differentiable, local_tensor
from .attention.step import kernel_runs_on, plain_module
from .convolution import MAX_KERNEL_SIZE

ENV = "INKLING2_FUSED_KEY_VALUE_STEP"


def enabled() -> bool:
    """Whether the fused key/value step is on (the default; `INKLING2_FUSED_KEY_VALUE_STEP=0` switches it off)."""
    return os.environ.get(ENV, "1") != "0"


def runs_fused(attention: nn.Module, key_states: torch.Tensor, value_states: torch.Tensor, cache) -> bool:
    """Whether `fused_key_value_step` may take this step (see the module docstring); key_states / value_states
    [batch, T, kv_heads * head_dim]."""
    if not enabled() or not attention.is_sliding or not isinstance(cache, Inkling2StaticCache):
        return False
    if not kernel_runs_on(key_states) or key_states.shape[1] > MAX_STEP_TOKENS:
        return False
    convolutions = (attention.k_sconv, attention.v_sconv)
    if not all(plain_module(convolution, Inkling2ShortConvolution) for convolution in convolutions):
        return False
    head_dim = attention.head_dim  # a power of two: the kernel's tl.arange over a head's channels
    if attention.k_sconv.kernel_size > MAX_KERNEL_SIZE or head_dim & (head_dim - 1):
        return False
    weights = [convolution.conv1d.weight for convolution in convolutions]
    return not differentiable(key_states, value_states, *weights)


def fused_key_value_step(
    attention: nn.Module,
    key_states: torch.Tensor,
    value_states: torch.Tensor,
    key_input: torch.Tensor,
    value_input: torch.Tensor,
    token_mask: torch.Tensor | None,
    cache,
    query_positions: torch.Tensor,
    attention_mask: torch.Tensor | None,
) -> tuple | None:
    """`Inkling2Attention.attended_keys`' result (same arguments) for a step that takes the kernel, its keys and
    values written into the cache; None where the reference runs (see the module docstring), and where the cache
    does not hold the step's rings (`step_convolution_ring`, `step_key_value_ring`: e.g. a longer chunk)."""
    if not runs_fused(attention, key_states, value_states, cache):
        return None
    batch, length, width = key_states.shape
    layer_idx, kernel_size, head_dim = attention.layer_idx, attention.k_sconv.kernel_size, attention.head_dim
    shape_only = key_states.new_empty(batch, width, 0, dtype=torch.float32)  # the convolution rings' shape
    rings = [
        cache.step_convolution_ring(layer_idx, conv_idx, shape_only, kernel_size, query_positions)
        for conv_idx in (K_CONV, V_CONV)
    ]
    # the attention ring's shape, in the dtype the reference caches keys in (the layer inputs')
    cache_like = key_states.new_empty(batch, width // head_dim, length, head_dim, dtype=key_input.dtype)
    attention_ring = cache.step_key_value_ring(layer_idx, cache_like, cache_like, query_positions)
    if rings[0] is None or rings[1] is None or attention_ring is None:
        return None
    (key_ring, step), (value_ring, _) = rings
    keys, values, key_valid, slot_positions, slots = attention_ring
    key_weight, value_weight = (
        local_tensor(convolution.conv1d.weight).float().squeeze(1)  # this rank's channels under tensor parallelism
        for convolution in (attention.k_sconv, attention.v_sconv)
    )
    from .key_value_kernel import key_value_step  # Triton, imported where the kernel runs

    key_value_step(
        key_states,
        value_states,
        token_mask,
        key_ring,
        value_ring,
        step.history_slots,
        step.history_held,
        step.conv_write,
        key_weight,
        value_weight,
        math.sqrt(kernel_size + 1),
        attention.config.qk_l2_clip_threshold,
        attention.config.rms_norm_eps,
        keys,
        values,
        key_valid,
        slot_positions,
        slots,
        query_positions,
    )
    return cache.attend_written_ring(layer_idx, length)


__all__ = ["ENV", "enabled", "fused_key_value_step", "runs_fused"]
