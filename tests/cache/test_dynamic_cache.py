"""generate() with Inkling2Cache against recomputing the whole sequence, and the cache's bounds and rollback."""

import pytest
import torch
from inkling2_helpers import (
    build_pair,
    greedy_by_recomputation,
    greedy_generate,
    left_padded_batch,
    positions_from_mask,
)
from transformers import DynamicCache

from transformers_inkling2 import Inkling2Cache


@pytest.fixture(scope="module")
def models():
    return build_pair(seed=5)


@pytest.mark.parametrize("prompt_length, pad", [(5, 2), (21, 5)], ids=["shorter-than-window", "longer-than-window"])
def test_cached_greedy_generate_equals_recomputation_and_builtin(models, prompt_length, pad):
    ours, oracle = models
    input_ids, attention_mask = left_padded_batch(seed=prompt_length, length=prompt_length, pad=pad)
    generated = greedy_generate(ours, input_ids, attention_mask, new_tokens=14)  # crosses the window of 8
    assert torch.equal(generated, greedy_by_recomputation(ours, input_ids, attention_mask, 14))
    assert torch.equal(generated, greedy_generate(oracle, input_ids, attention_mask, new_tokens=14))


def test_cache_holds_window_plus_margin_in_sliding_layers_and_everything_in_full_layers(models):
    ours, _ = models
    config = ours.config
    input_ids, attention_mask = left_padded_batch(length=40, pad=3)
    cache = Inkling2Cache(config)
    with torch.no_grad():
        ours(input_ids, attention_mask=attention_mask, past_key_values=cache)
    for layer_idx, layer in enumerate(cache.layers):
        expected_keys = 40 if layer_idx in config.full_attention_layers else config.sliding_window_size - 1 + 8
        assert layer.keys.shape[2] == expected_keys
        assert all(held.shape[-1] == config.conv_kernel_size - 1 + 8 for held in layer.conv_inputs)
    assert cache.get_seq_length() == 40


def test_rollback_restores_exactly_the_state_of_the_shorter_sequence(models):
    """Speculative decoding's rollback: extend by 8 tokens, take 5 back, continue; as if only 3 were added."""
    ours, _ = models
    input_ids, attention_mask = left_padded_batch(seed=9, length=30, pad=4)
    extension = torch.randint(0, 500, (2, 8), generator=torch.Generator().manual_seed(1))
    follow_up = torch.randint(0, 500, (2, 4), generator=torch.Generator().manual_seed(2))

    def run(cache, tokens, mask):
        with torch.no_grad():
            return ours(tokens, attention_mask=mask, past_key_values=cache).logits

    ones = torch.ones_like(extension)
    rolled_back = Inkling2Cache(ours.config)
    run(rolled_back, input_ids, attention_mask)
    run(rolled_back, extension, torch.cat([attention_mask, ones], 1))
    rolled_back.crop(-5)
    mask = torch.cat([attention_mask, ones[:, :3], torch.ones_like(follow_up)], 1)
    after_rollback = run(rolled_back, follow_up, mask)

    direct = Inkling2Cache(ours.config)
    run(direct, input_ids, attention_mask)
    run(direct, extension[:, :3], torch.cat([attention_mask, ones[:, :3]], 1))
    assert torch.allclose(run(direct, follow_up, mask), after_rollback, atol=1e-5, rtol=0)


def test_rollback_beyond_the_margin_is_refused(models):
    ours, _ = models
    cache = Inkling2Cache(ours.config)
    with torch.no_grad():
        ours(torch.randint(0, 500, (1, 20)), past_key_values=cache)
    with pytest.raises(ValueError, match="rollback margin"):
        cache.crop(-9)


def test_a_foreign_cache_is_a_clear_error(models):
    ours, _ = models
    with pytest.raises(TypeError, match="Inkling2Cache"):
        ours(torch.randint(0, 500, (1, 4)), past_key_values=DynamicCache())


def test_chunked_prefill_generates_the_same_tokens(models):
    """`prefill_chunk_size` bounds activation memory by the chunk: the cache carries everything across chunks."""
    ours, _ = models
    input_ids, attention_mask = left_padded_batch(seed=4, length=30, pad=4)
    whole = greedy_generate(ours, input_ids, attention_mask, new_tokens=8)
    assert torch.equal(whole, greedy_generate(ours, input_ids, attention_mask, new_tokens=8, prefill_chunk_size=7))


def test_a_forward_in_prefill_chunks_equals_one_forward(models):
    """`prefill_chunk_size` in a plain forward: the same logits, with or without a cache kept for later."""
    ours, _ = models
    input_ids, attention_mask = left_padded_batch(seed=6, length=30, pad=4)
    inputs = dict(attention_mask=attention_mask, position_ids=positions_from_mask(attention_mask))
    with torch.no_grad():
        whole = ours(input_ids, use_cache=False, **inputs).logits
        chunked = ours(input_ids, use_cache=False, prefill_chunk_size=7, **inputs)
        kept = ours(input_ids, past_key_values=Inkling2Cache(ours.config), prefill_chunk_size=11, **inputs)
    real = attention_mask.bool()
    assert chunked.past_key_values is None and kept.past_key_values.get_seq_length() == 30
    for logits in (chunked.logits, kept.logits):
        assert (logits - whole)[real].abs().max() <= 1e-5
