"""Prefill attention with the relative bias read in-tile: one fused Triton kernel (the `inkling2_triton` backend).

FlexAttention adds the bias through a `score_mod` that gathers `relative_logits[b, h, q, d]` one score at a time,
which costs a sliding layer about 3x the same call without bias (docs/benchmarks.md). Here a program owns one query
head and a block of BLOCK_M queries and walks only the key blocks its rows can see (the window, or everything up to
the diagonal in a full layer). For a tile, the bias of row i is a run of consecutive entries of its relative-logit
row (distance d = p_i - p_j changes by one per key); holding the keys of a tile in descending order makes that run
ascending, so the tile is one coalesced 2-D load. Key blocks come in runs that need no bias (wholly beyond the
extent: the far part of a full layer), no mask (the inner blocks) or masks (edges and the diagonal). Masks (causal,
window, left padding) are computed from positions; the softmax runs online and the sink joins the denominator at
the end:

    out = acc / (l + e^(sink - m)),   with acc and l scaled to the running max m (which includes the sink).

Positions must be contiguous and ascending (`q0 + arange(Q)`, `k0 + arange(K)`), as for `inkling2_flex`; q0 and k0
are read on the device (no host sync). Imported only for CUDA tensors (or under Triton's interpreter).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from .attention_kernel_tiles import attention_output_like, kernel_inputs, online_softmax_step, tile_scores, visible_keys

# from a sweep on one H200 (docs/benchmarks.md): 128 x 64 and 64 x 128 tiles were slower; three stages do not fit
BLOCK_M = 128
BLOCK_N = 128
NUM_WARPS = 8
NUM_STAGES = 2

# how a run of key blocks treats the relative bias
NO_BIAS = tl.constexpr(0)
MASKED_BIAS = tl.constexpr(1)  # a load masked to 0 <= d < extent
FULL_BIAS = tl.constexpr(2)  # every distance in [0, extent): a load without mask


# kernel signatures and pointer arithmetic read better packed
# fmt: off
@triton.jit
def _attend_key_blocks(q, m, l, acc, lo, hi, rows, row_ok, offset, bias_rows, k_base, v_base, padding_row_ptr,
                       stride_kk, stride_vk, key_length, extent, window, scaling,
                       DIM: tl.constexpr, BN: tl.constexpr, MASKED: tl.constexpr, BIAS: tl.constexpr,
                       HAS_WINDOW: tl.constexpr, HAS_PADDING: tl.constexpr, DOT_FP32: tl.constexpr):
    """Folds key blocks [lo, hi) into the online softmax of the query block. Each key block is held in descending
    key order (column c is key n0 + BN - 1 - c): the distance of a row then grows along the columns, so the row's
    bias is one ascending run of its relative logits and the tile a coalesced 2-D load. The caller splits the keys
    into runs that need no mask (MASKED false) and whose distances all lie in [0, extent) (FULL_BIAS: a load
    without mask) or all beyond it (NO_BIAS)."""
    dims = tl.arange(0, DIM)
    ascending = tl.arange(0, BN)
    for n0 in range(lo, hi, BN):
        cols = n0 + BN - 1 - ascending
        distance = (rows + offset - (n0 + BN - 1))[:, None] + ascending[None, :]
        if MASKED:
            col_ok = cols < key_length
            k = tl.load(k_base + cols[:, None] * stride_kk + dims[None, :], mask=col_ok[:, None], other=0.0)
            v = tl.load(v_base + cols[:, None] * stride_vk + dims[None, :], mask=col_ok[:, None], other=0.0)
        else:
            k = tl.load(k_base + cols[:, None] * stride_kk + dims[None, :])
            v = tl.load(v_base + cols[:, None] * stride_vk + dims[None, :])
        scores = tile_scores(q, k, DOT_FP32) * scaling
        if MASKED:
            visible = visible_keys(distance, row_ok, cols, col_ok, padding_row_ptr, window, HAS_WINDOW, HAS_PADDING)
        if BIAS == FULL_BIAS:
            scores += tl.load(bias_rows[:, None] + distance).to(tl.float32)
        elif BIAS == MASKED_BIAS:
            in_extent = (distance >= 0) & (distance < extent) & row_ok[:, None]
            scores += tl.load(bias_rows[:, None] + distance, mask=in_extent, other=0.0).to(tl.float32)
        if MASKED:
            scores = tl.where(visible, scores, float("-inf"))
        m, l, acc = online_softmax_step(scores, v, m, l, acc, DOT_FP32)
    return m, l, acc


@triton.jit
def _prefill_kernel(
    q_ptr, k_ptr, v_ptr, rl_ptr, sink_ptr, qpos_ptr, kpos_ptr, pad_ptr, out_ptr,
    stride_qb, stride_qh, stride_qq, stride_kb, stride_kh, stride_kk, stride_vb, stride_vh, stride_vk,
    stride_rb, stride_rh, stride_rq, stride_sb, stride_sh, stride_sq, stride_pb, stride_ob, stride_oq, stride_oh,
    query_length, key_length, extent, window, scaling,
    HEADS: tl.constexpr, GROUPS: tl.constexpr, DIM: tl.constexpr, BM: tl.constexpr, BN: tl.constexpr,
    HAS_PADDING: tl.constexpr, HAS_WINDOW: tl.constexpr, MASK_FAR: tl.constexpr, DOT_FP32: tl.constexpr,
):
    """grid (cdiv(Q, BM), batch * heads)."""
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
    # key index of the key at query i's own position: i + offset (keys before it are visible); positions stay far
    # below 2^31, so distances are 32-bit (half the registers of the [BM, BN] distance tile)
    offset = (first_query - first_key).to(tl.int32)
    bias_rows = rl_ptr + b * stride_rb + head * stride_rh + safe_rows * stride_rq
    k_base = k_ptr + b * stride_kb + kv_head * stride_kh
    v_base = v_ptr + b * stride_vb + kv_head * stride_vh
    padding_row_ptr = pad_ptr + b * stride_pb

    # The key blocks the rows can see, [low, high), in four runs by the distances d = row + offset - key they hold
    # (distances fall as keys rise): far blocks, all d >= extent (no bias); edge blocks, where the window or the
    # extent ends inside the block (masks); inner blocks, all 0 <= d < min(extent, window) (no mask); diagonal
    # blocks, some d < 0 (masks). Clamps keep the runs ordered and inside [low, high); `//` truncates, so its
    # operands are clamped to >= 0 first.
    first = m_block * BM + offset  # the block's first row's own key index
    last = first + BM - 1
    high = tl.minimum(last + 1, key_length)
    low = 0
    if HAS_WINDOW:
        low = tl.maximum(first - window + 1, 0) // BN * BN
    diagonal = tl.minimum(tl.maximum((first + 1) // BN * BN, low), high)
    far_end = tl.minimum(tl.maximum(tl.maximum(first - extent + 1, 0) // BN * BN, low), diagonal)
    reach = extent
    if HAS_WINDOW:
        reach = tl.minimum(extent, window)
    inner = tl.minimum(tl.maximum((tl.maximum(last - reach + 1, 0) + BN - 1) // BN * BN, far_end), diagonal)

    m = tl.full((BM,), float("-inf"), dtype=tl.float32)
    l = tl.zeros((BM,), dtype=tl.float32)
    acc = tl.zeros((BM, DIM), dtype=tl.float32)
    # the four runs in order: far (no bias), edge (masks), inner (no mask), diagonal (masks)
    m, l, acc = _attend_key_blocks(q, m, l, acc, low, far_end, rows, row_ok, offset, bias_rows, k_base, v_base,
                                   padding_row_ptr, stride_kk, stride_vk, key_length, extent, window, scaling,
                                   DIM, BN, MASK_FAR, NO_BIAS, HAS_WINDOW, HAS_PADDING, DOT_FP32)
    m, l, acc = _attend_key_blocks(q, m, l, acc, far_end, inner, rows, row_ok, offset, bias_rows, k_base, v_base,
                                   padding_row_ptr, stride_kk, stride_vk, key_length, extent, window, scaling,
                                   DIM, BN, True, MASKED_BIAS, HAS_WINDOW, HAS_PADDING, DOT_FP32)
    m, l, acc = _attend_key_blocks(q, m, l, acc, inner, diagonal, rows, row_ok, offset, bias_rows, k_base, v_base,
                                   padding_row_ptr, stride_kk, stride_vk, key_length, extent, window, scaling,
                                   DIM, BN, HAS_PADDING, FULL_BIAS, HAS_WINDOW, HAS_PADDING, DOT_FP32)
    m, l, acc = _attend_key_blocks(q, m, l, acc, diagonal, high, rows, row_ok, offset, bias_rows, k_base, v_base,
                                   padding_row_ptr, stride_kk, stride_vk, key_length, extent, window, scaling,
                                   DIM, BN, True, MASKED_BIAS, HAS_WINDOW, HAS_PADDING, DOT_FP32)

    sink = tl.load(sink_ptr + b * stride_sb + head * stride_sh + safe_rows * stride_sq).to(tl.float32)
    top = tl.maximum(m, sink)
    scale = tl.exp(m - top)  # 0 for a row without visible keys: all its mass goes to the sink
    out = acc * scale[:, None] / (l * scale + tl.exp(sink - top))[:, None]
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
    """Same contract as `attention.eager_attention`, positions contiguous and ascending -> [B, Q, H, D]. A custom op,
    so that `torch.compile` calls it as it is."""
    batch, heads, queries, head_dim = query.shape
    kv_heads, key_length = key.shape[1], key.shape[2]
    query, key, value, relative_logits, padding, fp32 = kernel_inputs(query, key, value, relative_logits, key_padding)
    output = torch.empty(batch, queries, heads, head_dim, dtype=value.dtype, device=query.device)
    _prefill_kernel[(triton.cdiv(queries, BLOCK_M), batch * heads)](
        query, key, value, relative_logits, sinks, query_positions.contiguous(), key_positions.contiguous(),
        padding, output,
        query.stride(0), query.stride(1), query.stride(2), key.stride(0), key.stride(1), key.stride(2),
        value.stride(0), value.stride(1), value.stride(2),
        relative_logits.stride(0), relative_logits.stride(1), relative_logits.stride(2),
        sinks.stride(0), sinks.stride(1), sinks.stride(2), padding.stride(0),
        output.stride(0), output.stride(1), output.stride(2),
        queries, key_length, relative_logits.shape[-1], sliding_window or 0, scaling,
        HEADS=heads, GROUPS=heads // kv_heads, DIM=head_dim, BM=BLOCK_M, BN=BLOCK_N,
        HAS_PADDING=key_padding is not None, HAS_WINDOW=sliding_window is not None,
        MASK_FAR=key_padding is not None or sliding_window is not None, DOT_FP32=fp32,
        num_warps=NUM_WARPS, num_stages=NUM_STAGES,
    )  # fmt: skip
    return output


prefill_attention.register_fake(attention_output_like)


__all__ = ["prefill_attention", "supports"]
