"""Shared fixtures: tiny configs, our model and transformers' built-in `inkling2` (the oracle) on equal weights."""

import importlib.util
import json
import os
import subprocess
import sys

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


# Runs Triton kernels on CPU tensors under Triton's interpreter, in a subprocess (TRITON_INTERPRET is read when
# triton is imported). The prelude works around numpy >= 2.4 refusing int() of a 1-element 1-d array, which
# triton 3.6's interpreter does for `range(..)` bounds held in tensors. CI installs triton 3.6.0 (`.ci/run`).
_INTERPRETER_PRELUDE = r"""
import os
os.environ["TRITON_INTERPRET"] = "1"
from triton.runtime import interpreter as _interp

_original_patch = getattr(_interp, "_patch_lang_tensor", None)  # (other triton versions need no patch)


def _patch_lang_tensor(tensor, scope):
    _original_patch(tensor, scope)
    scope.set_attr(tensor, "__index__", lambda self: int(self.handle.data.reshape(-1)[0]))


if _original_patch is not None:
    _interp._patch_lang_tensor = _patch_lang_tensor
"""
needs_triton = pytest.mark.skipif(importlib.util.find_spec("triton") is None, reason="triton is not installed")


def run_under_triton_interpreter(script: str, *args: str) -> dict:
    """Runs `script` (which prints a JSON object as its last line) under the interpreter; returns that object."""
    env = dict(os.environ, TRITON_INTERPRET="1", PYTHONPATH=os.pathsep.join(p for p in sys.path if p))
    proc = subprocess.run(
        [sys.executable, "-c", _INTERPRETER_PRELUDE + script, *args], env=env, capture_output=True, text=True,
        timeout=300,
    )
    assert proc.returncode == 0, proc.stderr[-4000:]
    return json.loads(proc.stdout.strip().splitlines()[-1])


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
