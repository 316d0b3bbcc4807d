"""The Inkling-2 chat template: conversations -> the token text that Thinking Machines' `tml-renderers` renders.

`CHAT_TEMPLATE` is a Jinja template for transformers' `apply_chat_template` (the tokenizer carries it by default; the
processor uses it too). It renders, token for token like `tml_renderers.v0.Renderer` (the tests compare ids):

    [system messages, in order]          <|message_system|><|content_text|>...<|end_message|>
    [tools]                              <|message_system|>tool_declare<|content_xml|>[...]<|end_message|>
    [thinking effort]                    <|message_system|><|content_text|>Thinking effort level: 0.9<|end_message|>
    [the other messages, in order]
    [generation prompt]                  <|message_model|>

Tools and the effort line go before the first non-system message, as tml puts its effort line. Every content part
is its own block: `<|message_{author}|>` + header + kind token + body + `<|end_message|>`, where the header is the
tool name in tool results and calls. An assistant message is its reasoning (`reasoning_content`, `thinking` or
`reasoning`, or content parts `{"type": "thinking", "thinking": ...}`), text and tool calls, then
`<|content_model_end_sampling|>`; it is marked with `{% generation %}` for `return_assistant_tokens_mask`, which
then equals tml's SFT loss weights.

Template kwargs:
    effort   thinking effort: "none" (0), "minimal" (0.1), "low" (0.2), "medium" (0.7), "high" (0.9), "xhigh" or
             "max" (0.99), or a number in [0, 0.99]. Left out: 0.9, the serving default. `None`: no effort line
             (tml's `render_for_completion` without an effort). Anything else raises.
    tools    OpenAI-style `{"type": "function", "function": {"name", "description", "parameters"}}` (or the bare
             function dicts); tml's tool_declare keeps exactly those fields, keys sorted at every depth, compact.
             Tool calls are written `{"name":...,"args":{...}}`, compact, the arguments' top-level keys sorted.

Image contract (with `Inkling2Processor`): an image content part (`{"type": "image", ...}` or `{"type":
"image_url", ...}`) renders `<|content_image|><|unused_200054|>`, exactly ONE placeholder per image; the processor
expands that placeholder into one per image feature. tml renders the same block with the image's feature count.

Text from the conversation is never read as control tokens. tml encodes every piece of content without special-token
matching; a transformers template renders one string that the tokenizer then encodes, matching special tokens
everywhere. So the template writes text it did not make itself (contents, thinking, tool names, tool results, tool
call arguments and declarations) through `plain()`, which puts `TEXT_ESCAPE` (U+FDD0, a Unicode noncharacter)
after every `<` that starts `<|` or `<` + U+FDD0; the tokenizer's special tokens are matched on the raw string, so
`<`U+FDD0`|end_message|>` is not one, and its normalizer (`<`U+FDD0 -> `<`, see tokenization_inkling2.py) then gives
the BPE exactly the original text: ids equal to tml's `encode_ordinary` of it. `escape_text`/`unescape_text` are the
same functions in Python; `mark_ordinary_text` escapes every `<` (used when decoding ids for parsing, where the next
character may not have arrived yet). Both are undone by `unescape_text` and by the tokenizer.

JSON (tool declarations and tool-call arguments) is written as tml writes it: compact, floats in the shortest
round-trip form with tml's exponents (arguments `1e-7`, `1e22`; declarations `1e-7`, `1e+22`; `0.00001` and `1.0` in
both), integers beyond the 64-bit range as floats; declarations with keys sorted at every depth, arguments with their
top-level keys sorted (tml sorts those whatever the order given) and nested objects in the given order. (tml's JSON
reader is not correctly rounded: some floats of 16-17 significant digits come out of tml one unit off in the last
digit; we keep the value given.)

Where we differ from tml (on purpose; documented in docs/conversations.md):
    - a tool result without `name` takes the name of the tool call with the same `tool_call_id` (tml leaves the
      header empty);
    - assistant `reasoning_content` / `thinking` / `reasoning` fields render as a thinking block (tml reads thinking
      only from content parts and drops these fields);
    - tool-call `arguments` given as a JSON string: `Inkling2Tokenizer.apply_chat_template` parses them first (as
      tml does), so they render like a dict; the template alone (another engine, or the processor) cannot parse
      JSON and writes such a string verbatim. An argument string that is not a JSON object stays verbatim (tml
      raises);
    - NaN and infinities are written as Python's `json` writes them (tml refuses them).
"""

from __future__ import annotations

import json
from typing import Any

EFFORT_LEVELS = {"none": 0.0, "minimal": 0.1, "low": 0.2, "medium": 0.7, "high": 0.9, "xhigh": 0.99, "max": 0.99}
DEFAULT_EFFORT = 0.9  # what serving uses when a request names none; tml writes no line without an effort argument
MAX_EFFORT = 0.99

# The effort line's number is tml's: millieffort = round(effort * 1000), then round(millieffort / 1000 * 100) in
# hundredths, both rounding half to even like Python's `round` (Jinja's `round` filter), trailing zeros dropped.
CHAT_TEMPLATE = r"""
{#- ---------- thinking effort ---------- -#}
{%- set effort_by_name = {"none": 0.0, "minimal": 0.1, "low": 0.2, "medium": 0.7, "high": 0.9, "xhigh": 0.99, "max": 0.99} -%}
{%- if effort is not defined -%}
    {%- set effort_value = 0.9 -%}
{%- elif effort is none -%}
    {%- set effort_value = none -%}
{%- elif effort is string -%}
    {%- if effort not in effort_by_name -%}
        {{- raise_exception("Unknown thinking effort '" ~ effort ~ "': use none, minimal, low, medium, high, xhigh, max, a number in [0, 0.99], or None for no effort line.") -}}
    {%- endif -%}
    {%- set effort_value = effort_by_name[effort] -%}
{%- elif effort is number and effort is not boolean and effort >= 0 and effort <= 0.99 -%}
    {%- set effort_value = effort -%}
{%- else -%}
    {{- raise_exception("Thinking effort must be a name (none, minimal, low, medium, high, xhigh, max), a number in [0, 0.99], or None; got " ~ effort ~ ".") -}}
{%- endif -%}
{%- set effort_text = none -%}
{%- if effort_value is not none -%}
    {%- set hundredths = ((((effort_value * 1000) | round) / 1000 * 100) | round | int) -%}
    {%- if hundredths == 0 -%}
        {%- set effort_text = "0" -%}
    {%- elif hundredths % 10 == 0 -%}
        {%- set effort_text = "0." ~ (hundredths // 10) -%}
    {%- else -%}
        {%- set effort_text = "0." ~ ("%02d" | format(hundredths)) -%}
    {%- endif -%}
{%- endif -%}
{#- ---------- text from the conversation: `<` + U+FDD0 after each `<` that starts `<|` or `<`U+FDD0 ---------- -#}
{#- The tokenizer matches special tokens on the raw text, so an escaped spelling is not one; its normalizer removes
    the U+FDD0 again, so the BPE sees the original text (see TEXT_ESCAPE in chat_template.py). -#}
{%- macro plain(text) -%}
    {{- (text | string) | replace("<\ufdd0", "<\ufdd0\ufdd0") | replace("<|", "<\ufdd0|") -}}
{%- endmacro -%}
{#- ---------- JSON as tml (serde) writes it ---------- -#}
{#- Floats: Python's repr is the same shortest round-trip digits; serde writes exponents without leading zeros (and
    tml's tool declarations with `+` on positive ones, `plus`), and 1e-5 <= |x| < 1e-4 without an exponent. -#}
{%- macro json_float(value, plus) -%}
    {%- set text = value | string -%}
    {%- if value != value or text in ("inf", "-inf") -%}
        {{- value | tojson -}}
    {%- elif "e" in text -%}
        {%- set mantissa, exponent = text.split("e") -%}
        {%- if (exponent | int) == -5 -%}
            {{- ("-" if mantissa.startswith("-") else "") ~ "0.0000" ~ (mantissa | replace("-", "") | replace(".", "")) -}}
        {%- else -%}
            {{- mantissa ~ ("e+" if plus and (exponent | int) > 0 else "e") ~ (exponent | int) -}}
        {%- endif -%}
    {%- else -%}
        {{- text -}}
    {%- endif -%}
{%- endmacro -%}
{#- `sort`: "all" sorts the keys of every object, "top" those of this one only, "none" keeps the given order. -#}
{%- macro json_value(value, sort, plus) -%}
    {%- if value is none -%}
        {{- "null" -}}
    {%- elif value is boolean -%}
        {{- "true" if value else "false" -}}
    {%- elif value is integer -%}
        {#- serde reads an integer outside u64/i64 as a float -#}
        {%- if value > 18446744073709551615 or value < -9223372036854775808 -%}
            {{- json_float(value | float, plus) -}}
        {%- else -%}
            {{- value | string -}}
        {%- endif -%}
    {%- elif value is float -%}
        {{- json_float(value, plus) -}}
    {%- elif value is string -%}
        {{- value | tojson -}}
    {%- elif value is mapping -%}
        {{- "{" -}}
        {%- for key, item in (value | dictsort(case_sensitive=true) if sort != "none" else value.items()) -%}
            {{- ("," if not loop.first else "") ~ ((key | string) | tojson) ~ ":" ~ json_value(item, "all" if sort == "all" else "none", plus) -}}
        {%- endfor -%}
        {{- "}" -}}
    {%- elif value is iterable -%}
        {{- "[" -}}
        {%- for item in value -%}
            {{- ("," if not loop.first else "") ~ json_value(item, "all" if sort == "all" else "none", plus) -}}
        {%- endfor -%}
        {{- "]" -}}
    {%- else -%}
        {{- value | tojson -}}
    {%- endif -%}
{%- endmacro -%}
{#- ---------- tool declarations: exactly tml's four fields, keys sorted at every depth ---------- -#}
{%- set ns = namespace(specs=[], preamble_done=false, calls=[], tool_name="") -%}
{%- for tool in (tools or []) -%}
    {%- set fn = tool.function if tool.function is mapping else tool -%}
    {%- if fn.name is not string -%}
        {{- raise_exception("Every tool needs a function name, got " ~ (tool | tojson)) -}}
    {%- endif -%}
    {%- set ns.specs = ns.specs + [{"description": fn.get("description") or "", "name": fn.name, "parameters": fn.get("parameters") or {}, "type": tool.get("type") or "function"}] -%}
{%- endfor -%}
{%- set preamble -%}
    {%- if ns.specs -%}
        {{- "<|message_system|>tool_declare<|content_xml|>" ~ plain(json_value(ns.specs, "all", true)) ~ "<|end_message|>" -}}
    {%- endif -%}
    {%- if effort_text is not none -%}
        {{- "<|message_system|><|content_text|>Thinking effort level: " ~ effort_text ~ "<|end_message|>" -}}
    {%- endif -%}
{%- endset -%}
{#- ---------- one block per content part ---------- -#}
{%- macro render_part(author, header, part, role) -%}
    {%- if part is not mapping -%}
        {{- raise_exception("Content parts must be dicts with a 'type', got " ~ part ~ " in a " ~ role ~ " message.") -}}
    {%- elif part.type == "text" -%}
        {{- author ~ header ~ "<|content_text|>" ~ plain(part.text) ~ "<|end_message|>" -}}
    {%- elif part.type in ("image", "image_url") -%}
        {{- author ~ header ~ "<|content_image|><|unused_200054|><|end_message|>" -}}
    {%- elif part.type == "thinking" -%}
        {{- author ~ header ~ "<|content_thinking|>" ~ plain(part.thinking) ~ "<|end_message|>" -}}
    {%- elif part.type == "tool_error" -%}
        {{- author ~ header ~ "<|content_tool_error|>" ~ plain(part.text) ~ "<|end_message|>" -}}
    {%- else -%}
        {{- raise_exception("Unsupported content part type '" ~ part.type ~ "' in a " ~ role ~ " message.") -}}
    {%- endif -%}
{%- endmacro -%}
{#- A string is one text block; None or "" is one empty text block unless `empty_block` is false; a list is its parts.
    `header` is already escaped. -#}
{%- macro render_content(author, header, content, role, empty_block) -%}
    {%- if content is string and content -%}
        {{- author ~ header ~ "<|content_text|>" ~ plain(content) ~ "<|end_message|>" -}}
    {%- elif content is none or content is undefined or content is string -%}
        {%- if empty_block -%}
            {{- author ~ header ~ "<|content_text|><|end_message|>" -}}
        {%- endif -%}
    {%- elif content is mapping -%}
        {{- raise_exception("Message content must be a string or a list of parts, got a dict in a " ~ role ~ " message.") -}}
    {%- else -%}
        {%- for part in content -%}
            {{- render_part(author, header, part, role) -}}
        {%- endfor -%}
    {%- endif -%}
{%- endmacro -%}
{#- ---------- the conversation ---------- -#}
{%- for message in messages -%}
    {%- set role = message.role -%}
    {%- if role not in ("system", "user", "assistant", "tool") -%}
        {{- raise_exception("Unsupported role '" ~ role ~ "': Inkling-2 knows system, user, assistant and tool.") -}}
    {%- endif -%}
    {%- if not ns.preamble_done and role != "system" -%}
        {{- preamble -}}
        {%- set ns.preamble_done = true -%}
    {%- endif -%}
    {%- if role == "system" -%}
        {{- render_content("<|message_system|>", "", message.content, role, true) -}}
    {%- elif role == "user" -%}
        {{- render_content("<|message_user|>", "", message.content, role, true) -}}
    {%- elif role == "tool" -%}
        {%- set ns.tool_name = message.name if message.name is string else "" -%}
        {%- if not ns.tool_name and message.tool_call_id is defined -%}
            {%- for call in ns.calls if call[0] == message.tool_call_id -%}
                {%- set ns.tool_name = call[1] -%}
            {%- endfor -%}
        {%- endif -%}
        {{- render_content("<|message_tool|>", plain(ns.tool_name), message.content, role, true) -}}
    {%- else -%}
        {%- set tool_calls = message.tool_calls or [] -%}
        {%- for call in tool_calls if call.id is defined and call.id is not none -%}
            {%- set ns.calls = ns.calls + [[call.id, (call.function if call.function is mapping else call).name]] -%}
        {%- endfor -%}
        {%- set reasoning = message.reasoning_content or message.thinking or message.reasoning -%}
        {%- set body -%}
            {%- if reasoning is string and reasoning -%}
                {{- "<|message_model|><|content_thinking|>" ~ plain(reasoning) ~ "<|end_message|>" -}}
            {%- endif -%}
            {{- render_content("<|message_model|>", "", message.content, role, not tool_calls) -}}
            {%- for call in tool_calls -%}
                {%- set fn = call.function if call.function is mapping else call -%}
                {%- if fn.name is not string -%}
                    {{- raise_exception("Every tool call needs a function name, got " ~ (call | tojson)) -}}
                {%- endif -%}
                {%- if fn.arguments is string -%}
                    {%- set args = fn.arguments or "{}" -%}
                {%- elif fn.arguments is mapping -%}
                    {#- tml sorts the arguments' own keys and keeps nested objects' key order -#}
                    {%- set args = json_value(fn.arguments, "top", false) -%}
                {%- elif fn.arguments is none or fn.arguments is undefined -%}
                    {%- set args = "{}" -%}
                {%- else -%}
                    {{- raise_exception("Tool-call arguments must be a JSON object (a dict or its JSON text), got " ~ (fn.arguments | tojson)) -}}
                {%- endif -%}
                {{- "<|message_model|>" ~ plain(fn.name) ~ "<|content_invoke_tool_json|>" ~ plain('{"name":' ~ (fn.name | tojson) ~ ',"args":' ~ args ~ "}") ~ "<|end_message|>" -}}
            {%- endfor -%}
        {%- endset -%}
        {%- if body -%}
            {%- generation -%}
                {{- body ~ "<|content_model_end_sampling|>" -}}
            {%- endgeneration -%}
        {%- endif -%}
    {%- endif -%}
{%- endfor -%}
{%- if not ns.preamble_done -%}
    {{- preamble -}}
{%- endif -%}
{%- if add_generation_prompt -%}
    {{- "<|message_model|>" -}}
{%- endif -%}
""".strip()

# ---- text from the conversation as ordinary text (see the module docstring) ----
TEXT_ESCAPE = "\ufdd0"  # a Unicode noncharacter (reserved for a program's internal use); the template writes it too
_ESCAPED = "<" + TEXT_ESCAPE


def escape_text(text: str) -> str:
    """What the template's `plain()` does: `<` + U+FDD0 after each `<` that starts `<|` or `<` + U+FDD0, so no
    special token can be matched in `text`; the tokenizer's normalizer (and `unescape_text`) undo it exactly."""
    return text.replace(_ESCAPED, _ESCAPED + TEXT_ESCAPE).replace("<|", _ESCAPED + "|")


def mark_ordinary_text(text: str) -> str:
    """U+FDD0 after every `<`: for text decoded from ordinary (non-special) tokens, where whatever follows a final `<`
    has not been decoded yet. Undone by `unescape_text` and by the tokenizer, like `escape_text`."""
    return text.replace("<", _ESCAPED)


def unescape_text(text: str) -> str:
    """The inverse of `escape_text` and `mark_ordinary_text` (what the tokenizer's normalizer does)."""
    return text.replace(_ESCAPED, "<")


def parse_tool_call_arguments(messages: list) -> list:
    """`messages` with each tool call's JSON-string `arguments` parsed into a dict (in the given key order, a repeated
    key keeping its last value), as tml parses them before rendering; arguments that are not a JSON object stay as
    they are. Messages without such calls are returned as they are (not copied)."""
    out = []
    for message in messages:
        calls = message.get("tool_calls") if isinstance(message, dict) else None
        if isinstance(calls, list) and any(_string_arguments(call) is not None for call in calls):
            message = {**message, "tool_calls": [_with_parsed_arguments(call) for call in calls]}
        out.append(message)
    return out


def _string_arguments(call) -> str | None:
    fn = call.get("function") if isinstance(call, dict) else None
    fn = fn if isinstance(fn, dict) else call
    arguments = fn.get("arguments") if isinstance(fn, dict) else None
    return arguments if isinstance(arguments, str) else None


def _with_parsed_arguments(call):
    text = _string_arguments(call)
    if text is None:
        return call
    try:
        arguments = json.loads(text)
    except ValueError:
        return call
    if not isinstance(arguments, dict):
        return call
    if isinstance(call.get("function"), dict):
        return {**call, "function": {**call["function"], "arguments": arguments}}
    return {**call, "arguments": arguments}


# The blocks of a model turn, as `response_parsing` reads them.
MESSAGE_MODEL = "<|message_model|>"
CONTENT_THINKING = "<|content_thinking|>"
CONTENT_TEXT = "<|content_text|>"
INVOKE_TOOL_JSON = "<|content_invoke_tool_json|>"
END_MESSAGE = "<|end_message|>"
END_OF_TURN = "<|content_model_end_sampling|>"

# transformers' declarative form (read by `tokenizer.parse_response`, `get_response_parser`, the pipelines and
# `transformers serve`). The tool-call region opens after `"args":` and closes at the object's last `}`, so its body
# is the arguments object itself; `allow_non_json` keeps a malformed or truncated one as text instead of raising.
# The call is named by its JSON `name` (as tml, vLLM and SGLang read it), not by the block header; the name is taken
# as written between the quotes (a JSON escape in it is not decoded).
RESPONSE_TEMPLATE: dict[str, Any] = {
    "defaults": {"role": "assistant"},
    "start_anchor": MESSAGE_MODEL,
    "fields": {
        "thinking": {
            "open": CONTENT_THINKING,
            "close": END_MESSAGE,
            "content": "text",
            "content_args": {"strip": False},
            "repeats": True,
            "join": "",
        },
        "content": {
            "open": CONTENT_TEXT,
            "close": END_MESSAGE,
            "content": "text",
            "content_args": {"strip": False},
            "repeats": True,
            "join": "",
        },
        "tool_calls": {
            "open_pattern": r'[^<>|]*<\|content_invoke_tool_json\|>\s*\{\s*"name"\s*:\s*"(?P<name>(?:[^"\\]|\\.)*)"\s*,\s*"args"\s*:',
            "close_pattern": r"\}\s*<\|end_message\|>",
            "content": "json",
            "content_args": {"allow_non_json": True},
            "repeats": True,
            "transform": {"type": "function", "function": {"name": "{name}", "arguments": "{content}"}},
        },
    },
}

__all__ = [
    "CHAT_TEMPLATE",
    "DEFAULT_EFFORT",
    "EFFORT_LEVELS",
    "MAX_EFFORT",
    "RESPONSE_TEMPLATE",
    "TEXT_ESCAPE",
    "escape_text",
    "mark_ordinary_text",
    "parse_tool_call_arguments",
    "unescape_text",
]
