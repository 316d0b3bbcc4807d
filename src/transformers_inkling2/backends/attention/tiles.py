"""Tile steps shared by the fused attention kernels (`decode_kernel`, `prefill_kernel`): the
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
    padding = query if key_padding is None else padding_bytes(key_padding)
    return query, key, value, relative_logits, padding, query.dtype == torch.float32 or INTERPRETING


def padding_bytes(key_padding: torch.Tensor) -> torch.Tensor:
    """[batch, keys] padding as int8 with unit stride along the keys: a bool mask (what the model and its caches
    pass, e.g. the static cache's `key_valid` at every decode step) is reinterpreted in place, its bytes already
    0 / 1; other dtypes are converted."""
    padding = key_padding.view(torch.int8) if key_padding.dtype == torch.bool else key_padding.to(torch.int8)
    return padding if padding.stride(-1) == 1 else padding.contiguous()


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


def reads_past_rows_in_bounds(relative_logits: torch.Tensor, block_m: int, block_n: int) -> bool:
    """Whether the buffer behind the relative logits extends at least `block_m` elements before the first and
    `block_m + block_n` after the last (`aligned_product` leaves such a guard): a tile reads its rows from
    d = 1 - block_m to at most extent + block_m + block_n - 3, so then no bias load needs a mask."""
    first = relative_logits.storage_offset()
    last = first + sum((size - 1) * stride for size, stride in zip(relative_logits.shape, relative_logits.stride()))
    stored = relative_logits.untyped_storage().nbytes() // relative_logits.element_size()
    return first >= block_m and stored - 1 - last >= block_m + block_n


def kernel_operands(query, key, value, relative_logits, sinks, query_positions, key_positions, key_padding):
    """(output, fp32 MMAs?, the arguments both prefill kernels begin with: pointers, then strides). The relative
    logits are passed one element past their start with a row pitch of their query stride + 1 (see _prefill_kernel):
    with the layout of `Inkling2RelativeLogits` that pointer and the pitch are 16-byte aligned."""
    batch, heads, queries, head_dim = query.shape
    query, key, value, relative_logits, padding, fp32 = kernel_inputs(query, key, value, relative_logits, key_padding)
    output = torch.empty(batch, queries, heads, head_dim, dtype=value.dtype, device=query.device)
    bias_origin = relative_logits.as_strided((1,), (1,), relative_logits.storage_offset() + 1)
    operands = (
        query, key, value, bias_origin, sinks, query_positions.contiguous(), key_positions.contiguous(), padding,
        output,
        query.stride(0), query.stride(1), query.stride(2), key.stride(0), key.stride(1), key.stride(2),
        value.stride(0), value.stride(1), value.stride(2),
        relative_logits.stride(0), relative_logits.stride(1), relative_logits.stride(2) + 1,
        sinks.stride(0), sinks.stride(1), sinks.stride(2), padding.stride(0),
        output.stride(0), output.stride(1), output.stride(2),
    )  # fmt: skip
    return output, fp32, operands
