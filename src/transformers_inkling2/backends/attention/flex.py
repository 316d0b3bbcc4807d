"""Memory-efficient attention backends of Inkling2: FlexAttention for prefill, small paths for decoding.

All compute exactly what `modeling.attention.eager_attention` computes (same signature, same result up to rounding)
without its [queries, keys] score matrix:

- `inkling2_flex_attention` (registered as `"inkling2_flex"`): FlexAttention with block-sparse masks built
  directly from block ranges (no [Q, K] mask is ever evaluated), split by backward distance `d = pos_q - pos_k`:
    * the *band* `0 <= d < extent` (clipped to the sliding window), with a `score_mod` that adds the relative
      bias `relative_logits[b, h, q, d]`;
    * for full-attention layers the *far* part `d >= extent`, plain causal attention without `score_mod` (the bias
      is zero there, so the gather is not paid on the whole triangle);
  each part returns its log-sum-exp, and the parts and the sink merge in one epilogue:
      out = sum_p e^(lse_p - M) o_p / (sum_p e^(lse_p - M) + e^(sink - M)),   M = max(lse_p..., sink).
  A row with no visible key in a part has lse = -inf there and contributes nothing. With a single part this is
  `o * sigmoid(lse - sink)`. Calls with at most `MAX_STEP_TOKENS` queries go to the decode path.
- `inkling2_decode_attention` (registered as `"inkling2_decode"`): for 1-8 queries (decoding, speculative
  verification). Query heads are folded onto their key/value head ([B, 48, Q, D] -> [B, 8, 6Q, D]) so keys and
  values are read once per kv head; scores are materialized (they are small), the relative bias is scattered onto
  the at most `extent` keys each query can reach (no [Q, K] gather), and the sink enters the softmax denominator.
  It does no host synchronization, so a decode step can be captured in a CUDA graph, and it also takes keys held
  in a ring (the static cache's sliding-window layers).
- `inkling2_triton_attention` (registered as `"inkling2_triton"`): prefill through our own fused kernel
  (`prefill_kernel`: the bias read in-tile, one pass for band and far part, the sink in the epilogue);
  decoding, CPU tensors and gradients as `inkling2_flex`.
- `inkling2_auto_attention` (registered as `"inkling2_auto"`, the default): `inkling2_triton` on CUDA, the eager
  reference elsewhere.
- `inkling2_flex_decode_attention` (registered as `"inkling2_flex_decode"`): prefill as `inkling2_flex`; 1-8
  queries through one FlexAttention call on the folded heads (head ratio 1), so that compiled flex can use its
  split-KV decoding kernel. Checked against eager on CPU, and in bf16 at full size on CUDA (the GPU tests).

All but the decode path need contiguous ascending positions (`query_positions = q0 + arange(Q)`,
`key_positions = k0 + arange(K)`), which is what `Inkling2Attention` and `Inkling2Cache` produce; this is checked
with an asynchronous device assert.

Where it runs: on CUDA, FlexAttention is compiled once per process (`torch.compile(..., dynamic=True)`, offsets
passed as 0-dim tensors, so new lengths do not recompile). On CPU it runs un-compiled (the reference math of
FlexAttention, which returns the log-sum-exp; compiled CPU flex does not). Un-compiled flex ignores the block
structure of a mask, so on CPU the mask also reads the block tables: it then skips exactly the blocks the GPU
kernel skips and CPU tests check the block masks too. Inference only (no backward of the block masks unless the
inputs require grad).
"""

from __future__ import annotations

import functools
import inspect
import warnings

import torch
import torch.nn.functional as F
from torch.nn.attention.flex_attention import BlockMask, flex_attention

from ...cache.common import MAX_STEP_TOKENS
from ...cache.paged import gather_pages
from ...modeling.attention import eager_attention
from ...modeling.tensors import differentiable

try:  # torch >= 2.9: auxiliary outputs; older versions only know `return_lse`
    from torch.nn.attention.flex_attention import AuxRequest
except ImportError:  # pragma: no cover
    AuxRequest = None

BLOCK_SIZE = 128
UNBOUNDED = 1 << 40  # a distance beyond any position
# Compiled variants: {band, far, folded decode} x {batch 1, batch > 1} x dtypes and strides seen; leave headroom so
# a process never falls back to un-compiled flex on CUDA, which would materialize the whole score matrix.
RECOMPILE_LIMIT = 64


# --- distance parts -----------------------------------------------------------------------------------------------


def distance_parts(extent: int, sliding_window: int | None) -> list[tuple[int, int | None, bool]]:
    """The disjoint ranges `[low, high)` of backward distance a query attends over, and whether the relative bias
    applies in each: the band `[0, min(extent, window))` with bias, then whatever the window leaves beyond the
    extent without bias (`high = None`: unbounded, the far part of a full-attention layer)."""
    band_end = extent if sliding_window is None else min(extent, sliding_window)
    parts = [(0, band_end, True)]
    if sliding_window is None or sliding_window > extent:
        parts.append((extent, sliding_window, False))
    return parts


# --- block masks --------------------------------------------------------------------------------------------------


def _block_bounds(length: int, device) -> tuple[torch.Tensor, torch.Tensor]:
    """First and last index of every BLOCK_SIZE block of a sequence of `length`."""
    first = torch.arange(0, length, BLOCK_SIZE, device=device)
    last = (first + BLOCK_SIZE).clamp(max=length) - 1
    return first, last


def distance_block_tables(
    offset: torch.Tensor,
    query_length: int,
    key_length: int,
    low: int,
    high: int | None,
    key_padding: torch.Tensor | None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """(partial, full) block tables, bool [B or 1, 1, q_blocks, kv_blocks], for the entries with `low <= d < high`
    (d = offset + q - k) on real keys. A *full* block has every entry visible (no mask is evaluated there); a
    *partial* block has some; every other block is skipped. Computed from block corners, O(blocks), on device."""
    device = offset.device
    q_first, q_last = _block_bounds(query_length, device)
    k_first, k_last = _block_bounds(key_length, device)
    nearest = offset + q_first[:, None] - k_last[None, :]  # smallest distance in the block
    farthest = offset + q_last[:, None] - k_first[None, :]  # largest
    touches = farthest >= low
    inside = nearest >= low
    if high is not None:
        touches = touches & (nearest < high)
        inside = inside & (farthest < high)
    touches, inside = touches[None, None], inside[None, None]
    if key_padding is not None:
        padded = -key_length % BLOCK_SIZE
        blocks = (key_padding.shape[0], -1, BLOCK_SIZE)
        any_real = F.pad(key_padding, (0, padded), value=False).view(blocks).any(-1)
        all_real = F.pad(key_padding, (0, padded), value=True).view(blocks).all(-1)
        touches = touches & any_real[:, None, None, :]
        inside = inside & all_real[:, None, None, :]
    return touches & ~inside, inside


def _kv_block_lists(table: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Block table -> (count, indices) in FlexAttention's layout: the selected kv blocks first, ascending."""
    counts = table.sum(-1, dtype=torch.int32)
    indices = torch.argsort((~table).to(torch.int8), dim=-1, stable=True).to(torch.int32)
    return counts, indices


def distance_block_mask(
    offset: torch.Tensor,
    query_length: int,
    key_length: int,
    low: int,
    high: int | None,
    key_padding: torch.Tensor | None,
    batch: int = 1,
    emulate_block_sparsity: bool = False,
    for_backward: bool = False,
    folded_rows: int | None = None,
) -> BlockMask:
    """A BlockMask for `low <= offset + q - k < high` on real keys, built from block ranges (never a dense grid).

    `folded_rows`: the query axis holds `folded_rows` rows, query heads folded in as `row = g * query_length + q`
    (decoding: the query index of a row is `row % query_length`). Needs query_length <= BLOCK_SIZE."""
    device = offset.device
    partial, full = distance_block_tables(offset, query_length, key_length, low, high, key_padding)
    # one table per batch row even without padding: a batch dimension of 1 would compile a kernel of its own
    partial, full = partial.expand(batch, -1, -1, -1), full.expand(batch, -1, -1, -1)
    rows = query_length
    if folded_rows is not None:
        # every folded block holds rows of all queries: it gets the (single) block row of the queries
        rows = folded_rows
        folded_blocks = -(-folded_rows // BLOCK_SIZE)
        partial, full = partial.expand(-1, -1, folded_blocks, -1), full.expand(-1, -1, folded_blocks, -1)
        queries = torch.full((), query_length, dtype=offset.dtype, device=device)
    # Bounds and padding ride in device tensors, never in Python values, so that every part, padded or not, shares
    # one compiled mask (a padding of ones costs one byte per key).
    above_low = offset - low  # d >= low  <=>  above_low + q - k >= 0
    below_high = offset - (high if high is not None else UNBOUNDED)  # d < high  <=>  below_high + q - k < 0
    real = key_padding if key_padding is not None else torch.ones(batch, key_length, dtype=torch.bool, device=device)

    def mask_mod(b, h, q_idx, kv_idx):
        if folded_rows is not None:
            q_idx = q_idx % queries
        keep = (above_low + q_idx - kv_idx >= 0) & (below_high + q_idx - kv_idx < 0)
        return keep & real[b, kv_idx]

    if emulate_block_sparsity:
        # Un-compiled flex evaluates the mask on the whole grid and ignores the block lists; make the mask say what
        # the kernel does: full blocks entirely, partial blocks through the mask, nothing elsewhere.
        table_rows = partial.shape[0]
        partial_table, full_table = partial[:, 0], full[:, 0]
        exact_mask = mask_mod

        def mask_mod(b, h, q_idx, kv_idx):
            row = b if table_rows > 1 else 0
            q_block, kv_block = q_idx // BLOCK_SIZE, kv_idx // BLOCK_SIZE
            in_partial = partial_table[row, q_block, kv_block]
            return full_table[row, q_block, kv_block] | (in_partial & exact_mask(b, h, q_idx, kv_idx))

    return BlockMask.from_kv_blocks(
        *_kv_block_lists(partial),
        *_kv_block_lists(full),
        BLOCK_SIZE=BLOCK_SIZE,
        mask_mod=mask_mod,
        seq_lengths=(rows, key_length),
        **({"compute_q_blocks": for_backward} if _FROM_KV_BLOCKS_TAKES_Q_FLAG else {}),
    )


# --- compiled pieces ----------------------------------------------------------------------------------------------


def _compile(function):
    """torch.compile with dynamic shapes and a recompile budget of RECOMPILE_LIMIT (a `torch.compile` argument
    in recent torch; a config patch around each call in older ones)."""
    if "recompile_limit" in inspect.signature(torch.compile).parameters:
        return torch.compile(function, dynamic=True, fullgraph=True, recompile_limit=RECOMPILE_LIMIT)
    compiled = torch.compile(function, dynamic=True, fullgraph=True)
    config = torch._dynamo.config
    limit_name = "recompile_limit" if hasattr(config, "recompile_limit") else "cache_size_limit"

    def call(*args, **kwargs):
        with config.patch(**{limit_name: max(RECOMPILE_LIMIT, getattr(config, limit_name))}):
            return compiled(*args, **kwargs)

    return call


@functools.cache
def _compiled_flex():
    return _compile(flex_attention)


@functools.cache
def _compiled_merge():
    return _compile(merge_with_sink)


def _flex_with_lse(attend, *args, **kwargs) -> tuple[torch.Tensor, torch.Tensor]:
    """(output, natural-log LSE) from FlexAttention, whichever way this torch version returns the LSE."""
    if AuxRequest is not None:
        output, aux = attend(*args, return_aux=AuxRequest(lse=True), **kwargs)
        return output, aux.lse
    return attend(*args, return_lse=True, **kwargs)


_FROM_KV_BLOCKS_TAKES_Q_FLAG = "compute_q_blocks" in inspect.signature(BlockMask.from_kv_blocks).parameters


def on_cuda_outside_compile(tensor: torch.Tensor) -> bool:
    """A CUDA tensor, and not already inside a graph `torch.compile` traces (fast paths compile or launch their own)."""
    return tensor.is_cuda and not torch.compiler.is_compiling()


def merge_with_sink(
    outputs: list[torch.Tensor], lses: list[torch.Tensor], sinks: torch.Tensor, dtype: torch.dtype
) -> torch.Tensor:
    """Softmax over the union of disjoint key sets plus one zero-value sink logit, from each set's normalized
    output [B, H, Q, D] and natural-log LSE [B, H, Q] (-inf: the set is empty for that row). Computed in fp32;
    returns [B, Q, H, D] in `dtype`, contiguous (the layout the model reshapes to [B, Q, H * D])."""
    sinks = sinks.float()
    top = sinks
    for lse in lses:
        top = torch.maximum(top, lse)
    denominator = torch.exp(sinks - top)
    merged = None
    for output, lse in zip(outputs, lses):
        weight = torch.exp(lse - top)
        denominator = denominator + weight
        term = weight[..., None] * output.float()
        merged = term if merged is None else merged + term
    return (merged / denominator[..., None]).to(dtype).transpose(1, 2).contiguous()


def _check_contiguous_positions(query_positions: torch.Tensor, key_positions: torch.Tensor) -> None:
    """Asynchronous check (no host sync on CUDA) of the `q0 + arange(Q)`, `k0 + arange(K)` layout."""
    ok = (query_positions[-1] - query_positions[0] == query_positions.numel() - 1) & (
        key_positions[-1] - key_positions[0] == key_positions.numel() - 1
    )
    torch._assert_async(ok, "inkling2 attention backends need contiguous ascending query and key positions")


# --- prefill: FlexAttention ----------------------------------------------------------------------------------------


def inkling2_flex_attention(
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
) -> torch.Tensor:
    """Same contract as `eager_attention`: query [B, H, Q, D], key/value [B, Hkv, K, D], relative_logits
    [B, H, Q, extent], sinks [B, H, Q] -> [B, Q, H, D]. Up to MAX_STEP_TOKENS queries take the decode path."""
    if query.shape[2] <= MAX_STEP_TOKENS:
        return inkling2_decode_attention(
            query, key, value, relative_logits, sinks, query_positions, key_positions, key_padding,
            sliding_window, scaling,
        )  # fmt: skip
    _check_contiguous_positions(query_positions, key_positions)
    query_length, key_length, extent = query.shape[2], key.shape[2], relative_logits.shape[-1]
    offset = query_positions[0] - key_positions[0]
    if key_padding is not None:
        key_padding = key_padding.bool()
    compiled = on_cuda_outside_compile(query)
    attend = _compiled_flex() if compiled else flex_attention
    # never the split-KV decode kernel for short query chunks: it needs a power-of-two GQA ratio (48 / 8 = 6)
    kernel_options = {"FORCE_USE_FLEX_ATTENTION": True} if compiled else None

    def add_relative_bias(score, b, h, q_idx, kv_idx):
        distance = (offset + q_idx - kv_idx).clamp(0, extent - 1)
        return score + relative_logits[b, h, q_idx, distance]

    outputs, lses = [], []
    for low, high, with_bias in distance_parts(extent, sliding_window):
        block_mask = distance_block_mask(
            offset, query_length, key_length, low, high, key_padding, query.shape[0],
            emulate_block_sparsity=not compiled, for_backward=query.requires_grad,
        )  # fmt: skip
        with warnings.catch_warnings():
            # un-compiled flex warns that it is not fused; on CPU that is the intended reference path
            warnings.filterwarnings("ignore", message="flex_attention called without torch.compile")
            output, lse = _flex_with_lse(
                attend,
                query,
                key,
                value,
                score_mod=add_relative_bias if with_bias else None,
                block_mask=block_mask,
                scale=scaling,
                enable_gqa=query.shape[1] != key.shape[1],
                kernel_options=kernel_options,
            )
        outputs.append(output)
        lses.append(lse)
    merge = _compiled_merge() if compiled else merge_with_sink
    return merge(outputs, lses, sinks, value.dtype)


def inkling2_triton_attention(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, **inputs) -> torch.Tensor:
    """Same contract as `eager_attention`. Prefill chunks on CUDA (without gradients) run the fused kernel of
    `prefill_kernel`, which reads the relative bias in-tile; everything else runs `inkling2_flex_attention`
    (1-8 queries: the decode path)."""
    if query.shape[2] > MAX_STEP_TOKENS and query.is_cuda and not differentiable(query, key, value):
        from . import prefill_kernel  # Triton, imported where a kernel runs

        if prefill_kernel.supports(query, key):
            _check_contiguous_positions(inputs["query_positions"], inputs["key_positions"])
            return prefill_kernel.prefill_attention(query, key, value, **inputs)
    return inkling2_flex_attention(query, key, value, **inputs)


def inkling2_auto_attention(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, **inputs) -> torch.Tensor:
    """The default backend (what a model uses when no `attn_implementation` is asked for): on CUDA the fastest path
    for the call (`inkling2_triton_attention`: the fused prefill kernel, the decode kernel for 1-8 queries, FlexAttention
    where gradients flow); elsewhere the eager reference (off CUDA the other paths run un-compiled and materialize
    the scores too, so nothing is gained by leaving the reference)."""
    if query.is_cuda:
        return inkling2_triton_attention(query, key, value, **inputs)
    return eager_attention(query, key, value, **inputs)


# --- decode / verification: 1-8 queries ---------------------------------------------------------------------------


def inkling2_decode_attention(
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
    """Same contract as `eager_attention`, for a few queries (decode, speculative verification). On CUDA, without
    gradients, one fused Triton kernel (`decode_kernel`); otherwise, and as its reference, this PyTorch
    path, which materializes the [B, H, Q, K] scores in fp32 (small for Q <= 8); everything else is O(Q * extent) or
    O(K). With a `block_table` ([B, pages]), `key` / `value` are page pools [pages, kv heads, page_size, D] and row
    b's key j sits in page `block_table[b, j // page_size]` (`Inkling2PagedCache`): the kernel reads them there,
    this path gathers them first."""
    if query.is_cuda and not differentiable(query, key, value):
        from . import decode_kernel  # Triton, imported where a kernel runs

        if decode_kernel.supports(query, key):
            return decode_kernel.decode_attention(
                query, key, value, relative_logits, sinks, query_positions, key_positions, key_padding,
                sliding_window, scaling, block_table, page_size,
            )  # fmt: skip
    if block_table is not None:
        key, value = gather_pages(key, block_table), gather_pages(value, block_table)
    batch, heads, query_length, head_dim = query.shape
    kv_heads, key_length = key.shape[1], key.shape[2]
    groups, extent = heads // kv_heads, relative_logits.shape[-1]

    # Query head h = kv_head * groups + g reads kv head h // groups: rows of one kv head are (g, query).
    folded = query.reshape(batch, kv_heads, groups * query_length, head_dim)
    scores = torch.matmul(folded, key.transpose(2, 3)).float() * scaling
    scores = scores.view(batch, kv_heads, groups, query_length, key_length)

    # Positions as [rows, Q] and [rows, K], rows = 1 when the batch shares them (both 1-D), else batch.
    rows = max(query_positions.view(-1, query_length).shape[0], key_positions.view(-1, key_length).shape[0])
    query_positions = query_positions.view(-1, query_length).expand(rows, -1)
    key_positions = key_positions.view(-1, key_length).expand(rows, -1)
    # Bias: query i reaches back `t < extent` tokens, to position p_i - t. Keys sit in ascending order or in a ring
    # (slot = position mod K): either way position x is at index (x - key_positions[0]) mod K when it is held.
    reached_positions = query_positions[:, :, None] - torch.arange(extent, device=query.device)
    reached = (reached_positions - key_positions[:, :1, None]).remainder(key_length)  # [rows, Q, extent]
    in_keys = key_positions.gather(1, reached.flatten(1)).view_as(reached) == reached_positions
    bias = relative_logits.float().masked_fill(~in_keys[:, None], 0.0)
    bias = bias.view(batch, kv_heads, groups, query_length, extent)
    scores.scatter_add_(-1, reached[:, None, None].expand_as(bias), bias)

    distance = (query_positions[:, :, None] - key_positions[:, None, :])[:, None, None]  # [rows, 1, 1, Q, K]
    visible = distance >= 0
    if sliding_window is not None:
        visible = visible & (distance < sliding_window)
    if key_padding is not None:
        visible = visible & key_padding.bool()[:, None, None, None, :]
    scores = scores.masked_fill(~visible, -torch.inf)

    # Softmax with the sink in the denominator; the max includes the sink so nothing overflows and a row without
    # visible keys gives 0.
    sinks = sinks.float().view(batch, kv_heads, groups, query_length, 1)
    top = torch.maximum(scores.amax(-1, keepdim=True), sinks)
    weights = torch.exp(scores - top)
    denominator = weights.sum(-1, keepdim=True) + torch.exp(sinks - top)
    weights = weights.view(batch, kv_heads, groups * query_length, key_length).to(value.dtype)
    output = torch.matmul(weights, value).float().view(batch, kv_heads, groups, query_length, head_dim)
    output = (output / denominator).to(value.dtype)
    return output.view(batch, heads, query_length, head_dim).transpose(1, 2)


# --- decode / verification through FlexAttention's split-KV kernel ------------------------------------------------


def inkling2_flex_decode_attention(
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
) -> torch.Tensor:
    """`inkling2_flex_attention` for prefill; for <= MAX_STEP_TOKENS queries, one FlexAttention call with the
    query heads folded onto their kv head ([B, 48, Q, D] -> [B, 8, 6Q, D], head ratio 1), which lets compiled flex
    use its split-KV decoding kernel (it needs a power-of-two head ratio; 48 / 8 = 6 is not). The bias `score_mod`
    recovers head and query from the folded row; keys beyond the extent read a bias of 0."""
    if query.shape[2] > MAX_STEP_TOKENS:
        return inkling2_flex_attention(
            query, key, value, relative_logits, sinks, query_positions, key_positions, key_padding,
            sliding_window, scaling,
        )  # fmt: skip
    _check_contiguous_positions(query_positions, key_positions)
    batch, heads, query_length, head_dim = query.shape
    kv_heads, key_length = key.shape[1], key.shape[2]
    groups, extent = heads // kv_heads, relative_logits.shape[-1]
    offset = query_positions[0] - key_positions[0]
    compiled = on_cuda_outside_compile(query)
    folded_rows = groups * query_length
    block_mask = distance_block_mask(
        offset, query_length, key_length, 0, sliding_window, None if key_padding is None else key_padding.bool(),
        batch, emulate_block_sparsity=not compiled, for_backward=query.requires_grad, folded_rows=folded_rows,
    )  # fmt: skip
    queries = torch.full((), query_length, dtype=offset.dtype, device=query.device)

    def add_relative_bias(score, b, h, row, kv_idx):
        q_idx = row % queries
        distance = offset + q_idx - kv_idx
        bias = relative_logits[b, h * groups + row // queries, q_idx, distance.clamp(0, extent - 1)]
        return score + torch.where(distance < extent, bias, 0.0)

    attend = _compiled_flex() if compiled else flex_attention
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="flex_attention called without torch.compile")
        output, lse = _flex_with_lse(
            attend,
            query.reshape(batch, kv_heads, folded_rows, head_dim),
            key,
            value,
            score_mod=add_relative_bias,
            block_mask=block_mask,
            scale=scaling,
        )
    output = output.view(batch, heads, query_length, head_dim)
    lse = lse.view(batch, heads, query_length)
    merge = _compiled_merge() if compiled else merge_with_sink
    return merge([output], [lse], sinks, value.dtype)


__all__ = [
    "distance_block_mask",
    "inkling2_decode_attention",
    "inkling2_flex_attention",
    "inkling2_flex_decode_attention",
    "merge_with_sink",
]
