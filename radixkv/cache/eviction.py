"""Eviction orders for the radix tree: each a small class whose one decision is ``key``.

The tree keeps every leaf in a sorted index by ``key(leaf)`` and evicts from
the smallest key up. ``key`` sees a :class:`LeafView`: the leaf's last access
(a logical clock, bumped by match and insert), its depth in tokens, its hit
count (matches through it), its creation time, its priority (the highest an
insert through it gave) and its size in blocks. It must not change the leaf.

Every order is an :class:`EvictionOrder`, whose other hooks let an order keep
state of its own beside the tree (``bind``, ``on_insert``, ``on_split``,
``on_evict``, ``on_reset``, ``check``); they do nothing by default, and the tree
calls them on every order, so no order needs a branch in the tree. A user's
object with a ``key`` method alone is an order too (``make_eviction_order``
gives it the default hooks).

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
- ``ghost``: ``lrfu`` (boost 600) plus S3-FIFO's ghost: the order remembers the
  leaves the tree deletes and protects a leaf inserted where one was
  (``Readmission``), up to a cap of the pool. The one order with state: it
  keeps the ghost through the hooks, one copy per tree (``bind``).

``docs/replay.md`` ("Eviction orders on the Mooncake traces") has the
measurements behind the ``lrfu``, ``deep`` and ``ghost`` defaults.
"""

from __future__ import annotations

import copy
from collections import OrderedDict
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from math import log2
from typing import TYPE_CHECKING, Protocol

from radixkv.checks import check_int, check_number
from radixkv.errors import invariant

if TYPE_CHECKING:
    from radixkv.cache.node import Node

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


class EvictionOrder:
    """Picks victims among leaves: the leaf with the smallest ``key`` goes first.

    Subclasses give ``name`` and ``key``. The hooks below are what the tree
    tells its order as leaves come and go; they do nothing here, and an order
    with state of its own (``GhostOrder``) overrides them. The tree calls them
    on the order ``bind`` returned for it, in this contract:

    - ``on_insert(parent, leaf)``: a new leaf was made under ``parent``, before
      the tree files it; returns the nodes whose keys the hook lowered (the tree
      re-files those it has filed, after the leaf);
    - ``on_split(head, tail)``: ``head`` was cut off the front of ``tail``;
    - ``on_evict(parent, node, deleted)``: ``node``'s device blocks left the tree;
      ``deleted``: the node left too (no host copy kept it);
    - ``on_reset()``: the tree dropped everything;
    - ``check(nodes)``: ``InvariantError`` unless the order's state agrees with
      the tree's ``nodes`` (every node but the roots).

    A hook may write ``Node.readmitted`` and nothing else of a node.
    """

    name: str

    def key(self, node: LeafView) -> tuple[int, ...]:
        """Sort key of a leaf: a tuple (the tree compares a filed key with a fresh one, and a
        list never equals a tuple); cheap, a pure function of the leaf's fields, never
        smaller after a touch (the tree re-files stale keys lazily, trusting they only
        grow; ``RadixCache.check()`` verifies it)."""
        raise NotImplementedError

    def bind(self, num_blocks: int, block_size: int) -> EvictionOrder:
        """The order one tree over a pool of ``num_blocks`` blocks of ``block_size`` tokens
        uses: ``self`` for an order without state; an order with state returns a fresh copy
        holding that tree's, so one order object may configure many trees."""
        return self

    def on_insert(self, parent: Node, leaf: Node) -> Sequence[Node]:
        """A new ``leaf`` under ``parent``, not filed yet; the nodes whose keys went down."""
        return ()

    def on_split(self, head: Node, tail: Node) -> None:
        """``head`` was cut off the front of ``tail``."""

    def on_evict(self, parent: Node, node: Node, deleted: bool) -> None:
        """``node``'s device blocks left the tree (and ``node`` with them when ``deleted``)."""

    def on_reset(self) -> None:
        """The tree dropped every node."""

    def check(self, nodes: Iterable[Node]) -> None:
        """No node is readmitted: only an order with a ghost readmits."""
        invariant(
            not any(n.readmitted for n in nodes), "a node is readmitted by an order without a ghost"
        )


class _KeyOnly(EvictionOrder):
    """A user's order with a ``key`` method alone: the hooks are the defaults."""

    def __init__(self, order: object) -> None:
        self.order = order
        self.key = order.key  # type: ignore[attr-defined]  # bound: the tree calls it directly
        self.name = getattr(order, "name", type(order).__name__)

    def __repr__(self) -> str:
        return repr(self.order)


class LevelOrder(EvictionOrder):
    """Deepest leaves first (depth in tokens to the node's end); LRU among equal depth."""

    name = "level"

    def key(self, node: LeafView) -> tuple[int, ...]:
        return (-node.depth_end, node.last_access)


class LruOrder(EvictionOrder):
    """Least recently used leaf first, whatever its depth (SGLang's order)."""

    name = "lru"

    def key(self, node: LeafView) -> tuple[int, ...]:
        return (node.last_access,)


class LfuOrder(EvictionOrder):
    """Fewest hits first; least recently used among equal hits."""

    name = "lfu"

    def key(self, node: LeafView) -> tuple[int, ...]:
        return (node.hits, node.last_access)


class FifoOrder(EvictionOrder):
    """Oldest leaf first (creation time; a split's head keeps its node's), use ignored."""

    name = "fifo"

    def key(self, node: LeafView) -> tuple[int, ...]:
        return (node.created,)


class PriorityOrder(EvictionOrder):
    """Lowest priority first, LRU among equal priority (SGLang's priority order)."""

    name = "priority"

    def key(self, node: LeafView) -> tuple[int, ...]:
        return (node.priority, node.last_access)


class LrfuOrder(EvictionOrder):
    """Recency plus a bonus of ``boost`` clock ticks per hit, for the first ``max_hits`` hits.

    The tree's clock ticks once per match and once per insert (about twice
    per request). ``ValueError`` naming the argument unless both are ints >= 0.
    """

    name = "lrfu"

    def __init__(self, boost: int = 200, max_hits: int = 3) -> None:
        self.boost = check_int("boost", boost, low=0)
        self.max_hits = check_int("max_hits", max_hits, low=0)

    def key(self, node: LeafView) -> tuple[int, ...]:
        hits, last = node.hits, node.last_access
        # last access breaks ties: keys then never tie, whatever order leaves were filed in
        return (last + self.boost * (hits if hits < self.max_hits else self.max_hits), last)


class DeepOrder(EvictionOrder):
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
        self.depth_credit = check_int("depth_credit", depth_credit, low=0)
        self.span_weight = check_int("span_weight", span_weight, low=0)

    def key(self, node: LeafView) -> tuple[int, ...]:
        last = node.last_access
        k = last + int(self.depth_credit * log2(max(node.depth_end, 1)))
        if node.hits:
            k += self.span_weight * (last - node.created)
        return (k, last)


@dataclass(frozen=True)
class Readmission:
    """How S3-FIFO's ghost behaves in a ``GhostOrder`` (``GhostOrder.readmission``).

    The order remembers the leaves the tree deletes, ``(parent depth, first block)`` in a FIFO
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
        check_number("ghost_ratio", self.ghost_ratio, low=0)
        ratio = self.protect_ratio
        if not 0 <= check_number("protect_ratio", ratio) <= 1:
            raise ValueError(f"protect_ratio must be a number in [0, 1], got {ratio!r}")


class GhostOrder(EvictionOrder):
    """``lrfu`` plus S3-FIFO's ghost: a readmitted leaf gets ``bonus`` more ticks.

    Key: last access, plus ``boost`` ticks per hit for the first ``max_hits``
    hits, plus ``bonus`` while the leaf is readmitted (``readmission``: what the
    ghost remembers and how many blocks it protects). A conversation whose tail
    was evicted between turns comes back protected, as S3-FIFO admits an id its
    ghost remembers straight to the main queue; the cap on readmitted blocks is
    S3-FIFO's capacity-relative queue. ``ValueError`` naming the argument for a
    bad value.

    The ghost is state, kept by the hooks: a FIFO of ``(parent depth, first
    block)`` of the leaves the tree deleted, with their sizes in blocks, and the
    readmitted nodes, oldest first. The object built here is a template (bound
    to an empty pool); ``bind`` gives each tree its own ghost, sized to its pool.
    """

    name = "ghost"

    def __init__(
        self,
        boost: int = 600,
        max_hits: int = 3,
        bonus: int = 1500,
        readmission: Readmission | None = None,
    ) -> None:
        check_int("boost", boost, low=0)
        check_int("max_hits", max_hits, low=0)
        check_int("bonus", bonus, low=0)
        if readmission is None:
            readmission = Readmission()
        if not isinstance(readmission, Readmission):
            raise ValueError(f"readmission must be a Readmission, got {readmission!r}")
        self.boost = boost
        self.max_hits = max_hits
        self.bonus = bonus
        self.readmission = readmission
        self._start(num_blocks=0, block_size=1)

    def _start(self, num_blocks: int, block_size: int) -> None:
        """An empty ghost for a pool of ``num_blocks`` blocks of ``block_size`` tokens."""
        self._block_bytes = 4 * block_size  # a node's first block: int32 token bytes
        # (parent depth_end, first block bytes) of a deleted leaf -> its blocks, oldest first
        self._ghost: OrderedDict[tuple[int, bytes], int] = OrderedDict()
        self._ghost_blocks = 0
        self._ghost_cap = int(self.readmission.ghost_ratio * num_blocks)
        self._protected: OrderedDict[int, Node] = OrderedDict()  # id -> readmitted node
        self._protected_blocks = 0
        self._protect_cap = int(self.readmission.protect_ratio * num_blocks)

    def key(self, node: LeafView) -> tuple[int, ...]:
        hits, last = node.hits, node.last_access
        k = last + self.boost * (hits if hits < self.max_hits else self.max_hits)
        return (k + self.bonus if node.readmitted else k, last)

    def bind(self, num_blocks: int, block_size: int) -> GhostOrder:
        """A copy of this order (a subclass's too) with an empty ghost for one tree's pool."""
        bound = copy.copy(self)
        bound._start(num_blocks, block_size)
        return bound

    def on_insert(self, parent: Node, leaf: Node) -> Sequence[Node]:
        """Readmit ``leaf`` if the ghost remembers a leaf deleted from its place; then lapse
        the oldest readmissions past the cap (their keys go down: the tree re-files them).
        Complexity: O(1) plus O(1) per lapse."""
        n = self._ghost.pop((parent.depth_end, leaf.key[: self._block_bytes]), None)
        if n is None:
            return ()
        self._ghost_blocks -= n
        leaf.readmitted = True
        self._protected[id(leaf)] = leaf
        self._protected_blocks += leaf.num_blocks
        lapsed = []
        protected = self._protected
        while self._protected_blocks > self._protect_cap and protected:
            _, node = protected.popitem(last=False)
            node.readmitted = False
            self._protected_blocks -= node.num_blocks
            lapsed.append(node)
        return lapsed

    def on_split(self, head: Node, tail: Node) -> None:
        """Both halves of a readmitted node stay readmitted (its blocks' count is unchanged)."""
        if tail.readmitted:
            head.readmitted = True
            self._protected[id(head)] = head

    def on_evict(self, parent: Node, node: Node, deleted: bool) -> None:
        """Protection is for device blocks: ``node`` loses it. A deleted leaf enters the ghost
        (replacing an entry for the same place), whose oldest entries go past its cap."""
        if node.readmitted:
            node.readmitted = False
            del self._protected[id(node)]
            self._protected_blocks -= node.num_blocks
        if not deleted:
            return
        key = (parent.depth_end, node.key[: self._block_bytes])
        ghost = self._ghost
        old = ghost.pop(key, None)
        if old is not None:
            self._ghost_blocks -= old
        n = node.num_blocks
        ghost[key] = n
        self._ghost_blocks += n
        while self._ghost_blocks > self._ghost_cap and ghost:
            self._ghost_blocks -= ghost.popitem(last=False)[1]

    def on_reset(self) -> None:
        self._ghost.clear()
        self._ghost_blocks = 0
        self._protected.clear()
        self._protected_blocks = 0

    def check(self, nodes: Iterable[Node]) -> None:
        """Readmitted nodes are exactly the protected queue's, on the device, within the cap;
        the ghost's block count is its entries' and within its bound. Complexity: O(nodes)."""
        flagged = [n for n in nodes if n.readmitted]
        protected = self._protected
        invariant(
            len(flagged) == len(protected) and all(protected.get(id(n)) is n for n in flagged),
            "readmitted nodes and the protected queue disagree",
        )
        invariant(all(n.blocks for n in flagged), "a readmitted node is not on the device")
        blocks = sum(n.num_blocks for n in flagged)
        invariant(blocks == self._protected_blocks, "readmitted blocks miscounted")
        invariant(blocks <= self._protect_cap, "readmitted blocks passed their cap")
        invariant(
            sum(self._ghost.values()) == self._ghost_blocks <= self._ghost_cap,
            "the ghost's block count is off or past its bound",
        )


EVICTION_ORDERS: dict[str, type[EvictionOrder]] = {
    "level": LevelOrder,
    "lru": LruOrder,
    "lfu": LfuOrder,
    "fifo": FifoOrder,
    "priority": PriorityOrder,
    "lrfu": LrfuOrder,
    "deep": DeepOrder,
    "ghost": GhostOrder,
}


def make_eviction_order(eviction: str | EvictionOrder | object) -> EvictionOrder:
    """An eviction order from its name (a key of ``EVICTION_ORDERS``), an ``EvictionOrder``
    (returned as is), or any object with a ``key(node)`` method (wrapped: the default hooks).

    ``ValueError`` for an unknown name, ``TypeError`` naming ``eviction`` for anything else.
    """
    if isinstance(eviction, str):
        try:
            return EVICTION_ORDERS[eviction]()
        except KeyError:
            names = ", ".join(repr(n) for n in EVICTION_ORDERS)
            raise ValueError(f"eviction must be one of {names}, got {eviction!r}") from None
    if isinstance(eviction, EvictionOrder):
        return eviction
    if not callable(getattr(eviction, "key", None)):
        raise TypeError(f"eviction must be a name or have a key(node) method, got {eviction!r}")
    return _KeyOnly(eviction)


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
