"""KVStore: what the tiered cache needs of a storage tier below the host (one small protocol).

A store keeps opaque values (a block's K/V as bytes; the engine does the
conversion) under fixed-length keys (:mod:`radixkv.cache.store.keys`: content-
addressed, so one key always names the same bytes). It is a cache, never the
owner of anything: it may drop any entry at any time (capacity, another
process, a fault), and a value it cannot vouch for is a miss, never served.

**Faults never raise.** A store that is down, slow, full or returns garbage
answers with misses (``get_many`` gives None, ``contains_run`` a shorter run,
``put_many`` stores fewer) and counts it in :class:`StoreStats`; only a bad
argument (a key of the wrong type or length: a caller's bug) raises, before
any change.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Protocol, runtime_checkable

__all__ = ["KVStore", "StoreStats"]


@dataclass
class StoreStats:
    """Cumulative counters since the store was opened; ``used_bytes`` and ``num_entries``
    are gauges (a snapshot when the stats were taken).

    - ``puts``/``put_bytes``: entries written (a key already stored is not rewritten
      and not counted); ``rejected``: values refused (larger than the whole capacity);
    - ``gets``: keys asked for; ``hits``/``hit_bytes``: values returned; ``misses``: keys
      not stored; ``corrupt``: entries found but refused (bad magic, version, key echo,
      length or checksum: the caller recomputes) and dropped;
    - ``evicted``/``evicted_bytes``: entries dropped for capacity;
    - ``errors``: operations that failed in the backend (an ``OSError``, a store that is
      down) and were answered as misses or skipped writes.
    """

    puts: int = 0
    put_bytes: int = 0
    rejected: int = 0
    gets: int = 0
    hits: int = 0
    hit_bytes: int = 0
    misses: int = 0
    corrupt: int = 0
    evicted: int = 0
    evicted_bytes: int = 0
    errors: int = 0
    used_bytes: int = 0  # a gauge
    num_entries: int = 0  # a gauge


@runtime_checkable
class KVStore(Protocol):
    """A storage tier: existence of a run of blocks, batched put and get, capacity, stats.

    Keys are ``bytes`` of the length the store was built for
    (``radixkv.cache.store.keys.KEY_BYTES``); a key of another type or length is a
    ``ValueError`` naming it, raised before any change.
    """

    @property
    def capacity_bytes(self) -> int:
        """The most bytes the store's entries may take (headers included)."""
        ...

    @property
    def stats(self) -> StoreStats:
        """A snapshot of the counters (a new object)."""
        ...

    def contains_run(self, keys: Sequence[bytes]) -> int:
        """How many of ``keys``, from the first, are stored: the length of the stored prefix
        of the run (a later ``get_many`` may still miss one: entries can go at any time)."""
        ...

    def put_many(self, items: Sequence[tuple[bytes, bytes]]) -> int:
        """Store each ``(key, value)``; return how many were written. A key already stored
        is kept (same key, same bytes) and counts as used now; a value larger than the
        capacity is refused (``rejected``); least recently used entries make room."""
        ...

    def get_many(self, keys: Sequence[bytes]) -> list[bytes | None]:
        """The value of each key, or None where it is not stored or its entry is not
        sound (counted in ``corrupt`` and dropped). A hit counts as a use."""
        ...

    def check(self) -> None:
        """Raise ``InvariantError`` naming the first broken invariant of the store's index."""
        ...
