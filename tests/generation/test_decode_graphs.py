"""The decode-step runner (`generation/decode_graphs.py`) over the static cache: its steps equal plain steps across
attention buckets, compiled steps trace whole and once and (through inductor) equal plain steps, and CUDA-graph
replays equal eager steps on a GPU."""

import pytest
import torch
from inkling2_helpers import (
    STEPS,
    assert_same_logits,
    build_pair,
    build_with_drafter,
    cast_keeping_fp32_modules,
    greedy_generate,
    left_padded_batch,
    relative_differences,
    run_steps,
)

from transformers_inkling2 import Inkling2Cache, Inkling2DecodeGraphs, Inkling2StaticCache
from transformers_inkling2.generation import decode_graphs
from transformers_inkling2.generation.decode_graphs import attend_bucket


@pytest.fixture(scope="module")
def model():
    return build_pair()[0]


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


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.gpu)])
def test_inductor_compiled_steps_equal_plain_steps(device):
    """`CompileConfig()` as a user passes it: inductor with the runner's options (PDL and combo kernels, which
    inductor applies on GPUs only) compiles steps whose fp32 logits are the plain forward's, up to the order of sums.
    Without CUDA graphs, so that fp32 experts run too."""
    import torch._dynamo
    from transformers import CompileConfig

    model = build_pair(seed=4)[0].to(device)
    input_ids, attention_mask = (t.to(device) for t in left_padded_batch(seed=6))
    steps = [1] * 3  # one shape: one compilation
    expected = run_steps(model, Inkling2Cache(model.config), input_ids, attention_mask, steps)
    torch._dynamo.reset()
    runner = Inkling2DecodeGraphs(model, use_cuda_graphs=False, min_bucket=64, compile_config=CompileConfig())
    static = Inkling2StaticCache(model.config, max_cache_len=64)
    actual = run_steps(model, static, input_ids, attention_mask, steps, forward=runner)
    differences = relative_differences(actual, expected)
    # on a GPU the fused decode kernels' fp32 dots and other kernels' sums in another order, as in test_key_value_step
    assert max(differences) <= (1e-5 if device == "cpu" else 1e-4), differences


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


@pytest.mark.parametrize(
    "options, expected",
    [
        (None, {"triton.enable_pdl": True, "combo_kernels": True}),
        ({"max_autotune": True}, {"triton.enable_pdl": True, "combo_kernels": True, "max_autotune": True}),
        ({"triton.enable_pdl": False, "combo_kernels": False}, {"triton.enable_pdl": False, "combo_kernels": False}),
    ],
)
def test_compile_config_options_reach_torch_compile_over_the_runners(monkeypatch, options, expected):
    """A `CompileConfig`'s inductor options reach `torch.compile` next to the PDL switch and the combo kernels the
    runner adds, and win over them; the default mode "reduce-overhead" leaves no cudagraph option."""
    from transformers import CompileConfig

    calls = []
    monkeypatch.setattr(torch, "compile", lambda model, **kwargs: calls.append(kwargs) or model)
    monkeypatch.setattr(decode_graphs.dependent_launch, "inductor_options", lambda: {"triton.enable_pdl": True})
    decode_graphs.compiled_step(torch.nn.Linear(2, 2), CompileConfig(options=options))
    assert calls == [dict(fullgraph=False, dynamic=False, backend="inductor", options=expected)]


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
