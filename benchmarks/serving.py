"""What clients of `inkling2 serve` get: throughput and latency of streamed chat completions at several
concurrency levels, measured on the client through the `openai` async client, with the server's own `/metrics`
beside them as a cross-check.

The server runs in this process (`Inkling2Server` in a background thread, a free port on loopback) over:
- on a GPU, the 6-layer full-width slice of Inkling-2-Small with 384 random NVFP4 / MXFP8 experts
  (`user_path.build_ours(quick=False, quantized=True)`) and the official tokenizer; with `--dspark`, also a drafter
  of the official shape (2 layers, block 7, tapping layers 0-4 of the slice) with random weights: it drafts tokens
  the random target rejects (acceptance about 0), so the DSpark rows measure the mechanism's cost, not its gain;
- on CPU, the embedded tiny random model (`build_tiny_causal_lm()`); with `--dspark`, the tiny multimodal model with
  its random drafter (`build_tiny_model(dspark=True)`).
With `--dspark` the model is served twice, DSpark off then on (`--dspark` of `inkling2 serve`: two servers, one after
the other, the same weights).

The weights are random, and a random model writes no block token (`<|content_text|>`, `<|content_thinking|>`): the
server's response parser would hold its text (it could be a tool's name) and release it in 256-character pieces. So
the model's replies are shaped (`TextBlockReplies`, a forward hook on the model; `--unshaped` leaves it out): after the
generation prompt's `<|message_model|>` its only choice is `<|content_text|>`, and it never writes another special
token, so every reply is a text block streamed token by token up to `max_tokens`, as a trained model's is (finish
reason `length`, as with vLLM's `ignore_eos`).

Each concurrency level (default 1, 4, 16, 64) keeps exactly C requests in flight (C client tasks, each sending its
next request when its last one ends) until N requests were sent (default max(4, 2 C)). Every request is a chat
completion with `temperature=0`, `max_tokens=--output-tokens`, `stream=True` and
`stream_options={"include_usage": True}`; its prompt is a passage of CPython's documentation (`pydoc_data`, offline),
a different one per request (seeded), trimmed to `--prompt-tokens` tokens after a one-line instruction. Two requests
warm each server up before anything is measured. Every request has a deadline (`--request-timeout`, whole request);
a request that fails or misses it is counted in the table's `failed` column and the run goes on.

Per level:
- aggregate output tokens/s: completion tokens of the successful requests (from `usage`) / the level's wall time
  (first request sent -> last request ended);
- per-user tokens/s: the mean over successful requests of (tokens in the token chunks after the first) / (arrival of
  the last token chunk - arrival of the first token chunk): the decode rate a user sees once the first token is
  there, the inverse of the request's mean ITL (a chunk's tokens: its text re-tokenized, at least 1; `serving.json`
  has their sum beside `usage`'s completion tokens; requests with one token chunk are left out);
- TTFT p50 / p99: request sent -> first chunk that carries content, reasoning or a tool call (the role-only first
  chunk does not count; a block's opening token reaches the client as no text, so this is the arrival of the
  first token of text: one decode step later than the server's own TTFT, which counts from that opening token);
- ITL p50 / p99: the gap before each later token chunk divided by the tokens in it (the chunk's text re-tokenized,
  at least 1; the server emits about one chunk per token, several when DSpark accepts a block), that value counted
  once per token, pooled over the level's requests. Tokens that reach the client as no text at all (markers the
  parser consumes) make the next gap longer;
- from the server's `/metrics`, the difference across the level: `inkling2:request_success_total` by finish reason
  and `inkling2:generation_tokens_total` (which should equal the client's completion tokens), and with DSpark its
  acceptance (accepted / drafted tokens).

`inkling2 serve` batches its requests continuously (`Inkling2Engine`, docs/engine.md), with the server's default
engine settings (`--max-num-seqs` at least the highest concurrency). The client runs in a child process (spawned
once; its own interpreter and GIL), as a real client runs elsewhere: in the server's process its parsing of every
streamed chunk would compete with the engine thread for the GIL (docs/benchmarks.md has both runs). The table's
"TTFT p50 after the first C" leaves out the opening burst (the first C requests of a level arrive at once and wait
for each other's prompts). The replies are noise (random weights).

CPU (small defaults: 128 prompt tokens, 32 output tokens; a couple of minutes):

    python benchmarks/serving.py --out /tmp/serving_bench [--concurrency 1 4] [--dspark]

GPU device:

    python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .whl/*.whl
    export PYTHONPATH=$PWD/src:/tmp/site
    python3 benchmarks/serving.py --out $OUT        # [--concurrency 1 4 16 64] [--requests-per-level N] [--dspark]

Prints markdown tables and writes `serving.md` (+ `serving.json`) under --out (default $OUT, else ./).
"""

from __future__ import annotations

import argparse
import asyncio
import datetime
import os
import platform
import random
import re
import sys
import time
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from attention import fmt, markdown_table, write_report  # noqa: E402

MODEL_ID = "inkling2-bench"
INSTRUCTION = "Summarize the following passage of the Python documentation in a few sentences.\n\n"
WARMUP_REQUESTS = 2


# ---------------------------------------------------------------------------------------------------------------
# Prompts


def documentation_paragraphs(seed: int) -> list[str]:
    """Paragraphs of CPython's documentation (the pydoc topics shipped with Python), in a seeded order."""
    from pydoc_data.topics import topics

    paragraphs = []
    for name in sorted(topics):
        for paragraph in re.split(r"\n\s*\n", topics[name]):
            text = paragraph.strip()
            if len(text) >= 80:
                paragraphs.append(text)
    random.Random(seed).shuffle(paragraphs)
    return paragraphs


class Prompts:
    """Prompt k: paragraphs from a seeded position on, joined and trimmed to `tokens` tokens of the tokenizer."""

    def __init__(self, tokenizer, tokens: int, seed: int):
        self.tokenizer, self.tokens = tokenizer, tokens
        self.paragraphs, self.seed = documentation_paragraphs(seed), seed
        self._made: dict[int, str] = {}

    def __getitem__(self, k: int) -> str:
        if k not in self._made:
            start = random.Random(f"{self.seed}-{k}").randrange(len(self.paragraphs))
            chosen, ids = [], []
            index = start
            while len(ids) < self.tokens and len(chosen) < len(self.paragraphs):
                chosen.append(self.paragraphs[index % len(self.paragraphs)])
                index += 1
                ids = self.tokenizer("\n\n".join(chosen), add_special_tokens=False)["input_ids"]
            self._made[k] = INSTRUCTION + self.tokenizer.decode(ids[: self.tokens])
        return self._made[k]


# ---------------------------------------------------------------------------------------------------------------
# One request, one level


@dataclass
class RequestResult:
    sent: float
    ended: float = 0.0
    chunks: list[tuple[float, str]] = field(default_factory=list)  # (arrival, text) of each token chunk
    completion_tokens: int | None = None
    prompt_tokens: int | None = None
    finish_reason: str | None = None
    error: str | None = None

    @property
    def ok(self) -> bool:
        return self.error is None and bool(self.chunks)


def chunk_text(delta) -> str | None:
    """The text a streamed delta carries (content, reasoning or tool call arguments), None for none."""
    if delta is None:
        return None
    parts = [delta.content or ""]
    extra = getattr(delta, "model_extra", None) or {}
    parts.append(extra.get("reasoning_content") or getattr(delta, "reasoning_content", None) or "")
    for call in delta.tool_calls or []:
        function = getattr(call, "function", None)
        parts.append((getattr(function, "name", None) or "") + (getattr(function, "arguments", None) or ""))
    text = "".join(parts)
    return text or (None if not delta.tool_calls else " ")


async def one_request(client, prompt: str, output_tokens: int, timeout: float) -> RequestResult:
    result = RequestResult(sent=time.perf_counter())

    async def stream_it():
        stream = await client.chat.completions.create(
            model=MODEL_ID,
            messages=[{"role": "user", "content": prompt}],
            max_tokens=output_tokens,
            temperature=0,
            stream=True,
            stream_options={"include_usage": True},
        )
        try:
            async for chunk in stream:
                now = time.perf_counter()
                if chunk.usage is not None:
                    result.completion_tokens = chunk.usage.completion_tokens
                    result.prompt_tokens = chunk.usage.prompt_tokens
                for choice in chunk.choices:
                    if choice.finish_reason:
                        result.finish_reason = choice.finish_reason
                    text = chunk_text(choice.delta)
                    if text:
                        result.chunks.append((now, text))
        finally:
            await stream.close()

    try:
        await asyncio.wait_for(stream_it(), timeout)
        if not result.chunks:
            result.error = "no tokens"
    except TimeoutError:
        result.error = f"timeout ({timeout:.0f} s)"
    except Exception as error:  # noqa: BLE001  (counted and reported, never stops the run)
        result.error = f"{type(error).__name__}: {str(error)[:120]}"
    result.ended = time.perf_counter()
    return result


async def run_level(client, texts: list[str], concurrency: int, output_tokens: int,
                    timeout: float) -> tuple[list[RequestResult], float]:  # fmt: skip
    """One request per prompt text, `concurrency` of them in flight at any time; (results, wall seconds)."""
    queue = list(range(len(texts)))
    results: list[RequestResult | None] = [None] * len(texts)

    async def user():
        while queue:
            k = queue.pop(0)
            results[k] = await one_request(client, texts[k], output_tokens, timeout)

    start = time.perf_counter()
    await asyncio.gather(*(user() for _ in range(min(concurrency, len(texts)))))
    return results, time.perf_counter() - start


async def drive(base_url: str, texts: list[str], concurrency: int, output_tokens: int, timeout: float):
    """One level from the client's side: (results, wall seconds, /metrics before, /metrics after)."""
    import openai

    client = openai.AsyncOpenAI(base_url=base_url, api_key="unused", max_retries=0, timeout=timeout)
    root = base_url.removesuffix("/v1")
    try:
        before = await server_metrics(client, root)
        results, wall = await run_level(client, texts, concurrency, output_tokens, timeout)
        after = await server_metrics(client, root)
    finally:
        await client.close()
    return results, wall, before, after


def client_level(*args):
    """`drive` in the client process (a spawned child of this script: its own interpreter and GIL)."""
    return asyncio.run(drive(*args))


# ---------------------------------------------------------------------------------------------------------------
# Statistics


def percentile(values: list[float], q: float) -> float | None:
    if not values:
        return None
    import numpy

    return float(numpy.percentile(values, q))


def level_stats(results: list[RequestResult], wall: float, tokenizer, concurrency: int) -> dict:
    """The level's numbers (module docstring); requests are in the order they were sent, so those after the first
    `concurrency` are the ones that arrived one by one as others ended, not in the opening burst."""
    good = [r for r in results if r.ok]
    after_burst = [r.chunks[0][0] - r.sent for r in results[concurrency:] if r.ok]
    failures: dict[str, int] = {}
    for r in results:
        if not r.ok:
            kind = (r.error or "no tokens").split(":")[0]
            failures[kind] = failures.get(kind, 0) + 1
    completion = [r.completion_tokens if r.completion_tokens is not None else len(r.chunks) for r in good]
    ttft = [r.chunks[0][0] - r.sent for r in good]
    per_user, itl, retokenized = [], [], 0
    for r in good:
        counts = [max(1, len(tokenizer(text, add_special_tokens=False)["input_ids"])) for _, text in r.chunks]
        retokenized += sum(counts)
        if len(r.chunks) >= 2 and r.chunks[-1][0] > r.chunks[0][0]:
            per_user.append(sum(counts[1:]) / (r.chunks[-1][0] - r.chunks[0][0]))
        for (before, _), (now, _), count in zip(r.chunks, r.chunks[1:], counts[1:]):
            itl += [(now - before) / count] * count
    return {
        "requests": len(results),
        "ok": len(good),
        "failed": len(results) - len(good),
        "failures": failures,
        "first_errors": [r.error for r in results if not r.ok][:3],
        "wall_s": wall,
        "completion_tokens": sum(completion),
        "retokenized_chunk_tokens": retokenized,
        "token_chunks": sum(len(r.chunks) for r in good),
        "usage_missing": sum(r.completion_tokens is None for r in good),
        "mean_completion_tokens": sum(completion) / len(good) if good else None,
        "mean_prompt_tokens": (sum(r.prompt_tokens or 0 for r in good) / len(good)) if good else None,
        "aggregate_tokens_per_s": sum(completion) / wall if wall > 0 else None,
        "per_user_tokens_per_s": sum(per_user) / len(per_user) if per_user else None,
        "ttft_p50_s": percentile(ttft, 50),
        "ttft_p99_s": percentile(ttft, 99),
        "ttft_after_burst_p50_s": percentile(after_burst, 50),
        "itl_p50_ms": None if not itl else percentile(itl, 50) * 1e3,
        "itl_p99_ms": None if not itl else percentile(itl, 99) * 1e3,
        "finish_reasons": dict(Counter(str(r.finish_reason) for r in good)),
    }


SAMPLE = re.compile(r"^([A-Za-z_:][\w:]*)(?:\{(.*)\})?\s+(\S+)")
LABEL = re.compile(r'(\w+)="((?:[^"\\]|\\.)*)"')


def parse_metrics(text: str) -> dict[str, float]:
    """Prometheus text -> {"name{label=value,...}": value} (model_name left out)."""
    samples = {}
    for line in text.splitlines():
        match = SAMPLE.match(line)
        if not match or line.startswith("#"):
            continue
        name, labels, value = match.groups()
        pairs = [f"{k}={v}" for k, v in LABEL.findall(labels or "") if k != "model_name"]
        key = name + ("{" + ",".join(pairs) + "}" if pairs else "")
        try:
            samples[key] = float(value)
        except ValueError:
            pass
    return samples


async def server_metrics(client, root: str) -> dict[str, float]:
    try:
        text = await client.with_options(base_url=root, timeout=30).get("/metrics", cast_to=str)
        return parse_metrics(text)
    except Exception as error:  # noqa: BLE001
        print(f"could not read /metrics: {type(error).__name__}: {error}", file=sys.stderr, flush=True)
        return {}


def metrics_delta(before: dict, after: dict) -> dict:
    if not before or not after:
        return {}

    def diff(key):
        return after.get(key, 0.0) - before.get(key, 0.0)

    reasons = {}
    for key in after:
        if key.startswith("inkling2:request_success_total{"):
            reason = key.split("finished_reason=")[-1].rstrip("}")
            if diff(key):
                reasons[reason] = int(diff(key))
    out = {"request_success": reasons, "generation_tokens": int(diff("inkling2:generation_tokens_total"))}
    drafted = diff("inkling2:spec_decode_num_draft_tokens_total")
    if drafted:
        out["dspark_steps"] = int(diff("inkling2:spec_decode_num_steps_total"))
        out["dspark_acceptance"] = diff("inkling2:spec_decode_num_accepted_tokens_total") / drafted
    for name in ("time_to_first_token_seconds", "inter_token_latency_seconds"):
        count = diff(f"inkling2:{name}_count")
        if count:
            out[f"server_mean_{name}"] = diff(f"inkling2:{name}_sum") / count
    return out


# ---------------------------------------------------------------------------------------------------------------
# Servers


class TextBlockReplies:
    """The shaping of the module docstring, as a forward hook on the model: it rewrites the logits of every position
    from its input token (inside the engine's CUDA graphs, and per verified position under DSpark). A hook rather
    than a logits processor per request: a trained model writes its block tokens at no cost, while a request's own
    processors are run row by row (1.7 to 3.8 ms for 16 rows on the H200, four runs of `engine.py --breakdown`)."""

    def __init__(self, model, tokenizer):
        device = model.get_input_embeddings().weight.device
        self.after = tokenizer.convert_tokens_to_ids("<|message_model|>")
        special = sorted({*tokenizer.all_special_ids, *tokenizer.added_tokens_decoder})
        self.special = torch.tensor(special, device=device)
        text = model.config.get_text_config()
        logits = min(text.vocab_size, text.unpadded_vocab_size)  # the logits are cut to the real tokens
        self.opening = torch.full((logits,), float("-inf"), device=device)
        self.opening[tokenizer.convert_tokens_to_ids("<|content_text|>")] = 0.0
        model.register_forward_hook(self, with_kwargs=True)

    def __call__(self, module, args, kwargs, output):
        ids = kwargs.get("input_ids")
        if ids is None:
            return output
        logits = output.logits
        opens = (ids[:, -logits.shape[1] :] == self.after)[..., None]
        banned = logits.index_fill(-1, self.special, float("-inf"))
        output.logits = torch.where(opens, self.opening.to(logits.dtype), banned)
        return output


def build_model(device: str, dspark: bool):
    """(model, label): the GPU slice with quantized experts (and a random drafter of the official shape), or the
    tiny CPU model (with its drafter)."""
    import transformers_inkling2

    if device == "cuda":
        from parallel import fill_randomly_
        from user_path import build_ours

        from transformers_inkling2 import Inkling2DSparkConfig
        from transformers_inkling2.modeling.modeling_inkling2_dspark import Inkling2DSparkDrafter

        model = build_ours(quick=False, quantized=True)
        label = "6-layer full-width slice, 384 random NVFP4/MXFP8 experts"
        if dspark:
            drafter_config = Inkling2DSparkConfig(target_layer_ids=[0, 1, 2, 3, 4])
            drafter = Inkling2DSparkDrafter(drafter_config, model.config.vocab_size)
            fill_randomly_(model.set_dspark(drafter))
            label += ", random drafter of the official shape"
        return model, label
    if dspark:
        model = transformers_inkling2.tiny.build_tiny_model(dspark=True).eval()
        return model, "embedded tiny model with its random DSpark drafter (multimodal class)"
    return transformers_inkling2.build_tiny_causal_lm(), "embedded tiny model (random weights)"


def measure_server(model, tokenizer, args, label: str, prompts: Prompts, dspark: bool, clients) -> dict:
    """One server over `model`: warm-up, then every concurrency level driven from the client process `clients`;
    the server stops at the end."""
    from transformers_inkling2.serving.server import Inkling2Server, ServerSettings, model_app

    most = max(args.concurrency)
    # room for the chat template and the instruction around the prompt
    max_model_len = args.prompt_tokens + args.output_tokens + 256
    settings = ServerSettings(model_id=MODEL_ID, port=0, max_waiting=max(64, most + 1),
                              max_connections=max(256, 2 * most + 8), max_num_seqs=max(64, most),
                              max_model_len=max_model_len, dspark=dspark)  # fmt: skip
    server = Inkling2Server(model_app(model, tokenizer, settings)).start()

    def level(texts: list[str], concurrency: int):
        job = (server.base_url, texts, concurrency, args.output_tokens, args.request_timeout)
        return clients.submit(client_level, *job).result()

    levels = {}
    try:
        print(f"[serving] {label}: {server.base_url}, warming up", flush=True)
        warm, _, _, _ = level([prompts[10_000 + k] for k in range(WARMUP_REQUESTS)], 1)
        for failed in (r for r in warm if r.error):
            print(f"[serving] warm-up request failed: {failed.error}", flush=True)
        next_prompt = 0
        for concurrency in args.concurrency:
            requests = args.requests_per_level or max(4, 2 * concurrency)
            texts = [prompts[next_prompt + k] for k in range(requests)]  # tokenized before the clock starts
            next_prompt += requests
            results, wall, before, after = level(texts, concurrency)
            stats = level_stats(results, wall, tokenizer, concurrency)
            stats["server"] = metrics_delta(before, after)
            levels[concurrency] = stats
            print(f"[serving] {label}, concurrency {concurrency}: {stats['ok']}/{requests} ok in {wall:.1f} s, "
                  f"{fmt(stats['aggregate_tokens_per_s'], '.1f')} tokens/s", flush=True)  # fmt: skip
    finally:
        server.stop()
    return levels


def server_latency(server: dict) -> str:
    ttft = server.get("server_mean_time_to_first_token_seconds")
    itl = server.get("server_mean_inter_token_latency_seconds")
    return f"{fmt(ttft, '.3f')} / {fmt(None if itl is None else itl * 1e3, '.1f')}"


def table(runs: dict) -> str:
    headers = ["server", "concurrency", "requests ok / failed", "wall s", "aggregate tok/s", "per-user tok/s",
               "TTFT p50 s", "TTFT p99 s", "TTFT p50 s after the first C", "ITL p50 ms", "ITL p99 ms", "mean out tokens",
               "/metrics: success by reason", "/metrics: generated tokens (client)",
               "/metrics: mean TTFT s / ITL ms"]  # fmt: skip
    rows = []
    for label, levels in runs.items():
        if isinstance(levels, str):
            rows.append([label, "-", levels] + ["-"] * (len(headers) - 3))
            continue
        for concurrency, s in levels.items():
            failed = str(s["failed"]) + (f" ({', '.join(f'{k} x{v}' for k, v in s['failures'].items())})"
                                         if s["failures"] else "")  # fmt: skip
            server = s["server"]
            reasons = ", ".join(f"{k} {v}" for k, v in server.get("request_success", {}).items()) or "-"
            tokens = f"{server.get('generation_tokens', '-')} ({s['completion_tokens']})"
            if "dspark_acceptance" in server:
                tokens += f"; DSpark acceptance {server['dspark_acceptance']:.2f}"
            rows.append([label, concurrency, f"{s['ok']} / {failed}", fmt(s["wall_s"], ".1f"),
                         fmt(s["aggregate_tokens_per_s"], ".1f"), fmt(s["per_user_tokens_per_s"], ".1f"),
                         fmt(s["ttft_p50_s"], ".3f"), fmt(s["ttft_p99_s"], ".3f"),
                         fmt(s["ttft_after_burst_p50_s"], ".3f"), fmt(s["itl_p50_ms"], ".1f"),
                         fmt(s["itl_p99_ms"], ".1f"), fmt(s["mean_completion_tokens"], ".1f"), reasons,
                         tokens, server_latency(server)])  # fmt: skip
    return markdown_table(headers, rows)


def environment_line(device: str) -> str:
    import transformers

    if device == "cuda":
        from attention import environment

        return environment()
    return (f"CPU ({platform.machine()}, {os.cpu_count()} cores, {torch.get_num_threads()} torch threads), torch "
            f"{torch.__version__}, transformers {transformers.__version__}, "
            f"{datetime.datetime.now(datetime.UTC):%Y-%m-%d %H:%M} UTC")  # fmt: skip


def benchmark(args) -> None:
    """Serves the model once per variant; the report is written after each (a run cut short keeps what it had)."""
    import multiprocessing
    from concurrent.futures import ProcessPoolExecutor

    import transformers_inkling2

    tokenizer = transformers_inkling2.build_inkling2_tokenizer()
    prompts = Prompts(tokenizer, args.prompt_tokens, args.seed)
    model, label = build_model(args.device, args.dspark)
    if not args.unshaped:
        TextBlockReplies(model, tokenizer)
    runs: dict[str, dict | str] = {}
    data = {"environment": environment_line(args.device), "model": label, "args": vars(args), "runs": runs}
    variants = [("without DSpark", False)] + ([("with DSpark", True)] if args.dspark else [])
    with ProcessPoolExecutor(1, mp_context=multiprocessing.get_context("spawn")) as clients:
        for name, dspark in variants:
            run_label = f"{'tiny' if args.device == 'cpu' else 'slice'}, {name}" if args.dspark else label
            try:
                runs[run_label] = measure_server(model, tokenizer, args, run_label, prompts, dspark, clients)
            except Exception as error:  # noqa: BLE001  (a server that does not start: reported, the next one runs)
                runs[run_label] = f"error: {type(error).__name__}: {str(error)[:200]}"
            write_report(args.out, "serving", report(args, label, data, runs), data)


def report(args, label: str, data: dict, runs: dict) -> str:
    requests = ("max(4, 2 x concurrency)" if not args.requests_per_level
                else str(args.requests_per_level))  # fmt: skip
    head = (f"Model: {label}. Prompts: {args.prompt_tokens} tokens of CPython documentation (+ instruction and chat "
            f"template); {args.output_tokens} output tokens (max_tokens), temperature 0, streamed; {requests} requests "
            f"per level after {WARMUP_REQUESTS} warm-up requests; request deadline {args.request_timeout:.0f} s. "
            "Per-user tok/s: mean over requests of (tokens after the first token chunk) / (last token chunk - first token "
            "chunk). "
            "ITL: gap before a token chunk / its tokens. `/metrics` columns: the server's counters across the level; "
            "generated tokens as the server counts them (and as the client's `usage` does).")  # fmt: skip
    sections = [f"# Serving ({data['environment']})", head,
                "## Streamed chat completions by concurrency", table(runs)]  # fmt: skip
    return "\n\n".join(sections)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", default=os.environ.get("OUT", "."))
    parser.add_argument("--device", default="auto", choices=["auto", "cpu", "cuda"])
    parser.add_argument("--concurrency", type=int, nargs="+", default=[1, 4, 16, 64])
    parser.add_argument("--requests-per-level", type=int, default=None, help="default: max(4, 2 x concurrency)")
    parser.add_argument("--prompt-tokens", type=int, default=None, help="default: 1024 on a GPU, 128 on CPU")
    parser.add_argument("--output-tokens", type=int, default=None, help="default: 256 on a GPU, 32 on CPU")
    parser.add_argument("--request-timeout", type=float, default=600.0, help="seconds for one whole request")
    parser.add_argument("--dspark", action="store_true", help="also serve with DSpark (a second server)")
    parser.add_argument("--unshaped", action="store_true", help="the random model's replies as they come (no "
                        "TextBlockReplies): the server releases their text in 256-character pieces")  # fmt: skip
    parser.add_argument("--seed", type=int, default=0, help="which documentation passages make the prompts")
    args = parser.parse_args()
    if args.device == "auto":
        args.device = "cuda" if torch.cuda.is_available() else "cpu"
    gpu = args.device == "cuda"
    args.prompt_tokens = args.prompt_tokens or (1024 if gpu else 128)
    args.output_tokens = args.output_tokens or (256 if gpu else 32)
    if min(args.concurrency) < 1 or (args.requests_per_level is not None and args.requests_per_level < 1):
        parser.error("--concurrency and --requests-per-level take positive integers")
    benchmark(args)


if __name__ == "__main__":
    main()
