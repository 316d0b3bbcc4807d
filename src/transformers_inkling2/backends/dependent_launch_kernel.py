"""The device side of `dependent_launch`: what a kernel launched with PDL does before it touches the step's
tensors. Imported only by the Triton kernel modules (triton is not a CPU dependency)."""

import triton
import triton.language as tl
from triton.language.extra.cuda import gdc_launch_dependents, gdc_wait


@triton.jit
def wait_for_predecessor(PDL: tl.constexpr):
    """With PDL: wait until the previous kernel has completed and its writes are visible. Without: nothing (the
    launch itself waited)."""
    if PDL:
        gdc_wait()


@triton.jit
def release_successor(PDL: tl.constexpr):
    """With PDL, after `wait_for_predecessor`: the next kernel may be scheduled once every program has come here (or
    ended). Called after a program's last load, where only stores remain: a successor that runs without waiting
    (inductor's kernels wait only for the buffers the previous kernel names) may then reuse the memory of our inputs,
    and a successor released earlier holds SM slots while it waits, so the programs of a grid of several waves queue
    behind it (4 step convolutions released at the start of the projections' GEMV: 41.8 us of waiting per layer,
    H200, docs/benchmarks.md)."""
    if PDL:
        gdc_launch_dependents()


__all__ = ["release_successor", "wait_for_predecessor"]
