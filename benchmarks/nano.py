"""Inkling-2-Nano against its targets (docs/nano.md), on the machine at hand: held-out scene and tool accuracy, DSpark's
accepted length at temperature 0 and 1 on held-out documentation and tool questions, and the README's main command
timed from start to its printed answer; then what explains the misses: the drafter's agreement with the model
teacher-forced and its acceptance per position while decoding, the time of a decode step (and with the experts
dequantized at every use, as without the small modules' cache), and the time to import transformers' modeling code.

    python benchmarks/nano.py [--count 50] [--runs 5]
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import time

import torch

from transformers_inkling2.dspark.training import random_anchors, teacher_forced_loss
from transformers_inkling2.nano import load_nano
from transformers_inkling2.nano.training import DRAFTER_KINDS
from transformers_inkling2.nano.data import ConversationDataset
from transformers_inkling2.nano.evaluation import (
    dspark_accepted_length,
    held_out_text_chats,
    prompts,
    scene_accuracy,
    tool_accuracy,
)
from transformers_inkling2.quantization import experts as experts_module


def main_job_seconds(seed: int) -> tuple[float, float, str]:
    """(seconds to the first reply text, seconds to the printed answer, the answer) of `inkling2 --seed SEED`, read
    as it prints (the reply streams within one line, so the output is read as it comes, not line by line)."""
    command = [sys.executable, "-c", "from transformers_inkling2_cli import main; main()", "--seed", str(seed)]
    start = time.perf_counter()
    process = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL,
                               env={**os.environ, "PYTHONUNBUFFERED": "1"})  # as `inkling2` runs in a terminal
    output, first_reply, answer_at = b"", None, None
    while chunk := os.read(process.stdout.fileno(), 4096):
        output += chunk
        if first_reply is None and b"[reply] <" in output:
            first_reply = time.perf_counter() - start
        if answer_at is None and b"[answer] " in output and output.endswith(b"\n"):
            answer_at = time.perf_counter() - start
    process.wait()
    return first_reply, answer_at, output.decode().split("[answer] ")[-1].strip()


@torch.no_grad()
def drafter_agreement(model, processor) -> tuple[list[float], list[float]]:
    """(per block position: how often the draft's argmax is the model's, teacher-forced on 4 windows of 512 tokens of
    text conversations; how often draft k was accepted, all before it too, greedy over 4 held-out replies)."""
    dataset = ConversationDataset(processor, "benchmark", 16, kinds=DRAFTER_KINDS)
    ids = torch.cat([dataset[i]["input_ids"] for i in range(16)])[:2048].view(4, 512)
    block = model.dspark.config.block_size
    anchors = random_anchors(512, block, 32, torch.Generator().manual_seed(0), "cpu")
    agreement = teacher_forced_loss(model, ids, anchors)["agreement"].tolist()
    chats, _ = held_out_text_chats("prose", 4)
    out = model.generate(**prompts(model, processor, chats), max_new_tokens=64, dspark=True,
                         return_dict_in_generate=True, do_sample=False)  # fmt: skip
    return agreement, out.position_acceptance.tolist()


@torch.no_grad()
def decode_ms_per_token(model, processor, tokens: int = 40) -> float:
    inputs = prompts(model, processor, [[{"role": "user", "content": "Tell me about The \"for\" statement."}]])
    model.generate(**inputs, max_new_tokens=4, do_sample=False)  # warm-up
    start = time.perf_counter()
    model.generate(**inputs, max_new_tokens=tokens, do_sample=False, eos_token_id=None)
    return (time.perf_counter() - start) / tokens * 1000


def import_seconds(module: str) -> float:
    start = time.perf_counter()
    subprocess.run([sys.executable, "-c", f"import {module}"], check=True)
    return time.perf_counter() - start


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--count", type=int, default=50, help="held-out scenes and tool questions")
    parser.add_argument("--runs", type=int, default=5, help="timed runs of the main command (seeds 0, 1, ...)")
    args = parser.parse_args()
    torch.manual_seed(0)
    model, processor = load_nano()
    scenes, tools = scene_accuracy(model, processor, args.count), tool_accuracy(model, processor, args.count)
    accepted = {kind: [dspark_accepted_length(model, processor, t, kind) for t in (0.0, 1.0)]
                for kind in ("prose", "tool")}  # fmt: skip
    agreement, acceptance = drafter_agreement(model, processor)
    step_ms = decode_ms_per_token(model, processor)
    kept_experts = experts_module.DEQUANTIZED_CACHE_BYTES
    experts_module.DEQUANTIZED_CACHE_BYTES = 0  # every use dequantizes its expert again, as before that cache
    uncached_step_ms = decode_ms_per_token(model, processor)
    experts_module.DEQUANTIZED_CACHE_BYTES = kept_experts
    del model  # the timed runs load their own
    imports = min(import_seconds("transformers.modeling_utils") for _ in range(3))
    times = [main_job_seconds(seed) for seed in range(args.runs)]
    print(f"| held-out scenes right | {scenes.right}/{scenes.total} ({scenes.accuracy:.0%}) | target 90% |")
    print(f"| held-out tool questions right | {tools.right}/{tools.total} ({tools.accuracy:.0%}) | target 90% |")
    for kind, (t0, t1) in accepted.items():
        print(f"| DSpark accepted length, held-out {kind} questions, T=0 / T=1 | {t0:.2f} / {t1:.2f} | target 4 / 3 |")
    for seed, (reply_s, answer_s, answer) in enumerate(times):
        print(f"| `inkling2 --seed {seed}`: first reply token / answer printed | {reply_s:.2f} s / {answer_s:.2f} s | "
              f"target 5 s | {answer} |")  # fmt: skip
    ordered = sorted(times, key=lambda t: t[1])
    print(f"| `inkling2`, the median run (by answer time) of {len(times)} | {ordered[len(times) // 2][0]:.2f} s / {ordered[len(times) // 2][1]:.2f} s "
          f"| target 5 s |")  # fmt: skip
    print(f"| drafter agreement per position, teacher-forced | {' '.join(f'{a:.2f}' for a in agreement)} |")
    print(f"| draft k accepted (with all before it), greedy | {' '.join(f'{a:.2f}' for a in acceptance)} |")
    print(f"| decode, one token (greedy, 40 tokens, fp32) | {step_ms:.1f} ms |")
    print(f"| the same, experts dequantized at every use (`DEQUANTIZED_CACHE_BYTES = 0`) | {uncached_step_ms:.1f} ms |")
    print(f"| `import transformers.modeling_utils`, fastest of 3 | {imports:.2f} s |")


if __name__ == "__main__":
    main()
