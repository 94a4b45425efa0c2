"""radixkv: radix-tree KV prefix caching for LLM serving.

``import radixkv`` loads the cache tier only (numpy, numba, sortedcontainers):
the allocator, both prefix caches and their records. The model and the engine
(``radixkv.model``, ``radixkv.engine``) need torch, installed with the
``engine`` extra; trace replay (``radixkv.replay``) does not.
"""

from radixkv.cache import (
    BlockAllocator,
    CacheStats,
    HashBlockCache,
    MatchResult,
    OutOfBlocks,
    PrefixCache,
    RadixCache,
)

__all__ = [
    "BlockAllocator",
    "CacheStats",
    "HashBlockCache",
    "MatchResult",
    "OutOfBlocks",
    "PrefixCache",
    "RadixCache",
]
__version__ = "0.1.0"
