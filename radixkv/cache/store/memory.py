"""MemoryStore: a KVStore in this process's memory (tests, and a stand-in for a remote store).

Entries are kept encoded (:mod:`radixkv.cache.store.entry`: a header, then the
payload, kept apart so a hit copies nothing) and checked on every get, as a
remote store's answers are: the same checks stand between any backend and the
cache.
"""

from __future__ import annotations

from collections.abc import Sequence

from radixkv.cache.store.entry import HEADER_BYTES, decode_parts, encode_header, log_corrupt
from radixkv.cache.store.keys import check_items, check_keys
from radixkv.cache.store.lru import LruStore
from radixkv.errors import invariant

__all__ = ["MemoryStore"]


class MemoryStore(LruStore):
    """A :class:`~radixkv.cache.store.protocol.KVStore` over a dict, least recently used
    out first, at most ``capacity_bytes`` of entries (payload plus the 64-byte header).

    Not thread-safe: one caller at a time. ``ValueError`` naming ``capacity_bytes``
    unless it is a positive int. Complexity: O(bytes moved) per put and get.

    >>> store = MemoryStore(1 << 20)
    >>> key = bytes(32)
    >>> store.put_many([(key, b"kv")]), store.get_many([key]), store.contains_run([key])
    (1, [b'kv'], 1)
    """

    def __init__(self, capacity_bytes: int) -> None:
        super().__init__(capacity_bytes)
        self._data: dict[bytes, tuple[bytes, bytes]] = {}  # key -> (header, payload)

    def contains_run(self, keys: Sequence[bytes]) -> int:
        n = 0
        data = self._data
        for key in check_keys("keys", keys):
            if key not in data:
                break
            n += 1
        return n

    def put_many(self, items: Sequence[tuple[bytes, bytes]]) -> int:
        index, stats = self._index, self._stats
        written = 0
        for key, value in check_items("items", items):
            if index.touch(key):
                continue
            size = HEADER_BYTES + value.nbytes
            if size > index.capacity_bytes:
                stats.rejected += 1
                continue
            self._drop(index.make_room(size))
            payload = value.tobytes()
            self._data[key] = (encode_header(key, payload), payload)
            index.add(key, size)
            stats.puts += 1
            stats.put_bytes += size
            written += 1
        return written

    def get_many(self, keys: Sequence[bytes]) -> list[bytes | None]:
        keys = check_keys("keys", keys)
        stats = self._stats
        out: list[bytes | None] = []
        for key in keys:
            stats.gets += 1
            entry = self._data.get(key)
            value = None if entry is None else decode_parts(key, *entry)
            if entry is None:
                stats.misses += 1
            elif value is None:
                stats.corrupt += 1
                log_corrupt("in memory", stats.corrupt)
                del self._data[key]
                self._index.remove(key)
            else:
                stats.hits += 1
                stats.hit_bytes += len(value)
                self._index.touch(key)
            out.append(value)
        return out

    def check(self) -> None:
        self._index.check()
        invariant(set(self._index) == set(self._data), "the index and the entries disagree")

    def _drop(self, victims: list[tuple[bytes, int]]) -> None:
        for key, size in victims:
            del self._data[key]
            self._stats.evicted += 1
            self._stats.evicted_bytes += size
