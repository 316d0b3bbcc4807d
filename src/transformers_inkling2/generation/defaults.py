"""What a plain `generate()` chooses when the caller leaves it open: the fast path on CUDA.

transformers' own default is a growing cache and eager decode steps, which on a GPU leaves the model waiting for the
host (an eager step of the full model launches well over a thousand kernels). So on CUDA, a call that names no
`cache_implementation` and passes no cache of its own decodes over the static cache, whose steps generate() replays
as CUDA graphs (`decode_graphs.py`); the attention backend is already the fastest for each call by default
(`"inkling2_auto"`). `torch.compile` inside the graphs stays opt-in (`compile_config=CompileConfig()`), see
docs/attention.md for the measurement behind that rule.

A call that cannot take the fast path runs transformers' reference path, and the log says why, once per reason:
a model that is not on CUDA, `output_attentions` (only the eager reference materializes attention probabilities),
beam search and assisted decoding (they roll the cache back further than the static cache's margin, or reorder it
every step). Explicit choices (`cache_implementation=...`, `past_key_values=...`, `use_cache=False`) are followed as
they are, without a log line.
"""

from __future__ import annotations

from transformers.utils import logging

logger = logging.get_logger(__name__)

FAST_CACHE = "static"
_EXPLICIT = ("cache_implementation", "past_key_values")


def _setting(name: str, generation_config, kwargs: dict):
    """The value generate() will use for `name`: the call's keyword, else the generation config's."""
    if kwargs.get(name) is not None:
        return kwargs[name]
    return getattr(generation_config, name, None)


def reference_path_reason(model, generation_config, kwargs: dict) -> str | None:
    """Why this call cannot decode over the static cache with graph-replayed steps, or None when it can."""
    if model.device.type != "cuda":
        return f"the model is on {model.device.type}, and CUDA graphs need CUDA"
    if _setting("output_attentions", generation_config, kwargs):
        return "`output_attentions=True` needs the eager reference, the one backend that materializes them"
    if (_setting("num_beams", generation_config, kwargs) or 1) > 1:
        return "beam search reorders the cache at every step"
    if any(kwargs.get(name) is not None for name in ("assistant_model", "prompt_lookup_num_tokens")):
        return "assisted decoding rolls the cache back further than the static cache keeps"
    return None


def choose_fast_path(model, settings, kwargs: dict) -> dict:
    """`kwargs` with `cache_implementation="static"` added when the caller left the cache open and the call can take
    the fast path; otherwise unchanged (with one log line per reason when the fast path does not apply). `settings`:
    the generation config the call uses (its own, else the model's)."""
    if any(_setting(name, settings, kwargs) is not None for name in _EXPLICIT):
        return kwargs
    if _setting("use_cache", settings, kwargs) is False:
        return kwargs
    reason = reference_path_reason(model, settings, kwargs)
    if reason is not None:
        logger.warning_once(
            f"Inkling2 generate() takes the reference path (growing cache, eager decode steps): {reason}."
        )
        return kwargs
    return {**kwargs, "cache_implementation": FAST_CACHE}


__all__ = ["choose_fast_path", "reference_path_reason"]
