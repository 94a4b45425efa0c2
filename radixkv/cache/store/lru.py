"""LruIndex: a store's entries by key with their sizes, least recently used first.

The capacity accounting every backend shares (the store owns its capacity, as a
cachetools cache does): :meth:`LruIndex.make_room` picks the victims, the
backend deletes them. O(1) per touch, add and remove (an ``OrderedDict``).
:class:`LruStore` is the surface that follows from it, shared by the backends:
the capacity, and stats whose gauges are the index's.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Iterator
from dataclasses import replace

from radixkv.cache.store.protocol import StoreStats
from radixkv.checks import check_int
from radixkv.errors import invariant

__all__ = ["LruIndex", "LruStore"]

# 1 PiB: past any disk or memory pool a store is given; a larger number is a typo, and a
# Mooncake client lends its pool as much memory as the capacity says.
MAX_CAPACITY_BYTES = 1 << 50


class LruIndex:
    """Keys with their entry sizes in bytes, in use order; at most ``capacity_bytes`` in all.

    ``ValueError`` naming ``capacity_bytes`` unless it is an int in [1, ``MAX_CAPACITY_BYTES``].

    >>> index = LruIndex(10)
    >>> index.add(b"a", 6); index.make_room(5)
    [(b'a', 6)]
    """

    __slots__ = ("_entries", "capacity_bytes", "used_bytes")

    def __init__(self, capacity_bytes: int) -> None:
        self.capacity_bytes = check_int(
            "capacity_bytes", capacity_bytes, low=1, high=MAX_CAPACITY_BYTES
        )
        self.used_bytes = 0
        self._entries: OrderedDict[bytes, int] = OrderedDict()

    def __len__(self) -> int:
        return len(self._entries)

    def __contains__(self, key: object) -> bool:
        return key in self._entries

    def __iter__(self) -> Iterator[bytes]:
        """Keys, least recently used first."""
        return iter(self._entries)

    def size(self, key: bytes) -> int | None:
        """``key``'s entry size, or None if it is not indexed; not a use. O(1)."""
        return self._entries.get(key)

    def touch(self, key: bytes) -> bool:
        """Mark ``key`` used now; False if it is not indexed. O(1)."""
        try:
            self._entries.move_to_end(key)
        except KeyError:
            return False
        return True

    def make_room(self, size: int) -> list[tuple[bytes, int]]:
        """Drop least recently used entries until ``size`` more bytes fit; return them (the
        caller deletes their data). ``size`` must be at most the capacity. O(victims)."""
        victims = []
        entries = self._entries
        while entries and self.used_bytes + size > self.capacity_bytes:
            key, old = entries.popitem(last=False)
            self.used_bytes -= old
            victims.append((key, old))
        return victims

    def add(self, key: bytes, size: int) -> None:
        """Index ``key`` (not indexed yet) as used now; the caller made room first. O(1)."""
        self._entries[key] = size
        self.used_bytes += size

    def remove(self, key: bytes) -> int | None:
        """Forget ``key``; its size, or None if it was not indexed. O(1)."""
        size = self._entries.pop(key, None)
        if size is not None:
            self.used_bytes -= size
        return size

    def check(self) -> None:
        """``InvariantError`` unless the sizes add up to ``used_bytes`` and fit the capacity."""
        invariant(sum(self._entries.values()) == self.used_bytes, "used_bytes disagrees")
        invariant(self.used_bytes <= self.capacity_bytes, "store usage passed its capacity")
        invariant(all(s > 0 for s in self._entries.values()), "an entry has no size")


class LruStore:
    """The base of a store whose entries an :class:`LruIndex` of ``capacity_bytes`` bounds:
    it owns the index (``_index``) and the counters (``_stats``) the backend updates, and
    answers :class:`~radixkv.cache.store.protocol.KVStore`'s ``capacity_bytes`` and
    ``stats`` from them. ``ValueError`` naming ``capacity_bytes`` as :class:`LruIndex`'s.
    """

    def __init__(self, capacity_bytes: int) -> None:
        self._index = LruIndex(capacity_bytes)
        self._stats = StoreStats()

    @property
    def capacity_bytes(self) -> int:
        return self._index.capacity_bytes

    @property
    def stats(self) -> StoreStats:
        index = self._index
        return replace(self._stats, used_bytes=index.used_bytes, num_entries=len(index))
