"""DSpark on one GPU, end to end: train a small Inkling2 target on real English text, distill its drafter, then
measure acceptance and generate() speed with and without DSpark.

The text is CPython's documentation topics (`pydoc_data.topics`, the English text `help()` prints, in every Python
installation: nothing to download) and, with `--corpus topics+docstrings`, also the standard library's docstrings
(read from its source files), tokenized with the real Inkling2 tokenizer; the ids that occur are renumbered into a
compact vocabulary. Documents are split 90 / 10 (every 10th is held out): training sees only the first part; prompts
come from the held-out documents.

1. Target: 8 layers (one full-attention layer), hidden 512, 8 / 2 heads of 64, sliding window 256, 16 experts
   (top-2) of width 512; trained from scratch in fp32 (TF32 matmuls) with AdamW, windows of 256 tokens.
2. Drafter: `default_dspark_config` (block 7, two layers, RNN Markov head, confidence head), distilled with
   `train_dspark` from the frozen bf16 target (the same code as `inkling2 train-dspark`), on corpus windows or, with
   `--self-distill N`, on N windows whose second half the target writes itself.
3. bf16 generation at batch 1 from held-out prompts of 64 tokens, `--new-tokens` each: plain `generate()` and
   `generate(dspark=True)`, at temperature 0 (greedy) and 1 (sampling); mean accepted length per step (the target's
   own token included), position acceptance, tokens/s (wall clock around generate(), CUDA synchronized), and for
   greedy how many tokens DSpark's output shares with plain greedy decoding. With `--cache static` (the default)
   generate() runs over `Inkling2StaticCache`: decode steps and verification passes replay as CUDA graphs.

    python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .whl/*.whl
    export PYTHONPATH=$PWD/src:/tmp/site
    python3 benchmarks/dspark.py [--target-steps 400] [--drafter-steps 3000] [--drafter-learning-rate 1e-2] [--out DIR]

Prints a markdown report and writes `dspark.md` (+ `dspark.json`, saved after every phase) under --out (default
$OUT, else ./).
"""

from __future__ import annotations

import argparse
import copy
import json
import os
import time
from pathlib import Path

import torch
from transformers import CompileConfig

import transformers_inkling2  # noqa: F401
from transformers_inkling2 import Inkling2ForCausalLM, Inkling2StaticCache, Inkling2TextConfig
from transformers_inkling2.cache.dynamic import Inkling2Cache
from transformers_inkling2.dspark.training import (
    attach_new_drafter,
    default_dspark_config,
    random_anchors,
    target_written_windows,
    teacher_forced_loss,
    token_windows,
    train_dspark,
    window_batches,
)
from transformers_inkling2.generation.dspark import DSparkDecoder, DSparkOptions
from transformers_inkling2.processing.tokenization_inkling2 import build_inkling2_tokenizer

DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")  # CPU: only to try the script with few steps
PROMPT_TOKENS = 64


def stdlib_docstrings(minimum: int = 80) -> list[str]:
    """The docstrings (of at least `minimum` characters) of the standard library's own modules, classes and
    functions, read from the source files with `ast` (nothing imported); tests and IDLE left out. About 1.5 MB of
    English on CPython 3.11, three times the documentation topics."""
    import ast
    import sysconfig

    root = Path(sysconfig.get_paths()["stdlib"])
    documents = []
    for path in sorted(root.rglob("*.py")):
        parts = path.relative_to(root).parts
        if parts[0] in ("test", "idlelib", "site-packages", "lib2to3", "turtledemo") or "tests" in parts:
            continue
        try:
            tree = ast.parse(path.read_text(encoding="utf-8"))
        except (SyntaxError, UnicodeDecodeError):
            continue
        for node in ast.walk(tree):
            if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)):
                text = ast.get_docstring(node)
                if text and len(text) >= minimum:
                    documents.append(text)
    return documents


def corpus(tokenizer, name: str):
    """(training token ids, held-out token ids, vocabulary size) in the compact vocabulary. Every 10th document is
    held out: a documentation topic, or with "topics+docstrings" also a standard-library docstring."""
    from pydoc_data.topics import topics

    documents = [topics[n] for n in sorted(topics)]
    if name == "topics+docstrings":
        documents += stdlib_docstrings()
    train_text = "\n\n".join(d for i, d in enumerate(documents) if i % 10 != 9)
    held_out_text = "\n\n".join(d for i, d in enumerate(documents) if i % 10 == 9)
    train = torch.tensor(tokenizer(train_text, add_special_tokens=False)["input_ids"])
    held_out = torch.tensor(tokenizer(held_out_text, add_special_tokens=False)["input_ids"])
    used = torch.unique(torch.cat([train, held_out]))
    compact = torch.full((int(used.max()) + 1,), -1, dtype=torch.long)
    compact[used] = torch.arange(len(used))
    return compact[train], compact[held_out], len(used)


def target_config(vocab: int) -> Inkling2TextConfig:
    padded = (vocab + 1 + 63) // 64 * 64  # + the drafter's mask token, in a padding row
    return Inkling2TextConfig(
        vocab_size=padded,
        unpadded_vocab_size=vocab,
        hidden_size=512,
        num_hidden_layers=8,
        num_attention_heads=8,
        num_key_value_heads=2,
        head_dim=64,
        swa_num_attention_heads=8,
        swa_num_key_value_heads=2,
        swa_head_dim=64,
        sliding_window_size=256,
        rel_extent=256,
        d_rel=16,
        moe_intermediate_size=512,
        n_routed_experts=16,
        num_experts_per_tok=2,
        n_layers_per_attn_res_block=4,
        max_position_embeddings=8192,
        eos_token_id=None,
    )


def train_target(config, tokens, steps: int, batch: int, window: int, learning_rate: float):
    torch.backends.cuda.matmul.allow_tf32 = True
    torch.manual_seed(0)
    model = Inkling2ForCausalLM(config).to(DEVICE)
    model.set_experts_implementation("eager")  # fp32 training; grouped GEMMs are bf16-only
    model.train()
    optimizer = torch.optim.AdamW(model.parameters(), lr=learning_rate, weight_decay=0.1, betas=(0.9, 0.95))
    schedule = torch.optim.lr_scheduler.OneCycleLR(optimizer, learning_rate, total_steps=steps, pct_start=0.05)
    batches = token_windows(tokens, window, batch, seed=1, device=DEVICE)
    losses = []
    start = time.perf_counter()
    for step in range(steps):
        input_ids = next(batches)
        loss = model(input_ids=input_ids, labels=input_ids, use_cache=False).loss
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        schedule.step()
        losses.append(loss.item())
        if step % 250 == 0 or step == steps - 1:
            print(f"  target step {step}: loss {loss.item():.3f}", flush=True)
    model.eval()
    model.set_experts_implementation("grouped_mm")
    return model.to(torch.bfloat16), losses, time.perf_counter() - start


@torch.no_grad()
def held_out_loss(model, tokens, window: int = 256, windows: int = 32) -> float:
    starts = torch.linspace(0, len(tokens) - window - 1, windows).long().tolist()
    batch = torch.stack([tokens[s : s + window] for s in starts]).to(DEVICE)
    return model(input_ids=batch, labels=batch, use_cache=False).loss.item()


@torch.no_grad()
def teacher_forced_agreement(model, tokens, window: int = 512, windows: int = 8) -> list[float]:
    """Per block position, how often the drafter's argmax equals the target's on held-out text (teacher-forced)."""
    starts = torch.linspace(0, len(tokens) - window - 1, windows).long().tolist()
    batch = torch.stack([tokens[s : s + window] for s in starts]).to(DEVICE)
    anchors = random_anchors(window, model.dspark.config.block_size, 64, torch.Generator().manual_seed(0), DEVICE)
    return teacher_forced_loss(model, batch, anchors)["agreement"].tolist()


@torch.no_grad()
def step_costs(model, prompt, cache: str, compile_config, repeats: int = 20) -> dict:
    """Milliseconds of the pieces of a step after a prefill: a plain one-token decode step, the DSpark verification
    pass (8 tokens with hidden states) and one draft (drafter pass + the 7 head steps); over the static cache on a
    GPU each replays as a CUDA graph, as in generate()."""

    def ms(fn) -> float:
        fn()
        synchronize()
        start = time.perf_counter()
        for _ in range(repeats):
            fn()
        synchronize()
        return 1000 * (time.perf_counter() - start) / repeats

    static = cache == "static"
    generation_config = copy.deepcopy(model.generation_config)
    generation_config.compile_config = compile_config
    target_cache = Inkling2StaticCache(model.config, prompt.shape[1] + 16) if static else Inkling2Cache(model.config)
    forward = model.get_compiled_call(compile_config) if static and DEVICE.type == "cuda" else model
    decoder = DSparkDecoder(model, target_cache, None, generation_config, DSparkOptions())
    anchor = decoder.prefill(prompt, None, model.get_input_embeddings()(prompt), None)
    one, eight = prompt[:, -1:], prompt[:, -8:]

    def plain_step():
        forward(input_ids=one, past_key_values=target_cache, use_cache=True)
        target_cache.crop(-1)

    def verify_step():
        forward(input_ids=eight, past_key_values=target_cache, use_cache=True, output_hidden_states=True)
        target_cache.crop(-8)

    return {
        "plain_step_ms": ms(plain_step),
        "verify_step_ms": ms(verify_step),
        "draft_ms": ms(lambda: decoder.draft(anchor, [True])),
    }


def synchronize() -> None:
    if DEVICE.type == "cuda":
        torch.cuda.synchronize()


def timed_generate(
    model, prompt, new_tokens: int, sample: bool, dspark: bool, seed: int, cache: str = "static", compile_config=None
):
    """`cache="static"`: decode steps and verification passes replay as CUDA graphs on a GPU (compiled with
    torch.compile inside them when `compile_config` is given)."""
    torch.manual_seed(seed)
    synchronize()
    start = time.perf_counter()
    out = model.generate(
        prompt,
        attention_mask=torch.ones_like(prompt),
        max_new_tokens=new_tokens,
        do_sample=sample,
        temperature=1.0 if sample else None,
        top_k=None,
        top_p=None,
        pad_token_id=0,
        dspark=dspark,
        return_dict_in_generate=True,
        cache_implementation=cache,
        compile_config=compile_config,
    )
    synchronize()
    return out.sequences[0, prompt.shape[1] :], time.perf_counter() - start, out


def evaluate(model, held_out, prompts: int, new_tokens: int, results: dict, save, cache: str, compile_config) -> None:
    """Fills `results[temperature]`, saving after each temperature (a run cut short keeps what it measured)."""
    starts = torch.linspace(0, len(held_out) - PROMPT_TOKENS - 1, prompts).long().tolist()
    prompt_list = [held_out[s : s + PROMPT_TOKENS][None].to(DEVICE) for s in starts]
    # warm-up at the measured length: a static cache of that size and its captured graphs are then reused
    timed_generate(model, prompt_list[0], new_tokens, False, False, 0, cache, compile_config)
    timed_generate(model, prompt_list[0], new_tokens, False, True, 0, cache, compile_config)
    for temperature, sample in (("0", False), ("1", True)):
        plain_time = dspark_time = 0.0
        plain_tokens = dspark_tokens = shared = 0
        accepted_lengths, position_acceptance = [], []
        for i, prompt in enumerate(prompt_list):
            plain, seconds, _ = timed_generate(model, prompt, new_tokens, sample, False, i, cache, compile_config)
            plain_time, plain_tokens = plain_time + seconds, plain_tokens + len(plain)
            drafted, seconds, out = timed_generate(model, prompt, new_tokens, sample, True, i, cache, compile_config)
            dspark_time, dspark_tokens = dspark_time + seconds, dspark_tokens + len(drafted)
            accepted_lengths.append(out.mean_accepted_length)
            position_acceptance.append(out.position_acceptance)
            if not sample:
                agree = (plain == drafted).long().cumprod(0).sum().item()
                shared += agree
        results[temperature] = {
            "mean_accepted_length": sum(accepted_lengths) / len(accepted_lengths),
            "position_acceptance": torch.stack(position_acceptance).mean(0).tolist(),
            "plain_tokens_per_s": plain_tokens / plain_time,
            "dspark_tokens_per_s": dspark_tokens / dspark_time,
            "speedup": (dspark_tokens / dspark_time) / (plain_tokens / plain_time),
            "greedy_prefix_shared_with_plain": None if sample else shared / plain_tokens,
        }
        print(f"  temperature {temperature}: {results[temperature]}", flush=True)
        save()


def report(summary: dict) -> str:
    lines = [
        "| temperature | mean accepted length | acceptance by position (1..7) | plain tokens/s | DSpark tokens/s | "
        "speedup | greedy tokens identical to plain |",
        "|---|---|---|---|---|---|---|",
    ]
    for temperature, r in summary["generation"].items():
        positions = " ".join(f"{p:.2f}" for p in r["position_acceptance"])
        shared = (
            "-"
            if r["greedy_prefix_shared_with_plain"] is None
            else f"{100 * r['greedy_prefix_shared_with_plain']:.1f}%"
        )
        lines.append(
            f"| {temperature} | {r['mean_accepted_length']:.2f} | {positions} | {r['plain_tokens_per_s']:.1f} | "
            f"{r['dspark_tokens_per_s']:.1f} | {r['speedup']:.2f}x | {shared} |"
        )
    head = (
        f"{summary['gpu']}, torch {summary['torch']}; corpus {summary['corpus']}: {summary['train_tokens']:,} training / "
        f"{summary['held_out_tokens']:,} held-out tokens, compact vocabulary {summary['vocab']:,}.\n"
        f"Target: {summary['target_parameters'] / 1e6:.1f}M parameters, {summary['target_steps']} steps in "
        f"{summary['target_seconds']:.0f} s, held-out loss {summary['target_held_out_loss']:.3f}. Drafter: "
        f"{summary['drafter_parameters'] / 1e6:.1f}M parameters, {summary['drafter_steps']} steps (learning rate "
        f"{summary['drafter_learning_rate']:g}) on "
        f"{summary['drafter_data']} in "
        f"{summary['drafter_seconds']:.0f} s, loss {summary['drafter_loss_first']:.3f} -> {summary['drafter_loss_last']:.3f}.\n"
        f"Held-out teacher-forced agreement of the drafter's argmax with the target's, by block position: "
        f"{' '.join(f'{a:.2f}' for a in summary['teacher_forced_agreement'])}.\n"
        f"Step costs after a {PROMPT_TOKENS}-token prompt ({summary['cache']} cache): plain decode step "
        f"{summary['step_costs']['plain_step_ms']:.1f} ms, "
        f"verification pass (8 tokens) {summary['step_costs']['verify_step_ms']:.1f} ms, draft "
        f"{summary['step_costs']['draft_ms']:.1f} ms.\n"
        f"Generation: batch 1, {summary['prompts']} held-out prompts of {PROMPT_TOKENS} tokens, "
        f"{summary['new_tokens']} new tokens each, bf16, cache: {summary['cache']}.\n\n"
    )
    return head + "\n".join(lines) + "\n"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    # defaults: the measured run of docs/benchmarks.md (about 420 s on one H200)
    parser.add_argument("--target-steps", type=int, default=400)
    parser.add_argument("--drafter-steps", type=int, default=3000)
    parser.add_argument("--drafter-learning-rate", type=float, default=1e-2)
    parser.add_argument("--self-distill", type=int, metavar="N", help="distill on N target-written windows of 256")
    parser.add_argument("--prompts", type=int, default=8)
    parser.add_argument("--new-tokens", type=int, default=256)
    parser.add_argument("--out", default=os.environ.get("OUT", "."))
    parser.add_argument(
        "--cache",
        choices=("static", "dynamic"),
        default="static",
        help="generate()'s cache_implementation: static replays decode steps as CUDA graphs",
    )
    parser.add_argument("--compile", action="store_true", help="with --cache static: torch.compile the steps too")
    parser.add_argument(
        "--corpus",
        choices=("topics", "topics+docstrings"),
        default="topics",
        help="CPython's documentation topics, or also the standard library's docstrings (3x the text)",
    )
    args = parser.parse_args()

    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)

    def save() -> None:  # after every phase: a run cut short keeps what it measured
        (out / "dspark.json").write_text(json.dumps(summary, indent=2))

    train, held_out, vocab = corpus(build_inkling2_tokenizer(), args.corpus)
    config = target_config(vocab)
    print(f"corpus: {len(train):,} training tokens, {len(held_out):,} held out, vocabulary {vocab:,}", flush=True)
    summary = {
        "gpu": torch.cuda.get_device_name() if DEVICE.type == "cuda" else "CPU",
        "torch": torch.__version__,
        "corpus": args.corpus,
        "train_tokens": len(train),
        "held_out_tokens": len(held_out),
        "vocab": vocab,
        "prompts": args.prompts,
        "new_tokens": args.new_tokens,
    }
    model, target_losses, target_seconds = train_target(config, train, args.target_steps, 32, 256, 2e-3)
    summary.update(
        target_parameters=sum(p.numel() for p in model.parameters()),
        target_steps=args.target_steps,
        target_seconds=target_seconds,
        target_loss_last=target_losses[-1],
        target_held_out_loss=held_out_loss(model, held_out),
    )
    print(f"target held-out loss {summary['target_held_out_loss']:.3f}", flush=True)
    save()

    summary["cache"] = args.cache + (", torch.compile" if args.compile else "")
    compile_config = CompileConfig() if args.compile else None
    drafter = attach_new_drafter(model, default_dspark_config(config, mask_token_id=vocab))
    start = time.perf_counter()
    if args.self_distill:  # the second half of every window written by the target itself
        windows = target_written_windows(model, train, args.self_distill, 256, batch_size=128, seed=2)
        batches = window_batches(windows, 16, seed=2, device=DEVICE)
    else:
        batches = token_windows(train, 512, 16, seed=2, device=DEVICE)
    drafter_losses = train_dspark(model, batches, args.drafter_steps, args.drafter_learning_rate, anchors_per_window=32)
    summary.update(
        drafter_parameters=sum(p.numel() for p in drafter.parameters()),
        drafter_steps=args.drafter_steps,
        drafter_learning_rate=args.drafter_learning_rate,
        drafter_data=f"{args.self_distill} target-written windows" if args.self_distill else "corpus windows",
        drafter_seconds=time.perf_counter() - start,
        drafter_loss_first=drafter_losses[0],
        drafter_loss_last=drafter_losses[-1],
        teacher_forced_agreement=teacher_forced_agreement(model, held_out),
        step_costs=step_costs(model, held_out[None, :PROMPT_TOKENS].to(DEVICE), args.cache, compile_config),
        generation={},
    )
    save()
    evaluate(model, held_out, args.prompts, args.new_tokens, summary["generation"], save, args.cache, compile_config)
    text = report(summary)
    print(text)
    (out / "dspark.md").write_text(text)


if __name__ == "__main__":
    main()
