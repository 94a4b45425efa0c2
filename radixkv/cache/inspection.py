"""Looking at a radix tree without changing it: its nodes, what eviction could free, a picture.

Functions over a tree's roots (``radixkv.cache.node``), never the tree: ``RadixCache``'s
``evictable_blocks``, ``num_nodes``, ``pretty`` and ``check`` call them (so this
module imports nothing of the tree, and the tree imports it).
"""

from __future__ import annotations

from collections.abc import Hashable, Iterable, Iterator

import numpy as np

from radixkv.cache import kernels
from radixkv.cache.node import TOKEN_BYTES, Node, Root
from radixkv.cache.tree_events import NoTreeEvents, TreeEvents
from radixkv.errors import invariant

__all__ = ["check_held_blocks", "check_structure", "evictable_blocks", "iter_nodes", "render"]


def iter_nodes(roots: Iterable[Root]) -> Iterator[Node]:
    """Every node below ``roots`` (roots excluded), depth first. Complexity: O(nodes)."""
    for root in roots:
        stack = list(root.children.values())
        while stack:
            node = stack.pop()
            yield node
            stack.extend(node.children.values())


def check_structure(
    roots: dict[Hashable, Root], block_bytes: int, events: TreeEvents | NoTreeEvents
) -> list[Node]:
    """Invariants 1-3 of docs/design.md over every node below ``roots`` (filed by namespace
    key), and each node's digests (``events.check``); return the nodes (``iter_nodes`` order).

    Roots are their namespace's, bare and non-empty; every other node holds a non-empty,
    block-aligned run of tokens (``block_bytes`` per block) and one block per block of
    them, is keyed in its parent by its first block, points back at that parent, and ends
    ``depth_end`` tokens from the root. ``InvariantError`` naming the first broken one.
    Complexity: O(nodes), plus the events' rehashing.
    """
    bb = block_bytes
    for ns_key, root in roots.items():
        invariant(
            isinstance(root, Root) and root.ns_key == ns_key,
            f"root filed under {ns_key!r} is not that namespace's root",
        )
        invariant(
            root.parent is None and root.key == b"" and root.depth_end == 0,
            f"root of namespace {root.namespace!r} has a parent, tokens or depth",
        )
        invariant(root.entry is None, "a root is in the leaf index")
        invariant(root.children, f"namespace {root.namespace!r} keeps an empty root")
        stack: list[Node] = [root]
        while stack:
            node = stack.pop()
            for key, child in node.children.items():
                invariant(child.parent is node, "child's parent pointer is wrong")
                invariant(len(child.key) > 0, "empty non-root node")
                invariant(len(child.key) % bb == 0, "node tokens not block-aligned")
                invariant(key == child.key[:bb], "child not keyed by its first block")
                invariant(child.num_blocks * bb == len(child.key), "blocks != tokens / block_size")
                invariant(
                    child.depth_end == node.depth_end + len(child.key) // TOKEN_BYTES,
                    "a node's depth_end is not its parent's plus its own tokens",
                )
                events.check(node, child)
                stack.append(child)
    return list(iter_nodes(roots.values()))


def check_held_blocks(ids: np.ndarray, held: np.ndarray, pool: str) -> None:
    """``InvariantError`` unless ``ids`` (every block of one pool the tree's nodes hold,
    concatenated) are distinct and in range and ``held`` (the tree's map of that pool) flags
    exactly them; ``pool`` (``"device"``, ``"host"``) names the pool in the message.
    Complexity: O(len(ids) log len(ids) + len(held)).
    """
    invariant(len(np.unique(ids)) == len(ids), f"a {pool} block is held by two nodes")
    invariant(
        not ids.size or (ids.min() >= 0 and ids.max() < len(held)),
        f"a node holds a {pool} block id out of range",
    )
    flags = np.zeros_like(held)
    flags[ids] = True
    invariant((flags == held).all(), f"the {pool} held-block map disagrees with the tree")


def evictable_blocks(roots: Iterable[Root], refcounts: np.ndarray) -> int:
    """Blocks the tree's ``evict`` could free now: every device block with no held block
    (``refcounts > 1``) at or below it, outside pinned nodes.

    Complexity: O(nodes + device blocks), vectorised per node.
    """
    last_busy = kernels.last_busy
    total = 0
    for root in roots:
        # Post-order: a node is evictable iff its blocks are free of requests and
        # every child is evictable (its children must go first).
        stack: list[tuple[Node, bool]] = [(root, False)]
        ok: dict[int, bool] = {}
        while stack:
            node, expanded = stack.pop()
            if not expanded:
                stack.append((node, True))
                stack.extend((c, False) for c in node.children.values())
                continue
            good = all(ok[id(c)] for c in node.children.values())
            if node.pinned:
                good = False  # evict skips it, so nothing above it goes either
            elif node is not root and good:
                # Blocks after the last held one can go (evict splits them off); a node
                # with no device blocks (ids is empty) never holds its parent back.
                ids = node.block_ids()
                busy = last_busy(refcounts, ids)
                total += len(ids) - (busy + 1)
                good = busy < 0
            ok[id(node)] = good
    return total


def render(
    header: str,
    roots: Iterable[Root],
    refcounts: np.ndarray,
    max_tokens: int = 8,
    max_blocks: int = 6,
) -> str:
    """``header``, then each namespace's tree as indented text: every node's tokens, device
    blocks and their refcounts, and its host copy if it has one, abbreviated."""
    lines = [header]
    for root in roots:
        lines.append(f"namespace {root.namespace!r}")
        _render_children(root, "", lines, refcounts, max_tokens, max_blocks)
    return "\n".join(lines)


def _render_children(
    node: Node,
    indent: str,
    lines: list[str],
    refcounts: np.ndarray,
    max_tokens: int,
    max_blocks: int,
) -> None:
    children = list(node.children.values())
    for i, child in enumerate(children):
        last = i == len(children) - 1
        toks = _abbrev(child.tokens().tolist(), max_tokens)
        ids = child.block_ids()
        rcs = refcounts[ids].tolist()
        host = child.host_ids().tolist()
        host = f" host {_abbrev(host, max_blocks)}" if child.host is not None else ""
        lines.append(
            f"{indent}{'└── ' if last else '├── '}{toks} ({len(child.key) // TOKEN_BYTES} tok)"
            f" blocks {_abbrev(ids.tolist(), max_blocks)} rc {_abbrev(rcs, max_blocks)}{host}"
        )
        _render_children(
            child, indent + ("    " if last else "│   "), lines, refcounts, max_tokens, max_blocks
        )


def _abbrev(values: list[int], limit: int) -> str:
    if len(values) <= limit:
        return "[" + " ".join(map(str, values)) + "]"
    head = " ".join(map(str, values[: limit - 2]))
    tail = " ".join(map(str, values[-2:]))
    return f"[{head} … {tail}]"
