"""The package layout is the design: no import cycles, and each room imports only what it may.

docs/design.md ("Layout"): cache and model stand alone (neither imports the
other), replay uses the cache, nothing imports upward (:data:`MAY_IMPORT`, per room:
a tier, or one of serve's three rooms), no import cycles, no tier reads another's
private members (:func:`private_reads`), and the cache, text, replay and fleet tiers
and serve's OpenAI layer never touch torch (statically here, and in a process where torch
cannot be imported: :func:`test_the_front_end_rooms_import_and_work_without_torch`).
This test parses every module under
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


# Rooms. A room is a folder: a module belongs to the room whose package below names it most
# closely. The exceptions are the package root's modules: errors, checks and cli_args are
# the bottom every tier may import; radixkv's __init__, cli, demo and workloads belong to
# none and are not checked; and serve/cli.py, the `radixkv serve` command, starts either
# server. A room imports only the rooms it lists (itself among them). The rooms of serve:
# the OpenAI layer (serve/openai/, torch-free) under the one-engine server (serve/), under
# Ray Serve's fleet (serve/ray/), under the command.
ROOMS = {
    "radixkv.errors": "bottom",
    "radixkv.checks": "bottom",
    "radixkv.cli_args": "bottom",
    "radixkv.cache": "cache",
    "radixkv.text": "text",
    "radixkv.model": "model",
    "radixkv.replay": "replay",
    "radixkv.engine": "engine",
    "radixkv.fleet": "fleet",
    "radixkv.serve": "serve.server",
    "radixkv.serve.openai": "serve.openai",
    "radixkv.serve.ray": "serve.ray",
    "radixkv.serve.cli": "serve.cli",
}
MAY_IMPORT = {
    "bottom": ("bottom",),
    "cache": ("cache", "bottom"),
    "text": ("text", "bottom"),
    "model": ("model", "text", "bottom"),
    "replay": ("replay", "cache", "bottom"),
    "engine": ("engine", "cache", "model", "text", "bottom"),
    "fleet": ("fleet", "cache", "replay", "bottom"),
    # the engine's torch-free bookkeeping (SamplingParams); test_openai_layer_... keeps
    # it torch-free
    "serve.openai": ("serve.openai", "engine", "text", "bottom"),
    "serve.server": ("serve.server", "serve.openai", "engine", "model", "cache", "text", "bottom"),
    "serve.ray": (
        "serve.ray",
        "serve.server",
        "serve.openai",
        "fleet",
        "engine",
        "cache",
        "text",
        "bottom",
    ),
    "serve.cli": (
        "serve.cli",
        "serve.ray",
        "serve.server",
        "serve.openai",
        "fleet",
        "engine",
        "model",
        "cache",
        "text",
        "bottom",
    ),
}
# The engine's bookkeeping (what a custom serving loop or a fleet simulator imports)
# stays free of the model tier and of torch; only engine.engine runs the model.
BOOKKEEPING = (
    "radixkv.engine.request",
    "radixkv.engine.scheduler",
    "radixkv.engine.stats",
)


def test_bookkeeping_names_modules_that_exist(graph: list[Edge]) -> None:
    assert set(BOOKKEEPING) <= {e.source for e in graph}


def room_of(module: str) -> str | None:
    """The room of ``module``: the room of the longest prefix in :data:`ROOMS` naming it."""
    best = max((p for p in ROOMS if in_package(module, p)), key=len, default=None)
    return None if best is None else ROOMS[best]


def test_rooms_are_assigned_as_written() -> None:
    assert set(MAY_IMPORT) == set(ROOMS.values())
    assert all(room in MAY_IMPORT[room] for room in MAY_IMPORT)
    assert room_of("radixkv.serve.openai.handlers") == "serve.openai"
    assert room_of("radixkv.serve.app") == room_of("radixkv.serve") == "serve.server"
    assert room_of("radixkv.serve.ray.ingress") == "serve.ray"
    assert room_of("radixkv.cache.radix") == "cache" and room_of("radixkv.demo") is None


# The modules ROOMS may name: the package root's bottom modules and the serve command.
NOT_FOLDERS = {"radixkv.errors", "radixkv.checks", "radixkv.cli_args", "radixkv.serve.cli"}


def test_every_room_is_a_folder() -> None:
    """A room is a folder (docs/design.md, "Layout"): ROOMS names a package, never a list of
    modules, but for the root's few bottom modules and the ``radixkv serve`` command."""
    modules = discover(ROOT, PACKAGE)
    assert set(ROOMS) <= set(modules)
    named = {p for p in ROOMS if modules[p].name != "__init__.py"}
    assert named == NOT_FOLDERS, sorted(named ^ NOT_FOLDERS)


@pytest.mark.parametrize("room", sorted(MAY_IMPORT))
def test_room_imports_only_what_it_may(graph: list[Edge], room: str) -> None:
    allowed = MAY_IMPORT[room]
    bad = [
        e for e in internal(graph) if room_of(e.source) == room and room_of(e.target) not in allowed
    ]
    assert not bad, _report(f"room {room} may import only {', '.join(allowed)}:", bad)


@pytest.mark.parametrize(
    "tier",
    ["radixkv.cache", "radixkv.replay", "radixkv.fleet", "radixkv.text", "radixkv.serve.openai"],
)
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


# ------------------------------------------------------------ private members
# Known cross-tier reads of private members, (module, name), each with the change that
# removes it. None now: serve/ray/fleet.py's walk of cache._iter_nodes() became
# RadixCache.block_hashes() (issue 23).
KNOWN_PRIVATE_READS: set[tuple[str, str]] = set()


def _is_private(name: str) -> bool:
    return name.startswith("_") and not (name.startswith("__") and name.endswith("__"))


def tier_of(module: str) -> str:
    """The top-level part of radixkv ``module`` belongs to: ``radixkv.cache.radix`` ->
    ``radixkv.cache``."""
    return ".".join(module.split(".")[:2])


def private_names(tree: ast.AST) -> set[str]:
    """The private names ``tree`` defines: functions, classes, assigned names, attributes
    assigned on ``self`` / ``cls``, and ``__slots__`` entries."""
    names: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            names.add(node.name)
        elif isinstance(node, (ast.Assign, ast.AnnAssign, ast.AugAssign)):
            targets = node.targets if isinstance(node, ast.Assign) else [node.target]
            for target in targets:
                for sub in ast.walk(target):
                    if isinstance(sub, ast.Name):
                        names.add(sub.id)
                        if sub.id == "__slots__" and node.value is not None:
                            names |= {
                                c.value
                                for c in ast.walk(node.value)
                                if isinstance(c, ast.Constant) and isinstance(c.value, str)
                            }
                    elif _is_self(sub):
                        names.add(sub.attr)  # type: ignore[attr-defined]
    return {n for n in names if _is_private(n)}


def _is_self(node: ast.AST) -> bool:
    """``self.x`` or ``cls.x``."""
    return (
        isinstance(node, ast.Attribute)
        and isinstance(node.value, ast.Name)
        and node.value.id in ("self", "cls")
    )


@dataclass(frozen=True)
class PrivateRead:
    """``module`` reads ``name``, private to ``owners`` (tiers), at ``path:line``."""

    module: str
    name: str
    owners: tuple[str, ...]
    path: str
    line: int

    def __str__(self) -> str:
        owners = ", ".join(self.owners)
        return f"{self.module} reads {self.name} of {owners}  ({self.path}:{self.line})"


def private_reads(
    sources: dict[str, str], paths: dict[str, str] | None = None, package: str = PACKAGE
) -> list[PrivateRead]:
    """Every read of another tier's private member in ``sources`` (module -> its text).

    A read is ``x._name`` where ``x`` is not ``self`` / ``cls``, ``_name`` is defined in a
    module of another tier (:func:`private_names`) and in none of the reader's own, or
    ``from <another tier's module> import _name``. Simple by design: a private name that
    both tiers define is not told apart.
    """
    paths = paths or {}
    trees = {m: ast.parse(src) for m, src in sources.items()}
    owners: dict[str, set[str]] = {}
    for module, tree in trees.items():
        for name in private_names(tree):
            owners.setdefault(name, set()).add(tier_of(module))
    reads: list[PrivateRead] = []
    for module, tree in trees.items():
        tier, path = tier_of(module), paths.get(module, module)
        for node in ast.walk(tree):
            if isinstance(node, ast.Attribute) and _is_private(node.attr) and not _is_self(node):
                held = owners.get(node.attr, set())
                if held and tier not in held:
                    reads.append(
                        PrivateRead(module, node.attr, tuple(sorted(held)), path, node.lineno)
                    )
            elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
                if in_package(node.module, package) and tier_of(node.module) != tier:
                    for alias in node.names:
                        if _is_private(alias.name):
                            owner = (tier_of(node.module),)
                            reads.append(PrivateRead(module, alias.name, owner, path, node.lineno))
    return reads


def test_private_read_finder_sees_attributes_and_imports() -> None:
    sources = {
        "pkg.a.tree": (
            "__slots__ = ('_kids',)\n"
            "class _Node: pass\n"
            "class Tree:\n"
            "    def __init__(self):\n"
            "        self._root = None\n"
            "    def _walk(self):\n"
            "        return self._root\n"
        ),
        "pkg.b.user": (
            "from pkg.a.tree import _Node, Tree\n"
            "def f(tree, node):\n"
            "    tree._walk()\n"  # another tier's private method
            "    node._kids\n"  # a slot
            "    self_like = tree._unknown\n"  # defined nowhere: not ours to judge
            "    return tree.__class__\n"  # dunder: public
        ),
        "pkg.a.other": "def g(tree):\n    return tree._walk()\n",  # same tier: fine
    }
    reads = private_reads(sources, package="pkg")
    assert sorted((r.module, r.name, r.line) for r in reads) == [
        ("pkg.b.user", "_Node", 1),
        ("pkg.b.user", "_kids", 4),
        ("pkg.b.user", "_walk", 3),
    ]


def test_no_tier_reads_another_s_private_members() -> None:
    modules = discover(ROOT, PACKAGE)
    sources = {m: p.read_text() for m, p in modules.items()}
    paths = {m: str(p.relative_to(ROOT)) for m, p in modules.items()}
    reads = private_reads(sources, paths)
    bad = [r for r in reads if (r.module, r.name) not in KNOWN_PRIVATE_READS]
    assert not bad, _report("a tier reads another tier's private members:", bad)
    # a known exception whose read is gone must leave the list
    stale = KNOWN_PRIVATE_READS - {(r.module, r.name) for r in reads}
    assert not stale, f"remove from KNOWN_PRIVATE_READS (the read is gone): {sorted(stale)}"


# ------------------------------------------------------------ torch-free rooms
def test_the_front_end_rooms_import_and_work_without_torch() -> None:
    """The cache, text and fleet tiers (every module) and the OpenAI layer of serve import
    where torch cannot be; the handlers answer over a stand-in engine client; a fleet's
    ingress (where Ray is installed) imports too: it only parses, tokenizes and routes."""
    for needed in ("zmq", "fastapi", "prometheus_client"):
        pytest.importorskip(needed)
    from test_torch_free import run_blocked

    run_blocked(
        """
        import asyncio, importlib, importlib.util, pkgutil
        import radixkv.cache, radixkv.fleet, radixkv.serve.openai, radixkv.text

        for pkg in (radixkv.cache, radixkv.fleet, radixkv.serve.openai, radixkv.text):
            for info in pkgutil.walk_packages(pkg.__path__, pkg.__name__ + "."):
                importlib.import_module(info.name)

        import radixkv.serve
        from radixkv.engine.request import EngineLimits
        from radixkv.serve.openai.client import EngineMetrics, RequestOutput
        from radixkv.serve.openai.handlers import OpenAIHandlers
        from radixkv.serve.openai.protocol import DetokenizeRequest, TokenizeRequest
        from radixkv.text.tokenizer import ByteTokenizer

        assert radixkv.serve.RequestOutput is RequestOutput
        assert radixkv.serve.EngineMetrics is EngineMetrics

        class Client:  # what the handlers need of an engine: no engine at all here
            tokenizer = ByteTokenizer()
            limits = EngineLimits(ByteTokenizer.vocab_size, 64)

        api = OpenAIHandlers(Client(), "m")
        assert api.models()["data"][0]["max_model_len"] == 64
        got = asyncio.run(api.tokenize(TokenizeRequest(prompt="hi")))
        assert got["tokens"] == [104, 105], got
        text = asyncio.run(api.detokenize(DetokenizeRequest(tokens=[104, 105])))
        assert text == {"prompt": "hi"}, text

        if importlib.util.find_spec("ray") is not None:
            importlib.import_module("radixkv.serve.ray.ingress")
        """
    )
