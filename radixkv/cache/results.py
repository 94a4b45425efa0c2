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
    ``num_tokens == len(blocks) * block_size``.
    """

    __slots__ = ("block_array", "num_tokens", "_blocks")

    def __init__(self, block_array: np.ndarray, num_tokens: int) -> None:
        self.block_array = block_array
        self.num_tokens = num_tokens
        self._blocks: list[int] | None = None

    @property
    def blocks(self) -> list[int]:
        if self._blocks is None:
            self._blocks = self.block_array.tolist()
        return self._blocks

    def __repr__(self) -> str:
        return f"MatchResult(blocks={self.blocks!r}, num_tokens={self.num_tokens})"

    def __eq__(self, other: object) -> bool:
        if not isinstance(other, MatchResult):
            return NotImplemented
        return self.num_tokens == other.num_tokens and self.blocks == other.blocks


@dataclass
class CacheStats:
    """Cumulative counters since the cache was built (``reset`` keeps them); tokens unless noted."""

    num_matches: int = 0
    query_tokens: int = 0
    hit_tokens: int = 0
    num_inserts: int = 0
    inserted_tokens: int = 0
    evicted_blocks: int = 0
    pinned_blocks: int = 0  # a gauge, not a counter: blocks pinned when the snapshot was taken

    @property
    def hit_rate(self) -> float:
        """hit_tokens / query_tokens (0.0 before any query)."""
        return self.hit_tokens / self.query_tokens if self.query_tokens else 0.0
