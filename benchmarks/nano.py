"""Inkling-2-Nano against its targets (docs/nano.md), on the machine at hand: held-out scene and tool accuracy, DSpark's
accepted length at temperature 0 and 1, and the README's main command timed from start to its printed answer.

    python benchmarks/nano.py [--count 50] [--runs 3]
"""

from __future__ import annotations

import argparse
import subprocess
import sys
import time

import torch

from transformers_inkling2.nano import load_nano
from transformers_inkling2.nano.evaluation import dspark_accepted_length, scene_accuracy, tool_accuracy


def main_job_seconds(seed: int) -> tuple[float, float, str]:
    """(seconds to the first reply text, seconds to the printed answer, the answer) of `inkling2 --seed SEED`."""
    start = time.perf_counter()
    process = subprocess.Popen([sys.executable, "-m", "transformers_inkling2", "--seed", str(seed)],
                               stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True)  # fmt: skip
    first_reply = answer_at = None
    answer = ""
    for line in process.stdout:
        if line.startswith("[reply]") and first_reply is None:
            first_reply = time.perf_counter() - start
        if line.startswith("[answer]"):
            answer_at, answer = time.perf_counter() - start, line.removeprefix("[answer] ").strip()
    process.wait()
    return first_reply, answer_at, answer


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--count", type=int, default=50, help="held-out scenes and tool questions")
    parser.add_argument("--runs", type=int, default=3, help="timed runs of the main command")
    args = parser.parse_args()
    torch.manual_seed(0)
    model, processor = load_nano()
    scenes, tools = scene_accuracy(model, processor, args.count), tool_accuracy(model, processor, args.count)
    t0, t1 = dspark_accepted_length(model, processor, 0.0), dspark_accepted_length(model, processor, 1.0)
    times = [main_job_seconds(seed) for seed in range(args.runs)]
    print(f"| held-out scenes right | {scenes.right}/{scenes.total} ({scenes.accuracy:.0%}) | target 90% |")
    print(f"| held-out tool questions right | {tools.right}/{tools.total} ({tools.accuracy:.0%}) | target 90% |")
    print(f"| DSpark accepted length, T=0 / T=1 | {t0:.2f} / {t1:.2f} | target 4 / 3 |")
    for seed, (reply_s, answer_s, answer) in enumerate(times):
        print(f"| `inkling2 --seed {seed}`: reply starts / answer printed | {reply_s:.2f} s / {answer_s:.2f} s | "
              f"target 5 s | {answer} |")  # fmt: skip


if __name__ == "__main__":
    main()
