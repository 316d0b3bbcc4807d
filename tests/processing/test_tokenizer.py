"""Inkling2Tokenizer must give exactly the ids of the reference tokenizer (tml-renderers) and of tiktoken.

The references are independent implementations (tml's Rust tokenizer, tiktoken's Rust BPE), so every
comparison here can fail if our pre-tokenizer regex, byte-level mapping, merges or special-token table drift.
"""

import inspect
import json
import re

import pytest

from transformers_inkling2.processing.tokenization_inkling2 import (
    O200K_PATTERN,
    SPECIAL_TOKENS,
    VOCAB_SIZE,
    Inkling2Tokenizer,
    build_inkling2_tokenizer,
    default_tiktoken_path,
)

tml_tokenizers = pytest.importorskip("tml_renderers.tokenizers")

FIRST_SPECIAL, NUM_SPECIAL = 199_998, 60

SAMPLES = [
    "",
    "Hello, world!",
    "hello world",
    " leading space",
    "trailing spaces   ",
    "trailing newline\n",
    "\n\n\nthree newlines first",
    "tabs\tand\t\ttabs\t",
    "mixed \t \n \r\n whitespace \u00a0 nbsp \u3000 ideographic",
    "    indented code\n\tand tab-indented\n",
    " " * 50,
    "\n" * 20,
    "I'm sure you're right, they've said we'd go, it's HE'LL and SHE'D",
    "DON'T YOU'RE I'M we'VE",
    "pattern = r'Scenario|Background' + u'Some' + b'Data'",  # (?i) contraction after a lowercase letter
    "1234567890 3.14159 -42 1e10 0x1F 1,000,000 ١٢٣ ½",
    "9" * 100,
    "supercalifragilisticexpialidocious antidisestablishmentarianism",
    "Pneumonoultramicroscopicsilicovolcanoconiosis" * 3,
    "a" * 3000,
    "CamelCaseIdentifier snake_case_name SCREAMING_CASE kebab-case",
    "def f(x):\n    return {'a': [1, 2, 3]}  # comment\n",
    "for (int i = 0; i < n; ++i) { sum += a[i] * b[i]; }\n",
    "https://example.com/path/to/file.html?q=1&r=two#frag",
    "path/to//dir///file",
    "你好，世界！这是一个测试。",
    "日本語のテキストとカタカナ、ひらがな。",
    "한국어 문장입니다.",
    "Привет, мир! Ёжик в тумане.",
    "مرحبا بالعالم — שלום עולם",
    "हिन्दी पाठ, தமிழ் உரை",
    "e\u0301 a\u0300 n\u0303 combining: Z\u0351\u036b\u0343\u036a\u0302\u036b\u033d\u034f",
    "Emoji: 🤗🚀👍🏽 👨‍👩‍👧‍👦 🏳️‍🌈 ❤️",
    "Mixed: café naïve façade Straße ÆØÅ İstanbul",
    "math: ∀x∈ℝ, x² ≥ 0; ∑_{i=1}^n i = n(n+1)/2",
    "punctuation!!! ??? ... --- *** ((( ))) <<< >>>",
    "<html><body><p class=\"x\">Hi</p></body></html>",
    '{"name": "get_weather", "args": {"city": "SF"}}',
    "<|not_a_real_token|> and <| endoftext |> stay text",
    "\x00\x01\x7f control chars \ufeff bom \ufffd replacement",
]
SAMPLES.append("\n".join(SAMPLES) + " " + " ".join(reversed(SAMPLES)))  # one long mixed document

# Texts with real special tokens embedded, as a rendered chat would contain them.
SPECIAL_SAMPLES = [
    "<|message_user|><|content_text|>What's the weather?<|end_message|><|message_model|>",
    "hello <|endoftext|> world",
    "<|message_model|>get_weather<|content_invoke_tool_json|>{\"name\":\"get_weather\"}<|end_message|>"
    "<|content_model_end_sampling|>",
    "<|content_image|><|unused_200054|><|unused_200054|><|end_message|>",
    "  <|content_thinking|>\n  spaced  <|end_message|>\n",
    "<|unused|><|begin_of_text|><|audio|><|audio_end|><|content_invoke_tool_text|>",
]


@pytest.fixture(scope="module")
def tok():
    return Inkling2Tokenizer.from_tiktoken()


@pytest.fixture(scope="module")
def tml():
    return tml_tokenizers.O200kBaseChatTokenizer()


@pytest.fixture(scope="module")
def tml_special_ids(tml):
    """tml's own special-token table, {"<|name|>": id}, read from its tokenizer (not from our module)."""
    table = {tml.decode([i]): i for i in range(FIRST_SPECIAL, FIRST_SPECIAL + NUM_SPECIAL)}
    assert all(tml.is_special_token(i) for i in table.values())
    return table


@pytest.fixture(scope="module")
def tiktoken_enc(tml_special_ids):
    tiktoken = pytest.importorskip("tiktoken")
    from tiktoken.load import load_tiktoken_bpe

    return tiktoken.Encoding(
        "inkling2_o200k",
        pat_str=O200K_PATTERN,
        mergeable_ranks=load_tiktoken_bpe(default_tiktoken_path()),
        special_tokens=tml_special_ids,
    )


def tml_encode_with_specials(tml, text):
    """Reference for text that may contain special tokens: tml encodes each token and each text run."""
    ids = []
    for part in re.split(r"(<\|[a-z0-9_]+\|>)", text):
        name = part[2:-2] if part.startswith("<|") and part.endswith("|>") else None
        if name is not None and name in tml.special_tokens():
            ids.append(tml.encode_special(name))
        elif part:
            ids.extend(tml.encode_ordinary(part))
    return ids


@pytest.mark.parametrize("text", SAMPLES)
def test_encode_matches_tml(tok, tml, text):
    assert tok.encode(text) == tml.encode_ordinary(text)


def test_encode_matches_tiktoken(tok, tiktoken_enc):
    ours = tok(SAMPLES, split_special_tokens=True)["input_ids"]
    assert ours == [tiktoken_enc.encode_ordinary(t) for t in SAMPLES]


@pytest.mark.parametrize("text", SPECIAL_SAMPLES)
def test_embedded_special_tokens(tok, tml, tiktoken_enc, text):
    expected = tml_encode_with_specials(tml, text)
    assert any(i >= FIRST_SPECIAL for i in expected)  # the sample really exercises special tokens
    assert tok.encode(text) == expected
    assert tiktoken_enc.encode(text, allowed_special="all") == expected


@pytest.mark.parametrize("text", SPECIAL_SAMPLES)
def test_special_tokens_as_plain_text(tok, tml, text):
    """With `split_special_tokens=True` the markers are ordinary text, like tml's `encode_ordinary`."""
    ids = tok.encode(text, split_special_tokens=True)
    assert ids == tml.encode_ordinary(text)
    assert max(ids) < FIRST_SPECIAL


def test_special_token_table(tok, tml, tml_special_ids):
    assert sorted(tml.all_special_tokens) == sorted(tml_special_ids)
    assert SPECIAL_TOKENS == tml_special_ids
    assert len(tok) == VOCAB_SIZE == FIRST_SPECIAL + NUM_SPECIAL == 200_058
    for name, idx in tml_special_ids.items():
        assert tok.convert_tokens_to_ids(name) == idx
        assert tok.convert_ids_to_tokens(idx) == name
        assert tok.encode(name) == [idx]
        assert tok.decode([idx]) == name
    assert sorted(tok.all_special_ids) == sorted(tml_special_ids.values())
    assert not tml.is_special_token(FIRST_SPECIAL - 1)
    assert tok.convert_ids_to_tokens(FIRST_SPECIAL - 1) not in tml_special_ids


def test_named_tokens_and_defaults(tok):
    assert tok.eos_token == "<|content_model_end_sampling|>" and tok.eos_token_id == 200006
    assert tok.pad_token == "<|endoftext|>" and tok.pad_token_id == 199999
    assert tok.pad_token_id != tok.eos_token_id
    assert tok.image_token_id == 200054
    assert tok.bos_token is None and tok.unk_token is None
    assert tok.padding_side == "left"
    assert tok.model_max_length == 1_048_576
    assert tok.encode("hi") == tok.encode("hi", add_special_tokens=False)  # nothing prepended or appended


@pytest.mark.parametrize("text", SAMPLES + SPECIAL_SAMPLES)
def test_decode_roundtrip(tok, text):
    assert tok.decode(tok.encode(text)) == text


def test_decode_matches_tml(tok, tml):
    for text in SPECIAL_SAMPLES:
        ids = tml_encode_with_specials(tml, text)
        assert tok.decode(ids) == tml.decode(ids)


def test_skip_special_tokens(tok):
    text = "<|message_user|><|content_text|>Hi there<|end_message|><|message_model|>"
    assert tok.decode(tok.encode(text), skip_special_tokens=True) == "Hi there"
    ids = tok.encode(SPECIAL_SAMPLES[1])
    assert tok.decode(ids, skip_special_tokens=True) == "hello  world"


def test_left_padding(tok):
    batch = tok(["hello", "a much longer piece of text"], padding=True)
    short_ids, short_mask = batch["input_ids"][0], batch["attention_mask"][0]
    pad = len(short_ids) - len(tok.encode("hello"))
    assert pad > 0
    assert short_ids[:pad] == [199999] * pad and short_mask[:pad] == [0] * pad
    assert short_ids[pad:] == tok.encode("hello")


def test_save_load_roundtrip(tok, tmp_path):
    tok.save_pretrained(tmp_path)
    assert (tmp_path / "tokenizer.json").is_file()
    config = json.loads((tmp_path / "tokenizer_config.json").read_text())
    assert config["tokenizer_class"] == "Inkling2Tokenizer"
    assert config["eos_token"] == "<|content_model_end_sampling|>"

    loaded = Inkling2Tokenizer.from_pretrained(tmp_path)
    assert type(loaded) is Inkling2Tokenizer
    texts = SAMPLES + SPECIAL_SAMPLES
    assert loaded(texts)["input_ids"] == tok(texts)["input_ids"]
    assert loaded(texts, split_special_tokens=True)["input_ids"] == tok(texts, split_special_tokens=True)["input_ids"]
    assert len(loaded) == len(tok)
    for attr in ("eos_token_id", "pad_token_id", "bos_token", "image_token_id", "padding_side", "model_max_length"):
        assert getattr(loaded, attr) == getattr(tok, attr), attr
    assert sorted(loaded.all_special_ids) == sorted(tok.all_special_ids)


def test_auto_tokenizer_resolves_registered_class(tok, tmp_path):
    from transformers import AutoTokenizer

    from transformers_inkling2.configuration_inkling2 import Inkling2Config

    AutoTokenizer.register(Inkling2Config, tokenizer_class=Inkling2Tokenizer, exist_ok=True)
    tok.save_pretrained(tmp_path)
    loaded = AutoTokenizer.from_pretrained(tmp_path)
    assert type(loaded) is Inkling2Tokenizer
    assert loaded.encode(SPECIAL_SAMPLES[0]) == tok.encode(SPECIAL_SAMPLES[0])


def test_other_constructors_agree(tok):
    text = SAMPLES[-1] + SPECIAL_SAMPLES[0]
    expected = tok.encode(text)
    assert Inkling2Tokenizer().encode(text) == expected
    assert build_inkling2_tokenizer(default_tiktoken_path()).encode(text) == expected


def test_init_kwargs_record_every_named_parameter(tok, tmp_path):
    """transformers saves `init_kwargs`: every named `__init__` parameter with a default is recorded there (its
    common suite checks this). The backend comes through `**kwargs` as `tokenizer_object` and is not recorded."""
    named = [
        name
        for name, parameter in inspect.signature(Inkling2Tokenizer.__init__).parameters.items()
        if parameter.default is not inspect.Parameter.empty and name != "tokenizer_file"
    ]
    assert all(name in tok.init_kwargs for name in named)
    assert "tokenizer_object" not in tok.init_kwargs
    tok.save_pretrained(tmp_path)
    assert "tokenizer_object" not in json.loads((tmp_path / "tokenizer_config.json").read_text())


def test_rejects_a_file_that_is_not_o200k(tmp_path):
    bogus = tmp_path / "tiny.tiktoken"
    bogus.write_text("YQ== 0\nYg== 1\nYWI= 2\n")
    with pytest.raises(ValueError, match="not o200k_base"):
        Inkling2Tokenizer.from_tiktoken(bogus)
