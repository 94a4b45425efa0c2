"""NullCache: a ``PrefixCache`` that caches nothing, the cache-off baseline.

A serving loop written against ``PrefixCache`` runs unchanged with prefix
caching off: every match misses, every insert adopts nothing, so a request's
blocks are exactly the ones it allocated and its ``decref`` frees them all.
Inputs are still validated as the real caches validate them, so a loop that
passes bad arguments fails the same way with the cache on or off.
"""

from __future__ import annotations

from collections.abc import Hashable
from dataclasses import replace

import numpy as np

from radixkv.cache.allocator import BlockAllocator
from radixkv.cache.arrays import BlockSeq, TokenSeq, as_token_array
from radixkv.cache.events import KVCacheEvent
from radixkv.cache.hashing import ChainHasher
from radixkv.cache.prefix_cache import check_insert_blocks, check_namespace, check_num_blocks
from radixkv.cache.results import CacheStats, MatchResult

__all__ = ["NullCache"]

_EMPTY_BLOCKS = np.empty(0, dtype=np.int32)


class NullCache:
    """A prefix cache over a ``BlockAllocator`` that never caches a block.

    It never holds a reference: every refcount is exactly the callers'. So it
    does not claim its allocator (one cache per allocator counts real caches
    only) and may sit beside a ``RadixCache`` or ``HashBlockCache`` on one.
    ``stats`` counts matches and query tokens (never a hit) and inserts
    (never an inserted token), so hit rates read 0.0 beside the real caches'.

    >>> alloc = BlockAllocator(num_blocks=4, block_size=2)
    >>> cache = NullCache(alloc)
    >>> blocks = alloc.alloc(2)
    >>> cache.insert([1, 2, 3, 4], blocks)
    0
    >>> alloc.decref(blocks)                       # nothing was adopted: both are freed
    2
    >>> cache.match([1, 2, 3, 4]).num_tokens
    0
    """

    __slots__ = ("_alloc", "_stats")

    def __init__(self, allocator: BlockAllocator) -> None:
        if not isinstance(allocator, BlockAllocator):
            raise TypeError(f"allocator must be a BlockAllocator, got {type(allocator).__name__}")
        self._alloc = allocator
        self._stats = CacheStats()

    @property
    def allocator(self) -> BlockAllocator:
        return self._alloc

    @property
    def block_size(self) -> int:
        return self._alloc.block_size

    @property
    def cached_blocks(self) -> int:
        """Always 0. Complexity: O(1)."""
        return 0

    @property
    def evictable_blocks(self) -> int:
        """Always 0. Complexity: O(1)."""
        return 0

    @property
    def num_namespaces(self) -> int:
        """Always 0: no namespace holds a block. Complexity: O(1)."""
        return 0

    @property
    def stats(self) -> CacheStats:
        """A snapshot of the counters."""
        return replace(self._stats)

    @property
    def events_hasher(self) -> ChainHasher | None:
        """Always None: the cache publishes no KV cache events."""
        return None

    def take_events(self) -> list[KVCacheEvent]:
        """Always []: no block ever enters or leaves. Complexity: O(1)."""
        return []

    def held_blocks(self) -> np.ndarray:
        """A new empty int32 array: the cache holds nothing. Complexity: O(1)."""
        return np.empty(0, dtype=np.int32)

    def match(
        self, tokens: TokenSeq, namespace: Hashable = None, *, stats: bool = True
    ) -> MatchResult:
        """An empty match (no blocks, ``num_tokens`` 0); no reference changes hands.

        Counts the query in ``stats`` unless ``stats=False``. ``TypeError`` /
        ``ValueError`` on bad input, before any change. Complexity: O(1) for an
        int32 array, else O(len(tokens)) to check it.
        """
        arr = as_token_array(tokens)
        check_namespace(namespace)
        if stats:
            self._stats.num_matches += 1
            self._stats.query_tokens += len(arr)
        return MatchResult(_EMPTY_BLOCKS, 0)

    def check_namespace(self, namespace: Hashable) -> None:
        """Raise what ``match`` would raise for ``namespace`` (``PrefixCache``); change nothing."""
        check_namespace(namespace)

    def peek(self, tokens: TokenSeq, namespace: Hashable = None) -> int:
        """0, after checking the input as ``match`` does. Changes nothing. Complexity: as match."""
        as_token_array(tokens)
        check_namespace(namespace)
        return 0

    def insert(self, tokens: TokenSeq, blocks: BlockSeq, namespace: Hashable = None) -> int:
        """Check the input as the real caches do, adopt nothing, return 0.

        ``blocks`` needs at least ``len(tokens) // block_size`` entries, every
        one allocated (``ValueError``); ``TypeError`` for bad types (``blocks``
        not an ordered sequence, an unhashable namespace). The caller's
        references are untouched: its ``decref`` frees every block. Counts the
        insert (with 0 inserted tokens) in ``stats``.
        Complexity: O(len(tokens) + len(blocks)) to check the input.
        """
        arr = as_token_array(tokens)
        check_namespace(namespace)
        check_insert_blocks(self._alloc, blocks, len(arr))
        self._stats.num_inserts += 1
        return 0

    def evict(self, num_blocks: int) -> int:
        """0: nothing to free. Any int ``>= 0``; ``TypeError`` / ``ValueError`` for a bad count.

        Complexity: O(1).
        """
        check_num_blocks(num_blocks)
        return 0

    def reset(self) -> None:
        """Nothing to let go of; stats are kept. Complexity: O(1)."""

    def check(self) -> None:
        """Check the allocator's invariants (the cache has none of its own): ``InvariantError``.

        Complexity: O(num_blocks).
        """
        self._alloc.check()

    def __repr__(self) -> str:
        return f"NullCache(block_size={self.block_size})"
