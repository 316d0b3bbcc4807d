"""The `inkling2` command (also `python -m transformers_inkling2`).

    inkling2                                  generate with the embedded tiny model (no download)
    inkling2 generate --model PATH --prompt "..." [--image PATH_OR_URL] [--max-new-tokens N] [--device cuda]
    inkling2 quantize BF16_CHECKPOINT TARGET [--mxfp8-from 40]          the official NVFP4 + MXFP8 layout
    inkling2 plan [--variant nvfp4-mxfp8] [--tp 4] [--context 262144] [--batch 1]   GPU memory per rank
    inkling2 serve [--model PATH] [--port 8000] [--effort high] [--dspark] [--static-cache N [--compile]]   a server
    inkling2 train-dspark --model PATH --output DIR [--corpus FILE ...] [--steps 1000]  distill the DSpark drafter
"""

from __future__ import annotations

import argparse
import sys
import time

import torch

SUBCOMMANDS = ("generate", "serve", "quantize", "plan", "train-dspark")
DEFAULT_PROMPT = "Write one sentence about the sea."
COMPILE_HELP = "with --static-cache: the captured decode steps are compiled by torch.compile (the fastest path)"


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="inkling2", description="Inkling-2-Small with Hugging Face transformers.")
    commands = parser.add_subparsers(dest="command")
    generate = commands.add_parser("generate", help="generate a reply to a prompt (the default command)")
    generate.add_argument("--model", help="checkpoint folder or Hub id; default: the embedded tiny random model")
    generate.add_argument("--prompt", default=DEFAULT_PROMPT)
    generate.add_argument("--image", help="an image (path or URL) to ask about")
    generate.add_argument("--max-new-tokens", type=int, default=32)
    generate.add_argument("--device", default="auto", help="cpu, cuda, cuda:1, ... or auto (GPU when present)")
    generate.add_argument("--dtype", default="auto", choices=["auto", "bfloat16", "float32"])
    generate.add_argument("--sample", action="store_true", help="sample instead of greedy decoding")
    generate.add_argument("--temperature", type=float, default=1.0)
    generate.add_argument("--seed", type=int, default=0)
    generate.add_argument("--dspark", action="store_true", help="speculative decoding with the bundled DSpark drafter")
    generate.add_argument(
        "--static-cache", action="store_true", help="decode over Inkling2StaticCache (CUDA graphs on a GPU)"
    )
    generate.add_argument("--compile", action="store_true", help=COMPILE_HELP)
    serve = commands.add_parser("serve", help="an OpenAI-compatible server (/v1/chat/completions, /v1/models)")
    serve.add_argument("--model", help="checkpoint folder or Hub id; default: the embedded tiny random model")
    serve.add_argument("--host", default="127.0.0.1")
    serve.add_argument("--port", type=int, default=8000)
    serve.add_argument("--model-id", help="the name /v1/models reports (default: the checkpoint folder's name)")
    serve.add_argument("--max-tokens", type=int, default=1024, help="for requests that do not say")
    serve.add_argument("--effort", help="default thinking effort: none/minimal/low/medium/high/xhigh/max or 0-0.99")
    serve.add_argument("--device", default="auto", help="cpu, cuda, cuda:1, ... or auto (GPU when present)")
    serve.add_argument("--dtype", default="auto", choices=["auto", "bfloat16", "float32"])
    serve.add_argument("--dspark", action="store_true", help="decode with the bundled DSpark drafter")
    serve.add_argument(
        "--static-cache",
        type=int,
        metavar="TOKENS",
        help="decode over one Inkling2StaticCache of this many tokens, reused by every request up to that length "
        "(CUDA graphs on a GPU, captured once)",
    )
    serve.add_argument("--compile", action="store_true", help=COMPILE_HELP)
    quantize = commands.add_parser("quantize", help="turn a BF16 checkpoint into the NVFP4 + MXFP8 expert layout")
    quantize.add_argument("source", help="BF16 checkpoint folder (original layout, as save_pretrained writes it)")
    quantize.add_argument("target", help="output folder")
    quantize.add_argument("--mxfp8-from", type=int, default=40, help="first layer with MXFP8 experts (NVFP4 before)")
    plan = commands.add_parser("plan", help="GPU memory per rank for a checkpoint variant, parallel size and context")
    plan.add_argument("--config", help="a config.json or checkpoint folder (default: Inkling-2-Small's)")
    plan.add_argument("--variant", default="nvfp4-mxfp8", choices=["nvfp4-mxfp8", "mxfp8", "bf16"])
    plan.add_argument("--tp", type=int, default=1, help="tensor-parallel size (attention heads)")
    plan.add_argument("--ep", type=int, help="expert-parallel size (default: --tp)")
    plan.add_argument("--context", type=int, default=262_144, help="tokens per sequence")
    plan.add_argument("--batch", type=int, default=1, help="sequences")
    plan.add_argument("--prefill-chunk", type=int, default=16_384)
    plan.add_argument("--gpu-gib", type=float, default=139.0, help="usable memory per GPU (H200: about 139 GiB)")
    train = commands.add_parser("train-dspark", help="distill the DSpark drafter from its frozen target on text")
    train.add_argument("--model", help="checkpoint folder or Hub id; default: the embedded tiny random model")
    train.add_argument("--output", required=True, help="folder for the model with its trained drafter")
    train.add_argument("--corpus", nargs="*", help="text files (default: CPython's English documentation, pydoc_data)")
    train.add_argument("--steps", type=int, default=1000)
    train.add_argument("--window", type=int, default=512, help="tokens per training window")
    train.add_argument("--batch-size", type=int, default=8)
    train.add_argument("--anchors", type=int, default=32, help="blocks per window")
    train.add_argument("--learning-rate", type=float, default=3e-3)
    train.add_argument("--new-drafter", action="store_true", help="train a fresh drafter instead of the model's own")
    train.add_argument(
        "--self-distill",
        type=int,
        metavar="N",
        help="train on N windows whose second half the target writes itself (sampled) instead of the corpus text",
    )
    train.add_argument("--device", default="auto", help="cpu, cuda, cuda:1, ... or auto (GPU when present)")
    train.add_argument("--dtype", default="auto", choices=["auto", "bfloat16", "float32"])
    train.add_argument("--seed", type=int, default=0)
    return parser


def resolve_device(name: str) -> torch.device:
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    return torch.device(name)


def resolve_dtype(name: str, device: torch.device) -> torch.dtype:
    if name == "auto":
        return torch.bfloat16 if device.type == "cuda" else torch.float32
    return getattr(torch, name)


def load(model_path: str | None, device: torch.device, dtype: torch.dtype):
    """(model, processor, tokenizer) of a checkpoint, or the embedded tiny model with the real tokenizer, chat
    template and image processor. The processor is None for a text-only checkpoint; the tokenizer is loaded once."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from .processing.processing_inkling2 import Inkling2Processor
    from .tiny import TINY_MODEL_LABEL, build_tiny_model, build_tiny_processor

    print(f"[model] {TINY_MODEL_LABEL if model_path is None else model_path}", flush=True)
    if model_path is None:
        processor = build_tiny_processor()
        return build_tiny_model(dspark=True).to(device=device, dtype=dtype), processor, processor.tokenizer
    model = AutoModelForCausalLM.from_pretrained(model_path, dtype=dtype, device_map=device).eval()
    try:
        processor = Inkling2Processor.from_pretrained(model_path)
    except (OSError, ValueError):
        return model, None, AutoTokenizer.from_pretrained(model_path)
    return model, processor, processor.tokenizer


class CountingStreamer:
    """Prints the reply as it is generated and counts its tokens."""

    def __init__(self, tokenizer):
        from transformers import TextStreamer

        self.printer = TextStreamer(tokenizer, skip_prompt=True)
        self.prompt_seen, self.new_tokens = False, 0

    def put(self, value):
        if self.prompt_seen:
            self.new_tokens += value.numel()
        self.prompt_seen = True
        self.printer.put(value)

    def end(self):
        self.printer.end()


def compile_config(args: argparse.Namespace):
    """transformers' `CompileConfig` for `--compile` (None without it): the static cache's captured steps then run
    the `torch.compile`d model (`Inkling2DecodeGraphs`); without a static cache there is nothing it applies to."""
    if not args.compile:
        return None
    if not args.static_cache:
        raise SystemExit("--compile applies to the static cache's decode steps: add --static-cache.")
    from transformers import CompileConfig

    return CompileConfig()


def run_generate(args: argparse.Namespace) -> None:
    """One chat turn through transformers' pipeline ("image-text-to-text", or "text-generation" for a text-only
    checkpoint), streamed, with its speed."""
    from transformers import pipeline

    compile_steps = compile_config(args)
    device = resolve_device(args.device)
    dtype = resolve_dtype(args.dtype, device)
    model, processor, tokenizer = load(args.model, device, dtype)
    if args.image and processor is None:
        raise SystemExit(f"{args.model} has no image processor (preprocessor_config.json): it cannot take --image.")
    content = [{"type": "text", "text": args.prompt}]
    if args.image:
        content.insert(0, {"type": "image", "url" if "://" in args.image else "path": args.image})
    messages = [{"role": "user", "content": content}]
    torch.manual_seed(args.seed)
    streamer = CountingStreamer(tokenizer)
    generation = dict(
        max_new_tokens=args.max_new_tokens,
        do_sample=args.sample,
        temperature=args.temperature if args.sample else None,
        top_p=None,
        top_k=None,
        streamer=streamer,
        dspark=args.dspark,
        cache_implementation="static" if args.static_cache else None,
        compile_config=compile_steps,
    )
    if processor is not None:  # the two pipelines name their inputs and generation arguments differently
        generator = pipeline("image-text-to-text", model=model, processor=processor)
        call = dict(text=messages, generate_kwargs=generation)
    else:
        generator = pipeline("text-generation", model=model, tokenizer=tokenizer)
        call = dict(text_inputs=messages, **generation)

    print(f"[prompt] {args.prompt}" + (f" [image: {args.image}]" if args.image else "") + "\n[reply] ", end="", flush=True)
    start = time.perf_counter()
    generator(**call)
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    elapsed = time.perf_counter() - start
    print(
        f"\n[speed] {streamer.new_tokens} new tokens in {elapsed:.2f} s: {streamer.new_tokens / elapsed:.1f} tokens/s "
        f"({device.type}, {str(dtype).removeprefix('torch.')}, prompt processing included)"
    )


def run_quantize(args: argparse.Namespace) -> None:
    from .quantization.quantize import quantize_checkpoint

    target = quantize_checkpoint(args.source, args.target, mxfp8_from=args.mxfp8_from)
    print(f"[quantize] wrote {target}")


def run_serve(args: argparse.Namespace) -> None:
    from .serving.server import serve

    compile_steps = compile_config(args)
    device = resolve_device(args.device)
    model, processor, tokenizer = load(args.model, device, resolve_dtype(args.dtype, device))
    if processor is None:
        print("[serve] the checkpoint has no image processor: serving text only", flush=True)
    if args.dspark:  # every generate() call of the server reads it from the generation config
        model.generation_config.dspark = True
    if args.static_cache:  # one size for every request, so that its buffers and graphs are reused
        model.generation_config.cache_implementation = "static"
        model.generation_config.max_cache_len = args.static_cache
        model.generation_config.compile_config = compile_steps
    effort = args.effort
    if effort is not None and effort.replace(".", "", 1).isdigit():
        effort = float(effort)
    model_id = args.model_id or (args.model.rstrip("/").split("/")[-1] if args.model else "inkling2-tiny-random")
    serve(model, tokenizer, processor, args.host, args.port, model_id, args.max_tokens, effort)


def run_plan(args: argparse.Namespace) -> None:
    from .configuration_inkling2 import Inkling2Config
    from .parallel.planning import format_plan, memory_plan

    config = Inkling2Config.from_pretrained(args.config) if args.config else Inkling2Config()
    try:
        plan = memory_plan(config, args.variant, args.tp, args.ep, args.context, args.batch, args.prefill_chunk)
    except ValueError as error:
        raise SystemExit(f"inkling2 plan: {error}") from None
    print(
        f"[plan] {args.variant} experts, TP {args.tp} / EP {args.ep or args.tp}, {args.batch} x {args.context:,} tokens, "
        f"prefill chunks of {args.prefill_chunk:,}\n{format_plan(plan, args.gpu_gib)}"
    )


def run_train_dspark(args: argparse.Namespace) -> None:
    from .dspark.training import (
        attach_new_drafter,
        default_dspark_config,
        offline_english_corpus,
        target_written_windows,
        token_windows,
        train_dspark,
        window_batches,
    )

    device = resolve_device(args.device)
    model, processor, tokenizer = load(args.model, device, resolve_dtype(args.dtype, device))
    if args.new_drafter or model.dspark is None:
        attach_new_drafter(model, default_dspark_config(model.config.get_text_config()), seed=args.seed)
    if args.corpus:
        text = "\n\n".join(open(path, encoding="utf-8").read() for path in args.corpus)
    else:
        text = offline_english_corpus()
    token_ids = torch.tensor(tokenizer(text, add_special_tokens=False)["input_ids"])
    print(f"[train-dspark] {len(token_ids):,} tokens of text; {args.steps} steps of {args.batch_size} x {args.window}")
    if args.self_distill:
        windows = target_written_windows(model, token_ids, args.self_distill, args.window, seed=args.seed)
        batches = window_batches(windows, args.batch_size, args.seed, device)
    else:
        batches = token_windows(token_ids, args.window, args.batch_size, args.seed, device)
    losses = train_dspark(model, batches, args.steps, args.learning_rate, args.anchors, args.seed)
    model.save_pretrained(args.output)
    (processor or tokenizer).save_pretrained(args.output)
    print(f"[train-dspark] loss {losses[0]:.3f} -> {losses[-1]:.3f}; wrote {args.output}")


def main(argv: list[str] | None = None) -> None:
    argv = sys.argv[1:] if argv is None else list(argv)
    if not argv or argv[0] not in (*SUBCOMMANDS, "-h", "--help"):
        argv = ["generate", *argv]
    args = build_parser().parse_args(argv)
    commands = {
        "generate": run_generate,
        "serve": run_serve,
        "quantize": run_quantize,
        "plan": run_plan,
        "train-dspark": run_train_dspark,
    }
    commands[args.command](args)


if __name__ == "__main__":
    main()
