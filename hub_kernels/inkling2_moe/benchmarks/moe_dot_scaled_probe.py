"""What Triton's `tl.dot_scaled` (block-scaled MMA) offers this kernel's formats, checked offline (no GPU needed).

The expert GEMMs multiply bf16 (MXFP8) or f16 (NVFP4) activations by block-scaled weights: MXFP8 (E4M3 values, an
E8M0 scale per 32) and NVFP4 (E2M1 values, an E4M3 scale per 16). For each pairing of operands this compiles a
128 x 128 x 128 `tl.dot_scaled` for sm_90a, sm_100a and sm_120a with Triton's bundled compiler and prints the MMA
instruction its PTX holds (`tcgen05.mma ... block_scale` is the native block-scaled MMA of Blackwell data-center
GPUs), or why it did not compile; then runs the first pairing under Triton's interpreter, in a subprocess
(TRITON_INTERPRET is read when triton is imported). docs/kernels.md ("Blackwell") records what it printed.

    python3 hub_kernels/inkling2_moe/benchmarks/moe_dot_scaled_probe.py
"""

import os
import re
import subprocess
import sys

import torch
import triton
import triton.language as tl
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource

TARGETS = (90, 100, 120)
# (what, activation format, weight format, weight scale: "e8m0" bytes or "e4m3", inputs per scale)
PAIRINGS = [
    ("MXFP8 weights, bf16 activations (this kernel's numerics)", "bf16", "e4m3", "e8m0", 32),
    ("NVFP4 weights, bf16 activations (this kernel's numerics)", "bf16", "e2m1", "e4m3", 16),
    ("NVFP4 weights, f16 activations (this kernel's numerics)", "fp16", "e2m1", "e4m3", 16),
    ("MXFP8 weights, MXFP8 activations (activations quantized)", "e4m3", "e4m3", "e8m0", 32),
    ("NVFP4 weights, NVFP4 activations (activations quantized)", "e2m1", "e2m1", "e4m3", 16),
]
MMA = re.compile(r"\b(?:tcgen05\.mma|wgmma\.mma_async|mma\.sync)[\w.:]*")
SIZE = 128


@triton.jit
def _probe_kernel(a_ptr, a_scale_ptr, w_ptr, w_scale_ptr, out_ptr, A_FORMAT: tl.constexpr, W_FORMAT: tl.constexpr,
                  E4M3_SCALES: tl.constexpr, GROUP: tl.constexpr, M: tl.constexpr, K: tl.constexpr):
    """out [M, M] = a [M, K] @ w [M (rows), K]^T, block-scaled; packed E2M1 holds two inputs per byte."""
    rows = tl.arange(0, M)
    a_bytes: tl.constexpr = K // 2 if A_FORMAT == "e2m1" else K
    w_bytes: tl.constexpr = K // 2 if W_FORMAT == "e2m1" else K
    a = tl.load(a_ptr + rows[:, None] * a_bytes + tl.arange(0, a_bytes)[None, :])
    w = tl.load(w_ptr + rows[:, None] * w_bytes + tl.arange(0, w_bytes)[None, :])
    scale_columns = rows[:, None] * (K // GROUP) + tl.arange(0, K // GROUP)[None, :]
    w_scale = tl.load(w_scale_ptr + scale_columns)
    a_scale = None
    if A_FORMAT == "e2m1" or A_FORMAT == "e4m3":
        a_scale = tl.load(a_scale_ptr + scale_columns)
        if E4M3_SCALES:
            a_scale = a_scale.to(tl.float8e4nv, bitcast=True)
    if E4M3_SCALES:
        w_scale = w_scale.to(tl.float8e4nv, bitcast=True)
    out = tl.dot_scaled(a, a_scale, A_FORMAT, tl.trans(w), w_scale, W_FORMAT)
    tl.store(out_ptr + rows[:, None] * M + rows[None, :], out)


def constants(a_format, w_format, scale, group):
    return dict(A_FORMAT=a_format, W_FORMAT=w_format, E4M3_SCALES=scale == "e4m3", GROUP=group, M=SIZE, K=SIZE)


def compile_pairing(arch: int, a_format: str, w_format: str, scale: str, group: int) -> str:
    pointer = {"bf16": "*bf16", "fp16": "*fp16"}.get(a_format, "*u8")
    signature = dict(a_ptr=pointer, a_scale_ptr="*u8", w_ptr="*u8", w_scale_ptr="*u8", out_ptr="*fp32",
                     **dict.fromkeys(constants(a_format, w_format, scale, group), "constexpr"))  # fmt: skip
    source = ASTSource(_probe_kernel, signature, constants(a_format, w_format, scale, group))
    try:
        ptx = triton.compile(source, target=GPUTarget("cuda", arch, 32)).asm["ptx"]
    except Exception as error:  # the compiler's own message says why
        return f"does not compile: {type(error).__name__}: {str(error).strip().splitlines()[0][:100]}"
    return ", ".join(sorted(set(MMA.findall(ptx)))) or "no MMA instruction"


def run_under_interpreter() -> None:
    """The first pairing on CPU tensors (this file, re-run with TRITON_INTERPRET=1)."""
    _, a_format, w_format, scale, group = PAIRINGS[0]
    a = torch.randn(SIZE, SIZE).bfloat16()
    w = torch.randint(0, 0x7E, (SIZE, SIZE), dtype=torch.uint8)  # E4M3 bytes without NaN
    w_scale = torch.full((SIZE, SIZE // group), 127, dtype=torch.uint8)
    out = torch.empty(SIZE, SIZE)
    _probe_kernel[(1,)](a, w_scale, w, w_scale, out, **constants(a_format, w_format, scale, group))
    print("ran under the interpreter")


def main() -> None:
    for what, *pairing in PAIRINGS:
        print(what)
        for arch in TARGETS:
            print(f"  sm_{arch}a: {compile_pairing(arch, *pairing)}")
    env = dict(os.environ, TRITON_INTERPRET="1")
    run = subprocess.run([sys.executable, __file__, "--interpret"], env=env, capture_output=True, text=True)
    error = (run.stderr.strip().splitlines() or ["(no message)"])[-1]
    print(f"{PAIRINGS[0][0]}, Triton interpreter: {'ran' if run.returncode == 0 else 'fails: ' + error[:160]}")


if __name__ == "__main__":
    run_under_interpreter() if "--interpret" in sys.argv else main()
