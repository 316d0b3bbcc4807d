"""The whole Inkling-2-Small at its real sizes, split for TP4/EP4 (one GB200 tray) and TP8/EP8 (two), on the meta device
through torch.distributed's fake process group (`benchmarks/fake_devices.py`, one subprocess per size, both at once):
rank 0's and the last rank's tensors against the official checkpoint's names, shapes and dtypes split as the plans
split them, their bytes against `inkling2 plan`, and one prefill with an image, one DSpark draft and one decode step
through every layer."""

import importlib.util
import json
import math
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from transformers_inkling2 import Inkling2Config
from transformers_inkling2.parallel.planning import GIB, memory_plan

SCRIPT = Path(__file__).parents[2] / "benchmarks" / "fake_devices.py"
SIZES = (4, 8)
CONTEXTS = {4: 262_144, 8: 1_048_576}

# Inkling-2-Small (SPEC §1, §3): hidden, query / kv heads, head dim, relative dim and extent, conv kernel, experts and
# their width, vocabulary; layer i is full attention when (i + 1) % 6 == 0; experts NVFP4 in layers 0-39, MXFP8 after.
H, HEADS, KV, D, REL, EXTENT, K, E, I, V = 4608, 48, 8, 128, 16, 1024, 4, 384, 2304, 201024
LAYERS, NVFP4_LAYERS, VIT_LAYERS = 48, 40, 23
BF16, F32, U8, F8 = "bfloat16", "float32", "uint8", "float8_e4m3fn"


def is_full(layer: int) -> bool:
    return (layer + 1) % 6 == 0


def decoder_layer(layer: int) -> dict[str, tuple[list[int], str]]:
    """The checkpoint tensors of one decoder layer: (shape, dtype as loaded in BF16, the fp32-kept ones in fp32)."""
    tensors = {
        "attn.wq_du.weight": ([HEADS * D, H], BF16),
        "attn.wk_dv.weight": ([KV * D, H], BF16),
        "attn.wv_dv.weight": ([KV * D, H], BF16),
        "attn.wr_du.weight": ([HEADS * REL, H], BF16),
        "attn.wo_ud.weight": ([H, HEADS * D], BF16),
        "attn.gate_attn.weight": ([HEADS * D, H], BF16),
        "attn.attn_sink_proj.weight": ([HEADS, H], BF16),
        "attn.q_l2_clip.scale": ([HEADS, D], BF16),
        "attn.rel_l2_clip.scale": ([HEADS, REL], BF16),
        "attn.rel_logits_proj.proj": ([REL, EXTENT], BF16),
        "attn_sconv.weight": ([H, 1, K], F32),
        "mlp_sconv.weight": ([H, 1, K], F32),
        "mlp_norm.weight": ([H], BF16),
        "mlp.gate.weight": ([E, H], F32),
        "mlp.gate.bias": ([E], F32),
    }
    if is_full(layer):  # separate q/k/v inputs, dynamic k/v convolutions
        tensors |= {f"{x}_input_norm.weight": ([H], BF16) for x in "qkv"}
        tensors |= {f"attn.{x}_sconv.static_w": ([K, KV * D], BF16) for x in "kv"}
        tensors |= {f"attn.{x}_sconv.weight_proj": ([KV * K, H], BF16) for x in "kv"}
    else:
        tensors |= {"attn_norm.weight": ([H], BF16), **{f"attn.{x}_sconv.weight": ([KV * D, 1, K], F32) for x in "kv"}}
    experts = "mlp.experts."
    if layer < NVFP4_LAYERS:  # E2M1 codes two a byte, an E4M3 scale per 16 inputs, fp32 outer scales (gate, up)
        tensors |= {
            experts + "w13_weight": ([E, 2 * I, H // 2], U8),
            experts + "w13_weight_scale": ([E, 2 * I, H // 16], F8),
            experts + "w13_weight_scale_2": ([E, 2], F32),
            experts + "w2_weight": ([E, H, I // 2], U8),
            experts + "w2_weight_scale": ([E, H, I // 16], F8),
            experts + "w2_weight_scale_2": ([E], F32),
        }
    else:  # E4M3 values, an E8M0 scale per 32 inputs
        tensors |= {
            experts + "w13_weight": ([E, 2 * I, H], F8),
            experts + "w13_weight_scale": ([E, 2 * I, H // 32], U8),
            experts + "w2_weight": ([E, H, I], F8),
            experts + "w2_weight_scale": ([E, H, I // 32], U8),
        }
    return {f"model.llm.layers.{layer}.{name}": value for name, value in tensors.items()}


def text_checkpoint() -> dict[str, tuple[list[int], str]]:
    """The text decoder's tensors in the official checkpoint's layout (`model.llm.*`)."""
    tensors = {
        "model.llm.embed.weight": ([V, H], BF16),
        "model.llm.embed_norm.weight": ([H], BF16),
        "model.llm.norm.weight": ([H], BF16),
        "model.llm.unembed.weight": ([V, H], BF16),
        "model.llm.attn_res.output_query": ([H], F32),
    }
    for layer in range(LAYERS):
        tensors |= decoder_layer(layer)
        tensors[f"model.llm.attn_res.mlp_queries.{layer}"] = ([H], F32)
        if layer > 0:  # layer 0's attention reads the embedding; a full layer has a query for each of q, k, v
            tensors[f"model.llm.attn_res.attn_queries.{layer - 1}"] = ([3, H] if is_full(layer) else [H], F32)
    return tensors


def vit_names() -> set[str]:
    """The ViT's tensors (SPEC §3; its attention as `self_attn.{q,k,v,out}_proj`)."""
    backbone = "model.visual.backbone."
    names = {backbone + f"embeddings.{n}" for n in ("class_embedding", "cls_position_embedding", "position_embedding")}
    names |= {backbone + "embeddings.patch_embedding.weight", *(f"model.visual.proj_{x}.weight" for x in ("in", "out"))}
    names |= {backbone + f"ln_pre.{p}" for p in ("weight", "bias")}
    for layer in range(VIT_LAYERS):
        modules = ["ln_1", "ln_2", "mlp.c_fc", "mlp.c_proj", *(f"self_attn.{x}_proj" for x in ("q", "k", "v", "out"))]
        names |= {backbone + f"layers.{layer}.{m}.{p}" for m in modules for p in ("weight", "bias")}
        names |= {backbone + f"layers.{layer}.ls_{i}.gamma" for i in (1, 2)}
    return names


# The checkpoint tensors the plans split, and along which dim (docs/parallel.md, "What is split"): query-head
# tensors, kv-head tensors (8 kv heads: at TP4 and TP8 every rank holds whole ones), experts, vocabulary.
SPLIT_DIMS = {
    r"\.attn\.(wq_du|wr_du|gate_attn|attn_sink_proj)\.weight$": 0,
    r"\.attn\.wo_ud\.weight$": 1,
    r"\.attn\.(q_l2_clip|rel_l2_clip)\.scale$": 0,
    r"\.attn\.(wk_dv|wv_dv)\.weight$": 0,
    r"\.attn\.[kv]_sconv\.(weight|weight_proj)$": 0,
    r"\.attn\.[kv]_sconv\.static_w$": 1,
    r"\.mlp\.experts\.": 0,
    r"^model\.llm\.unembed\.weight$": 0,
}


def split_shape(name: str, shape: list[int], tp: int) -> list[int]:
    for pattern, dim in SPLIT_DIMS.items():
        if re.search(pattern, name):
            return [size // tp if i == dim else size for i, size in enumerate(shape)]
    return shape


@pytest.fixture(scope="module")
def reports(tmp_path_factory):
    """{tp: the script's JSON report}; both sizes run at once (one core each)."""
    folder = tmp_path_factory.mktemp("fake_devices")
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    runs = {
        tp: subprocess.Popen([sys.executable, str(SCRIPT), "--tp", str(tp), "--json", str(folder / f"tp{tp}.json")],
                             stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env)
        for tp in SIZES
    }  # fmt: skip
    try:
        outputs = {tp: run.communicate(timeout=600) for tp, run in runs.items()}
    finally:
        for run in runs.values():
            run.kill()  # a run past the timeout; nothing once it has exited
    for tp, (out, err) in outputs.items():
        assert runs[tp].returncode == 0, f"fake_devices.py --tp {tp} failed:\n{out[-3000:]}\n{err[-3000:]}"
    return {tp: json.loads((folder / f"tp{tp}.json").read_text()) for tp in SIZES}


@pytest.mark.parametrize("tp", SIZES)
def test_every_rank_holds_the_checkpoints_text_tensors_split_as_the_plans_split_them(reports, tp):
    expected = text_checkpoint()
    assert sorted(reports[tp]["ranks"]) == ["0", str(tp - 1)]
    for layout in reports[tp]["ranks"].values():
        held = {name: tensor for name, tensor in layout["tensors"].items() if name.startswith("model.llm.")}
        assert set(held) == set(expected)
        for name, (shape, dtype) in expected.items():
            assert held[name] == {"shape": shape, "local": split_shape(name, shape, tp), "dtype": dtype}, name
        assert not layout["not_as_planned"]


@pytest.mark.parametrize("tp", SIZES)
def test_every_rank_holds_the_vit_and_the_drafter_whole(reports, tp):
    for layout in reports[tp]["ranks"].values():
        tensors = layout["tensors"]
        assert {name for name in tensors if name.startswith("model.visual.")} == vit_names()
        assert any(name.startswith("dspark.layers.1.") for name in tensors)  # the drafter's two layers
        assert set(tensors) == set(text_checkpoint()) | vit_names() | {n for n in tensors if n.startswith("dspark.")}
        replicated = [t for n, t in tensors.items() if not n.startswith("model.llm.")]
        assert all(tensor["local"] == tensor["shape"] and tensor["dtype"] == BF16 for tensor in replicated)


@pytest.mark.parametrize("tp", SIZES)
def test_each_rank_holds_the_weights_inkling2_plan_counts_plus_the_drafter(reports, tp):
    """`inkling2 plan` counts `Inkling2Config()`, which has no drafter; the official repo ships one (`mtp.safetensors`)
    and every rank holds it whole."""
    report = reports[tp]
    drafter = sum(bf16_bytes(t) for name, t in report["ranks"]["0"]["tensors"].items() if name.startswith("dspark."))
    planned = memory_plan(Inkling2Config(), "nvfp4-mxfp8", tp, context=CONTEXTS[tp]).weights
    for layout in report["ranks"].values():
        assert layout["held_bytes"] == report["plan"]["weights"] == planned + drafter
    assert 1.2 < drafter / GIB < 1.25 and report["failures"] == []


def bf16_bytes(tensor: dict) -> int:
    assert tensor["dtype"] == BF16
    return 2 * math.prod(tensor["local"])


@pytest.mark.parametrize("tp", SIZES)
def test_each_rank_holds_its_heads_its_expert_block_and_its_vocabulary_rows(reports, tp):
    for rank, layout in reports[tp]["ranks"].items():
        rank = int(rank)
        assert (layout["heads"], layout["kv_heads"]) == (HEADS // tp, KV // tp)
        assert layout["experts"] == [rank * E // tp, (rank + 1) * E // tp - 1]
        assert layout["lm_head_rows"] == V // tp


@pytest.mark.parametrize("tp", SIZES)
def test_a_prefill_with_an_image_a_draft_and_a_decode_step_run_through_every_layer(reports, tp):
    trace = reports[tp]["trace"]
    assert trace["rank"] == tp - 1
    assert trace["image_features"] == [2, H]  # a 1 x 2-token image
    assert trace["hidden_states"] == LAYERS + 1  # the embedding and every layer's output, the drafter's context
    assert trace["prefill_logits"] == trace["decode_logits"] == [1, 1, 200058]  # gathered, the real vocabulary
    assert trace["drafts"] == [1, 7]
    assert trace["cached_tokens"] == 2048 + 1


def load_script():
    spec = importlib.util.spec_from_file_location("fake_devices", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.mark.parametrize(
    "argv, message",
    [
        (["--tp", "3"], "cannot be split over 3 tensor-parallel ranks"),
        (["--tp", "1"], "a split needs 2 ranks or more"),
        (["--tp", "4", "--context", "0"], "positive whole numbers: `context` = 0"),
        (["--tp", "4", "--variant", "fp4"], "invalid choice: 'fp4'"),
    ],
)
def test_bad_arguments_are_named_before_anything_is_built(argv, message, capsys):
    with pytest.raises(SystemExit):
        load_script().main(argv)
    assert message in capsys.readouterr().err
