"""A decode step's attention from its raw query-side projections, where the step reaches the fused decode kernel.

Registered as the model's `"attention_step"` kernel (`modeling.interfaces.KERNELS`). The reference
(`Inkling2Attention.forward`) prepares the queries and relative states (per-head scale, L2 clip, a full layer's log
scale), multiplies the relative states into [B, H, Q, extent] relative logits, calls the attention backend and gates
its output with `sigmoid(gate)`: at a decode step four small launches (two reductions, a GEMM, a multiply) around
the decode kernel's two. `decode_kernel.decode_attention_step` does that work inside those two, with the
reference's roundings.

It takes over only calls that the backend the model picked would hand to the decode kernel anyway: one of this
package's backends that run it for steps (`DECODE_KERNEL_BACKENDS`, paged keys included), CUDA tensors without
gradients, at most `MAX_STEP_TOKENS` queries, shapes the kernel supports, and the clip and relative-logits modules
as this package defines them, without hooks. Everything else gets None, and the model runs the reference.

On by default: its GPU tests pass on an H200 and it makes the decode step faster there (docs/dev/benchmark-history.md,
"The fused decode steps"). `INKLING2_FUSED_ATTENTION_STEP=0` keeps the reference, e.g. to compare against it.
"""

from __future__ import annotations

import os

import torch
from torch import nn

from ...cache.common import MAX_STEP_TOKENS
from ...modeling.modeling_inkling2_text import Inkling2RelativeLogits, Inkling2ScaledL2Clip
from ...modeling.interfaces import has_forward_hooks
from ...modeling.tensors import differentiable, local_tensor
from .flex import (
    inkling2_auto_attention,
    inkling2_decode_attention,
    inkling2_flex_attention,
    inkling2_triton_attention,
)

ENV = "INKLING2_FUSED_ATTENTION_STEP"

# the backends that send a step of at most MAX_STEP_TOKENS CUDA queries to `decode_kernel` (see flex.py)
DECODE_KERNEL_BACKENDS = (
    inkling2_auto_attention,
    inkling2_triton_attention,
    inkling2_flex_attention,
    inkling2_decode_attention,
)


def enabled() -> bool:
    """Whether the fused step is on (the default; `INKLING2_FUSED_ATTENTION_STEP=0` switches it off)."""
    return os.environ.get(ENV, "1") != "0"


def kernel_runs_on(tensor: torch.Tensor) -> bool:
    """CUDA, or any tensor under Triton's interpreter (`TRITON_INTERPRET=1`: the kernels run on CPU tensors there,
    which is how the CPU tests check the model's steps through them)."""
    return tensor.is_cuda or os.environ.get("TRITON_INTERPRET") == "1"


def plain_module(module: nn.Module, kind: type) -> bool:
    """Whether `module` is exactly this package's `kind`, without hooks: what a kernel that reads its parameters in
    place of calling it computes the same as it."""
    return type(module) is kind and not has_forward_hooks(module)


def runs_fused(attention: nn.Module, backend, query_states: torch.Tensor, key: torch.Tensor) -> bool:
    """Whether `fused_attention_step` takes this call (see the module docstring); query_states [B, Q, H, D], key
    [B, Hkv, K, D] or page pools."""
    if not enabled() or backend not in DECODE_KERNEL_BACKENDS or not kernel_runs_on(query_states):
        return False
    clips, bank = (attention.q_l2_clip, attention.rel_l2_clip), attention.rel_logits_proj
    plain = all(plain_module(clip, Inkling2ScaledL2Clip) for clip in clips)
    if not plain or not plain_module(bank, Inkling2RelativeLogits):
        return False
    if query_states.shape[1] > MAX_STEP_TOKENS:
        return False
    if differentiable(query_states, key, *(clip.scale for clip in clips), bank.proj):
        return False
    from . import decode_kernel  # Triton, imported where a kernel runs

    return decode_kernel.supports(query_states.transpose(1, 2), key)


def fused_attention_step(
    attention: nn.Module,
    backend,
    query_states: torch.Tensor,
    relative_states: torch.Tensor,
    gate: torch.Tensor,
    log_scale: torch.Tensor | None,
    key: torch.Tensor,
    value: torch.Tensor,
    **inputs,
) -> torch.Tensor | None:
    """`Inkling2Attention`'s gated attention output [B, Q, H * D] from its raw projections (query_states, gate
    [B, Q, H * D], relative_states [B, Q, H * d_rel]), `log_scale` [B or 1, Q, 1, 1] fp32 (full layers) or None,
    key, value and the backend's other inputs (sinks, positions, padding, window, scaling, pages); None where the
    reference runs (see the module docstring)."""
    batch, length = query_states.shape[:2]
    queries = query_states.reshape(batch, length, -1, attention.head_dim)
    if not runs_fused(attention, backend, queries, key):
        return None
    from .decode_kernel import decode_attention_step  # Triton, imported where the kernel runs

    return decode_attention_step(
        queries,
        local_tensor(attention.q_l2_clip.scale),
        attention.q_l2_clip.threshold,
        relative_states.reshape(batch, length, -1, attention.config.d_rel),
        local_tensor(attention.rel_l2_clip.scale),
        attention.rel_l2_clip.threshold,
        attention.rel_logits_proj.proj.to(query_states.dtype),
        None if log_scale is None else log_scale.reshape(-1, length),
        gate,
        key,
        value,
        **inputs,
    )


__all__ = [
    "DECODE_KERNEL_BACKENDS",
    "ENV",
    "enabled",
    "fused_attention_step",
    "kernel_runs_on",
    "plain_module",
    "runs_fused",
]
