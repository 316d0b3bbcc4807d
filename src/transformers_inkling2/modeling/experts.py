"""The routed experts of an Inkling2 MoE layer: the BF16 reference, and the base every expert storage shares.

Every expert computes `down(softcap4(g) * sigmoid(g) * softcap25(u))` with `[g; u] = gate_up(x)`, and a token's
output is the routing-weighted sum of its experts' outputs, accumulated in fp32.

- `Inkling2Experts`: BF16 (or fp32) weights `gate_up_proj` [E, 2I, H] (gate rows, then up rows) and `down_proj`
  [E, H, I]. `experts_implementation="grouped_mm"` (the default) runs one `torch._grouped_mm` per projection over
  the tokens sorted by expert (training, CPU, fp32) or, for BF16 inference on CUDA, the `inkling2_moe` hub kernel;
  `"eager"` is the reference loop over the experts that received tokens.
- Packed NVFP4 / MXFP8 experts (`quantization/experts.py`) share `Inkling2ExpertsBase` and register their storage
  in `interfaces.EXPERT_STORAGES`; the fused kernel arrives as `interfaces.KERNELS["routed_experts"]`.

Split across ranks by a parallel plan (`parallel/tensor_parallel.py`, `expert_parallel` set), a module holds a
contiguous block of `num_experts` experts starting at global id `first_expert`, skips the routes whose id (minus
`first_expert`) falls outside its block and returns an fp32 output, which the plan sums over the ranks.
"""


import torch
import torch.nn.functional as F
from torch import nn

from ..configuration_inkling2 import Inkling2TextConfig
from .interfaces import EXPERT_STORAGES, KERNELS
from .tensors import differentiable, local_tensor

EXPERT_IMPLEMENTATIONS = ("eager", "grouped_mm", "batched_mm")
MAX_GROUPED_ELEMENTS = 2**31  # torch._grouped_mm indexes its operands with 32-bit integers


def softcap(x: torch.Tensor, cap: float) -> torch.Tensor:
    """Smoothly bounds `x` to (-cap, cap)."""
    return cap * torch.tanh(x / cap)


def softcapped_swiglu(gate: torch.Tensor, up: torch.Tensor, gate_cap: float, up_cap: float) -> torch.Tensor:
    """`softcap(g) * sigmoid(g) * softcap(u)`: the sigmoid sees the raw gate; in fp32."""
    gate, up = gate.float(), up.float()
    return softcap(gate, gate_cap) * torch.sigmoid(gate) * softcap(up, up_cap)


def experts_implementation(config: Inkling2TextConfig) -> str:
    """"eager" (the reference loop), "grouped_mm" (the default: one grouped GEMM per projection over the tokens
    sorted by expert) or "batched_mm" (each route's expert weights gathered and multiplied in one batched GEMM: more
    memory, fewer launches for a few tokens). Where the fused kernel applies (inference on CUDA) it serves both GEMM
    names, so that generate(), which switches "grouped_mm" to "batched_mm" while decoding on GPUs, keeps it."""
    name = getattr(config, "_experts_implementation", None) or "grouped_mm"
    if name not in EXPERT_IMPLEMENTATIONS:
        raise ValueError(
            f"Inkling2 experts run with `experts_implementation` in {EXPERT_IMPLEMENTATIONS}, got {name!r}."
        )
    return name


class Inkling2ExpertsBase(nn.Module):
    def __init__(self, config: Inkling2TextConfig):
        super().__init__()
        self.config = config
        self.num_experts = config.n_routed_experts  # held by this module: all of them unless split across ranks
        self.first_expert = 0  # global id of the module's expert 0
        self.expert_parallel = False  # split across ranks: other ranks' routes skipped, fp32 outputs for the sum
        self.hidden_size, self.intermediate_size = config.hidden_size, config.moe_intermediate_size
        self.gate_cap, self.up_cap = config.mlp_gate_softcap, config.mlp_up_softcap

    def local_expert_ids(self, expert_ids: torch.Tensor) -> torch.Tensor:
        """Global expert ids -> ids in this module's block; routes to other ranks' experts fall outside
        `[0, num_experts)`, which every path skips."""
        return expert_ids - self.first_expert if self.first_expert else expert_ids

    def finish(self, output: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        """The fp32 accumulation in the activations' dtype, or kept fp32 when it is to be summed over ranks."""
        return output.float() if self.expert_parallel else output.to(dtype)

    def expert_weights(self, expert: int) -> tuple[torch.Tensor, torch.Tensor]:
        """(gate_up [2I, H], down [H, I]) of one expert in a dtype that matmuls with the activations."""
        raise NotImplementedError

    def expert_mlp(self, x: torch.Tensor, expert: int) -> torch.Tensor:
        """One expert on its tokens: `down(softcapped_swiglu(gate_up(x)))`."""
        gate_up, down = self.expert_weights(expert)
        gate, up = F.linear(x, gate_up.to(x.dtype)).chunk(2, dim=-1)
        hidden = softcapped_swiglu(gate, up, self.gate_cap, self.up_cap).to(x.dtype)
        return F.linear(hidden, down.to(x.dtype))

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
        return self.finish(
            KERNELS.get("routed_experts")(
                x.to(torch.bfloat16),
                self.local_expert_ids(expert_ids),  # the kernel drops ids outside [0, experts): other ranks' routes
                weights.float(),
                gate_cap=self.gate_cap,
                up_cap=self.up_cap,
                **self.kernel_weights(),
            ),
            x.dtype,
        )

    def uses_kernel(self, x: torch.Tensor, weights: torch.Tensor) -> bool:
        """Inference on CUDA with the default implementation: the kernel has no backward, so with gradients flowing
        (into the activations, the routing weights or trainable expert weights) the differentiable paths run."""
        needs_grad = differentiable(x, weights, *self.parameters())
        by_matmuls = experts_implementation(self.config) != "eager"
        return x.is_cuda and not needs_grad and by_matmuls and "routed_experts" in KERNELS


class Inkling2Experts(Inkling2ExpertsBase):
    """Routed experts as stacked BF16 weights."""

    def __init__(self, config: Inkling2TextConfig):
        super().__init__(config)
        self.gate_up_proj = nn.Parameter(torch.empty(self.num_experts, 2 * self.intermediate_size, self.hidden_size))
        self.down_proj = nn.Parameter(torch.empty(self.num_experts, self.hidden_size, self.intermediate_size))

    def expert_weights(self, expert: int):
        return local_tensor(self.gate_up_proj)[expert], local_tensor(self.down_proj)[expert]

    def forward(self, x: torch.Tensor, expert_ids: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
        if experts_implementation(self.config) == "eager":
            return self.loop_over_experts(x, expert_ids, weights)
        # BF16 weights that need no gradient (inference, or LoRA elsewhere): the fused kernel reads each active expert
        # once and fuses the activation: faster than the grouped GEMMs at every size measured, decode steps to
        # 8k-token prefills (docs/benchmarks.md)
        if self.gate_up_proj.dtype == torch.bfloat16 and self.uses_kernel(x, weights):
            return self.run_kernel(x, expert_ids, weights)
        if experts_implementation(self.config) == "batched_mm":
            return self.batched(x, expert_ids, weights)
        return self.grouped(x, expert_ids, weights)

    def batched(self, x: torch.Tensor, expert_ids: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
        """Each (token, slot) route gathers its expert's weights and both projections run as batched GEMMs over the
        routes; no host sync. Routes to other ranks' experts compute on a stand-in expert and are zeroed."""
        tokens, top_k = expert_ids.shape
        ids = self.local_expert_ids(expert_ids).reshape(-1)
        held = (ids >= 0) & (ids < self.num_experts)
        ids = ids.clamp(0, self.num_experts - 1)
        routes = x.repeat_interleave(top_k, dim=0)[:, :, None]
        gate_up_proj, down_proj = local_tensor(self.gate_up_proj), local_tensor(self.down_proj)
        gate, up = torch.bmm(gate_up_proj[ids], routes)[..., 0].chunk(2, dim=-1)
        hidden = softcapped_swiglu(gate, up, self.gate_cap, self.up_cap).to(x.dtype)
        per_route = torch.bmm(down_proj[ids], hidden[:, :, None])[..., 0].float()
        per_route = per_route * (weights.reshape(-1) * held)[:, None]
        # summed slot by slot in a fixed order: deterministic
        return self.finish(per_route.view(tokens, top_k, -1).sum(1), x.dtype)

    def kernel_weights(self) -> dict:
        return dict(w13=local_tensor(self.gate_up_proj), w2=local_tensor(self.down_proj), fmt="bf16")

    def grouped(self, x: torch.Tensor, expert_ids: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
        """Sorts the (token, slot) pairs by expert and runs each projection as one grouped GEMM; no host sync.
        Long prefills go in chunks of tokens whose sorted activations stay under 2^31 elements. Routes to other
        ranks' experts sort last, past the final group: the GEMMs leave those rows unwritten (in backward too), so
        they are zeroed on the way in and out."""
        tokens, top_k = expert_ids.shape
        chunk = max(1, MAX_GROUPED_ELEMENTS // (top_k * 2 * max(self.hidden_size, self.intermediate_size)))
        if tokens > chunk:
            parts = [self.grouped(*(t[start : start + chunk] for t in (x, expert_ids, weights))) for start in range(0, tokens, chunk)]
            return torch.cat(parts)
        ids = self.local_expert_ids(expert_ids).reshape(-1)
        elsewhere = None
        if self.expert_parallel:
            elsewhere = (ids < 0) | (ids >= self.num_experts)
            ids = ids.masked_fill(elsewhere, self.num_experts)
        order = ids.argsort(stable=True)
        # where each expert's rows end; searchsorted rather than bincount, which reads its maximum back to the host
        experts = torch.arange(self.num_experts, device=ids.device)
        ends = torch.searchsorted(ids[order], experts, right=True).to(torch.int32)
        sorted_x = x[order // top_k]
        if elsewhere is not None:
            elsewhere = elsewhere[order, None]
            sorted_x = sorted_x.masked_fill(elsewhere, 0.0)  # and their unwritten input gradients in backward
        gate_up_proj, down_proj = local_tensor(self.gate_up_proj), local_tensor(self.down_proj)
        gate, up = torch._grouped_mm(sorted_x, gate_up_proj.transpose(1, 2), offs=ends).chunk(2, dim=-1)
        hidden = softcapped_swiglu(gate, up, self.gate_cap, self.up_cap).to(x.dtype)
        sorted_out = torch._grouped_mm(hidden, down_proj.transpose(1, 2), offs=ends).float()
        if elsewhere is not None:
            sorted_out = sorted_out.masked_fill(elsewhere, 0.0)
        per_slot = torch.empty(tokens * top_k, x.shape[1], dtype=torch.float32, device=x.device)
        per_slot[order] = sorted_out * weights.reshape(-1)[order, None]
        # summed slot by slot in a fixed order: deterministic
        return self.finish(per_slot.view(tokens, top_k, -1).sum(1), x.dtype)


EXPERT_STORAGES.register("bf16", Inkling2Experts)
