"""Builds the noarch hub kernels in this folder: `<kernel>/build/torch-<backend>/<name>/` and its `metadata.json`.

kernel-builder (Nix) builds Hub kernels from their `build.toml`. For a noarch kernel (`[torch-noarch]`: pure Python,
here Triton kernels compiled just in time) its build is the Python package of `torch-ext/<name>/`, copied once per
backend that `[general] backends` lists, next to a `metadata.json` that `kernels` reads when it loads the variant.
kernel-builder is not available here, so this script does that step with the standard library alone (setup.py runs
it too, for wheels). Kernels with compiled code (`[torch]`, `[kernel.*]`) need kernel-builder itself.

    python hub_kernels/build.py [KERNEL_DIR ...]      default: every folder here that holds a build.toml

`build/` is a build product (git-ignored); the variant is replaced as a whole. Each variant's `id` (the module name
`kernels` imports it under) ends with a digest of `build.toml` and the sources, so a build can tell whether it is
current (`is_current`, `ensure_built`).
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import shutil
import sys
import tempfile
from pathlib import Path

try:
    import tomllib
except ModuleNotFoundError:  # Python 3.10: `kernels` depends on tomli there, and setuptools (wheel builds) vendors it
    try:
        import tomli as tomllib
    except ModuleNotFoundError:
        from setuptools.extern import tomli as tomllib  # setuptools < 71

HUB_KERNELS = Path(__file__).resolve().parent
NOARCH_BACKENDS = ("cpu", "cuda", "metal", "rocm", "xpu")  # the noarch variants `kernels` resolves: torch-<backend>
KERNEL_NAME = re.compile(r"^[a-z][-a-z0-9]*[a-z0-9]$")
DEFAULT_PYEXT = ("py", "pyi")


class BuildError(RuntimeError):
    pass


def read_config(kernel_dir: Path) -> dict:
    """`build.toml`, checked for what this script can build."""
    path = kernel_dir / "build.toml"
    if not path.is_file():
        raise BuildError(f"{kernel_dir} has no build.toml")
    config = tomllib.loads(path.read_text(encoding="utf-8"))
    general = config.get("general", {})
    name, backends = general.get("name", ""), general.get("backends", [])
    if not KERNEL_NAME.match(name):
        raise BuildError(f"{path}: [general] name {name!r} must match {KERNEL_NAME.pattern}")
    if not general.get("license"):
        raise BuildError(f"{path}: [general] license is missing (kernels refuses a metadata.json without it)")
    if "torch-noarch" not in config or "torch" in config or "kernel" in config:
        raise BuildError(f"{path}: only [torch-noarch] kernels (pure Python) build here; this one needs kernel-builder")
    if not backends or set(backends) - set(NOARCH_BACKENDS):
        raise BuildError(f"{path}: [general] backends {backends} must be a non-empty subset of {NOARCH_BACKENDS}")
    return config


def python_name(config: dict) -> str:
    return config["general"]["name"].replace("-", "_")


def source_files(kernel_dir: Path, config: dict) -> list[Path]:
    """The package files under `torch-ext/<name>/` whose extension `[torch-noarch] pyext` lists, relative to it."""
    package = kernel_dir / "torch-ext" / python_name(config)
    if not (package / "__init__.py").is_file():
        raise BuildError(f"{package} has no __init__.py")
    extensions = {f".{ext}" for ext in config["torch-noarch"].get("pyext", DEFAULT_PYEXT)}
    return sorted(
        path.relative_to(package)
        for path in package.rglob("*")
        if path.is_file() and path.suffix in extensions and "__pycache__" not in path.parts
    )


def source_digest(kernel_dir: Path, config: dict | None = None) -> str:
    """A digest of `build.toml` and every source file (names and bytes)."""
    config = config or read_config(kernel_dir)
    package = kernel_dir / "torch-ext" / python_name(config)
    digest = hashlib.sha256((kernel_dir / "build.toml").read_bytes())
    for relative in source_files(kernel_dir, config):
        digest.update(relative.as_posix().encode() + b"\0" + (package / relative).read_bytes() + b"\0")
    return digest.hexdigest()[:12]


def variant_metadata(config: dict, backend: str, digest: str) -> dict:
    general = config["general"]
    metadata = {
        "name": general["name"],
        "id": f"_{python_name(config)}_{backend}_{digest}",
        "version": general.get("version"),
        "license": general.get("license"),
        "python-depends": list(general.get("python-depends", [])),
        "backend": {"type": backend},
    }
    return {key: value for key, value in metadata.items() if value is not None}


def is_current(kernel_dir: Path) -> bool:
    """Whether `build/` holds every variant, built from the sources as they are now."""
    config = read_config(kernel_dir)
    digest = source_digest(kernel_dir, config)
    for backend in config["general"]["backends"]:
        metadata = kernel_dir / "build" / f"torch-{backend}" / "metadata.json"
        try:
            built = json.loads(metadata.read_text(encoding="utf-8"))
        except (OSError, ValueError):
            return False
        if built.get("id") != variant_metadata(config, backend, digest)["id"]:
            return False
    return True


def build(kernel_dir: Path, out: Path | None = None) -> Path:
    """Writes the variants into `out` (default `<kernel_dir>/build`), replacing it; returns it.

    The build is assembled in a temporary folder beside `out` and moved into place in one rename, so that a process
    loading the kernel never sees half a build. When two processes build at once, the first rename wins."""
    kernel_dir = Path(kernel_dir).resolve()
    config = read_config(kernel_dir)
    out = Path(out).resolve() if out else kernel_dir / "build"
    out.parent.mkdir(parents=True, exist_ok=True)
    package = kernel_dir / "torch-ext" / python_name(config)
    files = source_files(kernel_dir, config)
    digest = source_digest(kernel_dir, config)
    staging = Path(tempfile.mkdtemp(prefix=".build-", dir=out.parent))
    try:
        for backend in config["general"]["backends"]:
            variant = staging / f"torch-{backend}"
            for relative in files:
                (variant / python_name(config) / relative).parent.mkdir(parents=True, exist_ok=True)
                shutil.copyfile(package / relative, variant / python_name(config) / relative)
            metadata = json.dumps(variant_metadata(config, backend, digest), indent=2) + "\n"
            (variant / "metadata.json").write_text(metadata, encoding="utf-8")
        try:
            os.rename(staging, out)
        except OSError:  # `out` exists: an older build (replace it) or another process's, just finished
            if out == kernel_dir / "build" and is_current(kernel_dir):
                return out
            retired = Path(tempfile.mkdtemp(prefix=".old-build-", dir=out.parent))
            os.rename(out, retired / out.name)
            os.rename(staging, out)
            shutil.rmtree(retired, ignore_errors=True)
    finally:
        shutil.rmtree(staging, ignore_errors=True)
    return out


def ensure_built(kernel_dir: Path) -> Path:
    """`<kernel_dir>/build`, built first when it is missing or older than the sources."""
    kernel_dir = Path(kernel_dir).resolve()
    if not is_current(kernel_dir):
        build(kernel_dir)
    return kernel_dir / "build"


def kernel_dirs() -> list[Path]:
    return sorted(path.parent for path in HUB_KERNELS.glob("*/build.toml"))


def main(argv: list[str]) -> int:
    targets = [Path(arg) for arg in argv] or kernel_dirs()
    for kernel_dir in targets:
        try:
            out = build(kernel_dir)
        except BuildError as error:
            print(f"error: {error}", file=sys.stderr)
            return 1
        variants = ", ".join(sorted(path.name for path in out.iterdir() if path.is_dir()))
        print(f"built {out} ({variants})")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
