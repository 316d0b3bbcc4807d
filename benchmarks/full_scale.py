"""The full Inkling-2-Small on the GPUs of one machine, built there with random weights (no checkpoint is written):
memory per GPU, prefill speed and the longest prompt, decode speed with and without DSpark next to the roofline.

The model: the official config (48 layers, 40 sliding + 8 full attention, hidden 4608, 384 experts top-8, the full
vocabulary), routed experts packed like the official checkpoint (NVFP4 in layers 0-39, MXFP8 in 40-47) and the
DSpark drafter. It is made on the meta device, split with the same plans `from_pretrained(...,
distributed_config=DistributedConfig(tp_plan="auto"))` applies (TP attention, EP experts over the same ranks,
vocab-split lm_head), and every rank then fills only its own blocks on its GPU (`random_weights`), replicated
tensors identically on every rank.

    python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .whl/*.whl
    export PYTHONPATH=$PWD/src:/tmp/site
    torchrun --nproc_per_node 4 benchmarks/full_scale.py --out $OUT     # TP4/EP4: prompts up to 262,144 tokens
    torchrun --nproc_per_node 8 benchmarks/full_scale.py --out $OUT     # TP8/EP8: up to 1,048,576
    torchrun --nproc_per_node 2 benchmarks/full_scale.py --quick --out DIR   # toy width: the whole path, CPU or GPU

Measured (rank 0 writes `full_scale.md` and `full_scale.json` under --out):
- memory per GPU after the build;
- prefill of one prompt at 8k and 32k tokens (chunked, `--chunk`), then the longest of `--longest` that fits;
- decode at batch 1 and 16 after `--context` tokens, over `Inkling2StaticCache` replayed as CUDA graphs (what
  `generate(..., cache_implementation="static")` runs): ms per step of plain decoding; for DSpark the 8-token
  verification pass, the draft, and one whole DSpark step (random weights accept nothing, so no acceptance);
- the roofline of a plain decode step: the bytes a rank reads (its attention and lm_head blocks, the experts the
  batch touches in its expert block, the cached keys and values) over the copy bandwidth measured on its GPU.
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import sys
import time
from pathlib import Path

import torch
from torch import nn

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "src"))
sys.path.insert(0, str(Path(__file__).resolve().parent))
from attention import markdown_table  # noqa: E402
from parallel import median_ms as parallel_median_ms  # noqa: E402
from parallel import official_quantization, slice_config  # noqa: E402
from random_weights import expert_format_of, fill_random_, seeded_generator  # noqa: E402

OOM = "OOM"


def full_config(quick: bool, layers: int | None = None):
    from transformers_inkling2 import Inkling2DSparkConfig, Inkling2TextConfig
    from transformers_inkling2.configuration_inkling2 import FULL_LAYER
    from transformers_inkling2.tiny import tiny_dspark_config

    if quick:  # the official head counts at toy width: 48 / 8 heads split like the real ones
        drafter = tiny_dspark_config(target_layer_ids=[0, 1, 2], mask_token_id=499)
        return slice_config(4, 1, quick=True, dspark_config=drafter.to_dict())
    config = Inkling2TextConfig(eos_token_id=None)
    types, mxfp8_from = config.layer_types, 40
    if layers is not None:  # the first layers of the official stack, whose last layer is full attention
        types = config.layer_types[: layers - 1] + [FULL_LAYER]
        mxfp8_from = layers - 1
    drafter = Inkling2DSparkConfig(target_layer_ids=sorted({min(i, len(types) - 2) for i in (1, 12, 23, 34, 45)}))
    quantization = official_quantization(["nvfp4"] * mxfp8_from + ["mxfp8"] * (len(types) - mxfp8_from))
    return Inkling2TextConfig(num_hidden_layers=len(types), layer_types=types, expert_quantization=quantization,
                              eos_token_id=None, dspark_config=drafter.to_dict())  # fmt: skip


def keep_in_fp32(model, name: str) -> bool:
    return any(pattern in name for pattern in model._keep_in_fp32_modules_strict)


def cast_to_bf16_(model) -> None:
    """Float tensors to bf16 in place (the meta device included), except what the original keeps in fp32 and the
    packed experts, whose one-byte codes and scales keep their dtypes."""
    for name, tensor in [*model.named_parameters(), *model.named_buffers()]:
        if tensor.is_floating_point() and tensor.element_size() > 1 and not keep_in_fp32(model, name):
            tensor.data = tensor.data.to(torch.bfloat16)


def build(config, attention: str):
    """The split model, its blocks filled with random values on this rank's device."""
    from torch.distributed.tensor import DTensor
    from transformers import DistributedConfig

    from transformers_inkling2 import Inkling2ForCausalLM

    distributed_config, _, mesh_manager = Inkling2ForCausalLM.prepare_distribute_model(
        DistributedConfig(tp_plan="auto")
    )
    if not torch.distributed.is_initialized():  # one rank: nothing to split, transformers starts no process group
        if torch.cuda.is_available():
            torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", 0)))
        torch.distributed.init_process_group("nccl" if torch.cuda.is_available() else "gloo")
    config._attn_implementation = attention
    with torch.device("meta"):
        model = Inkling2ForCausalLM(config)
    cast_to_bf16_(model)
    model = Inkling2ForCausalLM.maybe_distribute_model(model, distributed_config, mesh_manager)

    device = torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() else torch.device("cpu")
    rank = torch.distributed.get_rank()
    for module_name, module in model.named_modules():
        for kind in ("_parameters", "_buffers"):
            for name, tensor in list(getattr(module, kind).items()):
                if tensor is None:
                    continue
                full_name = f"{module_name}.{name}"
                split = isinstance(tensor, DTensor)
                local = torch.empty((tensor.to_local() if split else tensor).shape, dtype=tensor.dtype, device=device)
                generator = seeded_generator(full_name, device, salt=rank if split else 0)
                fill_random_(local, full_name, expert_format_of(module), generator)
                if split:
                    local = DTensor.from_local(local, tensor.device_mesh, tensor.placements, run_check=False,
                                               shape=tensor.shape, stride=tensor.stride())  # fmt: skip
                getattr(module, kind)[name] = (
                    nn.Parameter(local, requires_grad=False) if kind == "_parameters" else local
                )
    return model.eval(), device


# --- measuring ----------------------------------------------------------------------------------------------------


def synchronize(device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize()
    torch.distributed.barrier()


def median_ms(fn, device, repeats: int, warmup: int = 1) -> float:
    """`parallel.median_ms` with every rank in step (a barrier around each call)."""
    return parallel_median_ms(fn, warmup=warmup, repeats=repeats, sync=lambda: synchronize(device))


def guarded(fn, device):
    """fn() or "OOM": every rank holds the same shapes, so they run out of memory at the same allocation."""
    try:
        return fn()
    except torch.cuda.OutOfMemoryError:
        if device.type == "cuda":
            torch.cuda.empty_cache()
        return OOM


def prompt(batch: int, length: int, vocab: int, device) -> torch.Tensor:
    generator = torch.Generator().manual_seed(length * 131 + batch)
    return torch.randint(0, vocab, (batch, length), generator=generator).to(device)


def copy_bandwidth_gb_s(device) -> float:
    """Bytes read and written per second by a large device copy."""
    size = (1 << 30) if device.type == "cuda" else (1 << 26)
    source = torch.empty(size, dtype=torch.uint8, device=device)
    target = torch.empty_like(source)
    ms = median_ms(lambda: target.copy_(source), device, repeats=5)
    return 2 * size / ms / 1e6


def local_bytes(tensor) -> int:
    local = tensor.to_local() if hasattr(tensor, "to_local") else tensor
    return local.numel() * local.element_size()


def decode_step_bytes(model, batch: int, context: int) -> int:
    """Bytes one plain decode step reads on this rank: every local weight outside the experts, the drafter and the
    embedding table (one row per token), the experts the batch touches in expectation (top-k of E, uniform), and
    the cached keys and values (sliding layers up to their window)."""
    config = model.config
    total = 0
    for name, tensor in [*model.named_parameters(), *model.named_buffers()]:
        if ".experts." in name or name.startswith("dspark.") or "embed_tokens.weight" in name:
            continue
        total += local_bytes(tensor)
    touched = 1 - (1 - config.num_experts_per_tok / config.n_routed_experts) ** batch
    total += sum(local_bytes(t) for name, t in model.named_buffers() if ".experts." in name) * touched
    total += sum(local_bytes(t) for name, t in model.named_parameters() if ".experts." in name) * touched
    for layer in model.model.layers:
        attention = layer.self_attn
        channels = local_bytes(attention.k_proj.weight) // attention.k_proj.weight.shape[1] // 2  # local kv heads x dim
        keys = context if attention.sliding_window is None else min(context, attention.sliding_window)
        total += 2 * batch * keys * channels * 2  # keys and values, bf16
    return int(total)


def decode_measures(model, device, batch: int, args) -> dict:
    from transformers import CompileConfig

    from transformers_inkling2 import Inkling2DecodeGraphs, Inkling2StaticCache
    from transformers_inkling2.generation.dspark import DSparkDecoder, DSparkOptions

    vocab, block = model.config.unpadded_vocab_size, model.dspark.config.block_size
    length = args.context + args.steps * (block + 1) + 64
    compile_config = CompileConfig() if args.compile else None
    runner = Inkling2DecodeGraphs(model, use_cuda_graphs=device.type == "cuda", compile_config=compile_config)
    chunk = max(1, args.chunk // batch)
    result = {}

    cache = Inkling2StaticCache(model.config, length, batch)
    with torch.no_grad():
        logits = model(prompt(batch, args.context, vocab, device), past_key_values=cache, logits_to_keep=1,
                       prefill_chunk_size=chunk).logits  # fmt: skip
        token = logits[:, -1:].argmax(-1)

        def plain_step():
            nonlocal token
            token = runner(input_ids=token, past_key_values=cache, use_cache=True, logits_to_keep=1).logits.argmax(-1)

        result["plain_step_ms"] = median_ms(plain_step, device, repeats=args.steps, warmup=3)
        candidates = token.repeat(1, block + 1)

        def verify_pass():
            runner(input_ids=candidates, past_key_values=cache, use_cache=True, output_hidden_states=True)
            cache.crop(-(block + 1))

        result["verify_pass_ms"] = median_ms(verify_pass, device, repeats=args.steps, warmup=3)

        config = model.generation_config
        config.do_sample, config.compile_config = False, compile_config
        dspark_cache = Inkling2StaticCache(model.config, length, batch)
        decoder = DSparkDecoder(model, dspark_cache, [], config, DSparkOptions("greedy"))
        ids = prompt(batch, args.context, vocab, device)
        anchor = decoder.prefill(ids, None, model.get_input_embeddings()(ids), chunk)
        alive = [True] * batch
        result["draft_ms"] = median_ms(lambda: decoder.draft(anchor, alive), device, repeats=args.steps, warmup=3)

        def dspark_step():
            nonlocal anchor
            anchor, _ = decoder.step(anchor, alive)

        result["dspark_step_ms"] = median_ms(dspark_step, device, repeats=args.steps, warmup=2)
    return result


def measure(model, device, args) -> dict:
    result = {
        "held_gib": sum(local_bytes(t) for t in [*model.parameters(), *model.buffers()]) / 2**30,
        "allocated_after_build_gib": torch.cuda.memory_allocated() / 2**30 if device.type == "cuda" else None,
    }
    vocab = model.config.unpadded_vocab_size
    result["copy_bandwidth_gb_s"] = copy_bandwidth_gb_s(device)
    with torch.no_grad():
        for length in args.prefill:
            ids = prompt(1, length, vocab, device)
            ms = guarded(lambda: median_ms(lambda: model(ids, logits_to_keep=1, prefill_chunk_size=args.chunk),
                                           device, repeats=2), device)  # fmt: skip
            result[f"prefill_{length}"] = {"ms": ms, "tokens_per_s": None if ms == OOM else length / ms * 1e3}
            print(f"prefill {length}: {ms}", flush=True)
        for length in args.longest:
            ids = prompt(1, length, vocab, device)
            ms = guarded(lambda: median_ms(lambda: model(ids, logits_to_keep=1, prefill_chunk_size=args.chunk),
                                           device, repeats=1, warmup=0), device)  # fmt: skip
            result[f"longest_{length}"] = {"ms": ms, "tokens_per_s": None if ms == OOM else length / ms * 1e3}
            print(f"longest {length}: {ms}", flush=True)
            if ms == OOM:
                break
            result["fits_up_to"] = length
    for batch in args.decode_batch:
        decode = guarded(lambda: decode_measures(model, device, batch, args), device)
        if decode != OOM:
            decode["roofline_ms"] = decode_step_bytes(model, batch, args.context) / result["copy_bandwidth_gb_s"] / 1e6
        result[f"decode_batch{batch}"] = decode
        print(f"decode batch {batch}: {decode}", flush=True)
    peak = torch.cuda.max_memory_allocated() / 2**30 if device.type == "cuda" else None
    result["peak_allocated_gib"] = peak
    return result


def report(args, world: int, per_rank: list[dict], build_seconds: float) -> str:
    first = per_rank[0]
    name = torch.cuda.get_device_name() if torch.cuda.is_available() else "CPU"
    lines = [
        f"## Full Inkling-2-Small, TP{world}/EP{world}{' (--quick: toy width)' if args.quick else ''}"
        f"{f' (first {args.layers} layers)' if args.layers else ''}\n",
        f"{world} x {name}, torch {torch.__version__}; built with random weights in {build_seconds:.0f} s; "
        f"attention `{args.attention}`; prefill chunks of {args.chunk} tokens; decode after {args.context} tokens "
        f"over the static cache ({'CUDA graphs' if torch.cuda.is_available() else 'eager, no GPU'}"
        f"{', steps compiled by torch.compile' if args.compile else ''}).\n",
        "Model bytes per rank, GiB: " + ", ".join(f"{r['held_gib']:.2f}" for r in per_rank) + ". "
        "Memory per rank after the build, GiB: "
        + ", ".join(
            "-" if r["allocated_after_build_gib"] is None else f"{r['allocated_after_build_gib']:.1f}" for r in per_rank
        )  # fmt: skip
        + "; peak: "
        + ", ".join("-" if r["peak_allocated_gib"] is None else f"{r['peak_allocated_gib']:.1f}" for r in per_rank)
        + f". Copy bandwidth (rank 0): {first['copy_bandwidth_gb_s']:.0f} GB/s.\n",
    ]
    rows = [[key.replace("_", " "), value["ms"] if value["ms"] == OOM else f"{value['ms']:.0f}",
             "-" if value["tokens_per_s"] is None else f"{value['tokens_per_s']:,.0f}"]
            for key, value in first.items() if key.startswith(("prefill_", "longest_"))]  # fmt: skip
    lines.append(markdown_table(["prefill", "ms", "tokens/s"], rows))
    if args.longest:
        lines.append(f"\nLongest prompt of {args.longest} that ran: {first.get('fits_up_to', 'none')} tokens.\n")
    rows = []
    for batch in args.decode_batch:
        d = first[f"decode_batch{batch}"]
        if d == OOM:
            rows.append([batch, OOM, "", "", "", "", ""])
            continue
        rows.append([batch, f"{d['plain_step_ms']:.2f}", f"{d['plain_step_ms'] / batch:.3f}", f"{d['roofline_ms']:.2f}",
                     f"{d['verify_pass_ms']:.2f}", f"{d['draft_ms']:.2f}", f"{d['dspark_step_ms']:.2f}"])  # fmt: skip
    lines.append("\n" + markdown_table(
        ["batch", "plain step ms", "ms per token", "roofline ms", "DSpark verify pass ms", "draft ms",
         "DSpark step ms"], rows))  # fmt: skip
    return "\n".join(lines) + "\n"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", default=os.environ.get("OUT", "."))
    parser.add_argument("--quick", action="store_true", help="toy width: the whole path in seconds, CPU or GPU")
    parser.add_argument("--attention", default=None, help="attn_implementation (default inkling2_flex on CUDA)")
    parser.add_argument("--prefill", type=int, nargs="*", default=None, help="timed prompt lengths")
    parser.add_argument("--longest", type=int, nargs="*", default=None, help="lengths tried in order until OOM")
    parser.add_argument("--chunk", type=int, default=16384)
    parser.add_argument("--context", type=int, default=None)
    parser.add_argument("--decode-batch", type=int, nargs="*", default=[1, 16])
    parser.add_argument("--steps", type=int, default=None, help="timed decode steps")
    parser.add_argument("--compile", action="store_true", help="torch.compile the decode steps inside the graphs")
    parser.add_argument(
        "--layers",
        type=int,
        default=None,
        help="only the first N layers at full width (the last one full attention): a slice that fits "
        "fewer GPUs, to try the script",
    )
    args = parser.parse_args()
    if "WORLD_SIZE" not in os.environ:
        sys.exit("Start it with torchrun (see the docstring): the model is split over the ranks.")
    world = int(os.environ["WORLD_SIZE"])
    args.attention = args.attention or ("inkling2_flex" if torch.cuda.is_available() else "eager")
    args.prefill = args.prefill if args.prefill is not None else ([64, 256] if args.quick else [8192, 32768])
    goal = 262144 if world <= 4 else 1048576
    args.longest = args.longest if args.longest is not None else ([] if args.quick else
                                                                  [n for n in (131072, 262144, 524288, 1048576) if n <= goal])  # fmt: skip
    args.context = args.context or (64 if args.quick else 4096)
    args.steps = args.steps or (3 if args.quick else 16)

    import transformers_inkling2  # noqa: F401  (registers the classes and the parallel styles)

    started = time.perf_counter()
    model, device = build(full_config(args.quick, args.layers), args.attention)
    synchronize(device)
    build_seconds = time.perf_counter() - started
    result = measure(model, device, args)
    per_rank = [None] * world
    torch.distributed.all_gather_object(per_rank, result)
    if torch.distributed.get_rank() == 0:
        out = Path(args.out)
        out.mkdir(parents=True, exist_ok=True)
        text = report(args, world, per_rank, build_seconds)
        (out / "full_scale.md").write_text(text)
        (out / "full_scale.json").write_text(json.dumps({"args": vars(args), "per_rank": per_rank}, indent=1))
        print(text, flush=True)
    torch.distributed.barrier()
    # the decode measurements' CUDA graphs captured NCCL calls, and NCCL's teardown waits forever while such a graph
    # is alive (pytorch/pytorch#115388; this script hung here on two H200): collect them first
    gc.collect()
    torch.distributed.destroy_process_group()


if __name__ == "__main__":
    main()
