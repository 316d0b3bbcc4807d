"""Plain `generate()` and `forward` take the fast path by themselves (issue #27): the default attention backend, the
static cache with graph-replayed steps on CUDA (`generation/defaults.py`), prefill chunks chosen from the free memory
(`modeling/activation_memory.py`); what cannot take the fast path says why, once. The fast path's greedy tokens equal
the reference path's in fp32."""

import logging

import pytest
import torch
from inkling2_helpers import ORACLE_TEXT_CONFIG, build_pair, greedy_generate, left_padded_batch
from transformers import AutoModelForCausalLM
from transformers.utils import logging as transformers_logging

from transformers_inkling2 import Inkling2StaticCache, Inkling2TextConfig
from transformers_inkling2.backends.attention import flex
from transformers_inkling2.generation import defaults
from transformers_inkling2.modeling import activation_memory
from transformers_inkling2.modeling.attention import eager_attention
from transformers_inkling2.modeling.modeling_inkling2_text import Inkling2TextModel


@pytest.fixture(scope="module")
def model():
    return build_pair(seed=3)[0]


def test_models_default_to_the_auto_backend_and_eager_stays_the_reference():
    config = Inkling2TextConfig(**ORACLE_TEXT_CONFIG)
    assert AutoModelForCausalLM.from_config(config).config._attn_implementation == "inkling2_auto"
    explicit = AutoModelForCausalLM.from_config(config, attn_implementation="eager")
    assert explicit.config._attn_implementation == "eager"


def test_the_auto_backend_is_the_eager_reference_off_cuda_and_triton_on_it(monkeypatch):
    generator = torch.Generator().manual_seed(0)
    query, key, value = (torch.randn(1, 4, 12, 8, generator=generator) for _ in range(3))
    inputs = dict(
        relative_logits=torch.randn(1, 4, 12, 6, generator=generator),
        sinks=torch.randn(1, 4, 12, generator=generator),
        query_positions=torch.arange(12),
        key_positions=torch.arange(12),
        key_padding=None,
        sliding_window=None,
        scaling=8**-0.5,
    )
    assert torch.equal(
        flex.inkling2_auto_attention(query, key, value, **inputs), eager_attention(query, key, value, **inputs)
    )
    calls = []
    monkeypatch.setattr(flex, "inkling2_triton_attention", lambda *args, **kwargs: calls.append(args) or "triton")
    on_cuda = type("CudaTensor", (), {"is_cuda": True})()  # a stand-in: only `.is_cuda` is read
    assert flex.inkling2_auto_attention(on_cuda, key, value, **inputs) == "triton" and calls


class _Model:
    """What `choose_fast_path` reads of a model."""

    def __init__(self, device: str):
        self.device = torch.device(device)
        self.generation_config = type("GenerationConfig", (), {})()


@pytest.mark.parametrize(
    "device, kwargs, static",
    [
        ("cuda", {}, True),
        ("cuda", {"max_new_tokens": 8, "dspark": True}, True),
        ("cpu", {}, False),
        ("cuda", {"output_attentions": True}, False),
        ("cuda", {"num_beams": 2}, False),
        ("cuda", {"prompt_lookup_num_tokens": 3}, False),
        ("cuda", {"cache_implementation": "dynamic"}, False),
        ("cuda", {"past_key_values": object()}, False),
        ("cuda", {"use_cache": False}, False),
    ],
    ids=["cuda", "dspark", "cpu", "attentions", "beams", "assisted", "explicit-cache", "own-cache", "no-cache"],
)
def test_the_fast_path_is_chosen_only_when_the_call_leaves_it_open_and_can_take_it(device, kwargs, static):
    model = _Model(device)
    chosen = defaults.choose_fast_path(model, model.generation_config, dict(kwargs))
    assert (chosen.get("cache_implementation") == "static") == static
    assert {k: v for k, v in chosen.items() if k != "cache_implementation"} == {
        k: v for k, v in kwargs.items() if k != "cache_implementation"
    }


def test_a_call_that_cannot_take_the_fast_path_says_why_once(caplog):
    logging.Logger.warning_once.cache_clear()  # other tests may have logged the same reason already
    transformers_logging.enable_propagation()
    try:
        with caplog.at_level(logging.WARNING):
            for _ in range(2):
                model = _Model("cuda")
                defaults.choose_fast_path(model, model.generation_config, {"num_beams": 3})
    finally:
        transformers_logging.disable_propagation()
    lines = [record.getMessage() for record in caplog.records if "reference path" in record.getMessage()]
    assert len(lines) == 1 and "beam search" in lines[0]


def test_the_default_fast_path_gives_the_reference_paths_greedy_tokens(model, monkeypatch):
    """Plain generate() as on CUDA (the device check answered yes): the static cache, its steps eager on the CPU;
    against the eager backend over the growing cache, token for token in fp32."""
    input_ids, attention_mask = left_padded_batch(seed=4, length=21, pad=5)
    reference = greedy_generate(model, input_ids, attention_mask, new_tokens=24, cache_implementation="dynamic")
    monkeypatch.setattr(defaults, "reference_path_reason", lambda *args: None)
    fast = greedy_generate(model, input_ids, attention_mask, new_tokens=24)
    assert isinstance(model._static_cache, Inkling2StaticCache)
    assert torch.equal(fast, reference)


def test_the_static_cache_is_reused_by_prompts_of_other_lengths(model):
    """So that a server or a loop over prompts does not capture its graphs again for every prompt length."""
    long_ids, long_mask = left_padded_batch(seed=5, length=30, pad=3)
    greedy_generate(model, long_ids, long_mask, new_tokens=4, cache_implementation="static")
    cache = model._static_cache
    assert cache.max_cache_len % 4096 == 0
    short_ids, short_mask = left_padded_batch(seed=6, length=9, pad=2)
    expected = greedy_generate(model, short_ids, short_mask, new_tokens=4, cache_implementation="dynamic")
    assert torch.equal(
        greedy_generate(model, short_ids, short_mask, new_tokens=4, cache_implementation="static"), expected
    )
    assert model._static_cache is cache


def test_long_inputs_run_in_chunks_chosen_from_the_free_memory(model, monkeypatch):
    """With little memory free, a plain forward over 1,100 tokens runs in chunks by itself, with the result of one
    forward over them all."""
    generator = torch.Generator().manual_seed(7)
    input_ids = torch.randint(0, 500, (1, 1100), generator=generator)
    with torch.no_grad():
        whole = model(input_ids, prefill_chunk_size=2048).logits
    chunk_sizes = []
    in_chunks = Inkling2TextModel.prefill_in_chunks

    def recording(self, *args, **kwargs):
        chunk_sizes.append(args[5])
        return in_chunks(self, *args, **kwargs)

    monkeypatch.setattr(activation_memory, "free_memory_bytes", lambda device: 64 * 2**20)
    monkeypatch.setattr(Inkling2TextModel, "prefill_in_chunks", recording)
    with torch.no_grad():
        chunked = model(input_ids).logits
    assert chunk_sizes == [activation_memory.CHUNK_GRANULE]
    torch.testing.assert_close(chunked, whole, atol=1e-4, rtol=1e-4)


def test_every_layers_outputs_asked_for_in_the_config_keep_the_input_whole(model, monkeypatch):
    """`config.output_hidden_states` needs every layer over the whole input, as the argument does: no chunks."""
    monkeypatch.setattr(activation_memory, "free_memory_bytes", lambda device: 64 * 2**20)
    inputs_embeds = torch.zeros(1, activation_memory.CHUNK_GRANULE + 1, model.config.hidden_size)
    assert model.model.automatic_prefill_chunk(inputs_embeds, None) == activation_memory.CHUNK_GRANULE
    monkeypatch.setattr(model.model.config, "output_hidden_states", True)
    assert model.model.automatic_prefill_chunk(inputs_embeds, None) is None
    assert model.model.automatic_prefill_chunk(inputs_embeds, None, output_hidden_states=False) is not None


@pytest.mark.parametrize(
    "free, tokens, expected",
    [
        (None, 1000, None),  # short: one forward
        (2**40, 131_072, 41_984),  # plenty of memory: as many tokens as the kernels index in one call (48 heads)
        (8 * 2**30, 131_072, 6_144),  # 8 GiB free: half of it for activations of ~0.64 MiB a token
        (2**20, 131_072, 1_024),  # nearly nothing free: the smallest chunk
    ],
)
def test_the_chunk_of_a_full_width_prefill(monkeypatch, free, tokens, expected):
    config = Inkling2TextConfig()  # Inkling-2-Small's sizes
    monkeypatch.setattr(activation_memory, "free_memory_bytes", lambda device: free)
    chunk = activation_memory.automatic_prefill_chunk(config, 1, tokens, 0, torch.device("cuda"), False)
    assert chunk == expected


@pytest.mark.parametrize("batch", [1, 8, 64, 256])
def test_the_chunk_of_many_rows_stays_within_what_the_attention_kernels_index(monkeypatch, batch):
    """At batch 64 the index limit leaves 672 tokens of Inkling-2-Small's relative logits per call: the chunk goes
    below CHUNK_GRANULE in steps of SMALL_CHUNK_GRANULE, and the prefill kernels' layout of that many (on the meta
    device: only its bounds check runs) accepts it."""
    from transformers_inkling2.backends.attention.relative_logits import aligned_product

    config = Inkling2TextConfig()
    monkeypatch.setattr(activation_memory, "free_memory_bytes", lambda device: 2**40)
    chunk = activation_memory.automatic_prefill_chunk(config, batch, 131_072, 0, torch.device("cuda"), False)
    assert chunk % activation_memory.SMALL_CHUNK_GRANULE == 0
    small = chunk < activation_memory.CHUNK_GRANULE
    assert small == (batch >= 64)
    granule = activation_memory.SMALL_CHUNK_GRANULE if small else activation_memory.CHUNK_GRANULE
    weight = torch.empty(config.d_rel, config.rel_extent, device="meta")
    aligned_product(torch.empty(batch, config.num_attention_heads, chunk, config.d_rel, device="meta"), weight)
    with pytest.raises(ValueError, match="beyond what attention kernels index"):  # and not far below the limit
        states = torch.empty(batch, config.num_attention_heads, chunk + 2 * granule, config.d_rel, device="meta")
        aligned_product(states, weight)
