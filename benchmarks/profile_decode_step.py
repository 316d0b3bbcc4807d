"""Where the time of one decode step goes: torch.profiler over decode steps of the small DSpark benchmark target
(random weights, bf16), top operators by CPU time.

    python3 benchmarks/profile_decode_step.py [--queries 1] [--steps 10]
"""

import argparse
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from dspark import DEVICE, target_config  # noqa: E402

from transformers_inkling2 import Inkling2Cache, Inkling2ForCausalLM  # noqa: E402


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--queries", type=int, default=1)
    parser.add_argument("--steps", type=int, default=10)
    args = parser.parse_args()
    model = Inkling2ForCausalLM(target_config(6307)).to(DEVICE, torch.bfloat16).eval()
    prompt = torch.randint(0, 6307, (1, 64), device=DEVICE)
    cache = Inkling2Cache(model.config)
    tokens = prompt[:, -args.queries :]
    with torch.no_grad():
        model(input_ids=prompt, past_key_values=cache, use_cache=True)
        for _ in range(3):
            model(input_ids=tokens, past_key_values=cache, use_cache=True)
            cache.crop(-args.queries)
        activities = [torch.profiler.ProfilerActivity.CPU, torch.profiler.ProfilerActivity.CUDA]
        with torch.profiler.profile(activities=activities) as profile:
            for _ in range(args.steps):
                model(input_ids=tokens, past_key_values=cache, use_cache=True)
                cache.crop(-args.queries)
            torch.cuda.synchronize()
    print(profile.key_averages().table(sort_by="cpu_time_total", row_limit=25, max_name_column_width=60))


if __name__ == "__main__":
    main()
