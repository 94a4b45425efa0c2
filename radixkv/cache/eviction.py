"""Eviction orders for the radix tree: each a small class with one hook, ``key``.

The tree keeps every leaf in a sorted index by ``key(leaf)`` and evicts from
the smallest key up. ``key`` sees a :class:`LeafView`: the leaf's last access
(a logical clock, bumped by match and insert), its depth in tokens, its hit
count (matches through it), its creation time, its priority (the highest an
insert through it gave) and its size in blocks. It must not change the leaf.

A key must never get smaller when the leaf is touched (matched, inserted
through, or split at its head): the tree files a key once and re-files it
lazily when it pops a stale one, trusting keys only grow
(``RadixCache.check()`` verifies it). Every field above only grows on a touch,
except ``num_blocks`` (a split shrinks the tail), which no built-in order reads.

Orders (``EVICTION_ORDERS``):

- ``lru``: least recently used leaf first (SGLang's default).
- ``level``: deepest leaf first, LRU within a depth (the design card's order).
- ``lfu``: fewest hits first, LRU among equal hits.
- ``fifo``: oldest leaf first, however often it is used.
- ``priority``: lowest priority first, LRU among equal priority (SGLang's
  priority order; ``RadixCache.insert(..., priority=p)``).
- ``lrfu``: recency with a frequency bonus, scan-resistant: a leaf's key is
  its last access plus ``boost`` ticks for each of its first ``max_hits``
  hits, so a leaf matched three times outlives one inserted ``3 * boost``
  ticks later and never used; a scan of one-off prompts (no hits) ages out
  first.
- ``deep``: level's opposite, plus a credit for use: a leaf's key is its last
  access plus ``depth_credit`` ticks per doubling of its depth and, once it
  has been hit, ``span_weight`` times the span it has been in use (last
  access minus creation). Deep leaves are long conversations and long
  documents; a long span of use is the self-scaling form of frequency.
- ``ghost``: ``lrfu`` (boost 600) plus S3-FIFO's ghost: the tree remembers the
  leaves it deletes and protects a leaf inserted where one was (``Readmission``),
  up to a cap of the pool. The one order that needs the tree's help: it says
  so with its ``readmission`` attribute, and the tree keeps the ghost.

``docs/replay.md`` ("Eviction orders on the Mooncake traces") has the
measurements behind the ``lrfu``, ``deep`` and ``ghost`` defaults.
"""

from __future__ import annotations

from dataclasses import dataclass
from math import log2
from typing import Protocol

__all__ = [
    "EVICTION_ORDERS",
    "DeepOrder",
    "EvictionOrder",
    "FifoOrder",
    "GhostOrder",
    "LeafView",
    "LevelOrder",
    "LfuOrder",
    "LrfuOrder",
    "LruOrder",
    "PriorityOrder",
    "Readmission",
    "check_key",
    "make_eviction_order",
]


class LeafView(Protocol):
    """What an eviction order reads of a leaf (read-only: an order must not assign to it)."""

    @property
    def last_access(self) -> int: ...
    @property
    def depth_end(self) -> int: ...
    @property
    def hits(self) -> int: ...
    @property
    def created(self) -> int: ...
    @property
    def priority(self) -> int: ...
    @property
    def num_blocks(self) -> int: ...
    @property
    def readmitted(self) -> bool: ...


class EvictionOrder(Protocol):
    """Picks victims among leaves: the leaf with the smallest ``key`` goes first."""

    name: str

    def key(self, node: LeafView) -> tuple[int, ...]:
        """Sort key of a leaf: a tuple (the tree compares a filed key with a fresh one, and a
        list never equals a tuple); cheap, a pure function of the leaf's fields, never
        smaller after a touch (the tree re-files stale keys lazily, trusting they only
        grow; ``RadixCache.check()`` verifies it)."""
        ...


class LevelOrder:
    """Deepest leaves first (depth in tokens to the node's end); LRU among equal depth."""

    name = "level"

    def key(self, node: LeafView) -> tuple[int, ...]:
        return (-node.depth_end, node.last_access)


class LruOrder:
    """Least recently used leaf first, whatever its depth (SGLang's order)."""

    name = "lru"

    def key(self, node: LeafView) -> tuple[int, ...]:
        return (node.last_access,)


class LfuOrder:
    """Fewest hits first; least recently used among equal hits."""

    name = "lfu"

    def key(self, node: LeafView) -> tuple[int, ...]:
        return (node.hits, node.last_access)


class FifoOrder:
    """Oldest leaf first (creation time; a split's head keeps its node's), use ignored."""

    name = "fifo"

    def key(self, node: LeafView) -> tuple[int, ...]:
        return (node.created,)


class PriorityOrder:
    """Lowest priority first, LRU among equal priority (SGLang's priority order)."""

    name = "priority"

    def key(self, node: LeafView) -> tuple[int, ...]:
        return (node.priority, node.last_access)


class LrfuOrder:
    """Recency plus a bonus of ``boost`` clock ticks per hit, for the first ``max_hits`` hits.

    The tree's clock ticks once per match and once per insert (about twice
    per request). ``ValueError`` naming the argument unless both are ints >= 0.
    """

    name = "lrfu"

    def __init__(self, boost: int = 200, max_hits: int = 3) -> None:
        _check_ints(boost=boost, max_hits=max_hits)
        self.boost = boost
        self.max_hits = max_hits

    def key(self, node: LeafView) -> tuple[int, ...]:
        hits, last = node.hits, node.last_access
        # last access breaks ties: keys then never tie, whatever order leaves were filed in
        return (last + self.boost * (hits if hits < self.max_hits else self.max_hits), last)


class DeepOrder:
    """Recency plus ``depth_credit`` ticks per doubling of depth, plus ``span_weight`` times
    the span of use (``last_access - created``) once the leaf has been hit.

    The depth credit keeps the deep leaves that ``level`` throws out first: on
    the Mooncake traces those are long conversations and long documents, the
    ones reused most. It is a log, so the token unit of ``depth_end`` (blocks of
    any size) shifts every leaf's credit by the same amount, up to rounding; but it
    is given to unused leaves too, so a scan of long one-off prompts is kept
    ``depth_credit * log2(length)`` ticks longer than LRU would keep it. The
    span credit is frequency without a clock constant: a leaf only lives long
    enough to show a long span where the cache is big enough to keep it.
    ``ValueError`` naming the argument unless both are ints >= 0.
    """

    name = "deep"

    def __init__(self, depth_credit: int = 100, span_weight: int = 2) -> None:
        _check_ints(depth_credit=depth_credit, span_weight=span_weight)
        self.depth_credit = depth_credit
        self.span_weight = span_weight

    def key(self, node: LeafView) -> tuple[int, ...]:
        last = node.last_access
        k = last + int(self.depth_credit * log2(max(node.depth_end, 1)))
        if node.hits:
            k += self.span_weight * (last - node.created)
        return (k, last)


@dataclass(frozen=True)
class Readmission:
    """What an order asks of the tree to get S3-FIFO's ghost (``GhostOrder.readmission``).

    The tree remembers the leaves it deletes, ``(parent depth, first block)`` in a FIFO
    *ghost* of at most ``ghost_ratio * num_blocks`` blocks; a leaf inserted where a
    remembered one was (a conversation's next turn re-inserting its evicted tail) is
    *readmitted* (``LeafView.readmitted``) and the order protects it. At most
    ``protect_ratio * num_blocks`` blocks are readmitted at once: past that, the oldest
    readmission lapses. Without the cap, protection crowds out the working set of
    traces where re-insertions are common.
    """

    ghost_ratio: float = 4.0
    protect_ratio: float = 0.75

    def __post_init__(self) -> None:
        for name in ("ghost_ratio", "protect_ratio"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, (int, float)) or not value >= 0:
                raise ValueError(f"{name} must be a number >= 0, got {value!r}")
        if self.protect_ratio > 1:
            raise ValueError(f"protect_ratio must be <= 1, got {self.protect_ratio!r}")


class GhostOrder:
    """``lrfu`` plus S3-FIFO's ghost: a readmitted leaf gets ``bonus`` more ticks.

    Key: last access, plus ``boost`` ticks per hit for the first ``max_hits``
    hits, plus ``bonus`` while the leaf is readmitted (the tree's
    ``Readmission`` mechanism, switched on by this order's ``readmission``
    attribute). A conversation whose tail was evicted between turns comes back
    protected, as S3-FIFO admits an id its ghost remembers straight to the main
    queue; the cap on readmitted blocks is S3-FIFO's capacity-relative queue.
    ``ValueError`` naming the argument for a bad value.
    """

    name = "ghost"

    def __init__(
        self,
        boost: int = 600,
        max_hits: int = 3,
        bonus: int = 1500,
        readmission: Readmission | None = None,
    ) -> None:
        _check_ints(boost=boost, max_hits=max_hits, bonus=bonus)
        if readmission is None:
            readmission = Readmission()
        if not isinstance(readmission, Readmission):
            raise ValueError(f"readmission must be a Readmission, got {readmission!r}")
        self.boost = boost
        self.max_hits = max_hits
        self.bonus = bonus
        self.readmission = readmission

    def key(self, node: LeafView) -> tuple[int, ...]:
        hits, last = node.hits, node.last_access
        k = last + self.boost * (hits if hits < self.max_hits else self.max_hits)
        return (k + self.bonus if node.readmitted else k, last)


def _check_ints(**args: object) -> None:
    """``ValueError`` naming the first argument that is not an int >= 0 (bools refused)."""
    for arg, value in args.items():
        if isinstance(value, bool) or not isinstance(value, int) or value < 0:
            raise ValueError(f"{arg} must be an int >= 0, got {value!r}")


EVICTION_ORDERS: dict[str, type] = {
    "level": LevelOrder,
    "lru": LruOrder,
    "lfu": LfuOrder,
    "fifo": FifoOrder,
    "priority": PriorityOrder,
    "lrfu": LrfuOrder,
    "deep": DeepOrder,
    "ghost": GhostOrder,
}


def make_eviction_order(eviction: str | EvictionOrder) -> EvictionOrder:
    """An eviction order from its name (a key of ``EVICTION_ORDERS``) or an object with ``key``."""
    if isinstance(eviction, str):
        try:
            return EVICTION_ORDERS[eviction]()
        except KeyError:
            names = ", ".join(repr(n) for n in EVICTION_ORDERS)
            raise ValueError(f"eviction must be one of {names}, got {eviction!r}") from None
    if not callable(getattr(eviction, "key", None)):
        raise TypeError(f"eviction must be a name or have a key(node) method, got {eviction!r}")
    return eviction


def check_key(order: EvictionOrder, key: object) -> None:
    """``TypeError`` naming ``order`` unless ``key`` (what its ``key(node)`` returned) is a tuple.

    The tree files ``(*key, uid, node)`` and re-files an entry whose stored key
    differs from a fresh one: a key of another type (a list) never compares
    equal, and ``evict`` would re-file it forever. Complexity: O(1).
    """
    if not isinstance(key, tuple):
        raise TypeError(
            f"eviction order {order!r}: key(node) must return a tuple, got {type(key).__name__} "
            f"{key!r}"
        )
