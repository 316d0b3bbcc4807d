"""`inkling2 serve`: a small OpenAI-compatible server (`/v1/chat/completions`, `/v1/models`) on the standard library.

Why our own: `transformers serve` runs in its own process, where `inkling2` checkpoints resolve to transformers'
built-in classes (ours are registered only by importing this package), and even in-process it loads multimodal
model types through `AutoModelForMultimodalLM`, which maps our config's class name back to the built-in model. It
also needs fastapi, uvicorn and pydantic. This server is `http.server` plus the chat template and the response
parser; it serves one generation at a time, which is what one model on one device can do anyway.

The request path:
    OpenAI messages --(to_template_messages)--> chat template (tokenizer, or the processor when there are images)
    --> generate_fn(inputs, params) yields text --> Inkling2ResponseParser --> OpenAI message or SSE chunks

`generate_fn` is injectable: tests script the model's text; `model_generate_fn(model, tokenizer)` runs
`model.generate` in a worker thread, streaming text out of it. Reasoning comes back as `reasoning_content` (and
`reasoning`, the newer name), tool calls as OpenAI `tool_calls` with JSON-string `arguments`.
"""

from __future__ import annotations

import json
import queue
import threading
import time
import uuid
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass
from http import HTTPStatus
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import jinja2
import torch
from transformers import StoppingCriteria, StoppingCriteriaList

from ..processing.response_parsing import IncrementalTextStreamer, Inkling2ResponseParser, ResponseDelta

DEFAULT_MAX_TOKENS = 1024
MAX_REQUEST_BYTES = 64 * 1024 * 1024  # images arrive inline as base64


@dataclass
class GenerationParams:
    max_new_tokens: int
    temperature: float  # 0 means greedy
    top_p: float | None = None
    seed: int | None = None


# (model inputs from the chat template, sampling parameters) -> the model's text, special tokens spelled out
GenerateFn = Callable[[dict, GenerationParams], Iterable[str]]


class RequestError(ValueError):
    """A bad request: answered with HTTP 400 and OpenAI's error body."""


# ---------------------------------------------------------------------------------------------------------------
# Generation with a transformers model


class _Cancelled(StoppingCriteria):
    """Stops `generate` when the client went away."""

    def __init__(self, event: threading.Event):
        self.event = event

    def __call__(self, input_ids, scores, **kwargs):
        return torch.full((input_ids.shape[0],), self.event.is_set(), dtype=torch.bool, device=input_ids.device)


class _QueueTextStreamer(IncrementalTextStreamer):
    def __init__(self, tokenizer, chunks: queue.Queue):
        super().__init__(tokenizer, skip_prompt=True)
        self.chunks = chunks

    def on_finalized_text(self, text: str, stream_end: bool = False) -> None:
        if text:
            self.chunks.put(text)


def model_generate_fn(model, tokenizer) -> GenerateFn:
    """A `GenerateFn` over `model.generate`: it runs in a worker thread (one at a time) and its text is yielded as
    it is decoded. Closing the iterator early (the client left) stops generation at the next token."""
    lock = threading.Lock()
    end = object()

    def generate(inputs: dict, params: GenerationParams) -> Iterator[str]:
        chunks: queue.Queue = queue.Queue()
        cancelled = threading.Event()
        sampling = params.temperature > 0
        kwargs = dict(
            {name: value.to(model.device) if torch.is_tensor(value) else value for name, value in inputs.items()},
            max_new_tokens=params.max_new_tokens,
            do_sample=sampling,
            temperature=params.temperature if sampling else None,
            top_p=params.top_p if sampling else None,
            top_k=None,
            eos_token_id=tokenizer.eos_token_id,
            pad_token_id=tokenizer.pad_token_id,
            streamer=_QueueTextStreamer(tokenizer, chunks),
            stopping_criteria=StoppingCriteriaList([_Cancelled(cancelled)]),
        )

        def run():
            try:
                with lock, torch.inference_mode():
                    if params.seed is not None:
                        torch.manual_seed(params.seed)
                    model.generate(**kwargs)
            except BaseException as error:  # handed to the request thread, which reports it
                chunks.put(error)
            finally:
                chunks.put(end)

        worker = threading.Thread(target=run, name="inkling2-generate", daemon=True)
        worker.start()
        try:
            while (item := chunks.get()) is not end:
                if isinstance(item, BaseException):
                    raise item
                yield item
        finally:
            cancelled.set()
            worker.join()

    return generate


# ---------------------------------------------------------------------------------------------------------------
# OpenAI requests -> the chat template's conventions


def to_template_messages(messages: list) -> list[dict]:
    """OpenAI chat messages in the form the chat template and the processor read.

    `developer` becomes `system`; `image_url` parts become `{"type": "image", "url": ...}` (what transformers'
    processors load, data: URLs included); tool-call `arguments` strings are parsed, so the template writes them
    compactly as tml does."""
    if not isinstance(messages, list) or not messages:
        raise RequestError("'messages' must be a non-empty list")
    converted = []
    for message in messages:
        if not isinstance(message, dict) or "role" not in message:
            raise RequestError("every message needs a 'role'")
        message = dict(message)
        if message["role"] == "developer":
            message["role"] = "system"
        if isinstance(message.get("content"), list):
            message["content"] = [_to_template_part(part) for part in message["content"]]
        if message.get("tool_calls"):
            message["tool_calls"] = [_to_template_tool_call(call) for call in message["tool_calls"]]
        converted.append(message)
    return converted


def _to_template_part(part):
    if isinstance(part, dict) and part.get("type") == "image_url":
        image_url = part.get("image_url")
        url = image_url.get("url") if isinstance(image_url, dict) else image_url
        if not isinstance(url, str):
            raise RequestError("an image_url part needs image_url.url")
        return {"type": "image", "url": url}
    return part


def _to_template_tool_call(call):
    function = call.get("function") if isinstance(call, dict) else None
    if not isinstance(function, dict):
        raise RequestError("every tool call needs a 'function'")
    arguments = function.get("arguments")
    if isinstance(arguments, str):
        try:
            arguments = json.loads(arguments) if arguments.strip() else {}
        except ValueError:
            raise RequestError(f"tool call arguments are not JSON: {arguments[:200]!r}") from None
    return {**call, "function": {**function, "arguments": arguments}}


def _has_images(messages: list[dict]) -> bool:
    return any(
        isinstance(part, dict) and part.get("type") == "image"
        for message in messages
        if isinstance(message.get("content"), list)
        for part in message["content"]
    )


# ---------------------------------------------------------------------------------------------------------------
# The protocol, without HTTP


def _compact_json(value) -> str:
    # compact, key order and non-ASCII kept: the JSON the model wrote, byte for byte in the common case
    return json.dumps(value, ensure_ascii=False, separators=(",", ":"))


class ChatCompletions:
    """OpenAI chat completions over a chat template, a `GenerateFn` and the response parser."""

    def __init__(
        self,
        tokenizer,
        generate_fn: GenerateFn,
        processor=None,
        model_id: str = "inkling-2-small",
        default_max_tokens: int = DEFAULT_MAX_TOKENS,
        default_effort=None,
    ):
        self.tokenizer = tokenizer
        self.generate_fn = generate_fn
        self.processor = processor
        self.model_id = model_id
        self.default_max_tokens = default_max_tokens
        self.default_effort = default_effort  # None: the template's default (0.9)
        self.created = int(time.time())

    def models(self) -> dict:
        return {
            "object": "list",
            "data": [{"id": self.model_id, "object": "model", "created": self.created, "owned_by": "inkling2"}],
        }

    def prepare(self, body: dict) -> tuple[dict, GenerationParams]:
        """The model inputs and sampling parameters of a request."""
        if not isinstance(body, dict):
            raise RequestError("the request body must be a JSON object")
        messages = to_template_messages(body.get("messages"))
        template_kwargs = dict(body.get("chat_template_kwargs") or {})
        effort = body.get("reasoning_effort", self.default_effort)
        if effort is not None:
            template_kwargs.setdefault("effort", effort)
        tools = body.get("tools") or None
        if _has_images(messages):
            if self.processor is None:
                raise RequestError("this server has no image processor: serve a multimodal checkpoint for images")
            render = self.processor.apply_chat_template
        else:
            render = self.tokenizer.apply_chat_template
        try:
            inputs = render(
                messages,
                tools=tools,
                add_generation_prompt=True,
                tokenize=True,
                return_dict=True,
                return_tensors="pt",
                **template_kwargs,
            )
        except (jinja2.TemplateError, ValueError, TypeError) as error:  # the template's own checks, bad images
            raise RequestError(str(error)) from error
        max_tokens = next(
            (body[key] for key in ("max_completion_tokens", "max_tokens") if body.get(key) is not None),
            self.default_max_tokens,
        )
        temperature = body.get("temperature")
        if not isinstance(max_tokens, int) or isinstance(max_tokens, bool) or max_tokens < 1:
            raise RequestError("max_tokens must be a positive integer")
        if temperature is not None and (not isinstance(temperature, (int, float)) or temperature < 0):
            raise RequestError("temperature must be a number >= 0")
        params = GenerationParams(
            max_new_tokens=max_tokens,
            temperature=1.0 if temperature is None else float(temperature),
            top_p=body.get("top_p"),
            seed=body.get("seed"),
        )
        return dict(inputs), params

    def _run(self, body: dict) -> tuple[Iterator[ResponseDelta], Inkling2ResponseParser, dict]:
        """Start a generation: its deltas (lazily), the parser holding the result, and usage counters."""
        inputs, params = self.prepare(body)
        parser = Inkling2ResponseParser()
        usage = {"prompt_tokens": int(inputs["input_ids"].shape[-1]), "completion_tokens": 0}
        chunks = self.generate_fn(inputs, params)

        def deltas() -> Iterator[ResponseDelta]:
            text = []
            try:
                for chunk in chunks:
                    text.append(chunk)
                    yield from parser.feed(chunk)
                yield from parser.finish()
            finally:
                if hasattr(chunks, "close"):
                    chunks.close()  # stops generation when our consumer stopped early
                generated = "".join(text)
                usage["completion_tokens"] = len(self.tokenizer(generated, add_special_tokens=False)["input_ids"])
                usage["total_tokens"] = usage["prompt_tokens"] + usage["completion_tokens"]

        return deltas(), parser, usage

    @staticmethod
    def _finish_reason(parser: Inkling2ResponseParser) -> str:
        if not parser.ended_turn:
            return "length"
        return "tool_calls" if parser.tool_calls else "stop"

    @staticmethod
    def _openai_tool_call(call: dict) -> dict:
        function = call["function"]
        return {
            "id": f"call_{uuid.uuid4().hex[:24]}",
            "type": "function",
            "function": {"name": function["name"], "arguments": _compact_json(function["arguments"])},
        }

    def complete(self, body: dict) -> dict:
        """A whole `chat.completion`."""
        deltas, parser, usage = self._run(body)
        for _ in deltas:
            pass
        parsed = parser.message
        message = {"role": "assistant", "content": parsed["content"] or None}
        if parsed["thinking"] is not None:
            message["reasoning_content"] = message["reasoning"] = parsed["thinking"]
        if parsed["tool_calls"]:
            message["tool_calls"] = [self._openai_tool_call(call) for call in parsed["tool_calls"]]
        if parsed.get("invalid_tool_calls"):
            message["invalid_tool_calls"] = parsed["invalid_tool_calls"]
        if message["content"] is None and not parsed["tool_calls"]:
            message["content"] = ""
        return {
            "id": f"chatcmpl-{uuid.uuid4().hex}",
            "object": "chat.completion",
            "created": int(time.time()),
            "model": self.model_id,
            "choices": [{"index": 0, "message": message, "finish_reason": self._finish_reason(parser)}],
            "usage": usage,
        }

    def stream(self, body: dict) -> Iterator[dict]:
        """`chat.completion.chunk`s: role first, then reasoning, content and tool-call deltas, then the finish
        reason (and usage, when `stream_options.include_usage`). The request is validated before the first one."""
        deltas, parser, usage = self._run(body)
        completion_id, created = f"chatcmpl-{uuid.uuid4().hex}", int(time.time())

        def chunk(delta: dict, finish_reason=None) -> dict:
            return {
                "id": completion_id,
                "object": "chat.completion.chunk",
                "created": created,
                "model": self.model_id,
                "choices": [{"index": 0, "delta": delta, "finish_reason": finish_reason}],
            }

        def chunks() -> Iterator[dict]:
            yield chunk({"role": "assistant", "content": ""})
            try:
                for delta in deltas:
                    if delta.kind == "thinking":
                        yield chunk({"reasoning_content": delta.text, "reasoning": delta.text})
                    elif delta.kind == "content":
                        yield chunk({"content": delta.text})
                    elif delta.kind == "tool_call":
                        yield chunk({"tool_calls": [{"index": delta.index, **self._openai_tool_call(delta.tool_call)}]})
                    else:
                        yield chunk({"invalid_tool_calls": [delta.tool_call]})
            finally:
                deltas.close()
            yield chunk({}, finish_reason=self._finish_reason(parser))
            if (body.get("stream_options") or {}).get("include_usage"):
                yield {**chunk({}), "choices": [], "usage": usage}

        return chunks()


# ---------------------------------------------------------------------------------------------------------------
# HTTP


def _error_body(message: str, kind: str = "invalid_request_error") -> dict:
    return {"error": {"message": message, "type": kind, "param": None, "code": None}}


class _Handler(BaseHTTPRequestHandler):
    server: Inkling2Server
    protocol_version = "HTTP/1.0"  # one request per connection: streams end when the connection closes

    def log_message(self, format, *args):  # quiet unless asked
        if self.server.verbose:
            super().log_message(format, *args)

    def _send_json(self, status: int, payload: dict) -> None:
        data = json.dumps(payload, ensure_ascii=False).encode()
        self.send_response(status)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    def do_GET(self):
        path = self.path.split("?")[0].rstrip("/")
        if path == "/v1/models":
            self._send_json(200, self.server.app.models())
        elif path in ("/health", "/v1/health"):
            self._send_json(200, {"status": "ok"})
        else:
            self._send_json(404, _error_body(f"no route {self.path}", "not_found_error"))

    def do_POST(self):
        if self.path.split("?")[0].rstrip("/") != "/v1/chat/completions":
            self._send_json(404, _error_body(f"no route {self.path}", "not_found_error"))
            return
        try:
            length = int(self.headers.get("Content-Length") or 0)
            if not 0 < length <= MAX_REQUEST_BYTES:
                raise RequestError(f"the body must have a Content-Length between 1 and {MAX_REQUEST_BYTES}")
            try:
                body = json.loads(self.rfile.read(length))
            except ValueError as error:
                raise RequestError(f"the body is not JSON: {error}") from None
            if isinstance(body, dict) and body.get("stream"):
                self._stream(self.server.app.stream(body))
            else:
                self._send_json(200, self.server.app.complete(body))
        except RequestError as error:
            self._send_json(400, _error_body(str(error)))
        except Exception as error:  # a server bug or a generation failure: say so, keep serving
            self.log_error("request failed: %r", error)
            self._send_json(500, _error_body(f"{type(error).__name__}: {error}", "server_error"))

    def _stream(self, chunks: Iterator[dict]) -> None:
        """Server-sent events; `chunks` comes from `ChatCompletions.stream`, which validated the request already."""
        self.send_response(HTTPStatus.OK)
        self.send_header("Content-Type", "text/event-stream")
        self.send_header("Cache-Control", "no-cache")
        self.end_headers()
        try:
            for chunk in chunks:
                self.wfile.write(f"data: {json.dumps(chunk, ensure_ascii=False)}\n\n".encode())
                self.wfile.flush()
            self.wfile.write(b"data: [DONE]\n\n")
            self.wfile.flush()
        except (BrokenPipeError, ConnectionResetError):
            pass  # the client left; closing the chunks below stops generation
        except Exception as error:  # headers are out: report it in the stream, as OpenAI does
            self.log_error("stream failed: %r", error)
            payload = _error_body(f"{type(error).__name__}: {error}", "server_error")
            self.wfile.write(f"data: {json.dumps(payload)}\n\n".encode())
        finally:
            chunks.close()


class Inkling2Server(ThreadingHTTPServer):
    """The HTTP server around a `ChatCompletions`. `start()` serves from a background thread, `stop()` ends it and
    waits for every request thread; it is also a context manager. `port=0` picks a free port (`.port`)."""

    daemon_threads = False  # request threads are joined on close
    block_on_close = True

    def __init__(self, app: ChatCompletions, host: str = "127.0.0.1", port: int = 8000, verbose: bool = False):
        self.app = app
        self.verbose = verbose
        self._thread: threading.Thread | None = None
        super().__init__((host, port), _Handler)

    @property
    def port(self) -> int:
        return self.server_address[1]

    @property
    def base_url(self) -> str:
        return f"http://{self.server_address[0]}:{self.port}/v1"

    def start(self) -> Inkling2Server:
        self._thread = threading.Thread(target=self.serve_forever, name="inkling2-serve", daemon=True)
        self._thread.start()
        return self

    def stop(self) -> None:
        if self._thread is not None:
            self.shutdown()
            self._thread.join()
            self._thread = None
        self.server_close()

    def __exit__(self, *exc):
        self.stop()


def serve(
    model,
    tokenizer,
    processor=None,
    host: str = "127.0.0.1",
    port: int = 8000,
    model_id: str = "inkling-2-small",
    default_max_tokens: int = DEFAULT_MAX_TOKENS,
    default_effort=None,
) -> None:
    """Serve `model` until interrupted (Ctrl-C)."""
    if default_effort is not None:  # a bad --effort fails now, not on every request
        tokenizer.apply_chat_template([{"role": "user", "content": ""}], tokenize=False, effort=default_effort)
    app = ChatCompletions(
        tokenizer,
        model_generate_fn(model, tokenizer),
        processor=processor,
        model_id=model_id,
        default_max_tokens=default_max_tokens,
        default_effort=default_effort,
    )
    with Inkling2Server(app, host, port, verbose=True) as server:
        print(f"[serve] {model_id} on {server.base_url} (OpenAI-compatible; Ctrl-C stops)", flush=True)
        try:
            server.serve_forever()
        except KeyboardInterrupt:
            pass


__all__ = [
    "ChatCompletions",
    "GenerateFn",
    "GenerationParams",
    "Inkling2Server",
    "RequestError",
    "model_generate_fn",
    "serve",
    "to_template_messages",
]
