"""DSpark speculative decoding: greedy output equals plain greedy decoding token for token, sampling keeps the
target's distribution (a chi-square test), and the drafter's config, checkpoints and training."""

import json
import logging

import pytest
import torch
from conftest import ORACLE_TEXT_CONFIG, greedy_generate, left_padded_batch
from huggingface_hub.errors import StrictDataclassClassValidationError
from safetensors.torch import load_file, save_file
from test_multimodal import CONFIG as MULTIMODAL_CONFIG
from test_multimodal import IMAGE_TOKEN, images, prompt_with_placeholders

from transformers_inkling2 import (
    Inkling2Config,
    Inkling2DSparkConfig,
    Inkling2ForCausalLM,
    Inkling2ForConditionalGeneration,
    Inkling2TextConfig,
)
from transformers_inkling2 import generation_dspark as dspark_generation
from transformers_inkling2.cache_inkling2 import shift_rows_right
from transformers_inkling2.tiny import randomize_, tiny_dspark_config

# Three tapped layers of the 12; a context window (16) longer than the target's sliding window (8).
DRAFTER = tiny_dspark_config(
    target_layer_ids=[1, 5, 9], intermediate_size=96, num_draft_layers=2, mask_token_id=498
).to_dict()


def build(seed=3, drafter=None, **overrides):
    config = Inkling2TextConfig(**{**ORACLE_TEXT_CONFIG, **overrides}, dspark_config={**DRAFTER, **(drafter or {})})
    return randomize_(Inkling2ForCausalLM(config), seed).eval()


@pytest.fixture(scope="module")
def model():
    return build()


def dspark_generate(model, input_ids, attention_mask, new_tokens, **kwargs):
    return greedy_generate(model, input_ids, attention_mask, new_tokens, dspark=True, **kwargs)


@pytest.mark.parametrize("length, pad", [(5, 2), (21, 5), (40, 11)], ids=["short", "past-window", "past-context"])
def test_greedy_dspark_equals_plain_greedy_with_the_random_drafter(model, length, pad):
    input_ids, attention_mask = left_padded_batch(seed=length, length=length, pad=pad)
    expected = greedy_generate(model, input_ids, attention_mask, new_tokens=25)
    assert torch.equal(dspark_generate(model, input_ids, attention_mask, 25), expected)


def plant_drafts(monkeypatch, reference, prompt_mask, seed=0, perfect=False):
    """Replaces the drafter's proposals by the reference continuation, wrong at a random position per row and step
    (or nowhere, when `perfect`). Returns the list of planted error positions (7 = none)."""
    generator = torch.Generator().manual_seed(seed)
    prompt_real = prompt_mask.sum(-1)
    continuation = torch.cat([reference[:, prompt_mask.shape[1] :], torch.zeros_like(reference[:, :8])], dim=1)
    planted = []

    def draft(self, anchor, alive):
        generated = self.real_lengths - prompt_real + 1  # tokens generated so far, the anchor included
        rows = torch.arange(len(anchor))
        index = (generated[:, None] + torch.arange(self.block_size)).clamp(max=continuation.shape[1] - 1)
        drafts = continuation[rows[:, None], index]  # finished rows go on with junk
        errors = torch.randint(0, self.block_size + 1, (len(anchor),), generator=generator)
        if perfect:
            errors.fill_(self.block_size)
        planted.extend(errors.tolist())
        wrong = errors < self.block_size
        drafts[rows[wrong], errors[wrong]] = (drafts[rows[wrong], errors[wrong]] + 1) % 490
        return drafts, None

    monkeypatch.setattr(dspark_generation.DSparkDecoder, "draft", draft)
    return planted


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
    model = build(seed=6, drafter=dict(mask_token_id=7), vocab_size=8, unpadded_vocab_size=8)
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


# --- errors, config --------------------------------------------------------------------------------------------------


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


def test_config_defaults_and_mirroring():
    config = Inkling2DSparkConfig()
    assert (config.block_size, config.markov_rank, config.head_type, config.mask_token_id) == (7, 256, "rnn", 200064)
    multimodal = Inkling2Config(**MULTIMODAL_CONFIG, dspark_config=DRAFTER)
    assert multimodal.text_config.dspark_config is multimodal.dspark_config


def test_shift_rows_right():
    tensor = torch.arange(2 * 3 * 5).view(2, 3, 5)
    shifted = shift_rows_right(tensor, torch.tensor([0, 2]), dim=-1)
    assert torch.equal(shifted[0], tensor[0])
    assert torch.equal(shifted[1], torch.cat([torch.zeros(3, 2, dtype=tensor.dtype), tensor[1, :, :3]], dim=1))


# --- checkpoints ---------------------------------------------------------------------------------------------------


def test_save_and_load_keep_the_drafter(model, tmp_path):
    model.save_pretrained(tmp_path)
    names = set(load_file(str(tmp_path / "model.safetensors")))
    # the target's renamings to the original layout leave the drafter's names alone
    assert {name for name in names if name.startswith("dspark.")} == {f"dspark.{k}" for k in model.dspark.state_dict()}
    loaded = Inkling2ForCausalLM.from_pretrained(tmp_path).eval()
    for name, tensor in model.dspark.state_dict().items():
        assert torch.equal(loaded.dspark.state_dict()[name], tensor), name
    input_ids, attention_mask = left_padded_batch(seed=13, length=9, pad=2)
    assert torch.equal(
        dspark_generate(loaded, input_ids, attention_mask, 10), greedy_generate(model, input_ids, attention_mask, 10)
    )


def test_a_saved_generation_config_turns_dspark_on(tmp_path, dspark_calls):
    from transformers import GenerationConfig

    model = build(seed=4)
    model.generation_config = GenerationConfig(dspark=True, max_new_tokens=6, do_sample=False, pad_token_id=0)
    model.save_pretrained(tmp_path)
    loaded = Inkling2ForCausalLM.from_pretrained(tmp_path).eval()
    input_ids, attention_mask = left_padded_batch(seed=16, length=8, pad=0)
    with_dspark = loaded.generate(input_ids, attention_mask=attention_mask)
    assert dspark_calls == [1]
    assert torch.equal(with_dspark, loaded.generate(input_ids, attention_mask=attention_mask, dspark=False))


def write_official_layout(model, folder, drafter_names=lambda name: f"model.mtp.{name}", with_config=True):
    """The target as usual plus the drafter in a separate `mtp.safetensors`."""
    target = Inkling2ForCausalLM(Inkling2TextConfig(**ORACLE_TEXT_CONFIG))
    target.load_state_dict({k: v for k, v in model.state_dict().items() if not k.startswith("dspark.")})
    target.save_pretrained(folder)
    drafter = {drafter_names(name): tensor.contiguous() for name, tensor in model.dspark.state_dict().items()}
    save_file(
        {name.replace("context_norm.", "hidden_norm."): t for name, t in drafter.items()}, folder / "mtp.safetensors"
    )
    if with_config:
        config = json.loads((folder / "config.json").read_text())
        config["dspark_config"] = DRAFTER
        (folder / "config.json").write_text(json.dumps(config))


def test_mtp_file_loads_into_the_drafter(model, tmp_path):
    write_official_layout(model, tmp_path)
    loaded = Inkling2ForCausalLM.from_pretrained(tmp_path).eval()
    for name, tensor in model.dspark.state_dict().items():
        assert torch.equal(loaded.dspark.state_dict()[name], tensor), name


def test_unmappable_mtp_file_disables_dspark_with_a_warning(model, tmp_path, caplog):
    write_official_layout(model, tmp_path, drafter_names=lambda name: f"speculator.{name}")
    with caplog.at_level(logging.WARNING):
        loaded = Inkling2ForCausalLM.from_pretrained(tmp_path).eval()
    assert loaded.dspark is None
    assert "DSpark disabled" in caplog.text and "speculator." in caplog.text
    input_ids, attention_mask = left_padded_batch(seed=14, length=9, pad=2)
    with torch.no_grad():
        assert torch.equal(
            loaded(input_ids, attention_mask=attention_mask).logits,
            model(input_ids, attention_mask=attention_mask).logits,
        )


def test_mtp_file_without_a_drafter_config_needs_the_tapped_layers(model, tmp_path, caplog):
    """Without `dspark_config`, the shape is read off the tensors, but the tapped layers cannot be: disabled."""
    write_official_layout(model, tmp_path, with_config=False)
    with caplog.at_level(logging.WARNING):
        loaded = Inkling2ForCausalLM.from_pretrained(tmp_path)
    assert loaded.dspark is None and "target_layer_ids" in caplog.text


# --- training ------------------------------------------------------------------------------------------------------


def test_a_drafter_distilled_from_its_target_drafts_several_tokens_per_step():
    """End to end on a deterministic language (a 13-token cycle): train the target, let it write its own training
    text, distill the drafter, and decode with it; the drafts must be accepted several at a time."""
    from transformers_inkling2.dspark_training import (
        attach_new_drafter,
        default_dspark_config,
        target_written_windows,
        token_windows,
        train_dspark,
        window_batches,
    )

    torch.manual_seed(0)
    model = build(seed=2, drafter=dict(target_layer_ids=[1, 3]), num_hidden_layers=6, layer_types=None)
    tokens = torch.randperm(40)[torch.arange(5000) % 13]
    optimizer = torch.optim.AdamW(model.parameters(), lr=3e-3)
    model.train()
    for _, input_ids in zip(range(40), token_windows(tokens, 48, 8)):
        loss = model(input_ids=input_ids, labels=input_ids, use_cache=False).loss
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
    model.eval()
    attach_new_drafter(model, default_dspark_config(model.config, num_draft_layers=1, markov_rank=16))
    windows = target_written_windows(model, tokens, count=16, window=48, batch_size=16)
    losses = train_dspark(model, window_batches(windows, 8), steps=200, learning_rate=3e-3, anchors_per_window=8)
    assert sum(losses[-5:]) < 0.6 * sum(losses[:5])
    prompt = tokens[None, 3:23]
    out = dspark_generate(model, prompt, torch.ones_like(prompt), 40, return_dict_in_generate=True)
    assert torch.equal(out.sequences, greedy_generate(model, prompt, torch.ones_like(prompt), 40))
    assert out.mean_accepted_length >= 4


def test_train_dspark_command_writes_a_loadable_model(tmp_path):
    from transformers_inkling2.cli import main

    corpus = tmp_path / "corpus.txt"
    corpus.write_text("The sea is calm tonight. The tide is full, the moon lies fair upon the straits. " * 20)
    main(["train-dspark", "--output", str(tmp_path / "out"), "--corpus", str(corpus), "--steps", "2", "--window", "64",
          "--batch-size", "2", "--anchors", "4", "--device", "cpu", "--self-distill", "2"])  # fmt: skip
    assert Inkling2ForConditionalGeneration.from_pretrained(tmp_path / "out").dspark is not None


@pytest.mark.gpu
def test_greedy_dspark_equals_plain_greedy_on_gpu():
    model = build(seed=3).to("cuda")
    input_ids, attention_mask = (t.cuda() for t in left_padded_batch(seed=15, length=30, pad=7))
    expected = greedy_generate(model, input_ids, attention_mask, new_tokens=40)
    assert torch.equal(dspark_generate(model, input_ids, attention_mask, 40), expected)


@pytest.mark.parametrize("dtype, tolerance", [(torch.float32, 1e-5), (torch.bfloat16, 2e-2)])
def test_drafter_attention_equals_sdpa(dtype, tolerance):
    """The drafter's plain-matmul attention against PyTorch's SDPA on fresh random inputs, grouped heads, masked keys."""
    from transformers_inkling2.modeling_inkling2_dspark import attend

    generator = torch.Generator().manual_seed(17)
    q, k, v = (torch.randn(shape, generator=generator).to(dtype) for shape in ((2, 8, 14, 16), (2, 2, 30, 16), (2, 2, 30, 16)))
    bias = torch.randn(2, 8, 14, 30, generator=generator)
    bias[..., :5] = float("-inf")
    expected = torch.nn.functional.scaled_dot_product_attention(
        q.float(), k.float(), v.float(), attn_mask=bias, enable_gqa=True
    )
    actual = attend(q, k, v, bias).float()
    assert (actual - expected).norm() / expected.norm() < tolerance
