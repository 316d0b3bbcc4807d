"""The serving engine's cache: many sequences at once, each with its own positions, in memory that follows the
tokens in flight.

- full-attention layers: keys and values in a pool of pages of `page_size` tokens shared by every sequence; a
  sequence's `block_table` row lists its pages (token `t` sits in page `block_table[row, t // page_size]` at offset
  `t % page_size`). Page 0 is never handed out: unused table entries point at it, so a write past a sequence's pages
  (a dummy row of a padded batch) lands there harmlessly;
- sliding-window layers: one ring of `sliding_window - 1 + MAX_STEP_TOKENS` slots per row (slot = position mod ring
  size) and the position each slot holds;
- the four short convolutions: one ring of `conv_kernel_size - 1 + MAX_STEP_TOKENS` inputs per row, read by position;
- the DSpark drafter's context (when the engine drafts): one ring of `context_window + MAX_STEP_TOKENS` positions
  per row and drafter layer.

Rows are the engine's sequence slots. A forward covers a contiguous block of rows (`use_rows`): a decode step every
occupied row (positions [rows, tokens], each row at its own length), a prompt chunk one or more rows at the same
positions (positions [tokens]: rows admitted together prefill side by side, reading the expert weights once).
Slots that hold no token yet claim positions far before 0 (`EMPTY_POSITION`), never visible and never "held".
Taking tokens back (a rejected speculative draft) costs nothing here: the engine lowers the row's length, and the
slots of the dropped tokens hold positions after every later query until a later step overwrites them before it
attends. Buffers are allocated at the first write, with the dtype, device and (under tensor parallelism) local head
count of what is written.
"""

from __future__ import annotations

import math

import torch

from ..configuration_inkling2 import SLIDING_LAYER, Inkling2TextConfig
from .common import MAX_STEP_TOKENS, NUM_CONVOLUTIONS, join_convolution_context

TRASH_PAGE = 0
EMPTY_LAPS = 2**20  # an empty slot `j` of a ring of size n claims position `j - n * EMPTY_LAPS`


def empty_positions(rows: int, capacity: int, device) -> torch.Tensor:
    """[rows, capacity] positions of never-written ring slots: congruent to the slot (slot = position mod size keeps
    holding) and further back than any window or kernel reaches."""
    return (torch.arange(capacity, device=device) - capacity * EMPTY_LAPS).expand(rows, capacity).contiguous()


def full_layer_bytes_per_token(config: Inkling2TextConfig, dtype_bytes: int = 2, tp: int = 1) -> int:
    """Keys and values of one token in every full-attention layer (a rank's kv heads under tensor parallelism)."""
    kv_heads = max(1, config.num_key_value_heads // tp)
    full_layers = sum(kind != SLIDING_LAYER for kind in config.layer_types)
    return full_layers * 2 * kv_heads * config.head_dim * dtype_bytes


def local_kv_width(config: Inkling2TextConfig, layer_type: str, tp: int = 1) -> int:
    """Channels of a layer's keys (or values) that one rank holds: its kv heads (at least one) times the head dim."""
    prefix = "swa_" if layer_type == SLIDING_LAYER else ""
    return max(1, getattr(config, f"{prefix}num_key_value_heads") // tp) * getattr(config, f"{prefix}head_dim")


def convolution_state_bytes(config: Inkling2TextConfig, tp: int = 1) -> int:
    """One sequence's short-convolution inputs in every layer, as every Inkling2 cache keeps them: keys and values
    (the kv width) and the two residual-stream convolutions, `conv_kernel_size - 1 + MAX_STEP_TOKENS` fp32 each."""
    ring = config.conv_kernel_size - 1 + MAX_STEP_TOKENS
    widths = (2 * local_kv_width(config, kind, tp) + 2 * config.hidden_size for kind in config.layer_types)
    return sum(widths) * ring * 4


def row_state_bytes(config: Inkling2TextConfig, dtype_bytes: int = 2, tp: int = 1, dspark_config=None) -> int:
    """What one row holds whatever its length: sliding-window rings, convolution rings (fp32), the drafter's context."""
    sliding_ring = config.sliding_window_size - 1 + MAX_STEP_TOKENS
    total = convolution_state_bytes(config, tp)
    for kind in config.layer_types:
        if kind == SLIDING_LAYER:
            total += 2 * local_kv_width(config, kind, tp) * sliding_ring * dtype_bytes
    if dspark_config is not None:
        context = dspark_config.context_window + MAX_STEP_TOKENS
        width = dspark_config.num_key_value_heads * dspark_config.head_dim
        total += dspark_config.num_draft_layers * 2 * width * context * dtype_bytes
    return total


def check_page_size(page_size: int) -> None:
    """Pages hold whole key blocks of the decode kernel (64 keys) and split a sequence at powers of two."""
    if not isinstance(page_size, int) or page_size < 64 or page_size & (page_size - 1):
        raise ValueError(f"`page_size` must be a power of two of at least 64, got {page_size}.")


def pages_that_fit(
    memory_bytes: float,
    config: Inkling2TextConfig,
    page_size: int,
    max_rows: int,
    dtype_bytes: int = 2,
    tp: int = 1,
    dspark_config=None,
) -> int:
    """Pages of `page_size` tokens that `memory_bytes` hold once `max_rows` rows' fixed state is set aside (what the
    engine sizes its pool with, and `inkling2 plan` reports)."""
    check_page_size(page_size)
    fixed = max_rows * row_state_bytes(config, dtype_bytes, tp, dspark_config)
    return int((memory_bytes - fixed) // (page_size * full_layer_bytes_per_token(config, dtype_bytes, tp)))


class RowStep:
    """The index arithmetic of one forward over a block of rows, done once for every layer (`begin_step`).
    `positions` [rows, tokens]; `prompt` says whether they came 1-D (a prompt chunk at the same positions in every
    row: its attention takes the usual contiguous path)."""

    def __init__(self, cache: Inkling2PagedCache, positions: torch.Tensor):
        self.prompt = positions.dim() == 1
        rows = cache.rows.stop - cache.rows.start
        self.positions = positions.view(-1, positions.shape[-1]).expand(rows, -1)
        self._ring_slots: dict[int, torch.Tensor] = {}
        tokens = self.positions.shape[1]
        device = positions.device
        # full layers: every new token's page and offset
        page_index = torch.div(self.positions, cache.page_size, rounding_mode="floor")
        pages = cache.block_table[cache.rows].gather(1, page_index)
        self.pages, self.offsets = pages.long(), self.positions.remainder(cache.page_size)
        # convolutions: the `kernel - 1` inputs before the step (held or zeros), read before the new positions are
        # recorded (a long prompt chunk overwrites those slots); then the new ones, the last `ring size` of them
        history = cache.conv_kernel_size - 1
        before = self.positions[:, :1] - history + torch.arange(history, device=device)
        conv_positions = cache.conv_positions[cache.rows]
        self.history_slots = before.remainder(cache.conv_capacity)
        self.history_held = conv_positions.gather(1, self.history_slots) == before
        self.conv_written = min(tokens, cache.conv_capacity)
        self.conv_write = self.ring_slots(cache.conv_capacity)
        conv_positions.scatter_(1, self.conv_write, self.positions[:, -self.conv_written :])

    def ring_slots(self, capacity: int) -> torch.Tensor:
        """[rows, kept] slots of the step's last `capacity` positions in rings of that size, once per size."""
        if capacity not in self._ring_slots:
            self._ring_slots[capacity] = self.positions[:, -capacity:].remainder(capacity)
        return self._ring_slots[capacity]


class Inkling2PagedCache:
    """See the module docstring. `max_pages_per_row` bounds a sequence: `max_pages_per_row * page_size` tokens."""

    def __init__(
        self,
        config: Inkling2TextConfig,
        max_rows: int,
        num_pages: int,
        page_size: int,
        max_pages_per_row: int,
        device: torch.device | str = "cpu",
    ):
        config = config.get_text_config(decoder=True)
        check_page_size(page_size)
        if num_pages < 2:
            raise ValueError(f"A paged cache needs at least 2 pages (page 0 is reserved), got {num_pages}.")
        self.max_rows, self.num_pages, self.page_size = max_rows, num_pages, page_size
        self.layer_types = list(config.layer_types)
        self.sliding_capacity = config.sliding_window_size - 1 + MAX_STEP_TOKENS
        self.history = config.sliding_window_size - 1
        self.conv_kernel_size = config.conv_kernel_size
        self.conv_capacity = config.conv_kernel_size - 1 + MAX_STEP_TOKENS
        self.device = torch.device(device)
        self.block_table = torch.full((max_rows, max_pages_per_row), TRASH_PAGE, dtype=torch.int32, device=device)
        self.conv_positions = empty_positions(max_rows, self.conv_capacity, device)
        layers = len(self.layer_types)
        self.keys: list[torch.Tensor | None] = [None] * layers  # pools [pages, kv_heads, page_size, dim] or rings
        self.values: list[torch.Tensor | None] = [None] * layers  # [rows, kv_heads, ring, dim]
        self.slot_positions = {
            i: empty_positions(max_rows, self.sliding_capacity, device)
            for i, kind in enumerate(self.layer_types)
            if kind == SLIDING_LAYER
        }
        self.conv_inputs: list[list[torch.Tensor | None]] = [[None] * NUM_CONVOLUTIONS for _ in range(layers)]
        # the DSpark drafter's context, per drafter layer (`enable_drafter_context`, allocated at the first write)
        self.context_capacity = 0
        self.context_keys: list[torch.Tensor | None] = []
        self.context_values: list[torch.Tensor | None] = []
        self.context_positions: torch.Tensor | None = None
        self.rows = slice(0, max_rows)
        self.key_span: int | None = None  # the full layers' keys a step attends to (a multiple of the page size)
        self.step: RowStep | None = None

    @property
    def max_row_tokens(self) -> int:
        return self.block_table.shape[1] * self.page_size

    # --- what the engine calls ------------------------------------------------------------------------------------

    def use_rows(self, start: int, stop: int, key_span: int) -> None:
        """The rows the next forwards cover and how many of their full-attention keys they attend to (every row of a
        decode step: the longest row's tokens, rounded up; a bucket of them when the step is replayed as a graph)."""
        if key_span % self.page_size or key_span > self.max_row_tokens:
            raise ValueError(f"key_span {key_span} must be a multiple of {self.page_size} up to {self.max_row_tokens}.")
        self.rows, self.key_span = slice(start, stop), key_span

    def assign_pages(self, row: int, first: int, pages: list[int]) -> None:
        """Row `row`'s pages `first, first + 1, ...` are `pages`."""
        self.block_table[row, first : first + len(pages)] = torch.tensor(pages, dtype=torch.int32)

    def enable_drafter_context(self, num_layers: int, context_window: int) -> None:
        """Rows also keep a DSpark drafter's context: `context_window + MAX_STEP_TOKENS` positions per layer."""
        self.context_capacity = context_window + MAX_STEP_TOKENS
        self.context_keys, self.context_values = [None] * num_layers, [None] * num_layers
        self.context_positions = empty_positions(self.max_rows, self.context_capacity, self.device)

    def reset_row(self, row: int) -> None:
        """An empty row for a new sequence: no pages, no positions held."""
        self.block_table[row] = TRASH_PAGE
        for positions in self._position_rings():
            positions[row] = empty_positions(1, positions.shape[1], self.device)[0]

    def _position_rings(self) -> list[torch.Tensor]:
        rings = [self.conv_positions, *self.slot_positions.values()]
        return rings if self.context_positions is None else [*rings, self.context_positions]

    def move_row(self, source: int, target: int) -> None:
        """Row `source`'s whole state to row `target` (the engine keeps its occupied rows contiguous)."""
        sliding = [i for i, kind in enumerate(self.layer_types) if kind == SLIDING_LAYER]
        row_tensors = [self.block_table, *self._position_rings()]
        row_tensors += [self.keys[i] for i in sliding] + [self.values[i] for i in sliding]
        row_tensors += [t for per_layer in self.conv_inputs for t in per_layer]
        row_tensors += self.context_keys + self.context_values
        for tensor in row_tensors:
            if tensor is not None:
                tensor[target] = tensor[source]

    def write_context(self, layer_keys_values: list[tuple[torch.Tensor, torch.Tensor]], positions: torch.Tensor):
        """The drafter's context keys/values ([rows, kv_heads, tokens, dim] per drafter layer) of the current rows'
        positions [rows, tokens]: the last `context_capacity` of them, at slot = position mod capacity."""
        capacity = self.context_capacity
        rows = self.rows.stop - self.rows.start
        positions = positions.view(-1, positions.shape[-1])[:, -capacity:].expand(rows, -1)
        slots = positions.remainder(capacity)
        for i, (keys, values) in enumerate(layer_keys_values):
            if self.context_keys[i] is None:
                self.context_keys[i] = empty_ring(keys, self.max_rows, capacity)
                self.context_values[i] = empty_ring(values, self.max_rows, capacity)
            write_at_slots(self.context_keys[i][self.rows], slots, keys)
            write_at_slots(self.context_values[i][self.rows], slots, values)
        self.context_positions[self.rows].scatter_(1, slots, positions)

    def drafter_context(self) -> tuple[list[torch.Tensor], list[torch.Tensor], torch.Tensor]:
        """The current rows' drafter context: keys and values per layer, and the positions [rows, capacity] held."""
        rows = self.rows
        keys = [ring[rows] for ring in self.context_keys]
        return keys, [ring[rows] for ring in self.context_values], self.context_positions[rows]

    # --- what the model calls -------------------------------------------------------------------------------------

    def begin_step(self, query_positions: torch.Tensor) -> None:
        self.step = RowStep(self, query_positions)

    def get_seq_length(self, layer_idx: int = 0) -> int:
        raise ValueError("Inkling2PagedCache holds rows of different lengths: pass `cache_position` to the model.")

    def attention_keys(self, layer_idx, keys, values, query_positions, attention_mask):
        """Writes the step's keys/values ([rows, kv_heads, tokens, dim]); returns what the queries attend to: (keys,
        values, key positions, key padding, whether the key positions ascend contiguously and are shared, and for a
        decode step's full layers the rows' block table: the keys and values are then the page pools)."""
        if attention_mask is not None:
            raise ValueError("Inkling2PagedCache rows hold no padding: pass `attention_mask=None`.")
        step = self.step
        if self.layer_types[layer_idx] != SLIDING_LAYER:
            return self._full_layer_keys(layer_idx, keys, values, step)
        return self._sliding_layer_keys(layer_idx, keys, values, step)

    def _full_layer_keys(self, layer_idx, keys, values, step: RowStep):
        if self.keys[layer_idx] is None:
            shape = (self.num_pages, keys.shape[1], self.page_size, keys.shape[3])
            self.keys[layer_idx] = keys.new_zeros(shape)
            self.values[layer_idx] = values.new_zeros(*shape[:3], values.shape[3])
        pools = (self.keys[layer_idx], self.values[layer_idx])
        for pool, new in zip(pools, (keys, values)):
            pool[step.pages, :, step.offsets] = new.transpose(1, 2)
        block_table = self.block_table[self.rows, : self.key_span // self.page_size]
        key_positions = torch.arange(self.key_span, device=keys.device)
        if not step.prompt:  # the decode path reads the pages where they are
            return *pools, key_positions, None, False, block_table
        # a prompt chunk takes the usual contiguous path: its rows' pages gathered in order
        keys, values = (gather_pages(pool, block_table) for pool in pools)
        return keys, values, key_positions, None, True, None

    def _sliding_layer_keys(self, layer_idx, keys, values, step: RowStep):
        capacity = self.sliding_capacity
        if self.keys[layer_idx] is None:
            self.keys[layer_idx] = empty_ring(keys, self.max_rows, capacity)
            self.values[layer_idx] = empty_ring(values, self.max_rows, capacity)
        ring_keys, ring_values = self.keys[layer_idx][self.rows], self.values[layer_idx][self.rows]
        slot_positions = self.slot_positions[layer_idx][self.rows]
        slots = step.ring_slots(capacity)
        if step.prompt:  # the rows' chunks: the keys their window still reaches in position order, then the new ones
            first = step.positions[0, 0]
            held = torch.arange(self.history, device=keys.device) + first - self.history
            order = held.remainder(capacity)
            is_held = slot_positions.index_select(1, order) == held  # False before a sequence's start
            attend = (
                torch.cat([ring_keys.index_select(2, order), keys], dim=2),
                torch.cat([ring_values.index_select(2, order), values], dim=2),
                torch.cat([held, step.positions[0]]),
                torch.cat([is_held, is_held.new_ones(is_held.shape[0], keys.shape[2])], dim=1),
                True,
                None,
            )
        write_at_slots(ring_keys, slots, keys)
        write_at_slots(ring_values, slots, values)
        slot_positions.scatter_(1, slots, step.positions[:, -slots.shape[1] :])
        if step.prompt:
            return attend
        return ring_keys, ring_values, slot_positions, None, False, None

    def convolution_context(self, layer_idx, conv_idx, new_inputs, kernel_size, query_positions):
        """[rows, C, tokens] inputs preceded by the row's `kernel_size - 1` earlier inputs (zeros before its start);
        the new inputs are written into the row's ring (their positions already are, by `begin_step`)."""
        if kernel_size != self.conv_kernel_size:
            raise ValueError(f"This cache holds inputs of {self.conv_kernel_size}-tap convolutions, not {kernel_size}.")
        step = self.step
        if self.conv_inputs[layer_idx][conv_idx] is None:
            shape = (self.max_rows, new_inputs.shape[1], self.conv_capacity)
            self.conv_inputs[layer_idx][conv_idx] = new_inputs.new_zeros(shape)
        ring = self.conv_inputs[layer_idx][conv_idx][self.rows]
        channels = new_inputs.shape[1]
        history = ring.gather(-1, step.history_slots[:, None].expand(-1, channels, -1))
        context = join_convolution_context(history * step.history_held[:, None], new_inputs)
        written = step.conv_written
        ring.scatter_(-1, step.conv_write[:, None].expand(-1, channels, -1), new_inputs[..., -written:])
        return context


def empty_ring(like: torch.Tensor, rows: int, capacity: int) -> torch.Tensor:
    """A zeroed per-row ring [rows, heads, capacity, dim] for entries shaped like `like` [., heads, ., dim]."""
    return like.new_zeros(rows, like.shape[1], capacity, like.shape[3])


def write_at_slots(ring: torch.Tensor, slots: torch.Tensor, new: torch.Tensor) -> None:
    """Row r's last `slots.shape[1]` entries of `new` [rows, heads, tokens, dim] into `ring` [rows, heads, size, dim]
    at `slots[r]` (in place: `ring` may be a view of the cache's rows)."""
    rows = torch.arange(slots.shape[0], device=slots.device)[:, None]
    ring[rows, :, slots] = new[:, :, -slots.shape[1] :].transpose(1, 2)


def gather_pages(pool: torch.Tensor, block_table: torch.Tensor) -> torch.Tensor:
    """[rows, kv_heads, pages * page_size, dim]: every row's pages from a [pages, kv_heads, page_size, dim] pool."""
    rows, pages = block_table.shape
    gathered = pool[block_table.long()]  # [rows, pages, kv_heads, page_size, dim]
    return gathered.permute(0, 2, 1, 3, 4).reshape(rows, pool.shape[1], pages * pool.shape[2], pool.shape[3])


def pages_for(tokens: int, page_size: int) -> int:
    return math.ceil(tokens / page_size)


__all__ = [
    "Inkling2PagedCache",
    "check_page_size",
    "convolution_state_bytes",
    "full_layer_bytes_per_token",
    "gather_pages",
    "local_kv_width",
    "pages_for",
    "pages_that_fit",
    "row_state_bytes",
]
