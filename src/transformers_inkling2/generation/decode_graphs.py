"""Inkling2 decode steps replayed as CUDA graphs.

An eager decode step of the full model launches well over a thousand small kernels; on a GPU the host cannot
issue them as fast as the GPU runs them. Over an `Inkling2StaticCache` every shape of a step is fixed, so the
step is captured once per shape and then replayed with one launch:

- the tensors of a call (token ids, position ids, the new tokens' mask columns and their stream positions as
  `cache_position`) are copied into the graph's own input buffers, the graph replays, and the cache's host-side
  length moves on (`Inkling2StaticCache.advance`);
- full-attention layers attend over the first `bucket` slots of their cache, the smallest power of two
  (>= `MIN_BUCKET`) that holds the cached and new tokens: one graph per bucket, so a step reads at most about
  twice the keys it needs, and a 262k-token cache does not cost a 262k-key read at position 100;
- graphs live with the cache they read (`cache.graphs`); generate() reuses a static cache of the same size
  between calls, and with it the graphs.

Steps the graphs do not cover run eagerly, with identical results: prompts (more than `cache.max_queries` new
tokens), images, CPU tensors, and steps that cannot be captured (a warning says why). `use_cuda_graphs=False` runs
every step through the same static buffers eagerly (the CPU tests use it to check the bookkeeping against the plain
forward). With a `compile_config` the captured steps run the `torch.compile`d model (`compiled_step`).

A replay's outputs live in the graph's memory: they are valid until the next call.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass

import torch
from transformers.utils import logging

from ..backends import dependent_launch
from ..cache.static import Inkling2StaticCache

logger = logging.get_logger(__name__)

MIN_BUCKET = 1024
# inductor launches the step's data-independent kernels as one: about three launches fewer per layer and 2-4% faster
# batch-1 steps on an H200 (docs/dev/benchmark-history.md, "Inductor's combo kernels, on one H200")
COMBO_KERNELS = {"combo_kernels": True}
WARMUP_CALLS = 2  # before a capture: cuBLAS workspaces, Triton autotuning and compiled FlexAttention settle here


def attend_bucket(needed: int, capacity: int, minimum: int = MIN_BUCKET) -> int:
    """The full layers' attention span for a step that ends at `needed` tokens."""
    return min(capacity, max(minimum, 1 << max(0, needed - 1).bit_length()))


@contextmanager
def replaying(cache: Inkling2StaticCache, bucket: int) -> Iterator[None]:
    """A forward over the static buffers with the full layers attending over `bucket` slots; it leaves the
    host-side length alone (the caller advances it)."""
    cache.attend_length = bucket
    try:
        yield
    finally:
        cache.attend_length = None


@dataclass
class CapturedStep:
    inputs: dict[str, torch.Tensor]
    options: dict
    bucket: int
    graph: torch.cuda.CUDAGraph | None
    output: object = None


def compiled_step(model, compile_config):
    """`torch.compile` of the model for steps that our own CUDA graphs then capture (fused elementwise kernels, fewer
    launches): transformers' CompileConfig defaults to mode "reduce-overhead", which would capture graphs itself, so
    the cudagraph modes become their plain equivalents. Shapes are static per captured step (`dynamic=False`).
    Inductor's kernels launch with PDL as ours do (`backends.dependent_launch`), and its data-independent kernels as
    combo kernels (`COMBO_KERNELS`), unless the config's options say otherwise."""
    settings = compile_config.to_dict()
    mode = {"reduce-overhead": None, "max-autotune": "max-autotune-no-cudagraphs"}.get(
        settings["mode"], settings["mode"]
    )
    options = dict(settings["options"]) if settings.get("options") else None
    if settings["backend"] == "inductor":
        # torch.compile takes a mode or options: the mode as its options, ours, and the config's options over both
        from torch._inductor import list_mode_options

        base = options if options is not None else dict(list_mode_options(mode)) if mode else {}
        options = {**dependent_launch.inductor_options(), **COMBO_KERNELS, **base}
    tuning = {"mode": mode} if options is None else {"options": options}
    return torch.compile(model, fullgraph=settings["fullgraph"], dynamic=False, backend=settings["backend"], **tuning)


class Inkling2DecodeGraphs:
    """Callable like the model (`runner(**model_inputs)`); see the module docstring. With a `compile_config`
    (transformers' `CompileConfig`, e.g. `generate(..., compile_config=CompileConfig())`), the captured steps run
    the `torch.compile`d model (`compiled_step`)."""

    def __init__(self, model, use_cuda_graphs: bool = True, min_bucket: int = MIN_BUCKET, compile_config=None):
        self.model, self.use_cuda_graphs, self.min_bucket = model, use_cuda_graphs, min_bucket
        self.compile_config = compile_config
        self.step_model = model if compile_config is None else compiled_step(model, compile_config)

    def __call__(self, **inputs):
        cache = inputs.get("past_key_values")
        step_inputs = self.static_inputs(cache, inputs)
        if step_inputs is None:
            return self.model(**inputs)
        tensors, options, new_tokens = step_inputs
        bucket = attend_bucket(cache.get_seq_length() + new_tokens, cache.max_cache_len, self.min_bucket)
        shapes = tuple((name, t.shape, t.dtype) for name, t in tensors.items())
        key = (bucket, shapes, tuple(options.items()), self.use_cuda_graphs, repr(self.compile_config))
        step = cache.graphs.get(key)
        if step is None:
            step = cache.graphs[key] = self.capture(cache, tensors, options, bucket)
        else:
            for name, tensor in tensors.items():
                step.inputs[name].copy_(tensor)
        if step.graph is not None:
            step.graph.replay()
        else:
            with replaying(cache, bucket):
                step.output = self.step_model(past_key_values=cache, **step.inputs, **step.options)
        cache.advance(new_tokens)
        return step.output

    def static_inputs(self, cache, inputs: dict):
        """(tensors, other options, new tokens) of a step the graphs cover, else None."""
        if not isinstance(cache, Inkling2StaticCache) or inputs.get("pixel_values") is not None:
            return None
        tokens = inputs.get("input_ids") if inputs.get("inputs_embeds") is None else inputs["inputs_embeds"]
        if tokens is None or tokens.device.type != "cuda" and self.use_cuda_graphs:
            return None
        new_tokens = tokens.shape[1]
        if new_tokens > cache.max_queries or cache.get_seq_length() + new_tokens > cache.max_cache_len:
            return None
        tensors, options = {}, {}
        for name, value in inputs.items():
            if name == "past_key_values" or value is None:
                continue
            if isinstance(value, torch.Tensor):
                tensors[name] = value[:, -new_tokens:] if name == "attention_mask" else value
            elif isinstance(value, (bool, int, float, str)):
                options[name] = value
            else:
                return None  # not something a graph can take as an input
        if "cache_position" not in tensors:
            seen = cache.get_seq_length()
            tensors["cache_position"] = torch.arange(seen, seen + new_tokens, device=tokens.device)
        return tensors, options, new_tokens

    def capture(self, cache: Inkling2StaticCache, tensors: dict, options: dict, bucket: int) -> CapturedStep:
        """Buffers for the step's inputs (holding this call's values); on CUDA, warm-up calls and the capture. Every
        call writes the same cache slots with the same values, so the warm-up leaves the cache as the replay will."""
        step = CapturedStep({name: t.clone() for name, t in tensors.items()}, options, bucket, None)
        if not self.use_cuda_graphs:
            return step

        def forward():
            with replaying(cache, bucket):
                return self.step_model(past_key_values=cache, **step.inputs, **options)

        if cache.graph_pool is None:
            cache.graph_pool = torch.cuda.graph_pool_handle()
        # after a failed capture the pool may still be recording: later steps of this cache run eagerly
        captured = None if cache.capture_failed else capture_graph(forward, cache.graph_pool, "decode step")
        if captured is None:
            cache.capture_failed = True
            return step
        step.graph, step.output = captured
        return step


def capture_graph(run, pool, what: str):
    """(graph, output) of `run()` captured after warm-up calls on a side stream, or None (with a warning) when the
    calls cannot be captured; their callers then run eagerly."""
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        for _ in range(WARMUP_CALLS):
            run()
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    try:
        with torch.cuda.graph(graph, pool=pool):
            output = run()
    except RuntimeError as error:  # e.g. torch._grouped_mm on fp32 experts reads its offsets on the host
        logger.warning_once(
            f"Inkling2 could not capture its {what} in a CUDA graph ({str(error).splitlines()[0]}); it runs eagerly "
            "(same results, slower)."
        )
        return None
    return graph, output


__all__ = ["Inkling2DecodeGraphs", "attend_bucket", "capture_graph"]
