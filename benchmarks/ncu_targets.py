"""One warmed-up call of a kernel, for Nsight Compute to profile (the profiles quoted in docs/benchmarks.md).

    python3 benchmarks/ncu_targets.py attention sliding|full   # one prefill_attention call, 8192 tokens
    python3 benchmarks/ncu_targets.py moe T                    # one NVFP4 moe_forward call with T tokens

Run under ncu, skipping the warm-up launches, e.g.
    ncu --section SpeedOfLight --section WarpStateStats --section Occupancy -k regex:_prefill_kernel \
        --launch-skip 1 --launch-count 1 python3 benchmarks/ncu_targets.py attention sliding
    ncu --section SpeedOfLight --section Occupancy -k regex:"_gate_up_kernel|_down_kernel" \
        --launch-skip 2 --launch-count 2 python3 benchmarks/ncu_targets.py moe 1
"""

import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).parent))
# the MoE kernel's own benchmark lives with the kernel package
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "hub_kernels" / "inkling2_moe" / "benchmarks"))


def attention(layer: str) -> None:
    import attention as bench

    from transformers_inkling2.backends.attention import prefill_kernel as attention_prefill_kernel

    inputs = bench.attention_inputs(8192, torch.Generator(device="cuda").manual_seed(0))
    for _ in range(2):  # the first compiles
        attention_prefill_kernel.prefill_attention(
            **inputs, sliding_window=1024 if layer == "sliding" else None, scaling=128**-0.5
        )


def moe(tokens: int) -> None:
    import moe_kernels as bench

    kernel = bench.load_kernel()
    generator = torch.Generator(device="cuda").manual_seed(0)
    weights = bench.make_weights("nvfp4", generator)
    for x, ids, routing_weights, out in bench.inputs(tokens, generator, 2):  # the first compiles
        kernel.moe_forward(x, ids, routing_weights, fmt="nvfp4", out=out, **weights)


if __name__ == "__main__":
    kind, argument = sys.argv[1], sys.argv[2]
    if kind == "attention":
        attention(argument)
    else:
        moe(int(argument))
    torch.cuda.synchronize()
