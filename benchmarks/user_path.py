"""What a user gets from plain `generate()` on one GPU, through the public API only: transformers' built-in
`inkling2` beside ours, on the same random weights (issue #27).

The model: a 6-layer full-width slice of Inkling-2-Small (5 sliding + 1 full layer, hidden 4608, 48 / 8 heads, 64
BF16 experts of width 2304, top-8, the official 201,024-row vocabulary), built with `from_config` on the GPU (our
weights drawn at random, the built-in loading the same state dict); a second one with 384 random NVFP4 / MXFP8
experts (5 NVFP4 + 1 MXFP8 layers) for ours.

Measured:
1. decode: a 2,048-token prompt, 64 new tokens, greedy; ms per token from a streamer's timestamps (batch 1) and
   tokens/s (batch 8), each call warmed up once with the same arguments, for: the built-in with its defaults; ours
   with its defaults; ours with `compile_config=CompileConfig()`; ours on the reference path (`attn_implementation=
   "eager"`, `cache_implementation="dynamic"`); the quantized model with defaults and with compile. The first
   (compiling) call's extra seconds are reported too: the price of compile;
2. prefill: 8k, 32k and 131k-token prompts through plain `generate(max_new_tokens=1)`: seconds and peak memory;
3. cold start: a fresh process (`--cold-start`) builds the model, then the time from the model being ready to the
   first generated token of an 8k prompt: once with empty Triton / Inductor caches, once more with the caches the
   first left (what every later process sees);
4. where a default batch-1 decode step's time goes: kernel time per token against wall time (torch.profiler).

    python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .whl/*.whl
    export PYTHONPATH=$PWD/src:/tmp/site
    python3 benchmarks/user_path.py --out $OUT        # [--quick]: 2 layers, 8 experts, short prompts

Prints markdown tables and writes `user_path.md` (+ `.json`) under --out.
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from attention import environment, fmt, free_memory, guarded, markdown_table, write_report  # noqa: E402
from parallel import fill_randomly_, official_quantization  # noqa: E402

PROMPT, NEW_TOKENS = 2048, 64


def slice_fields(quick: bool, experts: int) -> dict:
    from transformers_inkling2.configuration_inkling2 import FULL_LAYER, SLIDING_LAYER

    layers = 2 if quick else 6
    return dict(
        num_hidden_layers=layers,
        layer_types=[SLIDING_LAYER] * (layers - 1) + [FULL_LAYER],
        n_routed_experts=experts,
        moe_intermediate_size=2304,
        eos_token_id=None,
    )


def build_ours(quick: bool, quantized: bool = False):
    """Ours through `AutoModelForCausalLM.from_config` on the GPU; random weights."""
    from transformers import AutoModelForCausalLM

    import transformers_inkling2
    from transformers_inkling2 import Inkling2TextConfig

    fields = slice_fields(quick, 384 if quantized else (8 if quick else 64))
    if quantized:
        layers = fields["num_hidden_layers"]
        fields["expert_quantization"] = official_quantization(["nvfp4"] * (layers - 1) + ["mxfp8"])
    with torch.device("cuda"):
        model = AutoModelForCausalLM.from_config(Inkling2TextConfig(**fields), dtype=torch.bfloat16)
    for name, tensor in [*model.named_parameters(), *model.named_buffers()]:  # as from_pretrained keeps them
        if tensor.is_floating_point() and any(part in name for part in model._keep_in_fp32_modules_strict):
            tensor.data = tensor.data.float()
    fill_randomly_(model)
    return model.eval()


def build_builtin(ours):
    """transformers' built-in `inkling2` holding our tensors themselves (`assign=True`: the same memory, and the
    modules the original runs in fp32 keep fp32 weights in both)."""
    from transformers.models.inkling2 import configuration_inkling2, modeling_inkling2

    fields = {key: value for key, value in ours.config.to_dict().items() if key != "dspark_config"}
    with torch.device("meta"):
        builtin = modeling_inkling2.Inkling2ForCausalLM._from_config(
            configuration_inkling2.Inkling2TextConfig(**fields), dtype=torch.bfloat16
        )
    builtin.load_state_dict(ours.state_dict(), strict=True, assign=True)
    return builtin.eval()


class TimingStreamer:
    """Timestamps of each step's new tokens (the first `put` is the prompt)."""

    def __init__(self):
        self.times = []

    def put(self, value):
        value.cpu()  # the token is on the host, as for a user reading a stream
        self.times.append(time.perf_counter())

    def end(self):
        pass


def prompt(batch: int, length: int, vocab: int = 200_000, seed: int = 0) -> dict:
    generator = torch.Generator(device="cuda").manual_seed(seed)
    ids = torch.randint(0, vocab, (batch, length), generator=generator, device="cuda")
    return {"input_ids": ids, "attention_mask": torch.ones_like(ids)}


def timed_generate(model, inputs: dict, new_tokens: int, **options) -> tuple[float, list[float]]:
    """(seconds of the call, timestamps of the new tokens relative to its start)."""
    streamer = TimingStreamer()
    torch.cuda.synchronize()
    start = time.perf_counter()
    model.generate(**inputs, max_new_tokens=new_tokens, min_new_tokens=new_tokens, do_sample=False,
                   streamer=streamer, pad_token_id=0, **options)  # fmt: skip
    torch.cuda.synchronize()
    return time.perf_counter() - start, [t - start for t in streamer.times[1:]]


def decode_rate(model, batch: int, **options) -> dict:
    """First call (warm-up, compiling if asked), then the measured call: ms per token and tokens/s after the first
    token."""
    inputs = prompt(batch, PROMPT)
    first, _ = timed_generate(model, inputs, NEW_TOKENS, **options)
    total, times = timed_generate(model, inputs, NEW_TOKENS, **options)
    per_token = (times[-1] - times[0]) / (len(times) - 1)
    return {"ms_per_token": per_token * 1e3, "tokens_per_s": batch / per_token, "first_call_extra_s": first - total}


def decode_table(models: dict, batches: list[int]) -> tuple[str, dict]:
    from transformers import CompileConfig

    variants = [
        ("built-in `inkling2`, default arguments", "builtin", {}),
        ("ours, default arguments", "ours", {}),
        ("ours, + `compile_config=CompileConfig()`", "ours", {"compile_config": CompileConfig()}),
        ("ours, reference path (`eager`, dynamic cache)", "ours-eager", {"cache_implementation": "dynamic"}),
        ("ours, 384 NVFP4/MXFP8 experts, default arguments", "quantized", {}),
        ("ours, 384 NVFP4/MXFP8 experts, + compile", "quantized", {"compile_config": CompileConfig()}),
    ]
    rows, data = [], {}
    for label, name, options in variants:
        model = models[name]
        results = {batch: guarded(lambda: decode_rate(model, batch, **options)) for batch in batches}
        data[label] = results
        cells = [label]
        for batch in batches:
            result = results[batch]
            if isinstance(result, str):
                cells += [result, "-", "-"]
            else:
                cells += [fmt(result["ms_per_token"]), fmt(result["tokens_per_s"], ".0f"),
                          fmt(result["first_call_extra_s"], ".1f")]  # fmt: skip
        rows.append(cells)
    headers = ["`generate()` call"]
    for batch in batches:
        headers += [f"batch {batch}: ms/token", f"batch {batch}: tokens/s", f"batch {batch}: first call +s"]
    return markdown_table(headers, rows), data


def step_breakdown(model, steps: int = 32) -> tuple[str, dict]:
    """Where a default batch-1 decode step's time goes: GPU kernel time per token (graph replays included, as the
    profiler sees them) against wall time per token, and the kernels that take the most. A call of `steps + 1`
    tokens minus a call of 1 token (the prefill alone) leaves the decode steps' kernels."""
    from torch.profiler import ProfilerActivity, profile

    def kernel_times(new_tokens: int) -> tuple[dict, list[float]]:
        inputs = prompt(1, PROMPT)
        timed_generate(model, inputs, new_tokens)  # warm: graphs captured
        with profile(activities=[ProfilerActivity.CUDA]) as profiler:
            _, times = timed_generate(model, inputs, new_tokens)
        kernels = {e.key: (e.count, e.self_device_time_total) for e in profiler.key_averages()
                   if e.device_type == torch.autograd.DeviceType.CUDA}  # fmt: skip
        return kernels, times

    decode, times = kernel_times(steps + 1)
    prefill, _ = kernel_times(1)
    per_token = {key: ((count - prefill.get(key, (0, 0))[0]) / steps, (us - prefill.get(key, (0, 0))[1]) / steps)
                 for key, (count, us) in decode.items()}  # fmt: skip
    gpu_ms = sum(us for _, us in per_token.values()) / 1e3
    wall_ms = (times[-1] - times[0]) / (len(times) - 1) * 1e3
    rows = [[key[:90], fmt(count, ".1f"), fmt(us / 1e3, ".3f")]
            for key, (count, us) in sorted(per_token.items(), key=lambda item: -item[1][1])[:15]]  # fmt: skip
    head = f"Wall {wall_ms:.2f} ms per token; GPU kernels {gpu_ms:.2f} ms per token ({steps} decode steps)."
    table = markdown_table(["kernel", "launches per token", "ms per token"], rows)
    return head + "\n\n" + table, {"wall_ms_per_token": wall_ms, "gpu_ms_per_token": gpu_ms}


def prefill_table(models: dict, lengths: list[int]) -> tuple[str, dict]:
    rows, data = [], {}
    for name in ("builtin", "ours"):
        for length in lengths:

            def run():
                inputs = prompt(1, length)
                free_memory()
                torch.cuda.reset_peak_memory_stats()
                seconds, _ = timed_generate(models[name], inputs, 1)
                return {"seconds": seconds, "peak_gib": torch.cuda.max_memory_allocated() / 2**30}

            guarded(run)  # warm-up (kernels' first launch)
            result = guarded(run)
            data[f"{name} {length}"] = result
            if isinstance(result, str):
                rows.append([name, f"{length:,}", result, "-"])
            else:
                rows.append([name, f"{length:,}", fmt(result["seconds"]), fmt(result["peak_gib"], ".1f")])
    return markdown_table(["model", "prompt tokens", "seconds (generate, 1 token)", "peak GiB"], rows), data


def cold_start(quick: bool, quantized: bool) -> None:
    """In this fresh process: build, then time model-ready to first generated token of an 8k prompt."""
    model = build_ours(quick, quantized)
    inputs = prompt(1, 1024 if quick else 8192)
    torch.cuda.synchronize()
    seconds, times = timed_generate(model, inputs, 1)
    print(f"COLD_START {times[0]:.3f}", flush=True)


def cold_start_table(quick: bool) -> tuple[str, dict]:
    rows, data = [], {}
    for quantized in (False, True):
        with tempfile.TemporaryDirectory() as caches:
            environment_vars = {**os.environ, "TRITON_CACHE_DIR": f"{caches}/triton",
                                "TORCHINDUCTOR_CACHE_DIR": f"{caches}/inductor"}  # fmt: skip
            for run in ("empty caches (first process)", "caches of the first process"):
                command = [sys.executable, __file__, "--cold-start"] + (["--quick"] if quick else [])
                command += ["--quantized"] if quantized else []
                done = subprocess.run(command, env=environment_vars, capture_output=True, text=True, timeout=400)
                lines = [line for line in done.stdout.splitlines() if line.startswith("COLD_START")]
                seconds = float(lines[-1].split()[1]) if lines else f"error: {done.stderr[-300:]}"
                label = "384 NVFP4/MXFP8 experts" if quantized else "64 BF16 experts"
                data[f"{label}, {run}"] = seconds
                rows.append([label, run, fmt(seconds, ".2f")])
    return markdown_table(["model", "process", "model ready -> first token (s)"], rows), data


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", default=os.environ.get("OUT", "."))
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--cold-start", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--quantized", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--skip", nargs="*", default=[], choices=["decode", "prefill", "cold"])
    args = parser.parse_args()
    if args.cold_start:
        cold_start(args.quick, args.quantized)
        return

    sections, data = [f"# User path ({environment()})"], {}
    if "cold" not in args.skip:  # first, before this process fills the caches
        table, data["cold_start"] = cold_start_table(args.quick)
        sections += ["## Cold start: model ready -> first token of an 8k prompt, fresh process", table]
    ours = build_ours(args.quick)
    models = {"ours": ours, "builtin": build_builtin(ours)}
    if "decode" not in args.skip:
        table = decode_table_with_quantized(models, args.quick, data)
        sections += [f"## Decode: {PROMPT:,}-token prompt, {NEW_TOKENS} new tokens, greedy", table]
        breakdown = guarded(lambda: step_breakdown(ours))
        table, data["step_breakdown"] = breakdown if isinstance(breakdown, tuple) else (breakdown, None)
        sections += ["## Where a default batch-1 step's time goes (torch.profiler)", table]
    if "prefill" not in args.skip:
        lengths = [1024, 4096] if args.quick else [8192, 32768, 131072]
        table, data["prefill"] = prefill_table(models, lengths)
        sections += ["## Prefill through plain generate()", table]
    write_report(args.out, "user_path", "\n\n".join(sections), data)


def decode_table_with_quantized(models: dict, quick: bool, data: dict) -> str:
    """The decode table; the eager reference switches ours' backend for its rows only, and the quantized model is
    built for its rows and dropped after."""
    quantized = build_ours(quick, quantized=True)
    models["quantized"] = quantized
    original = models["ours"].config._attn_implementation

    class EagerView:
        """Ours with `attn_implementation="eager"` for the duration of each generate() call."""

        def generate(self, **kwargs):
            models["ours"].set_attn_implementation("eager")
            try:
                return models["ours"].generate(**kwargs)
            finally:
                models["ours"].set_attn_implementation(original)

    models["ours-eager"] = EagerView()
    table, data["decode"] = decode_table(models, [1, 8])
    del models["quantized"], quantized
    free_memory()
    return table


if __name__ == "__main__":
    main()
