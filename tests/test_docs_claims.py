"""The docs' "only", "one place", "every" and "never" sentences, each held to the code.

Each test names the page and the sentence it guards, and fails if the code stops making
that sentence true. The import graph and the package's rooms are ``tests/test_layout.py``'s
(it already holds "nothing imports upward", "never torch" and the rooms' imports); the
install paragraph of README.md is ``tests/test_readme.py``'s. These checks read the
source with ``ast``: they see a lazy import or a call wherever it stands.
"""

from __future__ import annotations

import ast
import inspect
import re
from collections.abc import Iterator
from pathlib import Path

import pytest
from test_layout import build_graph, in_package

from radixkv.cache import eviction

ROOT = Path(__file__).resolve().parents[1]
PACKAGE = ROOT / "radixkv"
DESIGN = (ROOT / "docs" / "design.md").read_text()


def modules(*under: str) -> Iterator[tuple[Path, ast.Module]]:
    """Every module under ``radixkv/<under>`` (a folder or a file), parsed."""
    for part in under:
        path = PACKAGE / part
        for p in sorted(path.rglob("*.py")) if path.is_dir() else [path]:
            yield p, ast.parse(p.read_text(), filename=str(p))


def rel(path: Path) -> str:
    return str(path.relative_to(ROOT))


def module_level_imports(tree: ast.Module) -> set[str]:
    """The top-level packages a module imports when it is imported (not inside a function)."""
    out: set[str] = set()
    for node in tree.body:
        if isinstance(node, ast.Import):
            out |= {a.name.split(".")[0] for a in node.names}
        elif isinstance(node, ast.ImportFrom) and not node.level and node.module:
            out.add(node.module.split(".")[0])
    return out


def requirements() -> dict[str, set[str]]:
    """pyproject.toml's dependencies (``""``) and each extra's, as import names."""
    tomllib = pytest.importorskip("tomllib")
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    # the distributions whose import name differs from theirs
    import_name = {"pyzmq": "zmq"}

    def names(reqs: list[str]) -> set[str]:
        dists = {re.split(r"[\s\[<>=!~;]", r, maxsplit=1)[0].lower() for r in reqs}
        return {import_name.get(d, d) for d in dists if not d.startswith("radixkv")}

    extras = project["optional-dependencies"]
    return {"": names(project["dependencies"]), **{k: names(v) for k, v in extras.items()}}


def third_party(packages: set[str]) -> set[str]:
    import sys

    return {p for p in packages if p not in sys.stdlib_module_names and p != "radixkv"}


# ---------------------------------------------------------------- install (design.md)
def test_base_install_imports_cache_text_replay_and_the_bottom() -> None:
    """design.md, "Why this cut": "`cache`, `text` and `replay` import only numpy, numba,
    sortedcontainers, xxhash, msgspec and tqdm (`pip install radixkv`) at module level"."""
    base = requirements()[""]
    bad = {
        rel(p): sorted(extra)
        for p, tree in modules("cache", "text", "replay", "errors.py", "checks.py", "cli_args.py")
        if (extra := third_party(module_level_imports(tree)) - base)
    }
    assert not bad, f"modules of the base install import packages it does not bring: {bad}"


def test_the_fleet_extra_is_what_design_md_says_and_no_fleet_module_imports_ray() -> None:
    """design.md, "Why this cut": "the `fleet` extra adds pyzmq and cbor2 for the transport
    and vLLM's hash, and ray[serve] for `serve/ray` (no `fleet` module imports ray)"."""
    fleet = requirements()["fleet"]
    sentence = re.search(r"`fleet`(?: extra)? adds(.*?)\(the\s+`engine` extra\)", DESIGN, re.S)
    assert sentence, "design.md no longer describes the fleet extra"
    named = sentence.group(1)
    dist = {"zmq": "pyzmq", "ray": "ray[serve]"}
    missing = sorted(p for p in fleet if dist.get(p, p) not in named)
    assert not missing, f"design.md's fleet-extra sentence leaves out {missing}"
    ray_in_fleet = [
        f"{e.path}:{e.line}"
        for e in build_graph()
        if in_package(e.source, "radixkv.fleet") and e.target.split(".")[0] == "ray"
    ]
    assert not ray_in_fleet, f"the fleet tier imports ray: {ray_in_fleet}"


def test_serve_ray_is_the_only_room_that_imports_ray() -> None:
    """design.md, "Why this cut": "`serve/ray` ... is the only room that imports ray"."""
    bad = [
        f"{e.path}:{e.line}"
        for e in build_graph()
        if e.target.split(".")[0] == "ray" and not in_package(e.source, "radixkv.serve.ray")
    ]
    assert not bad, f"ray imported outside radixkv/serve/ray: {bad}"


# ----------------------------------------------------- the model boundary (design, engine)
# What the engine may do with a block table: measure it, or hand it to the model tier's
# two entry points that turn a step's block ids into tensors.
HANDOFFS = {("ForwardBatch", "build"), ("graphs", "run")}


def _callee(call: ast.Call) -> tuple[str, str] | None:
    """``X.f(...)`` or ``self.X.f(...)`` -> (X, f)."""
    func = call.func
    if not isinstance(func, ast.Attribute):
        return None
    owner = func.value
    if isinstance(owner, ast.Attribute):
        return owner.attr, func.attr
    if isinstance(owner, ast.Name):
        return owner.id, func.attr
    return None


def block_table_uses(tree: ast.Module) -> Iterator[tuple[int, str]]:
    """Each ``.block_table(...)`` read in ``tree`` that is neither ``len(...)``'d nor an
    element of a list handed straight to one of :data:`HANDOFFS`: (line, what it is)."""
    parent: dict[ast.AST, ast.AST] = {}
    for node in ast.walk(tree):
        for child in ast.iter_child_nodes(node):
            parent[child] = node
    for node in ast.walk(tree):
        if not (
            isinstance(node, ast.Call)
            and isinstance(node.func, ast.Attribute)
            and node.func.attr == "block_table"
        ):
            continue
        up = parent[node]
        if isinstance(up, ast.Call) and isinstance(up.func, ast.Name) and up.func.id == "len":
            continue
        if isinstance(up, ast.ListComp) and up.elt is node:
            call = parent[up]
            if isinstance(call, ast.Call) and up in call.args and _callee(call) in HANDOFFS:
                continue
        yield node.lineno, ast.unparse(up)[:80]


def test_the_engine_hands_block_tables_to_the_model_as_plain_ints() -> None:
    """design.md, "The model boundary": "Block ids become tensors only in the model tier,
    ...; the engine hands block tables over as plain ints, to the first two"; engine.md,
    "One step" (`ForwardBatch.build`, "where the step's block ids become tensors") and
    "The cache rules" ("slots are always derived from the table, by the model tier ...,
    never by the engine")."""
    bad = [
        f"{rel(p)}:{line}: {what}"
        for p, tree in modules("engine", "serve")
        for line, what in block_table_uses(tree)
    ]
    assert not bad, "a block table used other than measured or handed to the model:\n" + (
        "\n".join(bad)
    )
    handed = {
        _callee(n)
        for _, tree in modules("engine")
        for n in ast.walk(tree)
        if isinstance(n, ast.Call) and _callee(n) in HANDOFFS
    }
    assert handed == HANDOFFS  # both hand-offs are still there, so the check above means it
    mentions = [rel(p) for p, _ in modules("") if "slot_mapping" in p.read_text()]
    assert all(m.startswith("radixkv/model/") for m in mentions), mentions


def test_the_block_table_check_sees_a_tensor_made_in_the_engine() -> None:
    src = (
        "def step(kv, out, device):\n"
        "    n = len(kv.block_table(1))\n"
        "    ForwardBatch.build(ids, q, c, [kv.block_table(s) for s in out])\n"
        "    t = torch.tensor(kv.block_table(2), device=device)\n"
    )
    assert [line for line, _ in block_table_uses(ast.parse(src))] == [4]


# ------------------------------------------------------------------- eviction (design.md)
HOOKS = ("bind", "on_insert", "on_split", "on_evict", "on_reset", "check")


def test_only_the_ghost_order_overrides_the_tree_hooks() -> None:
    """design.md, "Eviction": the hooks are "no-ops on the base class, overridden only by an
    order with state of its own (`ghost`)"."""
    overriding = {
        cls.__name__
        for cls in vars(eviction).values()
        if inspect.isclass(cls)
        and issubclass(cls, eviction.EvictionOrder)
        and cls is not eviction.EvictionOrder
        and any(getattr(cls, h) is not getattr(eviction.EvictionOrder, h) for h in HOOKS)
    }
    assert overriding == {"GhostOrder"}


# ------------------------------------------------------------------- hashing (design.md)
def test_hashing_is_the_one_home_of_the_chain_hashes() -> None:
    """design.md: "`radixkv/cache/hashing.py`, the one home of every chain-hash recipe".
    The hash libraries are imported there alone; xxhash also places a prompt on the
    `chwbl` ring (radixkv/fleet/router.py), a hash of its head, not a chain; the KV store
    digests a key from a chain digest it takes from hashing.py (keys.py, blake2b) and
    checksums an entry's bytes (entry.py, xxh3), and the model tier digests a model's
    weights (radixkv/model/digest.py, sha256): none is a chain."""
    allowed = {"cbor2": {"radixkv.cache.hashing"}}
    allowed["hashlib"] = {
        "radixkv.cache.hashing", "radixkv.cache.store.keys", "radixkv.model.digest"
    }  # fmt: skip
    allowed["xxhash"] = {
        "radixkv.cache.hashing", "radixkv.fleet.router", "radixkv.cache.store.entry"
    }  # fmt: skip
    bad = [
        f"{e.path}:{e.line} imports {e.target}"
        for e in build_graph()
        if e.target in allowed and e.source not in allowed[e.target]
    ]
    assert not bad, bad


# -------------------------------------------------------------------- metrics (serving.md)
def test_request_histograms_are_recorded_only_by_the_openai_handlers() -> None:
    """serving.md, "Metrics": "Both front ends record them in one place, the OpenAI handlers
    (`radixkv.serve.openai.handlers`), into `radixkv.serve.openai.metrics.ServerMetrics`"."""
    recorders = {"started", "finished"}  # RequestMetrics's methods: the histograms' inputs
    callers = {
        rel(p)
        for p, tree in modules("")
        for n in ast.walk(tree)
        if isinstance(n, ast.Call)
        and isinstance(n.func, ast.Attribute)
        and n.func.attr in recorders
    }
    assert callers == {"radixkv/serve/openai/handlers.py"}
