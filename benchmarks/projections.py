"""A decode step's attention projections on one GPU: cuBLAS (the reference path) against our GEMVs.

For the full-width attention (hidden 4,608; 48 q / 8 kv heads of 128, d_rel 16) and the TP4-shaped one (12 / 2
heads), bf16, at 1, 8 and 16 rows: the six input projections as the reference runs them (six `nn.Linear` calls)
and as `backends/projections.py` runs them (one grouped GEMV). Each variant is captured 20 times in one CUDA graph
and replayed, as a decode step's graph replays it, so that host launch costs drop out; time per call, and the
weights' bytes over that time as GB/s and as % of the GPU's copy bandwidth. With `--sweep` it first times every
tile of a grid per row bucket (the input projections of both shapes) and prints the fastest, the values for
`projection_kernel.CONFIGS`.

    python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .whl/*.whl
    export PYTHONPATH=$PWD/src:/tmp/site
    python3 benchmarks/projections.py [--sweep] [--out DIR]

Writes `projections.md` (+ `.json`) under --out (default $OUT, else ./).
"""

from __future__ import annotations

import argparse
import itertools
import os
import sys
from pathlib import Path

import torch
from torch import nn

sys.path.insert(0, str(Path(__file__).resolve().parent))
from attention import DEVICE, cuda_ms, environment, markdown_table, write_report  # noqa: E402
from decode import copy_bandwidth_gb_s  # noqa: E402

from transformers_inkling2.backends import projection_kernel  # noqa: E402
from transformers_inkling2.backends.projections import input_projections  # noqa: E402

HIDDEN, HEAD_DIM, D_REL = 4608, 128, 16
SHAPES = {"full width": (48, 8), "tp4": (12, 2)}
ROWS = (1, 8, 16)
CALLS_PER_GRAPH = 20
# (BLOCK_N, BLOCK_K, warps, stages) grid per row bucket
SWEEP = {16: ((16, 32, 64), (128, 256, 512), (4, 8), (3, 4))}


def attention_linears(heads: int, kv_heads: int, generator) -> list[nn.Linear]:
    """q, gate, relative, sink, k, v: bf16 on the GPU, random weights of the model's scale."""

    def linear(inputs: int, outputs: int) -> nn.Linear:
        module = nn.Linear(inputs, outputs, bias=False, device=DEVICE, dtype=torch.bfloat16).requires_grad_(False)
        module.weight.copy_(torch.randn(outputs, inputs, device=DEVICE, generator=generator) / inputs**0.5)
        return module

    widths = [heads * HEAD_DIM, heads * HEAD_DIM, heads * D_REL, heads, kv_heads * HEAD_DIM, kv_heads * HEAD_DIM]
    return [linear(HIDDEN, n) for n in widths]


def per_call_ms(fn) -> float:
    """ms of one call of fn, from a CUDA graph holding CALLS_PER_GRAPH calls."""
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        fn()
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for _ in range(CALLS_PER_GRAPH):
            fn()
    return cuda_ms(graph.replay, warmup=3, repeats=15) / CALLS_PER_GRAPH


def weight_bytes(modules) -> int:
    return sum(m.weight.numel() * m.weight.element_size() for m in modules)


def compare(bandwidth: float) -> list[dict]:
    rows_out = []
    generator = torch.Generator(device=DEVICE).manual_seed(0)
    for shape, (heads, kv_heads) in SHAPES.items():
        linears = attention_linears(heads, kv_heads, generator)
        for rows in ROWS:
            x = torch.randn(rows, 1, HIDDEN, device=DEVICE, generator=generator).to(torch.bfloat16)

            def reference():
                [module(x) for module in linears]

            def ours():
                assert input_projections([x] * 6, linears) is not None

            for name, fn in (("cuBLAS (reference)", reference), ("ours", ours)):
                ms = per_call_ms(fn)
                read = weight_bytes(linears)
                rows_out.append(dict(shape=shape, rows=rows, path=name, us=ms * 1000, gb_s=read / ms / 1e6,
                                     share=read / ms / 1e6 / bandwidth))  # fmt: skip
                print(rows_out[-1], flush=True)
    return rows_out


def sweep() -> dict:
    """{bucket: (best config, its summed us over the shapes and rows of that bucket)} for the input projections."""
    generator = torch.Generator(device=DEVICE).manual_seed(1)
    shapes = [attention_linears(heads, kv, generator) for heads, kv in SHAPES.values()]
    best = {}
    for bucket, rows_of_bucket in ((16, (1, 8)),):
        timings = {}
        for config in itertools.product(*SWEEP[bucket]):
            projection_kernel.CONFIGS[bucket] = config
            try:
                total = 0.0
                for linears in shapes:
                    for rows in rows_of_bucket:
                        x = torch.randn(rows, HIDDEN, device=DEVICE, generator=generator).to(torch.bfloat16)
                        total += per_call_ms(lambda: input_projections([x] * 6, linears)) * 1000
                timings[config] = total
            except Exception as error:  # noqa: BLE001  (a tile past shared memory: skipped)
                print(bucket, config, type(error).__name__, str(error)[:120], flush=True)
        ranked = sorted(timings.items(), key=lambda item: item[1])
        print(bucket, "fastest", ranked[:5], flush=True)
        best[bucket] = ranked[0]
    return best


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--sweep", action="store_true", help="time a grid of tiles first and use the fastest")
    parser.add_argument("--out", default=os.environ.get("OUT", "."))
    args = parser.parse_args()
    bandwidth = copy_bandwidth_gb_s()
    best = sweep() if args.sweep else {}
    for bucket, (config, _) in best.items():
        projection_kernel.CONFIGS[bucket] = config
    rows = compare(bandwidth)
    table = markdown_table(
        ["shape", "rows", "path", "us", "GB/s", "% of copy"],
        [[r["shape"], r["rows"], r["path"], f"{r['us']:.1f}", f"{r['gb_s']:.0f}", f"{100 * r['share']:.0f}"]
         for r in rows],
    )  # fmt: skip
    text = (f"# Attention projections of a decode step\n\n{environment()}; copy bandwidth {bandwidth:.0f} GB/s; "
            f"tiles (BLOCK_N, BLOCK_K, warps, stages) per row bucket: {projection_kernel.CONFIGS}"
            f"\n\n{table}")  # fmt: skip
    write_report(args.out, "projections", text, dict(rows=rows, sweep={k: v for k, v in best.items()},
                                                      configs=projection_kernel.CONFIGS))  # fmt: skip


if __name__ == "__main__":
    main()
