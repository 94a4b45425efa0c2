"""The records both caches return: ``MatchResult`` from ``match``, ``CacheStats`` from ``stats``."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

__all__ = ["CacheStats", "MatchResult"]


class MatchResult:
    """The longest cached block-aligned prefix of a query.

    ``block_array`` is an int32 array of the matched blocks in order;
    ``blocks`` is the same as ``list[int]`` (built on first access). One
    reference on each block belongs to whoever received this result.
    ``num_tokens == len(blocks) * block_size``. ``host_num_tokens`` is what a
    cache with a host tier holds past those, in host memory only (0 otherwise):
    ``TieredRadixCache.load`` brings it back to the device. ``loaded_num_tokens`` is
    the part of ``num_tokens`` that ``load`` did bring back (the last
    ``loaded_num_tokens // block_size`` blocks); 0 from ``match``.
    ``store_num_tokens`` is what a cache with a store tier below the host
    (``radixkv.cache.store.tier``) found in the store past the host-only tokens
    (0 otherwise); from ``load``, the part of it ``load`` did not bring up.
    ``store_loaded_num_tokens`` is the part of ``loaded_num_tokens`` that ``load`` read
    from the store on the way (the last of them; the rest came from the host); 0 from
    ``match``.
    """

    __slots__ = (
        "block_array",
        "num_tokens",
        "host_num_tokens",
        "loaded_num_tokens",
        "store_num_tokens",
        "store_loaded_num_tokens",
        "_blocks",
    )

    def __init__(
        self,
        block_array: np.ndarray,
        num_tokens: int,
        host_num_tokens: int = 0,
        loaded_num_tokens: int = 0,
        store_num_tokens: int = 0,
        store_loaded_num_tokens: int = 0,
    ) -> None:
        self.block_array = block_array
        self.num_tokens = num_tokens
        self.host_num_tokens = host_num_tokens
        self.loaded_num_tokens = loaded_num_tokens
        self.store_num_tokens = store_num_tokens
        self.store_loaded_num_tokens = store_loaded_num_tokens
        self._blocks: list[int] | None = None

    @property
    def blocks(self) -> list[int]:
        if self._blocks is None:
            self._blocks = self.block_array.tolist()
        return self._blocks

    def __repr__(self) -> str:
        host = f", host_num_tokens={self.host_num_tokens}" if self.host_num_tokens else ""
        if self.loaded_num_tokens:
            host += f", loaded_num_tokens={self.loaded_num_tokens}"
        if self.store_num_tokens:
            host += f", store_num_tokens={self.store_num_tokens}"
        if self.store_loaded_num_tokens:
            host += f", store_loaded_num_tokens={self.store_loaded_num_tokens}"
        return f"MatchResult(blocks={self.blocks!r}, num_tokens={self.num_tokens}{host})"

    def __eq__(self, other: object) -> bool:
        if not isinstance(other, MatchResult):
            return NotImplemented
        return (
            self.num_tokens == other.num_tokens
            and self.host_num_tokens == other.host_num_tokens
            and self.loaded_num_tokens == other.loaded_num_tokens
            and self.store_num_tokens == other.store_num_tokens
            and self.store_loaded_num_tokens == other.store_loaded_num_tokens
            and self.blocks == other.blocks
        )


@dataclass
class CacheStats:
    """Cumulative counters since the cache was built (``reset`` keeps them); tokens unless noted.

    With a host tier (``radixkv.cache.host``): ``host_hit_tokens`` are the
    matched tokens found in host memory only (past ``hit_tokens``, which are on
    the device); ``loaded_blocks`` were copied host to device by ``load``;
    ``backed_up_blocks`` device to host; ``skipped_backup_blocks`` left the
    device with no host copy (no host space could be had); ``host_evicted_blocks``
    left the host pool; ``host_blocks`` is a gauge like ``pinned_blocks``.
    """

    num_matches: int = 0
    query_tokens: int = 0
    hit_tokens: int = 0
    num_inserts: int = 0
    inserted_tokens: int = 0
    evicted_blocks: int = 0
    pinned_blocks: int = 0  # a gauge, not a counter: blocks pinned when the snapshot was taken
    host_hit_tokens: int = 0
    loaded_blocks: int = 0
    backed_up_blocks: int = 0
    skipped_backup_blocks: int = 0
    host_evicted_blocks: int = 0
    host_blocks: int = 0  # a gauge: host blocks holding a copy when the snapshot was taken

    @property
    def hit_rate(self) -> float:
        """hit_tokens / query_tokens (0.0 before any query)."""
        return self.hit_tokens / self.query_tokens if self.query_tokens else 0.0
