"""The package's layering: one concern per folder, imports pointing one way, and a reference model that loads no
fast path. Read from the sources (every import, at module level or inside a function) and from a fresh interpreter.
"""

import ast
import subprocess
import sys
from pathlib import Path

import transformers_inkling2

PACKAGE = Path(transformers_inkling2.__file__).parent
NAME = "transformers_inkling2"
# Each part may import the parts of lower rank and its own folder, nothing else (the root `__init__` wires them all).
RANKS = {
    "version": 0,
    "configuration_inkling2": 0,
    "cache": 1,
    "processing": 1,
    "modeling": 2,
    "backends": 3,
    "quantization": 4,
    "parallel": 5,
    "generation": 6,
    "dspark": 6,
    "engine": 7,
    "serving": 8,
    "finetuning": 8,
    "tiny": 8,
    "nano": 8,
    "cli": 9,
    "__main__": 10,
}
FAST_PATHS = ("backends", "generation", "engine", "serving", "quantization", "dspark")


def module_name(path: Path) -> str:
    parts = path.relative_to(PACKAGE.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def imported_modules(path: Path, modules: set[str]) -> set[str]:
    """The package modules `path` imports anywhere in its body (relative imports resolved)."""
    name = module_name(path)
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    found = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            targets = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = package.rsplit(".", node.level - 1)[0] if node.level > 1 else package
                base = f"{anchor}.{base}" if base else anchor
            targets = [base, *(f"{base}.{alias.name}" for alias in node.names)]
        else:
            continue
        found.update(target for target in targets if target in modules)
    return found - {name}


def import_graph() -> dict[str, set[str]]:
    paths = {module_name(path): path for path in PACKAGE.rglob("*.py")}
    return {name: imported_modules(path, set(paths)) for name, path in paths.items()}


def part(module: str) -> str:
    return module.split(".")[1] if "." in module else "__init__"


def test_every_module_belongs_to_a_ranked_part():
    unranked = {part(module) for module in import_graph()} - set(RANKS) - {"__init__"}
    assert not unranked, f"give these parts a rank in RANKS: {sorted(unranked)}"


def test_imports_point_one_way():
    upward = [
        f"{module} -> {target}"
        for module, targets in import_graph().items()
        if part(module) != "__init__"
        for target in targets
        if part(target) != part(module) and RANKS.get(part(target), 99) >= RANKS[part(module)]
    ]
    assert not upward, "imports against the layering:\n" + "\n".join(sorted(upward))


def test_no_import_cycle():
    graph = import_graph()
    state: dict[str, str] = {}

    def visit(module: str, trail: list[str]) -> None:
        state[module] = "open"
        for target in sorted(graph[module]):
            assert state.get(target) != "open", "import cycle: " + " -> ".join([*trail, module, target])
            if target not in state:
                visit(target, [*trail, module])
        state[module] = "done"

    for module in sorted(graph):
        if module not in state:
            visit(module, [])


def test_layering_check_finds_an_upward_import(tmp_path, monkeypatch):
    """The graph above is read correctly: an upward import written into a copy of the model is found."""
    source = PACKAGE / "modeling" / "norms.py"
    copy = tmp_path / "norms.py"
    copy.write_text(source.read_text() + "\nfrom ..generation import hooks\n")
    monkeypatch.setattr(sys.modules[__name__], "module_name", lambda path: f"{NAME}.modeling.norms")
    assert f"{NAME}.generation.hooks" in imported_modules(copy, {f"{NAME}.generation.hooks"})


def loaded_after(statement: str) -> set[str]:
    """Modules that `statement` loads in a fresh interpreter beyond those transformers' own model classes load."""
    script = (
        "import sys\n"
        "import transformers\n"
        "from transformers import GenerationMixin, PreTrainedModel\n"
        "from transformers.cache_utils import Cache\n"
        "from transformers.modeling_layers import GradientCheckpointingLayer\n"
        "before = set(sys.modules)\n"
        f"{statement}\n"
        "print('\\n'.join(sorted(set(sys.modules) - before)))\n"
    )
    result = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, check=True)
    return set(result.stdout.split())


def test_the_reference_model_loads_no_fast_path():
    loaded = loaded_after(
        f"import {NAME}.modeling.modeling_inkling2_text, {NAME}.modeling.modeling_inkling2, "
        f"{NAME}.modeling.modeling_inkling2_vision"
    )
    assert f"{NAME}.modeling.modeling_inkling2_text" in loaded
    forbidden = {m for m in loaded if m.startswith(tuple(f"{NAME}.{p}" for p in FAST_PATHS)) or m.startswith("triton")}
    assert not forbidden, f"importing the reference model loaded {sorted(forbidden)}"


def test_a_built_model_has_its_fast_paths_registered():
    """The other side: the package's registries name the fast paths, which a built model then finds."""
    from transformers_inkling2.modeling.interfaces import ATTENTION_BACKENDS, GENERATION_HOOKS, KERNELS

    assert {"eager", "inkling2_flex", "inkling2_triton", "inkling2_decode", "inkling2_flex_decode"} <= set(
        ATTENTION_BACKENDS
    )
    assert {"prompt_convolution", "routed_experts", "relative_logits_layout"} <= set(KERNELS)
    assert {"generate", "compiled_call"} <= set(GENERATION_HOOKS)
