"""A decode step's router on one GPU: the reference (fp32 cuBLAS GEMV, `torch.topk` and elementwise passes) against
our two launches (`backends/router_kernel.py`).

Inkling-2-Small's router (hidden 4,608, 384 experts, top-8) and a TP4/EP4-shaped one (96 experts, top-2), bf16
inputs, fp32 weights, at 1 to 64 rows. Each variant is captured 20 times in one CUDA graph and replayed, as a
decode step's graph replays it; time per call, and the weight's bytes over that time as % of the copy bandwidth.
Our kernels are timed at every row count, also where the model's dispatch keeps the reference (`routing.kernel_takes`,
the path's name says which); `--rows-per-program` times them with each given number of rows per program of the
partial sums at most (`router_kernel.MAX_ROWS_PER_PROGRAM`, and fewer only where the step has fewer rows: the grid
rule, `MIN_PROGRAMS`, off) instead of the default.

    python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .whl/*.whl
    export PYTHONPATH=$PWD/src:/tmp/site
    python3 benchmarks/router.py [--rows-per-program N [N ...]] [--out DIR]

Writes `router.md` (+ `.json`) under --out (default $OUT, else ./).
"""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from attention import DEVICE, environment, timing_table, write_report  # noqa: E402
from decode import copy_bandwidth_gb_s, graph_ms  # noqa: E402

from transformers_inkling2 import Inkling2TextConfig  # noqa: E402
from transformers_inkling2.backends import router_kernel  # noqa: E402
from transformers_inkling2.backends.routing import kernel_takes  # noqa: E402
from transformers_inkling2.modeling.interfaces import KERNELS  # noqa: E402
from transformers_inkling2.modeling.modeling_inkling2_text import Inkling2TopKRouter  # noqa: E402

HIDDEN = 4608
SHAPES = {"full width": (384, 8), "tp4": (96, 2)}
ROWS = (1, 2, 4, 8, 16, 32, 64)
CALLS_PER_GRAPH = 20


def compare(bandwidth: float, rows_per_program: list[int]) -> list[dict]:
    results = []
    generator = torch.Generator(device=DEVICE).manual_seed(0)
    default = router_kernel.MAX_ROWS_PER_PROGRAM, router_kernel.MIN_PROGRAMS
    for shape, (experts, top_k) in SHAPES.items():
        config = Inkling2TextConfig(hidden_size=HIDDEN, n_routed_experts=experts, num_experts_per_tok=top_k)
        router = Inkling2TopKRouter(config).to(DEVICE).requires_grad_(False)
        router.weight.copy_(torch.randn(experts, HIDDEN, device=DEVICE, generator=generator) / HIDDEN**0.5)
        read = router.weight.numel() * router.weight.element_size()
        arguments = (router.weight, router.e_score_correction_bias, top_k, router.route_scale)
        for rows in ROWS:
            x = torch.randn(rows, HIDDEN, device=DEVICE, generator=generator).to(torch.bfloat16)
            entry = KERNELS._entries.pop("top_k_routing")
            timed = {"reference (cuBLAS + torch.topk)": graph_ms(lambda: router(x), calls=CALLS_PER_GRAPH)}
            KERNELS._entries["top_k_routing"] = entry
            taken = "the model's path" if kernel_takes(rows, experts) else "the model keeps the reference"
            for per_program in rows_per_program or [None]:
                if per_program is None:
                    name = f"ours ({taken})"
                else:
                    router_kernel.MAX_ROWS_PER_PROGRAM, router_kernel.MIN_PROGRAMS = per_program, 1
                    name = f"ours, {per_program} rows a program ({taken})"
                timed[name] = graph_ms(lambda: router_kernel.top_k_routing(x, *arguments), calls=CALLS_PER_GRAPH)
                router_kernel.MAX_ROWS_PER_PROGRAM, router_kernel.MIN_PROGRAMS = default
            for name, ms in timed.items():
                results.append(dict(shape=shape, rows=rows, path=name, us=ms * 1000, share=read / ms / 1e6 / bandwidth))
                print(results[-1], flush=True)
    return results


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--rows-per-program", type=int, nargs="+", default=[], metavar="N",
                        help="time our kernels with each of these rows per program of the partial sums (at most)")
    parser.add_argument("--out", default=os.environ.get("OUT", "."))
    args = parser.parse_args()
    if any(n < 1 or n & (n - 1) for n in args.rows_per_program):
        parser.error(f"--rows-per-program takes powers of 2 (a program's rows are one block of its layout), got "
                     f"{args.rows_per_program}")
    bandwidth = copy_bandwidth_gb_s()
    results = compare(bandwidth, args.rows_per_program)
    text = f"# Router of a decode step\n\n{environment()}; copy bandwidth {bandwidth:.0f} GB/s\n\n"
    write_report(args.out, "router", text + timing_table(results), dict(rows=results))


if __name__ == "__main__":
    main()
