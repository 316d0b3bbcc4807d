"""Tile sweep of the `inkling2_triton` prefill kernel (`attention_prefill_kernel`) on one GPU: one attention call
(batch 1, 48 q / 8 kv heads, head_dim 128, bf16, window = extent = 1024) at 8k and 32k tokens, sliding and full
layers, for (BLOCK_M, BLOCK_N, warps, stages) candidates; relative logits in the model's aligned layout, and for the
layer's default tiles (`TILES`) also a contiguous copy (what the kernel read before the aligned layout). Errors at 8k
are relative to `inkling2_flex`. TFLOP/s as in benchmarks/attention.py.

    PYTHONPATH=$PWD/src python3 benchmarks/prefill_kernel_sweep.py [sliding] [full]  # JSON lines; sweep.json in $OUT
"""

import json
import os
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).parent))
import attention as bench  # noqa: E402

from transformers_inkling2.backends.attention import prefill_kernel as K
from transformers_inkling2.backends.attention.flex import inkling2_flex_attention

CONFIGS = [(128, 128, 8, 2), (128, 64, 8, 2), (128, 64, 8, 3), (128, 64, 8, 4), (128, 32, 8, 3), (128, 32, 8, 4),
           (64, 64, 4, 2), (64, 64, 4, 3), (64, 32, 4, 3)]
DEFAULTS = dict(K.TILES)
LAYERS = sys.argv[1:] or ["sliding", "full"]  # e.g. `sliding` alone
g = torch.Generator(device="cuda").manual_seed(0)
out = []
for tokens in (8192, 32768):
    inputs = bench.attention_inputs(tokens, g)
    contiguous = dict(inputs, relative_logits=inputs["relative_logits"].contiguous())
    for layer, window in [(layer, 1024 if layer == "sliding" else None) for layer in LAYERS]:
        flops = 4 * bench.HEADS * bench.visible_pairs(tokens, window) * bench.HEAD_DIM
        reference = None
        if tokens == 8192:
            reference = inkling2_flex_attention(**inputs, sliding_window=window, scaling=128**-0.5).float()
        for bm, bn, warps, stages in CONFIGS:
            K.TILES[layer] = (bm, bn, warps, stages)
            for name, x in (("aligned", inputs), ("contiguous", contiguous)):
                if name == "contiguous" and (bm, bn, warps, stages) != DEFAULTS[layer]:
                    continue

                def run():
                    return K.triton_prefill_attention(**x, sliding_window=window, scaling=128**-0.5)

                try:
                    start = time.time()
                    y = run()
                    torch.cuda.synchronize()
                    compile_s = time.time() - start
                    err = None if reference is None else ((y.float() - reference).abs().max() / reference.abs().max()).item()
                    ms = bench.cuda_ms(run, warmup=2, repeats=5)
                    row = dict(tokens=tokens, layer=layer, config=(bm, bn, warps, stages), layout=name, ms=round(ms, 3),
                               tflops=round(flops / ms / 1e9, 1), rel_err=err, first_call_s=round(compile_s, 1))
                except Exception as error:  # e.g. out of shared memory: recorded, the sweep goes on
                    row = dict(tokens=tokens, layer=layer, config=(bm, bn, warps, stages), layout=name, error=str(error)[:300])
                print(json.dumps(row), flush=True)
                out.append(row)
    inputs = contiguous = None
    torch.cuda.empty_cache()
Path(os.environ.get("OUT", "."), "sweep.json").write_text(json.dumps(out, indent=1))
