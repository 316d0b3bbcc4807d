"""The routed experts of an Inkling2 MoE layer: the BF16 reference, and the base every expert storage shares.

Every expert computes `down(softcap4(g) * sigmoid(g) * softcap25(u))` with `[g; u] = gate_up(x)`, and a token's
output is the routing-weighted sum of its experts' outputs, accumulated in fp32.

- `Inkling2Experts`: BF16 (or fp32) weights `gate_up_proj` [E, 2I, H] (gate rows, then up rows) and `down_proj`
  [E, H, I], a transformers `@use_experts_implementation` experts module: `experts_implementation="grouped_mm"`
  (the default) and `"batched_mm"` run transformers' own experts functions (`ALL_EXPERTS_FUNCTIONS`) with our
  softcapped gate (`_apply_gate`), except for BF16 inference on CUDA, where the `inkling2_moe` hub kernel serves both
  names; `"eager"` is the reference loop over the experts that received tokens.
- Packed NVFP4 / MXFP8 experts (`quantization/experts.py`) share `Inkling2ExpertsBase` and register their storage
  in `interfaces.EXPERT_STORAGES`; the fused kernel arrives as `interfaces.KERNELS["routed_experts"]`.

Split across ranks by a parallel plan (`parallel/tensor_parallel.py`, `_is_expert_parallel` set, as transformers'
expert-parallel styles set it), a module holds a contiguous block of `num_experts` experts starting at global id
`first_expert` and skips the routes whose id (minus `first_expert`) falls outside its block; the plan sums the
ranks' outputs.
"""


from typing import NamedTuple

import torch
import torch.nn.functional as F
from torch import nn
from transformers.distributed.parallel_utils import _use_local_dtensor_params
from transformers.integrations.moe import ExpertsInterface, use_experts_implementation

from ..configuration_inkling2 import Inkling2TextConfig
from .interfaces import EXPERT_STORAGES, KERNELS
from .tensors import differentiable, local_tensor

# transformers' other experts functions (deepgemm, sonicmoe) fuse a SiLU gate: they would ignore our softcaps
EXPERT_IMPLEMENTATIONS = ("eager", "grouped_mm", "batched_mm")
MAX_GROUPED_ELEMENTS = 2**31  # torch._grouped_mm indexes its operands with 32-bit integers


def softcap(x: torch.Tensor, cap: float) -> torch.Tensor:
    """Smoothly bounds `x` to (-cap, cap)."""
    return cap * torch.tanh(x / cap)


def softcapped_swiglu(gate: torch.Tensor, up: torch.Tensor, gate_cap: float, up_cap: float) -> torch.Tensor:
    """`softcap(g) * sigmoid(g) * softcap(u)`: the sigmoid sees the raw gate; in fp32."""
    gate, up = gate.float(), up.float()
    return softcap(gate, gate_cap) * torch.sigmoid(gate) * softcap(up, up_cap)


def experts_implementation(name: str | None) -> str:
    """"eager" (the reference loop), "grouped_mm" (the default: one grouped GEMM per projection over the tokens
    sorted by expert) or "batched_mm" (each route's expert weights gathered and multiplied in one batched GEMM: more
    memory, fewer launches for a few tokens)."""
    name = name or "grouped_mm"
    if name not in EXPERT_IMPLEMENTATIONS:
        raise ValueError(
            f"Inkling2 experts run with `experts_implementation` in {EXPERT_IMPLEMENTATIONS}, got {name!r}."
        )
    return name


class RouteTerms(NamedTuple):
    """The routed experts' output before its sum (`Inkling2ExpertsBase.route_terms`), for a kernel that adds it up
    itself: `terms`, each route's routing-weighted output, fp32 [parts, N, top_k, H] (`parts`: the kernel's split of
    the down projection's reduction), and the routes' `expert_ids` [N, top_k]. Added per token in route order, each
    route's parts in order, and rounded to bf16 (then to the activations' dtype), they are the experts' output bit for
    bit; a route to an id outside [0, num_experts) holds no term (it is skipped)."""

    terms: torch.Tensor
    expert_ids: torch.Tensor
    num_experts: int


class Inkling2ExpertsInterface(ExpertsInterface):
    """transformers' experts functions, looked up in its registry at every call (so that its registrations and
    patches apply) and run through `Inkling2Experts.by_matmuls` (the fused kernel, chunking, expert parallelism)."""

    def get_interface(self, experts_implementation_name: str | None, default):
        name = experts_implementation(experts_implementation_name)
        if name == "eager":
            return default
        function = super().get_interface(name, default)
        return lambda experts, *args: experts.by_matmuls(function, *args)


class Inkling2ExpertsBase(nn.Module):
    def __init__(self, config: Inkling2TextConfig):
        super().__init__()
        self.config = config
        self.num_experts = config.n_routed_experts  # held by this module: all of them unless split across ranks
        self.first_expert = 0  # global id of the module's expert 0
        self._is_expert_parallel = False  # split across ranks: other ranks' routes skipped
        self.hidden_size, self.intermediate_size = config.hidden_size, config.moe_intermediate_size
        self.gate_cap, self.up_cap = config.mlp_gate_softcap, config.mlp_up_softcap

    def local_expert_ids(self, expert_ids: torch.Tensor) -> torch.Tensor:
        """Global expert ids -> ids in this module's block; routes to other ranks' experts fall outside
        `[0, num_experts)`, which every path skips."""
        return expert_ids - self.first_expert if self.first_expert else expert_ids

    def finish(self, output: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        """The fp32 accumulation in the activations' dtype, or kept fp32 when it is to be summed over ranks."""
        return output.float() if self._is_expert_parallel else output.to(dtype)

    def expert_weights(self, expert: int) -> tuple[torch.Tensor, torch.Tensor]:
        """(gate_up [2I, H], down [H, I]) of one expert in a dtype that matmuls with the activations."""
        raise NotImplementedError

    def _apply_gate(self, gate_up: torch.Tensor) -> torch.Tensor:
        """[..., 2I] gate and up projections -> [..., I] softcapped SwiGLU (in fp32), in their dtype: the name and
        contract of transformers' experts functions."""
        gate, up = gate_up.chunk(2, dim=-1)
        return softcapped_swiglu(gate, up, self.gate_cap, self.up_cap).to(gate_up.dtype)

    def expert_mlp(self, x: torch.Tensor, expert: int) -> torch.Tensor:
        """One expert on its tokens: `down(softcapped_swiglu(gate_up(x)))`."""
        gate_up, down = self.expert_weights(expert)
        return F.linear(self._apply_gate(F.linear(x, gate_up.to(x.dtype))), down.to(x.dtype))

    def loop_over_experts(self, x: torch.Tensor, expert_ids: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
        """The reference: x [N, H]; expert_ids, weights [N, k]. Outputs accumulate in fp32."""
        output = torch.zeros(x.shape, dtype=torch.float32, device=x.device)
        expert_ids = self.local_expert_ids(expert_ids)
        for expert in expert_ids.unique().tolist():
            if not 0 <= expert < self.num_experts:
                continue  # another rank's expert
            token, slot = torch.where(expert_ids == expert)
            expert_output = self.expert_mlp(x[token], expert) * weights[token, slot, None]
            output.index_add_(0, token, expert_output.float())
        return self.finish(output, x.dtype)

    def kernel_weights(self) -> dict:
        """The `moe_forward` arguments that describe this module's weights (format, tensors, scales)."""
        raise NotImplementedError

    def run_kernel(self, x: torch.Tensor, expert_ids: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
        """The `inkling2_moe` hub kernel (routing, fused dequantization, softcapped SwiGLU and combine in a handful of
        launches, no host sync: Triton on CUDA tensors, the kernel package's own PyTorch reference elsewhere);
        bf16 activations."""
        return self.finish(self.call_kernel("routed_experts", x, expert_ids, weights), x.dtype)

    def route_terms(self, x: torch.Tensor, expert_ids: torch.Tensor, weights: torch.Tensor) -> RouteTerms | None:
        """`RouteTerms` of x [N, H] from the hub kernel without its combine launch, where the kernel takes the call
        and the sum is this module's to make; None elsewhere (another path; expert parallelism, whose plan sums the
        ranks' outputs; a kernel build without the option)."""
        if self._is_expert_parallel or not self.takes_kernel(x, weights) or "routed_expert_terms" not in KERNELS:
            return None
        terms = self.call_kernel("routed_expert_terms", x, expert_ids, weights)
        return None if terms is None else RouteTerms(terms, expert_ids, self.num_experts)

    def call_kernel(self, name: str, x: torch.Tensor, expert_ids: torch.Tensor, weights: torch.Tensor):
        """The hub kernel `KERNELS[name]` on this module's weights: bf16 activations, this block's expert ids."""
        return KERNELS.get(name)(
            x.to(torch.bfloat16),
            self.local_expert_ids(expert_ids),  # the kernel drops ids outside [0, experts): other ranks' routes
            weights.float(),
            gate_cap=self.gate_cap,
            up_cap=self.up_cap,
            **self.kernel_weights(),
        )

    def takes_kernel(self, x: torch.Tensor, weights: torch.Tensor) -> bool:
        """Whether this call runs the hub kernel (`uses_kernel`, and whatever the storage adds)."""
        return self.uses_kernel(x, weights)

    def uses_kernel(self, x: torch.Tensor, weights: torch.Tensor) -> bool:
        """Inference on CUDA with the default implementation: the kernel has no backward, so with gradients flowing
        (into the activations, the routing weights or trainable expert weights) the differentiable paths run."""
        needs_grad = differentiable(x, weights, *self.parameters())
        by_matmuls = experts_implementation(self.config._experts_implementation) != "eager"
        return x.is_cuda and not needs_grad and by_matmuls and "routed_experts" in KERNELS


@use_experts_implementation(experts_interface=Inkling2ExpertsInterface())
class Inkling2Experts(Inkling2ExpertsBase):
    """Routed experts as stacked BF16 weights, laid out as transformers' experts functions read them (`has_gate`:
    `gate_up_proj` holds the gate rows, then the up rows)."""

    def __init__(self, config: Inkling2TextConfig):
        super().__init__(config)
        self.gate_up_proj = nn.Parameter(torch.empty(self.num_experts, 2 * self.intermediate_size, self.hidden_size))
        self.down_proj = nn.Parameter(torch.empty(self.num_experts, self.hidden_size, self.intermediate_size))

    def expert_weights(self, expert: int):
        return local_tensor(self.gate_up_proj)[expert], local_tensor(self.down_proj)[expert]

    def forward(self, x: torch.Tensor, expert_ids: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
        """`experts_implementation="eager"`: the reference loop (the decorator hands the other names to
        `by_matmuls`)."""
        return self.loop_over_experts(x, expert_ids, weights)

    def by_matmuls(self, function, x: torch.Tensor, expert_ids: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
        """transformers' experts `function` ("grouped_mm" or "batched_mm"), with three Inkling2 steps around it:
        - BF16 weights that need no gradient on CUDA: the fused kernel instead, whichever GEMM name is set (it reads
          each active expert once and fuses the activation: faster than the grouped GEMMs at every size measured,
          decode steps to 8k-token prefills, docs/benchmarks.md; generate() switches "grouped_mm" to "batched_mm"
          while decoding on GPUs and keeps it);
        - long prefills in chunks of tokens whose sorted activations stay under 2^31 elements;
        - split across ranks: routes to other ranks' experts become transformers' sentinel (id `num_experts`,
          weight 0) and the function reads this rank's block of the DTensor weights."""
        if self.takes_kernel(x, weights):
            return self.run_kernel(x, expert_ids, weights)
        tokens, top_k = expert_ids.shape
        chunk = max(1, MAX_GROUPED_ELEMENTS // (top_k * 2 * max(self.hidden_size, self.intermediate_size)))
        if tokens > chunk:
            parts = (self.by_matmuls(function, *(t[start : start + chunk] for t in (x, expert_ids, weights))) for start in range(0, tokens, chunk))
            return torch.cat(list(parts))
        if not self._is_expert_parallel:
            return function(self, x, expert_ids, weights)
        ids = self.local_expert_ids(expert_ids)
        elsewhere = (ids < 0) | (ids >= self.num_experts)
        with _use_local_dtensor_params(self):
            return function(self, x, ids.masked_fill(elsewhere, self.num_experts), weights.masked_fill(elsewhere, 0.0))

    def takes_kernel(self, x: torch.Tensor, weights: torch.Tensor) -> bool:
        """BF16 weights only: the kernel has no fp32 path."""
        return self.gate_up_proj.dtype == torch.bfloat16 and self.uses_kernel(x, weights)

    def kernel_weights(self) -> dict:
        return dict(w13=local_tensor(self.gate_up_proj), w2=local_tensor(self.down_proj), fmt="bf16")


EXPERT_STORAGES.register("bf16", Inkling2Experts)
