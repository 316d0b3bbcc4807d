"""How fast can the bytes of one decode-size NVFP4 MoE call be read at all? Pure-read Triton kernels (load and
XOR, no dequantization or math) over the packed weights the register GEMV kernels read at T = 1 (8 experts of
Inkling-2-Small: w13 [4608, 2304] and w2 [4608, 1152] bytes each), with the register kernels' grid and access
pattern (64 rows x 128 bytes per step, one program per 64 rows: 576 programs for w13, 576 for w2) and with each
program reading its rows' bytes as contiguous 8 KB steps instead. Time per call: median replay of a CUDA graph of
8 calls with different expert sets (so reads are not served from L2), next to the device-to-device copy
bandwidth of `moe_kernels.py`. One GPU.

    python hub_kernels/inkling2_moe/benchmarks/moe_read_ceiling.py
"""

from __future__ import annotations

import sys
from pathlib import Path

import torch
import triton
import triton.language as tl

sys.path.insert(0, str(Path(__file__).resolve().parent))
from moe_kernels import ROTATIONS, E, H, I, copy_bandwidth, graph_time_ms  # noqa: E402

ROWS, STEP = 64, 128  # the register kernels' program: 64 weight rows, 128 bytes of each per step


@triton.jit
def _xor(a, b):
    return a ^ b


@triton.jit
def _read_kernel(w_ptr, experts_ptr, out_ptr, stride_e, ROW_BYTES: tl.constexpr, ROWS: tl.constexpr,
                 STEP: tl.constexpr, CONTIGUOUS: tl.constexpr):
    """Program (expert slot, c) reads rows [ROWS c, ROWS c + ROWS) of its expert: STEP bytes of every row per step
    (the GEMV pattern), or the same bytes as contiguous ROWS * STEP-byte steps."""
    e = tl.load(experts_ptr + tl.program_id(0)).to(tl.int64)
    c = tl.program_id(1)
    base = w_ptr + e * stride_e + c * ROWS * ROW_BYTES
    if CONTIGUOUS:
        ptrs = base + tl.arange(0, ROWS)[:, None] * STEP + tl.arange(0, STEP)[None, :]
        advance = ROWS * STEP
    else:
        ptrs = base + tl.arange(0, ROWS)[:, None] * ROW_BYTES + tl.arange(0, STEP)[None, :]
        advance = STEP
    acc = tl.zeros([ROWS, STEP], tl.int32)
    for step in range(ROW_BYTES // STEP):
        acc ^= tl.load(ptrs + step * advance).to(tl.int32)
    tl.store(out_ptr + tl.program_id(0) * tl.num_programs(1) + c, tl.reduce(acc, None, _xor))


def main():
    gen = torch.Generator(device="cuda").manual_seed(0)
    ceiling = copy_bandwidth()
    print(f"{torch.cuda.get_device_name()}: copy bandwidth {ceiling:.2f} TB/s (bytes read + written)")
    expert_sets = [torch.randperm(E, generator=gen, device="cuda")[:8].int() for _ in range(ROTATIONS)]
    for name, rows, row_bytes in (("w13 (gate/up)", 2 * I, H // 2), ("w2 (down)", H, I // 2)):
        w = torch.randint(0, 256, (E, rows, row_bytes), generator=gen, dtype=torch.uint8, device="cuda")
        out = torch.empty(8 * (rows // ROWS), dtype=torch.int32, device="cuda")
        nbytes = 8 * rows * row_bytes
        for contiguous in (False, True):
            calls = [(lambda s=s: _read_kernel[(8, rows // ROWS)](
                w, s, out, w.stride(0), ROW_BYTES=row_bytes, ROWS=ROWS, STEP=STEP, CONTIGUOUS=contiguous,
                num_warps=4, num_stages=1)) for s in expert_sets]
            ms = graph_time_ms(calls)
            pattern = "contiguous 8 KB steps" if contiguous else f"{ROWS} rows x {STEP} B per step"
            print(f"{name}, {nbytes / 1e6:.1f} MB, {pattern}: {ms * 1e3:.1f} us, {nbytes / ms / 1e9:.2f} TB/s, "
                  f"{100 * nbytes / ms / 1e9 / ceiling:.0f}% of copy", flush=True)


if __name__ == "__main__":
    main()
