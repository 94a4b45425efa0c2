"""Replay through the radix tree: ``RadixCache`` with one token per block, one block per hash id.

Each dense hash id is one token of a ``RadixCache`` over a
``BlockAllocator(num_blocks=capacity, block_size=1)``, so the tree's blocks
are the cache's blocks and its prefix-closed eviction is the policy:
``"radix-<order>"`` for every order in ``radixkv.cache.eviction.EVICTION_ORDERS``
(``radix-lru``, ``radix-level``, ``radix-lfu``, ``radix-fifo``,
``radix-priority``, ``radix-lrfu``, ``radix-deep``).
"""

from __future__ import annotations

import numpy as np

from radixkv.cache.allocator import BlockAllocator
from radixkv.cache.eviction import EVICTION_ORDERS
from radixkv.cache.radix import RadixCache
from radixkv.replay.trace import Trace

__all__ = ["RadixReplayer", "radix_replay"]

_EVICTION = {f"radix-{name}": name for name in EVICTION_ORDERS}


class RadixReplayer:
    """The radix tree as a replay policy, one request at a time.

    Owns a ``BlockAllocator(num_blocks=capacity, block_size=1)`` and a
    ``RadixCache`` over it (``alloc`` and ``cache``, exposed for inspection;
    do not mutate them). Between requests every block is either free or held
    by the tree alone.
    """

    def __init__(self, policy: str, capacity: int) -> None:
        if policy not in _EVICTION:
            raise ValueError(f"policy must be one of {', '.join(_EVICTION)}, got {policy!r}")
        self.alloc = BlockAllocator(num_blocks=capacity, block_size=1)
        self.cache = RadixCache(self.alloc, eviction=_EVICTION[policy])

    def step(self, seq: np.ndarray) -> int:
        """Serve one request (an int32 id array); return its hit length in blocks.

        ``match`` the whole sequence (the request now holds references on its
        matched path, so eviction cannot touch it); if the pool is short of
        the rest, ``evict`` the shortfall from the tree; allocate what fits and
        ``insert`` the longest prefix that fits; then let go of every block
        the request held.

        Complexity: O(len(seq)) plus O(evicted leaves * log leaves).
        """
        alloc, cache = self.alloc, self.cache
        m = cache.match(seq)
        matched = len(m.block_array)
        need = len(seq) - matched
        if need:
            if alloc.num_free < need:
                cache.evict(need - alloc.num_free)
            new = alloc.alloc_array(min(need, alloc.num_free))
            got = len(new)
            if got:
                blocks = np.concatenate((m.block_array, new))
                cache.insert(seq[: matched + got], blocks)
                alloc.decref_distinct(blocks)
                return matched
        alloc.decref_distinct(m.block_array)
        return matched

    def count_matchable(self, trace: Trace) -> int:
        """Distinct tree blocks some request of ``trace`` matches now (bumps LRU clocks).

        Complexity: O(total ids).
        """
        seen = np.zeros(self.alloc.num_blocks, dtype=bool)
        ids, offsets = trace.ids, trace.offsets
        for r in range(trace.num_requests):
            m = self.cache.match(ids[offsets[r] : offsets[r + 1]])
            seen[m.block_array] = True
            self.alloc.decref_distinct(m.block_array)
        return int(seen.sum())


def radix_replay(trace: Trace, policy: str, capacity: int) -> tuple[np.ndarray, int, int, int]:
    """Replay ``trace``; return ``(hit_blocks, block_hits, final_cache_blocks, unreachable)``.

    ``hit_blocks[i]`` is request i's matched length (see ``RadixReplayer.step``);
    ``block_hits`` their sum. ``unreachable`` counts tree blocks no request of
    the trace would match at the end (measured by matching every request; 0
    for a prefix-closed tree).

    Complexity: O(total ids * log leaves) for the replay plus O(total ids) for
    the reachability count.
    """
    # The tree never holds more blocks than the trace has ids, so a bigger pool never runs
    # short either: clamping it changes nothing but the memory a huge capacity would take.
    replayer = RadixReplayer(policy, min(capacity, max(1, trace.num_accesses)))
    ids, offsets = trace.ids, trace.offsets
    hit_blocks = np.zeros(trace.num_requests, dtype=np.int64)
    step = replayer.step
    for r in range(trace.num_requests):
        hit_blocks[r] = step(ids[offsets[r] : offsets[r + 1]])
    final_cache_blocks = replayer.cache.cached_blocks
    unreachable = final_cache_blocks - replayer.count_matchable(trace)
    return hit_blocks, int(hit_blocks.sum()), final_cache_blocks, unreachable
