"""The Gluon sliding-layer kernel (`attention_prefill_gluon`, what `prefill_attention` runs for sliding layers on
Hopper) against the Triton kernel (`triton_prefill_attention`) on one Hopper GPU, for two tile shapes: relative
error on fresh inputs (1k, 8k with and without left padding, a chunk after cached keys) and TFLOP/s at 8k and 32k
tokens as in benchmarks/attention.py.

    PYTHONPATH=$PWD/src:/tmp/site python3 -u benchmarks/gluon_prefill_check.py
"""

import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).parent))
import attention as bench  # noqa: E402

from transformers_inkling2.backends.attention import prefill_gluon as gluon_kernel  # noqa: E402
from transformers_inkling2.backends.attention.prefill_kernel import triton_prefill_attention  # noqa: E402

WINDOW, SCALING = 1024, 128**-0.5
# (query rows, keys per block, warps, stages): the default, with two programs per SM, and the best of the 128-row
# programs (two warpgroups, one program per SM: 224 KB of shared memory)
TILES = [gluon_kernel.TILES, (128, 64, 8, 4)]
generator = torch.Generator(device="cuda").manual_seed(0)


def case_inputs(tokens, case):
    inputs = bench.attention_inputs(tokens, generator)
    if case == "left padding":
        inputs["key_padding"] = torch.ones(1, tokens, dtype=torch.bool, device="cuda")
        inputs["key_padding"][:, :300] = False
    if case == "chunk after cached keys":  # the last 4096 queries over all keys
        queries = 4096
        for name in ("query", "relative_logits", "sinks"):
            inputs[name] = inputs[name][:, :, -queries:]
        inputs["query_positions"] = inputs["query_positions"][-queries:]
    return inputs


for tokens, case in [(1024, "short"), (8192, "plain"), (8192, "left padding"), (8192, "chunk after cached keys"),
                     (32768, "plain")]:
    inputs = case_inputs(tokens, case)
    assert gluon_kernel.supports(inputs["query"], inputs["key"], inputs["value"], inputs["relative_logits"], WINDOW), case
    reference = triton_prefill_attention(**inputs, sliding_window=WINDOW, scaling=SCALING)
    flops = 4 * bench.HEADS * bench.visible_pairs(tokens, WINDOW) * bench.HEAD_DIM
    timed = case == "plain"
    line = f"{tokens} {case}:"
    if timed:
        ms = bench.cuda_ms(lambda: triton_prefill_attention(**inputs, sliding_window=WINDOW, scaling=SCALING), 2, 7)
        line += f" Triton {flops / ms / 1e9:.1f} TFLOP/s;"
    for tiles in TILES:
        try:
            run = lambda: gluon_kernel.sliding_prefill_attention(  # noqa: E731
                **inputs, sliding_window=WINDOW, scaling=SCALING, tiles=tiles)
            output = run()
            error = ((output.float() - reference.float()).abs().max() / reference.float().abs().max()).item()
            line += f" {tiles}: error {error:.1e}"
            if timed:
                line += f", {flops / bench.cuda_ms(run, 2, 7) / 1e9:.1f} TFLOP/s"
        except Exception as exc:  # noqa: BLE001  (report and go on to the next shape)
            line += f" {tiles}: {type(exc).__name__}: {str(exc)[:200]}"
        line += ";"
    print(line, flush=True)
