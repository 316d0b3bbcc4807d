"""Loading and saving checkpoints: the original layout, transformers' built-in saves, ours, sharded, broken."""

import json
import re
import subprocess
import sys
import textwrap

import pytest
import torch
from inkling2_helpers import ORACLE_TEXT_CONFIG, build_pair
from safetensors import safe_open
from safetensors.torch import load_file, save_file
from transformers import AutoModelForCausalLM

from transformers_inkling2 import Inkling2ForCausalLM

# Our names -> the original layout, written from the layout's description (SPEC §3), independently of the
# package's own conversion code.
TO_ORIGINAL = [
    (r"^lm_head\.weight$", "model.llm.unembed.weight"),
    (r"^model\.embed_tokens\.weight$", "model.llm.embed.weight"),
    (r"^model\.embed_tokens\.embed_norm\.", "model.llm.embed_norm."),
    (r"^model\.norm\.", "model.llm.norm."),
    (r"^model\.final_input\.query$", "model.llm.attn_res.output_query"),
    (r"^model\.layers\.(\d+)\.mlp_input\.query$", r"model.llm.attn_res.mlp_queries.\1"),
    (r"^model\.layers\.", "model.llm.layers."),
    (r"\.self_attn\.q_proj\.", ".attn.wq_du."),
    (r"\.self_attn\.k_proj\.", ".attn.wk_dv."),
    (r"\.self_attn\.v_proj\.", ".attn.wv_dv."),
    (r"\.self_attn\.r_proj\.", ".attn.wr_du."),
    (r"\.self_attn\.o_proj\.", ".attn.wo_ud."),
    (r"\.self_attn\.gate_proj\.", ".attn.gate_attn."),
    (r"\.self_attn\.sink_proj\.", ".attn.attn_sink_proj."),
    (r"\.self_attn\.(k|v)_sconv\.conv1d\.weight$", r".attn.\1_sconv.weight"),
    (r"\.self_attn\.(k|v)_sconv\.static_weight$", r".attn.\1_sconv.static_w"),
    (r"\.self_attn\.(k|v)_sconv\.weight_proj\.weight$", r".attn.\1_sconv.weight_proj"),
    (r"\.self_attn\.", ".attn."),
    (r"\.post_attention_convolution\.conv1d\.", ".attn_sconv."),
    (r"\.post_mlp_convolution\.conv1d\.", ".mlp_sconv."),
    (r"\.post_attention_layernorm\.", ".mlp_norm."),
    (r"\.input_layernorm\.", ".attn_norm."),
    (r"\.(q|k|v)_input_layernorm\.", r".\1_input_norm."),
    (r"\.mlp\.gate\.e_score_correction_bias$", ".mlp.gate.bias"),
    (r"\.mlp\.experts\.down_proj$", ".mlp.experts.w2_weight"),
]


def to_original_layout(state_dict):
    original = {}
    for name, tensor in state_dict.items():
        attention_query = re.match(r"^model\.layers\.(\d+)\.attention_input\.query$", name)
        if attention_query:
            original[f"model.llm.attn_res.attn_queries.{int(attention_query.group(1)) - 1}"] = tensor
            continue
        if name.endswith("mlp.experts.gate_up_proj"):
            gate, up = tensor.chunk(2, dim=1)
            interleaved = torch.stack([gate, up], dim=2).flatten(1, 2)  # rows g0, u0, g1, u1, ...
            original[name.replace("model.layers.", "model.llm.layers.").replace("gate_up_proj", "w13_weight")] = interleaved
            continue
        for pattern, replacement in TO_ORIGINAL:
            name = re.sub(pattern, replacement, name)
        original[name] = tensor
    return {name: tensor.contiguous() for name, tensor in original.items()}


def write_checkpoint(folder, state_dict, config):
    folder.mkdir(parents=True, exist_ok=True)
    save_file(state_dict, folder / "model.safetensors", metadata={"format": "pt"})
    (folder / "config.json").write_text(json.dumps(config))


def logits_of(model, input_ids):
    with torch.no_grad():
        return model(input_ids, use_cache=False).logits


@pytest.fixture(scope="module")
def pair_and_ids():
    ours, oracle = build_pair(seed=3)
    input_ids = torch.randint(0, 500, (2, 21), generator=torch.Generator().manual_seed(3))
    return ours, oracle, input_ids


def text_config_dict(model):
    return {**model.config.to_dict(), "model_type": "inkling2_text"}


def test_original_layout_checkpoint_loads_with_nothing_left_random(tmp_path, pair_and_ids):
    ours, oracle, input_ids = pair_and_ids
    config = text_config_dict(ours)
    config.pop("transformers_version", None)
    write_checkpoint(tmp_path, to_original_layout(ours.state_dict()), config)
    loaded = AutoModelForCausalLM.from_pretrained(tmp_path)
    assert isinstance(loaded, Inkling2ForCausalLM)
    for name, tensor in ours.state_dict().items():
        assert torch.equal(loaded.state_dict()[name], tensor), name
    assert (logits_of(loaded, input_ids) - logits_of(oracle, input_ids)).abs().max() <= 1e-4


def test_multimodal_original_checkpoint_loads_into_the_text_model(tmp_path, pair_and_ids):
    """The official checkpoints are multimodal: the text model takes `model.llm.*` and ignores the ViT."""
    ours, oracle, input_ids = pair_and_ids
    state_dict = to_original_layout(ours.state_dict())
    state_dict["model.visual.backbone.ln_pre.weight"] = torch.ones(8)
    config = {"model_type": "inkling2", "text_config": text_config_dict(ours), "vision_config": {"text_hidden_size": 64}}
    write_checkpoint(tmp_path, state_dict, config)
    loaded = Inkling2ForCausalLM.from_pretrained(tmp_path)
    assert (logits_of(loaded, input_ids) - logits_of(oracle, input_ids)).abs().max() <= 1e-4


BUILTIN_SAVE = textwrap.dedent(
    """
    import sys, json, torch
    from transformers.models.inkling2 import configuration_inkling2 as c, modeling_inkling2 as m
    torch.manual_seed(7)
    model = m.Inkling2ForCausalLM(c.Inkling2TextConfig(**json.loads(sys.argv[2]))).eval()
    with torch.no_grad():
        for tensor in model.parameters():
            tensor.normal_(0, 0.1)
    model.save_pretrained(sys.argv[1])
    input_ids = torch.randint(0, 500, (2, 21))
    with torch.no_grad():
        torch.save({"input_ids": input_ids, "logits": model(input_ids, use_cache=False).logits}, sys.argv[1] + "/expected.pt")
    """
)


def test_checkpoint_saved_by_builtin_inkling2_loads_and_matches_its_logits(tmp_path):
    """The built-in saves in a separate process, where our package (and its renamings) is not imported."""
    subprocess.run(
        [sys.executable, "-c", BUILTIN_SAVE, str(tmp_path), json.dumps(ORACLE_TEXT_CONFIG)], check=True
    )
    with safe_open(tmp_path / "model.safetensors", "pt") as f:
        assert any(key.startswith("model.llm.layers.") for key in f.keys())  # the original layout
    expected = torch.load(tmp_path / "expected.pt")
    loaded = AutoModelForCausalLM.from_pretrained(tmp_path)
    assert (logits_of(loaded, expected["input_ids"]) - expected["logits"]).abs().max() <= 1e-4


def test_our_save_writes_the_original_layout_and_reloads_exactly(tmp_path, pair_and_ids):
    ours, _, input_ids = pair_and_ids
    ours.save_pretrained(tmp_path)
    saved = load_file(tmp_path / "model.safetensors")
    expected = to_original_layout(ours.state_dict())
    assert saved.keys() == expected.keys()
    assert all(torch.equal(saved[name], expected[name]) for name in saved)
    reloaded = Inkling2ForCausalLM.from_pretrained(tmp_path)
    assert torch.equal(logits_of(reloaded, input_ids), logits_of(ours, input_ids))


def test_sharded_checkpoint_loads_with_device_map_and_progress_bar(tmp_path, pair_and_ids, capsys):
    ours, _, input_ids = pair_and_ids
    ours.save_pretrained(tmp_path, max_shard_size="200KB")
    assert (tmp_path / "model.safetensors.index.json").exists()
    assert len(list(tmp_path.glob("model-*.safetensors"))) > 1
    reloaded = Inkling2ForCausalLM.from_pretrained(tmp_path, device_map="cpu")
    assert "Loading weights" in capsys.readouterr().err
    assert all(torch.equal(reloaded.state_dict()[name], tensor) for name, tensor in ours.state_dict().items())
    # same weights; accelerate's placement hooks may change the summation order by a rounding
    assert (logits_of(reloaded, input_ids) - logits_of(ours, input_ids)).abs().max() <= 1e-5


def saved_with(tmp_path, model, damage):
    """`model` in the original layout, damaged, as a checkpoint folder."""
    state_dict = to_original_layout(model.state_dict())
    damage(state_dict)
    write_checkpoint(tmp_path, state_dict, text_config_dict(model))
    return tmp_path


def test_a_missing_tensor_is_reported_and_initialized_as_transformers_does(tmp_path, pair_and_ids):
    ours, _, _ = pair_and_ids
    folder = saved_with(tmp_path, ours, lambda sd: sd.pop("model.llm.layers.3.attn.wq_du.weight"))
    loaded, info = Inkling2ForCausalLM.from_pretrained(folder, output_loading_info=True)
    assert info["missing_keys"] == {"model.layers.3.self_attn.q_proj.weight"}
    fresh = loaded.model.layers[3].self_attn.q_proj.weight
    assert torch.isfinite(fresh).all() and not torch.equal(fresh, ours.model.layers[3].self_attn.q_proj.weight)
    assert torch.equal(loaded.model.layers[2].self_attn.q_proj.weight, ours.model.layers[2].self_attn.q_proj.weight)


def test_an_unexpected_tensor_is_reported(tmp_path, pair_and_ids):
    ours, _, _ = pair_and_ids
    folder = saved_with(tmp_path, ours, lambda sd: sd.update({"model.llm.layers.3.attn.extra.weight": torch.ones(2)}))
    _, info = Inkling2ForCausalLM.from_pretrained(folder, output_loading_info=True)
    assert info["unexpected_keys"] == {"model.layers.3.attn.extra.weight"} and not info["missing_keys"]


def test_a_checkpoint_whose_names_do_not_convert_is_a_clear_error(tmp_path, pair_and_ids):
    ours, _, _ = pair_and_ids
    folder = saved_with(tmp_path, ours, lambda sd: [sd.update({f"other.{k}": sd.pop(k)}) for k in list(sd)])
    with pytest.raises(ValueError, match=r"tensors are missing .*did not convert"):
        Inkling2ForCausalLM.from_pretrained(folder)
    loaded = Inkling2ForCausalLM.from_pretrained(folder, allow_incomplete_checkpoint=True)  # the way out it names
    assert isinstance(loaded, Inkling2ForCausalLM)


def test_a_checkpoint_holding_none_of_the_models_tensors_loads_them_initialized_as_transformers_does(tmp_path, pair_and_ids):
    """Nothing under unknown names (one small integer tensor the model does not load): the checkpoint simply lacks
    the model's tensors, reported missing and initialized, not an unconverted layout."""
    ours, _, _ = pair_and_ids
    ours.save_pretrained(tmp_path)
    save_file({"tensor": torch.tensor([1, 2])}, tmp_path / "model.safetensors", metadata={"format": "pt"})
    loaded, info = Inkling2ForCausalLM.from_pretrained(tmp_path, output_loading_info=True)
    assert info["missing_keys"] == set(loaded.state_dict()) and info["unexpected_keys"] == {"tensor"}
    assert all(torch.isfinite(tensor).all() for tensor in loaded.state_dict().values() if tensor.is_floating_point())


def test_a_tensor_of_the_wrong_shape_is_a_clear_error(tmp_path, pair_and_ids):
    ours, _, _ = pair_and_ids
    folder = saved_with(tmp_path, ours, lambda sd: sd.update({"model.llm.layers.4.attn.wk_dv.weight": torch.ones(3, 64)}))
    with pytest.raises((ValueError, RuntimeError), match="ignore_mismatched_sizes"):
        Inkling2ForCausalLM.from_pretrained(folder)


def test_a_base_model_checkpoint_loads_into_the_model_with_a_head(tmp_path, pair_and_ids):
    """The head is reported missing and initialized; the decoder loads whole."""
    ours, _, _ = pair_and_ids
    ours.model.save_pretrained(tmp_path)
    loaded, info = Inkling2ForCausalLM.from_pretrained(tmp_path, output_loading_info=True)
    assert info["missing_keys"] == {"lm_head.weight"}
    assert torch.isfinite(loaded.lm_head.weight).all()
    for name, tensor in ours.model.state_dict().items():
        assert torch.equal(loaded.model.state_dict()[name], tensor), name


@pytest.mark.parametrize("value", [float("nan"), float("inf"), -float("inf")])
def test_a_non_finite_weight_is_named(tmp_path, pair_and_ids, value):
    ours, _, _ = pair_and_ids

    def poison(sd):
        sd["model.llm.layers.2.mlp_norm.weight"] = sd["model.llm.layers.2.mlp_norm.weight"].clone()
        sd["model.llm.layers.2.mlp_norm.weight"][5] = value

    folder = saved_with(tmp_path, ours, poison)
    with pytest.raises(ValueError, match=r"model\.layers\.2\.post_attention_layernorm\.weight holds 1 NaN .*\[5\]"):
        Inkling2ForCausalLM.from_pretrained(folder)
    assert Inkling2ForCausalLM.from_pretrained(folder, check_finite_weights=False) is not None


def test_an_integer_tensor_for_a_float_weight_is_an_error_naming_both_dtypes(tmp_path, pair_and_ids):
    ours, _, _ = pair_and_ids
    name = "model.llm.layers.1.attn.wo_ud.weight"
    folder = saved_with(tmp_path, ours, lambda sd: sd.update({name: sd[name].to(torch.int32)}))
    expected = rf"{re.escape(name)} is stored as I32, but the model holds its weights as torch\.float32"
    with pytest.raises(ValueError, match=expected):
        Inkling2ForCausalLM.from_pretrained(folder)


@pytest.mark.parametrize("argument", ["dtype", "torch_dtype"])
def test_dtype_auto_loads_in_the_saved_dtype(tmp_path, pair_and_ids, argument):
    ours, _, _ = pair_and_ids
    ours.save_pretrained(tmp_path)
    loaded = Inkling2ForCausalLM.from_pretrained(tmp_path, **{argument: "auto"})
    assert loaded.model.layers[0].self_attn.q_proj.weight.dtype == ours.model.layers[0].self_attn.q_proj.weight.dtype
    assert Inkling2ForCausalLM.from_pretrained(tmp_path, **{argument: torch.bfloat16}).lm_head.weight.dtype == torch.bfloat16
