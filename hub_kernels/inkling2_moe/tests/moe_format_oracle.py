"""The tests' own oracle for the weight formats, written from the formats' bit rules (independent of the kernel).

Every code decodes through a table built from its bit layout, not through torch's float8 casts or the kernel's
reference, and all arithmetic is fp32:

* MXFP8: `weight` float8_e4m3fn `[..., N, K]`, `scale` uint8 E8M0 `[..., N, K/32]`;
  value = e4m3(weight) * 2**(scale - 127).
* NVFP4: `packed` uint8 `[..., N, K/2]` (low nibble = even input), E2M1 codes; `block_scale` float8_e4m3fn
  `[..., N, K/16]`; fp32 outer multiplier `[...]`, `[..., 1]` or `[..., 2]` (gate half, up half of `[gate; up]`
  rows); value = e2m1(code) * e4m3(block_scale) * outer.

The quantizers only make test data (nearest-even rounding, no saturation of the block maximum).
"""

from __future__ import annotations

import torch

MXFP8_BLOCK, NVFP4_BLOCK = 32, 16
E4M3_MAX, E2M1_MAX = 448.0, 6.0


def _e2m1(code: int) -> float:
    """Sign bit 3, exponent bits 2-1 (bias 1), mantissa bit 0; exponent 0 is subnormal (m / 2)."""
    exponent, mantissa = (code >> 1) & 3, code & 1
    magnitude = mantissa / 2 if exponent == 0 else (1 + mantissa / 2) * 2.0 ** (exponent - 1)
    return -magnitude if code & 8 else magnitude


def _e4m3(byte: int) -> float:
    """E4M3 "fn": sign bit 7, exponent bits 6-3 (bias 7), mantissa bits 2-0; S.1111.111 is NaN, no infinity."""
    exponent, mantissa = (byte >> 3) & 15, byte & 7
    if exponent == 15 and mantissa == 7:
        return float("nan")
    magnitude = mantissa / 8 * 2.0**-6 if exponent == 0 else (1 + mantissa / 8) * 2.0 ** (exponent - 7)
    return -magnitude if byte & 0x80 else magnitude


def _e8m0(byte: int) -> float:
    """An unsigned biased exponent: 2**(byte - 127), 255 is NaN (0 is 2**-127, an fp32 subnormal)."""
    return float("nan") if byte == 255 else 2.0 ** (byte - 127)


E2M1_VALUES = torch.tensor([_e2m1(c) for c in range(16)], dtype=torch.float32)
E4M3_VALUES = torch.tensor([_e4m3(b) for b in range(256)], dtype=torch.float32)
E8M0_VALUES = torch.tensor([_e8m0(b) for b in range(256)], dtype=torch.float32)


def _lookup(table: torch.Tensor, data: torch.Tensor) -> torch.Tensor:
    raw = data if data.dtype == torch.uint8 else data.view(torch.uint8)
    return table.to(raw.device)[raw.to(torch.int32)]


def e2m1_decode(codes: torch.Tensor) -> torch.Tensor:
    """E2M1 codes (uint8 0-15, one per element) -> fp32."""
    assert codes.dtype == torch.uint8 and (codes.numel() == 0 or int(codes.max()) < 16)
    return _lookup(E2M1_VALUES, codes)


def e4m3_decode(t: torch.Tensor) -> torch.Tensor:
    return _lookup(E4M3_VALUES, t)


def _e4m3_encode(x: torch.Tensor) -> torch.Tensor:
    return x.float().clamp(-E4M3_MAX, E4M3_MAX).to(torch.float8_e4m3fn)  # nearest-even, saturating


def _e2m1_encode(x: torch.Tensor) -> torch.Tensor:
    """Nearest E2M1 code, ties to the even code, magnitudes above 6 saturate; -0 keeps its sign bit."""
    a = x.float().abs()
    # midpoints of 0, .5, 1, 1.5, 2, 3, 4, 6; at a tie ">" keeps the lower (even-coded) neighbour, ">=" the upper
    magnitude = ((a > 0.25).to(torch.uint8) + (a >= 0.75) + (a > 1.25) + (a >= 1.75) + (a > 2.5) + (a >= 3.5)
                 + (a > 5.0)).to(torch.uint8)  # fmt: skip
    return magnitude | (torch.signbit(x).to(torch.uint8) << 3)


def _row_outer(outer: torch.Tensor, lead: tuple, rows: int) -> torch.Tensor:
    """The outer multiplier per weight row, `lead + (rows, 1)`: one per matrix, or per [gate; up] half."""
    outer = outer.float()
    if tuple(outer.shape) == lead + (2,):
        return outer.index_select(-1, torch.arange(rows, device=outer.device) // (rows // 2)).unsqueeze(-1)
    assert tuple(outer.shape) in (lead, lead + (1,)), (tuple(outer.shape), lead)
    return outer.reshape(lead + (1, 1)).expand(lead + (rows, 1))


def mxfp8_dequantize(weight, scale, dtype=torch.bfloat16, *, validate=True):
    k = weight.shape[-1]
    assert scale.shape == weight.shape[:-1] + (k // MXFP8_BLOCK,)
    if validate:
        assert not bool((scale.view(torch.uint8) == 255).any()), "E8M0 byte 255 (NaN)"
    values = _lookup(E4M3_VALUES, weight).unflatten(-1, (k // MXFP8_BLOCK, MXFP8_BLOCK))
    return (values * _lookup(E8M0_VALUES, scale).unsqueeze(-1)).flatten(-2).to(dtype)


def mxfp8_quantize(w: torch.Tensor):
    """-> (float8_e4m3fn weight, uint8 E8M0 scale): the smallest block exponent e with amax <= 448 * 2**e."""
    x = w.float()
    blocks = x.unflatten(-1, (x.shape[-1] // MXFP8_BLOCK, MXFP8_BLOCK))
    amax = blocks.abs().amax(-1)
    mantissa, power = torch.frexp(amax)  # amax = m * 2**p, m in [0.5, 1); 448 = 0.875 * 2**9
    exponent = (power - 9 + (mantissa > 0.875).to(power.dtype)).clamp(-127, 127)
    scale = (torch.where(amax > 0, exponent, torch.zeros_like(exponent)) + 127).to(torch.uint8)
    return _e4m3_encode(blocks / _lookup(E8M0_VALUES, scale).unsqueeze(-1)).flatten(-2), scale


def nvfp4_dequantize(packed, block_scale, outer, dtype=torch.bfloat16, *, validate=True):
    lead, rows, k = tuple(packed.shape[:-2]), packed.shape[-2], 2 * packed.shape[-1]
    assert block_scale.dtype == torch.float8_e4m3fn and block_scale.shape == packed.shape[:-1] + (k // NVFP4_BLOCK,)
    scale = e4m3_decode(block_scale)
    if validate:
        assert not bool(torch.isnan(scale).any() or (scale < 0).any()), "NaN or negative block scales"
    raw = packed.view(torch.uint8)
    codes = torch.stack([raw & 15, raw >> 4], dim=-1).flatten(-2)
    values = e2m1_decode(codes).unflatten(-1, (k // NVFP4_BLOCK, NVFP4_BLOCK)) * scale.unsqueeze(-1)
    return (values.flatten(-2) * _row_outer(outer, lead, rows).to(values.device)).to(dtype)


def nvfp4_quantize(w: torch.Tensor, *, per_half: bool = False):
    """-> (packed uint8, float8_e4m3fn block scales, fp32 outer [...] or [..., 2]); outer = amax / (448 * 6)."""
    x = w.float()
    lead, rows, k = tuple(x.shape[:-2]), x.shape[-2], x.shape[-1]
    row_amax = x.abs().amax(-1)
    amax = row_amax.unflatten(-1, (2, rows // 2)).amax(-1) if per_half else row_amax.amax(-1)
    outer = torch.where(amax > 0, amax / (E4M3_MAX * E2M1_MAX), torch.ones_like(amax))
    row_outer = _row_outer(outer, lead, rows)
    blocks = x.unflatten(-1, (k // NVFP4_BLOCK, NVFP4_BLOCK))
    block_scale = _e4m3_encode(blocks.abs().amax(-1) / E2M1_MAX / row_outer)
    step = (e4m3_decode(block_scale) * row_outer).unsqueeze(-1)
    nonzero = step > 0
    scaled = torch.where(nonzero, blocks / torch.where(nonzero, step, torch.ones_like(step)), torch.zeros_like(blocks))
    codes = _e2m1_encode(scaled.flatten(-2))
    return codes[..., 0::2] | (codes[..., 1::2] << 4), block_scale, outer
