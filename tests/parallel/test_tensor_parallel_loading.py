"""Loading under tensor parallelism reads only what a rank needs (#30): a checkpoint in the official layout (the real
key names, several shards and an index, the drafter in `mtp.safetensors`; toy width with the real model's 12 query and
2 kv heads per rank at TP4), BF16 and NVFP4 + MXFP8 experts, loaded with `tp_plan="auto"` by four CPU processes.

One `torchrun` launch runs `tp_loading_worker.py`, which counts the bytes each rank takes out of the safetensors
files, per stored tensor (its docstring says how), and the bytes its collectives move while loading; this file writes
the checkpoints and checks the report against the files' own headers.

The bound, exact: a rank reads its block, a quarter, of every tensor the plan splits (attention heads, routed experts,
the unembedding) and all of every other one, which every rank holds whole (embedding, norms, router, ViT, drafter).
At toy width those replicated tensors are most of the checkpoint, so a rank reads well over a quarter of it.
"""

import json
import re
import struct
from pathlib import Path

import pytest
import torch
from inkling2_helpers import torchrun
from safetensors.torch import load_file, save_file

from transformers_inkling2 import Inkling2ForConditionalGeneration
from transformers_inkling2.quantization.quantize import quantize_checkpoint
from transformers_inkling2.tiny import randomize_, tiny_config, tiny_dspark_config

WORKER = Path(__file__).with_name("tp_loading_worker.py")
RANKS = 4
# 48 query / 8 kv heads as on the real model, at toy width; 8 experts (2 per rank); 6 layers: 0-2 NVFP4, 3-5 MXFP8
TEXT = dict(
    num_attention_heads=48, num_key_value_heads=8, swa_num_attention_heads=48, swa_num_key_value_heads=8,
    head_dim=8, swa_head_dim=8, vocab_size=512, unpadded_vocab_size=500, eos_token_id=None,
    dspark_config=tiny_dspark_config(mask_token_id=510),
)  # fmt: skip
CHECKPOINTS = ("bf16", "quantized")
# what the plan splits, in the official names: attention projections and per-head parameters (not the shared
# relative-bias bank), every routed-expert tensor (packed weights and their scales), the unembedding
SPLIT_NAMES = re.compile(
    r"\.attn\.(w[qkvro]_\w+|gate_attn|attn_sink_proj|q_l2_clip|rel_l2_clip|[kv]_sconv)\.|\.mlp\.experts\.|\.unembed\."
)
TOLERANCE = 1e-4  # relative, fp32


def move_drafter_to_mtp_file(folder: Path) -> None:
    """The official layout ships the drafter as `mtp.safetensors` (names under `mtp.`), beside the indexed shards;
    our saves keep it under `dspark.` in the shards."""
    index_file = folder / "model.safetensors.index.json"
    index = json.loads(index_file.read_text())
    drafter = {}
    for shard in sorted(set(index["weight_map"].values())):
        target = {}
        for name, tensor in load_file(folder / shard).items():
            if name.startswith("dspark."):
                drafter[f"mtp.{name.removeprefix('dspark.')}"] = tensor
            else:
                target[name] = tensor
        save_file(target, folder / shard, metadata={"format": "pt"})
    weight_map = index["weight_map"]
    index["weight_map"] = {name: shard for name, shard in weight_map.items() if not name.startswith("dspark.")}
    index_file.write_text(json.dumps(index))
    save_file(drafter, folder / "mtp.safetensors", metadata={"format": "pt"})


def stored_bytes(folder: Path) -> dict[str, int]:
    """{stored tensor: its bytes} of every safetensors file, from the headers' data offsets."""
    sizes = {}
    for file in folder.glob("*.safetensors"):
        with open(file, "rb") as handle:
            header = json.loads(handle.read(struct.unpack("<Q", handle.read(8))[0]))
        header.pop("__metadata__", None)
        sizes |= {name: info["data_offsets"][1] - info["data_offsets"][0] for name, info in header.items()}
    return sizes


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory) -> Path:
    root = tmp_path_factory.mktemp("tp_loading")
    model = randomize_(Inkling2ForConditionalGeneration(tiny_config(image_token_id=499, **TEXT)), seed=1)
    model.to(torch.bfloat16).save_pretrained(root / "bf16", max_shard_size="300KB")
    quantize_checkpoint(root / "bf16", root / "quantized", mxfp8_from=3)
    for name in CHECKPOINTS:
        move_drafter_to_mtp_file(root / name)
    return root


@pytest.fixture(scope="module")
def report(checkpoints) -> list[dict]:
    torchrun(RANKS, WORKER, checkpoints, checkpoints / "report.json")
    return json.loads((checkpoints / "report.json").read_text())


@pytest.mark.parametrize("checkpoint", CHECKPOINTS)
def test_the_checkpoint_is_sharded_in_the_official_layout(checkpoints, checkpoint):
    folder = checkpoints / checkpoint
    assert len(list(folder.glob("model-*.safetensors"))) >= 4 and (folder / "mtp.safetensors").exists()
    names = stored_bytes(folder)
    assert "model.llm.layers.0.attn.wq_du.weight" in names and "model.llm.unembed.weight" in names
    assert not any(name.startswith("dspark.") for name in names)
    if checkpoint == "quantized":  # NVFP4 with block and outer scales, MXFP8 with block scales only
        experts = "model.llm.layers.{}.mlp.experts.{}"
        assert {experts.format(0, "w13_weight_scale_2"), experts.format(5, "w2_weight_scale")} <= names.keys()
        assert experts.format(5, "w13_weight_scale_2") not in names


@pytest.mark.parametrize("checkpoint", CHECKPOINTS)
def test_the_count_sees_every_stored_byte_of_a_single_process_load(checkpoints, report, checkpoint):
    """The count's own check: one process reads every stored tensor once, whole (the drafter's file included)."""
    reads = report[0][checkpoint]["single_process_reads"]
    assert reads == {name: [size] for name, size in stored_bytes(checkpoints / checkpoint).items()}


@pytest.mark.parametrize("checkpoint", CHECKPOINTS)
def test_each_rank_reads_a_quarter_of_every_split_tensor_and_all_of_the_others(checkpoints, report, checkpoint):
    sizes = stored_bytes(checkpoints / checkpoint)
    assert len(report) == RANKS
    for rank in report:
        reads, split = rank[checkpoint]["reads"], set(rank[checkpoint]["split"])
        assert split == {name for name in sizes if SPLIT_NAMES.search(name)}
        assert reads.keys() == sizes.keys()
        for name, size in sizes.items():
            assert sum(reads[name]) == (size // RANKS if name in split else size), name


@pytest.mark.parametrize("checkpoint", CHECKPOINTS)
def test_no_rank_ever_holds_a_whole_split_tensor(checkpoints, report, checkpoint):
    """Every read of a split tensor is at most its block, and nothing reaches a rank from another while loading:
    the largest piece of a split tensor a rank holds is its quarter."""
    sizes = stored_bytes(checkpoints / checkpoint)
    for rank in report:
        reads = rank[checkpoint]["reads"]
        assert [name for name in rank[checkpoint]["split"] if max(reads[name]) > sizes[name] // RANKS] == []
        assert rank[checkpoint]["collective_bytes"] == 0


@pytest.mark.parametrize("checkpoint", CHECKPOINTS)
def test_split_model_gives_the_single_process_logits(report, checkpoint):
    for rank in report:
        assert rank[checkpoint]["logits"] < TOLERANCE
