"""Four questions the model asks of its tensors: which block of a split tensor this rank holds, whether gradients
flow (the fast paths have no backward), whether a kernel may read it as it lies, and whether an fp32 operation needs
it converted first."""

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


# Set (True) on an `nn.Linear` whose forward a parallel plan replaced by `F.linear(x, local_tensor(weight))`: a kernel
# may take the weight's local block as the module's whole weight (parallel/tensor_parallel.py, backends/projections.py).
LOCAL_BLOCK_LINEAR = "_inkling2_local_block_linear"


def differentiable(*tensors: torch.Tensor) -> bool:
    """Whether gradients flow through these inputs (our Triton kernels have no backward)."""
    return torch.is_grad_enabled() and any(tensor.requires_grad for tensor in tensors)


def plain_contiguous(tensor: torch.Tensor) -> bool:
    """Whether a kernel may read the tensor as one contiguous buffer: an ordinary tensor or parameter (not a parallel
    plan's DTensor, nor another subclass), contiguous."""
    return type(tensor) in (torch.Tensor, torch.nn.Parameter) and tensor.is_contiguous()


# dtypes that type promotion upcasts exactly, inside the kernel, when the other operand is fp32
UPCAST_BY_PROMOTION = (torch.bfloat16, torch.float16, torch.float32)


def fp32_operand(tensor: torch.Tensor) -> torch.Tensor:
    """`tensor` as the operand of an elementwise operation whose other operand is fp32: as it is when type promotion
    already computes the operation in fp32 on its exact upcast (a half-precision tensor, the same values as
    `.float()` gives, without that conversion's launch and temporary), else `.float()` (a float64 tensor, which
    promotion would keep in float64)."""
    return tensor if tensor.dtype in UPCAST_BY_PROMOTION else tensor.float()


def shared_fp32(tensor: torch.Tensor) -> torch.Tensor:
    """`tensor` for several readers that each take it in fp32 (`.float()`): converted once here, which makes their
    conversions no-ops; but as it is where gradients flow into it, so that the readers' gradients still sum in its
    own dtype (each through its own conversion), as they did before this sharing."""
    return tensor if differentiable(tensor) else tensor.float()
