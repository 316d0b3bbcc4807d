"""Reading Inkling-2's replies: reasoning, visible text and tool calls, from generated text or ids, whole or streamed.

The model writes a turn as blocks (SPEC §4); the generation prompt already holds the first `<|message_model|>`:

    <|content_thinking|>...<|end_message|>                                   reasoning
    <|message_model|><|content_text|>...<|end_message|>                      visible text
    <|message_model|>get_weather<|content_invoke_tool_json|>{"name": "get_weather", "args": {...}}<|end_message|>
    <|content_model_end_sampling|>                                           end of turn (eos)

Two parsers read it:

- `chat_template.RESPONSE_TEMPLATE`, transformers' declarative `response_template`, which the tokenizer carries: so
  `tokenizer.parse_response(ids, prefix=prompt)`, `tokenizer.get_response_parser(prefix=prompt).feed(text)` and the
  text-generation pipelines parse by themselves. It reads well-formed output; what it cannot express (the tool
  JSON must start `{"name": "...", "args":`; a truncated or malformed call keeps `arguments` as raw text; text
  outside any block is dropped) is why there is a second one.
- `Inkling2ResponseParser` (and `parse_response`, `Inkling2ResponseStreamer`): our incremental parser. It never
  raises on model output: blocks in any order, a turn cut off by `max_new_tokens`, malformed tool JSON and stray
  text all end up in the result (`invalid_tool_calls`, `truncated`), and `feed()` returns deltas as they become
  certain, so a server can stream reasoning, content and tool calls.

Only real special tokens are markers. Ids are read through `decode_for_parsing` (tokenization_inkling2.py): special
ids are spelled as markers, and text the model wrote with ordinary tokens gets U+FDD0 after every `<`, so an
ordinary-token spelling of `<|end_message|>` stays text (and comes out as written). Text input is read as given:
there every spelling is a marker, except the escaped form the chat template and `decode_for_parsing` write.

A tool call is named by its JSON `name` (tml, vLLM and SGLang do the same), whatever its block header says.

The message both return is `{"role": "assistant", "content": str, "thinking": str | None, "tool_calls": [{"type":
"function", "function": {"name": str, "arguments": dict}}]}`, which the chat template renders back as the same
blocks. Several blocks of one kind are concatenated.
"""

from __future__ import annotations

import json
import queue
import re
from dataclasses import dataclass

from transformers import TextStreamer

from .chat_template import (
    CONTENT_TEXT,
    CONTENT_THINKING,
    END_MESSAGE,
    END_OF_TURN,
    INVOKE_TOOL_JSON,
    MESSAGE_MODEL,
    RESPONSE_TEMPLATE,
    unescape_text,
)
from .tokenization_inkling2 import build_inkling2_tokenizer, decode_for_parsing

_SPECIAL = re.compile(r"<\|[a-z0-9_]+\|>")
_SPECIAL_PREFIX = re.compile(r"<(?:\|[a-z0-9_]*\|?)?")  # what a special token looks like while half-received
_TOOL_NAME = re.compile(r"[A-Za-z_][\w.\-]*")
MAX_TOOL_NAME = 256  # longer text between blocks is taken for stray text: it streams as content
_HEADER, _THINKING, _TEXT, _TOOL, _DONE = "header", "thinking", "text", "tool", "done"


@dataclass
class ResponseDelta:
    """One increment of a streamed reply. `kind` is "thinking" or "content" (with `text`), "tool_call" (with
    `tool_call`, the complete call, and `index`), or "invalid_tool_call" (with `tool_call` = {name, raw, error})."""

    kind: str
    text: str = ""
    tool_call: dict | None = None
    index: int | None = None


def _held_back_from(text: str) -> int:
    """Where a possibly half-received special token starts at the end of `text` (len(text) if none)."""
    start = text.rfind("<")
    if start >= 0 and _SPECIAL_PREFIX.fullmatch(text, start):
        return start
    return len(text)


def _read_tool_call(header_name: str, raw: str) -> tuple[dict | None, str | None]:
    """The tool call in one invoke block's body, or why it is not one. Its JSON `name` names it (as tml reads it); the
    block header is only used when the JSON has no name."""
    try:
        payload = json.loads(raw)
    except ValueError as error:
        return None, f"invalid JSON: {error}"
    if not isinstance(payload, dict):
        return None, "the tool call is not a JSON object"
    name = payload.get("name", header_name)
    if not isinstance(name, str) or not name:
        return None, "the tool call has no name"
    arguments = payload.get("args", {})
    if not isinstance(arguments, dict):
        return None, "the tool call's args are not a JSON object"
    return {"type": "function", "function": {"name": name, "arguments": arguments}}, None


class Inkling2ResponseParser:
    """Incremental parser of one model turn: `feed(text)` as text arrives (special tokens spelled out, as
    `decode(..., skip_special_tokens=False)` gives them), `finish()` at the end; `message` is the result so far.

    Text is released as soon as it cannot be part of a special token; a tool call is released whole when its block
    closes. Nothing in the model's output makes it raise.
    """

    def __init__(self):
        self._buffer = ""
        self._state = _HEADER
        self._header = ""  # text between blocks: a tool name before `<|content_invoke_tool_json|>`, else stray
        self._tool_name = ""
        self._tool_raw = ""
        self._finished = False
        self.thinking: list[str] = []
        self.content: list[str] = []
        self.tool_calls: list[dict] = []
        self.invalid_tool_calls: list[dict] = []
        self.ended_turn = False  # saw `<|content_model_end_sampling|>`
        self._saw_marker = False  # any special token so far: without one, the text is not in the block format
        self._stray_open = False  # stray text was released since the last special token

    @property
    def message(self) -> dict:
        message = {
            "role": "assistant",
            "content": "".join(self.content),
            "thinking": "".join(self.thinking) if self.thinking else None,
            "tool_calls": list(self.tool_calls),
        }
        if self.invalid_tool_calls:
            message["invalid_tool_calls"] = list(self.invalid_tool_calls)
        if self._finished and not self.ended_turn:
            message["truncated"] = True
        return message

    def feed(self, text: str) -> list[ResponseDelta]:
        if self._finished:
            raise RuntimeError("this parser has finished; make a new one for the next turn")
        self._buffer += text
        deltas: list[ResponseDelta] = []
        self._run(deltas, at_end=False)
        return deltas

    def finish(self) -> list[ResponseDelta]:
        """Flush what is left; a block still open means the output was cut off (`message["truncated"]`)."""
        deltas: list[ResponseDelta] = []
        if not self._finished:
            self._run(deltas, at_end=True)
            if self._state in (_THINKING, _TEXT):
                self._state = _HEADER
            elif self._state == _TOOL:
                self._close_tool_call(deltas, truncated=True)
            elif self._saw_marker and _TOOL_NAME.fullmatch(unescape_text(self._header).strip()):
                # cut off between a tool's name and its kind token; text without any block token is content
                self._tool_name, self._header = unescape_text(self._header).strip(), ""
                self._close_tool_call(deltas, truncated=True)
            self._release_stray_header(deltas)
            self._finished = True
        return deltas

    # ---- the state machine ----

    def _run(self, deltas: list[ResponseDelta], at_end: bool) -> None:
        position = 0
        while position < len(self._buffer) and self._state != _DONE:
            match = _SPECIAL.search(self._buffer, position)
            if match is None:
                stop = len(self._buffer) if at_end else _held_back_from(self._buffer)
                stop = max(stop, position)
                if self._state == _HEADER:
                    # a header is only known at its kind token (tml reads any text before an invoke as the tool's
                    # name); past MAX_TOOL_NAME characters it is stray text, and streams from there on
                    self._header += self._buffer[position:stop]
                    if not at_end and (self._stray_open or len(self._header) > MAX_TOOL_NAME):
                        self._release_stray_header(deltas)
                        self._stray_open = True
                else:
                    self._body_text(deltas, self._buffer[position:stop])
                position = stop
                break
            before, token = self._buffer[position : match.start()], match.group()
            position = match.end()
            self._saw_marker = True
            if self._state == _HEADER:
                self._header += before
                self._header_token(deltas, token)
                self._stray_open = False
            else:
                self._body_text(deltas, before)
                self._body_token(deltas, token)
        self._buffer = "" if self._state == _DONE else self._buffer[position:]

    def _body_text(self, deltas: list[ResponseDelta], text: str) -> None:
        if not text:
            return
        if self._state == _TOOL:
            self._tool_raw += text
        else:
            self._emit_text(deltas, "thinking" if self._state == _THINKING else "content", text)

    def _header_token(self, deltas: list[ResponseDelta], token: str) -> None:
        if token == INVOKE_TOOL_JSON:
            self._state, self._tool_name, self._tool_raw = _TOOL, unescape_text(self._header).strip(), ""
            self._header = ""
            return
        self._release_stray_header(deltas)
        if token == CONTENT_THINKING:
            self._state = _THINKING
        elif token == CONTENT_TEXT:
            self._state = _TEXT
        elif token == END_OF_TURN:
            self._state, self.ended_turn = _DONE, True
        # `<|message_model|>`, an empty `<|end_message|>` and kinds we do not read leave us between blocks

    def _body_token(self, deltas: list[ResponseDelta], token: str) -> None:
        if token not in (END_MESSAGE, END_OF_TURN, MESSAGE_MODEL):
            self._body_text(deltas, token)  # any other special token inside a body is part of it
            return
        if self._state == _TOOL:
            self._close_tool_call(deltas, truncated=token != END_MESSAGE)
        self._state = _HEADER
        if token == END_OF_TURN:
            self._state, self.ended_turn = _DONE, True

    def _emit_text(self, deltas: list[ResponseDelta], kind: str, text: str) -> None:
        text = unescape_text(text)  # never half an escape: a final `<` is held back until the next character
        (self.thinking if kind == "thinking" else self.content).append(text)
        if deltas and deltas[-1].kind == kind:
            deltas[-1].text += text
        else:
            deltas.append(ResponseDelta(kind, text=text))

    def _release_stray_header(self, deltas: list[ResponseDelta]) -> None:
        """Text outside any block is kept as visible content rather than lost (whitespace alone is dropped, unless
        it continues stray text already released)."""
        stray, self._header = self._header, ""
        if stray.strip() or (stray and self._stray_open):
            self._emit_text(deltas, "content", stray)


    def _close_tool_call(self, deltas: list[ResponseDelta], truncated: bool) -> None:
        self._tool_raw = unescape_text(self._tool_raw)
        call, error = _read_tool_call(self._tool_name, self._tool_raw)
        if call is not None:
            self.tool_calls.append(call)
            deltas.append(ResponseDelta("tool_call", tool_call=call, index=len(self.tool_calls) - 1))
        else:
            if truncated:
                error = f"the block was cut off ({error})"
            invalid = {"name": self._tool_name, "raw": self._tool_raw, "error": error}
            self.invalid_tool_calls.append(invalid)
            deltas.append(ResponseDelta("invalid_tool_call", tool_call=invalid))
        self._tool_name = self._tool_raw = ""


_default_tokenizer = None


def _decode(output, tokenizer) -> str:
    if isinstance(output, str):
        return output
    global _default_tokenizer
    if tokenizer is None:
        if _default_tokenizer is None:
            _default_tokenizer = build_inkling2_tokenizer()
        tokenizer = _default_tokenizer
    ids = output.tolist() if hasattr(output, "tolist") else list(output)
    if ids and isinstance(ids[0], list):
        if len(ids) != 1:
            raise ValueError("parse_response reads one sequence; parse each row of a batch on its own")
        ids = ids[0]
    return decode_for_parsing(tokenizer, ids)


def parse_response(output, tokenizer=None) -> dict:
    """The assistant message in one generated turn: `output` is text (special tokens spelled out) or the new token
    ids (a list or 1-D tensor; read with `decode_for_parsing` and `tokenizer`, default: our tokenizer, so only real
    special-token ids are markers). A leading `<|message_model|>` is accepted too, so the generated ids with or
    without the prompt's last token both work; pad tokens after the end of the turn are ignored."""
    parser = Inkling2ResponseParser()
    parser.feed(_decode(output, tokenizer))
    parser.finish()
    return parser.message


class IncrementalTextStreamer(TextStreamer):
    """A `TextStreamer` that releases text as soon as it is whole characters, special tokens spelled out.

    `TextStreamer` holds text back until a space or newline, and Inkling's blocks often have neither; this one
    decodes the tokens received since the last release and releases them unless they end inside a UTF-8 character.
    The text goes to `on_finalized_text`, as with `TextStreamer`. Batch size 1 only. With `for_parsing=True` the
    tokens are decoded with `decode_for_parsing` (what `Inkling2ResponseParser` should be fed: only real special
    tokens are markers; tokenizing that text gives the same ids).
    """

    def __init__(self, tokenizer, skip_prompt: bool = True, for_parsing: bool = False):
        super().__init__(tokenizer, skip_prompt=skip_prompt, skip_special_tokens=False)
        self.for_parsing = for_parsing

    def _decode_cache(self) -> str:
        if self.for_parsing:
            return decode_for_parsing(self.tokenizer, self.token_cache)
        return self.tokenizer.decode(self.token_cache, **self.decode_kwargs)

    def put(self, value) -> None:
        if value.dim() > 1:
            if value.shape[0] > 1:
                raise ValueError(f"{type(self).__name__} streams batch size 1 only")
            value = value[0]
        if self.skip_prompt and self.next_tokens_are_prompt:
            self.next_tokens_are_prompt = False
            return
        self.token_cache.extend(value.tolist())
        text = self._decode_cache()
        if not text.endswith("\ufffd"):  # else wait for the rest of the character
            self.token_cache = []
            self.on_finalized_text(text)

    def end(self) -> None:
        text = self._decode_cache() if self.token_cache else ""
        self.token_cache = []
        self.next_tokens_are_prompt = True
        self.on_finalized_text(text, stream_end=True)


class Inkling2ResponseStreamer(IncrementalTextStreamer):
    """A `generate(..., streamer=...)` streamer that parses while the model writes.

    Each released piece of text goes through an `Inkling2ResponseParser`; every `ResponseDelta` goes to `on_delta`
    when given, else into a queue for iteration from another thread (`for delta in streamer`, like
    `TextIteratorStreamer`). The final message is `streamer.parser.message`.
    """

    def __init__(self, tokenizer, skip_prompt: bool = True, on_delta=None, timeout: float | None = None):
        super().__init__(tokenizer, skip_prompt=skip_prompt, for_parsing=True)
        self.parser = Inkling2ResponseParser()
        self.on_delta = on_delta
        self.timeout = timeout
        self._queue: queue.Queue = queue.Queue()
        self._end = object()

    def on_finalized_text(self, text: str, stream_end: bool = False) -> None:
        deltas = self.parser.feed(text) if text else []
        if stream_end:
            deltas += self.parser.finish()
        for delta in deltas:
            if self.on_delta is not None:
                self.on_delta(delta)
            else:
                self._queue.put(delta)
        if stream_end and self.on_delta is None:
            self._queue.put(self._end)

    def __iter__(self):
        return self

    def __next__(self) -> ResponseDelta:
        item = self._queue.get(timeout=self.timeout)
        if item is self._end:
            raise StopIteration
        return item


__all__ = [
    "RESPONSE_TEMPLATE",
    "IncrementalTextStreamer",
    "Inkling2ResponseParser",
    "Inkling2ResponseStreamer",
    "ResponseDelta",
    "parse_response",
]
