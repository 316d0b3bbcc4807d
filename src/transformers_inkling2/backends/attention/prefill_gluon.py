"""Sliding-layer prefill attention in Gluon (Triton's explicit-layout dialect) for Hopper: the algorithm of
`prefill_kernel` with the MMAs and copies scheduled by hand. `prefill_attention` routes sliding layers here
when `supports` says so.

Why: compiled from plain Triton, each step of that kernel waits for every outstanding MMA right after issuing QK^T,
so its softmax never overlaps an MMA. Here a step issues its QK^T and the previous block's PV back to back, waits
for the scores only (`warpgroup_mma_wait(1)`) and runs the softmax while that PV is on the tensor cores
(FlashAttention-3's overlap within a warpgroup). A program is one warpgroup on 64 query rows with two copy stages
(96 KB of shared memory, 222 registers), so two programs share an SM and one's softmax runs while the other's MMAs
do. Today's speed against the Triton kernel is in docs/benchmarks.md; the tile shapes and variants that were
measured and not kept are in docs/dev/benchmark-history.md ("Sliding layers in Gluon").

Scope (else the Triton kernel runs): Hopper under CUDA, Triton >= 3.6, a sliding layer with window <= extent (every
visible key carries a bias: no far blocks), bf16, head_dim 128, relative logits in `aligned_product`'s guarded,
16-byte aligned layout and keys / values whose rows are 16-byte aligned (the copies move 16 bytes at a time). Keys,
values and the bias tile of each block stream through shared memory with asynchronous copies; Q stays there. Blocks
are laid out from the diagonal in descending key order as in the Triton kernel (a row's bias is one ascending run).
"""

from __future__ import annotations

import torch
import triton
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia import hopper
from triton.experimental.gluon.language.nvidia.hopper import async_copy

from .tiles import LOG2E, kernel_operands, reads_past_rows_in_bounds

HEAD_DIM = 128
# query rows, keys per block, warps, copy stages (benchmarks/gluon_prefill_check.py measures the alternatives)
TILES = (64, 64, 4, 2)


# fmt: off
@gluon.jit
def _block_columns(block, end, first, key_length, BM: gl.constexpr, BN: gl.constexpr, kv_layout: gl.constexpr):
    """Key positions of block `block` (clamped to the program's blocks), descending; keys outside [0, key_length)
    are clamped: their scores are masked by position, their values meet a zero probability."""
    block = gl.minimum(gl.maximum(block, 0), end - 1)
    cols = first + BM - block * BN - 1 - gl.arange(0, BN, layout=gl.SliceLayout(1, kv_layout))
    return gl.minimum(gl.maximum(cols, 0), key_length - 1)


@gluon.jit
def _issue_loads(k_base, v_base, bias_rows, k_smem, v_smem, bias_smem, group, end, first, key_length, stride_kk,
                 stride_vk, BM: gl.constexpr, BN: gl.constexpr, DIM: gl.constexpr, STAGES: gl.constexpr,
                 kv_layout: gl.constexpr, bias_layout: gl.constexpr):
    """Copy group `group`, committed as one: keys and bias tile of block `group`, values of block `group - 1`.
    Step j waits for group j and then issues group j + STAGES - 1 into the buffers that steps j - 1 (keys, bias)
    and j - 2 (values, read by the PV issued in step j - 1) are done with, which the step's barrier guarantees for
    every warp. Blocks past the program's last load the last block again (never used)."""
    dims = gl.arange(0, DIM, layout=gl.SliceLayout(0, kv_layout))
    cols = _block_columns(group, end, first, key_length, BM, BN, kv_layout)
    async_copy.async_copy_global_to_shared(
        k_smem.index(group % STAGES), k_base + gl.expand_dims(cols * stride_kk, 1) + gl.expand_dims(dims, 0))
    cols = _block_columns(group - 1, end, first, key_length, BM, BN, kv_layout)
    async_copy.async_copy_global_to_shared(
        v_smem.index((group - 1 + STAGES) % STAGES),
        v_base + gl.expand_dims(cols * stride_vk, 1) + gl.expand_dims(dims, 0))
    runs = gl.arange(0, BN, layout=gl.SliceLayout(0, bias_layout))
    block = gl.minimum(group, end - 1)
    async_copy.async_copy_global_to_shared(
        bias_smem.index(group % STAGES), gl.expand_dims(bias_rows, 1) + gl.expand_dims(block * BN + runs, 0))
    async_copy.commit_group()


@gluon.jit
def _step(p_previous, acc, m, l, j, q_smem, k_smem, v_smem, bias_smem, scores_zero, k_base, v_base, bias_rows,
          padding_row_ptr, end, first, key_length, stride_kk, stride_vk, window, scaling, diagonal_end, inner_end,
          row_distance, row_ok, ascending, BM: gl.constexpr, BN: gl.constexpr, DIM: gl.constexpr,
          STAGES: gl.constexpr, HAS_PADDING: gl.constexpr, kv_layout: gl.constexpr, bias_layout: gl.constexpr,
          s_layout: gl.constexpr, rows_o: gl.constexpr, p_layout: gl.constexpr):
    """Key block j: issue the copies of block j + STAGES - 1, then its QK^T and the previous block's PV back to back;
    wait for the scores only, run the softmax while the PV is on the tensor cores, then wait for it and rescale the
    output. Registers that an in-flight MMA reads or writes are never touched until its wait (else ptxas serializes
    the MMAs). The copies are issued before the MMAs: in the other order Triton adds a barrier between them (it
    orders shared-memory accesses per buffer, not per stage). The orders and variants measured are in
    docs/dev/benchmark-history.md ("Sliding layers in Gluon").
    Returns (this block's probabilities as the PV operand, output, m, l)."""
    async_copy.wait_group(STAGES - 2)  # group j: block j's keys and bias, block j - 1's values
    gl.thread_barrier()  # every warp's copies landed; every warp is done with the buffers group j + STAGES - 1 takes
    hopper.fence_async_shared()
    _issue_loads(k_base, v_base, bias_rows, k_smem, v_smem, bias_smem, j + STAGES - 1, end, first, key_length,
                 stride_kk, stride_vk, BM, BN, DIM, STAGES, kv_layout, bias_layout)
    scores_token = hopper.warpgroup_mma(q_smem, k_smem.index(j % STAGES).permute((1, 0)), scores_zero,
                                        use_acc=False, is_async=True)
    # block j - 1's values (block 0's for j = 0, with zero probabilities: adds nothing)
    acc_token = hopper.warpgroup_mma(p_previous, v_smem.index((j - 1 + STAGES) % STAGES), acc, is_async=True)
    scores = hopper.warpgroup_mma_wait(1, deps=[scores_token])
    # softmax in base 2, the bias from shared memory (guarded: no masks on its reads)
    bias = bias_smem.index(j % STAGES).load(s_layout).to(gl.float32)
    scores = scores * scaling + bias  # natural units: one FMA; base 2 folds into the exponent's FMA below
    if HAS_PADDING:
        masked = True
    else:
        masked = (j < diagonal_end) | (j >= inner_end)
    if masked:
        cols = first + BM - j * BN - 1 - ascending
        distance = gl.expand_dims(row_distance + j * BN, 1) + gl.expand_dims(ascending, 0)
        visible = (distance >= 0) & (distance < window) & gl.expand_dims(row_ok, 1)
        visible = visible & gl.expand_dims((cols >= 0) & (cols < key_length), 0)
        if HAS_PADDING:
            real = gl.load(padding_row_ptr + gl.minimum(gl.maximum(cols, 0), key_length - 1)) != 0
            visible = visible & gl.expand_dims(real, 0)
        scores = gl.where(visible, scores, float("-inf"))
    m_new = gl.maximum(m, gl.max(scores, axis=1) * LOG2E)  # running maxima in base 2
    m_safe = gl.where(m_new == float("-inf"), 0.0, m_new)
    p = gl.exp2(scores * LOG2E - gl.expand_dims(m_safe, 1))
    alpha = gl.exp2(m - m_safe)
    l = l * alpha + gl.sum(p, axis=1)
    p_operand = gl.convert_layout(p.to(gl.bfloat16), p_layout)
    acc = hopper.warpgroup_mma_wait(0, deps=[acc_token])
    acc = acc * gl.expand_dims(gl.convert_layout(alpha, rows_o), 1)
    return p_operand, acc, m_new, l


@gluon.jit
def _sliding_prefill_kernel(
    q_ptr, k_ptr, v_ptr, rl_ptr, sink_ptr, qpos_ptr, kpos_ptr, pad_ptr, out_ptr,
    stride_qb, stride_qh, stride_qq, stride_kb, stride_kh, stride_kk, stride_vb, stride_vh, stride_vk,
    stride_rb, stride_rh, bias_pitch, stride_sb, stride_sh, stride_sq, stride_pb, stride_ob, stride_oq, stride_oh,
    query_length, key_length, window, scaling,
    HEADS: gl.constexpr, GROUPS: gl.constexpr, DIM: gl.constexpr, BM: gl.constexpr, BN: gl.constexpr,
    STAGES: gl.constexpr, WARPS: gl.constexpr, HAS_PADDING: gl.constexpr,
):
    """grid (cdiv(Q, BM), batch * heads); arguments as `_prefill_kernel`'s (`rl_ptr` one element past the relative
    logits' start, `bias_pitch` their query stride + 1)."""
    # layouts: scores [BM, BN] and output [BM, DIM] as wgmma accumulators (one warpgroup per 64 rows); P as the
    # register A operand of PV; 16-byte rows for the copies
    s_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[WARPS, 1],
                                                       instr_shape=[16, BN, 16])
    o_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[WARPS, 1],
                                                       instr_shape=[16, DIM, 16])
    p_layout: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=o_layout, k_width=2)
    kv_layout: gl.constexpr = gl.BlockedLayout(size_per_thread=[1, 8], threads_per_warp=[2, 16],
                                               warps_per_cta=[WARPS, 1], order=[1, 0])
    bias_layout: gl.constexpr = gl.BlockedLayout(size_per_thread=[1, 8], threads_per_warp=[4, 8],
                                                 warps_per_cta=[WARPS, 1], order=[1, 0])
    mma_smem: gl.constexpr = gl.NVMMASharedLayout(swizzle_byte_width=128, element_bitwidth=16, rank=2)
    # 16-byte chunks XOR-swizzled by row: read in the scores' layout without bank conflicts (unswizzled: 7 extra
    # wavefronts per read, `gl.bank_conflicts`)
    bias_smem_layout: gl.constexpr = gl.SwizzledSharedLayout(vec=8, per_phase=1, max_phase=8, order=[1, 0])
    rows_s: gl.constexpr = gl.SliceLayout(1, s_layout)
    cols_s: gl.constexpr = gl.SliceLayout(0, s_layout)
    rows_o: gl.constexpr = gl.SliceLayout(1, o_layout)

    m_block, pair = gl.program_id(0), gl.program_id(1)
    b, head = (pair // HEADS).to(gl.int64), pair % HEADS
    kv_head = head // GROUPS
    first_query, first_key = gl.load(qpos_ptr), gl.load(kpos_ptr)
    first = (first_query - first_key).to(gl.int32) + m_block * BM

    # Q into shared memory once
    q_rows = m_block * BM + gl.arange(0, BM, layout=gl.SliceLayout(1, kv_layout))
    q_dims = gl.arange(0, DIM, layout=gl.SliceLayout(0, kv_layout))
    q_safe = gl.minimum(q_rows, query_length - 1)
    q = gl.load(q_ptr + b * stride_qb + head * stride_qh + gl.expand_dims(q_safe * stride_qq, 1)
                + gl.expand_dims(q_dims, 0))
    q_smem = gl.allocate_shared_memory(gl.bfloat16, [BM, DIM], mma_smem, q)
    k_smem = gl.allocate_shared_memory(gl.bfloat16, [STAGES, BN, DIM], mma_smem)
    v_smem = gl.allocate_shared_memory(gl.bfloat16, [STAGES, BN, DIM], mma_smem)
    bias_smem = gl.allocate_shared_memory(gl.bfloat16, [STAGES, BM, BN], bias_smem_layout)

    rows = m_block * BM + gl.arange(0, BM, layout=rows_s)
    row_ok = rows < query_length
    # a row's bias run of block j starts at rl_ptr + row * bias_pitch - (m_block + 1) BM + j BN (see _prefill_kernel);
    # built in the copies' layout (a layout conversion in the loop would cost a barrier per step)
    copy_rows = gl.minimum(m_block * BM + gl.arange(0, BM, layout=gl.SliceLayout(1, bias_layout)), query_length - 1)
    bias_rows = rl_ptr + b * stride_rb + head * stride_rh + copy_rows * bias_pitch - (m_block + 1) * BM
    k_base = k_ptr + b * stride_kb + kv_head * stride_kh
    v_base = v_ptr + b * stride_vb + kv_head * stride_vh

    # the blocks a sliding program sees (window <= extent: all of them carry a bias); masks on the diagonal blocks,
    # the edge blocks, keys crossing 0 and everywhere with padding
    lowest_key = gl.maximum(first - window + 1, 0)
    end = (first + BM - 1 - lowest_key) // BN + 1
    whole_blocks = gl.maximum(first + BM, 0) // BN
    diagonal_end = gl.minimum((BM + BN - 1) // BN, end)
    inner_end = gl.minimum(gl.maximum(gl.minimum(window // BN, whole_blocks), diagonal_end), end)

    gl.static_assert(STAGES >= 2)
    for group in gl.static_range(STAGES - 1):
        _issue_loads(k_base, v_base, bias_rows, k_smem, v_smem, bias_smem, group, end, first, key_length, stride_kk,
                     stride_vk, BM, BN, DIM, STAGES, kv_layout, bias_layout)
    scores_zero = gl.zeros([BM, BN], gl.float32, layout=s_layout)
    acc = gl.zeros([BM, DIM], gl.float32, layout=o_layout)
    p_operand = gl.zeros([BM, BN], gl.bfloat16, layout=p_layout)
    m = gl.full([BM], float("-inf"), gl.float32, layout=rows_s)
    l = gl.zeros([BM], gl.float32, layout=rows_s)
    row_distance = rows % BM - BM + 1
    ascending = gl.arange(0, BN, layout=cols_s)
    for j in range(0, end):
        p_operand, acc, m, l = _step(
            p_operand, acc, m, l, j, q_smem, k_smem, v_smem, bias_smem, scores_zero, k_base, v_base, bias_rows,
            pad_ptr + b * stride_pb, end, first, key_length, stride_kk, stride_vk, window, scaling, diagonal_end,
            inner_end, row_distance, row_ok, ascending, BM, BN, DIM, STAGES, HAS_PADDING, kv_layout, bias_layout,
            s_layout, rows_o, p_layout)
    async_copy.wait_group(0)  # group `end` carries the last block's values
    gl.thread_barrier()
    hopper.fence_async_shared()
    acc = hopper.warpgroup_mma(p_operand, v_smem.index((end - 1) % STAGES), acc)  # the last block's PV

    safe_rows = gl.where(row_ok, rows, 0)
    sink = gl.load(sink_ptr + b * stride_sb + head * stride_sh + safe_rows * stride_sq).to(gl.float32) * LOG2E
    top = gl.maximum(m, sink)
    scale = gl.exp2(m - top)
    denominator = l * scale + gl.exp2(sink - top)
    out = acc * gl.expand_dims(gl.convert_layout(scale / denominator, rows_o), 1)
    out_rows = gl.convert_layout(safe_rows, rows_o)
    out_dims = gl.arange(0, DIM, layout=gl.SliceLayout(0, o_layout))
    destination = (out_ptr + b * stride_ob + gl.expand_dims(out_rows * stride_oq, 1) + head * stride_oh
                   + gl.expand_dims(out_dims, 0))
    gl.store(destination, out.to(gl.bfloat16), mask=gl.expand_dims(gl.convert_layout(row_ok, rows_o), 1))


# fmt: on


def _copyable(start: int, row_strides) -> bool:
    """Whether 16-byte copies reach every row: `start` (an address) 16-byte aligned and the row strides multiples of
    16 elements (Triton specializes such arguments as divisible by 16, which the copies' vectorization needs)."""
    return start % 16 == 0 and all(stride % 16 == 0 for stride in row_strides)


def supports(query, key, value, relative_logits, sliding_window) -> bool:
    """The kernel's scope (module docstring). The relative logits are read from one element past their start with a
    row pitch of their query stride + 1, as the Triton kernel reads them."""
    block_m, block_n = TILES[:2]
    bias_start = relative_logits.data_ptr() + relative_logits.element_size()
    bias_strides = (relative_logits.stride(0), relative_logits.stride(1), relative_logits.stride(2) + 1)
    return (
        query.is_cuda
        and torch.version.hip is None  # ROCm reports MI300 as capability 9.4
        and torch.cuda.get_device_capability(query.device)[0] == 9
        and query.dtype == key.dtype == value.dtype == relative_logits.dtype == torch.bfloat16
        and query.shape[-1] == HEAD_DIM
        and sliding_window is not None
        and sliding_window <= relative_logits.shape[-1]
        and reads_past_rows_in_bounds(relative_logits, block_m, block_n)
        and relative_logits.stride(-1) == key.stride(-1) == value.stride(-1) == 1
        and _copyable(bias_start, bias_strides)
        and _copyable(key.data_ptr(), key.stride()[:-1])
        and _copyable(value.data_ptr(), value.stride()[:-1])
    )


def sliding_prefill_attention(query, key, value, relative_logits, sinks, query_positions, key_positions, key_padding,
                              sliding_window, scaling, tiles=TILES):
    """`prefill_attention`'s contract for the inputs `supports` accepts -> [B, Q, H, D]."""
    block_m, block_n, warps, stages = tiles
    batch, heads, queries, head_dim = query.shape
    kv_heads, key_length = key.shape[1], key.shape[2]
    output, _, operands = kernel_operands(query, key, value, relative_logits, sinks, query_positions, key_positions,
                                          key_padding)
    _sliding_prefill_kernel[(triton.cdiv(queries, block_m), batch * heads)](
        *operands, queries, key_length, sliding_window, scaling,
        HEADS=heads, GROUPS=heads // kv_heads, DIM=head_dim, BM=block_m, BN=block_n, STAGES=stages, WARPS=warps,
        HAS_PADDING=key_padding is not None, num_warps=warps,
    )  # fmt: skip
    return output


__all__ = ["sliding_prefill_attention", "supports"]
