"""Prefill speed of Inkling2 attention on one GPU: our backends next to transformers' built-in `inkling2`.

Two parts, both at Inkling-2-Small attention width (48 q / 8 kv heads, head_dim 128, window 1024, relative
extent 1024, d_rel 16):

1. Attention only, one call of one layer (batch 1, bf16) at 8k and 32k tokens: `inkling2_flex` on a full layer
   (band with bias + far part, LSE merge with the sink) and on a sliding layer, `inkling2_triton` (our fused
   kernel, bias read in-tile) on both; next to it FlexAttention without
   bias or sink on the same masks, PyTorch SDPA causal without bias (flash / cuDNN), and our eager reference.
   TFLOP/s count 4 * B * H * Q * K_visible * D (K_visible summed over the queries; no FLOPs for masked keys).
2. A 6-layer slice of the model (5 sliding + 1 full layer, hidden 4608, BF16 experts but only
   `--experts` of them (default 16, top-8) so both models fit beside each other): prefill tokens/s of the decoder
   (no lm_head) at 2k, 8k, 32k, 128k and then doubling until it no longer fits (for `--longest-backend`), for
   ours (`inkling2_flex` and `inkling2_triton`, chunked when the config has `prefill_chunk_size`) and the
   built-in (eager; the oracle), all on the same weights; with the peak memory of each run.

    python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .whl/*.whl
    export PYTHONPATH=$PWD/src:/tmp/site
    python3 benchmarks/attention.py [--quick] [--out DIR] [--experts 16] [--max-tokens 524288]

Prints markdown tables and writes `attention.md` (+ `attention.json`) under --out (default $OUT, else ./). Every
measurement is OOM-safe: a run that does not fit is reported as "OOM" and the benchmark moves on.
"""

from __future__ import annotations

import argparse
import datetime
import gc
import inspect
import json
import os
import re
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "src"))

HEADS, KV_HEADS, HEAD_DIM, WINDOW, EXTENT, D_REL = 48, 8, 128, 1024, 1024, 16
DEVICE = "cuda"
OOM = "OOM"


# --- shared helpers (also used by benchmarks/decode.py) ------------------------------------------------------------


def free_memory() -> None:
    gc.collect()
    torch.cuda.empty_cache()


def guarded(fn):
    """fn() or "OOM" when it does not fit (or "error: ..." for anything else, so one failure never stops a run)."""
    try:
        return fn()
    except torch.cuda.OutOfMemoryError:
        free_memory()
        return OOM
    except RuntimeError as error:  # cuBLAS / cuDNN allocation failures arrive as RuntimeError
        free_memory()
        print(f"guarded: {type(error).__name__}: {str(error)[:400]}", file=sys.stderr, flush=True)
        if "out of memory" in str(error).lower() or "alloc" in str(error).lower():
            return OOM
        return f"error: {type(error).__name__}: {str(error)[:160]}"
    except Exception as error:  # noqa: BLE001  (report it in the table)
        free_memory()
        return f"error: {type(error).__name__}: {str(error)[:160]}"


def cuda_ms(fn, warmup: int = 1, repeats: int = 3) -> float:
    """Median milliseconds of fn() over `repeats` timed calls after `warmup` untimed ones."""
    for _ in range(warmup):
        fn()
    torch.cuda.synchronize()
    times = []
    for _ in range(repeats):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        torch.cuda.synchronize()
        times.append(start.elapsed_time(end))
    return sorted(times)[len(times) // 2]


def peak_gib(fn):
    """(result of fn(), peak GPU memory in GiB during it)."""
    free_memory()
    torch.cuda.reset_peak_memory_stats()
    result = fn()
    torch.cuda.synchronize()
    return result, torch.cuda.max_memory_allocated() / 2**30


def fmt(value, spec: str = ".2f") -> str:
    if isinstance(value, str):
        return value
    return "-" if value is None else format(value, spec)


def markdown_table(headers: list[str], rows: list[list]) -> str:
    lines = ["| " + " | ".join(headers) + " |", "|" + "---|" * len(headers)]
    lines += ["| " + " | ".join(str(cell) for cell in row) + " |" for row in rows]
    return "\n".join(lines)


def timing_table(results: list[dict]) -> str:
    """Rows of {shape, rows, path, us, share (of the copy bandwidth)} as a markdown table."""
    cells = [[r["shape"], r["rows"], r["path"], f"{r['us']:.1f}", f"{100 * r['share']:.0f}"] for r in results]
    return markdown_table(["shape", "rows", "path", "us", "% of copy bandwidth"], cells)


def environment() -> str:
    """The GPU, versions, time, and the package's environment switches that change what a step runs, where set."""
    props = torch.cuda.get_device_properties(0)
    import transformers

    from transformers_inkling2.backends import dependent_launch, kernel_loading, key_value_step, residual_mix
    from transformers_inkling2.backends.attention import step

    names = (dependent_launch.ENV, step.ENV, key_value_step.ENV, residual_mix.ENV, kernel_loading.TERMS_ENV)
    switches = "".join(f", {name}={os.environ[name]}" for name in names if name in os.environ)
    return (
        f"{props.name} ({props.total_memory / 2**30:.0f} GiB), torch {torch.__version__}, transformers "
        f"{transformers.__version__}, {datetime.datetime.now(datetime.UTC):%Y-%m-%d %H:%M} UTC{switches}"
    )


def write_report(out_dir: str, name: str, text: str, data) -> None:
    print(text, flush=True)
    try:
        path = Path(out_dir)
        path.mkdir(parents=True, exist_ok=True)
        (path / f"{name}.md").write_text(text + "\n")
        (path / f"{name}.json").write_text(json.dumps(data, indent=1, default=str))
    except OSError as error:
        print(f"could not write the report under {out_dir}: {error}", file=sys.stderr)


def slice_config_fields(experts: int, layers: int = 6) -> dict:
    """Full-width Inkling-2-Small layers with fewer experts and a small vocabulary: 5 sliding + 1 full layer."""
    return dict(
        hidden_size=4608,
        num_hidden_layers=layers,
        num_attention_heads=HEADS,
        num_key_value_heads=KV_HEADS,
        head_dim=HEAD_DIM,
        swa_num_attention_heads=HEADS,
        swa_num_key_value_heads=KV_HEADS,
        swa_head_dim=HEAD_DIM,
        sliding_window_size=WINDOW,
        rel_extent=EXTENT,
        d_rel=D_REL,
        moe_intermediate_size=2304,
        n_routed_experts=experts,
        num_experts_per_tok=8,
        vocab_size=8192,
        unpadded_vocab_size=8000,
        max_position_embeddings=1 << 21,
        eos_token_id=None,
    )


def gpu_randomize_(model: torch.nn.Module, seed: int = 0, std: float = 0.02) -> torch.nn.Module:
    """Like `tiny.randomize_` but drawn on the GPU (billions of parameters): every float tensor ~ N(0, std),
    norm weights and learned scales around 1, so no part of the model is inert."""
    generator = torch.Generator(device=DEVICE).manual_seed(seed)
    with torch.no_grad():
        for name, tensor in [*model.named_parameters(), *model.named_buffers()]:
            if tensor.is_floating_point():
                tensor.normal_(0.0, std, generator=generator)
                if re.search(r"(l2_clip\.scale|norm[^.]*\.weight)$", name):
                    tensor.add_(1.0)
    return model


def build_models(experts: int, with_oracle: bool = True, attn_implementation: str = "inkling2_flex"):
    """(ours, built-in or None): Inkling2ForCausalLM slices in bf16 on the GPU with equal random weights; the
    modules the original keeps in fp32 stay fp32 in both."""
    import transformers_inkling2  # noqa: F401  (registers our classes and backends)
    from transformers_inkling2 import Inkling2ForCausalLM, Inkling2TextConfig

    fields = slice_config_fields(experts)

    def construct(build):
        previous = torch.get_default_dtype()
        torch.set_default_dtype(torch.bfloat16)
        try:
            with torch.device(DEVICE):
                model = build()
        finally:
            torch.set_default_dtype(previous)
        keep = model._keep_in_fp32_modules_strict
        for name, tensor in [*model.named_parameters(), *model.named_buffers()]:
            if tensor.is_floating_point() and any(pattern in name for pattern in keep):
                tensor.data = tensor.data.float()
        return model.eval()

    config = Inkling2TextConfig(**fields)
    config._attn_implementation = attn_implementation
    ours = gpu_randomize_(construct(lambda: Inkling2ForCausalLM(config)))
    oracle = None
    if with_oracle:
        from transformers.models.inkling2 import (
            configuration_inkling2 as builtin_config,
        )
        from transformers.models.inkling2 import modeling_inkling2 as builtin

        oracle_config = builtin_config.Inkling2TextConfig(**fields)
        oracle_config._attn_implementation = "eager"
        oracle = construct(lambda: builtin.Inkling2ForCausalLM(oracle_config))
        oracle.load_state_dict(ours.state_dict(), strict=True)
    return ours, oracle


def prefill_chunking(model, chunk: int):
    """How our model can prefill in chunks, if it can: a config field or a forward argument named
    `prefill_chunk_size` (None when neither exists: plain prefill)."""
    if hasattr(model.config, "prefill_chunk_size"):
        model.config.prefill_chunk_size = chunk
        return "config"
    if "prefill_chunk_size" in inspect.signature(model.model.forward).parameters:
        return "argument"
    return None


# --- part 1: attention only ----------------------------------------------------------------------------------------


def visible_pairs(tokens: int, window: int | None) -> int:
    if window is None:
        return tokens * (tokens + 1) // 2
    return sum(min(i + 1, window) for i in range(tokens))


def attention_inputs(tokens: int, generator) -> dict:
    """Inputs with the model's magnitudes: clipped queries/keys (norm about 16), RMS-normalized values; relative
    logits from 16-dim states and a bank, in the layout the model's projection gives them (`aligned_product`)."""
    from transformers_inkling2.backends.attention.relative_logits import aligned_product

    def randn(*shape, scale=1.0):
        return torch.randn(shape, generator=generator, device=DEVICE, dtype=torch.bfloat16) * scale

    positions = torch.arange(tokens, device=DEVICE)
    return dict(
        query=randn(1, HEADS, tokens, HEAD_DIM, scale=1.4),
        key=randn(1, KV_HEADS, tokens, HEAD_DIM, scale=1.4),
        value=randn(1, KV_HEADS, tokens, HEAD_DIM),
        relative_logits=aligned_product(randn(1, HEADS, tokens, D_REL), randn(D_REL, EXTENT, scale=0.25)),
        sinks=randn(1, HEADS, tokens),
        query_positions=positions,
        key_positions=positions,
        key_padding=None,
    )


def attention_microbenchmark(lengths: list[int], repeats: int) -> list[dict]:
    from torch.nn.attention import SDPBackend, sdpa_kernel
    from torch.nn.attention.flex_attention import flex_attention

    from transformers_inkling2.backends.attention.flex import (
        distance_block_mask,
        inkling2_flex_attention,
        inkling2_triton_attention,
    )
    from transformers_inkling2.modeling.attention import eager_attention

    compiled_flex = torch.compile(flex_attention, dynamic=True, fullgraph=True)
    generator = torch.Generator(device=DEVICE).manual_seed(0)
    rows = []
    for tokens in lengths:
        inputs = guarded(lambda: attention_inputs(tokens, generator))
        if isinstance(inputs, str):
            rows.append(dict(tokens=tokens, layer="-", method="inputs", ms=inputs))
            continue
        query, key, value = inputs["query"], inputs["key"], inputs["value"]
        offset = torch.zeros((), dtype=torch.long, device=DEVICE)
        for layer, window in (("full", None), ("sliding", WINDOW)):
            flops = 4 * HEADS * visible_pairs(tokens, window) * HEAD_DIM

            def ours():
                return inkling2_flex_attention(**inputs, sliding_window=window, scaling=HEAD_DIM**-0.5)

            def ours_triton():
                return inkling2_triton_attention(**inputs, sliding_window=window, scaling=HEAD_DIM**-0.5)

            def flex_plain():
                mask = distance_block_mask(offset, tokens, tokens, 0, window, None)
                return compiled_flex(query, key, value, block_mask=mask, scale=HEAD_DIM**-0.5, enable_gqa=True,
                                     kernel_options={"FORCE_USE_FLEX_ATTENTION": True})

            def eager():
                return eager_attention(**inputs, sliding_window=window, scaling=HEAD_DIM**-0.5)

            methods = [("inkling2_flex (bias + sink)", ours), ("inkling2_triton (bias in-tile + sink)", ours_triton),
                       ("flex, no bias / sink", flex_plain)]
            if layer == "full":
                wide_key = key.repeat_interleave(HEADS // KV_HEADS, 1)
                wide_value = value.repeat_interleave(HEADS // KV_HEADS, 1)

                def sdpa():
                    backends = [SDPBackend.FLASH_ATTENTION, SDPBackend.CUDNN_ATTENTION, SDPBackend.EFFICIENT_ATTENTION]
                    with sdpa_kernel(backends):
                        return F.scaled_dot_product_attention(query, wide_key, wide_value, is_causal=True)

                methods.append(("SDPA causal, no bias / sink", sdpa))
            if tokens <= 8192:
                methods.append(("eager reference", eager))
            for method, fn in methods:
                result = guarded(lambda: peak_gib(lambda: cuda_ms(fn, warmup=2, repeats=repeats)))
                ms, peak = (result, None) if isinstance(result, str) else result
                row = dict(tokens=tokens, layer=layer, method=method, ms=ms, peak_gib=peak,
                           tflops=None if isinstance(ms, str) else flops / ms / 1e9)
                rows.append(row)
                print(json.dumps(row), flush=True)
            wide_key = wide_value = None
        inputs = query = key = value = None
        free_memory()
    return rows


# --- part 2: model slice prefill -----------------------------------------------------------------------------------


def prefill_benchmark(args) -> tuple[list[dict], str]:
    ours, oracle = build_models(args.experts, with_oracle=not args.no_oracle)
    chunking = prefill_chunking(ours, args.chunk)
    generator = torch.Generator(device=DEVICE).manual_seed(1)

    def run(model, tokens, chunked):
        input_ids = torch.randint(0, 8000, (1, tokens), device=DEVICE, generator=generator)
        kwargs = dict(use_cache=False)
        if chunked and chunking == "argument":
            kwargs = dict(prefill_chunk_size=args.chunk)
        if chunked:
            kwargs["use_cache"] = True  # a chunked prefill keeps the keys of earlier chunks in the cache

        def forward():
            with torch.no_grad():
                return model.model(input_ids, **kwargs).last_hidden_state

        return forward

    rows = []
    # warm-up: compiles the flex kernels once (dynamic shapes: later lengths reuse them)
    started = time.time()
    warm = guarded(lambda: run(ours, 2048, chunking is not None)())
    print(f"warm-up (compilation) {time.time() - started:.1f} s: {'ok' if not isinstance(warm, str) else warm}")
    warm = None

    lengths = list(args.lengths)
    candidates = [(f"ours ({backend})", ours, chunking is not None, backend)
                  for backend in ("inkling2_flex", "inkling2_triton")]
    if oracle is not None:
        candidates.append(("built-in inkling2 (eager)", oracle, False, None))
    for name, model, chunked, backend in candidates:
        if backend is not None:
            model.config._attn_implementation = backend
        fitted_last = True
        for tokens in lengths:
            if not fitted_last and model is oracle:
                rows.append(dict(model=name, tokens=tokens, ms=OOM, note="skipped after OOM"))
                continue
            result = guarded(lambda: peak_gib(lambda: cuda_ms(run(model, tokens, chunked), 1 if tokens <= 32768 else 0,
                                                              args.repeats if tokens <= 32768 else 1)))
            ms, peak = (result, None) if isinstance(result, str) else result
            fitted_last = not isinstance(ms, str)
            rows.append(dict(model=name, tokens=tokens, ms=ms, peak_gib=peak,
                             tokens_per_s=None if isinstance(ms, str) else tokens / ms * 1e3))
            print(json.dumps(rows[-1]), flush=True)
        if model is ours and not args.quick and backend == args.longest_backend:
            # the longest prefill that fits: double until OOM, the limit, or a run over the time budget
            tokens, last_seconds = max(lengths) * 2, 0.0
            while tokens <= args.max_tokens and last_seconds < args.longest_budget_s / 4:
                result = guarded(lambda: peak_gib(lambda: cuda_ms(run(model, tokens, chunked), 0, 1)))
                ms, peak = (result, None) if isinstance(result, str) else result
                rows.append(dict(model=name, tokens=tokens, ms=ms, peak_gib=peak, note="longest search",
                                 tokens_per_s=None if isinstance(ms, str) else tokens / ms * 1e3))
                print(json.dumps(rows[-1]), flush=True)
                if isinstance(ms, str):
                    break
                last_seconds, tokens = ms / 1e3, tokens * 2
        free_memory()
    ours = oracle = None
    free_memory()
    description = {None: "plain (no `prefill_chunk_size` in this version)", "config": f"chunked, "
                   f"`config.prefill_chunk_size={args.chunk}`", "argument": f"chunked, `prefill_chunk_size={args.chunk}`"}
    return rows, description[chunking]


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", default=os.environ.get("OUT", "."))
    parser.add_argument("--quick", action="store_true", help="8k attention only; prefill at 2k and 8k")
    parser.add_argument("--experts", type=int, default=16, help="routed experts per layer in the slice (top-8)")
    parser.add_argument("--chunk", type=int, default=16384, help="prefill chunk, when our model supports it")
    parser.add_argument("--max-tokens", type=int, default=1 << 19, help="upper end of the longest-prefill search")
    parser.add_argument("--longest-budget-s", type=float, default=120.0)
    parser.add_argument("--longest-backend", default="inkling2_flex", choices=("inkling2_flex", "inkling2_triton"),
                        help="the backend whose longest prefill is searched")
    parser.add_argument("--no-oracle", action="store_true")
    parser.add_argument("--skip-model", action="store_true", help="attention microbenchmark only")
    parser.add_argument("--skip-attention", action="store_true", help="model slice prefill only")
    args = parser.parse_args()
    if not torch.cuda.is_available():
        sys.exit("benchmarks/attention.py needs a CUDA GPU")
    args.lengths = [2048, 8192] if args.quick else [2048, 8192, 32768, 131072]
    args.repeats = 2 if args.quick else 3
    started = time.time()

    attention_rows = [] if args.skip_attention else attention_microbenchmark(
        [8192] if args.quick else [8192, 32768], args.repeats
    )
    report = [f"# Inkling2 attention prefill benchmark\n\n{environment()}; command: `python3 benchmarks/attention.py"
              f"{' --quick' if args.quick else ''}`\n",
              "## One attention call (batch 1, bf16, 48 q / 8 kv heads, head_dim 128, window = extent = 1024)\n",
              "TFLOP/s = 4 * H * Q * K_visible * D / time (visible keys only).\n",
              markdown_table(["tokens", "layer", "method", "ms", "TFLOP/s", "peak GiB"],
                             [[r["tokens"], r["layer"], r["method"], fmt(r["ms"], ".3f"), fmt(r.get("tflops"), ".1f"),
                               fmt(r.get("peak_gib"), ".1f")] for r in attention_rows])]
    model_rows, chunking = [], "-"
    if not args.skip_model:
        model_rows, chunking = prefill_benchmark(args)
        report += [f"\n## Prefill of a 6-layer slice (5 sliding + 1 full, hidden 4608, {args.experts} BF16 experts, "
                   f"top-8; decoder only, batch 1)\n",
                   f"Ours: `inkling2_flex` and `inkling2_triton`, {chunking}. Built-in: transformers' `inkling2`, "
                   "eager (its only backend), same weights.\n",
                   markdown_table(["model", "tokens", "ms", "tokens/s", "peak GiB", "note"],
                                  [[r["model"], r["tokens"], fmt(r["ms"], ".1f"), fmt(r.get("tokens_per_s"), ".0f"),
                                    fmt(r.get("peak_gib"), ".1f"), r.get("note", "")] for r in model_rows])]
    report.append(f"\nTotal benchmark time {time.time() - started:.0f} s.")
    write_report(args.out, "attention", "\n".join(report),
                 dict(attention=attention_rows, prefill=model_rows, chunking=chunking, args=vars(args)))


if __name__ == "__main__":
    main()
