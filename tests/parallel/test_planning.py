"""`inkling2 plan`: the memory plan's weights and cache, and the serving engine's pages, equal what the model and its
caches actually hold."""

import pytest
import torch
from inkling2_helpers import ORACLE_TEXT_CONFIG

from transformers_inkling2 import Inkling2Cache, Inkling2Config, Inkling2ForCausalLM, Inkling2TextConfig
from transformers_inkling2.configuration_inkling2 import SLIDING_LAYER
from transformers_inkling2.engine import Inkling2Engine, SamplingParams
from transformers_inkling2.parallel.planning import (
    GIB,
    NoRoomForPages,
    format_pages,
    memory_plan,
    planned_split,
    serving_pages,
)
from transformers_inkling2.quantization.quantize import quantize_checkpoint
from transformers_inkling2.tiny import build_tiny_causal_lm, build_tiny_model, randomize_
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


def gpu_gib_for_pages(config, num_pages, **engine):
    """Memory that holds `num_pages` pages and half of one more, for these engine settings."""
    unit = serving_pages(config, 1.0, "bf16", **engine)
    return (unit.weights + unit.activations + unit.row_state + (num_pages + 0.5) * unit.page_bytes) / GIB


@pytest.mark.parametrize("dspark", [False, True])
def test_planned_pages_equal_what_the_engines_cache_allocates(dspark):
    model = (build_tiny_model(dspark=True) if dspark else build_tiny_causal_lm()).to(torch.bfloat16)
    engine_settings = {"max_num_seqs": 2, "page_size": 64, "max_step_tokens": 2048, "dspark": dspark}
    gpu_gib = gpu_gib_for_pages(model.config, 5, **engine_settings)
    pages = serving_pages(model.config, gpu_gib, "bf16", **engine_settings)
    assert pages.pages == 5 and pages.tokens == 4 * 64 and pages.tokens_per_sequence == 2 * 64
    engine = Inkling2Engine(model, **engine_settings, num_pages=pages.pages, max_model_len=256)
    engine.add_request(list(range(1, 40)), SamplingParams(max_new_tokens=4))
    engine.step(), engine.step()  # the prompt, then a decode step over both rows
    cache = engine.cache
    full = [i for i, kind in enumerate(cache.layer_types) if kind != SLIDING_LAYER]
    sliding = [i for i, kind in enumerate(cache.layer_types) if kind == SLIDING_LAYER]
    assert held_bytes(t for i in full for t in (cache.keys[i], cache.values[i])) == pages.pages * pages.page_bytes
    rings = [t for i in sliding for t in (cache.keys[i], cache.values[i])]
    rings += [t for per_layer in cache.conv_inputs for t in per_layer]
    rings += cache.context_keys + cache.context_values  # the drafter's context (none without DSpark)
    assert held_bytes(rings) == pages.row_state


def test_no_room_for_two_pages_is_an_error_naming_what_takes_the_memory():
    config = build_tiny_causal_lm().config
    with pytest.raises(NoRoomForPages, match=r"weights .* activations .* 2 rows' fixed state"):
        serving_pages(config, gpu_gib_for_pages(config, 1, max_num_seqs=2), "bf16", max_num_seqs=2)


def test_parallel_sizes_split_what_they_split_and_bad_sizes_are_refused():
    config = Inkling2Config()
    one, four = memory_plan(config, tp=1), memory_plan(config, tp=4)
    assert 3.5 < one.weights / four.weights < 4  # experts and attention split, the embedding and the ViT not
    assert one.kv_cache / four.kv_cache == 4  # 8 kv heads: 2 per rank
    assert 350 < one.weights / GIB < 370  # Inkling-2-Small's NVFP4 + MXFP8 checkpoint: about 394 GB
    with pytest.raises(ValueError, match="must divide"):
        memory_plan(config, tp=5)


def test_only_the_decoders_attention_is_split_by_heads_the_vits_is_replicated():
    """Both have `self_attn.q_proj`; `tp_plan="auto"` splits the decoder's layers only."""
    text = Inkling2TextConfig()
    assert planned_split("model.language_model.layers.3.self_attn.q_proj.weight", text, tp=4, ep=4) == (0, 4)
    assert planned_split("model.layers.3.self_attn.o_proj.weight", text, tp=4, ep=4) == (1, 4)
    assert planned_split("model.vision_tower.layers.3.self_attn.q_proj.weight", text, tp=4, ep=4) is None


def test_plan_command_prints_the_table_and_the_pages(capsys):
    engine_settings = ["--max-num-seqs", "8", "--page-size", "128", "--max-step-tokens", "512"]
    main(["plan", "--tp", "8", "--context", "1048576", *engine_settings])
    out = capsys.readouterr().out
    assert "TP 8 / EP 8" in out and "| total |" in out and "fits in 139 GiB" in out
    pages = serving_pages(Inkling2Config(), 139.0, tp=8, max_num_seqs=8, page_size=128, max_step_tokens=512)
    assert "[pages] the serving engine: 8 rows, pages of 128 tokens, steps of 512 tokens" in out
    assert out.rstrip().endswith(format_pages(pages))


def test_plan_command_prints_the_table_before_saying_no_pages_fit(capsys):
    with pytest.raises(SystemExit, match="inkling2 plan: 139 GiB per GPU leave no room for the serving engine's pages"):
        main(["plan"])  # Inkling-2-Small on one GPU
    assert "does NOT fit in 139 GiB per GPU" in capsys.readouterr().out
