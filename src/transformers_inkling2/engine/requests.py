"""What a caller hands the engine and what it gets back, and the engine's record of one sequence."""

from __future__ import annotations

import itertools
from dataclasses import dataclass, field

import torch

FINISH_STOP, FINISH_LENGTH, FINISH_CANCELLED = "stop", "length", "cancelled"


@dataclass
class SamplingParams:
    """One request's decoding: greedy when `temperature` is 0, else sampled after temperature, top-k and top-p (as
    `generate(do_sample=True)` does), from the request's own generator when `seed` is given. `logits_processors`
    (transformers' `LogitsProcessor` interface: `(input_ids [1, n], scores [1, vocab]) -> scores`, e.g. a grammar)
    run before those. Generation stops after `max_new_tokens`, or at a token of `stop_token_ids` (kept)."""

    max_new_tokens: int = 256
    temperature: float = 0.0
    top_p: float | None = None
    top_k: int | None = None
    seed: int | None = None
    stop_token_ids: tuple[int, ...] = ()
    logits_processors: list = field(default_factory=list)

    def __post_init__(self):
        if self.max_new_tokens < 1:
            raise ValueError(f"`max_new_tokens` must be at least 1, got {self.max_new_tokens}.")
        if self.temperature < 0:
            raise ValueError(f"`temperature` must be 0 (greedy) or positive, got {self.temperature}.")
        if self.top_p is not None and not 0 < self.top_p <= 1:
            raise ValueError(f"`top_p` must be in (0, 1], got {self.top_p}.")

    @property
    def sampled(self) -> bool:
        return self.temperature > 0


@dataclass
class RequestOutput:
    """What one engine step produced for a request: its new tokens (several with DSpark), and how it ended."""

    request_id: str
    new_token_ids: list[int]
    finished: bool = False
    finish_reason: str | None = None


_ids = itertools.count()


@dataclass
class Sequence:
    """The engine's record of one request. `tokens` are the prompt's and the generated ones; the first `computed` of
    them are in the cache. A row decodes once every token but the last is cached (`computed == len(tokens) - 1`);
    before that it is prefilling, in chunks."""

    prompt_ids: list[int]
    params: SamplingParams
    prompt_embeddings: torch.Tensor | None = None  # [prompt, hidden] when the prompt has images
    image_inputs: dict | None = None  # pixel values etc., turned into `prompt_embeddings` at admission
    request_id: str = field(default_factory=lambda: f"req-{next(_ids)}")
    tokens: list[int] = field(init=False)
    computed: int = 0
    slot: int | None = None
    pages: list[int] = field(default_factory=list)
    admitted_order: int = -1
    generator: torch.Generator | None = None
    history: torch.Tensor | None = None  # `tokens` on the device, for the request's logits processors
    processors: list | None = None  # its processors and warpers (`sampling.row_processors`)
    # DSpark's tallies for this request
    draft_steps: int = 0
    accepted_drafts: int = 0

    def __post_init__(self):
        self.tokens = list(self.prompt_ids)

    @property
    def generated(self) -> list[int]:
        return self.tokens[len(self.prompt_ids) :]

    @property
    def decoding(self) -> bool:
        return self.computed == len(self.tokens) - 1 and len(self.tokens) > len(self.prompt_ids)

    @property
    def to_prefill(self) -> int:
        """Tokens still to run before the row samples: every known token (after a preemption, the generated ones
        too: they are run again, and the last one's logits give the next token)."""
        return 0 if self.decoding else len(self.tokens) - self.computed
