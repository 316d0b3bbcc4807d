"""Tensor-parallel attention and expert-parallel experts (`tensor_parallel`) on 2, 4 and 8 CPU processes over gloo
against the single-process model loaded from the same checkpoint, and the clear error for a size that does not split
the model.

The checkpoints are built once for the module at toy width with the official head and expert counts: BF16 experts,
NVFP4 + MXFP8 experts (both with a DSpark drafter) and the multimodal model. One `torchrun` launch per size runs
`tensor_parallel_worker.py` over them; the tests read its report. Every size checks what depends on the number of
ranks: the official split of heads and experts on each rank, logits, greedy generation (plain, DSpark, static cache)
and the bytes each rank holds. What the same code does at any size once each rank holds its heads and experts
(transformers' expert-parallel route, training, a fast attention backend, the multimodal model's nested plan) is
checked at TP2 only, which keeps TP4 and TP8 within CI's time on two cores.
"""

import json
from pathlib import Path

import pytest
import torch
from inkling2_helpers import torchrun

from transformers_inkling2 import Inkling2ForCausalLM, Inkling2ForConditionalGeneration, Inkling2TextConfig
from transformers_inkling2.parallel.planning import memory_plan
from transformers_inkling2.parallel.tensor_parallel import (
    TEXT_MODEL_EP_PLAN,
    TEXT_MODEL_TP_PLAN,
    AttentionHeads,
    split_experts,
    valid_parallel_sizes,
    validate_parallel_size,
)
from transformers_inkling2.quantization.quantize import quantize_checkpoint
from transformers_inkling2.tiny import randomize_, tiny_config, tiny_dspark_config, tiny_text_config

WORKER = Path(__file__).with_name("tensor_parallel_worker.py")
# The official head and expert counts (48 query / 8 kv heads, 6 query heads per kv head; 384 routed experts, top-8) at
# toy width: hidden 64 and expert width 32 hold whole NVFP4 (16) and MXFP8 (32) blocks.
TEXT = dict(
    num_attention_heads=48, num_key_value_heads=8, swa_num_attention_heads=48, swa_num_key_value_heads=8,
    head_dim=8, swa_head_dim=8, vocab_size=512, unpadded_vocab_size=500, eos_token_id=None,
    n_routed_experts=384, num_experts_per_tok=8,
)  # fmt: skip
# What one rank holds on the real model: query heads, key/value heads, routed experts
OFFICIAL_SPLIT = {2: (24, 4, 192), 4: (12, 2, 96), 8: (6, 1, 48)}
TOLERANCE = 1e-4  # relative, fp32
AT_TP2_ONLY = pytest.mark.parametrize("report", [2], indirect=True, ids=["tp2"])


def text_config_with_drafter():
    return tiny_text_config(**TEXT, dspark_config=tiny_dspark_config(mask_token_id=510))


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    root = tmp_path_factory.mktemp("tensor_parallel")
    randomize_(Inkling2ForCausalLM(text_config_with_drafter()), seed=1).save_pretrained(root / "bf16")
    quantize_checkpoint(root / "bf16", root / "quantized", mxfp8_from=3)  # layers 0-2 NVFP4, 3-5 MXFP8
    randomize_(Inkling2ForConditionalGeneration(tiny_config(image_token_id=499, **TEXT)), seed=2).save_pretrained(
        root / "multimodal"
    )
    return root


@pytest.fixture(scope="module", params=sorted(OFFICIAL_SPLIT), ids=lambda size: f"tp{size}")
def report(request, checkpoints):
    """One launch per size, shared by the module's tests; every rank's report."""
    size = request.param
    report_file = checkpoints / f"report_tp{size}.json"
    torchrun(size, WORKER, checkpoints, report_file, *(["--all-checks"] if size == 2 else []))
    report = json.loads(report_file.read_text())
    assert [rank["world_size"] for rank in report] == [size] * size
    return report


@pytest.mark.parametrize("checkpoint", ["bf16", "quantized"])
def test_split_model_gives_the_single_process_logits_and_greedy_generation(report, checkpoint):
    for rank in report:
        assert rank[checkpoint]["logits"] < TOLERANCE
        assert rank[checkpoint]["greedy_equal"]
        assert rank[checkpoint]["dspark_greedy_equal"]
        assert rank[checkpoint]["static_cache_greedy_equal"]
        assert rank[checkpoint]["greedy_tokens"] == report[0][checkpoint]["greedy_tokens"]


@pytest.mark.parametrize("checkpoint", ["bf16", "quantized"])
def test_each_rank_holds_the_official_split_of_heads_and_experts(report, checkpoint):
    """Head_dim 8, d_rel 4, kernel 4, hidden 64, vocabulary 512."""
    size = len(report)
    heads, kv_heads, experts = OFFICIAL_SPLIT[size]
    formats = {"bf16": ["bf16"] * 6, "quantized": ["nvfp4"] * 3 + ["mxfp8"] * 3}[checkpoint]
    for rank, ranks_report in enumerate(report):
        layout = ranks_report[checkpoint]["layout"]
        assert layout["q_proj"] == [heads * 8, 64] and layout["k_proj"] == [kv_heads * 8, 64]
        assert layout["o_proj"] == [64, heads * 8] and layout["sink_proj"] == [heads, 64]
        assert layout["q_scale"] == [heads, 8] and layout["rel_scale"] == [heads, 4]
        assert layout["sliding_k_conv"] == [kv_heads * 8, 1, 4] and layout["full_static_taps"] == [4, kv_heads * 8]
        assert layout["full_tap_proj"] == [kv_heads * 4, 64]
        # the decode step's grouped GEMV takes each rank's blocks (q, gate, relative, sink, k, v), as on one GPU
        q, kv = [heads * 8, 64], [kv_heads * 8, 64]
        assert layout["grouped_projection_blocks"] == [q, q, [heads * 4, 64], [heads, 64], kv, kv]
        assert layout["lm_head"] == [512 // size, 64]  # vocabulary split, logits gathered
        assert layout["embedding"] == [512, 64] and layout["router"] == [384, 64]  # replicated
        assert layout["experts_per_token"] == 8
        assert layout["experts"] == [experts * rank, experts]
        assert all(shape[0] == experts for shape in layout["expert_tensors"].values())
        assert ranks_report[checkpoint]["expert_blocks"]  # every layer's tensors are its block, byte for byte
        assert {"sliding", "full"} == set(layout["attention_kinds"]) and layout["expert_formats"] == formats
    if checkpoint == "quantized":  # packed NVFP4 / MXFP8 tensors stay buffers (transformers hands back parameters)
        assert all("gate_up_proj_scale" in rank["quantized"]["layout"]["packed_are_buffers"] for rank in report)


def test_memory_plan_counts_what_each_rank_holds(report):
    """`inkling2 plan --tp N` splits the weights the way the plan does (its numbers are in docs/parallel.md)."""
    planned = memory_plan(text_config_with_drafter(), "bf16", tp=len(report), context=1).weights
    for rank in report:
        assert rank["bf16"]["held_bytes_bf16"] == planned


@AT_TP2_ONLY
@pytest.mark.parametrize("checkpoint", ["bf16", "quantized"])
def test_transformers_expert_parallel_route_gives_the_same_model(report, checkpoint):
    """`DistributedConfig(tp_plan="auto", ep_size=2)`: the experts through transformers' `ep_dispatch_experts`, over
    the same blocks as our plan (whose split every size checks)."""
    for rank in report:
        assert rank[checkpoint]["expert_parallel_blocks"]
        assert rank[checkpoint]["expert_parallel_logits"] < TOLERANCE
        assert rank[checkpoint]["expert_parallel_greedy_equal"]


@AT_TP2_ONLY
def test_training_through_the_split_model_gives_the_single_process_gradients(report):
    for rank in report:
        assert rank["bf16"]["logits_with_grad_enabled"] < TOLERANCE  # grad enabled: DTensor projections
        assert rank["bf16"]["gradients"] < TOLERANCE  # our all-reduce dispatch
        assert rank["bf16"]["expert_parallel_gradients"] < TOLERANCE  # transformers' all-to-all in training


@AT_TP2_ONLY
def test_fast_attention_backend_and_multimodal_model_work_on_local_heads(report):
    for rank in report:
        assert rank["bf16"]["backend_logits"] < TOLERANCE and rank["bf16"]["backend_greedy_equal"]
        assert rank["multimodal"]["q_proj"] == [24 * 8, 64] and rank["multimodal"]["logits"] < TOLERANCE


# --- without torchrun -----------------------------------------------------------------------------------------------


def test_official_head_and_expert_counts_split_over_2_4_and_8_ranks():
    config = Inkling2TextConfig()
    assert valid_parallel_sizes(config) == [1, 2, 4, 8]
    for size in (1, 2, 4, 8):
        validate_parallel_size(config, size)


@pytest.mark.parametrize("size", [3, 6, 16])
def test_a_size_that_does_not_divide_the_kv_heads_is_a_clear_error(size):
    with pytest.raises(ValueError) as error:
        validate_parallel_size(Inkling2TextConfig(), size)
    message = str(error.value)
    assert f"over {size} tensor-parallel ranks" in message and "8 key/value heads" in message
    assert "48 query heads" not in message  # 48 divides by 3, 6 and 16: only what does not divide is named
    assert "[1, 2, 4, 8]" in message  # the fix


QUERY_HEADS, KV_HEADS, EXPERTS = "48 query heads", "8 key/value heads", "384 routed experts"  # of TEXT


class Mesh:
    """What the plan's rules read of a device mesh of `size` ranks, without processes."""

    def __init__(self, size: int, dim_name: str = "tp"):
        self.ranks, self.mesh_dim_names = size, (dim_name,)

    def size(self) -> int:
        return self.ranks

    def get_local_rank(self) -> int:
        return 0


@pytest.mark.parametrize(
    "size, uneven",
    [(3, {KV_HEADS}), (5, {QUERY_HEADS, KV_HEADS, EXPERTS}), (16, {KV_HEADS})],
    ids=["tp3", "tp5", "tp16"],
)
def test_the_attention_rule_checks_the_size_before_anything_is_split(size, uneven):
    with torch.device("meta"):
        model = Inkling2ForCausalLM(tiny_text_config(**TEXT))
    with pytest.raises(ValueError) as error:
        AttentionHeads().install_forward(model.model.layers[0].self_attn, Mesh(size))
    assert_names_what_does_not_divide(str(error.value), f"over {size} tensor-parallel ranks", uneven)


@pytest.mark.parametrize("size", [3, 16], ids=["ep3", "ep16"])
def test_the_expert_parallel_route_refuses_a_size_that_does_not_divide(size):
    """`DistributedConfig(tp_plan="auto", ep_size=N)` splits the experts on an "ep" mesh: the error says which."""
    with torch.device("meta"):
        experts = Inkling2ForCausalLM(tiny_text_config(**TEXT)).model.layers[0].mlp.experts
    with pytest.raises(ValueError) as error:
        split_experts(experts, Mesh(size, "ep"), first_expert_is_global=False)
    assert_names_what_does_not_divide(str(error.value), f"over {size} expert-parallel ranks", {KV_HEADS})
    assert experts.num_experts == 384 and not experts._is_expert_parallel  # refused before anything was split


def assert_names_what_does_not_divide(message: str, where: str, uneven: set[str]) -> None:
    assert where in message and "use one of [1, 2, 4, 8]" in message  # the fix
    assert {count for count in (QUERY_HEADS, KV_HEADS, EXPERTS) if count in message} == uneven


def test_every_plan_rule_names_a_module_or_parameter_of_the_model():
    model = Inkling2ForCausalLM(tiny_text_config(**TEXT))
    names = {
        ".".join("*" if part.isdigit() else part for part in name.split("."))
        for name, _ in [*model.named_modules(), *model.named_parameters()]
    }
    for rule in [
        *Inkling2ForCausalLM._tp_plan,
        *(f"model.{rule}" for rule in [*TEXT_MODEL_TP_PLAN, *TEXT_MODEL_EP_PLAN]),
    ]:
        assert rule in names, rule
    assert model.tp_plan["lm_head"] == "colwise_gather_output" and model.ep_plan


def test_unsplit_model_is_unchanged():
    """Without torchrun the experts hold every expert and return the activations' dtype."""
    experts = randomize_(Inkling2ForCausalLM(tiny_text_config(**TEXT)).model.layers[0].mlp.experts, seed=3)
    assert (experts.num_experts, experts.first_expert, experts._is_expert_parallel) == (384, 0, False)
    generator = torch.Generator().manual_seed(0)
    x = torch.randn(5, 64, generator=generator).bfloat16()
    ids = torch.randperm(384, generator=generator)[:40].view(5, 8)
    assert experts.to(torch.bfloat16)(x, ids, torch.rand(5, 8, generator=generator)).dtype == torch.bfloat16


def test_full_scale_benchmark_builds_split_and_measures(tmp_path):
    """`benchmarks/full_scale.py --quick` (the full-model script at toy width): built straight into its blocks on one
    and on two ranks, every measurement taken; a rank of two holds less than the whole model and more than half
    (attention and experts split, embedding and norms replicated)."""
    script = Path(__file__).parents[2] / "benchmarks" / "full_scale.py"
    held = {}
    for ranks in (1, 2):
        torchrun(ranks, script, "--quick", "--longest", "128", "--out", tmp_path / str(ranks))
        per_rank = json.loads((tmp_path / str(ranks) / "full_scale.json").read_text())["per_rank"]
        assert len(per_rank) == ranks
        assert per_rank[0]["fits_up_to"] == 128
        assert "Longest prompt of [128] that ran: 128 tokens." in (tmp_path / str(ranks) / "full_scale.md").read_text()
        for decode in (per_rank[0]["decode_batch1"], per_rank[0]["decode_batch16"]):
            assert {"plain_step_ms", "verify_pass_ms", "draft_ms", "dspark_step_ms", "roofline_ms"} <= set(decode)
        held[ranks] = [rank["held_gib"] for rank in per_rank]
    assert held[2][0] == held[2][1]
    assert held[1][0] / 2 < held[2][0] < held[1][0]
