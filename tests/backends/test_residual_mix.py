"""The fused attention-residual mixes (`residual_mix_kernel`, taken through `backends/residual_mix.py`): a decode step's
mix and RMS norms before attention, before the MoE (with the attention's convolved output joining the partial block
first) and before the readout, one operation (two launches) each.

Against the reference on fresh random inputs, through the decoder layer's own entry points (`attention_inputs`,
`mlp_inputs`) with the switch on and off: fp32 within 1e-5, bf16 within two bf16 ulps in L2 (the interpreter's fp32 ->
bf16 cast truncates where PyTorch rounds); with the static cache, the post-attention convolution's ring written the
same. Steps of 1 to 8 tokens, padding in some, one, three and nine entries in the stack, a width that the kernel's
chunks do not divide (the chunks narrowed to make several). Small on CPU under Triton's interpreter, at full width on a
GPU (marked `gpu`). Then whole decode and verification steps of a tiny model with the mixes switched on and off (with
the other fused steps on, their default), and the decode-step runner's compiled steps. On by default
(`INKLING2_FUSED_RESIDUAL_MIX=0` switches it off), and on CPU only under the interpreter.
"""

from __future__ import annotations

import contextlib
import os
from unittest import mock

import pytest
import torch
from inkling2_helpers import (
    ORACLE_TEXT_CONFIG,
    CountedLaunches,
    build_with_drafter,
    call_under_triton_interpreter,
    cast_keeping_fp32_modules,
    compiled_step_launches,
    greedy_generate,
    left_padded_batch,
    needs_triton,
    set_environment,
    switched_step_differences,
)
from test_decode_kernel_rows import relative_error
from torch.utils._python_dispatch import TorchDispatchMode

from transformers_inkling2 import (
    Inkling2Cache,
    Inkling2DecodeGraphs,
    Inkling2StaticCache,
    Inkling2TextConfig,
    Inkling2TextModel,
)
from transformers_inkling2.backends import residual_mix
from transformers_inkling2.cache.common import MAX_STEP_TOKENS, POST_ATTENTION_CONV, POST_MLP_CONV
from transformers_inkling2.modeling.modeling_inkling2_text import Inkling2DecoderLayer
from transformers_inkling2.modeling.norms import rms_normalize
from transformers_inkling2.tiny import randomize_

FP32_BOUND = 1e-5
BF16_BOUND = 2 * 2**-8  # two bf16 ulps, relative
PROMPT, STEP_TOKENS = 11, (1, 3, 8, 2, 1)
# layer 1: sliding, one query; layer 5: full, three queries (q / k / v inputs); layer 6: opens a block
LAYERS = (1, 5, 6)
WIDE = dict(hidden_size=320)  # the chunks narrowed (`narrow_chunks`): of 128 and 256 channels, the last partly masked
WIDE_FROM_ROWS = 6  # the kernel's wider chunk from here: the 3- and 8-token steps of two rows take it, the others not


def random_layer(index: int, fields: dict, dtype, device, seed: int) -> Inkling2DecoderLayer:
    """Decoder layer `index` of a config with `fields`, every parameter random (queries, norms, convolutions), whose
    MoE returns its input: `layer_output` is handed the MoE's output itself."""
    config = Inkling2TextConfig(**{**ORACLE_TEXT_CONFIG, **fields})
    layer = randomize_(Inkling2DecoderLayer(config, index), seed)
    layer.mlp.forward = lambda x, summed=True: x
    with torch.no_grad():  # convolution taps of the size the model's are trained to (so that they matter)
        for convolution in (layer.post_attention_convolution, layer.post_mlp_convolution):
            convolution.conv1d.weight.mul_(5)
    return cast_keeping_fp32_modules(layer, dtype).to(device).requires_grad_(False)


def random_stream(batch, length, blocks, width, dtype, device, generator) -> tuple:
    """(partial block [batch, T, H] in dtype, completed blocks [batch, T, n, H] fp32 RMS-normalized)."""
    partial = (torch.randn(batch, length, width, generator=generator) * 3).to(device, dtype)
    stack = torch.randn(batch, length, blocks, width, generator=generator) * torch.rand(blocks, 1, generator=generator)
    return partial, rms_normalize(stack, 1e-6).to(device)


@mock.patch.dict(os.environ, {residual_mix.ENV: "1"})
def fused(function, *args):
    return function(*args)


@mock.patch.dict(os.environ, {residual_mix.ENV: "0"})
def reference(function, *args):
    return function(*args)


def layer_comparison(dtype=torch.float32, device="cpu", fields=None, seed=0) -> list[dict]:
    """Per layer of `LAYERS` and step: the errors of `attention_inputs` (over 1, 3 and 9 stack entries), of
    `mlp_inputs` (the new partial block, the MoE's input) and of `layer_output` with the fused mixes against the
    reference, and whether the post-attention and post-MLP convolutions' rings agree. `mlp_inputs` and `layer_output`
    run over two static caches fed the same prompt, then `STEP_TOKENS` steps (the kernels convolve over the ring);
    `mlp_inputs` once more without a cache (it takes the convolution's output as the module returns it)."""
    generator = torch.Generator().manual_seed(seed)
    results = []
    for index in LAYERS:
        layer = random_layer(index, fields or {}, dtype, device, seed + index)
        width = layer.mlp_input.query.shape[-1]
        caches = [Inkling2StaticCache(layer.self_attn.config, max_cache_len=64) for _ in range(2)]
        start = 0
        for length in (PROMPT, *STEP_TOKENS):
            positions = torch.arange(start, start + length, device=device)
            start += length
            for cache in caches:
                cache.begin_step(positions)
            mask = None if length % 3 else (torch.rand(2, length, generator=generator) > 0.3).to(device)
            output = torch.randn(2, length, width, generator=generator).to(device, dtype)
            partial, blocks = random_stream(2, length, 1 + index // 6, width, dtype, device, generator)
            continued = None if layer.opens_block else partial  # in the layer's dtype, as the fused path hands it on
            # the reference on one cache, the fused mix on the other (a prompt: the reference on both)
            expected = reference(layer.mlp_inputs, output, continued, blocks, mask, caches[0], positions, dtype)
            got = fused(layer.mlp_inputs, output, continued, blocks, mask, caches[1], positions, dtype)
            # the layer's end: the MoE's output through the post-MLP convolution, added to the partial block
            moe_output = torch.randn(2, length, width, generator=generator).to(device, dtype)
            ends = [function(layer.layer_output, moe_output, expected[0], mask, cache, positions, dtype)
                    for function, cache in ((reference, caches[0]), (fused, caches[1]))]  # fmt: skip
            if length == PROMPT:
                continue
            rings = [cache.layers[index].conv_inputs[conv] for conv in (POST_ATTENTION_CONV, POST_MLP_CONV)
                     for cache in caches]  # fmt: skip
            no_cache = [function(layer.mlp_inputs, output, continued, blocks, mask, None, positions, dtype)
                        for function in (reference, fused)]  # fmt: skip
            attention, handed_blocks = [], []
            for entries in (1, 3, 9):
                partial, blocks = random_stream(2, length, entries, width, dtype, device, generator)
                pair = [function(layer.attention_inputs, blocks, partial, dtype) for function in (reference, fused)]
                attention.append(max(relative_error(g, e) for g, e in zip(pair[1][0], pair[0][0], strict=True)))
                # the completed blocks the layer goes on with (layer 6 opens a block: the partial one joins them)
                opened = pair[1][2].shape == (2, length, entries + 1, width)
                handed_blocks.append(relative_error(pair[1][2], pair[0][2]) if opened == layer.opens_block else 1.0)
            results.append(dict(
                layer=index,
                tokens=length,
                attention=attention,
                blocks=handed_blocks,
                partial=relative_error(got[0], expected[0]),
                mlp_input=relative_error(got[1], expected[1]),
                rings=all(torch.equal(*rings[i : i + 2]) and bool(rings[i].abs().sum() > 0) for i in (0, 2)),
                layer_output=relative_error(ends[1], ends[0]),
                without_cache=[relative_error(no_cache[1][i], no_cache[0][i]) for i in (0, 1)],
                dtypes=[str(got[0].dtype), str(got[1].dtype), str(pair[1][0][0].dtype), str(ends[1].dtype)],
            ))  # fmt: skip
    return results


def narrow_chunks():
    """The kernel's chunks of 128 channels, and of 256 from `WIDE_FROM_ROWS` rows: at width 320 three programs per
    token in the 1- and 2-token steps of two rows, two in the 3- and 8-token ones (one at the tiny width)."""
    from transformers_inkling2.backends import residual_mix_kernel

    return mock.patch.multiple(residual_mix_kernel, CHUNK=128, WIDE_CHUNK=256, WIDE_FROM_ROWS=WIDE_FROM_ROWS)


def wide_chunks_early():
    """The kernel's wider chunk from `WIDE_FROM_ROWS` rows, so that the 3- and 8-token steps of two rows take it (9
    chunks of 512 at hidden 4608) and the others the usual one (18 of 256)."""
    from transformers_inkling2.backends import residual_mix_kernel

    return mock.patch.object(residual_mix_kernel, "WIDE_FROM_ROWS", WIDE_FROM_ROWS)


def interpreter_layer_comparisons() -> dict:
    with narrow_chunks():
        wide = layer_comparison(torch.float32, fields=WIDE, seed=2)
    return {
        "fp32": layer_comparison(torch.float32),
        "bf16": layer_comparison(torch.bfloat16, seed=1),
        "fp32, width 320": wide,
    }


def assert_layers_agree(results: list[dict], bound: float, dtype: str) -> None:
    assert [(r["layer"], r["tokens"]) for r in results] == [(i, t) for i in LAYERS for t in STEP_TOKENS]
    for result in results:
        assert result["rings"], result
        assert result["dtypes"] == ["torch.float32", dtype, dtype, dtype], result
        errors = [*result["attention"], *result["blocks"], result["partial"], result["mlp_input"],
                  *result["without_cache"], result["layer_output"]]  # fmt: skip
        assert max(errors) <= bound, result


@needs_triton
def test_fused_mixes_under_the_triton_interpreter_equal_the_reference():
    results = call_under_triton_interpreter(interpreter_layer_comparisons)
    assert_layers_agree(results["fp32"], FP32_BOUND, "torch.float32")
    assert_layers_agree(results["fp32, width 320"], FP32_BOUND, "torch.float32")
    assert_layers_agree(results["bf16"], BF16_BOUND, "torch.bfloat16")


def model_step_differences(device: str = "cpu") -> dict:
    """A tiny model's steps over the static cache with the fused mixes switched on and off
    (`switched_step_differences`), counting the kernels' calls (the step convolution's: the layers' ends, on CPU)."""
    from transformers_inkling2.backends import convolution_kernel, residual_mix_kernel

    kernels = [(residual_mix_kernel, "residual_mix"), (residual_mix_kernel, "residual_mix_after_sublayer"),
               (convolution_kernel, "step_convolution")]  # fmt: skip
    return switched_step_differences([residual_mix.ENV], kernels, device)


MODEL_KERNELS = ("residual_mix", "residual_mix_after_sublayer", "step_convolution")


@needs_triton
def test_model_steps_with_the_fused_mixes_equal_the_reference_steps():
    results = call_under_triton_interpreter(model_step_differences)
    # every decode and verification step (6): the attention inputs of layers 1-11 and the readout, every layer's
    # MoE input and end; the prefill (21 tokens) none
    assert results["calls_by_kernel"] == dict.fromkeys(MODEL_KERNELS, 12 * 6)
    assert results["prefill"] == 0
    assert results["difference"] <= FP32_BOUND


def compiled_steps_with_the_fused_mixes() -> dict:
    """The decode-step runner's compiled steps with the fused mixes switched on, against the same steps run eagerly
    (`compiled_step_launches`), two one-token decode steps and, compiled afresh, two verification steps of
    `MAX_STEP_TOKENS`: the launches of the mix's first kernel by its mode (0: before attention and the readout; 2:
    after attention, convolving over the ring), and the step convolution's by whether it adds a residual (the layers'
    ends)."""
    from transformers_inkling2.backends import convolution_kernel, residual_mix_kernel

    kernels = [(residual_mix_kernel, "_mix_statistics_kernel", "ADDEND"),
               (convolution_kernel, "_step_convolution_kernel", "HAS_RESIDUAL")]  # fmt: skip
    results = {}
    for name, step_sizes in (("decode", (1,) * 2), ("verification", (MAX_STEP_TOKENS,) * 2)):
        compiled = compiled_step_launches({residual_mix.ENV: "1"}, kernels, step_sizes)
        launches, ends = compiled["launches"]
        results[name] = dict(difference=compiled["difference"], launches=launches, ends=ends, steps=len(step_sizes))
    return results


@needs_triton
def test_compiled_decode_and_verification_steps_take_the_fused_mixes_whole():
    results = call_under_triton_interpreter(compiled_steps_with_the_fused_mixes)
    for result in results.values():  # the prompt runs eagerly; each step has 12 mixes of each kind and 12 layer ends
        steps = result["steps"]
        assert result["launches"] == {"0": 12 * steps, "2": 12 * steps}, result
        assert result["ends"] == {"True": 12 * steps}, result
        assert result["difference"] == 0, result  # the same kernels as the eager steps, in the same order


def steps_through_the_experts_terms() -> dict:
    """Where the experts take the hub kernel (patched so: its Triton kernels run here under the interpreter, as on a
    GPU), the tiny model's steps with the layer ends adding the experts' terms: eager with
    `INKLING2_FUSED_EXPERT_SUM` on and off (`switched_step_differences`: steps of 1 to 8 tokens), and two compiled
    decode steps against the same steps eager (`compiled_step_launches`); the layer ends' launches counted by how
    many routes they add up."""
    from transformers_inkling2.backends import convolution_kernel, kernel_loading
    from transformers_inkling2.modeling.experts import Inkling2Experts, Inkling2ExpertsBase

    ends = (convolution_kernel, "_step_convolution_kernel", "ROUTES")
    with contextlib.ExitStack() as stack:
        for storage in (Inkling2ExpertsBase, Inkling2Experts):
            stack.enter_context(mock.patch.object(storage, "takes_kernel", lambda self, x, weights: True))
        stack.enter_context(mock.patch.object(kernel_loading.moe_kernel().ops, "_runs_kernels", lambda x, fmt: True))
        with CountedLaunches(*ends) as launches:
            results = dict(eager=switched_step_differences([kernel_loading.TERMS_ENV], []))
        results["eager_launches"] = launches
        compiled = compiled_step_launches({kernel_loading.TERMS_ENV: "1"}, [ends], (1, 1))
        results["compiled"] = dict(difference=compiled["difference"], launches=compiled["launches"][0])
    return results


@needs_triton
def test_layer_ends_add_the_experts_terms_eager_and_compiled():
    """Six eager steps (12 layer ends each) add the top-2 routes' terms switched on and none switched off (the
    experts' combine kernel then), with the same logits bit for bit; the compiled steps trace whole and take the
    terms path too, with the eager steps' logits exactly."""
    results = call_under_triton_interpreter(steps_through_the_experts_terms)
    assert results["eager_launches"] == {"2": 12 * 6, "0": 12 * 6}, results
    assert results["eager"]["calls"] == 0 and results["eager"]["difference"] == 0, results
    assert results["compiled"] == dict(difference=0, launches={"2": 12 * 2}), results


@pytest.mark.parametrize(
    "switch, interpreter, fused", [(None, "1", True), ("1", "1", True), ("0", "1", False), (None, None, False)]
)
def test_the_mixes_are_fused_by_default_unless_switched_off_or_on_cpu(monkeypatch, switch, interpreter, fused):
    """On by default where the kernel runs (here: under the interpreter); `=0` keeps the reference, and so does a
    plain CPU."""
    set_environment(monkeypatch, {residual_mix.ENV: switch, "TRITON_INTERPRET": interpreter})
    layer = random_layer(1, {}, torch.float32, "cpu", 0)
    partial, blocks = random_stream(1, 1, 2, 64, torch.float32, "cpu", torch.Generator().manual_seed(0))
    assert residual_mix.runs_fused(layer.mlp_input, (layer.post_attention_layernorm,), blocks, partial) == fused


@pytest.mark.parametrize("compiling", [False, True])
def test_steps_up_to_a_verification_step_take_the_fused_mixes_compiled_or_not(monkeypatch, compiling):
    """Compiled or not, one-token and verification steps take the kernel (with the step's tokens in its grid it is
    faster than inductor's reductions at 8 tokens too, docs/benchmarks.md); a longer chunk runs the reference."""
    set_environment(monkeypatch, {residual_mix.ENV: "1", "TRITON_INTERPRET": "1"})
    monkeypatch.setattr(torch.compiler, "is_compiling", lambda: compiling)
    layer = random_layer(1, {}, torch.float32, "cpu", 0)
    generator = torch.Generator().manual_seed(0)
    for length, fused in ((1, True), (MAX_STEP_TOKENS, True), (MAX_STEP_TOKENS + 1, False)):
        partial, blocks = random_stream(1, length, 2, 64, torch.float32, "cpu", generator)
        assert residual_mix.runs_fused(layer.mlp_input, (layer.post_attention_layernorm,), blocks, partial) == fused


def test_only_steps_without_gradients_or_hooks_take_the_fused_mixes(monkeypatch):
    """Switched on under the interpreter: a chunk longer than a step, gradients, a hooked module and norms of
    different eps keep the reference; a cache other than the static one keeps the convolution's own call."""
    set_environment(monkeypatch, {residual_mix.ENV: "1", "TRITON_INTERPRET": "1"})
    layer = random_layer(5, {}, torch.float32, "cpu", 0)
    norms = layer.attention_norms()
    generator = torch.Generator().manual_seed(0)
    partial, blocks = random_stream(1, 8, 2, 64, torch.float32, "cpu", generator)
    longer, longer_blocks = random_stream(1, 9, 2, 64, torch.float32, "cpu", generator)
    assert residual_mix.runs_fused(layer.attention_input, norms, blocks, partial)
    assert not residual_mix.runs_fused(layer.attention_input, norms, longer_blocks, longer)
    assert not residual_mix.runs_fused(layer.attention_input, norms[:1], blocks, partial)
    with torch.enable_grad():
        assert not residual_mix.runs_fused(layer.attention_input, norms, blocks, partial.requires_grad_())
    partial.requires_grad_(False)
    norms[1].eps = 1e-3
    assert not residual_mix.runs_fused(layer.attention_input, norms, blocks, partial)
    norms[1].eps = norms[0].eps
    handle = layer.attention_input.register_forward_hook(lambda *args: None)
    assert not residual_mix.runs_fused(layer.attention_input, norms, blocks, partial)
    handle.remove()
    convolution, positions = layer.post_attention_convolution, torch.arange(8)
    assert residual_mix.convolution_ring(convolution, partial, Inkling2Cache(layer.self_attn.config), positions) is None
    static = Inkling2StaticCache(layer.self_attn.config, max_cache_len=64)
    static.begin_step(positions)
    assert residual_mix.convolution_ring(convolution, partial, static, positions) is not None


class DispatchedOperations(TorchDispatchMode):
    """The operations dispatched inside it that compute something (a launch each on a GPU, outside a compiled
    graph): views and empty allocations left out."""

    FREE = ("view", "unsqueeze", "expand", "transpose", "unbind", "squeeze", "select", "slice", "t", "alias",
            "_unsafe_view", "detach", "unfold", "new_empty", "empty")  # fmt: skip

    def __init__(self):
        super().__init__()
        self.names = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func.overloadpacket.__name__ not in self.FREE:
            self.names.append(f"{func.namespace}.{func.overloadpacket.__name__}")
        return func(*args, **(kwargs or {}))


def dispatched_operations() -> dict:
    """Per layer of `LAYERS`: the operations of `attention_inputs`, `mlp_inputs` and `layer_output` (over a static
    cache, one token), with the fused mixes and without; and of the model's readout."""
    generator = torch.Generator().manual_seed(0)
    results = {}
    for index in LAYERS:
        layer = random_layer(index, {}, torch.bfloat16, "cpu", index)
        partial, blocks = random_stream(1, 1, 2, 64, torch.bfloat16, "cpu", generator)
        output = torch.randn(1, 1, 64, generator=generator).to(torch.bfloat16)
        cache = Inkling2StaticCache(layer.self_attn.config, max_cache_len=16)
        positions = torch.arange(1)
        for setting, function in (("reference", reference), ("fused", fused)):  # the reference makes the ring
            cache.begin_step(positions)
            with DispatchedOperations() as attention:  # the layer's bf16 input: the reference converts it here
                _, continued, _ = function(layer.attention_inputs, blocks, partial, torch.bfloat16)
            continued = None if layer.opens_block else continued
            with DispatchedOperations() as mlp:
                function(layer.mlp_inputs, output, continued, blocks, None, cache, positions, torch.bfloat16)
            new_partial = partial.float()  # as `mlp_inputs` hands it on
            with DispatchedOperations() as end:
                function(layer.layer_output, output, new_partial, None, cache, positions, torch.bfloat16)
            results[f"layer {index}, {setting}"] = dict(attention=attention.names, mlp=mlp.names, end=end.names)
    model = Inkling2TextModel(Inkling2TextConfig(**ORACLE_TEXT_CONFIG)).to(torch.bfloat16).requires_grad_(False)
    for setting, function in (("reference", reference), ("fused", fused)):
        with DispatchedOperations() as readout:
            function(model.readout, blocks, partial, torch.bfloat16)
        results[f"readout, {setting}"] = dict(readout=readout.names)
    return results


@needs_triton
def test_a_fused_mix_is_one_operation_where_the_reference_takes_many():
    """With `-s` it prints the reference's counts (docs/kernels.md quotes them; on a GPU the reference's
    convolutions are one launch each)."""
    results = call_under_triton_interpreter(dispatched_operations)
    for index in LAYERS:
        assert results[f"layer {index}, fused"] == dict(
            attention=["inkling2.residual_mix"], mlp=["inkling2.residual_mix_after_sublayer"],
            end=["inkling2.step_convolution"],
        )  # fmt: skip
        reference_counts = {part: len(names) for part, names in results[f"layer {index}, reference"].items()}
        print(f"layer {index}: the reference's operations {reference_counts}")
        assert min(reference_counts.values()) > 10
    assert results["readout, fused"] == dict(readout=["inkling2.residual_mix"])
    print(f"readout: the reference's operations {len(results['readout, reference']['readout'])}")


# --- GPU: full width, fp32 and bf16 --------------------------------------------------------------------------------

FULL_WIDTH = dict(hidden_size=4608, num_attention_heads=48, num_key_value_heads=8, head_dim=128,
                  swa_num_attention_heads=48, swa_num_key_value_heads=8, swa_head_dim=128)  # fmt: skip


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_gpu_fused_mixes_full_width(dtype):
    """Hidden 4608 (18 chunks, or 9 of the wider chunk), against the reference on the GPU: fp32 within 1e-5, bf16
    within two ulps."""
    with wide_chunks_early():
        results = layer_comparison(dtype, device="cuda", fields=FULL_WIDTH, seed=5)
    assert_layers_agree(results, FP32_BOUND if dtype == torch.float32 else BF16_BOUND, str(dtype))


@pytest.mark.gpu
def test_gpu_model_steps_with_the_fused_mixes_equal_the_reference_steps():
    results = model_step_differences("cuda")
    # the step convolution's calls are the layers' ends here too: the mixes take the post-attention convolutions, the
    # key/value step a sliding layer's k and v, and a full layer's k and v convolve with per-token taps
    assert results["calls_by_kernel"] == dict.fromkeys(MODEL_KERNELS, 12 * 6)
    assert results["prefill"] == 0
    assert results["difference"] <= 1e-4  # fp32 on a GPU: the other kernels' sums in another order


@pytest.mark.gpu
def test_gpu_layer_ends_adding_the_experts_terms_equal_the_experts_own_sum():
    """In bf16, where the experts take the hub kernel: every decode and verification step's layer ends add the
    experts' terms themselves (`INKLING2_FUSED_EXPERT_SUM`, on by default) and give the logits of the kernel's own sum
    bit for bit; the prefill keeps the kernel's sum."""
    from transformers_inkling2.backends import convolution_kernel, kernel_loading

    with CountedLaunches(convolution_kernel, "_step_convolution_kernel", "ROUTES") as launches:
        results = switched_step_differences([kernel_loading.TERMS_ENV], [], "cuda", torch.bfloat16)
    # the layers' ends of the six steps, switched on (the top-k routes added up) and off (none)
    assert launches.pop("0") == 12 * 6 and list(launches.values()) == [12 * 6] and results["calls"] == 0
    assert results["difference"] == 0 and results["prefill"] == 0


@pytest.mark.gpu
def test_gpu_graph_replays_with_the_fused_mixes_equal_eager_steps(monkeypatch):
    """Switched on, in bf16: generate() over the static cache replays captured graphs and gives exactly the tokens of
    the same steps run eagerly, DSpark's verification steps included (the kernel inside a CUDA graph, its outputs in
    the graph's memory)."""
    monkeypatch.setenv(residual_mix.ENV, "1")
    target = cast_keeping_fp32_modules(build_with_drafter(), torch.bfloat16).cuda()
    input_ids, attention_mask = (t.cuda() for t in left_padded_batch(seed=5, length=21, pad=5))

    def generate(use_cuda_graphs, **kwargs):
        target._decode_graphs = Inkling2DecodeGraphs(target, use_cuda_graphs=use_cuda_graphs, min_bucket=16)
        return greedy_generate(target, input_ids, attention_mask, 40, cache_implementation="static", **kwargs)

    assert torch.equal(generate(use_cuda_graphs=True), generate(use_cuda_graphs=False))
    assert torch.equal(generate(use_cuda_graphs=True, dspark=True), generate(use_cuda_graphs=False, dspark=True))
