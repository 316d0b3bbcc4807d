"""A decode step's router (fp32 logits, sigmoid scores, biased top-k, normalized weights) in two Triton launches.

The reference (`Inkling2TopKRouter`) runs an fp32 GEMV through cuBLAS, then `torch.topk`'s radix select and three
elementwise passes: five kernels for a read of a 7 MB weight, bound by their launches. Here the first kernel spreads
the GEMV over (expert blocks x K slices) programs, enough to stream the weight at bandwidth, and writes fp32 partial
sums; the second, one program per row, adds the slices in a fixed order (so the logits are deterministic, unlike
atomics), then scores, picks the top k by repeated arg-max and normalizes. fp32 throughout, as the reference: the
logits differ from cuBLAS's by the order of the sum only.

Imported only when a CUDA tensor takes the path (`routing.py`; triton is not a CPU dependency).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

BLOCK_M = 64  # rows of one program; at most this many rows take the kernels
BLOCK_E = 16  # experts of one program
BLOCK_K = 64
K_SLICES = 8  # 384 experts: 24 x 8 = 192 programs, about 37 KB of fp32 weight each
MAX_EXPERTS = 1024  # the top-k program holds a row of scores in registers


# fmt: off
@triton.jit
def _partial_logits_kernel(x_ptr, w_ptr, partial_ptr, rows, E, K, slice_width, BLOCK_M: tl.constexpr,
                           BLOCK_E: tl.constexpr, BLOCK_K: tl.constexpr):
    """grid (cdiv(E, BLOCK_E), K_SLICES): partial[slice, :rows, experts of the block] = x[:, slice] @ w[experts,
    slice].T in fp32 (x, w contiguous, any float dtype, upcast exactly)."""
    experts = tl.program_id(0) * BLOCK_E + tl.arange(0, BLOCK_E)
    ms, ks = tl.arange(0, BLOCK_M), tl.arange(0, BLOCK_K)
    expert_ok, row_ok = experts < E, ms < rows
    begin = tl.program_id(1) * slice_width
    end = tl.minimum(begin + slice_width, K)
    acc = tl.zeros((BLOCK_M, BLOCK_E), dtype=tl.float32)
    for start in range(begin, end, BLOCK_K):
        k_ok = (start + ks < end)[None, :]
        w = tl.load(w_ptr + experts[:, None] * K + start + ks[None, :], mask=expert_ok[:, None] & k_ok, other=0.0)
        x = tl.load(x_ptr + ms[:, None] * K + start + ks[None, :], mask=row_ok[:, None] & k_ok, other=0.0)
        acc += tl.dot(x.to(tl.float32), tl.trans(w.to(tl.float32)), input_precision="ieee")
    destination = partial_ptr + (tl.program_id(1) * rows + ms[:, None]) * E + experts[None, :]
    tl.store(destination, acc, mask=row_ok[:, None] & expert_ok[None, :])


@triton.jit
def _top_k_kernel(partial_ptr, bias_ptr, logits_ptr, weights_ptr, chosen_ptr, rows, E, route_scale,
                  SLICES: tl.constexpr, TOP_K: tl.constexpr, BLOCK_TOP_K: tl.constexpr, BLOCK_ALL: tl.constexpr):
    """grid (rows,): a row's logits from the slices' partial sums; its top-k experts by sigmoid score + bias (ties:
    the lower index), in that order, and their scores normalized to sum to route_scale."""
    row = tl.program_id(0)
    experts = tl.arange(0, BLOCK_ALL)
    ok = experts < E
    logits = tl.zeros((BLOCK_ALL,), dtype=tl.float32)
    for part in tl.static_range(SLICES):
        logits += tl.load(partial_ptr + (part * rows + row) * E + experts, mask=ok, other=0.0)
    tl.store(logits_ptr + row * E + experts, logits, mask=ok)
    scores = 1.0 / (1.0 + tl.exp(-logits))
    bias = tl.load(bias_ptr + experts, mask=ok, other=0.0).to(tl.float32)
    candidates = tl.where(ok, scores + bias, float("-inf"))
    picks = tl.arange(0, BLOCK_TOP_K)
    chosen = tl.zeros((BLOCK_TOP_K,), dtype=tl.int64)
    picked = tl.zeros((BLOCK_TOP_K,), dtype=tl.float32)
    for pick in tl.static_range(TOP_K):
        best = tl.argmax(candidates, 0, tie_break_left=True)
        chosen = tl.where(picks == pick, best.to(tl.int64), chosen)
        picked = tl.where(picks == pick, tl.sum(tl.where(experts == best, scores, 0.0), 0), picked)
        candidates = tl.where(experts == best, float("-inf"), candidates)
    weights = picked / (tl.sum(picked, 0) + 1e-20) * route_scale
    tl.store(chosen_ptr + row * TOP_K + picks, chosen, mask=picks < TOP_K)
    tl.store(weights_ptr + row * TOP_K + picks, weights, mask=picks < TOP_K)


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
    router weight [E, K] and score bias [E], all contiguous; at most BLOCK_M rows and MAX_EXPERTS experts. A custom
    op: the compiled decode steps call it as it is."""
    rows, width = x.shape
    experts = weight.shape[0]
    if not 0 < rows <= BLOCK_M or not 0 < top_k <= experts <= MAX_EXPERTS:
        raise ValueError(
            f"top_k_routing takes 1 to {BLOCK_M} rows and 1 <= top_k <= experts <= {MAX_EXPERTS}, got {rows} rows, "
            f"top_k {top_k}, {experts} experts."
        )
    logits, weights, chosen = _new_outputs(x, weight, top_k)
    slice_width = triton.cdiv(triton.cdiv(width, K_SLICES), BLOCK_K) * BLOCK_K
    slices = triton.cdiv(width, slice_width)
    partial = x.new_empty(slices, rows, experts, dtype=torch.float32)
    _partial_logits_kernel[(triton.cdiv(experts, BLOCK_E), slices)](
        x, weight, partial, rows, experts, width, slice_width, BLOCK_M=max(16, triton.next_power_of_2(rows)),
        BLOCK_E=BLOCK_E, BLOCK_K=BLOCK_K, num_warps=4,
    )  # fmt: skip
    _top_k_kernel[(rows,)](
        partial, bias, logits, weights, chosen, rows, experts, route_scale, SLICES=slices, TOP_K=top_k,
        BLOCK_TOP_K=triton.next_power_of_2(top_k), BLOCK_ALL=triton.next_power_of_2(experts), num_warps=4,
    )  # fmt: skip
    return logits, weights, chosen


@top_k_routing.register_fake
def _(x, weight, bias, top_k, route_scale):
    return _new_outputs(x, weight, top_k)


__all__ = ["BLOCK_M", "MAX_EXPERTS", "top_k_routing"]
