"""A decode step's keys and values in one launch, where the step runs over the static cache.

Registered as the model's `"key_value_step"` kernel (`modeling.interfaces.KERNELS`). The reference
(`Inkling2Attention.attended_keys`) convolves the raw k and v projections, L2-clips the keys and RMS-normalizes the
values per head, and writes both into the cache (`Inkling2StaticLayerCache.write`). In a sliding layer that is a
`step_convolution` launch per convolution and, in a compiled step, one inductor kernel each for the clip and the
norm with their cache writes: four launches. A full layer's convolutions are dynamic (each token adds taps projected
from the layer input, `Inkling2DynamicShortConvolution`): uncompiled, as plain `generate()`'s graphs replay it, 47
small operations (docs/kernels.md). `key_value_kernel.key_value_step` does all of it in one launch (a full layer's
per-token taps come from its two `weight_proj` GEMVs first), with the reference's roundings, and the cache then
hands attention what it attends to as before (`attend_written`).

It takes only the steps the reference would run through the step convolutions' rings: an `Inkling2StaticCache`, at
most `MAX_STEP_TOKENS` tokens (and the cache's `max_queries`), CUDA tensors (or Triton's interpreter) without
gradients, the convolutions as this package defines them, without hooks. Everything else gets None, and the model
runs the reference.

On by default: its GPU tests pass on an H200 (sliding and full layers) and it makes the decode step faster there
(docs/dev/benchmark-history.md, "The fused decode steps" and "Plain `generate()`'s decode step with the fused
mixes").
`INKLING2_FUSED_KEY_VALUE_STEP=0` keeps the reference.
"""

from __future__ import annotations

import math
import os

import torch
from torch import nn

from ..cache.common import K_CONV, V_CONV
from ..modeling.modeling_inkling2_text import Inkling2DynamicShortConvolution, Inkling2ShortConvolution
from ..modeling.tensors import differentiable, local_tensor
from .attention.step import kernel_runs_on, plain_module
from .convolution import step_ring

ENV = "INKLING2_FUSED_KEY_VALUE_STEP"


def enabled() -> bool:
    """Whether the fused key/value step is on (the default; `INKLING2_FUSED_KEY_VALUE_STEP=0` switches it off)."""
    return os.environ.get(ENV, "1") != "0"


def runs_fused(attention: nn.Module, key_states: torch.Tensor) -> bool:
    """Whether `fused_key_value_step` may take this step, as far as the layer tells (see the module docstring; the
    cache, the step's length and gradients through the states are `convolution.step_ring`'s to check); key_states
    [batch, T, C]."""
    if not enabled() or not kernel_runs_on(key_states):
        return False
    convolutions = (attention.k_sconv, attention.v_sconv)
    kind = Inkling2ShortConvolution if attention.is_sliding else Inkling2DynamicShortConvolution
    if not all(plain_module(convolution, kind) for convolution in convolutions):
        return False
    # a full layer's per-token taps come from calling `weight_proj` (a LoRA adapter on it included): no gradients
    if differentiable(*(parameter for convolution in convolutions for parameter in convolution.parameters())):
        return False
    head_dim = attention.head_dim  # a power of two: the kernel's tl.arange over a head's channels
    return not head_dim & (head_dim - 1)


def kernel_weights(convolution: nn.Module) -> tuple[torch.Tensor, torch.Tensor]:
    """(this rank's static weights as the kernel reads them, [C, k]: a sliding layer's in conv1d's order, a full
    layer's by lag; the same weights shaped [C, 1, k] as `F.conv1d` takes them, for `step_ring`'s checks of the tap
    count and gradients)."""
    if isinstance(convolution, Inkling2DynamicShortConvolution):
        by_lag = local_tensor(convolution.static_weight).T  # under tensor parallelism: this rank's channels
        return by_lag, by_lag.unsqueeze(1)
    weight = local_tensor(convolution.conv1d.weight)
    return weight.float().squeeze(1), weight


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
    layer_idx, head_dim, kernel_size = attention.layer_idx, attention.head_dim, attention.k_sconv.kernel_size
    (key_weight, key_conv1d), (value_weight, value_conv1d) = map(kernel_weights, (attention.k_sconv, attention.v_sconv))
    rings = [
        step_ring(states, cache, layer_idx, conv_idx, query_positions, weight)
        for states, conv_idx, weight in ((key_states, K_CONV, key_conv1d), (value_states, V_CONV, value_conv1d))
    ]
    if rings[0] is None or rings[1] is None:
        return None
    # the attention buffers' shape, in the dtype the reference caches keys in (the layer inputs')
    cache_like = key_states.new_empty(batch, width // head_dim, length, head_dim, dtype=key_input.dtype)
    attention_ring = cache.step_key_value_ring(layer_idx, cache_like, cache_like, query_positions)
    if attention_ring is None:
        return None
    (key_ring, step), (value_ring, _) = rings
    keys, values, key_valid, slot_positions, slots = attention_ring
    taps, divisor = {}, math.sqrt(kernel_size + 1)
    if not attention.is_sliding:  # each token's taps, projected from the layer input as the reference does
        taps = dict(key_taps=attention.k_sconv.weight_proj(key_input),
                    value_taps=attention.v_sconv.weight_proj(value_input))  # fmt: skip
        divisor = math.sqrt(2 * kernel_size + 1)
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
        divisor,
        attention.config.qk_l2_clip_threshold,
        attention.config.rms_norm_eps,
        keys,
        values,
        key_valid,
        slot_positions,
        slots,
        query_positions,
        **taps,
    )
    return cache.attend_written(layer_idx, length)


__all__ = ["ENV", "enabled", "fused_key_value_step", "runs_fused"]
