"""Two questions the model asks of its tensors: which block of a split tensor this rank holds, and whether
gradients flow (the fast paths have no backward)."""

from __future__ import annotations

import torch

try:
    from torch.distributed.tensor import DTensor
except ImportError:  # pragma: no cover  (a torch build without distributed support)
    DTensor = None


def local_tensor(tensor: torch.Tensor) -> torch.Tensor:
    """This rank's block of a tensor a parallel plan split (a DTensor), or the tensor itself. Modules that read a
    per-head parameter or an expert tensor directly (not through a hooked `nn.Linear`) take their block so."""
    return tensor.to_local() if DTensor is not None and isinstance(tensor, DTensor) else tensor


def differentiable(*tensors: torch.Tensor) -> bool:
    """Whether gradients flow through these inputs (our Triton kernels have no backward)."""
    return torch.is_grad_enabled() and any(tensor.requires_grad for tensor in tensors)
