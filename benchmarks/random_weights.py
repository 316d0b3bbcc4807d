"""Random weights for benchmark models, without a dequantized copy: float tensors ~ N(0, 0.02) (norm weights and
clip scales around 1), packed NVFP4 codes uniform, E4M3 block scales and E8M0 exponents in a range that keeps the
weights around 0.02. Used by `parallel.py` (a checkpoint written once) and `full_scale.py` (built on the GPUs)."""

from __future__ import annotations

import re
import zlib

import torch

NORM_LIKE = re.compile(r"(l2_clip\.scale|norm[^.]*\.weight)$")


def seeded_generator(name: str, device, salt: int = 0) -> torch.Generator:
    """The same numbers for a tensor name on every process (replicated tensors must agree across ranks)."""
    return torch.Generator(device=device).manual_seed(zlib.crc32(name.encode()) * 16 + salt)


def fill_random_(tensor: torch.Tensor, name: str, expert_format: str | None, generator: torch.Generator) -> None:
    """Fills a plain (local) tensor in place. `expert_format` is "nvfp4" / "mxfp8" for the buffers of packed
    experts (`gate_up_proj`, `..._scale`, `..._scale_2` and the down-projection ones), None otherwise."""
    leaf = name.rpartition(".")[2]

    def draw(low: int, high: int) -> None:  # random bytes in [low, high), expert by expert (bounded memory)
        for expert in tensor.view(torch.uint8):
            expert.copy_(torch.randint(low, high, expert.shape, generator=generator, device=tensor.device,
                                       dtype=torch.uint8))  # fmt: skip

    with torch.no_grad():
        if expert_format == "nvfp4":
            if leaf.endswith("_scale_2"):
                tensor.fill_(0.01)
            elif leaf.endswith("_scale"):
                draw(0x30, 0x40)  # E4M3 0.5 .. 1.9
            else:
                draw(0, 256)  # two E2M1 codes per byte, every byte valid
        elif expert_format == "mxfp8":
            if leaf.endswith("_scale"):
                draw(121, 122)  # E8M0 2^-6
            else:
                draw(0, 0x48)  # E4M3 magnitudes up to 4, then a random sign
                signs = torch.randint(0, 2, tensor.shape, generator=generator, device=tensor.device, dtype=torch.uint8)
                tensor.view(torch.uint8).bitwise_or_(signs << 7)
        elif tensor.is_floating_point():
            values = torch.randn(tensor.shape, generator=generator, device=tensor.device) * 0.02
            if NORM_LIKE.search(name):
                values += 1.0
            tensor.copy_(values.to(tensor.dtype))


def expert_format_of(module) -> str | None:
    from transformers_inkling2.quantization.experts import Inkling2QuantizedExperts

    return module.format if isinstance(module, Inkling2QuantizedExperts) else None
