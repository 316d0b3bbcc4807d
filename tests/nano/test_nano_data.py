"""Inkling-2-Nano's training data: scenes, tools and documentation conversations, and the token masks they train."""

import random

import pytest
import torch

from transformers_inkling2.nano.data import (
    HELD_OUT_STREAM,
    KINDS,
    TOOLS_DECLARED,
    ConversationDataset,
    OneKindBatches,
    collate,
    conversation,
    documentation,
    encode,
    example_rng,
    is_held_out,
    model_token_mask,
    prose_turns,
)
from transformers_inkling2.nano.scenes import COLOURS, SCORED_KINDS, SHAPES, answer_is_right, ask, draw_scene
from transformers_inkling2.nano.tools import TOOLS, run_tool, tool_answer, tool_question
from transformers_inkling2.nano.training import build_nano_processor


@pytest.fixture(scope="module")
def processor():
    return build_nano_processor()


def test_a_scene_is_a_pure_function_of_its_seed_and_its_answers_follow_from_it():
    image, scene = draw_scene(random.Random("held-out-3"))
    again, same = draw_scene(random.Random("held-out-3"))
    assert image.tobytes() == again.tobytes() and scene == same
    other, _ = draw_scene(random.Random("held-out-4"))
    assert image.tobytes() != other.tobytes()
    for seed in range(40):
        rng = random.Random(seed)
        _, scene = draw_scene(rng)
        assert 1 <= len(scene.things) <= 4 and len({t.cell for t in scene.things}) == len(scene.things)
        kind, question, answer = ask(scene, rng, "count")
        assert str(len(scene.things)) in answer


@pytest.mark.parametrize("kind", SCORED_KINDS)
def test_the_scorer_takes_the_expected_answer_and_refuses_a_wrong_one(kind):
    for seed in range(30):
        rng = random.Random(f"{kind}-{seed}")
        _, scene = draw_scene(rng)
        try:
            _, question, answer = ask(scene, rng, kind)
        except ValueError:  # this scene cannot answer this kind
            continue
        assert answer_is_right(kind, answer, answer)
        assert answer_is_right(kind, answer, "Well. " + answer.upper())
        words = {"count": [str(n) for n in range(6)], "count_shape": ["no", "one", "two", "three", "four"],
                 "colour": list(COLOURS), "shape": list(SHAPES)}[kind]  # fmt: skip
        right = next(w for w in words if f" {w} " in f" {answer.rstrip('.').lower()} ")
        wrong = next(w for w in words if w != right)
        assert not answer_is_right(kind, answer, answer.lower().replace(f" {right}", f" {wrong}", 1))


def test_the_tools_answer_their_calls_and_name_what_they_cannot_answer():
    assert run_tool("calculator", {"expression": "12 * 3"}) == "36"
    assert run_tool("calculator", {"expression": "7 / 2"}) == "3.5"
    assert run_tool("calculator", {"expression": "2 / 3"}) == "0.67"
    assert run_tool("convert_units", {"value": 100, "from_unit": "celsius", "to_unit": "fahrenheit"}) == "212"
    assert run_tool("convert_units", {"value": 10, "from_unit": "km", "to_unit": "miles"}) == "6.21"
    assert run_tool("lookup_capital", {"country": "Japan"}) == "Tokyo"
    for name, arguments in [("calculator", {"expression": "__import__('os')"}), ("calculator", {"expression": "1 / 0"}),
                            ("convert_units", {"value": 1, "from_unit": "km", "to_unit": "kg"}),
                            ("lookup_capital", {"country": "Atlantis"}), ("search", {})]:  # fmt: skip
        assert run_tool(name, arguments).startswith("error")
    names = {tool["function"]["name"] for tool in TOOLS}
    for seed in range(30):
        question, tool, arguments = tool_question(random.Random(seed))
        assert tool in names and question
        result = run_tool(tool, arguments)
        assert not result.startswith("error") and result in tool_answer(tool, arguments, result)


def test_training_never_draws_the_held_out_documentation():
    topics, docstrings = documentation()
    held_out = {title for i, (title, _) in enumerate(topics) if is_held_out(i)}
    assert held_out and len(held_out) < len(topics) / 5
    trained = {prose_turns(example_rng("train-0", i))[0] for i in range(300)}
    assert not any(title in question for question in trained for title in held_out)
    assert all(any(title in prose_turns(example_rng(HELD_OUT_STREAM, i), held_out=True)[0] for title in held_out)
               or "`" in prose_turns(example_rng(HELD_OUT_STREAM, i), held_out=True)[0] for i in range(20))  # fmt: skip


def test_the_loss_mask_covers_what_the_model_writes_and_nothing_else(processor):
    tokenizer = processor.tokenizer
    chat = conversation(random.Random(5), "tool")
    example = encode(processor, chat)
    written = example["input_ids"][example["labels"] != -100]
    text = tokenizer.decode(written)
    call, answer = chat.messages[1], chat.messages[3]
    assert text.startswith("<|content_thinking|>" + call["reasoning_content"])
    assert '{"name":"%s","args":' % call["tool_calls"][0]["function"]["name"] in text
    assert text.endswith(answer["content"] + "<|end_message|><|content_model_end_sampling|>")
    assert chat.messages[0]["content"] not in text  # the question
    assert "<|message_user|>" not in text and "<|message_tool|>" not in text and "tool_declare" not in text
    assert text.count("<|content_model_end_sampling|>") == 2  # both model turns, not the tool result between them
    message_model, end = tokenizer.convert_tokens_to_ids(["<|message_model|>", "<|content_model_end_sampling|>"])
    assert model_token_mask([1, message_model, 2, message_model, 3, end, 4], message_model, end) == [
        False, False, True, True, True, True, False]  # fmt: skip


def test_examples_are_pure_functions_of_their_index_and_batch_with_their_images(processor):
    dataset = ConversationDataset(processor, "train-0", 12)
    first, again = dataset[7], dataset[7]
    assert all(torch.equal(first[name], again[name]) for name in first)
    rows = [dataset[i] for i in range(12)]
    batch = collate(rows, processor.tokenizer.pad_token_id)
    with_images = [row for row in rows if "pixel_values" in row]
    assert with_images and batch["input_ids"].shape == (12, max(len(r["input_ids"]) for r in rows))
    assert len(batch["image_grid_thw"]) == len(with_images)
    placeholders = (batch["input_ids"] == processor.image_token_id).sum()
    assert placeholders == batch["image_grid_thw"].prod(-1).sum() == len(batch["pixel_values"])


def test_training_batches_hold_one_kind_each_in_the_mix_and_resume_where_they_stopped(processor):
    full = list(OneKindBatches("train-0", 4, 600))
    assert list(OneKindBatches("train-0", 4, 600, first_step=450)) == full[450:]
    assert [row[-1] for batch in full for row in batch] == list(range(2400))  # every example index once, in order
    kinds = [{row[:2] for row in batch} for batch in full]
    assert all(len(kind) == 1 for kind in kinds)
    for kind, weight in KINDS.items():
        assert abs(sum(k.pop()[0] == kind for k in map(set, kinds)) / 600 - weight) < 0.06
    assert abs(sum(k.pop()[1] for k in map(set, kinds)) / 600 - TOOLS_DECLARED) < 0.06
    dataset = ConversationDataset(processor, "train-0", 2400)
    for kind, declares_tools in (("scene", False), ("scene", True), ("tool", True), ("prose", False)):
        batch = next(b for b in full if b[0][:2] == (kind, declares_tools))
        rows = [dataset[item] for item in batch]
        assert all(("pixel_values" in row) == (kind == "scene") for row in rows)
        assert all(("tool_declare" in processor.tokenizer.decode(row["input_ids"])) == declares_tools for row in rows)
