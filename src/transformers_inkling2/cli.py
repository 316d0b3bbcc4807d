"""The `inkling2` command's subcommands, run on arguments parsed by `transformers_inkling2_cli` (the entry point,
which imports this module only once the arguments parse)."""

from __future__ import annotations

import argparse
import time

import torch

DEFAULT_TEXT_PROMPT = "What does `len` do?"  # the main job's question to a checkpoint without an image processor


def resolve_device(name: str) -> torch.device:
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    return torch.device(name)


def resolve_dtype(name: str, device: torch.device) -> torch.dtype:
    if name == "auto":
        return torch.bfloat16 if device.type == "cuda" else torch.float32
    return getattr(torch, name)


def load(model_path: str | None, device: torch.device, dtype: torch.dtype):
    """(model, processor, tokenizer) of a checkpoint, by default the embedded Inkling-2-Nano. The processor is None
    for a text-only checkpoint; the tokenizer is loaded once."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from .nano import NANO_CHECKPOINT, NANO_LABEL
    from .processing.processing_inkling2 import Inkling2Processor

    print(f"[model] {NANO_LABEL if model_path is None else model_path}", flush=True)
    path = model_path or NANO_CHECKPOINT
    model = AutoModelForCausalLM.from_pretrained(path, dtype=dtype, device_map=device).eval()
    try:
        processor = Inkling2Processor.from_pretrained(path)
    except (OSError, ValueError):
        return model, None, AutoTokenizer.from_pretrained(path)
    return model, processor, processor.tokenizer


class CountingStreamer:
    """Prints the reply as it is generated and keeps its token ids."""

    def __init__(self, tokenizer):
        from transformers import TextStreamer

        self.printer = TextStreamer(tokenizer, skip_prompt=True)
        self.prompt_seen, self.new_ids = False, []

    @property
    def new_tokens(self) -> int:
        return len(self.new_ids)

    def put(self, value):
        if self.prompt_seen:
            self.new_ids += value.flatten().tolist()
        else:  # the prompt arrives once generate() has set up (and logged which path it takes)
            print("[reply] ", end="", flush=True)
        self.prompt_seen = True
        self.printer.put(value)

    def end(self):
        self.printer.end()


def compile_config(args: argparse.Namespace):
    """transformers' `CompileConfig` for `--compile` (None without it): the decode steps replayed as CUDA graphs (the
    static cache, generate()'s default on CUDA) then run the `torch.compile`d model (`Inkling2DecodeGraphs`)."""
    if not args.compile:
        return None
    from transformers import CompileConfig

    return CompileConfig()


def picture_question(seed: int) -> tuple[str, str, str]:
    """The main job's default question: (question, image file, what the picture shows) about a scene drawn for this
    run from `seed` (a stream that Inkling-2-Nano's training never drew from)."""
    import random
    import tempfile
    from pathlib import Path

    from .nano.scenes import ask, draw_scene

    rng = random.Random(f"main-job-{seed}")
    image, scene = draw_scene(rng)
    _, question, _ = ask(scene, rng)
    path = Path(tempfile.mkdtemp(prefix="inkling2-")) / "picture.png"
    image.save(path)
    return question, str(path), scene.description()


def timed(device: torch.device, run):
    start = time.perf_counter()
    result = run()
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    return result, time.perf_counter() - start


def run_generate(args: argparse.Namespace) -> None:
    """One chat turn through transformers' pipeline ("image-text-to-text", or "text-generation" for a text-only
    checkpoint), streamed, with its speed; with `--dspark`, through `generate` twice (plain, then DSpark), to print the
    drafter's accepted length and speedup. Without `--prompt`: a question about a picture drawn for the run."""
    from transformers import pipeline

    from .processing.response_parsing import parse_response

    compile_steps = compile_config(args)
    device = resolve_device(args.device)
    dtype = resolve_dtype(args.dtype, device)
    model, processor, tokenizer = load(args.model, device, dtype)
    if args.image and processor is None:
        raise SystemExit(f"{args.model} has no image processor (preprocessor_config.json): it cannot take --image.")
    prompt, image = args.prompt, args.image
    if prompt is None and image is None and processor is not None:
        prompt, image, truth = picture_question(args.seed)
        print(f"[picture] drawn for this run (--seed {args.seed}), saved as {image}: {truth}", flush=True)
    prompt = prompt or DEFAULT_TEXT_PROMPT
    content = [{"type": "text", "text": prompt}]
    if image:
        content.insert(0, {"type": "image", "url" if "://" in image else "path": image})
    messages = [{"role": "user", "content": content}]
    torch.manual_seed(args.seed)
    streamer = CountingStreamer(tokenizer)
    generation = dict(
        max_new_tokens=args.max_new_tokens,
        do_sample=args.sample,
        temperature=args.temperature if args.sample else None,
        top_p=None,
        top_k=None,
        cache_implementation="static" if args.static_cache else None,
        compile_config=compile_steps,
    )
    print(f"[prompt] {prompt}" + (f" [image: {image}]" if image else ""), flush=True)
    if args.dspark:
        dspark_turn(model, processor or tokenizer, messages, generation, streamer, device, args.seed)
    else:
        if processor is not None:  # the two pipelines name their inputs and generation arguments differently
            generator = pipeline("image-text-to-text", model=model, processor=processor)
            call = dict(text=messages, generate_kwargs=dict(generation, streamer=streamer))
        else:
            generator = pipeline("text-generation", model=model, tokenizer=tokenizer)
            call = dict(text_inputs=messages, streamer=streamer, **generation)
        _, elapsed = timed(device, lambda: generator(**call))
        print(
            f"[speed] {streamer.new_tokens} new tokens in {elapsed:.2f} s: {streamer.new_tokens / elapsed:.1f} tokens/s "
            f"({device.type}, {str(dtype).removeprefix('torch.')}, prompt processing included)"
        )
    message = parse_response(streamer.new_ids, tokenizer)
    for call in message["tool_calls"]:
        print(f"[tool call] {call['function']['name']}({call['function']['arguments']})")
    print(f"[answer] {message['content']}")


def dspark_turn(model, processor, messages, generation: dict, streamer, device, seed: int) -> None:
    """The turn decoded plainly (timed, not printed), then with the DSpark drafter (streamed): accepted length and
    speedup. Greedy DSpark is lossless, so both write the same reply; sampled, they write different ones, so the
    speedup compares tokens per second."""
    inputs = processor.apply_chat_template(
        messages, add_generation_prompt=True, tokenize=True, return_dict=True, return_tensors="pt"
    ).to(model.device)
    prompt_length = inputs["input_ids"].shape[1]
    torch.manual_seed(seed)
    plain, plain_s = timed(device, lambda: model.generate(**inputs, **generation))
    torch.manual_seed(seed)
    drafted, dspark_s = timed(device, lambda: model.generate(
        **inputs, **generation, dspark=True, return_dict_in_generate=True, streamer=streamer))  # fmt: skip
    plain_rate = (plain.shape[1] - prompt_length) / plain_s
    dspark_rate = streamer.new_tokens / dspark_s
    print(
        f"[dspark] accepted length {drafted.mean_accepted_length:.2f} tokens per step ({drafted.num_steps} steps); "
        f"{dspark_rate:.1f} tokens/s against {plain_rate:.1f} plain: speedup {dspark_rate / plain_rate:.2f}x"
    )


def run_quantize(args: argparse.Namespace) -> None:
    from .quantization.quantize import quantize_checkpoint

    target = quantize_checkpoint(args.source, args.target, mxfp8_from=args.mxfp8_from)
    print(f"[quantize] wrote {target}")


def server_settings(args: argparse.Namespace, model_id: str, effort):
    """`ServerSettings` from the flags; a flag left out keeps the settings' default."""
    from .serving.media import MediaPolicy
    from .serving.settings import ServerSettings

    def given(**fields):
        return {name: value for name, value in fields.items() if value is not None}

    media = MediaPolicy(**given(
        max_bytes=args.max_media_bytes,
        timeout_s=args.media_timeout,
        allowed_domains=tuple(args.allowed_media_domains) if args.allowed_media_domains else None,
        allowed_local_path=args.allowed_local_media_path,
    ))  # fmt: skip
    return ServerSettings(media=media, trust_request_chat_template=args.trust_request_chat_template, **given(
        model_id=model_id,
        host=args.host,
        port=args.port,
        api_key=args.api_key,
        allowed_hosts=tuple(args.allowed_hosts) if args.allowed_hosts else None,
        max_model_len=args.max_model_len,
        default_max_tokens=args.max_tokens,
        default_effort=effort,
        max_request_bytes=args.max_request_bytes,
        max_images_per_request=args.max_images_per_request,
        max_image_pixels=args.max_image_pixels,
        max_waiting=args.max_waiting,
        max_connections=args.max_connections,
        keep_alive_timeout_s=args.keep_alive_timeout,
        max_num_seqs=args.max_num_seqs,
        page_size=args.page_size,
        num_pages=args.num_pages,
        max_step_tokens=args.max_step_tokens,
        dspark=args.dspark,
    ))  # fmt: skip


def run_serve(args: argparse.Namespace) -> None:
    try:
        from .serving.server import serve
    except ModuleNotFoundError as error:
        raise SystemExit(f"inkling2 serve needs {error.name}: pip install 'transformers-inkling2[serve]'") from None

    effort = args.effort
    if effort is not None and effort.replace(".", "", 1).isdigit():
        effort = float(effort)
    model_id = args.model_id or (args.model.rstrip("/").split("/")[-1] if args.model else "inkling2-nano")
    try:  # bad flags fail before the model loads
        settings = server_settings(args, model_id, effort)
    except ValueError as error:
        raise SystemExit(f"inkling2 serve: {error}") from None
    device = resolve_device(args.device)
    model, processor, tokenizer = load(args.model, device, resolve_dtype(args.dtype, device))
    if processor is None:
        print("[serve] the checkpoint has no image processor: serving text only", flush=True)
    try:
        serve(model, tokenizer, processor, settings)
    except ValueError as error:  # what the model contradicts: --max-model-len (its positions, its cache), --effort
        raise SystemExit(f"inkling2 serve: {error}") from None


def run_plan(args: argparse.Namespace) -> None:
    from .configuration_inkling2 import Inkling2Config
    from .parallel.planning import NoRoomForPages, format_pages, format_plan, memory_plan, serving_pages

    config = Inkling2Config.from_pretrained(args.config) if args.config else Inkling2Config()
    engine = {name: getattr(args, name) for name in ("max_num_seqs", "page_size", "max_step_tokens", "dspark")}
    try:
        plan = memory_plan(config, args.variant, args.tp, args.ep, args.context, args.batch, args.prefill_chunk)
        pages = serving_pages(config, args.gpu_gib, args.variant, args.tp, args.ep, **engine)
    except NoRoomForPages as error:  # the table still says what does not fit
        pages = error
    except ValueError as error:
        raise SystemExit(f"inkling2 plan: {error}") from None
    print(
        f"[plan] {args.variant} experts, TP {args.tp} / EP {args.ep or args.tp}, {args.batch} x {args.context:,} tokens, "
        f"prefill chunks of {args.prefill_chunk:,}\n{format_plan(plan, args.gpu_gib)}"
    )
    if isinstance(pages, NoRoomForPages):
        raise SystemExit(f"inkling2 plan: {pages}")
    print(
        f"\n[pages] the serving engine: {args.max_num_seqs} rows, pages of {args.page_size} tokens, steps of "
        f"{args.max_step_tokens:,} tokens{', DSpark' if args.dspark else ''}\n{format_pages(pages)}"
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


def run_train_nano(args: argparse.Namespace) -> None:
    import json

    from .nano.training import train_nano

    report = train_nano(
        args.output,
        steps=args.steps,
        batch_size=args.batch_size,
        learning_rate=args.learning_rate,
        drafter_steps=args.drafter_steps,
        seed=args.seed,
        device=resolve_device(args.device),
        workers=args.workers,
        held_out=args.held_out,
        max_minutes=args.max_minutes,
    )
    if "paused_at_step" in report:
        print(f"[train-nano] paused at step {report['paused_at_step']} of {report['steps']} (state in "
              f"{report['state']}): run the same command again to continue")  # fmt: skip
        return
    summary = {name: value for name, value in report.items() if not name.endswith("failures")}
    print(f"[train-nano] wrote {args.output}\n{json.dumps(summary, indent=2)}")


COMMANDS = {
    "generate": run_generate,
    "serve": run_serve,
    "quantize": run_quantize,
    "plan": run_plan,
    "train-dspark": run_train_dspark,
    "train-nano": run_train_nano,
}
