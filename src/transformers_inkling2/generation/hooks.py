"""What `generate()` adds to transformers' own for Inkling2 models, registered in
`modeling.interfaces.GENERATION_HOOKS` (the models call these hooks; they never import this folder):

- `"generate"` (`generate_with_dspark`): the fast path by default on CUDA (`defaults.py`); `dspark=True` decodes
  with the bundled DSpark drafter (`dspark.py`);
- `"compiled_call"` (`decode_graphs_call`): the static cache's decode steps replayed as CUDA graphs
  (`decode_graphs.py`), optionally through `torch.compile`.
"""

from __future__ import annotations

from .decode_graphs import Inkling2DecodeGraphs
from .defaults import choose_fast_path
from .dspark import DSparkOptions, dspark_decoding_method


def generate_with_dspark(
    model,
    generate,
    inputs=None,
    generation_config=None,
    *args,
    dspark: bool | None = None,
    draft_sample_method: str | None = None,
    dspark_confidence_threshold: float | None = None,
    **kwargs,
):
    """`generate()` as usual (`generate` is transformers' own, bound to the model), on the fast path by default on
    CUDA (`defaults.choose_fast_path`); `dspark=True` (or `dspark: true` in the generation config) decodes with the
    bundled DSpark drafter: same output as without it (token for token when greedy, the same distribution when
    sampling), several tokens per target pass. `draft_sample_method` ("probabilistic" or "greedy") and
    `dspark_confidence_threshold` tune the drafts; `return_dict_in_generate=True` adds acceptance statistics. See
    `docs/dspark.md`."""
    settings = generation_config if generation_config is not None else model.generation_config
    kwargs = choose_fast_path(model, settings, kwargs)
    if not (dspark if dspark is not None else getattr(settings, "dspark", False)):
        return generate(inputs, generation_config, *args, **kwargs)
    for conflicting in ("custom_generate", "assistant_model", "prompt_lookup_num_tokens"):
        if kwargs.get(conflicting) is not None:
            raise ValueError(f"`dspark=True` is its own decoding method; drop `{conflicting}`.")
    if draft_sample_method is None:
        draft_sample_method = getattr(settings, "draft_sample_method", None) or "probabilistic"
    if dspark_confidence_threshold is None:
        dspark_confidence_threshold = getattr(settings, "dspark_confidence_threshold", None)
    options = DSparkOptions(draft_sample_method, dspark_confidence_threshold)
    decoding = dspark_decoding_method(options, kwargs.get("streamer"))
    return generate(inputs, generation_config, *args, custom_generate=decoding, **kwargs)


def decode_graphs_call(model, compile_config) -> Inkling2DecodeGraphs:
    """The model's CUDA-graph runner for this `compile_config` (kept on the model, so its captured graphs are reused
    from one generate() call to the next). With an explicit `compile_config` the captured steps also run the
    `torch.compile`d model."""
    runner = getattr(model, "_decode_graphs", None)
    if runner is None or runner.compile_config != compile_config:
        model._decode_graphs = Inkling2DecodeGraphs(model, compile_config=compile_config)
    return model._decode_graphs


__all__ = ["decode_graphs_call", "generate_with_dspark"]
