"""Chat completions without HTTP: a validated request becomes model inputs (images fetched under the media policy,
the chat template rendered, every bound checked before any compute), and the model's text becomes OpenAI's message
or stream chunks (reasoning, content, tool calls; stop sequences; usage from token counts).

    ChatCompletionRequest --(ChatCompletions.prepare)--> PreparedRequest (inputs, sampling, grammar)
    worker: (text, tokens) events --(ReplyAssembler)--> ResponseDelta -> OpenAI message / chunks
"""

from __future__ import annotations

import json
import time
import uuid
from dataclasses import dataclass, field

import jinja2

from ..processing.response_parsing import Inkling2ResponseParser, ResponseDelta
from .media import MediaError, load_media_image
from .protocol import ChatCompletionRequest, ChatMessage, RequestError
from .settings import ServerSettings
from .worker import SamplingParams

TEMPLATE_KWARGS = frozenset({"effort"})  # what the chat template reads; anything else would reach apply_chat_template


@dataclass
class PreparedRequest:
    request: ChatCompletionRequest
    inputs: dict
    params: SamplingParams
    prompt_tokens: int
    logits_processors: list = field(default_factory=list)


def _compact_json(value) -> str:
    # compact, key order and non-ASCII kept: the JSON the model wrote, byte for byte in the common case
    return json.dumps(value, ensure_ascii=False, separators=(",", ":"))


def to_template_messages(messages: list[ChatMessage], load_image=None) -> list[dict]:
    """OpenAI messages in the form the chat template and the processor read: `developer` is `system`, image parts
    are `{"type": "image", "image": PIL image}` (loaded by `load_image`, which applies the media policy), tool-call
    arguments are parsed so the template writes them compactly as tml does."""
    converted = []
    for index, message in enumerate(messages):
        entry = {"role": "system" if message.role == "developer" else message.role}
        if isinstance(message.content, list):
            entry["content"] = [_template_part(part, load_image, index) for part in message.content]
        elif message.content is not None:
            entry["content"] = message.content
        if message.reasoning_content is not None:
            entry["reasoning_content"] = message.reasoning_content
        for name in ("name", "tool_call_id"):
            if getattr(message, name) is not None:
                entry[name] = getattr(message, name)
        if message.tool_calls:
            entry["tool_calls"] = [_template_tool_call(call, index) for call in message.tool_calls]
        converted.append(entry)
    return converted


def _template_part(part, load_image, index: int) -> dict:
    if part.type == "text":
        return {"type": "text", "text": part.text}
    if load_image is None:
        raise RequestError("this server has no image processor: serve a multimodal checkpoint for images")
    try:
        return {"type": "image", "image": load_image(part.image_url.url)}
    except MediaError as error:
        raise RequestError(str(error), param=f"messages.{index}.content") from None


def _template_tool_call(call, index: int) -> dict:
    arguments = call.function.arguments
    try:
        parsed = json.loads(arguments) if arguments.strip() else {}
    except ValueError:
        raise RequestError(f"tool call arguments are not JSON: {arguments[:200]!r}", f"messages.{index}") from None
    if not isinstance(parsed, dict):
        raise RequestError("tool call arguments must be a JSON object", f"messages.{index}")
    return {"id": call.id, "type": "function", "function": {"name": call.function.name, "arguments": parsed}}


def _texts(message: ChatMessage):
    """Every string of a message that the template writes."""
    if isinstance(message.content, str):
        yield message.content
    elif message.content:
        yield from (part.text for part in message.content if part.type == "text")
    yield from (text for text in (message.reasoning_content, message.name) if text)
    for call in message.tool_calls or []:
        yield call.function.arguments


def count_images(request: ChatCompletionRequest) -> int:
    return sum(
        part.type == "image_url"
        for message in request.messages
        if isinstance(message.content, list)
        for part in message.content
    )


class ChatCompletions:
    """Request -> model inputs, under `settings`' bounds. `max_position_embeddings` bounds `max_model_len`."""

    def __init__(self, tokenizer, settings: ServerSettings, processor=None, max_position_embeddings: int | None = None):
        self.tokenizer, self.processor, self.settings = tokenizer, processor, settings
        limit = settings.max_model_len or max_position_embeddings
        if limit is None:
            raise ValueError("max_model_len: give it, or a model whose config has max_position_embeddings")
        if max_position_embeddings is not None and limit > max_position_embeddings:
            raise ValueError(f"max_model_len {limit:,} is above the model's {max_position_embeddings:,} positions")
        self.max_model_len = limit
        self.max_token_length = max(len(token) for token in tokenizer.get_vocab())  # byte-level: a char per byte
        if settings.default_effort is not None:  # a bad --effort fails now, not on every request
            probe = [{"role": "user", "content": ""}]
            tokenizer.apply_chat_template(probe, tokenize=False, effort=settings.default_effort)

    def prepare(self, request: ChatCompletionRequest) -> PreparedRequest:
        """Blocking (fetches images, tokenizes): run it off the event loop."""
        images = count_images(request)
        if images > self.settings.max_images_per_request:
            raise RequestError(
                f"{images} images in one request; this server takes at most {self.settings.max_images_per_request}",
                "messages",
            )
        load_image = None
        if self.processor is not None:
            policy = self.settings.media

            def load_image(url):
                return load_media_image(url, policy)

        self._check_text_length(request)
        messages = to_template_messages(request.messages, load_image)
        tools = [tool.model_dump(exclude_none=True) for tool in request.tools or []] or None
        inputs = self._render(request, messages, tools, images > 0)
        prompt_tokens = int(inputs["input_ids"].shape[-1])
        params = self._sampling(request, prompt_tokens)
        constraints = self._constraints(request, tools, params, prompt_tokens)
        return PreparedRequest(request, inputs, params, prompt_tokens, constraints)

    def _check_text_length(self, request: ChatCompletionRequest) -> None:
        """Refuses, before tokenizing (seconds for megabytes), text that cannot fit: no token is longer than the
        vocabulary's longest, so more characters than `max_model_len` times that length are surely too many."""
        characters = sum(len(text) for message in request.messages for text in _texts(message))
        if characters > self.max_model_len * self.max_token_length:
            raise RequestError(
                f"the messages hold {characters:,} characters, more than {self.max_model_len:,} tokens can: this "
                f"server's context is {self.max_model_len:,} tokens",
                "messages",
                code="context_length_exceeded",
            )

    def _template_kwargs(self, request: ChatCompletionRequest) -> dict:
        kwargs = dict(request.chat_template_kwargs or {})
        if request.chat_template is not None:
            kwargs["chat_template"] = request.chat_template
        if "chat_template" in kwargs and not self.settings.trust_request_chat_template:
            raise RequestError(
                "this server does not take chat templates from requests (start it with --trust-request-chat-template "
                "to allow it)",
                "chat_template",
            )
        unknown = sorted(set(kwargs) - TEMPLATE_KWARGS - {"chat_template"})
        if unknown:
            raise RequestError(f"chat_template_kwargs: unknown {unknown}; the template reads only 'effort'",
                               "chat_template_kwargs")  # fmt: skip
        effort = request.reasoning_effort if request.reasoning_effort is not None else self.settings.default_effort
        if effort is not None:
            kwargs.setdefault("effort", effort)
        return kwargs

    def _render(self, request: ChatCompletionRequest, messages: list[dict], tools: list | None,
                has_images: bool) -> dict:  # fmt: skip
        if request.tool_choice == "none":
            tools = None  # not offered: the model is not to call one
        kwargs = self._template_kwargs(request)
        if has_images:
            render = self.processor.apply_chat_template
            kwargs["processor_kwargs"] = {"max_pixels": self.settings.max_image_pixels}
        else:
            render = self.tokenizer.apply_chat_template
        try:
            inputs = render(messages, tools=tools, add_generation_prompt=True, tokenize=True, return_dict=True,
                            return_tensors="pt", **kwargs)  # fmt: skip
        except (jinja2.TemplateError, ValueError, TypeError) as error:  # the template's own checks, bad images
            raise RequestError(str(error)[:1000]) from error
        except Exception as error:
            if "chat_template" not in kwargs:
                raise
            # a (trusted) client's template: whatever it raises is the request's fault
            raise RequestError(f"the request's chat template failed: {type(error).__name__}: {str(error)[:500]}",
                               "chat_template") from error  # fmt: skip
        return dict(inputs)

    def _sampling(self, request: ChatCompletionRequest, prompt_tokens: int) -> SamplingParams:
        room = self.max_model_len - prompt_tokens
        if room < 1:
            raise RequestError(
                f"the prompt is {prompt_tokens:,} tokens (images included); this server's context is "
                f"{self.max_model_len:,} tokens (prompt + max_tokens): shorten the conversation",
                "messages",
                code="context_length_exceeded",
            )
        asked = request.max_completion_tokens or request.max_tokens
        if asked is not None and asked > room:
            raise RequestError(
                f"max_tokens {asked:,} + the prompt's {prompt_tokens:,} tokens exceed this server's context of "
                f"{self.max_model_len:,} tokens: ask for at most {room:,}",
                "max_tokens",
                code="context_length_exceeded",
            )
        return SamplingParams(
            max_new_tokens=asked or min(self.settings.default_max_tokens, room),
            temperature=1.0 if request.temperature is None else request.temperature,
            top_p=request.top_p,
            top_k=request.top_k,
            seed=request.seed,
        )

    def _constraints(self, request: ChatCompletionRequest, tools: list | None, params: SamplingParams,
                     prompt_tokens: int) -> list:  # fmt: skip
        """The grammar processor for tool_choice "required" / named and json_object / json_schema, else none. The
        reasoning before a constrained reply gets at most half of max_tokens, so the reply itself has room."""
        from ..generation.constrained import GrammarLogitsProcessor, reply_grammar
        from ..processing.tokenization_inkling2 import first_special_id

        tool_choice = request.tool_choice
        if tool_choice is not None and not isinstance(tool_choice, str):
            tool_choice = tool_choice.model_dump()
        response_format = request.response_format.model_dump(by_alias=True, exclude_none=True) if (
            request.response_format) else None  # fmt: skip
        try:
            grammar = reply_grammar(
                tools=tools,
                tool_choice=tool_choice,
                response_format=response_format,
                parallel_tool_calls=request.parallel_tool_calls is not False,
                max_thinking_tokens=params.max_new_tokens // 2,
                num_ordinary_tokens=first_special_id(self.tokenizer),
            )
        except ValueError as error:
            raise RequestError(str(error)[:1000], "response_format" if response_format else "tool_choice") from None
        if grammar is None:
            return []
        return [GrammarLogitsProcessor(self.tokenizer, grammar, prompt_tokens)]


# ---------------------------------------------------------------------------------------------------------------
# The model's text -> OpenAI's message and chunks


def openai_tool_call(call: dict) -> dict:
    function = call["function"]
    return {
        "id": f"call_{uuid.uuid4().hex[:24]}",
        "type": "function",
        "function": {"name": function["name"], "arguments": _compact_json(function["arguments"])},
    }


class ReplyAssembler:
    """Feeds the model's text through the response parser and the request's stop sequences. `feed` returns the
    deltas to send; `stopped` turns true when a stop sequence was met (the caller cancels the generation)."""

    def __init__(self, request: ChatCompletionRequest, prompt_tokens: int, max_new_tokens: int):
        self.request, self.parser = request, Inkling2ResponseParser()
        self.stops = request.stop_sequences
        self.hold = max((len(stop) for stop in self.stops), default=1) - 1
        self.pending_content = ""
        self.stopped = False
        self.max_new_tokens = max_new_tokens
        self.usage = {"prompt_tokens": prompt_tokens, "completion_tokens": 0, "total_tokens": prompt_tokens}
        self.content: list[str] = []
        self.tool_calls: list[dict] = []

    def feed(self, text: str, tokens: int) -> list[ResponseDelta]:
        self.usage["completion_tokens"] += tokens
        self.usage["total_tokens"] += tokens
        if self.stopped:
            return []
        return self._filter(self.parser.feed(text) if text else [])

    def finish(self) -> list[ResponseDelta]:
        deltas = [] if self.stopped else self._filter(self.parser.finish())
        if self.pending_content and not self.stopped:
            deltas.append(self._content(self.pending_content))
            self.pending_content = ""
        return deltas

    def _content(self, text: str) -> ResponseDelta:
        self.content.append(text)
        return ResponseDelta("content", text=text)

    def _filter(self, deltas: list[ResponseDelta]) -> list[ResponseDelta]:
        kept = []
        for delta in deltas:
            if self.stopped:
                break
            if delta.kind == "content" and self.stops:
                kept += self._content_until_stop(delta.text)
            elif delta.kind == "content":
                kept.append(self._content(delta.text))
            elif delta.kind in ("tool_call", "invalid_tool_call") and self.request.tool_choice == "none":
                continue  # no tool was offered: a call the model writes anyway is not answered as one
            else:
                if delta.kind == "tool_call":
                    self.tool_calls.append(delta.tool_call)
                kept.append(delta)
        return kept

    def _content_until_stop(self, text: str) -> list[ResponseDelta]:
        self.pending_content += text
        hits = [index for index in (self.pending_content.find(stop) for stop in self.stops) if index >= 0]
        if hits:
            released, self.pending_content, self.stopped = self.pending_content[: min(hits)], "", True
            return [self._content(released)] if released else []
        cut = len(self.pending_content) - self.hold
        if cut <= 0:
            return []
        released, self.pending_content = self.pending_content[:cut], self.pending_content[cut:]
        return [self._content(released)]

    @property
    def finish_reason(self) -> str:
        if self.stopped:
            return "stop"
        if self.tool_calls:
            return "tool_calls"
        if not self.parser.ended_turn and self.usage["completion_tokens"] >= self.max_new_tokens:
            return "length"
        return "stop"

    def message(self) -> dict:
        parsed = self.parser.message
        message = {"role": "assistant", "content": "".join(self.content) or None}
        if parsed["thinking"] is not None:
            message["reasoning_content"] = message["reasoning"] = parsed["thinking"]
        if self.tool_calls:
            message["tool_calls"] = [openai_tool_call(call) for call in self.tool_calls]
        if parsed.get("invalid_tool_calls") and self.request.tool_choice != "none":
            message["invalid_tool_calls"] = parsed["invalid_tool_calls"]
        if message["content"] is None and not self.tool_calls:
            message["content"] = ""
        return message


def completion(model_id: str, assembler: ReplyAssembler) -> dict:
    return {
        "id": f"chatcmpl-{uuid.uuid4().hex}",
        "object": "chat.completion",
        "created": int(time.time()),
        "model": model_id,
        "choices": [{"index": 0, "message": assembler.message(), "finish_reason": assembler.finish_reason}],
        "usage": dict(assembler.usage),
    }


class ChunkWriter:
    """`chat.completion.chunk`s of one stream: role first, then reasoning, content and tool-call deltas, the finish
    reason, and usage when `stream_options.include_usage`."""

    def __init__(self, model_id: str):
        self.model_id, self.id, self.created = model_id, f"chatcmpl-{uuid.uuid4().hex}", int(time.time())

    def chunk(self, delta: dict, finish_reason=None) -> dict:
        return {
            "id": self.id,
            "object": "chat.completion.chunk",
            "created": self.created,
            "model": self.model_id,
            "choices": [{"index": 0, "delta": delta, "finish_reason": finish_reason}],
        }

    def delta(self, delta: ResponseDelta) -> dict:
        if delta.kind == "thinking":
            return self.chunk({"reasoning_content": delta.text, "reasoning": delta.text})
        if delta.kind == "content":
            return self.chunk({"content": delta.text})
        if delta.kind == "tool_call":
            return self.chunk({"tool_calls": [{"index": delta.index, **openai_tool_call(delta.tool_call)}]})
        return self.chunk({"invalid_tool_calls": [delta.tool_call]})

    def usage(self, usage: dict) -> dict:
        return {**self.chunk({}), "choices": [], "usage": dict(usage)}


__all__ = ["ChatCompletions", "ChunkWriter", "PreparedRequest", "ReplyAssembler", "completion", "to_template_messages"]
