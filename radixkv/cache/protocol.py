"""PrefixCache: the surface every block-level prefix cache in radixkv offers.

``RadixCache`` (token-level radix tree) and ``HashBlockCache`` (vLLM-style
chained block hashes) both satisfy this protocol structurally, so a serving
loop, the trace replayer or a benchmark can take either one.

Reference ownership, common to every implementation (ARCHITECTURE.md):

- A block's refcount is the number of running requests holding it, plus 1
  while the cache holds it. The cache holds exactly one reference on each
  block it caches.
- ``match`` hands the caller one new reference on every returned block.
- ``insert`` takes the cache's own reference on each block it adopts and never
  touches the caller's references; the caller always ends a request with
  ``allocator.decref(request_blocks)``, which frees the duplicates the cache
  did not adopt.
- ``evict`` and ``reset`` give back only the cache's own references; a block a
  request still holds (refcount > 1) is never freed by ``evict``.
- Every method validates its input first: on ``TypeError`` / ``ValueError``
  neither the cache nor any refcount has changed.
"""

from __future__ import annotations

from collections.abc import Hashable, Iterable
from typing import Protocol, runtime_checkable

import numpy as np

from radixkv.cache.allocator import BlockAllocator
from radixkv.cache.arrays import TokenSeq
from radixkv.cache.results import CacheStats, MatchResult

__all__ = ["PrefixCache", "check_namespace", "check_num_blocks", "release_held"]


@runtime_checkable
class PrefixCache(Protocol):
    """A block-level prefix cache over a ``BlockAllocator``.

    ``tokens`` arguments accept a list/tuple of ints, a 1-D integer numpy
    array or a 1-D integer torch tensor (see ``radixkv.cache.arrays``); anything
    else raises ``TypeError`` / ``ValueError`` with the cache unchanged.
    ``namespace`` is any hashable (a tenant, a LoRA adapter, a cache salt):
    equal tokens under different namespaces never share blocks.
    """

    @property
    def allocator(self) -> BlockAllocator:
        """The allocator whose blocks the cache holds references on."""
        ...

    @property
    def block_size(self) -> int:
        """Tokens per block (the allocator's)."""
        ...

    def match(self, tokens: TokenSeq, namespace: Hashable = None) -> MatchResult:
        """Longest cached block-aligned prefix of ``tokens`` under ``namespace``.

        Ownership: the caller receives one reference on each block of the
        result and must ``decref`` it. ``num_tokens == len(blocks) *
        block_size``; a block that only partly agrees with ``tokens`` is never
        matched (rounded down). Counts the query and hit tokens in ``stats``
        and marks the matched blocks recently used.
        """
        ...

    def insert(self, tokens: TokenSeq, blocks: Iterable[int], namespace: Hashable = None) -> int:
        """Cache the ``len(tokens) // block_size`` full blocks of ``tokens``.

        ``blocks[i]`` holds tokens ``[i * bs, (i + 1) * bs)``; at least that
        many entries, each allocated, distinct where adopted. Returns how many
        leading tokens were cached already (a multiple of ``block_size``).
        Ownership: the cache takes its own reference on each block it adopts;
        blocks whose content is already cached are not adopted. The caller's
        references are untouched. ``ValueError`` / ``TypeError`` before any
        change.
        """
        ...

    def evict(self, num_blocks: int) -> int:
        """Free at least ``num_blocks`` cached blocks if that many are evictable, else all it can.

        Returns the number of blocks freed. Never frees a block a request
        holds. ``ValueError`` for a negative count, ``TypeError`` for a
        non-int, before any change.
        """
        ...

    def reset(self) -> None:
        """Give back the cache's reference on every block it holds and forget them all.

        Blocks no request holds become free; requests keep theirs. Stats are kept.
        """
        ...

    @property
    def cached_blocks(self) -> int:
        """Blocks the cache holds a reference on."""
        ...

    @property
    def evictable_blocks(self) -> int:
        """Of the cached blocks, how many ``evict`` could free now."""
        ...

    @property
    def stats(self) -> CacheStats:
        """A snapshot of the cumulative counters (tokens unless noted)."""
        ...

    def check(self) -> None:
        """Assert every invariant of the structure; ``AssertionError`` naming the first broken."""
        ...


# What the implementations share: the same input checks and the same bookkeeping of
# the one reference a cache holds per cached block (a bool map over the allocator).


def check_namespace(namespace: object) -> Hashable:
    """``namespace`` itself; ``TypeError`` naming its type if it is unhashable."""
    try:
        hash(namespace)
    except TypeError:
        raise TypeError(f"namespace must be hashable, got {type(namespace).__name__}") from None
    return namespace


def check_num_blocks(num_blocks: object) -> None:
    """``TypeError`` unless an int (bool excluded), ``ValueError`` if negative."""
    if isinstance(num_blocks, bool) or not isinstance(num_blocks, (int, np.integer)):
        raise TypeError(f"num_blocks must be an int, got {type(num_blocks).__name__}")
    if num_blocks < 0:
        raise ValueError(f"num_blocks must be >= 0, got {num_blocks}")


def release_held(allocator: BlockAllocator, held: np.ndarray) -> None:
    """Give back the cache's reference on every block flagged in ``held``; clear the flags.

    Mutates ``held`` and the allocator's refcounts. Complexity: O(num_blocks).
    """
    allocator.decref_distinct(np.flatnonzero(held).astype(np.int32))
    held[:] = False
