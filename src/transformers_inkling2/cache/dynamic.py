"""The decoding cache of Inkling2: attention keys/values plus the inputs of the four short convolutions.

Every layer keeps
- its keys and values: all of them in full-attention layers; in sliding-window layers only the last
  `sliding_window - 1 + rollback_margin` (a query needs the `window - 1` keys before it; the margin lets
  speculative decoding take back up to `rollback_margin` tokens without losing one that is still needed);
- for each of its four short convolutions (k, v, post-attention, post-MoE) the last
  `conv_kernel_size - 1 + rollback_margin` raw fp32 inputs, padding already zeroed.

Positions are physical: token `i` of the stream (left padding included) has position `i`. The relative bias and
the sliding window only ever use differences of positions, so left padding shifts nothing. Rolling back
(`crop(-n)`) only drops the last `n` entries of every tensor, so it is exact.
"""

from __future__ import annotations

import torch
from transformers.cache_utils import Cache, CacheLayerMixin

from ..configuration_inkling2 import SLIDING_LAYER, Inkling2TextConfig
from .common import (
    MAX_STEP_TOKENS,
    NUM_CONVOLUTIONS,
    RollbackWithinMargin,
    join_convolution_context,
    keep_last,
    shift_rows_right,
)


class Inkling2LayerCache(CacheLayerMixin):
    """One decoder layer's keys/values ([batch, kv_heads, time, head_dim]) and convolution inputs ([batch, C, time])."""

    is_croppable = True

    def __init__(self, max_keys: int | None, max_conv_inputs: int, is_sliding: bool):
        super().__init__()
        self.max_keys = max_keys
        self.max_conv_inputs = max_conv_inputs
        self.is_sliding = is_sliding
        self.conv_inputs: list[torch.Tensor | None] = [None] * NUM_CONVOLUTIONS
        self.seen_tokens = 0

    def lazy_initialization(self, key_states: torch.Tensor, value_states: torch.Tensor) -> None:
        self.dtype, self.device = key_states.dtype, key_states.device
        self.is_initialized = True

    @property
    def first_key_position(self) -> int:
        """Position of the oldest key still held."""
        return self.seen_tokens - (0 if self.keys is None else self.keys.shape[2])

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args, **kwargs):
        """Appends this step's keys/values and returns the keys/values the step attends to (old + new)."""
        if not self.is_initialized:
            self.lazy_initialization(key_states, value_states)
        attend_keys = keep_last(self.keys, key_states, 2, None)
        attend_values = keep_last(self.values, value_states, 2, None)
        self.keys = keep_last(None, attend_keys, 2, self.max_keys)
        self.values = keep_last(None, attend_values, 2, self.max_keys)
        self.seen_tokens += key_states.shape[2]
        return attend_keys, attend_values

    def convolution_context(self, conv_idx: int, new_inputs: torch.Tensor, kernel_size: int) -> torch.Tensor:
        """The `kernel_size - 1` held inputs before `new_inputs` (zeros at the start), joined with them; then holds
        the newest inputs for the next step."""
        held = self.conv_inputs[conv_idx]
        if held is None:
            held = new_inputs.new_zeros(*new_inputs.shape[:-1], kernel_size - 1)
        context = join_convolution_context(held[..., held.shape[-1] - (kernel_size - 1) :], new_inputs)
        self.conv_inputs[conv_idx] = keep_last(held, new_inputs, -1, self.max_conv_inputs)
        return context

    def get_seq_length(self) -> int:
        return self.seen_tokens

    def get_max_length(self) -> int:
        return -1 if self.max_keys is None else self.max_keys

    def get_mask_sizes(self, query_length: int) -> tuple[int, int]:
        held = 0 if self.keys is None else self.keys.shape[2]
        return held + query_length, self.first_key_position

    def crop(self, tokens_to_remove: int) -> None:
        """Takes back the last `-tokens_to_remove` tokens (transformers' convention: a negative count)."""
        count = -tokens_to_remove
        if count <= 0:
            return
        if self.keys is not None and self.keys.shape[2] < count:
            raise ValueError(f"Cannot take back {count} tokens: the layer holds {self.keys.shape[2]} keys.")
        if self.keys is not None:
            self.keys = self.keys[:, :, : self.keys.shape[2] - count]
            self.values = self.values[:, :, : self.values.shape[2] - count]
        self.conv_inputs = [None if held is None else held[..., : held.shape[-1] - count] for held in self.conv_inputs]
        self.seen_tokens -= count

    def shift_rows_right(self, shifts: torch.Tensor) -> None:
        self._map_tensors(lambda t: shift_rows_right(t, shifts, 2 if t.dim() == 4 else -1))

    def _map_tensors(self, fn) -> None:
        if self.keys is not None:
            self.keys, self.values = fn(self.keys), fn(self.values)
        self.conv_inputs = [None if held is None else fn(held) for held in self.conv_inputs]

    def reorder_cache(self, beam_idx: torch.LongTensor) -> None:
        self._map_tensors(lambda t: t.index_select(0, beam_idx.to(t.device)))

    def batch_repeat_interleave(self, repeats: int) -> None:
        self._map_tensors(lambda t: t.repeat_interleave(repeats, dim=0))

    def batch_select_indices(self, indices: torch.Tensor) -> None:
        self._map_tensors(lambda t: t[indices])

    def reset(self) -> None:
        self.keys = self.values = None
        self.conv_inputs = [None] * NUM_CONVOLUTIONS
        self.seen_tokens = 0

    def offload(self):
        self._map_tensors(lambda t: t.to("cpu", non_blocking=True))

    def prefetch(self):
        if self.is_initialized:
            self._map_tensors(lambda t: t.to(self.device, non_blocking=True))


class Inkling2Cache(RollbackWithinMargin, Cache):
    """Keys/values and short-convolution inputs of every Inkling2 decoder layer; see the module docstring."""

    def __init__(self, config: Inkling2TextConfig, rollback_margin: int = MAX_STEP_TOKENS, **kwargs):
        config = config.get_text_config(decoder=True)
        self.rollback_margin = rollback_margin
        layers = [
            Inkling2LayerCache(
                max_keys=config.sliding_window_size - 1 + rollback_margin if layer_type == SLIDING_LAYER else None,
                max_conv_inputs=config.conv_kernel_size - 1 + rollback_margin,
                is_sliding=layer_type == SLIDING_LAYER,
            )
            for layer_type in config.layer_types
        ]
        super().__init__(layers=layers, **kwargs)

    def convolution_context(self, layer_idx, conv_idx, new_inputs, kernel_size, query_positions=None):
        return self.layers[layer_idx].convolution_context(conv_idx, new_inputs, kernel_size)

    def attention_keys(self, layer_idx, keys, values, query_positions, attention_mask):
        """Appends the step's keys/values; returns what the step attends to: (keys, values, key positions,
        key padding or None, whether key positions ascend contiguously — always here, a block table of paged keys —
        never here). `attention_mask` is the 2-D padding mask over the cached and the new tokens."""
        first_key_position = self.layers[layer_idx].first_key_position
        keys, values = self.update(keys, values, layer_idx)
        key_positions = torch.arange(keys.shape[2], device=keys.device) + first_key_position
        key_padding = None if attention_mask is None else attention_mask[:, key_positions]
        return keys, values, key_positions, key_padding, True, None


__all__ = ["Inkling2Cache"]
