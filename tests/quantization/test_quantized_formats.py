"""Tests for the pure-PyTorch MXFP8 / NVFP4 reference (src/transformers_inkling2/quantization/formats.py).

The hand-built fixtures write bytes from the format rules with literal expected numbers, so they do not
depend on the module's own tables or quantizers.
"""

import importlib.util
import math
import pathlib

import pytest
import torch

_PATH = pathlib.Path(__file__).resolve().parents[2] / "src" / "transformers_inkling2" / "quantization" / "formats.py"
_spec = importlib.util.spec_from_file_location("inkling2_quantized_formats", _PATH)
qf = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(qf)

QErr = qf.QuantizedFormatError
E2M1_LITERAL = [0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0]  # magnitudes of codes 0-7 (OCP MX spec)


def u8(values):
    return torch.tensor(values, dtype=torch.uint8)


def assert_same_bits(a: torch.Tensor, b: torch.Tensor):
    """Exact equality including the sign of zero and NaN positions."""
    assert a.shape == b.shape
    assert torch.equal(torch.isnan(a), torch.isnan(b))
    ok = ~torch.isnan(a)
    assert torch.equal(a[ok], b[ok])
    assert torch.equal(torch.signbit(a[ok]), torch.signbit(b[ok]))


# ----------------------------------------------------------------------------------------- codecs


def test_e2m1_all_16_codes_and_negative_zero():
    got = qf.e2m1_decode(torch.arange(16, dtype=torch.uint8))
    expected = torch.tensor(E2M1_LITERAL + [-v for v in E2M1_LITERAL])
    assert_same_bits(got, expected)
    assert bool(torch.signbit(got[8])) and got[8] == 0  # 0x8 is -0.0
    assert not bool(torch.signbit(got[0]))
    assert torch.signbit(got[9:]).all() and not torch.signbit(got[:8]).any()


def test_e2m1_encode_round_to_nearest_even_and_saturation():
    x = torch.tensor([0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0, 7.0, 1e9, -0.0, -0.3, 0.26, 4.9, -5.1])
    assert qf.e2m1_encode(x).tolist() == [0, 2, 2, 4, 4, 6, 6, 7, 7, 8, 9, 1, 6, 15]
    # every code survives decode -> encode
    codes = torch.arange(16, dtype=torch.uint8)
    assert torch.equal(qf.e2m1_encode(qf.e2m1_decode(codes)), codes)


def test_nibble_order_hand_built_bytes():
    # 0x21: low nibble 1 (0.5) is element 0, high nibble 2 (1.0) is element 1.
    assert qf.unpack_e2m1(u8([0x21])).tolist() == [1, 2]
    assert qf.e2m1_decode(qf.unpack_e2m1(u8([0x21]))).tolist() == [0.5, 1.0]
    # 0x7F: low nibble F (-6), high nibble 7 (+6); 0x80: low 0 (+0), high 8 (-0).
    v = qf.e2m1_decode(qf.unpack_e2m1(u8([0x7F, 0x80])))
    assert v.tolist() == [-6.0, 6.0, 0.0, 0.0]
    assert torch.signbit(v).tolist() == [True, False, False, True]
    assert qf.pack_e2m1(u8([1, 2, 0xF, 0x7])).tolist() == [0x21, 0x7F]
    g = torch.Generator().manual_seed(1)
    codes = torch.randint(0, 16, (3, 5, 64), generator=g).to(torch.uint8)
    packed = qf.pack_e2m1(codes)
    assert packed.shape == (3, 5, 32)
    assert torch.equal(qf.unpack_e2m1(packed), codes)


def test_e4m3_table_follows_bit_rules_and_matches_torch():
    t = qf.E4M3_VALUES
    assert t[0x01].item() == 2.0**-9  # smallest subnormal
    assert t[0x07].item() == 7 * 2.0**-9  # largest subnormal
    assert t[0x08].item() == 2.0**-6  # smallest normal
    assert t[0x38].item() == 1.0 and t[0x40].item() == 2.0 and t[0x30].item() == 0.5
    assert t[0x7E].item() == 448.0 and t[0xFE].item() == -448.0
    assert math.isnan(t[0x7F].item()) and math.isnan(t[0xFF].item())
    assert torch.isnan(t).sum() == 2
    assert_same_bits(t, torch.arange(256, dtype=torch.uint8).view(torch.float8_e4m3fn).float())


def _brute_e4m3(x: float) -> float:
    """Nearest finite E4M3 value, ties to the even byte, saturating at 448 (written from the spec)."""
    finite = [(b, qf.E4M3_VALUES[b].item()) for b in range(128) if b != 0x7F]
    a = min(abs(x), 448.0)
    best = min(finite, key=lambda bv: (abs(bv[1] - a), bv[0] & 1))
    return math.copysign(best[1], x)


def test_e4m3_encode_is_round_to_nearest_even():
    pos = sorted({qf.E4M3_VALUES[b].item() for b in range(127)})
    mids = [(a + b) / 2 for a, b in zip(pos, pos[1:])]
    g = torch.Generator().manual_seed(2)
    mag = torch.exp2(torch.randint(-12, 10, (300,), generator=g).float())
    rnd = (torch.randn(300, generator=g) * mag).tolist()
    xs = mids + [-m for m in mids] + rnd + [1000.0, -1e30, 449.0, 464.0]
    got = qf.e4m3_decode(qf.e4m3_encode(torch.tensor(xs, dtype=torch.float64))).tolist()
    assert got == [_brute_e4m3(x) for x in xs]


def test_e8m0_bytes_0_127_254_255():
    v = qf.e8m0_decode(u8([0, 1, 127, 128, 254, 255]))
    assert v[0].item() == 2.0**-127 and v[0].item() != 0.0  # 0 is 2^-127, NOT zero
    assert v[1].item() == 2.0**-126
    assert v[2].item() == 1.0 and v[3].item() == 2.0
    assert v[4].item() == 2.0**127
    assert math.isnan(v[5].item())  # the codec gives NaN; the dequantizer refuses it (below)
    if hasattr(torch, "float8_e8m0fnu"):
        assert_same_bits(qf.e8m0_decode(u8([0, 127, 254]).view(torch.float8_e8m0fnu)), v[[0, 2, 4]])
    assert qf.e8m0_encode(torch.tensor([-127, 0, 127])).tolist() == [0, 127, 254]
    with pytest.raises(QErr):
        qf.e8m0_encode(torch.tensor([128]))


# --------------------------------------------------------------------------- hand-written fixtures


def test_mxfp8_hand_built_fixture():
    # One 32-value block per (row, block); bytes from the E4M3 rules:
    # 0x38 = +1.0, 0xC0 = -2.0, 0x7E = 448, 0x01 = 2^-9, 0x3C = 1.5, 0x80 = -0.0, 0x00 = 0.
    block_bytes = [0x38, 0xC0, 0x7E, 0x01, 0x3C, 0x80] + [0x00] * 26
    block_vals = [1.0, -2.0, 448.0, 2.0**-9, 1.5, -0.0] + [0.0] * 26
    small_bytes = [0x38, 0xC0] + [0x00] * 30  # stays finite under the 2^127 scale
    small_vals = [1.0, -2.0] + [0.0] * 30
    weight = u8([block_bytes + block_bytes, block_bytes + small_bytes]).view(torch.float8_e4m3fn)
    scale = u8([[127, 130], [0, 254]])  # x1, x8, x2^-127, x2^127
    expected = torch.tensor(
        [
            [v * 1.0 for v in block_vals] + [v * 8.0 for v in block_vals],
            [v * 2.0**-127 for v in block_vals] + [v * 2.0**127 for v in small_vals],
        ],
        dtype=torch.float64,
    ).float()
    got = qf.mxfp8_dequantize(weight, scale, torch.float32)
    assert_same_bits(got, expected)
    assert got[1, 0].item() == 2.0**-127 and got[1, 2].item() == 448 * 2.0**-127
    assert got[1, 32].item() == 2.0**127
    # bf16 output is the float32 result rounded once
    assert torch.equal(qf.mxfp8_dequantize(weight, scale), expected.bfloat16())


def test_nvfp4_hand_built_fixture():
    # Row 0: codes 0..15 then 15..0 (all 16 codes in both nibble positions);
    # row 1: pairs (7, 1) then (0xA, 0x5).
    row0_codes = list(range(16)) + list(range(15, -1, -1))
    row1_codes = [7, 1] * 8 + [0xA, 0x5] * 8
    row0_bytes = [row0_codes[2 * j] | (row0_codes[2 * j + 1] << 4) for j in range(16)]
    assert row0_bytes[:2] == [0x10, 0x32]
    row1_bytes = [0x17] * 8 + [0x5A] * 8
    packed = u8([row0_bytes, row1_bytes])
    # block scales: 0x38 = 1.0, 0x40 = 2.0, 0x01 = 2^-9 (subnormal), 0x30 = 0.5
    block_scale = u8([[0x38, 0x40], [0x01, 0x30]]).view(torch.float8_e4m3fn)
    outer = 0.25  # a multiplier

    def val(c):
        return (-1.0 if c & 8 else 1.0) * E2M1_LITERAL[c & 7]

    bs = [[1.0, 2.0], [2.0**-9, 0.5]]
    expected = torch.tensor(
        [
            [val(c) * bs[r][i // 16] * outer for i, c in enumerate(codes)]
            for r, codes in enumerate([row0_codes, row1_codes])
        ],
        dtype=torch.float64,
    ).float()
    got = qf.nvfp4_dequantize(packed, block_scale, outer, torch.float32)
    assert_same_bits(got, expected)
    assert got[1, 0].item() == 6.0 * 2.0**-9 * 0.25  # subnormal block scale 0x01
    assert got[1, 16].item() == -1.0 * 0.5 * 0.25 and got[1, 17].item() == 3.0 * 0.5 * 0.25
    assert bool(torch.signbit(got[0, 8]))  # code 0x8 -> -0.0 survives the scaling
    if hasattr(torch, "float4_e2m1fn_x2"):  # torch's packed fp4 dtype is read as the same bytes
        fp4 = packed.view(torch.float4_e2m1fn_x2)
        assert_same_bits(qf.nvfp4_dequantize(fp4, block_scale, outer, torch.float32), expected)


def test_subnormal_block_scale_byte_0x01():
    packed = u8([[0x77] * 8])  # sixteen +6.0 codes
    block_scale = u8([[0x01]]).view(torch.float8_e4m3fn)
    got = qf.nvfp4_dequantize(packed, block_scale, torch.tensor(2.0), torch.float32)
    assert torch.equal(got, torch.full((1, 16), 6.0 * 2.0**-9 * 2.0))


# ------------------------------------------------------------------------------ interleaved w13


def test_deinterleave_rows_order_and_round_trip_on_weights_and_scales():
    rows = torch.arange(8).float().reshape(1, 8, 1).expand(2, 8, 4)  # row r holds r
    d = qf.deinterleave_rows(rows)
    assert d[0, :, 0].tolist() == [0, 2, 4, 6, 1, 3, 5, 7]  # [g0 g1 g2 g3; u0 u1 u2 u3]
    assert torch.equal(qf.interleave_rows(d), rows)
    g = torch.Generator().manual_seed(3)
    packed = torch.randint(0, 256, (3, 10, 8), generator=g).to(torch.uint8)
    scale = torch.randint(0, 0x7E, (3, 10, 1), generator=g).to(torch.uint8).view(torch.float8_e4m3fn)
    e8m0 = torch.randint(0, 255, (3, 10, 2), generator=g).to(torch.uint8)
    for t in (packed, scale, e8m0):
        dt = qf.deinterleave_rows(t)
        assert dt.dtype == t.dtype
        assert not torch.equal(dt.view(torch.uint8), t.view(torch.uint8))
        assert torch.equal(dt.view(torch.uint8)[:, :5], t.view(torch.uint8)[:, 0::2])
        assert torch.equal(dt.view(torch.uint8)[:, 5:], t.view(torch.uint8)[:, 1::2])
        assert torch.equal(qf.interleave_rows(dt).view(torch.uint8), t.view(torch.uint8))
    # Dequantizing then de-interleaving equals de-interleaving the quantized tensors then dequantizing.
    outer = torch.tensor([0.5, 1.0, 2.0])
    a = qf.deinterleave_rows(qf.nvfp4_dequantize(packed & 0x77, scale, outer, torch.float32))
    b = qf.nvfp4_dequantize(
        qf.deinterleave_rows(packed & 0x77), qf.deinterleave_rows(scale), outer, torch.float32
    )
    assert torch.equal(a, b)
    with pytest.raises(QErr, match="odd row count"):
        qf.deinterleave_rows(torch.zeros(2, 7, 4))


def test_gate_and_up_outer_scales_land_on_the_right_halves():
    E, I, K = 2, 3, 16
    # Stored interleaved: gate rows hold code 2 (1.0), up rows hold code 4 (2.0).
    gate_byte, up_byte = 0x22, 0x44
    row_bytes = [[gate_byte] * (K // 2), [up_byte] * (K // 2)] * I
    packed = u8([row_bytes] * E)  # [E, 2I, K/2], interleaved g0,u0,g1,u1,...
    block_scale = u8([[[0x38]] * (2 * I)] * E).view(torch.float8_e4m3fn)  # 1.0
    outer = torch.tensor([[3.0, 5.0], [7.0, 11.0]])  # per expert (gate, up)

    out = qf.dequantize_expert_weights(packed, block_scale, outer, interleaved=True, dtype=torch.float32)
    assert out.shape == (E, 2 * I, K)
    for e in range(E):
        assert torch.all(out[e, :I] == 1.0 * outer[e, 0])  # gate rows first
        assert torch.all(out[e, I:] == 2.0 * outer[e, 1])
    # Same numbers without reordering, applying the halves to even/odd rows.
    inter = qf.nvfp4_dequantize(packed, block_scale, outer, torch.float32, gate_up_layout="interleaved")
    assert torch.equal(qf.deinterleave_rows(inter), out)
    # And the split layout on already de-interleaved data.
    split = qf.nvfp4_dequantize(
        qf.deinterleave_rows(packed),
        qf.deinterleave_rows(block_scale),
        outer,
        torch.float32,
        gate_up_layout="split",
    )
    assert torch.equal(split, out)


def test_dequantize_expert_weights_mxfp8_detects_format_and_deinterleaves():
    g = torch.Generator().manual_seed(4)
    w = torch.randn(2, 6, 64, generator=g)
    q, s = qf.mxfp8_quantize(w)
    assert qf.detect_expert_format(q, s) == "mxfp8"
    out = qf.dequantize_expert_weights(q, s, interleaved=True, dtype=torch.float32)
    assert torch.equal(out, qf.deinterleave_rows(qf.mxfp8_dequantize(q, s, torch.float32)))
    assert out.dtype == torch.float32
    assert qf.dequantize_expert_weights(q, s).dtype == torch.bfloat16
    with pytest.raises(QErr, match="no outer scale"):
        qf.dequantize_expert_weights(q, s, torch.ones(2))
    p, bs, o = qf.nvfp4_quantize(w)
    assert qf.detect_expert_format(p, bs) == "nvfp4"
    with pytest.raises(QErr, match="outer scale"):
        qf.dequantize_expert_weights(p, bs)


# ------------------------------------------------------------------------------- round trips


def _scaled_normal(shape, seed, block, spread):
    """Normal data whose magnitude varies by up to 2^+-spread from block to block."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(shape, generator=g)
    exps = torch.randint(-spread, spread + 1, shape[:-1] + (shape[-1] // block, 1), generator=g)
    mag = torch.exp2(exps.float())
    return (x.unflatten(-1, (shape[-1] // block, block)) * mag).flatten(-2)


def test_mxfp8_quantize_round_trip_error_bound():
    x = _scaled_normal((4, 32, 256), seed=5, block=32, spread=12)  # MX scales are per block
    q, s = qf.mxfp8_quantize(x)
    assert q.dtype == torch.float8_e4m3fn and s.dtype == torch.uint8 and s.shape == (4, 32, 8)
    y = qf.mxfp8_dequantize(q, s, torch.float32)
    scale = qf.e8m0_decode(s).repeat_interleave(32, dim=-1)
    err = (y - x).abs()
    # E4M3 keeps 3 mantissa bits: half an ulp is <= 2^-4 relative for normals (|x|/scale >= 2^-6);
    # below that the E4M3 subnormal step 2^-9 gives an absolute error <= 2^-10 * scale.
    normal = x.abs() >= 2.0**-6 * scale
    assert normal.float().mean() > 0.9
    assert torch.all(err[normal] <= 2.0**-4 * x.abs()[normal])
    assert torch.all(err[~normal] <= 2.0**-10 * scale[~normal])
    # The exponent is the smallest that fits: block amax lies in (224, 448] * scale, nothing saturates.
    ratio = x.abs().unflatten(-1, (8, 32)).amax(-1) / qf.e8m0_decode(s)
    assert torch.all(ratio <= 448) and torch.all(ratio > 224)
    # measured about 0.026 RMS relative error
    assert ((y - x).norm() / x.norm()).item() < 0.035


def test_mxfp8_quantize_exponent_choice_exact_edges():
    w = torch.zeros(1, 4 * 32)
    w[0, 0], w[0, 32], w[0, 64] = 448.0, 449.0, 224.0  # block 3 stays all zero
    q, s = qf.mxfp8_quantize(w)
    assert s.tolist() == [[127, 128, 126, 127]]
    y = qf.mxfp8_dequantize(q, s, torch.float32)
    assert y[0, 0] == 448.0 and y[0, 32] == 448.0 and y[0, 64] == 224.0  # 449 -> 224.5 -> 224 -> 448
    assert torch.all(y[0, 96:] == 0)


def test_nvfp4_quantize_round_trip_error_bound():
    # One outer scale per matrix leaves E4M3 block scales about 2^17 of range, so keep blocks within 2^+-4.
    x = _scaled_normal((3, 48, 256), seed=6, block=16, spread=4) * 1e-2
    p, bs, outer = qf.nvfp4_quantize(x)
    assert p.dtype == torch.uint8 and p.shape == (3, 48, 128)
    assert bs.dtype == torch.float8_e4m3fn and bs.shape == (3, 48, 16) and outer.shape == (3,)
    assert torch.allclose(outer, x.abs().amax(dim=(-1, -2)) / 2688.0)
    y = qf.nvfp4_dequantize(p, bs, outer, torch.float32)
    assert torch.all(qf.e4m3_decode(bs) >= 2.0**-6)  # all block scales are E4M3 normals
    eff = (qf.e4m3_decode(bs) * outer[:, None, None]).repeat_interleave(16, dim=-1)
    # E2M1 keeps 1 mantissa bit: rounding error <= 0.2 |x| for |x| >= eff (worst at 1.25, 2.5, 5), and
    # <= 0.25 * eff below (the 0.5 subnormal step). Saturation after a rounded-down block scale costs
    # at most 2^-4 relative, inside the same bound.
    err = (y - x).abs()
    bound = torch.maximum(0.2 * x.abs(), 0.25 * eff) * (1 + 1e-6)
    assert torch.all(err <= bound)
    # measured about 0.096 RMS relative error
    assert ((y - x).norm() / x.norm()).item() < 0.11
    # Block scales are chosen from block amax / 6: each block's largest value lands near code 6.
    top = x.abs().unflatten(-1, (16, 16)).amax(-1) / (qf.e4m3_decode(bs) * outer[:, None, None])
    assert torch.all(top > 5.0) and torch.all(top < 6.0 * 1.07)


def test_nvfp4_quantize_per_half_outer_and_hand_case():
    g = torch.Generator().manual_seed(7)
    w = torch.randn(2, 8, 32, generator=g)
    w[:, 4:] *= 100.0  # up half much larger than the gate half
    p, bs, outer = qf.nvfp4_quantize(w, per_half=True)
    assert outer.shape == (2, 2)
    assert torch.allclose(outer[:, 0], w[:, :4].abs().amax(dim=(-1, -2)) / 2688.0)
    assert torch.allclose(outer[:, 1], w[:, 4:].abs().amax(dim=(-1, -2)) / 2688.0)
    y = qf.nvfp4_dequantize(p, bs, outer, torch.float32)
    assert ((y - w).norm() / w.norm()).item() < 0.12
    # Quantizing the interleaved storage order gives the same (gate, up) multipliers and rows.
    pi, bsi, outer_i = qf.nvfp4_quantize(qf.interleave_rows(w), per_half=True, gate_up_layout="interleaved")
    assert torch.equal(outer_i, outer)
    assert torch.equal(qf.deinterleave_rows(pi), p)
    assert torch.equal(qf.deinterleave_rows(bsi).view(torch.uint8), bs.view(torch.uint8))
    # Hand case with a given multiplier of 1: block amax 6 -> block scale 1.0; 3 -> code 5, -0.75 -> 1.0.
    x = torch.zeros(1, 16)
    x[0, 0], x[0, 1], x[0, 2] = 6.0, 3.0, -0.75
    p, bs, o = qf.nvfp4_quantize(x, 1.0)
    assert bs.view(torch.uint8).tolist() == [[0x38]]
    assert p[0, :2].tolist() == [0x57, 0x0A]  # (6 -> 7, 3 -> 5), (-0.75 -> 0xA, 0 -> 0)


def test_modelopt_multiplier_and_compressed_tensors_divisor_agree():
    g = torch.Generator().manual_seed(8)
    w = torch.randn(3, 8, 64, generator=g)
    amax = w.abs().amax(dim=(-1, -2))
    p, bs, used = qf.nvfp4_quantize(w, amax / 2688.0)
    weight_scale_2 = amax / 2688.0  # ModelOpt: multiplier
    weight_global_scale = 2688.0 / amax  # compressed-tensors: divisor
    a = qf.nvfp4_dequantize(p, bs, qf.nvfp4_multiplier_from_weight_scale_2(weight_scale_2), torch.float32)
    b = qf.nvfp4_dequantize(p, bs, qf.nvfp4_multiplier_from_global_scale(weight_global_scale), torch.float32)
    c = qf.nvfp4_dequantize(p, bs, qf.nvfp4_multiplier_from_amax(amax, 2688.0), torch.float32)
    torch.testing.assert_close(a, b, rtol=1e-6, atol=0)
    assert torch.equal(a, c)
    assert torch.equal(a, qf.nvfp4_dequantize(p, bs, qf.nvfp4_outer_multiplier(amax=amax), torch.float32))
    via_dispatch = qf.nvfp4_outer_multiplier(weight_global_scale=weight_global_scale)
    assert torch.equal(b, qf.nvfp4_dequantize(p, bs, via_dispatch, torch.float32))
    # Exact agreement with power-of-two scales, and the divisor really divides.
    pow2 = torch.tensor([0.25, 4.0, 1.0])
    m1 = qf.nvfp4_dequantize(p, bs, qf.nvfp4_multiplier_from_weight_scale_2(pow2), torch.float32)
    m2 = qf.nvfp4_dequantize(p, bs, qf.nvfp4_multiplier_from_global_scale(1.0 / pow2), torch.float32)
    assert torch.equal(m1, m2)
    unit = qf.nvfp4_dequantize(p, bs, torch.ones(3), torch.float32)
    assert torch.equal(m2[0], unit[0] * 0.25) and torch.equal(m2[1], unit[1] * 4.0)
    # A non-default denominator: amax 3 over 12 is a multiplier of 0.25.
    assert qf.nvfp4_multiplier_from_amax(torch.tensor([3.0]), 12.0).tolist() == [0.25]
    three = torch.tensor([3.0])
    assert qf.nvfp4_outer_multiplier(amax=three, outer_scale_denominator=12.0).tolist() == [0.25]
    with pytest.raises(QErr, match="exactly one"):
        qf.nvfp4_outer_multiplier(weight_scale_2=pow2, weight_global_scale=pow2)
    with pytest.raises(QErr, match="must be > 0"):
        qf.nvfp4_multiplier_from_global_scale(torch.tensor([1.0, 0.0]))


# ------------------------------------------------------------------------------------- errors


def _nvfp4_ok():
    packed = u8([[[0x21] * 16] * 4] * 2)  # [2, 4, 16] -> K = 32
    scale = u8([[[0x38, 0x40]] * 4] * 2).view(torch.float8_e4m3fn)
    return packed, scale, torch.tensor([1.0, 2.0])


def test_errors_for_nan_scales_name_the_tensor():
    packed, scale, outer = _nvfp4_ok()
    assert qf.nvfp4_dequantize(packed, scale, outer).abs().sum() > 0
    bad = scale.view(torch.uint8).clone()
    bad[1, 2, 1] = 0x7F
    with pytest.raises(QErr, match=r"w13_weight_scale holds float8_e4m3fn NaN.*\(1, 2, 1\)"):
        qf.nvfp4_dequantize(packed, bad.view(torch.float8_e4m3fn), outer, name="w13_weight")
    bad[1, 2, 1] = 0xB8  # -1.0
    with pytest.raises(QErr, match="negative block scales"):
        qf.nvfp4_dequantize(packed, bad.view(torch.float8_e4m3fn), outer)

    w = u8([[0x38] * 64]).view(torch.float8_e4m3fn)
    with pytest.raises(QErr, match="w2_weight_scale holds E8M0 byte 255"):
        qf.mxfp8_dequantize(w, u8([[127, 255]]), name="w2_weight")
    out = qf.mxfp8_dequantize(w, u8([[127, 255]]), torch.float32, validate=False)  # opt-out: NaN path
    assert torch.isnan(out[0, 32:]).all() and torch.all(out[0, :32] == 1.0)
    nan_w = u8([[0x38] * 63 + [0x7F]]).view(torch.float8_e4m3fn)
    with pytest.raises(QErr, match="NaN bytes"):
        qf.mxfp8_dequantize(nan_w, u8([[127, 127]]))

    nan, inf = float("nan"), float("inf")
    for bad_outer in (torch.tensor([1.0, nan]), torch.tensor([inf, 1.0]), torch.tensor([-1.0, 1.0])):
        with pytest.raises(QErr, match="outer_scale_multiplier for w13_weight"):
            qf.nvfp4_dequantize(packed, scale, bad_outer, name="w13_weight")
    with pytest.raises(QErr, match="NaN or inf"):
        qf.nvfp4_multiplier_from_weight_scale_2(torch.tensor([float("nan")]))
    with pytest.raises(QErr, match="NaN or inf"):
        qf.mxfp8_quantize(torch.full((1, 32), float("inf")))


def test_errors_for_bad_shapes_and_dtypes():
    packed, scale, outer = _nvfp4_ok()
    # K not divisible by the block
    with pytest.raises(QErr, match="K=24 is not divisible by the block size 16"):
        qf.nvfp4_dequantize(packed[..., :12], scale, outer)
    with pytest.raises(QErr, match="K=48 is not divisible by the block size 32"):
        qf.mxfp8_dequantize(torch.zeros(2, 48).to(torch.float8_e4m3fn), u8([[127], [127]]))
    # scale shape mismatch (e.g. rows not reordered together, or transposed)
    msg = r"w13_weight_scale has shape \(2, 4, 1\) but w13_weight needs \(2, 4, 2\)"
    with pytest.raises(QErr, match=msg):
        qf.nvfp4_dequantize(packed, scale[..., :1], outer, name="w13_weight")
    with pytest.raises(QErr, match="has shape"):
        qf.mxfp8_dequantize(torch.ones(4, 64).to(torch.float8_e4m3fn), u8([[127, 127]] * 3))
    # outer scale not per expert / per half
    for bad_outer in (torch.tensor(1.0), torch.ones(3), torch.ones(2, 3), torch.ones(4, 2)):
        with pytest.raises(QErr, match="one value per expert"):
            qf.nvfp4_dequantize(packed, scale, bad_outer)
    assert qf.nvfp4_dequantize(packed, scale, torch.ones(2, 1)).shape == (2, 4, 32)  # [E, 1] is fine
    assert qf.nvfp4_dequantize(packed[0], scale[0], 1.5).shape == (4, 32)  # scalar for one matrix
    with pytest.raises(QErr, match="odd row count"):
        qf.nvfp4_dequantize(packed[:, :3], scale[:, :3], torch.ones(2, 2))
    # wrong dtypes
    with pytest.raises(QErr, match=r"view\(torch.float8_e4m3fn\)"):
        qf.nvfp4_dequantize(packed, scale.view(torch.uint8), outer)
    with pytest.raises(QErr, match="NVFP4 weights are uint8"):
        qf.nvfp4_dequantize(packed.to(torch.float8_e4m3fn), scale, outer)
    with pytest.raises(QErr, match="MXFP8 weights are float8_e4m3fn"):
        qf.mxfp8_dequantize(u8([[0x38] * 32]), u8([[127]]))
    with pytest.raises(QErr, match="E8M0 exponent bytes"):
        fp8 = torch.float8_e4m3fn
        qf.mxfp8_dequantize(u8([[0x38] * 32]).view(fp8), u8([[0x38]]).view(fp8))
    with pytest.raises(QErr, match="floating dtype"):
        qf.nvfp4_dequantize(packed, scale, torch.tensor([1, 2]))
    with pytest.raises(QErr, match="cannot tell the format"):
        qf.detect_expert_format(torch.zeros(2, 32), u8([[1], [1]]))
