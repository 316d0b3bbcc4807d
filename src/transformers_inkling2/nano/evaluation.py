"""Held-out checks of Inkling-2-Nano: questions about freshly drawn scenes, tool questions answered over a call and
its result, and DSpark's accepted length on held-out text (documentation and tool questions). `inkling2 train-nano`
reports them and the tests assert them; every example comes from the `held-out` streams, which training never draws
from.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from ..processing.response_parsing import parse_response
from .data import HELD_OUT_STREAM, example_rng, picture_turn, prose_turns
from .scenes import SCORED_KINDS, answer_is_right, ask, draw_scene
from .tools import TOOLS, run_tool, tool_question

GENERATION_BATCH = 25


@dataclass
class Score:
    """How many of `total` held-out examples were right, and the wrong ones (for the report)."""

    right: int = 0
    total: int = 0
    failures: list = field(default_factory=list)

    @property
    def accuracy(self) -> float:
        return self.right / max(self.total, 1)

    def add(self, ok: bool, detail) -> None:
        self.right += ok
        self.total += 1
        if not ok:
            self.failures.append(detail)


def prompts(model, processor, chats: list[list[dict]], images=None, **template):
    """A batch of chats (and their images) rendered with the generation prompt, left-padded, on the model's device."""
    texts = [processor.tokenizer.apply_chat_template(chat, tokenize=False, add_generation_prompt=True, **template)
             for chat in chats]  # fmt: skip
    return processor(text=texts, images=images, padding=True, return_tensors="pt").to(model.device)


@torch.no_grad()
def reply(model, processor, chats: list[list[dict]], images=None, max_new_tokens: int = 64, **template) -> list[dict]:
    """Greedy replies (parsed assistant messages) to a batch of chats, left-padded into one `generate` call."""
    tokenizer = processor.tokenizer
    inputs = prompts(model, processor, chats, images, **template)
    out = model.generate(**inputs, max_new_tokens=max_new_tokens, do_sample=False, top_p=None, top_k=None)
    new = out[:, inputs["input_ids"].shape[1] :]
    return [parse_response(row[row != tokenizer.pad_token_id], tokenizer) for row in new]


def scene_question(index: int):
    """(image, scene, kind, question, answer) of held-out scene `index`; the kinds cycle through SCORED_KINDS (a
    scene that cannot answer its kind is redrawn)."""
    kind = SCORED_KINDS[index % len(SCORED_KINDS)]
    attempt = 0
    while True:
        rng = example_rng(f"{HELD_OUT_STREAM}-scene-{attempt}", index)
        image, scene = draw_scene(rng)
        try:
            _, question, answer = ask(scene, rng, kind)
            return image, scene, kind, question, answer
        except ValueError:
            attempt += 1


def scene_accuracy(model, processor, count: int = 50) -> Score:
    score = Score()
    for first in range(0, count, GENERATION_BATCH):
        items = [scene_question(i) for i in range(first, min(first + GENERATION_BATCH, count))]
        chats = [[picture_turn(question)] for _, _, _, question, _ in items]
        replies = reply(model, processor, chats, images=[[image] for image, *_ in items], max_new_tokens=80)
        for (_, scene, kind, question, answer), message in zip(items, replies):
            ok = answer_is_right(kind, answer, message["content"] or "")
            score.add(ok, {"scene": scene.description(), "question": question, "expected": answer,
                           "reply": message["content"]})  # fmt: skip
    return score


def tool_accuracy(model, processor, count: int = 50) -> Score:
    """A question counts when the model calls the right tool with a JSON object of arguments, and, given that
    call's real result, answers with the result."""
    score = Score()
    for first in range(0, count, GENERATION_BATCH):
        questions = [tool_question(example_rng(f"{HELD_OUT_STREAM}-tool", i))
                     for i in range(first, min(first + GENERATION_BATCH, count))]  # fmt: skip
        chats = [[{"role": "user", "content": question}] for question, _, _ in questions]
        calls = reply(model, processor, chats, max_new_tokens=96, tools=TOOLS)
        called = {}  # row -> (call, result) for the rows that called the right tool with an arguments object
        for row, ((_, tool, _), message) in enumerate(zip(questions, calls)):
            call = (message["tool_calls"] or [{}])[0].get("function", {})
            if call.get("name") == tool and isinstance(call.get("arguments"), dict):
                called[row] = call, run_tool(tool, call["arguments"])
            else:
                score.add(False, {"question": questions[row][0], "reply": message})
        follow_ups = [[*chats[row], {"role": "assistant", "tool_calls": [{"id": "call_0", "type": "function",
                                                                         "function": call}]},
                       {"role": "tool", "tool_call_id": "call_0", "name": call["name"], "content": result}]
                      for row, (call, result) in called.items()]  # fmt: skip
        answers = reply(model, processor, follow_ups, max_new_tokens=48, tools=TOOLS) if follow_ups else []
        for (row, (call, result)), answer in zip(called.items(), answers):
            ok = not result.startswith("error") and result in (answer["content"] or "")
            score.add(ok, {"question": questions[row][0], "call": call, "result": result, "answer": answer["content"]})
    return score


def held_out_text_chats(kind: str, count: int) -> tuple[list[list[dict]], dict]:
    """(chats, template arguments) of `count` held-out text questions: "prose" asks about held-out documentation,
    "tool" asks a tool question with the tools declared (the reply is a call)."""
    if kind == "prose":
        questions = [prose_turns(example_rng(f"{HELD_OUT_STREAM}-prose", i), held_out=True)[0] for i in range(count)]
        return [[{"role": "user", "content": question}] for question in questions], {}
    if kind == "tool":
        questions = [tool_question(example_rng(f"{HELD_OUT_STREAM}-tool", i))[0] for i in range(count)]
        return [[{"role": "user", "content": question}] for question in questions], {"tools": TOOLS}
    raise ValueError(f"Unknown held-out text kind {kind!r}: expected 'prose' or 'tool'.")


@torch.no_grad()
def dspark_accepted_length(model, processor, temperature: float, kind: str = "prose", count: int = 8,
                           max_new_tokens: int = 96) -> float:  # fmt: skip
    """DSpark's mean accepted length (tokens committed per step, the target's own included) over replies to `count`
    held-out text questions of `kind` (`held_out_text_chats`); greedy at temperature 0, else sampled (seed 0)."""
    chats, template = held_out_text_chats(kind, count)
    inputs = prompts(model, processor, chats, **template)
    torch.manual_seed(0)
    sampling = dict(do_sample=True, temperature=temperature) if temperature > 0 else dict(do_sample=False)
    out = model.generate(**inputs, max_new_tokens=max_new_tokens, dspark=True, return_dict_in_generate=True,
                         top_p=None, top_k=None, **sampling)  # fmt: skip
    return float(out.mean_accepted_length)
