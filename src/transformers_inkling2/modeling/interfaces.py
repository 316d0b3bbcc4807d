"""The points where faster or optional code plugs into the reference model.

The model in this folder computes everything itself in plain PyTorch. Where a faster path or a loading step exists,
it asks one of these registries instead of importing that code: the dependencies point from the fast paths to the
model, never back. Entries are objects, or `"module:attribute"` names imported on first use, so that importing the
model loads none of them. `transformers_inkling2/__init__.py` fills the registries with the package's backends.

- `ATTENTION_BACKENDS`: `attn_implementation` name -> attention function (`modeling/attention.py` has the contract
  and the eager reference).
- `EXPERT_STORAGES`: how a layer stores its routed experts ("bf16", "nvfp4", "mxfp8") -> the experts module class.
- `KERNELS`: single functions the model hands work to where they apply (the fused prompt and step convolutions,
  the routed experts kernel, with or without its sum, the relative-logits layout the prefill kernel reads, a decode
  step's grouped input projections, its router, its attention from the raw query-side projections, a layer's step
  keys and values computed and cached in one launch, its attention-residual mixes with the norms after them, and
  its end, the experts' sum included).
- `LOADING_HOOKS`: steps of `from_pretrained` (expert storage read from the tensor headers, the bundled drafter,
  scale checks), each with its `stage`: "config" hooks complete the config before the model is built, "model"
  hooks see the loaded model and its loading info.
- `GENERATION_HOOKS`: what `generate()` adds to transformers' own ("generate": DSpark decoding; "compiled_call": the
  decode steps replayed as CUDA graphs).

And `has_forward_hooks`: the one question every fast path asks of a module before computing in its place.
"""

from __future__ import annotations

import importlib
from collections.abc import Iterator
from typing import Any

import torch


class Registry:
    """Named implementations of one kind, with optional traits (e.g. whether a backend takes keys in any order)."""

    def __init__(self, kind: str):
        self.kind = kind
        self._entries: dict[str, Any] = {}
        self._traits: dict[str, dict[str, Any]] = {}

    def register(self, name: str, implementation: Any, **traits: Any) -> None:
        """`implementation` is the object itself or `"module:attribute"`, imported when first asked for."""
        self._entries[name] = implementation
        self._traits[name] = traits

    def __contains__(self, name: str) -> bool:
        return name in self._entries

    def __iter__(self) -> Iterator[str]:
        return iter(self._entries)

    def names(self) -> list[str]:
        return list(self._entries)

    def traits(self, name: str) -> dict[str, Any]:
        return self._traits.get(name, {})

    def get(self, name: str) -> Any:
        if name not in self._entries:
            raise ValueError(f"Unknown Inkling2 {self.kind} {name!r}; available: {sorted(self._entries)}.")
        entry = self._entries[name]
        if isinstance(entry, str):
            module, _, attribute = entry.partition(":")
            # a module's own tensors (lookup tables) stay on the CPU even when first imported while a model is built
            # under `torch.device("meta")`
            with torch.device("cpu"):
                entry = self._entries[name] = getattr(importlib.import_module(module), attribute)
        return entry

    def optional(self, name: str) -> Any:
        """The entry, or None when nothing is registered under `name`."""
        return self.get(name) if name in self._entries else None

    def stage(self, stage: str) -> Iterator[Any]:
        """The entries whose `stage` trait is `stage`, in registration order."""
        return (self.get(name) for name in self.names() if self.traits(name).get("stage") == stage)

    def load(self) -> None:
        """Imports every entry given by name: models do this when built, so that no import happens inside a graph
        that `torch.compile` traces or a CUDA graph captures."""
        for name in self.names():
            self.get(name)


def has_forward_hooks(module: torch.nn.Module) -> bool:
    """Whether someone hooked the module's forward: a fast path that computes what the module would, without calling
    it, must leave such a module to its own forward (its hooks expect to run, and to see its output)."""
    return bool(module._forward_hooks or module._forward_pre_hooks)


ATTENTION_BACKENDS = Registry("attention implementation")
EXPERT_STORAGES = Registry("expert storage")
KERNELS = Registry("kernel")
LOADING_HOOKS = Registry("loading hook")
GENERATION_HOOKS = Registry("generation hook")

__all__ = [
    "ATTENTION_BACKENDS",
    "EXPERT_STORAGES",
    "GENERATION_HOOKS",
    "KERNELS",
    "LOADING_HOOKS",
    "Registry",
    "has_forward_hooks",
]
