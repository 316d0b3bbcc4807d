"""Tile steps shared by the fused attention kernels (`attention_decode_kernel`, `attention_prefill_kernel`): the
scores of a key block, which keys each row sees, and the online-softmax update. Triton inlines them into each
kernel. Also the host-side preparation both share. Imported only with those kernels (triton is not a CPU
dependency)."""

import os

import torch
import triton
import triton.language as tl

# under Triton's interpreter (read by triton at import, like here) the MMAs run in fp32: its bf16 dot is unreliable
INTERPRETING = os.environ.get("TRITON_INTERPRET", "0") == "1"

# the kernels keep scores in base 2 (natural-log scores times log2 e) so that each exponential is one ex2
LOG2E = tl.constexpr(1.4426950408889634)


def kernel_inputs(query, key, value, relative_logits, key_padding):
    """(query, key, value, relative_logits, padding, fp32 MMAs?) as the kernels read them: unit stride on the last
    dimension (the other strides are passed), the padding mask as int8 (a placeholder pointer when there is none)."""
    query, key, value, relative_logits = (
        t if t.stride(-1) == 1 else t.contiguous() for t in (query, key, value, relative_logits)
    )
    padding = key_padding.to(torch.int8).contiguous() if key_padding is not None else query
    return query, key, value, relative_logits, padding, query.dtype == torch.float32 or INTERPRETING


@triton.jit
def tile_scores(q, k, DOT_FP32: tl.constexpr):
    """q [R, D] @ k [N, D]^T with fp32 accumulation; IEEE fp32 MMAs for fp32 inputs and under the interpreter (its
    bf16 dot is unreliable)."""
    if DOT_FP32:
        scores = tl.dot(q.to(tl.float32), tl.trans(k.to(tl.float32)), input_precision="ieee")
    else:
        scores = tl.dot(q, tl.trans(k))
    return scores


@triton.jit
def visible_keys(distance, row_ok, cols, col_ok, padding_row_ptr, window,
                 HAS_WINDOW: tl.constexpr, HAS_PADDING: tl.constexpr):
    """[R, N] True where a row may attend to a key: at a distance >= 0 (and < window), a real key of the row's batch
    entry (`padding_row_ptr[col]` != 0), rows and keys in range."""
    visible = (distance >= 0) & col_ok[None, :] & row_ok[:, None]
    if HAS_WINDOW:
        visible = visible & (distance < window)
    if HAS_PADDING:
        real = tl.load(padding_row_ptr + cols, mask=col_ok, other=0) != 0
        visible = visible & real[None, :]
    return visible


@triton.jit
def online_softmax_step(scores, v, m, l, acc, DOT_FP32: tl.constexpr):
    """Folds a tile of scores in base 2 (-inf where not visible) and its values [N, D] into the running max m (base
    2), sum l and unnormalized output acc of each row. Rows that have seen no key yet keep m = -inf, l = acc = 0."""
    m_new = tl.maximum(m, tl.max(scores, axis=1))
    m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
    p = tl.exp2(scores - m_safe[:, None])
    alpha = tl.exp2(m - m_safe)
    if DOT_FP32:
        values = tl.dot(p, v.to(tl.float32), input_precision="ieee")
    else:
        values = tl.dot(p.to(v.dtype), v)
    return m_new, l * alpha + tl.sum(p, axis=1), acc * alpha[:, None] + values


def attention_output_like(query, key, value, relative_logits, sinks, query_positions, key_positions, key_padding,
                          sliding_window, scaling):
    """What the fused attention ops return, for tracing (their `register_fake`): [B, Q, H, D] in the values' dtype."""
    batch, heads, queries, head_dim = query.shape
    return query.new_empty(batch, queries, heads, head_dim, dtype=value.dtype)
