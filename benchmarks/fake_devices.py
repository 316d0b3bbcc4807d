"""The whole Inkling-2-Small at its real sizes, split for a GB200 tray (TP4/EP4) or two (TP8/EP8), in one CPU process
without GPUs and without memory: the model (48 layers, the ViT, the DSpark drafter, the official vocabulary, experts
packed as `--variant` stores them) is built on the meta device and split with the plans `tp_plan="auto"` applies,
this process acting as one rank after another through torch.distributed's fake process group.

    python benchmarks/fake_devices.py --tp 4                     # one tray: ranks 0 and 3, a 262,144-token context
    python benchmarks/fake_devices.py --tp 8 --all-ranks --json report.json   # two trays: 1,048,576 tokens

For rank 0 and the last rank (every rank with `--all-ranks`) it lists each tensor the rank holds under its checkpoint
name (global shape, local shape, dtype) and checks that:
- every tensor is split as the planner counts it (`planning.planned_split`: attention by heads, experts in blocks,
  `lm_head` by vocabulary, the rest whole);
- the rank's bytes equal the weights of `inkling2 plan` for the same config (`memory_plan`; with the drafter, which
  `inkling2 plan`'s default config leaves out).
On the last rank it then runs one multimodal prefill with `output_hidden_states` (the drafter's context), one DSpark
draft and one decode step through every layer, and prints the planner's memory plan for `--context`, whose
activations are the peak estimate of a chunked prefill of that context. Exits with 1 when a check fails.

What the meta device cannot run, and what stands in (shapes and dtypes are what is checked, never values):
- the routed experts: the reference loop visits the experts a batch routes to (`unique`) and checks NVFP4 scales by
  value; here every token goes through the first and the last expert of the rank's block, dequantized from it;
- the ViT: it drops each image's class token by a boolean mask, whose size only values give, so it runs on the CPU
  (it is replicated: 0.33 B parameters, 0.66 GB of zeros); its features go on to the meta text model.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import sys
import time
import types
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "src"))

CONTEXTS = {4: 262_144, 8: 1_048_576}  # the GB200 plans: one tray of four GPUs, two trays
PROMPT_TOKENS = 2048  # past the 1024-token sliding window: the sliding layers' caches keep only its last keys
IMAGE_GRID = (1, 1, 2)  # one image of 1 x 2 tokens (the ViT runs on the CPU: few patches)


@contextlib.contextmanager
def fake_rank(rank: int, size: int):
    """This process as rank `rank` of `size`: the fake backend's collectives return at once and move nothing (meta
    tensors hold nothing to move)."""
    import torch.distributed as dist
    from torch.testing._internal.distributed.fake_pg import FakeStore

    dist.init_process_group("fake", store=FakeStore(), rank=rank, world_size=size)
    try:
        yield
    finally:
        dist.destroy_process_group()


def experts_on_meta(experts, x: torch.Tensor, expert_ids: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
    """`loop_over_experts` on meta tensors (see the module docstring): the rank's whole block dequantized, every token
    through its first and last expert, the fp32 sum as the loop returns it."""
    from transformers_inkling2.quantization.formats import dequantize_expert_weights

    packed = experts.kernel_weights()
    fmt = packed["fmt"]
    gate_up, down = (
        packed[name] if fmt == "bf16" else dequantize_expert_weights(
            packed[name], packed[f"{name}_scale"], packed[f"{name}_outer"], quant_format=fmt, dtype=x.dtype,
            validate=False,
        )
        for name in ("w13", "w2")
    )  # fmt: skip
    output = torch.zeros(x.shape, dtype=torch.float32, device=x.device)
    for expert in (0, experts.num_experts - 1):
        output += F.linear(experts._apply_gate(F.linear(x, gate_up[expert])), down[expert]) * weights[:, :1]
    return experts.finish(output, x.dtype)


def split_model(config, variant: str, tp: int):
    """The meta model split on this rank as `from_pretrained(..., distributed_config=DistributedConfig(tp_plan="auto"))`
    splits it (TP attention, the experts over the same ranks, vocabulary-split `lm_head`)."""
    from transformers import DistributedConfig

    from transformers_inkling2.modeling.experts import Inkling2ExpertsBase
    from transformers_inkling2.parallel.planning import meta_model

    model = meta_model(config, variant)
    model.set_experts_implementation("eager")  # BF16 experts too go through `loop_over_experts`
    for module in model.modules():
        if isinstance(module, Inkling2ExpertsBase):
            module.loop_over_experts = types.MethodType(experts_on_meta, module)
    distributed_config, _, mesh = model.prepare_distribute_model(DistributedConfig(tp_plan="auto", tp_size=tp))
    return model.maybe_distribute_model(model, distributed_config, mesh).eval()


def checkpoint_names(model) -> dict[str, str]:
    """Our tensor names -> the checkpoint's: transformers' conversion mapping reversed (`modeling/
    checkpoint_conversion.py`), as `save_pretrained` writes them and `from_pretrained` reads them back."""
    from transformers.conversion_mapping import get_model_conversion_mapping
    from transformers.core_model_loading import PrefixChange, WeightConverter, WeightRenaming, rename_source_key

    mapping = get_model_conversion_mapping(model, add_legacy=False)
    transforms = [t.reverse_transform() for t in mapping[::-1] if not isinstance(t, PrefixChange)]
    renamings = [t for t in transforms if isinstance(t, WeightRenaming)]
    converters = [t for t in transforms if isinstance(t, WeightConverter)]
    return {name: rename_source_key(name, renamings, converters, reverse=True)[0] for name in model.state_dict()}


def rank_layout(model, names: dict[str, str], tp: int) -> dict:
    """What this rank holds: its bytes (every tensor, as `weight_bytes` counts), the checkpoint tensors' shapes and
    dtypes, and the tensors whose local shape is not the planner's split."""
    from transformers_inkling2.modeling.tensors import local_tensor
    from transformers_inkling2.parallel.planning import planned_split

    text = model.config.get_text_config()
    held, tensors, not_as_planned = 0, {}, []
    for name, tensor in [*model.named_parameters(), *model.named_buffers()]:
        local = local_tensor(tensor)
        held += local.numel() * local.element_size()
        expected, split = list(tensor.shape), planned_split(name, text, tp, tp)
        if split is not None:
            expected[split[0]] //= split[1]
        if list(local.shape) != expected:
            not_as_planned.append(f"{name}: {list(local.shape)}, planned {expected}")
        if name in names:
            dtype = str(local.dtype).removeprefix("torch.")
            tensors[names[name]] = {"shape": list(tensor.shape), "local": list(local.shape), "dtype": dtype}
    language_model = model.model.language_model
    attention, experts = language_model.layers[0].self_attn, language_model.layers[0].mlp.experts
    return {
        "held_bytes": held,
        "tensors": tensors,
        "not_as_planned": not_as_planned,
        "heads": local_tensor(attention.q_proj.weight).shape[0] // text.head_dim,
        "kv_heads": local_tensor(attention.k_proj.weight).shape[0] // text.head_dim,
        "experts": [experts.first_expert, experts.first_expert + experts.num_experts - 1],
        "lm_head_rows": local_tensor(model.lm_head.weight).shape[0],
    }


def trace(model) -> dict:
    """One prefill of a prompt with an image (hidden states kept for the drafter), one DSpark draft from it and one
    decode step: every layer of the ViT, the decoder and the drafter runs on this rank's blocks."""
    from transformers_inkling2 import Inkling2Cache
    from transformers_inkling2.generation.dspark import DSparkDecoder, DSparkOptions

    config = model.config
    vision = model.model.vision_tower.to_empty(device="cpu")  # see the module docstring
    for tensor in [*vision.parameters(), *vision.buffers()]:
        tensor.data.zero_()
    cell = config.vision_config.patch_size * config.vision_config.spatial_merge_size
    image_tokens = IMAGE_GRID[1] * IMAGE_GRID[2]
    pixels = torch.zeros(image_tokens, cell, cell, config.vision_config.num_channels, dtype=torch.bfloat16)
    input_ids = torch.zeros(1, PROMPT_TOKENS, dtype=torch.long)
    input_ids[0, 1 : 1 + image_tokens] = config.image_token_id
    cache = Inkling2Cache(config.text_config)
    start = time.perf_counter()
    with torch.no_grad():
        prefill = model(input_ids=input_ids, pixel_values=pixels, image_grid_thw=torch.tensor([IMAGE_GRID]),
                        past_key_values=cache, logits_to_keep=1, output_hidden_states=True)  # fmt: skip
        decoder = DSparkDecoder(model, cache, None, model.generation_config, DSparkOptions())
        kept = min(PROMPT_TOKENS, decoder.context.max_positions)
        decoder.remember_context(prefill.hidden_states, torch.ones(1, kept, dtype=torch.bool, device="meta"))
        anchor = prefill.logits[:, -1].argmax(-1)
        drafts, _ = decoder.draft_block(anchor, torch.full((1,), PROMPT_TOKENS, device="meta"), alive=None)
        decode = model(input_ids=anchor[:, None], past_key_values=cache, logits_to_keep=1)
    return {
        "image_features": list(prefill.image_hidden_states.shape),
        "prefill_logits": list(prefill.logits.shape),
        "hidden_states": len(prefill.hidden_states),
        "drafts": list(drafts.shape),
        "decode_logits": list(decode.logits.shape),
        "cached_tokens": cache.get_seq_length(),
        "seconds": round(time.perf_counter() - start, 1),
    }


def check(tp: int, variant: str, context: int, prefill_chunk: int, ranks: list[int]) -> dict:
    """The report of `ranks` (the last one traced) and the failed checks."""
    from transformers_inkling2.parallel.planning import memory_plan, meta_model, official_config

    config = official_config()
    plan = memory_plan(config, variant, tp, context=context, prefill_chunk=prefill_chunk)
    names = checkpoint_names(meta_model(config, variant))
    report = {"tp": tp, "variant": variant, "context": context, "prefill_chunk": prefill_chunk}
    report["plan"] = {**plan.__dict__, "total": plan.total}
    report["ranks"], failures = {}, []
    for rank in ranks:
        with fake_rank(rank, tp):
            model = split_model(config, variant, tp)
            layout = rank_layout(model, names, tp)
            if rank == ranks[-1]:
                report["trace"] = {"rank": rank, **trace(model)}
        report["ranks"][rank] = layout
        failures += [f"rank {rank}: {name}" for name in layout["not_as_planned"]]
        if layout["held_bytes"] != plan.weights:
            failures.append(f"rank {rank} holds {layout['held_bytes']:,} bytes, the plan counts {plan.weights:,.0f}")
    report["failures"] = failures
    return report


def summary(report: dict) -> str:
    from transformers_inkling2.parallel.planning import GIB, MemoryPlan, format_plan

    tp = report["tp"]
    rows = ["| rank | q / kv heads | experts | lm_head rows | checkpoint tensors | held (GiB) | planned (GiB) | "
            "split as planned |", "|---|---|---|---|---|---|---|---|"]  # fmt: skip
    for rank, layout in report["ranks"].items():
        rows.append(
            f"| {rank} | {layout['heads']} / {layout['kv_heads']} | {layout['experts'][0]}-{layout['experts'][1]} | "
            f"{layout['lm_head_rows']:,} | {len(layout['tensors']):,} | {layout['held_bytes'] / GIB:,.3f} | "
            f"{report['plan']['weights'] / GIB:,.3f} | {'yes' if not layout['not_as_planned'] else 'NO'} |"
        )
    trace = report["trace"]
    plan = MemoryPlan(**{k: v for k, v in report["plan"].items() if k != "total"})
    return "\n".join([
        f"[fake devices] Inkling-2-Small ({report['variant']} experts, the ViT, the DSpark drafter) split TP {tp} / "
        f"EP {tp} on the meta device",
        *rows,
        "",
        f"[trace] rank {trace['rank']}: prefill of {PROMPT_TOKENS:,} tokens with a "
        f"{IMAGE_GRID[1]}x{IMAGE_GRID[2]}-token image: features {trace['image_features']}, "
        f"{trace['hidden_states']} hidden states, logits {trace['prefill_logits']}",
        f"[trace] DSpark draft {trace['drafts']}; decode step: logits {trace['decode_logits']}, "
        f"{trace['cached_tokens']:,} tokens cached ({trace['seconds']} s in all)",
        "",
        f"[plan] TP {tp} / EP {tp}, 1 x {report['context']:,} tokens, prefill chunks of {report['prefill_chunk']:,}",
        format_plan(plan),
        *(["", "FAILED:", *report["failures"]] if report["failures"] else []),
    ])  # fmt: skip


def main(argv: list[str] | None = None) -> int:
    from transformers_inkling2.parallel.planning import VARIANTS, official_config
    from transformers_inkling2.parallel.tensor_parallel import validate_parallel_size

    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--tp", type=int, required=True, help="tensor- and expert-parallel size: 2, 4 or 8")
    parser.add_argument("--variant", choices=sorted(VARIANTS), default="nvfp4-mxfp8")
    parser.add_argument("--context", type=int, help="tokens the plan holds (1,048,576 at TP8, else 262,144)")
    parser.add_argument("--prefill-chunk", type=int, default=16_384, help="tokens a prefill runs at once")
    parser.add_argument("--all-ranks", action="store_true", help="every rank, not only the first and the last")
    parser.add_argument("--json", type=Path, default=None, help="also write the report (every tensor) here")
    args = parser.parse_args(argv)
    if args.tp < 2:
        parser.error(f"--tp {args.tp}: a split needs 2 ranks or more (`inkling2 plan` counts one GPU).")
    try:
        validate_parallel_size(official_config(), args.tp)
    except ValueError as error:
        parser.error(str(error))
    context = CONTEXTS.get(args.tp, CONTEXTS[4]) if args.context is None else args.context
    ranks = list(range(args.tp)) if args.all_ranks else [0, args.tp - 1]
    try:
        report = check(args.tp, args.variant, context, args.prefill_chunk, ranks)
    except ValueError as error:  # what the planner refuses (a context below one token, ...)
        parser.error(str(error))
    print(summary(report))
    if args.json is not None:
        args.json.write_text(json.dumps(report))
    return 1 if report["failures"] else 0


if __name__ == "__main__":
    sys.exit(main())
