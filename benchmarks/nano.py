"""Inkling-2-Nano against its targets (docs/nano.md), on the machine at hand: held-out scene and tool accuracy, DSpark's
accepted length at temperature 0 and 1, and the README's main command timed from start to its printed answer.

    python benchmarks/nano.py [--count 50] [--runs 3]
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import time

import torch

from transformers_inkling2.nano import load_nano
from transformers_inkling2.nano.evaluation import dspark_accepted_length, scene_accuracy, tool_accuracy


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


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--count", type=int, default=50, help="held-out scenes and tool questions")
    parser.add_argument("--runs", type=int, default=5, help="timed runs of the main command (seeds 0, 1, ...)")
    args = parser.parse_args()
    torch.manual_seed(0)
    model, processor = load_nano()
    scenes, tools = scene_accuracy(model, processor, args.count), tool_accuracy(model, processor, args.count)
    t0, t1 = dspark_accepted_length(model, processor, 0.0), dspark_accepted_length(model, processor, 1.0)
    del model  # the timed runs load their own
    times = [main_job_seconds(seed) for seed in range(args.runs)]
    print(f"| held-out scenes right | {scenes.right}/{scenes.total} ({scenes.accuracy:.0%}) | target 90% |")
    print(f"| held-out tool questions right | {tools.right}/{tools.total} ({tools.accuracy:.0%}) | target 90% |")
    print(f"| DSpark accepted length, T=0 / T=1 | {t0:.2f} / {t1:.2f} | target 4 / 3 |")
    for seed, (reply_s, answer_s, answer) in enumerate(times):
        print(f"| `inkling2 --seed {seed}`: first reply token / answer printed | {reply_s:.2f} s / {answer_s:.2f} s | "
              f"target 5 s | {answer} |")  # fmt: skip
    ordered = sorted(times, key=lambda t: t[1])
    print(f"| `inkling2`, the median run (by answer time) of {len(times)} | {ordered[len(times) // 2][0]:.2f} s / {ordered[len(times) // 2][1]:.2f} s "
          f"| target 5 s |")  # fmt: skip


if __name__ == "__main__":
    main()
