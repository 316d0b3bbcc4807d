"""A decode step's attention projections on one GPU: cuBLAS (the reference path) against our GEMVs.

For the full-width attention (hidden 4,608; 48 q / 8 kv heads of 128, d_rel 16) and the TP4-shaped one (12 / 2
heads), bf16, at 1, 8 and 16 rows: the six input projections as the reference runs them (six `nn.Linear` calls)
and as `backends/projections.py` runs them (one grouped GEMV). Each variant is captured in one CUDA graph, several
calls in a row, and replayed, as a decode step's graph replays it, so that host launch costs drop out; the calls
read copies of the weights in turn, enough copies that the L2 cannot hold them (a decode step reads every weight
once: from memory). Time per call, and the weights' bytes over that time as GB/s and as % of the GPU's copy
bandwidth. With `--sweep` it first times every tile of a grid (the input projections of each shape at 1 and 8
rows) and uses the fastest per shape: the values for `projection_kernel.TILE` (full width) and `DEEP_TILE`
(TP4-shaped, a grid of at most one program per SM).

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
SWEEP_ROWS = (1, 8)
# (BLOCK_N, BLOCK_K, warps, stages)
SWEEP = ((16, 32, 64), (128, 256), (4, 8), (3, 4, 6))


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


def copies_past_l2(read: int) -> int:
    """How many copies of `read` bytes of weights together hold four times the GPU's L2 (at least two)."""
    return max(2, -(-4 * torch.cuda.get_device_properties(0).L2_cache_size // read))


def cold_attention_linears(heads: int, kv_heads: int, generator) -> list[list[nn.Linear]]:
    """Copies of one shape's six projections (each its own random weights), enough that the L2 cannot hold them."""
    first = attention_linears(heads, kv_heads, generator)
    more = copies_past_l2(weight_bytes(first)) - 1
    return [first] + [attention_linears(heads, kv_heads, generator) for _ in range(more)]


def cold_us(call, copies: list) -> float:
    """us per `call(copy)` with the weights read from memory: one CUDA graph calls it on each copy in turn, twice."""
    order = copies * 2
    calls = iter(order * 3)  # the graph's warm-up calls and its capture take from the same cycle
    return graph_ms(lambda: call(next(calls)), calls=len(order)) * 1000


def compare(bandwidth: float) -> list[dict]:
    rows_out = []
    generator = torch.Generator(device=DEVICE).manual_seed(0)
    for shape, (heads, kv_heads) in SHAPES.items():
        copies = cold_attention_linears(heads, kv_heads, generator)
        read = weight_bytes(copies[0])
        for rows in ROWS:
            x = torch.randn(rows, 1, HIDDEN, device=DEVICE, generator=generator).to(torch.bfloat16)

            def reference(linears):
                [module(x) for module in linears]

            def ours(linears):
                assert input_projections([x] * 6, linears) is not None

            for name, fn in (("cuBLAS (reference)", reference), ("ours", ours)):
                us = cold_us(fn, copies)
                rows_out.append(dict(shape=shape, rows=rows, path=name, us=us, share=read / us / 1e3 / bandwidth))
                print(rows_out[-1], flush=True)
        del copies
    return rows_out


def sweep() -> dict[str, tuple[tuple, float]]:
    """Per shape, (the fastest tile, its us summed over SWEEP_ROWS rows) for the input projections: both tiles of
    `projection_kernel` set to each candidate in turn, whichever the shape's grid takes."""
    generator = torch.Generator(device=DEVICE).manual_seed(1)
    tiles = projection_kernel.TILE, projection_kernel.DEEP_TILE
    fastest = {}
    for shape, (heads, kv_heads) in SHAPES.items():
        copies = cold_attention_linears(heads, kv_heads, generator)
        inputs = [torch.randn(rows, HIDDEN, device=DEVICE, generator=generator).to(torch.bfloat16)
                  for rows in SWEEP_ROWS]  # fmt: skip
        timings = {}
        for tile in itertools.product(*SWEEP):
            projection_kernel.TILE = projection_kernel.DEEP_TILE = tile
            try:
                timings[tile] = sum(cold_us(lambda linears: input_projections([x] * 6, linears), copies)
                                    for x in inputs)  # fmt: skip
            except Exception as error:  # noqa: BLE001  (a tile past shared memory: skipped)
                print(tile, type(error).__name__, str(error)[:120], flush=True)
        ranked = sorted(timings.items(), key=lambda item: item[1])
        print(shape, "fastest", ranked[:5], flush=True)
        fastest[shape] = ranked[0]
        del copies
    projection_kernel.TILE, projection_kernel.DEEP_TILE = tiles
    return fastest


O_PROJ_TILES = ((16, 128, 4, 3), (16, 256, 4, 3), (16, 128, 4, 4), (16, 512, 4, 2), (32, 128, 4, 3), (32, 256, 4, 3),
                (32, 256, 8, 3), (64, 128, 4, 3), (64, 256, 8, 3))


def o_proj(bandwidth: float) -> list[dict]:
    """The output projection ([4,608, heads x 128]) as cuBLAS runs it and as the grouped GEMV would, one weight,
    at each of O_PROJ_TILES (both of the kernel's tiles set to it): whether it should take the kernel too (so far
    cuBLAS's split-K GEMV wins)."""
    results, generator = [], torch.Generator(device=DEVICE).manual_seed(2)
    tiles = projection_kernel.TILE, projection_kernel.DEEP_TILE
    for shape, (heads, _) in SHAPES.items():
        width = heads * HEAD_DIM
        read = HIDDEN * width * 2
        copies = [(torch.randn(HIDDEN, width, device=DEVICE, generator=generator) / width**0.5).to(torch.bfloat16)
                  for _ in range(copies_past_l2(read))]  # fmt: skip
        for rows in SWEEP_ROWS:
            x = torch.randn(rows, width, device=DEVICE, generator=generator).to(torch.bfloat16)
            variants = [("cuBLAS", tiles[0], lambda weight: torch.nn.functional.linear(x, weight))]
            ours = lambda weight: projection_kernel.grouped_projections([x], [weight])  # noqa: E731
            variants += [(str(t), t, ours) for t in O_PROJ_TILES]
            for name, variant_tile, fn in variants:
                projection_kernel.TILE = projection_kernel.DEEP_TILE = variant_tile
                us = cold_us(fn, copies)
                results.append(dict(shape=shape, rows=rows, path=name, us=us, share=read / us / 1e3 / bandwidth))
                print(results[-1], flush=True)
        del copies
    projection_kernel.TILE, projection_kernel.DEEP_TILE = tiles
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
        projection_kernel.TILE, projection_kernel.DEEP_TILE = best["full width"][0], best["tp4"][0]
    rows = compare(bandwidth)
    tiles = dict(TILE=projection_kernel.TILE, DEEP_TILE=projection_kernel.DEEP_TILE)
    text = (f"# Attention projections of a decode step\n\n{environment()}; copy bandwidth {bandwidth:.0f} GB/s; "
            f"tiles (BLOCK_N, BLOCK_K, warps, stages) {tiles}\n\n{timing_table(rows)}")  # fmt: skip
    write_report(args.out, "projections", text, dict(rows=rows, sweep=best, tiles=tiles))


if __name__ == "__main__":
    main()
