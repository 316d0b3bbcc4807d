"""`benchmarks/decode.py --compare`: how a setting is read and applied, checked on CPU so that a malformed setting
fails here rather than on a lent GPU (the benchmark itself needs one)."""

import importlib.util
import os
import sys
from pathlib import Path
from unittest import mock

import pytest

BENCHMARKS = Path(__file__).resolve().parents[1] / "benchmarks"


@pytest.fixture(scope="module")
def decode():
    """benchmarks/decode.py as a module; afterwards the benchmarks' folder and modules (`attention`, ...), which it
    puts on the path, are taken off again so that no other test imports them by accident."""
    path = list(sys.path)
    spec = importlib.util.spec_from_file_location("decode_benchmark", BENCHMARKS / "decode.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    yield module
    sys.path[:] = path
    for name, loaded in list(sys.modules.items()):
        if BENCHMARKS in Path(getattr(loaded, "__file__", None) or "/").parents:
            del sys.modules[name]


@pytest.mark.parametrize(
    "setting, switches, options",
    [
        ("base", {}, {}),
        ("INKLING2_FUSED_KEY_VALUE_STEP=1", {"INKLING2_FUSED_KEY_VALUE_STEP": "1"}, {}),
        ("combo_kernels=True", {}, {"combo_kernels": True}),
        ("A_SWITCH=0,combo_kernels=False,B_SWITCH=1,max_fusion_size=-4",
         {"A_SWITCH": "0", "B_SWITCH": "1"}, {"combo_kernels": False, "max_fusion_size": -4}),
    ],
)  # fmt: skip
def test_a_setting_is_switches_and_inductor_options(decode, setting, switches, options):
    assert decode.setting_parts(setting) == (switches, options)


@pytest.mark.parametrize("setting", ["FOO", "A=1,", "=1", "A=1,combo_kernels"])
def test_a_malformed_setting_is_refused_before_the_gpu_is_asked_for(decode, setting):
    with mock.patch.object(sys, "argv", ["decode.py", "--per-layer", "nvfp4", "--compare", "base", setting]):
        with pytest.raises(SystemExit) as exited:
            decode.main()
    assert "is not NAME=VALUE or key=value" in str(exited.value.code)


def test_switches_are_set_inside_and_restored_after(decode, monkeypatch):
    monkeypatch.setenv("INKLING2_TEST_KEPT", "before")
    monkeypatch.delenv("INKLING2_TEST_NEW", raising=False)
    with decode.environment_set({"INKLING2_TEST_KEPT": "inside", "INKLING2_TEST_NEW": "1"}):
        assert os.environ["INKLING2_TEST_KEPT"] == "inside" and os.environ["INKLING2_TEST_NEW"] == "1"
    assert os.environ["INKLING2_TEST_KEPT"] == "before" and "INKLING2_TEST_NEW" not in os.environ


@pytest.mark.parametrize(
    "arguments", [["--readout", "--graphs-only"], ["--per-layer", "nvfp4", "--compare", "combo_kernels=False",
                                                   "--graphs-only"]],
)  # fmt: skip
def test_graphs_only_goes_with_per_layer_and_switches_only(decode, arguments):
    """Uncompiled captures are the per-layer parts' (slope and `--compare`), and have no inductor options to set."""
    with mock.patch.object(sys, "argv", ["decode.py", *arguments]):
        with pytest.raises(SystemExit) as exited:
            decode.main()
    assert "--graphs-only goes with --per-layer" in str(exited.value.code)
