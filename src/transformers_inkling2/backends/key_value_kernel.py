"""A layer's decode-step keys and values in one Triton launch (`key_value_step`), for `backends/key_value_step.py`.

A program owns one kv head of one batch row: it convolves the head's key channels and its value channels over the
step (`convolution_kernel._step_sum`, the step convolution's arithmetic), rounds each to the projections' dtype as
the convolution module returns it, L2-clips the keys and RMS-normalizes the values per token
(`decode_kernel.l2_clipped`; the norm with a correctly rounded mean, square root and division), and writes the step's
inputs into both convolution rings and its keys and values into the attention buffers at the step's slots. The
head's first program of each row also writes the slots' validity, and row 0's the positions the slots now hold: the
whole of `Inkling2StaticLayerCache.write` for the step. A full layer's dynamic convolutions add each token's own
taps (projected from the layer input) to the static ones. Imported only where the kernel runs.
"""

from __future__ import annotations

from typing import Optional

import torch
import triton
import triton.language as tl

from .attention.decode_kernel import l2_clipped
from .convolution_kernel import NUM_WARPS, _step_sum
from .dependent_launch import dependent_launch
from .dependent_launch_kernel import release_successor, wait_for_predecessor


# fmt: off
@triton.jit
def _key_value_step_kernel(
    key_ptr, value_ptr, mask_ptr, key_ring_ptr, value_ring_ptr, history_slots_ptr, history_held_ptr, conv_write_ptr,
    key_weight_ptr, value_weight_ptr, key_taps_ptr, value_taps_ptr, keys_ptr, values_ptr, key_valid_ptr,
    slot_positions_ptr, slots_ptr, positions_ptr, divisor, threshold, eps, stride_kb, stride_kt, stride_kc, stride_vb,
    stride_vt, stride_vc, stride_mb, stride_mt, stride_rb, stride_rc, stride_rs, stride_wc, stride_wk, stride_tb,
    stride_tt, stride_tl, stride_cb, stride_ch, stride_cs, stride_ab, stride_as, TOKENS: tl.constexpr,
    KERNEL_SIZE: tl.constexpr, HEAD_DIM: tl.constexpr, HAS_MASK: tl.constexpr, HAS_TOKEN_TAPS: tl.constexpr,
    BLOCK_T: tl.constexpr, PDL: tl.constexpr,
):
    """grid (kv_heads, batch). Keys: l2_clip(conv_k(key states)) and values: rms_norm(conv_v(value states)) of the
    program's head and row, each convolution `(sum_j context[t + j] weight[j] + x[t]) / divisor` over its ring; the
    two rings share their strides, weights and step slots, as the keys' and values' cache buffers do. HAS_TOKEN_TAPS
    (a full layer): weight[j] adds each token's tap of its head ([batch, T, kv_heads * k], as the weights by lag)."""
    wait_for_predecessor(PDL)
    head = tl.program_id(0)
    b = tl.program_id(1).to(tl.int64)
    dims = tl.arange(0, HEAD_DIM)
    chans = head * HEAD_DIM + dims
    chan_ok = (chans >= 0)[None, :]  # every channel: the heads tile the width exactly
    mask_row = mask_ptr + b * stride_mb
    key_ring_rows = key_ring_ptr + b * stride_rb + chans[None, :] * stride_rc
    value_ring_rows = value_ring_ptr + b * stride_rb + chans[None, :] * stride_rc
    tokens = tl.arange(0, BLOCK_T)
    # the weights of tap j: static [1, HEAD_DIM] and per token [BLOCK_T, 1], by lag (k - 1 - j) for a full layer
    first, stride_j, stride_tj = 0, stride_wk, 0
    if HAS_TOKEN_TAPS:
        first, stride_j, stride_tj = (KERNEL_SIZE - 1) * stride_wk, -stride_wk, -stride_tl
    token_taps = b * stride_tb + tokens[:, None] * stride_tt + (head * KERNEL_SIZE + KERNEL_SIZE - 1) * stride_tl
    key, key_inputs, write = _step_sum(
        key_ptr + b * stride_kb + chans[None, :] * stride_kc, stride_kt, mask_row, stride_mt, key_ring_rows,
        stride_rs, key_weight_ptr + first + chans[None, :] * stride_wc, stride_j, history_slots_ptr,
        history_held_ptr, conv_write_ptr, chan_ok, divisor, TOKENS, KERNEL_SIZE, HAS_MASK, BLOCK_T,
        key_taps_ptr + token_taps, stride_tj, HAS_TOKEN_TAPS)
    value, value_inputs, _ = _step_sum(
        value_ptr + b * stride_vb + chans[None, :] * stride_vc, stride_vt, mask_row, stride_mt, value_ring_rows,
        stride_rs, value_weight_ptr + first + chans[None, :] * stride_wc, stride_j, history_slots_ptr,
        history_held_ptr, conv_write_ptr, chan_ok, divisor, TOKENS, KERNEL_SIZE, HAS_MASK, BLOCK_T,
        value_taps_ptr + token_taps, stride_tj, HAS_TOKEN_TAPS)
    token_ok = tokens < TOKENS
    slots = tl.load(slots_ptr + tokens, mask=token_ok, other=0)
    positions = tl.load(positions_ptr + tokens, mask=token_ok, other=0)
    if HAS_MASK:
        valid = tl.load(mask_row + tokens * stride_mt, mask=token_ok, other=0) != 0
    else:
        valid = token_ok
    release_successor(PDL)

    # the convolutions' outputs in the projections' dtype, as the modules return them, then the per-token clip / norm
    key = l2_clipped(key.to(key_ptr.dtype.element_ty).to(tl.float32), threshold)
    value = value.to(value_ptr.dtype.element_ty).to(tl.float32)
    square_sum = tl.sum(value * value, 1)
    mean_square = tl.div_rn(square_sum, tl.zeros_like(square_sum) + HEAD_DIM)
    value = value * tl.div_rn(tl.zeros_like(square_sum) + 1.0, tl.sqrt_rn(mean_square + eps))[:, None]

    ok = token_ok[:, None] & chan_ok
    tl.store(key_ring_rows + write[:, None] * stride_rs, key_inputs, mask=ok)
    tl.store(value_ring_rows + write[:, None] * stride_rs, value_inputs, mask=ok)
    cached = b * stride_cb + head * stride_ch + slots[:, None] * stride_cs + dims[None, :]
    tl.store(keys_ptr + cached, key.to(keys_ptr.dtype.element_ty), mask=ok)
    tl.store(values_ptr + cached, value.to(values_ptr.dtype.element_ty), mask=ok)
    tl.store(key_valid_ptr + b * stride_ab + slots * stride_as, valid, mask=token_ok & (head == 0))
    tl.store(slot_positions_ptr + slots, positions, mask=token_ok & (head == 0) & (b == 0))


# fmt: on
@torch.library.custom_op(
    "inkling2::key_value_step",
    mutates_args=("key_ring", "value_ring", "keys", "values", "key_valid", "slot_positions"),
)
def key_value_step(
    key_states: torch.Tensor,
    value_states: torch.Tensor,
    token_mask: Optional[torch.Tensor],  # noqa: UP045  (the custom op's schema is inferred from this annotation)
    key_ring: torch.Tensor,
    value_ring: torch.Tensor,
    history_slots: torch.Tensor,
    history_held: torch.Tensor,
    conv_write: torch.Tensor,
    key_weight: torch.Tensor,
    value_weight: torch.Tensor,
    divisor: float,
    threshold: float,
    eps: float,
    keys: torch.Tensor,
    values: torch.Tensor,
    key_valid: torch.Tensor,
    slot_positions: torch.Tensor,
    slots: torch.Tensor,
    positions: torch.Tensor,
    key_taps: Optional[torch.Tensor] = None,  # noqa: UP045
    value_taps: Optional[torch.Tensor] = None,  # noqa: UP045
) -> None:
    """A layer's step keys and values, computed and cached in one launch. key_states / value_states [batch, T,
    kv_heads * D] (the raw projections); token_mask [batch, T] or None; key_ring / value_ring [batch, kv_heads * D,
    conv slots] fp32, history_slots / history_held [k - 1] and conv_write [T]: the step convolutions' rings and the
    step's `StepSlots`; key_weight / value_weight [kv_heads * D, k]: a sliding layer's in conv1d's order (tap k - 1
    meets the token itself), fp32; divisor sqrt(k + 1); threshold: the keys' L2 clip; eps: the values' RMS norm;
    keys / values [batch, kv_heads, slots, D], key_valid [batch, slots], slot_positions [slots]: the attention
    buffers; slots / positions [T]: the step's slots in them and its positions. A full layer's dynamic convolutions
    also pass key_taps / value_taps [batch, T, kv_heads * k] (each token's taps per head), and then the weights and
    taps are by lag (0: the token itself) as `Inkling2DynamicShortConvolution` holds them, and divisor sqrt(2k + 1).
    A custom op: the compiled decode steps call it as it is."""
    batch, length, width = key_states.shape
    kv_heads, head_dim = keys.shape[1], keys.shape[-1]
    kernel_size = key_weight.shape[-1]
    if (key_taps is None) != (value_taps is None):
        raise ValueError("Expected per-token taps for both the keys and the values, or for neither.")
    if key_taps is not None and (key_taps.shape != (batch, length, kv_heads * kernel_size)
                                 or value_taps.stride() != key_taps.stride()):  # fmt: skip
        raise ValueError(
            f"Expected key and value taps [batch, T, kv_heads * k] = {(batch, length, kv_heads * kernel_size)} of one "
            f"layout, got {tuple(key_taps.shape)} and {tuple(value_taps.shape)}."
        )
    if value_states.shape != key_states.shape or width != kv_heads * head_dim or head_dim & (head_dim - 1):
        raise ValueError(
            f"Expected key and value states [batch, T, kv_heads * D] with D a power of two for the cache's "
            f"{tuple(keys.shape)}, got {tuple(key_states.shape)} and {tuple(value_states.shape)}."
        )
    if key_ring.shape[:2] != (batch, width) or value_ring.stride() != key_ring.stride():
        raise ValueError(f"Expected two rings [batch, {width}, slots] of one layout, got {tuple(key_ring.shape)}.")
    if value_weight.stride() != key_weight.stride() or values.stride() != keys.stride() or keys.stride(-1) != 1:
        raise ValueError("Expected the keys' and values' weights, and their cache buffers, in one layout each.")
    if history_slots.numel() != kernel_size - 1 or conv_write.numel() != length or slots.numel() != length:
        raise ValueError(f"Expected {kernel_size - 1} history slots and {length} ring slots of each kind.")
    mask, mask_strides = (key_states, (0, 0)) if token_mask is None else (token_mask, token_mask.stride())
    taps = (key_states, value_states, (0, 0, 0)) if key_taps is None else (key_taps, value_taps, key_taps.stride())
    pdl = dependent_launch(key_states)
    _key_value_step_kernel[(kv_heads, batch)](
        key_states, value_states, mask, key_ring, value_ring, history_slots, history_held, conv_write, key_weight,
        value_weight, *taps[:2], keys, values, key_valid, slot_positions, slots, positions, divisor, threshold, eps,
        *key_states.stride(), *value_states.stride(), *mask_strides, *key_ring.stride(), *key_weight.stride(),
        *taps[2], *keys.stride()[:3], *key_valid.stride(), TOKENS=length, KERNEL_SIZE=kernel_size, HEAD_DIM=head_dim,
        HAS_MASK=token_mask is not None, HAS_TOKEN_TAPS=key_taps is not None, BLOCK_T=triton.next_power_of_2(length),
        PDL=pdl, num_warps=NUM_WARPS, enable_fp_fusion=False, launch_pdl=pdl,
    )  # fmt: skip


@key_value_step.register_fake
def _(key_states, value_states, token_mask, key_ring, value_ring, history_slots, history_held, conv_write,
      key_weight, value_weight, divisor, threshold, eps, keys, values, key_valid, slot_positions, slots,
      positions, key_taps=None, value_taps=None):  # fmt: skip
    return None


__all__ = ["key_value_step"]
