"""A decode step's router (fp32 logits, sigmoid scores, biased top-k, normalized weights) in two Triton launches, or
in one.

The reference (`Inkling2TopKRouter`) runs an fp32 GEMV through cuBLAS, then `torch.topk`'s radix select and three
elementwise passes: five kernels for a read of a 7 MB weight, bound by their launches. Here the first kernel spreads
the GEMV over (expert blocks x K slices) programs, each loading its whole weight tile at once, and writes fp32
partial sums; the second, one program per row, adds the slices in a fixed order (so the logits are deterministic, unlike
atomics), then scores, picks the top k by repeated arg-max and normalizes. fp32 throughout, as the reference: the
logits differ from cuBLAS's by the order of the sum only.

With `INKLING2_ROUTER_ONE_LAUNCH=1` one launch does both (`_one_launch_kernel`): each program of the partial sums takes
a ticket from a counter after its stores, and the program that takes the last one runs the top-k of every row on the
same partial sums in the same order, so the results are bitwise those of the two launches. Off by default until it has
been measured on a GPU.

Imported only when a CUDA tensor takes the path (`routing.py`; triton is not a CPU dependency).
"""

from __future__ import annotations

import os

import torch
import triton
import triton.language as tl

from .dependent_launch import dependent_launch
from .dependent_launch_kernel import release_successor, wait_for_predecessor

MAX_ROWS = 16  # rows of a step; each program keeps its weight tile in registers and reuses it for every row
BLOCK_E = 32  # experts of one program
SLICE = 256  # inputs of one program: one [BLOCK_E, SLICE] fp32 tile (32 KB), loaded at once
MAX_EXPERTS = 1024  # the top-k program holds a row of scores in registers
# the one-launch kernel's last program: rows whose top k it picks together, as one [rows, BLOCK_ALL] tile of at most
# GROUP_SCORES scores (4 rows of up to 512 experts, 2 of 1024), and slices whose partial sums it loads at once for
# them; larger tiles, or all 18 slices of a full-width layer at once, spilled registers in the loop over the groups
# (sm_90a or sm_100a, tests/backends/test_kernel_targets.py)
ROW_GROUP = 4
GROUP_SCORES = 2048
SLICES_AT_ONCE = 4
ONE_LAUNCH_ENV = "INKLING2_ROUTER_ONE_LAUNCH"

# per device, the one-launch kernel's counter of the programs done with their partial sums (int32 [1], 0 between
# launches: the last program resets it)
_TICKETS: dict[torch.device, torch.Tensor] = {}


def one_launch() -> bool:
    """Whether the router runs in one launch (`INKLING2_ROUTER_ONE_LAUNCH=1`; off by default until measured)."""
    return os.environ.get(ONE_LAUNCH_ENV, "0") == "1"


def _tickets(device: torch.device) -> torch.Tensor:
    """The device's ticket counter, made on first use. One per device, not per stream: the one-launch kernels of a
    device must not overlap in time, which holds since a decode step runs on one stream. Made while a CUDA graph is
    captured, its zeroing is captured too and replayed: still correct, as every launch ends at 0 anyway."""
    if device not in _TICKETS:
        _TICKETS[device] = torch.zeros(1, dtype=torch.int32, device=device)
    return _TICKETS[device]


# fmt: off
@triton.jit
def _partial_logits(x_ptr, w_ptr, partial_ptr, rows, E, K, ROWS: tl.constexpr, BLOCK_E: tl.constexpr,
                    SLICE: tl.constexpr, PDL: tl.constexpr):
    """partial[slice, :rows, experts of the block] = x[:, slice] @ w[experts, slice].T in fp32 for the program
    (expert block, K slice) (x, w contiguous, any float dtype, upcast exactly). A program's whole tile is one load, so
    that the GPU has the weight's bytes in flight at once rather than one small slice per program at a time; with PDL
    it is loaded before the wait for the step's previous kernel (no kernel of a step writes a weight)."""
    experts = tl.program_id(0) * BLOCK_E + tl.arange(0, BLOCK_E)
    ks = tl.program_id(1) * SLICE + tl.arange(0, SLICE)
    k_ok = ks < K
    tile_ok = (experts < E)[:, None] & k_ok[None, :]
    w = tl.load(w_ptr + experts[:, None] * K + ks[None, :], mask=tile_ok, other=0.0).to(tl.float32)
    wait_for_predecessor(PDL)
    destination = partial_ptr + tl.program_id(1) * rows * E + experts
    for row in tl.static_range(ROWS):  # masked rather than skipped: the loads of every row can issue at once
        x = tl.load(x_ptr + row * K + ks, mask=k_ok & (row < rows), other=0.0).to(tl.float32)
        tl.store(destination + row * E, tl.sum(w * x[None, :], 1), mask=(experts < E) & (row < rows))


@triton.jit
def _top_k_rows(partial_ptr, bias_ptr, logits_ptr, weights_ptr, chosen_ptr, first_row, rows, E, route_scale,
                SLICES: tl.constexpr, TOP_K: tl.constexpr, BLOCK_TOP_K: tl.constexpr, BLOCK_ALL: tl.constexpr,
                GROUP: tl.constexpr, SLICES_AT_ONCE: tl.constexpr, CACHE: tl.constexpr):
    """Rows first_row .. first_row + GROUP - 1 (those below rows) as one [GROUP, BLOCK_ALL] tile, so that a pick is
    one pass for the group: their logits from the slices' partial sums (SLICES_AT_ONCE loaded at a time, with cache
    modifier CACHE); their top-k experts by sigmoid score + bias (ties: the lower index), in that order, and their
    scores normalized to sum to route_scale."""
    row = first_row + tl.arange(0, GROUP)[:, None]
    row_ok = row < rows
    experts = tl.arange(0, BLOCK_ALL)[None, :]
    ok = row_ok & (experts < E)
    logits = tl.zeros((GROUP, BLOCK_ALL), dtype=tl.float32)
    # in slice order however many at a time; a masked slice past the last adds +0.0 to a sum that started at +0.0 (so
    # is never -0.0): the same bits
    for first_part in range(0, SLICES, SLICES_AT_ONCE):
        for next_part in tl.static_range(SLICES_AT_ONCE):
            part = first_part + next_part
            logits += tl.load(partial_ptr + (part * rows + row) * E + experts, mask=ok & (part < SLICES), other=0.0,
                              cache_modifier=CACHE)
    tl.store(logits_ptr + row * E + experts, logits, mask=ok)
    bias = tl.load(bias_ptr + experts, mask=experts < E, other=0.0).to(tl.float32)
    candidates = tl.where(ok, 1.0 / (1.0 + tl.exp(-logits)) + bias, float("-inf"))
    # one max per pick, over 64-bit keys: the candidate's bits made order-preserving as integers above, the index's
    # complement below (so that ties go to the lower index)
    bits = candidates.to(tl.int32, bitcast=True)
    ordered = bits ^ ((bits >> 31) & 0x7FFFFFFF)
    keys = (ordered.to(tl.int64) << 32) | (BLOCK_ALL - 1 - experts).to(tl.int64)
    picks = tl.arange(0, BLOCK_TOP_K)[None, :]
    pick_ok = row_ok & (picks < TOP_K)
    chosen = tl.zeros((GROUP, BLOCK_TOP_K), dtype=tl.int64)
    for pick in tl.static_range(TOP_K):
        best = tl.max(keys, 1)[:, None]
        chosen = tl.where(picks == pick, BLOCK_ALL - 1 - (best & 0xFFFFFFFF), chosen)
        keys = tl.where(keys == best, -(2**63), keys)
    # the chosen experts' logits summed again from the same partial sums in the same order: the same values, gathered
    # by a load instead of a reduction per pick
    chosen_logits = tl.zeros((GROUP, BLOCK_TOP_K), dtype=tl.float32)
    for part in tl.static_range(SLICES):
        chosen_logits += tl.load(partial_ptr + (part * rows + row) * E + chosen, mask=pick_ok, other=0.0,
                                 cache_modifier=CACHE)
    picked = tl.where(pick_ok, 1.0 / (1.0 + tl.exp(-chosen_logits)), 0.0)
    weights = picked / (tl.sum(picked, 1)[:, None] + 1e-20) * route_scale
    tl.store(chosen_ptr + row * TOP_K + picks, chosen, mask=pick_ok)
    tl.store(weights_ptr + row * TOP_K + picks, weights, mask=pick_ok)


@triton.jit
def _partial_logits_kernel(x_ptr, w_ptr, partial_ptr, rows, E, K, ROWS: tl.constexpr, BLOCK_E: tl.constexpr,
                           SLICE: tl.constexpr, PDL: tl.constexpr):
    """grid (cdiv(E, BLOCK_E), cdiv(K, SLICE)): the slices' partial sums (`_partial_logits`)."""
    _partial_logits(x_ptr, w_ptr, partial_ptr, rows, E, K, ROWS, BLOCK_E, SLICE, PDL)
    release_successor(PDL)


@triton.jit
def _top_k_kernel(partial_ptr, bias_ptr, logits_ptr, weights_ptr, chosen_ptr, rows, E, route_scale,
                  SLICES: tl.constexpr, TOP_K: tl.constexpr, BLOCK_TOP_K: tl.constexpr, BLOCK_ALL: tl.constexpr,
                  PDL: tl.constexpr):
    """grid (rows,): a row's logits, top-k experts and weights (`_top_k_rows`)."""
    wait_for_predecessor(PDL)
    _top_k_rows(partial_ptr, bias_ptr, logits_ptr, weights_ptr, chosen_ptr, tl.program_id(0), rows, E, route_scale,
                SLICES, TOP_K, BLOCK_TOP_K, BLOCK_ALL, 1, SLICES, "")
    release_successor(PDL)


@triton.jit
def _one_launch_kernel(x_ptr, w_ptr, partial_ptr, bias_ptr, logits_ptr, weights_ptr, chosen_ptr, tickets_ptr, rows,
                       E, K, route_scale, ROWS: tl.constexpr, BLOCK_E: tl.constexpr, SLICE: tl.constexpr,
                       SLICES: tl.constexpr, TOP_K: tl.constexpr, BLOCK_TOP_K: tl.constexpr, BLOCK_ALL: tl.constexpr,
                       ROW_GROUP: tl.constexpr, SLICES_AT_ONCE: tl.constexpr, PDL: tl.constexpr):
    """grid (cdiv(E, BLOCK_E), cdiv(K, SLICE)): both kernels above in one launch. Each program stores its partial
    sums, then takes a ticket (an acquire-release atomic at GPU scope, after a barrier so that every thread's stores
    come before it); the program with the last ticket sees every program's sums, and alone runs the top-k of all rows,
    ROW_GROUP at a time, reading the sums past L1 (which other SMs' writes do not update). It resets the counter for
    the next launch (a CUDA graph's replay included). No program waits for another, so the grid needs no co-resident
    programs."""
    _partial_logits(x_ptr, w_ptr, partial_ptr, rows, E, K, ROWS, BLOCK_E, SLICE, PDL)
    tl.debug_barrier()
    ticket = tl.atomic_add(tickets_ptr, 1, sem="acq_rel", scope="gpu")
    if ticket == tl.num_programs(0) * tl.num_programs(1) - 1:
        for first_row in range(0, rows, ROW_GROUP):
            _top_k_rows(partial_ptr, bias_ptr, logits_ptr, weights_ptr, chosen_ptr, first_row, rows, E, route_scale,
                        SLICES, TOP_K, BLOCK_TOP_K, BLOCK_ALL, ROW_GROUP, SLICES_AT_ONCE, ".cg")
        tl.atomic_xchg(tickets_ptr, 0)
    release_successor(PDL)


# fmt: on
def _new_outputs(x: torch.Tensor, weight: torch.Tensor, top_k: int):
    rows, experts = x.shape[0], weight.shape[0]
    return (
        x.new_empty(rows, experts, dtype=torch.float32),
        x.new_empty(rows, top_k, dtype=torch.float32),
        x.new_empty(rows, top_k, dtype=torch.int64),
    )


@torch.library.custom_op("inkling2::top_k_routing", mutates_args=())
def top_k_routing(
    x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor, top_k: int, route_scale: float
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(logits [rows, E] fp32, weights [rows, top_k] fp32, chosen experts [rows, top_k] int64) of x [rows, K] under
    router weight [E, K] and score bias [E], all contiguous; at most MAX_ROWS rows and MAX_EXPERTS experts. A custom
    op: the compiled decode steps call it as it is, and it reads `INKLING2_ROUTER_ONE_LAUNCH` when called (captured
    into a CUDA graph: when captured)."""
    rows, width = x.shape
    experts = weight.shape[0]
    if not 0 < rows <= MAX_ROWS or not 0 < top_k <= experts <= MAX_EXPERTS:
        raise ValueError(
            f"top_k_routing takes 1 to {MAX_ROWS} rows and 1 <= top_k <= experts <= {MAX_EXPERTS}, got {rows} rows, "
            f"top_k {top_k}, {experts} experts."
        )
    logits, weights, chosen = _new_outputs(x, weight, top_k)
    slices = triton.cdiv(width, SLICE)
    pdl = dependent_launch(x)
    partial = x.new_empty(slices, rows, experts, dtype=torch.float32)
    grid = (triton.cdiv(experts, BLOCK_E), slices)
    sizes = dict(ROWS=triton.next_power_of_2(rows), BLOCK_E=BLOCK_E, SLICE=SLICE)
    block_all = triton.next_power_of_2(experts)
    top_k_sizes = dict(SLICES=slices, TOP_K=top_k, BLOCK_TOP_K=triton.next_power_of_2(top_k), BLOCK_ALL=block_all)
    # 4 warps: the fastest of 1, 2, 4 and 8 for the top-k (docs/kernels.md, "A decode step's small kernels")
    launch = dict(PDL=pdl, num_warps=4, launch_pdl=pdl)
    if one_launch():
        group = min(triton.next_power_of_2(rows), ROW_GROUP, GROUP_SCORES // block_all)
        at_once = slices if group == 1 else min(slices, SLICES_AT_ONCE)  # one row: all at once, as `_top_k_kernel`
        _one_launch_kernel[grid](
            x, weight, partial, bias, logits, weights, chosen, _tickets(x.device), rows, experts, width, route_scale,
            **sizes, **top_k_sizes, ROW_GROUP=group, SLICES_AT_ONCE=at_once, **launch,
        )  # fmt: skip
    else:
        _partial_logits_kernel[grid](x, weight, partial, rows, experts, width, **sizes, **launch)
        _top_k_kernel[(rows,)](partial, bias, logits, weights, chosen, rows, experts, route_scale, **top_k_sizes,
                               **launch)  # fmt: skip
    return logits, weights, chosen


@top_k_routing.register_fake
def _(x, weight, bias, top_k, route_scale):
    return _new_outputs(x, weight, top_k)


__all__ = ["MAX_EXPERTS", "MAX_ROWS", "ONE_LAUNCH_ENV", "one_launch", "top_k_routing"]
