"""Instructions per weight element in the main loop of the expert GEMM kernels, counted offline (no GPU needed).

Compiles `_gate_up_kernel` or `_down_kernel` (the sources in torch-ext/) for sm_90 with Triton (its bundled ptxas),
disassembles the cubin with the bundled nvdisasm, finds the innermost loop (the longest backward branch) and counts
its SASS instructions by opcode. Instructions per weight element = loop instructions / weight elements per thread and
step (BLOCK_N x BLOCK_K, twice for gate/up). Used for docs/benchmarks.md's reading of the NVFP4 decode kernels.

    python3 hub_kernels/inkling2_moe/benchmarks/moe_sass_counts.py [gate_up|down] [nvfp4|mxfp8|bf16] \
        [BM BN BK warps stages]
"""

import collections
import inspect
import os
import re
import subprocess
import sys
import tempfile
from pathlib import Path

import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "torch-ext"))
from inkling2_moe import triton_kernels  # noqa: E402

FORMATS = {"bf16": 0, "mxfp8": 1, "nvfp4": 2}
INSTRUCTION = re.compile(r"\s+/\*([0-9a-f]{4})\*/\s+(?:@!?U?P\w+\s+)?([A-Z0-9_]+)")


def compile_kernel(which: str, fmt: str, block_m: int, block_n: int, block_k: int, warps: int, stages: int) -> bytes:
    kernel = triton_kernels._gate_up_kernel if which == "gate_up" else triton_kernels._down_kernel
    names = list(inspect.signature(kernel.fn).parameters)
    constants = dict(FMT=FORMATS[fmt], BM=block_m, BN=block_n, BK=block_k, SPLIT_K=1, DOT_FP32=False)
    if "TOPK" in names:
        constants["TOPK"] = 8
    activation = "*fp16" if fmt == "nvfp4" else "*bf16"
    weight = "*bf16" if fmt == "bf16" else "*u8"
    types = {
        "x_ptr": activation,
        "act_ptr": activation,
        "w_ptr": weight,
        "s_ptr": "*u8",
        "outer_ptr": "*fp32",
        "xs_ptr": "*fp32",
        "part_ptr": "*fp32",
        "y_ptr": "*fp32",
        "rw_ptr": "*fp32",
        "gate_cap": "fp32",
        "up_cap": "fp32",
    }
    signature, attributes = {}, {}
    for index, name in enumerate(names):
        if name in constants:
            signature[name] = "constexpr"
            continue
        signature[name] = types.get(name, "*i32" if name.endswith("_ptr") else "i32")
        if name.endswith("_ptr") or name.startswith("stride") or name in ("H", "I"):
            attributes[(index,)] = [["tt.divisibility", 16]]
    compiled = triton.compile(
        ASTSource(kernel, signature, constants, attributes),
        target=GPUTarget("cuda", 90, 32),
        options=dict(num_warps=warps, num_stages=stages),
    )
    return compiled.asm["cubin"]


def innermost_loop(sass: str) -> list[str]:
    """Opcodes between the target of the longest backward branch and the branch."""
    labels, instructions = {}, []
    pending = []
    for line in sass.splitlines():
        label = re.match(r"(\.L_x_\d+):", line)
        if label:
            pending.append(label.group(1))
            continue
        match = INSTRUCTION.match(line)
        if match:
            address = int(match.group(1), 16)
            for name in pending:
                labels[name] = address
            pending = []
            instructions.append((address, match.group(2), line))
    loops = []
    for address, opcode, line in instructions:
        target = re.search(r"BRA\s+`\((\.L_x_\d+)\)", line)
        if opcode == "BRA" and target and labels.get(target.group(1), address) < address:
            loops.append((address - labels[target.group(1)], labels[target.group(1)], address))
    _, start, end = max(loops)
    return [opcode for address, opcode, _ in instructions if start <= address <= end]


def main() -> None:
    which = sys.argv[1] if len(sys.argv) > 1 else "gate_up"
    fmt = sys.argv[2] if len(sys.argv) > 2 else "nvfp4"
    block_m, block_n, block_k, warps, stages = map(int, sys.argv[3:8]) if len(sys.argv) > 7 else (16, 64, 128, 4, 3)
    cubin = compile_kernel(which, fmt, block_m, block_n, block_k, warps, stages)
    with tempfile.TemporaryDirectory() as folder:
        path = os.path.join(folder, "kernel.cubin")
        Path(path).write_bytes(cubin)
        nvdisasm = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", "nvdisasm")
        sass = subprocess.run([nvdisasm, "-c", path], capture_output=True, text=True, check=True).stdout
    loop = innermost_loop(sass)
    per_thread = block_n * block_k * (2 if which == "gate_up" else 1) / (warps * 32)
    print(
        f"{which} {fmt} tiles {(block_m, block_n, block_k, warps, stages)}: {len(loop)} instructions per loop step, "
        f"{len(loop) / per_thread:.2f} per weight element and thread"
    )
    print("  " + ", ".join(f"{opcode} {count}" for opcode, count in collections.Counter(loop).most_common(16)))


if __name__ == "__main__":
    main()
