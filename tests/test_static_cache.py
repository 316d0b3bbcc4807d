"""The static cache and the decode-step runner: the same logits as the growing `Inkling2Cache` (fp32, 1e-4), the same
greedy tokens through generate(), DSpark over it, and CUDA-graph replays equal to eager steps on a GPU."""

import pytest
import torch
from conftest import build_pair, cast_keeping_fp32_modules, greedy_generate, left_padded_batch, positions_from_mask
from test_dspark import build as build_with_drafter
from test_dspark import plant_drafts

from transformers_inkling2 import Inkling2Cache, Inkling2DecodeGraphs, Inkling2StaticCache
from transformers_inkling2 import generation_dspark as dspark_generation
from transformers_inkling2.cache_inkling2 import shift_rows_right
from transformers_inkling2.decode_graphs import attend_bucket
from transformers_inkling2.static_cache_inkling2 import initial_slot_positions, shift_ring_rows_right

BACKENDS = ["eager", "inkling2_decode", "inkling2_flex", "inkling2_flex_decode"]


@pytest.fixture(scope="module")
def model():
    return build_pair()[0]


def run_steps(model, cache, input_ids, attention_mask, step_sizes, forward=None, crop_after=None):
    """Prefill, then steps of fresh random tokens (2 rows); optionally takes back 3 tokens after step `crop_after`.
    Returns every forward's logits."""
    forward = forward or model
    with torch.no_grad():
        logits = [forward(input_ids=input_ids, attention_mask=attention_mask, past_key_values=cache).logits]
        mask = attention_mask
        for step, size in enumerate(step_sizes):
            tokens = torch.randint(0, 500, (2, size), generator=torch.Generator().manual_seed(step))
            mask = torch.cat([mask, torch.ones(2, size, dtype=mask.dtype)], dim=1)
            output = forward(
                input_ids=tokens,
                attention_mask=mask,
                position_ids=positions_from_mask(mask)[:, -size:],
                past_key_values=cache,
            )
            logits.append(output.logits.clone())
            if step == crop_after:
                cache.crop(-3)
                mask = mask[:, :-3]
    return logits


def assert_same_logits(expected, actual, atol=1e-4):
    assert len(expected) == len(actual)
    for e, a in zip(expected, actual):
        torch.testing.assert_close(a, e, atol=atol, rtol=0)


STEPS = [1, 3, 1, 8, 1, 1, 5, 1, 2, 1, 1, 1, 8, 1]  # crosses the window (8) and the extent (12) several times


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


def test_runner_steps_equal_plain_steps_across_buckets(model):
    """The runner's path (static input buffers, `cache_position`, the new tokens' mask columns, full layers
    attending over a power-of-two bucket of slots) without CUDA graphs, against the plain forward."""
    input_ids, attention_mask = left_padded_batch(seed=3)
    expected = run_steps(model, Inkling2Cache(model.config), input_ids, attention_mask, STEPS, crop_after=6)
    runner = Inkling2DecodeGraphs(model, use_cuda_graphs=False, min_bucket=16)
    static = Inkling2StaticCache(model.config, max_cache_len=80)
    actual = run_steps(model, static, input_ids, attention_mask, STEPS, forward=runner, crop_after=6)
    assert_same_logits(expected, actual)
    assert {key[0] for key in static.graphs} == {32, 64}  # 21 + 35 tokens: buckets of 32 and 64 slots


def test_attend_bucket():
    assert [attend_bucket(n, 5000) for n in (1, 1024, 1025, 3000, 4097)] == [1024, 1024, 2048, 4096, 5000]
    assert attend_bucket(9, 100, minimum=4) == 16


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
    shifted = shift_ring_rows_right(ring, slot_positions, shifts, 2)
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


@pytest.mark.gpu
def test_cuda_graph_replays_equal_eager_steps():
    """On the GPU, in bf16: generate() over the static cache replays captured graphs (one per bucket and step shape)
    and gives exactly the tokens of the same steps run eagerly; DSpark's verification passes replay too."""
    target = cast_keeping_fp32_modules(build_with_drafter(), torch.bfloat16).cuda()
    input_ids, attention_mask = (t.cuda() for t in left_padded_batch(seed=5, length=21, pad=5))

    def generate(use_cuda_graphs, **kwargs):
        target._decode_graphs = Inkling2DecodeGraphs(target, use_cuda_graphs=use_cuda_graphs, min_bucket=16)
        return greedy_generate(target, input_ids, attention_mask, 40, cache_implementation="static", **kwargs)

    expected = generate(use_cuda_graphs=False)
    assert torch.equal(generate(use_cuda_graphs=True), expected)
    graphs = target._static_cache.graphs
    captured = {key: step for key, step in graphs.items() if key[3]}  # key[3]: use_cuda_graphs (not the eager ones)
    assert captured and all(step.graph is not None for step in captured.values())
    assert {key[0] for key in captured} == {32, 64}
    assert torch.equal(generate(use_cuda_graphs=True, dspark=True), generate(use_cuda_graphs=False, dspark=True))


def test_compiled_steps_trace_whole_and_once():
    """With a `compile_config` the runner's steps run the `torch.compile`d model: the step traces as one graph
    (`fullgraph=True`), reads no host-side length (one compilation serves every step of a shape) and gives the
    eager step's logits (backend "eager": the same kernels; inductor fuses them on GPUs). bf16: `torch._grouped_mm`
    takes bf16 only."""
    import torch._dynamo
    from transformers import CompileConfig

    model = cast_keeping_fp32_modules(build_pair(seed=4)[0], torch.bfloat16)
    input_ids, attention_mask = left_padded_batch(seed=6)
    steps = [1] * 6
    expected = run_steps(model, Inkling2Cache(model.config), input_ids, attention_mask, steps)
    torch._dynamo.reset()
    runner = Inkling2DecodeGraphs(
        model, use_cuda_graphs=False, min_bucket=64, compile_config=CompileConfig(backend="eager", fullgraph=True)
    )
    static = Inkling2StaticCache(model.config, max_cache_len=64)
    # config.patch, not monkeypatch: monkeypatch would delete the option on the way out (it is not in __dict__)
    with torch._dynamo.config.patch(error_on_recompile=True):
        actual = run_steps(model, static, input_ids, attention_mask, steps, forward=runner)
    assert_same_logits(expected, actual, atol=0)
