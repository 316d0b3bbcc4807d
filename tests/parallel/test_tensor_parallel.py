"""Tensor-parallel attention and expert-parallel experts (`tensor_parallel`): two CPU processes over gloo against the
single-process model loaded from the same checkpoint, and the clear error for a size that does not split the model.

One `torchrun` launch runs `tensor_parallel_worker.py`, which checks BF16 experts, quantized (NVFP4 + MXFP8) experts,
greedy DSpark decoding (the checkpoints carry a drafter), transformers' expert-parallel route and the multimodal
model; this file reads its report.
"""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from transformers_inkling2 import Inkling2ForCausalLM, Inkling2ForConditionalGeneration, Inkling2TextConfig
from transformers_inkling2.parallel.planning import memory_plan
from transformers_inkling2.parallel.tensor_parallel import (
    TEXT_MODEL_EP_PLAN,
    TEXT_MODEL_TP_PLAN,
    AttentionHeads,
    valid_parallel_sizes,
    validate_parallel_size,
)
from transformers_inkling2.quantization.quantize import quantize_checkpoint
from transformers_inkling2.tiny import randomize_, tiny_config, tiny_dspark_config, tiny_text_config

WORKER = Path(__file__).with_name("tensor_parallel_worker.py")
RANKS = 2
# The official head counts (48 query / 8 kv heads: 24 / 4 per rank, 6 query heads per kv head as on the real model)
# at toy width; 8 experts (4 per rank); hidden 64 and expert width 32 hold whole NVFP4 / MXFP8 blocks.
TEXT = dict(
    num_attention_heads=48, num_key_value_heads=8, swa_num_attention_heads=48, swa_num_key_value_heads=8,
    head_dim=8, swa_head_dim=8, vocab_size=512, unpadded_vocab_size=500, eos_token_id=None,
)  # fmt: skip
TOLERANCE = 1e-4  # relative, fp32


def text_config_with_drafter():
    return tiny_text_config(**TEXT, dspark_config=tiny_dspark_config(mask_token_id=510))


@pytest.fixture(scope="module")
def report(tmp_path_factory):
    root = tmp_path_factory.mktemp("tensor_parallel")
    randomize_(Inkling2ForCausalLM(text_config_with_drafter()), seed=1).save_pretrained(root / "bf16")
    quantize_checkpoint(root / "bf16", root / "quantized", mxfp8_from=3)  # layers 0-2 NVFP4, 3-5 MXFP8
    randomize_(Inkling2ForConditionalGeneration(tiny_config(image_token_id=499, **TEXT)), seed=2).save_pretrained(
        root / "multimodal"
    )
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={RANKS}",
               str(WORKER), str(root), str(root / "report.json")]  # fmt: skip
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    result = subprocess.run(command, capture_output=True, text=True, timeout=300, env=env)
    assert result.returncode == 0, f"torchrun failed:\n{result.stdout[-3000:]}\n{result.stderr[-6000:]}"
    return json.loads((root / "report.json").read_text())


@pytest.mark.parametrize("checkpoint", ["bf16", "quantized"])
def test_split_model_gives_the_single_process_logits_and_greedy_generation(report, checkpoint):
    assert len(report) == RANKS
    for rank in report:
        assert rank[checkpoint]["logits"] < TOLERANCE
        assert rank[checkpoint]["greedy_equal"]
        assert rank[checkpoint]["dspark_greedy_equal"]
        assert rank[checkpoint]["static_cache_greedy_equal"]
    assert report[0][checkpoint]["greedy_tokens"] == report[1][checkpoint]["greedy_tokens"]


def test_each_rank_holds_its_heads_and_its_expert_block(report):
    for rank, ranks_report in enumerate(report):
        for checkpoint in ("bf16", "quantized"):
            layout = ranks_report[checkpoint]["layout"]
            # 48 query heads, 8 kv heads, head_dim 8, d_rel 4, kernel 4, hidden 64: half of every head count
            assert layout["q_proj"] == [24 * 8, 64] and layout["k_proj"] == [4 * 8, 64]
            assert layout["o_proj"] == [64, 24 * 8] and layout["sink_proj"] == [24, 64]
            assert layout["q_scale"] == [24, 8] and layout["rel_scale"] == [24, 4]
            assert layout["sliding_k_conv"] == [4 * 8, 1, 4] and layout["full_static_taps"] == [4, 4 * 8]
            assert layout["full_tap_proj"] == [4 * 4, 64]
            assert layout["lm_head"] == [256, 64]  # vocabulary split, logits gathered
            assert layout["embedding"] == [512, 64] and layout["router"] == [8, 64]  # replicated
            assert layout["experts"] == [4 * rank, 4]
            assert all(shape[0] == 4 for shape in layout["expert_tensors"].values())
            assert ranks_report[checkpoint]["expert_blocks"]
        # the packed NVFP4 / MXFP8 tensors stay buffers (transformers' loader hands DTensors back as parameters)
        assert "gate_up_proj_scale" in ranks_report["quantized"]["layout"]["packed_are_buffers"]


@pytest.mark.parametrize("checkpoint", ["bf16", "quantized"])
def test_transformers_expert_parallel_route_gives_the_same_model(report, checkpoint):
    """`DistributedConfig(tp_plan="auto", ep_size=2)`: the experts through transformers' `ep_dispatch_experts`."""
    for rank in report:
        assert rank[checkpoint]["expert_parallel_blocks"]
        assert rank[checkpoint]["expert_parallel_logits"] < TOLERANCE
        assert rank[checkpoint]["expert_parallel_greedy_equal"]


def test_training_through_the_split_model_gives_the_single_process_gradients(report):
    for rank in report:
        assert rank["bf16"]["logits_with_grad_enabled"] < TOLERANCE  # grad enabled: DTensor projections
        assert rank["bf16"]["gradients"] < TOLERANCE  # our all-reduce dispatch
        assert rank["bf16"]["expert_parallel_gradients"] < TOLERANCE  # transformers' all-to-all in training


def test_fast_attention_backend_and_multimodal_model_work_on_local_heads(report):
    for rank in report:
        assert rank["bf16"]["backend_logits"] < TOLERANCE and rank["bf16"]["backend_greedy_equal"]
        assert rank["multimodal"]["q_proj"] == [24 * 8, 64] and rank["multimodal"]["logits"] < TOLERANCE


def test_memory_plan_counts_what_each_rank_holds(report):
    """`inkling2 plan --tp 2` splits the weights the way the plan does (its numbers are in docs/parallel.md)."""
    planned = memory_plan(text_config_with_drafter(), "bf16", tp=RANKS, context=1).weights
    for rank in report:
        assert rank["bf16"]["held_bytes_bf16"] == planned


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


def test_the_attention_rule_checks_the_size_before_anything_is_split():
    class Mesh:
        def size(self):
            return 5

    model = Inkling2ForCausalLM(tiny_text_config(**TEXT))
    with pytest.raises(ValueError, match="48 query heads .*8 key/value heads.*8 routed experts"):
        AttentionHeads().install_forward(model.model.layers[0].self_attn, Mesh())


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
    model = randomize_(Inkling2ForCausalLM(tiny_text_config(**TEXT)), seed=3).eval()
    experts = model.model.layers[0].mlp.experts
    assert (experts.num_experts, experts.first_expert, experts._is_expert_parallel) == (8, 0, False)
    x = torch.randn(5, 64, dtype=torch.bfloat16)
    ids = torch.randint(0, 8, (5, 2))
    assert experts.to(torch.bfloat16)(x, ids, torch.rand(5, 2)).dtype == torch.bfloat16


def test_full_scale_benchmark_builds_split_and_measures(tmp_path):
    """`benchmarks/full_scale.py --quick` (the full-model script at toy width): built straight into its blocks on one
    and on two ranks, every measurement taken; a rank of two holds less than the whole model and more than half
    (attention and experts split, embedding and norms replicated)."""
    script = Path(__file__).parents[2] / "benchmarks" / "full_scale.py"
    held = {}
    for ranks in (1, 2):
        command = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={ranks}",
                   str(script), "--quick", "--longest", "128", "--out", str(tmp_path / str(ranks))]  # fmt: skip
        env = {**os.environ, "OMP_NUM_THREADS": "1"}
        result = subprocess.run(command, capture_output=True, text=True, timeout=300, env=env)
        assert result.returncode == 0, f"torchrun failed:\n{result.stdout[-3000:]}\n{result.stderr[-6000:]}"
        per_rank = json.loads((tmp_path / str(ranks) / "full_scale.json").read_text())["per_rank"]
        assert len(per_rank) == ranks
        assert per_rank[0]["fits_up_to"] == 128
        assert "Longest prompt of [128] that ran: 128 tokens." in (tmp_path / str(ranks) / "full_scale.md").read_text()
        for decode in (per_rank[0]["decode_batch1"], per_rank[0]["decode_batch16"]):
            assert {"plain_step_ms", "verify_pass_ms", "draft_ms", "dspark_step_ms", "roofline_ms"} <= set(decode)
        held[ranks] = [rank["held_gib"] for rank in per_rank]
    assert held[2][0] == held[2][1]
    assert held[1][0] / 2 < held[2][0] < held[1][0]
