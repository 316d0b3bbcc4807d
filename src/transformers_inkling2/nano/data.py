"""Inkling-2-Nano's training conversations, drawn from a seed: picture scenes (`scenes.py`), tool use (`tools.py`)
and CPython's English documentation (the reference manual's topics in `pydoc_data`, and the docstrings of the
built-ins and of a few standard modules), all in the official chat format with thinking blocks.

Every example is a pure function of (stream, index): `random.Random(f"{stream}-{index}")`. Training draws from the
stream `train-{seed}`; the tests draw held-out examples from `held-out`, which training never uses, and hold out
every tenth documentation topic and docstring (`is_held_out`) from the prose it trains on.
"""

from __future__ import annotations

import functools
import inspect
import random
from dataclasses import dataclass

import torch

from .scenes import ask, draw_scene
from .tools import TOOLS, run_tool, tool_answer, tool_question, tool_thinking

HELD_OUT_STREAM = "held-out"
MAX_LENGTH = 512  # tokens per training conversation (longer prose is cut, its end dropped from the loss)
KINDS = {"scene": 0.6, "tool": 0.2, "prose": 0.2}  # the training mix, by batch (`OneKindBatches`)
TOOLS_DECLARED = 0.3  # how often a picture or documentation chat declares the tools anyway (and needs none)
EFFORTS = {0.0: 0.25, "default": 0.45, "low": 0.1, "medium": 0.1, "high": 0.1}  # "default": no effort argument
DOCUMENTED_MODULES = ("json", "os.path", "re", "collections", "itertools", "functools", "math", "string", "random",
                      "textwrap", "shutil", "pathlib", "statistics", "datetime", "heapq", "bisect")  # fmt: skip


def example_rng(stream: str, index: int) -> random.Random:
    return random.Random(f"{stream}-{index}")


def is_held_out(position: int) -> bool:
    """Every tenth documentation topic or docstring (by position in its sorted list) is never trained on."""
    return position % 10 == 7


@functools.lru_cache(maxsize=1)
def documentation() -> tuple[list[tuple[str, str]], list[tuple[str, str]]]:
    """(topics, docstrings): [(title, text)] of CPython's reference-manual topics and [(name, text)] of the
    docstrings of the built-ins and `DOCUMENTED_MODULES`, each sorted, so positions are stable."""
    from pydoc_data.topics import topics as pydoc_topics

    topics = []
    for name in sorted(pydoc_topics):
        lines = pydoc_topics[name].strip().split("\n")
        title = lines[0].strip()
        body = "\n".join(line for line in lines[1:] if not set(line.strip()) <= {"*", "="})  # drop underlines
        topics.append((title, body.strip()))
    import builtins
    import importlib

    docstrings = []
    for module_name in ("builtins", *DOCUMENTED_MODULES):
        module = builtins if module_name == "builtins" else importlib.import_module(module_name)
        for name in sorted(dir(module)):
            value = getattr(module, name)
            doc = inspect.getdoc(value) if not name.startswith("_") and callable(value) else None
            if doc and len(doc) > 80:
                label = name if module_name == "builtins" else f"{module_name}.{name}"
                docstrings.append((label, doc))
    return topics, sorted(set(docstrings))


def paragraphs(text: str) -> list[str]:
    return [p.strip() for p in text.split("\n\n") if p.strip()]


def passage(parts: list[str], start: int, max_chars: int) -> tuple[str, int]:
    """Paragraphs from `start` until `max_chars` (at least one); returns (text, the index after the last)."""
    taken, size, end = [], 0, start
    while end < len(parts) and (not taken or size + len(parts[end]) <= max_chars):
        taken.append(parts[end])
        size += len(parts[end])
        end += 1
    return "\n\n".join(taken), end


def prose_turns(rng: random.Random, held_out: bool = False) -> tuple[str, str, str]:
    """(question, thinking, answer) from the documentation: what a topic says, what comes next in it, or what a
    documented function does; from the held-out topics and docstrings when `held_out`."""
    topics, docstrings = documentation()
    topics = [t for i, t in enumerate(topics) if is_held_out(i) == held_out]
    docstrings = [d for i, d in enumerate(docstrings) if is_held_out(i) == held_out]
    kind = rng.choice(["topic", "topic", "continue", "docstring"])
    if kind == "docstring":
        name, doc = rng.choice(docstrings)
        question = rng.choice([f"What does `{name}` do?", f"Explain `{name}`.", f"What is `{name}` for?"])
        return question, f"The user asks about `{name}`. I will explain it from its documentation.", doc[:700]
    title, body = rng.choice(topics)
    parts = paragraphs(body)
    if kind == "topic" or len(parts) < 2:
        start = 0 if rng.random() < 0.5 else rng.randrange(len(parts))
        text, _ = passage(parts, start, 700)
        question = rng.choice([f"Tell me about {title}.", f"Explain {title}.", f"What does the manual say about {title}?"])
        return question, f"The user asks about {title}. I will explain it from the Python reference.", text
    start = rng.randrange(len(parts) - 1)
    shown, end = passage(parts, start, 400)
    following, _ = passage(parts, end, 500) if end < len(parts) else ("That is the end of this section.", end)
    return f"Continue this text:\n\n{shown}", "I will continue the text in the same style.", following


def pick(rng: random.Random, weights: dict):
    return rng.choices(list(weights), weights=list(weights.values()))[0]


def assistant(thinking: str | None, **fields) -> dict:
    message = {"role": "assistant", **fields}
    if thinking is not None:
        message["reasoning_content"] = thinking
    return message


@dataclass
class Conversation:
    """One chat: its messages, the tools it declares, its thinking effort (None: the template's default) and its
    image (a scene), ready for the chat template."""

    messages: list[dict]
    tools: list[dict] | None
    effort: object
    image: object = None

    def template_kwargs(self) -> dict:
        kwargs = {"tools": self.tools}
        if self.effort is not None:
            kwargs["effort"] = self.effort
        return kwargs


def picture_turn(question: str) -> dict:
    """The user turn that asks `question` about the conversation's picture (the image placeholder first)."""
    return {"role": "user", "content": [{"type": "image"}, {"type": "text", "text": question}]}


def conversation(rng: random.Random, kind: str | None = None, declares_tools: bool | None = None,
                 held_out: bool = False) -> Conversation:  # fmt: skip
    """A training conversation of `kind` ("scene", "tool" or "prose"; drawn from the mix when None), whose chat
    declares the tools when `declares_tools` (always for "tool"; drawn with TOOLS_DECLARED when None)."""
    kind = kind or pick(rng, KINDS)
    effort = pick(rng, EFFORTS)
    effort = None if effort == "default" else effort
    thinks = effort != 0.0
    if declares_tools is None:
        declares_tools = rng.random() < TOOLS_DECLARED
    tools = TOOLS if kind == "tool" or declares_tools else None
    if kind == "scene":
        image, scene = draw_scene(rng)
        _, question, answer = ask(scene, rng)
        reply = assistant(scene.inventory() if thinks else None, content=answer)
        return Conversation([picture_turn(question), reply], tools, effort, image)
    if kind == "tool":
        question, tool, arguments = tool_question(rng)
        result = run_tool(tool, arguments)
        call = {"id": "call_0", "type": "function", "function": {"name": tool, "arguments": arguments}}
        messages = [
            {"role": "user", "content": question},
            assistant(tool_thinking(tool, arguments) if thinks else None, tool_calls=[call]),
            {"role": "tool", "tool_call_id": "call_0", "name": tool, "content": result},
            assistant(f"The tool returned {result}." if thinks else None, content=tool_answer(tool, arguments, result)),
        ]
        return Conversation(messages, tools, effort)
    question, thinking, answer = prose_turns(rng, held_out)
    messages = [{"role": "user", "content": question}, assistant(thinking if thinks else None, content=answer)]
    return Conversation(messages, tools, effort)


def model_token_mask(input_ids: list[int], message_model: int, end_sampling: int) -> list[bool]:
    """Which tokens the model writes: in each model turn, everything after the turn's opening `<|message_model|>`
    (the generation prompt) up to and including its `<|content_model_end_sampling|>`."""
    mask, inside = [], False
    for token in input_ids:
        mask.append(inside)
        if not inside and token == message_model:
            inside = True
        elif inside and token == end_sampling:
            inside = False
    return mask


def encode(processor, chat: Conversation, max_length: int = MAX_LENGTH) -> dict:
    """Token ids (image placeholders expanded), labels (-100 outside what the model writes) and the image inputs of
    one conversation, cut to `max_length` tokens (never inside an image)."""
    tokenizer = processor.tokenizer
    text = tokenizer.apply_chat_template(chat.messages, tokenize=False, **chat.template_kwargs())
    images = [chat.image] if chat.image is not None else None
    inputs = processor(text=text, images=images, return_tensors="pt")
    ids = inputs["input_ids"][0][:max_length]
    mask = model_token_mask(
        ids.tolist(),
        tokenizer.convert_tokens_to_ids("<|message_model|>"),
        tokenizer.convert_tokens_to_ids("<|content_model_end_sampling|>"),
    )
    labels = torch.where(torch.tensor(mask), ids, -100)
    example = {"input_ids": ids, "labels": labels}
    if images:
        example["pixel_values"] = inputs["pixel_values"]
        example["image_grid_thw"] = inputs["image_grid_thw"]
    return example


class ConversationDataset(torch.utils.data.Dataset):
    """`length` examples of `stream`, each a pure function of its index (so any number of DataLoader workers gives the
    same batches): item `index` is a conversation of a kind drawn from `kinds` (or from the whole mix when None),
    item `(kind, declares_tools, index)` one of that kind, declaring the tools or not."""

    def __init__(self, processor, stream: str, length: int, kinds: dict | None = None):
        self.processor, self.stream, self.length = processor, stream, length
        self.kinds = kinds

    def __len__(self) -> int:
        return self.length

    def __getitem__(self, item: int | tuple[str, bool, int]) -> dict:
        kind, declares_tools, index = item if isinstance(item, tuple) else (None, None, item)
        rng = example_rng(self.stream, index)
        if kind is None and self.kinds:
            kind = pick(rng, self.kinds)
        return encode(self.processor, conversation(rng, kind, declares_tools))


class OneKindBatches(torch.utils.data.Sampler):
    """The batches of steps `first_step` to `steps`: step s's kind (and whether its chats declare the tools) is drawn
    from `kinds` (and TOOLS_DECLARED) by its own seed, its rows are examples `s * batch_size` to `(s + 1) *
    batch_size`, so any step's batch is known without the steps before it (a resumed run draws what an uninterrupted
    one would). One kind per batch because a batch is padded to its longest row: mixed, every picture question (about
    100 tokens) would be padded to the documentation or the tool declarations beside it (over 300)."""

    def __init__(self, stream: str, batch_size: int, steps: int, first_step: int = 0, kinds: dict = KINDS):
        self.stream, self.batch_size, self.kinds = stream, batch_size, kinds
        self.steps, self.first_step = steps, first_step

    def kind(self, step: int) -> tuple[str, bool]:
        """(kind, whether the chats declare the tools) of step `step`'s batch."""
        rng = example_rng(f"{self.stream}-batch", step)
        return pick(rng, self.kinds), rng.random() < TOOLS_DECLARED

    def __len__(self) -> int:
        return self.steps - self.first_step

    def __iter__(self):
        for step in range(self.first_step, self.steps):
            kind, declares_tools = self.kind(step)
            yield [(kind, declares_tools, step * self.batch_size + row) for row in range(self.batch_size)]


def collate(examples: list[dict], pad_token_id: int) -> dict:
    """Right-padded rows (a causal model never reads the padding after a row's tokens, so no attention mask is
    needed) and the images of the rows that have one, in row order."""
    length = max(len(e["input_ids"]) for e in examples)
    input_ids = torch.full((len(examples), length), pad_token_id, dtype=torch.long)
    labels = torch.full((len(examples), length), -100, dtype=torch.long)
    for row, example in enumerate(examples):
        input_ids[row, : len(example["input_ids"])] = example["input_ids"]
        labels[row, : len(example["labels"])] = example["labels"]
    batch = {"input_ids": input_ids, "labels": labels}
    with_images = [e for e in examples if "pixel_values" in e]
    if with_images:
        batch["pixel_values"] = torch.cat([e["pixel_values"] for e in with_images])
        batch["image_grid_thw"] = torch.cat([e["image_grid_thw"] for e in with_images])
    return batch
