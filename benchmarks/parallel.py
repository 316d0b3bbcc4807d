"""Tensor/expert parallelism on two GPUs: a full-width Inkling-2-Small slice loaded with `tp_plan="auto"` next to
the same checkpoint on one GPU: outputs, per-GPU memory, prefill and decode times.

The slice has the official widths (hidden 4608, 48 q / 8 kv heads, head_dim 128, 384 experts of width 2304, top-8,
the full 201,024-token vocabulary) and `--layers` layers (default 4: three sliding, the last one full attention),
routed experts stored like the official checkpoint (NVFP4, the last `--mxfp8-layers` MXFP8), random weights. About
40 GB at 4 layers; a TP2 rank holds half the experts and attention plus the replicated embedding.

    python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .whl/*.whl
    export PYTHONPATH=$PWD/src:/tmp/site
    python3 benchmarks/parallel.py build --checkpoint /tmp/slice              # once, on the CPU (host RAM + disk)
    python3 benchmarks/parallel.py run --checkpoint /tmp/slice --out $OUT     # one GPU: writes reference.pt
    torchrun --nproc_per_node 2 benchmarks/parallel.py run --checkpoint /tmp/slice --out $OUT   # two GPUs

The two-GPU run compares its logits and greedy tokens with `reference.pt` of the one-GPU run (same --out) and
writes `parallel.md` / `parallel.json` with both runs side by side. BF16 activations: the split changes the order of
the sums (o_proj and the MoE are all-reduced), so logits agree to bf16 rounding, not bitwise; the report gives the
relative error, the argmax agreement and how many greedy tokens match. `--quick` runs the whole path on a toy-width
model (CPU and gloo work: `torchrun --nproc_per_node 2 benchmarks/parallel.py run --quick ...`).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
import warnings
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "src"))
sys.path.insert(0, str(Path(__file__).resolve().parent))
from attention import markdown_table  # noqa: E402
from random_weights import expert_format_of, fill_random_, seeded_generator  # noqa: E402

PROMPT_TOKENS, COMPARED_POSITIONS, GREEDY_TOKENS = 512, 16, 32


def official_quantization(formats: list[str]) -> dict:
    """`expert_quantization` of a config whose layers' experts are stored as `formats` ("nvfp4" / "mxfp8" per layer),
    with the official checkpoint's NVFP4 outer scales (`scale_2`, one per gate/up half)."""
    return {"formats": formats, "nvfp4_outer_scales": ["scale_2"], "nvfp4_outer_per_half": True}


def slice_config(layers: int, mxfp8_layers: int, quick: bool, **extra):
    """`layers` layers (the last one full attention, the others sliding), the last `mxfp8_layers` with MXFP8 experts
    and NVFP4 before; official widths, or with `quick` a toy width with the official head counts. `extra`: more
    config fields."""
    from transformers_inkling2 import Inkling2TextConfig
    from transformers_inkling2.configuration_inkling2 import FULL_LAYER, SLIDING_LAYER
    from transformers_inkling2.tiny import tiny_text_config

    types = [SLIDING_LAYER] * (layers - 1) + [FULL_LAYER]
    quantization = official_quantization(["nvfp4"] * (layers - mxfp8_layers) + ["mxfp8"] * mxfp8_layers)
    if quick:
        heads = dict(num_attention_heads=48, num_key_value_heads=8, swa_num_attention_heads=48,
                     swa_num_key_value_heads=8, head_dim=8, swa_head_dim=8)  # fmt: skip
        return tiny_text_config(num_hidden_layers=layers, layer_types=types, expert_quantization=quantization,
                                vocab_size=512, unpadded_vocab_size=500, eos_token_id=None, **heads, **extra)  # fmt: skip
    return Inkling2TextConfig(num_hidden_layers=layers, layer_types=types, expert_quantization=quantization,
                              eos_token_id=None, **extra)  # fmt: skip


def fill_randomly_(model, seed: int = 0) -> None:
    """Random weights without a dequantized copy (`random_weights.fill_random_`), tensor by tensor."""
    device = "cuda" if torch.cuda.is_available() else "cpu"
    for module_name, module in model.named_modules():
        for name, tensor in [*module.named_parameters(recurse=False), *module.named_buffers(recurse=False)]:
            full_name = f"{module_name}.{name}"
            local = tensor.data.to(device)
            fill_random_(local, full_name, expert_format_of(module), seeded_generator(full_name, device, seed))
            tensor.data.copy_(local)


def build(args) -> None:
    from transformers_inkling2 import Inkling2ForCausalLM

    started = time.perf_counter()
    config = slice_config(args.layers, args.mxfp8_layers, args.quick)
    model = Inkling2ForCausalLM(config).to(torch.bfloat16)  # packed experts keep their dtypes
    fill_randomly_(model)
    model.save_pretrained(args.checkpoint, max_shard_size="5GB")
    print(f"wrote {args.checkpoint} in {time.perf_counter() - started:.0f} s", flush=True)


# --- measuring ----------------------------------------------------------------------------------------------------


def synchronize() -> None:
    if torch.cuda.is_available():
        torch.cuda.synchronize()


def median_ms(fn, warmup: int = 1, repeats: int = 3, sync=synchronize) -> float:
    """Median wall time of `fn`, with `sync()` (by default the GPU's) before and after each call."""
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(repeats):
        sync()
        start = time.perf_counter()
        fn()
        sync()
        times.append((time.perf_counter() - start) * 1000)
    return statistics.median(times)


def memory_gib() -> dict:
    if not torch.cuda.is_available():
        return {}
    return {
        "allocated_gib": torch.cuda.memory_allocated() / 2**30,
        "peak_gib": torch.cuda.max_memory_allocated() / 2**30,
    }


def prompt(batch: int, length: int, vocab: int, device) -> torch.Tensor:
    generator = torch.Generator().manual_seed(batch * 7 + length)
    return torch.randint(0, vocab, (batch, length), generator=generator).to(device)


def measure(model, args, device) -> dict:
    from transformers_inkling2 import Inkling2Cache

    vocab = model.config.unpadded_vocab_size
    result = {"memory_after_load": memory_gib()}
    with torch.no_grad():
        ids = prompt(2, PROMPT_TOKENS, vocab, device)
        result["logits"] = model(ids, logits_to_keep=COMPARED_POSITIONS).logits.float().cpu()
        generated = model.generate(
            ids[:1], max_new_tokens=GREEDY_TOKENS, do_sample=False, eos_token_id=None, pad_token_id=0
        )
        result["greedy"] = generated[0, PROMPT_TOKENS:].cpu()

        for length in args.prefill:
            ids = prompt(1, length, vocab, device)
            result[f"prefill_{length}_ms"] = median_ms(
                lambda: model(ids, logits_to_keep=1, prefill_chunk_size=args.prefill_chunk), repeats=2
            )
        for batch in args.decode_batch:
            cache = Inkling2Cache(model.config)
            ids = prompt(batch, args.context, vocab, device)
            chunk = max(1, args.prefill_chunk // batch)  # a chunk's relative logits stay under 2^31 elements
            next_token = model(ids, past_key_values=cache, logits_to_keep=1, prefill_chunk_size=chunk)
            next_token = next_token.logits[:, -1:].argmax(-1)

            def step():
                nonlocal next_token
                logits = model(next_token, past_key_values=cache, logits_to_keep=1).logits
                next_token = logits[:, -1:].argmax(-1)

            for _ in range(3):  # warm-up (compilation of the decode path, allocator)
                step()
            synchronize()
            started = time.perf_counter()
            for _ in range(args.decode_steps):
                step()
            synchronize()
            result[f"decode_batch{batch}_ms_per_step"] = (time.perf_counter() - started) * 1000 / args.decode_steps
    result["memory_peak"] = memory_gib()
    return result


def load(args, distributed: bool):
    from transformers import DistributedConfig

    from transformers_inkling2 import Inkling2ForCausalLM

    kwargs = dict(dtype=torch.bfloat16, attn_implementation=args.attention)
    if distributed:
        kwargs["distributed_config"] = DistributedConfig(tp_plan="auto")
    elif torch.cuda.is_available():
        kwargs["device_map"] = "cuda:0"
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=".*deprecated")
        model = Inkling2ForCausalLM.from_pretrained(args.checkpoint, **kwargs)
    return model


def compare(tp: dict, reference: dict) -> dict:
    logits, expected = tp["logits"], reference["logits"]
    matching = 0
    for got, want in zip(tp["greedy"].tolist(), reference["greedy"].tolist()):
        if got != want:
            break
        matching += 1
    return {
        "logits_relative_error": ((logits - expected).abs().max() / expected.abs().max()).item(),
        "argmax_agreement": (logits.argmax(-1) == expected.argmax(-1)).float().mean().item(),
        "greedy_tokens_matching": f"{matching} / {len(reference['greedy'])}",
    }


def run(args) -> None:
    import transformers_inkling2  # noqa: F401  (registers the classes)

    world = int(os.environ.get("WORLD_SIZE", "1"))
    distributed = world > 1
    model = load(args, distributed)
    device = next(p for p in model.parameters()).device
    rank = torch.distributed.get_rank() if distributed else 0
    if torch.cuda.is_available():
        torch.cuda.reset_peak_memory_stats()
    result = measure(model, args, device)
    out = Path(args.out)
    tensors = {key: result.pop(key) for key in ("logits", "greedy")}
    if not distributed:
        out.mkdir(parents=True, exist_ok=True)
        torch.save({**tensors, "result": result}, out / "reference.pt")
        print(json.dumps(result, indent=1))
        return
    per_rank = [None] * world
    torch.distributed.all_gather_object(per_rank, {"memory_after_load": result["memory_after_load"],
                                                    "memory_peak": result["memory_peak"]})  # fmt: skip
    if rank == 0:
        reference = torch.load(out / "reference.pt") if (out / "reference.pt").exists() else None
        report(args, world, result, per_rank, tensors, reference)
    torch.distributed.barrier()


def report(args, world, result, per_rank, tensors, reference) -> None:
    single = reference["result"] if reference else {}
    rows = []
    for key in result:
        if key.startswith(("prefill", "decode")):
            rows.append([key, f"{single[key]:.1f}" if key in single else "-", f"{result[key]:.1f}"])
    for name in ("memory_after_load", "memory_peak"):
        for field in ("allocated_gib", "peak_gib"):
            if field in result[name]:
                ranks = ", ".join(f"{r[name][field]:.1f}" for r in per_rank)
                one = single.get(name, {}).get(field)
                rows.append([f"{name}.{field}", "-" if one is None else f"{one:.1f}", ranks])
    comparison = compare({**tensors}, reference) if reference else {"note": "no reference.pt: run on one GPU first"}
    device = torch.cuda.get_device_name(0) if torch.cuda.is_available() else "CPU (gloo)"
    text = "\n".join([
        f"## Tensor/expert parallelism: {args.layers}-layer {'toy-width' if args.quick else 'full-width'} slice, "
        f"TP{world}/EP{world} vs one GPU",
        "",
        f"{device}, torch {torch.__version__}, attention `{args.attention}`, bf16, context {args.context} for decode,"
        f" prefill chunks of {args.prefill_chunk}.",
        "",
        markdown_table(["measure", "1 GPU", f"TP{world} (per rank)"], rows),
        "",
        "Outputs (prefill logits of the last positions of 2 x 512 tokens; greedy decoding of 32 tokens): "
        + ", ".join(f"{key} = {value:.3g}" if isinstance(value, float) else f"{key} = {value}"
                    for key, value in comparison.items()),  # fmt: skip
    ])
    print(text, flush=True)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "parallel.md").write_text(text + "\n")
    data = {"single": single, "parallel": result, "per_rank_memory": per_rank, "comparison": comparison}
    (out / "parallel.json").write_text(json.dumps(data, indent=1, default=str))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("mode", choices=["build", "run"])
    parser.add_argument("--checkpoint", required=True)
    parser.add_argument("--out", default=os.environ.get("OUT", "."))
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--mxfp8-layers", type=int, default=1)
    parser.add_argument("--quick", action="store_true", help="toy width (CPU smoke test of the whole path)")
    parser.add_argument("--attention", default=None, help="attn_implementation (default: inkling2_flex on CUDA)")
    parser.add_argument("--prefill", type=int, nargs="*", default=None, help="prompt lengths timed for prefill")
    parser.add_argument("--prefill-chunk", type=int, default=16384)
    parser.add_argument("--context", type=int, default=None, help="cached tokens before the timed decode steps")
    parser.add_argument("--decode-batch", type=int, nargs="*", default=[1, 8])
    parser.add_argument("--decode-steps", type=int, default=None)
    args = parser.parse_args()
    args.attention = args.attention or ("inkling2_flex" if torch.cuda.is_available() else "eager")
    args.prefill = args.prefill or ([64] if args.quick else [4096, 32768])
    args.context = args.context or (64 if args.quick else 8192)
    args.decode_steps = args.decode_steps or (4 if args.quick else 32)
    build(args) if args.mode == "build" else run(args)


if __name__ == "__main__":
    main()
