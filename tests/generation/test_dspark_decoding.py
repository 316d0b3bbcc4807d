"""DSpark speculative decoding (`generation/dspark.py`): greedy output equals plain greedy decoding token for token,
sampling keeps the target's distribution (a chi-square test), generation configs turn it on, and its errors. The
drafter's config, checkpoints and training: `tests/dspark/test_dspark_drafter.py`."""

import pytest
import torch
from huggingface_hub.errors import StrictDataclassClassValidationError
from transformers import StoppingCriteria, StoppingCriteriaList
from inkling2_helpers import (
    DRAFTER,
    IMAGE_TOKEN,
    MULTIMODAL_CONFIG,
    ORACLE_TEXT_CONFIG,
    build_with_drafter,
    dspark_generate,
    greedy_generate,
    images,
    left_padded_batch,
    plant_drafts,
    prompt_with_placeholders,
)

from transformers_inkling2 import (
    Inkling2Config,
    Inkling2DSparkConfig,
    Inkling2ForCausalLM,
    Inkling2ForConditionalGeneration,
    Inkling2TextConfig,
)
from transformers_inkling2.cache.common import shift_rows_right
from transformers_inkling2.generation import dspark as dspark_generation
from transformers_inkling2.tiny import randomize_


@pytest.fixture(scope="module")
def model():
    return build_with_drafter()


@pytest.mark.parametrize("length, pad", [(5, 2), (21, 5), (40, 11)], ids=["short", "past-window", "past-context"])
def test_greedy_dspark_equals_plain_greedy_with_the_random_drafter(model, length, pad):
    input_ids, attention_mask = left_padded_batch(seed=length, length=length, pad=pad)
    expected = greedy_generate(model, input_ids, attention_mask, new_tokens=25)
    assert torch.equal(dspark_generate(model, input_ids, attention_mask, 25), expected)


def test_greedy_equals_plain_when_drafts_fail_at_every_position(model, monkeypatch):
    """Rows accept different counts every step (so rows move right by different amounts), all 0..7 occur."""
    input_ids, attention_mask = left_padded_batch(seed=7, length=21, pad=5)
    expected = greedy_generate(model, input_ids, attention_mask, new_tokens=60)
    planted = plant_drafts(monkeypatch, expected, attention_mask, seed=1)
    out = dspark_generate(model, input_ids, attention_mask, 60, return_dict_in_generate=True)
    assert torch.equal(out.sequences, expected)
    assert set(planted) == set(range(8))
    assert 1 < out.mean_accepted_length < 8
    assert torch.all(out.position_acceptance[:-1] >= out.position_acceptance[1:])


def test_eos_and_max_new_tokens_inside_a_step(model, monkeypatch):
    input_ids, attention_mask = left_padded_batch(seed=8, length=12, pad=3)
    reference = greedy_generate(model, input_ids, attention_mask, new_tokens=30)
    eos = int(reference[0, 12 + 10])  # row 0 stops at its 11th token (in the middle of a perfect step)
    expected = model.generate(
        input_ids, attention_mask=attention_mask, max_new_tokens=30, do_sample=False, eos_token_id=eos, pad_token_id=0
    )
    plant_drafts(monkeypatch, reference, attention_mask, perfect=True)
    out = model.generate(
        input_ids,
        attention_mask=attention_mask,
        max_new_tokens=30,
        do_sample=False,
        eos_token_id=eos,
        pad_token_id=0,
        dspark=True,
    )
    assert torch.equal(out, expected)
    # 13 = 1 (prefill) + 8 + 4: the budget ends four tokens into the second step
    assert torch.equal(dspark_generate(model, input_ids, attention_mask, 13), reference[:, : 12 + 13])


class StopAtLength(StoppingCriteria):
    """A caller's own criterion (as a server's cancel flag is): stops every row once it holds `length` tokens."""

    def __init__(self, length: int):
        self.length = length

    def __call__(self, input_ids, scores, **kwargs):
        return torch.full((input_ids.shape[0],), input_ids.shape[1] >= self.length, device=input_ids.device)


def test_a_callers_stopping_criteria_stop_dspark_where_they_stop_plain_decoding(model, monkeypatch):
    input_ids, attention_mask = left_padded_batch(seed=9, length=12, pad=0)
    input_ids, attention_mask = input_ids[:1], attention_mask[:1]
    reference = greedy_generate(model, input_ids, attention_mask, new_tokens=30)
    plant_drafts(monkeypatch, reference, attention_mask, perfect=True)
    arguments = dict(attention_mask=attention_mask, max_new_tokens=30, do_sample=False, pad_token_id=0)
    criteria = StoppingCriteriaList([StopAtLength(12 + 7)])  # the 7th token falls inside a step of 8
    out = model.generate(input_ids, stopping_criteria=criteria, dspark=True, **arguments)
    assert torch.equal(out, reference[:, : 12 + 7])


class Collect:
    """A streamer that keeps what it is given."""

    def __init__(self):
        self.parts = []

    def put(self, value):
        self.parts.append(value.flatten())

    def end(self):
        self.parts.append(None)


def test_streamer_and_statistics(model, monkeypatch):
    input_ids = left_padded_batch(seed=9, length=10, pad=0)[0][:1]
    reference = greedy_generate(model, input_ids, torch.ones_like(input_ids), new_tokens=17)
    plant_drafts(monkeypatch, reference, torch.ones_like(input_ids), perfect=True)

    streamer = Collect()
    out = dspark_generate(model, input_ids, None, 17, streamer=streamer, return_dict_in_generate=True)
    assert torch.equal(out.sequences, reference)
    assert streamer.parts[-1] is None
    assert torch.equal(torch.cat(streamer.parts[:-1]), reference[0])
    # perfect drafts: 1 token from the prefill, then 8 (7 drafts + the target's) per step
    assert out.num_steps == 2 and out.mean_accepted_length == 8.0 and torch.all(out.position_acceptance == 1)


def test_prefill_in_chunks_and_confidence_threshold_keep_the_output(model):
    input_ids, attention_mask = left_padded_batch(seed=10, length=45, pad=6)
    expected = greedy_generate(model, input_ids, attention_mask, new_tokens=12)
    assert torch.equal(dspark_generate(model, input_ids, attention_mask, 12, prefill_chunk_size=8), expected)
    out = dspark_generate(model, input_ids, attention_mask, 12, dspark_confidence_threshold=0.5)
    assert torch.equal(out, expected)


def test_images_in_the_prompt():
    config = Inkling2Config(**MULTIMODAL_CONFIG, dspark_config=DRAFTER)
    model = randomize_(Inkling2ForConditionalGeneration(config), seed=4).eval()
    pixel_values, grid = images((2, 2), (1, 2), seed=1)
    input_ids, attention_mask = prompt_with_placeholders([[(3, 4)], [(10, 2)]], length=24)
    assert int((input_ids == IMAGE_TOKEN).sum()) == 6
    inputs = dict(pixel_values=pixel_values, image_grid_thw=grid)
    expected = greedy_generate(model, input_ids, attention_mask, new_tokens=15, **inputs)
    assert torch.equal(dspark_generate(model, input_ids, attention_mask, 15, **inputs), expected)
    # over the static cache too, plain and DSpark (the prompt's images go through the eager prefill)
    static = dict(inputs, cache_implementation="static")
    assert torch.equal(greedy_generate(model, input_ids, attention_mask, 15, **static), expected)
    assert torch.equal(dspark_generate(model, input_ids, attention_mask, 15, **static), expected)


@pytest.fixture
def dspark_calls(monkeypatch):
    """How many times generate() entered DSpark decoding."""
    calls = []
    original = dspark_generation.dspark_decoding

    def counting(*args, **kwargs):
        calls.append(1)
        return original(*args, **kwargs)

    monkeypatch.setattr(dspark_generation, "dspark_decoding", counting)
    return calls


def test_generation_config_field_turns_dspark_on(model, dspark_calls):
    input_ids, attention_mask = left_padded_batch(seed=11, length=8, pad=0)
    expected = greedy_generate(model, input_ids, attention_mask, new_tokens=6)
    config = model.generation_config.__class__(dspark=True, max_new_tokens=6, do_sample=False, pad_token_id=0)
    assert torch.equal(model.generate(input_ids, attention_mask=attention_mask, generation_config=config), expected)
    assert dspark_calls == [1]


def test_a_saved_generation_config_turns_dspark_on(tmp_path, dspark_calls):
    from transformers import GenerationConfig

    model = build_with_drafter(seed=4)
    model.generation_config = GenerationConfig(dspark=True, max_new_tokens=6, do_sample=False, pad_token_id=0)
    model.save_pretrained(tmp_path)
    loaded = Inkling2ForCausalLM.from_pretrained(tmp_path).eval()
    input_ids, attention_mask = left_padded_batch(seed=16, length=8, pad=0)
    with_dspark = loaded.generate(input_ids, attention_mask=attention_mask)
    assert dspark_calls == [1]
    assert torch.equal(with_dspark, loaded.generate(input_ids, attention_mask=attention_mask, dspark=False))


# --- sampling keeps the target's distribution -----------------------------------------------------------------------

TEMPERATURE = 0.7
SIGNIFICANCE = 1e-3  # the test fails with this probability if the sampler is exact (fixed seed: deterministic)


def chi_square_p_value(counts: torch.Tensor, probabilities: torch.Tensor) -> float:
    """Pearson's test; cells expecting fewer than 5 samples are pooled into one."""
    total = counts.sum()
    expected = probabilities * total
    small = expected < 5
    observed = torch.cat([counts[~small], counts[small].sum()[None]])
    expected = torch.cat([expected[~small], expected[small].sum()[None]])
    statistic = ((observed - expected) ** 2 / expected.clamp(min=1e-12)).sum()
    degrees = len(observed) - 1
    return float(torch.special.gammaincc(torch.tensor(degrees / 2.0), statistic / 2))


def exact_three_token_distribution(model, prompt, temperature):
    """P(t1, t2, t3 | prompt) over the 8-token vocabulary by enumerating t1 and t2: [512]."""
    pairs = torch.cartesian_prod(torch.arange(8), torch.arange(8))
    sequences = torch.cat([prompt.repeat(64, 1), pairs], dim=1)
    with torch.no_grad():
        logits = model(sequences, use_cache=False).logits.double() / temperature
    first = torch.softmax(logits[0, -3], -1)
    second = torch.softmax(logits[::8, -2], -1)  # rows 0, 8, ...: t1 = 0..7
    third = torch.softmax(logits[:, -1], -1).view(8, 8, 8)
    return (first[:, None, None] * second[:, :, None] * third).flatten()


@pytest.mark.parametrize("method", ["probabilistic", "greedy"])
def test_sampling_keeps_the_target_distribution(method):
    model = build_with_drafter(seed=6, drafter=dict(mask_token_id=7), vocab_size=8, unpadded_vocab_size=8)
    with torch.no_grad():
        model.lm_head.weight.mul_(6.0)  # peaked distributions, so that a wrong sampler is visible
    prompt = torch.tensor([[1, 4, 2, 7, 3, 0]])
    exact = exact_three_token_distribution(model, prompt, TEMPERATURE)
    torch.manual_seed(0)
    rows = 3000
    out = model.generate(
        prompt.repeat(rows, 1),
        attention_mask=torch.ones(rows, prompt.shape[1], dtype=torch.long),
        max_new_tokens=3,
        do_sample=True,
        temperature=TEMPERATURE,
        top_k=None,
        top_p=None,
        eos_token_id=None,
        pad_token_id=0,
        dspark=True,
        draft_sample_method=method,
        return_dict_in_generate=True,
    )
    assert 1.0 < out.mean_accepted_length < 8.0  # both acceptances and rejections happened
    t1, t2, t3 = out.sequences[:, -3:].unbind(-1)
    counts = torch.bincount(t1 * 64 + t2 * 8 + t3, minlength=512).double()
    assert chi_square_p_value(counts, exact) > SIGNIFICANCE
    # the test has power: the same samples are rejected against the temperature-1 distribution
    assert chi_square_p_value(counts, exact_three_token_distribution(model, prompt, 1.0)) < SIGNIFICANCE


# --- errors --------------------------------------------------------------------------------------------------------


def test_clear_errors(model):
    input_ids, attention_mask = left_padded_batch(seed=12, length=6, pad=0)
    plain = randomize_(Inkling2ForCausalLM(Inkling2TextConfig(**ORACLE_TEXT_CONFIG)), 0).eval()
    with pytest.raises(ValueError, match="needs a DSpark drafter"):
        plain.generate(input_ids, max_new_tokens=3, dspark=True)
    with pytest.raises(ValueError, match="beam search"):
        model.generate(input_ids, max_new_tokens=3, num_beams=2, dspark=True)
    with pytest.raises(ValueError, match="Streaming takes one sequence"):
        model.generate(input_ids, max_new_tokens=3, dspark=True, streamer=Collect())
    with pytest.raises(ValueError, match="draft_sample_method"):
        model.generate(input_ids, max_new_tokens=3, dspark=True, draft_sample_method="top")
    with pytest.raises(StrictDataclassClassValidationError, match="target_layer_ids"):
        Inkling2TextConfig(**ORACLE_TEXT_CONFIG, dspark_config={**DRAFTER, "target_layer_ids": [11]})
    with pytest.raises(StrictDataclassClassValidationError, match="hidden_size"):
        Inkling2TextConfig(**ORACLE_TEXT_CONFIG, dspark_config={**DRAFTER, "hidden_size": 32})
    with pytest.raises(StrictDataclassClassValidationError, match="hidden_size"):
        Inkling2Config(**MULTIMODAL_CONFIG, dspark_config={**DRAFTER, "hidden_size": 32})
    with pytest.raises(StrictDataclassClassValidationError, match="head_type"):
        Inkling2DSparkConfig(head_type="lstm")


def test_shift_rows_right():
    tensor = torch.arange(2 * 3 * 5).view(2, 3, 5)
    shifted = shift_rows_right(tensor, torch.tensor([0, 2]), dim=-1)
    assert torch.equal(shifted[0], tensor[0])
    assert torch.equal(shifted[1], torch.cat([torch.zeros(3, 2, dtype=tensor.dtype), tensor[1, :, :3]], dim=1))


@pytest.mark.gpu
def test_greedy_dspark_equals_plain_greedy_on_gpu():
    model = build_with_drafter(seed=3).to("cuda")
    input_ids, attention_mask = (t.cuda() for t in left_padded_batch(seed=15, length=30, pad=7))
    expected = greedy_generate(model, input_ids, attention_mask, new_tokens=40)
    assert torch.equal(dspark_generate(model, input_ids, attention_mask, 40), expected)
