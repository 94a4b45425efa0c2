"""The package layout is the design: no import cycles, and each tier imports only what it may.

docs/design.md ("Layout"): cache and model stand alone (neither imports the
other), replay uses the cache, nothing imports upward, no import cycles, and
the cache and replay tiers never touch torch. This test parses every module under
``radixkv/`` with ``ast`` and collects every import statement, wherever it
stands (module level, inside functions, under ``if TYPE_CHECKING:``), so a lazy
import cannot hide an edge. ``from pkg import name`` counts as an import of
``pkg.name`` when that is a module, else of ``pkg``. Importing a module also
runs its parent packages' ``__init__``; those implicit edges are not counted
(every submodule would otherwise form a cycle with its own package).
"""

from __future__ import annotations

import ast
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PACKAGE = "radixkv"


@dataclass(frozen=True)
class Edge:
    """``source`` imports ``target`` (an absolute module name) at ``path:line``."""

    source: str
    target: str
    path: str
    line: int

    def __str__(self) -> str:
        return f"{self.source} -> {self.target}  ({self.path}:{self.line})"


def module_name(path: Path, root: Path) -> str:
    """``radixkv/cache/radix.py`` -> ``radixkv.cache.radix``; a package's ``__init__`` -> it."""
    parts = list(path.relative_to(root).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def discover(root: Path, package: str) -> dict[str, Path]:
    """Every module of ``package`` under ``root``, by name."""
    return {module_name(p, root): p for p in sorted((root / package).rglob("*.py"))}


def imports_of(
    name: str, source: str, is_package: bool, known: Iterable[str], path: str = "<src>"
) -> list[Edge]:
    """Every import in ``source`` (module ``name``) as an edge to an absolute module name.

    Relative imports are resolved against ``name``; ``from X import Y`` targets
    ``X.Y`` when that is in ``known``, else ``X``. Targets outside ``known`` are
    kept too (``torch``, ``numpy``): the caller filters.
    """
    known = set(known)
    package = name if is_package else name.rpartition(".")[0]
    edges: list[Edge] = []
    for node in ast.walk(ast.parse(source, filename=path)):
        if isinstance(node, ast.Import):
            edges += [Edge(name, a.name, path, node.lineno) for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".")
                base = base[: len(base) - (node.level - 1)]
                base_name = ".".join(base + ([node.module] if node.module else []))
            else:
                base_name = node.module or ""
            for alias in node.names:
                sub = f"{base_name}.{alias.name}"
                target = sub if sub in known else base_name
                edges.append(Edge(name, target, path, node.lineno))
    return edges


def build_graph(root: Path = ROOT, package: str = PACKAGE) -> list[Edge]:
    """Every import edge of every module of ``package`` (targets of any package)."""
    modules = discover(root, package)
    edges: list[Edge] = []
    for name, path in modules.items():
        rel = str(path.relative_to(root))
        edges += imports_of(name, path.read_text(), path.name == "__init__.py", modules, rel)
    return edges


def in_package(module: str, package: str) -> bool:
    return module == package or module.startswith(package + ".")


def find_cycles(edges: Iterable[Edge]) -> list[list[Edge]]:
    """One cycle (as its edges, in order) per strongly connected component that has one."""
    graph: dict[str, dict[str, Edge]] = {}
    for e in edges:
        graph.setdefault(e.source, {}).setdefault(e.target, e)
        graph.setdefault(e.target, {})
    # Tarjan's SCC, iterative (no recursion limit to worry about).
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    on_stack: set[str] = set()
    stack: list[str] = []
    sccs: list[list[str]] = []
    counter = 0
    for start in sorted(graph):
        if start in index:
            continue
        work = [(start, iter(sorted(graph[start])))]
        index[start] = low[start] = counter
        counter += 1
        stack.append(start)
        on_stack.add(start)
        while work:
            v, children = work[-1]
            for w in children:
                if w not in index:
                    index[w] = low[w] = counter
                    counter += 1
                    stack.append(w)
                    on_stack.add(w)
                    work.append((w, iter(sorted(graph[w]))))
                    break
                if w in on_stack:
                    low[v] = min(low[v], index[w])
            else:
                work.pop()
                if work:
                    low[work[-1][0]] = min(low[work[-1][0]], low[v])
                if low[v] == index[v]:
                    scc = []
                    while True:
                        w = stack.pop()
                        on_stack.discard(w)
                        scc.append(w)
                        if w == v:
                            break
                    if len(scc) > 1 or v in graph[v]:
                        sccs.append(sorted(scc))
    return [_cycle_in(graph, scc) for scc in sccs]


def _cycle_in(graph: dict[str, dict[str, Edge]], scc: list[str]) -> list[Edge]:
    """A shortest cycle through the first module of ``scc`` (breadth-first inside it)."""
    members, start = set(scc), scc[0]
    parent: dict[str, Edge] = {}
    frontier = [start]
    while frontier:
        nxt = []
        for v in frontier:
            for w, e in sorted(graph[v].items()):
                if w == start:
                    path = [e]
                    while path[0].source != start:
                        path.insert(0, parent[path[0].source])
                    return path
                if w in members and w not in parent:
                    parent[w] = e
                    nxt.append(w)
        frontier = nxt
    raise AssertionError(f"no cycle through {start} in {scc}")  # unreachable for an SCC


def _report(title: str, lines: Iterable[object]) -> str:
    return title + "\n" + "\n".join(f"  {line}" for line in lines)


# ------------------------------------------------------------ the extractor
def test_extractor_sees_every_kind_of_import() -> None:
    known = {"pkg", "pkg.a", "pkg.sub", "pkg.sub.b", "pkg.sub.c"}
    source = (
        "import os, pkg.a\n"
        "from pkg.sub import b, helper\n"  # a module, and a name in the package
        "from . import c\n"  # relative, a module
        "from ..a import thing\n"  # relative, two levels
        "def f():\n"
        "    import torch.nn\n"  # inside a function
        "    from numpy import array\n"
        "if False:\n"
        "    from pkg import a\n"
    )
    edges = imports_of("pkg.sub.x", source, is_package=False, known=known)
    assert [(e.target, e.line) for e in edges] == [
        ("os", 1),
        ("pkg.a", 1),
        ("pkg.sub.b", 2),
        ("pkg.sub", 2),
        ("pkg.sub.c", 3),
        ("pkg.a", 4),
        ("torch.nn", 6),
        ("numpy", 7),
        ("pkg.a", 9),
    ]
    # In a package's __init__, "." is the package itself.
    [e] = imports_of("pkg.sub", "from . import b\n", is_package=True, known=known)
    assert e.target == "pkg.sub.b"


def test_cycle_finder_reports_each_cycle_and_only_cycles() -> None:
    def edges(*pairs: str) -> list[Edge]:
        return [Edge(s, t, f"{s}.py", i) for i, (s, t) in enumerate(p.split() for p in pairs)]

    assert find_cycles(edges("a b", "b c", "a c")) == []
    [cycle] = find_cycles(edges("a b", "b c", "c a", "c d"))
    assert [(e.source, e.target) for e in cycle] == [("a", "b"), ("b", "c"), ("c", "a")]
    [self_loop] = find_cycles(edges("a a", "a b"))
    assert [(e.source, e.target) for e in self_loop] == [("a", "a")]
    assert len(find_cycles(edges("a b", "b a", "c d", "d c"))) == 2


# ---------------------------------------------------------------- radixkv
@pytest.fixture(scope="module")
def graph() -> list[Edge]:
    edges = build_graph()
    # Sanity: the walk found the package and resolves its imports.
    pairs = {(e.source, e.target) for e in edges}
    assert ("radixkv.cache.radix", "radixkv.cache.allocator") in pairs
    assert ("radixkv.cache.allocator", "radixkv.cache.kernels") in pairs  # from pkg import mod
    assert len({e.source for e in edges}) >= 20
    return edges


def internal(edges: list[Edge]) -> list[Edge]:
    return [e for e in edges if in_package(e.target, PACKAGE)]


def test_no_import_cycles(graph: list[Edge]) -> None:
    cycles = find_cycles(internal(graph))
    assert not cycles, _report(
        f"{len(cycles)} import cycle(s) in radixkv:",
        ("\n  ".join(["cycle:", *(f"  {e}" for e in c)]) for c in cycles),
    )


# Tier: what its modules may import from radixkv (each a package prefix).
TIERS = {
    "radixkv.cache": ("radixkv.cache",),
    "radixkv.model": ("radixkv.model",),
    "radixkv.replay": ("radixkv.replay", "radixkv.cache"),
    "radixkv.engine": ("radixkv.engine", "radixkv.cache", "radixkv.model"),
    "radixkv.fleet": ("radixkv.fleet", "radixkv.cache", "radixkv.replay"),
    # radixkv.replay only for cli_types (argparse types and one-line errors), as fleet.cli
    "radixkv.serve": (
        "radixkv.serve",
        "radixkv.engine",
        "radixkv.model",
        "radixkv.cache",
        "radixkv.fleet",
        "radixkv.replay",
    ),
}
# The engine's bookkeeping (what a custom serving loop or a fleet simulator imports)
# stays free of the model tier and of torch; only engine.engine runs the model.
BOOKKEEPING = (
    "radixkv.engine.request",
    "radixkv.engine.kv_manager",
    "radixkv.engine.scheduler",
)


@pytest.mark.parametrize("tier", sorted(TIERS))
def test_tier_imports_only_what_it_may(graph: list[Edge], tier: str) -> None:
    allowed = TIERS[tier]
    bad = [
        e
        for e in internal(graph)
        if in_package(e.source, tier) and not any(in_package(e.target, a) for a in allowed)
    ]
    assert not bad, _report(f"{tier} may import only {', '.join(allowed)} from radixkv:", bad)


@pytest.mark.parametrize("tier", ["radixkv.cache", "radixkv.replay", "radixkv.fleet"])
def test_tier_never_imports_torch(graph: list[Edge], tier: str) -> None:
    bad = [e for e in graph if in_package(e.source, tier) and e.target.split(".")[0] == "torch"]
    assert not bad, _report(f"{tier} must not import torch:", bad)


@pytest.mark.parametrize("module", BOOKKEEPING)
def test_engine_bookkeeping_stays_torch_free(graph: list[Edge], module: str) -> None:
    bad = [
        e
        for e in graph
        if e.source == module
        and (e.target.split(".")[0] == "torch" or in_package(e.target, "radixkv.model"))
    ]
    assert not bad, _report(f"{module} must import neither torch nor radixkv.model:", bad)
