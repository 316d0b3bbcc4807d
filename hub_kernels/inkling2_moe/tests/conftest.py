"""Pytest hooks of the kernel's tests: the `gpu` marker (skipped without CUDA) and a current build.

The helpers the test modules share live in `moe_kernel_helpers.py` (imported by name: pytest puts this folder on
`sys.path`), not here: run next to another test folder, `from conftest import ...` would find whichever conftest
was imported last.
"""

from pathlib import Path

import pytest
import torch
from moe_kernel_helpers import ensure_built

HERE = Path(__file__).resolve().parent


def pytest_configure(config):
    config.addinivalue_line("markers", "gpu: needs a CUDA GPU (skipped elsewhere)")


def pytest_collection_modifyitems(config, items):
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA GPU")
    for item in items:
        if "gpu" in item.keywords and HERE in item.path.parents:  # this hook sees every folder's tests
            item.add_marker(skip)


@pytest.fixture(scope="session", autouse=True)
def built_kernel():
    """`build/` as the sources are now (built here when missing or stale): every test loads the build."""
    return ensure_built()
