"""Tokenizer of Inkling-2-Small: OpenAI's o200k_base BPE plus Thinking Machines' 60 chat special tokens.

The reference implementation is `tml_renderers.tokenizers.O200kBaseChatTokenizer`; this module rebuilds the
same tokenizer as a `tokenizers` (Rust) backend so it plugs into transformers' fast-tokenizer machinery
(`save_pretrained`, `from_pretrained`, `AutoTokenizer`, batching, padding, chat templates).

Ids match tml/tiktoken because (1) the pre-tokenizer is tiktoken's o200k regex followed by byte-level
mapping without prefix space, and (2) the BPE model lists, for every token, each split into two vocabulary
tokens, ranked by the merged token's rank: this replays tiktoken's "merge the adjacent pair whose
concatenation has the lowest rank". `ignore_merges=True` mirrors tiktoken's "a piece that is itself a token
is kept whole" shortcut (a speed-up: every token is also reachable through the merges).

Conversation text is never read as control tokens (`chat_template.TEXT_ESCAPE` says how): the chat
template writes text it did not make itself with U+FDD0 after each `<` that starts `<|`, so the special tokens,
matched on the raw string, are only the template's own; the normalizer (`<`U+FDD0 -> `<`, the only one) then hands
the BPE exactly the original text. So `apply_chat_template` gives tml's ids, where user text is encoded like tml's
`encode_ordinary`. The one string this changes for plain `encode` is `<` followed by U+FDD0 (a noncharacter), which
encodes like `<`. `decode_for_parsing` is the way back for the reply parsers: only real special-token ids are
spelled as markers; text the model wrote with ordinary tokens is escaped (and unescaped by the parsers).
"""

from __future__ import annotations

import base64
import copy
import functools
import importlib.resources
import os

from tokenizers import AddedToken, Regex, Tokenizer, decoders, normalizers, pre_tokenizers, processors
from tokenizers.models import BPE
from transformers.convert_slow_tokenizer import bytes_to_unicode
from transformers.tokenization_utils_tokenizers import TokenizersBackend

from .chat_template import (
    CHAT_TEMPLATE,
    RESPONSE_TEMPLATE,
    TEXT_ESCAPE,
    mark_ordinary_text,
    parse_tool_call_arguments,
    unescape_text,
)

# tiktoken's o200k_base split pattern (a fact of the encoding; byte-for-byte the same alternatives).
O200K_PATTERN = "|".join(
    [
        r"""[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]*[\p{Ll}\p{Lm}\p{Lo}\p{M}]+(?i:'s|'t|'re|'ve|'m|'ll|'d)?""",
        r"""[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]+[\p{Ll}\p{Lm}\p{Lo}\p{M}]*(?i:'s|'t|'re|'ve|'m|'ll|'d)?""",
        r"""\p{N}{1,3}""",
        r""" ?[^\s\p{L}\p{N}]+[\r\n/]*""",
        r"""\s*[\r\n]+""",
        r"""\s+(?!\S)""",
        r"""\s+""",
    ]
)

NUM_BPE_RANKS = 199_998
# Special tokens as `tml_renderers.tokenizers.O200kBaseChatTokenizer` lists them (the tests check this
# table against it): ids 199998..200057 are contiguous; every id not named here is `<|unused_{id}|>`.
_NAMED_SPECIAL_IDS = {
    199998: "unused",
    199999: "endoftext",
    200000: "message_user",
    200001: "message_model",
    200002: "message_system",
    200003: "message_tool",
    200004: "content_text",
    200005: "content_image",
    200006: "content_model_end_sampling",
    200008: "content_thinking",
    200010: "end_message",
    200020: "content_audio_input",
    200022: "content_tool_error",
    200023: "audio",
    200024: "content_xml",
    200028: "begin_of_text",
    200043: "audio_end",
    200049: "content_invoke_tool_json",
    200057: "content_invoke_tool_text",
}


def special_tokens(first_id: int = NUM_BPE_RANKS) -> dict[str, int]:
    """The 60 special tokens, spelled as Inkling-2 spells them, on ids `first_id`.. in the official order: right after
    the BPE ranks (199998.. for o200k_base; a tokenizer that keeps only o200k's first ranks, as Inkling-2-Nano's,
    moves them down with it, so the chat template and the reply grammar stay the same strings)."""
    return {
        f"<|{_NAMED_SPECIAL_IDS.get(i, f'unused_{i}')}|>": first_id + i - NUM_BPE_RANKS
        for i in range(NUM_BPE_RANKS, NUM_BPE_RANKS + 60)
    }


SPECIAL_TOKENS: dict[str, int] = special_tokens()
VOCAB_SIZE = NUM_BPE_RANKS + len(SPECIAL_TOKENS)  # 200058; the model pads its embedding to 201024

EOS_TOKEN = "<|content_model_end_sampling|>"  # ends every model turn; the serving stop token
PAD_TOKEN = "<|endoftext|>"  # never rendered by the chat format, so padding cannot look like a stop
IMAGE_TOKEN = "<|unused_200054|>"  # one per image feature after `<|content_image|>`


def text_escape_normalizer() -> normalizers.Normalizer:
    """Undoes the chat template's escape (`<` + U+FDD0 -> `<`) after special tokens were matched on the raw text."""
    return normalizers.Replace("<" + TEXT_ESCAPE, "<")


def default_tiktoken_path() -> str:
    """The o200k_base ranks file that ships inside the `tml-renderers` wheel (so no network is needed)."""
    return str(importlib.resources.files("tml_renderers") / "data" / "o200k_base.tiktoken")


def load_tiktoken_ranks(path: str | os.PathLike) -> dict[bytes, int]:
    """Parse a `.tiktoken` file (`base64(token) rank` per line) without depending on `tiktoken`."""
    ranks = {}
    with open(path, "rb") as f:
        for line in f:
            if line.strip():
                token, rank = line.split()
                ranks[base64.b64decode(token)] = int(rank)
    return ranks


@functools.lru_cache(maxsize=2)
def _build_backend_cached(path: str, num_ranks: int = NUM_BPE_RANKS) -> Tokenizer:
    ranks = load_tiktoken_ranks(path)
    if len(ranks) != NUM_BPE_RANKS or sorted(ranks.values()) != list(range(NUM_BPE_RANKS)):
        raise ValueError(f"{path} is not o200k_base: expected ranks 0..{NUM_BPE_RANKS - 1}, got {len(ranks)}")
    if not 256 <= num_ranks <= NUM_BPE_RANKS:
        raise ValueError(f"num_ranks must be in [256, {NUM_BPE_RANKS}] (the 256 bytes come first), got {num_ranks}")
    # The first `num_ranks` ranks are a BPE of their own: a token's two parts always rank below it, so every merge
    # that makes a kept token uses kept tokens. On text whose o200k tokens all rank below `num_ranks` it gives
    # o200k's ids; elsewhere it stops merging earlier (more, shorter tokens).
    ranks = {token: rank for token, rank in ranks.items() if rank < num_ranks}
    # Byte-level alphabet (GPT-2's printable stand-ins for the 256 bytes), applied with one `str.translate`.
    byte_chars = bytes_to_unicode()
    as_str = {token: token.decode("latin-1").translate(byte_chars) for token in ranks}
    by_rank = sorted(ranks, key=ranks.__getitem__)

    # Every split (left, right) of a token into two tokens becomes a merge ranked with the merged token, so
    # the BPE model merges whichever adjacent pair forms the lowest-ranked token, exactly like tiktoken.
    # (Splits of one token are listed left to right; the ids this gives are checked against tiktoken's:
    # docs/tokenizer.md, tests/processing/test_tokenizer.py.)
    merges = []
    for token in by_rank:
        for i in range(1, len(token)):
            left, right = token[:i], token[i:]
            if left in ranks and right in ranks:
                merges.append((as_str[left], as_str[right]))
    vocab = {as_str[token]: rank for token, rank in ranks.items()}

    tok = Tokenizer(BPE(vocab, merges, fuse_unk=False, ignore_merges=True))
    tok.normalizer = text_escape_normalizer()
    tok.pre_tokenizer = pre_tokenizers.Sequence(
        [
            pre_tokenizers.Split(Regex(O200K_PATTERN), behavior="isolated", invert=False),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
        ]
    )
    tok.decoder = decoders.ByteLevel()
    tok.post_processor = processors.ByteLevel(trim_offsets=False)
    # Added in id order, so they land right after the BPE ranks (199998..200057 for the whole of o200k).
    specials = special_tokens(num_ranks)
    tok.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in specials])
    assert all(tok.token_to_id(t) == i for t, i in specials.items()), "special token ids drifted"
    return tok


def build_inkling2_backend(path: str | os.PathLike | None = None) -> Tokenizer:
    """Build the `tokenizers.Tokenizer` from an o200k_base `.tiktoken` file (default: tml-renderers' copy).

    Takes about 3 s on one CPU core (most of it listing the ~446k merges of 200k ranks); the result is cached
    per path, and callers get a copy (about 1 s) so they cannot mutate the cached one.
    """
    return copy.deepcopy(_build_backend_cached(os.fspath(path or default_tiktoken_path())))


class Inkling2Tokenizer(TokenizersBackend):
    """Fast tokenizer of Inkling-2-Small (o200k_base + 60 special tokens, 200058 ids).

    `Inkling2Tokenizer()` or `Inkling2Tokenizer.from_tiktoken(path)` builds it offline from the tiktoken ranks
    file; `from_pretrained(dir)` loads a saved `tokenizer.json` as is. Defaults: eos is
    `<|content_model_end_sampling|>` (200006); pad is `<|endoftext|>` (199999), a real token that is not eos
    (so padding is never mistaken for a stop) and that the chat format never emits; no bos is added because
    rendered chats start directly with a message token; padding is on the left, as decoding appends on the
    right; `model_max_length` is the model's 1M-token context.

    A ready backend (`tokenizers.Tokenizer`) comes as the keyword `tokenizer_object`, through `**kwargs` as in
    `TokenizersBackend`: transformers records every named `__init__` parameter in `init_kwargs`, which are saved to
    `tokenizer_config.json`, and the backend belongs in `tokenizer.json`.
    """

    model_input_names = ["input_ids", "attention_mask"]

    def __init__(self, tokenizer_file: str | None = None, **kwargs):
        kwargs.setdefault("eos_token", EOS_TOKEN)
        kwargs.setdefault("pad_token", PAD_TOKEN)
        kwargs.setdefault("bos_token", None)
        kwargs.setdefault("unk_token", None)
        kwargs.setdefault("image_token", IMAGE_TOKEN)  # read by the processor; gives `image_token_id`
        kwargs.setdefault("extra_special_tokens", list(SPECIAL_TOKENS))  # so `all_special_ids` lists all 60
        kwargs.setdefault("model_max_length", 1_048_576)
        kwargs.setdefault("padding_side", "left")  # passed (not a class attribute) so tokenizer_config.json records it
        kwargs.setdefault("clean_up_tokenization_spaces", False)
        kwargs.setdefault("chat_template", CHAT_TEMPLATE)  # the Inkling chat format (chat_template.py)
        kwargs.setdefault("response_template", copy.deepcopy(RESPONSE_TEMPLATE))  # parse_response, pipelines
        if tokenizer_file is None and kwargs.get("tokenizer_object") is None:
            # Built from the tiktoken ranks; the base class deep-copies it, so the cache stays clean.
            kwargs["tokenizer_object"] = _build_backend_cached(default_tiktoken_path())
        super().__init__(tokenizer_file=tokenizer_file, **kwargs)
        if self._tokenizer.normalizer is None:  # a tokenizer.json saved before the template escaped its text
            self._tokenizer.normalizer = text_escape_normalizer()

    def apply_chat_template(self, conversation, *args, **kwargs):
        """transformers' `apply_chat_template`, with tool calls' JSON-string `arguments` parsed first (as tml does),
        so that they render like the same arguments given as a dict."""
        return super().apply_chat_template(_with_parsed_arguments(conversation), *args, **kwargs)

    def decode_for_parsing(self, ids) -> str:
        """The text the reply parsers read: see the module-level `decode_for_parsing`."""
        return decode_for_parsing(self, ids)

    def parse_response(self, response, schema=None, *, prefix=None, tools=None):
        """transformers' `parse_response` (the declarative `response_template`), where ids are decoded with
        `decode_for_parsing`: only real special-token ids act as markers, and text the model wrote with ordinary
        tokens (even if it spells `<|end_message|>`) stays text. Text input is read as it is."""
        parsed = super().parse_response(
            _text_for_parsing(self, response),
            schema,
            prefix=None if prefix is None else _text_for_parsing(self, prefix),
            tools=tools,
        )
        return _unescape_all(parsed)

    @classmethod
    def convert_to_native_format(cls, trust_remote_code=False, **kwargs):
        """Load a saved `tokenizer.json` directly (the base class would re-extract vocab and merges, which is
        slower and drops the pre-tokenizer for classes with their own `__init__`)."""
        if kwargs.get("tokenizer_file") and os.path.isfile(kwargs["tokenizer_file"]):
            return kwargs
        return super().convert_to_native_format(trust_remote_code=trust_remote_code, **kwargs)

    @classmethod
    def from_tiktoken(
        cls, path: str | os.PathLike | None = None, num_ranks: int = NUM_BPE_RANKS, **kwargs
    ) -> Inkling2Tokenizer:
        """Build from an o200k_base `.tiktoken` file (default: the copy inside `tml-renderers`), offline; with
        `num_ranks`, only o200k's first ranks (a smaller vocabulary; the special tokens follow them)."""
        backend = _build_backend_cached(os.fspath(path or default_tiktoken_path()), num_ranks)
        return cls(tokenizer_object=backend, **kwargs)


def first_special_id(tokenizer) -> int:
    """The id of the first special token, `<|unused|>`: the count of BPE ids before it (199,998 for o200k)."""
    return tokenizer.convert_tokens_to_ids("<|unused|>")


def _special_ids(tokenizer) -> set[int]:
    return {i for i, token in tokenizer.added_tokens_decoder.items() if token.special}


def decode_for_parsing(tokenizer, ids) -> str:
    """Decode `ids` (a list or 1-D tensor) for the reply parsers: each special-token id as its spelling, the runs of
    ordinary ids between them as their text with U+FDD0 after every `<` (`chat_template.mark_ordinary_text`), so a
    marker the model spelled with ordinary tokens cannot be read as one. `unescape_text` gives `decode(ids)` back,
    and the tokenizer encodes the result as it encodes that text. Works with any tokenizer of these ids."""
    ids = ids.tolist() if hasattr(ids, "tolist") else list(ids)
    special = _special_ids(tokenizer)
    pieces, run = [], []
    for i in ids:
        if i in special:
            if run:
                pieces.append(mark_ordinary_text(tokenizer.decode(run, skip_special_tokens=False)))
                run = []
            pieces.append(tokenizer.convert_ids_to_tokens(i))
        else:
            run.append(i)
    if run:
        pieces.append(mark_ordinary_text(tokenizer.decode(run, skip_special_tokens=False)))
    return "".join(pieces)


def _text_for_parsing(tokenizer, value):
    """Ids (one sequence or a batch) -> `decode_for_parsing` text; text, lists of text and `[]` as they are."""
    if isinstance(value, str) or (isinstance(value, (list, tuple)) and (not value or isinstance(value[0], str))):
        return value
    if hasattr(value, "keys") and "input_ids" in value:  # a BatchEncoding, as `apply_chat_template` returns
        value = value["input_ids"]
    rows = value.tolist() if hasattr(value, "tolist") else list(value)
    if rows and isinstance(rows[0], (list, tuple)):
        return [decode_for_parsing(tokenizer, row) for row in rows]
    return decode_for_parsing(tokenizer, rows)


def _unescape_all(value):
    if isinstance(value, str):
        return unescape_text(value)
    if isinstance(value, dict):
        return {_unescape_all(key): _unescape_all(item) for key, item in value.items()}
    if isinstance(value, list):
        return [_unescape_all(item) for item in value]
    return value


def _with_parsed_arguments(conversation):
    """`parse_tool_call_arguments` on one conversation (a list of message dicts) or on each of a batch."""
    if not isinstance(conversation, (list, tuple)) or not conversation:
        return conversation
    if isinstance(conversation[0], (list, tuple)):
        return [_with_parsed_arguments(chat) for chat in conversation]
    if all(isinstance(message, dict) for message in conversation):
        return parse_tool_call_arguments(conversation)
    return conversation


def build_inkling2_tokenizer(
    path: str | os.PathLike | None = None, num_ranks: int = NUM_BPE_RANKS, **kwargs
) -> Inkling2Tokenizer:
    """Module-level alias of `Inkling2Tokenizer.from_tiktoken`."""
    return Inkling2Tokenizer.from_tiktoken(path, num_ranks, **kwargs)


__all__ = [
    "EOS_TOKEN",
    "IMAGE_TOKEN",
    "NUM_BPE_RANKS",
    "O200K_PATTERN",
    "PAD_TOKEN",
    "SPECIAL_TOKENS",
    "VOCAB_SIZE",
    "Inkling2Tokenizer",
    "build_inkling2_backend",
    "build_inkling2_tokenizer",
    "decode_for_parsing",
    "first_special_id",
    "load_tiktoken_ranks",
    "special_tokens",
    "text_escape_normalizer",
]
