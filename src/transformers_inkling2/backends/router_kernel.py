"""A decode step's router (fp32 logits, sigmoid scores, biased top-k, normalized weights) in two Triton launches.

The reference (`Inkling2TopKRouter`) runs an fp32 GEMV through cuBLAS, then `torch.topk`'s radix select and three
elementwise passes: five kernels for a read of a 7 MB weight, bound by their launches. Here the first kernel spreads
the GEMV over (expert blocks x K slices x pairs of rows) programs, each loading its whole weight tile at once, and
writes fp32 partial sums; the second, one program per row, adds the slices in a fixed order (so the logits are
deterministic, unlike atomics), then scores, picks the top k by repeated arg-max and normalizes. fp32 throughout, as
the reference: the logits differ from cuBLAS's by the order of the sum only.

Two rows a program, not all of them: a program's rows are a chain (each row's load, product and reduction after the
one before). With every row in one program and a store after each row, the router took 17.9 us at 8 rows and 384
experts and 14.3 at 96, against 6.9 and 3.7 at one row; with two rows a program 12.9 and 5.4 (one row 14.2 and 5.6,
four 13.7 and 6.1, all in one program with one store 12.9 and 8.2; an H100, `benchmarks/router.py`,
docs/dev/benchmark-history.md). Each program stores its rows' sums once, after its last load.

Imported only when a CUDA tensor takes the path (`routing.py`; triton is not a CPU dependency).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from .dependent_launch import dependent_launch
from .dependent_launch_kernel import release_successor, wait_for_predecessor

# rows of a program (a power of 2): it keeps its weight tile in registers and reuses it for each
ROWS_PER_PROGRAM = 2
BLOCK_E = 32  # experts of one program
SLICE = 256  # inputs of one program: one [BLOCK_E, SLICE] fp32 tile (32 KB), loaded at once
MAX_EXPERTS = 1024  # the top-k program holds a row of scores in registers


# fmt: off
@triton.jit
def _partial_logits_kernel(x_ptr, w_ptr, partial_ptr, rows, E, K, ROWS: tl.constexpr, BLOCK_E: tl.constexpr,
                           SLICE: tl.constexpr, PDL: tl.constexpr):
    """grid (cdiv(E, BLOCK_E), cdiv(K, SLICE), cdiv(rows, ROWS)): partial[slice, rows of the group, experts of the
    block] = x[rows, slice] @ w[experts, slice].T in fp32 (x, w contiguous, any float dtype, upcast exactly). A
    program's whole tile is one load, so that the GPU has the weight's bytes in flight at once rather than one small
    slice per program at a time; with PDL it is loaded before the wait for the step's previous kernel (no kernel of a
    step writes a weight). The sums are gathered and stored once, after the last load: a store between two loads
    keeps the next load behind it (the two may alias)."""
    experts = tl.program_id(0) * BLOCK_E + tl.arange(0, BLOCK_E)
    ks = tl.program_id(1) * SLICE + tl.arange(0, SLICE)
    first = tl.program_id(2) * ROWS
    group = first + tl.arange(0, ROWS)
    k_ok = ks < K
    tile_ok = (experts < E)[:, None] & k_ok[None, :]
    w = tl.load(w_ptr + experts[:, None] * K + ks[None, :], mask=tile_ok, other=0.0).to(tl.float32)
    wait_for_predecessor(PDL)
    sums = tl.zeros((ROWS, BLOCK_E), dtype=tl.float32)
    for i in tl.static_range(ROWS):  # masked rather than skipped: the loads of every row can issue at once
        row = first + i
        x = tl.load(x_ptr + row * K + ks, mask=k_ok & (row < rows), other=0.0).to(tl.float32)
        sums = tl.where((group == row)[:, None], tl.sum(w * x[None, :], 1)[None, :], sums)
    release_successor(PDL)
    destination = partial_ptr + tl.program_id(1) * rows * E + group[:, None] * E + experts[None, :]
    tl.store(destination, sums, mask=(group < rows)[:, None] & (experts < E)[None, :])


@triton.jit
def _top_k_kernel(partial_ptr, bias_ptr, logits_ptr, weights_ptr, chosen_ptr, rows, E, route_scale,
                  SLICES: tl.constexpr, TOP_K: tl.constexpr, BLOCK_TOP_K: tl.constexpr, BLOCK_ALL: tl.constexpr,
                  PDL: tl.constexpr):
    """grid (rows,): a row's logits from the slices' partial sums; its top-k experts by sigmoid score + bias (ties:
    the lower index), in that order, and their scores normalized to sum to route_scale."""
    wait_for_predecessor(PDL)
    row = tl.program_id(0)
    experts = tl.arange(0, BLOCK_ALL)
    ok = experts < E
    logits = tl.zeros((BLOCK_ALL,), dtype=tl.float32)
    for part in tl.static_range(SLICES):
        logits += tl.load(partial_ptr + (part * rows + row) * E + experts, mask=ok, other=0.0)
    tl.store(logits_ptr + row * E + experts, logits, mask=ok)
    bias = tl.load(bias_ptr + experts, mask=ok, other=0.0).to(tl.float32)
    candidates = tl.where(ok, 1.0 / (1.0 + tl.exp(-logits)) + bias, float("-inf"))
    # one max per pick, over 64-bit keys: the candidate's bits made order-preserving as integers above, the index's
    # complement below (so that ties go to the lower index)
    bits = candidates.to(tl.int32, bitcast=True)
    ordered = bits ^ ((bits >> 31) & 0x7FFFFFFF)
    keys = (ordered.to(tl.int64) << 32) | (BLOCK_ALL - 1 - experts).to(tl.int64)
    picks = tl.arange(0, BLOCK_TOP_K)
    pick_ok = picks < TOP_K
    chosen = tl.zeros((BLOCK_TOP_K,), dtype=tl.int64)
    for pick in tl.static_range(TOP_K):
        best = tl.max(keys, 0)
        chosen = tl.where(picks == pick, BLOCK_ALL - 1 - (best & 0xFFFFFFFF), chosen)
        keys = tl.where(keys == best, -(2**63), keys)
    # the chosen experts' logits summed again from the same partial sums in the same order: the same values, gathered
    # by a load instead of a reduction per pick
    chosen_logits = tl.zeros((BLOCK_TOP_K,), dtype=tl.float32)
    for part in tl.static_range(SLICES):
        chosen_logits += tl.load(partial_ptr + (part * rows + row) * E + chosen, mask=pick_ok, other=0.0)
    release_successor(PDL)
    picked = tl.where(pick_ok, 1.0 / (1.0 + tl.exp(-chosen_logits)), 0.0)
    weights = picked / (tl.sum(picked, 0) + 1e-20) * route_scale
    tl.store(chosen_ptr + row * TOP_K + picks, chosen, mask=pick_ok)
    tl.store(weights_ptr + row * TOP_K + picks, weights, mask=pick_ok)


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
    router weight [E, K] and score bias [E], all contiguous; at least one row, at most MAX_EXPERTS experts. A custom
    op: the compiled decode steps call it as it is."""
    rows, width = x.shape
    experts = weight.shape[0]
    if rows < 1 or not 0 < top_k <= experts <= MAX_EXPERTS:
        raise ValueError(
            f"top_k_routing takes at least one row and 1 <= top_k <= experts <= {MAX_EXPERTS}, got {rows} rows, "
            f"top_k {top_k}, {experts} experts."
        )
    logits, weights, chosen = _new_outputs(x, weight, top_k)
    slices = triton.cdiv(width, SLICE)
    pdl = dependent_launch(x)
    partial = x.new_empty(slices, rows, experts, dtype=torch.float32)
    rows_per_program = min(triton.next_power_of_2(rows), ROWS_PER_PROGRAM)
    _partial_logits_kernel[(triton.cdiv(experts, BLOCK_E), slices, triton.cdiv(rows, rows_per_program))](
        x, weight, partial, rows, experts, width, ROWS=rows_per_program, BLOCK_E=BLOCK_E, SLICE=SLICE, PDL=pdl,
        num_warps=4, launch_pdl=pdl,
    )  # fmt: skip
    # 4 warps: the fastest of 1, 2, 4 and 8 (docs/kernels.md, "A decode step's small kernels")
    _top_k_kernel[(rows,)](
        partial, bias, logits, weights, chosen, rows, experts, route_scale, SLICES=slices, TOP_K=top_k,
        BLOCK_TOP_K=triton.next_power_of_2(top_k), BLOCK_ALL=triton.next_power_of_2(experts), PDL=pdl, num_warps=4,
        launch_pdl=pdl,
    )  # fmt: skip
    return logits, weights, chosen


@top_k_routing.register_fake
def _(x, weight, bias, top_k, route_scale):
    return _new_outputs(x, weight, top_k)


__all__ = ["MAX_EXPERTS", "top_k_routing"]
