"""What the two caches, the DSpark drafter's contexts and the model share: the step limit, the convolution slots,
the layout of a convolution's context, and the row operations of speculative decoding."""

from __future__ import annotations

import torch

# A decode or verification step feeds at most this many tokens (DSpark verifies 7 drafts + 1 anchor), and
# speculative decoding takes back at most as many: the caches' rollback margin, the static cache's ring headroom,
# and the largest step that attention and convolutions treat as decoding (longer inputs are prompts).
MAX_STEP_TOKENS = 8
NUM_CONVOLUTIONS = 4
K_CONV, V_CONV, POST_ATTENTION_CONV, POST_MLP_CONV = range(NUM_CONVOLUTIONS)


def keep_last(tensor: torch.Tensor | None, new: torch.Tensor, dim: int, limit: int | None) -> torch.Tensor:
    """`cat(tensor, new)` along `dim`, trimmed to its last `limit` entries (all of them when `limit` is None). Only
    the kept entries are copied, and a tail cut from a much longer `new` is a copy of its own: a prompt's activations
    are neither joined in full nor held alive by the few entries the cache keeps of them."""
    if limit is not None and new.shape[dim] >= limit:
        tail = new.narrow(dim, new.shape[dim] - limit, limit)
        return tail.clone() if new.shape[dim] > 2 * limit else tail
    if tensor is None:
        return new
    if limit is not None and tensor.shape[dim] + new.shape[dim] > limit:
        held = limit - new.shape[dim]
        tensor = tensor.narrow(dim, tensor.shape[dim] - held, held)
    return torch.cat([tensor, new], dim=dim)


def shift_rows_right(
    tensor: torch.Tensor, shifts: torch.Tensor, dim: int, slot_positions: torch.Tensor | None = None
) -> torch.Tensor:
    """Moves row `b` of `tensor` (batch first) `shifts[b]` positions later along `dim`: the entry of position `x`
    receives what position `x - shifts[b]` held, or zero where that position is not held. Speculative decoding uses
    it to drop the rejected tokens of a row that accepted fewer than the others, turning them into left padding.

    Entries hold positions in order unless `slot_positions` is given: then `dim` is a ring (the static cache's
    sliding windows and convolution inputs) whose slot `j` holds position `slot_positions[j]`, `j = position mod
    ring size`. In order, the last `shifts[b]` entries fall off and the first ones become zeros."""
    moved = tensor.movedim(dim, -1)
    size = moved.shape[-1]
    slots = torch.arange(size, device=tensor.device)
    positions = slots if slot_positions is None else slot_positions
    shifts = shifts.to(tensor.device)[:, None]
    source = (slots[None, :] - shifts).remainder(size)  # [batch, size]
    held = positions[source] == positions[None, :] - shifts
    index = source.view(source.shape[0], *([1] * (moved.dim() - 2)), size).expand_as(moved)
    keep = held.view(index.shape[0], *([1] * (moved.dim() - 2)), size)
    return (moved.gather(-1, index) * keep.to(moved.dtype)).movedim(-1, dim)


def initial_slot_positions(capacity: int, device) -> torch.Tensor:
    """One lap before position 0: slot `j` claims position `j - capacity` (negative, never a real token), which
    keeps `slot_positions[j] = j (mod capacity)` true from the start."""
    return torch.arange(capacity, device=device) - capacity


def ring_slots(positions: torch.Tensor, capacity: int) -> torch.Tensor:
    """The slots of the last `capacity` positions in a ring of that size: position mod ring size."""
    return positions[-capacity:].remainder(capacity)


def write_by_position(
    slot_positions: torch.Tensor,
    positions: torch.Tensor,
    entries: list[tuple[torch.Tensor, torch.Tensor, int]],
    slots: torch.Tensor | None = None,
) -> torch.Tensor:
    """Stores new entries in position-indexed rings (slot = position mod ring size; the last `ring size` of them
    when there are more) and records their positions. `entries`: (ring, new values, the dim both index by position).
    `slots`: `ring_slots(positions, ring size)` when the caller already has them. Returns the slots written."""
    capacity = slot_positions.shape[0]
    positions = positions[-capacity:]
    slots = positions.remainder(capacity) if slots is None else slots
    for ring, new, dim in entries:
        ring.index_copy_(dim, slots, new.narrow(dim, new.shape[dim] - positions.numel(), positions.numel()))
    slot_positions.index_copy_(0, slots, positions)
    return slots


def join_convolution_context(history: torch.Tensor, inputs: torch.Tensor) -> torch.Tensor:
    """`cat([history, inputs], -1)` of [batch, C, T] convolution inputs (the caches' and the reference's context).
    A prompt's is laid out time-major ([batch, T, C] in memory): its inputs arrive as a transposed view of [batch, T,
    C] activations, which that layout copies contiguously, and the fused prompt convolution reads it so. A step's
    stays channel-major, the layout `F.conv1d` reads."""
    if inputs.shape[-1] <= MAX_STEP_TOKENS:
        return torch.cat([history, inputs], dim=-1)
    return torch.cat([history.transpose(1, 2), inputs.transpose(1, 2)], dim=1).transpose(1, 2)


class RollbackWithinMargin:
    """Taking tokens back, for both Inkling2 caches (listed before `Cache` in their bases): at most
    `rollback_margin` at a time, the tokens that sliding windows and convolutions still need beyond what they hold."""

    rollback_margin: int

    def crop(self, tokens_to_remove: int) -> None:
        """Takes back the last `-tokens_to_remove` tokens."""
        if tokens_to_remove > 0 or -tokens_to_remove > self.rollback_margin:
            raise ValueError(
                f"{type(self).__name__}.crop takes a negative count of at most {self.rollback_margin} tokens (its "
                f"rollback margin), got {tokens_to_remove}. Build the cache with a larger `rollback_margin` for "
                "longer drafts."
            )
        super().crop(tokens_to_remove)

    def shift_rows_right(self, shifts: torch.Tensor) -> None:
        """Row `b` drops its last `shifts[b]` tokens and gains as many padding slots at its start, so that every row
        keeps the same length (and physical positions). Exact while `shifts <= rollback_margin`: in sliding-window
        layers and convolutions the slots that turn to zeros are then already outside the window or kernel. The
        caller shifts its 2-D padding mask the same way."""
        if int(shifts.max()) > self.rollback_margin:
            raise ValueError(f"Rows can move at most {self.rollback_margin} places (the rollback margin).")
        for layer in self.layers:
            layer.shift_rows_right(shifts)
