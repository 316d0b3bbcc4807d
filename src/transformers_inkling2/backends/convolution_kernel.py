"""A prompt's short convolution (`convolution.short_convolution_sum`) as one hand-written Triton kernel.

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

import torch
import triton
import triton.language as tl


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


__all__ = ["short_convolution"]
