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

from ..cache.common import K_CONV, V_CONV
from ..modeling.modeling_inkling2_text import Inkling2ShortConvolution
from ..modeling.tensors import local_tensor
from .attention.step import kernel_runs_on, plain_module
from .convolution import step_ring

ENV = "INKLING2_FUSED_KEY_VALUE_STEP"


def enabled() -> bool:
    """Whether the fused key/value step is on (the default; `INKLING2_FUSED_KEY_VALUE_STEP=0` switches it off)."""
    return os.environ.get(ENV, "1") != "0"


def runs_fused(attention: nn.Module, key_states: torch.Tensor) -> bool:
    """Whether `fused_key_value_step` may take this step, as far as the layer tells (see the module docstring; the
    cache, the step's length and gradients are `convolution.step_ring`'s to check); key_states [batch, T, C]."""
    if not enabled() or not attention.is_sliding or not kernel_runs_on(key_states):
        return False
    convolutions = (attention.k_sconv, attention.v_sconv)
    if not all(plain_module(convolution, Inkling2ShortConvolution) for convolution in convolutions):
        return False
    head_dim = attention.head_dim  # a power of two: the kernel's tl.arange over a head's channels
    return not head_dim & (head_dim - 1)


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
    if not runs_fused(attention, key_states):
        return None
    batch, length, width = key_states.shape
    layer_idx, head_dim = attention.layer_idx, attention.head_dim
    # this rank's channels under tensor parallelism, [C, 1, k]
    key_weight, value_weight = (local_tensor(conv.conv1d.weight) for conv in (attention.k_sconv, attention.v_sconv))
    rings = [
        step_ring(states, cache, layer_idx, conv_idx, query_positions, weight)
        for states, conv_idx, weight in ((key_states, K_CONV, key_weight), (value_states, V_CONV, value_weight))
    ]
    if rings[0] is None or rings[1] is None:
        return None
    # the attention ring's shape, in the dtype the reference caches keys in (the layer inputs')
    cache_like = key_states.new_empty(batch, width // head_dim, length, head_dim, dtype=key_input.dtype)
    attention_ring = cache.step_key_value_ring(layer_idx, cache_like, cache_like, query_positions)
    if attention_ring is None:
        return None
    (key_ring, step), (value_ring, _) = rings
    keys, values, key_valid, slot_positions, slots = attention_ring
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
        key_weight.float().squeeze(1),
        value_weight.float().squeeze(1),
        math.sqrt(attention.k_sconv.kernel_size + 1),
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
