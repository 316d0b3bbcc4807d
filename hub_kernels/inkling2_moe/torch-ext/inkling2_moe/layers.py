"""Layer face for `kernels.kernelize` / `use_kernel_forward_from_hub`.

`Inkling2MoE.forward` replaces the forward of a model's routed-experts module. It keeps no state of its own (the
`kernels` loader forbids it) and asks the module it is bound to for its weights:

- `kernel_weights()`: a dict of `moe_forward`'s weight arguments, `w13`, `w2`, `fmt` and, for the quantized
  formats, `w13_scale`, `w2_scale` (and NVFP4's `w13_outer`, `w2_outer`);
- `gate_cap`, `up_cap`: the SwiGLU softcaps.

`top_k_index` numbers the experts as the module does; ids outside `[0, E)` are dropped, so under expert parallelism
the caller passes the ids shifted to this rank's experts.
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
            gate_cap=self.gate_cap,
            up_cap=self.up_cap,
            **self.kernel_weights(),
        )
        return out.reshape(shape).to(hidden_states.dtype)


__all__ = ["Inkling2MoE"]
