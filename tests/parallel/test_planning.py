"""`inkling2 plan`: the memory plan's weights and cache equal what the model and its cache actually hold."""

import pytest
import torch
from inkling2_helpers import ORACLE_TEXT_CONFIG

from transformers_inkling2 import Inkling2Cache, Inkling2Config, Inkling2ForCausalLM, Inkling2TextConfig
from transformers_inkling2.parallel.planning import GIB, memory_plan
from transformers_inkling2.quantization.quantize import quantize_checkpoint
from transformers_inkling2.tiny import randomize_
from transformers_inkling2_cli import main

CONFIG = {**ORACLE_TEXT_CONFIG, "num_hidden_layers": 6, "n_layers_per_attn_res_block": 3}


def held_bytes(tensors):
    return sum(t.numel() * t.element_size() for t in tensors)


@pytest.mark.parametrize("variant, mxfp8_from", [("bf16", None), ("mxfp8", 0), ("nvfp4-mxfp8", 40)])
def test_planned_weights_equal_the_loaded_models_bytes(tmp_path, variant, mxfp8_from):
    model = randomize_(Inkling2ForCausalLM(Inkling2TextConfig(**CONFIG)), seed=0)
    model.save_pretrained(tmp_path / "bf16")
    folder = tmp_path / "bf16"
    if mxfp8_from is not None:
        folder = quantize_checkpoint(folder, tmp_path / "quantized", mxfp8_from=mxfp8_from)
    loaded = Inkling2ForCausalLM.from_pretrained(folder, dtype=torch.bfloat16)
    actual = held_bytes([*loaded.parameters(), *loaded.buffers()])
    assert memory_plan(Inkling2TextConfig(**CONFIG), variant, context=1).weights == actual


def test_planned_cache_equals_what_the_cache_holds_after_a_long_prefill():
    config = Inkling2TextConfig(**CONFIG)
    model = randomize_(Inkling2ForCausalLM(config), seed=0).to(torch.bfloat16)
    cache = Inkling2Cache(config)
    with torch.no_grad():
        model(torch.randint(0, 500, (2, 40)), past_key_values=cache)
    plan = memory_plan(config, "bf16", context=40, batch=2)
    assert plan.kv_cache == held_bytes(t for layer in cache.layers for t in (layer.keys, layer.values))
    assert plan.conv_states == held_bytes(t for layer in cache.layers for t in layer.conv_inputs)


def test_parallel_sizes_split_what_they_split_and_bad_sizes_are_refused():
    config = Inkling2Config()
    one, four = memory_plan(config, tp=1), memory_plan(config, tp=4)
    assert 3.5 < one.weights / four.weights < 4  # experts and attention split, the embedding and the ViT not
    assert one.kv_cache / four.kv_cache == 4  # 8 kv heads: 2 per rank
    assert 350 < one.weights / GIB < 370  # Inkling-2-Small's NVFP4 + MXFP8 checkpoint: about 394 GB
    with pytest.raises(ValueError, match="must divide"):
        memory_plan(config, tp=5)


def test_plan_command_prints_the_table(capsys):
    main(["plan", "--tp", "8", "--context", "1048576"])
    out = capsys.readouterr().out
    assert "TP 8 / EP 8" in out and "| total |" in out and "fits in 139 GiB" in out
