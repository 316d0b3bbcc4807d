"""Run by `test_fused_step_parallel.py` under `torchrun --nproc_per_node 2` (gloo, CPU) with `TRITON_INTERPRET=1`:
the fused decode attention step (`backends/attention/step.py`) and the fused key/value step
(`backends/key_value_step.py`) on each rank's block of heads, and the fused attention-residual mixes
(`backends/residual_mix.py`) on the replicated stream, against the same rank's steps without them and against the
single-process model.

Usage: TRITON_INTERPRET=1 torchrun --nproc_per_node 2 tests/parallel/fused_step_worker.py CHECKPOINT REPORT.json
Every rank loads the checkpoint split over the ranks (`tp_plan="auto"`) and runs a prefill and decode / verification
steps over the static cache, with `INKLING2_FUSED_ATTENTION_STEP`, `INKLING2_FUSED_KEY_VALUE_STEP` and
`INKLING2_FUSED_RESIDUAL_MIX` on and off;
rank 0 also runs the unsplit model.
Rank 0 writes every rank's report; the test reads it.
"""

import argparse
import os
from pathlib import Path

import torch
import torch.distributed as dist
from rank_report import COLLECTIVE_TIMEOUT, write_every_ranks_report

from transformers_inkling2 import Inkling2ForCausalLM, Inkling2StaticCache
from transformers_inkling2.backends import (
    convolution_kernel,
    key_value_kernel,
    key_value_step,
    residual_mix,
    residual_mix_kernel,
)
from transformers_inkling2.backends.attention import decode_kernel, step

STEP_TOKENS = (1, 3, 1, 8, 1)  # decode steps and verification steps


def step_logits(model) -> list[torch.Tensor]:
    """A left-padded prefill of two rows, then STEP_TOKENS, over the static cache: every forward's logits."""
    generator = torch.Generator().manual_seed(5)
    input_ids = torch.randint(0, 500, (2, 21), generator=generator)
    mask = torch.ones_like(input_ids)
    mask[1, :4] = 0
    cache = Inkling2StaticCache(model.config, max_cache_len=64)
    with torch.no_grad():
        logits = [model(input_ids, attention_mask=mask, past_key_values=cache).logits]
        for size in STEP_TOKENS:
            tokens = torch.randint(0, 500, (2, size), generator=generator)
            mask = torch.cat([mask, torch.ones(2, size, dtype=mask.dtype)], dim=1)
            positions = (mask.cumsum(-1) - 1).clamp(min=0)[:, -size:]
            logits.append(model(tokens, attention_mask=mask, position_ids=positions, past_key_values=cache).logits)
    return logits


def largest_difference(actual: list[torch.Tensor], expected: list[torch.Tensor]) -> float:
    return max(((a - e).norm() / e.norm()).item() for a, e in zip(actual, expected, strict=True))


def counting_calls(module, name: str) -> list:
    """Wraps `module.name` so that every call appends to the returned list."""
    calls, original = [], getattr(module, name)
    setattr(module, name, lambda *args, **kwargs: calls.append(1) or original(*args, **kwargs))
    return calls


def main(checkpoint: Path, report_file: Path) -> None:
    torch.set_num_threads(1)
    dist.init_process_group("gloo", timeout=COLLECTIVE_TIMEOUT)
    split = Inkling2ForCausalLM.from_pretrained(checkpoint, tp_plan="auto")
    attention_calls = counting_calls(decode_kernel, "decode_attention_step")
    key_value_calls = counting_calls(key_value_kernel, "key_value_step")
    mix_calls = [counting_calls(residual_mix_kernel, name) for name in ("residual_mix", "residual_mix_after_sublayer")]
    mix_calls.append(counting_calls(convolution_kernel, "step_convolution"))  # the layers' ends, on CPU
    switches = (step.ENV, key_value_step.ENV, residual_mix.ENV)
    os.environ.update(dict.fromkeys(switches, "1"))
    fused = step_logits(split)
    fused_calls = {"attention": len(attention_calls), "key_value": len(key_value_calls),
                   "mix": [len(calls) for calls in mix_calls]}  # fmt: skip
    os.environ.update(dict.fromkeys(switches, "0"))
    plain = step_logits(split)
    single = [step_logits(Inkling2ForCausalLM.from_pretrained(checkpoint)) if dist.get_rank() == 0 else None]
    dist.broadcast_object_list(single, src=0)
    report = {
        "world_size": dist.get_world_size(),
        "local_heads": split.model.layers[0].self_attn.q_l2_clip.scale.to_local().shape[0],
        "fused_calls": fused_calls["attention"],
        "key_value_calls": fused_calls["key_value"],
        "mix_calls": fused_calls["mix"],
        "to_plain_split": largest_difference(fused, plain),
        "to_single_process": largest_difference(fused, single[0]),
        "plain_split_to_single_process": largest_difference(plain, single[0]),
    }
    write_every_ranks_report(report, report_file)


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("checkpoint", type=Path)
    parser.add_argument("report", type=Path)
    arguments = parser.parse_args()
    main(arguments.checkpoint, arguments.report)
