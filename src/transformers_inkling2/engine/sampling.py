"""Choosing each row's next token from its logits with the row's own parameters.

A row's scores go through its logits processors, then temperature, top-k and top-p (transformers' warpers, in
`generate()`'s order), then an argmax (greedy) or a draw from the softmax with `torch.multinomial` and the row's
generator: a seeded request samples what `torch.manual_seed(seed)` and `generate(do_sample=True)` would, whatever
else runs in the batch. Greedy rows without processors, the common case, share one argmax.
"""

from __future__ import annotations

import torch
from transformers import LogitsProcessorList, TemperatureLogitsWarper, TopKLogitsWarper, TopPLogitsWarper

from .requests import Sequence


def needs_processing(sequence: Sequence) -> bool:
    """Whether the row's scores go through processors (sampling warpers or the request's own) before a choice."""
    return sequence.params.sampled or bool(sequence.params.logits_processors)


def row_processors(sequence: Sequence) -> LogitsProcessorList:
    """The row's processors and warpers, in the order generate() applies them (made once per request)."""
    if sequence.processors is None:
        params = sequence.params
        sequence.processors = LogitsProcessorList(params.logits_processors)
        if params.sampled:
            if params.temperature != 1.0:
                sequence.processors.append(TemperatureLogitsWarper(params.temperature))
            if params.top_k:
                sequence.processors.append(TopKLogitsWarper(params.top_k))
            if params.top_p is not None and params.top_p < 1.0:
                sequence.processors.append(TopPLogitsWarper(params.top_p))
    return sequence.processors


def row_generator(sequence: Sequence, device: torch.device) -> torch.Generator | None:
    """The request's own random stream, made once (None: the global one)."""
    if sequence.generator is None and sequence.params.seed is not None:
        sequence.generator = torch.Generator(device).manual_seed(sequence.params.seed)
    return sequence.generator


def to_device(values: list, device: torch.device) -> torch.Tensor:
    """A tensor of Python values on `device` without waiting for the device: a CUDA copy from pinned memory is
    asynchronous (from pageable memory it would wait for every queued kernel, and hand the GIL around)."""
    tensor = torch.tensor(values)
    if device.type != "cuda":
        return tensor
    return tensor.pin_memory().to(device, non_blocking=True)


def token_history(sequence: Sequence, device: torch.device) -> torch.Tensor:
    """[1, tokens] the sequence's tokens on the device, kept between steps and grown by the new ones only."""
    known = 0 if sequence.history is None else sequence.history.shape[1]
    if known < len(sequence.tokens):
        new = to_device(sequence.tokens[known:], device)[None]
        sequence.history = new if sequence.history is None else torch.cat([sequence.history, new], dim=1)
    return sequence.history


def processed_scores(sequence: Sequence, logits: torch.Tensor, following: torch.Tensor | None = None) -> torch.Tensor:
    """[positions, vocab] fp32 scores after the row's processors. Position j's processors see the sequence's tokens
    and the first j tokens of `following` (a DSpark block's drafts, on the device). Temperature, top-k and top-p read
    no tokens: without processors of its own a row hands them a placeholder of the right length."""
    processors = row_processors(sequence)
    logits = logits.float()
    if not processors:
        return logits
    length = len(sequence.tokens) + (0 if following is None else following.shape[0])
    if sequence.params.logits_processors:
        ids = token_history(sequence, logits.device)
        ids = ids if following is None else torch.cat([ids, following[None]], dim=1)
    else:
        ids = torch.zeros((), dtype=torch.long, device=logits.device).expand(1, length)
    first = length - logits.shape[0] + 1
    return torch.cat([processors(ids[:, : first + j], logits[j : j + 1]) for j in range(logits.shape[0])])


def draw(sequence: Sequence, scores: torch.Tensor) -> torch.Tensor:
    """One token per row of processed `scores` [n, vocab]: the argmax, or a draw with the row's generator."""
    if not sequence.params.sampled:
        return scores.argmax(-1)
    probabilities = torch.softmax(scores, dim=-1)
    return torch.multinomial(probabilities, 1, generator=row_generator(sequence, scores.device)).squeeze(-1)


def next_tokens(sequences: list[Sequence], logits: torch.Tensor) -> list[int]:
    """The next token of every sequence from its last logits `logits` [len(sequences), vocab]; one transfer. Rows
    are chosen together where they can be: greedy rows in one argmax, sampled rows with the same temperature, top-k
    and top-p in one pass of the warpers (which work row by row); rows with processors of their own one by one."""
    chosen = torch.empty(len(sequences), dtype=torch.long, device=logits.device)
    groups: dict[tuple, list[int]] = {}
    for i, sequence in enumerate(sequences):
        params = sequence.params
        key = "own" if params.logits_processors else (params.temperature, params.top_k, params.top_p)
        groups.setdefault(key if params.sampled or params.logits_processors else "greedy", []).append(i)
    for key, rows in groups.items():
        if key == "own":
            for i in rows:
                sequence = sequences[i]
                chosen[i] = draw(sequence, processed_scores(sequence, logits[i : i + 1]))[0]
                if sequence.history is not None:  # grown on the device: the next step copies nothing
                    sequence.history = torch.cat([sequence.history, chosen[None, i : i + 1]], dim=1)
            continue
        index = to_device(rows, logits.device)
        scores = logits.index_select(0, index).float()
        if key == "greedy":
            chosen[index] = scores.argmax(-1)
            continue
        no_tokens = torch.zeros((), dtype=torch.long, device=logits.device).expand(len(rows), 1)
        probabilities = torch.softmax(row_processors(sequences[rows[0]])(no_tokens, scores), dim=-1)
        unseeded = [j for j, i in enumerate(rows) if sequences[i].params.seed is None]
        if unseeded:
            picked = to_device(unseeded, logits.device)
            chosen[index[picked]] = torch.multinomial(probabilities[picked], 1).squeeze(-1)
        for j, i in enumerate(rows):  # a seeded row draws from its own generator, as generate() would alone
            if sequences[i].params.seed is not None:
                generator = row_generator(sequences[i], logits.device)
                chosen[i] = torch.multinomial(probabilities[j : j + 1], 1, generator=generator)[0, 0]
    return chosen.tolist()
