"""Eviction orders for the radix tree: each a small class with one hook, ``key``.

The tree keeps every leaf in a sorted index by ``key(node)`` and evicts from
the smallest key up. A key may read only fields that stay fixed while the
node is a leaf in the index, except through the tree's own re-keying on touch:
``last_access`` (a logical clock, bumped by match and insert) and
``depth_end`` (tokens from the root to the end of the node, which a split of
the node's head does not change).
"""

from __future__ import annotations

from typing import Protocol

__all__ = [
    "EVICTION_ORDERS",
    "EvictionOrder",
    "LevelOrder",
    "LruOrder",
    "check_key",
    "make_eviction_order",
]


class _KeyedNode(Protocol):
    last_access: int
    depth_end: int


class EvictionOrder(Protocol):
    """Picks victims among leaves: the leaf with the smallest ``key`` goes first."""

    name: str

    def key(self, node: _KeyedNode) -> tuple[int, ...]:
        """Sort key of a leaf: a tuple (the tree compares a filed key with a fresh one, and a
        list never equals a tuple); cheap, a pure function of the node's fields, never
        smaller after a touch (the tree re-files stale keys lazily, trusting they only
        grow; ``RadixCache.check()`` verifies it)."""
        ...


class LevelOrder:
    """Deepest leaves first (depth in tokens to the node's end); LRU among equal depth."""

    name = "level"

    def key(self, node: _KeyedNode) -> tuple[int, ...]:
        return (-node.depth_end, node.last_access)


class LruOrder:
    """Least recently used leaf first, whatever its depth (SGLang's order)."""

    name = "lru"

    def key(self, node: _KeyedNode) -> tuple[int, ...]:
        return (node.last_access,)


EVICTION_ORDERS: dict[str, type] = {"level": LevelOrder, "lru": LruOrder}


def make_eviction_order(eviction: str | EvictionOrder) -> EvictionOrder:
    """An eviction order from its name (``"level"``, ``"lru"``) or an object with ``key``."""
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
