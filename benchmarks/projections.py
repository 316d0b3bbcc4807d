"""A decode step's attention projections on one GPU: cuBLAS (the reference path) against our GEMVs.

For the full-width attention (hidden 4,608; 48 q / 8 kv heads of 128, d_rel 16) and the TP4-shaped one (12 / 2
heads), bf16, at 1, 8 and 16 rows: the six input projections as the reference runs them (six `nn.Linear` calls)
and as `backends/projections.py` runs them (one grouped GEMV). Each variant is captured 20 times in one CUDA graph
and replayed, as a decode step's graph replays it, so that host launch costs drop out; time per call, and the
weights' bytes over that time as GB/s and as % of the GPU's copy bandwidth. With `--sweep` it first times every
tile of a grid (the input projections of both shapes at 1 and 8 rows) and uses the fastest, the value for
`projection_kernel.TILE`.

    python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .whl/*.whl
    export PYTHONPATH=$PWD/src:/tmp/site
    python3 benchmarks/projections.py [--sweep] [--out DIR]
    python3 benchmarks/projections.py --o-proj [--out DIR]

Writes `projections.md` (+ `.json`) under --out (default $OUT, else ./); with `--o-proj`, instead, the output
projection (one weight) through cuBLAS and through the grouped GEMV at several tiles, `o_proj.md` (+ `.json`).
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
from attention import DEVICE, environment, timing_table, write_report  # noqa: E402
from decode import copy_bandwidth_gb_s, graph_ms  # noqa: E402

from transformers_inkling2.backends import projection_kernel  # noqa: E402
from transformers_inkling2.backends.projections import input_projections  # noqa: E402

HIDDEN, HEAD_DIM, D_REL = 4608, 128, 16
SHAPES = {"full width": (48, 8), "tp4": (12, 2)}
ROWS = (1, 8, 16)
CALLS_PER_GRAPH = 20
SWEEP_ROWS = (1, 8)
# (BLOCK_N, BLOCK_K, warps, stages)
SWEEP = ((16, 32, 64), (128, 256, 512), (4, 8), (3, 4))


def attention_linears(heads: int, kv_heads: int, generator) -> list[nn.Linear]:
    """q, gate, relative, sink, k, v: bf16 on the GPU, random weights of the model's scale."""

    def linear(inputs: int, outputs: int) -> nn.Linear:
        module = nn.Linear(inputs, outputs, bias=False, device=DEVICE, dtype=torch.bfloat16).requires_grad_(False)
        module.weight.copy_(torch.randn(outputs, inputs, device=DEVICE, generator=generator) / inputs**0.5)
        return module

    widths = [heads * HEAD_DIM, heads * HEAD_DIM, heads * D_REL, heads, kv_heads * HEAD_DIM, kv_heads * HEAD_DIM]
    return [linear(HIDDEN, n) for n in widths]


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
                ms = graph_ms(fn, calls=CALLS_PER_GRAPH)
                read = weight_bytes(linears)
                share = read / ms / 1e6 / bandwidth
                rows_out.append(dict(shape=shape, rows=rows, path=name, us=ms * 1000, share=share))
                print(rows_out[-1], flush=True)
    return rows_out


def sweep() -> tuple[tuple, float]:
    """(the fastest tile, its us summed over both shapes at SWEEP_ROWS rows) for the input projections."""
    generator = torch.Generator(device=DEVICE).manual_seed(1)
    shapes = [attention_linears(heads, kv, generator) for heads, kv in SHAPES.values()]
    timings = {}
    for tile in itertools.product(*SWEEP):
        projection_kernel.TILE = tile
        try:
            total = 0.0
            for linears in shapes:
                for rows in SWEEP_ROWS:
                    x = torch.randn(rows, HIDDEN, device=DEVICE, generator=generator).to(torch.bfloat16)
                    total += graph_ms(lambda: input_projections([x] * 6, linears), calls=CALLS_PER_GRAPH) * 1000
            timings[tile] = total
        except Exception as error:  # noqa: BLE001  (a tile past shared memory: skipped)
            print(tile, type(error).__name__, str(error)[:120], flush=True)
    ranked = sorted(timings.items(), key=lambda item: item[1])
    print("fastest", ranked[:5], flush=True)
    return ranked[0]


O_PROJ_TILES = ((16, 128, 4, 3), (16, 256, 4, 3), (16, 128, 4, 4), (16, 512, 4, 2), (32, 128, 4, 3), (32, 256, 4, 3),
                (32, 256, 8, 3), (64, 128, 4, 3), (64, 256, 8, 3))


def o_proj(bandwidth: float) -> list[dict]:
    """The output projection ([4,608, heads x 128]) as cuBLAS runs it and as the grouped GEMV would, one weight,
    at each of O_PROJ_TILES: whether it should take the kernel too (so far cuBLAS's split-K GEMV wins)."""
    results, generator, tile = [], torch.Generator(device=DEVICE).manual_seed(2), projection_kernel.TILE
    for shape, (heads, _) in SHAPES.items():
        width = heads * HEAD_DIM
        weight = (torch.randn(HIDDEN, width, device=DEVICE, generator=generator) / width**0.5).to(torch.bfloat16)
        read = weight.numel() * weight.element_size()
        for rows in SWEEP_ROWS:
            x = torch.randn(rows, width, device=DEVICE, generator=generator).to(torch.bfloat16)
            variants = [("cuBLAS", tile, lambda: torch.nn.functional.linear(x, weight))]
            ours = lambda: projection_kernel.grouped_projections([x], [weight])  # noqa: E731
            variants += [(str(t), t, ours) for t in O_PROJ_TILES]
            for name, variant_tile, fn in variants:
                projection_kernel.TILE = variant_tile
                ms = graph_ms(fn, calls=CALLS_PER_GRAPH)
                share = read / ms / 1e6 / bandwidth
                results.append(dict(shape=shape, rows=rows, path=name, us=ms * 1000, share=share))
                print(results[-1], flush=True)
    projection_kernel.TILE = tile
    return results


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--sweep", action="store_true", help="time a grid of tiles first and use the fastest")
    parser.add_argument("--out", default=os.environ.get("OUT", "."))
    parser.add_argument("--o-proj", action="store_true", help="instead: the output projection, cuBLAS against "
                        "the grouped GEMV at several tiles")
    args = parser.parse_args()
    bandwidth = copy_bandwidth_gb_s()
    if args.o_proj:
        results = o_proj(bandwidth)
        text = f"# Output projection of a decode step\n\n{environment()}; copy bandwidth {bandwidth:.0f} GB/s\n\n"
        write_report(args.out, "o_proj", text + timing_table(results), dict(rows=results))
        return
    best = sweep() if args.sweep else None
    if best is not None:
        projection_kernel.TILE = best[0]
    rows = compare(bandwidth)
    text = (f"# Attention projections of a decode step\n\n{environment()}; copy bandwidth {bandwidth:.0f} GB/s; "
            f"tile (BLOCK_N, BLOCK_K, warps, stages) {projection_kernel.TILE}"
            f"\n\n{timing_table(rows)}")  # fmt: skip
    write_report(args.out, "projections", text, dict(rows=rows, sweep=best, tile=projection_kernel.TILE))


if __name__ == "__main__":
    main()
