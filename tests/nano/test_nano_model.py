"""The shipped Inkling-2-Nano: its layout, its tokenizer, and what it does on held-out data (streams and documentation
that training never drew). docs/nano.md gives the targets and which of them this checkpoint meets."""

import json

import pytest
import torch
from inkling2_helpers import greedy_generate

from transformers_inkling2.nano import NANO_CHECKPOINT, load_nano
from transformers_inkling2.nano.evaluation import dspark_accepted_length, scene_accuracy, tool_accuracy
from transformers_inkling2.nano.training import NANO_MAX_BYTES, NANO_MXFP8_FROM, NANO_NUM_RANKS, build_nano_processor
from transformers_inkling2.processing.tokenization_inkling2 import (
    SPECIAL_TOKENS,
    build_inkling2_tokenizer,
    first_special_id,
)


@pytest.fixture(scope="module")
def nano():
    torch.manual_seed(0)
    return load_nano()


def test_the_checkpoint_fits_the_budget_and_has_the_whole_architecture(nano):
    model, _ = nano
    assert sum(f.stat().st_size for f in NANO_CHECKPOINT.iterdir()) <= NANO_MAX_BYTES
    text = model.config.text_config
    assert {"hybrid", "hybrid_sliding"} == set(text.layer_types)
    assert model.dspark is not None and model.model.vision_tower is not None
    formats = json.loads((NANO_CHECKPOINT / "hf_quant_config.json").read_text())["quantization"]["quantized_layers"]
    assert len(formats) == text.num_hidden_layers
    for name, entry in formats.items():
        layer = int(name.split("layers.")[1].split(".")[0])
        assert entry["quant_algo"] == ("NVFP4" if layer < NANO_MXFP8_FROM else "MXFP8")


def test_the_tokenizer_is_o200k_first_ranks_with_the_official_special_tokens(nano):
    _, processor = nano
    shipped = processor.tokenizer
    assert first_special_id(shipped) == NANO_NUM_RANKS and len(shipped) == NANO_NUM_RANKS + 60
    for token, official_id in SPECIAL_TOKENS.items():
        assert shipped.convert_tokens_to_ids(token) == official_id - 199_998 + NANO_NUM_RANKS
    full = build_inkling2_tokenizer()
    rebuilt = build_nano_processor().tokenizer
    texts = ["The for statement iterates over a sequence.", "What is 945 * 85?", "Größe: 12 km → 7.46 miles",
             "def f(x):\n    return x ** 2  # square"]  # fmt: skip
    for text in texts:
        ids = shipped(text)["input_ids"]
        assert ids == rebuilt(text)["input_ids"] and shipped.decode(ids) == text
        full_ids = full(text)["input_ids"]
        if max(full_ids) < NANO_NUM_RANKS:  # every merge o200k makes is one the prefix keeps
            assert ids == full_ids
        else:
            assert len(ids) > len(full_ids)


def test_it_answers_questions_about_held_out_scenes(nano):
    score = scene_accuracy(*nano, count=50)
    assert score.total == 50 and score.accuracy >= 0.9, score.failures[:5]


def test_it_calls_the_right_tool_and_answers_with_its_result(nano):
    score = tool_accuracy(*nano, count=50)
    assert score.total == 50 and score.accuracy >= 0.9, score.failures[:5]


def test_dspark_on_held_out_text_is_lossless_and_accepts_drafts(nano):
    """Greedy DSpark writes exactly the plain greedy reply, and accepts the targets' lengths (4 tokens per step at
    temperature 0, 3 at 1) on held-out documentation questions and tool questions, measured as docs/nano.md reports
    them (benchmarks/nano.py: 8 questions, 96 new tokens)."""
    model, processor = nano
    tokenizer = processor.tokenizer
    chat = [{"role": "user", "content": "Tell me about The \"while\" statement."}]
    inputs = tokenizer.apply_chat_template(chat, add_generation_prompt=True, return_tensors="pt", return_dict=True)
    plain = greedy_generate(model, inputs["input_ids"], inputs["attention_mask"], 40)
    drafted = model.generate(**inputs, max_new_tokens=40, do_sample=False, dspark=True)
    assert torch.equal(drafted[:, : plain.shape[1]], plain)
    for kind in ("prose", "tool"):
        assert dspark_accepted_length(model, processor, 0.0, kind) >= 4.0, kind
        assert dspark_accepted_length(model, processor, 1.0, kind) >= 3.0, kind
