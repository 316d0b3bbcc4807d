"""Which sequences run in the next engine step, and where their tokens live.

Every step decodes each row that has finished its prompt (one token, or a DSpark block), and spends what is left of
the step's token budget on prompt chunks of the rows still prefilling, oldest first (chunked prefill: a long prompt
never stalls the rows that decode). Neighbouring rows at the same position (requests admitted together) prefill
side by side in one forward, which reads every routed expert's weights once for all of them (`side_by_side` picks
how many, and how far). Rows (the cache's slots) stay contiguous from 0: a sequence that ends hands its
slot to the last row, so a decode step covers rows `0 .. running - 1`.

Memory follows the tokens: a sequence gets the pages of its prompt when admitted, and one more page whenever its
next step crosses into it. Admission waits (first come, first served) until a slot and the prompt's pages are free,
keeping a reserve of one page per running row for their growth. When a decoding row needs a page and none is free,
the most recently admitted sequence is preempted: its pages and slot are freed and it waits at the head of the
queue, to be run again from its tokens (its output so far is kept; recomputing it gives the same state). A request
that could not fit even alone is refused when it arrives.
"""

from __future__ import annotations

import math
from collections import deque
from dataclasses import dataclass, field

from ..cache.paged import TRASH_PAGE, Inkling2PagedCache, pages_for
from .requests import Sequence

# the share of the step budget that prompt chunks keep even when decode rows would take it all (time to first token)
MIN_PREFILL_SHARE = 8


class RequestTooLong(ValueError):
    """The request cannot fit in the cache even alone (answered at once, not queued)."""


class PageAllocator:
    """A free list of the pool's pages (page 0, the trash page, is never handed out)."""

    def __init__(self, num_pages: int):
        self.free = list(range(num_pages - 1, TRASH_PAGE, -1))

    @property
    def free_count(self) -> int:
        return len(self.free)

    def take(self, count: int) -> list[int] | None:
        if count > len(self.free):
            return None
        taken = self.free[len(self.free) - count :]
        del self.free[len(self.free) - count :]
        return taken

    def give_back(self, pages: list[int]) -> None:
        self.free.extend(pages)


@dataclass
class StepPlan:
    decode: list[Sequence] = field(default_factory=list)
    # (rows, first, end): neighbouring rows and the token range they all prefill in one forward
    prefill: list[tuple[list[Sequence], int, int]] = field(default_factory=list)
    admitted: list[Sequence] = field(default_factory=list)

    @property
    def empty(self) -> bool:
        return not self.decode and not self.prefill


def side_by_side(group: list[Sequence], budget: int) -> tuple[int, int]:
    """(rows, tokens per row) of the next chunk of `group` (neighbouring rows at one position), within `budget`: the
    one that finishes the most prompts (their first tokens come out of it), then the most tokens, then the most rows
    (fewer forwards)."""
    choices, shortest = [], math.inf
    for count, sequence in enumerate(group, start=1):
        shortest = min(shortest, sequence.to_prefill)
        length = min(shortest, budget // count)
        if length < 1:
            break
        finished = sum(s.to_prefill == length for s in group[:count])
        choices.append(((finished, count * length, count), (count, length)))
    return max(choices)[1]


class Scheduler:
    """See the module docstring. `step_tokens` is what one decode step feeds a row (1, or DSpark's block + 1)."""

    def __init__(self, cache: Inkling2PagedCache, max_step_tokens: int, step_tokens: int = 1):
        self.cache, self.max_step_tokens, self.step_tokens = cache, max_step_tokens, step_tokens
        self.page_size = cache.page_size
        self.pages = PageAllocator(cache.num_pages)
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []  # index = slot
        self._admissions = 0

    @property
    def max_sequence_tokens(self) -> int:
        """Tokens one sequence may reach (its last step's look-ahead included)."""
        return min(self.cache.max_row_tokens, (self.cache.num_pages - 1) * self.page_size) - self.step_tokens

    def add(self, sequence: Sequence) -> None:
        needed = len(sequence.prompt_ids) + sequence.params.max_new_tokens
        if needed > self.max_sequence_tokens:
            raise RequestTooLong(
                f"The prompt ({len(sequence.prompt_ids)} tokens) plus `max_new_tokens` "
                f"({sequence.params.max_new_tokens}) exceed what one sequence can hold here "
                f"({self.max_sequence_tokens} tokens: `max_model_len` and the cache's pages). Shorten the prompt or "
                "ask for fewer tokens."
            )
        self.waiting.append(sequence)

    def remove(self, sequence: Sequence) -> None:
        """Drops a sequence wherever it is (finished, cancelled), freeing its slot and pages."""
        if sequence.slot is None:
            if sequence in self.waiting:
                self.waiting.remove(sequence)
            return
        self._release(sequence)

    # --- one step -------------------------------------------------------------------------------------------------

    def schedule(self) -> StepPlan:
        plan = StepPlan(admitted=self._admit())
        plan.decode = [s for s in self.running if s.decoding]
        for sequence in list(plan.decode):  # pages for this step's tokens, preempting the newest when short
            if sequence.slot is None:  # preempted below for an older row
                continue
            while not self._grow(sequence, sequence.computed + self.step_tokens):
                victim = max(self.running, key=lambda s: s.admitted_order)
                self._preempt(victim)
                if victim is sequence:
                    break
        plan.decode = [s for s in plan.decode if s.slot is not None]
        decode_tokens = len(plan.decode) * self.step_tokens
        budget = max(self.max_step_tokens - decode_tokens, self.max_step_tokens // MIN_PREFILL_SHARE, 1)
        pending = [s for s in self.running if s.to_prefill]
        while pending and budget > 0:
            group = [pending[0]]
            for sequence in pending[1:]:
                if sequence.slot != group[-1].slot + 1 or sequence.computed != group[0].computed:
                    break
                group.append(sequence)
            count, length = side_by_side(group, budget)
            first = group[0].computed
            plan.prefill.append((group[:count], first, first + length))
            budget -= count * length
            del pending[:count]
        return plan

    def _admit(self) -> list[Sequence]:
        admitted = []
        while self.waiting and len(self.running) < self.cache.max_rows:
            sequence = self.waiting[0]
            needed = pages_for(len(sequence.tokens) + self.step_tokens, self.page_size)
            if self.pages.free_count - needed < len(self.running):  # a page of growth for every running row
                break
            self.waiting.popleft()
            sequence.slot, sequence.computed = len(self.running), 0
            sequence.admitted_order, self._admissions = self._admissions, self._admissions + 1
            self.running.append(sequence)
            self.cache.reset_row(sequence.slot)
            self._grow(sequence, len(sequence.tokens) + self.step_tokens)
            admitted.append(sequence)
        return admitted

    def _grow(self, sequence: Sequence, tokens: int) -> bool:
        """Pages for the first `tokens` positions of the sequence; False when the pool is short."""
        missing = pages_for(tokens, self.page_size) - len(sequence.pages)
        if missing <= 0:
            return True
        pages = self.pages.take(missing)
        if pages is None:
            return False
        self.cache.assign_pages(sequence.slot, len(sequence.pages), pages)
        sequence.pages += pages
        return True

    def _preempt(self, sequence: Sequence) -> None:
        self._release(sequence)
        sequence.computed = 0
        self.waiting.appendleft(sequence)

    def _release(self, sequence: Sequence) -> None:
        """Frees the sequence's pages and slot; the last row moves into the slot."""
        self.pages.give_back(sequence.pages)
        sequence.pages = []
        slot, last = sequence.slot, self.running[-1]
        if last is not sequence:
            self.cache.move_row(last.slot, slot)
            self.running[slot], last.slot = last, slot
        self.running.pop()
        # the vacated row may still pad a decode batch: its writes must not reach pages handed to others
        self.cache.reset_row(len(self.running))
        sequence.slot = None
