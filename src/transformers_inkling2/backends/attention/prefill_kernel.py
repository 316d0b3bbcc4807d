"""Prefill attention with the relative bias read in-tile: one fused Triton kernel (the `inkling2_triton` backend).

FlexAttention adds the bias through a `score_mod` that gathers `relative_logits[b, h, q, d]` one score at a time,
which costs a sliding layer about 3x the same call without bias (docs/dev/benchmark-history.md). Here a program owns
one query head and a block of BLOCK_M queries (`TILES`) and walks only the key blocks its rows can see (the window,
or everything up to the diagonal in a full layer). Key blocks are counted from the diagonal, so every query block
meets the same distances d = p_i - p_j; for a tile, the bias of row i is a run of consecutive entries of its
relative-logit row (d changes by one per key), and holding the keys of a tile in descending order makes that run
ascending: one coalesced 2-D load, vectorized when the relative logits come in the layout of `aligned_product` (the
model's, for prompts), whose guard of buffer around them lets even the masked blocks read their bias without masks
(a select keeps 0 <= d < extent). Key blocks come in runs that need no bias (wholly beyond the extent: the far part
of a full layer), no mask (the inner blocks) or masks (the diagonal, edges, keys crossing 0). Masks (causal, window,
left padding) are computed from positions; the softmax runs online and the sink joins the denominator at the end:

    out = acc / (l + e^(sink - m)),   with acc and l scaled to the running max m (which includes the sink),

all in base 2 inside the kernel (scores times log2 e: one ex2 per exponential).

On Hopper, sliding layers run a Gluon version of this kernel with the MMAs scheduled by hand (`prefill_gluon`)
where its scope allows: it overlaps the softmax with the MMAs, which Triton's schedule of this kernel does not
(docs/benchmarks.md compares the two).

Positions must be contiguous and ascending (`q0 + arange(Q)`, `k0 + arange(K)`), as for `inkling2_flex`; q0 and k0
are read on the device (no host sync). Imported only for CUDA tensors (or under Triton's interpreter).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ..triton_features import GLUON_API
from .tiles import (
    LOG2E,
    attention_output_like,
    kernel_operands,
    online_softmax_step,
    reads_past_rows_in_bounds,
    tile_scores,
    visible_keys,
)

# (BLOCK_M, BLOCK_N, warps, stages) by layer: the fastest shapes of the tile sweep in docs/dev/benchmark-history.md
# (benchmarks/prefill_kernel_sweep.py); 128 x 128 tiles spill registers
TILES = {"full": (128, 64, 8, 3), "sliding": (128, 64, 8, 3)}

# how a run of key blocks treats the relative bias
NO_BIAS = tl.constexpr(0)
MASKED_BIAS = tl.constexpr(1)  # a load masked to 0 <= d < extent
FULL_BIAS = tl.constexpr(2)  # every distance in [0, extent): a load without mask


# kernel signatures and pointer arithmetic read better packed
# fmt: off
@triton.jit
def _attend_key_blocks(q, m, l, acc, lo, hi, rows, row_ok, first, bias_rows, k_base, v_base, padding_row_ptr,
                       stride_kk, stride_vk, key_length, extent, window, scaling,
                       DIM: tl.constexpr, BM: tl.constexpr, BN: tl.constexpr, MASKED: tl.constexpr,
                       BIAS: tl.constexpr, HAS_WINDOW: tl.constexpr, HAS_PADDING: tl.constexpr,
                       GUARDED: tl.constexpr, DOT_FP32: tl.constexpr):
    """Folds key blocks j in [lo, hi) into the online softmax of the query block. Block j holds the keys
    [first + BM - (j + 1) BN, first + BM - j BN) in descending order (column c is key first + BM - j BN - 1 - c), so
    local row r sees them at distances r - BM + j BN + 1 + c, the same for every query block: its bias is one
    ascending run of its relative logits that starts j BN - BM + 1 entries after the row's own (`bias_rows`). The
    caller splits the blocks into runs that need no mask (MASKED false) and whose distances all lie in [0, extent)
    (FULL_BIAS: a load without mask) or all beyond it (NO_BIAS); the others (MASKED_BIAS) load their bias without
    mask too when the buffer holds a guard around the relative logits (GUARDED) and select it where 0 <= d < extent."""
    dims = tl.arange(0, DIM)
    ascending = tl.arange(0, BN)
    row_distance = rows % BM - BM + 1  # of column 0 in block 0
    for j in range(lo, hi):
        cols = first + BM - j * BN - 1 - ascending
        # built from vectors in each step: a [BM, BN] tile of distances kept across steps would hold registers
        distance = (row_distance + j * BN)[:, None] + ascending[None, :]
        if MASKED:
            col_ok = (cols >= 0) & (cols < key_length)
            k = tl.load(k_base + cols[:, None] * stride_kk + dims[None, :], mask=col_ok[:, None], other=0.0)
            v = tl.load(v_base + cols[:, None] * stride_vk + dims[None, :], mask=col_ok[:, None], other=0.0)
        else:
            k = tl.load(k_base + cols[:, None] * stride_kk + dims[None, :])
            v = tl.load(v_base + cols[:, None] * stride_vk + dims[None, :])
        scores = tile_scores(q, k, DOT_FP32) * (scaling * LOG2E)  # base 2 (online_softmax_step)
        if MASKED:
            visible = visible_keys(distance, row_ok, cols, col_ok, padding_row_ptr, window, HAS_WINDOW, HAS_PADDING)
        bias = bias_rows[:, None] + (j * BN + ascending)[None, :]
        if BIAS == FULL_BIAS:
            scores += tl.load(bias).to(tl.float32) * LOG2E
        elif BIAS == MASKED_BIAS:
            in_extent = (distance >= 0) & (distance < extent)
            if GUARDED:  # reads past a row's ends stay in the buffer; whatever they hold is not selected
                scores += tl.where(in_extent, tl.load(bias).to(tl.float32) * LOG2E, 0.0)
            else:
                scores += tl.load(bias, mask=in_extent & row_ok[:, None], other=0.0).to(tl.float32) * LOG2E
        if MASKED:
            scores = tl.where(visible, scores, float("-inf"))
        m, l, acc = online_softmax_step(scores, v, m, l, acc, DOT_FP32)
    return m, l, acc


@triton.jit
def _prefill_kernel(
    q_ptr, k_ptr, v_ptr, rl_ptr, sink_ptr, qpos_ptr, kpos_ptr, pad_ptr, out_ptr,
    stride_qb, stride_qh, stride_qq, stride_kb, stride_kh, stride_kk, stride_vb, stride_vh, stride_vk,
    stride_rb, stride_rh, bias_pitch, stride_sb, stride_sh, stride_sq, stride_pb, stride_ob, stride_oq, stride_oh,
    query_length, key_length, extent, window, scaling,
    HEADS: tl.constexpr, GROUPS: tl.constexpr, DIM: tl.constexpr, BM: tl.constexpr, BN: tl.constexpr,
    HAS_PADDING: tl.constexpr, HAS_WINDOW: tl.constexpr, MASK_FAR: tl.constexpr, GUARDED: tl.constexpr,
    DOT_FP32: tl.constexpr,
):
    """grid (cdiv(Q, BM), batch * heads). `rl_ptr` points one element past the relative logits' start and
    `bias_pitch` is their query stride + 1 (see `prefill_attention`)."""
    m_block, pair = tl.program_id(0), tl.program_id(1)
    b, head = (pair // HEADS).to(tl.int64), pair % HEADS  # 64-bit offsets: a batch of long caches passes 2^31
    kv_head = head // GROUPS
    rows = m_block * BM + tl.arange(0, BM)
    row_ok = rows < query_length
    safe_rows = tl.where(row_ok, rows, 0)  # pointers; distances keep the block's nominal rows
    dims = tl.arange(0, DIM)
    q = tl.load(q_ptr + b * stride_qb + head * stride_qh + safe_rows[:, None] * stride_qq + dims[None, :],
                mask=row_ok[:, None], other=0.0)
    first_query, first_key = tl.load(qpos_ptr), tl.load(kpos_ptr)
    # key index of the block's first row's own key (query i sits at key i + first - m_block * BM); positions stay
    # far below 2^31, so keys and distances are 32-bit (half the registers of the [BM, BN] tiles)
    first = (first_query - first_key).to(tl.int32) + m_block * BM
    # the relative logit of row i at distance d: rl[i, d] = rl_ptr - 1 + i * (bias_pitch - 1) + d; the tile of
    # block j reads d = i - m_block BM - BM + j BN + 1 + c, which makes the row's run start at
    # rl_ptr + i bias_pitch - (m_block + 1) BM + j BN: 16-byte aligned when the layout allows it (vector loads).
    # Rows past the queries read the last row's run (in bounds; never stored).
    last_rows = tl.minimum(rows, query_length - 1)
    bias_rows = rl_ptr + b * stride_rb + head * stride_rh + last_rows * bias_pitch - (m_block + 1) * BM
    k_base = k_ptr + b * stride_kb + kv_head * stride_kh
    v_base = v_ptr + b * stride_vb + kv_head * stride_vh
    padding_row_ptr = pad_ptr + b * stride_pb

    # Block j (keys below first + BM - j BN, see _attend_key_blocks) holds distances from j BN - BM + 1 to
    # j BN + BN - 1. Runs by j: diagonal blocks, some d < 0 (masks); inner blocks, all d < min(extent, window) and
    # keys >= 0 (no mask); edge blocks, where the window or the extent ends inside the block, or keys cross 0 before
    # the far blocks (masks); far blocks, all d >= extent and keys >= 0 (no bias, no mask); the tail, beyond the
    # extent with keys crossing 0 (no bias, masks). Clamps keep the runs ordered and below `end`, the first block
    # without a visible key; operands of `//` (which truncates) stay >= 0 (queries never precede their keys).
    lowest_key = 0
    if HAS_WINDOW:
        lowest_key = tl.maximum(first - window + 1, 0)
    end = (first + BM - 1 - lowest_key) // BN + 1
    whole_blocks = tl.maximum(first + BM, 0) // BN  # blocks whose keys are all >= 0
    reach = extent
    if HAS_WINDOW:
        reach = tl.minimum(extent, window)
    diagonal_end = tl.minimum((BM + BN - 1) // BN, end)
    inner_end = tl.minimum(tl.maximum(tl.minimum(reach // BN, whole_blocks), diagonal_end), end)
    far_start = tl.minimum(tl.maximum((extent + BM + BN - 2) // BN, inner_end), end)
    far_end = tl.minimum(tl.maximum(whole_blocks, far_start), end)

    m = tl.full((BM,), float("-inf"), dtype=tl.float32)
    l = tl.zeros((BM,), dtype=tl.float32)
    acc = tl.zeros((BM, DIM), dtype=tl.float32)
    # the runs, nearest keys first
    m, l, acc = _attend_key_blocks(q, m, l, acc, 0, diagonal_end, rows, row_ok, first, bias_rows, k_base, v_base,
                                   padding_row_ptr, stride_kk, stride_vk, key_length, extent, window, scaling,
                                   DIM, BM, BN, True, MASKED_BIAS, HAS_WINDOW, HAS_PADDING, GUARDED, DOT_FP32)
    m, l, acc = _attend_key_blocks(q, m, l, acc, diagonal_end, inner_end, rows, row_ok, first, bias_rows, k_base,
                                   v_base, padding_row_ptr, stride_kk, stride_vk, key_length, extent, window, scaling,
                                   DIM, BM, BN, HAS_PADDING, FULL_BIAS, HAS_WINDOW, HAS_PADDING, GUARDED, DOT_FP32)
    m, l, acc = _attend_key_blocks(q, m, l, acc, inner_end, far_start, rows, row_ok, first, bias_rows, k_base,
                                   v_base, padding_row_ptr, stride_kk, stride_vk, key_length, extent, window, scaling,
                                   DIM, BM, BN, True, MASKED_BIAS, HAS_WINDOW, HAS_PADDING, GUARDED, DOT_FP32)
    m, l, acc = _attend_key_blocks(q, m, l, acc, far_start, far_end, rows, row_ok, first, bias_rows, k_base, v_base,
                                   padding_row_ptr, stride_kk, stride_vk, key_length, extent, window, scaling,
                                   DIM, BM, BN, MASK_FAR, NO_BIAS, HAS_WINDOW, HAS_PADDING, GUARDED, DOT_FP32)
    m, l, acc = _attend_key_blocks(q, m, l, acc, far_end, end, rows, row_ok, first, bias_rows, k_base, v_base,
                                   padding_row_ptr, stride_kk, stride_vk, key_length, extent, window, scaling,
                                   DIM, BM, BN, True, NO_BIAS, HAS_WINDOW, HAS_PADDING, GUARDED, DOT_FP32)

    sink = tl.load(sink_ptr + b * stride_sb + head * stride_sh + safe_rows * stride_sq).to(tl.float32) * LOG2E
    top = tl.maximum(m, sink)  # base 2, as m
    scale = tl.exp2(m - top)  # 0 for a row without visible keys: all its mass goes to the sink
    out = acc * scale[:, None] / (l * scale + tl.exp2(sink - top))[:, None]
    destination = out_ptr + b * stride_ob + safe_rows[:, None] * stride_oq + head * stride_oh + dims[None, :]
    tl.store(destination, out.to(out_ptr.dtype.element_ty), mask=row_ok[:, None])


# fmt: on


def supports(query: torch.Tensor, key: torch.Tensor) -> bool:
    """A power-of-two head dim from 16 to 256 and the inputs' dtypes alike."""
    head_dim = query.shape[-1]
    return 16 <= head_dim <= 256 and head_dim & (head_dim - 1) == 0 and query.dtype == key.dtype


@torch.library.custom_op("inkling2::prefill_attention", mutates_args=())
def prefill_attention(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    relative_logits: torch.Tensor,
    sinks: torch.Tensor,
    query_positions: torch.Tensor,
    key_positions: torch.Tensor,
    key_padding: torch.Tensor | None,
    sliding_window: int | None,
    scaling: float,
) -> torch.Tensor:
    """Same contract as `modeling.attention.eager_attention`, positions contiguous and ascending -> [B, Q, H, D]. A
    custom op, so that `torch.compile` calls it as it is. Sliding layers on Hopper run the Gluon kernel where it
    applies, the rest `triton_prefill_attention`."""
    inputs = (query, key, value, relative_logits, sinks, query_positions, key_positions, key_padding, sliding_window,
              scaling)  # fmt: skip
    if sliding_window is not None and query.is_cuda and GLUON_API:
        from . import prefill_gluon  # imported on first use (Gluon, `triton_features.GLUON_API`)

        if prefill_gluon.supports(query, key, value, relative_logits, sliding_window):
            return prefill_gluon.sliding_prefill_attention(*inputs)
    return triton_prefill_attention(*inputs)


prefill_attention.register_fake(attention_output_like)


def triton_prefill_attention(query, key, value, relative_logits, sinks, query_positions, key_positions, key_padding,
                             sliding_window, scaling) -> torch.Tensor:
    """`prefill_attention` through `_prefill_kernel`, for every layer kind, dtype and GPU Triton supports."""
    batch, heads, queries, head_dim = query.shape
    kv_heads, key_length = key.shape[1], key.shape[2]
    output, fp32, operands = kernel_operands(query, key, value, relative_logits, sinks, query_positions,
                                             key_positions, key_padding)
    block_m, block_n, warps, stages = TILES["full" if sliding_window is None else "sliding"]
    _prefill_kernel[(triton.cdiv(queries, block_m), batch * heads)](
        *operands, queries, key_length, relative_logits.shape[-1], sliding_window or 0, scaling,
        HEADS=heads, GROUPS=heads // kv_heads, DIM=head_dim, BM=block_m, BN=block_n,
        HAS_PADDING=key_padding is not None, HAS_WINDOW=sliding_window is not None,
        MASK_FAR=key_padding is not None or sliding_window is not None,
        GUARDED=reads_past_rows_in_bounds(relative_logits, block_m, block_n), DOT_FP32=fp32,
        num_warps=warps, num_stages=stages,
    )  # fmt: skip
    return output


__all__ = ["prefill_attention", "supports", "triton_prefill_attention"]
