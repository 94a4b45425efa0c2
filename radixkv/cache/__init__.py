"""The cache tier: refcounted blocks and the prefix caches over them (numpy and numba; never torch).

- :mod:`~radixkv.cache.allocator`: ``BlockAllocator``, the refcounted block pool
  (one cache per pool), and ``InvariantError``, what every ``check()`` raises;
- :mod:`~radixkv.cache.protocol`: ``PrefixCache``, the surface every cache offers;
- :mod:`~radixkv.cache.radix`: ``RadixCache``, the radix tree, with its eviction
  orders in :mod:`~radixkv.cache.eviction`;
- :mod:`~radixkv.cache.hashcache`: ``HashBlockCache``, vLLM-style chained block
  hashes (:mod:`~radixkv.cache.block_hash`);
- :mod:`~radixkv.cache.null`: ``NullCache``, which caches nothing (caching off);
- :mod:`~radixkv.cache.results`: the records they return;
- :mod:`~radixkv.cache.arrays`: token sequences and block tables as int32 arrays;
- :mod:`~radixkv.cache.kernels`: the numba loops on the hot paths.
"""

from radixkv.cache.allocator import BlockAllocator, InvariantError, OutOfBlocks
from radixkv.cache.hashcache import HashBlockCache
from radixkv.cache.null import NullCache
from radixkv.cache.protocol import PrefixCache
from radixkv.cache.radix import RadixCache
from radixkv.cache.results import CacheStats, MatchResult

__all__ = [
    "BlockAllocator",
    "CacheStats",
    "HashBlockCache",
    "InvariantError",
    "MatchResult",
    "NullCache",
    "OutOfBlocks",
    "PrefixCache",
    "RadixCache",
]
