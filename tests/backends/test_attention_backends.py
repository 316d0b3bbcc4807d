"""The fast attention backends (`backends/attention/`) against the eager reference, on fresh random inputs.

Tolerances: fp32 on CPU, max abs difference <= 1e-4 (outputs are convex combinations of RMS-normalized values,
so of order 1; the backends only reorder fp32 sums). bf16 on GPU (marked `gpu`): relative L2 error to an fp32
eager reference <= 1e-2, and at most 1.5x the eager backend's own bf16 error plus 1e-3.
"""

from __future__ import annotations

import tempfile
import warnings
from pathlib import Path

import pytest
import torch
from inkling2_helpers import held_in_a_ring, needs_triton, random_inputs, run_under_triton_interpreter

from transformers_inkling2.backends.attention.flex import (
    BLOCK_SIZE,
    distance_block_tables,
    inkling2_decode_attention,
    inkling2_flex_attention,
    inkling2_flex_decode_attention,
    inkling2_triton_attention,
)
from transformers_inkling2.modeling.attention import ATTENTION_BACKENDS, eager_attention

warnings.filterwarnings("ignore", message="flex_attention called without torch.compile")

FP32_TOLERANCE = 1e-4
BACKENDS = {  # on CPU, inkling2_triton is inkling2_flex (its kernel is checked under the interpreter below)
    "inkling2_flex": inkling2_flex_attention,
    "inkling2_triton": inkling2_triton_attention,
    "inkling2_decode": inkling2_decode_attention,
    "inkling2_flex_decode": inkling2_flex_decode_attention,
}


def max_difference(backend, inputs, sliding_window, scaling):
    expected = eager_attention(**inputs, sliding_window=sliding_window, scaling=scaling)
    actual = backend(**inputs, sliding_window=sliding_window, scaling=scaling)
    assert actual.shape == expected.shape and actual.dtype == expected.dtype
    assert expected.abs().max() > 0.1  # a live case, not an all-sink one
    return (actual - expected).abs().max().item()


# --- prefill: FlexAttention ----------------------------------------------------------------------------------------

PREFILL_CASES = {
    # window 16 / extent 24 over 70 tokens: crosses both; full layers split into band + far parts
    "crosses window and extent": dict(queries=70),
    "left padding, rows that see no key": dict(queries=70, padding=(0, 30)),
    "cache offset": dict(queries=40, keys=90, first_query=50),
    "cache offset and padding": dict(queries=40, keys=90, first_query=50, padding=(7, 60)),
    # several 128-blocks: partial, full and skipped blocks, a ragged last block
    "many blocks": dict(batch=2, heads=4, kv_heads=2, queries=300, extent=150, padding=(0, 140)),
    "many blocks, cache offset": dict(batch=1, heads=6, kv_heads=1, queries=200, keys=330, first_query=400),
    "log-scaled queries": dict(queries=70, query_scale=4.0),
    "head_dim 32, GQA 4": dict(heads=8, kv_heads=2, head_dim=32, queries=50),
}


@pytest.mark.parametrize("sliding_window", [16, None], ids=["sliding", "full"])
@pytest.mark.parametrize("case", PREFILL_CASES, ids=list(PREFILL_CASES))
def test_flex_prefill_equals_eager(case, sliding_window):
    options = PREFILL_CASES[case]
    inputs = random_inputs(seed=list(PREFILL_CASES).index(case), **options)
    if sliding_window is not None and options.get("extent", 24) != 24:
        sliding_window = options["extent"]  # sliding layers: extent == window
    scaling = inputs["query"].shape[-1] ** -0.5
    assert max_difference(inkling2_flex_attention, inputs, sliding_window, scaling) <= FP32_TOLERANCE


def test_rows_without_visible_keys_put_everything_on_the_sink():
    inputs = random_inputs(seed=3, queries=40, padding=(0, 25))
    for backend in BACKENDS.values():
        for window in (16, None):
            output = backend(**inputs, sliding_window=window, scaling=0.25)
            assert output[1, :25].abs().max() == 0  # padded rows see only padding
            assert output[1, 25:].abs().min(dim=-1).values.max() > 0


def test_large_logits_do_not_overflow():
    """Queries at 20x: scores in the hundreds, sinks far below; LSE arithmetic must stay finite."""
    inputs = random_inputs(seed=4, queries=64, query_scale=20.0)
    inputs["sinks"] = inputs["sinks"] * 50
    for backend in BACKENDS.values():
        for window in (16, None):
            expected = eager_attention(**inputs, sliding_window=window, scaling=0.25)
            actual = backend(**inputs, sliding_window=window, scaling=0.25)
            assert torch.isfinite(actual).all()
            assert (actual - expected).abs().max() <= FP32_TOLERANCE


# --- decode / verification -----------------------------------------------------------------------------------------


@pytest.mark.parametrize("queries", range(1, 9))
@pytest.mark.parametrize("backend_name", BACKENDS)
def test_decode_equals_eager_against_long_keys(backend_name, queries):
    inputs = random_inputs(
        seed=10 + queries, queries=queries, keys=400, first_query=500, extent=24, padding=(0, 390), query_scale=2.0
    )
    for window in (16, None):
        assert max_difference(BACKENDS[backend_name], inputs, window, 0.25) <= FP32_TOLERANCE


@pytest.mark.parametrize("backend_name", ["inkling2_decode", "inkling2_flex_decode"])
def test_decode_with_fewer_keys_than_the_extent(backend_name):
    inputs = random_inputs(seed=21, queries=3, keys=10, extent=24)
    for window in (16, None):
        assert max_difference(BACKENDS[backend_name], inputs, window, 0.25) <= FP32_TOLERANCE


_ATTENTION_KERNELS_SCRIPT = r"""
import json, sys
import torch
sys.path.insert(0, sys.argv[1])
from inkling2_helpers import held_in_a_ring, random_inputs
from transformers_inkling2.modeling.attention import eager_attention
from transformers_inkling2.backends.attention.decode_kernel import decode_attention
from transformers_inkling2.backends.attention.prefill_kernel import prefill_attention, reads_past_rows_in_bounds
from transformers_inkling2.backends.attention.relative_logits import aligned_product

cases = {  # name: (inputs, window); keys split over several programs in all but the smallest
    "long keys, padding": (dict(seed=40, queries=8, keys=400, first_query=500, padding=(0, 390)), 16),
    "long keys, full": (dict(seed=41, queries=1, keys=400, first_query=500, padding=(0, 390)), None),
    "fewer keys than the extent": (dict(seed=42, queries=3, keys=10), None),
    "a row without keys (all on the sink)": (dict(seed=43, queries=2, keys=70, first_query=80, padding=(0, 70)), 16),
    "one kv head per query head": (dict(seed=44, queries=5, keys=130, heads=4, kv_heads=4), None),
    # 71 splits of one kv head: the merge reads them in two blocks (MERGE_SPLIT_BLOCK), not all at once
    "more splits than the merge reads at once": (
        dict(seed=46, batch=1, heads=2, kv_heads=1, queries=1, keys=4500, first_query=4600), None),
}
results = {}
for name, (options, window) in cases.items():
    inputs = random_inputs(**options)
    expected = eager_attention(**inputs, sliding_window=window, scaling=0.25)
    results[name] = (decode_attention(**inputs, sliding_window=window, scaling=0.25) - expected).abs().max().item()
    # the same keys held in a ring, as the static cache's sliding layers hold them
    ring = decode_attention(**held_in_a_ring(inputs), sliding_window=window, scaling=0.25)
    results[name + ", ring"] = (ring - expected).abs().max().item()
# a custom op: torch.compile (fullgraph, as the compiled decode steps run) calls it as it is
inputs = random_inputs(seed=45, queries=2, keys=70, first_query=80, padding=(0, 7))
compiled = torch.compile(lambda **kw: decode_attention(**kw, sliding_window=16, scaling=0.25), fullgraph=True)
eager = decode_attention(**inputs, sliding_window=16, scaling=0.25)
results["compiled"] = (compiled(**inputs) - eager).abs().max().item()

prefill_cases = {  # (inputs, window): 128-query and 128-key blocks; extent 24 leaves far tiles without bias, extent
    # 448 leaves inner tiles (no mask, the whole tile in the extent) between the edge and the diagonal
    "prefill, sliding, padding": (dict(seed=50, queries=300, extent=24, padding=(0, 40)), 16),
    "prefill, full, padding": (dict(seed=51, queries=300, extent=24, padding=(0, 40)), None),
    "prefill chunk after cached keys, sliding": (dict(seed=52, queries=150, keys=230, first_query=500), 64),
    "prefill chunk after cached keys, full": (dict(seed=53, queries=150, keys=230, first_query=500), None),
    "prefill, a row without keys, extent beyond the prompt": (
        dict(seed=54, queries=70, extent=100, padding=(0, 70)), None),
    "prefill, window beyond the keys, one kv head per query head": (
        dict(seed=55, queries=130, keys=140, heads=4, kv_heads=4), 200),
    "prefill, sliding, window = extent = 448": (dict(seed=56, queries=900, extent=448), 448),
    "prefill, full, extent 448, padding": (dict(seed=57, queries=900, extent=448, padding=(0, 90)), None),
    "prefill chunk after cached keys, full, extent 448": (
        dict(seed=58, queries=300, keys=900, first_query=1200, extent=448), None),
}
for name, (options, window) in prefill_cases.items():
    inputs = random_inputs(**options)
    assert not reads_past_rows_in_bounds(inputs["relative_logits"], 128, 64)  # masked bias loads at the row ends
    expected = eager_attention(**inputs, sliding_window=window, scaling=0.25)
    results[name] = (prefill_attention(**inputs, sliding_window=window, scaling=0.25) - expected).abs().max().item()
# the relative logits as the model's projection lays them out for prompts (a view into a padded buffer with a
# guard: the diagonal and edge tiles then read their bias without masks)
for window, padding in ((None, (0, 0)), (256, (0, 30))):  # the window beyond the extent: d >= extent selected
    inputs = random_inputs(seed=59, queries=300, keys=500, first_query=400, extent=200, padding=padding)
    states, bank = torch.randn(2, 12, 300, 4), torch.randn(4, 200) / 2
    inputs["relative_logits"] = aligned_product(states, bank)
    assert reads_past_rows_in_bounds(inputs["relative_logits"], 128, 128)
    expected = eager_attention(**inputs, sliding_window=window, scaling=0.25)
    results[f"prefill, relative logits in the aligned layout, window {window}"] = (
        prefill_attention(**inputs, sliding_window=window, scaling=0.25) - expected).abs().max().item()
print(json.dumps(results))
"""


@needs_triton
def test_attention_kernels_under_the_triton_interpreter_equal_eager():
    """The fused decode and prefill kernels (what CUDA tensors run), on CPU under Triton's interpreter (fp32 MMAs
    there), against the eager reference."""
    tests_folder = Path(__file__).parents[1]  # where `inkling2_helpers` lives
    results = run_under_triton_interpreter(_ATTENTION_KERNELS_SCRIPT, str(tests_folder))
    assert len(results) == 24 and all(difference <= FP32_TOLERANCE for difference in results.values()), results
    assert results["compiled"] == 0


@needs_triton
def test_a_bool_padding_mask_reaches_the_kernels_without_a_copy():
    """The static cache's `key_valid` (bool) is read as int8 in place at every decode step: no conversion kernel per
    layer; masks of other dtypes are converted."""
    from transformers_inkling2.backends.attention.tiles import padding_bytes

    key_valid = torch.ones(2, 10, dtype=torch.bool)
    key_valid[1, :3] = False
    as_bytes = padding_bytes(key_valid[:, :7])  # a full layer's first slots: rows apart, keys at unit stride
    assert as_bytes.dtype == torch.int8 and as_bytes.data_ptr() == key_valid.data_ptr()
    assert torch.equal(as_bytes, key_valid[:, :7].to(torch.int8))
    assert torch.equal(padding_bytes(key_valid.long()), key_valid.to(torch.int8))


def test_flex_decode_with_more_folded_rows_than_a_block():
    """24 query heads per kv head x 8 queries = 192 folded rows: two query blocks."""
    inputs = random_inputs(seed=23, queries=8, keys=300, heads=48, kv_heads=2, padding=(0, 5))
    for window in (16, None):
        assert max_difference(inkling2_flex_decode_attention, inputs, window, 0.25) <= FP32_TOLERANCE


@pytest.mark.parametrize("backend_name, queries", [("inkling2_flex", 12), ("inkling2_flex_decode", 4)])
def test_non_contiguous_positions_are_refused(backend_name, queries):
    inputs = random_inputs(seed=22, queries=queries, keys=30)
    inputs["key_positions"] = inputs["key_positions"] * 2
    with pytest.raises(RuntimeError):
        BACKENDS[backend_name](**inputs, sliding_window=None, scaling=0.25)


@pytest.mark.parametrize("window", [16, None])
def test_decode_reads_keys_held_in_a_ring(window):
    """The static cache's sliding layers hold keys at slot = position mod K: the decode path gives what it gives on
    the same keys in order (bias, window, padding and the sink included)."""
    inputs = random_inputs(seed=24, queries=5, keys=30, first_query=40, padding=(0, 3))
    expected = inkling2_decode_attention(**inputs, sliding_window=window, scaling=0.25)
    ring = held_in_a_ring(inputs)
    assert not torch.equal(ring["key_positions"], inputs["key_positions"])
    torch.testing.assert_close(inkling2_decode_attention(**ring, sliding_window=window, scaling=0.25), expected)
    assert max_difference(inkling2_decode_attention, ring, window, 0.25) <= FP32_TOLERANCE


# --- block masks ---------------------------------------------------------------------------------------------------


def check_block_tables(queries, keys, offset, low, high, padding):
    key_padding = None
    if padding is not None:
        key_padding = torch.ones(len(padding), keys, dtype=torch.bool)
        for row, count in enumerate(padding):
            key_padding[row, :count] = False
    partial, full = distance_block_tables(torch.tensor(offset), queries, keys, low, high, key_padding)
    distance = offset + torch.arange(queries)[:, None] - torch.arange(keys)[None, :]
    visible = (distance >= low) & (distance < (high if high is not None else keys + offset + 1))
    visible = visible[None] if key_padding is None else visible[None] & key_padding[:, None, :]

    def per_entry(table):  # [B, 1, qb, kb] -> [B, queries, keys]
        expanded = table[:, 0].repeat_interleave(BLOCK_SIZE, 1).repeat_interleave(BLOCK_SIZE, 2)
        return expanded[:, :queries, :keys]

    assert not (partial & full).any()
    assert not (visible & ~per_entry(partial | full)).any()
    assert not (per_entry(full) & ~visible).any()
    # partial blocks hold at least one visible entry
    q_blocks, kv_blocks = partial.shape[-2:]
    tiles = torch.nn.functional.pad(visible, (0, kv_blocks * BLOCK_SIZE - keys, 0, q_blocks * BLOCK_SIZE - queries))
    tiles = tiles.view(visible.shape[0], q_blocks, BLOCK_SIZE, kv_blocks, BLOCK_SIZE).any(4).any(2)
    assert not (partial[:, 0] & ~tiles).any()


@pytest.mark.parametrize(
    "queries, keys, offset, low, high, padding",
    [
        (300, 300, 0, 0, 150, None),
        (300, 300, 0, 150, None, None),
        (200, 457, 257, 0, 1024, (0, 200)),
        (129, 700, 571, 130, None, (5, 650)),
        (1, 300, 299, 0, 24, None),
    ],
)
def test_block_tables_cover_exactly_what_is_visible(queries, keys, offset, low, high, padding):
    """Every visible entry lies in a partial or full block; full blocks hold only visible entries; partial blocks
    hold at least one (no wasted tiles)."""
    check_block_tables(queries, keys, offset, low, high, padding)


def test_block_tables_at_block_boundaries():
    """Distances and offsets on and next to multiples of the block size, where an off-by-one would show."""
    for queries, keys in [(300, 300), (130, 385)]:
        for offset in (0, 1, 128 + keys - queries):
            for low in (0, 1, 128):
                for high in (1, 2, 127, 128, 129, 256, None):
                    if high is None or high > low:
                        check_block_tables(queries, keys, offset, low, high, None)


# --- in the model --------------------------------------------------------------------------------------------------


def tiny_pair(attn_implementation: str, seed: int = 0):
    """(eager, fast) tiny Inkling2ForCausalLM with equal random weights; full layers have extent 24, sliding
    layers window 16, so a 40-token prompt crosses both; log scaling starts inside the prompt."""
    from transformers import AutoModelForCausalLM

    from transformers_inkling2.tiny import randomize_, tiny_text_config

    config = dict(rel_extent=24, log_scaling_n_floor=20)
    eager = randomize_(AutoModelForCausalLM.from_config(tiny_text_config(**config)), seed).eval()
    fast = AutoModelForCausalLM.from_config(tiny_text_config(**config), attn_implementation=attn_implementation)
    fast.load_state_dict(eager.state_dict())
    assert fast.config._attn_implementation == attn_implementation
    return eager, fast.eval()


def left_padded_prompts(seed: int = 0, length: int = 40, pad: int = 13):
    generator = torch.Generator().manual_seed(seed)
    input_ids = torch.randint(0, 200000, (2, length), generator=generator)
    attention_mask = torch.ones_like(input_ids)
    attention_mask[1, :pad] = 0
    return input_ids, attention_mask


@pytest.fixture(scope="module")
def models():
    return tiny_pair("inkling2_flex")


def test_model_logits_equal_eager_with_left_padding_beyond_the_window(models):
    eager, fast = models
    input_ids, attention_mask = left_padded_prompts()
    positions = (attention_mask.cumsum(-1) - 1).clamp(min=0)
    with torch.no_grad():
        expected = eager(input_ids, attention_mask=attention_mask, position_ids=positions, use_cache=False).logits
        actual = fast(input_ids, attention_mask=attention_mask, position_ids=positions, use_cache=False).logits
    real = attention_mask.bool()
    assert expected[real].abs().max() > 1.0
    assert (actual - expected)[real].abs().max() <= FP32_TOLERANCE


def test_model_chunked_prefill_through_the_cache_equals_eager(models):
    """Two prefill chunks (25 + 15 tokens, both on the flex path): the second attends to cached keys."""
    from transformers_inkling2 import Inkling2Cache

    input_ids, attention_mask = left_padded_prompts(seed=1)
    logits = []
    for model in models:
        cache = Inkling2Cache(model.config)
        with torch.no_grad():
            first = model(input_ids[:, :25], attention_mask=attention_mask[:, :25], past_key_values=cache).logits
            second = model(input_ids[:, 25:], attention_mask=attention_mask, past_key_values=cache).logits
        logits.append(torch.cat([first, second], dim=1))
    real = attention_mask.bool()
    assert (logits[1] - logits[0])[real].abs().max() <= FP32_TOLERANCE


def test_model_cached_greedy_generation_equals_eager(models):
    """Prefill on the flex path, then one-token steps on the decode path; also with `inkling2_flex_decode`."""
    eager, fast = models
    input_ids, attention_mask = left_padded_prompts(seed=2)
    kwargs = dict(attention_mask=attention_mask, max_new_tokens=12, do_sample=False, eos_token_id=None, pad_token_id=0)
    with torch.no_grad():
        expected = eager.generate(input_ids, **kwargs)
        assert torch.equal(fast.generate(input_ids, **kwargs), expected)
        fast.config._attn_implementation = "inkling2_flex_decode"
        try:
            assert torch.equal(fast.generate(input_ids, **kwargs), expected)
        finally:
            fast.config._attn_implementation = "inkling2_flex"


def test_from_pretrained_accepts_the_backend_names():
    from transformers import AutoModelForCausalLM

    from transformers_inkling2.tiny import build_tiny_causal_lm

    with tempfile.TemporaryDirectory() as directory:
        build_tiny_causal_lm(seed=3).save_pretrained(directory)
        for name in ("inkling2_flex", "inkling2_decode", "inkling2_flex_decode", "eager"):
            model = AutoModelForCausalLM.from_pretrained(directory, attn_implementation=name)
            assert model.config._attn_implementation == name
    assert {"eager", *BACKENDS} <= set(ATTENTION_BACKENDS)


# --- GPU: compiled flex, bf16, full-size heads ---------------------------------------------------------------------


def relative_error(actual, expected):
    return ((actual.float() - expected.float()).norm() / expected.float().norm()).item()


@pytest.mark.gpu
@pytest.mark.parametrize("backend_name", ["inkling2_flex", "inkling2_triton"])
@pytest.mark.parametrize("sliding_window", [1024, None], ids=["sliding", "full"])
@pytest.mark.parametrize("tokens, padding", [(4096, (0, 0)), (1000, (0, 300))], ids=["4k", "1000-padded"])
def test_gpu_prefill_bf16_full_size(sliding_window, tokens, padding, backend_name):
    """48 q / 8 kv heads, head_dim 128, extent = window = 1024; bf16 compiled flex or our prefill kernel vs eager
    fp32."""
    options = dict(batch=len(padding), heads=48, kv_heads=8, queries=tokens, head_dim=128, extent=1024)
    options.update(padding=padding, query_scale=1.5, device="cuda")
    reference = random_inputs(seed=5, **options)
    reference["relative_logits"] = reference["relative_logits"] * 0.5
    low = {name: tensor.bfloat16() if tensor.is_floating_point() else tensor for name, tensor in reference.items()
           if tensor is not None}
    low["key_padding"] = reference["key_padding"]
    scaling = 128**-0.5
    with torch.no_grad():
        expected = eager_attention(**reference, sliding_window=sliding_window, scaling=scaling)
        eager16 = eager_attention(**low, sliding_window=sliding_window, scaling=scaling)
        fast16 = BACKENDS[backend_name](**low, sliding_window=sliding_window, scaling=scaling)
    assert fast16.dtype == torch.bfloat16 and torch.isfinite(fast16).all()
    assert relative_error(fast16, expected) <= 1e-2
    assert relative_error(fast16, expected) <= 1.5 * relative_error(eager16, expected) + 1e-3
    if any(padding):
        assert fast16[1, : padding[1]].abs().max() == 0


@pytest.mark.gpu
@pytest.mark.parametrize("backend_name", ["inkling2_flex", "inkling2_flex_decode"])
@pytest.mark.parametrize("queries", [1, 3, 8])
def test_gpu_decode_bf16_full_size(queries, backend_name):
    options = dict(batch=2, heads=48, kv_heads=8, queries=queries, keys=6000, head_dim=128, extent=1024)
    reference = random_inputs(seed=6, padding=(0, 100), device="cuda", first_query=7000, **options)
    low = {name: tensor.bfloat16() if tensor is not None and tensor.is_floating_point() else tensor
           for name, tensor in reference.items()}
    for window in (1024, None):
        with torch.no_grad():
            expected = eager_attention(**reference, sliding_window=window, scaling=128**-0.5)
            fast16 = BACKENDS[backend_name](**low, sliding_window=window, scaling=128**-0.5)
        assert torch.isfinite(fast16).all() and relative_error(fast16, expected) <= 1e-2


@pytest.mark.gpu
@pytest.mark.parametrize("queries", [1, 8])
def test_gpu_decode_kernel_equals_the_pytorch_path(queries):
    """The fused kernel that `inkling2_decode` runs on CUDA against its PyTorch path (what it runs on CPU tensors,
    here on CPU copies): fp32 (same inputs, tight: IEEE MMAs) and bf16 at full size (both against the fp32
    reference: the kernel's error at most 1.5x the PyTorch path's own bf16 error plus 1e-3), keys in order and in a
    ring, with padding and an all-sink row; and one kv head over 20,000 keys, whose 264 splits the merge reads in
    several blocks."""

    def pytorch_path(inputs, window):
        on_cpu = {name: t.cpu() if t is not None else None for name, t in inputs.items()}
        return inkling2_decode_attention(**on_cpu, sliding_window=window, scaling=0.25).cuda()

    from transformers_inkling2.backends.attention.decode_kernel import decode_attention

    cases = [
        (dict(batch=3, heads=12, kv_heads=2, keys=300, head_dim=32, extent=24, padding=(0, 10, 300)), torch.float32),
        (dict(batch=2, heads=48, kv_heads=8, keys=5000, head_dim=128, extent=1024, padding=(0, 40)), torch.bfloat16),
        (dict(batch=1, heads=4, kv_heads=1, keys=20000, head_dim=64, extent=64, padding=(0,)), torch.float32),
    ]
    for options, dtype in cases:
        first_query = max(6000, options["keys"])
        reference = random_inputs(seed=queries, queries=queries, first_query=first_query, device="cuda", **options)
        inputs = {name: t.to(dtype) if t is not None and t.is_floating_point() else t for name, t in reference.items()}
        for window in (1024, None):
            expected = pytorch_path(reference, window)
            own_error = relative_error(pytorch_path(inputs, window), expected)
            fused = decode_attention(**inputs, sliding_window=window, scaling=0.25)
            fused_ring = decode_attention(**held_in_a_ring(inputs), sliding_window=window, scaling=0.25)
            bound = 1e-5 if dtype == torch.float32 else 1.5 * own_error + 1e-3
            assert relative_error(fused, expected) <= bound and relative_error(fused_ring, expected) <= bound
            if options["padding"][-1] == options["keys"]:
                assert fused[-1].abs().max() == 0  # the fully padded row puts everything on the sink


@pytest.mark.gpu
def test_gpu_tiny_model_fp32_logits_equal_eager():
    eager, fast = tiny_pair("inkling2_flex", seed=7)
    eager, fast = eager.cuda(), fast.cuda()
    input_ids, attention_mask = (t.cuda() for t in left_padded_prompts(seed=7, length=300, pad=150))
    with torch.no_grad():
        expected = eager(input_ids, attention_mask=attention_mask, use_cache=False).logits
        actual = fast(input_ids, attention_mask=attention_mask, use_cache=False).logits
    real = attention_mask.bool()
    assert (actual - expected)[real].abs().max() <= 1e-3


@pytest.mark.gpu
@pytest.mark.parametrize(
    "options",
    [dict(queries=4096, padding=(0, 0)), dict(queries=1000, padding=(0, 300)),
     dict(queries=600, keys=3600, first_query=3000, padding=(0, 0)), dict(queries=9, padding=(0,)),
     dict(queries=200, padding=(5, 0))],
    ids=["4k", "1000-padded", "chunk-after-cache", "9-queries", "200-padded"],
)
def test_gpu_gluon_sliding_prefill_full_size(options):
    """The Gluon sliding-layer kernel (Hopper) on the model's guarded relative-logit layout, bf16, vs eager fp32 on the
    same values; `prefill_attention` routes such inputs to it, and others (plain logits, fp32, a window beyond the
    extent) to the Triton kernel."""
    if not torch.cuda.is_available() or torch.version.hip or torch.cuda.get_device_capability()[0] != 9:
        pytest.skip("the Gluon kernel is for Hopper under CUDA")
    from transformers_inkling2.backends.attention import prefill_gluon as attention_prefill_gluon
    from transformers_inkling2.backends.attention.prefill_kernel import prefill_attention
    from transformers_inkling2.backends.attention.relative_logits import aligned_product

    reference = random_inputs(seed=7, batch=len(options["padding"]), heads=48, kv_heads=8, head_dim=128,
                              extent=1024, query_scale=1.5, device="cuda", **options)
    generator = torch.Generator(device="cuda").manual_seed(8)
    states = torch.randn(len(options["padding"]), 48, options["queries"], 16, device="cuda", generator=generator)
    bank = torch.randn(16, 1024, device="cuda", generator=generator) * 0.1
    low = {name: tensor.bfloat16() if tensor is not None and tensor.is_floating_point() else tensor
           for name, tensor in reference.items()}
    low["relative_logits"] = aligned_product(states.bfloat16(), bank.bfloat16())
    reference["relative_logits"] = low["relative_logits"].float()
    with torch.no_grad():
        expected = eager_attention(**reference, sliding_window=1024, scaling=128**-0.5)
        eager16 = eager_attention(**low, sliding_window=1024, scaling=128**-0.5)
        fast16 = attention_prefill_gluon.sliding_prefill_attention(**low, sliding_window=1024, scaling=128**-0.5)
        routed = prefill_attention(**low, sliding_window=1024, scaling=128**-0.5)
    assert torch.isfinite(fast16).all()
    assert relative_error(fast16, expected) <= 1.5 * relative_error(eager16, expected) + 1e-3
    assert torch.equal(routed, fast16)
    supports = attention_prefill_gluon.supports
    assert supports(low["query"], low["key"], low["value"], low["relative_logits"], 1024)
    assert not supports(low["query"], low["key"], low["value"], low["relative_logits"].contiguous(), 1024)
    assert not supports(low["query"], low["key"], low["value"], low["relative_logits"], 1025)
    assert not supports(reference["query"], reference["key"], reference["value"], reference["relative_logits"], 1024)
