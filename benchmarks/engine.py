"""`Inkling2Engine` by itself (no HTTP, no tokenizer): what continuous batching gives per concurrency level, and where
a step's time goes. The serving benchmark (`serving.py`) measures the same through `inkling2 serve`; this one
isolates the engine.

The model: on a GPU the 6-layer full-width slice of Inkling-2-Small with 384 random NVFP4 / MXFP8 experts
(`user_path.build_ours(quick=False, quantized=True)`); on CPU the embedded tiny model. Each level submits C requests
at once (random prompts of --prompt-tokens, greedy, --output-tokens each) and steps the engine until all finish:
- aggregate output tokens/s: all generated tokens / wall time of the level;
- per-user tokens/s: the mean over requests of (tokens after the first) / (time of the last - time of the first);
- TTFT p50 / p99: submission -> the step that returned the request's first token;
- decode step ms: the mean wall time of steps that only decoded (no prompt chunk), i.e. at C rows.
A warm-up level runs first with the same shapes (CUDA graphs captured there).

    python3 benchmarks/engine.py --out $OUT [--concurrency 1 4 16 64] [--prompt-tokens 1024] [--output-tokens 256]
"""

from __future__ import annotations

import argparse
import platform
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from attention import environment, fmt, markdown_table, write_report  # noqa: E402


def build_model():
    if torch.cuda.is_available():
        from user_path import build_ours

        return build_ours(quick=False, quantized=True), "6-layer slice, 384 NVFP4/MXFP8 experts"
    from transformers_inkling2.tiny import build_tiny_causal_lm

    return build_tiny_causal_lm().eval(), "embedded tiny model"


def run_level(engine, concurrency: int, prompt_tokens: int, output_tokens: int, seed: int) -> dict:
    from transformers_inkling2.engine import SamplingParams

    generator = torch.Generator().manual_seed(seed)
    vocab = min(engine.text_config.vocab_size, 200_000)
    submitted, first, last, counts = {}, {}, {}, {}
    start = time.perf_counter()
    for _ in range(concurrency):
        prompt = torch.randint(0, vocab, (prompt_tokens,), generator=generator).tolist()
        request = engine.add_request(prompt, SamplingParams(max_new_tokens=output_tokens))
        submitted[request], counts[request] = time.perf_counter(), 0
    decode_steps = []
    while engine.has_unfinished():
        step_start = time.perf_counter()
        prefilling = any(not s.decoding for s in engine.scheduler.running) or engine.num_waiting
        outputs = engine.step()
        now = time.perf_counter()
        if not prefilling:
            decode_steps.append(now - step_start)
        for output in outputs:
            if output.new_token_ids:
                first.setdefault(output.request_id, now)
                last[output.request_id] = now
                counts[output.request_id] += len(output.new_token_ids)
    wall = time.perf_counter() - start
    ttft = sorted(first[r] - submitted[r] for r in submitted)
    per_user = [(counts[r] - 1) / (last[r] - first[r]) for r in submitted if last[r] > first[r]]
    return {
        "concurrency": concurrency,
        "aggregate_tokens_per_s": sum(counts.values()) / wall,
        "per_user_tokens_per_s": sum(per_user) / len(per_user),
        "ttft_p50_s": ttft[len(ttft) // 2],
        "ttft_p99_s": ttft[min(len(ttft) - 1, round(0.99 * (len(ttft) - 1)))],
        "decode_step_ms": 1e3 * sum(decode_steps) / len(decode_steps) if decode_steps else None,
        "wall_s": wall,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", default=None)
    parser.add_argument("--concurrency", type=int, nargs="+", default=[1, 4, 16, 64])
    parser.add_argument("--prompt-tokens", type=int, default=None)
    parser.add_argument("--output-tokens", type=int, default=None)
    parser.add_argument("--max-step-tokens", type=int, default=2048)
    args = parser.parse_args()
    gpu = torch.cuda.is_available()
    prompt_tokens = args.prompt_tokens or (1024 if gpu else 128)
    output_tokens = args.output_tokens or (256 if gpu else 32)

    from transformers_inkling2.engine import Inkling2Engine

    model, label = build_model()
    engine = Inkling2Engine(
        model, max_num_seqs=max(args.concurrency), max_model_len=prompt_tokens + output_tokens + 64,
        max_step_tokens=args.max_step_tokens,
    )  # fmt: skip
    if torch.cuda.is_available():
        engine.warm_up()
    rows = []
    for concurrency in args.concurrency:
        run_level(engine, concurrency, prompt_tokens, min(output_tokens, 16), seed=1)  # warm-up: graphs, kernels
        result = run_level(engine, concurrency, prompt_tokens, output_tokens, seed=2)
        rows.append(result)
        print(result, flush=True)
    base = rows[0]
    table = markdown_table(
        ["concurrency", "aggregate tok/s", "x c1", "per-user tok/s", "% of c1", "TTFT p50 s", "TTFT p99 s",
         "decode step ms"],
        [[r["concurrency"], fmt(r["aggregate_tokens_per_s"]),
          fmt(r["aggregate_tokens_per_s"] / base["aggregate_tokens_per_s"]), fmt(r["per_user_tokens_per_s"]),
          fmt(100 * r["per_user_tokens_per_s"] / base["per_user_tokens_per_s"]), fmt(r["ttft_p50_s"], ".3f"),
          fmt(r["ttft_p99_s"], ".3f"), fmt(r["decode_step_ms"])] for r in rows],
    )  # fmt: skip
    header = (
        f"# Inkling2Engine by itself: {label}, {prompt_tokens} prompt tokens, {output_tokens} output tokens, greedy, "
        f"max_step_tokens {args.max_step_tokens}\n\n{environment() if gpu else platform.processor() or 'CPU'}\n"
    )
    write_report(args.out, "engine", header + "\n" + table + "\n", {"rows": rows, "label": label})


if __name__ == "__main__":
    main()
