"""Where the time of one decode step goes: torch.profiler over eager decode steps, top operators.

By default the small DSpark benchmark target (random weights, bf16) with the growing `Inkling2Cache`, sorted by
host time (what an eager step waits on). `--full-width` profiles the 6-layer full-width slice of
`benchmarks/decode.py` instead and `--static` the static cache's step (the one CUDA graphs replay), where the GPU
time is what remains: sort with `--sort cuda`. The last line gives the GPU time and kernel launches per step.

    python3 benchmarks/profile_decode_step.py [--queries 1] [--steps 10] [--full-width] [--static] [--sort cuda]
"""

import argparse
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from attention import build_models  # noqa: E402
from dspark import DEVICE, target_config  # noqa: E402

from transformers_inkling2 import Inkling2Cache, Inkling2ForCausalLM, Inkling2StaticCache  # noqa: E402


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--queries", type=int, default=1)
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--full-width", action="store_true", help="the 6-layer slice, hidden 4608, 16 BF16 experts")
    parser.add_argument("--static", action="store_true", help="Inkling2StaticCache instead of Inkling2Cache")
    parser.add_argument("--sort", choices=("cpu", "cuda"), default="cpu")
    args = parser.parse_args()
    if args.full_width:
        model = build_models(16, with_oracle=False)[0]
    else:
        model = Inkling2ForCausalLM(target_config(6307)).to(DEVICE, torch.bfloat16).eval()
    prompt = torch.randint(0, 6307, (1, 64), device=DEVICE)
    cache = Inkling2StaticCache(model.config, 256) if args.static else Inkling2Cache(model.config)
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
    events = profile.key_averages()
    print(events.table(sort_by=f"{args.sort}_time_total", row_limit=30, max_name_column_width=70))
    kernels = [e for e in profile.events() if e.device_type == torch.autograd.DeviceType.CUDA]
    gpu_ms = sum(e.device_time for e in kernels) / 1e3 / args.steps  # device_time is in microseconds
    print(f"per step: GPU time {gpu_ms:.3f} ms over {len(kernels) / args.steps:.0f} kernels")


if __name__ == "__main__":
    main()
