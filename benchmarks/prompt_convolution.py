"""A prompt's short convolution on one GPU: the Triton kernel against the `torch.compile`d sum it replaced and the
`F.conv1d` reference (issue #27).

1. Steady state, batch 1, bf16 activations, 4,608 channels, k = 4, at 8k, 32k and 131k tokens: one
   `Inkling2ShortConvolution` forward (the context join included, as the model runs it) with the prompt
   convolution hook set to the kernel, to `torch.compile(short_convolution_sum, dynamic=True)` (what the package ran
   before) and to nothing (the module's `F.conv1d` path); and the kernel alone on a built context, with GB/s = bytes
   of context, x and output moved once / time.
2. The first call in a fresh process (8k tokens), which is what a cold start pays: the kernel with an empty Triton
   cache (compiles) and with the cache the first run left (loads the binary); the compiled sum with empty and with
   warm Inductor caches (dynamo traces either way).

    python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .whl/*.whl
    export PYTHONPATH=$PWD/src:/tmp/site
    python3 benchmarks/prompt_convolution.py [--out DIR]

Prints markdown tables and writes `prompt_convolution.md` (+ `.json`) under --out (default $OUT, else ./).
"""

from __future__ import annotations

import argparse
import json
import math
import os
import subprocess
import sys
import tempfile
import time
from contextlib import contextmanager
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from attention import cuda_ms, environment, fmt, free_memory, guarded, markdown_table, write_report  # noqa: E402

from transformers_inkling2.backends.convolution import fused_prompt_convolution, short_convolution_sum  # noqa: E402
from transformers_inkling2.cache.common import join_convolution_context  # noqa: E402
from transformers_inkling2.modeling.interfaces import KERNELS  # noqa: E402
from transformers_inkling2.modeling.modeling_inkling2_text import Inkling2ShortConvolution  # noqa: E402

CHANNELS, KERNEL_SIZE = 4608, 4
LENGTHS = (8192, 32768, 131072)
FIRST_CALL_LENGTH = 8192


def convolution_inputs(length: int, dtype=torch.bfloat16):
    """(module, x [1, T, C], context [1, C, T + k - 1] time-major as the model builds it, weight [C, k]), random."""
    generator = torch.Generator(device="cuda").manual_seed(length)
    module = Inkling2ShortConvolution(CHANNELS, KERNEL_SIZE, layer_idx=0, conv_idx=0).cuda().requires_grad_(False)
    torch.nn.init.normal_(module.conv1d.weight, std=0.5, generator=generator)
    x = torch.randn(1, length, CHANNELS, device="cuda", dtype=dtype, generator=generator)
    context = join_convolution_context(torch.zeros(1, CHANNELS, KERNEL_SIZE - 1, device="cuda"), x.float().mT)
    return module, x, context, module.conv1d.weight.squeeze(1)


def compiled_sum():
    """What `backends/convolution.py` ran before the kernel."""
    return torch.compile(short_convolution_sum, dynamic=True, fullgraph=True)


def hooks() -> dict:
    """The prompt convolution hook of each method (None: the module computes `F.conv1d` itself)."""
    compiled = compiled_sum()

    def through_compiled(context, x, weight, divisor):
        return compiled(context, x, weight.squeeze(1), divisor)

    return {"Triton kernel": fused_prompt_convolution, "torch.compile (before)": through_compiled,
            "F.conv1d reference": lambda *args: None}


@contextmanager
def prompt_convolution_hook(hook):
    KERNELS.register("prompt_convolution", hook)
    try:
        yield
    finally:
        KERNELS.register("prompt_convolution", fused_prompt_convolution)


def kernel_alone(context, x, weight):
    from transformers_inkling2.backends.convolution_kernel import short_convolution

    return short_convolution(context, x, weight, math.sqrt(KERNEL_SIZE + 1))


def steady_state() -> list[dict]:
    rows, methods = [], hooks()
    for length in LENGTHS:
        module, x, context, weight = convolution_inputs(length)
        for method, hook in methods.items():
            with prompt_convolution_hook(hook), torch.no_grad():
                ms = guarded(lambda: cuda_ms(lambda: module(x), warmup=2, repeats=10))
            rows.append(dict(tokens=length, method=f"module forward, {method}", ms=ms))
        moved = context.numel() * 4 + 2 * x.numel() * x.element_size()
        ms = guarded(lambda: cuda_ms(lambda: kernel_alone(context, x, weight), warmup=2, repeats=10))
        gbps = moved / ms / 1e6 if isinstance(ms, float) else None
        rows.append(dict(tokens=length, method="Triton kernel alone (built context)", ms=ms, gbps=gbps))
        del module, x, context, weight
        free_memory()
    return rows


def first_call(method: str) -> dict:
    """In this (fresh) process: ms of the first and the second call of `method` at FIRST_CALL_LENGTH tokens."""
    _, x, context, weight = convolution_inputs(FIRST_CALL_LENGTH)
    compiled = compiled_sum()
    run = (lambda: kernel_alone(context, x, weight)) if method == "kernel" else (
        lambda: compiled(context, x, weight, math.sqrt(KERNEL_SIZE + 1)))
    times = []
    for _ in range(2):
        torch.cuda.synchronize()
        start = time.perf_counter()
        run()
        torch.cuda.synchronize()
        times.append((time.perf_counter() - start) * 1e3)
    return dict(first_ms=times[0], second_ms=times[1])


def first_calls() -> list[dict]:
    """Each method in two fresh processes sharing Triton's and Inductor's on-disk caches: the first finds them empty,
    the second warm."""
    rows = []
    for method in ("kernel", "compiled"):
        with tempfile.TemporaryDirectory() as cache:
            for state in ("empty", "warm"):
                env = dict(os.environ, TRITON_CACHE_DIR=f"{cache}/triton", TORCHINDUCTOR_CACHE_DIR=f"{cache}/inductor")
                command = [sys.executable, __file__, "--first-call", method]
                started = time.perf_counter()
                done = subprocess.run(command, env=env, capture_output=True, text=True, timeout=600)
                process_s = time.perf_counter() - started
                if done.returncode:
                    rows.append(dict(method=method, cache=state, error=done.stderr[-400:]))
                    continue
                result = json.loads(done.stdout.strip().splitlines()[-1])
                rows.append(dict(method=method, cache=state, process_s=process_s, **result))
    return rows


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", default=os.environ.get("OUT", "."))
    parser.add_argument("--first-call", choices=("kernel", "compiled"), help=argparse.SUPPRESS)  # the child's part
    args = parser.parse_args()
    if not torch.cuda.is_available():
        sys.exit("benchmarks/prompt_convolution.py needs a CUDA GPU")
    if args.first_call:
        print(json.dumps(first_call(args.first_call)))
        return
    cold = first_calls()  # before this process compiles anything
    steady = steady_state()
    report = [
        f"# Prompt short convolution\n\n{environment()}; command: `python3 benchmarks/prompt_convolution.py`\n",
        f"## Steady state (batch 1, bf16, {CHANNELS} channels, k = {KERNEL_SIZE}; median of 10)\n",
        markdown_table(["tokens", "method", "ms", "GB/s"],
                       [[r["tokens"], r["method"], fmt(r["ms"], ".3f"), fmt(r.get("gbps"), ".0f")] for r in steady]),
        f"\n## First call in a fresh process ({FIRST_CALL_LENGTH} tokens)\n",
        markdown_table(["method", "cache", "first call ms", "second call ms", "whole process s"],
                       [[r["method"], r["cache"], fmt(r.get("first_ms"), ".1f"), fmt(r.get("second_ms"), ".3f"),
                         fmt(r.get("process_s"), ".1f")] if "error" not in r else
                        [r["method"], r["cache"], r["error"], "-", "-"] for r in cold]),
    ]
    write_report(args.out, "prompt_convolution", "\n".join(report), dict(steady=steady, first_call=cold))


if __name__ == "__main__":
    main()
