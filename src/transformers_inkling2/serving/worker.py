"""The model's side of the server: one worker thread that drives a `Runner` (the continuous-batching engine) over a
bounded queue, and hands each job's text and token counts to the event loop as they are decoded.

Why a thread and not the event loop: a step of the model blocks. Why one: one engine on one device steps all its
requests together (`engine/engine.py`). The thread loops: it moves queued jobs into the runner while the runner has
room (waiting for one only when the runner is idle), tells the runner about jobs whose `cancelled` event is set, and
runs one step; a job ends when the runner says so. A job is cancelled by setting its event: a queued one never runs,
a running one stops at the next step and frees its place.

`Runner` is what the thread drives: `EngineRunner` over an `Inkling2Engine`; tests pass a fake that emits scripted
text, through the same loop.
"""

from __future__ import annotations

import asyncio
import dataclasses
import itertools
import queue
import sys
import threading
import time
from dataclasses import dataclass, field
from typing import Protocol

import torch

from ..engine import RequestTooLong, SamplingParams
from ..engine.requests import Sequence
from ..processing.image_processing_inkling2 import Inkling2ImageProcessor
from ..processing.response_parsing import IncrementalTextStreamer
from .metrics import ServingMetrics
from .protocol import RequestError

# what the engine embeds with the prompt when it admits a request: the image processor's outputs
IMAGE_INPUTS = tuple(Inkling2ImageProcessor.model_input_names)
_job_ids = itertools.count()

GIL_SWITCH_INTERVAL_S = 2e-4


@dataclass(eq=False)  # a job is itself: the worker keeps sets of them
class GenerationJob:
    """One request's generation. The worker thread calls `emit`; the event loop reads `events` (an asyncio queue of
    `(text, token_count)` pairs, then `None` at the end, or the exception that ended it)."""

    inputs: dict
    params: SamplingParams
    logits_processors: list = field(default_factory=list)
    cancelled: threading.Event = field(default_factory=threading.Event)
    received_at: float = field(default_factory=time.monotonic)
    request_id: str = field(default_factory=lambda: f"job-{next(_job_ids)}")
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


class Runner(Protocol):
    """What the worker thread drives, one step at a time (only that thread calls it). `capacity` jobs at once; the
    others wait in the worker's queue. The counts feed the gauges: `num_waiting` are jobs it took that do not run
    yet (the engine waits for cache pages), `free_pages` the cache's free pages."""

    capacity: int
    num_running: int
    num_waiting: int
    free_pages: int

    def add(self, job: GenerationJob) -> None:
        """Takes a job; raises `RequestError` for one that cannot run (answered as a 4xx)."""

    def cancel(self, job: GenerationJob) -> None:
        """Stops a job: a later `step` returns it as ended."""

    def step(self) -> list[GenerationJob]:
        """Runs one step, each job's new text going to `job.emit`; returns the jobs that ended."""


class Overloaded(RuntimeError):
    """The waiting queue is full: answered with 503 and Retry-After."""


class GenerationWorker:
    """A daemon-free worker thread driving `runner` over a bounded queue; `close()` ends what is queued or running
    and joins the thread."""

    def __init__(self, runner: Runner, max_waiting: int, metrics: ServingMetrics):
        self.runner, self.max_waiting, self.metrics = runner, max_waiting, metrics
        self._jobs: queue.Queue = queue.Queue()
        self._queued = 0  # submitted, not yet taken by the thread
        self._runner_waiting = 0  # the runner's count as of the thread's last look (`submit` reads it)
        self._in_flight: set[GenerationJob] = set()  # taken by the runner, not ended (the thread's own)
        self._lock = threading.Lock()
        self._closed = False
        self._publish()
        # The thread lets go of the GIL at every wait for the GPU and needs it back at once; at Python's default
        # switch interval (5 ms) a busy event loop (many streams) keeps it that long each time. Only ever lowered.
        sys.setswitchinterval(min(sys.getswitchinterval(), GIL_SWITCH_INTERVAL_S))
        self._thread = threading.Thread(target=self._run, name="inkling2-worker")
        self._thread.start()

    def submit(self, job: GenerationJob) -> GenerationJob:
        with self._lock:
            if self._closed:
                raise Overloaded("the server is shutting down")
            waiting = self._queued + self._runner_waiting
            if waiting >= self.max_waiting:
                raise Overloaded(f"{waiting} requests are waiting already (--max-waiting {self.max_waiting})")
            self._queued += 1
            self.metrics.waiting.set(waiting + 1)
        self._jobs.put(job)
        return job

    @property
    def _busy(self) -> bool:
        return bool(self.runner.num_running or self.runner.num_waiting)

    def _run(self) -> None:
        while not self._closed and self._take_jobs():
            for job in self._in_flight:
                if job.cancelled.is_set():
                    self.runner.cancel(job)
            if self._busy:
                self._step()
        self._end_all()

    def _take_jobs(self) -> bool:
        """Moves queued jobs into the runner while it has room, waiting for one only when it is idle. False once
        `close()` asked the thread to end."""
        while len(self._in_flight) < self.runner.capacity:
            try:
                job = self._jobs.get(block=not self._busy)
            except queue.Empty:
                break
            if job is None:
                return False
            with self._lock:
                self._queued -= 1
            if job.cancelled.is_set():  # its client left while it waited: it never runs
                self._end([job])
                continue
            try:
                self.runner.add(job)
            except Exception as error:  # a RequestError is the request's fault (a 4xx); anything else a 500
                self._end([job], error)
                continue
            self._in_flight.add(job)
            self._publish()
        return True

    def _step(self) -> None:
        try:
            ended = self.runner.step()
        except Exception as error:  # every job in flight fails with it (handed to its request); the thread goes on
            failed, self._in_flight = list(self._in_flight), set()
            for job in failed:
                self.runner.cancel(job)  # its place is freed at the next step
            self._end(failed, error)
            return
        ended = [job for job in ended if job in self._in_flight]  # not those failed above, answered already
        self._in_flight.difference_update(ended)
        self._end(ended)

    def _end(self, jobs: list[GenerationJob], error: BaseException | None = None) -> None:
        """Publishes the gauges, then tells each job's request that it ended: a reply never races its gauge."""
        self._publish()
        for job in jobs:
            job.finish(error)

    def _publish(self) -> None:
        with self._lock:
            self._runner_waiting = self.runner.num_waiting
            self.metrics.running.set(self.runner.num_running)
            self.metrics.waiting.set(self._queued + self._runner_waiting)
            self.metrics.free_pages.set(self.runner.free_pages)

    def _end_all(self) -> None:
        """The server is stopping: every job queued or in flight ends (their clients are gone)."""
        ended = list(self._in_flight)
        for job in ended:
            self.runner.cancel(job)
        self._in_flight.clear()
        while not self._jobs.empty():
            if (job := self._jobs.get_nowait()) is not None:
                ended.append(job)
        with self._lock:
            self._queued = 0
        for job in ended:
            job.cancel()
        self._end(ended)

    def close(self) -> None:
        with self._lock:
            self._closed = True
        self._jobs.put(None)  # wakes the thread when it waits for work
        self._thread.join()


# ---------------------------------------------------------------------------------------------------------------
# The engine


class _JobStreamer(IncrementalTextStreamer):
    """A job's generated tokens -> text for the parser (only real special tokens spelled as markers) with the
    number of tokens it came from."""

    def __init__(self, tokenizer, job: GenerationJob):
        super().__init__(tokenizer, skip_prompt=False, for_parsing=True)
        self.job, self.pending_tokens = job, 0

    def put(self, value) -> None:
        self.pending_tokens += value.numel()
        super().put(value)

    def on_finalized_text(self, text: str, stream_end: bool = False) -> None:
        if text or self.pending_tokens:
            self.job.emit(text, self.pending_tokens)
            self.pending_tokens = 0


@dataclass
class _EngineRequest:
    job: GenerationJob
    sequence: Sequence  # the engine's record: its DSpark tallies are read when it ends
    streamer: _JobStreamer


class EngineRunner:
    """The worker's `Runner` over an `Inkling2Engine`: a job becomes an engine request (its sampling, its grammar
    processors, the tokenizer's end-of-sequence token as the stop), and every step's tokens go through the job's
    incremental detokenizer to `job.emit`."""

    def __init__(self, engine, tokenizer):
        self.engine, self.tokenizer = engine, tokenizer
        self.capacity = engine.cache.max_rows
        eos = tokenizer.eos_token_id
        self.stop_token_ids = () if eos is None else (eos,)
        self._requests: dict[str, _EngineRequest] = {}

    @property
    def num_running(self) -> int:
        return self.engine.num_running

    @property
    def num_waiting(self) -> int:
        return self.engine.num_waiting

    @property
    def free_pages(self) -> int:
        return self.engine.scheduler.pages.free_count

    def add(self, job: GenerationJob) -> None:
        params = job.params
        images = {name: job.inputs[name] for name in IMAGE_INPUTS if name in job.inputs}
        try:
            params = dataclasses.replace(
                params,
                top_k=params.top_k if params.top_k and params.top_k > 0 else None,  # vLLM's 0 and -1 mean off
                stop_token_ids=self.stop_token_ids,
                logits_processors=list(job.logits_processors),
            )
            self.engine.add_request(job.inputs["input_ids"][0].tolist(), params, images or None, job.request_id)
        except ValueError as error:  # the engine's checks: the request cannot run here
            code = "context_length_exceeded" if isinstance(error, RequestTooLong) else None
            raise RequestError(str(error), code=code) from None
        sequence = self.engine.sequences[job.request_id]
        self._requests[job.request_id] = _EngineRequest(job, sequence, _JobStreamer(self.tokenizer, job))

    def cancel(self, job: GenerationJob) -> None:
        self.engine.cancel(job.request_id)

    def step(self) -> list[GenerationJob]:
        ended = []
        for output in self.engine.step():
            request = self._requests[output.request_id]
            if output.new_token_ids:
                request.streamer.put(torch.tensor(output.new_token_ids))
            if output.finished:
                request.streamer.end()
                self._record_dspark(request)
                del self._requests[output.request_id]
                ended.append(request.job)
        return ended

    def _record_dspark(self, request: _EngineRequest) -> None:
        steps = request.sequence.draft_steps
        if self.engine.drafter is not None and steps:
            request.job.dspark = {"steps": steps, "drafts": steps * self.engine.drafter.block_size,
                                  "accepted": request.sequence.accepted_drafts}  # fmt: skip


__all__ = ["EngineRunner", "GenerationJob", "GenerationWorker", "Overloaded", "Runner", "SamplingParams"]
