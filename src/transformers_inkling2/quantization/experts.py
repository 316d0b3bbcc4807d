"""Routed experts whose weights stay packed in the checkpoint's NVFP4 or MXFP8 layout (`formats` holds the codecs).

Built by the model for the layers whose storage `from_pretrained` read from the tensor headers
(`checkpoints.attach_expert_quantization`, through `modeling.interfaces.EXPERT_STORAGES`). On CUDA they run through
the `inkling2_moe` hub kernel (fused dequantization); elsewhere, and with `experts_implementation="eager"`, each
active expert is dequantized on the fly (and kept, in small modules) and computed like the BF16 reference.
"""

import torch
from torch import nn

from ..configuration_inkling2 import Inkling2TextConfig
from ..modeling.experts import Inkling2ExpertsBase
from ..modeling.tensors import local_tensor
from . import formats as qf

# NVFP4 outer-scale tensors a checkpoint may carry (suffix after `w13_weight_` / `w2_weight_`) and the argument of
# `formats.nvfp4_outer_multiplier` each one is: ModelOpt's multiplier, compressed-tensors' divisor, or
# amax (with an optional denominator, 448 * 6 by default).
NVFP4_OUTER_SCALES = {
    "scale_2": "weight_scale_2",
    "global_scale": "weight_global_scale",
    "amax": "amax",
    "outer_scale_denominator": "outer_scale_denominator",
}

# A module whose experts all fit this many bytes dequantized (fp32) keeps them once dequantized: Inkling-2-Nano's
# layers (4.7 MB each) do, Inkling-2-Small's (24 GB each) never do.
DEQUANTIZED_CACHE_BYTES = 64 * 2**20


class Inkling2QuantizedExperts(Inkling2ExpertsBase):
    """Routed experts whose weights stay packed: NVFP4 (E2M1 codes two per byte, E4M3 scales per 16 inputs, fp32
    outer scales per expert or per gate/up half) or MXFP8 (E4M3 values, E8M0 scales per 32 inputs).

    Buffers mirror the checkpoint's tensors (`gate_up_proj` <- `w13_weight`, `gate_up_proj_scale` <-
    `w13_weight_scale`, `gate_up_proj_<outer>` <- `w13_weight_<outer>` for the NVFP4 outer-scale tensors the
    checkpoint carries: `scale_2`, `global_scale`, `amax`, ...), so that loading is a renaming and
    saving writes the same layout back. They are frozen: quantized experts are not trained.
    """

    def __init__(self, config: Inkling2TextConfig, fmt: str, outer_scales: tuple[str, ...] = (), per_half: bool = False):
        super().__init__(config)
        if fmt not in ("nvfp4", "mxfp8"):
            raise ValueError(f"Unknown quantized expert format {fmt!r}: expected 'nvfp4' or 'mxfp8'.")
        self.format, self.outer_scale_names, self.per_half = fmt, tuple(outer_scales), per_half
        experts, inner, hidden = self.num_experts, self.intermediate_size, self.hidden_size
        for name, rows, columns, halves in (("gate_up_proj", 2 * inner, hidden, 2), ("down_proj", hidden, inner, 1)):
            if fmt == "nvfp4":
                self._frozen(name, (experts, rows, columns // 2), torch.uint8)
                self._frozen(f"{name}_scale", (experts, rows, columns // qf.NVFP4_BLOCK_SIZE), torch.float8_e4m3fn)
                outer_shape = (experts, 2) if per_half and halves == 2 else (experts,)
                for outer in self.outer_scale_names:
                    self._frozen(f"{name}_{outer}", outer_shape, torch.float32)
            else:
                self._frozen(name, (experts, rows, columns), torch.float8_e4m3fn)
                self._frozen(f"{name}_scale", (experts, rows, columns // qf.MXFP8_BLOCK_SIZE), torch.uint8)

    def _frozen(self, name: str, shape: tuple[int, ...], dtype: torch.dtype) -> None:
        self.register_buffer(name, torch.zeros(shape, dtype=dtype))

    def __setattr__(self, name, value):
        # transformers' loader hands a tensor-parallel (DTensor) block back as an `nn.Parameter`: keep it a buffer
        if isinstance(value, nn.Parameter) and name in self.__dict__.get("_buffers", {}):
            loaded = getattr(value, "_is_hf_initialized", False)
            value = value.detach()
            value._is_hf_initialized = loaded
        super().__setattr__(name, value)

    def _apply(self, fn, recurse=True):
        """`.to()`, `.cuda()`, `.bfloat16()` move the packed tensors but never cast them: their dtype is their format
        (a cast would turn E4M3 bytes into numbers and round the fp32 outer scales). `to_empty()` off the meta device
        gets uninitialized buffers, as anywhere else (a meta tensor has no values to move)."""
        for name, buffer in self._buffers.items():
            device = fn(buffer.new_empty(0)).device
            self._buffers[name] = torch.empty_like(buffer, device=device) if buffer.is_meta else buffer.to(device)
        return self

    def outer_multiplier(self, name: str, validate: bool = True) -> torch.Tensor:
        """fp32 multiplier per expert ([E] or [E, 2]) from whichever outer-scale convention the checkpoint uses.
        `validate=False` leaves out the value checks, which synchronize with the host (done at load)."""
        tensors = {outer: local_tensor(getattr(self, f"{name}_{outer}")) for outer in self.outer_scale_names}
        tensors = {NVFP4_OUTER_SCALES[outer]: t for outer, t in tensors.items()}
        return qf.nvfp4_outer_multiplier(**tensors, validate=validate)

    def expert_weights(self, expert: int):
        """One expert's weights, dequantized (`dequantized_expert`), from the module's cache when it keeps one: on the
        CPU reference path an NVFP4 expert of Inkling-2-Nano takes 0.6 ms to dequantize, for every token that uses
        it (about 8 ms of a 32-36 ms decode step; docs/benchmarks.md). The cache holds the experts of small modules
        (`DEQUANTIZED_CACHE_BYTES`) and starts afresh when a packed buffer is replaced or written in place (its
        pointer or version changes)."""
        if self.num_experts * 3 * self.hidden_size * self.intermediate_size * 4 > DEQUANTIZED_CACHE_BYTES:
            return self.dequantized_expert(expert)
        buffers = tuple(local_tensor(buffer) for buffer in self._buffers.values())
        fingerprint = tuple((buffer.data_ptr(), buffer._version) for buffer in buffers)
        cache = self.__dict__.get("_dequantized")
        if cache is None or cache[0] != fingerprint:
            cache = self.__dict__["_dequantized"] = (fingerprint, {})
        if expert not in cache[1]:
            cache[1][expert] = self.dequantized_expert(expert)
        return cache[1][expert]

    def dequantized_expert(self, expert: int):
        """Dequantizes one expert (only the experts a batch uses, one at a time: no dequantized model copy), without
        the value checks, which loading made once (`validate_quantized_experts`)."""
        weights = []
        for name in ("gate_up_proj", "down_proj"):
            packed = local_tensor(getattr(self, name))[expert : expert + 1]
            scale = local_tensor(getattr(self, f"{name}_scale"))[expert : expert + 1]
            outer = self.outer_multiplier(name, validate=False)[expert : expert + 1] if self.format == "nvfp4" else None
            weights.append(qf.dequantize_expert_weights(packed, scale, outer, quant_format=self.format,
                                                        dtype=torch.float32, validate=False)[0])  # fmt: skip
        return tuple(weights)

    def expert_mlp(self, x: torch.Tensor, expert: int) -> torch.Tensor:
        """When gradients flow through (LoRA on attention trains through frozen experts), the dequantized weights
        are recomputed in backward instead of being kept: training holds no dequantized copy of the experts beyond
        the small modules' cache (`expert_weights`)."""
        if torch.is_grad_enabled() and x.requires_grad:
            return torch.utils.checkpoint.checkpoint(super().expert_mlp, x, expert, use_reentrant=False)
        return super().expert_mlp(x, expert)

    def forward(self, x: torch.Tensor, expert_ids: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
        if self.takes_kernel(x, weights):
            return self.run_kernel(x, expert_ids, weights)
        return self.loop_over_experts(x, expert_ids, weights)

    def kernel_weights(self) -> dict:
        """The packed buffers as they are; the NVFP4 outer scales were checked at load (`validate_quantized_experts`),
        so no host sync here and decode steps can be captured."""
        nvfp4 = self.format == "nvfp4"
        return dict(
            w13=local_tensor(self.gate_up_proj),
            w2=local_tensor(self.down_proj),
            fmt=self.format,
            w13_scale=local_tensor(self.gate_up_proj_scale),
            w2_scale=local_tensor(self.down_proj_scale),
            w13_outer=self.outer_multiplier("gate_up_proj", validate=False) if nvfp4 else None,
            w2_outer=self.outer_multiplier("down_proj", validate=False) if nvfp4 else None,
        )

    def extra_repr(self) -> str:
        return f"format={self.format}, experts={self.num_experts}, outer_scales={self.outer_scale_names}"
