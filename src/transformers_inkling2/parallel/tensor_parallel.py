"""Tensor and expert parallelism of Inkling2: the plans that `from_pretrained(..., tp_plan="auto")` applies under
`torchrun`, and the parallel styles (`inkling2_*`) they need beyond transformers' own.

What each rank holds (always a contiguous block, so a rank reads only its slice of every checkpoint tensor):
- attention, split by heads: q/k/v/r/gate/sink projections column-wise (`HeadColumnsProjection`: a plain linear over
  this rank's rows, which a decode step's grouped GEMV reads as it does one GPU's), `o_proj` row-wise (one all-reduce
  per layer, of fp32 partial products: see `HeadRowsProjection`); the per-head parameters go with their heads: the
  query and relative-state scales [heads, dim] by rows, the sliding layers' k/v convolution weights
  [channels, 1, k] by channels, the full layers' dynamic-convolution taps (`weight_proj` rows are
  `kv_head * kernel + lag`: column-wise) and static taps [kernel, channels] by channels. Query head h reads kv
  head `h // (heads / kv_heads)`, so a block of query heads and the block of kv heads they read land on the same
  rank; attention, its backends and the cache just see fewer heads.
- routed experts, in contiguous blocks of `n_routed_experts / size` (BF16 parameters, and the packed NVFP4 / MXFP8
  buffers with their scales alike). Dispatch by all-reduce: the router is replicated, every rank routes every token,
  runs the routes that land on its own block and the partial outputs are summed across ranks (in fp32). No tokens
  move and nothing is read back to the host, so a decode step can still be captured in a CUDA graph; all-to-all
  would move less data for large prefills, but needs per-layer split sizes on the host.
- `lm_head` by vocabulary (column-wise, the logits gathered on every rank).
Everything else is replicated: the embedding (its RMSNorm follows the lookup, so a vocabulary-split lookup could not
be summed after it), norms, router, attention-residual queries, the relative-bias bank, the post-attention and
post-MoE convolutions (full width) and the ViT.

`tp_plan="auto"` (or `DistributedConfig(tp_plan="auto")`) splits both attention and experts over the same ranks:
TP4/EP4 on four GPUs, with the all-reduce dispatch above. `DistributedConfig(tp_plan="auto", ep_size=N)` splits the
experts through transformers' expert-parallel plan instead (same blocks; its `ep_dispatch_experts` runs the
all-reduce at inference when the expert group shares the batch, all-to-all otherwise, e.g. in training).
See docs/parallel.md.

Split tensors are DTensors whose local block is all a rank loads; the modules that read a per-head parameter or an
expert tensor directly (not through a hooked `nn.Linear`) take that block with `local_tensor`. The styles run
before loading, on the meta device, and only make placeholders (nothing is built whole and then split):
transformers' loader reads each rank's block straight from the safetensors file, so a rank reads its blocks and the
replicated tensors, no more, and receives nothing from the other ranks while loading
(tests/parallel/test_tensor_parallel_loading.py counts the bytes).
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn

from ..configuration_inkling2 import TEXT_MODEL_EP_PLAN, TEXT_MODEL_TP_PLAN
from ..modeling.tensors import LOCAL_BLOCK_LINEAR, local_tensor

try:
    import torch.distributed as dist
    from torch.distributed.tensor import DTensor, Shard, distribute_tensor
except ImportError:  # pragma: no cover  (a torch build without distributed support)
    dist = DTensor = None



def parallel_split_counts(config) -> dict[str, int]:
    """What every rank must hold a whole number of."""
    text = config.get_text_config()
    counts = {
        "query heads (`num_attention_heads`)": text.num_attention_heads,
        "key/value heads (`num_key_value_heads`)": text.num_key_value_heads,
        "sliding-window query heads (`swa_num_attention_heads`)": text.swa_num_attention_heads,
        "sliding-window key/value heads (`swa_num_key_value_heads`)": text.swa_num_key_value_heads,
        "routed experts (`n_routed_experts`)": text.n_routed_experts,
    }
    return {name: count for name, count in counts.items() if count is not None}


def valid_parallel_sizes(config) -> list[int]:
    """The TP/EP sizes that split every head and expert count evenly (1, 2, 4, 8 for Inkling-2-Small)."""
    common = math.gcd(*parallel_split_counts(config).values())
    return [size for size in range(1, common + 1) if common % size == 0]


def validate_parallel_size(config, size: int, kind: str = "tensor-parallel") -> None:
    """Raises a ValueError naming the counts when `size` ranks cannot each hold whole heads and whole experts."""
    uneven = {name: count for name, count in parallel_split_counts(config).items() if count % size}
    if uneven:
        listing = ", ".join(f"{count} {name}" for name, count in uneven.items())
        valid = valid_parallel_sizes(config)
        raise ValueError(
            f"Inkling2 cannot be split over {size} {kind} ranks: {listing} do not divide by {size}. Every rank holds "
            f"whole attention heads and a whole block of experts, so the size must divide the query heads, the "
            f"key/value heads and the experts: use one of {valid} (e.g. `torchrun --nproc_per_node {max(valid)}`)."
        )


def _shard_placeholder(tensor: torch.Tensor, mesh, dim: int) -> torch.Tensor:
    """A DTensor view of a (meta) tensor split on `dim`: transformers' loader then reads only this rank's block."""
    return distribute_tensor(tensor, mesh, [Shard(dim)], src_data_rank=None)


class ParallelStyle:
    """What transformers' `apply_tensor_parallelism` / `apply_expert_parallelism` call on a style: `shard_param` for
    every parameter the plan names (before the weights are loaded, on the meta device), then `install_forward` on
    every module it names. Same hooks as `transformers.distributed.tensor_parallel.TensorParallelLayer`."""

    def validate_param(self, module, param, mesh, parameter_name=None):
        pass

    def shard_param(self, module, param, mesh):
        pass

    def install_forward(self, module, mesh):
        return module


class HeadBlocks(ParallelStyle):
    """A per-head parameter (rows or columns are heads, or head-major channels) split on `dim` like the projections
    next to it. No forward hook: the module takes its block with `local_tensor`."""

    def __init__(self, dim: int):
        self.dim = dim

    def shard_param(self, module, param, mesh):
        tensor = module._parameters[param]
        if tensor.shape[self.dim] % mesh.size():
            raise ValueError(
                f"{type(module).__name__}.{param} {tuple(tensor.shape)} does not split over {mesh.size()} ranks on "
                f"dim {self.dim}."
            )
        module._parameters[param] = nn.Parameter(
            _shard_placeholder(tensor, mesh, self.dim), requires_grad=tensor.requires_grad
        )


class AttentionHeads(ParallelStyle):
    """On `self_attn`: checks that the heads split evenly before any projection is split (its children are sharded
    by their own rules; the attention code reshapes with `-1` heads)."""

    def install_forward(self, module, mesh):
        validate_parallel_size(module.config, mesh.size())
        return module


class _SumOverRanks(torch.autograd.Function):
    """All-reduce (sum) forward; identity backward (every rank holds the same summed output and its gradient)."""

    @staticmethod
    def forward(ctx, partial, group):
        total = partial.clone()
        dist.all_reduce(total, group=group)
        return total

    @staticmethod
    def backward(ctx, grad):
        return grad, None


class _SumGradientsOverRanks(torch.autograd.Function):
    """Identity forward; all-reduce backward: a replicated input feeding this rank's experts only gets a partial
    gradient from each rank."""

    @staticmethod
    def forward(ctx, tensor, group):
        ctx.group = group
        return tensor.view_as(tensor)

    @staticmethod
    def backward(ctx, grad):
        grad = grad.contiguous().clone()
        dist.all_reduce(grad, group=ctx.group)
        return grad, None


class SplitLinear(ParallelStyle):
    """A bias-free `nn.Linear` whose weight is split on `dim` by head; `local_forward` says what the module then
    computes from this rank's block."""

    name: str
    dim: int

    def shard_param(self, module, param, mesh):
        tensor = module._parameters[param]
        if param == "weight":
            module._parameters[param] = nn.Parameter(
                _shard_placeholder(tensor, mesh, self.dim), requires_grad=tensor.requires_grad
            )

    def install_forward(self, module, mesh):
        if module.bias is not None:
            raise ValueError(f"{self.name} shards projections without a bias (Inkling2's have none).")
        module.forward = self.local_forward(module, mesh.get_group())
        return module

    def local_forward(self, module, group):
        raise NotImplementedError


class HeadColumnsProjection(SplitLinear):
    """A projection to heads (q, k, v, r, gate, sink; the full layers' tap projections) split column-wise: its weight's
    rows, the output features, by head, over a replicated input, so no communication in the forward. Instead of
    transformers' `colwise` (DTensor hooks on every call) the module computes `F.linear(x, this rank's block)` and says
    so (`LOCAL_BLOCK_LINEAR`): a decode step's input projections then take the grouped GEMV as on one GPU
    (`backends/projections.py`). In training the input's gradient is summed over the ranks, each holding the part
    that flows through its heads."""

    name, dim = "inkling2_colwise", 0

    def install_forward(self, module, mesh):
        module = super().install_forward(module, mesh)
        setattr(module, LOCAL_BLOCK_LINEAR, True)
        return module

    def local_forward(self, module, group):
        def forward(x):
            weight = local_tensor(module.weight)
            if torch.is_grad_enabled() and (x.requires_grad or weight.requires_grad):
                x = _SumGradientsOverRanks.apply(x, group)
            return F.linear(x, weight)

        return forward


def fp32_linear(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """`x @ weight.T` accumulated and returned in fp32: a bf16 GEMM with an fp32 output on CUDA (`torch.mm`'s
    `out_dtype`), an fp32 GEMM elsewhere."""
    if x.is_cuda and x.dtype in (torch.float16, torch.bfloat16) and weight.dtype == x.dtype:
        try:
            output = torch.mm(x.reshape(-1, x.shape[-1]), weight.t(), out_dtype=torch.float32)
            return output.view(*x.shape[:-1], -1)
        except (TypeError, NotImplementedError):  # a torch without `out_dtype`
            pass
    return F.linear(x.float(), weight.float())


class HeadRowsProjection(SplitLinear):
    """`o_proj` row-wise: its input is this rank's heads, its weight the matching input columns; the partial products
    are summed over the ranks in fp32 and rounded once, like one GPU's GEMM (fp32 accumulation). transformers'
    `rowwise` rounds each partial to bf16 before the sum, which on a toy-width bf16 model moved the logits ten times
    further from one GPU's than bf16 itself does (from fp32)."""

    name, dim = "inkling2_rowwise", -1

    def local_forward(self, module, group):
        def forward(x):
            weight = local_tensor(module.weight)
            if torch.is_grad_enabled() and (x.requires_grad or weight.requires_grad):
                return _SumOverRanks.apply(F.linear(x.float(), weight.float()), group).to(x.dtype)
            partial = fp32_linear(x, weight)
            dist.all_reduce(partial, group=group)
            return partial.to(x.dtype)

        return forward


def split_experts(experts: nn.Module, mesh, first_expert_is_global: bool) -> None:
    """Splits every tensor of an experts module (parameters and packed buffers) on its first dim, the experts:
    rank r holds `[r * n, (r + 1) * n)`, `n = n_routed_experts / size`. The module then skips the routes of other
    ranks' experts (see `experts.Inkling2ExpertsBase`; `_is_expert_parallel`, as transformers' own styles set it). With
    `first_expert_is_global` it takes global expert ids; otherwise ids already local to the block (what
    transformers' expert-parallel dispatch passes)."""
    size, rank = mesh.size(), mesh.get_local_rank()
    kind = "expert-parallel" if "ep" in (mesh.mesh_dim_names or ()) else "tensor-parallel"
    validate_parallel_size(experts.config, size, kind)
    for name, tensor in list(experts._parameters.items()):
        if tensor is not None and not isinstance(tensor, DTensor):
            placeholder = _shard_placeholder(tensor, mesh, 0)
            experts._parameters[name] = nn.Parameter(placeholder, requires_grad=tensor.requires_grad)
    for name, tensor in list(experts._buffers.items()):
        if tensor is not None and name not in experts._non_persistent_buffers_set:
            experts._buffers[name] = _shard_placeholder(tensor, mesh, 0)
    experts.num_experts = experts.config.n_routed_experts // size
    experts.first_expert = rank * experts.num_experts if first_expert_is_global else 0
    experts._is_expert_parallel = True


class ExpertBlocks(ParallelStyle):
    """The TP plan's experts (on `mlp.experts`): split in blocks over the TP ranks, which all route the same tokens;
    each runs the routes to its own experts and the fp32 partial outputs are summed with one all-reduce."""

    def install_forward(self, module, mesh):
        split_experts(module, mesh, first_expert_is_global=True)
        group = mesh.get_group()
        experts_forward = module.forward

        def forward(x, expert_ids, weights):
            if torch.is_grad_enabled() and (x.requires_grad or weights.requires_grad):
                x, weights = _SumGradientsOverRanks.apply(x, group), _SumGradientsOverRanks.apply(weights, group)
                return _SumOverRanks.apply(experts_forward(x, expert_ids, weights).float(), group).to(x.dtype)
            partial = experts_forward(x, expert_ids, weights).float()
            dist.all_reduce(partial, group=group)
            return partial.to(x.dtype)

        module.forward = forward
        return module


class ExpertBlocksForDispatch(ParallelStyle):
    """The EP plan's rule on the MoE block (`mlp`): splits its experts' tensors, packed buffers included, which
    transformers' `grouped_gemm` cannot; its `ep_dispatch_experts` on `mlp.experts` then brings them their tokens
    with block-local expert ids."""

    def install_forward(self, module, mesh):
        split_experts(module.experts, mesh, first_expert_is_global=False)
        return module


def register_parallel_styles() -> None:
    """Makes the plans' `inkling2_*` style names known to transformers (idempotent)."""
    if dist is None or not dist.is_available():
        return
    from transformers.distributed.parallel_utils import ALL_PARALLEL_STYLES

    ALL_PARALLEL_STYLES.register("inkling2_attention", AttentionHeads())
    ALL_PARALLEL_STYLES.register("inkling2_head_rows", HeadBlocks(0))
    ALL_PARALLEL_STYLES.register("inkling2_head_columns", HeadBlocks(-1))
    ALL_PARALLEL_STYLES.register("inkling2_colwise", HeadColumnsProjection())
    ALL_PARALLEL_STYLES.register("inkling2_rowwise", HeadRowsProjection())
    ALL_PARALLEL_STYLES.register("inkling2_experts", ExpertBlocks())
    ALL_PARALLEL_STYLES.register("inkling2_expert_blocks", ExpertBlocksForDispatch())


register_parallel_styles()

__all__ = [
    "TEXT_MODEL_EP_PLAN",
    "TEXT_MODEL_TP_PLAN",
    "local_tensor",
    "valid_parallel_sizes",
    "validate_parallel_size",
]
