"""The package's layers, read from the source (ast): imports flow one way.

Every module of specdec_kernels is parsed; its imports of the package become edges between
units (a top-level module or subpackage). The test fails on an edge the layer table below does
not allow, on a cycle between modules, on a function-local import of the package (an import
inside a function is for optional third-party dependencies only), and on a private name (or
private module) imported from another package.
"""
from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parent.parent / "specdec_kernels"

# unit -> the units it may import. Kernels -> op registration -> public API -> integrations and
# applications; the reference (with the Philox definition) is the bottom, torch-only.
LAYERS = {
    "reference": set(),
    "tree_utils": set(),
    "testing": set(),
    "_C": set(),
    "checks": {"tree_utils"},
    "triton": {"reference"},
    "_ops": {"_C", "checks", "reference", "triton"},
    "backends": {"_ops"},
    "chain": {"_ops", "backends", "checks", "reference"},
    "tree": {"_ops", "backends", "checks", "reference"},
    "distributed": {"checks", "reference", "triton"},
    "__init__": {"_ops", "backends", "chain", "tree", "tree_utils", "reference"},
    "integrations": {"chain", "reference"},
    "hf": {"chain", "tree", "tree_utils", "reference"},
    "demo": {"__init__", "backends", "testing"},
    "generate": {"hf"},
}


def _modules() -> dict[str, Path]:
    """Dotted module name (relative to the package) -> file."""
    out = {}
    for path in sorted(PACKAGE.rglob("*.py")):
        parts = list(path.relative_to(PACKAGE).with_suffix("").parts)
        if parts[-1] == "__init__" and len(parts) > 1:
            parts = parts[:-1]
        out[".".join(parts)] = path
    return out


MODULES = _modules()


def _is_package(name: str) -> bool:
    return MODULES[name].name == "__init__.py" and name != "__init__"


def _resolve(module: str, node: ast.ImportFrom) -> list[str]:
    """The package modules an ``import from`` names (relative or absolute), as dotted names."""
    if node.level == 0:
        if not (node.module or "").startswith("specdec_kernels"):
            return []
        base = node.module.split(".")[1:]
    else:
        here = module.split(".") if module != "__init__" else []
        if not _is_package(module):
            here = here[:-1]
        base = here[:len(here) - (node.level - 1)] + (node.module.split(".") if node.module else [])
    targets = []
    for alias in node.names:
        candidate = ".".join(base + [alias.name])
        targets.append(candidate if candidate in MODULES or alias.name == "_C" else ".".join(base) or "__init__")
    return targets


def _unit(name: str) -> str:
    return name.split(".")[0]


def _package(name: str) -> str:
    """The package a module belongs to ("" = specdec_kernels itself)."""
    if name in MODULES and _is_package(name):
        return name
    return ".".join(name.split(".")[:-1])


def _imports(module: str):
    """(target module, imported name, function-local, line) for each import of the package."""
    tree = ast.parse(MODULES[module].read_text())
    found = []

    def visit(node, in_function: bool):
        for child in ast.iter_child_nodes(node):
            local = in_function or isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda))
            if isinstance(child, ast.ImportFrom):
                for target, alias in zip(_resolve(module, child), child.names):
                    found.append((target, alias.name, in_function, child.lineno))
            elif isinstance(child, ast.Import):
                for alias in child.names:
                    if alias.name.startswith("specdec_kernels"):
                        name = ".".join(alias.name.split(".")[1:]) or "__init__"
                        found.append((name, alias.name, in_function, child.lineno))
            visit(child, local)

    visit(tree, False)
    return found


EDGES = {module: _imports(module) for module in MODULES}


def layer_violations(module: str, edges) -> list[str]:
    unit = _unit(module)
    return [f"{module}:{line} imports {target}: {unit} may import only {sorted(LAYERS[unit])}"
            for target, _, _, line in edges if _unit(target) != unit and _unit(target) not in LAYERS[unit]]


def local_import_violations(module: str, edges) -> list[str]:
    return [f"{module}:{line} imports {target} inside a function" for target, _, local, line in edges if local]


def private_violations(module: str, edges) -> list[str]:
    """``from .other_package import _name`` (or a private module of another package) couples a
    module to another package's internals: share it under a public name instead."""
    found = []
    for target, name, _, line in edges:
        if _package(target) == _package(module) or name == "_C":
            continue
        private = [part for part in target.split(".") + [name] if part.startswith("_") and part != "__init__"]
        if private:
            found.append(f"{module}:{line} imports the private {'.'.join(private)} of {target}")
    return found


def find_cycle(graph: dict[str, set[str]]) -> list[str] | None:
    state: dict[str, int] = {}

    def walk(node, path):
        state[node] = 1
        for nxt in sorted(graph.get(node, ())):
            if state.get(nxt) == 1:
                return path[path.index(nxt):] + [nxt]
            if nxt not in state:
                cycle = walk(nxt, path + [nxt])
                if cycle:
                    return cycle
        state[node] = 2
        return None

    for node in sorted(graph):
        if node not in state:
            cycle = walk(node, [node])
            if cycle:
                return cycle
    return None


def test_every_unit_has_a_layer():
    assert {_unit(m) for m in MODULES} | {"_C"} <= set(LAYERS), set(map(_unit, MODULES)) - set(LAYERS)


@pytest.mark.parametrize("module", sorted(MODULES))
def test_imports_follow_the_rules(module):
    edges = EDGES[module]
    problems = layer_violations(module, edges) + local_import_violations(module, edges) + \
        private_violations(module, edges)
    assert not problems, "\n".join(problems)


def test_no_import_cycle():
    graph = {m: {t for t, _, _, _ in EDGES[m] if t in MODULES and t != m} for m in MODULES}
    cycle = find_cycle(graph)
    assert cycle is None, "import cycle: " + " -> ".join(cycle)


def test_the_rules_catch_bad_imports():
    """Negative controls: each rule reports a hand-made violation."""
    up = ("triton.chain", "rejection_sample_triton", False, 1)
    assert layer_violations("reference.chain", [up])                       # the oracle importing a kernel
    assert local_import_violations("chain", [("_ops", "draw_seeds", True, 1)])
    assert private_violations("integrations.vllm", [("_ops", "triton_call", False, 1)])
    assert private_violations("distributed.vocab_parallel", [("triton.common", "_helper", False, 1)])
    assert not private_violations("triton.tree", [("triton.common", "_helper", False, 1)])  # same package
    assert find_cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}}) == ["a", "b", "c", "a"]
    assert find_cycle({"a": {"b"}, "b": set()}) is None
    bad = ast.parse("from ..triton import chain\n").body[0]
    assert _resolve("reference.chain", bad) == ["triton.chain"]


def test_library_imports_without_transformers():
    """The kernel library (everything but ``hf``) imports with transformers unavailable."""
    code = ("import sys; sys.modules['transformers'] = None\n"
            "import specdec_kernels, specdec_kernels.distributed, specdec_kernels.integrations.vllm, "
            "specdec_kernels.testing, specdec_kernels.tree_utils\n"
            "print('ok')")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          cwd=PACKAGE.parent, timeout=300)
    assert done.returncode == 0 and "ok" in done.stdout, done.stderr[-2000:]
