"""The static cache (`cache/static.py`): the same logits as the growing `Inkling2Cache` (fp32, 1e-4), the same greedy
tokens through generate(), DSpark over it (rows shifted in its rings), its errors, and a decode step's index arithmetic
done once for all layers. The decode-step runner over it (CUDA graphs, compiled steps):
`tests/generation/test_decode_graphs.py`."""

import traceback
from pathlib import Path

import pytest
import torch
from inkling2_helpers import (
    ORACLE_TEXT_CONFIG,
    STEPS,
    assert_same_logits,
    build_pair,
    build_with_drafter,
    greedy_generate,
    left_padded_batch,
    plant_drafts,
    run_steps,
)
from torch.utils._python_dispatch import TorchDispatchMode

from transformers_inkling2 import Inkling2Cache, Inkling2ForCausalLM, Inkling2StaticCache, Inkling2TextConfig
from transformers_inkling2.cache.common import initial_slot_positions, shift_rows_right
from transformers_inkling2.generation import dspark as dspark_generation
from transformers_inkling2.tiny import randomize_

BACKENDS = ["eager", "inkling2_decode", "inkling2_flex", "inkling2_flex_decode"]


@pytest.fixture(scope="module")
def model():
    return build_pair()[0]


@pytest.mark.parametrize("backend", BACKENDS)
def test_static_cache_equals_the_growing_cache(model, backend):
    model.set_attn_implementation(backend)
    try:
        input_ids, attention_mask = left_padded_batch(seed=1)
        expected = run_steps(model, Inkling2Cache(model.config), input_ids, attention_mask, STEPS, crop_after=4)
        static = Inkling2StaticCache(model.config, max_cache_len=80)
        assert_same_logits(expected, run_steps(model, static, input_ids, attention_mask, STEPS, crop_after=4))
    finally:
        model.set_attn_implementation("eager")


def test_chunked_prefill_into_the_static_cache(model):
    """Chunks longer than a step (> 8 tokens) attend over the ring's keys in position order, then the new ones."""
    input_ids, attention_mask = left_padded_batch(seed=2, length=40, pad=7)
    whole = model(input_ids, attention_mask=attention_mask, use_cache=False).logits
    with torch.no_grad():
        chunked = model(
            input_ids,
            attention_mask=attention_mask,
            past_key_values=Inkling2StaticCache(model.config, max_cache_len=48),
            prefill_chunk_size=11,
        ).logits
    torch.testing.assert_close(chunked, whole, atol=1e-4, rtol=0)


@pytest.mark.parametrize("length, pad", [(5, 2), (21, 5)], ids=["short", "past-window"])
def test_generate_with_the_static_cache_gives_the_same_tokens(model, length, pad):
    input_ids, attention_mask = left_padded_batch(seed=length, length=length, pad=pad)
    expected = greedy_generate(model, input_ids, attention_mask, new_tokens=20)
    static = greedy_generate(model, input_ids, attention_mask, new_tokens=20, cache_implementation="static")
    assert torch.equal(static, expected)
    cache = model._static_cache
    again = greedy_generate(model, input_ids, attention_mask, new_tokens=20, cache_implementation="static")
    assert torch.equal(again, expected) and model._static_cache is cache  # reused, reset in place


def test_a_static_cache_made_under_inference_mode_is_not_reused_outside_it():
    """`inkling2 serve` generates under inference mode, whose tensors cannot be reset outside it."""
    model = build_pair(seed=7)[0]
    input_ids, attention_mask = left_padded_batch(seed=8)
    with torch.inference_mode():
        served = greedy_generate(model, input_ids, attention_mask, 6, cache_implementation="static")
    assert torch.equal(greedy_generate(model, input_ids, attention_mask, 6, cache_implementation="static"), served)


def test_dspark_over_the_static_cache_equals_plain_greedy(monkeypatch):
    """Rows accept different counts: the static rings shift rows right in place."""
    target = build_with_drafter()
    input_ids, attention_mask = left_padded_batch(seed=9, length=21, pad=5)
    expected = greedy_generate(target, input_ids, attention_mask, new_tokens=30)
    plant_drafts(monkeypatch, expected, attention_mask, seed=4)
    actual = greedy_generate(
        target, input_ids, attention_mask, new_tokens=30, dspark=True, cache_implementation="static"
    )
    assert torch.equal(actual, expected)


@pytest.mark.parametrize("graph_pieces", [False, True])
def test_drafts_over_the_static_context_equal_drafts_over_the_growing_one(monkeypatch, graph_pieces):
    """The drafter's context held in rings (static cache) gives the drafts it gives over the growing context, step by
    step, with left padding and rows that accept different counts (planted acceptance patterns). `graph_pieces`: the
    draft and the context append go through `CapturedCall`'s buffers, as they do when a GPU replays them as graphs
    (here eagerly, the capture stubbed out as failed), the append with its positions on the device."""
    if graph_pieces:
        real_init = dspark_generation.DSparkDecoder.__init__

        def init(self, *args):
            real_init(self, *args)
            self.graphs = self.graph_drafts = isinstance(self.cache, Inkling2StaticCache)

        monkeypatch.setattr(dspark_generation.DSparkDecoder, "__init__", init)
        monkeypatch.setattr(dspark_generation, "capture_graph", lambda run, pool, what: None)
        monkeypatch.setattr(torch.cuda, "graph_pool_handle", lambda: None)
    target = build_with_drafter()
    input_ids, attention_mask = left_padded_batch(seed=10, length=30, pad=6)
    reference = greedy_generate(target, input_ids, attention_mask, new_tokens=30)
    real_draft = dspark_generation.DSparkDecoder.draft_block
    recorded = {}

    def run(cache_implementation):
        recorded[cache_implementation] = []

        def recording(self, anchor, anchor_position, alive):
            drafts, distributions = real_draft(self, anchor, anchor_position, alive)
            recorded[cache_implementation].append(drafts)
            return reference_drafts(self, anchor, drafts), distributions

        monkeypatch.setattr(dspark_generation.DSparkDecoder, "draft_block", recording)
        return greedy_generate(
            target, input_ids, attention_mask, 30, dspark=True, cache_implementation=cache_implementation
        )

    def reference_drafts(decoder, anchor, drafts):
        """The reference continuation, wrong at a fixed position per row: rows accept 2 and 5 drafts."""
        generated = decoder.real_lengths - attention_mask.sum(-1) + 1
        continuation = torch.cat([reference[:, input_ids.shape[1] :], torch.zeros_like(reference[:, :8])], 1)
        index = (generated[:, None] + torch.arange(decoder.block_size)).clamp(max=continuation.shape[1] - 1)
        planted = continuation[torch.arange(2)[:, None], index]
        planted[0, 2], planted[1, 5] = (planted[0, 2] + 1) % 490, (planted[1, 5] + 1) % 490
        return planted

    assert torch.equal(run(None), reference) and torch.equal(run("static"), reference)
    assert len(recorded[None]) == len(recorded["static"]) > 3
    for dynamic, static in zip(recorded[None], recorded["static"]):
        assert torch.equal(dynamic, static)


class CacheOperations(TorchDispatchMode):
    """Counts the operations that the package's caches run, views left out."""

    def __init__(self):
        super().__init__()
        self.count = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        in_cache = any(Path(frame.filename).parts[-3:-1] == ("transformers_inkling2", "cache")
                       for frame in traceback.extract_stack())  # fmt: skip
        self.count += in_cache and not func.is_view
        return func(*args, **(kwargs or {}))


def cache_operations_of_a_decode_step(layers: int) -> int:
    config = Inkling2TextConfig(**{**ORACLE_TEXT_CONFIG, "num_hidden_layers": layers})
    model = randomize_(Inkling2ForCausalLM(config)).eval()
    input_ids, attention_mask = left_padded_batch(seed=11, length=9, pad=2)
    cache = Inkling2StaticCache(config, max_cache_len=16)
    with torch.no_grad():
        model(input_ids, attention_mask=attention_mask, past_key_values=cache)
        step_mask = torch.ones(2, 10, dtype=attention_mask.dtype)
        with CacheOperations() as counted:
            model(input_ids[:, :1], attention_mask=step_mask, past_key_values=cache)
    return counted.count


def test_a_decode_step_computes_its_slots_once_for_all_layers():
    """The slots of the new token in every ring and which convolution inputs are still held depend on its position
    only, computed once per step (`StepSlots`); a layer then only writes and reads its rings: 3 operations per
    convolution, 4 for its keys and values (the arithmetic ran per ring: about 200 more small GPU launches per step
    of a 6-layer slice)."""
    per_layer = 4 * 3 + 4
    assert cache_operations_of_a_decode_step(12) - cache_operations_of_a_decode_step(6) == 6 * per_layer


def test_ring_shift_matches_the_contiguous_shift():
    """A ring whose slots hold positions 13..20 (slot = position mod 8), shifted per row, equals the same keys laid
    out in order and shifted by `shift_rows_right`."""
    capacity, positions = 8, torch.arange(13, 21)
    slot_positions = initial_slot_positions(capacity, "cpu")
    slot_positions[positions % capacity] = positions
    ordered = torch.randn(3, 2, capacity, 4)  # position 13 + i at index i
    ring = torch.empty_like(ordered)
    ring[:, :, positions % capacity] = ordered
    shifts = torch.tensor([0, 2, 5])
    shifted = shift_rows_right(ring, shifts, 2, slot_positions)
    torch.testing.assert_close(shifted[:, :, positions % capacity], shift_rows_right(ordered, shifts, 2))


def test_clear_errors(model):
    input_ids, attention_mask = left_padded_batch(seed=4)
    cache = Inkling2StaticCache(model.config, max_cache_len=24)
    with pytest.raises(ValueError, match="holds 24 tokens"):
        model(torch.cat([input_ids, input_ids[:, :4]], 1), past_key_values=cache)
    with pytest.raises(ValueError, match="built for 3 rows"):
        model(input_ids, past_key_values=Inkling2StaticCache(model.config, max_cache_len=24, max_batch_size=3))
    with pytest.raises(ValueError, match="cache_implementation"):
        greedy_generate(model, input_ids, attention_mask, new_tokens=2, cache_implementation="offloaded")
    with pytest.raises(ValueError, match="rollback margin"):
        cache.crop(-9)
