"""Shared fixtures: tiny configs, our model and transformers' built-in `inkling2` (the oracle) on equal weights."""

import pytest
import torch

import transformers_inkling2  # noqa: F401  (registers our classes)
from transformers_inkling2.tiny import randomize_

# 12 layers: full attention at 5 and 11, attention-residual blocks opening at 0 and 6; short windows so that a
# 21-token prompt crosses both the sliding window (8) and the relative-bias extent (12); a log-scaling floor
# inside the prompt so that the full layers' scaling is exercised.
ORACLE_TEXT_CONFIG = dict(
    hidden_size=64,
    num_hidden_layers=12,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=16,
    swa_num_attention_heads=4,
    swa_num_key_value_heads=2,
    swa_head_dim=16,
    moe_intermediate_size=32,
    n_routed_experts=8,
    num_experts_per_tok=2,
    vocab_size=512,
    unpadded_vocab_size=500,
    sliding_window_size=8,
    rel_extent=12,
    d_rel=4,
    eos_token_id=None,
    log_scaling_n_floor=6,
)


def pytest_configure(config):
    config.addinivalue_line("markers", "gpu: needs a CUDA GPU (skipped elsewhere)")


def pytest_collection_modifyitems(config, items):
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA GPU")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


def build_pair(seed: int = 0, dtype=torch.float32, **overrides):
    """(ours, built-in) Inkling2ForCausalLM with identical random weights, in eval mode."""
    from transformers.models.inkling2 import configuration_inkling2 as builtin_config
    from transformers.models.inkling2 import modeling_inkling2 as builtin

    from transformers_inkling2 import Inkling2ForCausalLM, Inkling2TextConfig

    fields = {**ORACLE_TEXT_CONFIG, **overrides}
    ours = randomize_(Inkling2ForCausalLM(Inkling2TextConfig(**fields)), seed).eval()
    oracle = builtin.Inkling2ForCausalLM(builtin_config.Inkling2TextConfig(**fields)).eval()
    oracle.load_state_dict(ours.state_dict(), strict=True)
    return cast_keeping_fp32_modules(ours, dtype), cast_keeping_fp32_modules(oracle, dtype)


def cast_keeping_fp32_modules(model, dtype):
    """Casts like `from_pretrained(dtype=...)`: modules listed in `_keep_in_fp32_modules_strict` stay fp32."""
    keep = model._keep_in_fp32_modules_strict
    for name, tensor in [*model.named_parameters(), *model.named_buffers()]:
        if not any(pattern in name for pattern in keep):
            tensor.data = tensor.data.to(dtype)
    return model


def left_padded_batch(seed: int = 0, length: int = 21, pad: int = 5, vocab: int = 500):
    """Two rows; the second is left-padded by `pad` tokens."""
    generator = torch.Generator().manual_seed(seed)
    input_ids = torch.randint(0, vocab, (2, length), generator=generator)
    attention_mask = torch.ones_like(input_ids)
    attention_mask[1, :pad] = 0
    return input_ids, attention_mask


def positions_from_mask(attention_mask):
    """What generate() passes: positions count real tokens only."""
    return (attention_mask.cumsum(-1) - 1).clamp(min=0)


def greedy_by_recomputation(model, input_ids, attention_mask, new_tokens, **inputs):
    """Reference: every step runs the whole sequence again (images included), without a cache."""
    for _ in range(new_tokens):
        with torch.no_grad():
            logits = model(
                input_ids,
                attention_mask=attention_mask,
                position_ids=positions_from_mask(attention_mask),
                use_cache=False,
                **inputs,
            ).logits[:, -1]
        input_ids = torch.cat([input_ids, logits.argmax(-1, keepdim=True)], dim=1)
        attention_mask = torch.cat([attention_mask, torch.ones_like(attention_mask[:, :1])], dim=1)
    return input_ids


def greedy_generate(model, input_ids, attention_mask, new_tokens, **inputs):
    return model.generate(
        input_ids,
        attention_mask=attention_mask,
        max_new_tokens=new_tokens,
        do_sample=False,
        eos_token_id=None,
        pad_token_id=0,
        **inputs,
    )
