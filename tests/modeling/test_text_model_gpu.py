"""On a CUDA GPU: the model gives the CPU's logits and its cached generation equals recomputation (`-m gpu`)."""

import pytest
import torch
from inkling2_helpers import (
    build_pair,
    greedy_by_recomputation,
    greedy_generate,
    left_padded_batch,
    positions_from_mask,
)

pytestmark = pytest.mark.gpu


def test_text_model_on_gpu_matches_cpu_and_its_cached_generation_equals_recomputation():
    ours, _ = build_pair(seed=11)
    input_ids, attention_mask = left_padded_batch(seed=11)
    inputs = dict(attention_mask=attention_mask, position_ids=positions_from_mask(attention_mask), use_cache=False)
    with torch.no_grad():
        cpu_logits = ours(input_ids, **inputs).logits
        gpu = ours.to("cuda")
        gpu_logits = gpu(input_ids.cuda(), **{k: v.cuda() if torch.is_tensor(v) else v for k, v in inputs.items()}).logits
    real = attention_mask.bool()
    assert (gpu_logits.cpu() - cpu_logits)[real].abs().max() <= 1e-3  # TF32-free fp32 on both; reductions differ
    input_ids, attention_mask = input_ids.cuda(), attention_mask.cuda()
    generated = greedy_generate(gpu, input_ids, attention_mask, new_tokens=8)
    assert torch.equal(generated, greedy_by_recomputation(gpu, input_ids, attention_mask, 8))


def test_bf16_generation_on_gpu_runs_with_the_cache():
    ours, _ = build_pair(seed=12, dtype=torch.bfloat16)
    ours = ours.to("cuda")
    input_ids, attention_mask = left_padded_batch(seed=12)
    generated = ours.generate(
        input_ids.cuda(), attention_mask=attention_mask.cuda(), max_new_tokens=8, do_sample=False, pad_token_id=0
    )
    assert generated.shape == (2, 29)
