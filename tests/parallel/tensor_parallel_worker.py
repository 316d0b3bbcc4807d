"""Run by `test_tensor_parallel.py` under `torchrun --nproc_per_node N` (gloo, CPU; N = 2, 4 and 8): every rank
loads the same tiny checkpoints split over the ranks and compares them with the single-process model loaded from the
same files.

Usage: torchrun --nproc_per_node N tests/parallel/tensor_parallel_worker.py CHECKPOINTS_DIR REPORT.json [--all-checks]
CHECKPOINTS_DIR holds `bf16/` (BF16 experts), `quantized/` (NVFP4 and MXFP8 experts) and `multimodal/` (the
ViT in front). Every launch checks what depends on the number of ranks: what each rank holds, logits, greedy
generation (plain, DSpark, static cache) and the bytes held. `--all-checks` (the TP2 launch) adds what the same code
does at any size: transformers' expert-parallel route, training, a fast attention backend and the multimodal model's
nested plan. Rank 0 writes every rank's report; the test reads it.
"""

import argparse
import os
import warnings
from pathlib import Path

import torch
import torch.distributed as dist
from rank_report import COLLECTIVE_TIMEOUT, write_every_ranks_report
from torch.distributed.tensor import DTensor
from transformers import DistributedConfig

import transformers_inkling2  # noqa: F401  (registers the classes)
from transformers_inkling2 import Inkling2ForCausalLM, Inkling2ForConditionalGeneration
from transformers_inkling2.backends.projections import plain_weight
from transformers_inkling2.parallel.tensor_parallel import local_tensor
from transformers_inkling2.quantization.experts import Inkling2QuantizedExperts

NEW_TOKENS = 8


def batch():
    """Two rows, the second left-padded; longer than the sliding window (16) of the tiny model."""
    input_ids = torch.randint(0, 500, (2, 21), generator=torch.Generator().manual_seed(3))
    attention_mask = torch.ones_like(input_ids)
    attention_mask[1, :4] = 0
    return input_ids, attention_mask


def logits(model, grad: bool = False):
    input_ids, attention_mask = batch()
    with torch.set_grad_enabled(grad):
        return model(input_ids, attention_mask=attention_mask, use_cache=False).logits.detach()


def load(model_class, folder, **kwargs):
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=".*tp_plan.*deprecated")  # `tp_plan=` is still the short way
        return model_class.from_pretrained(folder, **kwargs)


def greedy(model, **kwargs):
    input_ids, attention_mask = batch()
    return model.generate(
        input_ids, attention_mask=attention_mask, max_new_tokens=NEW_TOKENS, do_sample=False, eos_token_id=None,
        pad_token_id=0, **kwargs,
    )  # fmt: skip


def relative_error(actual, expected) -> float:
    return ((actual - expected).abs().max() / expected.abs().max()).item()


def local_shape(tensor) -> list[int]:
    return list(local_tensor(tensor).shape)


def bytes_of(tensor):
    return tensor.view(torch.uint8) if tensor.element_size() == 1 else tensor


def holds_its_expert_block(split, reference) -> bool:
    """Rank r's expert tensors are exactly experts [r * n, (r + 1) * n) of the single-process model's."""
    for split_layer, reference_layer in zip(split.model.layers, reference.model.layers):
        experts, full = split_layer.mlp.experts, dict(reference_layer.mlp.experts.state_dict())
        start = dist.get_rank() * experts.num_experts
        for name, tensor in experts.state_dict().items():
            if not isinstance(tensor, DTensor):
                return False
            block = full[name][start : start + experts.num_experts]
            if not torch.equal(bytes_of(tensor.to_local()), bytes_of(block)):
                return False
    return True


def grouped_projection_blocks(model, attention) -> list:
    """What a decode step's grouped GEMV would read for the six input projections (`plain_weight`: a rank's block, as
    one GPU's weight), or None where they keep the six linears."""
    modules = [attention.q_proj, attention.gate_proj, attention.r_proj, attention.sink_proj, attention.k_proj,
               attention.v_proj]  # fmt: skip
    weights = [plain_weight(module, model.config.hidden_size, local_tensor(module.weight).dtype) for module in modules]
    return [None if weight is None else list(weight.shape) for weight in weights]


def layout(model) -> dict:
    """What rank holds what: proves the plan was applied (a replicated model would also give equal logits)."""
    layers = model.model.layers
    full = next(i for i, layer in enumerate(layers) if not layer.self_attn.is_sliding)
    attention, full_attention, experts = layers[0].self_attn, layers[full].self_attn, layers[0].mlp.experts
    described = {
        "q_proj": local_shape(attention.q_proj.weight),
        "grouped_projection_blocks": grouped_projection_blocks(model, attention),
        "k_proj": local_shape(attention.k_proj.weight),
        "o_proj": local_shape(attention.o_proj.weight),
        "sink_proj": local_shape(attention.sink_proj.weight),
        "q_scale": local_shape(attention.q_l2_clip.scale),
        "rel_scale": local_shape(attention.rel_l2_clip.scale),
        "sliding_k_conv": local_shape(attention.k_sconv.conv1d.weight),
        "full_static_taps": local_shape(full_attention.k_sconv.static_weight),
        "full_tap_proj": local_shape(full_attention.k_sconv.weight_proj.weight),
        "lm_head": local_shape(model.lm_head.weight),
        "embedding": local_shape(model.model.embed_tokens.weight),
        "router": local_shape(layers[0].mlp.gate.weight),
        "experts_per_token": layers[0].mlp.gate.top_k,
        "experts": [experts.first_expert, experts.num_experts],
        # every layer kind: sliding and full attention; BF16, or NVFP4 and MXFP8 experts
        "attention_kinds": ["sliding" if layer.self_attn.is_sliding else "full" for layer in layers],
        "expert_formats": [model.config.expert_format(i) for i in range(len(layers))],
        "expert_tensors": {name: local_shape(t) for name, t in [*experts.named_parameters(), *experts.named_buffers()]},
    }
    if isinstance(experts, Inkling2QuantizedExperts):
        described["packed_are_buffers"] = sorted(name for name, _ in experts.named_buffers())
    return described


def gradient_error(split, reference) -> float:
    """Training through the split model: the largest relative difference of a loss's gradients from one process's,
    over a parameter of every kind (this rank's block of the split ones)."""
    full = next(i for i, layer in enumerate(reference.model.layers) if not layer.self_attn.is_sliding)
    compared = {  # name: dim it is split on (None: replicated)
        "model.embed_tokens.weight": None,
        "model.layers.1.attention_input.query": None,
        "model.layers.0.mlp.gate.weight": None,
        "model.layers.0.self_attn.q_proj.weight": 0,
        "model.layers.0.self_attn.o_proj.weight": -1,
        "model.layers.0.self_attn.q_l2_clip.scale": 0,
        "model.layers.0.self_attn.k_sconv.conv1d.weight": 0,
        f"model.layers.{full}.self_attn.k_sconv.static_weight": -1,
        f"model.layers.{full}.self_attn.k_sconv.weight_proj.weight": 0,
        "model.layers.0.mlp.experts.gate_up_proj": 0,
        "lm_head.weight": 0,
    }
    input_ids, _ = batch()
    for model in (reference, split):
        if model.model.embed_tokens.weight.grad is None:  # once (the reference serves two comparisons)
            model.train()
            model(input_ids, labels=input_ids, use_cache=False).loss.backward()
    errors = []
    for name, dim in compared.items():
        expected = dict(reference.named_parameters())[name].grad
        if dim is not None:
            expected = expected.chunk(dist.get_world_size(), dim)[dist.get_rank()]
        errors.append(relative_error(local_tensor(dict(split.named_parameters())[name].grad), expected))
    return max(errors)


def single_process_outputs(reference) -> tuple[torch.Tensor, torch.Tensor]:
    """The unsplit model's logits and greedy tokens, computed on rank 0 and sent to all: every rank compares with the
    same outputs, and 8 ranks sharing 2 cores do not compute 8 copies."""
    outputs = [(logits(reference), greedy(reference)) if dist.get_rank() == 0 else None]
    dist.broadcast_object_list(outputs, src=0)
    return outputs[0]


def check(
    name: str,
    folder: Path,
    report: dict,
    all_checks: bool,
    training: bool = False,
    attention_backend: str | None = None,
) -> None:
    """The split model of one checkpoint against the single-process one; `training` and `attention_backend` are
    size-independent checks, run with `all_checks` only."""
    reference = load(Inkling2ForCausalLM, folder)
    split = load(Inkling2ForCausalLM, folder, tp_plan="auto")
    expected, expected_tokens = single_process_outputs(reference)
    tokens = greedy(split)
    result = {
        "layout": layout(split),
        "expert_blocks": holds_its_expert_block(split, reference),
        "logits": relative_error(logits(split), expected),
        "greedy_equal": torch.equal(tokens, expected_tokens),
        "greedy_tokens": tokens[:, -NEW_TOKENS:].tolist(),
        # the drafter is replicated; every rank sees the same all-reduced logits, so all accept the same drafts
        "dspark_greedy_equal": torch.equal(greedy(split, dspark=True), expected_tokens),
        # the static cache sizes its buffers from the local kv heads and channels
        "static_cache_greedy_equal": torch.equal(greedy(split, cache_implementation="static"), expected_tokens),
    }
    if name == "bf16":  # what `inkling2 plan` counts: the model in BF16 (fp32-kept modules in fp32)
        result["held_bytes_bf16"] = held_bytes(load(Inkling2ForCausalLM, folder, tp_plan="auto", dtype=torch.bfloat16))
    if all_checks:
        check_at_any_size(result, folder, split, reference, expected, expected_tokens, training, attention_backend)
    report[name] = result


def check_at_any_size(result, folder, split, reference, expected, expected_tokens, training, attention_backend) -> None:
    """What the same code does at any number of ranks once each holds its heads and experts (run at TP2 only)."""
    if training:  # without no_grad the projections go through transformers' DTensor path
        result["logits_with_grad_enabled"] = relative_error(logits(split, grad=True), expected)
        result["gradients"] = gradient_error(split, reference)
        split.eval()
    if attention_backend:  # a fast backend on the local heads (prefill through flex, decode steps)
        split.set_attn_implementation(attention_backend)
        result["backend_logits"] = relative_error(logits(split), expected)
        result["backend_greedy_equal"] = torch.equal(greedy(split), expected_tokens)
    # the experts through transformers' expert-parallel plan (its `ep_dispatch_experts`: all-reduce at inference,
    # all-to-all in training)
    config = DistributedConfig(tp_plan="auto", ep_size=dist.get_world_size())
    split_ep = load(Inkling2ForCausalLM, folder, distributed_config=config)
    result["expert_parallel_blocks"] = holds_its_expert_block(split_ep, reference)
    result["expert_parallel_logits"] = relative_error(logits(split_ep), expected)
    result["expert_parallel_greedy_equal"] = torch.equal(greedy(split_ep), expected_tokens)
    if training:
        result["expert_parallel_gradients"] = gradient_error(split_ep, reference)


def held_bytes(model) -> int:
    """Bytes this rank holds: its blocks of the split tensors, all of the replicated ones."""
    tensors = [*model.parameters(), *model.buffers()]
    return sum(local_tensor(t).numel() * t.element_size() for t in tensors)


def check_multimodal(folder: Path, report: dict) -> None:
    """The multimodal model nests the text decoder (`model.language_model.*`): its plan is the decoder's, prefixed."""
    reference = load(Inkling2ForConditionalGeneration, folder)
    split = load(Inkling2ForConditionalGeneration, folder, tp_plan="auto")
    report["multimodal"] = {
        "q_proj": local_shape(split.model.language_model.layers[0].self_attn.q_proj.weight),
        "logits": relative_error(logits(split), logits(reference)),
    }


def main(checkpoints: Path, report_file: Path, all_checks: bool) -> None:
    torch.set_num_threads(1)
    # before transformers' loader would, with its timeout of 2 hours: ranks that share 2 CI cores wait on each other
    # for a while, but a hang must fail within the test's launch timeout
    dist.init_process_group("gloo", timeout=COLLECTIVE_TIMEOUT)
    report = {}
    check("bf16", checkpoints / "bf16", report, all_checks, training=True, attention_backend="inkling2_flex")
    check("quantized", checkpoints / "quantized", report, all_checks)
    if all_checks:
        check_multimodal(checkpoints / "multimodal", report)
    report["world_size"] = dist.get_world_size()
    write_every_ranks_report(report, report_file)


if __name__ == "__main__":
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("checkpoints", type=Path)
    parser.add_argument("report", type=Path)
    parser.add_argument("--all-checks", action="store_true", help="also the size-independent checks (TP2)")
    arguments = parser.parse_args()
    main(arguments.checkpoints, arguments.report, arguments.all_checks)
