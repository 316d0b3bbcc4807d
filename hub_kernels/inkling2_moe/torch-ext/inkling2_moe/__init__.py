"""inkling2_moe: routed-expert kernels (routing, fused-dequant grouped GEMMs with a softcapped SwiGLU,
deterministic top-k combine) for MoE layers with BF16, MXFP8 or NVFP4 expert weights.

Triton on CUDA tensors, PyTorch references elsewhere. Triton is imported only when a kernel runs.
"""

from . import layers
from .ops import KernelConfig, moe_forward, pick_config, route, slot_output_parts
from .reference import (
    FORMATS,
    Routing,
    dequantize_reference,
    max_tiles,
    moe_forward_reference,
    route_reference,
    softcapped_swiglu_reference,
)

__version__ = "0.1.0"

__all__ = [
    "FORMATS",
    "KernelConfig",
    "Routing",
    "dequantize_reference",
    "layers",
    "max_tiles",
    "moe_forward",
    "moe_forward_reference",
    "pick_config",
    "route",
    "route_reference",
    "slot_output_parts",
    "softcapped_swiglu_reference",
]
