"""Replay through the radix tree: ``RadixCache`` with one token per block, one block per hash id.

Each dense hash id is one token of a ``RadixCache`` over a
``BlockAllocator(num_blocks=capacity, block_size=1)``, so the tree's blocks
are the cache's blocks and its prefix-closed eviction is the policy:
``"radix-<order>"`` for every order in ``radixkv.cache.eviction.EVICTION_ORDERS``
(``radix-lru``, ``radix-level``, ``radix-lfu``, ``radix-fifo``,
``radix-priority``, ``radix-lrfu``, ``radix-deep``, ``radix-ghost``).

With ``host_capacity > 0`` the tree is a ``TieredRadixCache``, with a host-memory tier
(``radixkv.cache.host.HostTier`` over a ``BlockAllocator(host_capacity, 1)``,
write-back, LRU host order, a ``NullCopier``: bookkeeping only): a block the
device evicts waits on the host, and a later request that matches it loads it
back (``TieredRadixCache.load``) instead of recomputing it.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from radixkv.cache.allocator import BlockAllocator
from radixkv.cache.eviction import EVICTION_ORDERS
from radixkv.cache.host import HostTier, NullCopier
from radixkv.cache.placement import place_prompt
from radixkv.cache.radix import RadixCache
from radixkv.cache.results import CacheStats
from radixkv.cache.tiered import TieredRadixCache
from radixkv.checks import check_int
from radixkv.replay.trace import Trace

__all__ = ["RadixReplayer", "TierReplay", "radix_replay", "radix_replay_tiers"]

_EVICTION = {f"radix-{name}": name for name in EVICTION_ORDERS}


class RadixReplayer:
    """The radix tree as a replay policy, one request at a time.

    Owns a ``BlockAllocator(num_blocks=capacity, block_size=1)`` and a
    ``RadixCache`` over it, which ``place_prompt`` serves each request from
    (``alloc`` and ``cache``, exposed for inspection; do not mutate them).
    Between requests every block is either free or held by the tree alone.

    With ``host_capacity > 0`` the cache also has a host tier: ``host_alloc``
    (``BlockAllocator(host_capacity, 1)``) under a write-back, LRU-ordered
    ``HostTier`` whose ``copier`` (a ``NullCopier``) counts the blocks moved.
    ``host_capacity == 0`` (the default) is exactly the one-tier replayer
    (``host_alloc`` and ``copier`` are None). ``ValueError`` naming the
    argument for an unknown policy or a bad capacity.
    """

    def __init__(self, policy: str, capacity: int, host_capacity: int = 0) -> None:
        if policy not in _EVICTION:
            raise ValueError(f"policy must be one of {', '.join(_EVICTION)}, got {policy!r}")
        host_capacity = check_int("host_capacity", host_capacity, low=0)
        self.alloc = BlockAllocator(num_blocks=capacity, block_size=1)
        self.host_alloc: BlockAllocator | None = None
        self.copier: NullCopier | None = None
        eviction = _EVICTION[policy]
        if host_capacity:
            self.host_alloc = BlockAllocator(num_blocks=host_capacity, block_size=1)
            self.copier = NullCopier()
            host = HostTier(self.host_alloc, self.copier, write_policy="write_back", eviction="lru")
            self.cache: RadixCache = TieredRadixCache(self.alloc, eviction=eviction, host=host)
        else:
            self.cache = RadixCache(self.alloc, eviction=eviction)

    def step(self, seq: np.ndarray) -> int:
        """Serve one request (an int32 id array); return its device hit length in blocks.

        The device hit is the prefix that was on the device when the request
        arrived; ``step_tiers`` also says how many blocks were loaded from the
        host. Complexity: as ``step_tiers``.
        """
        return self.step_tiers(seq)[0]

    def step_tiers(self, seq: np.ndarray) -> tuple[int, int]:
        """Serve one request; return ``(device_hit, loaded)`` in blocks.

        ``device_hit`` is the length of the prefix of ``seq`` resident on the
        device at arrival; ``loaded`` the blocks right after it that were on
        the host alone and were loaded back (always 0 without a host tier).
        One ``place_prompt`` (match or load, evict the shortfall,
        allocate what fits, insert the longest prefix that fits; with a host
        tier the evicted leaves are backed up to the host, write-back, and an
        insert through host-only nodes the load could not bring back gives
        them the new, recomputed blocks), then its blocks are released at
        once: every block is again free or held by the tree alone.

        Without a host tier this is one ``match``; with one, one ``load``
        (a ``match`` that loads) and a ``peek``, so every node is touched once
        per request, as in the one-tier replay.

        Complexity: O(len(seq)) plus O(evicted leaves * log leaves), plus the
        host tier's backups and host evictions.
        """
        placed = place_prompt(self.cache, seq)
        self.alloc.decref_distinct(placed.blocks)
        return placed.num_hit_blocks, placed.num_loaded_blocks

    def count_matchable(self, trace: Trace) -> int:
        """Distinct device blocks some request of ``trace`` matches now (bumps LRU clocks).

        Matches only, never loads: host-only blocks are not counted (nor are
        they in ``cache.cached_blocks``). Complexity: O(total ids).
        """
        seen = np.zeros(self.alloc.num_blocks, dtype=bool)
        ids, offsets = trace.ids, trace.offsets
        for r in range(trace.num_requests):
            m = self.cache.match(ids[offsets[r] : offsets[r + 1]])
            seen[m.block_array] = True
            self.alloc.decref_distinct(m.block_array)
        return int(seen.sum())


@dataclass(frozen=True)
class TierReplay:
    """What ``radix_replay_tiers`` measured (int64 arrays, one entry per request; blocks).

    - ``hit_blocks[i]``: request i's device hit (resident on the device at arrival);
    - ``host_hit_blocks[i]``: the blocks right after it loaded back from the
      host (all 0 with ``host_capacity == 0``);
    - ``final_cache_blocks`` / ``final_host_blocks``: blocks the tree holds on
      the device / on the host after the last request (a host block may be a
      mirror of a device-resident one);
    - ``unreachable``: device blocks no request of the trace would match at
      the end (0 for a prefix-closed tree);
    - ``stats``: the cache's counters after the replay, before the
      reachability count (``loaded_blocks == host_hit_blocks.sum()``).
    """

    hit_blocks: np.ndarray
    host_hit_blocks: np.ndarray
    final_cache_blocks: int
    final_host_blocks: int
    unreachable: int
    stats: CacheStats


def radix_replay_tiers(
    trace: Trace, policy: str, capacity: int, host_capacity: int = 0
) -> TierReplay:
    """Replay ``trace`` through a ``RadixReplayer(policy, capacity, host_capacity)``.

    ``host_capacity == 0`` is the one-tier replay (``radix_replay``), and gives
    identical device figures. Raises as ``RadixReplayer``.

    Complexity: O(total ids * log leaves) for the replay, plus the host tier's
    work, plus O(total ids) for the reachability count.
    """
    # The tree never holds more blocks than the trace has ids on either tier (every block of
    # either is a distinct position some request inserted), so a bigger pool never runs short
    # either: clamping changes nothing but the memory a huge capacity would take.
    most = max(1, trace.num_accesses)
    replayer = RadixReplayer(policy, min(capacity, most), min(host_capacity, most))
    ids, offsets = trace.ids, trace.offsets
    hit_blocks = np.zeros(trace.num_requests, dtype=np.int64)
    host_hit_blocks = np.zeros(trace.num_requests, dtype=np.int64)
    step = replayer.step_tiers
    for r in range(trace.num_requests):
        hit_blocks[r], host_hit_blocks[r] = step(ids[offsets[r] : offsets[r + 1]])
    cache = replayer.cache
    stats = cache.stats
    final_cache_blocks = cache.cached_blocks
    unreachable = final_cache_blocks - replayer.count_matchable(trace)
    return TierReplay(
        hit_blocks=hit_blocks,
        host_hit_blocks=host_hit_blocks,
        final_cache_blocks=final_cache_blocks,
        final_host_blocks=stats.host_blocks,
        unreachable=unreachable,
        stats=stats,
    )


def radix_replay(trace: Trace, policy: str, capacity: int) -> tuple[np.ndarray, int, int, int]:
    """Replay ``trace``; return ``(hit_blocks, block_hits, final_cache_blocks, unreachable)``.

    The one-tier replay: ``hit_blocks[i]`` is request i's matched length (see
    ``RadixReplayer.step``); ``block_hits`` their sum. ``unreachable`` counts
    tree blocks no request of the trace would match at the end (measured by
    matching every request; 0 for a prefix-closed tree). ``radix_replay_tiers``
    adds the host tier.

    Complexity: O(total ids * log leaves) for the replay plus O(total ids) for
    the reachability count.
    """
    r = radix_replay_tiers(trace, policy, capacity)
    return r.hit_blocks, int(r.hit_blocks.sum()), r.final_cache_blocks, r.unreachable
