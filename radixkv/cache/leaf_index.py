"""The leaf index: a tree's eviction candidates in eviction order, kept lazily.

Each entry is ``(*key, uid, node)`` in a ``SortedList``, ``key`` the eviction order's key of
the node when it was filed and ``uid`` a tie-breaker (so nodes themselves are never
compared); ``node.entry`` is the node's live entry, None when it has none. The index is
lazy: a touch only moves the node's clock (an order's keys never decrease, so a stale
entry sorts at or before its place) and a node that stops being a leaf only forgets its
entry. :meth:`LeafIndex.pop` re-files stale entries and drops dead ones, and the list is
rebuilt when dead entries outnumber live ones two to one.

Over nodes, not the tree (``RadixCache`` owns one and decides what a leaf is): this
module imports nothing of the tree.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator

from sortedcontainers import SortedList

from radixkv.cache.eviction import EvictionOrder, check_key
from radixkv.cache.node import Node
from radixkv.errors import invariant

__all__ = ["LeafIndex"]

_REBUILD_AT = 64  # dead entries tolerated before a rebuild is considered


class LeafIndex:
    """The leaves of one tree, sorted by ``order.key(node)``; see the module docstring.

    Writes ``Node.entry`` of the nodes it is handed, nothing else of them.
    """

    __slots__ = ("_entries", "_num_dead", "_order", "_uid")

    def __init__(self, order: EvictionOrder) -> None:
        self._order = order
        self._entries = SortedList()
        self._num_dead = 0  # entries whose node no longer has them as its entry
        self._uid = 0

    def __len__(self) -> int:
        """Live entries: the leaves filed. Complexity: O(1)."""
        return len(self._entries) - self._num_dead

    def __iter__(self) -> Iterator[tuple]:
        """Every entry, in order, dead ones included (a dead entry's node has another
        ``entry``). Complexity: O(entries)."""
        return iter(self._entries)

    def file(self, node: Node) -> None:
        """File ``node`` under its fresh key (its old entry, if any, must be gone or dead).

        ``TypeError`` naming the order if its key is no tuple, before any change.
        Complexity: O(log entries).
        """
        key = self._order.key(node)
        if type(key) is not tuple:
            check_key(self._order, key)
        self._add(node, key)

    def forget(self, node: Node) -> None:
        """``node`` stops being a leaf: its entry turns dead (dropped when popped, or at a
        rebuild). Complexity: O(1), amortised O(entries) for the rebuild."""
        node.entry = None
        self._num_dead += 1
        if self._num_dead > _REBUILD_AT and self._num_dead > 2 * len(self):
            self._entries = SortedList(e for e in self._entries if e[-1].entry is e)
            self._num_dead = 0

    def pop(self) -> tuple | None:
        """Take the first live entry whose key is fresh out of the index and return it (its
        node is ``entry[-1]``, whose ``entry`` still names it); None when none is left.

        Dead entries on the way are dropped and stale ones re-filed under their fresh key.
        A fresh key that is no tuple puts its entry back and raises ``TypeError`` naming
        the order: the index stays whole. Complexity: O((dropped + re-filed + 1) * log
        entries).
        """
        entries = self._entries
        key = self._order.key
        while entries:
            entry = entries.pop(0)
            node = entry[-1]
            if node.entry is not entry:  # dead: the node lost its place or was evicted
                self._num_dead -= 1
                continue
            fresh = key(node)
            if entry[:-2] == fresh:
                return entry
            if type(fresh) is not tuple:
                entries.add(entry)
                check_key(self._order, fresh)
            self._add(node, fresh)  # touched since filed
        return None

    def put_back(self, entries: Iterable[tuple]) -> None:
        """Return entries :meth:`pop` handed out whose nodes stay leaves (skipped victims).
        Complexity: O(k log entries)."""
        self._entries.update(entries)

    def clear(self) -> None:
        """Forget every entry (the caller empties the tree). Complexity: O(entries)."""
        self._entries.clear()
        self._num_dead = 0

    def check(self, leaves: list[Node], others: list[Node]) -> None:
        """``InvariantError`` unless every node of ``leaves`` has a live entry in the index
        whose key is at or before its fresh one (an order lowered no key on a touch), no node
        of ``others`` (the tree's other nodes) has one, and the dead entries are counted
        right. Complexity: O((leaves + others) log entries + entries)."""
        order = self._order
        for node in others:
            invariant(node.entry is None, "an interior or host-only node is in the leaf index")
        for node in leaves:
            invariant(node.entry is not None, "a leaf is missing from the leaf index")
            fresh = order.key(node)
            invariant(
                isinstance(fresh, tuple),
                f"eviction order {order!r} returned a {type(fresh).__name__}",
            )
            invariant(
                node.entry[:-2] <= fresh,
                f"a leaf's filed key {node.entry[:-2]} exceeds its fresh key {fresh}: "
                f"eviction order {order!r} lowered a key on a touch",
            )
            invariant(node.entry in self._entries, "a leaf's entry is not in the index")
        dead = sum(1 for e in self._entries if e[-1].entry is not e)
        invariant(dead == self._num_dead, "dead leaf-index entries miscounted")
        invariant(len(leaves) == len(self), "leaf index misses leaves or has extras")

    def _add(self, node: Node, key: tuple) -> None:
        self._uid += 1
        node.entry = (*key, self._uid, node)
        self._entries.add(node.entry)
