"""Pins: prefixes of a radix tree kept whatever its eviction order says (``RadixCache.pin``).

A pin covers a root-connected path of nodes; each node counts the pins that
cover it (``Node.pinned``) and the tree's ``evict`` skips a leaf whose count is
above 0. :class:`Pins` keeps the pins in force, their count of blocks and the
cap on it. It takes nodes, never the tree: the tree walks and splits, then
hands this object the path a pin covers (so this module imports only
``node``, and the tree imports it).

A pin is filed under (namespace key, the full-block bytes ``pin`` was given)
and remembered by the last node it covers: its anchor. The anchor stays that
prefix's last node for as long as the pin is in force: a split keeps the
original node object as the tail (so the anchor still ends the prefix), and
eviction never takes a pinned node.
"""

from __future__ import annotations

from collections.abc import Hashable, Iterable, Iterator

import numpy as np

from radixkv.cache.node import TOKEN_BYTES, Node, Root
from radixkv.errors import invariant

__all__ = ["Pins", "pin_key", "pinned_path"]

PinKey = tuple[Hashable, bytes]  # (namespace key, the full-block bytes pin() was given)


def pin_key(ns_key: Hashable, tokens: np.ndarray, block_bytes: int) -> PinKey:
    """What a pin of ``tokens`` (int32) under namespace key ``ns_key`` is filed under: their
    full blocks' bytes (``block_bytes`` per block)."""
    return ns_key, tokens.tobytes()[: len(tokens) * TOKEN_BYTES // block_bytes * block_bytes]


def pinned_path(anchor: Node) -> Iterator[Node]:
    """The nodes a pin anchored at ``anchor`` covers: it and its ancestors, roots excluded."""
    node = anchor
    while node.parent is not None:
        yield node
        node = node.parent


class Pins:
    """The pins in force over one tree, and the cap on the blocks they hold.

    Writes ``Node.pinned`` of the nodes it is handed, nothing else. The tree
    counts ``num_blocks`` as the blocks in nodes with ``pinned > 0``.
    """

    __slots__ = ("_anchors", "max_blocks", "num_blocks")

    def __init__(self, max_blocks: int) -> None:
        self.max_blocks = max_blocks
        self.num_blocks = 0  # blocks in nodes with pinned > 0
        # one anchor per pin() not yet undone, the latest last
        self._anchors: dict[PinKey, list[Node]] = {}

    def check_room(self, path: list[Node], split_child: Node | None, split_at: int) -> None:
        """``ValueError`` naming ``max_pinned_blocks`` unless pinning ``path`` (and the first
        ``split_at`` blocks of ``split_child``, where the prefix ends inside it) fits the cap.

        Changes nothing: the tree calls it before it splits.
        """
        added = sum(n.num_blocks for n in path if not n.pinned)
        if split_child is not None and not split_child.pinned:
            added += split_at
        if self.num_blocks + added > self.max_blocks:
            raise ValueError(
                f"pinning {added} more blocks would pass max_pinned_blocks="
                f"{self.max_blocks} ({self.num_blocks} pinned)"
            )

    def add(self, key: PinKey, path: list[Node]) -> None:
        """Pin ``path`` (root-connected, non-empty, ending at a node) under ``key``."""
        for node in path:
            if not node.pinned:
                self.num_blocks += node.num_blocks
            node.pinned += 1
        self._anchors.setdefault(key, []).append(path[-1])

    def remove(self, key: PinKey) -> int | None:
        """Undo the latest pin under ``key``; return the tokens it pinned, None if there is none."""
        stack = self._anchors.get(key)
        if not stack:
            return None
        anchor = stack.pop()
        if not stack:
            del self._anchors[key]
        for node in pinned_path(anchor):
            node.pinned -= 1
            if not node.pinned:
                self.num_blocks -= node.num_blocks
        return anchor.depth_end

    def clear(self) -> None:
        """The tree dropped every node: no pin is in force."""
        self._anchors.clear()
        self.num_blocks = 0

    def check(self, nodes: Iterable[Node], roots: dict[Hashable, Root]) -> None:
        """Every pin still covers the prefix it was given, ending at a node of a root in
        ``roots``; every node's count and the block count match the pins in force; the cap
        holds. ``InvariantError`` naming the first that does not. Complexity: O(nodes + pinned
        path lengths)."""
        want: dict[int, int] = {}
        for (ns_key, data), anchors in self._anchors.items():
            for anchor in anchors:
                path = list(pinned_path(anchor))
                top = path[-1].parent
                invariant(roots.get(ns_key) is top, "a pin's namespace holds nothing")
                pos = anchor.depth_end * TOKEN_BYTES
                covered = b"".join(n.key for n in reversed(path))
                invariant(covered == data[:pos], "a pinned prefix left the tree")
                for node in path:
                    want[id(node)] = want.get(id(node), 0) + 1
        pinned_blocks = 0
        for node in nodes:
            invariant(node.pinned == want.get(id(node), 0), "a node's pin count is off")
            if node.pinned:
                pinned_blocks += node.num_blocks
        invariant(pinned_blocks == self.num_blocks, "pinned_blocks count is off")
        invariant(self.num_blocks <= self.max_blocks, "pins passed max_pinned_blocks")
