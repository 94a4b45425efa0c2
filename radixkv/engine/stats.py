"""What an engine's run cost, rolled up: over a set of requests, and by cache tier.

Plain records (numpy, no torch), so a server's metrics or a benchmark's report read them
without the model tier. A single request's cost is :class:`~radixkv.engine.request.RequestStats`;
:class:`EngineStats` aggregates a set of them and :class:`TierStats` turns the prefix cache's
counters (:class:`~radixkv.cache.results.CacheStats`) into tokens and bytes per tier.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from radixkv.cache.results import CacheStats
from radixkv.cache.store.protocol import StoreStats
from radixkv.cache.store.tier import StoreTierStats
from radixkv.engine.request import RequestStats

__all__ = ["EngineStats", "TierStats"]


@dataclass(frozen=True)
class EngineStats:
    """Aggregate over a set of finished requests (times in seconds).

    ``hit_rate`` is ``cached_tokens / prompt_tokens`` (tokens matched at first
    admission); ``throughput`` is output tokens per second of ``wall_time``.
    """

    num_requests: int
    prompt_tokens: int
    cached_tokens: int
    prefill_tokens: int
    decode_tokens: int
    output_tokens: int
    preemptions: int
    wall_time: float
    ttft_median: float
    ttft_p90: float
    decode_tps_median: float
    throughput: float
    hit_rate: float

    @classmethod
    def of(cls, stats: Sequence[RequestStats], wall_time: float) -> EngineStats:
        """The aggregate of ``stats`` over ``wall_time`` seconds; NaN for a median or a
        rate with nothing to measure. Complexity: O(len(stats) log len(stats))."""
        nan = float("nan")
        ttft = np.array([s.ttft for s in stats], dtype=np.float64)
        tps = np.array([s.decode_tps for s in stats if s.decode_tps == s.decode_tps])
        prompt = sum(s.prompt_tokens for s in stats)
        cached = sum(s.cached_tokens for s in stats)
        output = sum(s.output_tokens for s in stats)
        return cls(
            num_requests=len(stats),
            prompt_tokens=prompt,
            cached_tokens=cached,
            prefill_tokens=sum(s.prefill_tokens for s in stats),
            decode_tokens=sum(s.decode_tokens for s in stats),
            output_tokens=output,
            preemptions=sum(s.preemptions for s in stats),
            wall_time=wall_time,
            ttft_median=float(np.median(ttft)) if ttft.size else nan,
            ttft_p90=float(np.percentile(ttft, 90)) if ttft.size else nan,
            decode_tps_median=float(np.median(tps)) if tps.size else nan,
            throughput=output / wall_time if wall_time > 0 else nan,
            hit_rate=cached / prompt if prompt else 0.0,
        )


@dataclass(frozen=True)
class TierStats:
    """The prefix cache's hits by tier and the traffic between tiers (tokens unless noted).

    ``device_hit_tokens`` were matched on the device; ``host_hit_tokens`` were
    found in host memory (and reloaded, unless the pool could not take them);
    ``loaded_tokens`` / ``loaded_bytes`` moved host to device; ``backed_up_*``
    device to host; ``skipped_backup_blocks`` left the device with no host copy
    (no host space). Zeros without a host tier, but for the device hits.

    The KV store below the host (``has_store``; zeros without one), in blocks:
    ``store_loaded_*`` read from the store into the host pool, in
    ``store_load_seconds``; ``store_stored_*`` written to it, in
    ``store_store_seconds``; ``store_load_misses`` loads cut short by a block the
    store no longer gave; ``store_corrupt_blocks`` entries refused as unsound (the
    store's checksum or the tier's size check: recomputed, never served);
    ``store_errors`` store or codec calls that failed (answered as misses or skipped
    writes); ``store_used_bytes`` / ``store_entries`` what this process's store holds.
    """

    device_hit_tokens: int
    host_hit_tokens: int
    loaded_tokens: int
    loaded_bytes: int
    backed_up_blocks: int
    backed_up_bytes: int
    skipped_backup_blocks: int
    host_blocks: int
    has_store: bool = False
    store_loaded_blocks: int = 0
    store_loaded_bytes: int = 0
    store_load_seconds: float = 0.0
    store_load_misses: int = 0
    store_stored_blocks: int = 0
    store_stored_bytes: int = 0
    store_store_seconds: float = 0.0
    store_corrupt_blocks: int = 0
    store_errors: int = 0
    store_used_bytes: int = 0
    store_entries: int = 0

    @classmethod
    def of(
        cls,
        stats: CacheStats,
        block_size: int,
        bytes_per_block: int,
        tier: StoreTierStats | None = None,
        store: StoreStats | None = None,
    ) -> TierStats:
        """``stats`` in tokens and bytes, for a pool of ``block_size``-token blocks of
        ``bytes_per_block`` bytes each; with the store tier's ``tier`` and its store's
        ``store`` counters when there is one (both or neither). O(1)."""
        kept: dict[str, bool | int | float] = {}
        if tier is not None and store is not None:
            kept = {
                "has_store": True,
                "store_loaded_blocks": tier.loaded_blocks,
                "store_loaded_bytes": tier.loaded_bytes,
                "store_load_seconds": tier.load_seconds,
                "store_load_misses": tier.load_misses,
                "store_stored_blocks": tier.stored_blocks,
                "store_stored_bytes": tier.stored_bytes,
                "store_store_seconds": tier.store_seconds,
                # the store refuses a bad entry (checksum), the tier a bad payload (size)
                "store_corrupt_blocks": store.corrupt + tier.corrupt_blocks,
                # the store answers its own faults as misses; the tier counts calls that raised
                "store_errors": store.errors + tier.errors,
                "store_used_bytes": store.used_bytes,
                "store_entries": store.num_entries,
            }
        return cls(
            device_hit_tokens=stats.hit_tokens,
            host_hit_tokens=stats.host_hit_tokens,
            loaded_tokens=stats.loaded_blocks * block_size,
            loaded_bytes=stats.loaded_blocks * bytes_per_block,
            backed_up_blocks=stats.backed_up_blocks,
            backed_up_bytes=stats.backed_up_blocks * bytes_per_block,
            skipped_backup_blocks=stats.skipped_backup_blocks,
            host_blocks=stats.host_blocks,
            **kept,
        )
