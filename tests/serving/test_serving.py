"""`inkling2 serve` end to end: the real `openai` client against the server on loopback, in-process.

Most tests script the model's text (the server's worker drives any `Runner`; these emit scripted text), so they can
check that reasoning, content and tool calls reach the client as OpenAI's fields; some run the embedded tiny model on
the engine (concurrent requests on it: test_batching.py). Every request is bounded (client timeout, no retries) and
the server, with its threads, is stopped at the end. Attacks and bad input: test_abuse.py.
"""

import json
import threading
import time

import pytest
import torch

from transformers_inkling2.processing.tokenization_inkling2 import build_inkling2_tokenizer
from transformers_inkling2.serving.chat import to_template_messages
from transformers_inkling2.serving.protocol import ChatMessage
from transformers_inkling2.serving.server import Inkling2Server, ServerSettings, model_app
from transformers_inkling2.tiny import build_tiny_causal_lm
from transformers_inkling2_cli import build_parser

from serving_helpers import (
    END,
    EOT,
    MODEL,
    TEXT,
    THINK,
    Script,
    ScriptedRunner,
    leftover_threads,
    openai_client,
    start_server,
)

openai = pytest.importorskip("openai")

WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "Current weather.",
        "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]},
    },
}
FULL_TURN = [
    f"{THINK}The user wants",
    f" the weather.{END}{MODEL}{TEXT}Let me ",
    "check.",
    f"{END}{MODEL}get_weather<|content_invoke_tool_json|>",
    '{"name":"get_weather","args":{"city":"San Francisco","days":[1,2]}}',
    f"{END}{EOT}",
]


def script_tokens(script: Script) -> int:
    return sum(script.count(chunk) for chunk in script.chunks)


@pytest.fixture(scope="module")
def tok():
    return build_inkling2_tokenizer()


@pytest.fixture(scope="module")
def tiny_model():
    return build_tiny_causal_lm()


@pytest.fixture(scope="module")
def processor(tok):
    processing = pytest.importorskip("transformers_inkling2.processing.processing_inkling2")
    from transformers_inkling2.processing.image_processing_inkling2 import Inkling2ImageProcessorPil

    return processing.Inkling2Processor(image_processor=Inkling2ImageProcessorPil(), tokenizer=tok)


@pytest.fixture(scope="module")
def script(tok):
    return Script(tok)


@pytest.fixture(scope="module")
def server(tok, script):
    threads_before = set(threading.enumerate())
    srv = start_server(tok, script)
    yield srv
    srv.stop()
    leftover = leftover_threads(threads_before)  # the event loop's worker threads end just after it stops
    assert not leftover, f"threads left running: {leftover}"


@pytest.fixture()
def client(server, script):
    script.reset(FULL_TURN)
    return openai_client(server)


def prompt_ids(script):
    return script.jobs[-1].inputs["input_ids"][0]


def prompt_text(tok, script):
    return tok.decode(prompt_ids(script), skip_special_tokens=False)


def test_models(client):
    assert [model.id for model in client.models.list()] == ["inkling2-test"]


def test_chat_completion_returns_reasoning_content_and_tool_calls(tok, client, script):
    reply = client.chat.completions.create(
        model="inkling2-test",
        messages=[{"role": "system", "content": "Be useful."}, {"role": "user", "content": "Weather in SF?"}],
        tools=[WEATHER],
        max_tokens=64,
        temperature=0,
        reasoning_effort="low",
    )
    choice = reply.choices[0]
    assert choice.finish_reason == "tool_calls"
    assert choice.message.content == "Let me check."
    assert choice.message.model_extra["reasoning_content"] == "The user wants the weather."
    assert choice.message.model_extra["reasoning"] == "The user wants the weather."
    (tool_call,) = choice.message.tool_calls
    assert tool_call.type == "function" and tool_call.id.startswith("call_")
    assert tool_call.function.name == "get_weather"
    assert json.loads(tool_call.function.arguments) == {"city": "San Francisco", "days": [1, 2]}
    assert reply.usage.prompt_tokens == len(prompt_ids(script))
    assert reply.usage.completion_tokens == script_tokens(script)  # what the runner counted, not re-tokenized text
    # the prompt: system, tool_declare, effort 0.2, user, generation prompt; sampling parameters passed through
    assert prompt_text(tok, script) == tok.apply_chat_template(
        [{"role": "system", "content": "Be useful."}, {"role": "user", "content": "Weather in SF?"}],
        tools=[WEATHER],
        effort="low",
        add_generation_prompt=True,
        tokenize=False,
    )
    assert "Thinking effort level: 0.2" in prompt_text(tok, script)
    params = script.jobs[-1].params
    assert (params.max_new_tokens, params.temperature) == (64, 0.0)


def test_streaming_sends_reasoning_content_and_tool_call_deltas(client):
    stream = client.chat.completions.create(
        model="inkling2-test",
        messages=[{"role": "user", "content": "Weather in SF?"}],
        tools=[WEATHER],
        stream=True,
        stream_options={"include_usage": True},
    )
    reasoning, content, tool_calls, finish, usage = "", "", [], None, None
    for chunk in stream:
        if chunk.usage is not None:
            usage = chunk.usage
        if not chunk.choices:
            continue
        delta = chunk.choices[0].delta
        reasoning += (delta.model_extra or {}).get("reasoning_content") or ""
        content += delta.content or ""
        tool_calls += delta.tool_calls or []
        finish = chunk.choices[0].finish_reason or finish
    assert reasoning == "The user wants the weather."
    assert content == "Let me check."
    (tool_call,) = tool_calls
    assert tool_call.index == 0 and tool_call.function.name == "get_weather"
    assert json.loads(tool_call.function.arguments) == {"city": "San Francisco", "days": [1, 2]}
    assert finish == "tool_calls"
    assert usage is not None and usage.completion_tokens > 0


def test_truncated_reply_finishes_with_length(client, script):
    script.chunks = [f"{THINK}still thinking when max_tokens hit"]  # as many tokens as max_tokens, no end of turn
    reply = client.chat.completions.create(
        model="inkling2-test", messages=[{"role": "user", "content": "q"}], max_tokens=script_tokens(script)
    )
    assert reply.choices[0].finish_reason == "length"
    assert reply.choices[0].message.model_extra["reasoning_content"] == "still thinking when max_tokens hit"
    assert reply.choices[0].message.content == ""


def test_malformed_tool_call_is_reported_not_raised(client, script):
    script.chunks = [
        f"{TEXT}ok{END}{MODEL}get_weather<|content_invoke_tool_json|>" + '{"name":"get_weather","args":{"ci' + END + EOT
    ]
    reply = client.chat.completions.create(model="inkling2-test", messages=[{"role": "user", "content": "q"}], tools=[WEATHER])
    message = reply.choices[0].message
    assert message.content == "ok" and message.tool_calls is None
    assert reply.choices[0].finish_reason == "stop"
    (invalid,) = message.model_extra["invalid_tool_calls"]
    assert invalid["name"] == "get_weather" and "invalid JSON" in invalid["error"]


def test_multi_turn_history_renders_like_tml(tok, client, script):
    """The client sends back our tool call (JSON-string arguments) and a tool result with only tool_call_id."""
    first = client.chat.completions.create(
        model="inkling2-test", messages=[{"role": "user", "content": "Weather in SF?"}], tools=[WEATHER]
    )
    assistant = first.choices[0].message.model_dump(exclude_none=True)
    assistant.pop("reasoning", None)  # keep one name for the reasoning, as clients usually do
    call_id = assistant["tool_calls"][0]["id"]
    script.chunks = [f"{TEXT}It is sunny.{END}{EOT}"]
    history = [
        {"role": "developer", "content": "Be brief."},
        {"role": "user", "content": "Weather in SF?"},
        assistant,
        {"role": "tool", "tool_call_id": call_id, "content": "sunny"},
    ]
    second = client.chat.completions.create(model="inkling2-test", messages=history, tools=[WEATHER], reasoning_effort="high")
    assert second.choices[0].message.content == "It is sunny."
    assert second.choices[0].finish_reason == "stop"

    tml_chat = pytest.importorskip("tml_renderers.chat")
    from tml_renderers import tokenizers, v0

    tml_messages = [
        {"role": "system", "content": "Be brief."},
        {"role": "tool_declare", "content": json.dumps([WEATHER])},
        {"role": "user", "content": "Weather in SF?"},
        {
            "role": "assistant",
            "content": [
                {"type": "thinking", "thinking": "The user wants the weather."},
                {"type": "text", "text": "Let me check."},
            ],
            "tool_calls": [{"id": call_id, "type": "function", "function": assistant["tool_calls"][0]["function"]}],
        },
        {"role": "tool", "tool_call_id": call_id, "name": "get_weather", "content": "sunny"},
    ]
    renderer = v0.Renderer(tokenizers.O200kBaseChatTokenizer())
    spans, _ = renderer.render_for_completion_with_effort(tml_chat.MessageList.from_oss_messages(tml_messages), 0.9)
    expected = [t for span in spans for t in span.span.int_tokens] + [200001]
    assert prompt_ids(script).tolist() == expected


@pytest.mark.parametrize(
    "request_fields,message",
    [
        ({"messages": [{"role": "robot", "content": "x"}]}, "messages.0.role"),
        ({"messages": [{"role": "user", "content": "x"}], "reasoning_effort": "extreme"}, "thinking effort"),
        ({"messages": []}, "at least 1 item"),
        ({"messages": [{"role": "user", "content": "x"}], "max_tokens": 0}, "max_tokens"),
        (
            {"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "data:,"}}]}]},
            "no image processor",
        ),
    ],
)
def test_bad_requests_get_400(client, request_fields, message):
    with pytest.raises(openai.BadRequestError, match=message):
        client.chat.completions.create(model="inkling2-test", **request_fields)


def test_client_leaving_mid_stream_stops_generation(client, script):
    script.reset([f"{TEXT}"] + ["tick "] * 2000, delay=0.005)  # ~10 s if nobody stops it
    stream = client.chat.completions.create(
        model="inkling2-test", messages=[{"role": "user", "content": "q"}], stream=True
    )
    start = time.monotonic()
    for index, _ in enumerate(stream):
        if index == 3:
            break
    stream.close()
    assert script.closed.wait(5), "generation kept running after the client left"
    assert time.monotonic() - start < 5


def test_client_leaving_a_non_streaming_request_stops_generation(server, client, script):
    script.reset([f"{TEXT}"] + ["tick "] * 2000, delay=0.005)
    impatient = openai_client(server, timeout=0.5)
    with pytest.raises(openai.APITimeoutError):
        impatient.chat.completions.create(model="inkling2-test", messages=[{"role": "user", "content": "q"}])
    assert script.closed.wait(5), "generation kept running after the client left"
    assert script.jobs[-1].cancelled.is_set()
    metrics = client.with_options(base_url=server.base_url.removesuffix("/v1")).get("/metrics", cast_to=str)
    assert 'inkling2:request_success_total{finished_reason="abort",model_name="inkling2-test"}' in metrics


def png_data_url(width: int, height: int, color=(10, 200, 30)) -> str:
    import base64
    import io

    from PIL import Image

    buffer = io.BytesIO()
    Image.new("RGB", (width, height), color).save(buffer, format="PNG")
    return "data:image/png;base64," + base64.b64encode(buffer.getvalue()).decode()


def image_message(url: str, text: str = "What is it?") -> list[dict]:
    return [{"role": "user", "content": [{"type": "text", "text": text}, {"type": "image_url", "image_url": {"url": url}}]}]


def test_images_go_through_the_processor(tok, processor, script):
    """An image_url part reaches the processor: pixel values and one placeholder per image feature."""
    with start_server(tok, script, processor) as srv:
        script.chunks = [f"{TEXT}A green rectangle.{END}{EOT}"]
        reply = openai_client(srv).chat.completions.create(
            model="inkling2-test", messages=image_message(png_data_url(120, 80))
        )
    assert reply.choices[0].message.content == "A green rectangle."
    inputs = script.jobs[-1].inputs
    assert "pixel_values" in inputs and "image_grid_thw" in inputs
    features = int(inputs["image_grid_thw"].prod())
    assert features == (80 // 40) * (120 // 40 + 1)  # a width that is a multiple of 40 gets an extra column
    assert inputs["input_ids"][0].tolist().count(tok.convert_tokens_to_ids("<|unused_200054|>")) == features


def test_a_large_image_is_downscaled_to_the_pixel_budget(tok, processor, script):
    with start_server(tok, script, processor, max_image_pixels=200 * 200) as srv:
        script.chunks = [f"{TEXT}ok{END}{EOT}"]
        reply = openai_client(srv).chat.completions.create(
            model="inkling2-test", messages=image_message(png_data_url(1600, 800))
        )
    assert reply.choices[0].message.content == "ok"
    assert int(script.jobs[-1].inputs["image_grid_thw"].prod()) <= 200 * 200 // 1600


def test_the_tiny_model_end_to_end(tok, tiny_model):
    """The real generation path: the engine in the worker thread, streamed text, parsed; the same tokens as
    `generate()`; usage counts the generated tokens themselves."""
    settings = ServerSettings(model_id="tiny", port=0)
    threads_before = set(threading.enumerate())
    with Inkling2Server(model_app(tiny_model, tok, settings)).start() as srv:
        client = openai_client(srv, timeout=30)
        messages = [{"role": "user", "content": "Hello"}]
        reply = client.chat.completions.create(model="tiny", messages=messages, max_tokens=5, temperature=0)
        chunks = list(
            client.chat.completions.create(model="tiny", messages=messages, max_tokens=5, temperature=0, stream=True)
        )
    assert leftover_threads(threads_before) == []
    with torch.no_grad():  # what generate() writes for this prompt
        prompt = tok.apply_chat_template(messages, add_generation_prompt=True, return_tensors="pt")["input_ids"]
        output = tiny_model.generate(prompt, max_new_tokens=5, do_sample=False, pad_token_id=tok.pad_token_id)
    generated = output[0, prompt.shape[1] :]
    assert reply.usage.completion_tokens == len(generated)
    assert reply.usage.prompt_tokens == prompt.shape[1]
    assert reply.choices[0].finish_reason == ("length" if len(generated) == 5 else "stop")
    # greedy: the stream carries the same reply
    streamed = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert streamed == (reply.choices[0].message.content or "")
    assert chunks[-1].choices[0].finish_reason == reply.choices[0].finish_reason
    from transformers_inkling2.processing.response_parsing import parse_response

    assert (parse_response(generated, tok)["content"] or None) == reply.choices[0].message.content


class Drafting(Script):
    """A runner that reports DSpark statistics for its jobs, as `EngineRunner` does from the engine's tallies."""

    def reply(self, job):
        job.dspark = {"steps": 3, "drafts": 3 * 15, "accepted": 20}
        return super().reply(job)


def test_dspark_statistics_reach_the_metrics(tok):
    with start_server(tok, Drafting(tok)) as srv:
        client = openai_client(srv)
        client.chat.completions.create(model="inkling2-test", messages=[{"role": "user", "content": "q"}])
        metrics = client.with_options(base_url=srv.base_url.removesuffix("/v1")).get("/metrics", cast_to=str)
    for name, value in (("steps", 3), ("draft_tokens", 45), ("accepted_tokens", 20)):
        assert f'inkling2:spec_decode_num_{name}_total{{model_name="inkling2-test"}} {value:.1f}' in metrics


def test_dspark_goes_to_the_engine(tok, tiny_model):
    """`inkling2 serve --dspark`: the engine decodes with the model's drafter, so a model without one is refused at
    start with the reason."""
    with pytest.raises(ValueError, match="needs a DSpark drafter"):
        model_app(tiny_model, tok, ServerSettings(model_id="tiny", port=0, dspark=True))


def test_stop_sequences_end_the_reply_before_them(client, script):
    script.chunks = [f"{TEXT}one two ", "thr", "ee four five", f"{END}{EOT}"]
    reply = client.chat.completions.create(
        model="inkling2-test", messages=[{"role": "user", "content": "count"}], stop=["three", "zzz"]
    )
    assert reply.choices[0].message.content == "one two "
    assert reply.choices[0].finish_reason == "stop"
    assert script.jobs[-1].cancelled.is_set()  # the generation was stopped there


def test_a_full_queue_answers_503_with_retry_after(tok, script):
    script.reset([f"{TEXT}"] + ["tick "] * 40, delay=0.02)
    with start_server(tok, script, max_waiting=1) as srv:
        results = []

        def ask():
            try:
                openai_client(srv).chat.completions.create(
                    model="inkling2-test", messages=[{"role": "user", "content": "q"}]
                )
                results.append(200)
            except openai.APIStatusError as error:
                results.append((error.status_code, error.response.headers.get("retry-after")))

        threads = [threading.Thread(target=ask) for _ in range(4)]
        for thread in threads:
            thread.start()
            time.sleep(0.05)
        for thread in threads:
            thread.join(30)
    assert results.count(200) == 2  # one running, one waiting
    assert sorted(r for r in results if r != 200) == [(503, "1"), (503, "1")]


def test_metrics_count_requests_and_tokens(server, client, script):
    client.chat.completions.create(model="inkling2-test", messages=[{"role": "user", "content": "q"}])
    text = client.with_options(base_url=server.base_url.removesuffix("/v1")).get("/metrics", cast_to=str)
    values = {line.split("{")[0]: float(line.split()[-1]) for line in text.splitlines() if line.startswith("inkling2:")}
    assert values["inkling2:num_requests_running"] == 0 and values["inkling2:num_requests_waiting"] == 0
    assert values["inkling2:generation_tokens_total"] >= script_tokens(script)
    assert values["inkling2:prompt_tokens_total"] >= len(prompt_ids(script))
    assert values["inkling2:time_to_first_token_seconds_count"] >= 1
    assert values["inkling2:inter_token_latency_seconds_count"] >= 1


def test_openai_messages_become_template_messages():
    messages = [
        ChatMessage.model_validate(message)
        for message in [
            {"role": "developer", "content": "d"},
            {
                "role": "assistant",
                "tool_calls": [
                    {"id": "1", "type": "function", "function": {"name": "f", "arguments": '{"b": 1, "a": 2}'}}
                ],
            },
        ]
    ]
    converted = to_template_messages(messages)
    assert converted[0] == {"role": "system", "content": "d"}
    assert converted[1]["tool_calls"][0]["function"]["arguments"] == {"b": 1, "a": 2}


def test_serve_subcommand_parses():
    args = build_parser().parse_args(["serve", "--port", "0", "--effort", "high", "--max-tokens", "16"])
    assert (args.command, args.port, args.effort, args.max_tokens, args.host) == ("serve", 0, "high", 16, "127.0.0.1")
    engine = (args.max_num_seqs, args.page_size, args.num_pages, args.max_step_tokens, args.dspark)
    assert engine == (None, None, None, None, False)  # left out: the settings' defaults
    args = build_parser().parse_args(["serve", "--api-key", "k" * 16, "--allowed-media-domains", "a.org", "b.org"])
    assert (args.api_key, args.allowed_media_domains, args.max_waiting) == ("k" * 16, ["a.org", "b.org"], None)


UNIT = {
    "type": "function",
    "function": {
        "name": "set_unit",
        "parameters": {
            "type": "object",
            "properties": {"unit": {"enum": ["celsius", "fahrenheit"]}, "precise": {"type": "boolean"}},
            "required": ["unit", "precise"],
            "additionalProperties": False,
        },
    },
}


@pytest.fixture(scope="module")
def tiny_server(tok, tiny_model):
    with Inkling2Server(model_app(tiny_model, tok, ServerSettings(model_id="tiny", port=0))).start() as srv:
        yield srv


DAY = {
    "type": "function",
    "function": {
        "name": "pick_day",
        "parameters": {"type": "object", "properties": {"day": {"type": "integer", "minimum": 1, "maximum": 7}},
                       "required": ["day"], "additionalProperties": False},
    },
}  # fmt: skip


@pytest.mark.parametrize("tool_choice", ["required", {"type": "function", "function": {"name": "set_unit"}}])
def test_tool_choice_required_or_named_makes_the_random_model_call_an_offered_tool(tiny_server, tool_choice):
    """Bounded argument schemas: random weights never end an unbounded string (the grammar would hold, the reply
    would be cut off by max_tokens)."""
    reply = openai_client(tiny_server, timeout=120).chat.completions.create(
        model="tiny", messages=[{"role": "user", "content": "Use celsius."}], tools=[DAY, UNIT],
        tool_choice=tool_choice, parallel_tool_calls=False, max_tokens=128, temperature=0,
    )  # fmt: skip
    assert reply.choices[0].finish_reason == "tool_calls"
    (call,) = reply.choices[0].message.tool_calls
    arguments = json.loads(call.function.arguments)
    if call.function.name == "set_unit":
        assert arguments["unit"] in ("celsius", "fahrenheit") and isinstance(arguments["precise"], bool)
    else:
        assert call.function.name == "pick_day" and tool_choice == "required"
        assert 1 <= arguments["day"] <= 7


def test_a_json_schema_response_format_makes_the_random_model_write_matching_json(tiny_server):
    schema = {
        "type": "object",
        "properties": {"answer": {"enum": ["yes", "no"]}, "sure": {"type": "boolean"}},
        "required": ["answer", "sure"],
        "additionalProperties": False,
    }
    reply = openai_client(tiny_server, timeout=120).chat.completions.create(
        model="tiny", messages=[{"role": "user", "content": "Is it?"}], max_tokens=96, temperature=0.8, seed=1,
        response_format={"type": "json_schema", "json_schema": {"name": "verdict", "schema": schema}},
    )  # fmt: skip
    content = json.loads(reply.choices[0].message.content)
    assert content["answer"] in ("yes", "no") and isinstance(content["sure"], bool) and set(content) == set(schema["properties"])


class Failing(ScriptedRunner):
    def reply(self, job):
        yield f"{TEXT}partial", 2
        raise RuntimeError("the device fell over")


def test_a_failing_generation_is_a_500_with_its_reason_and_ends_a_stream_with_done(tok):
    with start_server(tok, Failing()) as srv:
        client = openai_client(srv)
        with pytest.raises(openai.InternalServerError, match="RuntimeError: the device fell over"):
            client.chat.completions.create(model="inkling2-test", messages=[{"role": "user", "content": "q"}])
        stream = client.chat.completions.with_raw_response.create(
            model="inkling2-test", messages=[{"role": "user", "content": "q"}], stream=True
        )
        lines = [line for line in stream.http_response.iter_lines() if line]
        metrics = client.with_options(base_url=srv.base_url.removesuffix("/v1")).get("/metrics", cast_to=str)
    assert '"server_error"' in lines[-2] and "the device fell over" in lines[-2] and lines[-1] == "data: [DONE]"
    assert 'inkling2:request_success_total{finished_reason="error",model_name="inkling2-test"} 2.0' in metrics


class FailsOnce(ScriptedRunner):
    """Two jobs at once; the first step that has both fails, and later jobs are answered."""

    capacity = 2

    def __init__(self):
        super().__init__()
        self.failed = False

    def reply(self, job):
        while not self.failed and self.num_running < 2:
            time.sleep(0.005)
            yield None
        if not self.failed:
            self.failed = True
            raise RuntimeError("the device fell over")
        yield f"{TEXT}ok{END}{EOT}", 3


def test_a_failing_step_fails_every_request_in_flight_and_the_server_goes_on(tok):
    with start_server(tok, FailsOnce()) as srv:
        client = openai_client(srv)
        errors = []

        def ask():
            with pytest.raises(openai.InternalServerError, match="RuntimeError: the device fell over") as error:
                client.chat.completions.create(model="inkling2-test", messages=[{"role": "user", "content": "q"}])
            errors.append(error)

        threads = [threading.Thread(target=ask) for _ in range(2)]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join(15)
        assert len(errors) == 2
        reply = client.chat.completions.create(model="inkling2-test", messages=[{"role": "user", "content": "q"}])
    assert reply.choices[0].message.content == "ok"
