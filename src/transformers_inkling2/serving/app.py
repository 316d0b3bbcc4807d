"""The HTTP face of the server, on FastAPI: `/v1/chat/completions` (streaming and not), `/v1/models`, `/health`,
`/metrics`. Every refusal is OpenAI's error body with a 4xx (a 500 only for a fault of ours, never the request's);
`/v1/*` asks for the API key when one is set (compared in constant time).

A request's path: body (size-capped, depth-checked JSON) -> `protocol.parse_request` -> model name -> `ChatCompletions.
prepare` in a thread (media, template, bounds) -> the worker's queue (503 + Retry-After when full) -> events -> the
reply. A client that leaves (streaming or not) cancels its job: the generation stops within one decode step. A job
the engine refuses ends with a `RequestError`, answered as the 4xx it names.
"""

from __future__ import annotations

import asyncio
import contextlib
import hmac
import json
import logging
import time

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response, StreamingResponse
from starlette.concurrency import run_in_threadpool
from starlette.exceptions import HTTPException as StarletteHTTPException

from .chat import ChatCompletions, ChunkWriter, PreparedRequest, ReplyAssembler, completion
from .metrics import ServingMetrics
from .protocol import RequestError, error_body, parse_request
from .settings import ServerSettings
from .worker import GenerationJob, GenerationWorker, Overloaded

logger = logging.getLogger(__name__)

MAX_HEADER_BYTES = 32 * 1024
ERROR_TYPES = {400: "invalid_request_error", 401: "authentication_error", 404: "not_found_error",
               405: "invalid_request_error", 408: "invalid_request_error", 413: "invalid_request_error",
               415: "invalid_request_error", 431: "invalid_request_error", 503: "overloaded_error"}  # fmt: skip


class _ASCIIJSONResponse(JSONResponse):
    """Error bodies quote what the client sent, which may hold lone surrogates that UTF-8 cannot encode."""

    def render(self, content) -> bytes:
        return json.dumps(content, ensure_ascii=True, separators=(",", ":")).encode()


def error_response(status: int, message: str, param=None, code=None, headers=None) -> JSONResponse:
    kind = ERROR_TYPES.get(status, "server_error" if status >= 500 else "invalid_request_error")
    return _ASCIIJSONResponse(error_body(message, kind, param, code), status_code=status, headers=headers)


async def read_body(request: Request, limit: int) -> dict:
    """The JSON body, read up to `limit` bytes (a larger one is refused while it arrives, not after). Only
    `application/json`: a browser sends `text/plain` and form bodies cross-origin without asking, so accepting them
    would let any web page drive a server on the visitor's loopback."""
    media_type = request.headers.get("content-type", "").split(";")[0].strip().lower()
    if media_type != "application/json":
        raise RequestError(f"the body must be sent as 'Content-Type: application/json', not {media_type[:100]!r}",
                           status=415)  # fmt: skip
    declared = request.headers.get("content-length")
    if declared is not None and (not declared.isdigit() or int(declared) > limit):
        raise RequestError(f"the request body is over {limit:,} bytes (--max-request-bytes)", status=413)
    chunks, size = [], 0
    async for chunk in request.stream():
        size += len(chunk)
        if size > limit:
            raise RequestError(f"the request body is over {limit:,} bytes (--max-request-bytes)", status=413)
        chunks.append(chunk)
    try:
        return json.loads(b"".join(chunks))
    except RecursionError:
        raise RequestError("the request nests too deeply") from None
    except ValueError as error:
        raise RequestError(f"the body is not JSON: {str(error)[:200]}") from None


async def wait_for_disconnect(request: Request) -> None:
    """Returns when the client closes the connection (the body was read already: the next message is the end)."""
    while (await request.receive())["type"] != "http.disconnect":
        pass


class Inkling2App:
    """The FastAPI application around a `ChatCompletions` and a `GenerationWorker`."""

    def __init__(self, chat: ChatCompletions, worker: GenerationWorker, metrics: ServingMetrics,
                 settings: ServerSettings):  # fmt: skip
        self.chat, self.worker, self.metrics, self.settings = chat, worker, metrics, settings
        self.created = int(time.time())
        self.app = FastAPI(title="inkling2", docs_url=None, redoc_url=None, openapi_url=None)
        self._routes()

    # ---- routes ----

    def _routes(self) -> None:
        app = self.app

        @app.exception_handler(RequestError)
        async def refused(request: Request, error: RequestError):
            return error_response(error.status, str(error), error.param, error.code)

        @app.exception_handler(StarletteHTTPException)
        async def http_error(request: Request, error: StarletteHTTPException):
            message = "no such route" if error.status_code == 404 else str(error.detail)
            return error_response(error.status_code, f"{message}: {request.method} {request.url.path}")

        @app.exception_handler(Exception)
        async def failed(request: Request, error: Exception):  # a fault of ours or of the generation: say which
            return error_response(500, f"{type(error).__name__}: {str(error)[:500]}")

        @app.exception_handler(RequestValidationError)
        async def invalid(request: Request, error: RequestValidationError):
            return error_response(400, str(error.errors()[:1])[:500])

        @app.middleware("http")
        async def guard(request: Request, call_next):
            head = sum(len(name) + len(value) for name, value in request.scope["headers"])
            if head > MAX_HEADER_BYTES:  # uvicorn bounds a head that arrives in pieces, not one in a single read
                return error_response(431, f"the request's headers are over {MAX_HEADER_BYTES:,} bytes")
            if not self.settings.host_allowed(request.headers.get("host", "")):
                return error_response(400, "this server does not answer to that Host header (--allowed-hosts)")
            if request.url.path.startswith("/v1/") and not self._authorized(request):
                return error_response(401, "a valid API key is needed: send 'Authorization: Bearer <key>'",
                                      headers={"WWW-Authenticate": "Bearer"})  # fmt: skip
            return await call_next(request)

        @app.get("/health")
        async def health():
            return {"status": "ok"}

        @app.get("/metrics")
        async def metrics():
            return Response(self.metrics.exposition(), media_type="text/plain; version=0.0.4; charset=utf-8")

        @app.get("/v1/models")
        async def models():
            return {"object": "list", "data": [self._model_card()]}

        @app.get("/v1/models/{model_id:path}")
        async def model(model_id: str):
            if model_id != self.settings.model_id:
                raise RequestError(f"The model '{model_id}' does not exist", "model", 404, "model_not_found")
            return self._model_card()

        @app.post("/v1/chat/completions")
        async def chat_completions(request: Request):
            return await self.chat_completions(request)

    def _authorized(self, request: Request) -> bool:
        if self.settings.api_key is None:
            return True
        scheme, _, token = request.headers.get("authorization", "").partition(" ")
        key = self.settings.api_key.encode()
        return scheme.lower() == "bearer" and hmac.compare_digest(token.strip().encode(), key)

    def _model_card(self) -> dict:
        return {"id": self.settings.model_id, "object": "model", "created": self.created, "owned_by": "inkling2",
                "max_model_len": self.chat.max_model_len}  # fmt: skip

    # ---- chat completions ----

    async def chat_completions(self, request: Request):
        try:
            body = await asyncio.wait_for(read_body(request, self.settings.max_request_bytes),
                                          self.settings.request_timeout_s)  # fmt: skip
        except TimeoutError:
            late = f"the body took over {self.settings.request_timeout_s} s to arrive"
            raise RequestError(late, status=408) from None
        chat_request = parse_request(body)
        if chat_request.model != self.settings.model_id:
            raise RequestError(
                f"The model '{chat_request.model[:200]}' does not exist (this server has '{self.settings.model_id}')",
                "model", 404, "model_not_found",
            )  # fmt: skip
        prepared = await run_in_threadpool(self.chat.prepare, chat_request)
        job = GenerationJob(prepared.inputs, prepared.params, prepared.logits_processors)
        job.bind(asyncio.get_running_loop())
        try:
            self.worker.submit(job)
        except Overloaded as error:
            return error_response(503, f"the server is busy: {error}; retry later",
                                  headers={"Retry-After": str(self.settings.retry_after_s)})  # fmt: skip
        self.metrics.prompt_tokens.inc(prepared.prompt_tokens)
        assembler = ReplyAssembler(chat_request, prepared.prompt_tokens, prepared.params.max_new_tokens)
        if chat_request.stream:
            return StreamingResponse(self._stream(job, assembler, prepared), media_type="text/event-stream",
                                     headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})  # fmt: skip
        return await self._complete(request, job, assembler)

    async def _events(self, job: GenerationJob, assembler: ReplyAssembler):
        """The job's deltas as they come; records the token metrics; cancels the job when its consumer stops early,
        or when a stop sequence is met."""
        last = None
        reason = "abort"  # unless the generation ends or fails
        try:
            while (event := await job.events.get()) is not None:
                if isinstance(event, BaseException):
                    reason = "error"
                    raise event
                text, tokens = event
                now = time.monotonic()
                if tokens:
                    self._record_tokens(job, tokens, last, now)
                    last = now
                deltas = assembler.feed(text, tokens)
                if assembler.stopped:
                    job.cancel()
                for delta in deltas:
                    yield delta
            final = assembler.finish()
            reason = assembler.finish_reason
            for delta in final:
                yield delta
        finally:
            job.cancel()  # no-op when done; stops the generation when the client left
            self.metrics.finished(reason)
            self.metrics.request_latency.observe(time.monotonic() - job.received_at)
            if job.dspark:
                self.metrics.spec_decode_steps.inc(job.dspark["steps"])
                self.metrics.spec_decode_drafts.inc(job.dspark["drafts"])
                self.metrics.spec_decode_accepted.inc(job.dspark["accepted"])

    def _record_tokens(self, job: GenerationJob, tokens: int, last: float | None, now: float) -> None:
        self.metrics.generation_tokens.inc(tokens)
        if last is None:  # the first chunk: its tokens arrived together with the first one
            self.metrics.time_to_first_token.observe(now - job.received_at)
            return
        for _ in range(tokens):  # several tokens at once (DSpark, a split character) share the gap
            self.metrics.inter_token_latency.observe((now - last) / tokens)

    async def _complete(self, request: Request, job: GenerationJob, assembler: ReplyAssembler):
        async def collect():
            async for _ in self._events(job, assembler):
                pass

        collecting = asyncio.ensure_future(collect())
        watching = asyncio.ensure_future(wait_for_disconnect(request))
        try:
            await asyncio.wait({collecting, watching}, return_when=asyncio.FIRST_COMPLETED)
        finally:
            watching.cancel()
            if not collecting.done():  # the client left (or this handler was cancelled): stop the generation
                collecting.cancel()
                with contextlib.suppress(asyncio.CancelledError):
                    await collecting
        if collecting.cancelled():
            return Response(status_code=499)  # nobody is there to read it
        error = collecting.exception()
        if isinstance(error, RequestError):  # the engine refused the request: the request's fault
            return error_response(error.status, str(error), error.param, error.code)
        if error is not None:  # the generation failed: a 500 that says how
            logger.error("generation failed", exc_info=error)
            return error_response(500, f"the generation failed: {type(error).__name__}: {str(error)[:500]}")
        return completion(self.settings.model_id, assembler)

    async def _stream(self, job: GenerationJob, assembler: ReplyAssembler, prepared: PreparedRequest):
        writer = ChunkWriter(self.settings.model_id)

        def event(payload: dict) -> str:
            return f"data: {json.dumps(payload, ensure_ascii=False)}\n\n"

        yield event(writer.chunk({"role": "assistant", "content": ""}))
        events = self._events(job, assembler)
        try:
            async for delta in events:
                yield event(writer.delta(delta))
        except RequestError as error:  # headers are out: report it in the stream, as OpenAI does, then end it
            yield event(error_body(str(error), ERROR_TYPES.get(error.status, "invalid_request_error"), error.param,
                                   error.code))  # fmt: skip
        except Exception as error:
            yield event(error_body(f"{type(error).__name__}: {str(error)[:500]}", "server_error"))
        else:
            yield event(writer.chunk({}, finish_reason=assembler.finish_reason))
            if prepared.request.include_usage:
                yield event(writer.usage(assembler.usage))
        finally:
            await events.aclose()
        yield "data: [DONE]\n\n"


__all__ = ["Inkling2App", "error_response"]
