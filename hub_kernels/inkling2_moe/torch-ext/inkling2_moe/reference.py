"""Pure-PyTorch references: the CPU path of every op and the oracle the Triton kernels are tested against.

Nothing here knows about any model. The numerics define what the fast path must compute:

* routing: slots ``s = t * top_k + j`` sorted by expert, stable in slot order; ids outside
  ``[0, num_experts)`` are *dropped* (they sort last and contribute nothing), which is what expert
  parallelism needs when a rank holds only some experts;
* weights are dequantized to bf16 (``e2m1 * e4m3 * outer`` or ``e4m3 * 2**(b - 127)`` computed in fp32, one
  rounding), every matmul accumulates in fp32, the softcapped SwiGLU runs in fp32 and is rounded to bf16
  before the down projection, each slot's output is scaled by its routing weight in fp32 and the ``top_k``
  slots of a token are summed in fp32 in slot order, then rounded to bf16.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

__all__ = [
    "FORMATS",
    "Routing",
    "dequantize_reference",
    "max_tiles",
    "moe_forward_reference",
    "route_reference",
    "softcapped_swiglu_reference",
]

FORMATS = ("bf16", "mxfp8", "nvfp4")
MXFP8_BLOCK = 32
NVFP4_BLOCK = 16

# E2M1 magnitudes of codes 0-7 (sign is bit 3): exponent 0 is subnormal (0, 0.5), then (1 + m/2) * 2**(e-1).
_E2M1_MAGNITUDES = [0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0]


@dataclass
class Routing:
    """Slots grouped by expert, plus the M-tiles a grouped GEMM walks over.

    All tensors are int32 and their sizes depend only on ``num_slots = T * top_k``, ``num_experts`` and
    ``block_m`` (never on the data), so computing and using a routing needs no host synchronization and can
    be captured in a CUDA graph.

    * ``sorted_slots[p]``: the slot at sorted position ``p`` (slots of expert 0 first, in slot order; dropped
      slots last).
    * ``slot_position[s]``: inverse permutation.
    * ``expert_offsets[e]`` for ``e`` in ``0..num_experts``: first sorted position of expert ``e``;
      ``expert_offsets[num_experts]`` is the number of routed (non-dropped) slots.
    * ``tile_expert[i]``: expert of M-tile ``i`` or -1 past the last tile; tiles are in expert order, each
      covers ``block_m`` sorted positions starting at ``tile_start[i]`` (clipped to its expert's end).
      ``len(tile_expert) == max_tiles(num_slots, num_experts, block_m)``.
    """

    sorted_slots: torch.Tensor
    slot_position: torch.Tensor
    expert_offsets: torch.Tensor
    tile_expert: torch.Tensor
    tile_start: torch.Tensor
    num_experts: int
    top_k: int
    block_m: int


def max_tiles(num_slots: int, num_experts: int, block_m: int) -> int:
    """Upper bound on M-tiles: every full block plus one partial tile per expert that can be active."""
    return -(-num_slots // block_m) + min(num_experts, num_slots)


def _check_ids(expert_ids: torch.Tensor) -> None:
    if expert_ids.dim() != 2:
        raise ValueError(f"expert_ids must be [T, top_k], got shape {tuple(expert_ids.shape)}")
    if expert_ids.dtype not in (torch.int32, torch.int64, torch.int16, torch.uint8):
        raise ValueError(f"expert_ids must be an integer tensor, got {expert_ids.dtype}")


def route_reference(expert_ids: torch.Tensor, num_experts: int, block_m: int = 16) -> Routing:
    """Reference routing (see :class:`Routing`); runs anywhere, uses data-dependent torch ops."""
    _check_ids(expert_ids)
    top_k = expert_ids.shape[1]
    ids = expert_ids.reshape(-1).long()
    s = ids.numel()
    dev = ids.device
    key = torch.where((ids >= 0) & (ids < num_experts), ids, torch.full_like(ids, num_experts))
    order = torch.sort(key, stable=True).indices
    position = torch.empty_like(order)
    position[order] = torch.arange(s, device=dev)
    counts = torch.bincount(key, minlength=num_experts + 1)[: num_experts + 1]
    offsets = torch.zeros(num_experts + 1, dtype=torch.long, device=dev)
    offsets[1:] = torch.cumsum(counts[:num_experts], 0)

    n_tiles = max_tiles(s, num_experts, block_m)
    tiles = (counts[:num_experts] + block_m - 1) // block_m
    tile_expert = torch.full((n_tiles,), -1, dtype=torch.long, device=dev)
    tile_start = torch.zeros(n_tiles, dtype=torch.long, device=dev)
    experts = torch.repeat_interleave(torch.arange(num_experts, device=dev), tiles)
    first_tile = torch.cumsum(tiles, 0) - tiles
    within = torch.arange(experts.numel(), device=dev) - first_tile[experts]
    tile_expert[: experts.numel()] = experts
    tile_start[: experts.numel()] = offsets[experts] + within * block_m

    i32 = torch.int32
    return Routing(
        sorted_slots=order.to(i32),
        slot_position=position.to(i32),
        expert_offsets=offsets.to(i32),
        tile_expert=tile_expert.to(i32),
        tile_start=tile_start.to(i32),
        num_experts=num_experts,
        top_k=top_k,
        block_m=block_m,
    )


def _outer_rows(outer: torch.Tensor | None, num_experts: int, rows: int, halves: int) -> torch.Tensor:
    """Outer multiplier as fp32 ``[E, rows, 1]``; ``outer`` is ``[E]``, ``[E, 1]`` or (``halves == 2``)
    ``[E, 2]`` = (first half of the rows, second half)."""
    if outer is None:
        raise ValueError("nvfp4 needs its fp32 outer multiplier per expert ([E], [E, 1] or [E, 2]).")
    o = outer.float().reshape(num_experts, -1)
    if o.shape[1] == 1:
        return o[:, :1, None].expand(num_experts, rows, 1)
    if o.shape[1] == 2 and halves == 2 and rows % 2 == 0:
        return o.repeat_interleave(rows // 2, dim=1)[:, :, None]
    raise ValueError(f"outer multiplier of shape {tuple(outer.shape)} does not fit {num_experts} experts")


def dequantize_reference(
    fmt: str,
    weight: torch.Tensor,
    scale: torch.Tensor | None = None,
    outer: torch.Tensor | None = None,
    *,
    halves: int = 1,
    dtype: torch.dtype = torch.bfloat16,
) -> torch.Tensor:
    """Stacked expert weights ``[E, N, K_storage]`` -> ``dtype`` ``[E, N, K]``.

    * ``bf16``: ``weight`` as is.
    * ``mxfp8``: float8_e4m3fn (or its uint8 bytes) ``[E, N, K]`` and uint8 E8M0 ``[E, N, K/32]``.
    * ``nvfp4``: uint8 ``[E, N, K/2]`` (low nibble = even input), float8_e4m3fn ``[E, N, K/16]`` block
      scales and the fp32 outer multiplier (``halves=2`` lets ``[E, 2]`` scale the two row halves of a fused
      gate/up weight separately).
    """
    if fmt == "bf16":
        return weight.to(dtype)
    e, n = weight.shape[0], weight.shape[1]
    if fmt == "mxfp8":
        codes = weight.view(torch.float8_e4m3fn) if weight.dtype == torch.uint8 else weight
        values = codes.float()
        k = values.shape[-1]
        exps = torch.exp2(scale.view(torch.uint8).float() - 127.0)
        return (values.unflatten(-1, (k // MXFP8_BLOCK, MXFP8_BLOCK)) * exps[..., None]).flatten(-2).to(dtype)
    if fmt == "nvfp4":
        packed = weight.view(torch.uint8)
        table = torch.tensor(_E2M1_MAGNITUDES + [-v for v in _E2M1_MAGNITUDES], device=packed.device)
        lo = table[(packed & 0xF).long()]
        hi = table[(packed >> 4).long()]
        values = torch.stack([lo, hi], dim=-1).flatten(-2)  # [E, N, K], even inputs from the low nibble
        k = values.shape[-1]
        block = scale.view(torch.float8_e4m3fn).float() if scale.dtype == torch.uint8 else scale.float()
        values = (values.unflatten(-1, (k // NVFP4_BLOCK, NVFP4_BLOCK)) * block[..., None]).flatten(-2)
        return (values * _outer_rows(outer, e, n, halves).to(values.device)).to(dtype)
    raise ValueError(f"unknown format {fmt!r}; expected one of {FORMATS}")


def softcapped_swiglu_reference(
    gate: torch.Tensor, up: torch.Tensor, gate_cap: float = 4.0, up_cap: float = 25.0
) -> torch.Tensor:
    """``cap_g*tanh(g/cap_g) * sigmoid(g) * cap_u*tanh(u/cap_u)`` in fp32 (the sigmoid sees the raw gate)."""
    g, u = gate.float(), up.float()
    return gate_cap * torch.tanh(g / gate_cap) * torch.sigmoid(g) * (up_cap * torch.tanh(u / up_cap))


def moe_forward_reference(
    x: torch.Tensor,
    expert_ids: torch.Tensor,
    routing_weights: torch.Tensor,
    w13: torch.Tensor,
    w2: torch.Tensor,
    fmt: str = "bf16",
    *,
    w13_scale: torch.Tensor | None = None,
    w2_scale: torch.Tensor | None = None,
    w13_outer: torch.Tensor | None = None,
    w2_outer: torch.Tensor | None = None,
    gate_cap: float = 4.0,
    up_cap: float = 25.0,
    combine: bool = True,
) -> torch.Tensor:
    """Routed experts on ``x [T, H]``: ``sum_j w[t, j] * down_e(act(gate_up_e(x_t)))`` for ``e = ids[t, j]``.

    ``w13`` holds the gate rows then the up rows (``[E, 2I, H]`` in its storage format), ``w2`` is
    ``[E, H, I]``. Returns bf16 ``[T, H]``; see the module docstring for the exact numerics. ``combine=False``
    returns the terms of that sum instead, each slot's weighted output: fp32 ``[1, T, top_k, H]`` (one part, as
    `moe_forward`'s), zero for dropped slots.
    """
    _check_ids(expert_ids)
    if fmt not in FORMATS:
        raise ValueError(f"unknown format {fmt!r}; expected one of {FORMATS}")
    t, h = x.shape
    top_k = expert_ids.shape[1]
    num_experts = w13.shape[0]
    ids = expert_ids.reshape(-1).long()
    weights = routing_weights.reshape(-1).float()
    y = torch.zeros(t * top_k, h, dtype=torch.float32, device=x.device)
    valid = (ids >= 0) & (ids < num_experts)
    for e in torch.unique(ids[valid]).tolist():
        slots = torch.nonzero(ids == e).squeeze(1)
        x_e = x[slots // top_k].float()
        g_u = dequantize_reference(
            fmt, w13[e : e + 1], None if w13_scale is None else w13_scale[e : e + 1],
            None if w13_outer is None else w13_outer[e : e + 1], halves=2,
        )[0].float()
        down = dequantize_reference(
            fmt, w2[e : e + 1], None if w2_scale is None else w2_scale[e : e + 1],
            None if w2_outer is None else w2_outer[e : e + 1],
        )[0].float()
        inter = g_u.shape[0] // 2
        hidden = x_e @ g_u.T
        act = softcapped_swiglu_reference(hidden[:, :inter], hidden[:, inter:], gate_cap, up_cap)
        y[slots] = (act.to(torch.bfloat16).float() @ down.T) * weights[slots, None]
    per_slot = y.view(t, top_k, h)
    if not combine:
        return per_slot[None]
    out = torch.zeros(t, h, dtype=torch.float32, device=x.device)
    for j in range(top_k):  # fixed order: bitwise reproducible
        out = out + per_slot[:, j]
    return out.to(torch.bfloat16)
