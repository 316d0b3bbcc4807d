"""The prompt's fused short convolution (`backends/convolution_kernel.py`, what CUDA prefill runs) against
`short_convolution_sum` and against the module's reference path (`Inkling2ShortConvolution`, `F.conv1d`), on fresh
random inputs.

Tolerances. Against `short_convolution_sum`: fp32 bit for bit (the kernel does the sum's operations in its order,
unfused, with a correctly rounded division, as PyTorch's CPU kernels do); fp16/bf16 outputs bit for bit on a GPU and
within one ulp of the output dtype under Triton's interpreter, whose fp32 -> bf16 cast truncates. Against
`F.conv1d`, which sums in its own order: relative to max(|reference|, 1), 1e-5 in fp32 and one ulp of the output
dtype in fp16/bf16.
"""

from __future__ import annotations

import math
from pathlib import Path

import pytest
import torch
from inkling2_helpers import needs_triton, run_under_triton_interpreter, within

from transformers_inkling2.backends.convolution import (
    MAX_KERNEL_SIZE,
    fused_prompt_convolution,
    fused_step_convolution,
    runs_fused,
    short_convolution_sum,
)
from transformers_inkling2.cache.common import MAX_STEP_TOKENS, join_convolution_context
from transformers_inkling2.modeling.interfaces import KERNELS
from transformers_inkling2.modeling.modeling_inkling2_text import Inkling2ShortConvolution, depthwise_convolution


def convolution_inputs(batch, length, channels, kernel_size, dtype, seed, device="cpu"):
    """An `Inkling2ShortConvolution` with random weights, x [batch, T, C] and the k - 1 inputs held before it (as a
    cache holds them; random, never zeros), on `device`."""
    generator = torch.Generator().manual_seed(seed)
    convolution = Inkling2ShortConvolution(channels, kernel_size, layer_idx=0, conv_idx=0)
    torch.nn.init.normal_(convolution.conv1d.weight, std=0.5, generator=generator)
    x = torch.randn(batch, length, channels, generator=generator).to(dtype)
    history = torch.randn(batch, channels, kernel_size - 1, generator=generator)
    return convolution.to(device), x.to(device), history.to(device)


class HeldInputs:
    """The cache's part in a convolution: `history` before the inputs, joined as the caches join them."""

    def __init__(self, history):
        self.history = history

    def convolution_context(self, layer_idx, conv_idx, inputs, kernel_size, query_positions):
        return join_convolution_context(self.history, inputs)


def reference_pair(convolution, x, history):
    """(the module's output, the context the model builds for x): a prompt's is time-major."""
    with torch.no_grad():
        expected = convolution(x, cache=HeldInputs(history))
    return expected, join_convolution_context(history, x.float().transpose(1, 2))


def conv1d_tolerance(dtype):
    """Of `within` against `F.conv1d`: fp32 sums in another order; a low-precision output may round the other way."""
    return 1e-5 if dtype == torch.float32 else torch.finfo(dtype).eps


def within_one_ulp(actual, expected):
    """Each element at most one ulp of expected's (low-precision) dtype from it."""
    finfo = torch.finfo(expected.dtype)
    bound = finfo.eps * expected.float().abs().clamp(min=finfo.tiny)
    return bool(((actual.float() - expected.float()).abs() <= bound).all())


_INTERPRETER_SCRIPT = r"""
import json, math, sys
import torch
sys.path.insert(0, sys.argv[1])
sys.path.insert(0, sys.argv[2])
from inkling2_helpers import within
from test_convolution import conv1d_tolerance, convolution_inputs, reference_pair, within_one_ulp
from transformers_inkling2.backends.convolution import short_convolution_sum
from transformers_inkling2.backends.convolution_kernel import BLOCK_C, BLOCK_T, short_convolution

# (batch, T, C, k, dtype): T never a multiple of BLOCK_T; C = 300 spans channel blocks, the last partial
cases = [
    (1, 20, 48, 2, torch.float32), (2, 45, 48, 3, torch.float32), (2, 45, 300, 4, torch.float32),
    (1, 70, 48, 5, torch.float32), (2, 20, 48, 2, torch.bfloat16), (1, 45, 300, 3, torch.bfloat16),
    (2, 45, 48, 4, torch.bfloat16), (2, 70, 48, 5, torch.bfloat16), (2, 45, 48, 4, torch.float16),
]
results = {}
for seed, (batch, length, channels, k, dtype) in enumerate(cases):
    assert length % BLOCK_T and (channels < BLOCK_C or channels % BLOCK_C)
    convolution, x, history = convolution_inputs(batch, length, channels, k, dtype, seed)
    expected, context = reference_pair(convolution, x, history)
    assert context.stride(1) == 1  # time-major, as the model lays out a prompt's context
    weight, divisor = convolution.conv1d.weight.detach().squeeze(1), math.sqrt(k + 1)
    layouts = {"time-major": (context, x)}
    if seed % 3 == 0:  # other strides: a channel-major context, x a view into wider activations
        wide = torch.randn(batch, length, channels + 16, generator=torch.Generator().manual_seed(99)).to(dtype)
        wide[..., 8 : 8 + channels] = x
        layouts["channel-major, x a view"] = (context.contiguous(), wide[..., 8 : 8 + channels])
    for layout, (context, x_view) in layouts.items():
        fused = short_convolution(context, x_view, weight, divisor)
        summed = short_convolution_sum(context, x, weight, divisor)
        name = f"{batch}x{length}x{channels}, k={k}, {dtype}, {layout}"
        exact = torch.equal(fused, summed) if dtype == torch.float32 else within_one_ulp(fused, summed)
        close = within(fused, expected, conv1d_tolerance(dtype))
        results[name] = [fused.dtype == dtype and fused.shape == x.shape, exact, close]
print(json.dumps(results))
"""


@needs_triton
def test_kernel_under_the_triton_interpreter_equals_the_sum_and_the_module():
    """fp32/fp16/bf16, k = 2..5, batch 1-2, partial token and channel tiles, the model's time-major context and other
    strides; `[right dtype and shape, equal to the sum, within tolerance of F.conv1d]` for each case."""
    here = Path(__file__).parent
    results = run_under_triton_interpreter(_INTERPRETER_SCRIPT, str(here.parent), str(here))
    assert len(results) == 12 and all(all(checks) for checks in results.values()), results


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_sum_equals_the_module(dtype):
    """The readable reference itself (no Triton needed) against `F.conv1d`, after held inputs, on a prompt's
    time-major context."""
    convolution, x, history = convolution_inputs(2, 20, 48, 4, dtype, seed=7)
    expected, context = reference_pair(convolution, x, history)
    weight = convolution.conv1d.weight.detach().squeeze(1)
    summed = short_convolution_sum(context, x, weight, math.sqrt(5))
    assert summed.dtype == dtype and within(summed, expected, conv1d_tolerance(dtype))


def test_cpu_tensors_keep_the_reference_path():
    """Only CUDA prompts take the kernel: on CPU the hook declines and the module runs `F.conv1d`."""
    convolution, x, history = convolution_inputs(1, 20, 16, 4, torch.float32, seed=3)
    _, context = reference_pair(convolution, x, history)
    assert not runs_fused(x, convolution.conv1d.weight)
    assert fused_prompt_convolution(context, x, convolution.conv1d.weight, math.sqrt(5)) is None


@pytest.mark.parametrize("length", [1, 3, 8])
def test_cpu_steps_take_the_unfolded_sum(length):
    """On the CPU a step's few tokens (at most MAX_STEP_TOKENS = 8) skip oneDNN's per-call set-up: the unfolded
    product must give F.conv1d's values (fp32, relative 1e-6), and its gradients."""
    generator = torch.Generator().manual_seed(length)
    context = torch.randn(2, 48, length + 3, generator=generator, requires_grad=True)
    weight = torch.randn(48, 1, 4, generator=generator, requires_grad=True)
    expected = torch.nn.functional.conv1d(context, weight, groups=48)
    output = depthwise_convolution(context, weight)
    assert output.shape == expected.shape == (2, 48, length)
    assert within(output, expected, 1e-6)
    cotangent = torch.randn(expected.shape, generator=generator)
    grads = torch.autograd.grad(output, (context, weight), cotangent)
    expected_grads = torch.autograd.grad(expected, (context, weight), cotangent)
    assert all(within(g, e, 1e-5) for g, e in zip(grads, expected_grads, strict=True))


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("batch, length", [(1, 8192), (2, 1037)], ids=["8k", "2x1037"])
def test_gpu_kernel_full_width(batch, length, dtype):
    """4,608 channels, k = 4, through the module (which takes the kernel on CUDA): bit for bit
    `short_convolution_sum` on CPU copies, and within tolerance of the module's `F.conv1d` path (run on CPU, where the
    kernel is never taken)."""
    convolution, x, history = convolution_inputs(batch, length, 4608, 4, dtype, seed=length, device="cuda")
    weight = convolution.conv1d.weight
    assert not runs_fused(x, weight)  # gradients flow: the kernel has no backward
    with torch.no_grad():
        assert runs_fused(x, weight) and not runs_fused(x[:, :8], weight)
        assert not runs_fused(x, torch.randn(4608, 1, MAX_KERNEL_SIZE + 1, device="cuda"))
    fused, context = reference_pair(convolution, x, history)
    assert fused.dtype == dtype and fused.is_contiguous()
    weight = convolution.conv1d.weight.detach().squeeze(1).cpu()
    assert torch.equal(fused.cpu(), short_convolution_sum(context.cpu(), x.cpu(), weight, math.sqrt(5)))
    expected, _ = reference_pair(convolution.cpu(), x.cpu(), history.cpu())
    assert within(fused.cpu(), expected, conv1d_tolerance(dtype))


@pytest.mark.gpu
def test_gpu_kernel_past_2_31_elements():
    """4 x 131,072 tokens x 4,608 channels (2.4e9 elements, 20 GB with the context): the last row's last tokens, whose
    offsets need 64 bits, bit for bit `short_convolution_sum` on CPU copies of their slices."""
    batch, length, channels, tail = 4, 131072, 4608, 64
    assert batch * length * channels > 2**31
    generator = torch.Generator(device="cuda").manual_seed(11)
    x = torch.randn(batch, length, channels, device="cuda", dtype=torch.bfloat16, generator=generator)
    history = torch.randn(batch, channels, 3, device="cuda", generator=generator)
    weight = torch.randn(channels, 1, 4, device="cuda", generator=generator)
    context = join_convolution_context(history, x.float().transpose(1, 2))
    with torch.no_grad():
        fused = fused_prompt_convolution(context, x, weight, math.sqrt(5))
    for row, tokens in ((0, slice(0, tail)), (batch - 1, slice(length - tail, length))):
        held = context[row : row + 1, :, tokens.start : tokens.stop + 3].cpu()
        expected = short_convolution_sum(held, x[row : row + 1, tokens].cpu(), weight.squeeze(1).cpu(), math.sqrt(5))
        assert torch.equal(fused[row : row + 1, tokens].cpu(), expected)


# --- decode steps over the static cache (`fused_step_convolution`, `convolution_kernel.step_convolution`) ------------


def run_steps_both_ways(channels, kernel_size, dtype, seed, step_kernel, device="cpu"):
    """A prompt of 11 tokens, then steps of 1, 3, 1, 8 and 2 tokens (two rows, padding in some), through two static
    caches: the module's reference path on one, `step_kernel(x, mask, ring, slots..., weight, divisor)` on the other's
    ring for the steps. `[(step, output within tolerance of the reference, the two rings equal)]`."""
    from transformers_inkling2 import Inkling2TextConfig
    from transformers_inkling2.cache.static import Inkling2StaticCache

    generator = torch.Generator().manual_seed(seed)
    config = Inkling2TextConfig(conv_kernel_size=kernel_size)
    reference_cache, kernel_cache = (Inkling2StaticCache(config, max_cache_len=64) for _ in range(2))
    convolution = Inkling2ShortConvolution(channels, kernel_size, layer_idx=0, conv_idx=0)
    convolution.conv1d.weight.data = torch.randn(channels, 1, kernel_size, generator=generator)
    convolution = convolution.to(device).requires_grad_(False)
    weight, divisor = convolution.conv1d.weight.squeeze(1), math.sqrt(kernel_size + 1)
    results, start = [], 0
    for length in (11, 1, 3, 1, 8, 2):
        x = torch.randn(2, length, channels, generator=generator).to(device, dtype)
        mask = None if length % 3 else (torch.rand(2, length, generator=generator) > 0.3).to(device)
        positions = torch.arange(start, start + length, device=device)
        expected = convolution(x, mask, reference_cache, positions)
        if length <= MAX_STEP_TOKENS:
            shape_only = x.new_empty(2, channels, 0, dtype=torch.float32)
            ring, step = kernel_cache.step_convolution_ring(0, 0, shape_only, kernel_size, positions)
            got = step_kernel(x, mask, ring, step.history_slots, step.history_held, step.conv_write, weight, divisor)
            rings = reference_cache.layers[0].conv_inputs[0], kernel_cache.layers[0].conv_inputs[0]
            close = got.dtype == dtype and within(got, expected, conv1d_tolerance(dtype))
            results.append((length, close, torch.equal(*rings)))
        else:  # a prompt: both through the reference
            convolution(x, mask, kernel_cache, positions)
        start += length
    return results


def step_convolution_via_terms(x, mask, ring, history_slots, history_held, write_slots, weight, divisor, routes=4,
                               parts=3):
    """`step_convolution` of terms whose sum is x: per token, x in one live term (a random route and part)
    and zeros in the others, and NaN in a route to a dropped id, which the kernel must skip. A `run_steps_both_ways`
    step kernel."""
    generator = torch.Generator().manual_seed(x.shape[1])
    rows, channels = x.shape[0] * x.shape[1], x.shape[2]
    experts = 2 * routes
    ids = torch.randint(0, experts, (rows, routes), generator=generator)
    ids[0, 0] = experts  # dropped
    terms = torch.zeros(parts, rows, routes, channels)
    terms[:, 0, 0] = float("nan")
    for row, (route, part) in enumerate(zip(torch.randint(1, routes, (rows,), generator=generator).tolist(),
                                            torch.randint(0, parts, (rows,), generator=generator).tolist())):
        terms[part, row, route] = x.reshape(rows, channels)[row].float()
    terms, ids = terms.to(x.device), ids.to(x.device)
    from transformers_inkling2.backends.convolution_kernel import step_convolution

    # x poisoned past the terms: the kernel must not read it
    return step_convolution(torch.full_like(x, float("nan")), mask, ring, history_slots, history_held, write_slots,
                            weight, divisor, None, terms, ids, experts)  # fmt: skip


_STEP_INTERPRETER_SCRIPT = r"""
import json, sys
import torch
sys.path.insert(0, sys.argv[1])
sys.path.insert(0, sys.argv[2])
from test_convolution import run_steps_both_ways, step_convolution_via_terms
from transformers_inkling2.backends.convolution_kernel import BLOCK_C, step_convolution

results = {}
for seed, (channels, k, dtype) in enumerate([(48, 4, torch.float32), (300, 2, torch.bfloat16), (40, 3, torch.float32)]):
    assert channels < BLOCK_C or channels % BLOCK_C  # a partial channel tile
    results[f"{channels} channels, k={k}, {dtype}"] = run_steps_both_ways(channels, k, dtype, seed, step_convolution)
# the terms' sum is rounded to bf16 (as the experts' combine rounds it): bf16 inputs, and steps of other sizes
for seed, (channels, k) in enumerate([(300, 4), (40, 3)]):
    results[f"{channels} channels, k={k}, terms"] = run_steps_both_ways(channels, k, torch.bfloat16, seed + 3,
                                                                        step_convolution_via_terms)
print(json.dumps(results))
"""


@needs_triton
def test_step_kernel_under_the_triton_interpreter_equals_the_module_and_keeps_the_ring():
    """Steps of 1-8 tokens after a prompt, padding in some, k = 2..4, fp32 and bf16, the step's input given as it
    is or (bf16) as the experts' terms: each step's output within tolerance of the module's reference path, and the
    ring it wrote equal to the reference's."""
    here = Path(__file__).parent
    results = run_under_triton_interpreter(_STEP_INTERPRETER_SCRIPT, str(here.parent), str(here))
    assert len(results) == 5 and all(ok and same for steps in results.values() for _, ok, same in steps), results
    assert all([length for length, *_ in steps] == [1, 3, 1, 8, 2] for steps in results.values())


def test_step_kernel_only_for_cuda_steps_over_the_static_cache():
    """CPU steps, the dynamic cache and prompts keep the reference: the hook declines."""
    from transformers_inkling2 import Inkling2TextConfig
    from transformers_inkling2.cache.dynamic import Inkling2Cache
    from transformers_inkling2.cache.static import Inkling2StaticCache

    config = Inkling2TextConfig()
    x, weight = torch.randn(1, 1, 16), torch.randn(16, 1, 4)
    static = Inkling2StaticCache(config, max_cache_len=16)
    assert fused_step_convolution(x, None, static, 0, 0, torch.arange(1), weight, math.sqrt(5)) is None
    assert fused_step_convolution(x, None, Inkling2Cache(config), 0, 0, torch.arange(1), weight, 2.0) is None
    assert KERNELS.get("step_convolution") is fused_step_convolution
    prompt = torch.arange(MAX_STEP_TOKENS + 1)
    assert static.step_convolution_ring(0, 0, x.new_empty(1, 16, 0), 4, prompt) is None  # not read from the ring


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_gpu_step_kernel_full_width(dtype):
    """4,608 channels, k = 4, on the GPU: steps through the dispatch's kernel, in bf16 also from the experts' terms,
    against the module's reference path (cuDNN) within tolerance, the rings equal."""
    from transformers_inkling2.backends.convolution_kernel import step_convolution

    with torch.no_grad():
        results = run_steps_both_ways(4608, 4, dtype, 5, step_convolution, device="cuda")
        if dtype == torch.bfloat16:  # (the terms' sum is rounded to bf16)
            results += run_steps_both_ways(4608, 4, dtype, 5, step_convolution_via_terms, device="cuda")
    assert len(results) == (10 if dtype == torch.bfloat16 else 5) and all(ok and same for _, ok, same in results)


@pytest.mark.gpu
@pytest.mark.parametrize("tokens,parts", [(1, 1), (1, 3), (8, 1)])
def test_gpu_layer_end_of_terms_is_the_layer_end_of_their_sum(tokens, parts):
    """Two steps of a layer's end from random experts' terms (two rows, top-8, a dropped route, hidden 4,608, bf16)
    against the end of their sum made as the experts' combine makes it (`moe_forward`'s order; the hub kernel's tests
    hold the combine to that sum bit for bit), each over its own static cache: outputs and rings bit for bit."""
    from transformers_inkling2 import Inkling2TextConfig
    from transformers_inkling2.backends.convolution_kernel import step_convolution
    from transformers_inkling2.cache.static import Inkling2StaticCache

    generator = torch.Generator(device="cuda").manual_seed(tokens * 10 + parts)
    channels, kernel_size, routes, experts, rows = 4608, 4, 8, 384, 2 * tokens
    weight = torch.randn(channels, kernel_size, device="cuda", generator=generator)
    config = Inkling2TextConfig(conv_kernel_size=kernel_size)
    caches = [Inkling2StaticCache(config, max_cache_len=64) for _ in range(2)]
    for first in (0, tokens):  # the second step convolves over the first one's inputs
        terms = torch.randn(parts, rows, routes, channels, device="cuda", generator=generator)
        ids = torch.randint(0, experts, (rows, routes), device="cuda", generator=generator)
        ids[1, 3] = -1  # dropped
        total = torch.zeros(rows, channels, device="cuda")
        for route in range(routes):
            for part in range(parts):
                total = total + torch.where((ids[:, route] >= 0)[:, None], terms[part, :, route], 0.0)
        x = total.to(torch.bfloat16).view(2, tokens, channels)
        residual = torch.randn(2, tokens, channels, device="cuda", generator=generator)
        positions = torch.arange(first, first + tokens, device="cuda")
        ends = []
        for cache in caches:
            ring, step = cache.step_convolution_ring(0, 0, x.new_empty(2, channels, 0, dtype=torch.float32),
                                                     kernel_size, positions)  # fmt: skip
            convolved = (ring, step.history_slots, step.history_held, step.conv_write, weight, kernel_size**0.5)
            if cache is caches[0]:
                ends.append(step_convolution(x, None, *convolved, residual))
            else:
                ends.append(step_convolution(torch.full_like(x, float("nan")), None, *convolved, residual, terms, ids,
                                             experts))  # fmt: skip
        assert torch.equal(ends[0], ends[1])
    assert torch.equal(*(cache.layers[0].conv_inputs[0] for cache in caches))
