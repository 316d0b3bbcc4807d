"""The experimental Gluon sliding-layer kernel (`attention_prefill_gluon`) against `inkling2_triton`'s Triton kernel
on one Hopper GPU: relative error on fresh inputs (8k and 32k tokens, left padding, a chunk after cached keys) and
TFLOP/s as in benchmarks/attention.py.

    PYTHONPATH=$PWD/src:/tmp/site python3 -u benchmarks/gluon_prefill_check.py
"""

import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).parent))
import attention as bench  # noqa: E402

from transformers_inkling2 import attention_prefill_gluon as gluon_kernel  # noqa: E402
from transformers_inkling2.attention_prefill_kernel import prefill_attention  # noqa: E402

WINDOW, SCALING = 1024, 128**-0.5
generator = torch.Generator(device="cuda").manual_seed(0)
CASES = [(1024, "short"), (8192, "plain"), (8192, "left padding"), (8192, "chunk after cached keys"),
         (32768, "plain"), (32768, "four stages")]
for tokens, case in CASES:
    gluon_kernel.STAGES = 4 if case == "four stages" else 3  # 4: 224 KB of shared memory, at the H200's limit
    inputs = bench.attention_inputs(tokens, generator)
    if case == "left padding":
        inputs["key_padding"] = torch.ones(1, tokens, dtype=torch.bool, device="cuda")
        inputs["key_padding"][:, :300] = False
    if case == "chunk after cached keys":  # the last 4096 queries over all keys
        queries = 4096
        inputs["query"] = inputs["query"][:, :, -queries:]
        inputs["relative_logits"] = inputs["relative_logits"][:, :, -queries:]
        inputs["sinks"] = inputs["sinks"][:, :, -queries:]
        inputs["query_positions"] = inputs["query_positions"][-queries:]
    assert gluon_kernel.supports(inputs["query"], inputs["key"], inputs["relative_logits"], WINDOW), case
    reference = prefill_attention(**inputs, sliding_window=WINDOW, scaling=SCALING).float()
    try:
        output = gluon_kernel.sliding_prefill_attention(**inputs, sliding_window=WINDOW, scaling=SCALING).float()
        error = ((output - reference).abs().max() / reference.abs().max()).item()
        flops = 4 * bench.HEADS * bench.visible_pairs(tokens, WINDOW) * bench.HEAD_DIM
        if case not in ("plain", "four stages"):
            print(f"{tokens} {case}: relative error {error:.2e}", flush=True)
            continue
        triton_ms = bench.cuda_ms(lambda: prefill_attention(**inputs, sliding_window=WINDOW, scaling=SCALING), 2, 7)
        gluon_ms = bench.cuda_ms(
            lambda: gluon_kernel.sliding_prefill_attention(**inputs, sliding_window=WINDOW, scaling=SCALING), 2, 7
        )
        print(f"{tokens} {case}: relative error {error:.2e}; Triton {flops / triton_ms / 1e9:.1f} TFLOP/s, "
              f"Gluon {flops / gluon_ms / 1e9:.1f} TFLOP/s", flush=True)
    except Exception as error:  # noqa: BLE001  (a first run on hardware: report and go on)
        print(f"{tokens} {case}: {type(error).__name__}: {str(error)[:400]}", flush=True)
