"""transformers' own common test suites (`test_modeling_common.py`, `test_configuration_common.py`, ...), fetched at
test time from the transformers source distribution on PyPI, never committed.

`fetch()` downloads the sdist of the installed transformers version once (`pip download transformers==V --no-binary
:all: --no-deps`), extracts its `tests/` folder into `.cache/transformers-tests-V/tests/` (git ignores `.cache/`), lays
the few files those suites import from transformers' repository but the sdist lacks as small stand-ins (below), and
downloads `parameterized` (which the suites import; it is no dependency of ours) into `.cache/.../site/`.
`load(name)` imports `tests.<name>` from there, as transformers' own model tests do: the cache is laid out like
transformers' repository (`tests/`, `utils/`, `src/transformers/`), so the suites' relative imports and the paths
they compute from `__file__` hold.

Run `python tests/common/transformers_suites.py` to fetch (`.ci/run` does, before the tests). A test module calls
`require_suites()` at import: without the cache and without a way to fetch it (no network), its tests skip, saying so.
"""

from __future__ import annotations

import importlib
import os
import shutil
import subprocess
import sys
import tarfile
import tempfile
import zipfile
from pathlib import Path

import transformers

VERSION = transformers.__version__
PARAMETERIZED = "parameterized==0.9.0"
REPO_ROOT = Path(__file__).resolve().parents[2]
CACHE_ROOT = REPO_ROOT / ".cache" / f"transformers-tests-{VERSION}"
_MARKER = CACHE_ROOT / "FETCHED"
# bumped when the stand-ins or the layout change, so that an older cache is laid anew
_LAYOUT = "3"

# Files the suites import from transformers' repository that its sdist does not ship. Each is the least that lets the
# suites import and run: what they stand in for is either not run here (generate, export and distributed tests have
# their own homes: our generate() has its own tests) or needs the Hub (no network on these machines).
STAND_INS = {
    "tests/__init__.py": "",
    # `test_modeling_common.py` imports the generation mixin to check that generative models' testers inherit it
    "tests/generation/__init__.py": "",
    "tests/generation/test_utils.py": '''"""Stand-in: the sdist has no tests/generation/.
No generate() tests run from here."""


class GenerationTesterMixin:
    pass
''',
    "tests/exporters/__init__.py": "",
    "tests/exporters/test_export.py": '''"""Stand-in: the sdist has no tests/exporters/.
No torch.export tests run from here."""


class ExportTesterMixin:
    pass
''',
    "tests/utils/__init__.py": "",
    # `ConfigTester.check_config_arguments_init`: one non-default value for each attribute of PreTrainedConfig
    "tests/utils/test_configuration_utils.py": '''"""Stand-in: the sdist has no tests/utils/.
Non-default values of PreTrainedConfig's own attributes."""

config_common_kwargs = {
    "return_dict": False,
    "output_hidden_states": True,
    "output_attentions": True,
    "dtype": "float16",
    "chunk_size_feed_forward": 5,
    "architectures": ["BertModel"],
    "id2label": {0: "label"},
    "label2id": {"label": "0"},
    "problem_type": "regression",
}
''',
    # `test_pipeline_mixin.py` reads the Hub's tiny-model summary: none is known here, so its pipeline tests skip
    "tests/utils/tiny_model_summary.json": "{}\n",
    "tests/distributed_testing_utils.py": '''"""Stand-in: the sdist has no tests/distributed_testing_utils.py.
Multi-process tests skip."""

import unittest


def run_distributed(*args, **kwargs):
    raise unittest.SkipTest("multi-process tests need transformers' distributed_testing_utils (not in the sdist)")
''',
    # `test_processing_common.py` / `test_image_processing_common.py`: fixtures are files on the Hub, left as URLs
    "utils/fetch_hub_objects_for_ci.py": '''"""Stand-in: transformers' utils/ is not in the sdist.
No Hub fixtures are fetched: URLs stay URLs."""


def url_to_local_path(url, return_url_if_not_found=True):
    return url
''',
    # `TokenizerTesterMixin.setUpClass` reads a sample text (transformers' own is not in the sdist): a few lines of ours
    "tests/fixtures/sample_text.txt": (
        "The tokenizer tests read a few lines of plain text.\n\n"
        "They encode it, decode it again and compare, with and without special tokens.\n"
        "Some lines carry numbers like 1984 or 3.14, and some carry punctuation: commas, dashes - and quotes.\n\n"
        "A short line.\n"
        "A longer line follows it, long enough that a tokenizer splits it into a good many pieces of different "
        "lengths, which is what the batch and padding tests need.\n"
    ),
    # `direct_transformers_import(<this>)` in the suites: an empty module leaves the installed transformers in place
    "src/transformers/__init__.py": "",
}


class SuitesUnavailable(RuntimeError):
    pass


def is_fetched() -> bool:
    return _MARKER.is_file() and _MARKER.read_text().strip() == _LAYOUT


def _pip(*args: str, timeout: int) -> None:
    command = [
        sys.executable,
        "-m",
        "pip",
        "download",
        "--disable-pip-version-check",
        "--no-input",
        "--retries",
        "1",
        "--timeout",
        "20",
        "--no-deps",
        *args,
    ]
    try:
        proc = subprocess.run(command, capture_output=True, text=True, timeout=timeout)
    except (OSError, subprocess.TimeoutExpired) as error:
        raise SuitesUnavailable(f"`pip download {' '.join(args)}` did not finish: {error}") from error
    if proc.returncode != 0:
        tail = (proc.stderr or proc.stdout).strip().splitlines()[-3:]
        raise SuitesUnavailable(f"`pip download {' '.join(args)}` failed: {' | '.join(tail)}")


def _extract_tests(sdist: Path, into: Path) -> None:
    prefix = f"transformers-{VERSION}/tests/"
    with tarfile.open(sdist) as archive:
        members = [m for m in archive.getmembers() if m.name.startswith(prefix) and (m.isfile() or m.isdir())]
        if not any(m.name.endswith("/test_modeling_common.py") for m in members):
            raise SuitesUnavailable(f"{sdist.name} has no tests/test_modeling_common.py")
        for member in members:
            relative = Path(member.name[len(prefix) :])
            if relative.is_absolute() or ".." in relative.parts:
                raise SuitesUnavailable(f"{sdist.name}: unexpected path {member.name}")
            target = into / "tests" / relative
            if member.isdir():
                target.mkdir(parents=True, exist_ok=True)
                continue
            target.parent.mkdir(parents=True, exist_ok=True)
            with archive.extractfile(member) as source, open(target, "wb") as out:
                shutil.copyfileobj(source, out)


def fetch(timeout: int = 300) -> Path:
    """Fetches the suites into CACHE_ROOT once (a no-op when they are there); returns CACHE_ROOT. Builds in a temporary
    folder beside it and renames it into place, so that concurrent runs never see half a cache."""
    if is_fetched():
        return CACHE_ROOT
    CACHE_ROOT.parent.mkdir(parents=True, exist_ok=True)
    build = Path(tempfile.mkdtemp(prefix=f".{CACHE_ROOT.name}-", dir=CACHE_ROOT.parent))
    try:
        downloads = build / "downloads"
        _pip(f"transformers=={VERSION}", "--no-binary", ":all:", "-d", str(downloads), timeout=timeout)
        sdist = next(downloads.glob(f"transformers-{VERSION}.tar.gz"), None)
        if sdist is None:
            raise SuitesUnavailable(f"pip download left no transformers-{VERSION}.tar.gz")
        _extract_tests(sdist, build)
        for relative, text in STAND_INS.items():
            path = build / relative
            path.parent.mkdir(parents=True, exist_ok=True)
            path.write_text(text)
        _pip(PARAMETERIZED, "--only-binary", ":all:", "-d", str(downloads), timeout=timeout)
        for wheel in downloads.glob("parameterized-*.whl"):
            with zipfile.ZipFile(wheel) as archive:
                archive.extractall(build / "site")
        shutil.rmtree(downloads)
        (build / "FETCHED").write_text(_LAYOUT + "\n")
        if is_fetched():  # another run finished first
            return CACHE_ROOT
        if CACHE_ROOT.exists():  # an older layout
            shutil.rmtree(CACHE_ROOT, ignore_errors=True)
        try:
            os.rename(build, CACHE_ROOT)
        except OSError:
            if not is_fetched():  # (else another run renamed its copy into place first)
                raise
        return CACHE_ROOT
    finally:
        shutil.rmtree(build, ignore_errors=True)


_failure: str | None = None


def ensure() -> None:
    """Fetches if needed (once per process) and puts the suites on sys.path; raises SuitesUnavailable."""
    global _failure
    if _failure is not None:
        raise SuitesUnavailable(_failure)
    try:
        fetch()
    except SuitesUnavailable as error:
        _failure = str(error)
        raise
    for path in (CACHE_ROOT / "site", CACHE_ROOT):
        if str(path) not in sys.path:
            sys.path.insert(0, str(path))
    # `tests` must be the cache's package: a namespace package of another `tests/` folder (this repository's, which
    # has no __init__.py) would hide it
    loaded = sys.modules.get("tests")
    if loaded is not None and Path(getattr(loaded, "__file__", None) or "/").parent != CACHE_ROOT / "tests":
        for name in [n for n in sys.modules if n == "tests" or n.startswith("tests.")]:
            del sys.modules[name]


def require_suites():
    """For a test module's top: skips the whole module, saying why, when the suites cannot be had."""
    import pytest

    try:
        ensure()
    except SuitesUnavailable as error:
        reason = f"transformers' common test suites are not fetched and cannot be ({error})"
        pytest.skip(reason, allow_module_level=True)


def load(name: str):
    """`load("test_modeling_common")` -> the module `tests.test_modeling_common` of the fetched suites."""
    ensure()
    return importlib.import_module(f"tests.{name}")


if __name__ == "__main__":
    try:
        print(f"transformers {VERSION} common test suites in {fetch()}")
    except SuitesUnavailable as error:
        sys.exit(f"transformers' common test suites could not be fetched: {error}")
