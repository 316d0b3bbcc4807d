"""Prefill attention with the relative bias read in-tile: one fused Triton kernel (the `inkling2_triton` backend).

FlexAttention adds the bias through a `score_mod` that gathers `relative_logits[b, h, q, d]` one score at a time,
which costs a sliding layer about 3x the same call without bias (docs/benchmarks.md). Here a program owns one query
head and a block of BLOCK_M queries and walks only the key blocks its rows can see (the window, or everything up to
the diagonal in a full layer). For a tile, the bias of row i is a run of consecutive entries of its relative-logit
row (distance d = p_i - p_j falls by one per key), read as one masked 2-D load; tiles wholly beyond the extent (the
far part of a full layer) skip it. Masks (causal, window, left padding) are computed from positions; the softmax
runs online and the sink joins the denominator at the end:

    out = acc / (l + e^(sink - m)),   with acc and l scaled to the running max m (which includes the sink).

Positions must be contiguous and ascending (`q0 + arange(Q)`, `k0 + arange(K)`), as for `inkling2_flex`; q0 and k0
are read on the device (no host sync). Imported only for CUDA tensors (or under Triton's interpreter).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from .attention_kernel_tiles import attention_output_like, kernel_inputs, online_softmax_step, tile_scores, visible_keys

BLOCK_M = 128
BLOCK_N = 64


# kernel signatures and pointer arithmetic read better packed
# fmt: off
@triton.jit
def _prefill_kernel(
    q_ptr, k_ptr, v_ptr, rl_ptr, sink_ptr, qpos_ptr, kpos_ptr, pad_ptr, out_ptr,
    stride_qb, stride_qh, stride_qq, stride_kb, stride_kh, stride_kk, stride_vb, stride_vh, stride_vk,
    stride_rb, stride_rh, stride_rq, stride_sb, stride_sh, stride_sq, stride_pb, stride_ob, stride_oq, stride_oh,
    query_length, key_length, extent, window, scaling,
    HEADS: tl.constexpr, GROUPS: tl.constexpr, DIM: tl.constexpr, BM: tl.constexpr, BN: tl.constexpr,
    HAS_PADDING: tl.constexpr, HAS_WINDOW: tl.constexpr, DOT_FP32: tl.constexpr,
):
    """grid (cdiv(Q, BM), batch * heads)."""
    m_block, pair = tl.program_id(0), tl.program_id(1)
    b, head = (pair // HEADS).to(tl.int64), pair % HEADS  # 64-bit offsets: a batch of long caches passes 2^31
    kv_head = head // GROUPS
    rows = m_block * BM + tl.arange(0, BM)
    row_ok = rows < query_length
    rows = tl.where(row_ok, rows, 0)
    dims = tl.arange(0, DIM)
    q = tl.load(q_ptr + b * stride_qb + head * stride_qh + rows[:, None] * stride_qq + dims[None, :],
                mask=row_ok[:, None], other=0.0)
    first_query, first_key = tl.load(qpos_ptr), tl.load(kpos_ptr)
    # key index of the key at query i's own position: i + offset (keys before it are visible); positions stay far
    # below 2^31, so distances are 32-bit (half the registers of the [BM, BN] distance tile)
    offset = (first_query - first_key).to(tl.int32)
    bias_rows = rl_ptr + b * stride_rb + head * stride_rh + rows * stride_rq
    k_base = k_ptr + b * stride_kb + kv_head * stride_kh
    v_base = v_ptr + b * stride_vb + kv_head * stride_vh

    # key blocks the block's rows can see: [last row's position - window + 1 (or 0), last row's position]
    block_first_row = m_block * BM
    high = tl.minimum(block_first_row + BM - 1 + offset + 1, key_length)
    low = 0
    if HAS_WINDOW:
        low = tl.maximum(block_first_row + offset - window + 1, 0)
    low = (low // BN) * BN

    m = tl.full((BM,), float("-inf"), dtype=tl.float32)
    l = tl.zeros((BM,), dtype=tl.float32)
    acc = tl.zeros((BM, DIM), dtype=tl.float32)
    for n0 in range(low, high, BN):
        cols = n0 + tl.arange(0, BN)
        col_ok = cols < key_length
        k = tl.load(k_base + cols[:, None] * stride_kk + dims[None, :], mask=col_ok[:, None], other=0.0)
        scores = tile_scores(q, k, DOT_FP32) * scaling
        distance = (rows + offset)[:, None] - cols[None, :]
        visible = visible_keys(distance, row_ok, cols, col_ok, pad_ptr + b * stride_pb, window, HAS_WINDOW,
                               HAS_PADDING)
        # the tile's smallest distance: its first row against its last key; beyond the extent there is no bias
        if block_first_row + offset - (n0 + BN - 1) < extent:
            bias = tl.load(bias_rows[:, None] + distance, mask=visible & (distance < extent), other=0.0)
            scores = scores + bias.to(tl.float32)
        scores = tl.where(visible, scores, float("-inf"))
        v = tl.load(v_base + cols[:, None] * stride_vk + dims[None, :], mask=col_ok[:, None], other=0.0)
        m, l, acc = online_softmax_step(scores, v, m, l, acc, DOT_FP32)

    sink = tl.load(sink_ptr + b * stride_sb + head * stride_sh + rows * stride_sq).to(tl.float32)
    top = tl.maximum(m, sink)
    scale = tl.exp(m - top)  # 0 for a row without visible keys: all its mass goes to the sink
    out = acc * scale[:, None] / (l * scale + tl.exp(sink - top))[:, None]
    destination = out_ptr + b * stride_ob + rows[:, None] * stride_oq + head * stride_oh + dims[None, :]
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
        HAS_PADDING=key_padding is not None, HAS_WINDOW=sliding_window is not None, DOT_FP32=fp32,
        num_warps=8, num_stages=3,
    )  # fmt: skip
    return output


prefill_attention.register_fake(attention_output_like)


__all__ = ["prefill_attention", "supports"]
