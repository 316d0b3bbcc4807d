"""What the kernel's test modules share: where the build is, how it loads, data makers, oracles, the interpreter.

Imported by name (pytest puts this folder on `sys.path`; the interpreter subprocess is handed it), never through
`conftest`. Nothing here imports the model package: the format oracle is `moe_format_oracle.py`.
"""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path

import moe_format_oracle as qf
import pytest
import torch

KERNEL_DIR = Path(__file__).resolve().parents[1]
# hub_kernels/build.py: this repository's stand-in for kernel-builder (absent where the kernel is published alone)
BUILDER = KERNEL_DIR.parent / "build.py"
# the variant `kernels` picks for this torch: torch-cuda on CUDA builds of torch, torch-cpu elsewhere
VARIANT_DIR = KERNEL_DIR / "build" / ("torch-cuda" if torch.version.cuda else "torch-cpu")
FORMATS = ("bf16", "mxfp8", "nvfp4")


def ensure_built() -> Path:
    """`build/` from the sources as they are now: built with `hub_kernels/build.py` when missing or stale."""
    if BUILDER.is_file():
        spec = importlib.util.spec_from_file_location("_hub_kernels_build", BUILDER)
        builder = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(builder)
        return builder.ensure_built(KERNEL_DIR)
    if not VARIANT_DIR.is_dir():
        raise FileNotFoundError(f"{VARIANT_DIR} is missing: build the kernel first (kernel-builder)")
    return KERNEL_DIR / "build"


def load_kernel():
    try:
        from kernels import get_local_kernel
    except ImportError:  # the GPU image may lack `kernels`; import the variant directly then
        sys.path.insert(0, str(VARIANT_DIR))
        import inkling2_moe

        return inkling2_moe
    return get_local_kernel(KERNEL_DIR)


# ------------------------------------------------------------------------------------------ data makers


def quantized_weights(fmt, num_experts, hidden, inter, gen, *, per_half=True):
    """Expert weights quantized from random fp32 with the format oracle's own quantizers."""
    w13 = torch.randn(num_experts, 2 * inter, hidden, generator=gen) * 0.05
    w2 = torch.randn(num_experts, hidden, inter, generator=gen) * 0.05
    if fmt == "bf16":
        return dict(w13=w13.bfloat16(), w2=w2.bfloat16())
    if fmt == "mxfp8":
        q13, s13 = qf.mxfp8_quantize(w13)
        q2, s2 = qf.mxfp8_quantize(w2)
        return dict(w13=q13, w13_scale=s13, w2=q2, w2_scale=s2)
    q13, s13, o13 = qf.nvfp4_quantize(w13, per_half=per_half)
    q2, s2, o2 = qf.nvfp4_quantize(w2)
    return dict(w13=q13, w13_scale=s13, w13_outer=o13, w2=q2, w2_scale=s2, w2_outer=o2)


def random_byte_weights(fmt, num_experts, hidden, inter, gen, device="cpu"):
    """Random bit patterns in each format (no NaN codes), scaled so activations stay O(1)."""
    e = num_experts

    def randint(lo, hi, shape):
        return torch.randint(lo, hi, shape, generator=gen, device=device, dtype=torch.uint8)

    if fmt == "bf16":
        bf16 = dict(generator=gen, device=device, dtype=torch.bfloat16)
        return dict(w13=torch.randn(e, 2 * inter, hidden, **bf16).mul_(0.03),
                    w2=torch.randn(e, hidden, inter, **bf16).mul_(0.03))
    if fmt == "mxfp8":
        def e4m3(shape):
            b = randint(0, 256, shape)
            return torch.where((b & 0x7F) == 0x7F, b ^ 0x01, b).view(torch.float8_e4m3fn)  # no NaN bytes

        return dict(
            w13=e4m3((e, 2 * inter, hidden)), w13_scale=randint(112, 117, (e, 2 * inter, hidden // 32)),
            w2=e4m3((e, hidden, inter)), w2_scale=randint(112, 117, (e, hidden, inter // 32)),
        )
    # nvfp4: any byte is two valid codes; positive block scales 2**-2 .. 2**1.
    return dict(
        w13=randint(0, 256, (e, 2 * inter, hidden // 2)),
        w13_scale=randint(0x28, 0x41, (e, 2 * inter, hidden // 16)).view(torch.float8_e4m3fn),
        w13_outer=torch.rand(e, 2, generator=gen, device=device) * 0.01 + 0.004,
        w2=randint(0, 256, (e, hidden, inter // 2)),
        w2_scale=randint(0x28, 0x41, (e, hidden, inter // 16)).view(torch.float8_e4m3fn),
        w2_outer=torch.rand(e, generator=gen, device=device) * 0.01 + 0.004,
    )


def realistic_routing(tokens, num_experts, top_k, gen, device="cpu"):
    """Top-k of random sigmoid scores, weights normalized (like a sigmoid router)."""
    scores = torch.rand(tokens, num_experts, generator=gen, device=device)
    scores = scores + torch.rand(num_experts, generator=gen, device=device) * 0.2  # uneven expert load
    weights, ids = torch.topk(scores, top_k, dim=-1)
    return ids, (weights / weights.sum(-1, keepdim=True)).float()


# ------------------------------------------------------------------------------------------ oracles


def oracle_dequant(fmt, w, which, dtype=torch.bfloat16, experts=None):
    """Dequantize w13 ('w13') or w2 ('w2') with the format oracle, optionally some experts."""
    sel = (lambda t: t) if experts is None else (lambda t: t[experts])
    weight = sel(w[which])
    if fmt == "bf16":
        return weight.to(dtype)
    if fmt == "mxfp8":
        return qf.mxfp8_dequantize(weight, sel(w[f"{which}_scale"]), dtype, validate=False)
    outer = sel(w[f"{which}_outer"])
    return qf.nvfp4_dequantize(weight, sel(w[f"{which}_scale"]), outer, dtype, validate=False)


def kwargs_of(w):
    return {k: v for k, v in w.items() if k not in ("w13", "w2")}


def softcap(v, cap):
    return cap * torch.tanh(v / cap)


def naive_oracle(x, ids, rw, w, fmt, gate_cap=4.0, up_cap=25.0):
    """Per token, per slot, in float64, on the format oracle's bf16 weights; act rounded to bf16."""
    w13 = oracle_dequant(fmt, w, "w13").double()
    w2 = oracle_dequant(fmt, w, "w2").double()
    inter = w2.shape[-1]
    out = torch.zeros(x.shape, dtype=torch.float64)
    for t in range(x.shape[0]):
        for j in range(ids.shape[1]):
            e = int(ids[t, j])
            if not 0 <= e < w13.shape[0]:
                continue
            h = w13[e] @ x[t].double()
            g, u = h[:inter], h[inter:]
            act = (softcap(g, gate_cap) * torch.sigmoid(g) * softcap(u, up_cap)).bfloat16().double()
            out[t] += float(rw[t, j]) * (w2[e] @ act)
    return out


def rel_err(a, b):
    a, b = a.double(), b.double()
    return float((a - b).norm() / b.norm())


# ------------------------------------------------------------------------------------------ interpreter

# Runs Triton kernels on CPU tensors under Triton's interpreter, in a subprocess (TRITON_INTERPRET is read when
# triton is imported). The prelude works around numpy >= 2.4 refusing int() of a 1-element 1-d array, which
# triton 3.6's interpreter does for `range(..)` bounds held in tensors. CI installs triton 3.6.0 (`.ci/run`).
_INTERPRETER_PRELUDE = r"""
import os
os.environ["TRITON_INTERPRET"] = "1"
from triton.runtime import interpreter as _interp

_original_patch = getattr(_interp, "_patch_lang_tensor", None)  # (other triton versions need no patch)


def _patch_lang_tensor(tensor, scope):
    _original_patch(tensor, scope)
    scope.set_attr(tensor, "__index__", lambda self: int(self.handle.data.reshape(-1)[0]))


if _original_patch is not None:
    _interp._patch_lang_tensor = _patch_lang_tensor
"""
needs_triton = pytest.mark.skipif(importlib.util.find_spec("triton") is None, reason="triton is not installed")


def run_under_triton_interpreter(script: str, *args: str) -> dict:
    """Runs `script` (which prints a JSON object as its last line) under the interpreter; returns that object.

    On one thread: in a fresh process on 2 threads, the first `torch.exp` of a contiguous fp32 tensor (MKL's
    vector math, one chunk per thread) gave one chunk at about 12-bit accuracy in 7 of 379 processes, 0 of 200 on
    one thread; the references here are computed in that fresh process."""
    env = dict(
        os.environ, TRITON_INTERPRET="1", OMP_NUM_THREADS="1", PYTHONPATH=os.pathsep.join(p for p in sys.path if p)
    )
    proc = subprocess.run(
        [sys.executable, "-c", _INTERPRETER_PRELUDE + script, *args], env=env, capture_output=True, text=True,
        timeout=300,
    )
    assert proc.returncode == 0, proc.stderr[-4000:]
    return json.loads(proc.stdout.strip().splitlines()[-1])
