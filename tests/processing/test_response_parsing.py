"""Parsing model output: our incremental parser, transformers' declarative `response_template`, and the streamer.

Oracles: tml's own parser (`Renderer.render_for_completion(...)[1].parse_tokens`) on well-formed output, and the
chat template: a parsed reply rendered back must give the tokens the model wrote.
"""

import json
import random

import pytest
import torch
from transformers import pipeline

from transformers_inkling2.processing.chat_template import unescape_text
from transformers_inkling2.processing.response_parsing import (
    MAX_TOOL_NAME,
    RESPONSE_TEMPLATE,
    Inkling2ResponseParser,
    Inkling2ResponseStreamer,
    parse_response,
)
from transformers_inkling2.processing.tokenization_inkling2 import build_inkling2_tokenizer
from transformers_inkling2.tiny import build_tiny_causal_lm

THINK, TEXT, END, MODEL, EOT = (
    "<|content_thinking|>",
    "<|content_text|>",
    "<|end_message|>",
    "<|message_model|>",
    "<|content_model_end_sampling|>",
)


def tool(name, json_body):
    return f"{MODEL}{name}<|content_invoke_tool_json|>{json_body}{END}"


def call(name, arguments):
    return {"type": "function", "function": {"name": name, "arguments": arguments}}


@pytest.fixture(scope="module")
def tok():
    return build_inkling2_tokenizer()


@pytest.fixture(scope="module")
def tiny_model():
    return build_tiny_causal_lm()


# (id, generated text, expected message) for well-formed turns: the first block's <|message_model|> is in the prompt
WELL_FORMED = [
    ("text", f"{TEXT}Hello there.{END}{EOT}", {"content": "Hello there.", "thinking": None, "tool_calls": []}),
    (
        "thinking-text",
        f"{THINK}Let me think.{END}{MODEL}{TEXT}Done.{END}{EOT}",
        {"content": "Done.", "thinking": "Let me think.", "tool_calls": []},
    ),
    (
        "thinking-text-tool",
        f"{THINK}hmm{END}{MODEL}{TEXT}Checking.{END}"
        + tool("get_weather", '{"name":"get_weather","args":{"city":"SF"}}')
        + EOT,
        {"content": "Checking.", "thinking": "hmm", "tool_calls": [call("get_weather", {"city": "SF"})]},
    ),
    (
        "tool-only-nested",
        tool(
            "search", '{"name":"search","args":{"filters":{"site":"a.com","n":[1,2.5,null,true]},"query":"ü 😀"}}'
        ).removeprefix(MODEL)  # the first block's <|message_model|> is in the prompt
        + EOT,
        {
            "content": "",
            "thinking": None,
            "tool_calls": [call("search", {"filters": {"site": "a.com", "n": [1, 2.5, None, True]}, "query": "ü 😀"})],
        },
    ),
    (
        "parallel-tools",
        f"{THINK}two calls{END}"
        + tool("get_weather", '{"name":"get_weather","args":{"city":"SF"}}')
        + tool("get_weather", '{"name":"get_weather","args":{"city":"NYC"}}')
        + tool("now", '{"name":"now","args":{}}')
        + EOT,
        {
            "content": "",
            "thinking": "two calls",
            "tool_calls": [
                call("get_weather", {"city": "SF"}),
                call("get_weather", {"city": "NYC"}),
                call("now", {}),
            ],
        },
    ),
    (
        "blocks-in-any-order",
        f"{TEXT}first text{END}{MODEL}{THINK}then a thought{END}"
        + tool("f", '{"name":"f","args":{"x":1}}')
        + f"{MODEL}{TEXT} and more text{END}{MODEL}{THINK} and another thought{END}{EOT}",
        {
            "content": "first text and more text",
            "thinking": "then a thought and another thought",
            "tool_calls": [call("f", {"x": 1})],
        },
    ),
    (
        "whitespace-kept",
        f"{THINK}\n  indented\n{END}{MODEL}{TEXT}  two spaces\n\n```py\nx = 1\n```\n{END}{EOT}",
        {"content": "  two spaces\n\n```py\nx = 1\n```\n", "thinking": "\n  indented\n", "tool_calls": []},
    ),
    (
        "markup-in-text",
        f"{TEXT}a < b and c <| d |> e, <html> & {{json: true}}{END}{EOT}",
        {"content": "a < b and c <| d |> e, <html> & {json: true}", "thinking": None, "tool_calls": []},
    ),
    ("empty-text", f"{TEXT}{END}{EOT}", {"content": "", "thinking": None, "tool_calls": []}),
]


def test_text_outside_any_block_streams_after_a_bounded_hold():
    """Text between blocks may be a tool's name (held until its kind token); past MAX_TOOL_NAME characters it is
    stray text and streams as content, as a random model's reply must (it arrived all at the end before)."""
    parser = Inkling2ResponseParser()
    words = [f"word{i} " for i in range(120)]
    released_early = []
    for index, word in enumerate(words):
        released_early += [(index, d.text) for d in parser.feed(word)]
    first_release = released_early[0][0]
    assert len("".join(words[: first_release + 1])) > MAX_TOOL_NAME >= len("".join(words[:first_release]))
    assert all(index == first_release or len(text) == len(words[index]) for index, text in released_early)
    tail = "".join(d.text for d in parser.feed(f"{MODEL}{TEXT}done{END}{EOT}"))
    assert "".join(text for _, text in released_early) + tail == "".join(words) + "done"
    assert parser.message["content"] == "".join(words) + "done"


@pytest.mark.parametrize("name,text,expected", WELL_FORMED, ids=[case[0] for case in WELL_FORMED])
def test_parse_well_formed(tok, name, text, expected):
    assert parse_response(text) == {"role": "assistant", **expected}
    # from ids too, with or without the prompt's last token, and with padding after the end of the turn
    ids = tok(text, add_special_tokens=False)["input_ids"]
    assert parse_response(ids, tok) == {"role": "assistant", **expected}
    assert parse_response(torch.tensor([200001, *ids, 199999, 199999]), tok) == {"role": "assistant", **expected}


@pytest.mark.parametrize("name,text,expected", WELL_FORMED, ids=[case[0] for case in WELL_FORMED])
def test_streaming_deltas_add_up(name, text, expected):
    """Whatever the chunking, the deltas add up to the whole parse, and text is never released twice."""
    rng = random.Random(name)
    for chunking in ("chars", "random", "whole"):
        parser = Inkling2ResponseParser()
        deltas, position = [], 0
        while position < len(text):
            size = {"chars": 1, "random": rng.randint(1, 12), "whole": len(text)}[chunking]
            deltas += parser.feed(text[position : position + size])
            position += size
        deltas += parser.finish()
        assert parser.message == {"role": "assistant", **expected}
        assert "".join(d.text for d in deltas if d.kind == "content") == expected["content"]
        assert "".join(d.text for d in deltas if d.kind == "thinking") == (expected["thinking"] or "")
        calls = [d for d in deltas if d.kind == "tool_call"]
        assert [d.tool_call for d in calls] == expected["tool_calls"]
        assert [d.index for d in calls] == list(range(len(calls)))


def test_text_is_released_before_the_block_ends():
    parser = Inkling2ResponseParser()
    assert [(d.kind, d.text) for d in parser.feed(f"{THINK}step one, ")] == [("thinking", "step one, ")]
    assert [(d.kind, d.text) for d in parser.feed("step two <")] == [("thinking", "step two ")]  # "<" may open a token
    assert [(d.kind, d.text) for d in parser.feed(f"|end_message|>{MODEL}{TEXT}Hi")] == [("content", "Hi")]
    assert parser.feed(f"{END}{EOT}") == []
    assert parser.ended_turn


@pytest.mark.parametrize("name,text,expected", WELL_FORMED, ids=[case[0] for case in WELL_FORMED])
def test_matches_tml_parser(tok, name, text, expected):
    tml_chat = pytest.importorskip("tml_renderers.chat")
    from tml_renderers import tokenizers, v0

    renderer = v0.Renderer(tokenizers.O200kBaseChatTokenizer())
    _, tml_parser = renderer.render_for_completion(
        tml_chat.MessageList.from_oss_messages([{"role": "user", "content": "q"}])
    )
    (message,) = tml_chat.MessageList(
        tml_parser.parse_tokens(tok(text, add_special_tokens=False)["input_ids"])
    ).to_oss_messages()
    parts = (
        message["content"] if isinstance(message["content"], list) else [{"type": "text", "text": message["content"]}]
    )
    assert "".join(p["text"] for p in parts if p["type"] == "text") == expected["content"]
    assert "".join(p["thinking"] for p in parts if p["type"] == "thinking") == (expected["thinking"] or "")
    tml_calls = [
        call(c["function"]["name"], json.loads(c["function"]["arguments"])) for c in message.get("tool_calls", [])
    ]
    assert tml_calls == expected["tool_calls"]


@pytest.mark.parametrize("name,text,expected", WELL_FORMED, ids=[case[0] for case in WELL_FORMED])
def test_parsed_reply_renders_back_to_the_same_tokens(tok, name, text, expected):
    """prompt + generated text == the conversation with the parsed reply appended (thinking, text, calls)."""
    if name == "blocks-in-any-order":
        pytest.skip("several blocks of one kind are concatenated, so their order is not kept")
    history = [{"role": "user", "content": "q"}]
    prompt = tok.apply_chat_template(history, add_generation_prompt=True, tokenize=False)
    message = parse_response(text)
    if not message["content"] and message["tool_calls"]:
        message["content"] = None  # as OpenAI writes a reply that only calls tools
    rendered = tok.apply_chat_template([*history, message], tokenize=False)
    # the template escapes `<|` in the reply's text (so it cannot become a special token); the ids are the same
    assert unescape_text(rendered) == prompt + text
    assert tok(rendered, add_special_tokens=False)["input_ids"] == tok(prompt + text, add_special_tokens=False)[
        "input_ids"
    ]


# ---------------------------------------------------------------------------------------------------------------
# Truncated and malformed output: reported in the result, never raised


def test_truncated_inside_thinking():
    message = parse_response(f"{THINK}a long thought that was cut")
    assert message["thinking"] == "a long thought that was cut"
    assert message["truncated"] is True
    assert message["tool_calls"] == []


def test_truncated_inside_text_keeps_a_dangling_partial_token():
    message = parse_response(f"{THINK}t{END}{MODEL}{TEXT}half an answer <|end_mes")
    assert message["content"] == "half an answer <|end_mes"
    assert message["truncated"] is True


def test_truncated_inside_tool_json():
    message = parse_response(
        f"{TEXT}Calling.{END}" + f'{MODEL}get_weather<|content_invoke_tool_json|>{{"name":"get_weather","args":{{"ci'
    )
    assert message["content"] == "Calling."
    assert message["tool_calls"] == []
    (invalid,) = message["invalid_tool_calls"]
    assert invalid["name"] == "get_weather"
    assert invalid["raw"] == '{"name":"get_weather","args":{"ci'
    assert "cut off" in invalid["error"]
    assert message["truncated"] is True


def test_truncated_after_complete_tool_json_keeps_the_call():
    message = parse_response(tool("f", '{"name":"f","args":{"a":1}}').removesuffix(END))
    assert message["tool_calls"] == [call("f", {"a": 1})]
    assert message["truncated"] is True


def test_truncated_inside_a_tool_name():
    message = parse_response(f"{TEXT}ok{END}{MODEL}get_wea")
    assert message["content"] == "ok" and message["tool_calls"] == []
    assert (
        message["invalid_tool_calls"][0]["name"] == "get_wea" and "cut off" in message["invalid_tool_calls"][0]["error"]
    )


def test_one_word_without_any_block_token_is_content():
    """Issue #26: a reply of plain text (cut after one word, or decoded without its special tokens) is content, not a
    truncated tool call named after the word. tml's parser finds no message in it (EmptyResponseError: its header
    text is dropped); we keep the text, as we keep any text outside blocks, and say the turn did not end."""
    for text in ("hello", "hello world", "get_weather"):
        message = parse_response(text)
        assert message == {"role": "assistant", "content": text, "thinking": None, "tool_calls": [], "truncated": True}


def test_truncated_between_blocks():
    message = parse_response(f"{TEXT}done{END}{MODEL}")
    assert message == {"role": "assistant", "content": "done", "thinking": None, "tool_calls": [], "truncated": True}


@pytest.mark.parametrize(
    "body,error",
    [
        ('{"name":"f","args":{"x":}}', "invalid JSON"),
        ("not json at all", "invalid JSON"),
        ('["f", {}]', "not a JSON object"),
        ('{"name":"f","args":[1,2]}', "args are not a JSON object"),
        ('{"name":"f","args":{"x":1}} trailing', "invalid JSON"),
    ],
)
def test_malformed_tool_call_is_reported_and_parsing_goes_on(body, error):
    text = f"{THINK}t{END}" + tool("f", body) + tool("ok", '{"name":"ok","args":{}}') + f"{MODEL}{TEXT}after{END}{EOT}"
    parser = Inkling2ResponseParser()
    deltas = [d for ch in text for d in parser.feed(ch)] + parser.finish()
    message = parser.message
    assert message["tool_calls"] == [call("ok", {})]
    assert message["content"] == "after" and message["thinking"] == "t"
    (invalid,) = message["invalid_tool_calls"]
    assert invalid["name"] == "f" and invalid["raw"] == body and error in invalid["error"]
    assert "truncated" not in message
    assert [d.kind for d in deltas if "tool" in d.kind] == ["invalid_tool_call", "tool_call"]


def test_tool_json_without_args_means_no_arguments():
    assert parse_response(tool("now", '{"name":"now"}') + EOT)["tool_calls"] == [call("now", {})]


def test_stray_text_outside_blocks_is_kept_as_content():
    assert parse_response("plain text without any block")["content"] == "plain text without any block"
    message = parse_response(f"{TEXT}a{END}\n{MODEL}oops{TEXT}b{END}{EOT}")
    assert message["content"] == "aoopsb"


def test_everything_after_the_end_of_turn_is_ignored():
    message = parse_response(f"{TEXT}a{END}{EOT}{MODEL}{TEXT}never{END}<|endoftext|>")
    assert message["content"] == "a" and "truncated" not in message


def test_finished_parser_refuses_more_input():
    parser = Inkling2ResponseParser()
    parser.finish()
    with pytest.raises(RuntimeError):
        parser.feed("x")


# ---------------------------------------------------------------------------------------------------------------
# transformers' declarative response_template (what pipelines and `transformers serve` use)


def test_tokenizer_carries_the_response_template(tok):
    assert tok.response_template == RESPONSE_TEMPLATE


@pytest.mark.parametrize("name,text,expected", WELL_FORMED, ids=[case[0] for case in WELL_FORMED])
def test_transformers_parse_response_agrees_on_well_formed_output(tok, name, text, expected):
    prompt = tok.apply_chat_template([{"role": "user", "content": "q"}], add_generation_prompt=True)
    ids = tok(text, add_special_tokens=False)["input_ids"]
    parsed = tok.parse_response(ids, prefix=prompt)
    # transformers leaves out empty fields
    assert parsed.get("content", "") == expected["content"]
    assert parsed.get("thinking") == expected["thinking"]
    assert parsed.get("tool_calls", []) == expected["tool_calls"]


def test_transformers_streaming_parser_events(tok):
    prompt = tok.apply_chat_template([{"role": "user", "content": "q"}], add_generation_prompt=True, tokenize=False)
    stream = tok.get_response_parser(prefix=prompt)
    text = WELL_FORMED[2][1]
    events = [event for ch in text for event in stream.feed(ch)]
    message, final_events = stream.finalize()
    events += final_events
    thinking = "".join(e["text"] for e in events if e["type"] == "region_chunk" and e["field"] == "thinking")
    content = "".join(e["text"] for e in events if e["type"] == "region_chunk" and e["field"] == "content")
    calls = [e["value"] for e in events if e["type"] == "region_close" and e["field"] == "tool_calls"]
    assert (thinking, content, calls) == ("hmm", "Checking.", [call("get_weather", {"city": "SF"})])
    assert message["tool_calls"] == calls


def test_transformers_parser_does_not_raise_on_malformed_or_truncated_calls(tok):
    """Its limit: a malformed or cut-off call keeps `arguments` as text (ours reports it as invalid instead)."""
    for text in (
        tool("f", '{"name":"f","args":{"x":}}') + EOT,
        tool("f", '{"name":"f","args":{"x":1'),
    ):
        parsed = tok.parse_response(text, prefix="")
        assert isinstance(parsed["tool_calls"][0]["function"]["arguments"], str)


def test_pipeline_parses_chat_replies_by_itself(tok, tiny_model):
    """With a response_template on the tokenizer, the text-generation pipeline returns a parsed message."""
    generator = pipeline("text-generation", model=tiny_model, tokenizer=tok)
    out = generator([{"role": "user", "content": "Hi"}], max_new_tokens=6, do_sample=False)
    reply = out[0]["generated_text"][-1]
    assert isinstance(reply, dict) and reply["role"] == "assistant"


# ---------------------------------------------------------------------------------------------------------------
# The streamer, for `generate(streamer=...)`


def test_streamer_waits_for_whole_characters(tok):
    """An emoji spans several byte-level tokens: no replacement character may leak into a delta."""
    deltas = []
    streamer = Inkling2ResponseStreamer(tok, on_delta=deltas.append)
    ids = tok(f"{TEXT}hi 😀🤗 done{END}{EOT}", add_special_tokens=False)["input_ids"]
    streamer.put(torch.tensor([[1, 2, 3]]))  # the prompt, skipped
    for token in ids:
        streamer.put(torch.tensor([token]))
    streamer.end()
    assert all("\ufffd" not in d.text for d in deltas)
    assert "".join(d.text for d in deltas) == "hi 😀🤗 done"
    assert streamer.parser.message["content"] == "hi 😀🤗 done"


def test_streamer_with_generate_on_the_tiny_model(tok, tiny_model):
    """The tiny model's text is random; the streamed deltas must still equal the parse of its whole output."""
    messages = [{"role": "user", "content": "Hi"}]
    prompt = tok.apply_chat_template(messages, add_generation_prompt=True, return_tensors="pt")["input_ids"]
    streamer = Inkling2ResponseStreamer(tok)
    output = tiny_model.generate(
        prompt, max_new_tokens=12, do_sample=False, streamer=streamer, pad_token_id=tok.pad_token_id
    )
    deltas = list(streamer)
    whole = parse_response(output[0, prompt.shape[1] :], tok)
    assert streamer.parser.message == whole
    assert "".join(d.text for d in deltas if d.kind == "content") == whole["content"]
    assert "".join(d.text for d in deltas if d.kind == "thinking") == (whole["thinking"] or "")
