"""A decode step's six attention input projections as one Triton GEMV launch.

At a few tokens a projection is a read of its weight matrix; what else it costs is per launch. cuBLAS gives the six
input projections of a layer six launches plus split-K reductions for the narrow ones (together 54% of copy
bandwidth at one row on an H200). Here a program owns BLOCK_N output features of one weight for all the step's rows,
streams that weight's rows once in BLOCK_K slices and accumulates with `tl.dot` in fp32 (the rows padded to 16, as
the tensor cores take them); the programs of all the weights share one grid, so the narrow ones ride in the same
wave as the wide ones: 94% of copy bandwidth at full width (docs/benchmarks.md).

Each output is rounded once from its fp32 sum, as cuBLAS rounds its own: the two differ by the order of the sum
only. Imported only when a CUDA tensor takes the path (`projections.py`; triton is not a CPU dependency).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from .dependent_launch import dependent_launch
from .dependent_launch_kernel import release_successor, wait_for_predecessor

MAX_WEIGHTS = 6  # q, gate, relative, sink, k, v
BLOCK_M = 16  # the step's rows, padded to what the tensor cores take; at 64 rows cuBLAS won, so the kernel stops here
# (BLOCK_N, BLOCK_K, warps, stages), the fastest at 1 and 8 rows of `benchmarks/projections.py --sweep` (weights read
# cold) on an H100, 2026-12-05: TILE at full width (474 programs, 96% of copy bandwidth), DEEP_TILE where TILE's grid
# gives each SM at most one program (the TP4-shaped layer: 119 programs on 132 SMs; 80% of copy bandwidth against
# 61% with TILE; docs/dev/benchmark-history.md): a program then streams its rows alone, and takes twice the bytes per
# step, one stage deeper.
TILE = (32, 128, 4, 3)
DEEP_TILE = (32, 256, 4, 4)


# kernel signatures and pointer arithmetic read better packed
# fmt: off
@triton.jit
def _gemv_tile(x_ptr, w_ptr, y_ptr, n, rows, K, block, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
               BLOCK_K: tl.constexpr, STAGES: tl.constexpr, PDL: tl.constexpr):
    """y[:rows, block * BLOCK_N + j] = sum_k x[:rows, k] w[block * BLOCK_N + j, k] for the tile's j; x [rows, K] and
    w [n, K] contiguous, y [rows, n]."""
    outs = block * BLOCK_N + tl.arange(0, BLOCK_N)
    ms = tl.arange(0, BLOCK_M)
    ks = tl.arange(0, BLOCK_K)
    out_ok, row_ok = outs < n, ms < rows
    w_ptrs = w_ptr + outs[:, None].to(tl.int64) * K + ks[None, :]
    x_offsets = ms[:, None] * K + ks[None, :]
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for start in tl.range(0, K, BLOCK_K, num_stages=STAGES):
        k_ok = (start + ks < K)[None, :]
        w = tl.load(w_ptrs + start, mask=out_ok[:, None] & k_ok, other=0.0)
        x = tl.load(x_ptr + x_offsets + start, mask=row_ok[:, None] & k_ok, other=0.0)
        acc += tl.dot(x, tl.trans(w))
    release_successor(PDL)
    destination = y_ptr + ms[:, None] * n + outs[None, :]
    tl.store(destination, acc.to(y_ptr.dtype.element_ty), mask=row_ok[:, None] & out_ok[None, :])


@triton.jit
def _grouped_kernel(x0, x1, x2, x3, x4, x5, w0, w1, w2, w3, w4, w5, y0, y1, y2, y3, y4, y5,
                    n0, n1, n2, n3, n4, n5, rows, K, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                    BLOCK_K: tl.constexpr, STAGES: tl.constexpr, PDL: tl.constexpr):
    """grid (sum_i cdiv(n_i, BLOCK_N),): the programs of weight 0, then of weight 1, ...; y_i = x_i @ w_i.T.
    Unused slots have n_i = 0 and own no program."""
    wait_for_predecessor(PDL)
    pid = tl.program_id(0)
    e0 = tl.cdiv(n0, BLOCK_N)
    e1 = e0 + tl.cdiv(n1, BLOCK_N)
    e2 = e1 + tl.cdiv(n2, BLOCK_N)
    e3 = e2 + tl.cdiv(n3, BLOCK_N)
    e4 = e3 + tl.cdiv(n4, BLOCK_N)
    if pid < e0:
        _gemv_tile(x0, w0, y0, n0, rows, K, pid, BLOCK_M, BLOCK_N, BLOCK_K, STAGES, PDL)
    elif pid < e1:
        _gemv_tile(x1, w1, y1, n1, rows, K, pid - e0, BLOCK_M, BLOCK_N, BLOCK_K, STAGES, PDL)
    elif pid < e2:
        _gemv_tile(x2, w2, y2, n2, rows, K, pid - e1, BLOCK_M, BLOCK_N, BLOCK_K, STAGES, PDL)
    elif pid < e3:
        _gemv_tile(x3, w3, y3, n3, rows, K, pid - e2, BLOCK_M, BLOCK_N, BLOCK_K, STAGES, PDL)
    elif pid < e4:
        _gemv_tile(x4, w4, y4, n4, rows, K, pid - e3, BLOCK_M, BLOCK_N, BLOCK_K, STAGES, PDL)
    else:
        _gemv_tile(x5, w5, y5, n5, rows, K, pid - e4, BLOCK_M, BLOCK_N, BLOCK_K, STAGES, PDL)


# fmt: on
def launch_config(rows: int, widths: list[int], multiprocessors: int) -> dict:
    """The launch's tile for `rows` rows (at most BLOCK_M) and weights of `widths` outputs on a GPU of
    `multiprocessors` SMs: TILE, or DEEP_TILE where TILE's grid would leave each SM at most one program."""
    if not 0 < rows <= BLOCK_M:
        raise ValueError(f"The projection GEMVs take 1 to {BLOCK_M} rows, got {rows}.")
    programs = sum(triton.cdiv(n, TILE[0]) for n in widths)
    block_n, block_k, warps, stages = DEEP_TILE if programs <= multiprocessors else TILE
    return dict(BLOCK_M=BLOCK_M, BLOCK_N=block_n, BLOCK_K=block_k, STAGES=stages, num_warps=warps)


def multiprocessors(tensor: torch.Tensor) -> int:
    """The SMs of the GPU `tensor` is on; 0 off CUDA (CPU tensors under Triton's interpreter: TILE)."""
    return torch.cuda.get_device_properties(tensor.device).multi_processor_count if tensor.is_cuda else 0


def _new_outputs(inputs, weights) -> list[torch.Tensor]:
    return [x.new_empty(x.shape[0], w.shape[0], dtype=w.dtype) for x, w in zip(inputs, weights, strict=True)]


@torch.library.custom_op("inkling2::grouped_projections", mutates_args=())
def grouped_projections(inputs: list[torch.Tensor], weights: list[torch.Tensor]) -> list[torch.Tensor]:
    """`[x @ w.T for x, w in zip(inputs, weights)]` in one launch: each x [rows, K] and w [n_i, K] contiguous, one
    dtype, at most MAX_WEIGHTS pairs. A custom op: the compiled decode steps call it as it is."""
    if not 0 < len(weights) <= MAX_WEIGHTS:
        raise ValueError(f"grouped_projections takes 1 to {MAX_WEIGHTS} weights, got {len(weights)}.")
    outputs = _new_outputs(inputs, weights)
    rows, width = inputs[0].shape
    widths = [w.shape[0] for w in weights]
    config = launch_config(rows, widths, multiprocessors(inputs[0]))
    padding = MAX_WEIGHTS - len(weights)
    xs, ws, ys = (list(group) + [group[0]] * padding for group in (inputs, weights, outputs))
    widths += [0] * padding
    grid = (sum(triton.cdiv(n, config["BLOCK_N"]) for n in widths),)
    pdl = dependent_launch(inputs[0])
    _grouped_kernel[grid](*xs, *ws, *ys, *widths, rows, width, PDL=pdl, launch_pdl=pdl, **config)
    return outputs


@grouped_projections.register_fake
def _(inputs, weights):
    return _new_outputs(inputs, weights)


__all__ = ["BLOCK_M", "DEEP_TILE", "MAX_WEIGHTS", "TILE", "grouped_projections", "launch_config"]
