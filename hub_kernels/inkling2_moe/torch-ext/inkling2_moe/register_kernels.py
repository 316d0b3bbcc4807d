"""NVFP4 and MXFP8 expert GEMMs for decode sizes (at most 8 slots per expert and tile), in Gluon: the weight bytes
go from global memory straight into the registers of an mma.sync A operand, with no shared-memory round trip.
Imported lazily (CUDA, compute capability >= 8.9, Triton with Gluon); `ops.moe_forward` uses the Triton
kernels elsewhere.

Why: at decode sizes the expert GEMMs stream weights, and the Triton kernels spend about 3.7 instructions per
NVFP4 weight (docs/benchmarks.md): the dequantized tile goes through shared memory into the MMA's operand
layout, and every nibble through an E4M3 conversion. Here:

* a program owns 64 weight rows (4 warps of 16) and 8 slots; each 256-input step, lane 4 g + t of a warp
  loads bytes [16 t, 16 t + 16) and [64 + 16 t, 80 + 16 t) of the step from rows g and g + 8 of its warp's
  16 (the checkpoint's own layout, `[N, K/2]`, low nibble = even input): exactly the rows, and the number of
  values, of its A-operand fragments. Contiguous bytes per row and step matter most (whole-MoE calls at
  T = 8 / 64 on an H200, before the SwiGLU moved in: rows x bytes per step 64 x 64: 48-51% of the copy
  bandwidth, 256 x 64: 46-48%, 128 x 128: 57-61%, 64 x 128: 64-69%; docs/benchmarks.md);
* a dot product does not care in which order its inputs come, as long as both operands agree: the weight
  values are relabeled to the operand's input positions by a reshape/permute that moves no data
  (`WEIGHTS_ORDER`), and the activations get the same relabeling (`ACTIVATIONS_ORDER`); every relabeling is
  checked at compile time (`convert_layout(..., assert_trivial=True)`);
* a 32-bit word holds nibbles n0..n7; nibbles i and i + 4 need the same shift to land as f16 bits
  s.00eem.000000000 (the E2M1 value times 2**-14, subnormals included), so 8 values take 4 pairs of shifts and
  masks and no conversion instruction (`_DECODE`). A pair holds bytes (0, 2) or (1, 3) of the word, so decoded
  position j holds byte j with bits 0 and 1 swapped; the activations are relabeled the same way;
* the low nibbles meet the even inputs and the high nibbles the odd ones, so activations come de-interleaved
  (`[K/2 even | K/2 odd]` f16, as the Triton NVFP4 path writes them);
* the E4M3 block scale multiplies the decoded f16 pairs (exact: every product is a multiple of 2**-24 below 2**-2).

MXFP8 (`_mxfp8_rows_by_slots`) takes the same 128 bytes of 64 rows per step, now 128 inputs: E4M3 converts to
f16 exactly, but an E8M0 scale (2**-127 .. 2**127) does not fit f16. So each 32-input block, whose four lanes
t load 8 bytes each of rows g and g + 8, is its own k32 product from zero, multiplied by the rows' scales in
fp32 and added to the accumulator: exact for every scale byte, at 2 MMAs and 4 FMAs per block and lane. x and
the activation are f16 in their own order (`MX_WEIGHTS_ORDER` / `MX_ACTIVATIONS_ORDER` relabel within a block).

The gate/up kernel applies the softcapped SwiGLU itself (each 16-row block holds 8 gate rows and their 8 up rows,
so both values of a feature meet in one thread) or, with the reduction split, writes fp32 gate and up sums per
K slice for the Triton `_swiglu_kernel`; the down kernel writes the routing-weighted rows per K slice for the
Triton `_combine_kernel`. Bitwise reproducible, no atomics; grids fixed by the sizes (CUDA-graph capturable).
"""

from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.ampere import mma_v2

from .triton_kernels import FMT_NVFP4, _deinterleaved, _softcapped_swiglu

NVFP4 = gl.constexpr(FMT_NVFP4)  # the kernels' FMT: NVFP4 or (else) MXFP8

WARPS = gl.constexpr(4)
ROWS = gl.constexpr(64)  # weight rows per program
FEATURES = gl.constexpr(ROWS.value // 2)  # gate/up kernel: features per program (a gate row and an up row each)
STEP_BYTES = gl.constexpr(128)  # bytes of a row per step (256 NVFP4 or 128 MXFP8 inputs: `_step_inputs`)
DECODE_SCALE = gl.constexpr(2.0**14)  # decoded values are the E2M1 values times 2**-14

# A step's bytes [64 rows, 128]: registers 16 consecutive bytes, row + 8, byte + 64; lane 4 g + t: byte 16 t,
# row g; warps: rows + 16, + 32.
W_LAYOUT = gl.constexpr(gl.DistributedLinearLayout(
    reg_bases=[[0, 1], [0, 2], [0, 4], [0, 8], [8, 0], [0, 64]],
    lane_bases=[[0, 16], [0, 32], [1, 0], [2, 0], [4, 0]], warp_bases=[[16, 0], [32, 0]], block_bases=[],
    shape=[ROWS.value, STEP_BYTES.value]))
# Its block scales [64 rows, 16 blocks of 16 inputs (8 bytes)]: each thread those of its bytes.
S_LAYOUT = gl.constexpr(gl.DistributedLinearLayout(
    reg_bases=[[0, 1], [8, 0], [0, 8]],
    lane_bases=[[0, 2], [0, 4], [1, 0], [2, 0], [4, 0]], warp_bases=[[16, 0], [32, 0]], block_bases=[],
    shape=[ROWS.value, STEP_BYTES.value // 8]))
# One half (even or odd inputs) of a step's activations [8 slots, 128]: lane 4 g + t holds slot g's values of
# the bytes lane t loads; every warp holds all of them.
X_LAYOUT = gl.constexpr(gl.DistributedLinearLayout(
    reg_bases=[[0, 1], [0, 2], [0, 4], [0, 8], [0, 64]],
    lane_bases=[[0, 16], [0, 32], [1, 0], [2, 0], [4, 0]], warp_bases=[[0, 0], [0, 0]], block_bases=[],
    shape=[8, STEP_BYTES.value]))
MMA = gl.constexpr(gl.NVMMADistributedLayout(version=[2, 0], warps_per_cta=[WARPS.value, 1], instr_shape=[16, 8]))
A_OPERAND = gl.constexpr(gl.DotOperandLayout(operand_index=0, parent=MMA.value, k_width=2))
B_OPERAND = gl.constexpr(gl.DotOperandLayout(operand_index=1, parent=MMA.value, k_width=2))

# Decoded position j of a step (bits: j6 chunk, j5 j4 = t, j3 j2 word, j1 j0 byte of the word) -> the operand's
# input j0 + 2 j4 + 4 j5 + 8 j1 + 16 j2 + 32 j3 + 64 j6 (t on the operand's lane bits, the rest on registers),
# as a permutation of [rows, j6, j5, j4, j3, j2, j1, j0]:
WEIGHTS_ORDER = gl.constexpr((0, 1, 4, 5, 6, 2, 3, 7))
# The activations [slots, j6..j0] go to [inputs, slots] the same way after swapping j1 and j0 (see `_DECODE`).
ACTIVATIONS_ORDER = gl.constexpr((1, 4, 5, 7, 2, 3, 6, 0))
BYTE_BITS = gl.constexpr(7)

# MXFP8: one E8M0 scale per 32 inputs, so a step's 128 bytes go through the MMA as four 32-input blocks, each its
# own k32 product (from zero) that is multiplied by its rows' scales in fp32 and added. A block's bytes [64 rows,
# 32]: registers 8 consecutive bytes, row + 8; lane 4 g + t: byte 8 t, row g; warps: rows + 16, + 32.
MX_BLOCK = gl.constexpr(32)
MX_W_LAYOUT = gl.constexpr(gl.DistributedLinearLayout(
    reg_bases=[[0, 1], [0, 2], [0, 4], [8, 0]], lane_bases=[[0, 8], [0, 16], [1, 0], [2, 0], [4, 0]],
    warp_bases=[[16, 0], [32, 0]], block_bases=[], shape=[ROWS.value, MX_BLOCK.value]))
# A block of the activations [8 slots, 32]: lane 4 g + t holds slot g's values of the bytes lane t loads.
MX_X_LAYOUT = gl.constexpr(gl.DistributedLinearLayout(
    reg_bases=[[0, 1], [0, 2], [0, 4]], lane_bases=[[0, 8], [0, 16], [1, 0], [2, 0], [4, 0]],
    warp_bases=[[0, 0], [0, 0]], block_bases=[], shape=[8, MX_BLOCK.value]))
# Byte p = j0 + 2 j1 + 4 j2 + 8 t0 + 16 t1 of a block (t: the lane's t) -> operand input j0 + 2 t0 + 4 t1 + 8 j1 + 16 j2,
# as permutations of [rows, p4, p3, p2, p1, p0] and of [slots, p4, ..., p0] (to [inputs, slots]):
MX_WEIGHTS_ORDER = gl.constexpr((0, 3, 4, 1, 2, 5))
MX_ACTIVATIONS_ORDER = gl.constexpr((3, 4, 1, 2, 5, 0))
MX_BLOCK_BITS = gl.constexpr(5)
MX_STEP_BLOCKS = gl.constexpr(STEP_BYTES.value // MX_BLOCK.value)
# A step's E8M0 scales [64 rows, 4 blocks]: each thread those of its two rows (the MMA accumulator's rows).
MX_S_LAYOUT = gl.constexpr(gl.DistributedLinearLayout(
    reg_bases=[[0, 1], [0, 2], [8, 0]], lane_bases=[[0, 0], [0, 0], [1, 0], [2, 0], [4, 0]],
    warp_bases=[[16, 0], [32, 0]], block_bases=[], shape=[ROWS.value, MX_STEP_BLOCKS.value]))

# 4 bytes b0..b3 (nibbles n0..n7, n0 = low nibble of b0) -> f16x2 (n0, n4), (n2, n6) [low nibbles of bytes
# (0, 2), (1, 3)] and (n1, n5), (n3, n7) [their high nibbles]: sign to bit 15, magnitude to bits 9-11.
_DECODE = gl.constexpr("""{
.reg .b32 m, s;
shl.b32 m, $4, 9;
shl.b32 s, $4, 12;
and.b32 m, m, 0x0E000E00;
and.b32 s, s, 0x80008000;
or.b32 $0, m, s;
shl.b32 m, $4, 1;
shl.b32 s, $4, 4;
and.b32 m, m, 0x0E000E00;
and.b32 s, s, 0x80008000;
or.b32 $1, m, s;
shl.b32 m, $4, 5;
shl.b32 s, $4, 8;
and.b32 m, m, 0x0E000E00;
and.b32 s, s, 0x80008000;
or.b32 $2, m, s;
shr.b32 m, $4, 3;
and.b32 m, m, 0x0E000E00;
and.b32 s, $4, 0x80008000;
or.b32 $3, m, s;
}""")


# fmt: off
@gluon.jit
def _decode(q):
    """A step's bytes [64, 128] -> (low nibbles, high nibbles) as f16 times 2**-14, position j holding byte j
    with bits 0 and 1 swapped."""
    return gl.inline_asm_elementwise(asm=_DECODE, constraints="=r,=r,=r,=r,r", args=[q],
                                     dtype=(gl.float16, gl.float16), is_pure=True, pack=4)


@gluon.jit
def _weights_operand(values):
    v = gl.permute(gl.reshape(values, [ROWS] + [2] * BYTE_BITS), WEIGHTS_ORDER.value)
    return gl.convert_layout(gl.reshape(v, [ROWS, STEP_BYTES]), A_OPERAND, assert_trivial=True)


@gluon.jit
def _activations_operand(x):
    x = gl.permute(gl.reshape(x, [8] + [2] * BYTE_BITS), ACTIVATIONS_ORDER.value)
    return gl.convert_layout(gl.reshape(x, [STEP_BYTES, 8]), B_OPERAND, assert_trivial=True)


@gluon.jit
def _scaled(values, scales):
    """values [64, 128] times the block scale of their 8 consecutive positions (one block of 16 inputs)."""
    v3 = gl.reshape(values, [ROWS, STEP_BYTES // 8, 8])
    s = gl.convert_layout(scales, gl.SliceLayout(2, v3.type.layout), assert_trivial=True)
    return gl.reshape(v3 * gl.expand_dims(s, 2), [ROWS, STEP_BYTES])


@gluon.jit
def _step(q, s, x_even, x_odd, acc):
    scales = s.to(gl.float8e4nv, bitcast=True).to(gl.float16)
    low, high = _decode(q)
    acc = mma_v2(_weights_operand(_scaled(low, scales)), _activations_operand(x_even), acc)
    return mma_v2(_weights_operand(_scaled(high, scales)), _activations_operand(x_odd), acc)


@gluon.jit
def _load_step(w_ptrs, s_ptrs, x_ptrs, half_k, step):
    offset = step * STEP_BYTES
    return (gl.load(w_ptrs + offset), gl.load(s_ptrs + offset // 8), gl.load(x_ptrs + offset),
            gl.load(x_ptrs + (half_k + offset)))


@gluon.jit
def _nvfp4_rows_by_slots(w_rows, s_rows, x_rows, half_k, first, steps):
    """[64 weight rows, 8 slots] fp32 (times 2**-14) over the 256-input steps [first, first + steps).
    w_rows / s_rows: [64] pointers to the rows' packed bytes / block scales (slices of W_LAYOUT / S_LAYOUT);
    x_rows: [8] pointers to the slots' de-interleaved f16 rows (odd inputs at + half_k)."""
    w_ptrs = gl.expand_dims(w_rows, 1) + gl.expand_dims(gl.arange(0, STEP_BYTES, gl.SliceLayout(0, W_LAYOUT)), 0)
    s_ptrs = gl.expand_dims(s_rows, 1) + gl.expand_dims(gl.arange(0, STEP_BYTES // 8, gl.SliceLayout(0, S_LAYOUT)), 0)
    x_ptrs = gl.expand_dims(x_rows, 1) + gl.expand_dims(gl.arange(0, STEP_BYTES, gl.SliceLayout(0, X_LAYOUT)), 0)
    acc = gl.zeros([ROWS, 8], gl.float32, layout=MMA)
    for step in range(first, first + steps):
        q, s, x_even, x_odd = _load_step(w_ptrs, s_ptrs, x_ptrs, half_k, step)
        acc = _step(q, s, x_even, x_odd, acc)
    return acc


@gluon.jit
def _e8m0(s):
    """E8M0 bytes -> fp32 2**(s - 127), as the reference's exp2: byte 0 is 2**-127 (a subnormal), 255 is inf."""
    bits = s.to(gl.int32) << 23
    return (bits | gl.where(s == 0, 0x400000, 0)).to(gl.float32, bitcast=True)


@gluon.jit
def _mxfp8_block(w_ptrs, x_ptrs, k, scale, zero, acc):
    """acc + scale[row] * the product over the 32 inputs from k: a k32 MMA from zero, scaled in fp32."""
    w = gl.load(w_ptrs + k).to(gl.float8e4nv, bitcast=True).to(gl.float16)  # exact: E4M3 is within f16
    w = gl.permute(gl.reshape(w, [ROWS] + [2] * MX_BLOCK_BITS), MX_WEIGHTS_ORDER.value)
    x = gl.permute(gl.reshape(gl.load(x_ptrs + k), [8] + [2] * MX_BLOCK_BITS), MX_ACTIVATIONS_ORDER.value)
    block = mma_v2(gl.convert_layout(gl.reshape(w, [ROWS, MX_BLOCK]), A_OPERAND, assert_trivial=True),
                   gl.convert_layout(gl.reshape(x, [MX_BLOCK, 8]), B_OPERAND, assert_trivial=True), zero)
    return acc + block * gl.expand_dims(gl.convert_layout(scale, gl.SliceLayout(1, MMA), assert_trivial=True), 1)


@gluon.jit
def _mxfp8_rows_by_slots(w_rows, s_rows, x_rows, first, steps):
    """[64 weight rows, 8 slots] fp32 over the 128-input steps [first, first + steps), exact E8M0 scaling.
    w_rows: [64] pointers to the rows' E4M3 bytes (slice of MX_W_LAYOUT); s_rows: [64] pointers to their E8M0
    bytes (slice of MX_S_LAYOUT); x_rows: [8] pointers to the slots' f16 rows (slice of MX_X_LAYOUT)."""
    w_ptrs = gl.expand_dims(w_rows, 1) + gl.expand_dims(gl.arange(0, MX_BLOCK, gl.SliceLayout(0, MX_W_LAYOUT)), 0)
    x_ptrs = gl.expand_dims(x_rows, 1) + gl.expand_dims(gl.arange(0, MX_BLOCK, gl.SliceLayout(0, MX_X_LAYOUT)), 0)
    s_ptrs = gl.expand_dims(s_rows, 1) + gl.expand_dims(gl.arange(0, MX_STEP_BLOCKS, gl.SliceLayout(0, MX_S_LAYOUT)), 0)
    acc = gl.zeros([ROWS, 8], gl.float32, layout=MMA)
    zero = gl.zeros([ROWS, 8], gl.float32, layout=MMA)
    for step in range(first, first + steps):
        # the step's four scales of a row in one load at its start (one load per block, issued late by the
        # compiler: 56-57% of the copy bandwidth at T = 1 against 60-62%, docs/benchmarks.md)
        scales = _e8m0(gl.load(s_ptrs + step * MX_STEP_BLOCKS))
        even, odd = gl.split(gl.reshape(scales, [ROWS, 2, 2]))  # blocks (0, 2) and (1, 3)
        s0, s2 = gl.split(even)
        s1, s3 = gl.split(odd)
        k = step * STEP_BYTES
        acc = _mxfp8_block(w_ptrs, x_ptrs, k, s0, zero, acc)
        acc = _mxfp8_block(w_ptrs, x_ptrs, k + MX_BLOCK, s1, zero, acc)
        acc = _mxfp8_block(w_ptrs, x_ptrs, k + 2 * MX_BLOCK, s2, zero, acc)
        acc = _mxfp8_block(w_ptrs, x_ptrs, k + 3 * MX_BLOCK, s3, zero, acc)
    return acc


@gluon.jit
def _rows_by_slots(w_rows, s_rows, x_rows, K, first, steps, FMT: gl.constexpr):
    """[64 weight rows, 8 slots] fp32 over the steps [first, first + steps) of K inputs (`_step_inputs`), in
    units of `_decode_scale`. Pointers as slices of W_LAYOUT (weights), S_LAYOUT (scales), X_LAYOUT (slots)."""
    if FMT == NVFP4:
        acc = _nvfp4_rows_by_slots(w_rows, s_rows, x_rows, K // 2, first, steps)
    else:
        acc = _mxfp8_rows_by_slots(gl.convert_layout(w_rows, gl.SliceLayout(1, MX_W_LAYOUT), assert_trivial=True),
                                   gl.convert_layout(s_rows, gl.SliceLayout(1, MX_S_LAYOUT), assert_trivial=True),
                                   gl.convert_layout(x_rows, gl.SliceLayout(1, MX_X_LAYOUT), assert_trivial=True),
                                   first, steps)
    return acc


@gluon.jit
def _step_inputs(FMT: gl.constexpr):
    """Inputs per step: 128 bytes of a row hold 256 NVFP4 or 128 MXFP8 values."""
    return 2 * STEP_BYTES if FMT == NVFP4 else STEP_BYTES


@gluon.jit
def _decode_scale(FMT: gl.constexpr):
    """What the accumulator must be multiplied by: NVFP4 values are decoded times 2**-14, MXFP8 exactly."""
    return DECODE_SCALE if FMT == NVFP4 else 1.0


@gluon.jit
def _tile(tile_expert_ptr, tile_start_ptr, offsets_ptr):
    """This program's expert (-1: no tile), its first sorted position and its expert's end."""
    tile = gl.program_id(0)
    e = gl.load(tile_expert_ptr + tile)
    return e, gl.load(tile_start_ptr + tile), gl.load(offsets_ptr + gl.maximum(e, 0) + 1)


@gluon.jit
def _positions(start, end, layout: gl.constexpr):
    """The tile's 8 sorted positions (those past the expert's end replaced by the first, so loads stay in
    bounds) and which of them are real."""
    positions = start + gl.arange(0, 8, layout=layout)
    real = positions < end
    return gl.where(real, positions, start), real


@gluon.jit
def _gate_up_rows(c, I, layout: gl.constexpr):
    """w13 rows of program c: each 16-row block of the MMA holds 8 gate rows (g) and their 8 up rows (g + 8),
    so a thread's accumulator holds the gate and the up value of the same features (register bit row + 8)."""
    r = gl.arange(0, ROWS, layout=layout)
    return FEATURES * c + 8 * (r // 16) + r % 8 + (r // 8 % 2) * I


@gluon.jit
def _store_activation(gate_up, outer_gate, outer_up, act_ptr, c, start, end, I, gate_cap, up_cap, FMT: gl.constexpr):
    """act[position, feature] (f16, in x's order) of the gate and up sums [64 w13 rows, 8 slots] (MMA layout, scaled
    but for the outer multipliers): the softcapped SwiGLU of each feature's gate and up value, which one thread
    holds."""
    # [warp, gate/up, g, slot] -> gate and up [32 features, 8 slots], each thread both of its features
    gate, up = gl.split(gl.permute(gl.reshape(gate_up, [WARPS, 2, 8, 8]), (0, 2, 3, 1)))
    act = _softcapped_swiglu(gl.reshape(gate, [FEATURES, 8]) * outer_gate, gl.reshape(up, [FEATURES, 8]) * outer_up,
                             gate_cap, up_cap)
    features = FEATURES * c + gl.arange(0, FEATURES, layout=gl.SliceLayout(1, act.type.layout))
    act_positions, act_real = _positions(start, end, gl.SliceLayout(0, act.type.layout))
    destination = (act_ptr + gl.expand_dims(act_positions.to(gl.int64) * I, 0)
                   + gl.expand_dims(_deinterleaved(features, I // 2) if FMT == NVFP4 else features, 1))
    # |act| <= gate_cap * up_cap: the bf16 value is exact in f16 (the down projection's input)
    gl.store(destination, act.to(gl.float32).to(gl.float16), mask=gl.expand_dims(act_real, 0))


@gluon.jit
def _gate_up_kernel(x_ptr, sorted_ptr, tile_expert_ptr, tile_start_ptr, offsets_ptr, w_ptr, stride_we, stride_wn,
                    s_ptr, stride_se, stride_sn, outer_ptr, xs_ptr, act_ptr, part_ptr, tickets_ptr, num_slots, H, I,
                    gate_cap, up_cap, TOPK: gl.constexpr, SPLIT_K: gl.constexpr, TICKETS: gl.constexpr,
                    FMT: gl.constexpr):
    """grid (tiles, I / FEATURES, SPLIT_K): features [FEATURES c, FEATURES (c + 1)) of this tile's slots.
    SPLIT_K == 1: the activation act[position, feature] (f16, in x's order); else the gate and up sums of one K
    slice to part[slice, position, w13 row], then, with TICKETS, the last of the SPLIT_K programs of (tile, c) to
    finish (counted in tickets[tile, c], zero at the start) adds them in slice order and stores the activation;
    without, `_swiglu_kernel` does. x: [T, H] f16 (NVFP4: de-interleaved)."""
    e, start, end = _tile(tile_expert_ptr, tile_start_ptr, offsets_ptr)
    if e >= 0:
        c = gl.program_id(1)
        steps = H // (_step_inputs(FMT) * SPLIT_K)
        e64 = e.to(gl.int64)
        positions, _ = _positions(start, end, gl.SliceLayout(1, X_LAYOUT))
        tokens = gl.load(sorted_ptr + positions) // TOPK
        acc = _rows_by_slots(w_ptr + e64 * stride_we + _gate_up_rows(c, I, gl.SliceLayout(1, W_LAYOUT)) * stride_wn,
                             s_ptr + e64 * stride_se + _gate_up_rows(c, I, gl.SliceLayout(1, S_LAYOUT)) * stride_sn,
                             x_ptr + tokens.to(gl.int64) * H, H, gl.program_id(2) * steps, steps, FMT)
        out_positions, real = _positions(start, end, gl.SliceLayout(0, MMA))
        x_scale = gl.load(xs_ptr + gl.load(sorted_ptr + out_positions) // TOPK) * _decode_scale(FMT)
        x_scale = gl.expand_dims(x_scale, 0)
        if FMT == NVFP4:
            outer_gate, outer_up = gl.load(outer_ptr + 2 * e), gl.load(outer_ptr + 2 * e + 1)
        else:
            outer_gate, outer_up = 1.0, 1.0
        if SPLIT_K == 1:
            # (the outer multipliers applied after the split, as scalars: per row, before it, the unsplit call at
            # T = 1 ran 10% slower on an H100)
            _store_activation(acc * x_scale, outer_gate, outer_up, act_ptr, c, start, end, I, gate_cap, up_cap, FMT)
        else:
            rows = _gate_up_rows(c, I, gl.SliceLayout(1, MMA))
            outer = gl.where(rows < I, outer_gate, outer_up)
            part = part_ptr + gl.expand_dims(out_positions * (2 * I), 0) + gl.expand_dims(rows, 1)
            part_size = num_slots * 2 * I
            gl.store(part + gl.program_id(2) * part_size, acc * x_scale * gl.expand_dims(outer, 1),
                     mask=gl.expand_dims(real, 0))
            if TICKETS:
                # every thread's sums stored before the ticket, whose release (gpu scope) publishes them; the last
                # program's acquire makes the others' visible (their loads bypass L1)
                gl.thread_barrier()
                ticket = tickets_ptr + gl.program_id(0) * gl.num_programs(1) + c
                if gl.atomic_add(ticket, 1, sem="acq_rel", scope="gpu") == SPLIT_K - 1:
                    total = gl.load(part, cache_modifier=".cg")  # (masked slots: their real twin's row, unused)
                    for k in gl.static_range(1, SPLIT_K):
                        total += gl.load(part + k * part_size, cache_modifier=".cg")
                    _store_activation(total, 1.0, 1.0, act_ptr, c, start, end, I, gate_cap, up_cap, FMT)


@gluon.jit
def _down_kernel(act_ptr, sorted_ptr, tile_expert_ptr, tile_start_ptr, offsets_ptr, rw_ptr, w_ptr, stride_we,
                 stride_wn, s_ptr, stride_se, stride_sn, outer_ptr, y_ptr, num_slots, H, I, FMT: gl.constexpr):
    """grid (tiles, H / 64, K slices): y[slice, slot, rows of block c] = routing weight * outer * act @ w2^T;
    act: [slots in sorted order, I] f16 (NVFP4: de-interleaved)."""
    e, start, end = _tile(tile_expert_ptr, tile_start_ptr, offsets_ptr)
    if e >= 0:
        positions, _ = _positions(start, end, gl.SliceLayout(1, X_LAYOUT))
        c = gl.program_id(1)
        steps = I // (_step_inputs(FMT) * gl.num_programs(2))
        e64 = e.to(gl.int64)
        rows = c * ROWS + gl.arange(0, ROWS, layout=gl.SliceLayout(1, W_LAYOUT))
        s_rows = c * ROWS + gl.arange(0, ROWS, layout=gl.SliceLayout(1, S_LAYOUT))
        acc = _rows_by_slots(w_ptr + e64 * stride_we + rows * stride_wn, s_ptr + e64 * stride_se + s_rows * stride_sn,
                             act_ptr + positions.to(gl.int64) * I, I, gl.program_id(2) * steps, steps, FMT)
        out_positions, real = _positions(start, end, gl.SliceLayout(0, MMA))
        slots = gl.load(sorted_ptr + out_positions)
        weight = gl.load(rw_ptr + slots) * _decode_scale(FMT)
        if FMT == NVFP4:
            weight = weight * gl.load(outer_ptr + e)
        out_rows = c * ROWS + gl.arange(0, ROWS, layout=gl.SliceLayout(1, MMA))
        destination = (y_ptr + gl.program_id(2) * num_slots * H + gl.expand_dims(slots.to(gl.int64) * H, 0)
                       + gl.expand_dims(out_rows, 1))
        gl.store(destination, acc * gl.expand_dims(weight, 0), mask=gl.expand_dims(real, 0))
# fmt: on
