"""The `inkling2` command (also `python -m transformers_inkling2`).

    inkling2                                  generate with the embedded tiny model (no download)
    inkling2 generate --model PATH --prompt "..." [--max-new-tokens N] [--device cuda] [--dtype bfloat16]
    inkling2 serve [--model PATH] [--host 127.0.0.1] [--port 8000] [--effort high]   OpenAI-compatible server
"""

from __future__ import annotations

import argparse
import sys
import time

import torch

SUBCOMMANDS = ("generate", "serve")
DEFAULT_PROMPT = "Write one sentence about the sea."


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="inkling2", description="Inkling-2-Small with Hugging Face transformers.")
    commands = parser.add_subparsers(dest="command")
    generate = commands.add_parser("generate", help="generate a reply to a prompt (the default command)")
    generate.add_argument("--model", help="checkpoint folder or Hub id; default: the embedded tiny random model")
    generate.add_argument("--prompt", default=DEFAULT_PROMPT)
    generate.add_argument("--max-new-tokens", type=int, default=32)
    generate.add_argument("--device", default="auto", help="cpu, cuda, cuda:1, ... or auto (GPU when present)")
    generate.add_argument("--dtype", default="auto", choices=["auto", "bfloat16", "float32"])
    generate.add_argument("--sample", action="store_true", help="sample instead of greedy decoding")
    generate.add_argument("--temperature", type=float, default=1.0)
    generate.add_argument("--seed", type=int, default=0)
    serve = commands.add_parser("serve", help="an OpenAI-compatible server (/v1/chat/completions, /v1/models)")
    serve.add_argument("--model", help="checkpoint folder or Hub id; default: the embedded tiny random model")
    serve.add_argument("--host", default="127.0.0.1")
    serve.add_argument("--port", type=int, default=8000)
    serve.add_argument("--model-id", help="the name /v1/models reports (default: the checkpoint folder's name)")
    serve.add_argument("--max-tokens", type=int, default=1024, help="for requests that do not say")
    serve.add_argument("--effort", help="default thinking effort: none/minimal/low/medium/high/xhigh/max or 0-0.99")
    serve.add_argument("--device", default="auto", help="cpu, cuda, cuda:1, ... or auto (GPU when present)")
    serve.add_argument("--dtype", default="auto", choices=["auto", "bfloat16", "float32"])
    return parser


def resolve_device(name: str) -> torch.device:
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    return torch.device(name)


def resolve_dtype(name: str, device: torch.device) -> torch.dtype:
    if name == "auto":
        return torch.bfloat16 if device.type == "cuda" else torch.float32
    return getattr(torch, name)


def load_model_and_tokenizer(model_path: str | None, device: torch.device, dtype: torch.dtype):
    """A checkpoint's model and tokenizer, or the embedded tiny model with the real tokenizer."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from .tiny import TINY_MODEL_LABEL, build_tiny_causal_lm
    from .tokenization_inkling2 import build_inkling2_tokenizer

    if model_path is None:
        print(f"[model] {TINY_MODEL_LABEL}", flush=True)
        return build_tiny_causal_lm().to(device=device, dtype=dtype), build_inkling2_tokenizer()
    print(f"[model] {model_path}", flush=True)
    model = AutoModelForCausalLM.from_pretrained(model_path, dtype=dtype, device_map=device)
    return model.eval(), AutoTokenizer.from_pretrained(model_path)


def render_prompt(tokenizer, prompt: str) -> list[int]:
    """One user turn and the start of the model's turn, in the Inkling chat format."""
    if tokenizer.chat_template:
        messages = [{"role": "user", "content": prompt}]
        return tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True, return_dict=False)
    text = f"<|message_user|><|content_text|>{prompt}<|end_message|><|message_model|>"
    return tokenizer(text, add_special_tokens=False)["input_ids"]


def run_generate(args: argparse.Namespace) -> None:
    from transformers import TextStreamer

    device = resolve_device(args.device)
    dtype = resolve_dtype(args.dtype, device)
    model, tokenizer = load_model_and_tokenizer(args.model, device, dtype)
    input_ids = torch.tensor([render_prompt(tokenizer, args.prompt)], device=device)
    torch.manual_seed(args.seed)

    print(f"[prompt] {args.prompt}\n[reply] ", end="", flush=True)
    start = time.perf_counter()
    output = model.generate(
        input_ids,
        attention_mask=torch.ones_like(input_ids),
        max_new_tokens=args.max_new_tokens,
        do_sample=args.sample,
        temperature=args.temperature if args.sample else None,
        top_p=None,
        top_k=None,
        pad_token_id=tokenizer.pad_token_id,
        streamer=TextStreamer(tokenizer, skip_prompt=True),
    )
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    elapsed = time.perf_counter() - start
    new_tokens = output.shape[1] - input_ids.shape[1]
    print(
        f"\n[speed] {new_tokens} new tokens in {elapsed:.2f} s: {new_tokens / elapsed:.1f} tokens/s "
        f"(prompt {input_ids.shape[1]} tokens, {device.type}, {str(dtype).removeprefix('torch.')})"
    )


def run_serve(args: argparse.Namespace) -> None:
    from .serving import serve

    device = resolve_device(args.device)
    model, tokenizer = load_model_and_tokenizer(args.model, device, resolve_dtype(args.dtype, device))
    processor = None
    if args.model is not None:  # images need the checkpoint's image processor; text-only serving works without
        try:
            from .processing_inkling2 import Inkling2Processor

            processor = Inkling2Processor.from_pretrained(args.model)
        except (ImportError, OSError, ValueError) as error:
            print(f"[serve] no image processor ({type(error).__name__}: {error}); serving text only", flush=True)
    effort = args.effort
    if effort is not None and effort.replace(".", "", 1).isdigit():
        effort = float(effort)
    model_id = args.model_id or (args.model.rstrip("/").split("/")[-1] if args.model else "inkling2-tiny-random")
    serve(model, tokenizer, processor, args.host, args.port, model_id, args.max_tokens, effort)


def main(argv: list[str] | None = None) -> None:
    argv = sys.argv[1:] if argv is None else list(argv)
    if not argv or argv[0] not in (*SUBCOMMANDS, "-h", "--help"):
        argv = ["generate", *argv]
    args = build_parser().parse_args(argv)
    {"generate": run_generate, "serve": run_serve}[args.command](args)


if __name__ == "__main__":
    main()
