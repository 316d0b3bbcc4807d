"""A decode step's attention-residual mix and the RMS norms after it, in one Triton launch (`residual_mix`; after a
sublayer's output joins the partial block, `residual_mix_after_sublayer`), for `backends/residual_mix.py`.

A program owns one token of one batch row (and all of the step's tokens, at most `MAX_STEP_TOKENS`, where it
convolves: the convolution reads the earlier ones), and walks the hidden width in chunks of at most `TILE` values (a
one-token step of one query: 4,096 channels at a time) three times:
1. the partial block: as given, or with a sublayer's output added (the post-attention convolution computed here over
   the static cache's ring, `convolution_kernel._step_sum`, and rounded to the output's dtype as the module returns
   it; the step's inputs written into the ring), stored in fp32; with it, its sum of squares and every query's dot
   product with it and with each completed block;
2. the softmax over the blocks (the partial's logit scaled by its RMS norm), then the sum of squares of each query's
   mix;
3. each mix again, RMS-normalized, times its norm's weight, rounded to the output dtype and stored; in a layer that
   opens a block, the stack it mixed too (the completed blocks, then the normalized partial block: `with_block`).
The arithmetic is the reference's (`Inkling2BlockAttentionResidual`, `Inkling2RMSNorm`) in fp32, with correctly
rounded means, square roots and divisions, FMA contraction off; two sums run in another order: a dot product with the
normalized partial is taken as its dot product with the partial times its norm's scale, and the chunks add up in
chunk order. Imported only where the kernel runs.
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

# A pass over the width is a chain of dependent loads and reductions in one program, so its chunks are few and wide:
# a [rows, channels] tile of at most TILE fp32 values (half that where the first pass convolves: its k taps' rows are
# held at once), never narrower than MIN_BLOCK_C channels. The widest tiles that compile without spilled registers
# inside the loops, for sm_90a and sm_100a, at every specialization the model launches (tests/backends/
# test_kernel_targets.py reads the SASS).
TILE = 4096
MIN_BLOCK_C = 128
NUM_WARPS = 8
BLOCK_EPS = tl.constexpr(1e-6)  # `with_block`'s RMS norm of the partial block (a constexpr: the kernel reads it)
NO_ADDEND, GIVEN_ADDEND, CONVOLVED_ADDEND = 0, 1, 2


# kernel signatures and pointer arithmetic read better packed
# fmt: off
@triton.jit
def _entry_weights(weights, ns, n):
    """Each row's weight of stack entry n: [BLOCK_R, 1] of weights [BLOCK_R, BLOCK_N]."""
    return tl.sum(tl.where(ns == n, weights, 0.0), 1)[:, None]


@triton.jit
def _chunk_mixes(start, hidden, row_ok, stream_rows, stride_sc, block_scale, weights, blocks_rows, stride_bn,
                 stride_bc, ns, stack_rows, store_ok, NUM_BLOCKS: tl.constexpr, BLOCK_C: tl.constexpr,
                 STORE_STACK: tl.constexpr):
    """(channels [BLOCK_C], their mask [BLOCK_R, BLOCK_C], each row's mix over them [BLOCK_R, BLOCK_C]):
    sum_n weights[:, n] entry_n, the partial block (read at `stream_rows`, times its RMS scale) last, the products
    added in the stack's order. STORE_STACK: the stack's entries, as read, also go to `stack_rows` (contiguous
    [NUM_BLOCKS + 1, H] per row; the rows of `store_ok` only)."""
    chans = start + tl.arange(0, BLOCK_C)
    ok = row_ok[:, None] & (chans < hidden)[None, :]
    partial = tl.load(stream_rows + chans[None, :] * stride_sc, mask=ok, other=0.0).to(tl.float32)
    normalized = partial * block_scale[:, None]
    if STORE_STACK:
        tl.store(stack_rows + NUM_BLOCKS * hidden + chans[None, :], normalized, mask=ok & store_ok[:, None])
    mixed = _entry_weights(weights, ns, NUM_BLOCKS) * normalized
    if NUM_BLOCKS > 0:
        block = tl.load(blocks_rows + chans[None, :] * stride_bc, mask=ok, other=0.0)
        if STORE_STACK:
            tl.store(stack_rows + chans[None, :], block, mask=ok & store_ok[:, None])
        mixed_blocks = _entry_weights(weights, ns, 0) * block
        for n in tl.static_range(1, NUM_BLOCKS):
            block = tl.load(blocks_rows + n * stride_bn + chans[None, :] * stride_bc, mask=ok, other=0.0)
            if STORE_STACK:
                tl.store(stack_rows + n * hidden + chans[None, :], block, mask=ok & store_ok[:, None])
            mixed_blocks = mixed_blocks + _entry_weights(weights, ns, n) * block
        mixed = mixed_blocks + mixed
    return chans, ok, mixed


@triton.jit
def _residual_mix_kernel(
    partial_ptr, addend_ptr, mask_ptr, ring_ptr, history_slots_ptr, history_held_ptr, write_slots_ptr,
    conv_weight_ptr, blocks_ptr, queries_ptr, norm0_ptr, norm1_ptr, norm2_ptr, out_ptr, new_partial_ptr, stack_ptr,
    hidden,
    divisor, logit_divisor, eps, stride_pb, stride_pt, stride_pc, stride_ab, stride_at, stride_ac, stride_mb,
    stride_mt, stride_rb, stride_rc, stride_rs, stride_wc, stride_wk, stride_bb, stride_bt, stride_bn, stride_bc,
    stride_qq, stride_qc, stride_oq, stride_ob, stride_ot, TOKENS: tl.constexpr, NUM_BLOCKS: tl.constexpr,
    QUERIES: tl.constexpr, ADDEND: tl.constexpr, HAS_PARTIAL: tl.constexpr, KERNEL_SIZE: tl.constexpr,
    HAS_MASK: tl.constexpr, BLOCK_T: tl.constexpr, BLOCK_Q: tl.constexpr, BLOCK_N: tl.constexpr,
    BLOCK_C: tl.constexpr, STORE_STACK: tl.constexpr, PDL: tl.constexpr,
):
    """grid (batch, token blocks of BLOCK_T). out[q, b, t] = norm_q(sum_n softmax_n(stack[n] . query_q / logit_divisor)
    stack[n]) in out's dtype, stack = [blocks[b, t, 0..NUM_BLOCKS), rms_normalize(partial)]; partial = partial[b, t]
    (HAS_PARTIAL) plus the addend (ADDEND 1: addend[b, t] as given; 2: the step convolution of addend over the ring,
    rounded to its dtype), stored in new_partial[b, t] when there is an addend (then with one query; where it convolves,
    the step's tokens in one block: the convolution reads the earlier ones). norm_q(x) = norm_q_weight * x /
    sqrt(mean(x^2) + eps). STORE_STACK (a layer that opens a block): the stack itself goes to stack[b, t] [NUM_BLOCKS
    + 1, H] fp32, the completed blocks with the normalized partial block after them (`with_block`). Row r of every
    tile is the block's token r // BLOCK_Q and query r % BLOCK_Q."""
    wait_for_predecessor(PDL)
    b = tl.program_id(0).to(tl.int64)
    rows = tl.arange(0, BLOCK_T * BLOCK_Q)
    tokens, qs = tl.program_id(1) * BLOCK_T + rows // BLOCK_Q, rows % BLOCK_Q
    row_ok = (tokens < TOKENS) & (qs < QUERIES)
    ns = tl.arange(0, BLOCK_N)[None, :]
    blocks_rows = blocks_ptr + b * stride_bb + tokens[:, None] * stride_bt
    partial_rows = partial_ptr + b * stride_pb + tokens[:, None] * stride_pt
    new_partial_rows = new_partial_ptr + (b * TOKENS + tokens[:, None]) * hidden
    query_rows = queries_ptr + qs[:, None] * stride_qq
    stack_rows = stack_ptr + (b * TOKENS + tokens[:, None]) * (NUM_BLOCKS + 1) * hidden

    # 1. the partial block (stored where it changes), its sum of squares, the queries' dot products with the stack
    square_sum = tl.zeros([BLOCK_T * BLOCK_Q], dtype=tl.float32)
    dots = tl.zeros([BLOCK_T * BLOCK_Q, BLOCK_N], dtype=tl.float32)
    for start in range(0, hidden, BLOCK_C):
        chans = start + tl.arange(0, BLOCK_C)
        chan_ok = chans < hidden
        ok = row_ok[:, None] & chan_ok[None, :]
        if HAS_PARTIAL:
            partial = tl.load(partial_rows + chans[None, :] * stride_pc, mask=ok, other=0.0).to(tl.float32)
        else:
            partial = tl.zeros([BLOCK_T * BLOCK_Q, BLOCK_C], dtype=tl.float32)
        if ADDEND == 1:
            addend = tl.load(addend_ptr + b * stride_ab + tokens[:, None] * stride_at + chans[None, :] * stride_ac,
                             mask=ok, other=0.0)
            partial = partial + addend.to(tl.float32)
        if ADDEND == 2:  # one query: the rows are the tokens, as the convolution's
            ring_rows = ring_ptr + b * stride_rb + chans[None, :] * stride_rc
            convolved, ring_inputs, write = _step_sum(
                addend_ptr + b * stride_ab + chans[None, :] * stride_ac, stride_at, mask_ptr + b * stride_mb,
                stride_mt, ring_rows, stride_rs, conv_weight_ptr + chans[None, :] * stride_wc, stride_wk,
                history_slots_ptr, history_held_ptr, write_slots_ptr, chan_ok[None, :], divisor, TOKENS, KERNEL_SIZE,
                HAS_MASK, BLOCK_T)
            partial = partial + convolved.to(addend_ptr.dtype.element_ty).to(tl.float32)
            tl.store(ring_rows + write[:, None] * stride_rs, ring_inputs, mask=ok)
        if ADDEND != 0:
            tl.store(new_partial_rows + chans[None, :], partial, mask=ok)
        square_sum += tl.sum(partial * partial, 1)
        queries = tl.load(query_rows + chans[None, :] * stride_qc, mask=ok, other=0.0).to(tl.float32)
        dots += tl.where(ns == NUM_BLOCKS, tl.sum(partial * queries, 1)[:, None], 0.0)
        for n in tl.static_range(NUM_BLOCKS):
            block = tl.load(blocks_rows + n * stride_bn + chans[None, :] * stride_bc, mask=ok, other=0.0)
            dots += tl.where(ns == n, tl.sum(block * queries, 1)[:, None], 0.0)

    # the partial block's RMS scale (`with_block`), then the softmax over the stack
    block_scale = tl.div_rn(tl.zeros_like(square_sum) + 1.0,
                            tl.sqrt_rn(tl.div_rn(square_sum, tl.zeros_like(square_sum) + hidden) + BLOCK_EPS))
    dots = tl.where(ns == NUM_BLOCKS, dots * block_scale[:, None], dots)
    logits = tl.where(ns <= NUM_BLOCKS, tl.div_rn(dots, tl.zeros_like(dots) + logit_divisor), float("-inf"))
    exponents = tl.exp(logits - tl.max(logits, 1)[:, None])
    weights = tl.div_rn(exponents, tl.sum(exponents, 1)[:, None])
    if ADDEND != 0:
        tl.debug_barrier()  # the partial block stored above is read back below, by other threads of the program

    # 2. each row's mix: its sum of squares
    if ADDEND != 0:
        stream_rows, stride_sc = new_partial_rows, 1
    else:
        stream_rows, stride_sc = partial_rows, stride_pc
    mix_square_sum = tl.zeros([BLOCK_T * BLOCK_Q], dtype=tl.float32)
    for start in range(0, hidden, BLOCK_C):
        _, _, mixed = _chunk_mixes(start, hidden, row_ok, stream_rows, stride_sc, block_scale, weights, blocks_rows,
                                   stride_bn, stride_bc, ns, stack_rows, qs == 0, NUM_BLOCKS, BLOCK_C, False)
        mix_square_sum += tl.sum(mixed * mixed, 1)
    norm_scale = tl.div_rn(tl.zeros_like(mix_square_sum) + 1.0,
                           tl.sqrt_rn(tl.div_rn(mix_square_sum, tl.zeros_like(mix_square_sum) + hidden) + eps))

    # 3. each mix again, normalized and weighted: the outputs
    destination_rows = out_ptr + qs[:, None] * stride_oq + b * stride_ob + tokens[:, None] * stride_ot
    for start in range(0, hidden, BLOCK_C):
        chans, ok, mixed = _chunk_mixes(start, hidden, row_ok, stream_rows, stride_sc, block_scale, weights,
                                        blocks_rows, stride_bn, stride_bc, ns, stack_rows, qs == 0, NUM_BLOCKS,
                                        BLOCK_C, STORE_STACK)
        norm_weight = tl.load(norm0_ptr + chans[None, :] + qs[:, None] * 0, mask=ok & (qs == 0)[:, None], other=0.0)
        if QUERIES > 1:
            norm_weight += tl.load(norm1_ptr + chans[None, :] + qs[:, None] * 0, mask=ok & (qs == 1)[:, None],
                                   other=0.0)
            norm_weight += tl.load(norm2_ptr + chans[None, :] + qs[:, None] * 0, mask=ok & (qs == 2)[:, None],
                                   other=0.0)
        normalized = norm_weight.to(tl.float32) * (mixed * norm_scale[:, None])
        tl.store(destination_rows + chans[None, :], normalized.to(out_ptr.dtype.element_ty), mask=ok)
    release_successor(PDL)  # after the last load: pass 3 reads its inputs to the end


# fmt: on
def _launch(partial, addend, token_mask, ring, step_slots, conv_weight, divisor, blocks, queries, norm_weights, eps,
            dtype, mode, opens_block=False):  # fmt: skip
    """Checks the shapes, launches the kernel; returns (out [Q, batch, T, H] in dtype, new partial [batch, T, H]
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
    out = like.new_empty((count, batch, length, hidden), dtype=dtype)
    new_partial = like.new_empty((batch, length, hidden) if addend is not None else (0,), dtype=torch.float32)
    stack = like.new_empty((batch, length, num_blocks + 1, hidden) if opens_block else (0,), dtype=torch.float32)
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
    norms = [*norm_weights, *norm_weights[:1] * (3 - count)]
    # a program per token (rows: its queries), but per batch row where a convolution spans the step's tokens
    convolves = mode == CONVOLVED_ADDEND
    block_t, block_q = (triton.next_power_of_2(length) if convolves else 1), triton.next_power_of_2(count)
    tile = TILE // 2 if convolves else TILE
    block_c = min(triton.next_power_of_2(hidden), max(MIN_BLOCK_C, tile // (block_t * block_q)))
    pdl = dependent_launch(like)
    _residual_mix_kernel[(batch, 1 if convolves else length)](
        partial_, addend_, mask, ring_, unused if history_slots is None else history_slots,
        unused if history_held is None else history_held, unused if write_slots is None else write_slots, weight_,
        blocks, queries, *norms, out, new_partial, stack, hidden, divisor, math.sqrt(hidden), eps, *partial_strides,
        *addend_strides, *mask_strides, *ring_strides, *weight_strides, *blocks.stride(), *queries.stride(),
        *out.stride()[:3], TOKENS=length, NUM_BLOCKS=num_blocks, QUERIES=count, ADDEND=mode,
        HAS_PARTIAL=partial is not None, KERNEL_SIZE=kernel_size, HAS_MASK=token_mask is not None,
        BLOCK_T=block_t, BLOCK_Q=block_q, BLOCK_N=triton.next_power_of_2(num_blocks + 1), BLOCK_C=block_c,
        STORE_STACK=opens_block, PDL=pdl, num_warps=NUM_WARPS, enable_fp_fusion=False, launch_pdl=pdl,
    )  # fmt: skip
    return out, new_partial, stack


@torch.library.custom_op("inkling2::residual_mix", mutates_args=())
def residual_mix(
    partial: torch.Tensor, blocks: torch.Tensor, queries: torch.Tensor, norm_weights: list[torch.Tensor], eps: float,
    dtype: torch.dtype, opens_block: bool = False,
) -> tuple[torch.Tensor, torch.Tensor]:
    """A sublayer's normalized inputs from the stream, in one launch: for each query q, `norm_q(mix_q(blocks,
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
