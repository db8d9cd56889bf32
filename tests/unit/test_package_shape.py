"""The package's shape: no import cycle anywhere, no module over 500 lines, a lazy public root."""

from __future__ import annotations

import ast
import graphlib
import subprocess
import sys
from pathlib import Path

import megascale_data_ext

PACKAGE = Path(megascale_data_ext.__file__).parent
MAX_LINES = 500


def _module_name(path: Path) -> str:
    parts = path.relative_to(PACKAGE.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _modules() -> dict[str, Path]:
    return {_module_name(p): p for p in sorted(PACKAGE.rglob("*.py"))}


def _type_checking_lines(tree: ast.AST) -> set[int]:
    lines: set[int] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test):
            for sub in node.body:
                lines.update(range(sub.lineno, (sub.end_lineno or sub.lineno) + 1))
    return lines


def import_graph() -> dict[str, set[str]]:
    """Module -> the package modules it imports (at any depth of its code, not under TYPE_CHECKING)."""
    modules = _modules()
    graph: dict[str, set[str]] = {}
    for name, path in modules.items():
        tree = ast.parse(path.read_text())
        skip = _type_checking_lines(tree)
        deps = graph.setdefault(name, set())
        for node in ast.walk(tree):
            if getattr(node, "lineno", None) in skip:
                continue
            if isinstance(node, ast.Import):
                targets = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
                # `from pkg import mod` imports the module pkg.mod; `from mod import name` imports mod
                targets = [f"{node.module}.{a.name}" if f"{node.module}.{a.name}" in modules else node.module
                           for a in node.names]
            else:
                continue
            deps.update(t for t in targets if t in modules and t != name)
    return graph


def test_no_import_cycle_in_the_package() -> None:
    graph = import_graph()
    assert len(graph) > 60
    list(graphlib.TopologicalSorter(graph).static_order())  # raises CycleError naming the cycle


def test_no_module_over_500_lines() -> None:
    sizes = {name: len(path.read_text().splitlines()) for name, path in _modules().items()}
    assert {n: s for n, s in sizes.items() if s > MAX_LINES} == {}


def test_public_surface_is_sorted_and_resolves() -> None:
    names = megascale_data_ext.__all__
    assert names == sorted(names)
    for required in ("ClientPlaceTree", "DGraph", "DataService", "InProcessService", "Client", "Vanilla",
                     "LLMBalance", "VLMBalance", "load_config", "install", "Stateful", "ServiceTopology"):
        assert required in names
    for name in names:
        assert getattr(megascale_data_ext, name) is not None
    from megascale_data_ext import ClientPlaceTree
    from megascale_data_ext.dataplane.placetree import ClientPlaceTree as Direct

    assert ClientPlaceTree is Direct


def test_the_root_and_the_actor_modules_load_neither_torch_nor_ray() -> None:
    """Every actor imports the package root; it must stay as light as the data plane."""
    code = (
        "import sys, megascale_data_ext\n"
        "from megascale_data_ext import ClientPlaceTree, DGraph, Stateful\n"
        "import megascale_data_ext.runtime.planner, megascale_data_ext.runtime.constructor\n"
        "heavy = sorted({'torch', 'ray', 'hydra', 'megatron'} & {m.split('.')[0] for m in sys.modules})\n"
        "assert not heavy, heavy\n"
    )
    subprocess.run([sys.executable, "-c", code], check=True)


def test_layers_import_only_downwards() -> None:
    """The data plane needs nothing of the runtime or Megatron; the integration a Megatron user
    imports (`megatron/`) needs nothing of the reference trainer (`trainer/`)."""
    graph = import_graph()

    def reaching(layer: str, forbidden: tuple[str, ...]) -> dict[str, list[str]]:
        return {m: sorted(d for d in deps if d.startswith(forbidden))
                for m, deps in graph.items() if m.startswith(layer) and any(d.startswith(forbidden) for d in deps)}

    pkg = "megascale_data_ext."
    assert reaching(pkg + "dataplane", (pkg + "runtime", pkg + "megatron", pkg + "trainer", pkg + "sources")) == {}
    assert reaching(pkg + "megatron", (pkg + "trainer", pkg + "commands")) == {}
    assert reaching(pkg + "runtime", (pkg + "trainer", pkg + "commands")) == {}
