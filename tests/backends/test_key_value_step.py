"""The fused key/value step (`key_value_kernel.key_value_step`, taken through `backends/key_value_step.py`): a sliding
layer's step keys and values convolved, clipped / normalized and written into the static cache in one launch.

Against the reference (`Inkling2Attention.attended_keys`) on a second cache fed the same steps: the attention ring's
keys and values (fp32 relative error <= 1e-5; bf16 within two ulps, the interpreter's fp32 -> bf16 cast truncating
where PyTorch rounds), its validity and positions and both convolution rings equal, and the same tuple handed to
attention. Small on CPU under Triton's interpreter, at full size on a GPU (marked `gpu`). Then whole decode and
verification steps of a tiny model with the step switched on and off (and together with the fused attention step),
and the decode-step runner's compiled steps with both. The model takes it by default (`INKLING2_FUSED_KEY_VALUE_STEP=0`
switches it off), and on CPU only under the interpreter.
"""

from __future__ import annotations

import os
from unittest import mock

import pytest
import torch
from inkling2_helpers import (
    ORACLE_TEXT_CONFIG,
    call_under_triton_interpreter,
    compiled_step_launches,
    needs_triton,
    set_environment,
    switched_step_differences,
)
from test_decode_kernel_rows import relative_error

from transformers_inkling2 import Inkling2Cache, Inkling2StaticCache, Inkling2TextConfig
from transformers_inkling2.backends import key_value_step
from transformers_inkling2.cache.common import K_CONV, V_CONV
from transformers_inkling2.configuration_inkling2 import SLIDING_LAYER
from transformers_inkling2.modeling.modeling_inkling2_text import Inkling2Attention

FP32_BOUND = 1e-5
PROMPT, STEP_TOKENS = 11, (1, 3, 1, 8, 2, 1)  # the attention ring (8 - 1 + 8 slots) wraps within these


def sliding_attention(config: Inkling2TextConfig, seed: int, device: str) -> Inkling2Attention:
    """Layer 0 (sliding) of `config`, with random convolution weights (the model's start at the identity's)."""
    return attention_layer(config, 0, seed, device)


def attention_layer(config: Inkling2TextConfig, index: int, seed: int, device: str) -> Inkling2Attention:
    """Layer `index` of `config` with random convolution weights, each tap of variance 0.25 (a full layer's static
    and per-token taps 0.25 each, for unit inputs)."""
    generator = torch.Generator().manual_seed(seed)
    attention = Inkling2Attention(config, layer_idx=index)
    for convolution in (attention.k_sconv, attention.v_sconv):
        if attention.is_sliding:
            convolution.conv1d.weight.data = torch.randn(convolution.conv1d.weight.shape, generator=generator) * 0.5
        else:
            convolution.static_weight.data = torch.randn(convolution.static_weight.shape, generator=generator) * 0.5
            projection = convolution.weight_proj.weight
            projection.data = torch.randn(projection.shape, generator=generator) * 0.5 / projection.shape[1] ** 0.5
    return attention.to(device).requires_grad_(False)


def within_ulps(actual: torch.Tensor, expected: torch.Tensor, ulps: int) -> bool:
    """|actual - expected| <= ulps units in the last place of expected's dtype, at expected's magnitude."""
    spacing = torch.finfo(expected.dtype).eps * expected.float().abs() + torch.finfo(expected.dtype).tiny
    return bool(((actual.float() - expected.float()).abs() <= ulps * spacing).all())


def clipped_keys(layer, positions: torch.Tensor, threshold: float) -> list[int]:
    """[keys the step wrote at the clip's threshold, keys it wrote] (padding included) in the layer's ring."""
    norms = layer.keys.float()[:, :, positions.remainder(layer.capacity)].norm(dim=-1)
    return [int((norms > threshold * (1 - 1e-3)).sum()), norms.numel()]


def hands_what_it_wrote(attended: tuple, layer, expected: tuple) -> bool:
    """Whether `attended` (what the fused step attends to) views the layer's own key and value buffers as the
    reference's `expected` views its cache's (a sliding layer's whole ring, a full layer's first slots), with the
    same positions, padding and flags."""
    buffers = (layer.keys, layer.values)
    views = all(a.data_ptr() == buffer.data_ptr() and a.shape == e.shape
                for a, buffer, e in zip(attended[:2], buffers, expected[:2], strict=True))  # fmt: skip
    same = all(torch.equal(a, e) for a, e in zip(attended[2:4], expected[2:4], strict=True))
    return views and same and attended[4:] == expected[4:]


@mock.patch.dict(os.environ, {key_value_step.ENV: "1"})
def cache_comparison(dtype=torch.float32, device="cpu", config_fields=None, seed=0, full=False) -> list[dict]:
    """A prompt (both caches through the reference), then STEP_TOKENS steps of 2 rows with fresh random k / v
    projections and layer inputs (padding in some): the reference on one static cache, `fused_key_value_step` on the
    other, in a sliding layer (or with `full` a full one). Per step: the attention buffers' keys / values error,
    whether their validity, positions, convolution rings, host-side counts and the tuples handed to attention
    agree."""
    fields = {**ORACLE_TEXT_CONFIG, **(config_fields or {})}
    config = Inkling2TextConfig(**fields)
    index = next(i for i, kind in enumerate(config.layer_types) if (kind != SLIDING_LAYER) == full)
    # about the keys' median norm, so that about half of them are clipped: each convolved channel below has variance
    # (k taps of variance 0.25 (0.5 in a full layer) x 4, plus the residual's 4) / (k + 1) (2k + 1)
    k, head_dim = config.conv_kernel_size, config.head_dim if full else config.swa_head_dim
    variance = (2 * k + 4) / (2 * k + 1) if full else (k + 4) / (k + 1)
    config.qk_l2_clip_threshold = (variance * head_dim) ** 0.5
    attention = attention_layer(config, index, seed, device)
    if full:  # in the model's dtype, as a full layer's static weights and `weight_proj` are (not kept in fp32)
        attention.to(dtype)
    generator = torch.Generator().manual_seed(seed + 1)
    width = attention.num_key_value_heads * head_dim
    reference, fused = (Inkling2StaticCache(config, max_cache_len=64) for _ in range(2))
    results, start = [], 0
    for length in (PROMPT, *STEP_TOKENS):
        states = [(torch.randn(2, length, width, generator=generator) * 2).to(device, dtype) for _ in range(2)]
        # a sliding layer reads only its inputs' dtype, a full one its taps from them
        layer_inputs = [torch.randn(2, length, config.hidden_size, generator=generator).to(device, dtype)
                        for _ in range(2)]  # fmt: skip
        mask = None if length % 3 else (torch.rand(2, length, generator=generator) > 0.3).to(device)
        positions = torch.arange(start, start + length, device=device)
        for cache in (reference, fused):
            cache.begin_step(positions)
        # the mask: the new tokens' (what a static cache's step takes)
        inputs = (*states, *layer_inputs, mask, reference, positions, mask)
        expected = attention.attended_keys(*inputs)
        if length == PROMPT:
            attention.attended_keys(*inputs[:5], fused, positions, mask)
        else:
            got = key_value_step.fused_key_value_step(attention, *inputs[:5], fused, positions, mask)
            expected_layer, got_layer = reference.layers[index], fused.layers[index]
            rings = [(got_layer.conv_inputs[i], expected_layer.conv_inputs[i]) for i in (K_CONV, V_CONV)]
            close = [relative_error(got_layer.keys, expected_layer.keys),
                     relative_error(got_layer.values, expected_layer.values)]  # fmt: skip
            ulps = [within_ulps(got_layer.keys, expected_layer.keys, 2),
                    within_ulps(got_layer.values, expected_layer.values, 2)]  # fmt: skip
            results.append(dict(
                tokens=length,
                errors=close,
                within_two_ulps=ulps,
                valid=torch.equal(got_layer.key_valid, expected_layer.key_valid),
                positions=torch.equal(got_layer.slot_positions, expected_layer.slot_positions),
                rings=all(torch.equal(a, b) for a, b in rings),
                counts=got_layer.seen_tokens == expected_layer.seen_tokens,
                handed=got is not None and hands_what_it_wrote(got, got_layer, expected),
                keys_written=bool(got_layer.keys.abs().sum() > 0),
                clipped_keys=clipped_keys(expected_layer, positions, config.qk_l2_clip_threshold),
            ))  # fmt: skip
        start += length
    return results


def compiled_cache_comparison() -> list[dict]:
    """`cache_comparison` with the op under `torch.compile` (its in-place writes through inductor's functionalization),
    as the compiled decode steps call it."""
    from transformers_inkling2.backends import key_value_kernel

    original = key_value_kernel.key_value_step
    key_value_kernel.key_value_step = torch.compile(original, fullgraph=True)
    try:
        return cache_comparison(torch.float32, seed=3)
    finally:
        key_value_kernel.key_value_step = original


def interpreter_cache_comparisons() -> dict:
    return {
        "fp32, compiled": compiled_cache_comparison(),
        "fp32": cache_comparison(torch.float32),
        "bf16": cache_comparison(torch.bfloat16, seed=1),
        "fp32, head_dim 32, 3 kv heads, k=2": cache_comparison(
            torch.float32, config_fields=dict(swa_head_dim=32, swa_num_key_value_heads=3, swa_num_attention_heads=6,
                                              conv_kernel_size=2), seed=2),  # fmt: skip
        "full layer, fp32": cache_comparison(torch.float32, seed=4, full=True),
        "full layer, bf16": cache_comparison(torch.bfloat16, seed=5, full=True),
        "full layer, fp32, head_dim 32, 3 kv heads, k=2": cache_comparison(
            torch.float32, config_fields=dict(head_dim=32, num_key_value_heads=3, num_attention_heads=6,
                                              conv_kernel_size=2), seed=6, full=True),  # fmt: skip
    }


def model_step_differences(device: str = "cpu", with_attention_step: bool = False) -> dict:
    """A tiny model's steps over the static cache with the fused key/value step switched on (and, with
    `with_attention_step`, the fused attention step too) and off (`switched_step_differences`)."""
    from transformers_inkling2.backends import key_value_kernel
    from transformers_inkling2.backends.attention import step

    switches = [key_value_step.ENV] + ([step.ENV] if with_attention_step else [])
    return switched_step_differences(switches, [(key_value_kernel, "key_value_step")], device)


def model_step_differences_with_both_steps() -> dict:
    return model_step_differences(with_attention_step=True)


def compiled_steps_with_both_fused_steps() -> dict:
    """bf16 decode steps through the decode-step runner's compiled step with both fused steps switched on, against the
    same steps run eagerly (`compiled_step_launches`): the key/value kernel's launches, and the decode kernel's with
    (True) and without the fused attention step's prologue. Both fused paths must trace whole for the compiled decode
    steps to take them."""
    from transformers_inkling2.backends import key_value_kernel
    from transformers_inkling2.backends.attention import decode_kernel, step

    kernels = [(key_value_kernel, "_key_value_step_kernel", "HEAD_DIM"), (decode_kernel, "_decode_partial_kernel",
                                                                          "PREPARE")]  # fmt: skip
    results = compiled_step_launches({step.ENV: "1", key_value_step.ENV: "1"}, kernels, step_sizes=(1,) * 4)
    key_value, attention = results["launches"]
    return dict(difference=results["difference"], key_value_launches=sum(key_value.values()),
                attention_launches=attention)  # fmt: skip


def assert_caches_agree(results: list[dict], bound: float | None) -> None:
    assert [result["tokens"] for result in results] == list(STEP_TOKENS)
    clipped, written = (sum(result["clipped_keys"][i] for result in results) for i in (0, 1))
    assert 0.2 < clipped / written < 0.8, (clipped, written)  # both sides of the clip
    for result in results:
        assert result["valid"] and result["positions"] and result["rings"] and result["counts"], result
        assert result["handed"] and result["keys_written"], result
        if bound is None:
            assert all(result["within_two_ulps"]), result
        else:
            assert max(result["errors"]) <= bound, result


@needs_triton
def test_key_value_step_under_the_triton_interpreter_writes_the_reference_cache():
    """Steps of 1-8 tokens after a prompt, padding in some, the rings wrapping; sliding and full layers; fp32 and
    bf16; two head shapes and kernel sizes; the op compiled."""
    results = call_under_triton_interpreter(interpreter_cache_comparisons)
    assert len(results) == 7
    for layer in ("", "full layer, "):
        assert_caches_agree(results[f"{layer}fp32"], FP32_BOUND)
        assert_caches_agree(results[f"{layer}fp32, head_dim 32, 3 kv heads, k=2"], FP32_BOUND)
        assert_caches_agree(results[f"{layer}bf16"], None)
    assert_caches_agree(results["fp32, compiled"], FP32_BOUND)


@needs_triton
@pytest.mark.parametrize("function", [model_step_differences, model_step_differences_with_both_steps])
def test_model_steps_with_the_fused_key_value_step_equal_the_reference_steps(function):
    results = call_under_triton_interpreter(function)
    # every decode and verification step of the 12 layers took it (6 steps); the prefill did not
    assert results["calls"] == 12 * 6
    assert results["prefill"] == 0
    assert results["difference"] <= FP32_BOUND


@needs_triton
def test_compiled_decode_steps_take_both_fused_steps_whole():
    results = call_under_triton_interpreter(compiled_steps_with_both_fused_steps)
    # four one-token steps (the prompt runs eagerly): every layer's (12) fused
    assert results["key_value_launches"] == 12 * 4
    assert results["attention_launches"] == {"True": 12 * 4}
    assert results["difference"] == 0  # the same kernels as the eager steps, in the same order


@pytest.mark.parametrize(
    "switch, interpreter, fused", [(None, "1", True), ("1", "1", True), ("0", "1", False), (None, None, False)]
)
def test_the_step_is_fused_by_default_unless_switched_off_or_on_cpu(monkeypatch, switch, interpreter, fused):
    """On by default in sliding and full layers where the kernel runs (here: under the interpreter); `=0` keeps the
    reference, and so does a CPU call without the interpreter."""
    set_environment(monkeypatch, {key_value_step.ENV: switch, "TRITON_INTERPRET": interpreter})
    config = Inkling2TextConfig(**ORACLE_TEXT_CONFIG)
    full_layer = next(i for i, kind in enumerate(config.layer_types) if kind != SLIDING_LAYER)
    states = torch.zeros(1, 1, 32)
    assert key_value_step.runs_fused(attention_layer(config, 0, 0, "cpu"), states) == fused
    assert key_value_step.runs_fused(attention_layer(config, full_layer, 0, "cpu"), states) == fused


@needs_triton
def test_only_steps_over_the_static_cache_take_it(monkeypatch):
    """Switched on under the interpreter, the kernel stubbed: a sliding or full layer's step over the static cache
    takes it; the dynamic cache, a chunk longer than a step, a step longer than the cache's ring takes and gradients
    through a full layer's per-token taps keep the reference (None); a full layer's step past the cache's length is
    refused before the kernel runs."""
    monkeypatch.setenv(key_value_step.ENV, "1")
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    config = Inkling2TextConfig(**ORACLE_TEXT_CONFIG)
    full_layer = next(i for i, kind in enumerate(config.layer_types) if kind != SLIDING_LAYER)
    full, sliding = attention_layer(config, full_layer, 0, "cpu"), attention_layer(config, 0, 0, "cpu")

    def takes(attention, cache, tokens=1) -> bool:
        states, inputs = torch.randn(1, tokens, 32), torch.randn(1, tokens, config.hidden_size)
        with mock.patch("transformers_inkling2.backends.key_value_kernel.key_value_step") as kernel:
            result = key_value_step.fused_key_value_step(
                attention, states, states, inputs, inputs, None, cache, torch.arange(tokens), None
            )
        assert (result is not None) == kernel.called
        return kernel.called

    static = Inkling2StaticCache(config, max_cache_len=64)
    assert takes(sliding, static) and takes(full, Inkling2StaticCache(config, max_cache_len=64))
    assert not takes(sliding, Inkling2Cache(config))
    assert not takes(sliding, static, tokens=17)
    assert not takes(sliding, Inkling2StaticCache(config, max_cache_len=64, max_queries=2), tokens=3)
    # a full cache: the error comes before the kernel writes, as the reference's before `write`
    filled = Inkling2StaticCache(config, max_cache_len=16)
    filled.layers[full_layer].seen_tokens = 16
    states, inputs = torch.randn(1, 1, 32), torch.randn(1, 1, config.hidden_size)
    with mock.patch("transformers_inkling2.backends.key_value_kernel.key_value_step") as kernel:
        with pytest.raises(ValueError, match="holds 16 tokens"):
            key_value_step.fused_key_value_step(full, states, states, inputs, inputs, None, filled, torch.arange(1),
                                                None)  # fmt: skip
    assert not kernel.called
    full.v_sconv.weight_proj.weight.requires_grad_(True)
    assert not takes(full, Inkling2StaticCache(config, max_cache_len=64))


# --- GPU: full size, bf16 and fp32 ---------------------------------------------------------------------------------

FULL_SIZE = dict(hidden_size=4608, swa_num_attention_heads=48, swa_num_key_value_heads=8, swa_head_dim=128,
                 num_attention_heads=48, num_key_value_heads=8, head_dim=128)  # fmt: skip


@pytest.mark.gpu
@pytest.mark.parametrize("full", [False, True], ids=["sliding", "full"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_gpu_key_value_step_full_size(dtype, full):
    """8 kv heads of 128 (the model's sliding and full layers), against the reference on the GPU: fp32 within 1e-5,
    bf16 within two ulps (both round to nearest there)."""
    with torch.no_grad():
        results = cache_comparison(dtype, device="cuda", config_fields=FULL_SIZE, seed=5, full=full)
    assert_caches_agree(results, FP32_BOUND if dtype == torch.float32 else None)


@pytest.mark.gpu
def test_gpu_model_steps_with_the_fused_key_value_step_equal_the_reference_steps():
    results = model_step_differences("cuda")
    assert results["calls"] == 12 * 6
    assert results["prefill"] == 0
    assert results["difference"] <= 1e-4  # fp32 on a GPU: the other kernels' sums in another order
