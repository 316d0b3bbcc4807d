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

`--breakdown` (GPU) then times the pieces of a step apart, each synchronized: a prompt chunk of one row, of two rows
one after the other and of two rows side by side, the decode forward (graph replay) at 1 and at the most rows,
choosing the rows' next tokens greedy without processors and with a logits processor of each row's own (as a
request's grammar is), and an engine step of the most rows decoding (prompts of their own); and writes the
host-device synchronizations of a prompt chunk and of a decode step, a cProfile of 30 decode steps and the profiler's
top kernels of one prompt chunk.

    python3 benchmarks/engine.py --out $OUT [--concurrency 1 4 16 64] [--prompt-tokens 1024] [--output-tokens 256]
        [--breakdown]
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


def synchronized_ms(fn, repeats: int = 5) -> float:
    """Median wall milliseconds of `fn()` with the GPU idle before and after."""
    times = []
    for _ in range(repeats + 1):
        torch.cuda.synchronize()
        start = time.perf_counter()
        fn()
        torch.cuda.synchronize()
        times.append(1e3 * (time.perf_counter() - start))
    return sorted(times[1:])[repeats // 2]


class BanToken:
    """A request's own logits processor (one masked fill per step), as a grammar's would be."""

    def __init__(self, token: int):
        self.token = token

    def __call__(self, input_ids: torch.Tensor, scores: torch.Tensor) -> torch.Tensor:
        return scores.index_fill(-1, torch.tensor([self.token], device=scores.device), float("-inf"))


@torch.inference_mode()
def breakdown(engine, prompt_tokens: int, rows: int) -> tuple[list[list], str]:
    """([piece, ms] rows, the profiler's kernel table of one prompt chunk); see the module docstring."""
    from transformers_inkling2.engine.requests import SamplingParams, Sequence
    from transformers_inkling2.engine.sampling import next_tokens

    # random tokens: a prompt of one repeated token would route every position to the same 8 experts
    vocab = min(engine.text_config.vocab_size, 200_000)
    prompt = torch.randint(0, vocab, (prompt_tokens,), generator=torch.Generator().manual_seed(3)).tolist()
    sequences = [Sequence(prompt, SamplingParams()) for _ in range(2)]
    for slot, sequence in enumerate(sequences):
        sequence.slot = slot

    def chunks(count):
        for sequence in sequences[:count]:
            engine._prefill([sequence], 0, prompt_tokens)

    pieces = [[f"prompt chunk, 1 row x {prompt_tokens}", synchronized_ms(lambda: chunks(1))],
              [f"prompt chunks, 2 rows x {prompt_tokens}, one after the other", synchronized_ms(lambda: chunks(2))],
              [f"prompt chunk, 2 rows x {prompt_tokens} side by side",
               synchronized_ms(lambda: engine._prefill(sequences, 0, prompt_tokens))]]  # fmt: skip
    engine.scheduler.running = [Sequence(prompt, SamplingParams()) for _ in range(rows)]
    for slot, sequence in enumerate(engine.scheduler.running):
        sequence.slot, sequence.computed = slot, prompt_tokens
    span = engine.key_span(1)
    for count in sorted({1, rows}):  # rows of different tokens (one token everywhere would read 8 experts a layer)
        ids = torch.arange(count, device=engine.device)[:, None] * 7919 + 11
        positions = torch.full((count, 1), prompt_tokens, device=engine.device)
        engine.run_decode(ids, positions, span)
        forward_ms = synchronized_ms(lambda: engine.run_decode(ids, positions, span))
        pieces.append([f"decode forward, {count} rows (graph)", forward_ms])
    logits = torch.randn(rows, engine.text_config.vocab_size, device=engine.device)
    greedy = [Sequence(prompt, SamplingParams()) for _ in range(rows)]
    own = [Sequence(prompt, SamplingParams(logits_processors=[BanToken(0)])) for _ in range(rows)]
    pieces.append([f"next tokens, {rows} greedy rows", synchronized_ms(lambda: next_tokens(greedy, logits))])
    own_ms = synchronized_ms(lambda: next_tokens(own, logits))
    pieces.append([f"next tokens, {rows} rows with a processor each", own_ms])
    engine.scheduler.running = []
    prefill_syncs = sync_points(lambda: chunks(1))
    for row in range(rows):  # prompts of their own: the rows then route to different experts, as users' do
        engine.add_request(prompt[row:] + prompt[:row], SamplingParams(max_new_tokens=200))
    while any(not s.decoding for s in engine.scheduler.running) or engine.num_waiting:
        engine.step()
    pieces.append([f"engine step, {rows} rows decoding (host and GPU)", synchronized_ms(engine.step, repeats=21)])
    step_syncs = sync_points(engine.step)
    import cProfile
    import io
    import pstats

    profiler = cProfile.Profile()
    profiler.runcall(lambda: [engine.step() for _ in range(30)])
    host = io.StringIO()
    pstats.Stats(profiler, stream=host).sort_stats("tottime").print_stats(18)
    for request_id in list(engine.sequences):
        engine.cancel(request_id)
    engine.step()
    diagnostics = (f"Host syncs in one prompt chunk: {prefill_syncs}\n\nHost syncs in one decode step: {step_syncs}\n\n"
                   f"cProfile of 30 decode steps ({rows} rows), by own time:\n\n```\n{host.getvalue()[-6000:]}\n```\n")  # fmt: skip
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as profile:
        chunks(1)
        torch.cuda.synchronize()
    table = profile.key_averages().table(sort_by="cuda_time_total", row_limit=25, max_name_column_width=70)
    for row in range(engine.cache.max_rows):
        engine.cache.reset_row(row)
    return pieces, diagnostics + "\nTop kernels of one prompt chunk:\n\n```\n" + table + "\n```\n"


def sync_points(fn) -> dict[str, int]:
    """{file:line in our code: count} of the host-device synchronizations `fn()` makes."""
    import warnings

    found: dict[str, int] = {}
    torch.cuda.set_sync_debug_mode("warn")
    try:
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            fn()
    finally:
        torch.cuda.set_sync_debug_mode(0)
    for warning in caught:
        if "synchroniz" in str(warning.message):
            where = f"{warning.filename}:{warning.lineno}"
            found[where] = found.get(where, 0) + 1
    return found


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", default=None)
    parser.add_argument("--concurrency", type=int, nargs="+", default=[1, 4, 16, 64])
    parser.add_argument("--prompt-tokens", type=int, default=None)
    parser.add_argument("--output-tokens", type=int, default=None)
    parser.add_argument("--max-step-tokens", type=int, default=2048)
    parser.add_argument("--breakdown", action="store_true", help="also time a step's pieces apart (GPU)")
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
    text, data = header + "\n" + table + "\n", {"rows": rows, "label": label}
    if args.breakdown and gpu:
        pieces, kernels = breakdown(engine, prompt_tokens, max(args.concurrency))
        text += "\n" + markdown_table(["piece", "ms"], [[name, fmt(ms)] for name, ms in pieces])
        text += f"\n\n{kernels}"
        print(text, flush=True)
        data["breakdown"] = pieces
    write_report(args.out, "engine", text, data)


if __name__ == "__main__":
    main()
