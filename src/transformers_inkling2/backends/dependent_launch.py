"""Programmatic dependent launch (PDL) of the decode step's Triton kernels on Hopper and newer GPUs.

A captured decode step is a chain of short kernels, and an H200 idles between one kernel's end and the next one's
start (about 1.6 us a kernel in a layer, docs/benchmarks.md). A kernel launched with PDL may be scheduled while its
predecessor still runs: it waits (`gdc_wait`) for the predecessor to complete before it reads or writes anything a
kernel of the step touches, and lets its own successor be scheduled (`gdc_launch_dependents`) after its last load.
Waiting before releasing keeps the chain exact: when a kernel starts, every kernel before its predecessor has
completed, and the predecessor's writes are visible past the wait. Before its wait a kernel may only read what no
kernel of the step writes (weights).

`torch.compile`'s own kernels follow the same rule (`torch._inductor.config.triton.enable_pdl`), which the compiled
decode steps turn on with ours (`generation.decode_graphs`); cuBLAS kernels launch plainly and simply end the
overlap. Set `INKLING2_DEPENDENT_LAUNCH=0` to launch every kernel plainly (to compare, or to rule PDL out).
"""

from __future__ import annotations

import os

import torch

ENV = "INKLING2_DEPENDENT_LAUNCH"
INDUCTOR_OPTION = "triton.enable_pdl"


def enabled() -> bool:
    """Whether PDL is on for this process (`INKLING2_DEPENDENT_LAUNCH`, default on)."""
    return os.environ.get(ENV, "1") != "0"


def dependent_launch(tensor: torch.Tensor) -> bool:
    """Whether kernels reading `tensor` launch with PDL: on, and a CUDA tensor on a Hopper or newer GPU (the CPU,
    where Triton's interpreter runs the kernels, never)."""
    return (
        enabled()
        and tensor.is_cuda
        and torch.version.hip is None
        and torch.cuda.get_device_capability(tensor.device)[0] >= 9
    )


def inductor_options() -> dict:
    """The `torch.compile` option that launches inductor's kernels with PDL too ({} when PDL is off or this torch's
    inductor has no such option). Inductor itself keeps it to CUDA devices of compute capability 9 and newer."""
    from torch._inductor import config

    return {INDUCTOR_OPTION: True} if enabled() and hasattr(config.triton, "enable_pdl") else {}


__all__ = ["ENV", "INDUCTOR_OPTION", "dependent_launch", "enabled", "inductor_options"]
