"""Layer face for `kernels.kernelize` / `use_kernel_forward_from_hub`.

`Inkling2MoE.forward` replaces the forward of a model's routed-experts module. It keeps no state of its
own (the `kernels` loader forbids it) and reads these attributes of the module it is bound to:

| attribute | meaning | default |
|---|---|---|
| `quant_format` | `"bf16"`, `"mxfp8"` or `"nvfp4"` | `"bf16"` |
| `gate_up_proj` | `[E, 2I, H]` gate rows then up rows (`[E, 2I, H/2]` uint8 for nvfp4) | required |
| `down_proj` | `[E, H, I]` (`[E, H, I/2]` for nvfp4) | required |
| `gate_up_proj_scale`, `down_proj_scale` | block scales (mxfp8 uint8 E8M0 / 32 inputs; nvfp4 e4m3 / 16) | None |
| `gate_up_proj_outer`, `down_proj_outer` | nvfp4 fp32 outer multipliers `[E]`/`[E, 2]`, `[E]` | None |
| `gate_softcap`, `up_softcap` | SwiGLU softcaps | 4.0, 25.0 |
"""

import torch
from torch import nn

from .ops import moe_forward


class Inkling2MoE(nn.Module):
    """`forward(hidden_states [..., H], top_k_index [N, k], top_k_weights [N, k]) -> [..., H]`."""

    has_backward = False
    can_torch_compile = False

    def forward(self, hidden_states: torch.Tensor, top_k_index: torch.Tensor, top_k_weights: torch.Tensor):
        shape = hidden_states.shape
        out = moe_forward(
            hidden_states.reshape(-1, shape[-1]),
            top_k_index.reshape(-1, top_k_index.shape[-1]),
            top_k_weights.reshape(-1, top_k_weights.shape[-1]),
            self.gate_up_proj,
            self.down_proj,
            getattr(self, "quant_format", "bf16"),
            w13_scale=getattr(self, "gate_up_proj_scale", None),
            w2_scale=getattr(self, "down_proj_scale", None),
            w13_outer=getattr(self, "gate_up_proj_outer", None),
            w2_outer=getattr(self, "down_proj_outer", None),
            gate_cap=getattr(self, "gate_softcap", 4.0),
            up_cap=getattr(self, "up_softcap", 25.0),
        )
        return out.reshape(shape).to(hidden_states.dtype)


__all__ = ["Inkling2MoE"]
