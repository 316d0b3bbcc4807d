"""A decode step's attention input projections (`backends/projections.py`, `backends/projection_kernel.py`): the
grouped GEMV of the six against the reference path (`nn.Linear`) on fresh random inputs, and which modules and
tensors take the kernel.

Tolerance. Against fp32 products of the same (half-precision) operands: each output within one ulp of its dtype,
relative to max(|expected|, 1): the kernel and cuBLAS both round an fp32 sum once, in their own orders.
"""

from __future__ import annotations

import pytest
import torch
from inkling2_helpers import needs_triton, run_under_triton_interpreter, within
from torch import nn

from transformers_inkling2.backends.projections import MAX_ROWS, input_projections, plain_weight
from transformers_inkling2.modeling.interfaces import KERNELS
from transformers_inkling2.modeling.tensors import LOCAL_BLOCK_LINEAR


def projection_case(rows, width, outputs, dtype, seed, device="cpu"):
    """(inputs [rows, width] per weight, three distinct tensors shared as the attention shares them, the linears);
    weights scaled so that outputs are O(1)."""
    generator = torch.Generator().manual_seed(seed)
    query, key, value = (torch.randn(rows, width, generator=generator).to(dtype) for _ in range(3))
    inputs = [query] * (len(outputs) - 2) + [key, value]
    modules = []
    for features in outputs:
        module = nn.Linear(width, features, bias=False, dtype=dtype)
        module.weight.data = (torch.randn(features, width, generator=generator) / width**0.5).to(dtype)
        modules.append(module.to(device))
    return [x.to(device) for x in inputs], modules


def exact_products(inputs, modules):
    return [x.float() @ module.weight.float().T for x, module in zip(inputs, modules, strict=True)]


_INTERPRETER_SCRIPT = r"""
import json, sys
import torch
sys.path.insert(0, sys.argv[1])
sys.path.insert(0, sys.argv[2])
from inkling2_helpers import within
from test_projections import exact_products, projection_case
from transformers_inkling2.backends import projection_kernel
from transformers_inkling2.backends.projection_kernel import BLOCK_M, grouped_projections
from transformers_inkling2.backends.projections import MAX_ROWS

# widths that are not multiples of the tiles (BLOCK_N 32, BLOCK_K 128 or 256); 1 to 16 rows; fp16 (the
# interpreter's bf16 `tl.dot` returns garbage: bf16 is checked on the GPU); TILE (no SMs off CUDA), then DEEP_TILE
# (as many SMs as programs or more)
results = {}
for sms in (0, 64):
    projection_kernel.multiprocessors = lambda tensor: sms
    for seed, (rows, width) in enumerate([(1, 200), (5, 96), (11, 160), (16, 320)]):
        dtype = torch.float16
        outputs = [48, 48, 12, 3, 16, 17] if seed % 2 == 0 else [40, 7, 33]
        inputs, modules = projection_case(rows, width, outputs, dtype, seed)
        got = grouped_projections(inputs, [m.weight.detach() for m in modules])
        expected = exact_products(inputs, modules)
        name = f"{rows}x{width} {dtype} -> {outputs}, {sms} SMs"
        results[name] = [all(y.dtype == dtype and y.shape == e.shape for y, e in zip(got, expected))]
        results[name] += [within(y, e, torch.finfo(dtype).eps) for y, e in zip(got, expected)]
assert MAX_ROWS <= BLOCK_M  # the dispatcher never hands the kernel more rows than it takes
print(json.dumps(results))
"""


@needs_triton
def test_kernels_under_the_triton_interpreter_equal_the_products():
    """1-16 rows, widths off the tiles, six and three weights of their own widths, fp16, through either tile: `[shapes
    and dtypes, each output within bound...]` per case."""
    from pathlib import Path

    here = Path(__file__).parent
    results = run_under_triton_interpreter(_INTERPRETER_SCRIPT, str(here.parent), str(here))
    assert len(results) == 8 and all(all(checks) for checks in results.values()), results


@needs_triton
def test_a_grid_of_at_most_one_program_per_sm_takes_the_deep_tile():
    """The full-width layer's six projections (474 programs of TILE) keep TILE on 132 SMs; the TP4-shaped layer's
    (119) take DEEP_TILE there, and TILE where the GPU has fewer SMs than that."""
    from transformers_inkling2.backends.projection_kernel import DEEP_TILE, TILE, launch_config

    def widths(heads, kv_heads):
        return [heads * 128, heads * 128, heads * 16, heads, kv_heads * 128, kv_heads * 128]

    def tile(config):
        return config["BLOCK_N"], config["BLOCK_K"], config["num_warps"], config["STAGES"]

    assert TILE != DEEP_TILE
    assert tile(launch_config(1, widths(48, 8), 132)) == TILE
    assert tile(launch_config(8, widths(12, 2), 132)) == DEEP_TILE
    assert tile(launch_config(8, widths(12, 2), 118)) == TILE
    with pytest.raises(ValueError, match="1 to 16 rows"):
        launch_config(17, widths(12, 2), 132)


def test_cpu_tensors_keep_the_reference_path():
    inputs, modules = projection_case(1, 64, [32, 8, 16, 16], torch.bfloat16, seed=1)
    assert input_projections(inputs, modules) is None


class HookedLinear(nn.Linear):
    """A subclass, as PEFT's and parallel plans' wrappers are."""


@pytest.mark.parametrize(
    "change, takes",
    [
        ("none", True),
        ("bias", False),
        ("fp32", False),
        ("subclass", False),
        ("hook", False),
        ("pre_hook", False),
        ("narrower input", False),
        ("transposed", False),
        ("own forward", False),
        ("local block forward", True),
    ],
)
def test_only_plain_linears_take_the_kernels(change, takes):
    """LoRA layers, parallel plans (hooks, DTensors) and the rest keep the reference: `plain_weight` says which."""
    module = (HookedLinear if change == "subclass" else nn.Linear)(64, 32, bias=change == "bias", dtype=torch.bfloat16)
    if change == "fp32":
        module.float()
    if change == "hook":
        module.register_forward_hook(lambda *args: None)
    if change == "pre_hook":
        module.register_forward_pre_hook(lambda *args: None)
    if change == "transposed":
        module.weight = nn.Parameter(torch.randn(64, 32, dtype=torch.bfloat16).T)
    if change in ("own forward", "local block forward"):  # a parallel style's forward: only ours says what it is
        module.forward = lambda x: x
    if change == "local block forward":
        setattr(module, LOCAL_BLOCK_LINEAR, True)
    width = 48 if change == "narrower input" else 64
    assert (plain_weight(module, width, torch.bfloat16) is not None) is takes


def test_the_attention_asks_the_registered_kernel():
    assert KERNELS.get("input_projections") is input_projections


@pytest.mark.gpu
@pytest.mark.parametrize("rows", [1, 8, MAX_ROWS])
@pytest.mark.parametrize("layer", ["full width", "tp4"])
def test_gpu_kernels_at_model_shapes(rows, layer):
    """The attention's shapes (hidden 4,608; 48 or 12 query heads of 128, 8 or 2 kv heads, d_rel 16), bf16: the
    kernel through the dispatch, shaped as the modules' outputs, within bound of fp32 products."""
    heads, kv_heads = (48, 8) if layer == "full width" else (12, 2)
    outputs = [heads * 128, heads * 128, heads * 16, heads, kv_heads * 128, kv_heads * 128]
    inputs, modules = projection_case(rows, 4608, outputs, torch.bfloat16, seed=rows, device="cuda")
    with torch.no_grad():
        got = input_projections([x.view(rows, 1, -1) for x in inputs], modules)
        expected = exact_products(inputs, modules)
        assert all(y.shape == (rows, 1, e.shape[-1]) for y, e in zip(got, expected))
        assert all(within(y.view(rows, -1), e, torch.finfo(torch.bfloat16).eps) for y, e in zip(got, expected))
    assert input_projections([x.view(rows, 1, -1) for x in inputs], modules) is None  # weights require grad


@pytest.mark.gpu
def test_gpu_model_step_with_and_without_the_kernels(monkeypatch):
    """A tiny bf16 model on CUDA: logits with the projection kernels within bf16 rounding of those with the reference
    projections (the entries taken out of the registry), and every layer called the kernel."""
    from inkling2_helpers import ORACLE_TEXT_CONFIG

    from transformers_inkling2 import Inkling2ForCausalLM, Inkling2TextConfig
    from transformers_inkling2.tiny import randomize_

    # every expert routed: rounding cannot flip a routing choice and turn a small difference into a large one
    config = Inkling2TextConfig(**{**ORACLE_TEXT_CONFIG, "n_routed_experts": 2, "num_experts_per_tok": 2})
    model = randomize_(Inkling2ForCausalLM(config), 3).to("cuda", torch.bfloat16)
    ids = torch.randint(0, 500, (2, 7), generator=torch.Generator().manual_seed(0)).cuda()
    calls = []

    def counted(inputs, modules):
        calls.append(inputs[0].shape)
        return input_projections(inputs, modules)

    def logits():
        with torch.no_grad():
            return model(ids).logits.float()

    monkeypatch.setitem(KERNELS._entries, "input_projections", counted)
    fused = logits()
    assert calls == [(2, 7, 64)] * 12  # 14 rows: every layer's projections took the kernel
    monkeypatch.delitem(KERNELS._entries, "input_projections")
    reference = logits()
    assert ((fused - reference).abs().max() / reference.abs().max()).item() < 0.02
