"""A decode step's router (`backends/routing.py`, `backends/router_kernel.py`) against the reference
(`Inkling2TopKRouter`'s own computation) on fresh random inputs, and which calls take the kernels.

Tolerances. Logits: fp32 sums in another order, 1e-5 relative to max(|reference|, 1). Chosen experts: the same set
(random scores have no near-ties at that error). Weights: 1e-5 relative (sigmoid through another exp, sums of eight
in another order).
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from inkling2_helpers import needs_triton, on_mocked_gpu, run_under_triton_interpreter, within

from transformers_inkling2 import Inkling2TextConfig
from transformers_inkling2.backends.routing import MAX_ROWS, kernel_takes, top_k_routing
from transformers_inkling2.modeling.interfaces import KERNELS
from transformers_inkling2.modeling.modeling_inkling2_text import Inkling2TopKRouter


def router_case(rows, width, experts, top_k, dtype, seed, device="cpu"):
    """(x [rows, width] of dtype, a router of `experts` fp32 weights and a random score bias)."""
    generator = torch.Generator().manual_seed(seed)
    config = Inkling2TextConfig(hidden_size=width, n_routed_experts=experts, num_experts_per_tok=top_k, route_scale=2.5)
    router = Inkling2TopKRouter(config)
    router.weight.data = torch.randn(experts, width, generator=generator) / width**0.5
    router.e_score_correction_bias.copy_(torch.rand(experts, generator=generator) * 0.1)
    x = torch.randn(rows, width, generator=generator).to(dtype)
    return x.to(device), router.to(device)


def agrees(routed, expected) -> list[bool]:
    """[shapes and dtypes, logits within bound, the same experts per row, their weights within bound]."""
    logits, weights, chosen = routed
    expected_logits, expected_weights, expected_chosen = expected
    order, expected_order = chosen.sort(-1).indices, expected_chosen.sort(-1).indices
    return [
        all(a.shape == e.shape and a.dtype == e.dtype for a, e in zip(routed, expected, strict=True)),
        within(logits, expected_logits, 1e-5),
        torch.equal(chosen.sort(-1).values, expected_chosen.sort(-1).values),
        within(weights.gather(-1, order), expected_weights.gather(-1, expected_order), 1e-5),
    ]


# widths off the K slices, expert counts off BLOCK_E, 1 to 37 rows (odd counts: a program's group of rows part empty),
# bf16 and fp32 inputs
ODD_CASES = [(1, 200, 40, 8), (5, 96, 384, 8), (16, 130, 17, 3), (11, 600, 96, 2), (37, 300, 40, 5)]

_INTERPRETER_SCRIPT = r"""
import json, sys
import torch
sys.path.insert(0, sys.argv[1])
sys.path.insert(0, sys.argv[2])
from test_routing import ODD_CASES, agrees, router_case
from transformers_inkling2.backends import routing, router_kernel
from transformers_inkling2.backends.router_kernel import SLICE, top_k_of_partial_sums

assert routing.MAX_EXPERTS == router_kernel.MAX_EXPERTS


def partial_sums(x, weight):
    # what `partial_logits` writes (its Gluon kernel has no interpreter): fp32 sums per K slice
    x, weight = x.float(), weight.float()
    return torch.stack([x[:, k:k + SLICE] @ weight[:, k:k + SLICE].T for k in range(0, x.shape[1], SLICE)])


results = {}
for seed, (rows, width, experts, top_k) in enumerate(ODD_CASES):
    dtype = torch.bfloat16 if seed % 2 == 0 else torch.float32
    x, router = router_case(rows, width, experts, top_k, dtype, seed)
    with torch.no_grad():
        expected = router(x)
        routed = top_k_of_partial_sums(partial_sums(x, router.weight), router.e_score_correction_bias, top_k,
                                       router.route_scale)
    results[f"{rows}x{width} {dtype} -> top-{top_k} of {experts}"] = agrees(routed, expected)
# all scores tied (zero weights and bias): the lowest indices, each weighted route_scale / k
_, weights, chosen = top_k_of_partial_sums(torch.zeros(1, 2, 40), torch.zeros(40), 3, 2.5)
results["ties"] = [chosen.tolist() == [[0, 1, 2]] * 2, torch.allclose(weights, torch.full((2, 3), 2.5 / 3))]
print(json.dumps(results))
"""


@needs_triton
def test_top_k_kernel_under_the_triton_interpreter_equals_the_reference():
    """`[shapes and dtypes, logits, experts, weights]` all within bound, per case, from partial sums computed here;
    ties go to the lower index."""
    here = Path(__file__).parent
    results = run_under_triton_interpreter(_INTERPRETER_SCRIPT, str(here.parent), str(here))
    assert len(results) == 6 and all(all(checks) for checks in results.values()), results


def test_the_kernels_take_the_rows_they_route_faster():
    """Up to 64 rows, the most the benchmark times (the kernels beat the reference at every count up to it, at
    Inkling-2-Small's 384 experts and a TP4/EP4-shaped 96); never an empty step or more experts than the top-k program
    holds."""
    assert kernel_takes(1, 384) and kernel_takes(MAX_ROWS, 384) and kernel_takes(MAX_ROWS, 96)
    assert MAX_ROWS == 64 and not kernel_takes(MAX_ROWS + 1, 16)
    assert not kernel_takes(0, 96) and not kernel_takes(1, 1025)


def test_cpu_tensors_keep_the_reference_path():
    x, router = router_case(1, 64, 16, 4, torch.bfloat16, seed=1)
    assert top_k_routing(x, router.weight, router.e_score_correction_bias, 4, 2.5) is None


@needs_triton
def test_rocm_keeps_the_reference_path(monkeypatch):
    """The partial sums' Gluon layout is one of 32-lane warps: a GPU under ROCm (64-lane wavefronts) routes through
    the reference, before any launch."""
    x, router = router_case(1, 64, 16, 4, torch.bfloat16, seed=3)
    router.requires_grad_(False)
    monkeypatch.setattr(torch.version, "hip", "6.2")
    with on_mocked_gpu((9, 4)):
        assert top_k_routing(x, router.weight, router.e_score_correction_bias, 4, 2.5) is None


def test_the_router_asks_the_registered_kernel(monkeypatch):
    """The router hands its call to the registry's entry and returns what that returns."""
    assert KERNELS.get("top_k_routing") is top_k_routing
    x, router = router_case(3, 64, 16, 4, torch.float32, seed=2)
    handed = []

    def recording(*args):
        handed.append(args)
        return "routed"

    monkeypatch.setitem(KERNELS._entries, "top_k_routing", recording)
    assert router(x) == "routed"
    assert handed[0][0] is x and handed[0][1] is router.weight and handed[0][3:] == (4, 2.5)


def _gpu_agrees(rows, width, experts, top_k, dtype, seed) -> list[bool]:
    """`agrees` of the kernels through the dispatch against the reference on the same GPU."""
    x, router = router_case(rows, width, experts, top_k, dtype, seed, device="cuda")
    router.requires_grad_(False)
    fused = top_k_routing(x, router.weight, router.e_score_correction_bias, top_k, router.route_scale)
    entry = KERNELS._entries.pop("top_k_routing")
    try:
        expected = router(x)
    finally:
        KERNELS._entries["top_k_routing"] = entry
    return agrees(fused, expected)


@pytest.mark.gpu
@pytest.mark.parametrize("experts, top_k, rows", [(384, 8, 1), (384, 8, 8), (384, 8, 32), (384, 8, MAX_ROWS),
                                                  (96, 2, 1), (96, 2, 7), (96, 2, MAX_ROWS)])
def test_gpu_kernels_at_model_shapes(rows, experts, top_k):
    """Inkling-2-Small's router (hidden 4,608, 384 experts, top-8) and a TP4/EP4-shaped one (96, top-2), bf16
    inputs, up to the most rows the dispatch gives them (8 rows at 96 experts: programs of 4 rows)."""
    assert all(_gpu_agrees(rows, 4608, experts, top_k, torch.bfloat16, seed=rows))
    x, router = router_case(rows, 4608, experts, top_k, torch.bfloat16, seed=rows, device="cuda")
    assert top_k_routing(x, router.weight, router.e_score_correction_bias, top_k, 2.5) is None  # gradients


@pytest.mark.gpu
@pytest.mark.parametrize("seed, case", list(enumerate(ODD_CASES)))
def test_gpu_kernels_at_odd_shapes(seed, case):
    """The interpreter's cases (widths off the K slices, experts off BLOCK_E, groups of rows part empty) through both
    kernels, the partial sums' among them, which have no interpreter."""
    assert all(_gpu_agrees(*case, torch.bfloat16 if seed % 2 == 0 else torch.float32, seed))
