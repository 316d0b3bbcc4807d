"""A prompt's short convolution (`convolution.short_convolution_sum`) as one hand-written Triton kernel, and a decode
step's, which also reads and writes its inputs' ring in the static cache.

`torch.compile` made the same single kernel, but traced and compiled it again in every fresh process: about 12 s
before the first long prefill (issue #27). Triton compiles this kernel once per dtype, kernel size and stride
pattern and keeps the binary in its on-disk cache, so a later process only loads it.

A program owns BLOCK_T tokens x BLOCK_C channels of one batch row. x and the output are [batch, T, C] with channels
contiguous; a prompt's context is time-major (`cache.common.join_convolution_context`), so its k shifted rows are
contiguous along channels too, and the k - 1 rows that neighbouring taps share come from L1/L2 rather than HBM.
Strides are read, never assumed: a channel-major context is correct, only slower. The arithmetic is the PyTorch
sum's, step for step in fp32: tap 0's product, then each further product added in tap order, mul and add rounded
separately (FMA contraction off), the residual added, a correctly rounded division. Offsets are 64-bit: a batch of
long prompts passes 2^31 elements (131,072 tokens x 4,608 channels is 6e8 per row). Imported only when a CUDA
tensor takes the fused path (triton is not a CPU dependency).
"""

from __future__ import annotations

from typing import Optional

import torch
import triton
import triton.language as tl

from .dependent_launch import dependent_launch
from .dependent_launch_kernel import release_successor, wait_for_predecessor


# Measured on an H200 (bf16 x, 4,608 channels; fastest of 20 shapes from 4 x 512 to 128 x 64 tokens x channels, 2 to 8
# warps): 92 us at 8k tokens, 1.29 ms at 131k, 86-87% of a plain copy's bandwidth counting each byte once; tiles
# of 256+ channels or 32+ tokens ran 15-50% slower.
BLOCK_T = 16
BLOCK_C = 128
NUM_WARPS = 4


# kernel signatures and pointer arithmetic read better packed
# fmt: off
@triton.jit(do_not_specialize=["length"])  # one binary for every prompt length
def _short_convolution_kernel(
    context_ptr, x_ptr, weight_ptr, out_ptr, length, channels, divisor, stride_cb, stride_cc, stride_ct,
    stride_xb, stride_xt, stride_xc, stride_wc, stride_wk, KERNEL_SIZE: tl.constexpr, BLOCK_T: tl.constexpr,
    BLOCK_C: tl.constexpr,
):
    """grid (cdiv(T, BLOCK_T), cdiv(C, BLOCK_C), batch): out[b, t, c] = (sum_j context[b, c, t + j] weight[c, j]
    + x[b, t, c]) / divisor for the tile's tokens t and channels c; out is contiguous [batch, T, C]."""
    b = tl.program_id(2).to(tl.int64)
    tokens = tl.program_id(0).to(tl.int64) * BLOCK_T + tl.arange(0, BLOCK_T)
    chans = tl.program_id(1).to(tl.int64) * BLOCK_C + tl.arange(0, BLOCK_C)
    token_ok, chan_ok = tokens < length, chans < channels
    ok = token_ok[:, None] & chan_ok[None, :]
    rows = context_ptr + b * stride_cb + tokens[:, None] * stride_ct + chans[None, :] * stride_cc
    taps = weight_ptr + chans * stride_wc
    acc = tl.load(rows, mask=ok, other=0.0) * tl.load(taps, mask=chan_ok, other=0.0)[None, :]
    for tap in tl.static_range(1, KERNEL_SIZE):
        weight = tl.load(taps + tap * stride_wk, mask=chan_ok, other=0.0)
        acc = acc + tl.load(rows + tap * stride_ct, mask=ok, other=0.0) * weight[None, :]
    x = tl.load(x_ptr + b * stride_xb + tokens[:, None] * stride_xt + chans[None, :] * stride_xc, mask=ok, other=0.0)
    out = tl.div_rn(acc + x.to(tl.float32), divisor)
    destination = out_ptr + (b * length + tokens[:, None]) * channels + chans[None, :]
    tl.store(destination, out.to(out_ptr.dtype.element_ty), mask=ok)


# fmt: on
def short_convolution(context: torch.Tensor, x: torch.Tensor, weight: torch.Tensor, divisor: float) -> torch.Tensor:
    """`short_convolution_sum` in one launch, same arguments: context [batch, C, T + k - 1] fp32 in any layout, x
    [batch, T, C], weight [C, k] fp32 (the taps are unrolled: `convolution.runs_fused` sends at most
    `MAX_KERNEL_SIZE`). Returns a contiguous [batch, T, C] in x's dtype."""
    batch, length, channels = x.shape
    kernel_size = weight.shape[-1]
    if context.shape != (batch, channels, length + kernel_size - 1) or weight.shape[0] != channels:
        raise ValueError(
            f"Expected context [batch, C, T + k - 1] and weight [C, k] for x {tuple(x.shape)}, got "
            f"{tuple(context.shape)} and {tuple(weight.shape)}."
        )
    out = torch.empty_like(x, memory_format=torch.contiguous_format)
    grid = (triton.cdiv(length, BLOCK_T), triton.cdiv(channels, BLOCK_C), batch)
    _short_convolution_kernel[grid](
        context, x, weight, out, length, channels, divisor, *context.stride(), *x.stride(), *weight.stride(),
        KERNEL_SIZE=kernel_size, BLOCK_T=BLOCK_T, BLOCK_C=BLOCK_C, num_warps=NUM_WARPS, enable_fp_fusion=False,
    )
    return out


# fmt: off
@triton.jit
def _step_context(i, chan_ok, x_rows, stride_xt, mask_row, stride_mt, ring_rows, stride_rs, history_slots_ptr,
                  history_held_ptr, HISTORY: tl.constexpr, TOKENS: tl.constexpr, HAS_MASK: tl.constexpr):
    """Rows i [BLOCK_T] of a step's context over a tile's channels (x_rows, ring_rows: [1, BLOCK_C] pointers to
    the batch row's channels): for i < HISTORY the ring's input at history_slots[i] times history_held[i] (the
    cache's `StepSlots`), else the step's input i - HISTORY times its token mask (padding never enters a
    convolution)."""
    from_ring = i < HISTORY
    from_step = (i >= HISTORY) & (i < HISTORY + TOKENS)
    slot = tl.load(history_slots_ptr + i, mask=from_ring, other=0)
    held = tl.load(history_held_ptr + i, mask=from_ring, other=0).to(tl.float32)
    ring = tl.load(ring_rows + slot[:, None] * stride_rs, mask=from_ring[:, None] & chan_ok, other=0.0)
    t = i - HISTORY
    x = tl.load(x_rows + t[:, None] * stride_xt, mask=from_step[:, None] & chan_ok, other=0.0).to(tl.float32)
    if HAS_MASK:
        x = x * tl.load(mask_row + t * stride_mt, mask=from_step, other=0).to(tl.float32)[:, None]
    return tl.where(from_ring[:, None], ring * held[:, None], x)


@triton.jit
def _tap(taps, stride_wk, token_taps, stride_tk, tap, chan_ok, token_ok, HAS_TOKEN_TAPS: tl.constexpr):
    """Weight `tap` of the tile: the channels' static weight in fp32 [1, BLOCK_C], plus with HAS_TOKEN_TAPS each
    token's own [BLOCK_T, 1] (a full layer's dynamic convolution, the sum in fp32 as the reference's)."""
    weight = tl.load(taps + tap * stride_wk, mask=chan_ok, other=0.0).to(tl.float32)
    if HAS_TOKEN_TAPS:
        weight = weight + tl.load(token_taps + tap * stride_tk, mask=token_ok[:, None], other=0.0).to(tl.float32)
    return weight


@triton.jit
def _step_sum(x_rows, stride_xt, mask_row, stride_mt, ring_rows, stride_rs, taps, stride_wk, history_slots_ptr,
              history_held_ptr, write_slots_ptr, chan_ok, divisor, TOKENS: tl.constexpr, KERNEL_SIZE: tl.constexpr,
              HAS_MASK: tl.constexpr, BLOCK_T: tl.constexpr, token_taps=None, stride_tk=0,
              HAS_TOKEN_TAPS: tl.constexpr = False):
    """A step's convolution over a tile's channels (x_rows, ring_rows, taps: [1, BLOCK_C] pointers to the batch
    row's channels and their weights; token_taps: [BLOCK_T, 1] pointers to each token's weight 0, `_tap`): (out
    [BLOCK_T, BLOCK_C] = (sum_j context[t + j] weight[j] + x[t]) / divisor in fp32, the step's masked inputs that go
    into the ring, their ring slots). Loads only: the caller stores, after releasing its successor."""
    tokens = tl.arange(0, BLOCK_T)
    token_ok = tokens < TOKENS
    rows = _step_context(tokens, chan_ok, x_rows, stride_xt, mask_row, stride_mt, ring_rows, stride_rs,
                         history_slots_ptr, history_held_ptr, KERNEL_SIZE - 1, TOKENS, HAS_MASK)
    acc = rows * _tap(taps, stride_wk, token_taps, stride_tk, 0, chan_ok, token_ok, HAS_TOKEN_TAPS)
    for tap in tl.static_range(1, KERNEL_SIZE):
        rows = _step_context(tokens + tap, chan_ok, x_rows, stride_xt, mask_row, stride_mt, ring_rows, stride_rs,
                             history_slots_ptr, history_held_ptr, KERNEL_SIZE - 1, TOKENS, HAS_MASK)
        acc = acc + rows * _tap(taps, stride_wk, token_taps, stride_tk, tap, chan_ok, token_ok, HAS_TOKEN_TAPS)
    # the last tap's rows (offset k - 1 = the history's length) are the step's own masked inputs: the ring's new ones
    x = tl.load(x_rows + tokens[:, None] * stride_xt, mask=token_ok[:, None] & chan_ok, other=0.0)
    write = tl.load(write_slots_ptr + tokens, mask=token_ok, other=0)
    return tl.div_rn(acc + x.to(tl.float32), divisor), rows, write


@triton.jit
def _summed_terms(terms_ptr, ids_ptr, x_ptr, b, chans, chan_ok, rows, channels, num_experts, TOKENS: tl.constexpr,
                  ROUTES: tl.constexpr, PARTS: tl.constexpr, BLOCK_T: tl.constexpr, BLOCK_C: tl.constexpr):
    """x[b, t, chans] (x contiguous [batch, TOKENS, C]) = the terms of token n = b * TOKENS + t (terms [PARTS, rows,
    ROUTES, C] fp32, ids [rows, ROUTES]) added in route order, each route's parts in order, skipping routes to ids
    outside [0, num_experts), rounded to bf16 and then to x's dtype: the experts' combine, sum for sum, and the
    experts' output as the model takes it."""
    tokens = tl.arange(0, BLOCK_T)
    token_ok = tokens < TOKENS
    n = b * TOKENS + tokens
    total = tl.zeros((BLOCK_T, BLOCK_C), dtype=tl.float32)
    for route in tl.static_range(ROUTES):
        expert = tl.load(ids_ptr + n * ROUTES + route, mask=token_ok, other=-1)
        routed = (token_ok & (expert >= 0) & (expert < num_experts))[:, None] & chan_ok
        for part in tl.static_range(PARTS):
            term_rows = terms_ptr + ((part * rows + n) * ROUTES + route)[:, None] * channels
            total += tl.load(term_rows + chans[None, :], mask=routed, other=0.0)
    destination = x_ptr + n[:, None] * channels + chans[None, :]
    tl.store(destination, total.to(tl.bfloat16).to(x_ptr.dtype.element_ty), mask=token_ok[:, None] & chan_ok)


@triton.jit
def _step_convolution_kernel(
    x_ptr, mask_ptr, ring_ptr, history_slots_ptr, history_held_ptr, write_slots_ptr, weight_ptr, residual_ptr,
    out_ptr, terms_ptr, ids_ptr, channels, divisor, routed_rows, num_experts, stride_xb, stride_xt, stride_xc,
    stride_mb, stride_mt, stride_rb, stride_rc, stride_rs, stride_wc, stride_wk, stride_eb, stride_et, stride_ec,
    TOKENS: tl.constexpr, KERNEL_SIZE: tl.constexpr, HAS_MASK: tl.constexpr, HAS_RESIDUAL: tl.constexpr,
    ROUTES: tl.constexpr, PARTS: tl.constexpr, BLOCK_T: tl.constexpr, BLOCK_C: tl.constexpr, PDL: tl.constexpr,
):
    """grid (cdiv(C, BLOCK_C), batch): out[b, t, c] = (sum_j context[t + j, c] weight[c, j] + x[b, t, c]) / divisor
    for the step's TOKENS tokens (`_step_context` rows), the sum in the prompt kernel's order (HAS_RESIDUAL: rounded
    to out's dtype, then added to residual[b, t, c] in fp32); then the step's masked inputs go into the ring at
    write_slots, after every read of it (the step's history slots are others). ROUTES > 0: x is first written here,
    the experts' terms added up (`_summed_terms`), and read back after a barrier (the convolution reads other
    threads' values of it)."""
    wait_for_predecessor(PDL)
    b = tl.program_id(1).to(tl.int64)
    chans = tl.program_id(0) * BLOCK_C + tl.arange(0, BLOCK_C)
    chan_ok = (chans < channels)[None, :]
    if ROUTES > 0:
        _summed_terms(terms_ptr, ids_ptr, x_ptr, b, chans, chan_ok, routed_rows, channels, num_experts, TOKENS, ROUTES,
                      PARTS, BLOCK_T, BLOCK_C)
        tl.debug_barrier()
    x_rows = x_ptr + b * stride_xb + chans[None, :] * stride_xc
    ring_rows = ring_ptr + b * stride_rb + chans[None, :] * stride_rc
    out, rows, write = _step_sum(x_rows, stride_xt, mask_ptr + b * stride_mb, stride_mt, ring_rows, stride_rs,
                                 weight_ptr + chans[None, :] * stride_wc, stride_wk, history_slots_ptr,
                                 history_held_ptr, write_slots_ptr, chan_ok, divisor, TOKENS, KERNEL_SIZE, HAS_MASK,
                                 BLOCK_T)
    tokens = tl.arange(0, BLOCK_T)
    ok = (tokens < TOKENS)[:, None] & chan_ok
    if HAS_RESIDUAL:
        residual = tl.load(residual_ptr + b * stride_eb + tokens[:, None] * stride_et + chans[None, :] * stride_ec,
                           mask=ok, other=0.0)
        out = residual.to(tl.float32) + out.to(out_ptr.dtype.element_ty).to(tl.float32)
    release_successor(PDL)
    tl.store(out_ptr + (b * TOKENS + tokens[:, None]) * channels + chans[None, :], out.to(out_ptr.dtype.element_ty),
             mask=ok)
    tl.store(ring_rows + write[:, None] * stride_rs, rows, mask=ok)


# fmt: on
@torch.library.custom_op("inkling2::step_convolution", mutates_args=("ring",))
def step_convolution(
    x: torch.Tensor,
    token_mask: Optional[torch.Tensor],  # noqa: UP045  (the custom op's schema is inferred from this annotation)
    ring: torch.Tensor,
    history_slots: torch.Tensor,
    history_held: torch.Tensor,
    write_slots: torch.Tensor,
    weight: torch.Tensor,
    divisor: float,
    residual: Optional[torch.Tensor] = None,  # noqa: UP045
    terms: Optional[torch.Tensor] = None,  # noqa: UP045
    expert_ids: Optional[torch.Tensor] = None,  # noqa: UP045
    num_experts: int = 0,
) -> torch.Tensor:
    """A decode step's `(conv(context) + x) / divisor` in one launch, reading its context from the static cache's
    ring and writing the step's inputs into it (what `Inkling2StaticLayerCache.convolution_context` and the
    module's `F.conv1d` do in several). x [batch, T, C]; token_mask [batch, T] or None; ring [batch, C, slots] fp32;
    history_slots / history_held [k - 1] and write_slots [T], the step's `StepSlots`; weight [C, k] fp32; residual
    [batch, T, C] or None: added (in fp32) to the output rounded to x's dtype, as a decoder layer ends. Returns a
    contiguous [batch, T, C] in x's dtype. A custom op: the compiled decode steps call it as it is.

    With `terms` (the routed experts' output as its terms, `RouteTerms`: fp32 [parts, batch * T, top_k, C], and
    expert_ids [batch * T, top_k]) the step's input is their sum, which the same launch makes first, as the experts'
    combine would (route order, each route's parts in order, routes to ids outside [0, num_experts) skipped, rounded
    to bf16, then to x's dtype): the combine's launch and its output's round trip go. x then gives the input's shape
    and dtype only (the MoE's input): its values are not read."""
    batch, length, channels = x.shape
    if terms is not None:
        parts, routed_rows, routes, _ = terms.shape
        expected = (batch * length, routes, channels)
        if expert_ids is None or expert_ids.shape != (routed_rows, routes) or terms.shape[1:] != expected:
            raise ValueError(
                f"Expected terms [parts, batch * T, top_k, C] and expert ids [batch * T, top_k] for an input "
                f"{tuple(x.shape)}, got {tuple(terms.shape)} and "
                f"{None if expert_ids is None else tuple(expert_ids.shape)}."
            )
        x = torch.empty_like(x, memory_format=torch.contiguous_format)  # the sum: the kernel writes it and reads it
        terms, expert_ids = terms.contiguous(), expert_ids.contiguous()
    else:
        parts, routed_rows, routes = 1, 0, 0
        terms = expert_ids = x  # placeholders, never read
    kernel_size = weight.shape[-1]
    if ring.shape[:2] != (batch, channels) or weight.shape[0] != channels or write_slots.numel() != length:
        raise ValueError(
            f"Expected ring [batch, C, slots], weight [C, k] and T write slots for x {tuple(x.shape)}, got "
            f"{tuple(ring.shape)}, {tuple(weight.shape)} and {write_slots.numel()}."
        )
    if history_slots.numel() != kernel_size - 1 or history_held.numel() != kernel_size - 1:
        raise ValueError(f"Expected {kernel_size - 1} history slots for a {kernel_size}-tap convolution.")
    if residual is not None and residual.shape != x.shape:
        raise ValueError(f"Expected a residual {tuple(x.shape)}, got {tuple(residual.shape)}.")
    out = torch.empty_like(x, memory_format=torch.contiguous_format)
    mask, mask_strides = (x, (0, 0)) if token_mask is None else (token_mask, token_mask.stride())
    added, added_strides = (x, (0, 0, 0)) if residual is None else (residual, residual.stride())
    pdl = dependent_launch(x)
    _step_convolution_kernel[(triton.cdiv(channels, BLOCK_C), batch)](
        x, mask, ring, history_slots, history_held, write_slots, weight, added, out, terms, expert_ids, channels,
        divisor, routed_rows, num_experts, *x.stride(), *mask_strides, *ring.stride(), *weight.stride(), *added_strides,
        TOKENS=length, KERNEL_SIZE=kernel_size, HAS_MASK=token_mask is not None, HAS_RESIDUAL=residual is not None,
        ROUTES=routes, PARTS=parts, BLOCK_T=triton.next_power_of_2(length), BLOCK_C=BLOCK_C, PDL=pdl,
        num_warps=NUM_WARPS, enable_fp_fusion=False, launch_pdl=pdl,
    )  # fmt: skip
    return out


@step_convolution.register_fake
def _(x, token_mask, ring, history_slots, history_held, write_slots, weight, divisor, residual=None, terms=None,
      expert_ids=None, num_experts=0):  # fmt: skip
    return torch.empty_like(x, memory_format=torch.contiguous_format)


__all__ = ["short_convolution", "step_convolution"]
