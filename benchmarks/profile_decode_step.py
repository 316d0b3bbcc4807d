"""Where the time of one decode step goes: torch.profiler over eager decode steps, top operators.

By default the small DSpark benchmark target (random weights, bf16) with the growing `Inkling2Cache`, sorted by
host time (what an eager step waits on). `--full-width` profiles the 6-layer full-width slice of
`benchmarks/decode.py` instead and `--static` the static cache's step (the one CUDA graphs replay), where the GPU
time is what remains: sort with `--sort cuda`. `--graphs` profiles the replays themselves (`Inkling2DecodeGraphs`,
with `--compile` the `torch.compile`d step inside them: what `generate(..., cache_implementation="static",
compile_config=CompileConfig())` runs). The last line gives the GPU time and kernels per step.

    python3 benchmarks/profile_decode_step.py [--queries 1] [--steps 10] [--full-width] [--static] [--graphs]
        [--compile] [--sort cuda]

`--prefill TOKENS` profiles one prefill forward of the full-width slice instead (a random prompt of that many
tokens, no cache given), sorted by GPU time.
"""

import argparse
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from attention import build_models  # noqa: E402
from dspark import DEVICE, target_config  # noqa: E402

from transformers_inkling2 import (  # noqa: E402
    Inkling2Cache,
    Inkling2DecodeGraphs,
    Inkling2ForCausalLM,
    Inkling2StaticCache,
)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--queries", type=int, default=1)
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--full-width", action="store_true", help="the 6-layer slice, hidden 4608, 16 BF16 experts")
    parser.add_argument("--static", action="store_true", help="Inkling2StaticCache instead of Inkling2Cache")
    parser.add_argument("--graphs", action="store_true", help="profile CUDA graph replays (implies --static)")
    parser.add_argument("--compile", action="store_true", help="with --graphs: the torch.compile'd step")
    parser.add_argument("--sort", choices=("cpu", "cuda"), default="cpu")
    parser.add_argument("--prefill", type=int, default=0, help="profile a prefill of this many tokens (full width)")
    args = parser.parse_args()
    args.static = args.static or args.graphs
    if args.prefill:
        return profile_prefill(build_models(16, with_oracle=False)[0], args.prefill)
    if args.full_width:
        model = build_models(16, with_oracle=False)[0]
    else:
        model = Inkling2ForCausalLM(target_config(6307)).to(DEVICE, torch.bfloat16).eval()
    prompt = torch.randint(0, 6307, (1, 64), device=DEVICE)
    cache = Inkling2StaticCache(model.config, 256) if args.static else Inkling2Cache(model.config)
    tokens = prompt[:, -args.queries :]
    step = model
    if args.graphs:
        from transformers import CompileConfig

        step = Inkling2DecodeGraphs(model, compile_config=CompileConfig() if args.compile else None)
    with torch.no_grad():
        model(input_ids=prompt, past_key_values=cache, use_cache=True)
        for _ in range(3):
            step(input_ids=tokens, past_key_values=cache, use_cache=True)
            cache.crop(-args.queries)
        activities = [torch.profiler.ProfilerActivity.CPU, torch.profiler.ProfilerActivity.CUDA]
        with torch.profiler.profile(activities=activities) as profile:
            for _ in range(args.steps):
                step(input_ids=tokens, past_key_values=cache, use_cache=True)
                cache.crop(-args.queries)
            torch.cuda.synchronize()
    report(profile, args.sort, "step", args.steps)


def profile_prefill(model, tokens: int) -> None:
    prompt = torch.randint(0, 8000, (1, tokens), device=DEVICE)
    with torch.no_grad():
        for _ in range(2):
            model.model(prompt, use_cache=True)
        torch.cuda.synchronize()
        activities = [torch.profiler.ProfilerActivity.CPU, torch.profiler.ProfilerActivity.CUDA]
        with torch.profiler.profile(activities=activities) as profile:
            model.model(prompt, use_cache=True)
            torch.cuda.synchronize()
    report(profile, "cuda", "prefill", 1)


def report(profile, sort: str, what: str, calls: int) -> None:
    """The top operators and the GPU time and kernels per call."""
    print(profile.key_averages().table(sort_by=f"{sort}_time_total", row_limit=40, max_name_column_width=70))
    kernels = [e for e in profile.events() if e.device_type == torch.autograd.DeviceType.CUDA]
    gpu_ms = sum(e.device_time for e in kernels) / 1e3 / calls  # device_time is in microseconds
    print(f"per {what}: GPU time {gpu_ms:.3f} ms over {len(kernels) / calls:.0f} kernels")


if __name__ == "__main__":
    main()
