"""replay(): one trace through one cache policy, with per-request and total figures."""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from radixkv.cache.results import CacheStats
from radixkv.cache.store.protocol import StoreStats
from radixkv.cache.store.tier import StoreTierStats
from radixkv.replay import flat_policies
from radixkv.replay.config import FLAT_POLICIES, ReplayConfig
from radixkv.replay.id_pools import STORE_ENTRY_BYTES
from radixkv.replay.radix_policy import radix_replay_tiers
from radixkv.replay.trace import Trace, TraceRequest

__all__ = ["ReplayResult", "hit_tokens_for", "replay"]


@dataclass(frozen=True)
class ReplayResult:
    """What a replay measured. Token figures are ints; arrays are int64, one entry per request.

    - ``prompt_tokens[i]``: request i's ``input_length``;
    - ``hit_blocks[i]``: its prefix hit length k in blocks (ids);
    - ``hit_tokens[i] = min(k * block_size, input_length)``;
    - ``block_hits`` / ``block_misses``: accesses that found / did not find
      their block resident (flat policies decide this per access, so blocks
      past a request's first miss count too; the radix tree's hits are its
      matched prefixes); ``block_hits + host_block_hits + store_block_hits +
      block_misses`` is the total number of ids (``host_block_hits`` is 0
      without a host tier, ``store_block_hits`` without a store tier);
    - ``final_cache_blocks``: blocks resident after the last request (S3FIFO:
      ``|S| + |M|``, never the ghost; radix: blocks the tree holds);
    - ``unreachable_blocks``: resident blocks that no request of the trace
      would get as part of its prefix hit now, because some block before them
      on every path is not resident (wasted capacity; always 0 for the tree);
    - ``orphan_blocks``: resident blocks whose parent id (the id before it
      where it first appears in the trace) is not resident: the direct form
      of the same test, ``orphan_blocks <= unreachable_blocks`` on chained ids
      (always 0 for the tree, whose resident set is prefix-closed).

    With a host tier (``config.host_capacity > 0``, radix policies only), the
    figures above are the device's, and:

    - ``host_hit_blocks[i]``: the blocks right after request i's device hit
      that were on the host alone and were loaded back instead of recomputed;
    - ``host_hit_tokens[i] = min((k + h) * block_size, input_length) -
      hit_tokens[i]`` for ``h = host_hit_blocks[i]``: the prompt tokens those
      blocks served (the cap falls on the last block, whichever tier it is in);
    - ``host_block_hits``: their sum; ``final_host_blocks``: blocks the host
      holds after the last request (copies of evicted blocks, and mirrors of
      device-resident ones);
    - ``cache_stats``: the tree's ``CacheStats`` after the replay (radix
      policies; None for the flat ones), e.g. ``backed_up_blocks``,
      ``host_evicted_blocks``, ``skipped_backup_blocks``.

    With a store tier below the host as well (``config.store_capacity > 0``):

    - ``store_hit_blocks[i]``: the blocks right after the host's part that were
      read from the store and reached the device; ``store_hit_tokens[i] =
      min((k + h + s) * block_size, input_length) - hit_tokens[i] -
      host_hit_tokens[i]`` for ``s = store_hit_blocks[i]``: device, host and store
      tokens partition the served prefix, ``min((k + h + s) * block_size,
      input_length)``;
    - ``store_block_hits``: their sum (``block_hits + host_block_hits +
      store_block_hits + block_misses`` is the number of ids);
    - ``store_stats``: the store tier's counters (``StoreTierStats``: ``lookups``,
      ``found_blocks``, ``loaded_blocks``, ``put_blocks``, ``stored_blocks``, ...);
      ``store_counts``: the store's own (``StoreStats``: ``evicted``,
      ``num_entries``, ...). ``loaded_blocks`` may exceed ``store_block_hits``:
      a run read into the host that the device had no room for is recomputed.

    Without them these are zeros and None (the defaults, so a result built
    without them reads the same). ``recompute_tokens[i] = prompt_tokens[i] -
    hit_tokens[i] - host_hit_tokens[i] - store_hit_tokens[i]`` is what request i
    had to prefill.
    """

    config: ReplayConfig
    prompt_tokens: np.ndarray
    hit_blocks: np.ndarray
    hit_tokens: np.ndarray
    block_hits: int
    block_misses: int
    final_cache_blocks: int
    unreachable_blocks: int
    orphan_blocks: int
    host_hit_blocks: np.ndarray | None = field(default=None)
    host_hit_tokens: np.ndarray | None = field(default=None)
    host_block_hits: int = 0
    final_host_blocks: int = 0
    cache_stats: CacheStats | None = None
    store_hit_blocks: np.ndarray | None = field(default=None)
    store_hit_tokens: np.ndarray | None = field(default=None)
    store_block_hits: int = 0
    store_stats: StoreTierStats | None = None
    store_counts: StoreStats | None = None

    def __post_init__(self) -> None:
        # Absent tier figures are zeros, one per request: after this no array is None.
        for name in ("host_hit_blocks", "host_hit_tokens", "store_hit_blocks", "store_hit_tokens"):
            if getattr(self, name) is None:
                object.__setattr__(self, name, np.zeros(len(self.prompt_tokens), dtype=np.int64))

    @property
    def policy(self) -> str:
        return self.config.policy

    @property
    def num_requests(self) -> int:
        return len(self.prompt_tokens)

    @property
    def total_prompt_tokens(self) -> int:
        return int(self.prompt_tokens.sum())

    @property
    def total_hit_tokens(self) -> int:
        return int(self.hit_tokens.sum())

    @property
    def overall_hit_rate(self) -> float:
        """``total_hit_tokens / total_prompt_tokens`` (0.0 when there are no prompt tokens).

        The device's hit rate: host hits are not in it (see ``combined_hit_rate``).
        """
        total = self.total_prompt_tokens
        return self.total_hit_tokens / total if total else 0.0

    @property
    def total_host_hit_tokens(self) -> int:
        """Prompt tokens served by blocks loaded back from the host (0 without a host tier)."""
        return int(self.host_hit_tokens.sum())

    @property
    def total_store_hit_tokens(self) -> int:
        """Prompt tokens served by blocks read from the store (0 without a store tier)."""
        return int(self.store_hit_tokens.sum())

    @property
    def recompute_tokens(self) -> np.ndarray:
        """Per request, the prompt tokens no tier had: ``prompt - hit - host_hit - store_hit``."""
        return self.prompt_tokens - self.hit_tokens - self.host_hit_tokens - self.store_hit_tokens

    @property
    def host_hit_rate(self) -> float:
        """``total_host_hit_tokens / total_prompt_tokens`` (0.0 when there are no prompt tokens)."""
        total = self.total_prompt_tokens
        return self.total_host_hit_tokens / total if total else 0.0

    @property
    def store_hit_rate(self) -> float:
        """``total_store_hit_tokens / total_prompt_tokens`` (0.0 when there are none)."""
        total = self.total_prompt_tokens
        return self.total_store_hit_tokens / total if total else 0.0

    @property
    def combined_hit_rate(self) -> float:
        """Prompt tokens served by any tier (device, host, store) over all prompt tokens
        (0.0 for none)."""
        total = self.total_prompt_tokens
        served = self.total_hit_tokens + self.total_host_hit_tokens + self.total_store_hit_tokens
        return served / total if total else 0.0

    def to_dict(self, per_request: bool = False) -> dict[str, Any]:
        """The CLI's JSON object; with ``per_request``, a ``per_request`` list in trace order.

        With a host tier (``config.host_capacity > 0``) it also has
        ``host_capacity_blocks, total_host_hit_tokens, host_hit_rate,
        combined_hit_rate, host_block_hits, final_host_blocks``, and each
        ``per_request`` entry a ``host_hit_tokens``; without one it is exactly
        the one-tier object. With a store tier (``config.store_capacity > 0``) it
        also has ``store_capacity_blocks, store_capacity_bytes,
        store_write_policy, total_store_hit_tokens, store_hit_rate,
        store_block_hits`` and the counters ``store_lookups, store_found_blocks,
        store_loaded_blocks, store_put_blocks, store_stored_blocks,
        store_evicted_blocks, final_store_blocks`` (``combined_hit_rate`` then
        counts the store's tokens too), and each ``per_request`` entry a
        ``store_hit_tokens``; without one it is exactly the two-tier object.
        """
        out: dict[str, Any] = {
            "policy": self.config.policy,
            "cache_capacity_blocks": self.config.capacity,
            "block_size": self.config.block_size,
            "num_requests": self.num_requests,
            "total_prompt_tokens": self.total_prompt_tokens,
            "total_hit_tokens": self.total_hit_tokens,
            "overall_hit_rate": self.overall_hit_rate,
            "final_cache_blocks": self.final_cache_blocks,
            "block_hits": self.block_hits,
            "block_misses": self.block_misses,
            "unreachable_blocks": self.unreachable_blocks,
            "orphan_blocks": self.orphan_blocks,
        }
        tiered = self.config.host_capacity > 0
        if tiered:
            out.update(
                host_capacity_blocks=self.config.host_capacity,
                total_host_hit_tokens=self.total_host_hit_tokens,
                host_hit_rate=self.host_hit_rate,
                combined_hit_rate=self.combined_hit_rate,
                host_block_hits=self.host_block_hits,
                final_host_blocks=self.final_host_blocks,
            )
            stats = self.cache_stats
            if stats is not None:
                out.update(
                    backed_up_blocks=stats.backed_up_blocks,
                    host_evicted_blocks=stats.host_evicted_blocks,
                    skipped_backup_blocks=stats.skipped_backup_blocks,
                )
        stored = self.config.store_capacity > 0
        tier, counts = self.store_stats, self.store_counts
        if stored:
            out.update(
                store_capacity_blocks=self.config.store_capacity,
                store_capacity_bytes=self.config.store_capacity * STORE_ENTRY_BYTES,
                store_write_policy=self.config.store_write_policy,
                total_store_hit_tokens=self.total_store_hit_tokens,
                store_hit_rate=self.store_hit_rate,
                store_block_hits=self.store_block_hits,
            )
            if tier is not None and counts is not None:
                out.update(
                    store_lookups=tier.lookups,
                    store_found_blocks=tier.found_blocks,
                    store_loaded_blocks=tier.loaded_blocks,
                    store_put_blocks=tier.put_blocks,
                    store_stored_blocks=tier.stored_blocks,
                    store_evicted_blocks=counts.evicted,
                    final_store_blocks=counts.num_entries,
                )
        if per_request:
            prompts, hits = self.prompt_tokens.tolist(), self.hit_tokens.tolist()
            if stored:
                out["per_request"] = [
                    {
                        "prompt_tokens": p,
                        "hit_tokens": h,
                        "host_hit_tokens": g,
                        "store_hit_tokens": t,
                    }
                    for p, h, g, t in zip(
                        prompts,
                        hits,
                        self.host_hit_tokens.tolist(),
                        self.store_hit_tokens.tolist(),
                        strict=True,
                    )
                ]
            elif tiered:
                out["per_request"] = [
                    {"prompt_tokens": p, "hit_tokens": h, "host_hit_tokens": g}
                    for p, h, g in zip(prompts, hits, self.host_hit_tokens.tolist(), strict=True)
                ]
            else:
                pairs = zip(prompts, hits, strict=True)
                out["per_request"] = [{"prompt_tokens": p, "hit_tokens": h} for p, h in pairs]
        return out


def hit_tokens_for(
    hit_blocks: np.ndarray, input_lengths: np.ndarray, block_size: int
) -> np.ndarray:
    """``min(k * block_size, input_length)`` per request: the partial last block is capped."""
    return np.minimum(hit_blocks.astype(np.int64) * block_size, input_lengths)


def replay(
    requests: Trace | Iterable[TraceRequest | Mapping[str, Any]],
    policy: str,
    capacity: int,
    block_size: int = 512,
    small_ratio: float = 0.1,
    max_freq: int = 3,
    host_capacity: int = 0,
    store_capacity: int = 0,
    store_write_policy: str = "write_back",
) -> ReplayResult:
    """Replay ``requests`` in order through ``policy`` with room for ``capacity`` blocks.

    ``requests`` is a ``Trace`` (from ``load_trace``) or an iterable of
    ``TraceRequest`` objects or mappings with the trace fields. Per request: the
    prefix hit k is taken at arrival (the longest run of resident ids from
    index 0), then every id is accessed against the policy in order
    (``lru``, ``lfu``, ``s3fifo``), or the radix tree matches and inserts the
    sequence (``radix-level``, ``radix-lru``). ``host_capacity > 0`` gives the
    radix tree a host-memory tier of that many blocks (``RadixReplayer``):
    blocks the device evicts wait there, and a request loads what it finds
    there back (``ReplayResult.host_hit_tokens``). ``store_capacity > 0`` puts a
    KV store tier of that many blocks below the host, written under
    ``store_write_policy`` (``RadixReplayer``; ``ReplayResult.store_hit_tokens``).
    See ``ReplayConfig`` for the parameters. Raises ``ValueError``/``TypeError``
    for bad parameters (a negative ``host_capacity``, one > 0 with a flat policy,
    a store without a host tier, included) and ``TraceError`` for bad requests,
    before replaying anything.

    Complexity: O(total ids) time and memory, compiled, for the flat policies;
    the radix policies run the Python tree, O(total ids * log leaves).
    """
    config = ReplayConfig(
        policy,
        capacity,
        block_size,
        small_ratio,
        max_freq,
        host_capacity,
        store_capacity,
        store_write_policy,
    )
    trace = requests if isinstance(requests, Trace) else Trace.from_requests(requests)
    if config.policy in FLAT_POLICIES:
        hit_blocks, block_hits, resident = _run_flat(trace, config)
        final_cache_blocks = int(resident.sum())
        reach = flat_policies.reachable_mask(trace.ids, trace.offsets, resident)
        unreachable = final_cache_blocks - int(reach.sum())
        orphans = int(flat_policies.orphan_count(trace.ids, trace.offsets, resident))
        host_hit_blocks = np.zeros(trace.num_requests, dtype=np.int64)
        store_hit_blocks = host_hit_blocks
        final_host_blocks = 0
        cache_stats = None
        store_stats = store_counts = None
    else:
        tiers = radix_replay_tiers(
            trace,
            config.policy,
            config.capacity,
            config.host_capacity,
            config.store_capacity,
            config.store_write_policy,
        )
        hit_blocks, host_hit_blocks = tiers.hit_blocks, tiers.host_hit_blocks
        store_hit_blocks = tiers.store_hit_blocks
        store_stats, store_counts = tiers.store_stats, tiers.store_counts
        block_hits = int(hit_blocks.sum())
        final_cache_blocks, final_host_blocks = tiers.final_cache_blocks, tiers.final_host_blocks
        unreachable = tiers.unreachable
        cache_stats = tiers.stats
        orphans = 0  # the tree evicts leaves only: every resident block's parent is resident
    block_hits = int(block_hits)
    host_block_hits = int(host_hit_blocks.sum())
    store_block_hits = int(store_hit_blocks.sum())
    lengths, bs = trace.input_lengths, config.block_size
    hit_tokens = hit_tokens_for(hit_blocks, lengths, bs)
    upto_host = hit_tokens_for(hit_blocks + host_hit_blocks, lengths, bs)
    upto_store = hit_tokens_for(hit_blocks + host_hit_blocks + store_hit_blocks, lengths, bs)
    return ReplayResult(
        config=config,
        prompt_tokens=lengths.copy(),
        hit_blocks=hit_blocks,
        hit_tokens=hit_tokens,
        block_hits=block_hits,
        block_misses=trace.num_accesses - block_hits - host_block_hits - store_block_hits,
        final_cache_blocks=final_cache_blocks,
        unreachable_blocks=unreachable,
        orphan_blocks=orphans,
        host_hit_blocks=host_hit_blocks,
        host_hit_tokens=upto_host - hit_tokens,
        host_block_hits=host_block_hits,
        final_host_blocks=final_host_blocks,
        cache_stats=cache_stats,
        store_hit_blocks=store_hit_blocks,
        store_hit_tokens=upto_store - upto_host,
        store_block_hits=store_block_hits,
        store_stats=store_stats,
        store_counts=store_counts,
    )


def _run_flat(trace: Trace, config: ReplayConfig) -> tuple[np.ndarray, int, np.ndarray]:
    ids, offsets, num_ids = trace.ids, trace.offsets, trace.num_ids
    if config.policy == "lru":
        return flat_policies.lru_kernel(ids, offsets, num_ids, config.capacity)
    if config.policy == "lfu":
        return flat_policies.lfu_kernel(ids, offsets, num_ids, config.capacity)
    return flat_policies.s3fifo_kernel(
        ids, offsets, num_ids, config.small_cap, config.main_cap, config.max_freq
    )
