"""`inkling2 serve`: the OpenAI-compatible server on uvicorn, in the foreground (`serve`) or in a background thread
(`Inkling2Server`, for scripts and tests).

Why our own and not `transformers serve`: that runs in its own process, where `inkling2` checkpoints resolve to
transformers' built-in classes (ours are registered by importing this package), and it loads multimodal models
through `AutoModelForMultimodalLM`, which maps our config back to the built-in model. The stack is the same
(FastAPI, uvicorn, pydantic); the parts are in this folder, one concern each:

    protocol.py  the request as pydantic models       chat.py     request -> inputs, text -> OpenAI replies
    media.py     image URLs under a policy            worker.py   the engine's thread and its bounded queue
    settings.py  flags and limits                     metrics.py  Prometheus metrics
    app.py       FastAPI routes, auth, errors
"""

from __future__ import annotations

import logging
import socket
import threading

import uvicorn
from uvicorn.protocols.http.h11_impl import H11Protocol

from ..engine import Inkling2Engine
from .app import Inkling2App
from .chat import ChatCompletions
from .metrics import ServingMetrics
from .settings import ServerSettings
from .worker import EngineRunner, GenerationWorker, Runner

logger = logging.getLogger(__name__)


def _application(chat: ChatCompletions, runner: Runner, settings: ServerSettings) -> Inkling2App:
    metrics = ServingMetrics(settings.model_id)
    return Inkling2App(chat, GenerationWorker(runner, settings.max_waiting, metrics), metrics, settings)


def build_app(tokenizer, runner: Runner, settings: ServerSettings, processor=None,
              max_position_embeddings: int | None = None) -> Inkling2App:  # fmt: skip
    """The application over any `Runner` (`model_app` builds the engine's; tests pass scripted ones)."""
    return _application(ChatCompletions(tokenizer, settings, processor, max_position_embeddings), runner, settings)


def build_engine(model, settings: ServerSettings, max_model_len: int) -> Inkling2Engine:
    """The engine `settings` describe, over `model` (already on its device). Refuses a cache that cannot hold one
    sequence of `max_model_len` tokens, as vLLM does: requests the context admits would be refused one by one."""
    engine = Inkling2Engine(
        model,
        max_num_seqs=settings.max_num_seqs,
        max_model_len=max_model_len,
        page_size=settings.page_size,
        num_pages=settings.num_pages,
        max_step_tokens=settings.max_step_tokens,
        dspark=settings.dspark,
    )
    holds = engine.scheduler.max_sequence_tokens
    if holds < max_model_len:
        raise ValueError(
            f"the cache's {engine.cache.num_pages:,} pages of {settings.page_size} tokens hold {holds:,} tokens of one "
            f"sequence, fewer than max_model_len {max_model_len:,}: lower --max-model-len, or give more pages "
            "(--num-pages, or free memory)"
        )
    if engine.device.type == "cuda":
        engine.warm_up()  # compilations and graph captures before the first request, not in its stream
    return engine


def model_app(model, tokenizer, settings: ServerSettings, processor=None) -> Inkling2App:
    """The application over `model`: continuous batching on an `Inkling2Engine` sized by `settings`."""
    chat = ChatCompletions(tokenizer, settings, processor, model.config.get_text_config().max_position_embeddings)
    engine = build_engine(model, settings, chat.max_model_len)
    return _application(chat, EngineRunner(engine, tokenizer), settings)


def _listening_socket(host: str, port: int) -> socket.socket:
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.bind((host, port))
    sock.listen(2048)
    sock.set_inheritable(True)
    return sock


class _RequestHeadTimeout(H11Protocol):
    """uvicorn's HTTP/1.1 protocol, which closes a connection idle between requests (`timeout_keep_alive`) but not
    one that never completes a request's head (slowloris): each would hold one of `--max-connections` forever. This
    closes a connection whose request line and headers have not arrived within `head_timeout_s` of its opening or of
    its last response. (A body that trickles is the app's: `request_timeout_s`, answered with 408.)"""

    head_timeout_s = 30.0
    _head_timer = None

    def connection_made(self, transport) -> None:
        super().connection_made(transport)
        self._arm_head_timer()

    def _arm_head_timer(self) -> None:
        self._cancel_head_timer()
        self._head_timer = self.loop.call_later(self.head_timeout_s, self._head_late)

    def _cancel_head_timer(self) -> None:
        if self._head_timer is not None:
            self._head_timer.cancel()
            self._head_timer = None

    def _head_late(self) -> None:
        self._head_timer = None
        waiting_for_a_request = self.cycle is None or self.cycle.response_complete
        if waiting_for_a_request and not self.transport.is_closing():
            self.transport.close()

    def handle_events(self) -> None:
        super().handle_events()
        if self.cycle is not None and not self.cycle.response_complete:
            self._cancel_head_timer()  # a request's head arrived

    def on_response_complete(self) -> None:
        super().on_response_complete()
        if not self.transport.is_closing():
            self._arm_head_timer()

    def connection_lost(self, exc) -> None:
        self._cancel_head_timer()
        super().connection_lost(exc)


def _uvicorn_config(app: Inkling2App, log_level: str) -> uvicorn.Config:
    settings = app.settings
    protocol = type("Inkling2HTTPProtocol", (_RequestHeadTimeout,), {"head_timeout_s": settings.request_timeout_s})
    return uvicorn.Config(
        app.app,
        http=protocol,
        log_level=log_level,
        access_log=log_level in ("info", "debug"),
        timeout_keep_alive=settings.keep_alive_timeout_s,
        limit_concurrency=settings.max_connections,  # beyond it: 503, not a thread or a task per connection
        timeout_graceful_shutdown=5,
        server_header=False,
    )


def warn_if_exposed(settings: ServerSettings) -> None:
    if settings.exposed_without_key:
        logger.warning(
            "inkling2 serve: listening on %s without an API key: anyone who reaches this port can use the model. "
            "Set --api-key (or INKLING2_API_KEY), and put TLS in front (docs/serving.md).",
            settings.host,
        )


class Inkling2Server:
    """uvicorn in a background thread: `start()` returns once it listens (`port=0` picks a free port, `.port`),
    `stop()` ends it, cancels queued work and joins every thread it started; also a context manager."""

    def __init__(self, app: Inkling2App, log_level: str = "warning"):
        self.app = app
        self._socket = _listening_socket(app.settings.host, app.settings.port)
        self._server = uvicorn.Server(_uvicorn_config(app, log_level))
        self._thread: threading.Thread | None = None

    @property
    def port(self) -> int:
        return self._socket.getsockname()[1]

    @property
    def base_url(self) -> str:
        host = self.app.settings.host
        return f"http://{f'[{host}]' if ':' in host else host}:{self.port}/v1"

    def start(self) -> Inkling2Server:
        warn_if_exposed(self.app.settings)
        self._thread = threading.Thread(target=self._server.run, kwargs={"sockets": [self._socket]},
                                        name="inkling2-serve")  # fmt: skip
        self._thread.start()
        while not self._server.started:
            if not self._thread.is_alive():
                raise RuntimeError("the server did not start (see the log above)")
            self._thread.join(0.01)
        return self

    def stop(self) -> None:
        if self._thread is not None:
            self._server.should_exit = True
            self._thread.join()
            self._thread = None
        self.app.worker.close()
        self._socket.close()

    def __enter__(self) -> Inkling2Server:
        return self.start() if self._thread is None else self

    def __exit__(self, *exc):
        self.stop()


def serve(model, tokenizer, processor=None, settings: ServerSettings | None = None) -> None:
    """Serve `model` in the foreground until interrupted (Ctrl-C)."""
    settings = settings or ServerSettings()
    app = model_app(model, tokenizer, settings, processor)
    warn_if_exposed(settings)
    sock = _listening_socket(settings.host, settings.port)
    host = f"[{settings.host}]" if ":" in settings.host else settings.host
    print(f"[serve] {settings.model_id} on http://{host}:{sock.getsockname()[1]}/v1 (OpenAI-compatible; "
          f"context {app.chat.max_model_len:,} tokens; up to {settings.max_num_seqs} requests batched; Ctrl-C stops)",
          flush=True)  # fmt: skip
    try:
        uvicorn.Server(_uvicorn_config(app, "info")).run(sockets=[sock])
    finally:
        app.worker.close()
        sock.close()


__all__ = ["Inkling2Server", "ServerSettings", "build_app", "build_engine", "model_app", "serve"]
