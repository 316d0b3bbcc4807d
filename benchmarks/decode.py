"""Decode speed of Inkling2 attention on one GPU: our decode path next to transformers' built-in `inkling2`.

1. Attention only, one layer, one decode call (bf16, 48 q / 8 kv heads, head_dim 128, extent 1024): our
   `inkling2_decode` (the fused decode kernel on CUDA; what `inkling2_flex` runs for <= 8 queries) and
   `inkling2_flex_decode` (compiled FlexAttention with folded heads, its split-KV kernel) for Q = 1 and 8 queries
   over K = 8k, 32k, 128k cached
   keys (a full layer) and over the keys a sliding layer holds, at batch 1, 8, 64; launched op by op and replayed
   as a CUDA graph (neither path synchronizes with the host); next to it our eager reference and SDPA without bias
   or sink. GB/s = bytes of the keys and values read once / time.
2. A 6-layer slice of the model (5 sliding + 1 full, hidden 4608, `--experts` BF16 experts, top-8): after a
   prefill of `--context` tokens per row, one decode step of the decoder (no lm_head), in ms per layer, at batch
   1, 8, 64: ours with `inkling2_flex`, `inkling2_flex_decode` and `eager`, and the built-in (eager), same
   weights; peak memory.
3. `--per-layer VARIANT ...` (instead of 1 and 2): what one layer of a batch-1, 8 and 64 decode step costs against
   the bytes it reads, at 2k tokens of context, over `Inkling2StaticCache` with the step `torch.compile`d inside
   CUDA graphs (what `generate(..., compile_config=CompileConfig())` runs on a GPU; with `--graphs-only`, captured
   without compiling, what plain `generate()` runs). Per layer means the slope
   between a 2-layer and a 6-layer slice (the last layer full attention, the others sliding) divided by 4, so the
   embedding, the lm_head and the full layer drop out; both slices are held at once and their steps timed in
   alternating rounds (the range: single rounds' slopes), so a variant whose two slices do not fit the GPU together
   reports OOM (MXFP8 needs an H200): kernels launched (from a profile of the replays), bytes
   read (the layer's weights, the experts the batch touches in expectation under uniform routing, its cached keys
   and values), time, and the time of those bytes at the GPU's measured copy bandwidth as % of it; and one layer's
   kernels at batch 1 by GPU time (the same slope, kernel by kernel). Variants:
   `nvfp4`, `mxfp8` (384 experts, top-8, as in the checkpoint), `bf16` (128 BF16 experts, top-8: 384 do not fit
   six times) and `tp4-nvfp4` / `tp4-mxfp8` / `tp4-bf16`: what one GPU computes per layer at TP4/EP4 (12 q / 2 kv
   heads, 96 of the 384 experts, of which top-2 on average; hidden 4608).
4. `--readout` (instead of 1 to 3): the step's readout at the full vocabulary (201,024 rows of 4,608), at the
   `--batches`: the lm_head alone (`F.linear`, cuBLAS) and the model's readout (final RMS norm, `compute_logits`:
   lm_head in fp32, softcap, the real vocabulary), eager and `torch.compile`d, each replayed from a CUDA graph; the
   lm_head's bytes over the time as % of the copy bandwidth (the roofline issue's target: at least 80%).

    python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .whl/*.whl
    export PYTHONPATH=$PWD/src:/tmp/site
    python3 benchmarks/decode.py [--quick] [--out DIR] [--experts 16] [--context 4096] [--compile]
    python3 benchmarks/decode.py --per-layer nvfp4 tp4-nvfp4 [--context 2048] [--out DIR]
    python3 benchmarks/decode.py --readout [--batches 1 8 64] [--out DIR]
    python3 benchmarks/decode.py --per-layer nvfp4 --batches 1 --compare combo_kernels=False base
    python3 benchmarks/decode.py --per-layer nvfp4 --compare base INKLING2_FUSED_RESIDUAL_MIX=1 --graphs-only

`--compare SETTING ...` (with `--per-layer`, instead of the slope): one decode step of each variant's 6-layer slice
captured once per setting and the captures timed in interleaved rounds (a change of a few launches is smaller than
the slope's run-to-run spread). A setting is `base` (as the package runs), `NAME=VALUE` in capitals (an environment
switch, e.g. `INKLING2_FUSED_ATTENTION_STEP=1`, set while that setting's runner is built and its steps run),
`key=value` (an inductor option passed through `CompileConfig(options=...)`, e.g. `combo_kernels=False`), or several
of those joined by commas (`INKLING2_FUSED_ATTENTION_STEP=1,INKLING2_FUSED_KEY_VALUE_STEP=1`). Reports step ms
(median, range over the rounds), kernels, GPU busy ms and the logits' relative difference to the first setting's,
over the batch and per row, median and largest (one row far off while the rest agree: an expert picked differently
where two router logits were nearly tied, not a broken kernel);
`decode_compare.md`. The steps are `torch.compile`d inside their graphs; with `--graphs-only` (with `--per-layer`,
the slope or `--compare`) they are captured as plain `generate()` captures them, without compiling (then only
environment switches make `--compare` settings).

`--inductor-config KEY=VALUE ...` sets `torch._inductor.config` entries (dotted keys reach its sub-configs; True /
False and integers are parsed) before anything compiles: to measure a compiler switch on the compiled steps (the
options the runner passes itself, PDL and combo kernels, win over these: compare those with `--compare`).

Prints markdown tables and writes `decode.md` (+ `decode.json`) under --out (default $OUT, else ./); with
`--per-layer`, `decode_per_layer.md` (+ `.json`), rewritten after each variant; with `--readout`, `readout.md` (+
`.json`).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import statistics
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parent))
from attention import (
    DEVICE,
    EXTENT,
    HEAD_DIM,
    HEADS,
    KV_HEADS,
    WINDOW,
    build_models,
    cuda_ms,
    environment,
    fmt,
    free_memory,
    guarded,
    markdown_table,
    peak_gib,
    write_report,
)

SLIDING_KEYS = WINDOW - 1 + 8  # what a sliding layer's cache holds (window - 1 + rollback margin) ...
LAYERS = 6


def graph_ms(fn, repeats: int = 20, calls: int = 1) -> float:
    """Median ms per call of fn, from replays of a CUDA graph holding `calls` calls (more calls: a short kernel's
    time without the replay's own launch)."""
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        for _ in range(2):
            fn()
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for _ in range(calls):
            fn()
    return cuda_ms(graph.replay, warmup=3, repeats=repeats) / calls


# --- part 1: attention only ----------------------------------------------------------------------------------------


def decode_inputs(batch: int, queries: int, keys: int, generator) -> dict:
    def randn(*shape, scale=1.0):
        return torch.randn(shape, generator=generator, device=DEVICE, dtype=torch.bfloat16) * scale

    return dict(
        query=randn(batch, HEADS, queries, HEAD_DIM, scale=1.4),
        key=randn(batch, KV_HEADS, keys, HEAD_DIM, scale=1.4),
        value=randn(batch, KV_HEADS, keys, HEAD_DIM),
        relative_logits=randn(batch, HEADS, queries, EXTENT),
        sinks=randn(batch, HEADS, queries),
        query_positions=torch.arange(keys - queries, keys, device=DEVICE),
        key_positions=torch.arange(keys, device=DEVICE),
        key_padding=None,
    )


def attention_decode_benchmark(key_counts, batches, repeats, with_flex_decode=True) -> list[dict]:
    from transformers_inkling2.backends.attention.flex import inkling2_decode_attention, inkling2_flex_decode_attention
    from transformers_inkling2.modeling.attention import eager_attention

    generator = torch.Generator(device=DEVICE).manual_seed(0)
    rows = []
    layouts = [("sliding", SLIDING_KEYS, WINDOW)] + [("full", keys, None) for keys in key_counts]
    for layer, keys, window in layouts:
        for batch in batches:
            for queries in (1, 8):
                inputs = guarded(lambda: decode_inputs(batch, queries, keys + queries, generator))
                if isinstance(inputs, str):
                    rows.append(dict(layer=layer, keys=keys, batch=batch, queries=queries, method="inputs", ms=inputs))
                    continue
                kv_bytes = 2 * inputs["key"].numel() * inputs["key"].element_size()

                def ours():
                    return inkling2_decode_attention(**inputs, sliding_window=window, scaling=HEAD_DIM**-0.5)

                def flex_split_kv():
                    return inkling2_flex_decode_attention(**inputs, sliding_window=window, scaling=HEAD_DIM**-0.5)

                def eager():
                    return eager_attention(**inputs, sliding_window=window, scaling=HEAD_DIM**-0.5)

                def sdpa():
                    return F.scaled_dot_product_attention(
                        inputs["query"], inputs["key"], inputs["value"], enable_gqa=True
                    )

                methods = [
                    ("inkling2_decode", lambda: cuda_ms(ours, 2, repeats)),
                    ("inkling2_decode, CUDA graph", lambda: graph_ms(ours, repeats)),
                    *(
                        [("inkling2_flex_decode", lambda: cuda_ms(flex_split_kv, 2, repeats)),
                         ("inkling2_flex_decode, CUDA graph", lambda: graph_ms(flex_split_kv, repeats))]
                        if with_flex_decode else []
                    ),
                    ("eager reference", lambda: cuda_ms(eager, 1, repeats)),
                    ("SDPA, no bias / sink", lambda: cuda_ms(sdpa, 2, repeats)),
                ]
                for method, measure in methods:
                    result = guarded(lambda: peak_gib(measure))
                    ms, peak = (result, None) if isinstance(result, str) else result
                    row = dict(layer=layer, keys=keys, batch=batch, queries=queries, method=method, ms=ms,
                               peak_gib=peak, gb_per_s=None if isinstance(ms, str) else kv_bytes / ms / 1e6)
                    rows.append(row)
                    print(json.dumps(row), flush=True)
                inputs = None
                free_memory()
    return rows


# --- part 2: model slice decode step -------------------------------------------------------------------------------


def model_decode_benchmark(args) -> list[dict]:
    from transformers import CompileConfig

    from transformers_inkling2 import Inkling2Cache, Inkling2DecodeGraphs, Inkling2StaticCache

    ours, oracle = build_models(args.experts, with_oracle=not args.no_oracle)
    generator = torch.Generator(device=DEVICE).manual_seed(2)
    rows = []

    def prefill(model, batch, make_cache):
        """The context, fed in chunks small enough for the eager attention of the built-in."""
        cache = make_cache()
        chunk = max(128, min(2048, (8 << 30) // (batch * args.context * HEADS * 4)))
        context = torch.randint(0, 8000, (batch, args.context), device=DEVICE, generator=generator)
        with torch.no_grad():
            for start in range(0, args.context, chunk):
                output = model.model(context[:, start : start + chunk], past_key_values=cache, use_cache=True)
                cache = output.past_key_values
        return cache

    def decode_steps(model, cache, batch, compile_config):
        tokens = torch.randint(0, 8000, (batch, 1), device=DEVICE, generator=generator)
        # over the static cache, the step replays a CUDA graph (captured in the warm-up calls)
        forward = model.model
        if isinstance(cache, Inkling2StaticCache):
            forward = Inkling2DecodeGraphs(model.model, compile_config=compile_config)

        def step():
            with torch.no_grad():
                forward(input_ids=tokens, past_key_values=cache, use_cache=True)

        return cuda_ms(step, warmup=2, repeats=args.steps)

    static_length = args.context + 2 * args.steps + 16
    candidates = [
        (f"ours ({backend})", ours, lambda: Inkling2Cache(ours.config), backend, None)
        for backend in ("inkling2_flex", "inkling2_flex_decode", "eager")
        if args.flex_decode or backend != "inkling2_flex_decode"
    ] + [
        (f"ours ({backend}, static cache, {'torch.compile + ' if compiled else ''}CUDA graph)", ours,
         lambda: Inkling2StaticCache(ours.config, static_length), backend, CompileConfig() if compiled else None)
        for backend in ("inkling2_flex", "inkling2_flex_decode")
        for compiled in ((False, True) if args.compile else (False,))
        if args.flex_decode or backend != "inkling2_flex_decode"
    ]  # fmt: skip
    if oracle is not None:
        candidates.append(("built-in inkling2 (eager)", oracle, lambda: None, None, None))
    for batch in args.batches:
        for name, model, make_cache, backend, compile_config in candidates:
            if backend is not None:
                model.config._attn_implementation = backend

            def measure():
                cache = prefill(model, batch, make_cache)
                free_memory()
                torch.cuda.reset_peak_memory_stats()
                ms = decode_steps(model, cache, batch, compile_config)
                return ms, torch.cuda.max_memory_allocated() / 2**30

            result = guarded(measure)
            ms, peak = (result, None) if isinstance(result, str) else result
            row = dict(model=name, batch=batch, context=args.context, step_ms=ms, peak_gib=peak,
                       ms_per_layer=None if isinstance(ms, str) else ms / LAYERS)
            rows.append(row)
            print(json.dumps(row), flush=True)
            free_memory()
    ours.config._attn_implementation = "inkling2_flex"
    return rows


# --- part 3: one layer's cost against the bytes it reads -------------------------------------------------------------

PER_LAYER_VARIANTS = ("nvfp4", "mxfp8", "bf16", "tp4-nvfp4", "tp4-mxfp8", "tp4-bf16")
BF16_EXPERTS = 128  # 384 BF16 experts take 24.5 GB a layer: six layers of them do not fit one H200
SLOPE_LAYERS = (2, 6)


def layer_slice_config(variant: str, layers: int):
    """`layers` layers, the last one full attention, the others sliding; full width, or what one GPU computes per
    layer at TP4/EP4 ("tp4-..."); routed experts stored as the variant says."""
    from parallel import official_quantization

    from transformers_inkling2 import Inkling2TextConfig
    from transformers_inkling2.configuration_inkling2 import FULL_LAYER, SLIDING_LAYER

    storage = variant.removeprefix("tp4-")
    fields = dict(num_hidden_layers=layers, layer_types=[SLIDING_LAYER] * (layers - 1) + [FULL_LAYER],
                  vocab_size=8192, unpadded_vocab_size=8000, eos_token_id=None)  # fmt: skip
    if variant.startswith("tp4-"):
        fields.update(num_attention_heads=12, num_key_value_heads=2, swa_num_attention_heads=12,
                      swa_num_key_value_heads=2, n_routed_experts=96, num_experts_per_tok=2)  # fmt: skip
    elif storage == "bf16":
        fields["n_routed_experts"] = BF16_EXPERTS
    if storage != "bf16":
        fields["expert_quantization"] = official_quantization([storage] * layers)
    return Inkling2TextConfig(**fields)


def random_slice(config):
    """The model on the GPU with random weights, built on the meta device (no dequantized or fp32 copy on the way):
    bf16, except what the original keeps in fp32 and the packed experts' codes and scales."""
    from full_scale import cast_to_bf16_
    from parallel import fill_randomly_

    from transformers_inkling2 import Inkling2ForCausalLM

    with torch.device("meta"):
        model = Inkling2ForCausalLM(config)
    cast_to_bf16_(model)
    fill_randomly_(model.to_empty(device=DEVICE))
    return model.eval()


def copy_bandwidth_gb_s() -> float:
    """Bytes read plus bytes written per second by a 1 GiB device copy."""
    source = torch.empty(1 << 30, dtype=torch.uint8, device=DEVICE)
    target = torch.empty_like(source)
    return 2 * source.numel() / cuda_ms(lambda: target.copy_(source), warmup=2, repeats=10) / 1e6


def profiled_kernels(step, steps: int = 3) -> tuple[float, float, dict]:
    """(kernels launched per step, their GPU time in ms per step, {kernel name: [count, us] per step}) of `step`,
    memory copies and sets left out (the graphs' input copies)."""
    from torch.autograd import DeviceType
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as trace:
        for _ in range(steps):
            step()
        torch.cuda.synchronize()
    by_name = {}
    for event in trace.events():
        if event.device_type != DeviceType.CUDA or any(word in event.name.lower() for word in ("memcpy", "memset")):
            continue
        entry = by_name.setdefault(event.name, [0.0, 0.0])
        entry[0] += 1 / steps
        entry[1] += event.time_range.elapsed_us() / steps
    return sum(c for c, _ in by_name.values()), sum(us for _, us in by_name.values()) / 1000, by_name


ROUNDS = 8  # interleaved rounds of steps timed in turns (`--compare` and the per-layer slope)


def interleaved_ms(steps: dict, repeats: int) -> dict[object, list[float]]:
    """{key: ms of its step in each of ROUNDS rounds}, the steps timed in turns within each round."""
    times = {key: [] for key in steps}
    for _ in range(ROUNDS):
        for key, step in steps.items():
            times[key].append(cuda_ms(step, warmup=3, repeats=repeats))
    return times


def timed_slices(models: dict, batch: int, args) -> dict:
    """{layers: its slice's step ms in each of ROUNDS rounds, kernels, GPU ms, bytes read, kernels by name}: the
    slices' decode steps (`compared_step` as it is, after `args.context` tokens per row) timed in turns, so that a
    drift of the GPU between two slices timed one after the other cannot move the slope."""
    from full_scale import decode_step_bytes

    compiled = not args.graphs_only
    steps = {layers: compared_step(model, batch, args.context, "base", compiled)[0] for layers, model in models.items()}
    slices = {}
    with torch.no_grad():
        times = interleaved_ms(steps, args.steps)
        for layers, step in steps.items():
            kernels, gpu_ms, by_name = profiled_kernels(step)
            slices[layers] = dict(ms=times[layers], kernels=kernels, gpu_ms=gpu_ms, by_name=by_name,
                                  bytes=decode_step_bytes(models[layers], batch, args.context))  # fmt: skip
    return slices


def per_layer_benchmark(args) -> list[dict]:
    bandwidth = copy_bandwidth_gb_s()
    print(f"copy bandwidth {bandwidth:.0f} GB/s", flush=True)
    rows, busiest = [], {}
    small, large = SLOPE_LAYERS
    for variant in args.per_layer:
        # both slices at once (their steps are timed in turns): one after the other, the same code's slope moved by
        # up to 0.16 ms between runs (docs/benchmarks.md)
        models = guarded(lambda: {layers: random_slice(layer_slice_config(variant, layers)) for layers in SLOPE_LAYERS})
        for batch in args.batches:
            slices = guarded(lambda: timed_slices(models, batch, args)) if isinstance(models, dict) else models
            if not isinstance(slices, dict):
                rows.append(dict(variant=variant, batch=batch, error=slices))
                print(rows[-1], flush=True)
                continue
            a, b = slices[small], slices[large]
            per_layer = {key: (b[key] - a[key]) / (large - small) for key in ("kernels", "gpu_ms", "bytes")}
            per_layer["ms"] = (statistics.median(b["ms"]) - statistics.median(a["ms"])) / (large - small)
            round_slopes = [(y - x) / (large - small) for x, y in zip(a["ms"], b["ms"], strict=True)]
            roofline_ms = per_layer["bytes"] / bandwidth / 1e6
            rows.append(dict(variant=variant, batch=batch, **per_layer, low=min(round_slopes), high=max(round_slopes),
                             roofline_ms=roofline_ms, roofline_share=roofline_ms / per_layer["ms"],
                             step_ms_2=statistics.median(a["ms"]), step_ms_6=statistics.median(b["ms"]),
                             bandwidth_gb_s=bandwidth))  # fmt: skip
            print(rows[-1], flush=True)
            if batch == args.batches[0]:  # one layer's kernels
                few, many = a["by_name"], b["by_name"]
                kernels = {name: [(many.get(name, (0, 0))[i] - few.get(name, (0, 0))[i]) / (large - small)
                                  for i in (0, 1)] for name in {*few, *many}}  # fmt: skip
                top = sorted(kernels.items(), key=lambda item: -item[1][1])
                busiest[variant] = [(name[:100], round(count, 2), round(us, 2)) for name, (count, us) in top
                                    if abs(count) > 0.01 or abs(us) > 0.05]  # fmt: skip
            free_memory()
        del models
        torch._dynamo.reset()  # every slice compiles afresh: keep the recompile limit out of the way
        free_memory()
        write_report(args.out, "decode_per_layer", per_layer_report(args, rows, busiest, bandwidth),
                     dict(rows=rows, busiest=busiest, args=vars(args)))  # fmt: skip
    return rows


def parsed_value(text: str):
    """True / False, an integer, or the text."""
    return {"True": True, "False": False}.get(text, int(text) if text.lstrip("-").isdigit() else text)


def setting_parts(setting: str) -> tuple[dict, dict]:
    """(environment switches, inductor options) of a `--compare` setting: `base`, or `NAME=VALUE` / `key=value`
    items joined by commas."""
    switches, options = {}, {}
    for item in [] if setting == "base" else setting.split(","):
        name, equals, value = item.partition("=")
        if not (name and equals):
            raise ValueError(f"{item!r} in --compare {setting!r} is not NAME=VALUE or key=value")
        if name.isupper():
            switches[name] = value
        else:
            options[name] = parsed_value(value)
    return switches, options


@contextlib.contextmanager
def environment_set(switches: dict):
    before = {name: os.environ.get(name) for name in switches}
    os.environ.update(switches)
    try:
        yield
    finally:
        for name, value in before.items():
            if value is None:
                del os.environ[name]
            else:
                os.environ[name] = value


def compared_step(model, batch: int, context: int, setting: str, compiled: bool = True):
    """(step, first logits): one decode step of `model` captured under `setting` (see `--compare`), `torch.compile`d
    inside the graph unless `compiled` is False; an environment switch is set while the runner is built (it picks
    inductor's options then) and during every call of the step, so that a capture the runner makes later sees it
    too."""
    from transformers import CompileConfig

    from transformers_inkling2 import Inkling2DecodeGraphs, Inkling2StaticCache

    switches, options = setting_parts(setting)
    # room for every round's steps without a new bucket (a new capture) for the full layers
    cache = Inkling2StaticCache(model.config, context + 1024, batch)
    generator = torch.Generator(device=DEVICE).manual_seed(batch)
    ids = torch.randint(0, 8000, (batch, context), device=DEVICE, generator=generator)

    with environment_set(switches):
        compile_config = CompileConfig(options=options or None) if compiled else None
        runner = Inkling2DecodeGraphs(model, compile_config=compile_config)

    def step():
        with environment_set(switches):
            return runner(input_ids=ids[:, -1:], past_key_values=cache, use_cache=True, logits_to_keep=1)

    torch._dynamo.reset()  # dynamo does not guard on the environment: this setting traces the step afresh
    with torch.no_grad():
        model(ids, past_key_values=cache, use_cache=True, logits_to_keep=1)
        first = step().logits.float()
    return step, first


def compare_benchmark(args) -> list[dict]:
    rows = []
    for variant in args.per_layer:
        model = random_slice(layer_slice_config(variant, LAYERS))
        for batch in args.batches:
            steps = {setting: compared_step(model, batch, args.context, setting, not args.graphs_only)
                     for setting in args.compare}  # fmt: skip
            with torch.no_grad():
                times = interleaved_ms({setting: step for setting, (step, _) in steps.items()}, args.steps)
                reference = next(iter(steps.values()))[1]
                for setting, (step, first) in steps.items():
                    kernels, gpu_ms, _ = profiled_kernels(step)
                    difference = ((first - reference).norm() / reference.norm()).item()
                    by_row = ((first - reference).norm(dim=-1) / reference.norm(dim=-1)).flatten().tolist()
                    rows.append(dict(variant=variant, batch=batch, setting=setting, ms=statistics.median(
                        times[setting]), low=min(times[setting]), high=max(times[setting]), kernels=kernels,
                        gpu_ms=gpu_ms, difference=difference, row_difference=(statistics.median(by_row),
                                                                                max(by_row))))  # fmt: skip
                    print(rows[-1], flush=True)
            del steps
            free_memory()
        del model
        free_memory()
        table = markdown_table(
            ["layer", "batch", "setting", "step ms (median)", "range", "kernels", "GPU busy ms", "logits vs first",
             "per row: median, largest"],
            [[r["variant"], r["batch"], r["setting"], fmt(r["ms"], ".3f"), f"{r['low']:.3f}-{r['high']:.3f}",
              fmt(r["kernels"], ".1f"), fmt(r["gpu_ms"], ".3f"), fmt(r["difference"], ".1e"),
              ", ".join(fmt(d, ".1e") for d in r["row_difference"])] for r in rows],
        )  # fmt: skip
        text = (f"# Decode steps of a {LAYERS}-layer slice under several settings\n\n{environment()}; command: "
                f"`python3 benchmarks/decode.py --per-layer {' '.join(args.per_layer)} --batches "
                f"{' '.join(map(str, args.batches))} --context {args.context} --compare {' '.join(args.compare)}"
                f"{' --graphs-only' if args.graphs_only else ''}`; {ROUNDS} interleaved rounds of {args.steps} "
                f"replays per setting\n\n{table}")
        write_report(args.out, "decode_compare", text, dict(rows=rows, args=vars(args)))
    return rows


def per_layer_report(args, rows: list[dict], busiest: dict, bandwidth: float) -> str:
    table = markdown_table(
        ["layer", "batch", "kernels", "MB read", "ms", "rounds' range", "GPU busy ms", "roofline ms", "% of roofline"],
        [[r["variant"], r["batch"], r.get("error", fmt(r.get("kernels"), ".1f")),
          fmt(r["bytes"] / 1e6 if "bytes" in r else None, ".1f"), fmt(r.get("ms"), ".3f"),
          "" if "error" in r else f"{r['low']:.3f}-{r['high']:.3f}", fmt(r.get("gpu_ms"), ".3f"),
          fmt(r.get("roofline_ms"), ".3f"),
          fmt(None if "error" in r else 100 * r["roofline_share"], ".0f")] for r in rows],
    )  # fmt: skip
    batches = " ".join(map(str, args.batches))
    inductor = f" --inductor-config {' '.join(args.inductor_config)}" if args.inductor_config else ""
    graphs_only = " --graphs-only" if args.graphs_only else ""
    step = "CUDA graphs without `torch.compile`" if args.graphs_only else "`torch.compile` inside CUDA graphs"
    text = [f"# One decode layer against the bytes it reads\n\n{environment()}; command: `python3 benchmarks/decode.py "
            f"--per-layer {' '.join(args.per_layer)} --context {args.context} --batches {batches}{inductor}"
            f"{graphs_only}`; copy bandwidth {bandwidth:.0f} GB/s\n",
            "Per layer: the slope between a 2- and a 6-layer slice (median step at 6 layers minus median step at 2, "
            f"over 4; both slices held at once, their steps timed in {ROUNDS} alternating rounds of {args.steps} "
            f"replays; the range: the slopes of single rounds), {args.context} tokens of context per row, static "
            f"cache, {step}.\n", table]
    for variant, kernels in busiest.items():
        text += [f"\nOne `{variant}` layer's kernels at batch {args.batches[0]}, by GPU time (the same slope; all in "
                 "the JSON):\n",
                 markdown_table(["kernel", "launches", "us"], [list(k) for k in kernels[:16]])]
    return "\n".join(text)


READOUT_CALLS = 4  # calls per graph: the 1.85 GB weight is read afresh by each (it does not fit the L2)


def readout_benchmark(args) -> list[dict]:
    """The readout at the full vocabulary: the lm_head alone and the model's readout, eager and compiled."""
    from transformers_inkling2 import Inkling2TextConfig
    from transformers_inkling2.configuration_inkling2 import SLIDING_LAYER

    bandwidth = copy_bandwidth_gb_s()
    # the default (full) vocabulary and one small layer, which the readout does not run
    model = random_slice(Inkling2TextConfig(num_hidden_layers=1, layer_types=[SLIDING_LAYER], n_routed_experts=8,
                                            eos_token_id=None))  # fmt: skip
    weight = model.lm_head.weight
    read = weight.numel() * weight.element_size()

    def readout(hidden):  # what the step runs after the last layer: the final norm, then compute_logits
        return model.compute_logits(model.model.norm(hidden).to(weight.dtype), 1)

    compiled = torch.compile(readout)
    rows, generator = [], torch.Generator(device=DEVICE).manual_seed(0)
    for batch in args.batches:
        hidden = torch.randn(batch, 1, weight.shape[1], device=DEVICE, generator=generator)
        variants = {"lm_head (F.linear)": lambda: F.linear(hidden.to(weight.dtype), weight),
                    "readout, eager": lambda: readout(hidden), "readout, torch.compile": lambda: compiled(hidden)}
        with torch.no_grad():
            for name, fn in variants.items():
                ms = graph_ms(fn, repeats=args.steps, calls=READOUT_CALLS)
                rows.append(dict(batch=batch, path=name, ms=ms, share=read / ms / 1e6 / bandwidth))
                print(rows[-1], flush=True)
    text = [f"# The readout at the full vocabulary\n\n{environment()}; command: `python3 benchmarks/decode.py "
            f"--readout --batches {' '.join(map(str, args.batches))}`; copy bandwidth {bandwidth:.0f} GB/s\n",
            f"lm_head {tuple(weight.shape)} bf16, {read / 1e9:.2f} GB; % = those bytes over the time, of the copy "
            "bandwidth.\n",
            markdown_table(["batch", "path", "ms", "% of copy"],
                           [[r["batch"], r["path"], fmt(r["ms"], ".3f"), fmt(100 * r["share"], ".0f")] for r in rows])]
    write_report(args.out, "readout", "\n".join(text), dict(rows=rows, bandwidth_gb_s=bandwidth, args=vars(args)))
    return rows


def set_inductor_config(items: list[str]) -> None:
    """Sets `torch._inductor.config` entries given as KEY=VALUE (dotted keys for its sub-configs, e.g.
    triton.max_tiles=3); an unknown key is an error rather than a silently ignored switch. The options the decode
    runner passes to `torch.compile` (PDL, combo kernels) win over these: compare those with `--compare`."""
    import torch._inductor.config as inductor_config

    for item in items:
        key, separator, text = item.partition("=")
        if not separator:
            sys.exit(f"--inductor-config takes KEY=VALUE, got {item!r}")
        *parents, name = key.split(".")
        owner = inductor_config
        for parent in parents:
            owner = getattr(owner, parent)
        if not hasattr(owner, name):
            sys.exit(f"torch._inductor.config has no {key!r}")
        setattr(owner, name, parsed_value(text))


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", default=os.environ.get("OUT", "."))
    parser.add_argument("--quick", action="store_true", help="keys 8k/32k, context 1024, fewer repeats")
    parser.add_argument("--experts", type=int, default=16)
    parser.add_argument("--context", type=int, help="tokens per row before the timed decode steps (default 4096; "
                        "2048 with --per-layer, as the roofline issue measured)")
    parser.add_argument("--no-oracle", action="store_true")
    parser.add_argument("--skip-model", action="store_true", help="attention microbenchmark only")
    parser.add_argument("--skip-attention", action="store_true", help="model slice only")
    parser.add_argument("--compile", action="store_true",
                        help="also the static-cache steps compiled with torch.compile (CompileConfig()) inside the "
                        "graphs")
    parser.add_argument("--no-flex-decode", dest="flex_decode", action="store_false",
                        help="leave out inkling2_flex_decode (shorter runs)")
    parser.add_argument("--per-layer", nargs="+", choices=PER_LAYER_VARIANTS,
                        help="part 3 only: one layer's cost per variant (the context defaults to 2048 here)")
    parser.add_argument("--batches", type=int, nargs="+", default=[1, 8, 64], help="rows per step (default 1 8 64)")
    parser.add_argument("--readout", action="store_true", help="part 4 only: the readout at the full vocabulary")
    parser.add_argument("--compare", nargs="+", metavar="SETTING",
                        help="with --per-layer: time one step under each setting, interleaved (see above)")
    parser.add_argument("--graphs-only", action="store_true",
                        help="with --per-layer: capture the steps without torch.compile, as plain generate() runs them")
    parser.add_argument("--inductor-config", nargs="+", default=[], metavar="KEY=VALUE",
                        help="torch._inductor.config entries to set first, e.g. coordinate_descent_tuning=True")
    args = parser.parse_args()
    if args.compare and not args.per_layer:
        sys.exit("--compare needs --per-layer VARIANT ...")
    try:
        for setting in args.compare or ():
            setting_parts(setting)
    except ValueError as error:
        sys.exit(f"{error}: --compare takes base, NAME=VALUE (an environment switch), key=value (an inductor option) "
                 "or several of those joined by commas")
    if args.graphs_only and (not args.per_layer or any(setting_parts(setting)[1] for setting in args.compare or ())):
        sys.exit("--graphs-only goes with --per-layer, and with --compare settings of environment switches only "
                 "(inductor options need the compiled steps)")
    set_inductor_config(args.inductor_config)
    if not torch.cuda.is_available():
        sys.exit("benchmarks/decode.py needs a CUDA GPU")
    if args.context is None:
        args.context = 2048 if args.per_layer else 4096
    if args.quick:
        args.context = min(args.context, 1024)
    args.steps = 3 if args.quick else 8
    if args.per_layer:
        args.steps = max(args.steps, 20)
        (compare_benchmark if args.compare else per_layer_benchmark)(args)
        return
    if args.readout:
        readout_benchmark(args)
        return
    started = time.time()

    key_counts = [8192, 32768] if args.quick else [8192, 32768, 131072]
    attention_rows = [] if args.skip_attention else attention_decode_benchmark(
        key_counts, args.batches, 5 if args.quick else 20, args.flex_decode
    )
    report = [f"# Inkling2 decode benchmark\n\n{environment()}; command: `python3 benchmarks/decode.py"
              f"{' --quick' if args.quick else ''}`\n",
              "## One attention call (bf16, 48 q / 8 kv heads, head_dim 128, extent 1024)\n",
              f"Sliding layers hold {SLIDING_KEYS} keys. GB/s = bytes of keys + values / time.\n",
              markdown_table(["layer", "keys", "batch", "queries", "method", "ms", "GB/s", "peak GiB"],
                             [[r["layer"], r["keys"], r["batch"], r["queries"], r["method"], fmt(r["ms"], ".3f"),
                               fmt(r.get("gb_per_s"), ".0f"), fmt(r.get("peak_gib"), ".1f")]
                              for r in attention_rows])]
    model_rows = []
    if not args.skip_model:
        model_rows = model_decode_benchmark(args)
        report += [f"\n## One decode step of a 6-layer slice (5 sliding + 1 full, hidden 4608, {args.experts} BF16 "
                   f"experts, top-8), after {args.context} tokens per row\n",
                   "Eager PyTorch launches unless the row says CUDA graph (`Inkling2StaticCache` + "
                   "`Inkling2DecodeGraphs`, what `generate(cache_implementation=\"static\")` runs); ms per layer = "
                   "step / 6.\n",
                   markdown_table(["model", "batch", "step ms", "ms per layer", "peak GiB"],
                                  [[r["model"], r["batch"], fmt(r["step_ms"], ".2f"), fmt(r.get("ms_per_layer"), ".3f"),
                                    fmt(r.get("peak_gib"), ".1f")] for r in model_rows])]
    report.append(f"\nTotal benchmark time {time.time() - started:.0f} s.")
    write_report(args.out, "decode", "\n".join(report), dict(attention=attention_rows, model=model_rows,
                                                             args=vars(args)))


if __name__ == "__main__":
    main()
