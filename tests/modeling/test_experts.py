"""The BF16 experts through transformers' experts functions when split across ranks (one process: the block and the
flag a parallel plan sets, without DTensors; tests/parallel runs the real split over two processes)."""

import pytest
import torch
from inkling2_helpers import ORACLE_TEXT_CONFIG

from transformers_inkling2 import Inkling2TextConfig
from transformers_inkling2.modeling.experts import Inkling2Experts
from transformers_inkling2.tiny import randomize_


@pytest.mark.parametrize("implementation", ["grouped_mm", "batched_mm"])
@pytest.mark.parametrize("first_expert", [0, 4])
def test_a_block_of_experts_runs_its_own_routes_only_like_the_reference(implementation, first_expert):
    config = Inkling2TextConfig(**ORACLE_TEXT_CONFIG)
    full = randomize_(Inkling2Experts(config), seed=5)
    block = Inkling2Experts(config)
    block.gate_up_proj = torch.nn.Parameter(full.gate_up_proj[first_expert : first_expert + 4].detach().clone())
    block.down_proj = torch.nn.Parameter(full.down_proj[first_expert : first_expert + 4].detach().clone())
    block.num_experts, block.first_expert, block._is_expert_parallel = 4, first_expert, True
    generator = torch.Generator().manual_seed(5)
    x = torch.randn(11, config.hidden_size, generator=generator, requires_grad=True)
    ids = torch.randint(0, 8, (11, 2), generator=generator)
    weights = torch.rand(11, 2, generator=generator)
    config._experts_implementation = "eager"
    reference = block(x, ids, weights)
    # the reference, by hand: the full module with other ranks' routes weighted 0
    mine = (ids >= first_expert) & (ids < first_expert + 4)
    torch.testing.assert_close(reference, full(x, ids, weights * mine).float(), rtol=1e-5, atol=1e-6)
    config._experts_implementation = implementation
    output = block(x, ids, weights)
    torch.testing.assert_close(output.float(), reference, rtol=1e-5, atol=1e-6)
    (gradient,) = torch.autograd.grad(output.sum(), block.gate_up_proj)
    (expected,) = torch.autograd.grad(reference.sum(), block.gate_up_proj)
    torch.testing.assert_close(gradient, expected, rtol=1e-5, atol=1e-6)
