"""The reference modules (`test_common_builtin_*.py`) run transformers' suites on its built-in `inkling2`."""

import sys

import pytest


def require_pristine_transformers():
    """Skips the calling module where `transformers_inkling2` is imported (the repository's conftest imports it):
    it registers its configs, Auto classes and checkpoint renamings for the model type `inkling2` over the
    built-in's, so that the built-in port would be tested with ours in its place."""
    if "transformers_inkling2" in sys.modules:
        pytest.skip(
            "the reference runs without transformers_inkling2 (it replaces the built-in's registrations): "
            "python -m pytest --noconftest tests/common/test_common_builtin_*.py",
            allow_module_level=True,
        )
