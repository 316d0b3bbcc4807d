"""The `inkling2` command's entry point: its arguments, parsed before anything heavy is imported. It lives outside
the package because importing `transformers_inkling2` registers the classes with transformers' Auto classes, which
loads torch and transformers (seconds) that `--help` or a mistyped argument should not wait for. The subcommands run
in `transformers_inkling2.cli`, imported once the arguments parse. (`python -m transformers_inkling2` runs this too,
but only after importing the package.)

    inkling2                                  the embedded Inkling-2-Nano answers a question about a picture it draws
    inkling2 generate --model PATH --prompt "..." [--image PATH_OR_URL] [--max-new-tokens N] [--device cuda]
    inkling2 quantize BF16_CHECKPOINT TARGET [--mxfp8-from 40]          the official NVFP4 + MXFP8 layout
    inkling2 plan [--variant nvfp4-mxfp8] [--tp 4] [--context 262144] [--batch 1]   GPU memory per rank
    inkling2 serve [--model PATH] [--port 8000] [--effort high] [--dspark] [--max-num-seqs 64]   a server
    inkling2 train-dspark --model PATH --output DIR [--corpus FILE ...] [--steps 1000]  distill the DSpark drafter
    inkling2 train-nano --output DIR [--steps 2200] [--seed 0]    train Inkling-2-Nano, the embedded default (a GPU)
"""

from __future__ import annotations

import argparse
import sys

SUBCOMMANDS = ("generate", "serve", "quantize", "plan", "train-dspark", "train-nano")
COMPILE_HELP = (
    "on a GPU, the decode steps replayed as CUDA graphs also run torch.compile'd: the fastest steps, after about "
    "half a minute of compiling per batch size and cache bucket (docs/attention.md)"
)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="inkling2", description="Inkling-2-Small with Hugging Face transformers.")
    commands = parser.add_subparsers(dest="command")
    generate = commands.add_parser("generate", help="generate a reply to a prompt (the default command)")
    generate.add_argument("--model", help="checkpoint folder or Hub id; default: the embedded Inkling-2-Nano")
    generate.add_argument(
        "--prompt", help="default: a question about a picture drawn for this run (--seed picks it), which is printed"
    )
    generate.add_argument("--image", help="an image (path or URL) to ask about")
    generate.add_argument("--max-new-tokens", type=int, default=64)
    generate.add_argument("--device", default="auto", help="cpu, cuda, cuda:1, ... or auto (GPU when present)")
    generate.add_argument("--dtype", default="auto", choices=["auto", "bfloat16", "float32"])
    generate.add_argument("--sample", action="store_true", help="sample instead of greedy decoding")
    generate.add_argument("--temperature", type=float, default=1.0)
    generate.add_argument("--seed", type=int, default=0)
    generate.add_argument(
        "--dspark",
        action="store_true",
        help="speculative decoding with the bundled DSpark drafter; prints its accepted length and its speedup over "
        "plain decoding of the same prompt",
    )
    generate.add_argument(
        "--static-cache", action="store_true", help="decode over Inkling2StaticCache (generate()'s default on a GPU)"
    )
    generate.add_argument("--compile", action="store_true", help=COMPILE_HELP)
    serve = commands.add_parser("serve", help="an OpenAI-compatible server (/v1/chat/completions, /v1/models)")
    serve.add_argument("--model", help="checkpoint folder or Hub id; default: the embedded Inkling-2-Nano")
    serve.add_argument("--host", default="127.0.0.1")
    serve.add_argument("--port", type=int, default=8000)
    serve.add_argument("--model-id", help="the name /v1/models reports (default: the checkpoint folder's name)")
    serve.add_argument("--max-tokens", type=int, default=1024, help="for requests that do not say")
    serve.add_argument("--effort", help="default thinking effort: none/minimal/low/medium/high/xhigh/max or 0-0.99")
    serve.add_argument("--device", default="auto", help="cpu, cuda, cuda:1, ... or auto (GPU when present)")
    serve.add_argument("--dtype", default="auto", choices=["auto", "bfloat16", "float32"])
    serve.add_argument("--dspark", action="store_true", help="decode with the bundled DSpark drafter")
    add_server_limits(serve)
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
    engine = plan.add_argument_group("the serving engine's cache: the pages --gpu-gib holds (docs/planning.md)")
    engine.add_argument("--max-num-seqs", type=int, default=64, help="sequences in flight at once (rows)")
    engine.add_argument("--page-size", type=int, default=256, help="tokens per page (a power of two, at least 64)")
    engine.add_argument("--max-step-tokens", type=int, default=2048, help="tokens one step runs (prompt chunks)")
    engine.add_argument("--dspark", action="store_true", help="rows also hold the config's DSpark drafter's context")
    train = commands.add_parser("train-dspark", help="distill the DSpark drafter from its frozen target on text")
    train.add_argument("--model", help="checkpoint folder or Hub id; default: the embedded Inkling-2-Nano")
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
    add_train_nano(commands)
    return parser


def add_train_nano(commands) -> None:
    """`inkling2 train-nano`: its defaults are the recipe's (`nano.training.NANO_DEFAULTS`, repeated here so that
    `--help` needs no torch; tests/nano checks they agree)."""
    nano = commands.add_parser(
        "train-nano", help="train Inkling-2-Nano (the embedded default model) from scratch: about 25 minutes on an H200"
    )
    nano.add_argument("--output", required=True, help="folder for the quantized checkpoint and training_report.json")
    nano.add_argument("--steps", type=int, default=2200, help="model training steps")
    nano.add_argument("--batch-size", type=int, default=128, help="conversations per step")
    nano.add_argument("--learning-rate", type=float, default=3e-3)
    nano.add_argument("--drafter-steps", type=int, default=2400, help="DSpark drafter training steps")
    nano.add_argument("--seed", type=int, default=0)
    nano.add_argument("--workers", type=int, default=12, help="processes drawing the training conversations")
    nano.add_argument("--held-out", type=int, default=50, help="held-out examples of each kind to score at the end")
    nano.add_argument(
        "--max-minutes",
        type=float,
        help="stop the model's training after this long and save its state beside --output; the same command again "
        "continues exactly where it stopped (for machines that run a command for a limited time)",
    )
    nano.add_argument("--device", default="auto", help="cuda (the shipped weights' device), cpu, ... or auto")


def add_server_limits(serve: argparse.ArgumentParser) -> None:
    """Access and bounds of `inkling2 serve` (docs/serving.md: the security model). Left out, each takes
    `ServerSettings`' default, which docs/serving.md lists."""
    access = serve.add_argument_group("access")
    access.add_argument("--api-key", help="required as 'Authorization: Bearer KEY' on /v1/* (default: $INKLING2_API_KEY)")
    access.add_argument(
        "--trust-request-chat-template",
        action="store_true",
        help="let requests replace the chat template (chat_template, chat_template_kwargs.chat_template)",
    )
    access.add_argument(
        "--allowed-hosts",
        nargs="+",
        metavar="NAME",
        help="Host header names answered ('*': any; default: the loopback names when listening on loopback, else any)",
    )
    limits = serve.add_argument_group("limits")
    limits.add_argument("--max-model-len", type=int, help="prompt + max_tokens, in tokens (default: the model's)")
    limits.add_argument("--max-request-bytes", type=int)
    limits.add_argument("--max-images-per-request", type=int)
    limits.add_argument(
        "--max-image-pixels", type=int, help="images are downscaled to this many pixels"
    )
    limits.add_argument("--max-waiting", type=int, help="requests queued; beyond: 503 with Retry-After")
    limits.add_argument("--max-connections", type=int, help="open connections; beyond: 503")
    limits.add_argument("--keep-alive-timeout", type=float, help="seconds an idle connection stays open")
    engine = serve.add_argument_group("the engine (continuous batching; docs/serving.md)")
    engine.add_argument("--max-num-seqs", type=int, help="requests decoded together (default 64)")
    engine.add_argument(
        "--page-size", type=int, help="tokens per page of the key/value cache (a power of two >= 64; default 256)"
    )
    engine.add_argument("--num-pages", type=int, help="pages in the cache (default: sized from the free memory)")
    engine.add_argument(
        "--max-step-tokens", type=int, help="tokens one step runs: decoding rows plus prompt chunks (default 2048)"
    )
    media = serve.add_argument_group("image URLs")
    media.add_argument("--max-media-bytes", type=int)
    media.add_argument("--media-timeout", type=float, help="seconds for one image, redirects included")
    media.add_argument(
        "--allowed-media-domains", nargs="+", metavar="DOMAIN", help="fetch http(s) images only from these domains"
    )
    media.add_argument(
        "--allowed-local-media-path", metavar="DIR", help="let requests read image files under DIR (default: never)"
    )


def main(argv: list[str] | None = None) -> None:
    argv = sys.argv[1:] if argv is None else list(argv)
    if not argv or argv[0] not in (*SUBCOMMANDS, "-h", "--help"):
        argv = ["generate", *argv]
    args = build_parser().parse_args(argv)
    from transformers_inkling2.cli import COMMANDS

    COMMANDS[args.command](args)


if __name__ == "__main__":
    main()
