"""The multimodal model against transformers' built-in `inkling2` on the same random weights, and its errors."""

import json
import subprocess
import sys
import textwrap

import pytest
import torch
from inkling2_helpers import (
    MULTIMODAL_CONFIG,
    greedy_by_recomputation,
    greedy_generate,
    images,
    positions_from_mask,
    prompt_with_placeholders,
)
from transformers import AutoModelForImageTextToText

from transformers_inkling2 import Inkling2Config, Inkling2ForConditionalGeneration
from transformers_inkling2.tiny import randomize_


@pytest.fixture(scope="module")
def models():
    from transformers.models.inkling2 import configuration_inkling2 as builtin_config
    from transformers.models.inkling2 import modeling_inkling2 as builtin

    ours = randomize_(Inkling2ForConditionalGeneration(Inkling2Config(**MULTIMODAL_CONFIG)), seed=4).eval()
    oracle = builtin.Inkling2ForConditionalGeneration(builtin_config.Inkling2Config(**MULTIMODAL_CONFIG)).eval()
    oracle.load_state_dict(ours.state_dict(), strict=True)
    return ours, oracle


def both_outputs(models, input_ids, attention_mask, pixel_values, grid):
    inputs = dict(
        pixel_values=pixel_values,
        image_grid_thw=grid,
        attention_mask=attention_mask,
        position_ids=positions_from_mask(attention_mask),
        use_cache=False,
    )
    with torch.no_grad():
        return [model(input_ids, **inputs) for model in models]


def test_one_image(models):
    pixel_values, grid = images((2, 3))
    input_ids, attention_mask = prompt_with_placeholders([[(4, 6)]])
    ours, oracle = both_outputs(models, input_ids, attention_mask, pixel_values, grid)
    assert (ours.image_hidden_states - oracle.image_hidden_states).abs().max() <= 1e-4
    assert (ours.logits - oracle.logits).abs().max() <= 1e-4


def test_two_images_of_different_sizes(models):
    pixel_values, grid = images((2, 3), (1, 4), seed=1)
    input_ids, attention_mask = prompt_with_placeholders([[(2, 6), (12, 4)]], seed=1)
    ours, oracle = both_outputs(models, input_ids, attention_mask, pixel_values, grid)
    assert ours.image_hidden_states.shape == (10, 64)
    assert (ours.logits - oracle.logits).abs().max() <= 1e-4


def test_batch_mixing_an_image_row_and_a_left_padded_text_only_row(models):
    pixel_values, grid = images((3, 2), seed=2)
    input_ids, attention_mask = prompt_with_placeholders([[(5, 6)], []], seed=2)
    attention_mask[1, :3] = 0
    ours, oracle = both_outputs(models, input_ids, attention_mask, pixel_values, grid)
    real = attention_mask.bool()
    assert (ours.logits - oracle.logits)[real].abs().max() <= 1e-4


def test_generate_with_images_equals_uncached_recomputation_and_builtin(models):
    ours, oracle = models
    pixel_values, grid = images((2, 2), seed=3)
    input_ids, attention_mask = prompt_with_placeholders([[(3, 4)], []], length=10, seed=3)
    attention_mask[1, :2] = 0
    kwargs = dict(pixel_values=pixel_values, image_grid_thw=grid)
    generated = greedy_generate(ours, input_ids, attention_mask, new_tokens=12, **kwargs)
    assert torch.equal(generated, greedy_by_recomputation(ours, input_ids, attention_mask, 12, **kwargs))
    assert torch.equal(generated, greedy_generate(oracle, input_ids, attention_mask, new_tokens=12, **kwargs))


def test_a_forward_with_images_in_prefill_chunks_equals_one_forward(models):
    ours, _ = models
    pixel_values, grid = images((2, 3), seed=5)
    input_ids, attention_mask = prompt_with_placeholders([[(4, 6)]], seed=5)
    inputs = dict(pixel_values=pixel_values, image_grid_thw=grid, attention_mask=attention_mask, use_cache=False)
    calls = []
    hook = ours.model.language_model.register_forward_hook(lambda *_: calls.append(1))
    with torch.no_grad():
        whole = ours(input_ids, **inputs).logits
        chunked = ours(input_ids, prefill_chunk_size=7, **inputs).logits
    hook.remove()
    assert len(calls) == 1 + (1 + 4)  # one forward, then a chunked one: itself and 24 tokens in 4 chunks
    assert (chunked - whole).abs().max() <= 1e-5


def test_placeholder_count_that_does_not_match_the_features_is_a_clear_error(models):
    ours, _ = models
    pixel_values, grid = images((2, 3))
    input_ids, _ = prompt_with_placeholders([[(4, 5)]])
    with pytest.raises(ValueError, match="5 image placeholder tokens .* give 6 features"):
        ours(input_ids, pixel_values=pixel_values, image_grid_thw=grid)


def test_placeholders_without_images_are_a_clear_error(models):
    ours, _ = models
    input_ids, _ = prompt_with_placeholders([[(4, 5)]])
    with pytest.raises(ValueError, match="no `pixel_values`"):
        ours(input_ids)


BUILTIN_SAVE = textwrap.dedent(
    """
    import sys, json, torch
    from transformers.models.inkling2 import configuration_inkling2 as c, modeling_inkling2 as m
    torch.manual_seed(8)
    model = m.Inkling2ForConditionalGeneration(c.Inkling2Config(**json.loads(sys.argv[2]))).eval()
    with torch.no_grad():
        for tensor in model.parameters():
            tensor.normal_(0, 0.1)
    model.save_pretrained(sys.argv[1])
    inputs = torch.load(sys.argv[1] + "/inputs.pt")
    with torch.no_grad():
        torch.save(model(**inputs, use_cache=False).logits, sys.argv[1] + "/expected.pt")
    """
)


def test_original_layout_multimodal_checkpoint_saved_by_builtin_loads(tmp_path):
    """Written by the built-in in a separate process (`model.llm.*`, `model.visual.*`): loads with nothing random."""
    pixel_values, grid = images((2, 3))
    input_ids, _ = prompt_with_placeholders([[(4, 6)]])
    torch.save(dict(input_ids=input_ids, pixel_values=pixel_values, image_grid_thw=grid), tmp_path / "inputs.pt")
    subprocess.run([sys.executable, "-c", BUILTIN_SAVE, str(tmp_path), json.dumps(MULTIMODAL_CONFIG)], check=True)
    loaded = AutoModelForImageTextToText.from_pretrained(tmp_path)
    assert isinstance(loaded, Inkling2ForConditionalGeneration)
    with torch.no_grad():
        logits = loaded(input_ids, pixel_values=pixel_values, image_grid_thw=grid, use_cache=False).logits
    assert (logits - torch.load(tmp_path / "expected.pt")).abs().max() <= 1e-4
