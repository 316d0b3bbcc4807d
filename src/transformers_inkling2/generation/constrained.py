"""Constrained decoding for OpenAI's `tool_choice` and `response_format`: a grammar of the whole reply, enforced by
masking logits in `generate()`.

`reply_grammar(...)` turns a request's `tools`, `tool_choice`, `response_format` (OpenAI chat-completions semantics)
into an llguidance grammar (Lark syntax) of one assistant turn in Inkling's block format, or None when nothing
constrains the reply. `GrammarLogitsProcessor` enforces it: a `transformers.LogitsProcessor` that sets every
token the grammar forbids to -inf, one llguidance matcher per batch row. Parse the result with
`processing.response_parsing.parse_response` (or `Inkling2ResponseParser`), as any other reply:

    from transformers import LogitsProcessorList
    from transformers_inkling2.generation.constrained import GrammarLogitsProcessor, reply_grammar
    from transformers_inkling2.processing.response_parsing import parse_response

    grammar = reply_grammar(tools=tools, tool_choice="required", max_thinking_tokens=512)
    inputs = tokenizer.apply_chat_template(messages, tools=tools, add_generation_prompt=True, return_dict=True,
                                           return_tensors="pt")
    processors = LogitsProcessorList([GrammarLogitsProcessor(tokenizer, grammar)]) if grammar else None
    output = model.generate(**inputs, max_new_tokens=1024, logits_processor=processors)
    message = parse_response(output[0, inputs["input_ids"].shape[1]:], tokenizer)  # message["tool_calls"], ...

Needs `llguidance` (`pip install transformers-inkling2[serve]`); it is imported only when a grammar is checked or
enforced, so that `reply_grammar` returning None and the rest of the package work without it.

The reply the grammar allows (the generation prompt already ends with `<|message_model|>`; each block is written
exactly as the chat template writes it for such a message, so `Inkling2ResponseParser` reads it and the template
renders the parsed message back to the same text):

    [<|content_thinking|>THINKING<|end_message|><|message_model|>]    optional reasoning, then the reply:
    tool_choice "required"        CALL (<|message_model|>CALL)*         one or more calls
                                                                        (exactly one: parallel_tool_calls=False)
    tool_choice {function: F}     CALL of F                             exactly one call
    response_format json_*        <|content_text|>JSON<|end_message|>   the visible text is JSON
    "auto" + a JSON format        CALL (<|message_model|>CALL)*  |  <|content_text|>JSON<|end_message|>
    where CALL = NAME<|content_invoke_tool_json|>{"name":"NAME","args":ARGS}<|end_message|>

and then the turn ends: the grammar allows only eos (`<|content_model_end_sampling|>`), which `generate()` stops
on. NAME is one of the offered tools; ARGS is JSON matching that tool's `parameters` schema (a tool without
parameters takes `{}`), written compact with the schema's top-level properties in sorted order, as the template
writes arguments (and tml sorts them); JSON is the `json_schema`'s schema (or any object for `json_object`),
compact. `tool_choice` "none", "auto" or absent without a JSON `response_format` constrain nothing (None).
With "required" or a named function, `response_format` has nothing to apply to (the reply has no text) and is only
validated.

Thinking: THINKING is one or more ordinary tokens, any of them (free text, as unconstrained); `thinking=False`
leaves the block out (the reply starts with its first call or text block); `max_thinking_tokens=N` bounds it to N
tokens: the grammar repeats the ordinary-token set `<[...]>` 1 to N times, so after N tokens only `<|end_message|>`
may follow. (llguidance's `max_tokens=` lexeme option would bound it too, but a matcher with such a lexeme cannot
roll back, which speculative decoding needs.) 0 is the same as `thinking=False`.

Markers cannot be forged: llguidance sees a special token as its name behind a 0xFF marker byte, which no UTF-8
text matches, so string literals and JSON never produce one, and the thinking block's token set lists ordinary ids
only: special-token ids are allowed exactly where the grammar names them. Text the model writes with ordinary
tokens (thinking, or a JSON string, that spells `<|end_message|>`) stays ordinary tokens, which `decode_for_parsing`
escapes, so the parsers read it as text. (o200k's token 187 is the lone byte 0xFF; llguidance reserves that byte, so
it sees id 187 as a 61st special token without text. It cannot occur in UTF-8 text and is left out of the thinking
set: no grammar here allows it.)

In `generate()`: the processor goes in `logits_processor`, which generate() applies before its sampling warpers
(temperature, top-k, top-p), so those only choose among allowed tokens. Rows may go back (DSpark and assisted
decoding show it drafts, beam search reorders rows): each call re-synchronises a row's matcher with its tokens.
Do not combine it with `min_new_tokens` (or anything else that forbids eos) when the grammar can end sooner: once the
reply is complete, eos is the only token left.
"""

from __future__ import annotations

import copy
import json
import weakref
from collections.abc import Sequence

import numpy as np
import torch
from transformers import LogitsProcessor

from ..processing.chat_template import (
    CONTENT_TEXT,
    CONTENT_THINKING,
    END_MESSAGE,
    INVOKE_TOOL_JSON,
    MESSAGE_MODEL,
)
from ..processing.tokenization_inkling2 import NUM_BPE_RANKS

INSTALL_HINT = "pip install transformers-inkling2[serve]"
TOOL_CHOICES = ("none", "auto", "required")
# Compact JSON, as the chat template (and tml) write tool-call arguments; llguidance's default string escapes (no
# `\/`, `\uXXXX` only for control characters) are already those of Python's json.dumps(ensure_ascii=False).
_COMPACT = {"whitespace_flexible": False, "item_separator": ",", "key_separator": ":"}


def _ordinary_token(num_ordinary_tokens: int) -> str:
    """Any ordinary (BPE) token but 187, o200k's lone byte 0xFF, which llguidance reserves (see the module
    docstring); the ordinary ids are 0..num_ordinary_tokens-1 (o200k's first ranks)."""
    return f"<[0-186,188-{num_ordinary_tokens - 1}]>"


def _first_line(error: str) -> str:
    """llguidance's error without the parser state and grammar it appends."""
    return error.strip().split("\n")[0]


def _llguidance():
    try:
        import llguidance
    except ImportError as error:  # pragma: no cover - depends on the environment
        raise ImportError(
            f"constrained decoding (tool_choice, response_format) needs llguidance: {INSTALL_HINT}"
        ) from error
    return llguidance


# ---------------------------------------------------------------------------------------------------------------
# The grammar


def _lark_string(text: str) -> str:
    """A Lark string literal for `text` (llguidance reads them as JSON strings)."""
    return json.dumps(text).replace("\x7f", "\\u007f")


def _tool_function(tool, index: int) -> dict:
    """The function dict of one `tools` entry (OpenAI `{"type": "function", "function": {...}}` or the bare
    function, as the chat template takes them)."""
    where = f"tools[{index}]"
    if not isinstance(tool, dict):
        raise ValueError(f"{where} must be an object like {{'type': 'function', 'function': {{'name': ...}}}}")
    if tool.get("type", "function") != "function":
        raise ValueError(f"{where} has type {tool.get('type')!r}; only 'function' tools can be called")
    function = tool["function"] if isinstance(tool.get("function"), dict) else tool
    name = function.get("name")
    if not isinstance(name, str) or not name:
        raise ValueError(f"{where}.function.name must be a non-empty string")
    return function


def _arguments_schema(function: dict, index: int) -> dict:
    """The JSON schema a call's `args` must match: the tool's `parameters` (an object schema; missing, null or {}:
    no parameters, so `{}`), its top-level properties sorted as the template writes them."""
    where = f"tools[{index}].function.parameters"
    parameters = function.get("parameters")
    if parameters is None or parameters == {}:
        return {"type": "object", "properties": {}, "additionalProperties": False}
    if not isinstance(parameters, dict):
        raise ValueError(f"{where} of tool {function['name']!r} must be a JSON schema object, got {parameters!r}")
    schema = copy.deepcopy(parameters)
    kind = schema.get("type", "object")
    if kind != "object" and not (isinstance(kind, list) and "object" in kind):
        raise ValueError(
            f"{where} of tool {function['name']!r} must describe an object (type 'object'), got type {kind!r}"
        )
    schema["type"] = "object"
    if isinstance(schema.get("properties"), dict):
        schema["properties"] = dict(sorted(schema["properties"].items()))
    return schema


def _checked_schema(schema: dict, where: str) -> dict:
    """`schema` with our compact-JSON options, after llguidance compiled it (else ValueError naming `where`)."""
    schema = {**schema, "x-guidance": dict(_COMPACT)}
    llguidance = _llguidance()
    try:
        grammar = llguidance.LLMatcher.grammar_from_json_schema(schema)
    except ValueError as error:
        raise ValueError(f"{where} is not a valid JSON schema: {error}") from None
    is_error, messages = llguidance.LLMatcher.validate_grammar_with_warnings(grammar)
    if is_error:
        raise ValueError(
            f"{where} is not a JSON schema constrained decoding supports: {'; '.join(messages)}. "
            "Fix or remove the offending keyword."
        )
    return schema


def _tool_choice_name(tool_choice: dict) -> str:
    """The function a dict `tool_choice` names (chat-completions `{"type": "function", "function": {"name": ...}}`,
    or `{"type": "function", "name": ...}`)."""
    if tool_choice.get("type") != "function":
        raise ValueError(
            f"tool_choice {tool_choice!r} is not understood: use 'none', 'auto', 'required' or "
            "{'type': 'function', 'function': {'name': <one of the tools>}}"
        )
    function = tool_choice.get("function")
    name = function.get("name") if isinstance(function, dict) else tool_choice.get("name")
    if not isinstance(name, str) or not name:
        raise ValueError("tool_choice.function.name must be the name of one of the tools")
    return name


def _response_schema(response_format) -> dict | None:
    """The schema the visible text must match, or None (no response_format, or type 'text')."""
    if response_format is None:
        return None
    if not isinstance(response_format, dict) or "type" not in response_format:
        raise ValueError(
            "response_format must be {'type': 'text'}, {'type': 'json_object'} or "
            "{'type': 'json_schema', 'json_schema': {'name': ..., 'schema': {...}}}"
        )
    kind = response_format["type"]
    if kind == "text":
        return None
    if kind == "json_object":
        return _checked_schema({"type": "object"}, "response_format")
    if kind == "json_schema":
        spec = response_format.get("json_schema")
        if not isinstance(spec, dict) or not isinstance(spec.get("schema"), dict):
            raise ValueError(
                "response_format.json_schema.schema must be a JSON schema object: "
                "{'type': 'json_schema', 'json_schema': {'name': ..., 'schema': {...}}}"
            )
        return _checked_schema(spec["schema"], "response_format.json_schema.schema")
    raise ValueError(f"response_format.type {kind!r} is not one of 'text', 'json_object', 'json_schema'")


def reply_grammar(
    *,
    tools: Sequence[dict] | None = None,
    tool_choice: str | dict | None = None,
    response_format: dict | None = None,
    parallel_tool_calls: bool = True,
    thinking: bool = True,
    max_thinking_tokens: int | None = None,
    num_ordinary_tokens: int = NUM_BPE_RANKS,
) -> str | None:
    """The llguidance grammar (Lark syntax) of a whole assistant reply to a request with these OpenAI fields, or
    None when nothing constrains it (`tool_choice` "none", "auto" or absent, and no JSON `response_format`).

    Args:
        tools: OpenAI tools (`{"type": "function", "function": {"name", "parameters", ...}}`, or the bare function
            dicts), as given to the chat template.
        tool_choice: "none", "auto", "required", or `{"type": "function", "function": {"name": ...}}`.
        response_format: `{"type": "text" | "json_object"}` or `{"type": "json_schema", "json_schema": {"name":
            ..., "schema": {...}, "strict": ...}}` (always enforced, strict or not).
        parallel_tool_calls: whether several calls may follow one another (else one call; a named function is
            always called once).
        thinking: whether the reply may open with a thinking block.
        max_thinking_tokens: the most tokens that block's text may take (None: unbounded; 0: no block).
        num_ordinary_tokens: the tokenizer's BPE ids, 0.. below its first special token (o200k: all 199,998;
            `first_special_id(tokenizer)`), which the thinking text may use.

    Raises:
        ValueError: a malformed or inconsistent request, with the field and the fix in the message (a server
            answers HTTP 400): an unknown `tool_choice`, "required" or a named function without tools, a name no
            tool has, two tools of one name, a `parameters` or response schema that is not a JSON schema (or uses
            a keyword llguidance cannot enforce).
        ImportError: llguidance is not installed and the request needs a grammar.

    Only what the grammar enforces is checked: when nothing constrains (None), `tools` are not looked at.

    The grammar's shape for each case is in the module docstring.
    """
    if max_thinking_tokens is not None and (
        not isinstance(max_thinking_tokens, int) or isinstance(max_thinking_tokens, bool) or max_thinking_tokens < 0
    ):
        raise ValueError(f"max_thinking_tokens must be a non-negative integer or None, got {max_thinking_tokens!r}")
    if tool_choice is None:
        tool_choice = "auto"
    if isinstance(tool_choice, dict):
        mode, chosen = "named", _tool_choice_name(tool_choice)
    elif isinstance(tool_choice, str) and tool_choice in TOOL_CHOICES:
        mode, chosen = tool_choice, None
    else:
        raise ValueError(
            f"tool_choice {tool_choice!r} is not understood: use 'none', 'auto', 'required' or "
            "{'type': 'function', 'function': {'name': <one of the tools>}}"
        )
    if mode == "required" and not tools:
        raise ValueError("tool_choice is 'required' but no tools are given; pass tools or use tool_choice 'auto'")
    text_schema = _response_schema(response_format)  # checked even where it cannot apply (required, named)
    if mode in ("none", "auto") and text_schema is None:
        return None  # tools are not looked at: nothing here enforces them

    # the tools are read only when the grammar calls them
    calls_allowed = mode in ("required", "named") or (mode == "auto" and bool(tools))
    functions = []
    if calls_allowed:
        if chosen is not None and not tools:
            raise ValueError(f"tool_choice names function {chosen!r}, but no tools are given; pass the tools")
        if not isinstance(tools, (list, tuple)):
            raise ValueError("tools must be a list of {'type': 'function', 'function': {...}} objects")
        functions = [_tool_function(tool, index) for index, tool in enumerate(tools)]
        names = [function["name"] for function in functions]
        duplicates = sorted({name for name in names if names.count(name) > 1})
        if duplicates:
            raise ValueError(f"tools declare these function names more than once: {duplicates}; names must be unique")
        if chosen is not None and chosen not in names:
            raise ValueError(
                f"tool_choice names function {chosen!r}, but tools offer {names}; name one of them, or use "
                "'required' (any tool) or 'auto'"
            )

    rules = []
    alternatives = []
    if calls_allowed:
        callable_ = [(i, f) for i, f in enumerate(functions) if chosen is None or f["name"] == chosen]
        for i, function in callable_:
            schema = _checked_schema(_arguments_schema(function, i), f"tools[{i}].function.parameters")
            name = function["name"]
            opening = '{"name":' + json.dumps(name, ensure_ascii=False) + ',"args":'
            rules.append(
                f'call_{i}: {_lark_string(name)} {INVOKE_TOOL_JSON} {_lark_string(opening)} args_{i} "}}" {END_MESSAGE}'
            )
            rules.append(f"args_{i}: %json {json.dumps(schema)}")
        rules.append("call: " + " | ".join(f"call_{i}" for i, _ in callable_))
        several = mode != "named" and parallel_tool_calls
        rules.append(f"calls: call ({MESSAGE_MODEL} call)*" if several else "calls: call")
        alternatives.append("calls")
    if text_schema is not None and mode != "required" and mode != "named":
        rules.append(f"text: {CONTENT_TEXT} text_json {END_MESSAGE}")
        rules.append(f"text_json: %json {json.dumps(text_schema)}")
        alternatives.append("text")
    rules.append("reply: " + " | ".join(alternatives))

    if thinking and max_thinking_tokens != 0:
        count = "+" if max_thinking_tokens is None else f"{{1,{max_thinking_tokens}}}"
        rules.append(f"thinking: {CONTENT_THINKING} thinking_text {END_MESSAGE} {MESSAGE_MODEL}")
        rules.append(f"thinking_text: {_ordinary_token(num_ordinary_tokens)}{count}")
        start = "start: thinking? reply"
    else:
        start = "start: reply"
    return "\n".join(["%llguidance {}", start, *rules]) + "\n"


# ---------------------------------------------------------------------------------------------------------------
# Enforcing it in generate()

_LL_TOKENIZERS: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def llguidance_tokenizer(tokenizer):
    """The llguidance tokenizer of a fast (`tokenizers`-backed) transformers tokenizer, built once per tokenizer
    object (a few seconds for o200k) and cached for as long as that object lives. Its eos is the tokenizer's."""
    try:
        return _LL_TOKENIZERS[tokenizer]
    except (KeyError, TypeError):
        pass
    _llguidance()
    import llguidance.hf

    built = llguidance.hf.from_tokenizer(tokenizer)
    try:
        _LL_TOKENIZERS[tokenizer] = built
    except TypeError:  # not weak-referenceable: not cached
        pass
    return built


class _Row:
    """One batch row: its matcher and the generated tokens it has consumed (a growing buffer)."""

    def __init__(self, matcher):
        self.matcher = matcher
        self._buffer = np.zeros(256, dtype=np.int64)
        self.count = 0

    @property
    def tokens(self) -> np.ndarray:
        return self._buffer[: self.count]

    def append(self, tokens: list[int]) -> None:
        if self.count + len(tokens) > len(self._buffer):
            grown = np.zeros(max(2 * len(self._buffer), self.count + len(tokens)), dtype=np.int64)
            grown[: self.count] = self.tokens
            self._buffer = grown
        self._buffer[self.count : self.count + len(tokens)] = tokens
        self.count += len(tokens)


class GrammarLogitsProcessor(LogitsProcessor):
    """Masks, in each batch row, every token that the row's grammar does not allow next (as -inf).

    Args:
        tokenizer: the model's fast tokenizer (its llguidance view is built once per tokenizer and cached).
        grammar: a `reply_grammar` result (one grammar for every row), or one per row (None: that row is free).
        prompt_length: where the generated tokens start in the first call's `input_ids`; None: at its end (the first
            call sees the padded prompt), which is right for `generate()`.

    Each call brings the rows' matchers up to date with the tokens after the prompt (a row's prompt is looked for
    where it was, or further right: DSpark adds left padding to a row that accepted fewer drafts). A row's consumed
    tokens are compared with its current ones and the matcher rolls back to where they agree, so decoding that goes
    back (speculative drafts, DSpark's verification, beam reordering) stays in step. Tokens after the end of a
    finished row (eos, then padding) are ignored; once a row's grammar is complete it allows only eos. Ids beyond
    the tokenizer's vocabulary (a model's padded `vocab_size`) are always masked in constrained rows. Masks are
    built on the CPU and applied on the logits' device. A token the grammar does not allow (another processor undid
    the mask, or a wrong `prompt_length`) raises RuntimeError rather than producing an unconstrained reply.
    """

    def __init__(self, tokenizer, grammar: str | Sequence[str | None], prompt_length: int | None = None):
        if grammar is None:
            raise ValueError("grammar is None (reply_grammar returns None when nothing constrains): pass no processor")
        llguidance = _llguidance()
        self.tokenizer = tokenizer
        self.ll_tokenizer = llguidance_tokenizer(tokenizer)
        self.grammars = [grammar] if isinstance(grammar, str) else list(grammar)
        self.per_row = not isinstance(grammar, str)
        self.prompt_length = prompt_length
        self.eos = self.ll_tokenizer.eos_token
        self._compiled = {}
        for text in self.grammars:
            if text is not None and text not in self._compiled:
                compiled = llguidance.LLMatcher.grammar_from_lark(text)
                is_error, messages = llguidance.LLMatcher.validate_grammar_with_warnings(compiled, self.ll_tokenizer)
                if is_error:
                    raise ValueError(f"the grammar does not compile: {'; '.join(messages)}")
                self._compiled[text] = compiled
        self._rows: list[_Row | None] | None = None

    def _start(self, batch: int) -> None:
        if self.per_row and len(self.grammars) != batch:
            raise ValueError(f"{len(self.grammars)} grammars were given for a batch of {batch} rows")
        self._texts = self.grammars if self.per_row else self.grammars * batch
        self._rows = [None if text is None else _Row(self._matcher(text)) for text in self._texts]

    def _matcher(self, text: str):
        matcher = _llguidance().LLMatcher(self.ll_tokenizer, self._compiled[text], log_level=0)
        if matcher.is_error():
            raise ValueError(f"the grammar does not compile: {_first_line(matcher.get_error())}")
        return matcher

    def _advance(self, index: int, row: _Row, generated: np.ndarray) -> None:
        """Brings the row's matcher to `generated`: back to where it agrees with what was consumed, then forward."""
        consumed = row.tokens
        agree = min(len(consumed), len(generated))
        if agree and not np.array_equal(consumed[:agree], generated[:agree]):
            agree = int(np.flatnonzero(consumed[:agree] != generated[:agree])[0])
        if agree < len(consumed):
            if not row.matcher.rollback(len(consumed) - agree):
                # grammars with `max_tokens=` or `stop=` lexemes cannot roll back: replay the agreed tokens instead
                row.matcher = self._matcher(self._texts[index])
                if agree and not row.matcher.consume_tokens(consumed[:agree].tolist()):
                    raise RuntimeError(
                        f"row {index}: the grammar could not be replayed: {_first_line(row.matcher.get_error())}"
                    )
            row.count = agree
        new = []
        for token in generated[agree:].tolist():
            if row.matcher.is_stopped():
                break  # the reply is complete: what follows (eos already consumed, padding) is not the grammar's
            if not row.matcher.consume_token(token):
                raise RuntimeError(
                    f"row {index}: token {token} ({self.tokenizer.convert_ids_to_tokens(token)!r}) is not allowed by "
                    f"the grammar ({_first_line(row.matcher.get_error())}); was the mask undone by a later logits processor, or is "
                    "prompt_length wrong?"
                )
            new.append(token)
        row.append(new)

    def _generated(self, index: int, input_ids: torch.Tensor) -> np.ndarray:
        """Row `index`'s tokens after its prompt. The prompt is found where it was, or further right: DSpark moves a
        row that accepted fewer drafts right by new left padding (a prompt never starts with padding, so the first
        place it matches, looking right from where it was, is the right one)."""
        prompt, row = self._prompts[index], input_ids[index]
        width, length = row.shape[0], prompt.shape[0]
        offset = self._offsets[index]
        if not torch.equal(row[offset : offset + length], prompt):
            # rows only move right: look there first
            for offset in [*range(offset + 1, width - length + 1), *range(offset)]:
                if torch.equal(row[offset : offset + length], prompt):
                    break
            else:
                raise RuntimeError(f"row {index}: its prompt is no longer in input_ids; one processor serves one batch")
            self._offsets[index] = offset
        return row[offset + length :].cpu().numpy()

    def __call__(self, input_ids: torch.LongTensor, scores: torch.FloatTensor) -> torch.FloatTensor:
        batch, model_vocab = scores.shape
        if self._rows is None:
            if self.prompt_length is None:
                self.prompt_length = input_ids.shape[1]
            self._start(batch)
            self._prompts = input_ids[:, : self.prompt_length].clone()
            self._offsets = [0] * batch
        if len(self._rows) != batch:
            raise RuntimeError(f"this processor was started for {len(self._rows)} rows, not {batch}")
        vocab = self.ll_tokenizer.vocab_size
        words = (vocab + 31) // 32
        bitmask = np.zeros((batch, words), dtype=np.int32)
        constrained = []
        for index, row in enumerate(self._rows):
            if row is None:
                continue
            constrained.append(index)
            self._advance(index, row, self._generated(index, input_ids))
            target = bitmask[index]
            if row.matcher.is_stopped():
                target[self.eos // 32] = np.array([1 << (self.eos % 32)], dtype=np.uint32).view(np.int32)[0]
                continue
            row.matcher.unsafe_compute_mask_ptr(target.ctypes.data, target.nbytes)
            if row.matcher.is_error():
                raise RuntimeError(f"row {index}: the grammar matcher failed: {_first_line(row.matcher.get_error())}")
        if not constrained:
            return scores
        # one bool per id, True where forbidden: ids past the tokenizer's vocabulary too, free rows nowhere
        bits = np.unpackbits(bitmask.view(np.uint8), axis=1, count=vocab, bitorder="little")
        usable = min(vocab, model_vocab)
        blocked = np.ones((batch, model_vocab), dtype=np.bool_)
        np.equal(bits[:, :usable], 0, out=blocked[:, :usable])
        blocked[[index for index in range(batch) if self._rows[index] is None]] = False
        return scores.masked_fill(torch.from_numpy(blocked).to(scores.device), float("-inf"))

    def finished(self) -> list[bool]:
        """Whether each row's reply is complete (its grammar allows nothing but eos); rows without a grammar: True."""
        return [row is None or row.matcher.is_stopped() for row in (self._rows or [])]


__all__ = ["GrammarLogitsProcessor", "llguidance_tokenizer", "reply_grammar"]
