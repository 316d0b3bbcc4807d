"""A decode step's attention-residual mix and the RMS norms after it, in two Triton launches split over the hidden
width (`residual_mix`; after a sublayer's output joins the partial block, `residual_mix_after_sublayer`), for
`backends/residual_mix.py`.

The mix of a token is a softmax over its stack (the completed blocks, then the RMS-normalized partial block), and the
norm after it needs the mix's sum of squares: two reductions over the whole width before a single output channel is
known. A program per token walking the width (the first version of this kernel) leaves all but one SM idle and took
16 to 92 us a mix on an H200, more than inductor's reductions below batch 64 (docs/dev/benchmark-history.md); here both
reductions come from one set of sums, so the width splits over programs with one launch boundary between them:
1. `_mix_statistics_kernel`, a program per batch row, chunk of channels (`CHUNK`; `WIDE_CHUNK` from `WIDE_FROM_ROWS`
   rows of batch x tokens) and token of the step: the partial block (as given, or with a sublayer's output added: the
   post-attention convolution computed here over the static cache's ring, `convolution_kernel._step_sum`, for all of
   the step's tokens in every token's program since a token's reads the earlier ones, rounded to the output's dtype
   as the module returns it; token 0's program writes the step's inputs into the ring and the new partial block in
   fp32), then the token's Gram matrix of the stack over the chunk, G[i, j] = s_i . s_j, and every query's dot product
   with each entry (one row reduction per entry), stored per chunk.
2. `_mix_kernel`, the same grid: each program adds the chunks' sums up (every program of a row in the same order, so
   to the same numbers), scales the partial block's row and column of G by its RMS scale, takes each query's softmax
   over the stack and the mix's sum of squares as w^T G w, then writes its channels of each mix, RMS-normalized,
   times its norm's weight, in the output dtype; in a layer that opens a block also its channels of the stack
   (`with_block`).
The arithmetic is the reference's (`Inkling2BlockAttentionResidual`, `Inkling2RMSNorm`) in fp32 with correctly rounded
means, square roots and divisions, in another order: sums over the width by chunk, the normalized partial block's dot
products as the partial's times its scale, and the mix's sum of squares as w^T G w (the weights are a softmax, so
positive: no cancellation beyond the stack's own). Imported only where the kernel runs.
"""

from __future__ import annotations

import math
from typing import Optional

import torch
import triton
import triton.language as tl

from .convolution_kernel import _step_sum
from .dependent_launch import dependent_launch
from .dependent_launch_kernel import release_successor, wait_for_predecessor

# Channels per program: hidden 4,608 in 18 chunks. On an H200 the fastest or within 1 us of 128 and 512 at batch 1 and
# 8; from 24 rows (batch x tokens) 512 is faster, by 1-7 us a mix on an H100 at 24-64 (at 16 within 1 us either way;
# `benchmarks/residual_mix.py --chunks 256 512 --batches ...`, docs/dev/benchmark-history.md).
CHUNK, WIDE_CHUNK, WIDE_FROM_ROWS = 256, 512, 24
NUM_WARPS = 4
BLOCK_EPS = tl.constexpr(1e-6)  # `with_block`'s RMS norm of the partial block (a constexpr: the kernel reads it)
NO_ADDEND, GIVEN_ADDEND, CONVOLVED_ADDEND = 0, 1, 2


# kernel signatures and pointer arithmetic read better packed
# fmt: off
@triton.jit
def _blocks_tile(blocks_row, stride_bn, stride_bc, chans, chan_ok, NUM_BLOCKS: tl.constexpr, BLOCK_M: tl.constexpr):
    """One token's completed blocks over a chunk, [BLOCK_M, BLOCK_C] fp32 in rows 0..NUM_BLOCKS - 1, zeros below."""
    ms = tl.arange(0, BLOCK_M)[:, None]
    return tl.load(blocks_row + ms * stride_bn + chans[None, :] * stride_bc,
                   mask=(ms < NUM_BLOCKS) & chan_ok[None, :], other=0.0)


@triton.jit
def _with_partial(blocks, partial, NUM_BLOCKS: tl.constexpr, BLOCK_M: tl.constexpr):
    """The stack over a chunk: `_blocks_tile`'s blocks with the partial block [BLOCK_C] (not yet normalized) in row
    NUM_BLOCKS."""
    ms = tl.arange(0, BLOCK_M)[:, None]
    return blocks + tl.where(ms == NUM_BLOCKS, partial[None, :], 0.0)


@triton.jit
def _mix_statistics_kernel(
    partial_ptr, addend_ptr, mask_ptr, ring_ptr, history_slots_ptr, history_held_ptr, write_slots_ptr,
    conv_weight_ptr, blocks_ptr, queries_ptr, new_partial_ptr, products_ptr, hidden, chunks, divisor,
    stride_pb, stride_pt, stride_pc, stride_ab, stride_at, stride_ac, stride_mb, stride_mt, stride_rb, stride_rc,
    stride_rs, stride_wc, stride_wk, stride_bb, stride_bt, stride_bn, stride_bc, stride_qq, stride_qc,
    TOKENS: tl.constexpr, NUM_BLOCKS: tl.constexpr, QUERIES: tl.constexpr, ADDEND: tl.constexpr,
    HAS_PARTIAL: tl.constexpr, KERNEL_SIZE: tl.constexpr, HAS_MASK: tl.constexpr, BLOCK_T: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_C: tl.constexpr, PDL: tl.constexpr,
):
    """grid (batch, chunks, TOKENS). For token t and chunk k of BLOCK_C channels: products[b, t, k, n, m] = entry_n .
    row_m over the chunk for the stack's entries n (NUM_BLOCKS completed blocks, then the partial block) and the rows
    m of [the stack's entries, the queries]: the stack's Gram matrix and the queries' dot products in one. The partial
    block is partial[b, t] (HAS_PARTIAL) plus the addend (ADDEND 1: addend[b, t] as given; 2: the step convolution of
    addend over the ring, rounded to its dtype, which every token's program computes for all of the step's tokens: a
    token's reads the earlier ones), stored in new_partial[b] by token 0's program when there is an addend."""
    wait_for_predecessor(PDL)
    b = tl.program_id(0).to(tl.int64)
    chunk = tl.program_id(1)
    t = tl.program_id(2)
    chans = chunk * BLOCK_C + tl.arange(0, BLOCK_C)
    chan_ok = chans < hidden
    if ADDEND != 0:  # the new partial block of every token, this one's row kept
        tokens = tl.arange(0, BLOCK_T)
        ok = (tokens < TOKENS)[:, None] & chan_ok[None, :]
        if HAS_PARTIAL:
            partials = tl.load(partial_ptr + b * stride_pb + tokens[:, None] * stride_pt + chans[None, :] * stride_pc,
                               mask=ok, other=0.0).to(tl.float32)
        else:
            partials = tl.zeros([BLOCK_T, BLOCK_C], dtype=tl.float32)
        if ADDEND == 1:
            addend = tl.load(addend_ptr + b * stride_ab + tokens[:, None] * stride_at + chans[None, :] * stride_ac,
                             mask=ok, other=0.0)
            partials = partials + addend.to(tl.float32)
        if ADDEND == 2:
            ring_rows = ring_ptr + b * stride_rb + chans[None, :] * stride_rc
            convolved, ring_inputs, write = _step_sum(
                addend_ptr + b * stride_ab + chans[None, :] * stride_ac, stride_at, mask_ptr + b * stride_mb,
                stride_mt, ring_rows, stride_rs, conv_weight_ptr + chans[None, :] * stride_wc, stride_wk,
                history_slots_ptr, history_held_ptr, write_slots_ptr, chan_ok[None, :], divisor, TOKENS, KERNEL_SIZE,
                HAS_MASK, BLOCK_T)
            partials = partials + convolved.to(addend_ptr.dtype.element_ty).to(tl.float32)
            # other tokens' programs read the ring's history meanwhile: no race, the kernel runs only on steps whose
            # tokens and history fit the ring together (`StepSlots.reads_ring`), so the write slots are others
            tl.store(ring_rows + write[:, None] * stride_rs, ring_inputs, mask=ok & (t == 0))
        tl.store(new_partial_ptr + (b * TOKENS + tokens[:, None]) * hidden + chans[None, :], partials,
                 mask=ok & (t == 0))
        partial = tl.sum(tl.where(tokens[:, None] == t, partials, 0.0), 0)
    else:
        partial = tl.load(partial_ptr + b * stride_pb + t * stride_pt + chans * stride_pc, mask=chan_ok,
                          other=0.0).to(tl.float32)
    # the queries in the rows after the stack's
    ms = tl.arange(0, BLOCK_M)
    query_rows = ms[:, None] - (NUM_BLOCKS + 1)
    queries = tl.load(queries_ptr + query_rows * stride_qq + chans[None, :] * stride_qc,
                      mask=(query_rows >= 0) & (query_rows < QUERIES) & chan_ok[None, :], other=0.0).to(tl.float32)
    blocks_row = blocks_ptr + b * stride_bb + t * stride_bt
    blocks = _blocks_tile(blocks_row, stride_bn, stride_bc, chans, chan_ok, NUM_BLOCKS, BLOCK_M)
    rows = _with_partial(blocks, partial, NUM_BLOCKS, BLOCK_M) + queries
    slot = ((b * TOKENS + t) * chunks + chunk) * BLOCK_M
    for n in tl.static_range(NUM_BLOCKS + 1):
        if n < NUM_BLOCKS:
            entry = tl.load(blocks_row + n * stride_bn + chans * stride_bc, mask=chan_ok, other=0.0)
        else:
            entry = partial
        tl.store(products_ptr + (slot + n) * BLOCK_M + ms, tl.sum(rows * entry[None, :], 1))
    release_successor(PDL)


@triton.jit
def _mix_kernel(
    stream_ptr, blocks_ptr, products_ptr, norm0_ptr, norm1_ptr, norm2_ptr, out_ptr, stack_ptr, hidden, chunks,
    logit_divisor, eps, stride_sb, stride_st, stride_sc, stride_bb, stride_bt, stride_bn, stride_bc, stride_oq,
    stride_ob, stride_ot, TOKENS: tl.constexpr, NUM_BLOCKS: tl.constexpr, QUERIES: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_C: tl.constexpr, BLOCK_K: tl.constexpr, STORE_STACK: tl.constexpr,
    PDL: tl.constexpr,
):
    """grid (batch, chunks, TOKENS). out[q, b, t] over this chunk's channels = norm_q(sum_n softmax_n(stack[n] .
    query_q / logit_divisor) stack[n]) in out's dtype, stack = [blocks[b, t, 0..NUM_BLOCKS), rms_normalize(stream[b,
    t])], from `_mix_statistics_kernel`'s products, added up over the chunks (in the same order by every program).
    norm_q(x) = norm_q_weight * x / sqrt(mean(x^2) + eps). STORE_STACK (a layer that opens a block): the stack itself
    goes to stack[b, t] [NUM_BLOCKS + 1, H] fp32 (`with_block`)."""
    wait_for_predecessor(PDL)
    b = tl.program_id(0).to(tl.int64)
    chans = tl.program_id(1) * BLOCK_C + tl.arange(0, BLOCK_C)
    t = tl.program_id(2)
    chan_ok = chans < hidden
    ms = tl.arange(0, BLOCK_M)
    ks = tl.arange(0, BLOCK_K)
    entry_ok = ms <= NUM_BLOCKS
    values = tl.arange(0, BLOCK_M * BLOCK_M)
    chunk_products = tl.load(products_ptr + ((b * TOKENS + t) * chunks + ks[:, None]) * (BLOCK_M * BLOCK_M)
                             + values[None, :],
                             mask=(ks < chunks)[:, None] & (values < (NUM_BLOCKS + 1) * BLOCK_M)[None, :], other=0.0)
    # every load at once, before the reductions (the compiler does not move a load past their barriers)
    partial = tl.load(stream_ptr + b * stride_sb + t * stride_st + chans * stride_sc, mask=chan_ok, other=0.0)
    blocks = _blocks_tile(blocks_ptr + b * stride_bb + t * stride_bt, stride_bn, stride_bc, chans, chan_ok, NUM_BLOCKS,
                          BLOCK_M)
    norm_weights0 = tl.load(norm0_ptr + chans, mask=chan_ok, other=0.0).to(tl.float32)
    norm_weights1 = tl.load(norm1_ptr + chans, mask=chan_ok & (QUERIES > 1), other=0.0).to(tl.float32)
    norm_weights2 = tl.load(norm2_ptr + chans, mask=chan_ok & (QUERIES > 2), other=0.0).to(tl.float32)
    release_successor(PDL)
    products = tl.reshape(tl.sum(chunk_products, 0), (BLOCK_M, BLOCK_M))  # [entry n, row m]
    # the partial block's RMS scale (`with_block`) on its row and column
    partial_entry = (ms[:, None] == NUM_BLOCKS) & (ms[None, :] == NUM_BLOCKS)
    square_sum = tl.sum(tl.sum(tl.where(partial_entry, products, 0.0), 1), 0)
    zero = tl.zeros_like(square_sum)
    block_scale = tl.div_rn(zero + 1.0, tl.sqrt_rn(tl.div_rn(square_sum, zero + hidden) + BLOCK_EPS))
    scales = tl.where(ms == NUM_BLOCKS, block_scale, 1.0)
    products = products * scales[:, None] * scales[None, :]
    gram = tl.where(entry_ok[None, :], products, 0.0)
    stack = _with_partial(blocks, partial.to(tl.float32), NUM_BLOCKS, BLOCK_M) * scales[:, None]
    if STORE_STACK:
        stack_rows = stack_ptr + ((b * TOKENS + t) * (NUM_BLOCKS + 1) + ms[:, None]) * hidden + chans[None, :]
        tl.store(stack_rows, stack, mask=entry_ok[:, None] & chan_ok[None, :])
    for q in tl.static_range(QUERIES):
        # the query's softmax over the stack, its mix's sum of squares as w^T G w, the mix normalized
        dots = tl.sum(tl.where(ms[None, :] == NUM_BLOCKS + 1 + q, products, 0.0), 1)
        logits = tl.where(entry_ok, tl.div_rn(dots, tl.zeros_like(dots) + logit_divisor), float("-inf"))
        exponents = tl.exp(logits - tl.max(logits, 0))
        weights = tl.div_rn(exponents, tl.zeros_like(exponents) + tl.sum(exponents, 0))
        mix_square_sum = tl.sum(tl.sum(weights[:, None] * gram * weights[None, :], 1), 0)
        zero = tl.zeros_like(mix_square_sum)
        norm_scale = tl.div_rn(zero + 1.0, tl.sqrt_rn(tl.div_rn(mix_square_sum, zero + hidden) + eps))
        mixed = tl.sum(weights[:, None] * stack, 0)
        norm_weight = norm_weights0 if q == 0 else (norm_weights1 if q == 1 else norm_weights2)
        destination = out_ptr + q * stride_oq + b * stride_ob + t * stride_ot + chans
        tl.store(destination, (norm_weight * (mixed * norm_scale)).to(out_ptr.dtype.element_ty), mask=chan_ok)


# fmt: on
def _launch(partial, addend, token_mask, ring, step_slots, conv_weight, divisor, blocks, queries, norm_weights, eps,
            dtype, mode, opens_block=False):  # fmt: skip
    """Checks the shapes, launches both kernels; returns (out [Q, batch, T, H] in dtype, new partial [batch, T, H]
    fp32, written where there is an addend, the stack [batch, T, n + 1, H] fp32, written where `opens_block`)."""
    like = addend if partial is None else partial
    batch, length, hidden = like.shape
    num_blocks = blocks.shape[2]
    count = queries.shape[0]
    if blocks.shape[:2] != (batch, length) or blocks.shape[3] != hidden or queries.shape[1] != hidden:
        raise ValueError(
            f"Expected blocks [batch, T, n, H] and queries [Q, H] for a partial block {tuple(like.shape)}, got "
            f"{tuple(blocks.shape)} and {tuple(queries.shape)}."
        )
    if count not in (1, 3) or len(norm_weights) != count or any(w.shape != (hidden,) for w in norm_weights):
        raise ValueError(f"Expected 1 or 3 queries, each with a norm weight [{hidden}], got {count} queries.")
    if any(not w.is_contiguous() for w in norm_weights):
        raise ValueError("Expected contiguous norm weights.")
    if addend is not None and addend.shape != like.shape:
        raise ValueError(f"Expected the sublayer's output {tuple(like.shape)}, got {tuple(addend.shape)}.")
    if mode != NO_ADDEND and count != 1:
        raise ValueError(f"A sublayer's output joins the partial block before one query's mix, got {count} queries.")
    block_m = triton.next_power_of_2(num_blocks + 1 + count)  # the stack's entries, then the queries
    block_c = min(triton.next_power_of_2(hidden), WIDE_CHUNK if batch * length >= WIDE_FROM_ROWS else CHUNK)
    chunks = triton.cdiv(hidden, block_c)
    out = like.new_empty((count, batch, length, hidden), dtype=dtype)
    new_partial = like.new_empty((batch, length, hidden) if addend is not None else (0,), dtype=torch.float32)
    stack = like.new_empty((batch, length, num_blocks + 1, hidden) if opens_block else (0,), dtype=torch.float32)
    products = like.new_empty((batch, length, chunks, block_m, block_m), dtype=torch.float32)
    kernel_size, history_slots, history_held, write_slots = 1, None, None, None
    if mode == CONVOLVED_ADDEND:
        history_slots, history_held, write_slots = step_slots
        kernel_size = conv_weight.shape[-1]
        if ring.shape[:2] != (batch, hidden) or conv_weight.shape[0] != hidden or write_slots.numel() != length:
            raise ValueError(
                f"Expected a ring [batch, H, slots], a weight [H, k] and T write slots for {tuple(like.shape)}, got "
                f"{tuple(ring.shape)}, {tuple(conv_weight.shape)} and {write_slots.numel()}."
            )
        if history_slots.numel() != kernel_size - 1 or history_held.numel() != kernel_size - 1:
            raise ValueError(f"Expected {kernel_size - 1} history slots for a {kernel_size}-tap convolution.")
    unused = blocks  # a pointer for the arguments this mode leaves unread
    mask, mask_strides = (unused, (0, 0)) if token_mask is None else (token_mask, token_mask.stride())
    partial_ = unused if partial is None else partial
    partial_strides = (0, 0, 0) if partial is None else partial.stride()
    addend_ = unused if addend is None else addend
    addend_strides = (0, 0, 0) if addend is None else addend.stride()
    ring_ = unused if ring is None else ring
    ring_strides = (0, 0, 0) if ring is None else ring.stride()
    weight_ = unused if conv_weight is None else conv_weight
    weight_strides = (0, 0) if conv_weight is None else conv_weight.stride()
    pdl = dependent_launch(like)
    shared = dict(TOKENS=length, NUM_BLOCKS=num_blocks, QUERIES=count, BLOCK_M=block_m, BLOCK_C=block_c, PDL=pdl,
                  num_warps=NUM_WARPS, enable_fp_fusion=False, launch_pdl=pdl)
    _mix_statistics_kernel[(batch, chunks, length)](
        partial_, addend_, mask, ring_, unused if history_slots is None else history_slots,
        unused if history_held is None else history_held, unused if write_slots is None else write_slots, weight_,
        blocks, queries, new_partial, products, hidden, chunks, divisor, *partial_strides, *addend_strides,
        *mask_strides, *ring_strides, *weight_strides, *blocks.stride(), *queries.stride(), ADDEND=mode,
        HAS_PARTIAL=partial is not None, KERNEL_SIZE=kernel_size, HAS_MASK=token_mask is not None,
        BLOCK_T=triton.next_power_of_2(length), **shared,
    )  # fmt: skip
    # the partial block the mixes read: the new one where a sublayer's output joined it
    stream, stream_strides = (new_partial, new_partial.stride()) if addend is not None else (partial, partial_strides)
    norms = [*norm_weights, *norm_weights[:1] * (3 - count)]
    _mix_kernel[(batch, chunks, length)](
        stream, blocks, products, *norms, out, stack, hidden, chunks, math.sqrt(hidden), eps, *stream_strides,
        *blocks.stride(), *out.stride()[:3], BLOCK_K=triton.next_power_of_2(chunks), STORE_STACK=opens_block, **shared,
    )  # fmt: skip
    return out, new_partial, stack


@torch.library.custom_op("inkling2::residual_mix", mutates_args=())
def residual_mix(
    partial: torch.Tensor, blocks: torch.Tensor, queries: torch.Tensor, norm_weights: list[torch.Tensor], eps: float,
    dtype: torch.dtype, opens_block: bool = False,
) -> tuple[torch.Tensor, torch.Tensor]:
    """A sublayer's normalized inputs from the stream, in two launches: for each query q, `norm_q(mix_q(blocks,
    partial)).to(dtype)`. partial [batch, T, H] (any float dtype); blocks [batch, T, n, H] fp32 (the completed
    blocks, RMS-normalized); queries [Q, H] (Q = 1 or 3), norm_weights Q tensors [H]. Returns ([Q, batch, T, H], the
    stack `with_block(blocks, partial)` [batch, T, n + 1, H] fp32 where `opens_block`, else an empty tensor). A
    custom op: the compiled decode steps call it as it is."""  # fmt: skip
    out, _, stack = _launch(partial, None, None, None, None, None, 1.0, blocks, queries, norm_weights, eps, dtype,
                            NO_ADDEND, opens_block)  # fmt: skip
    return out, stack


@residual_mix.register_fake
def _(partial, blocks, queries, norm_weights, eps, dtype, opens_block=False):
    stack_shape = (*blocks.shape[:2], blocks.shape[2] + 1, blocks.shape[3]) if opens_block else (0,)
    return partial.new_empty((queries.shape[0], *partial.shape), dtype=dtype), blocks.new_empty(stack_shape)


@torch.library.custom_op("inkling2::residual_mix_after_sublayer", mutates_args=("ring",))
def residual_mix_after_sublayer(
    partial: Optional[torch.Tensor],  # noqa: UP045  (the custom op's schema is inferred from these annotations)
    output: torch.Tensor,
    token_mask: Optional[torch.Tensor],  # noqa: UP045
    ring: Optional[torch.Tensor],  # noqa: UP045
    history_slots: Optional[torch.Tensor],  # noqa: UP045
    history_held: Optional[torch.Tensor],  # noqa: UP045
    write_slots: Optional[torch.Tensor],  # noqa: UP045
    conv_weight: Optional[torch.Tensor],  # noqa: UP045
    divisor: float,
    blocks: torch.Tensor,
    queries: torch.Tensor,
    norm_weights: list[torch.Tensor],
    eps: float,
    dtype: torch.dtype,
) -> tuple[torch.Tensor, torch.Tensor]:
    """`residual_mix` after a sublayer's output joins the partial block: partial + output (or output alone where
    partial is None, a layer that opens a block), where output is either the sublayer's convolved output as given
    (ring None) or its output before the short convolution, which is then computed over the static cache's ring
    (ring [batch, H, slots] fp32, history_slots / history_held [k - 1] and write_slots [T]: the step's `StepSlots`,
    conv_weight [H, k] fp32, divisor sqrt(k + 1); token_mask [batch, T] or None), the step's inputs written into the
    ring. Returns (the normalized inputs [Q, batch, T, H] in dtype, the new partial block [batch, T, H] fp32)."""
    convolved = ring is not None
    slots = (history_slots, history_held, write_slots) if convolved else None
    return _launch(partial, output, token_mask, ring, slots, conv_weight, divisor, blocks, queries, norm_weights, eps,
                   dtype, CONVOLVED_ADDEND if convolved else GIVEN_ADDEND)[:2]  # fmt: skip


@residual_mix_after_sublayer.register_fake
def _(partial, output, token_mask, ring, history_slots, history_held, write_slots, conv_weight, divisor, blocks,
      queries, norm_weights, eps, dtype):  # fmt: skip
    out = output.new_empty((queries.shape[0], *output.shape), dtype=dtype)
    return out, output.new_empty(output.shape, dtype=torch.float32)


__all__ = ["residual_mix", "residual_mix_after_sublayer"]
