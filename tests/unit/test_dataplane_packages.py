"""The data plane's `balancers` and `mixing` packages: modules import one way, share no private names."""

from __future__ import annotations

import ast
import graphlib
import subprocess
import sys
from pathlib import Path

import pytest

import megascale_data_ext.dataplane as dataplane

DATAPLANE = Path(dataplane.__file__).parent


def _sibling_imports(package: str) -> dict[str, dict[str, set[str]]]:
    """Per module of `package`: the sibling modules it imports, with the names taken from each."""
    prefix = f"megascale_data_ext.dataplane.{package}."
    graph: dict[str, dict[str, set[str]]] = {}
    for path in sorted((DATAPLANE / package).glob("*.py")):
        uses = graph.setdefault(path.stem, {})
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ImportFrom) and node.module and node.module.startswith(prefix):
                uses.setdefault(node.module.removeprefix(prefix), set()).update(a.name for a in node.names)
    return graph


@pytest.mark.parametrize("package", ["balancers", "mixing"])
def test_modules_import_one_way_and_take_no_private_names(package: str) -> None:
    graph = _sibling_imports(package)
    deps = {mod: set(uses) for mod, uses in graph.items() if mod != "__init__"}
    list(graphlib.TopologicalSorter(deps).static_order())  # raises CycleError on a cycle
    private = {(mod, dep, name) for mod, uses in graph.items() for dep, names in uses.items()
               for name in names if name.startswith("_")}
    assert not private
    init = ast.parse((DATAPLANE / package / "__init__.py").read_text())
    assert not [n for n in init.body if isinstance(n, ast.FunctionDef) and n.name == "__getattr__"]  # no lazy shim


@pytest.mark.parametrize(("package", "module", "absent"), [
    ("balancers", "levels", ()),
    ("mixing", "schedules", ("mixer", "build")),
])
def test_module_imports_without_its_package_init(package: str, module: str, absent: tuple[str, ...]) -> None:
    """Import one module under an empty package: only what it really needs gets loaded."""
    name = f"megascale_data_ext.dataplane.{package}"
    code = (
        "import sys, types\n"
        f"pkg = types.ModuleType({name!r}); pkg.__path__ = [{str(DATAPLANE / package)!r}]\n"
        f"sys.modules[{name!r}] = pkg\n"
        f"import {name}.{module}\n"
        f"loaded = sorted(m for m in sys.modules if m.startswith({name + '.'!r}))\n"
        f"assert not {{{name!r} + '.' + m for m in {absent!r}}} & set(loaded), loaded\n"
    )
    subprocess.run([sys.executable, "-c", code], check=True)


def test_the_readmes_data_plane_snippet_runs_as_written(capsys) -> None:
    """README's "The data plane in Python" block, executed: it had used a `summary` it never made."""
    import contextlib
    import io
    import re
    from pathlib import Path

    readme = (Path(__file__).resolve().parents[2] / "README.md").read_text()
    section = readme.split("## The data plane in Python", 1)[1]
    code = re.search(r"```python\n(.*?)```", section, re.S).group(1)
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        exec(compile(code, "README.md (The data plane in Python)", "exec"), {})
    assert "bucket cost max/mean" in out.getvalue() and "digraph" in out.getvalue()
