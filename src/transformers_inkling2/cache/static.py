"""A fixed-size decoding cache for Inkling2, so that a decode step has static shapes and can be replayed as a CUDA
graph (`generation/decode_graphs.py`).

Every buffer is allocated once (at the first forward) and written in place at slots computed on the device from
the tokens' positions; nothing is ever concatenated or reallocated while decoding:

- full-attention layers: keys/values for `max_cache_len` positions, slot = position;
- sliding-window layers: a ring of `sliding_window - 1 + max(max_queries, rollback_margin)` slots,
  slot = position mod ring size, and the position each slot holds (`slot_positions`), so a step of up to
  `max_queries` tokens writes first and then attends over the whole ring (attention backends take arbitrary key
  positions; the window and the bias follow from position differences);
- the four short convolutions: a ring of `conv_kernel_size - 1 + rollback_margin` inputs, read by position;
- `key_valid` [batch, slots]: False for padding and never-written slots.

Rolling back (`crop(-n)`, speculative decoding) only moves the host-side length back: the slots of the dropped
tokens hold positions after every later query (masked as the future) until the next step overwrites them, which it
does before attending. The length lives on the host (`seen_tokens`); a replayed graph does not run Python, so its
runner calls `advance(n)` after each replay.
"""

from __future__ import annotations

import torch
from transformers.cache_utils import Cache, CacheLayerMixin

from ..configuration_inkling2 import SLIDING_LAYER, Inkling2TextConfig
from .common import (
    MAX_STEP_TOKENS,
    NUM_CONVOLUTIONS,
    RollbackWithinMargin,
    initial_slot_positions,
    join_convolution_context,
    shift_rows_right,
    write_by_position,
)


class Inkling2StaticLayerCache(CacheLayerMixin):
    """One decoder layer's fixed buffers; see the module docstring."""

    is_compileable = True
    is_croppable = True

    def __init__(self, capacity: int, conv_capacity: int, is_sliding: bool, max_queries: int, history: int):
        super().__init__()
        self.capacity, self.conv_capacity = capacity, conv_capacity
        self.is_sliding, self.max_queries = is_sliding, max_queries
        self.history = history  # keys before a query that it may still see: sliding_window - 1
        self.conv_inputs: list[torch.Tensor | None] = [None] * NUM_CONVOLUTIONS
        self.conv_positions: list[torch.Tensor | None] = [None] * NUM_CONVOLUTIONS
        self.seen_tokens = 0

    def lazy_initialization(self, key_states: torch.Tensor, value_states: torch.Tensor) -> None:
        batch, kv_heads, _, head_dim = key_states.shape
        self.dtype, self.device = key_states.dtype, key_states.device
        self.keys = key_states.new_zeros(batch, kv_heads, self.capacity, head_dim)
        self.values = value_states.new_zeros(batch, kv_heads, self.capacity, value_states.shape[-1])
        self.key_valid = torch.zeros(batch, self.capacity, dtype=torch.bool, device=self.device)
        self.slot_positions = initial_slot_positions(self.capacity, self.device)
        self.all_positions = torch.arange(self.capacity, device=self.device)
        self.is_initialized = True

    def check_room(self, new_tokens: int) -> None:
        if not self.is_sliding and self.seen_tokens + new_tokens > self.capacity:
            raise ValueError(
                f"The static cache holds {self.capacity} tokens (`max_cache_len`); {self.seen_tokens} are cached and "
                f"{new_tokens} more were given. Build it with a larger `max_cache_len` (generate() sizes it from "
                "`max_length`)."
            )

    def write(self, positions: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, valid: torch.Tensor) -> None:
        """Stores tokens at their slots (the last `capacity` of them when there are more)."""
        write_by_position(self.slot_positions, positions, [(self.keys, keys, 2), (self.values, values, 2),
                                                           (self.key_valid, valid, 1)])  # fmt: skip

    def attention_keys(self, keys, values, query_positions, token_mask, attend_length):
        """Writes the step's keys/values; returns what it attends to: (keys, values, key positions, key padding,
        whether the key positions ascend contiguously). With `attend_length` (a captured step, at most `max_queries`
        tokens) the full layers attend over that many slots and the host-side length is left to the runner: nothing
        here then reads it, so the traced step does not depend on it."""
        if not self.is_initialized:
            self.lazy_initialization(keys, values)
        new_tokens = keys.shape[2]
        if token_mask is None:
            valid = torch.ones(keys.shape[0], new_tokens, dtype=torch.bool, device=keys.device)
        else:
            valid = token_mask.bool()
        if attend_length is None:
            self.check_room(new_tokens)
            past = self.seen_tokens
            self.seen_tokens += new_tokens
            attend_length = past + new_tokens

        if not self.is_sliding:  # slot = position: the first `attend_length` slots, in order
            self.write(query_positions, keys, values, valid)
            length = attend_length
            return (
                self.keys[:, :, :length],
                self.values[:, :, :length],
                self.all_positions[:length],
                self.key_valid[:, :length],
                True,
            )
        if new_tokens <= self.max_queries:  # write, then attend over the whole ring
            self.write(query_positions, keys, values, valid)
            return self.keys, self.values, self.slot_positions, self.key_valid, False
        # a long chunk (prefill): the keys the window still reaches in position order, then the new ones
        held = min(past, self.history)
        positions = torch.arange(past - held, past, device=keys.device)
        order = positions.remainder(self.capacity)
        held_valid = self.key_valid.index_select(1, order) & (self.slot_positions.index_select(0, order) == positions)
        attend = (
            torch.cat([self.keys.index_select(2, order), keys], dim=2),
            torch.cat([self.values.index_select(2, order), values], dim=2),
            torch.cat([positions, query_positions]),
            torch.cat([held_valid, valid], dim=1),
            True,
        )
        self.write(query_positions, keys, values, valid)
        return attend

    def update(self, key_states, value_states, *args, **kwargs):
        """transformers' Cache interface: appends after the cached tokens; returns the keys/values attended."""
        positions = torch.arange(key_states.shape[2], device=key_states.device) + self.seen_tokens
        return self.attention_keys(key_states, value_states, positions, None, None)[:2]

    def convolution_context(self, conv_idx, new_inputs, kernel_size, query_positions):
        """The `kernel_size - 1` inputs before `new_inputs` ([batch, C, T]), read from the ring by position (zeros
        before the sequence start), joined with them; then writes the new inputs into the ring."""
        if self.conv_inputs[conv_idx] is None:
            self.conv_inputs[conv_idx] = new_inputs.new_zeros(*new_inputs.shape[:-1], self.conv_capacity)
            self.conv_positions[conv_idx] = initial_slot_positions(self.conv_capacity, new_inputs.device)
        ring, ring_positions = self.conv_inputs[conv_idx], self.conv_positions[conv_idx]
        previous = query_positions[0] - (kernel_size - 1) + torch.arange(kernel_size - 1, device=ring.device)
        slots = previous.remainder(self.conv_capacity)
        held = (ring_positions[slots] == previous).to(ring.dtype)
        context = join_convolution_context(ring.index_select(-1, slots) * held, new_inputs)
        write_by_position(ring_positions, query_positions, [(ring, new_inputs, -1)])
        return context

    def get_seq_length(self) -> int:
        return self.seen_tokens

    def get_max_length(self) -> int:
        return -1 if self.is_sliding else self.capacity

    def get_mask_sizes(self, query_length: int) -> tuple[int, int]:
        return self.capacity, 0

    def crop(self, tokens_to_remove: int) -> None:
        self.seen_tokens -= max(0, -tokens_to_remove)

    def rings(self) -> list[tuple[torch.Tensor, torch.Tensor, int]]:
        """Every batch-first buffer with the positions of its slots and its slot dimension."""
        rings = (
            [(self.keys, self.slot_positions, 2), (self.values, self.slot_positions, 2)] if self.is_initialized else []
        )
        rings += [(self.key_valid, self.slot_positions, 1)] if self.is_initialized else []
        return rings + [(r, p, -1) for r, p in zip(self.conv_inputs, self.conv_positions) if r is not None]

    def shift_rows_right(self, shifts: torch.Tensor) -> None:
        """In place, like everything here, so that captured graphs keep reading the same buffers."""
        for ring, positions, dim in self.rings():
            ring.copy_(shift_rows_right(ring, shifts, dim, positions))

    def reorder_cache(self, beam_idx: torch.LongTensor) -> None:
        for ring, _, _ in self.rings():
            ring.copy_(ring.index_select(0, beam_idx.to(ring.device)))

    def reset(self) -> None:
        """Empties the cache in place (buffers and captured graphs stay valid)."""
        self.seen_tokens = 0
        if self.is_initialized:
            self.key_valid.zero_()
            self.slot_positions.copy_(initial_slot_positions(self.capacity, self.device))
        for ring, positions in zip(self.conv_inputs, self.conv_positions):
            if ring is not None:
                ring.zero_()
                positions.copy_(initial_slot_positions(self.conv_capacity, ring.device))


class Inkling2StaticCache(RollbackWithinMargin, Cache):
    """The fixed-size Inkling2 cache (`generate(..., cache_implementation="static")`); see the module docstring.

    `max_cache_len` bounds the tokens a full-attention layer holds (prompt + new tokens + one speculative block);
    sliding layers and convolutions hold their fixed rings whatever the length. Buffers are allocated at the first
    forward, with the batch size, dtype and device of its keys."""

    is_compileable = True

    def __init__(
        self,
        config: Inkling2TextConfig,
        max_cache_len: int,
        max_batch_size: int | None = None,
        rollback_margin: int = MAX_STEP_TOKENS,
        max_queries: int = MAX_STEP_TOKENS,
        **kwargs,
    ):
        config = config.get_text_config(decoder=True)
        self.rollback_margin, self.max_queries, self.max_cache_len = rollback_margin, max_queries, max_cache_len
        self.max_batch_size = max_batch_size  # checked at the first forward when given
        ring = config.sliding_window_size - 1 + max(max_queries, rollback_margin)
        layers = [
            Inkling2StaticLayerCache(
                capacity=ring if layer_type == SLIDING_LAYER else max_cache_len,
                conv_capacity=config.conv_kernel_size - 1 + rollback_margin,
                is_sliding=layer_type == SLIDING_LAYER,
                max_queries=max_queries,
                history=config.sliding_window_size - 1,
            )
            for layer_type in config.layer_types
        ]
        super().__init__(layers=layers, **kwargs)
        # Set while a step is captured or replayed (decode_graphs): the full layers' attention span (a power-of-two
        # bucket), the host-side length then being the runner's to keep. None: an ordinary forward.
        self.attend_length: int | None = None
        self.graphs: dict = {}  # CUDA graphs captured over these buffers, kept with them (decode_graphs)
        self.graph_pool = None  # their shared memory pool
        self.capture_failed = False  # a step could not be captured: the others run eagerly too

    def attention_keys(self, layer_idx, keys, values, query_positions, attention_mask):
        if self.max_batch_size is not None and keys.shape[0] != self.max_batch_size:
            raise ValueError(
                f"This static cache was built for {self.max_batch_size} rows; the forward has {keys.shape[0]}."
            )
        token_mask = None if attention_mask is None else attention_mask[:, -keys.shape[2] :]
        return self.layers[layer_idx].attention_keys(keys, values, query_positions, token_mask, self.attend_length)

    def convolution_context(self, layer_idx, conv_idx, new_inputs, kernel_size, query_positions):
        return self.layers[layer_idx].convolution_context(conv_idx, new_inputs, kernel_size, query_positions)

    def advance(self, new_tokens: int) -> None:
        """Counts tokens that a replayed graph wrote (its Python bookkeeping does not run)."""
        for layer in self.layers:
            layer.seen_tokens += new_tokens

    def reset(self) -> None:
        super().reset()
        self.attend_length = None


__all__ = ["Inkling2StaticCache"]
