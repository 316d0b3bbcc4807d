"""Helpers shared by the serving tests (test_abuse.py, test_soak.py): scripted runners, a server started in-process
on a free loopback port and stopped with its threads checked, the `openai` client with bounds, raw HTTP over
`http.client` and raw sockets, the OpenAI error body, `/metrics` as numbers, and "is it still serving?".

Imported by name: pytest puts this folder on `sys.path` (rootdir-relative "prepend" import mode, no __init__.py).
"""

from __future__ import annotations

import contextlib
import http.client
import json
import socket
import threading
import time

import openai

from transformers_inkling2.processing.chat_template import (
    CONTENT_TEXT,
    CONTENT_THINKING,
    END_MESSAGE,
    END_OF_TURN,
    MESSAGE_MODEL,
)
from transformers_inkling2.serving.server import (
    Inkling2Server,
    ServerSettings,
    build_app,
)

MODEL_ID = "inkling2-test"
THINK, TEXT, END, MODEL, EOT = CONTENT_THINKING, CONTENT_TEXT, END_MESSAGE, MESSAGE_MODEL, END_OF_TURN
OK_REPLY = [f"{TEXT}ok", f"{END}{EOT}"]
SLOW_REPLY = [TEXT] + ["tick "] * 2000  # with a delay per chunk: runs until cancelled
TIMEOUT = 15  # seconds: every client call and socket is bounded by this or less


ENDED = object()  # what `next` gives a reply that has no chunk left


class ScriptedRunner:
    """The worker's `Runner` over scripted replies: `reply(job)` is a generator of `(text, tokens)` chunks (or None:
    nothing this step), one per step for each job in flight, `capacity` jobs at once (1: one after another). A chunk
    that raises fails the step, as a failing engine step does."""

    capacity = 1
    num_waiting = 0
    free_pages = 0

    def __init__(self):
        self._replies: dict = {}
        self._cancelled: set = set()

    @property
    def num_running(self) -> int:
        return len(self._replies)

    def reply(self, job):
        raise NotImplementedError

    def add(self, job) -> None:
        self._replies[job] = self.reply(job)

    def cancel(self, job) -> None:
        if job in self._replies:
            self._cancelled.add(job)

    def step(self) -> list:
        ended = list(self._cancelled)
        self._cancelled.clear()
        for job in ended:
            self._replies.pop(job).close()
        for job, reply in list(self._replies.items()):
            chunk = next(reply, ENDED)
            if chunk is ENDED:
                del self._replies[job]
                ended.append(job)
            elif chunk is not None:
                job.emit(*chunk)
        return ended


class Script(ScriptedRunner):
    """Replays scripted text, one chunk per step (`delay` seconds each), and records its jobs. `gate` (an Event),
    when set up, holds every job before its first chunk until it is set (or the job is cancelled). `started` is set
    when a job starts; `closed` when one ends; `ended_at` is when the last one ended."""

    def __init__(self, tok):
        super().__init__()
        self.tok = tok
        self._counts: dict[str, int] = {}
        self.reset()

    def reset(self, chunks=OK_REPLY, delay: float = 0.0, gate: threading.Event | None = None) -> Script:
        self.chunks, self.delay, self.gate = list(chunks), delay, gate
        self.jobs: list = []
        self.started, self.closed = threading.Event(), threading.Event()
        self.ended_at: float | None = None
        return self

    def count(self, chunk: str) -> int:
        if chunk not in self._counts:
            self._counts[chunk] = len(self.tok(chunk, add_special_tokens=False)["input_ids"])
        return self._counts[chunk]

    def reply(self, job):
        self.jobs.append(job)
        return self._chunks()

    def _chunks(self):
        self.started.set()
        try:
            while self.gate is not None and not self.gate.wait(0.01):
                yield None
            for chunk in self.chunks:
                time.sleep(self.delay)
                yield chunk, self.count(chunk)
        finally:
            self.ended_at = time.monotonic()
            self.closed.set()


def start_server(tok, runner, processor=None, **settings) -> Inkling2Server:
    settings = ServerSettings(**{"model_id": MODEL_ID, "port": 0, "max_model_len": 4096, **settings})
    return Inkling2Server(build_app(tok, runner, settings, processor)).start()


def leftover_threads(before: set, grace_s: float = 3.0) -> list:
    """Threads started since `before` that are still alive after `grace_s` (timers and resolvers end on their own)."""
    deadline = time.monotonic() + grace_s
    while True:
        left = [t for t in set(threading.enumerate()) - before if t.is_alive()]
        if not left or time.monotonic() > deadline:
            return left
        time.sleep(0.05)


@contextlib.contextmanager
def serving(tok, runner, processor=None, check_threads: bool = True, **settings):
    """A started server; stopped at the end, then no thread started meanwhile may be left running. Where other
    servers run meanwhile (a module-scoped one beside others), pass `check_threads=False` and check once at the end
    of the module: their worker threads cannot be told apart."""
    before = set(threading.enumerate())
    server = start_server(tok, runner, processor, **settings)
    try:
        yield server
    finally:
        server.stop()
    if check_threads:
        left = leftover_threads(before)
        assert not left, f"threads left running after the server stopped: {left}"


def openai_client(server: Inkling2Server, api_key: str = "unused", timeout: float = TIMEOUT) -> openai.OpenAI:
    return openai.OpenAI(base_url=server.base_url, api_key=api_key, max_retries=0, timeout=timeout)


def ask(server, text: str = "hi", api_key: str = "unused", timeout: float = TIMEOUT, **fields):
    return openai_client(server, api_key, timeout).chat.completions.create(
        model=MODEL_ID, messages=[{"role": "user", "content": text}], **fields
    )


# ---- raw HTTP ----


class Reply:
    def __init__(self, status: int, headers: dict, body: bytes):
        self.status, self.headers, self.body = status, headers, body

    def json(self):
        return json.loads(self.body)

    def __repr__(self):
        return f"Reply({self.status}, {self.headers.get('content-type')!r}, {self.body[:300]!r})"


def http_request(server, method: str, path: str, body: bytes | None = None, headers: dict | None = None,
                 timeout: float = TIMEOUT) -> Reply:  # fmt: skip
    """One request over a fresh connection; header names in the reply are lower case."""
    connection = http.client.HTTPConnection("127.0.0.1", server.port, timeout=timeout)
    try:
        connection.request(method, path, body=body, headers=headers or {})
        response = connection.getresponse()
        reply = Reply(response.status, {k.lower(): v for k, v in response.getheaders()}, response.read())
    finally:
        connection.close()
    if reply.status >= 500:
        # uvicorn logs the error's traceback after the response went out; Python 3.11's traceback formatting calls
        # ast.parse, whose state is shared between threads: pytest formatting this test's failure at the same time
        # can crash the session (SystemError: AST constructor recursion depth mismatch). Let the log finish first.
        time.sleep(0.5)
    return reply


def post_json(server, payload, headers: dict | None = None, timeout: float = TIMEOUT, raw: bytes | None = None) -> Reply:
    body = raw if raw is not None else json.dumps(payload).encode()
    return http_request(server, "POST", "/v1/chat/completions", body,
                        {"Content-Type": "application/json", **(headers or {})}, timeout)  # fmt: skip


def chat(**fields) -> dict:
    """A minimal valid request body with `fields` on top."""
    return {"model": MODEL_ID, "messages": [{"role": "user", "content": "hi"}], **fields}


def assert_openai_error(reply: Reply, status: int | None = None, code=None) -> dict:
    """OpenAI's error body: {"error": {"message", "type", "param", "code"}}, JSON, and a 4xx unless `status`."""
    if status is not None:
        assert reply.status == status, reply
    else:
        assert 400 <= reply.status < 500, reply
    assert reply.headers.get("content-type", "").startswith("application/json"), reply
    error = reply.json()["error"]
    assert set(error) == {"message", "type", "param", "code"}, error
    assert isinstance(error["message"], str) and error["message"], error
    assert isinstance(error["type"], str) and error["type"], error
    if code is not None:
        assert error["code"] == code, error
    return error


def raw_exchange(port: int, data: bytes, timeout: float = 5.0, wait_for_close: bool = True) -> tuple[bytes, bool]:
    """Send `data` on a fresh socket and read until the server closes it or `timeout` passes: (bytes, closed)."""
    with socket.create_connection(("127.0.0.1", port), timeout=timeout) as sock:
        try:
            sock.sendall(data)
        except OSError:
            pass
        return read_until_close(sock, timeout, wait_for_close)


def read_until_close(sock: socket.socket, timeout: float, wait_for_close: bool = True) -> tuple[bytes, bool]:
    received, deadline = b"", time.monotonic() + timeout
    while time.monotonic() < deadline:
        sock.settimeout(max(0.01, deadline - time.monotonic()))
        try:
            chunk = sock.recv(65536)
        except TimeoutError:
            break
        except OSError:  # reset by the server: closed
            return received, True
        if not chunk:
            return received, True
        received += chunk
        if not wait_for_close and b"\r\n\r\n" in received:
            break
    return received, False


def status_of(raw: bytes) -> int | None:
    if not raw.startswith(b"HTTP/1."):
        return None
    return int(raw.split(b" ", 2)[1])


# ---- the server's state ----


def metrics(server) -> dict[str, float]:
    """`/metrics` as {'name{labels}': value} (and {'name': value} for metrics with only the model label)."""
    reply = http_request(server, "GET", "/metrics", timeout=5)
    assert reply.status == 200, reply
    values = {}
    for line in reply.body.decode().splitlines():
        if line.startswith("inkling2:"):
            key, value = line.rsplit(" ", 1)
            values[key] = float(value)
            name, _, labels = key.partition("{")
            if labels.rstrip("}").count("=") == 1:
                values[name] = float(value)
    return values


def settled(server) -> bool:
    """Nothing running or waiting."""
    values = metrics(server)
    return values["inkling2:num_requests_running"] == 0 and values["inkling2:num_requests_waiting"] == 0


def aborted(server) -> float:
    return metrics(server).get(f'inkling2:request_success_total{{finished_reason="abort",model_name="{MODEL_ID}"}}', 0.0)


def wait_until(condition, timeout: float = 5.0, step: float = 0.02) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if condition():
            return True
        time.sleep(step)
    return bool(condition())


def assert_serving(server, script: Script | None = None, api_key: str = "unused") -> None:
    """The server is up and answering: `/health` is 200 and a normal chat completion succeeds (with `script`'s
    normal reply: the script is reset first; nothing else may be generating then)."""
    health = http_request(server, "GET", "/health", timeout=5)
    assert health.status == 200 and health.json() == {"status": "ok"}, health
    if script is not None:
        assert wait_until(lambda: metrics(server)["inkling2:num_requests_running"] == 0), "a generation is still running"
        script.reset()
    reply = ask(server, "are you there?", api_key=api_key, timeout=10)
    assert reply.choices[0].finish_reason == "stop"
    if script is not None:
        assert reply.choices[0].message.content == "ok"

