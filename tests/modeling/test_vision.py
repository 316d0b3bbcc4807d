"""The ViT against transformers' built-in `Inkling2VisionModel` (the oracle), on tiny random weights, CPU, fp32.

The oracle runs eager attention; ours runs both its SDPA default and its eager reference. Weights move between the
two with `load_state_dict(strict=True)`, which also checks that every parameter name and shape agree.
"""

import re

import pytest
import torch
from transformers.core_model_loading import WeightRenaming, rename_source_key
from transformers.models.inkling2 import modeling_inkling2 as builtin
from transformers.models.inkling2.configuration_inkling2 import Inkling2VisionConfig as BuiltinVisionConfig

from transformers_inkling2.configuration_inkling2 import Inkling2VisionConfig
from transformers_inkling2.modeling.modeling_inkling2_vision import Inkling2VisionModel, vision_checkpoint_renames

# patch 4 x merge 2 = 8x8 pixel blocks; a 5x5 position grid is both up- and down-sampled by the grids below
TINY = dict(
    hidden_size=32,
    num_hidden_layers=2,
    num_attention_heads=4,
    patch_size=4,
    posemb_grid_size=5,
    projection_hidden_dim=48,
    text_hidden_size=40,
)
BLOCK = (8, 8, 3)
TOLERANCE = 1e-4


def random_model(attn_implementation="sdpa", seed=0) -> Inkling2VisionModel:
    """Our model with every parameter perturbed (biases, norms, layer scales, class tokens too), so none hides a bug."""
    torch.manual_seed(seed)
    model = Inkling2VisionModel(Inkling2VisionConfig(**TINY)).eval()
    with torch.no_grad():
        for parameter in model.parameters():
            parameter.add_(torch.randn_like(parameter) * 0.1)
    model.set_attn_implementation(attn_implementation)
    return model


def oracle_from(model: Inkling2VisionModel) -> builtin.Inkling2VisionModel:
    config = BuiltinVisionConfig(**TINY)
    config._attn_implementation = "eager"
    oracle = builtin.Inkling2VisionModel(config).eval()
    oracle.load_state_dict(model.state_dict(), strict=True)
    return oracle


def random_pixels(grid: list[list[int]], seed=1) -> tuple[torch.Tensor, torch.Tensor]:
    grid = torch.tensor(grid)
    generator = torch.Generator().manual_seed(seed)
    return torch.randn(int(grid.prod(-1).sum()), *BLOCK, generator=generator), grid


def max_diff(a: torch.Tensor, b: torch.Tensor) -> float:
    return (a.float() - b.float()).abs().max().item()


GRIDS = {
    "one image": [[1, 3, 3]],
    "two images, one non-square": [[1, 2, 3], [1, 4, 1]],
    "three images, incl. 1x1 and larger than the position grid": [[1, 1, 1], [1, 4, 6], [1, 3, 2]],
    "runs of equal images, batched by the ViT": [[1, 2, 3], [1, 2, 3], [1, 2, 3], [1, 1, 1], [1, 2, 3], [1, 2, 3]],
}


@pytest.mark.parametrize("attn_implementation", ["sdpa", "eager"])
@pytest.mark.parametrize("grid", GRIDS.values(), ids=GRIDS.keys())
def test_matches_builtin(grid, attn_implementation):
    model = random_model(attn_implementation)
    oracle = oracle_from(model)
    pixel_values, image_grid_thw = random_pixels(grid)
    with torch.no_grad():
        ours = model(pixel_values, image_grid_thw)
        expected = oracle(pixel_values=pixel_values, image_grid_thw=image_grid_thw)
    assert ours.pooler_output.shape == (pixel_values.shape[0], TINY["text_hidden_size"])
    assert ours.last_hidden_state.shape == expected.last_hidden_state.shape
    assert max_diff(ours.pooler_output, expected.pooler_output) <= TOLERANCE
    assert max_diff(ours.last_hidden_state, expected.last_hidden_state) <= TOLERANCE


def test_eager_matches_builtin_bitwise_in_bf16():
    """Same formulas in the same order: the eager path reproduces the oracle to the bit, also in bf16."""
    model = random_model("eager")
    oracle = oracle_from(model)
    model.to(torch.bfloat16)
    for parameter in oracle.parameters():  # parameters only: the oracle keeps its rotary frequencies in fp32
        parameter.data = parameter.data.to(torch.bfloat16)
    pixel_values, image_grid_thw = random_pixels(GRIDS["runs of equal images, batched by the ViT"])
    with torch.no_grad():
        ours = model(pixel_values, image_grid_thw)
        expected = oracle(pixel_values=pixel_values, image_grid_thw=image_grid_thw)
    assert ours.pooler_output.dtype == torch.bfloat16
    assert torch.equal(ours.pooler_output, expected.pooler_output)
    assert torch.equal(ours.last_hidden_state, expected.last_hidden_state)


def test_sdpa_matches_eager():
    sdpa, eager = random_model("sdpa"), random_model("eager")
    pixel_values, image_grid_thw = random_pixels([[1, 2, 3], [1, 4, 1], [1, 1, 1]])
    with torch.no_grad():
        fast, reference = sdpa(pixel_values, image_grid_thw), eager(pixel_values, image_grid_thw)
    assert max_diff(fast.pooler_output, reference.pooler_output) <= TOLERANCE
    assert max_diff(fast.last_hidden_state, reference.last_hidden_state) <= TOLERANCE


@pytest.mark.parametrize("attn_implementation", ["sdpa", "eager"])
def test_images_in_one_batch_do_not_see_each_other(attn_implementation):
    model = random_model(attn_implementation)
    pixel_values, image_grid_thw = random_pixels([[1, 2, 2], [1, 3, 1]])
    alone, _ = random_pixels([[1, 2, 2]])
    changed = pixel_values.clone()
    changed[4:] = torch.randn_like(changed[4:])  # only the second image's 3 tokens
    with torch.no_grad():
        first = model(pixel_values, image_grid_thw).pooler_output
        second = model(changed, image_grid_thw).pooler_output
        single = model(pixel_values[:4], image_grid_thw[:1]).pooler_output
    assert torch.allclose(first[:4], second[:4], atol=1e-6)
    assert not torch.allclose(first[4:], second[4:])
    assert torch.allclose(first[:4], single, atol=1e-5)


@pytest.mark.parametrize("attn_implementation", ["sdpa", "eager"])
def test_equal_images_batched_together_do_not_see_each_other(attn_implementation):
    """Consecutive images of one size run as one batch: each still sees only itself."""
    model = random_model(attn_implementation)
    pixel_values, image_grid_thw = random_pixels([[1, 2, 2]] * 3)
    changed = pixel_values.clone()
    changed[4:8] = torch.randn_like(changed[4:8])  # only the middle image
    with torch.no_grad():
        batched = model(pixel_values, image_grid_thw, output_attentions=True)
        second = model(changed, image_grid_thw).pooler_output
        singles = [model(pixel_values[i : i + 4], image_grid_thw[:1]).pooler_output for i in (0, 4, 8)]
    assert torch.allclose(batched.pooler_output, torch.cat(singles), atol=1e-5)
    assert torch.allclose(batched.pooler_output[:4], second[:4], atol=1e-6)
    assert torch.allclose(batched.pooler_output[8:], second[8:], atol=1e-6)
    assert not torch.allclose(batched.pooler_output[4:8], second[4:8])
    assert [tuple(p.shape) for p in batched.attentions[0]] == [(1, TINY["num_attention_heads"], 17, 17)] * 3


def test_outputs_layout():
    model = random_model()
    pixel_values, image_grid_thw = random_pixels([[1, 2, 3], [1, 1, 1]])
    with torch.no_grad():
        output = model(pixel_values, image_grid_thw, output_hidden_states=True)
        as_tuple = model(pixel_values, image_grid_thw, return_dict=False)
    patches = 4 * pixel_values.shape[0]
    assert output.last_hidden_state.shape == (patches + 2, TINY["hidden_size"])  # + one class token per image
    assert len(output.hidden_states) == TINY["num_hidden_layers"] + 1
    assert torch.equal(output.hidden_states[-1], output.last_hidden_state)
    assert torch.equal(as_tuple[1], output.pooler_output)


def test_state_dict_names_equal_builtin():
    ours = Inkling2VisionModel(Inkling2VisionConfig(**TINY)).state_dict()
    theirs = builtin.Inkling2VisionModel(BuiltinVisionConfig(**TINY)).state_dict()
    assert {k: v.shape for k, v in ours.items()} == {k: v.shape for k, v in theirs.items()}
    assert "embeddings.position_embedding.weight" in ours and "layers.1.lambda_2" in ours


def test_fresh_weights_are_initialised():
    torch.manual_seed(0)
    model = Inkling2VisionModel(Inkling2VisionConfig(**TINY))
    layer = model.layers[0]
    assert torch.all(layer.lambda_1 == 0.1) and torch.all(layer.lambda_2 == 0.1)
    assert 0.005 < model.embeddings.class_embedding.std() < 0.05
    assert 0.005 < model.embeddings.position_embedding.weight.std() < 0.05
    assert torch.all(layer.self_attn.q_proj.bias == 0) and torch.all(model.pre_layernorm.weight == 1)


def test_save_and_load_keeps_every_weight(tmp_path):
    model = random_model()
    model.save_pretrained(tmp_path)
    loaded, info = Inkling2VisionModel.from_pretrained(tmp_path, output_loading_info=True)
    assert not any(info.values()), info
    pixel_values, image_grid_thw = random_pixels([[1, 2, 1]])
    with torch.no_grad():
        assert torch.equal(
            model(pixel_values, image_grid_thw).pooler_output, loaded(pixel_values, image_grid_thw).pooler_output
        )


def test_gradient_checkpointing_backward():
    model = random_model().train()
    model.activation_checkpointing_enable()
    pixel_values, image_grid_thw = random_pixels([[1, 2, 2]])
    model(pixel_values, image_grid_thw).pooler_output.square().mean().backward()
    assert model.layers[0].lambda_1.grad is not None
    assert model.embeddings.position_embedding.weight.grad.abs().sum() > 0


# ---------------------------------------------------------------------------------------------------------------
# The original checkpoint layout
# ---------------------------------------------------------------------------------------------------------------

ORIGINAL_NAMES = [  # ours -> original, for the parts that differ (SPEC section 3)
    (r"^embeddings\.position_embedding\.weight$", "visual.backbone.embeddings.position_embedding"),
    (r"^embeddings\.", "visual.backbone.embeddings."),
    (r"^pre_layernorm\.", "visual.backbone.ln_pre."),
    (r"^layers\.(\d+)\.layernorm_before\.", r"visual.backbone.layers.\1.ln_1."),
    (r"^layers\.(\d+)\.layernorm_after\.", r"visual.backbone.layers.\1.ln_2."),
    (r"^layers\.(\d+)\.mlp\.fc1\.", r"visual.backbone.layers.\1.mlp.c_fc."),
    (r"^layers\.(\d+)\.mlp\.fc2\.", r"visual.backbone.layers.\1.mlp.c_proj."),
    (r"^layers\.(\d+)\.lambda_1$", r"visual.backbone.layers.\1.ls_1.gamma"),
    (r"^layers\.(\d+)\.lambda_2$", r"visual.backbone.layers.\1.ls_2.gamma"),
    (r"^layers\.", "visual.backbone.layers."),
    (r"^merger\.linear_1\.", "visual.proj_in."),
    (r"^merger\.linear_2\.", "visual.proj_out."),
]


def original_key(our_key: str) -> str:
    for pattern, replacement in ORIGINAL_NAMES:
        if re.search(pattern, our_key):
            return "model." + re.sub(pattern, replacement, our_key)
    raise AssertionError(f"no original name for {our_key}")


def apply(renamings: list[WeightRenaming], key: str) -> str:
    return rename_source_key(key, renamings, [])[0]


def test_original_checkpoint_keys_map_to_ours():
    """Through transformers' own renaming machinery, as the loader will use the pairs."""
    our_keys = set(Inkling2VisionModel(Inkling2VisionConfig(**TINY)).state_dict())
    original_keys = {original_key(key) for key in our_keys}
    assert len(original_keys) == len(our_keys)
    assert "model.visual.backbone.embeddings.position_embedding" in original_keys

    renamings = [WeightRenaming(source, target) for source, target in vision_checkpoint_renames()]
    renamed = {apply(renamings, key) for key in original_keys}
    assert renamed == {"model.vision_tower." + key for key in our_keys}

    # keys that already have our names are left alone, so a checkpoint saved by us loads too
    fresh = [WeightRenaming(source, target) for source, target in vision_checkpoint_renames()]
    assert {apply(fresh, key) for key in renamed} == renamed


def test_original_checkpoint_renames_agree_with_builtin_mapping():
    from transformers.conversion_mapping import get_checkpoint_conversion_mapping

    our_keys = Inkling2VisionModel(Inkling2VisionConfig(**TINY)).state_dict()
    builtin_renamings = [t for t in get_checkpoint_conversion_mapping("inkling2") if type(t) is WeightRenaming]
    renamings = [WeightRenaming(source, target) for source, target in vision_checkpoint_renames()]
    for key in our_keys:
        original = original_key(key)
        assert apply(renamings, original) == apply(builtin_renamings, original)


def test_original_checkpoint_renames_reverse_for_saving():
    """transformers saves in the original layout by reversing the renamings (in reverse order)."""
    our_keys = ["model.vision_tower." + k for k in Inkling2VisionModel(Inkling2VisionConfig(**TINY)).state_dict()]
    forward = [WeightRenaming(source, target) for source, target in vision_checkpoint_renames()]
    backward = [renaming.reverse_transform() for renaming in forward[::-1]]
    for key in our_keys:
        assert apply(backward, key) == original_key(key.removeprefix("model.vision_tower."))


# ---------------------------------------------------------------------------------------------------------------
# Errors
# ---------------------------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "pixels_shape, grid, message",
    [
        ((5, *BLOCK), [[1, 2, 3]], "describes 6 image tokens"),
        ((6, 4, 4, 3), [[1, 2, 3]], r"must have shape \[image tokens, 8, 8, 3\]"),
        ((6, 3, 8, 8), [[1, 2, 3]], r"must have shape \[image tokens, 8, 8, 3\]"),
        ((6, *BLOCK), [[2, 1, 3]], "still images"),
        ((6, *BLOCK), [[1, 0, 3], [1, 2, 3]], "token rows >= 1"),
        ((6, *BLOCK), [1, 2, 3], r"shape \[images, 3\]"),
        ((6, *BLOCK), [[1.0, 2.0, 3.0]], "integer tensor"),
        ((0, *BLOCK), torch.zeros(0, 3, dtype=torch.long), "no image"),
    ],
)
def test_inconsistent_inputs_are_refused(pixels_shape, grid, message):
    model = random_model()
    with pytest.raises(ValueError, match=message):
        model(torch.zeros(pixels_shape), torch.as_tensor(grid))
