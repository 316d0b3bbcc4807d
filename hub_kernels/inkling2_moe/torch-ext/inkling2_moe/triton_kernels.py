"""Triton kernels. Imported lazily (only for CUDA tensors or the interpreter), because the kernel-hub loader
refuses `triton` as a declared Python dependency.

Routing (no host sync, sizes bounded by the slot count):
  decode sizes: programs rank blocks of slots against all slots (a stable counting sort without a histogram:
          position = #smaller keys + #earlier equal keys) and count the offsets of a share of the experts;
          then one program writes the tile list from the offsets (up to 64 slots one program does it all, and
          where x goes to f16 the same launch converts it: `_route_and_convert_kernel`);
  large:  per-chunk histograms -> one program scans them (chunk bases, offsets, tiles) -> per-chunk scatter.
Experts:
  _gate_up_kernel  grid (tiles, cdiv(I, BN)): x rows gathered by token, gate and up rows of the same
                   expert in one program, weights dequantized in registers, softcapped SwiGLU epilogue,
                   bf16 activation stored in sorted order.
  _down_kernel     grid (tiles, cdiv(H, BN)): activation @ w2^T, times the routing weight, fp32 row per slot.
  _combine_kernel  grid (T, cdiv(H, BLOCK)): sums the top_k slot rows of each token in slot order.
Each program of the expert kernels reads one [BN, K] weight slab of ONE active expert, once; programs of
inactive tiles exit after one load, so decode reads only the active experts' bytes.
"""

import triton
import triton.language as tl

FMT_BF16 = 0
FMT_MXFP8 = 1
FMT_NVFP4 = 2


# ------------------------------------------------------------------------------------------------ routing


@triton.jit
def _slot_keys(ids_ptr, start, num_slots, num_experts, B: tl.constexpr, NB: tl.constexpr):
    """Bin of each slot in [start, start+B): its expert, `num_experts` for dropped ids, NB for padding."""
    offs = start + tl.arange(0, B)
    inb = offs < num_slots
    e = tl.load(ids_ptr + offs, mask=inb, other=-1).to(tl.int32)
    key = tl.where((e >= 0) & (e < num_experts), e, num_experts)
    key = tl.where(inb, key, NB)
    return offs, inb, key


@triton.jit
def _histogram(ids_ptr, start, stop, num_slots, num_experts, B: tl.constexpr, NB: tl.constexpr):
    bins = tl.arange(0, NB)
    counts = tl.zeros((NB,), dtype=tl.int32)
    for s0 in range(start, stop, B):
        offs, inb, key = _slot_keys(ids_ptr, s0, num_slots, num_experts, B, NB)
        counts += tl.sum((key[:, None] == bins[None, :]).to(tl.int32), axis=0)
    return counts


@triton.jit
def _scatter(ids_ptr, sorted_ptr, position_ptr, next_pos, start, stop, num_slots, num_experts,
             B: tl.constexpr, NB: tl.constexpr):
    """Writes sorted positions of slots [start, stop); next_pos[b] = next free position of bin b."""
    bins = tl.arange(0, NB)
    lanes = tl.arange(0, B)
    earlier = lanes[None, :] < lanes[:, None]
    for s0 in range(start, stop, B):
        offs, inb, key = _slot_keys(ids_ptr, s0, num_slots, num_experts, B, NB)
        onehot = key[:, None] == bins[None, :]
        base = tl.sum(tl.where(onehot, next_pos[None, :], 0), axis=1)
        rank = tl.sum(((key[:, None] == key[None, :]) & earlier).to(tl.int32), axis=1)
        pos = base + rank
        tl.store(sorted_ptr + pos, offs.to(tl.int32), mask=inb)
        tl.store(position_ptr + offs, pos, mask=inb)
        next_pos += tl.sum(onehot.to(tl.int32), axis=0)


@triton.jit
def _write_tiles(offsets, counts, tile_expert_ptr, tile_start_ptr, num_experts, n_tiles,
                 BM: tl.constexpr, NB: tl.constexpr, TB: tl.constexpr):
    """Tile list from each expert's first sorted row and row count: expert e's tiles are consecutive, tile k
    starting at row offsets[e] + k * BM; entries past the last tile are -1 (their programs exit)."""
    bins = tl.arange(0, NB)
    tiles = tl.where(bins < num_experts, (counts + BM - 1) // BM, 0)
    first_tile = tl.cumsum(tiles, axis=0) - tiles
    total = tl.sum(tiles, axis=0)
    for k in range(0, tl.max(tiles, axis=0)):  # one pass per tile of the fullest expert
        has = k < tiles
        tl.store(tile_expert_ptr + first_tile + k, bins, mask=has)
        tl.store(tile_start_ptr + first_tile + k, offsets + k * BM, mask=has)
    for t0 in range(0, n_tiles, TB):
        t = t0 + tl.arange(0, TB)
        unused = (t >= total) & (t < n_tiles)
        tl.store(tile_expert_ptr + t, tl.full((TB,), -1, tl.int32), mask=unused)
        tl.store(tile_start_ptr + t, tl.zeros((TB,), tl.int32), mask=unused)


@triton.jit
def _offsets_and_tiles(counts, offsets_ptr, tile_expert_ptr, tile_start_ptr, num_experts, n_tiles,
                       BM: tl.constexpr, NB: tl.constexpr, TB: tl.constexpr):
    bins = tl.arange(0, NB)
    offsets = tl.cumsum(counts, axis=0) - counts
    tl.store(offsets_ptr + bins, offsets, mask=bins <= num_experts)
    _write_tiles(offsets, counts, tile_expert_ptr, tile_start_ptr, num_experts, n_tiles, BM, NB, TB)
    return offsets


@triton.jit
def _rank_slots(ids_ptr, sorted_ptr, position_ptr, offsets_ptr, tile_expert_ptr, tile_start_ptr, num_slots,
                num_experts, n_tiles, p, RB: tl.constexpr, NB: tl.constexpr, NBP: tl.constexpr, TILES: tl.constexpr,
                BM: tl.constexpr, TB: tl.constexpr):
    """Program p of the ranking: sorts slots [p*RB, p*RB + RB) to their positions (#slots with a smaller key +
    #earlier slots with the same key: stable) and writes expert_offsets of experts [p*NBP, p*NBP + NBP) (#slots with
    a smaller key). TILES (one program, which then sees every slot and expert): also the tile list."""
    offs_i, inb_i, key_i = _slot_keys(ids_ptr, p * RB, num_slots, num_experts, RB, NB)
    bins = p * NBP + tl.arange(0, NBP)
    position = tl.zeros((RB,), dtype=tl.int32)
    below = tl.zeros((NBP,), dtype=tl.int32)
    counts = tl.zeros((NBP,), dtype=tl.int32)
    for j0 in range(0, num_slots, RB):  # padding lanes have key NB: never smaller, never equal
        offs_j, inb_j, key_j = _slot_keys(ids_ptr, j0, num_slots, num_experts, RB, NB)
        earlier_equal = (key_j[None, :] == key_i[:, None]) & (offs_j[None, :] < offs_i[:, None])
        position += tl.sum(((key_j[None, :] < key_i[:, None]) | earlier_equal).to(tl.int32), axis=1)
        below += tl.sum((key_j[:, None] < bins[None, :]).to(tl.int32), axis=0)
        if TILES:
            counts += tl.sum((key_j[:, None] == bins[None, :]).to(tl.int32), axis=0)
    tl.store(sorted_ptr + position, offs_i.to(tl.int32), mask=inb_i)
    tl.store(position_ptr + offs_i, position, mask=inb_i)
    tl.store(offsets_ptr + bins, below, mask=bins <= num_experts)
    if TILES:
        _write_tiles(below, counts, tile_expert_ptr, tile_start_ptr, num_experts, n_tiles, BM, NB, TB)


@triton.jit
def _route_rank_kernel(ids_ptr, sorted_ptr, position_ptr, offsets_ptr, tile_expert_ptr, tile_start_ptr, num_slots,
                       num_experts, n_tiles, RB: tl.constexpr, NB: tl.constexpr, NBP: tl.constexpr,
                       TILES: tl.constexpr, BM: tl.constexpr, TB: tl.constexpr):
    """grid (G,): `_rank_slots` of program p. O(slots^2) compares, spread over the programs: cheaper than histograms
    at decode sizes. With TILES (G = 1) the tile list too, which otherwise takes a second launch
    (`_route_tiles_kernel`), on the path of every decode step."""
    _rank_slots(ids_ptr, sorted_ptr, position_ptr, offsets_ptr, tile_expert_ptr, tile_start_ptr, num_slots,
                num_experts, n_tiles, tl.program_id(0), RB, NB, NBP, TILES, BM, TB)


@triton.jit
def _route_tiles_kernel(offsets_ptr, tile_expert_ptr, tile_start_ptr, num_experts, n_tiles,
                        BM: tl.constexpr, NB: tl.constexpr, TB: tl.constexpr):
    bins = tl.arange(0, NB)
    offsets = tl.load(offsets_ptr + bins, mask=bins <= num_experts, other=0)
    counts = tl.load(offsets_ptr + bins + 1, mask=bins < num_experts, other=0) - offsets
    _write_tiles(offsets, counts, tile_expert_ptr, tile_start_ptr, num_experts, n_tiles, BM, NB, TB)


@triton.jit
def _route_hist_kernel(ids_ptr, hist_ptr, num_slots, num_experts,
                       CHUNK: tl.constexpr, B: tl.constexpr, NB: tl.constexpr):
    c = tl.program_id(0)
    counts = _histogram(ids_ptr, c * CHUNK, c * CHUNK + CHUNK, num_slots, num_experts, B, NB)
    tl.store(hist_ptr + c * NB + tl.arange(0, NB), counts)


@triton.jit
def _route_scan_kernel(hist_ptr, chunk_base_ptr, offsets_ptr, tile_expert_ptr, tile_start_ptr,
                       num_chunks, num_experts, n_tiles,
                       BM: tl.constexpr, NB: tl.constexpr, TB: tl.constexpr):
    bins = tl.arange(0, NB)
    running = tl.zeros((NB,), dtype=tl.int32)
    for c in range(num_chunks):
        h = tl.load(hist_ptr + c * NB + bins)
        tl.store(chunk_base_ptr + c * NB + bins, running)
        running += h
    _offsets_and_tiles(running, offsets_ptr, tile_expert_ptr, tile_start_ptr, num_experts, n_tiles, BM, NB, TB)


@triton.jit
def _route_scatter_kernel(ids_ptr, chunk_base_ptr, offsets_ptr, sorted_ptr, position_ptr,
                          num_slots, num_experts,
                          CHUNK: tl.constexpr, B: tl.constexpr, NB: tl.constexpr):
    c = tl.program_id(0)
    bins = tl.arange(0, NB)
    next_pos = tl.load(offsets_ptr + bins, mask=bins <= num_experts, other=0)
    next_pos += tl.load(chunk_base_ptr + c * NB + bins)
    _scatter(ids_ptr, sorted_ptr, position_ptr, next_pos, c * CHUNK, c * CHUNK + CHUNK, num_slots,
             num_experts, B, NB)


# ------------------------------------------------------------------------------------------------ experts


@triton.jit
def _mma(a, b_nk, acc, DOT_FP32: tl.constexpr):
    """acc += a @ b_nk^T. DOT_FP32 (interpreter only: its bf16 dot is unreliable) upcasts both operands.
    (Making the weight tile the A operand instead was worse in the SASS: more byte permutes.)"""
    if DOT_FP32:
        return tl.dot(a.to(tl.float32), tl.trans(b_nk.to(tl.float32)), acc, input_precision="ieee")
    else:
        return tl.dot(a, tl.trans(b_nk), acc)


# Packed decoders (GPU only; the interpreter cannot run PTX). Each handles 4 bytes held in one 32-bit
# register, where Triton's own conversions extract and convert byte by byte (about 3x the instructions).
# cvt.rn.f16x2.e4m3x2 (sm_89+) converts two E4M3 bytes at once; all conversions below are exact.


@triton.jit
def _e4m3x4_to_bf16(q):
    """4 E4M3 bytes -> 4 bf16 (via f16x2 and f32: exact)."""
    return tl.inline_asm_elementwise(
        asm="""{
        .reg .b16 a01, a23;
        .reg .b32 h01, h23;
        .reg .f16 g0, g1, g2, g3;
        .reg .f32 f0, f1, f2, f3;
        mov.b32 {a01, a23}, $2;
        cvt.rn.f16x2.e4m3x2 h01, a01;
        cvt.rn.f16x2.e4m3x2 h23, a23;
        mov.b32 {g0, g1}, h01;
        mov.b32 {g2, g3}, h23;
        cvt.f32.f16 f0, g0;
        cvt.f32.f16 f1, g1;
        cvt.f32.f16 f2, g2;
        cvt.f32.f16 f3, g3;
        cvt.rn.bf16x2.f32 $0, f1, f0;
        cvt.rn.bf16x2.f32 $1, f3, f2;
        }""",
        constraints="=r,=r,r", args=[q], dtype=tl.bfloat16, is_pure=True, pack=4)


@triton.jit
def _e2m1x4_lo_to_f16(p):
    """Low nibbles of 4 bytes -> 4 f16 equal to the E2M1 values times 2**-6 (nibble moved into an E4M3
    byte as s.0ee0.m00: the two formats' subnormals line up, so the hardware conversion is exact)."""
    return tl.inline_asm_elementwise(
        asm="""{
        .reg .b32 m, s, e;
        .reg .b16 e01, e23;
        and.b32 m, $2, 0x07070707;
        shl.b32 m, m, 2;
        and.b32 s, $2, 0x08080808;
        shl.b32 s, s, 4;
        or.b32 e, m, s;
        mov.b32 {e01, e23}, e;
        cvt.rn.f16x2.e4m3x2 $0, e01;
        cvt.rn.f16x2.e4m3x2 $1, e23;
        }""",
        constraints="=r,=r,r", args=[p], dtype=tl.float16, is_pure=True, pack=4)


@triton.jit
def _e2m1x4_hi_to_f16(p):
    """High nibbles of 4 bytes -> 4 f16 (E2M1 value times 2**-6), as above."""
    return tl.inline_asm_elementwise(
        asm="""{
        .reg .b32 m, s, e;
        .reg .b16 e01, e23;
        shr.b32 m, $2, 2;
        and.b32 m, m, 0x1C1C1C1C;
        and.b32 s, $2, 0x80808080;
        or.b32 e, m, s;
        mov.b32 {e01, e23}, e;
        cvt.rn.f16x2.e4m3x2 $0, e01;
        cvt.rn.f16x2.e4m3x2 $1, e23;
        }""",
        constraints="=r,=r,r", args=[p], dtype=tl.float16, is_pure=True, pack=4)


@triton.jit
def _mxfp8_tile(w_rows, s_rows, k0, BN: tl.constexpr, BK: tl.constexpr, DOT_FP32: tl.constexpr):
    """[BN, BK] from e4m3 bytes and E8M0 exponents; exact (power-of-two scaling). bf16 on the GPU; fp32
    under the interpreter, whose bf16 arithmetic is unreliable."""
    kk = k0 + tl.arange(0, BK)
    sb = tl.load(s_rows + (k0 // 32 + tl.arange(0, BK // 32))[None, :])
    # 2**(b - 127) straight from the bits: the byte is the biased exponent field of bf16 and fp32 alike.
    if DOT_FP32:
        v = tl.load(w_rows + kk[None, :]).to(tl.float8e4nv, bitcast=True).to(tl.float32)
        sc = (sb.to(tl.int32) << 23).to(tl.float32, bitcast=True)
    else:
        v = _e4m3x4_to_bf16(tl.load(w_rows + kk[None, :]))
        sc = (sb.to(tl.int16) << 7).to(tl.bfloat16, bitcast=True)
    v = tl.reshape(v, (BN, BK // 32, 32)) * sc[:, :, None]
    return tl.reshape(v, (BN, BK))


@triton.jit
def _nvfp4_tiles(w_rows, s_rows, k0, BN: tl.constexpr, BK: tl.constexpr, DOT_FP32: tl.constexpr):
    """Even- and odd-input halves [BN, BK/2] of a weight tile, each value times 2**-6, as f16 (exact:
    code * 2**-6 * E4M3 block scale has at most 5 significant bits and stays >= 2**-16). Under the
    interpreter the same bit trick runs in plain Triton and the result is fp32."""
    kb = k0 // 2 + tl.arange(0, BK // 2)
    p = tl.load(w_rows + kb[None, :])
    sb = tl.load(s_rows + (k0 // 16 + tl.arange(0, BK // 16))[None, :]).to(tl.float8e4nv, bitcast=True)
    if DOT_FP32:
        lo = (((p & 0x7) << 2) | ((p & 0x8) << 4)).to(tl.uint8).to(tl.float8e4nv, bitcast=True)
        hi = (((p >> 2) & 0x1C) | (p & 0x80)).to(tl.uint8).to(tl.float8e4nv, bitcast=True)
        lo, hi, sc = lo.to(tl.float32), hi.to(tl.float32), sb.to(tl.float32)[:, :, None]
    else:
        lo, hi, sc = _e2m1x4_lo_to_f16(p), _e2m1x4_hi_to_f16(p), sb.to(tl.float16)[:, :, None]
    lo = tl.reshape(tl.reshape(lo, (BN, BK // 16, 8)) * sc, (BN, BK // 2))
    hi = tl.reshape(tl.reshape(hi, (BN, BK // 16, 8)) * sc, (BN, BK // 2))
    return lo, hi


@triton.jit
def _load_act(a_rows, k0, K, FMT: tl.constexpr, BK: tl.constexpr):
    """Activation tile for K step k0. NVFP4: the low nibbles meet the even inputs and the high nibbles the
    odd ones, so activation rows come de-interleaved ([K/2 even | K/2 odd], f16) and (even, odd) halves
    are two plain loads; other formats: one [BM, BK] tile (the second value is unused)."""
    if FMT == 2:
        ke = k0 // 2 + tl.arange(0, BK // 2)
        return tl.load(a_rows + ke[None, :]), tl.load(a_rows + (K // 2 + ke)[None, :])
    else:
        a = tl.load(a_rows + (k0 + tl.arange(0, BK))[None, :])
        return a, a


@triton.jit
def _accumulate(a0, a1, w_rows, s_rows, k0, acc, FMT: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr,
                DOT_FP32: tl.constexpr):
    """acc[BM, BN] += a @ w[:, k0:k0+BK]^T with the weight tile dequantized in registers."""
    if FMT == 2:
        lo, hi = _nvfp4_tiles(w_rows, s_rows, k0, BN, BK, DOT_FP32)
        acc = _mma(a0, lo, acc, DOT_FP32)
        acc = _mma(a1, hi, acc, DOT_FP32)
    elif FMT == 1:
        acc = _mma(a0, _mxfp8_tile(w_rows, s_rows, k0, BN, BK, DOT_FP32), acc, DOT_FP32)
    else:
        acc = _mma(a0, tl.load(w_rows + (k0 + tl.arange(0, BK))[None, :]), acc, DOT_FP32)
    return acc


@triton.jit
def _deinterleaved(k, half):
    """Where input k of a row goes in the NVFP4 paths' f16 inputs (x and the activation): [even inputs | odd
    inputs], so that the low and the high nibbles of a weight byte each meet a contiguous half."""
    return (k % 2) * half + k // 2


@triton.jit
def _x_row_to_f16(x_ptr, stride_xt, x16_ptr, xs_ptr, H, t, DEINTERLEAVE: tl.constexpr, BLOCK: tl.constexpr):
    """Input of the f16 MMAs (NVFP4, and MXFP8 in the register kernels): row t of x times 2**-p_t as f16
    (NVFP4: de-interleaved, [even inputs | odd inputs]), with p_t = the smallest power that keeps the row under
    2**15 (0 for ordinary activations, where bf16 -> f16 is exact); xs[t] = 2**p_t undoes it in the epilogue.
    BLOCK >= H: the row is read once, into registers (one load latency)."""
    cols = tl.arange(0, BLOCK)
    v = tl.load(x_ptr + t * stride_xt + cols, mask=cols < H, other=0.0).to(tl.float32)
    biased = (tl.max(tl.abs(v), axis=0).to(tl.int32, bitcast=True) >> 23) & 0xFF  # amax < 2**(biased - 126)
    p = tl.maximum(biased - 141, 0)
    down = ((127 - p) << 23).to(tl.float32, bitcast=True)
    dst = x16_ptr + t * H + (_deinterleaved(cols, H // 2) if DEINTERLEAVE else cols)
    tl.store(dst, (v * down).to(tl.float16), mask=cols < H)
    tl.store(xs_ptr + t, ((127 + p) << 23).to(tl.float32, bitcast=True))


@triton.jit
def _x_to_f16_kernel(x_ptr, stride_xt, x16_ptr, xs_ptr, H, DEINTERLEAVE: tl.constexpr, BLOCK: tl.constexpr):
    """grid (T,): `_x_row_to_f16` of each token."""
    _x_row_to_f16(x_ptr, stride_xt, x16_ptr, xs_ptr, H, tl.program_id(0), DEINTERLEAVE, BLOCK)


@triton.jit
def _route_and_convert_kernel(ids_ptr, sorted_ptr, position_ptr, offsets_ptr, tile_expert_ptr, tile_start_ptr,
                              num_slots, num_experts, n_tiles, x_ptr, stride_xt, x16_ptr, xs_ptr, H, tickets_ptr,
                              n_tickets, RB: tl.constexpr, NB: tl.constexpr, BM: tl.constexpr, TB: tl.constexpr,
                              DEINTERLEAVE: tl.constexpr, BLOCK: tl.constexpr):
    """grid (1 + T,): at decode sizes, program 0 routes every slot (`_rank_slots` as one program, tile list
    included) and zeroes the n_tickets counters of the split register gate/up GEMM (`register_kernels`), and
    program 1 + t converts token t (`_x_row_to_f16`): independent steps that each took a launch on the path of every
    decode step, in one."""
    p = tl.program_id(0)
    if p == 0:
        _rank_slots(ids_ptr, sorted_ptr, position_ptr, offsets_ptr, tile_expert_ptr, tile_start_ptr, num_slots,
                    num_experts, n_tiles, 0, RB, NB, NB, True, BM, TB)
        for start in range(0, n_tickets, 1024):
            offsets = start + tl.arange(0, 1024)
            tl.store(tickets_ptr + offsets, 0, mask=offsets < n_tickets)
    else:
        _x_row_to_f16(x_ptr, stride_xt, x16_ptr, xs_ptr, H, p - 1, DEINTERLEAVE, BLOCK)


@triton.jit
def _softcap(v, cap):
    """cap * tanh(v / cap) in fp32 from exp (a short series near 0 keeps the relative error small)."""
    z = v / cap
    az = tl.abs(z)
    ex = tl.exp(-2.0 * az)
    t = (1.0 - ex) / (1.0 + ex)
    z2 = z * z
    t = tl.where(az < 0.0625, az * (1.0 - z2 * (0.3333333333333333 - z2 * 0.13333333333333333)), t)
    return cap * tl.where(z < 0, -t, t)


@triton.jit
def _tile_rows(tile_expert_ptr, tile_start_ptr, offsets_ptr, tile, BM: tl.constexpr):
    e = tl.load(tile_expert_ptr + tile)
    row0 = tl.load(tile_start_ptr + tile)
    row_end = tl.load(offsets_ptr + tl.maximum(e, 0) + 1)
    rows = row0 + tl.arange(0, BM)
    rmask = rows < row_end
    return e, tl.where(rmask, rows, row0), rmask


@triton.jit
def _softcapped_swiglu(gate, up, gate_cap, up_cap):
    """Softcapped SwiGLU in fp32 (the sigmoid sees the raw gate), rounded to bf16 like the reference. Also
    called from the Gluon kernels of register_kernels."""
    return (_softcap(gate, gate_cap) * (1.0 / (1.0 + tl.exp(-gate))) * _softcap(up, up_cap)).to(tl.bfloat16)


@triton.jit
def _swiglu_store(acc_g, acc_u, act_ptr, stride_at, rows, cols, smask, I, gate_cap, up_cap, FMT: tl.constexpr):
    act = _softcapped_swiglu(acc_g, acc_u, gate_cap, up_cap)
    if FMT == 2:
        # |act| <= cap_g * cap_u = 100, so the bf16 value is exact in f16; stored de-interleaved for the
        # down projection's nibble halves.
        dst = act_ptr + rows[:, None] * stride_at + _deinterleaved(cols, I // 2)[None, :]
        tl.store(dst, act.to(tl.float32).to(tl.float16), mask=smask)
    else:
        tl.store(act_ptr + rows[:, None] * stride_at + cols[None, :], act, mask=smask)


@triton.jit
def _gate_up_kernel(
    x_ptr, stride_xt, sorted_ptr, tile_expert_ptr, tile_start_ptr, offsets_ptr,
    w_ptr, stride_we, stride_wn, s_ptr, stride_se, stride_sn, outer_ptr, xs_ptr,
    act_ptr, stride_at, part_ptr, num_slots, H, I, gate_cap, up_cap,
    TOPK: tl.constexpr, FMT: tl.constexpr, BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr,
    SPLIT_K: tl.constexpr, DOT_FP32: tl.constexpr,
):
    """grid (tiles, cdiv(I, BN), SPLIT_K). With SPLIT_K > 1 each program sums one K slice and writes fp32
    partial gate/up rows to part[SPLIT_K, num_slots, 2I]; _swiglu_kernel finishes them in fixed order."""
    tile = tl.program_id(0)
    e, rows, rmask = _tile_rows(tile_expert_ptr, tile_start_ptr, offsets_ptr, tile, BM)
    if e < 0:
        return
    toks = tl.load(sorted_ptr + rows) // TOPK
    cols = tl.program_id(1) * BN + tl.arange(0, BN)
    cmask = cols < I
    cols = tl.where(cmask, cols, 0)  # clamped rows are read but never stored: no masks on weight loads
    e64 = e.to(tl.int64)
    wg_rows = w_ptr + e64 * stride_we + cols[:, None] * stride_wn
    wu_rows = wg_rows + I * stride_wn
    sg_rows = s_ptr + e64 * stride_se + cols[:, None] * stride_sn
    su_rows = sg_rows + I * stride_sn
    x_rows = x_ptr + toks[:, None] * stride_xt
    acc_g = tl.zeros((BM, BN), dtype=tl.float32)
    acc_u = tl.zeros((BM, BN), dtype=tl.float32)
    steps = H // (SPLIT_K * BK)  # K slice of this program: [k_begin, k_begin + steps * BK)
    k_begin = tl.program_id(2) * steps * BK
    for i in range(steps):
        k0 = k_begin + i * BK  # written so the compiler sees multiples of BK (16-byte loads, cp.async)
        x0, x1 = _load_act(x_rows, k0, H, FMT, BK)
        acc_g = _accumulate(x0, x1, wg_rows, sg_rows, k0, acc_g, FMT, BN, BK, DOT_FP32)
        acc_u = _accumulate(x0, x1, wu_rows, su_rows, k0, acc_u, FMT, BN, BK, DOT_FP32)
    if FMT == 2:  # 2**6 of the nibble decode, the outer multipliers, the per-token x scale
        row_scale = tl.load(xs_ptr + toks)[:, None] * 64.0
        acc_g = acc_g * (row_scale * tl.load(outer_ptr + 2 * e))
        acc_u = acc_u * (row_scale * tl.load(outer_ptr + 2 * e + 1))
    smask = rmask[:, None] & cmask[None, :]
    if SPLIT_K == 1:
        _swiglu_store(acc_g, acc_u, act_ptr, stride_at, rows, cols, smask, I, gate_cap, up_cap, FMT)
    else:
        part = part_ptr + tl.program_id(2) * num_slots * 2 * I + rows[:, None] * (2 * I) + cols[None, :]
        tl.store(part, acc_g, mask=smask)
        tl.store(part + I, acc_u, mask=smask)


@triton.jit
def _swiglu_kernel(part_ptr, offsets_ptr, act_ptr, stride_at, num_slots, num_experts, I, gate_cap, up_cap,
                   FMT: tl.constexpr, SPLIT_K: tl.constexpr, BR: tl.constexpr, BC: tl.constexpr):
    """Sums the SPLIT_K partial gate/up rows in slice order (deterministic) and applies the SwiGLU."""
    rows = tl.program_id(0) * BR + tl.arange(0, BR)
    cols = tl.program_id(1) * BC + tl.arange(0, BC)
    smask = (rows < tl.load(offsets_ptr + num_experts))[:, None] & (cols < I)[None, :]
    g = tl.zeros((BR, BC), dtype=tl.float32)
    u = tl.zeros((BR, BC), dtype=tl.float32)
    for ks in tl.static_range(SPLIT_K):
        part = part_ptr + ks * num_slots * 2 * I + rows[:, None] * (2 * I) + cols[None, :]
        g += tl.load(part, mask=smask, other=0.0)
        u += tl.load(part + I, mask=smask, other=0.0)
    _swiglu_store(g, u, act_ptr, stride_at, rows, cols, smask, I, gate_cap, up_cap, FMT)


@triton.jit
def _down_kernel(
    act_ptr, stride_at, sorted_ptr, tile_expert_ptr, tile_start_ptr, offsets_ptr, rw_ptr,
    w_ptr, stride_we, stride_wn, s_ptr, stride_se, stride_sn, outer_ptr,
    y_ptr, num_slots, H, I,
    FMT: tl.constexpr, BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr, SPLIT_K: tl.constexpr,
    DOT_FP32: tl.constexpr,
):
    """grid (tiles, cdiv(H, BN), SPLIT_K): y[ks, slot] = routing weight * (act @ w2^T over K slice ks)."""
    tile = tl.program_id(0)
    e, rows, rmask = _tile_rows(tile_expert_ptr, tile_start_ptr, offsets_ptr, tile, BM)
    if e < 0:
        return
    slots = tl.load(sorted_ptr + rows)
    cols = tl.program_id(1) * BN + tl.arange(0, BN)
    cmask = cols < H
    cols_c = tl.where(cmask, cols, 0)
    e64 = e.to(tl.int64)
    w_rows = w_ptr + e64 * stride_we + cols_c[:, None] * stride_wn
    s_rows = s_ptr + e64 * stride_se + cols_c[:, None] * stride_sn
    a_rows = act_ptr + rows[:, None] * stride_at
    acc = tl.zeros((BM, BN), dtype=tl.float32)
    steps = I // (SPLIT_K * BK)
    k_begin = tl.program_id(2) * steps * BK
    for i in range(steps):
        k0 = k_begin + i * BK
        a0, a1 = _load_act(a_rows, k0, I, FMT, BK)
        acc = _accumulate(a0, a1, w_rows, s_rows, k0, acc, FMT, BN, BK, DOT_FP32)
    if FMT == 2:
        acc = acc * (tl.load(outer_ptr + e) * 64.0)
    acc = acc * tl.load(rw_ptr + slots)[:, None]
    ptrs = y_ptr + tl.program_id(2) * num_slots * H + slots[:, None] * H + cols[None, :]
    tl.store(ptrs, acc, mask=rmask[:, None] & cmask[None, :])


@triton.jit
def _combine_kernel(y_ptr, ids_ptr, out_ptr, stride_ot, num_slots, H, num_experts, TOPK: tl.constexpr,
                    SPLIT_K: tl.constexpr, BLOCK: tl.constexpr):
    t = tl.program_id(0)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    cmask = cols < H
    acc = tl.zeros((BLOCK,), dtype=tl.float32)
    for j in tl.static_range(TOPK):  # slot order then K-slice order, no atomics: bitwise reproducible
        e = tl.load(ids_ptr + t * TOPK + j)
        routed = (e >= 0) & (e < num_experts)
        for ks in tl.static_range(SPLIT_K):
            acc += tl.load(y_ptr + ks * num_slots * H + (t * TOPK + j) * H + cols, mask=cmask & routed, other=0.0)
    tl.store(out_ptr + t * stride_ot + cols, acc.to(tl.bfloat16), mask=cmask)
