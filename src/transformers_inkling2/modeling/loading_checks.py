"""Checks that `from_pretrained` runs on what it loaded, so that a broken checkpoint fails loudly, naming the tensor,
instead of producing NaN logits or a mostly random model.

- `raise_on_unconverted_load`: most of the model's tensors missing while the checkpoint holds tensors under names we
  do not know means its names did not convert (a layout this package does not read); missing tensors alone are
  reported and initialized, as transformers does (a base-model checkpoint in a model with a head, a checkpoint
  without `lm_head.weight`, one that holds none of the model's tensors).
- `raise_on_non_float_tensors`: the safetensors headers say every tensor's dtype; a weight stored as integers would
  be cast to the model's dtype without a word (tensors the model does not load are left alone).
- `raise_on_non_finite_weights`: NaN or infinite values in any floating weight (a corrupt download or export).
"""

from __future__ import annotations

import functools
from pathlib import Path

import torch
from safetensors import safe_open

from .tensors import local_tensor

FLOAT_DTYPES = {"BF16", "F16", "F32", "F64"}
# routed experts may be stored packed (NVFP4 codes and scales, MXFP8): quantization/checkpoints.py checks their layout
PACKED_DTYPES = {"U8", "F8_E4M3", "F8_E8M0"}
PACKED_TENSORS = ".mlp.experts."


def tensor_headers(checkpoint: str, revision: str | None = None) -> tuple[tuple[str, str, tuple[int, ...]], ...]:
    """(name, dtype, shape) of every tensor of a local folder or Hub repo, from the safetensors headers only (a Hub
    repo's headers are read remotely, without downloading the weights). The speculator's `mtp*` files aside."""
    folder, headers = Path(checkpoint), []
    if not folder.is_dir():
        return hub_tensor_headers(checkpoint, revision)
    for file in sorted(folder.glob("*.safetensors")):
        if not file.name.startswith("mtp"):
            with safe_open(file, "pt") as handle:
                for name in handle.keys():
                    header = handle.get_slice(name)
                    headers.append((name, header.get_dtype(), tuple(header.get_shape())))
    return tuple(headers)


@functools.lru_cache(maxsize=8)
def hub_tensor_headers(repo_id: str, revision: str | None) -> tuple[tuple[str, str, tuple[int, ...]], ...]:
    """`tensor_headers` of a Hub repo, fetched once per process (several loading steps read them)."""
    from huggingface_hub import get_safetensors_metadata

    files = get_safetensors_metadata(repo_id, revision=revision).files_metadata.items()
    return tuple(
        (name, info.dtype, tuple(info.shape))
        for file, metadata in files
        if not file.startswith("mtp")
        for name, info in metadata.tensors.items()
    )


def listing(keys, limit: int = 10) -> str:
    keys = sorted(keys)
    return f"{len(keys)}: {', '.join(keys[:limit])}{' ...' if len(keys) > limit else ''}"


def raise_on_unconverted_load(model: torch.nn.Module, loading_info: dict) -> None:
    """An error when more than half of the model's tensors are missing and the checkpoint holds tensors under unknown
    names, at least a quarter as many (a layout may fuse a few, e.g. q/k/v): the model's weights are there under
    names that did not convert. Missing tensors without such names are the checkpoint simply lacking them."""
    missing, unexpected = loading_info.get("missing_keys") or set(), loading_info.get("unexpected_keys") or set()
    expected = len(model.state_dict())
    if len(missing) * 2 <= expected or len(unexpected) * 4 < len(missing):
        return
    raise ValueError(
        f"The checkpoint does not match {type(model).__name__}: {len(missing)} of its {expected} tensors are missing "
        f"({listing(missing)}); unexpected tensors ({listing(unexpected)}). Its names did not convert from a layout "
        "this package reads (the original `model.llm.*`, or ours): check that the checkpoint and the class belong "
        "together, or pass `allow_incomplete_checkpoint=True` to load it anyway with the missing tensors freshly "
        "initialized."
    )


def raise_on_non_float_tensors(model: torch.nn.Module, checkpoint, revision: str | None = None, unexpected=()) -> None:
    """Every stored tensor the model loads is floating point (routed experts may also be packed bytes); `unexpected`
    names the checkpoint's tensors it does not load."""
    if checkpoint is None:
        return
    try:
        headers = tensor_headers(str(checkpoint), revision)
    except OSError:  # a Hub id whose headers cannot be read here: the weights were read, nothing more to learn
        return
    for name, dtype, _ in headers:
        if name in unexpected:
            continue
        allowed = FLOAT_DTYPES | (PACKED_DTYPES if PACKED_TENSORS in name else set())
        if dtype not in allowed:
            raise ValueError(
                f"{name} is stored as {dtype}, but the model holds its weights as {model.dtype} (floating point): "
                "an integer tensor would be cast without a word. Re-export the checkpoint with floating-point weights."
            )


def raise_on_non_finite_weights(model: torch.nn.Module) -> None:
    """NaN or infinite values in any floating parameter or buffer, named. One reduction per tensor (min and max,
    which NaN propagates through) and one host synchronization per device; the culprit is looked for only then."""
    tensors = [
        (name, local_tensor(tensor))
        for name, tensor in (*model.named_parameters(), *model.named_buffers())
        if tensor.is_floating_point() and tensor.element_size() > 1 and tensor.numel() and tensor.device.type != "meta"
    ]
    finite_by_device: dict[torch.device, list[torch.Tensor]] = {}
    for _, tensor in tensors:
        low, high = torch.aminmax(tensor.detach())
        finite_by_device.setdefault(tensor.device, []).append(torch.isfinite(low) & torch.isfinite(high))
    if all(bool(torch.stack(flags).all()) for flags in finite_by_device.values()):
        return
    for name, tensor in tensors:
        bad = ~torch.isfinite(tensor.detach())
        if bad.any():
            raise ValueError(
                f"{name} holds {int(bad.sum())} NaN or infinite value(s) (first at index {bad.nonzero()[0].tolist()}): "
                "the checkpoint is corrupt. Download or export it again (or pass `check_finite_weights=False` to load "
                "it anyway)."
            )


__all__ = ["raise_on_non_finite_weights", "raise_on_non_float_tensors", "raise_on_unconverted_load", "tensor_headers"]
