"""`inkling2 serve` on the engine (continuous batching), with the embedded tiny model on CPU: requests decoded
together get what each gets alone, a client that leaves frees its row at once, a request the cache cannot hold is a
4xx that says why (and a cache that cannot hold the context is refused at start), `/metrics` shows the engine's
rows, its waiting requests and its free pages, and images reach the engine with their prompt. Replies are short (8
tokens) and greedy.
"""

import base64
import io
import threading
import time

import PIL.Image
import pytest
import torch
from serving_helpers import (
    MODEL_ID,
    aborted,
    assert_openai_error,
    chat,
    leftover_threads,
    metrics,
    openai_client,
    post_json,
    settled,
    wait_until,
)

from transformers_inkling2.engine import Inkling2Engine
from transformers_inkling2.processing.response_parsing import parse_response
from transformers_inkling2.processing.tokenization_inkling2 import build_inkling2_tokenizer
from transformers_inkling2.serving.server import Inkling2Server, ServerSettings, build_app, build_engine, model_app
from transformers_inkling2.serving.worker import EngineRunner
from transformers_inkling2.tiny import build_tiny_causal_lm, build_tiny_model, build_tiny_processor

openai = pytest.importorskip("openai")

ROWS = 4
CONTEXT = 512
QUESTIONS = ["Hello", "What is the sea?", "Count to three.", "A longer question about batching, please"]
FREE_PAGES = "inkling2:kv_cache_free_pages"


class HeldRunner(EngineRunner):
    """The engine's runner, which does not step while `held` is set (requests gather, then run together), and
    records the most rows that ran at once and the fewest free pages."""

    def __init__(self, engine, tokenizer):
        super().__init__(engine, tokenizer)
        self.held = threading.Event()
        self.most_running, self.fewest_free = 0, self.free_pages

    def step(self):
        if self.held.is_set():
            time.sleep(0.005)
            return []
        ended = super().step()
        self.most_running = max(self.most_running, self.num_running)
        self.fewest_free = min(self.fewest_free, self.free_pages)
        return ended


@pytest.fixture(scope="module")
def tok():
    return build_inkling2_tokenizer()


@pytest.fixture(scope="module")
def model():
    return build_tiny_causal_lm()


def engine_settings(**fields) -> ServerSettings:
    return ServerSettings(**{"model_id": MODEL_ID, "port": 0, "max_model_len": CONTEXT, "max_num_seqs": ROWS,
                             "page_size": 64, **fields})  # fmt: skip


@pytest.fixture(scope="module")
def server(tok, model):
    settings = engine_settings()
    runner = HeldRunner(build_engine(model, settings, CONTEXT), tok)
    threads_before = set(threading.enumerate())
    with Inkling2Server(build_app(tok, runner, settings)) as srv:
        srv.runner = runner
        yield srv
    assert leftover_threads(threads_before) == []


def streamed(server, question: str) -> tuple:
    """(reasoning, content, finish reason, completion tokens) of a streamed greedy reply of 8 tokens."""
    chunks = openai_client(server, timeout=60).chat.completions.create(
        model=MODEL_ID, messages=[{"role": "user", "content": question}], max_tokens=8, temperature=0, stream=True,
        stream_options={"include_usage": True},
    )  # fmt: skip
    reasoning, content, finish, tokens = "", "", None, None
    for chunk in chunks:
        tokens = chunk.usage.completion_tokens if chunk.usage else tokens
        if chunk.choices:
            delta = chunk.choices[0].delta
            reasoning += (delta.model_extra or {}).get("reasoning_content") or ""
            content += delta.content or ""
            finish = chunk.choices[0].finish_reason or finish
    return reasoning, content, finish, tokens


def in_parallel(function, arguments: list) -> tuple[list, list]:
    """Runs `function` on each argument in its own thread: (the started threads, their results once joined)."""
    results = [None] * len(arguments)

    def run(index):
        results[index] = function(arguments[index])

    threads = [threading.Thread(target=run, args=(index,)) for index in range(len(arguments))]
    for thread in threads:
        thread.start()
    return threads, results


def test_concurrent_streams_decode_together_and_get_what_each_gets_alone(server):
    alone = [streamed(server, question) for question in QUESTIONS]
    assert all(tokens == 8 or finish == "stop" for *_, finish, tokens in alone), alone
    runner = server.runner
    runner.most_running = 0
    runner.held.set()
    threads, together = in_parallel(lambda question: streamed(server, question), QUESTIONS)
    assert wait_until(lambda: metrics(server)["inkling2:num_requests_waiting"] == ROWS, 10), metrics(server)
    runner.held.clear()
    for thread in threads:
        thread.join(60)
    assert together == alone
    assert runner.most_running == ROWS  # they were decoded in one batch


def test_metrics_show_running_waiting_and_free_pages(server):
    runner = server.runner
    full = runner.engine.cache.num_pages - 1  # page 0 is never handed out
    assert wait_until(lambda: settled(server))
    assert metrics(server)[FREE_PAGES] == full
    runner.fewest_free = full
    runner.held.set()
    threads, replies = in_parallel(lambda question: streamed(server, question), QUESTIONS[:2])
    assert wait_until(lambda: metrics(server)["inkling2:num_requests_waiting"] == 2, 10), metrics(server)
    values = metrics(server)
    assert values["inkling2:num_requests_running"] == 0 and values[FREE_PAGES] == full  # taken, not admitted yet
    runner.held.clear()
    for thread in threads:
        thread.join(60)
    assert all(reply[2] is not None for reply in replies), replies
    assert runner.fewest_free < full  # the two rows held pages while they ran
    assert wait_until(lambda: settled(server) and metrics(server)[FREE_PAGES] == full)


@pytest.mark.parametrize("stream", [True, False], ids=["streaming", "non-streaming"])
def test_a_client_that_leaves_frees_its_row(server, stream):
    """400 tokens would take seconds: the row is freed, its pages given back, within a few steps of the client
    leaving."""
    engine, before = server.runner.engine, aborted(server)
    full = engine.cache.num_pages - 1
    client = openai_client(server, timeout=60 if stream else 1.0)
    fields = dict(model=MODEL_ID, messages=[{"role": "user", "content": "Talk."}], max_tokens=400, temperature=0)
    if stream:
        chunks = client.chat.completions.create(stream=True, **fields)
        assert wait_until(lambda: metrics(server)["inkling2:num_requests_running"] == 1, 10)
        chunks.close()
    else:
        with pytest.raises(openai.APITimeoutError):
            client.chat.completions.create(**fields)
    left = time.monotonic()
    assert wait_until(lambda: engine.num_running == 0 and settled(server), 5)
    assert time.monotonic() - left < 2
    assert wait_until(lambda: aborted(server) == before + 1 and metrics(server)[FREE_PAGES] == full)


def test_a_request_over_the_context_is_a_400_before_it_reaches_the_engine(server):
    error = assert_openai_error(post_json(server, chat(max_tokens=CONTEXT)), 400, code="context_length_exceeded")
    assert f"this server's context of {CONTEXT:,} tokens" in error["message"]


@pytest.mark.parametrize("stream", [False, True], ids=["non-streaming", "streaming"])
def test_a_request_the_cache_cannot_hold_is_a_400_that_says_why(tok, model, stream):
    """An engine whose cache holds fewer tokens than the server's context (model_app refuses to start so; built here
    by hand): the engine refuses the request when the worker hands it over, and the client hears why, as a 400 or,
    once a stream's headers are out, as the stream's error event."""
    settings = engine_settings()
    engine = Inkling2Engine(model, max_num_seqs=2, max_model_len=CONTEXT, page_size=64, num_pages=3)
    with Inkling2Server(build_app(tok, EngineRunner(engine, tok), settings)) as srv:
        reply = post_json(srv, chat(max_tokens=200, stream=stream))
        if stream:
            assert reply.status == 200, reply
            events = [line for line in reply.body.decode().splitlines() if line.startswith("data: ")]
            assert events[-1] == "data: [DONE]"
            assert '"type": "invalid_request_error"' in events[-2] and '"context_length_exceeded"' in events[-2]
            assert "exceed what one sequence can hold here" in events[-2]
        else:
            error = assert_openai_error(reply, 400, code="context_length_exceeded")
            assert "exceed what one sequence can hold here" in error["message"]
        assert post_json(srv, chat(max_tokens=8)).status == 200  # one that fits is served
        assert engine.num_running == 0


def test_a_cache_that_cannot_hold_the_context_is_refused_at_start(tok, model):
    with pytest.raises(ValueError, match=r"hold 127 tokens of one sequence, fewer than max_model_len 512"):
        model_app(model, tok, engine_settings(num_pages=3))


class RecordingRunner(EngineRunner):
    """The engine's runner, keeping the inputs of the last job it took."""

    def add(self, job):
        self.inputs = job.inputs
        super().add(job)


def test_an_image_reaches_the_engine_with_its_prompt(tok):
    """The processor's pixel values go to the engine with the prompt: the greedy reply is generate()'s for the same
    inputs."""
    model, processor = build_tiny_model(), build_tiny_processor()
    buffer = io.BytesIO()
    PIL.Image.new("RGB", (120, 80), (10, 200, 30)).save(buffer, format="PNG")
    url = "data:image/png;base64," + base64.b64encode(buffer.getvalue()).decode()
    messages = [{"role": "user", "content": [{"type": "text", "text": "What is it?"},
                                             {"type": "image_url", "image_url": {"url": url}}]}]  # fmt: skip
    settings = engine_settings()
    runner = RecordingRunner(build_engine(model, settings, CONTEXT), tok)
    with Inkling2Server(build_app(tok, runner, settings, processor)) as srv:
        reply = openai_client(srv, timeout=60).chat.completions.create(
            model=MODEL_ID, messages=messages, max_tokens=8, temperature=0
        )
    assert "pixel_values" in runner.inputs and "image_grid_thw" in runner.inputs
    prompt = runner.inputs["input_ids"]
    with torch.no_grad():
        output = model.generate(**runner.inputs, max_new_tokens=8, do_sample=False, pad_token_id=tok.pad_token_id)
    generated = output[0, prompt.shape[1] :]
    assert reply.usage.completion_tokens == len(generated)
    assert (parse_response(generated, tok)["content"] or None) == reply.choices[0].message.content
