"""Constrained decoding (`generation/constrained.py`): `reply_grammar` turns OpenAI's tool_choice / response_format
into a grammar of the whole reply, `GrammarLogitsProcessor` enforces it in generate(). With the tiny model's random
weights, the constrained reply must still parse (`parse_response`) into a call of an offered tool whose arguments
match its schema, or into JSON text matching the response schema, greedy and sampled; the same model unconstrained
does not, so the constraint is doing the work. Schemas keep values short (enums, bounded integers and strings):
random weights would otherwise write digits and string characters for hundreds of tokens."""

import json
import re
import sys

import pytest
import torch
from transformers import LogitsProcessor, LogitsProcessorList

pytest.importorskip("llguidance")

from transformers_inkling2.generation.constrained import (
    GrammarLogitsProcessor,
    llguidance_tokenizer,
    reply_grammar,
)
from transformers_inkling2.processing.chat_template import unescape_text
from transformers_inkling2.processing.response_parsing import parse_response
from transformers_inkling2.processing.tokenization_inkling2 import (
    NUM_BPE_RANKS,
    SPECIAL_TOKENS,
    VOCAB_SIZE,
    build_inkling2_tokenizer,
    default_tiktoken_path,
    load_tiktoken_ranks,
)
from transformers_inkling2.tiny import build_tiny_causal_lm, randomize_, tiny_dspark_config, tiny_text_config

WEATHER = {
    "type": "object",
    "properties": {"unit": {"enum": ["celsius", "fahrenheit"]}, "city": {"type": "string", "maxLength": 6}},
    "required": ["city", "unit"],
    "additionalProperties": False,
}
ADD = {
    "type": "object",
    "properties": {
        "a": {"type": "integer", "minimum": 0, "maximum": 99},
        "b": {"type": "integer", "minimum": -5, "maximum": 5},
        "exact": {"type": "boolean"},
    },
    "required": ["a", "b"],
    "additionalProperties": False,
}
TOOLS = [
    {"type": "function", "function": {"name": "get_weather", "description": "Weather", "parameters": WEATHER}},
    {"type": "function", "function": {"name": "add", "description": "Adds", "parameters": ADD}},
    {"type": "function", "function": {"name": "now", "description": "The time"}},  # no parameters
]
SCHEMAS = {"get_weather": WEATHER, "add": ADD, "now": {"type": "object", "additionalProperties": False}}
ANSWER = {
    "type": "object",
    "properties": {
        "label": {"enum": ["yes", "no", "maybe"]},
        "count": {"type": "integer", "minimum": 1, "maximum": 20},
        "ok": {"type": "boolean"},
        "note": {"type": "string", "maxLength": 5},
    },
    "required": ["label", "count", "ok"],
    "additionalProperties": False,
}
MESSAGES = [{"role": "user", "content": "What is the weather in Paris, and what is 2 + 3?"}]
EOS = SPECIAL_TOKENS["<|content_model_end_sampling|>"]
THINKING, END_MESSAGE = SPECIAL_TOKENS["<|content_thinking|>"], SPECIAL_TOKENS["<|end_message|>"]
SAMPLING = [False, 0, 1, 2]  # greedy, then sampling with these seeds
SAMPLING_IDS = ["greedy", "sample-0", "sample-1", "sample-2"]


@pytest.fixture(scope="module")
def tok():
    return build_inkling2_tokenizer()


@pytest.fixture(scope="module")
def model():
    return build_tiny_causal_lm()


@pytest.fixture(scope="module")
def prompt(tok):
    return tok.apply_chat_template(MESSAGES, tools=TOOLS, add_generation_prompt=True, return_tensors="pt")["input_ids"]


def conforms(value, schema) -> bool:
    """A JSON-schema check of the subset these tests use."""
    if "enum" in schema and value not in schema["enum"]:
        return False
    kind = schema.get("type")
    if kind == "object":
        if not isinstance(value, dict) or any(key not in value for key in schema.get("required", [])):
            return False
        properties = schema.get("properties", {})
        if schema.get("additionalProperties") is False and any(key not in properties for key in value):
            return False
        return all(conforms(item, properties[key]) for key, item in value.items() if key in properties)
    if kind == "integer":
        return (
            isinstance(value, int)
            and not isinstance(value, bool)
            and schema.get("minimum", value) <= value <= schema.get("maximum", value)
        )
    if kind == "string":
        return isinstance(value, str) and len(value) <= schema.get("maxLength", len(value))
    if kind == "boolean":
        return isinstance(value, bool)
    return True


def generate(model, tok, prompt, grammar=None, sample=False, max_new_tokens=120, extra=(), **kwargs):
    """The new tokens of one constrained (or, with grammar None, free) generation; `sample` is False (greedy) or a
    seed. `extra` processors run before the grammar's."""
    processors = LogitsProcessorList([*extra, *([GrammarLogitsProcessor(tok, grammar)] if grammar else [])])
    if sample is not False:
        torch.manual_seed(sample)
    output = model.generate(
        prompt,
        attention_mask=torch.ones_like(prompt),
        max_new_tokens=max_new_tokens,
        do_sample=sample is not False,
        logits_processor=processors,
        pad_token_id=tok.pad_token_id,
        **kwargs,
    )
    return output[0, prompt.shape[1] :]


def assert_valid_calls(message, names=("get_weather", "add", "now")):
    assert not message.get("truncated") and not message.get("invalid_tool_calls"), message
    assert message["tool_calls"], message
    for call in message["tool_calls"]:
        name, arguments = call["function"]["name"], call["function"]["arguments"]
        assert name in names, message
        assert conforms(arguments, SCHEMAS[name]), (name, arguments)


def thinking_tokens(ids) -> int:
    ids = ids.tolist()
    if not ids or ids[0] != THINKING:
        return 0
    return ids.index(END_MESSAGE) - 1


# ---------------------------------------------------------------------------------------------------------------
# The grammar


@pytest.mark.parametrize(
    "request_",
    [
        {},
        {"tools": TOOLS},
        {"tools": TOOLS, "tool_choice": "auto"},
        {"tools": TOOLS, "tool_choice": "none"},
        {"tool_choice": "none"},
        {"tools": TOOLS, "response_format": {"type": "text"}},
    ],
    ids=["nothing", "tools", "auto", "none", "none-without-tools", "text-format"],
)
def test_nothing_constrains_auto_none_or_text(request_):
    assert reply_grammar(**request_) is None


@pytest.mark.parametrize(
    "request_, message",
    [
        ({"tools": TOOLS, "tool_choice": {"type": "function", "function": {"name": "nope"}}}, r"tool_choice names function 'nope'.*'get_weather'"),
        ({"tool_choice": "required"}, r"'required' but no tools are given"),
        ({"tools": TOOLS, "tool_choice": "always"}, r"tool_choice 'always' is not understood"),
        ({"tools": TOOLS, "tool_choice": {"type": "function"}}, r"tool_choice.function.name"),
        ({"tool_choice": {"type": "function", "function": {"name": "f"}}}, r"names function 'f', but no tools are given"),
        (
            {"tools": [{"type": "function", "function": {"name": "f", "parameters": {"type": "object", "properties": {"x": {"type": "strin"}}}}}], "tool_choice": "required"},
            r"tools\[0\].function.parameters .*Invalid type: strin",
        ),
        (
            {"tools": [{"type": "function", "function": {"name": "f", "parameters": {"type": "string"}}}], "tool_choice": "required"},
            r"tools\[0\].function.parameters of tool 'f' must describe an object",
        ),
        ({"tools": [TOOLS[0], TOOLS[0]], "tool_choice": "required"}, r"more than once: \['get_weather'\]"),
        ({"tools": [{"type": "function", "function": {"parameters": {}}}], "tool_choice": "required"}, r"tools\[0\].function.name"),
        ({"tools": [{"type": "custom", "name": "x"}], "tool_choice": "required"}, r"tools\[0\] has type 'custom'"),
        ({"response_format": {"type": "json_schema", "json_schema": {"name": "x"}}}, r"response_format.json_schema.schema must be"),
        ({"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {"$ref": "#/nowhere"}}}}, r"response_format.json_schema.schema .*nowhere"),
        ({"response_format": {"type": "yaml"}}, r"response_format.type 'yaml'"),
        ({"response_format": "json"}, r"response_format must be"),
        ({"response_format": {"type": "json_object"}, "max_thinking_tokens": -1}, r"max_thinking_tokens"),
    ],
    ids=[
        "unknown-name", "required-without-tools", "unknown-choice", "choice-without-name", "named-without-tools",
        "bad-parameters",
        "non-object-parameters", "duplicate-names", "nameless-tool", "custom-tool", "schema-missing", "bad-ref",
        "unknown-format", "format-not-a-dict", "negative-thinking-bound",
    ],
)  # fmt: skip
def test_bad_requests_raise_value_errors_naming_the_field_and_the_fix(request_, message):
    with pytest.raises(ValueError, match=message):
        reply_grammar(**request_)


def test_the_grammar_writes_blocks_as_the_chat_template_does():
    grammar = reply_grammar(tools=TOOLS, tool_choice="required", max_thinking_tokens=7)
    assert "start: thinking? reply" in grammar
    assert "thinking_text: <[0-186,188-199997]>{1,7}" in grammar
    assert "calls: call (<|message_model|> call)*" in grammar
    assert '"get_weather" <|content_invoke_tool_json|> "{\\"name\\":\\"get_weather\\",\\"args\\":" args_0' in grammar
    # arguments: compact, top-level properties sorted (the template sorts them)
    arguments = json.loads(re.search(r"args_0: %json (.*)", grammar).group(1))
    assert list(arguments["properties"]) == ["city", "unit"] and arguments["x-guidance"]["whitespace_flexible"] is False
    assert json.loads(re.search(r"args_2: %json (.*)", grammar).group(1))["additionalProperties"] is False
    single = reply_grammar(tools=TOOLS, tool_choice="required", parallel_tool_calls=False, thinking=False)
    assert "calls: call\n" in single and "thinking" not in single
    named = reply_grammar(tools=TOOLS, tool_choice={"type": "function", "function": {"name": "add"}})
    assert "call: call_1\n" in named and "call_0" not in named
    assert "thinking" not in reply_grammar(response_format={"type": "json_object"}, max_thinking_tokens=0)
    both = reply_grammar(tools=TOOLS, tool_choice="auto", response_format={"type": "json_object"})
    assert "reply: calls | text" in both
    text_only = reply_grammar(tools=TOOLS, tool_choice="none", response_format={"type": "json_object"})
    assert "reply: text\n" in text_only and "call" not in text_only


def test_llguidance_sees_the_vocabulary_as_the_tokenizer_does(tok):
    """Its byte view of every ordinary id is o200k's bytes, its special tokens are the 60 added ones (plus id 187, the
    lone byte 0xFF, which llguidance reserves as its marker byte: no UTF-8 text contains it, so no grammar allows it),
    and eos is the end of a turn. The view is built once per tokenizer."""
    ll = llguidance_tokenizer(tok)
    assert llguidance_tokenizer(tok) is ll
    assert ll.vocab_size == VOCAB_SIZE and ll.eos_token == EOS
    ranks = {rank: token for token, rank in load_tiktoken_ranks(default_tiktoken_path()).items()}
    assert ranks[187] == b"\xff"
    differing = [i for i in range(NUM_BPE_RANKS) if ll.decode_bytes([i]) != ranks[i]]
    assert differing == [187]
    special = {i for i in range(VOCAB_SIZE) if ll.is_special_token(i)}
    assert special == set(SPECIAL_TOKENS.values()) | {187}
    assert all(ll.decode_bytes([i]) == name.encode() for name, i in SPECIAL_TOKENS.items())


# ---------------------------------------------------------------------------------------------------------------
# The mask


def test_the_mask_covers_the_padded_vocabulary_and_ends_with_eos(tok):
    grammar = reply_grammar(tools=TOOLS, tool_choice={"type": "function", "function": {"name": "now"}}, thinking=False)
    processor = GrammarLogitsProcessor(tok, grammar)
    prompt = torch.tensor([[5, 6, 7]])
    ids = prompt
    while True:
        scores = processor(ids, torch.zeros(1, 201024))
        allowed = torch.isfinite(scores[0]).nonzero().flatten().tolist()
        assert allowed and max(allowed) < VOCAB_SIZE and 187 not in allowed
        ids = torch.cat([ids, torch.tensor([[allowed[0]]])], 1)
        if allowed[0] == EOS:
            assert allowed == [EOS]
            break
        assert ids.shape[1] < 40
    assert tok.decode(ids[0, 3:]) == (
        'now<|content_invoke_tool_json|>{"name":"now","args":{}}<|end_message|><|content_model_end_sampling|>'
    )
    assert processor.finished() == [True]
    # padding after the end is ignored; the row keeps allowing only eos
    scores = processor(torch.cat([ids, torch.tensor([[tok.pad_token_id] * 3])], 1), torch.zeros(1, 201024))
    assert torch.isfinite(scores[0]).nonzero().flatten().tolist() == [EOS]


USER_GRAMMAR_WITHOUT_ROLLBACK = (  # llguidance cannot roll back over a `max_tokens` lexeme: the processor replays
    "start: <|content_thinking|> think <|end_message|> <|content_text|> body <|end_message|>\n"
    'think[max_tokens=4]: /(?s:.+)/\nbody: %json {"type": "object"}\n'
)


@pytest.mark.parametrize("grammar", ["reply", "user"], ids=["reply-grammar", "grammar-without-rollback"])
def test_the_processor_follows_tokens_that_go_back(tok, grammar):
    """Speculative decoding shows the processor a prefix, then a shorter one, then another continuation: the masks
    are those of a fresh processor on the same tokens."""
    if grammar == "reply":
        grammar = reply_grammar(response_format={"type": "json_object"}, max_thinking_tokens=4)
    else:
        grammar = USER_GRAMMAR_WITHOUT_ROLLBACK
    think = tok.encode("<|content_thinking|>so then<|end_message|>", add_special_tokens=False)
    text = think + tok.encode('<|message_model|><|content_text|>{"a":[1,2],"b":"x"}<|end_message|>')
    other = think + tok.encode('<|message_model|><|content_text|>{"c":true}', add_special_tokens=False)
    if "max_tokens" in grammar:  # that grammar has no `<|message_model|>` between the blocks
        text, other = ([t for t in ids if t != SPECIAL_TOKENS["<|message_model|>"]] for ids in (text, other))
    prompt = [1, 2, 3]
    moving = GrammarLogitsProcessor(tok, grammar, prompt_length=len(prompt))

    def mask(processor, tokens):
        return torch.isfinite(processor(torch.tensor([prompt + tokens]), torch.zeros(1, VOCAB_SIZE)))

    for cut in [1, 8, 3, len(text), None, 6, 1, 2, 0, 12]:
        tokens = other if cut is None else text[:cut]
        assert torch.equal(mask(moving, tokens), mask(GrammarLogitsProcessor(tok, grammar, len(prompt)), tokens))


def test_rows_moved_right_by_new_left_padding_are_found(tok):
    """DSpark pads a row that accepted fewer drafts on the left: the row's prompt is found further right."""
    grammar = reply_grammar(response_format={"type": "json_object"}, thinking=False)
    prompt = [[9, 9, 4, 5], [1, 2, 3, 4]]  # the first row is left-padded with 9
    tokens = tok.encode('<|content_text|>{"a":1', add_special_tokens=False)
    moving = GrammarLogitsProcessor(tok, grammar)
    moving(torch.tensor(prompt), torch.zeros(2, VOCAB_SIZE))
    rows = torch.tensor([[9] * (len(tokens) - 2) + prompt[0] + tokens[:2], prompt[1] + tokens])
    expected = [
        GrammarLogitsProcessor(tok, grammar, prompt_length=4)(torch.tensor([ids]), torch.zeros(1, VOCAB_SIZE))[0]
        for ids in (prompt[0] + tokens[:2], prompt[1] + tokens)
    ]
    assert torch.equal(moving(rows, torch.zeros(2, VOCAB_SIZE)), torch.stack(expected))
    assert moving._offsets == [len(tokens) - 2, 0]
    with pytest.raises(RuntimeError, match="row 1: its prompt is no longer in input_ids"):
        moving(torch.stack([rows[0], torch.full_like(rows[1], 7)]), torch.zeros(2, VOCAB_SIZE))


def test_thinking_is_bounded_in_tokens(tok):
    grammar = reply_grammar(response_format={"type": "json_object"}, max_thinking_tokens=2)
    processor = GrammarLogitsProcessor(tok, grammar, prompt_length=1)
    words = tok.encode(" one two", add_special_tokens=False)
    allowed = [
        torch.isfinite(processor(torch.tensor([[0, THINKING, *words[:n]]]), torch.zeros(1, VOCAB_SIZE)))[0]
        for n in range(3)
    ]
    assert allowed[0][words[0]] and not allowed[0][END_MESSAGE]  # at least one token
    assert allowed[1][words[1]] and allowed[1][END_MESSAGE] and allowed[1].sum() == NUM_BPE_RANKS  # 187 aside
    assert allowed[2].nonzero().flatten().tolist() == [END_MESSAGE]
    unbounded = reply_grammar(response_format={"type": "json_object"})
    assert "thinking_text: <[0-186,188-199997]>+" in unbounded


def test_a_token_the_grammar_forbids_raises(tok):
    processor = GrammarLogitsProcessor(tok, reply_grammar(response_format={"type": "json_object"}, thinking=False))
    processor(torch.tensor([[1, 2]]), torch.zeros(1, VOCAB_SIZE))
    with pytest.raises(RuntimeError, match="not allowed by the grammar"):
        processor(torch.tensor([[1, 2, tok.convert_tokens_to_ids("<|content_thinking|>")]]), torch.zeros(1, VOCAB_SIZE))


def test_llguidance_is_needed_only_when_a_grammar_is(monkeypatch):
    monkeypatch.setitem(sys.modules, "llguidance", None)  # `import llguidance` now fails
    assert reply_grammar(tools=TOOLS, tool_choice="auto") is None
    with pytest.raises(ImportError, match=r"pip install transformers-inkling2\[serve\]"):
        reply_grammar(tools=TOOLS, tool_choice="required")


# ---------------------------------------------------------------------------------------------------------------
# Generation with the tiny model (random weights)


@pytest.mark.parametrize("sample", SAMPLING, ids=SAMPLING_IDS)
def test_required_calls_offered_tools_with_arguments_that_match_their_schemas(model, tok, prompt, sample):
    grammar = reply_grammar(tools=TOOLS, tool_choice="required", max_thinking_tokens=3)
    new = generate(model, tok, prompt, grammar, sample, max_new_tokens=200)
    assert new[-1] == EOS
    assert_valid_calls(parse_response(new, tok))
    assert thinking_tokens(new) <= 3


@pytest.mark.parametrize("sample", [False, 0], ids=["greedy", "sample-0"])
def test_the_unconstrained_model_makes_no_valid_call(model, tok, prompt, sample):
    """The same prompt and decoding without the processor: random weights write no tool call, so the calls above
    come from the constraint."""
    message = parse_response(generate(model, tok, prompt, None, sample, max_new_tokens=60), tok)
    assert not message["tool_calls"]


@pytest.mark.parametrize("sample", SAMPLING, ids=SAMPLING_IDS)
def test_a_named_function_is_called_exactly_once(model, tok, prompt, sample):
    grammar = reply_grammar(tools=TOOLS, tool_choice={"type": "function", "function": {"name": "add"}}, thinking=False)
    message = parse_response(generate(model, tok, prompt, grammar, sample), tok)
    assert_valid_calls(message, names=("add",))
    assert len(message["tool_calls"]) == 1 and not message["content"] and message["thinking"] is None


@pytest.mark.parametrize("sample", SAMPLING, ids=SAMPLING_IDS)
def test_json_schema_text_matches_the_schema(model, tok, prompt, sample):
    response_format = {"type": "json_schema", "json_schema": {"name": "answer", "schema": ANSWER, "strict": True}}
    new = generate(model, tok, prompt, reply_grammar(response_format=response_format, max_thinking_tokens=3), sample)
    message = parse_response(new, tok)
    assert not message.get("truncated") and not message["tool_calls"], message
    assert conforms(json.loads(message["content"]), ANSWER), message["content"]
    assert thinking_tokens(new) <= 3


class _PreferClosing(LogitsProcessor):
    """Raises the tokens made only of `"`, `,`, `}` and `]`: a model that wants to close what it opened. Random
    weights otherwise write a JSON object's free keys and values for hundreds of tokens; validity still comes from
    the grammar alone (these tokens are not all valid everywhere)."""

    def __init__(self, tok, boost=6.0):
        vocab = tok.convert_ids_to_tokens(list(range(NUM_BPE_RANKS)))
        self.ids = torch.tensor([i for i, t in enumerate(vocab) if t and set(t) <= set('",}]')])
        self.boost = boost

    def __call__(self, input_ids, scores):
        scores = scores.clone()
        scores[:, self.ids] += self.boost
        return scores


@pytest.mark.parametrize("sample", SAMPLING, ids=SAMPLING_IDS)
def test_json_object_text_is_an_object(model, tok, prompt, sample):
    grammar = reply_grammar(response_format={"type": "json_object"}, thinking=False)
    message = parse_response(generate(model, tok, prompt, grammar, sample, extra=[_PreferClosing(tok)]), tok)
    assert not message.get("truncated"), message
    assert isinstance(json.loads(message["content"]), dict), message["content"]


def test_auto_with_a_response_format_gives_calls_or_json_text(model, tok, prompt):
    grammar = reply_grammar(
        tools=TOOLS, tool_choice="auto", response_format={"type": "json_object"}, parallel_tool_calls=False, thinking=False
    )
    for sample in SAMPLING:
        message = parse_response(generate(model, tok, prompt, grammar, sample, extra=[_PreferClosing(tok)]), tok)
        assert not message.get("truncated"), message
        if message["tool_calls"]:
            assert_valid_calls(message)
        else:
            assert isinstance(json.loads(message["content"]), dict)


@pytest.mark.parametrize("sample", [False, 1], ids=["greedy", "sample-1"])
def test_replies_render_back_through_the_chat_template(model, tok, prompt, sample):
    """The constrained reply is exactly what the chat template writes for the parsed message."""
    prompt_text = tok.apply_chat_template(MESSAGES, tools=TOOLS, add_generation_prompt=True, tokenize=False)
    for request_ in [
        {"tools": TOOLS, "tool_choice": "required", "thinking": False},
        {"response_format": {"type": "json_schema", "json_schema": {"name": "a", "schema": ANSWER}}, "thinking": False},
    ]:
        new = generate(model, tok, prompt, reply_grammar(**request_), sample)
        message = parse_response(new, tok)
        rendered = tok.apply_chat_template([*MESSAGES, message], tools=TOOLS, tokenize=False)
        assert unescape_text(rendered) == unescape_text(prompt_text) + tok.decode(new, skip_special_tokens=False)


@pytest.mark.parametrize("sample", [False, 2], ids=["greedy", "sample-2"])
def test_a_left_padded_batch_is_constrained_row_by_row(model, tok, sample):
    conversations = [MESSAGES, [{"role": "user", "content": "Hi"}]]
    inputs = tok.apply_chat_template(
        conversations, tools=TOOLS, add_generation_prompt=True, padding=True, return_dict=True, return_tensors="pt"
    )
    assert inputs["attention_mask"][1, 0] == 0  # the second row is left-padded
    grammar = reply_grammar(tools=TOOLS, tool_choice="required", parallel_tool_calls=False, max_thinking_tokens=2)
    if sample is not False:
        torch.manual_seed(sample)
    output = model.generate(
        **inputs,
        max_new_tokens=60,
        do_sample=sample is not False,
        logits_processor=LogitsProcessorList([GrammarLogitsProcessor(tok, grammar)]),
        pad_token_id=tok.pad_token_id,
    )
    for row in output[:, inputs["input_ids"].shape[1] :]:
        message = parse_response(row, tok)
        assert_valid_calls(message)
        assert len(message["tool_calls"]) == 1  # parallel_tool_calls=False


def test_one_grammar_per_row_and_free_rows(model, tok):
    inputs = tok.apply_chat_template(
        [MESSAGES, MESSAGES], tools=TOOLS, add_generation_prompt=True, return_dict=True, return_tensors="pt"
    )
    named = reply_grammar(tools=TOOLS, tool_choice={"type": "function", "function": {"name": "now"}}, thinking=False)
    processor = GrammarLogitsProcessor(tok, [named, None])
    output = model.generate(
        **inputs, max_new_tokens=16, do_sample=False, logits_processor=LogitsProcessorList([processor]),
        pad_token_id=tok.pad_token_id,
    )  # fmt: skip
    new = output[:, inputs["input_ids"].shape[1] :]
    assert parse_response(new[0], tok)["tool_calls"] == [
        {"type": "function", "function": {"name": "now", "arguments": {}}}
    ]
    assert not parse_response(new[1], tok)["tool_calls"]
    free = generate(model, tok, inputs["input_ids"][1:], None, max_new_tokens=16)
    assert torch.equal(new[1, : len(free)], free)
    with pytest.raises(ValueError, match="2 grammars were given for a batch of 1 rows"):
        processor = GrammarLogitsProcessor(tok, [named, None])
        processor(inputs["input_ids"][:1], torch.zeros(1, VOCAB_SIZE))


class _Lengths(LogitsProcessor):
    """Records the width of every prefix the processors see."""

    def __init__(self):
        self.widths = []

    def __call__(self, input_ids, scores):
        self.widths.append(input_ids.shape[1])
        return scores


def test_dspark_drafts_are_constrained_too(tok):
    """DSpark shows the processors its drafts, then goes back to what verification accepted, and moves rows that
    accepted fewer drafts right: greedy constrained DSpark decoding writes what greedy constrained plain decoding
    writes, for a left-padded batch."""
    from transformers_inkling2 import Inkling2ForCausalLM

    drafting = randomize_(Inkling2ForCausalLM(tiny_text_config(dspark_config=tiny_dspark_config().to_dict())), 1).eval()
    inputs = tok.apply_chat_template(
        [MESSAGES, [{"role": "user", "content": "Hi"}]], tools=TOOLS, add_generation_prompt=True, padding=True,
        return_dict=True, return_tensors="pt",
    )  # fmt: skip
    grammar = reply_grammar(tools=TOOLS, tool_choice="required", parallel_tool_calls=False, max_thinking_tokens=3)
    outputs = []
    for dspark in (False, True):
        lengths = _Lengths()
        output = drafting.generate(
            **inputs, max_new_tokens=60, do_sample=False, dspark=dspark, pad_token_id=tok.pad_token_id,
            logits_processor=LogitsProcessorList([lengths, GrammarLogitsProcessor(tok, grammar)]),
        )  # fmt: skip
        outputs.append(output[:, inputs["input_ids"].shape[1] :])
    assert any(b < a for a, b in zip(lengths.widths, lengths.widths[1:]))  # DSpark went back
    for row in outputs[0]:
        assert_valid_calls(parse_response(row, tok))
    for plain, drafted in zip(*outputs):
        assert parse_response(plain, tok) == parse_response(drafted, tok)
