"""No module of ``sbx`` or ``bench`` imports, directly or through others, a module that imports it back.

The graph is grimp's (the library under import-linter), with every import counted: at module level, inside a
function, and under ``if TYPE_CHECKING:`` (a type-only import still ties the two modules together). One edge is
added to grimp's: ``from P import x`` counts as importing the package ``P`` too, also when ``x`` is a submodule
(grimp records only ``P.x`` then): the statement looks ``x`` up in ``P``'s namespace, so when ``P``'s ``__init__``
loads the importer (as ``sbx.sdk`` loads its client classes), that is a circle. A folder of modules without an
``__init__.py`` would be left out of grimp's graph unseen, so every importable module file must be in it.

The check runs on the tree and, with one deliberate circle added, on a copy of it (each of those must fail naming
the circle's modules).
"""

from __future__ import annotations

import json
import re
import shutil
import subprocess
import sys
from collections import deque
from collections.abc import Iterable
from pathlib import Path

import grimp
import pytest

ROOT = Path(__file__).resolve().parents[2]
PACKAGES = ("sbx", "bench")
FROM_IMPORT = re.compile(r"\s*from\s+(\.*)([\w.]*)\s+import\b")


def _from_module(importer: str, is_package: bool, line: str) -> str | None:
    """The module a ``from M import ...`` line of ``importer`` names as ``M`` (relative dots resolved); None for
    another kind of import."""
    m = FROM_IMPORT.match(line)
    if not m:
        return None
    dots, name = m.groups()
    if not dots:
        return name
    base = importer.split(".")
    if not is_package:
        base = base[:-1]
    if len(dots) > 1:
        base = base[:-(len(dots) - 1)]
    return ".".join([*base, name] if name else base)


def import_edges(graph: grimp.ImportGraph) -> dict[str, set[str]]:
    """Importer -> the modules it imports, from ``graph`` plus the package of each ``from P import x`` (module
    docstring)."""
    edges: dict[str, set[str]] = {m: set() for m in graph.modules}
    for importer in graph.modules:
        is_package = bool(graph.find_children(importer))
        for imported in graph.find_modules_directly_imported_by(importer):
            edges[importer].add(imported)
            for detail in graph.get_import_details(importer=importer, imported=imported):
                source = _from_module(importer, is_package, str(detail["line_contents"]))
                if source and source != importer and source in edges:
                    edges[importer].add(source)
    return edges


def _circles(edges: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan's algorithm, iterative), each sorted."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []
    for start in sorted(edges):
        if start in index:
            continue
        work = [(start, iter(sorted(edges[start])))]
        index[start] = low[start] = len(index)
        stack.append(start)
        on_stack.add(start)
        while work:
            node, todo = work[-1]
            nxt = next(todo, None)
            if nxt is not None:
                if nxt not in index:
                    index[nxt] = low[nxt] = len(index)
                    stack.append(nxt)
                    on_stack.add(nxt)
                    work.append((nxt, iter(sorted(edges[nxt]))))
                elif nxt in on_stack:
                    low[node] = min(low[node], index[nxt])
                continue
            work.pop()
            if work:
                low[work[-1][0]] = min(low[work[-1][0]], low[node])
            if low[node] == index[node]:
                component = []
                while True:
                    member = stack.pop()
                    on_stack.discard(member)
                    component.append(member)
                    if member == node:
                        break
                if len(component) > 1:
                    found.append(sorted(component))
    return sorted(found)


def _one_round(edges: dict[str, set[str]], members: list[str]) -> list[str]:
    """A shortest way from the first of ``members`` back to itself through them: ``[a, b, ..., a]``."""
    inside = set(members)
    start = members[0]
    came: dict[str, str] = {}
    queue = deque([start])
    while queue:
        node = queue.popleft()
        for nxt in sorted(edges[node] & inside):
            if nxt == start:
                way = [node]
                while way[-1] != start:
                    way.append(came[way[-1]])
                return [*reversed(way), start]
            if nxt not in came:
                came[nxt] = node
                queue.append(nxt)
    raise AssertionError(f"{members} is not a circle")


def import_circles(*packages: str) -> list[dict[str, list[str]]]:
    """Every circle among the modules of ``packages``: ``{"modules": [...sorted], "round": [a, b, ..., a]}``."""
    graph = grimp.build_graph(*packages, exclude_type_checking_imports=False, cache_dir=None)
    edges = import_edges(graph)
    return [{"modules": c, "round": _one_round(edges, c)} for c in _circles(edges)]


def module_files(root: Path, packages: Iterable[str]) -> set[str]:
    """The dotted names of the importable module files under ``root/<package>`` (every part an identifier: the
    migration scripts, loaded by path, are not modules)."""
    names = set()
    for package in packages:
        for path in (root / package).rglob("*.py"):
            parts = list(path.relative_to(root).with_suffix("").parts)
            if parts[-1] == "__init__":
                parts.pop()
            if all(p.isidentifier() for p in parts):
                names.add(".".join(parts))
    return names


def describe(circles: list[dict[str, list[str]]]) -> str:
    return "\n".join(f"{len(c['modules'])} modules import each other: {', '.join(c['modules'])}\n"
                     f"  e.g. {' -> '.join(c['round'])}" for c in circles)


def test_no_module_imports_itself_back() -> None:
    circles = import_circles(*PACKAGES)
    assert not circles, ("import circles:\n" + describe(circles) + "\n(a step into a package P can be a"
                         " `from P import submodule` in a module P's __init__ loads: `import P.submodule as name`"
                         " names only the submodule)")


def test_every_module_is_in_the_graph() -> None:
    graph = grimp.build_graph(*PACKAGES, cache_dir=None)
    missing = module_files(ROOT, PACKAGES) - graph.modules
    assert not missing, f"not in the import graph (a folder without __init__.py?): {sorted(missing)}"


# --------------------------------------------------------------------------- the check fails on a deliberate circle

def _circles_in(tree: Path) -> list[dict[str, list[str]]]:
    """``import_circles`` of the packages in ``tree`` (a fresh interpreter, which finds them there first)."""
    code = (f"import json, runpy; ns = runpy.run_path({str(Path(__file__))!r}); "
            f"print(json.dumps(ns['import_circles'](*{PACKAGES!r})))")
    r = subprocess.run([sys.executable, "-c", code], cwd=tree, env={"PYTHONPATH": str(tree), "PATH": "/usr/bin:/bin"},
                       capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr
    return json.loads(r.stdout)  # type: ignore[no-any-return]


@pytest.fixture(scope="module")
def tree(tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp("tree")
    for package in PACKAGES:
        shutil.copytree(ROOT / package, root / package, ignore=shutil.ignore_patterns("__pycache__", "results"))
    return root


@pytest.fixture(scope="module")
def before(tree: Path) -> list[list[str]]:
    """The circles of the unchanged copy (none, once the tree passes the test above)."""
    return [c["modules"] for c in _circles_in(tree)]


@pytest.mark.parametrize(
    ("module", "added", "circle"),
    [
        # at module level, in both packages
        ("bench/storage.py", "from bench import figures  # noqa: E402, F401",
         ["bench.figures", "bench.storage"]),
        ("sbx/storage/reflink.py", "import sbx.storage.disk  # noqa: E402, F401",
         ["sbx.storage.disk", "sbx.storage.reflink"]),
        # a type-only import counts
        ("sbx/sdk/filecalls.py", "from typing import TYPE_CHECKING  # noqa: E402\n"
         "if TYPE_CHECKING:\n    from sbx.sdk.files import Files  # noqa: F401",
         ["sbx.sdk.filecalls", "sbx.sdk.files"]),
        # so does one inside a function
        ("sbx/sdk/config.py", "def _late() -> None:\n    from sbx.sdk.http import Client  # noqa: F401",
         ["sbx.sdk.config", "sbx.sdk.http"]),
        # from the package, whose __init__ loads the importer
        ("sbx/sdk/files.py", "from sbx.sdk import errors as E  # noqa: E402, F401",
         ["sbx.sdk", "sbx.sdk.client", "sbx.sdk.files"]),
    ],
)
def test_a_circle_is_named(tree: Path, before: list[list[str]], tmp_path: Path, module: str, added: str,
                           circle: list[str]) -> None:
    copy = tmp_path / "tree"
    shutil.copytree(tree, copy)
    (copy / module).write_text((copy / module).read_text() + f"\n{added}\n")
    found = [c for c in _circles_in(copy) if c["modules"] not in before]
    assert [c["modules"] for c in found] == [circle]
    way = found[0]["round"]
    assert way[0] == way[-1] and set(way) == set(circle)
    assert all(name in describe(found) for name in circle)


def test_relative_imports_are_resolved() -> None:
    assert _from_module("sbx.sdk.files", False, "from . import protocol as P") == "sbx.sdk"
    assert _from_module("sbx.sdk", True, "from .client import Sandbox") == "sbx.sdk.client"
    assert _from_module("sbx.sdk.files", False, "from ..node import agent") == "sbx.node"
    assert _from_module("sbx.sdk.files", False, "import sbx.sdk.protocol as P") is None
