"""The whole-prompt cycle over a cache: match, evict the shortfall, allocate, insert.

For a loop that computes a whole prompt at once and tracks no request (trace
replay, the fleet simulator), :func:`place_prompt` does in one call what a
serving loop spreads over :class:`~radixkv.cache.manager.KVCacheManager`'s
calls, and hands the caller a :class:`Placement` whose blocks it holds until it
gives them back (``cache.allocator.decref_distinct(placement.blocks)``). The
cache finds prefixes as the manager does (loading from a host tier).
"""

from __future__ import annotations

from collections.abc import Hashable
from typing import Literal, NamedTuple, overload

import numpy as np

from radixkv.cache.arrays import TokenSeq, as_token_array
from radixkv.cache.manager import _lookup_for
from radixkv.cache.prefix_cache import PrefixCache

__all__ = ["Placement", "place_prompt"]


class Placement(NamedTuple):
    """What :func:`place_prompt` did for one prompt (blocks; tokens where named).

    - ``blocks``: the int32 blocks the caller now holds one reference on, in
      position order: the cached prefix, then what was loaded, then the new
      blocks (inserted: the cache adopted them, unless it caches nothing). The
      caller owns the array and gives the references back with
      ``cache.allocator.decref_distinct(blocks)``;
    - ``num_hit_blocks``: the prefix that was resident on the device at arrival;
    - ``num_loaded_blocks``: the blocks right after it that were below the device
      and were loaded (0 without a host tier): from the host, then from the store;
    - ``num_cached_tokens``: the tokens those two served,
      ``(num_hit_blocks + num_loaded_blocks) * block_size``: the request's
      first position to compute;
    - ``num_store_blocks``: the last of ``num_loaded_blocks``, those read from the
      store tier on the way (``MatchResult.store_loaded_num_tokens``; 0 without one);
      the rest of the load came from the host.
    """

    blocks: np.ndarray
    num_hit_blocks: int
    num_loaded_blocks: int
    num_cached_tokens: int
    num_store_blocks: int


@overload
def place_prompt(
    cache: PrefixCache,
    tokens: TokenSeq,
    namespace: Hashable = ...,
    *,
    exclusive: Literal[True] = ...,
) -> Placement: ...


@overload
def place_prompt(
    cache: PrefixCache, tokens: TokenSeq, namespace: Hashable = ..., *, exclusive: bool
) -> Placement | None: ...


def place_prompt(
    cache: PrefixCache, tokens: TokenSeq, namespace: Hashable = None, *, exclusive: bool = True
) -> Placement | None:
    """Match, evict the shortfall, allocate, insert: give one whole prompt its blocks at once.

    For a caller that computes a whole prompt in one go and tracks no request
    (trace replay, a simulated replica): finds the cached prefix (with a host
    tier, loading its host-only part back), evicts from the cache when fewer
    blocks are free than the uncached full blocks need, allocates what it can
    and inserts the prompt's full blocks up to there. Returns the
    :class:`Placement`, whose ``blocks`` now carry one reference each for the
    caller (give them back with ``cache.allocator.decref_distinct(blocks)``; the
    cache keeps its own).

    When even eviction leaves too few free blocks: an ``exclusive`` call (the
    caller holds nothing else: nothing can wait for a release) allocates and
    inserts as much as fits; a non-``exclusive`` one gives its match back and
    returns None, having evicted what it could (the caller waits for blocks to
    be released). The partial last block of ``tokens`` is never cached.
    ``TypeError`` for a ``cache`` that is not a ``PrefixCache``; ``TypeError`` /
    ``ValueError`` for bad tokens or namespace, as the cache's ``match``, before
    any change. Complexity: the cache's ``match`` (or ``load``), ``evict`` and
    ``insert``.

    >>> from radixkv import BlockAllocator, RadixCache
    >>> cache = RadixCache(BlockAllocator(num_blocks=8, block_size=2))
    >>> first = place_prompt(cache, [1, 2, 3, 4, 5])      # 2 full blocks cached
    >>> cache.allocator.decref_distinct(first.blocks)     # blocks freed: the cache keeps both
    0
    >>> place_prompt(cache, [1, 2, 3, 4, 9, 9]).num_cached_tokens
    4
    """
    if not isinstance(cache, PrefixCache):
        raise TypeError(f"cache must be a PrefixCache, got {type(cache).__name__}")
    m = _lookup_for(cache).find(tokens, namespace)  # validates tokens first
    hit = m.block_array
    num_matched = len(hit)
    alloc = cache.allocator
    bs = alloc.block_size
    num_loaded = m.loaded_num_tokens // bs
    need = len(tokens) // bs - num_matched
    blocks = hit
    if need > 0:
        if alloc.num_free < need:
            cache.evict(need - alloc.num_free)
            if alloc.num_free < need and not exclusive:
                alloc.decref_distinct(hit)
                return None
        new = alloc.alloc_array(min(need, alloc.num_free))
        if len(new):
            blocks = np.concatenate((hit, new))
            arr = as_token_array(tokens)
            cache.insert(arr[: (num_matched + len(new)) * bs], blocks, namespace)
    num_store = m.store_loaded_num_tokens // bs
    return Placement(blocks, num_matched - num_loaded, num_loaded, m.num_tokens, num_store)
