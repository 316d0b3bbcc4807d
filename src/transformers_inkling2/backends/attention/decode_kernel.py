"""The decode / verification attention of `inkling2_decode_attention` (1-8 queries) as one fused Triton kernel.

The PyTorch path launches about twenty small kernels per layer (two batched GEMMs whose shapes cuBLAS handles
poorly, the bias scatter, masks, softmax pieces) for work that is a single read of the layer's keys and values.
Here a program owns one (batch row, kv head) pair and a slice of the keys (split-K, so that a batch-1 step still
spreads over the GPU): the query heads of that kv head are folded into the rows of one tile (row r = group g,
query i), scores come from one MMA per key block, the relative bias is read at distance `p_i - p_j` straight from
the [B, H, Q, extent] relative logits, masks (causal, window, padding) are computed from positions, and the softmax
runs online. A second kernel merges the slices and the sink by log-sum-exp:

    out = sum_s e^(m_s - M) acc_s / (sum_s e^(m_s - M) l_s + e^(sink - M)),   M = max(m_s..., sink).

Keys may sit in any order (the static cache's rings): nothing here assumes ascending positions. Positions may be
shared by the batch (1-D) or per row ([B, Q], [B, K]: the serving engine's rows each at their own position), read
with a batch stride of 0 when shared. Paged keys and values (`block_table`): key j of batch row b lives in page
`block_table[b, j // page_size]` of the key/value pools, slot j % page_size; pages hold whole key blocks, so a
block finds its page with one load. No host synchronization: grids depend on shapes only, so a decode step with
this kernel can be captured in a CUDA graph.

A decode step of the model may also hand over its query-side projections as they come out of the GEMV
(`decode_attention_step`, through `attention/step.py`): the partial kernel then applies the queries' and relative
states' per-head scale and L2 clip (and a full layer's log scale) to the rows it loads, and computes each key's
relative bias from the [d_rel] relative state and the bank's column at its distance instead of reading a [B, H, Q,
extent] product; the merge kernel multiplies its output by the sigmoid gate. Four launches of the step (two clips,
the relative-logits GEMM, the gate) become work inside these two, in the reference's order of roundings: each
query row and relative state is rounded to the model dtype after its transforms, each bias after its sum, the
output before the gate and after it.
Imported only when a CUDA tensor reaches the decode path (triton is not a CPU dependency).
"""

from __future__ import annotations

import dataclasses

import torch
import triton
import triton.language as tl

from ..dependent_launch import dependent_launch
from ..dependent_launch_kernel import release_successor, wait_for_predecessor
from .tiles import (
    LOG2E,
    attention_output_like,
    kernel_inputs,
    online_softmax_step,
    tile_scores,
    visible_keys,
)

BLOCK_KEYS = 64
MAX_ROWS = 64  # folded rows of one tile: its fp32 output accumulator stays in registers
MIN_PROGRAMS = 264  # two per SM of an H100/H200: below this, keys are split further
MERGE_SPLIT_BLOCK = 64  # splits the merge reads at once: [64, head dim] fp32 partial outputs per program
MIN_DOT_DEPTH = 16  # `tl.dot`'s smallest inner size: d_rel is padded to it for the bias's MMA


# kernel signatures and pointer arithmetic read better packed
# fmt: off
@triton.jit
def _folded_rows(pair, KV_HEADS: tl.constexpr, GROUPS: tl.constexpr, QUERIES: tl.constexpr, ROWS: tl.constexpr):
    """The (batch row, kv head) of program `pair` and its tile rows: row r is query r % QUERIES of query head
    kv_head * GROUPS + r // QUERIES; rows past GROUPS * QUERIES are padding (clamped to a valid head and query)."""
    b, kv_head = (pair // KV_HEADS).to(tl.int64), pair % KV_HEADS  # 64-bit offsets: a batch of long caches passes 2^31
    rows = tl.arange(0, ROWS)
    row_ok = rows < GROUPS * QUERIES
    query = tl.where(row_ok, rows % QUERIES, 0)
    head = kv_head * GROUPS + tl.where(row_ok, rows // QUERIES, 0)
    return b, kv_head, rows, row_ok, query, head


@triton.jit
def _key_block(k_ptr, v_ptr, bt_row_ptr, b, kv_head, k0, stride_kb, stride_kh, stride_vb, stride_vh,
               BN: tl.constexpr, PAGE: tl.constexpr):
    """Where keys [k0, k0 + BN) of batch row b lie: (key base, value base, slots). Paged (PAGE > 0): in page
    `block_table[b, k0 // PAGE]` of the pools, from slot k0 % PAGE (a page holds whole blocks); otherwise row b of
    key/value is its own page."""
    if PAGE > 0:
        page = tl.load(bt_row_ptr + k0 // PAGE).to(tl.int64)
        slots = k0 % PAGE + tl.arange(0, BN)
    else:
        page = b
        slots = k0 + tl.arange(0, BN)
    return k_ptr + page * stride_kb + kv_head * stride_kh, v_ptr + page * stride_vb + kv_head * stride_vh, slots


@triton.jit
def l2_clipped(x, threshold):
    """Rows of x [R, N] fp32 scaled down to L2 norm `threshold` where longer: `modeling_inkling2_text.l2_clip`'s
    formula, with a correctly rounded square root and division."""
    norm = tl.sqrt_rn(tl.sum(x * x, 1))
    return x * tl.minimum(tl.div_rn(threshold + tl.zeros_like(norm), norm + 1e-6), 1.0)[:, None]


@triton.jit
def _step_rows(raw, scale, threshold, tau):
    """A step's raw query rows or relative states [R, N] (the projection's output) after the reference's per-head
    scale, L2 clip and log scale (`tau` [R], 1 in sliding layers), rounded to the raw dtype as the model rounds them."""
    return (l2_clipped(raw.to(tl.float32) * scale.to(tl.float32), threshold) * tau[:, None]).to(raw.dtype)


@triton.jit
def _computed_bias(states, bank_ptr, qpos_row_ptr, key_position, query, col_ok, extent, d_rel,
                   QUERIES: tl.constexpr, DREL: tl.constexpr, DOT_FP32: tl.constexpr):
    """[R, N] relative bias: row r's relative state [R, DREL] (model-dtype values, channels from d_rel on zero)
    times the bank column at each key's distance, with fp32 accumulation and rounded to the bank's dtype, as the
    reference's [B, H, Q, extent] product holds it; 0 beyond the extent. The columns are gathered once per query
    ([DREL, N]: every head of the tile shares its query's distances) and meet the rows of that query in one MMA."""
    channels = tl.arange(0, DREL)
    bias = tl.zeros((states.shape[0], key_position.shape[0]), dtype=tl.float32)
    for i in tl.static_range(QUERIES):
        distance = tl.load(qpos_row_ptr + i) - key_position
        ok = col_ok & (distance >= 0) & (distance < extent)
        columns = tl.load(bank_ptr + channels[:, None] * extent + distance[None, :],
                          mask=(channels < d_rel)[:, None] & ok[None, :], other=0.0)
        rows = tl.where((query == i)[:, None], states, tl.zeros_like(states))
        if DOT_FP32:
            bias = tl.dot(rows.to(tl.float32), columns.to(tl.float32), bias, input_precision="ieee")
        else:
            bias = tl.dot(rows, columns, bias)
    return bias.to(bank_ptr.dtype.element_ty).to(tl.float32)


@triton.jit
def _decode_partial_kernel(
    q_ptr, k_ptr, v_ptr, rl_ptr, qpos_ptr, kpos_ptr, pad_ptr, bt_ptr, m_ptr, l_ptr, acc_ptr, qscale_ptr, rs_ptr,
    rscale_ptr, tau_ptr, stride_qb, stride_qh, stride_qq, stride_kb, stride_kh, stride_kk, stride_vb, stride_vh,
    stride_vk, stride_rb, stride_rh, stride_rq, stride_pb, stride_qpb, stride_kpb, stride_btb, stride_rsb, stride_rsq,
    stride_rsh, stride_taub, key_length, keys_per_split, num_splits, extent, window, scaling, q_threshold,
    r_threshold, d_rel, KV_HEADS: tl.constexpr, GROUPS: tl.constexpr, QUERIES: tl.constexpr, ROWS: tl.constexpr,
    DIM: tl.constexpr, BN: tl.constexpr, PAGE: tl.constexpr, HAS_PADDING: tl.constexpr, HAS_WINDOW: tl.constexpr,
    DOT_FP32: tl.constexpr, PREPARE: tl.constexpr, HAS_TAU: tl.constexpr, DREL: tl.constexpr, PDL: tl.constexpr,
):
    """grid (batch * kv_heads, splits): running max m, sum l and unnormalized output acc of each row over the
    keys [split * keys_per_split, ...) of one kv head. Positions are read at batch strides (0: shared); PAGE > 0:
    keys and values are page pools indexed by the block table (see `_key_block`). PREPARE: q holds the raw query
    projection, rs_ptr the raw relative states [B, Q, H, d_rel] and rl_ptr the bank [d_rel, extent] (DREL: d_rel
    padded to an MMA's depth); the rows are prepared here (`_step_rows`, with the per-head scales [H, DIM] /
    [H, d_rel] and, HAS_TAU, the log scale [B, Q]) and the bias computed (`_computed_bias`)."""
    wait_for_predecessor(PDL)
    pair, split = tl.program_id(0), tl.program_id(1)
    b, kv_head, rows, row_ok, query, head = _folded_rows(pair, KV_HEADS, GROUPS, QUERIES, ROWS)
    dims = tl.arange(0, DIM)
    q = tl.load(q_ptr + b * stride_qb + head[:, None] * stride_qh + query[:, None] * stride_qq + dims[None, :],
                mask=row_ok[:, None], other=0.0)
    if PREPARE:
        tau = tl.full((ROWS,), 1.0, dtype=tl.float32)
        if HAS_TAU:
            tau = tl.load(tau_ptr + b * stride_taub + query).to(tl.float32)
        q = _step_rows(q, tl.load(qscale_ptr + head[:, None] * DIM + dims[None, :]), q_threshold, tau)
        channels = tl.arange(0, DREL)
        state_ok = row_ok[:, None] & (channels < d_rel)[None, :]
        raw_states = tl.load(rs_ptr + b * stride_rsb + query[:, None] * stride_rsq + head[:, None] * stride_rsh
                             + channels[None, :], mask=state_ok, other=0.0)
        state_scale = tl.load(rscale_ptr + head[:, None] * d_rel + channels[None, :], mask=state_ok, other=0.0)
        states = _step_rows(raw_states, state_scale, r_threshold, tau)
    query_position = tl.load(qpos_ptr + b * stride_qpb + query)
    bias_rows = rl_ptr + b * stride_rb + head * stride_rh + query * stride_rq
    block_table_row = bt_ptr + b * stride_btb

    m = tl.full((ROWS,), float("-inf"), dtype=tl.float32)
    l = tl.zeros((ROWS,), dtype=tl.float32)
    acc = tl.zeros((ROWS, DIM), dtype=tl.float32)
    start = split * keys_per_split
    stop = tl.minimum(start + keys_per_split, key_length)
    for k0 in range(start, stop, BN):
        cols = k0 + tl.arange(0, BN)
        col_ok = cols < stop
        k_base, v_base, slots = _key_block(k_ptr, v_ptr, block_table_row, b, kv_head, k0, stride_kb, stride_kh,
                                           stride_vb, stride_vh, BN, PAGE)
        k = tl.load(k_base + slots[:, None] * stride_kk + dims[None, :], mask=col_ok[:, None], other=0.0)
        scores = tile_scores(q, k, DOT_FP32)
        key_position = tl.load(kpos_ptr + b * stride_kpb + cols, mask=col_ok, other=0)
        distance = query_position[:, None] - key_position[None, :]
        visible = visible_keys(distance, row_ok, cols, col_ok, pad_ptr + b * stride_pb, window, HAS_WINDOW,
                               HAS_PADDING)
        in_extent = visible & (distance < extent)
        if PREPARE:  # a gather per query where any key of the tile is within the extent; none beyond it
            bias = tl.zeros((ROWS, BN), dtype=tl.float32)
            if tl.max(in_extent.to(tl.int32)) > 0:
                bias = _computed_bias(states, rl_ptr, qpos_ptr + b * stride_qpb, key_position, query, col_ok, extent,
                                      d_rel, QUERIES, DREL, DOT_FP32)
        else:
            bias = tl.load(bias_rows[:, None] + distance, mask=in_extent, other=0.0).to(tl.float32)
        scores = tl.where(visible, (scores * scaling + bias) * LOG2E, float("-inf"))
        v = tl.load(v_base + slots[:, None] * stride_vk + dims[None, :], mask=col_ok[:, None], other=0.0)
        m, l, acc = online_softmax_step(scores, v, m, l, acc, DOT_FP32)
    release_successor(PDL)
    part = pair * num_splits + split
    tl.store(m_ptr + part * ROWS + rows, m)
    tl.store(l_ptr + part * ROWS + rows, l)
    tl.store(acc_ptr + (part * ROWS + rows[:, None]) * DIM + dims[None, :], acc)


@triton.jit
def _split_block(m_ptr, l_ptr, acc_ptr, parts, ok, row, dims, ROWS: tl.constexpr, DIM: tl.constexpr):
    """A block of one folded row's splits: their maxima (-inf past the splits), sums and partial outputs."""
    maxima = tl.load(m_ptr + parts * ROWS + row, mask=ok, other=float("-inf"))
    sums = tl.load(l_ptr + parts * ROWS + row, mask=ok, other=0.0)
    outputs = tl.load(acc_ptr + (parts[:, None] * ROWS + row) * DIM + dims[None, :], mask=ok[:, None], other=0.0)
    return maxima, sums, outputs


@triton.jit
def _weighted_sums(maxima, sums, outputs, top, denominator, numerator):
    """The merge's sums with a block of splits added, each weighted by 2^(its maximum - top) (2^-inf = 0 for a split
    that saw nothing, and for the block's padding)."""
    weight = tl.exp2(maxima - top)
    return numerator + tl.sum(weight[:, None] * outputs, 0), denominator + tl.sum(weight * sums, 0)


@triton.jit
def _decode_merge_kernel(
    m_ptr, l_ptr, acc_ptr, sink_ptr, gate_ptr, out_ptr, stride_sb, stride_sh, stride_sq, stride_gb, stride_gq,
    stride_ob, stride_oq, stride_oh, num_splits, KV_HEADS: tl.constexpr, GROUPS: tl.constexpr,
    QUERIES: tl.constexpr, ROWS: tl.constexpr, DIM: tl.constexpr, SPLIT_BLOCK: tl.constexpr, ONE_BLOCK: tl.constexpr,
    GATED: tl.constexpr, PDL: tl.constexpr,
):
    """grid (batch * kv_heads, GROUPS * QUERIES): one folded row's splits and sink merged by log-sum-exp, its
    splits read SPLIT_BLOCK at a time and summed in a fixed order (deterministic). A program per row, not per kv
    head: at one token a kv head's 30-odd splits of [rows, DIM] read one after another by 8 programs took longer
    than the attention itself. ONE_BLOCK (at most SPLIT_BLOCK splits, a decode step's case): every load issued at
    once, before the maximum's reduction, instead of the maxima first and the rest after it. GATED: the row, rounded
    to the output dtype, times the sigmoid of its gate ([B, Q, H * DIM], unit stride within a row), in fp32, rounded
    again."""
    wait_for_predecessor(PDL)
    pair, row = tl.program_id(0), tl.program_id(1)
    b, kv_head = (pair // KV_HEADS).to(tl.int64), pair % KV_HEADS
    query, head = row % QUERIES, kv_head * GROUPS + row // QUERIES
    dims, splits = tl.arange(0, DIM), tl.arange(0, SPLIT_BLOCK)
    sink = tl.load(sink_ptr + b * stride_sb + head * stride_sh + query * stride_sq).to(tl.float32) * LOG2E
    if GATED:
        gate = tl.load(gate_ptr + b * stride_gb + query * stride_gq + head * DIM + dims).to(tl.float32)
    if ONE_BLOCK:
        maxima, sums, outputs = _split_block(m_ptr, l_ptr, acc_ptr, pair * num_splits + splits, splits < num_splits,
                                             row, dims, ROWS, DIM)
        release_successor(PDL)
        top = tl.maximum(sink, tl.max(maxima, 0))  # base 2, as the splits' maxima
        numerator, denominator = _weighted_sums(maxima, sums, outputs, top, tl.exp2(sink - top),
                                                tl.zeros((DIM,), dtype=tl.float32))
    else:
        top = sink
        for s0 in range(0, num_splits, SPLIT_BLOCK):
            parts = pair * num_splits + s0 + splits
            maxima = tl.load(m_ptr + parts * ROWS + row, mask=s0 + splits < num_splits, other=float("-inf"))
            top = tl.maximum(top, tl.max(maxima, 0))
        denominator = tl.exp2(sink - top)
        numerator = tl.zeros((DIM,), dtype=tl.float32)
        for s0 in range(0, num_splits, SPLIT_BLOCK):
            maxima, sums, outputs = _split_block(m_ptr, l_ptr, acc_ptr, pair * num_splits + s0 + splits,
                                                 s0 + splits < num_splits, row, dims, ROWS, DIM)
            numerator, denominator = _weighted_sums(maxima, sums, outputs, top, denominator, numerator)
        release_successor(PDL)
    output = (numerator / denominator).to(out_ptr.dtype.element_ty)
    if GATED:
        output = (output.to(tl.float32) * tl.sigmoid(gate)).to(out_ptr.dtype.element_ty)
    tl.store(out_ptr + b * stride_ob + query * stride_oq + head * stride_oh + dims, output)


# fmt: on


def supports(query: torch.Tensor, key: torch.Tensor) -> bool:
    """Shapes the kernel takes: a power-of-two head dim of at least 16, at most MAX_ROWS folded rows (query heads
    per kv head x queries: 48 for Inkling-2-Small verifying 8 tokens), and the inputs' dtypes alike."""
    head_dim = query.shape[-1]
    rows = query.shape[1] // key.shape[1] * query.shape[2]
    return head_dim >= 16 and head_dim & (head_dim - 1) == 0 and rows <= MAX_ROWS and query.dtype == key.dtype


def _per_row(positions: torch.Tensor, batch: int) -> torch.Tensor:
    """Positions [n] (shared by the batch) or [B, n] as [B, n] with unit stride along n: a shared vector is
    expanded, batch stride 0, never copied per row."""
    positions = positions.contiguous()
    return positions.view(-1, positions.shape[-1]).expand(batch, -1)


@torch.library.custom_op("inkling2::decode_attention", mutates_args=())
def decode_attention(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    relative_logits: torch.Tensor,
    sinks: torch.Tensor,
    query_positions: torch.Tensor,
    key_positions: torch.Tensor,
    key_padding: torch.Tensor | None,
    sliding_window: int | None,
    scaling: float,
    block_table: torch.Tensor | None = None,
    page_size: int = 0,
) -> torch.Tensor:
    """Same contract as `modeling.attention.eager_attention` (query [B, H, Q, D], key/value [B, Hkv, K, D] in any
    slot order, relative_logits [B, H, Q, extent], sinks [B, H, Q], positions [Q] / [K] shared by the batch or
    [B, Q] / [B, K] per row) -> [B, Q, H, D]. With `block_table` (int32 [B, pages per row]), key/value are page
    pools [pages, Hkv, page_size, D] and the logical keys are K = pages per row * page_size (key_positions and
    key_padding index those); page_size must be a multiple of BLOCK_KEYS. A custom op: `torch.compile` (the compiled
    decode steps) calls it as it is instead of tracing and recompiling the kernels."""
    return _attend(
        query, key, value, relative_logits, sinks, query_positions, key_positions, key_padding, sliding_window,
        scaling, block_table, page_size,
    )  # fmt: skip


@dataclasses.dataclass(frozen=True)
class _StepPrologue:
    """What `decode_attention_step` hands the kernels beyond `decode_attention`'s inputs (see its docstring)."""

    query_scale: torch.Tensor
    query_threshold: float
    relative_states: torch.Tensor
    relative_scale: torch.Tensor
    relative_threshold: float
    log_scale: torch.Tensor | None
    gate: torch.Tensor


@torch.library.custom_op("inkling2::decode_attention_step", mutates_args=())
def decode_attention_step(
    query_states: torch.Tensor,
    query_scale: torch.Tensor,
    query_threshold: float,
    relative_states: torch.Tensor,
    relative_scale: torch.Tensor,
    relative_threshold: float,
    bank: torch.Tensor,
    log_scale: torch.Tensor | None,
    gate: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    sinks: torch.Tensor,
    query_positions: torch.Tensor,
    key_positions: torch.Tensor,
    key_padding: torch.Tensor | None,
    sliding_window: int | None,
    scaling: float,
    block_table: torch.Tensor | None = None,
    page_size: int = 0,
) -> torch.Tensor:
    """A model's decode attention from its raw query-side projections, gated: `decode_attention` of the queries
    `l2_clip(query_states * query_scale, query_threshold) * log_scale` and the relative logits
    `(l2_clip(relative_states * relative_scale, relative_threshold) * log_scale) @ bank` (each in the model dtype),
    then `output * sigmoid(gate)` (see the module docstring). query_states [B, Q, H, D], relative_states
    [B, Q, H, d_rel] and gate [B, Q, H * D] in the model dtype; query_scale [H, D] and relative_scale [H, d_rel]
    (this rank's heads); bank [d_rel, extent] in the model dtype; log_scale [B or 1, Q] (full layers) or None; the
    rest as `decode_attention`. -> [B, Q, H * D]. The small operands are made contiguous here (no copy for the
    model's, which are)."""
    prologue = _StepPrologue(
        query_scale.contiguous(), query_threshold, relative_states.contiguous(), relative_scale.contiguous(),
        relative_threshold, log_scale, gate.contiguous(),
    )  # fmt: skip
    output = _attend(
        query_states.transpose(1, 2), key, value, bank.contiguous(), sinks, query_positions, key_positions, key_padding,
        sliding_window, scaling, block_table, page_size, prologue,
    )  # fmt: skip
    return output.flatten(2)


def _attend(
    query, key, value, relative_logits, sinks, query_positions, key_positions, key_padding, sliding_window, scaling,
    block_table, page_size, prologue: _StepPrologue | None = None,
) -> torch.Tensor:
    """Both ops' launches -> [B, Q, H, D]; with a `prologue`, relative_logits is the bank [d_rel, extent]."""
    batch, heads, queries, head_dim = query.shape
    kv_heads = key.shape[1]
    if block_table is None:
        key_length = key.shape[2]
    elif page_size <= 0 or page_size % BLOCK_KEYS or page_size != key.shape[2]:
        raise ValueError(
            f"page_size ({page_size}) must be a positive multiple of {BLOCK_KEYS} (a page holds whole key blocks) "
            f"and the pools' page length ({key.shape[2]})"
        )
    else:
        key_length = block_table.shape[1] * page_size
    groups = heads // kv_heads
    rows = max(16, triton.next_power_of_2(groups * queries))
    pairs = batch * kv_heads
    # split the keys until the grid fills the GPU; slices are whole key blocks
    blocks = triton.cdiv(key_length, BLOCK_KEYS)
    splits = max(1, min(blocks, triton.cdiv(MIN_PROGRAMS, pairs)))
    keys_per_split = triton.cdiv(blocks, splits) * BLOCK_KEYS
    splits = triton.cdiv(key_length, keys_per_split)

    query, key, value, relative_logits, padding, fp32 = kernel_inputs(query, key, value, relative_logits, key_padding)
    query_positions, key_positions = _per_row(query_positions, batch), _per_row(key_positions, batch)
    table = query_positions if block_table is None else block_table.contiguous()  # a placeholder pointer when unpaged
    device = query.device
    m = torch.empty(pairs * splits * rows, dtype=torch.float32, device=device)
    l = torch.empty_like(m)
    acc = torch.empty(pairs * splits * rows, head_dim, dtype=torch.float32, device=device)
    output = torch.empty(batch, queries, heads, head_dim, dtype=value.dtype, device=device)
    if prologue is None:
        bias_strides = relative_logits.stride()[:3]
        # placeholders (never read): scales, states and log scale, their strides and thresholds
        states = query_scale = state_scale = tau = gate = query
        state_strides, tau_stride, gate_strides, thresholds = (0, 0, 0), 0, (0, 0), (0.0, 0.0)
        d_rel = padded_d_rel = 1
    else:
        bias_strides = (0, 0, 0)
        states, query_scale, state_scale = prologue.relative_states, prologue.query_scale, prologue.relative_scale
        state_strides, d_rel = states.stride()[:3], states.shape[-1]
        padded_d_rel = max(MIN_DOT_DEPTH, triton.next_power_of_2(d_rel))
        tau = query if prologue.log_scale is None else prologue.log_scale.expand(batch, -1)
        tau_stride = 0 if prologue.log_scale is None else tau.stride(0)
        gate = prologue.gate
        gate_strides = gate.stride()[:2]
        thresholds = (prologue.query_threshold, prologue.relative_threshold)
    pdl = dependent_launch(query)
    constants = dict(KV_HEADS=kv_heads, GROUPS=groups, QUERIES=queries, ROWS=rows, DIM=head_dim, PDL=pdl,
                     launch_pdl=pdl)
    _decode_partial_kernel[(pairs, splits)](
        query, key, value, relative_logits, query_positions, key_positions, padding, table, m, l, acc, query_scale,
        states, state_scale, tau,
        query.stride(0), query.stride(1), query.stride(2), key.stride(0), key.stride(1), key.stride(2),
        value.stride(0), value.stride(1), value.stride(2), *bias_strides, padding.stride(0),
        query_positions.stride(0), key_positions.stride(0), table.stride(0), *state_strides, tau_stride,
        key_length, keys_per_split, splits, relative_logits.shape[-1], sliding_window or 0, scaling, *thresholds, d_rel,
        BN=BLOCK_KEYS, PAGE=0 if block_table is None else page_size, HAS_PADDING=key_padding is not None,
        HAS_WINDOW=sliding_window is not None, DOT_FP32=fp32, PREPARE=prologue is not None,
        HAS_TAU=prologue is not None and prologue.log_scale is not None, DREL=padded_d_rel, num_warps=4, **constants,
    )  # fmt: skip
    _decode_merge_kernel[(pairs, groups * queries)](
        m, l, acc, sinks, gate, output, sinks.stride(0), sinks.stride(1), sinks.stride(2), *gate_strides,
        output.stride(0), output.stride(1), output.stride(2), splits, SPLIT_BLOCK=MERGE_SPLIT_BLOCK,
        ONE_BLOCK=splits <= MERGE_SPLIT_BLOCK, GATED=prologue is not None, num_warps=4, **constants,
    )  # fmt: skip
    return output


@decode_attention.register_fake
def _output_like(*inputs):
    """For tracing: the output's shape and dtype, which the paging arguments (after the ten of
    `attention_output_like`; the dispatcher leaves them out where they are the defaults) do not change."""
    return attention_output_like(*inputs[:10])


@decode_attention_step.register_fake
def _step_output_like(query_states, query_scale, query_threshold, relative_states, relative_scale, relative_threshold,
                      bank, log_scale, gate, key, value, *rest, **paging):  # fmt: skip
    """For tracing: [B, Q, H * D] in the values' dtype."""
    return gate.new_empty(gate.shape, dtype=value.dtype)


__all__ = ["decode_attention", "decode_attention_step", "supports"]
