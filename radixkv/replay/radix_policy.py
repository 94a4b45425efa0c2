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

With ``store_capacity > 0`` as well, a KV store tier hangs below the host
(``radixkv.cache.store.tier.StoreTier`` over a ``MemoryStore`` of
``store_capacity * STORE_ENTRY_BYTES`` bytes, so it holds exactly
``store_capacity`` blocks, least recently used out first): blocks the host lets
go of (``write_back``) or every host backup (``write_through``) are put there,
and a request whose prefix goes on in the store past the device and the host
reads that run back through the host to the device. The pools then hold real
payloads (``radixkv.replay.id_pools.IdPools``: one id per block), and every
served block is checked to hold its position's id.
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
from radixkv.cache.store import MemoryStore
from radixkv.cache.store.protocol import StoreStats
from radixkv.cache.store.tier import StoreTier, StoreTierStats
from radixkv.cache.tiered import TieredRadixCache
from radixkv.checks import check_int
from radixkv.replay.id_pools import REPLAY_KEYSPACE, STORE_ENTRY_BYTES, IdPools
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
    (``host_alloc`` and ``copier`` are None).

    With ``store_capacity > 0`` (which needs ``host_capacity > 0``) the host tier
    gets a ``StoreTier`` (``store_tier``) over ``store``, a ``MemoryStore`` of
    ``store_capacity * STORE_ENTRY_BYTES`` bytes, written under
    ``store_write_policy``; ``copier`` is then an ``IdPools`` (both pools hold
    each block's id, and the store tier's payloads are those ids).
    ``ValueError`` naming the argument for an unknown policy, a bad capacity or
    write policy, or a store without a host tier.
    """

    def __init__(
        self,
        policy: str,
        capacity: int,
        host_capacity: int = 0,
        store_capacity: int = 0,
        store_write_policy: str = "write_back",
    ) -> None:
        if policy not in _EVICTION:
            raise ValueError(f"policy must be one of {', '.join(_EVICTION)}, got {policy!r}")
        host_capacity = check_int("host_capacity", host_capacity, low=0)
        store_capacity = check_int("store_capacity", store_capacity, low=0)
        if store_capacity and not host_capacity:
            raise ValueError(
                f"store_capacity needs a host tier (the store sits below it), got store_capacity="
                f"{store_capacity} with host_capacity=0"
            )
        self.alloc = BlockAllocator(num_blocks=capacity, block_size=1)
        self.host_alloc: BlockAllocator | None = None
        self.copier: NullCopier | IdPools | None = None
        self.store: MemoryStore | None = None
        self.store_tier: StoreTier | None = None
        self._pools: IdPools | None = None
        eviction = _EVICTION[policy]
        if host_capacity:
            self.host_alloc = BlockAllocator(num_blocks=host_capacity, block_size=1)
            if store_capacity:
                self.copier = self._pools = IdPools(capacity, host_capacity)
                self.store = MemoryStore(store_capacity * STORE_ENTRY_BYTES)
                self.store_tier = StoreTier(
                    self.store, REPLAY_KEYSPACE, self._pools, write_policy=store_write_policy
                )
            else:
                self.copier = NullCopier()
            host = HostTier(
                self.host_alloc,
                self.copier,
                write_policy="write_back",
                eviction="lru",
                store=self.store_tier,
            )
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
        if self.store_tier is not None:
            device, host, store = self.step_store(seq)
            return device, host + store
        placed = place_prompt(self.cache, seq)
        self.alloc.decref_distinct(placed.blocks)
        return placed.num_hit_blocks, placed.num_loaded_blocks

    def step_store(self, seq: np.ndarray) -> tuple[int, int, int]:
        """Serve one request with a store tier; return ``(device_hit, host_hit, store_hit)``.

        The three partition the prefix the request was served from the cache:
        ``device_hit`` blocks resident on the device at arrival, then ``host_hit``
        blocks loaded back from the host, then ``store_hit`` blocks read from the
        store that reached the device (a store run that only reached the host, the
        device being too short, is recomputed and not counted). Each served block
        is checked to hold its position's id (``InvariantError`` otherwise), and the
        blocks computed for the rest get theirs. Without a store it is
        ``step_tiers`` with ``store_hit`` 0. Complexity: as ``step_tiers``, plus the
        store tier's hashing, puts and gets.
        """
        pools, tier = self._pools, self.store_tier
        if tier is None or pools is None:
            device, host = self.step_tiers(seq)
            return device, host, 0
        placed = place_prompt(self.cache, seq)
        served = placed.num_hit_blocks + placed.num_loaded_blocks
        blocks = placed.blocks
        pools.check(blocks[:served], seq[:served])
        pools.computed(blocks[served:], seq[served : len(blocks)])
        self.alloc.decref_distinct(blocks)
        store_hit = placed.num_store_blocks
        return placed.num_hit_blocks, placed.num_loaded_blocks - store_hit, store_hit

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
      reachability count (``loaded_blocks == host_hit_blocks.sum() +
      store_hit_blocks.sum()``).

    With a store tier (``store_capacity > 0``):

    - ``store_hit_blocks[i]``: the blocks right after the host's part that were
      read from the store and reached the device (all 0 without a store);
    - ``store_stats``: the store tier's counters (``StoreTierStats``: lookups,
      loaded and put blocks, ...), ``store_counts`` the ``MemoryStore``'s own
      (``StoreStats``: evicted, used bytes, entries); both None without a store.
    """

    hit_blocks: np.ndarray
    host_hit_blocks: np.ndarray
    final_cache_blocks: int
    final_host_blocks: int
    unreachable: int
    stats: CacheStats
    store_hit_blocks: np.ndarray
    store_stats: StoreTierStats | None = None
    store_counts: StoreStats | None = None


def radix_replay_tiers(
    trace: Trace,
    policy: str,
    capacity: int,
    host_capacity: int = 0,
    store_capacity: int = 0,
    store_write_policy: str = "write_back",
) -> TierReplay:
    """Replay ``trace`` through a ``RadixReplayer(policy, capacity, host_capacity,
    store_capacity, store_write_policy)``.

    ``host_capacity == 0`` is the one-tier replay (``radix_replay``), and gives
    identical device figures; ``store_capacity == 0`` is the two-tier one. Raises
    as ``RadixReplayer``.

    Complexity: O(total ids * log leaves) for the replay, plus the host and store
    tiers' work (the store's: hashing each request's blocks past the tree's
    match, O(total ids) in all), plus O(total ids) for the reachability count.
    """
    # The tree never holds more blocks than the trace has ids on either tier (every block of
    # either is a distinct position some request inserted), so a bigger pool never runs short
    # either: clamping changes nothing but the memory a huge capacity would take. The store
    # is not clamped: its capacity is a byte count that reserves no memory.
    most = max(1, trace.num_accesses)
    replayer = RadixReplayer(
        policy,
        min(capacity, most),
        min(host_capacity, most),
        store_capacity,
        store_write_policy,
    )
    ids, offsets = trace.ids, trace.offsets
    hit_blocks = np.zeros(trace.num_requests, dtype=np.int64)
    host_hit_blocks = np.zeros(trace.num_requests, dtype=np.int64)
    store_hit_blocks = np.zeros(trace.num_requests, dtype=np.int64)
    if replayer.store_tier is None:
        step = replayer.step_tiers
        for r in range(trace.num_requests):
            hit_blocks[r], host_hit_blocks[r] = step(ids[offsets[r] : offsets[r + 1]])
    else:
        step3 = replayer.step_store
        for r in range(trace.num_requests):
            seq = ids[offsets[r] : offsets[r + 1]]
            hit_blocks[r], host_hit_blocks[r], store_hit_blocks[r] = step3(seq)
    cache = replayer.cache
    stats = cache.stats
    tier, store = replayer.store_tier, replayer.store
    store_stats = None if tier is None else tier.stats
    store_counts = None if store is None else store.stats
    final_cache_blocks = cache.cached_blocks
    unreachable = final_cache_blocks - replayer.count_matchable(trace)
    return TierReplay(
        hit_blocks=hit_blocks,
        host_hit_blocks=host_hit_blocks,
        final_cache_blocks=final_cache_blocks,
        final_host_blocks=stats.host_blocks,
        unreachable=unreachable,
        stats=stats,
        store_hit_blocks=store_hit_blocks,
        store_stats=store_stats,
        store_counts=store_counts,
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
