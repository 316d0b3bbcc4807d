"""Programmatic dependent launch (`backends/dependent_launch.py`): when the decode step's kernels launch with it, and
the `torch.compile` options that launch inductor's kernels the same way (`generation.decode_graphs.compiled_step`).
That the kernels compile with their waits for Hopper and Blackwell: tests/backends/test_kernel_targets.py; that the
captured steps give the reference's outputs with it on: the GPU tests of the kernels and of the decode graphs."""

from unittest import mock

import pytest
import torch
from inkling2_helpers import on_mocked_gpu
from transformers import CompileConfig

from transformers_inkling2.backends import dependent_launch
from transformers_inkling2.generation.decode_graphs import COMBO_KERNELS, compiled_step

PDL = {dependent_launch.INDUCTOR_OPTION: True}
DEFAULTS = {**PDL, **COMBO_KERNELS}  # what the runner adds to a config's options


@pytest.mark.parametrize(
    ("capability", "expected"), [((8, 0), False), ((8, 9), False), ((9, 0), True), ((10, 0), True), ((12, 0), True)]
)
def test_kernels_launch_dependent_from_hopper_on(capability, expected):
    with on_mocked_gpu(capability):
        assert dependent_launch.dependent_launch(torch.zeros(1)) is expected


def test_the_cpu_and_the_switch_launch_plainly(monkeypatch):
    assert not dependent_launch.dependent_launch(torch.zeros(1))  # Triton's interpreter runs the kernels here
    monkeypatch.setenv(dependent_launch.ENV, "0")
    with on_mocked_gpu((9, 0)):
        assert not dependent_launch.dependent_launch(torch.zeros(1))
    assert dependent_launch.inductor_options() == {}


def compile_arguments(config: CompileConfig) -> dict:
    """What `compiled_step` passes to `torch.compile` for `config`."""
    with mock.patch("torch.compile") as compile_:
        compiled_step(torch.nn.Identity(), config)
    return compile_.call_args.kwargs


def test_compiled_steps_launch_inductors_kernels_dependent_too():
    assert compile_arguments(CompileConfig())["options"] == DEFAULTS  # "reduce-overhead": our graphs capture
    autotune = compile_arguments(CompileConfig(mode="max-autotune"))["options"]
    assert autotune == {**torch._inductor.list_mode_options("max-autotune-no-cudagraphs"), **DEFAULTS}
    assert autotune["max_autotune"]  # the mode still counts, as its options
    own = compile_arguments(CompileConfig(options={dependent_launch.INDUCTOR_OPTION: False, "max_autotune": True}))
    assert own["options"] == {**COMBO_KERNELS, dependent_launch.INDUCTOR_OPTION: False, "max_autotune": True}


def test_other_backends_keep_the_mode_and_the_switch_drops_pdl(monkeypatch):
    eager = compile_arguments(CompileConfig(backend="eager"))
    assert eager["backend"] == "eager" and eager["mode"] is None and "options" not in eager
    monkeypatch.setenv(dependent_launch.ENV, "0")
    plain = compile_arguments(CompileConfig(mode="max-autotune"))["options"]  # the mode as its options, no PDL
    assert plain == {**torch._inductor.list_mode_options("max-autotune-no-cudagraphs"), **COMBO_KERNELS}
