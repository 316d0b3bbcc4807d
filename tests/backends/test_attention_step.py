"""The fused decode step (`decode_kernel.decode_attention_step`, taken through `backends/attention/step.py`): the
queries' and relative states' per-head scale, L2 clip and log scale, each key's relative bias from the relative state
and the bank, and the sigmoid gate, inside the decode kernel's two launches.

Against the reference's composition of the same pieces (`reference_step`: PyTorch, then `inkling2_decode_attention`'s
own path): small on CPU under Triton's interpreter (fp32 MMAs there; relative L2 error <= 1e-5), at full size on a GPU
(marked `gpu`; in bf16 within 1.5x the reference's own bf16 error plus 1e-3, both against the fp32 reference on CPU).
Then whole decode and verification steps of a tiny model over the static cache, with the step fused (under the
interpreter, or on a GPU) and without. The model takes it by default (`INKLING2_FUSED_ATTENTION_STEP=0` switches it
off), and on CPU only under the interpreter.
"""

from __future__ import annotations

import pytest
import torch
from inkling2_helpers import (
    build_pair,
    call_under_triton_interpreter,
    needs_triton,
    set_environment,
    switched_step_differences,
)
from test_decode_kernel_rows import FULL, SMALL, cast, in_pages, per_row_cases, relative_error

from transformers_inkling2.backends.attention.flex import inkling2_decode_attention
from transformers_inkling2.modeling.modeling_inkling2_text import l2_clip

FP32_BOUND = 1e-5
# at the small sizes (head_dim 16, d_rel 4) about half the random rows below are longer: clipped and unclipped rows
Q_THRESHOLD, R_THRESHOLD = 4.0, 2.0


def step_arguments(inputs: dict, seed: int, d_rel: int, log_scale: bool) -> dict:
    """`decode_attention_step`'s arguments around a decode-kernel case (`test_decode_kernel_rows`): its keys, values,
    sinks and positions, and fresh raw projections, per-head scales, bank and (full layers) log scales for its
    query and relative-logit shapes."""
    generator = torch.Generator().manual_seed(seed)
    batch, heads, queries, head_dim = inputs["query"].shape
    extent = inputs["relative_logits"].shape[-1]
    device, dtype = inputs["query"].device, inputs["query"].dtype

    def randn(*shape, scale=1.0, shift=0.0):
        return (torch.randn(shape, generator=generator) * scale + shift).to(device=device, dtype=dtype)

    step = {key: value for key, value in inputs.items() if key not in ("query", "relative_logits")}
    return dict(
        step,
        query_states=randn(batch, queries, heads, head_dim),
        query_scale=randn(heads, head_dim, scale=0.2, shift=1.0).float(),
        query_threshold=Q_THRESHOLD,
        relative_states=randn(batch, queries, heads, d_rel),
        relative_scale=randn(heads, d_rel, scale=0.2, shift=1.0).float(),
        relative_threshold=R_THRESHOLD,
        bank=randn(d_rel, extent),
        log_scale=randn(batch, queries, scale=0.1, shift=1.2).float().abs() if log_scale else None,
        gate=randn(batch, queries, heads * head_dim, scale=2.0),
    )


def reference_step(query_states, query_scale, query_threshold, relative_states, relative_scale, relative_threshold,
                   bank, log_scale, gate, **attention):  # fmt: skip
    """What `Inkling2Attention.forward` computes from the same pieces when no fused step runs."""
    batch, queries, heads, _ = query_states.shape
    dtype = query_states.dtype
    tau = 1.0 if log_scale is None else log_scale[..., None, None]
    query = (l2_clip(query_states.float() * query_scale, query_threshold) * tau).to(dtype).transpose(1, 2)
    states = (l2_clip(relative_states.float() * relative_scale, relative_threshold) * tau).to(dtype)
    output = inkling2_decode_attention(query, relative_logits=(states @ bank).transpose(1, 2), **attention)
    return (output.reshape(batch, queries, -1).float() * torch.sigmoid(gate.float())).to(dtype)


def on_cpu(arguments: dict) -> dict:
    return {key: t.cpu() if torch.is_tensor(t) else t for key, t in arguments.items()}


def step_errors(cases: dict, windows, dtype=torch.float32) -> dict:
    """name -> [relative error of the fused step (inputs in `dtype`) to the fp32 reference, of the reference in
    `dtype` to its fp32 self]; references on CPU copies."""
    from transformers_inkling2.backends.attention.decode_kernel import decode_attention_step

    errors = {}
    for name, arguments in cases.items():
        for window in windows:
            options = dict(sliding_window=window, scaling=0.25)
            expected = reference_step(**on_cpu(arguments), **options)
            assert expected.abs().max() > 0.1  # a live case, not an all-sink one
            fused = decode_attention_step(**cast(arguments, dtype), **options).cpu()
            assert fused.dtype == dtype and fused.shape == expected.shape and torch.isfinite(fused).all()
            own = reference_step(**cast(on_cpu(arguments), dtype), **options)
            errors[f"{name}, window {window}"] = [relative_error(fused, expected), relative_error(own, expected)]
    return errors


def small_cases() -> dict:
    cases = {}
    for queries in (1, 3):
        for name, (inputs, _) in per_row_cases(queries, queries, 130, (70, 200, 100), (150, 230, 140), **SMALL).items():
            for log_scale in (False, True):
                cases[f"{name}, log scale {log_scale}"] = step_arguments(inputs, queries, 4, log_scale)
    paged, _ = in_pages(per_row_cases(5, 1, 192, (70, 191, 150), (100, 191, 160), **SMALL)[
        "1 queries, shared keys"][0], 64, seed=5)  # fmt: skip
    cases["1 query, paged, d_rel 6"] = step_arguments(paged, 5, 6, True)  # padded to the MMA's 16 with masks
    return cases


def small_step_errors() -> dict:
    from transformers_inkling2.backends.attention.decode_kernel import decode_attention_step

    cases = small_cases()
    ring = cases["3 queries, keys per row in a ring, log scale True"]

    def attend(**arguments):
        return decode_attention_step(**arguments, sliding_window=50, scaling=0.25)

    compiled = (torch.compile(attend, fullgraph=True)(**ring) - attend(**ring)).abs().max().item()
    return dict(errors=step_errors(cases, (None, 50)), compiled=compiled)


def model_step_differences(device: str = "cpu") -> dict:
    """A tiny model's steps over the static cache with the fused step switched on (on CPU the interpreter lets it
    run) and off (`switched_step_differences`)."""
    from transformers_inkling2.backends.attention import decode_kernel, step

    return switched_step_differences([step.ENV], [(decode_kernel, "decode_attention_step")], device)


@needs_triton
def test_fused_step_under_the_triton_interpreter_equals_the_reference():
    """Per-row query positions with keys shared or in per-row rings, 1 and 3 queries, with and without a log scale,
    with and without a window, and paged keys; also under torch.compile."""
    results = call_under_triton_interpreter(small_step_errors)
    assert len(results["errors"]) == 18
    for name, (error, _) in results["errors"].items():
        assert error <= FP32_BOUND, (name, error)
    assert results["compiled"] == 0


@needs_triton
def test_model_steps_with_the_fused_step_equal_the_reference_steps():
    results = call_under_triton_interpreter(model_step_differences)
    # every decode and verification step of both layer kinds took it (12 layers, 6 steps); the prefill did not
    assert results["calls"] == 12 * 6
    assert results["prefill"] == 0
    assert results["difference"] <= FP32_BOUND


@needs_triton
@pytest.mark.parametrize(
    "switch, interpreter, fused", [(None, "1", True), ("1", "1", True), ("0", "1", False), (None, None, False)]
)
def test_the_step_is_fused_by_default_unless_switched_off_or_on_cpu(monkeypatch, switch, interpreter, fused):
    """On by default where the kernel runs (here: under the interpreter); `=0` keeps the reference, and so does a CPU
    call without the interpreter."""
    # `runs_fused` asks the kernel's module (`supports`): imported here, before the interpreter's switch is set, as the
    # other tests of this process expect its kernels (Triton decides at import whether they are interpreted)
    from transformers_inkling2.backends.attention import decode_kernel, step  # noqa: F401
    from transformers_inkling2.backends.attention.flex import inkling2_auto_attention

    set_environment(monkeypatch, {step.ENV: switch, "TRITON_INTERPRET": interpreter})
    attention = build_pair(seed=3)[0].model.layers[0].self_attn
    queries = torch.zeros(1, 1, attention.config.num_attention_heads, attention.head_dim)
    keys = torch.zeros(1, 2, 8, attention.head_dim)
    with torch.no_grad():  # a step with gradients keeps the reference
        assert step.runs_fused(attention, inkling2_auto_attention, queries, keys) == fused


# --- GPU: full size, bf16 and fp32 ---------------------------------------------------------------------------------


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("queries", [1, 8])
def test_gpu_fused_step(queries, dtype):
    rows = per_row_cases(queries, queries, 4096, (4500, 7000, 3000), (4600, 7100, 4200), **FULL)
    cases = {name: step_arguments(inputs, queries, 16, name.endswith("keys")) for name, (inputs, _) in rows.items()}
    for name, (error, own) in step_errors(cases, (1024, None), dtype).items():
        bound = FP32_BOUND if dtype == torch.float32 else 1.5 * own + 1e-3
        assert error <= bound, (name, error, own)


@pytest.mark.gpu
def test_gpu_model_steps_with_the_fused_step_equal_the_reference_steps():
    results = model_step_differences("cuda")
    assert results["calls"] == 12 * 6
    assert results["prefill"] == 0
    assert results["difference"] <= 1e-4  # fp32 on a GPU: the kernels' MMAs and sums in another order
