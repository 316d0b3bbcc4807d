"""A fixed-size decoding cache for Inkling2, so that a decode step has static shapes and can be replayed as a CUDA
graph (`generation/decode_graphs.py`).

Every buffer is allocated once (at the first forward) and written in place at slots computed on the device from
the tokens' positions; nothing is ever concatenated or reallocated while decoding:

- full-attention layers: keys/values for `max_cache_len` positions, slot = position;
- sliding-window layers: a ring of `sliding_window - 1 + max(max_queries, rollback_margin)` slots,
  slot = position mod ring size, and the position each slot holds (`slot_positions`), so a step of up to
  `max_queries` tokens writes first and then attends over the whole ring (attention backends take arbitrary key
  positions; the window and the bias follow from position differences);
- the four short convolutions: a ring of `conv_kernel_size - 1 + rollback_margin` inputs, read by position; every
  convolution sees every token, so all these rings hold the same positions, recorded once (`conv_positions`);
- `key_valid` [batch, slots]: False for padding and never-written slots.

The index arithmetic of a forward (slots, which convolution inputs are held) depends on its positions only: the
model calls `begin_step` once before its layers, and every layer reuses the result (`StepSlots`) instead of
recomputing it for each of its rings (about 200 small launches fewer per decode step of a 6-layer slice).

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
    ring_slots,
    shift_rows_right,
    write_by_position,
)


class StepSlots:
    """The index arithmetic of one forward over the static cache, done once for every layer: the new tokens' slots
    in rings of each size, and where the short convolutions read their context. Made by `begin_step`, which also
    records the new positions in the convolution rings' shared `conv_positions` (after reading which of the history
    inputs they still hold: a long prompt may overwrite those slots)."""

    def __init__(self, query_positions: torch.Tensor, conv_positions: torch.Tensor, kernel_size: int):
        self.query_positions = query_positions
        self._slots: dict[int, torch.Tensor] = {}
        capacity, history = conv_positions.shape[0], kernel_size - 1
        # the `kernel_size - 1` inputs before the step, zeros where a ring no longer (or never) held them
        before = query_positions[0] - history + torch.arange(history, device=query_positions.device)
        self.history_slots = before.remainder(capacity)
        self.history_held = conv_positions[self.history_slots] == before  # bool: multiplies as 1.0 / 0.0
        self.conv_write = self.slots(capacity)
        # a step whose slots miss its history's writes first and then gathers its whole context from the ring (one
        # gather instead of a gather and a cat); longer inputs keep the prompt layout of `join_convolution_context`
        new_tokens = query_positions.numel()
        self.reads_ring = new_tokens <= MAX_STEP_TOKENS and new_tokens + history <= capacity
        if self.reads_ring:
            self.context_slots = torch.cat([self.history_slots, self.conv_write])
            self.context_held = torch.cat([self.history_held, self.conv_write.new_ones(new_tokens, dtype=torch.bool)])
        conv_positions.index_copy_(0, self.conv_write, query_positions[-capacity:])

    def slots(self, capacity: int) -> torch.Tensor:
        """`ring_slots` of the step's positions for rings of `capacity`, computed once per size."""
        if capacity not in self._slots:
            self._slots[capacity] = ring_slots(self.query_positions, capacity)
        return self._slots[capacity]


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
        self.conv_positions: torch.Tensor | None = None  # shared by every ring (`Inkling2StaticCache.begin_step`)
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

    def write(self, positions, keys, values, valid, slots=None) -> None:
        """Stores tokens at their slots (the last `capacity` of them when there are more); `valid` None: no padding.
        `slots`: `ring_slots(positions, capacity)` when the caller has them."""
        entries = [(self.keys, keys, 2), (self.values, values, 2)]
        if valid is not None:
            entries.append((self.key_valid, valid, 1))
        slots = write_by_position(self.slot_positions, positions, entries, slots)
        if valid is None:  # every new token is a real key: one fill, no mask to build and copy
            self.key_valid.index_fill_(1, slots, True)

    def attention_keys(self, keys, values, query_positions, token_mask, attend_length, slots=None):
        """Writes the step's keys/values; returns what it attends to: (keys, values, key positions, key padding,
        whether the key positions ascend contiguously, None: no paged keys). With `attend_length` (a captured step,
        at most `max_queries` tokens) the full layers attend over that many slots and the host-side length is left to
        the runner: nothing here then reads it, so the traced step does not depend on it. `slots`: the step's slots in
        this layer's ring, when already computed (`StepSlots`)."""
        if not self.is_initialized:
            self.lazy_initialization(keys, values)
        new_tokens = keys.shape[2]
        valid = None if token_mask is None else token_mask.bool()
        past, attend_length = self.count(new_tokens, attend_length)

        if not self.is_sliding or new_tokens <= self.max_queries:  # write, then attend over what holds them
            self.write(query_positions, keys, values, valid, slots)
            return self.written(attend_length)
        # a long chunk (prefill): the keys the window still reaches in position order, then the new ones
        held = min(past, self.history)
        positions = torch.arange(past - held, past, device=keys.device)
        order = positions.remainder(self.capacity)
        held_valid = self.key_valid.index_select(1, order) & (self.slot_positions.index_select(0, order) == positions)
        new_valid = valid if valid is not None else held_valid.new_ones(keys.shape[0], new_tokens)
        attend = (
            torch.cat([self.keys.index_select(2, order), keys], dim=2),
            torch.cat([self.values.index_select(2, order), values], dim=2),
            torch.cat([positions, query_positions]),
            torch.cat([held_valid, new_valid], dim=1),
            True,
            None,
        )
        self.write(query_positions, keys, values, valid, slots)
        return attend

    def count(self, new_tokens: int, attend_length: int | None) -> tuple[int | None, int]:
        """The host-side count of a forward's new tokens: (tokens cached before them, the full layers' attention
        span). A captured step (`attend_length` given) leaves the count to its runner: (None, attend_length)."""
        if attend_length is not None:
            return None, attend_length
        self.check_room(new_tokens)
        past = self.seen_tokens
        self.seen_tokens += new_tokens
        return past, past + new_tokens

    def written(self, attend_length: int) -> tuple:
        """What a step attends to once its keys are written (`attention_keys`' tuple): in a full layer (slot =
        position) the first `attend_length` slots, in order; in a sliding layer every slot of the ring, with the
        positions the slots hold and their validity."""
        if not self.is_sliding:
            length = attend_length
            return (self.keys[:, :, :length], self.values[:, :, :length], self.all_positions[:length],
                    self.key_valid[:, :length], True, None)  # fmt: skip
        return self.keys, self.values, self.slot_positions, self.key_valid, False, None

    def update(self, key_states, value_states, *args, **kwargs):
        """transformers' Cache interface: appends after the cached tokens; returns the keys/values attended."""
        positions = torch.arange(key_states.shape[2], device=key_states.device) + self.seen_tokens
        return self.attention_keys(key_states, value_states, positions, None, None)[:2]

    def convolution_context(self, conv_idx: int, new_inputs: torch.Tensor, step: StepSlots) -> torch.Tensor:
        """The `kernel_size - 1` inputs before `new_inputs` ([batch, C, T]), read from the ring by position (zeros
        where it does not hold them: before the sequence start), joined with them; the new inputs are written into
        the ring (their positions already are, by `begin_step`)."""
        ring, written = self.convolution_ring(conv_idx, new_inputs), step.conv_write.numel()
        new_inputs_kept = new_inputs.narrow(-1, new_inputs.shape[-1] - written, written)
        if step.reads_ring:  # the same values as below, in three launches
            ring.index_copy_(-1, step.conv_write, new_inputs_kept)
            return ring.index_select(-1, step.context_slots) * step.context_held
        context = join_convolution_context(ring.index_select(-1, step.history_slots) * step.history_held, new_inputs)
        ring.index_copy_(-1, step.conv_write, new_inputs_kept)
        return context

    def convolution_ring(self, conv_idx: int, new_inputs: torch.Tensor) -> torch.Tensor:
        """The ring [batch, C, conv_capacity] of a convolution's inputs, made (zeros, as `new_inputs` [batch, C, T]
        in dtype and device) at its first use."""
        if self.conv_inputs[conv_idx] is None:
            self.conv_inputs[conv_idx] = new_inputs.new_zeros(*new_inputs.shape[:-1], self.conv_capacity)
        return self.conv_inputs[conv_idx]

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
        return rings + [(r, self.conv_positions, -1) for r in self.conv_inputs if r is not None]

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
        for ring in self.conv_inputs:
            if ring is not None:
                ring.zero_()  # (the shared `conv_positions` are reset by the cache)


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
        self.conv_kernel_size = config.conv_kernel_size
        self.conv_capacity = config.conv_kernel_size - 1 + rollback_margin
        self.conv_positions: torch.Tensor | None = None  # what every convolution ring holds, made at `begin_step`
        self.step: StepSlots | None = None  # the current forward's index arithmetic
        ring = config.sliding_window_size - 1 + max(max_queries, rollback_margin)
        layers = [
            Inkling2StaticLayerCache(
                capacity=ring if layer_type == SLIDING_LAYER else max_cache_len,
                conv_capacity=self.conv_capacity,
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

    def check_rows(self, batch: int) -> None:
        if self.max_batch_size is not None and batch != self.max_batch_size:
            raise ValueError(f"This static cache was built for {self.max_batch_size} rows; the forward has {batch}.")

    def attention_keys(self, layer_idx, keys, values, query_positions, attention_mask):
        self.check_rows(keys.shape[0])
        token_mask = None if attention_mask is None else attention_mask[:, -keys.shape[2] :]
        layer = self.layers[layer_idx]
        slots = self.step.slots(layer.capacity) if self.step_is_for(query_positions) else None
        return layer.attention_keys(keys, values, query_positions, token_mask, self.attend_length, slots)

    def begin_step(self, query_positions: torch.Tensor) -> None:
        """Prepares a forward of tokens at `query_positions` (on the device): its index arithmetic, once for all
        layers (`StepSlots`). The model calls it before its layers; a convolution read for other positions makes
        its own."""
        if self.conv_positions is None:
            self.conv_positions = initial_slot_positions(self.conv_capacity, query_positions.device)
            for layer in self.layers:
                layer.conv_positions = self.conv_positions
        self.step = StepSlots(query_positions, self.conv_positions, self.conv_kernel_size)

    def step_is_for(self, query_positions: torch.Tensor) -> bool:
        return self.step is not None and self.step.query_positions is query_positions

    def convolution_step(self, kernel_size: int, query_positions: torch.Tensor) -> StepSlots:
        """The slots of the step at `query_positions` (made here when the model did not begin it)."""
        if kernel_size != self.conv_kernel_size:
            raise ValueError(f"This cache holds inputs of {self.conv_kernel_size}-tap convolutions, not {kernel_size}.")
        if not self.step_is_for(query_positions):
            self.begin_step(query_positions)
        return self.step

    def convolution_context(self, layer_idx, conv_idx, new_inputs, kernel_size, query_positions):
        step = self.convolution_step(kernel_size, query_positions)
        return self.layers[layer_idx].convolution_context(conv_idx, new_inputs, step)

    def step_convolution_ring(self, layer_idx, conv_idx, new_inputs, kernel_size, query_positions):
        """What a fused step convolution reads and writes instead of calling `convolution_context`: (the ring
        [batch, C, conv_capacity] of this convolution's fp32 inputs, the step's `StepSlots`) for a step that reads
        its whole context from the ring (a decode or verification step), else None. new_inputs [batch, C, T] give
        the ring's shape, dtype and device at its first use; the kernel writes them into the ring itself."""
        step = self.convolution_step(kernel_size, query_positions)
        if not step.reads_ring:
            return None
        return self.layers[layer_idx].convolution_ring(conv_idx, new_inputs), step

    def step_key_value_ring(self, layer_idx, keys_like, values_like, query_positions) -> tuple | None:
        """Where a kernel that computes a layer's step keys and values writes them itself, instead of passing them to
        `attention_keys`: (keys, values, key_valid, slot_positions, the step's slots) of the layer's buffers (a
        sliding layer's ring; a full layer's, where slot = position), for a step of at most `max_queries` tokens;
        else None. keys_like / values_like [batch, kv_heads, T, head_dim] give the buffers' shapes, dtype and device
        at their first use. The kernel writes the slots' positions and validity too; `attend_written` then returns
        what the step attends to."""
        layer = self.layers[layer_idx]
        self.check_rows(keys_like.shape[0])
        if keys_like.shape[2] > layer.max_queries:
            return None
        if self.attend_length is None:  # a full layer's room, checked before the kernel writes, as `attention_keys`
            layer.check_room(keys_like.shape[2])
        if not layer.is_initialized:
            layer.lazy_initialization(keys_like, values_like)
        step = self.step if self.step_is_for(query_positions) else None
        slots = ring_slots(query_positions, layer.capacity) if step is None else step.slots(layer.capacity)
        return layer.keys, layer.values, layer.key_valid, layer.slot_positions, slots

    def attend_written(self, layer_idx: int, new_tokens: int) -> tuple:
        """`attention_keys`' result for a step whose keys and values a kernel wrote (`step_key_value_ring`): the
        host-side count updated (and the full layers' room checked) as there."""
        layer = self.layers[layer_idx]
        return layer.written(layer.count(new_tokens, self.attend_length)[1])

    def advance(self, new_tokens: int) -> None:
        """Counts tokens that a replayed graph wrote (its Python bookkeeping does not run)."""
        for layer in self.layers:
            layer.seen_tokens += new_tokens

    def reset(self) -> None:
        super().reset()
        self.attend_length, self.step = None, None
        if self.conv_positions is not None:
            self.conv_positions.copy_(initial_slot_positions(self.conv_capacity, self.conv_positions.device))


__all__ = ["Inkling2StaticCache"]
