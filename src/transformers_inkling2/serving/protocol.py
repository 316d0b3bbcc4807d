"""The OpenAI chat-completions request as pydantic models: the field types and ranges OpenAI documents, checked
strictly (`"0.5"` is not a number, `2**70` is not a seed), so that every malformed request is a 400 with OpenAI's
error body before any work is done.

What this server does not implement is refused by name (`n > 1`, `logprobs`, `logit_bias`, penalties) rather than
silently ignored; fields that only describe the caller (`user`, `metadata`, `store`, ...) are accepted and unused.
Unknown fields are refused, as OpenAI refuses them. vLLM's `chat_template_kwargs`, `chat_template` and `top_k` are
accepted with the same meaning.
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, StringConstraints, ValidationError, field_validator, model_validator

MAX_MESSAGES = 2048
MAX_TOOLS = 128
MAX_STOP_SEQUENCES = 4
MAX_JSON_DEPTH = 64  # of the request body; deeper documents are refused before validation
SEED_RANGE = (-(2**63), 2**64 - 1)  # what torch.manual_seed takes

ToolName = Annotated[str, StringConstraints(pattern=r"^[A-Za-z0-9_.\-]{1,64}$")]


class _Strict(BaseModel):
    model_config = ConfigDict(strict=True, extra="forbid")


class _Lenient(BaseModel):
    """Messages and parts: clients send back what OpenAI returned (`refusal`, `annotations`, ...): ignored."""

    model_config = ConfigDict(strict=True, extra="ignore")


class TextPart(_Lenient):
    type: Literal["text"]
    text: str


class ImageURL(_Lenient):
    url: str = Field(min_length=1)
    detail: Literal["auto", "low", "high"] | None = None


class ImagePart(_Lenient):
    type: Literal["image_url"]
    image_url: ImageURL


ContentPart = Annotated[TextPart | ImagePart, Field(discriminator="type")]


class FunctionCall(_Lenient):
    name: ToolName
    arguments: str  # JSON text, as OpenAI sends it


class ToolCall(_Lenient):
    id: str | None = None
    type: Literal["function"] = "function"
    function: FunctionCall


class ChatMessage(_Lenient):
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[ContentPart] | None = None
    name: str | None = None
    tool_calls: list[ToolCall] | None = None
    tool_call_id: str | None = None
    reasoning_content: str | None = None  # an earlier reply's reasoning, sent back

    @model_validator(mode="after")
    def _content_fits_the_role(self):
        if self.role != "assistant" and self.content is None:
            raise ValueError(f"a '{self.role}' message needs 'content'")
        if self.tool_calls and self.role != "assistant":
            raise ValueError("only assistant messages carry 'tool_calls'")
        if self.role != "user" and isinstance(self.content, list):
            if any(part.type == "image_url" for part in self.content):
                raise ValueError("images go in user messages")
        return self


class FunctionDefinition(_Strict):
    name: ToolName
    description: str | None = None
    parameters: dict[str, Any] | None = None
    strict: bool | None = None


class Tool(_Strict):
    type: Literal["function"]
    function: FunctionDefinition


class NamedFunction(_Strict):
    name: ToolName


class NamedToolChoice(_Strict):
    type: Literal["function"]
    function: NamedFunction


class JSONSchema(_Strict):
    name: Annotated[str, StringConstraints(pattern=r"^[A-Za-z0-9_\-]{1,64}$")]
    description: str | None = None
    schema_: dict[str, Any] | None = Field(default=None, alias="schema")
    strict: bool | None = None

    model_config = ConfigDict(strict=True, extra="forbid", populate_by_name=True)


class ResponseFormat(_Strict):
    type: Literal["text", "json_object", "json_schema"]
    json_schema: JSONSchema | None = None

    @model_validator(mode="after")
    def _schema_with_its_type(self):
        if (self.type == "json_schema") != (self.json_schema is not None):
            raise ValueError("'json_schema' goes with type 'json_schema', and only with it")
        return self


class StreamOptions(_Strict):
    include_usage: bool | None = None
    continuous_usage_stats: bool | None = None  # vLLM's; accepted, unused


class ChatCompletionRequest(_Strict):
    model: str
    messages: list[ChatMessage] = Field(min_length=1, max_length=MAX_MESSAGES)
    max_tokens: int | None = Field(default=None, ge=1)
    max_completion_tokens: int | None = Field(default=None, ge=1)
    temperature: float | None = Field(default=None, ge=0, le=2)
    top_p: float | None = Field(default=None, gt=0, le=1)
    top_k: int | None = Field(default=None, ge=-1)  # vLLM's extension: 0 and -1 mean off
    seed: int | None = Field(default=None, ge=SEED_RANGE[0], le=SEED_RANGE[1])
    n: int = 1
    stream: bool = False
    stream_options: StreamOptions | None = None
    stop: str | list[str] | None = None
    tools: list[Tool] | None = Field(default=None, max_length=MAX_TOOLS)
    tool_choice: Literal["none", "auto", "required"] | NamedToolChoice | None = None
    parallel_tool_calls: bool | None = None
    response_format: ResponseFormat | None = None
    reasoning_effort: str | float | None = None  # the template checks the value: names or a number in [0, 0.99]
    chat_template_kwargs: dict[str, Any] | None = None
    chat_template: str | None = None
    frequency_penalty: float = Field(default=0, ge=-2, le=2)
    presence_penalty: float = Field(default=0, ge=-2, le=2)
    logprobs: bool | None = None
    top_logprobs: int | None = Field(default=None, ge=0, le=20)
    logit_bias: dict[str, float] | None = None
    user: str | None = None
    metadata: dict[str, str] | None = None
    store: bool | None = None
    service_tier: str | None = None

    @field_validator("n", "frequency_penalty", "presence_penalty", "logprobs", "top_logprobs", "logit_bias")
    @classmethod
    def _only_the_default(cls, value, info):
        default = 1 if info.field_name == "n" else None if info.field_name == "logit_bias" else 0
        if value and value != default:
            allowed = "leave it out" if default is None else f"leave it out, or {default}"
            raise ValueError(f"this server does not implement '{info.field_name}' ({allowed})")
        return value

    @field_validator("stop")
    @classmethod
    def _bounded_stop(cls, stop):
        stops = [stop] if isinstance(stop, str) else stop or []
        if len(stops) > MAX_STOP_SEQUENCES or any(not 1 <= len(s) <= 256 for s in stops):
            raise ValueError(f"'stop' takes at most {MAX_STOP_SEQUENCES} strings of 1 to 256 characters")
        return stop

    @model_validator(mode="after")
    def _tool_choice_names_an_offered_tool(self):
        if isinstance(self.tool_choice, NamedToolChoice):
            offered = {tool.function.name for tool in self.tools or []}
            if self.tool_choice.function.name not in offered:
                raise ValueError(f"tool_choice names '{self.tool_choice.function.name}', which is not in 'tools'")
        if self.tool_choice == "required" and not self.tools:
            raise ValueError("tool_choice 'required' needs 'tools'")
        return self

    @property
    def stop_sequences(self) -> list[str]:
        return [self.stop] if isinstance(self.stop, str) else list(self.stop or [])

    @property
    def include_usage(self) -> bool:
        return bool(self.stream_options and self.stream_options.include_usage)


class RequestError(ValueError):
    """A request this server refuses: answered with `status` and OpenAI's error body naming the parameter."""

    def __init__(self, message: str, param: str | None = None, status: int = 400, code: str | None = None):
        super().__init__(message)
        self.param, self.status, self.code = param, status, code


def error_body(message: str, kind: str = "invalid_request_error", param: str | None = None, code=None) -> dict:
    """OpenAI's error object."""
    return {"error": {"message": message, "type": kind, "param": param, "code": code}}


def json_depth_exceeds(value, limit: int = MAX_JSON_DEPTH) -> bool:
    """Whether a parsed JSON document nests deeper than `limit` (checked without recursion)."""
    stack = [(value, 1)]
    while stack:
        item, depth = stack.pop()
        if depth > limit:
            return True
        if isinstance(item, dict):
            stack.extend((child, depth + 1) for child in item.values())
        elif isinstance(item, list):
            stack.extend((child, depth + 1) for child in item)
    return False


def parse_request(body) -> ChatCompletionRequest:
    """The validated request, or a `RequestError` naming the first field that is wrong and why."""
    if not isinstance(body, dict):
        raise RequestError("the request body must be a JSON object")
    if json_depth_exceeds(body):
        raise RequestError(f"the request nests deeper than {MAX_JSON_DEPTH} levels")
    try:
        return ChatCompletionRequest.model_validate(body)
    except ValidationError as error:
        first = error.errors(include_url=False)[0]
        param = ".".join(str(part) for part in first["loc"]) or None
        problem = first["msg"].removeprefix("Value error, ")
        raise RequestError(f"{param}: {problem}" if param else problem, param=param) from None


__all__ = [
    "ChatCompletionRequest",
    "ChatMessage",
    "RequestError",
    "Tool",
    "error_body",
    "json_depth_exceeds",
    "parse_request",
]
