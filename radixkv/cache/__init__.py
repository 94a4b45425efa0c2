"""The cache tier: refcounted blocks and the prefix caches over them (numpy and numba; never torch).

- :mod:`~radixkv.cache.allocator`: ``BlockAllocator``, the refcounted block pool
  (one cache per pool); ``InvariantError``, what every ``check()`` raises, is
  :mod:`radixkv.errors`'s (re-exported here and from the allocator);
- :mod:`~radixkv.cache.prefix_cache`: ``PrefixCache``, the surface every cache offers;
- :mod:`~radixkv.cache.radix`: ``RadixCache``, the radix tree, with its eviction
  orders in :mod:`~radixkv.cache.eviction`, its events in
  :mod:`~radixkv.cache.tree_events`, its pins in :mod:`~radixkv.cache.pins` and its
  inspection in :mod:`~radixkv.cache.inspection`;
- :mod:`~radixkv.cache.tiered`: ``TieredRadixCache``, the tree with tiers below the
  device (the tier's pool and policy are :mod:`~radixkv.cache.host`'s);
- :mod:`~radixkv.cache.hashcache`: ``HashBlockCache``, vLLM-style chained block
  hashes;
- :mod:`~radixkv.cache.hashing`: every chained-hash recipe and the one namespace
  encoding; :mod:`~radixkv.cache.events`: the KV cache events and their log;
- :mod:`~radixkv.cache.manager`: ``KVCacheManager``, every block a request holds
  (and the request's tokens), and ``make_cache``;
- :mod:`~radixkv.cache.placement`: ``place_prompt``, the whole-prompt cycle over a
  cache (match, evict, allocate, insert), and its ``Placement``;
- :mod:`~radixkv.cache.null`: ``NullCache``, which caches nothing (caching off);
- :mod:`~radixkv.cache.results`: the records they return;
- :mod:`~radixkv.cache.arrays`: token sequences and block tables as int32 arrays;
- :mod:`~radixkv.cache.kernels`: the numba loops on the hot paths.
"""

from radixkv.cache.allocator import BlockAllocator, OutOfBlocks
from radixkv.cache.hashcache import HashBlockCache
from radixkv.cache.manager import CACHE_KINDS, KVCacheManager, make_cache
from radixkv.cache.null import NullCache
from radixkv.cache.placement import Placement, place_prompt
from radixkv.cache.prefix_cache import PrefixCache
from radixkv.cache.radix import RadixCache
from radixkv.cache.results import CacheStats, MatchResult
from radixkv.cache.tiered import TieredRadixCache
from radixkv.errors import InvariantError

__all__ = [
    "CACHE_KINDS",
    "BlockAllocator",
    "CacheStats",
    "HashBlockCache",
    "InvariantError",
    "KVCacheManager",
    "MatchResult",
    "NullCache",
    "OutOfBlocks",
    "Placement",
    "PrefixCache",
    "RadixCache",
    "TieredRadixCache",
    "make_cache",
    "place_prompt",
]
