"""radixkv: radix-tree KV prefix caching for LLM serving.

``import radixkv`` loads the cache tier only (numpy, numba, sortedcontainers,
xxhash, msgspec; tqdm for progress bars): the allocator, the prefix caches (and
``NullCache``, caching off), their records, ``make_cache`` and ``KVCacheManager``
(a request's blocks and tokens over any cache). Trace replay (``radixkv.replay``)
needs nothing more. The model and the engine (``radixkv.model``,
``radixkv.engine``) need torch: ``pip install 'radixkv[engine]'``; ``radixkv
sweep``'s plot needs ``radixkv[plot]``; README's install paragraph lists every
extra.
"""

from radixkv.cache import (
    BlockAllocator,
    CacheStats,
    HashBlockCache,
    InvariantError,
    KVCacheManager,
    MatchResult,
    NullCache,
    OutOfBlocks,
    PrefixCache,
    RadixCache,
    make_cache,
)

__all__ = [
    "BlockAllocator",
    "CacheStats",
    "HashBlockCache",
    "InvariantError",
    "KVCacheManager",
    "MatchResult",
    "NullCache",
    "OutOfBlocks",
    "PrefixCache",
    "RadixCache",
    "make_cache",
]
__version__ = "0.1.0"
