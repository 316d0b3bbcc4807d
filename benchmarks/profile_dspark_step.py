"""Where a DSpark step's time goes, on one GPU: the `benchmarks/dspark.py` target shape with random weights (its
drafter accepts about nothing, so every step is a full draft + verify + commit), bf16, static cache (CUDA graphs).

Prints plain generate() ms per token and DSpark ms per step, then the same DSpark generate() with a CUDA synchronize
around each phase of a step (`draft`, `target` = the verification pass, `commit`, and the whole `step`), then a
`torch.profiler` table of one more DSpark generate() (a Chrome trace goes to $OUT/dspark_trace.json).

    PYTHONPATH=$PWD/src:/tmp/site python3 benchmarks/profile_dspark_step.py
"""

import collections
import functools
import os
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from dspark import target_config  # noqa: E402

from transformers_inkling2 import Inkling2ForCausalLM  # noqa: E402
from transformers_inkling2.dspark.training import attach_new_drafter, default_dspark_config  # noqa: E402
from transformers_inkling2.generation import dspark as generation_dspark  # noqa: E402

VOCAB = 6307
PHASES = ("draft", "target", "commit", "step")


def generate(model, prompt, dspark: bool, new_tokens: int = 128):
    torch.cuda.synchronize()
    start = time.perf_counter()
    out = model.generate(prompt, attention_mask=torch.ones_like(prompt), max_new_tokens=new_tokens, do_sample=False,
                         pad_token_id=0, dspark=dspark, cache_implementation="static", return_dict_in_generate=True,
                         top_k=None, top_p=None, temperature=None)  # fmt: skip
    torch.cuda.synchronize()
    return out, time.perf_counter() - start


def synced_phases(model, prompt) -> None:
    """One DSpark generate() with each phase of `DSparkDecoder` timed between CUDA synchronizations."""
    seconds = collections.defaultdict(float)
    originals = {name: getattr(generation_dspark.DSparkDecoder, name) for name in PHASES}

    def timed(name, method):
        @functools.wraps(method)
        def run(*args, **kwargs):
            torch.cuda.synchronize()
            start = time.perf_counter()
            result = method(*args, **kwargs)
            torch.cuda.synchronize()
            seconds[name] += time.perf_counter() - start
            return result

        return run

    for name, method in originals.items():
        setattr(generation_dspark.DSparkDecoder, name, timed(name, method))
    try:
        out, total = generate(model, prompt, dspark=True)
    finally:
        for name, method in originals.items():
            setattr(generation_dspark.DSparkDecoder, name, method)
    steps = out.num_steps
    phases = {name: round(1000 * value / steps, 3) for name, value in seconds.items()}
    print(f"synced phases, ms per step: {phases}, whole generate() {1000 * total / steps:.3f}", flush=True)


def main() -> None:
    if not torch.cuda.is_available():
        sys.exit("benchmarks/profile_dspark_step.py needs a CUDA GPU")
    torch.manual_seed(0)
    config = target_config(VOCAB)
    model = Inkling2ForCausalLM(config).cuda().to(torch.bfloat16).eval()
    model.set_experts_implementation("grouped_mm")
    attach_new_drafter(model, default_dspark_config(config, mask_token_id=VOCAB)).cuda().to(torch.bfloat16)
    prompt = torch.randint(0, VOCAB, (1, 64), device="cuda")
    for _ in range(2):  # static caches and their graphs, then reused
        generate(model, prompt, dspark=False)
        generate(model, prompt, dspark=True)
    _, plain = generate(model, prompt, dspark=False)
    out, drafted = generate(model, prompt, dspark=True)
    print(f"plain {1000 * plain / 128:.2f} ms/token; DSpark {1000 * drafted / out.num_steps:.2f} ms/step over "
          f"{out.num_steps} steps, {out.mean_accepted_length:.2f} accepted", flush=True)  # fmt: skip
    synced_phases(model, prompt)
    activities = [torch.profiler.ProfilerActivity.CPU, torch.profiler.ProfilerActivity.CUDA]
    with torch.profiler.profile(activities=activities) as profile:
        generate(model, prompt, dspark=True, new_tokens=64)
    print(profile.key_averages().table(sort_by="cpu_time_total", row_limit=40, max_name_column_width=70))
    profile.export_chrome_trace(str(Path(os.environ.get("OUT", "."), "dspark_trace.json")))


if __name__ == "__main__":
    main()
