"""A decode step's router (fp32 logits, sigmoid scores, biased top-k, normalized weights) in two launches.

The reference (`Inkling2TopKRouter`) runs an fp32 GEMV through cuBLAS, then `torch.topk`'s radix select and three
elementwise passes: five kernels for a read of a 7 MB weight, bound by their launches. Here the first kernel spreads
the GEMV over (expert blocks x K slices x groups of rows) programs, each loading its whole weight tile at once, and
writes fp32 partial sums; the second, one program per row, adds the slices in a fixed order (so the logits are
deterministic, unlike atomics), then scores, picks the top k by repeated arg-max and normalizes. fp32 throughout, as
the reference: the logits differ from cuBLAS's by the order of the sum only.

The partial sums are a Gluon kernel for its layout: a thread holds 4 consecutive inputs of every 64 of a weight row,
16 lanes of a warp lie along the inputs and the other 2 and the warps along the experts, so that a row's sum over its
slice is mostly a thread's own adds and 4 shuffles. Triton lays the same tile out with all 32 lanes along the inputs;
compiled for sm_90a, its kernel took 324 shuffles and 9 barriers for two rows, this one 32 and none. A program holds
up to 8 rows (`MAX_ROWS_PER_PROGRAM`), all loaded at once, multiplied and summed together; fewer where the grid would
have fewer than `MIN_PROGRAMS` programs. Both launches on an H100 (docs/dev/benchmark-history.md, "The router's
partial sums in Gluon"; the Triton kernel timed in a sweep, this one in `benchmarks/router.py` on another H100 of the
same kind): 384 experts, 8 rows 13.0 -> 8.1 us, 64 rows 51.6 -> 23.5, one row 6.5 -> 6.1; 96 experts, 8 rows 5.2 ->
3.7 (programs of 4 rows), one row 3.5 -> 3.1.

Imported only when a CUDA tensor takes the path (`routing.py`; triton is not a CPU dependency). Gluon has no
interpreter: the CPU tests run the top-k kernel under Triton's, the partial sums run on GPUs only.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from triton.experimental import gluon
from triton.experimental.gluon import language as gl

from .dependent_launch import dependent_launch
from .dependent_launch_kernel import release_successor, wait_for_predecessor

# rows of a program's group (a power of 2; its weight tile is loaded once for them): the most the grid leaves at least
# MIN_PROGRAMS programs (at 96 experts and 8 rows, 108 programs of 4 rows took 3.7 us, 54 of 8 4.1; an H100)
MAX_ROWS_PER_PROGRAM = 8
MIN_PROGRAMS = 64
BLOCK_E = 32  # experts of one program
SLICE = 256  # inputs of one program: one [BLOCK_E, SLICE] fp32 tile (32 KB), loaded at once
MAX_EXPERTS = 1024  # the top-k program holds a row of scores in registers
WARPS = gl.constexpr(4)
LANES_ALONG_INPUTS = gl.constexpr(16)  # of a warp's 32; 4 inputs a thread, the other lanes along the experts


# fmt: off
@gluon.jit
def _partial_logits_kernel(x_ptr, w_ptr, partial_ptr, rows, E, K, ROWS: gl.constexpr, BLOCK_E: gl.constexpr,
                           SLICE: gl.constexpr, PDL: gl.constexpr):
    """grid (cdiv(E, BLOCK_E), cdiv(K, SLICE), cdiv(rows, ROWS)): partial[slice, rows of the group, experts of the
    block] = x[rows, slice] @ w[experts, slice].T in fp32 (x, w contiguous, any float dtype, upcast exactly). A
    program's whole tile is one load, so that the GPU has the weight's bytes in flight at once rather than one small
    slice per program at a time; with PDL it is loaded before the wait for the step's previous kernel (no kernel of a
    step writes a weight). Every row of the group is loaded at once, then multiplied and summed: [rows, experts,
    inputs] in one layout (the module docstring), each thread all of the group's rows."""
    layout: gl.constexpr = gl.BlockedLayout([ROWS, 1, 4], [1, 32 // LANES_ALONG_INPUTS, LANES_ALONG_INPUTS],
                                            [1, WARPS, 1], [2, 1, 0])
    tile: gl.constexpr = gl.SliceLayout(0, layout)  # [experts, inputs]
    group: gl.constexpr = gl.SliceLayout(1, layout)  # [rows, inputs]
    sums: gl.constexpr = gl.SliceLayout(2, layout)  # [rows, experts]
    first_expert = gl.program_id(0) * BLOCK_E
    first_input = gl.program_id(1) * SLICE
    first_row = gl.program_id(2) * ROWS
    experts = first_expert + gl.arange(0, BLOCK_E, layout=gl.SliceLayout(1, tile))
    ks = first_input + gl.arange(0, SLICE, layout=gl.SliceLayout(0, tile))
    tile_ok = gl.expand_dims(experts < E, 1) & gl.expand_dims(ks < K, 0)
    w = gl.load(w_ptr + gl.expand_dims(experts, 1) * K + gl.expand_dims(ks, 0), mask=tile_ok, other=0.0)
    wait_for_predecessor(PDL)
    x_rows = first_row + gl.arange(0, ROWS, layout=gl.SliceLayout(1, group))
    x_ks = first_input + gl.arange(0, SLICE, layout=gl.SliceLayout(0, group))
    x_ok = gl.expand_dims(x_rows < rows, 1) & gl.expand_dims(x_ks < K, 0)
    x = gl.load(x_ptr + gl.expand_dims(x_rows, 1) * K + gl.expand_dims(x_ks, 0), mask=x_ok, other=0.0)
    release_successor(PDL)
    partial = gl.sum(gl.expand_dims(w.to(gl.float32), 0) * gl.expand_dims(x.to(gl.float32), 1), 2)
    out_rows = first_row + gl.arange(0, ROWS, layout=gl.SliceLayout(1, sums))
    out_experts = first_expert + gl.arange(0, BLOCK_E, layout=gl.SliceLayout(0, sums))
    destination = (partial_ptr + (gl.program_id(1) * rows + gl.expand_dims(out_rows, 1)) * E
                   + gl.expand_dims(out_experts, 0))
    gl.store(destination, partial, mask=gl.expand_dims(out_rows < rows, 1) & gl.expand_dims(out_experts < E, 0))


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
def partial_logits(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """fp32 partial sums [K slices, rows, E] of x [rows, K] @ weight [E, K].T, both contiguous (on a GPU: Gluon)."""
    (rows, width), experts = x.shape, weight.shape[0]
    slices = triton.cdiv(width, SLICE)
    partial = x.new_empty(slices, rows, experts, dtype=torch.float32)
    blocks = triton.cdiv(experts, BLOCK_E)
    per_program = min(triton.next_power_of_2(rows), MAX_ROWS_PER_PROGRAM)
    while per_program > 1 and blocks * slices * triton.cdiv(rows, per_program) < MIN_PROGRAMS:
        per_program //= 2
    pdl = dependent_launch(x)
    _partial_logits_kernel[(blocks, slices, triton.cdiv(rows, per_program))](
        x, weight, partial, rows, experts, width, ROWS=per_program, BLOCK_E=BLOCK_E, SLICE=SLICE, PDL=pdl,
        num_warps=WARPS.value, launch_pdl=pdl,
    )  # fmt: skip
    return partial


def _routing_outputs(like: torch.Tensor, rows: int, experts: int, top_k: int):
    """Empty (logits [rows, E] fp32, weights [rows, top_k] fp32, chosen experts [rows, top_k] int64) beside like."""
    return (like.new_empty(rows, experts, dtype=torch.float32), like.new_empty(rows, top_k, dtype=torch.float32),
            like.new_empty(rows, top_k, dtype=torch.int64))  # fmt: skip


def top_k_of_partial_sums(partial: torch.Tensor, bias: torch.Tensor, top_k: int, route_scale: float):
    """(logits, weights, chosen experts) of the partial sums [slices, rows, E] that `partial_logits` writes: their
    sums, and the top k of each row by score + bias, `_top_k_kernel`."""
    slices, rows, experts = partial.shape
    logits, weights, chosen = _routing_outputs(partial, rows, experts, top_k)
    pdl = dependent_launch(partial)
    # 4 warps: the fastest of 1, 2, 4 and 8 (docs/kernels.md, "A decode step's small kernels")
    _top_k_kernel[(rows,)](
        partial, bias, logits, weights, chosen, rows, experts, route_scale, SLICES=slices, TOP_K=top_k,
        BLOCK_TOP_K=triton.next_power_of_2(top_k), BLOCK_ALL=triton.next_power_of_2(experts), PDL=pdl, num_warps=4,
        launch_pdl=pdl,
    )  # fmt: skip
    return logits, weights, chosen


@torch.library.custom_op("inkling2::top_k_routing", mutates_args=())
def top_k_routing(
    x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor, top_k: int, route_scale: float
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(logits [rows, E] fp32, weights [rows, top_k] fp32, chosen experts [rows, top_k] int64) of x [rows, K] under
    router weight [E, K] and score bias [E], all contiguous, on a GPU; at least one row, at most MAX_EXPERTS experts.
    A custom op: the compiled decode steps call it as it is."""
    rows, experts = x.shape[0], weight.shape[0]
    if rows < 1 or not 0 < top_k <= experts <= MAX_EXPERTS:
        raise ValueError(
            f"top_k_routing takes at least one row and 1 <= top_k <= experts <= {MAX_EXPERTS}, got {rows} rows, "
            f"top_k {top_k}, {experts} experts."
        )
    return top_k_of_partial_sums(partial_logits(x, weight), bias, top_k, route_scale)


@top_k_routing.register_fake
def _(x, weight, bias, top_k, route_scale):
    return _routing_outputs(x, x.shape[0], weight.shape[0], top_k)


__all__ = ["MAX_EXPERTS", "partial_logits", "top_k_of_partial_sums", "top_k_routing"]
