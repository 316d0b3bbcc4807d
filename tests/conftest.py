"""Pytest hooks and fixtures shared by every test folder: the `gpu` marker (skipped without CUDA).

Shared builders and helpers (tiny configs, our model against transformers' built-in `inkling2`, greedy references,
the Triton-interpreter runner) live in `inkling2_helpers.py`, which every test module imports by name: the root
`pytest.ini` puts this folder on `sys.path` (`pythonpath = tests`). Test modules never import each other or this file.
"""

import pytest
import torch

import transformers_inkling2  # noqa: F401  (registers our classes)


def pytest_configure(config):
    config.addinivalue_line("markers", "gpu: needs a CUDA GPU (skipped elsewhere)")


def pytest_collection_modifyitems(config, items):
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA GPU")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)
