"""The model's side of the server: one worker thread that runs generations one at a time from a bounded queue, and
hands each job's text and token counts to the event loop as they are decoded.

Why a thread and not the event loop: `generate()` blocks for the whole reply. Why one: one model on one device runs
one `generate()` at a time (continuous batching is the batching issue's engine). A job is cancelled by setting its
event: a queued job is dropped, a running one stops at the next decode step (a stopping criterion reads the event).

`Backend` is what runs a job: `model_backend(model, tokenizer)` wraps `model.generate`; tests pass a function that
emits scripted text.
"""

from __future__ import annotations

import asyncio
import queue
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field

import torch
from transformers import LogitsProcessorList, StoppingCriteria, StoppingCriteriaList

from ..processing.response_parsing import IncrementalTextStreamer
from .metrics import ServingMetrics


@dataclass
class SamplingParams:
    max_new_tokens: int
    temperature: float  # 0 means greedy
    top_p: float | None = None
    top_k: int | None = None
    seed: int | None = None


@dataclass
class GenerationJob:
    """One request's generation. The worker thread calls `emit`; the event loop reads `events` (an asyncio queue of
    `(text, token_count)` pairs, then `None` at the end, or the exception that ended it)."""

    inputs: dict
    params: SamplingParams
    logits_processors: list = field(default_factory=list)
    cancelled: threading.Event = field(default_factory=threading.Event)
    received_at: float = field(default_factory=time.monotonic)
    loop: asyncio.AbstractEventLoop | None = None
    events: asyncio.Queue | None = None
    generated_tokens: int = 0
    dspark: dict | None = None  # DSpark's statistics of this job, when it drafted

    def bind(self, loop: asyncio.AbstractEventLoop) -> GenerationJob:
        self.loop, self.events = loop, asyncio.Queue()
        return self

    def _deliver(self, item) -> None:
        try:
            self.loop.call_soon_threadsafe(self.events.put_nowait, item)
        except RuntimeError:  # the loop is gone (server shut down): nobody is reading
            self.cancelled.set()

    def emit(self, text: str, tokens: int) -> None:
        self.generated_tokens += tokens
        self._deliver((text, tokens))

    def finish(self, error: BaseException | None = None) -> None:
        self._deliver(error)

    def cancel(self) -> None:
        self.cancelled.set()


Backend = Callable[[GenerationJob], None]


class Overloaded(RuntimeError):
    """The waiting queue is full: answered with 503 and Retry-After."""


class GenerationWorker:
    """A daemon-free worker thread over a bounded queue; `close()` cancels what waits and joins the thread."""

    def __init__(self, backend: Backend, max_waiting: int, metrics: ServingMetrics):
        self.backend, self.max_waiting, self.metrics = backend, max_waiting, metrics
        self._jobs: queue.Queue = queue.Queue()
        self._waiting = 0
        self._lock = threading.Lock()
        self._closed = False
        self._thread = threading.Thread(target=self._run, name="inkling2-worker")
        self._thread.start()

    def submit(self, job: GenerationJob) -> GenerationJob:
        with self._lock:
            if self._closed:
                raise Overloaded("the server is shutting down")
            if self._waiting >= self.max_waiting:
                raise Overloaded(f"{self._waiting} requests are waiting already (--max-waiting {self.max_waiting})")
            self._waiting += 1
            self.metrics.waiting.set(self._waiting)
        self._jobs.put(job)
        return job

    def _run(self) -> None:
        while (job := self._jobs.get()) is not None:
            with self._lock:
                self._waiting -= 1
                self.metrics.waiting.set(self._waiting)
            if job.cancelled.is_set():
                job.finish()
                continue
            self.metrics.running.inc()
            failure = None
            try:
                self.backend(job)
            except BaseException as error:  # handed to the request, which reports it
                failure = error
            self.metrics.running.dec()  # before the request hears of the end: a reply never races its gauge
            job.finish(failure)

    def close(self) -> None:
        with self._lock:
            self._closed = True
        pending = []
        while True:
            try:
                pending.append(self._jobs.get_nowait())
            except queue.Empty:
                break
        for job in pending:
            job.cancel()
            job.finish()
        self._jobs.put(None)
        self._thread.join()


# ---------------------------------------------------------------------------------------------------------------
# Generation with a transformers model


class _Cancelled(StoppingCriteria):
    """Stops `generate` at the next step once the job is cancelled."""

    def __init__(self, event: threading.Event):
        self.event = event

    def __call__(self, input_ids, scores, **kwargs):
        return torch.full((input_ids.shape[0],), self.event.is_set(), dtype=torch.bool, device=input_ids.device)


class _JobStreamer(IncrementalTextStreamer):
    """Text for the parser (only real special tokens spelled as markers) with the number of tokens it came from."""

    def __init__(self, tokenizer, job: GenerationJob):
        super().__init__(tokenizer, skip_prompt=True, for_parsing=True)
        self.job, self.pending_tokens = job, 0

    def put(self, value) -> None:
        if not (self.skip_prompt and self.next_tokens_are_prompt):
            self.pending_tokens += value.numel()
        super().put(value)

    def on_finalized_text(self, text: str, stream_end: bool = False) -> None:
        if text or self.pending_tokens:
            self.job.emit(text, self.pending_tokens)
            self.pending_tokens = 0


def model_backend(model, tokenizer) -> Backend:
    """A `Backend` over `model.generate` (its fast defaults; DSpark when the generation config turns it on)."""

    def run(job: GenerationJob) -> None:
        params = job.params
        sampling = params.temperature > 0
        dspark = bool(getattr(model.generation_config, "dspark", False))
        inputs = {name: value.to(model.device) if torch.is_tensor(value) else value
                  for name, value in job.inputs.items()}  # fmt: skip
        with torch.inference_mode():
            if params.seed is not None:
                torch.manual_seed(params.seed)
            output = model.generate(
                **inputs,
                max_new_tokens=params.max_new_tokens,
                do_sample=sampling,
                temperature=params.temperature if sampling else None,
                top_p=params.top_p if sampling else None,
                top_k=params.top_k if sampling and params.top_k and params.top_k > 0 else None,
                eos_token_id=tokenizer.eos_token_id,
                pad_token_id=tokenizer.pad_token_id,
                streamer=_JobStreamer(tokenizer, job),
                stopping_criteria=StoppingCriteriaList([_Cancelled(job.cancelled)]),
                logits_processor=LogitsProcessorList(job.logits_processors),
                return_dict_in_generate=dspark,
            )
        if dspark and getattr(output, "num_steps", None):
            block = model.dspark.config.block_size
            committed = round(output.mean_accepted_length * output.num_steps)
            job.dspark = {"steps": output.num_steps, "drafts": output.num_steps * block,
                          "accepted": committed - output.num_steps}  # fmt: skip

    return run


__all__ = ["Backend", "GenerationJob", "GenerationWorker", "Overloaded", "SamplingParams", "model_backend"]
