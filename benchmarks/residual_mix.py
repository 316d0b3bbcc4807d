"""A decode step's attention-residual mixes on one GPU: the reference (PyTorch, eager and `torch.compile`d) against
the fused kernel (`backends/residual_mix.py`, `INKLING2_FUSED_RESIDUAL_MIX=1`), at its chunk and warp settings.

Full-width Inkling-2-Small layers (hidden 4,608), bf16, through the decoder layer's own entry points: a sliding layer's
mix and norm before attention (one query), a full layer's (three), and the mix before the MoE after the post-attention
convolution over the static cache's ring, each over 8 completed blocks (the most a mix of the model reads); and the
layer's end, the post-MLP step convolution with the partial block added in its epilogue. One token at batch 1, 8 and 64,
and an 8-token verification step at batch 1 (`--batches`: one-token steps at the batch sizes given instead). Each
variant is captured 20 times in one CUDA graph and replayed, as a decode step's graph replays it: us per call. The
fused kernels run at their defaults, and with `--chunks` / `--warps` also at each chunk and warp count given
(`residual_mix_kernel.CHUNK` and `WIDE_CHUNK` both set to the chunk, so one chunk at every batch; `NUM_WARPS`; each
pair compiles its own kernels).

    python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .whl/*.whl
    export PYTHONPATH=$PWD/src:/tmp/site
    python3 benchmarks/residual_mix.py [--chunks 256 512 1024] [--warps 4 8 16] [--fused-only] [--batches 16 32]
                                       [--out DIR]

Writes `residual_mix.md` (+ `.json`) under --out (default $OUT, else ./).
"""

from __future__ import annotations

import argparse
import itertools
import os
import sys
from pathlib import Path
from unittest import mock

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from attention import DEVICE, environment, markdown_table, write_report  # noqa: E402
from decode import graph_ms  # noqa: E402

from transformers_inkling2 import Inkling2StaticCache, Inkling2TextConfig  # noqa: E402
from transformers_inkling2.backends import residual_mix, residual_mix_kernel  # noqa: E402
from transformers_inkling2.modeling.modeling_inkling2_text import Inkling2DecoderLayer  # noqa: E402
from transformers_inkling2.modeling.norms import rms_normalize  # noqa: E402
from transformers_inkling2.tiny import randomize_  # noqa: E402

CONFIG = dict(hidden_size=4608, num_hidden_layers=12, n_routed_experts=8, moe_intermediate_size=256)
SLIDING, FULL = 1, 5  # layer 1 slides, layer 5 attends fully ((i + 1) % 6 == 0)
BLOCKS = 8
STEPS = ((1, 1), (8, 1), (64, 1), (1, 8))  # (batch, tokens)
CALLS_PER_GRAPH = 20


def build_layer(index: int) -> Inkling2DecoderLayer:
    """A random full-width layer whose MoE returns its input: the layer's end is timed on a given MoE output."""
    layer = randomize_(Inkling2DecoderLayer(Inkling2TextConfig(**CONFIG), index), seed=index)
    layer.mlp.forward = lambda x, summed=True: x
    return layer.to(DEVICE, torch.bfloat16).requires_grad_(False)


def cases(layers: dict, batch: int, tokens: int) -> dict:
    """name -> a call of one mix (with its inputs made here)."""
    generator = torch.Generator(device=DEVICE).manual_seed(batch * 10 + tokens)
    hidden = CONFIG["hidden_size"]
    partial = torch.randn(batch, tokens, hidden, device=DEVICE, generator=generator)
    blocks = rms_normalize(torch.randn(batch, tokens, BLOCKS, hidden, device=DEVICE, generator=generator), 1e-6)
    output = torch.randn(batch, tokens, hidden, device=DEVICE, generator=generator).to(torch.bfloat16)
    sliding = layers[SLIDING]
    cache = Inkling2StaticCache(sliding.self_attn.config, max_cache_len=64, max_batch_size=batch)
    positions = torch.arange(16, 16 + tokens, device=DEVICE)
    cache.begin_step(positions)
    dtype = torch.bfloat16
    return {
        "before attention, sliding (1 query)": lambda: sliding.attention_inputs(blocks, partial, dtype),
        "before attention, full (3 queries)": lambda: layers[FULL].attention_inputs(blocks, partial, dtype),
        "before the MoE, convolution included": lambda: sliding.mlp_inputs(
            output, partial, blocks, None, cache, positions, dtype
        ),
        "the layer's end, convolution and sum": lambda: sliding.layer_output(
            output, partial, None, cache, positions, dtype
        ),
    }


def timed(function, fused: bool, compiled: bool = False) -> float:
    """us per call, the switch set while the graph is captured (what it holds is decided then)."""
    with mock.patch.dict(os.environ, {residual_mix.ENV: "1" if fused else "0"}):
        torch._dynamo.reset()
        return 1000 * graph_ms(torch.compile(function) if compiled else function, calls=CALLS_PER_GRAPH)


def compare(steps: list[tuple[int, int]], settings: list[tuple[int, int]], fused_only: bool) -> list[dict]:
    layers = {index: build_layer(index) for index in (SLIDING, FULL)}
    results = []
    with torch.no_grad():
        for batch, tokens in steps:
            for name, function in cases(layers, batch, tokens).items():
                paths = {} if fused_only else {"reference, eager": timed(function, fused=False),
                                               "reference, torch.compile": timed(function, fused=False, compiled=True)}
                paths["fused, defaults"] = timed(function, fused=True)
                for chunk, num_warps in settings:
                    with mock.patch.multiple(residual_mix_kernel, CHUNK=chunk, WIDE_CHUNK=chunk, NUM_WARPS=num_warps):
                        paths[f"fused, chunk {chunk}, {num_warps} warps"] = timed(function, fused=True)
                for path, us in paths.items():
                    results.append(dict(batch=batch, tokens=tokens, mix=name, path=path, us=us))
                    print(results[-1], flush=True)
    return results


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--out", default=os.environ.get("OUT", "."))
    parser.add_argument("--chunks", type=int, nargs="+", default=[], help="also time the kernels at these chunks")
    parser.add_argument("--warps", type=int, nargs="+", default=[], help="and these warp counts")
    parser.add_argument("--fused-only", action="store_true", help="leave the reference out (to compare kernels)")
    parser.add_argument("--batches", type=int, nargs="+", help="one-token steps at these batch sizes only")
    args = parser.parse_args()
    if not torch.cuda.is_available():
        sys.exit("benchmarks/residual_mix.py needs a CUDA GPU")
    settings = []
    if args.chunks or args.warps:
        chunks, warps = args.chunks or [residual_mix_kernel.CHUNK], args.warps or [residual_mix_kernel.NUM_WARPS]
        settings = list(itertools.product(chunks, warps))
    steps = [(batch, 1) for batch in args.batches] if args.batches else STEPS
    results = compare(steps, settings, args.fused_only)
    table = markdown_table(["batch", "tokens", "mix", "path", "us per call"],
                           [[r["batch"], r["tokens"], r["mix"], r["path"], f"{r['us']:.1f}"] for r in results])
    command = " ".join(["python3 benchmarks/residual_mix.py", *sys.argv[1:]])
    text = f"# A decode step's attention-residual mixes\n\n{environment()}; command: `{command}`\n\n{table}"
    write_report(args.out, "residual_mix", text, dict(rows=results, args=vars(args)))


if __name__ == "__main__":
    main()
