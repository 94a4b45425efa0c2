"""radixkv: radix-tree KV prefix caching for LLM serving.

``import radixkv`` stays light: the cache, allocator and replay work on numpy
arrays and plain ints; torch is imported only by the KV pool, model and engine.
"""

from radixkv.allocator import BlockAllocator, OutOfBlocks
from radixkv.hashcache import HashBlockCache
from radixkv.prefix_cache import PrefixCache
from radixkv.radix import RadixCache
from radixkv.results import CacheStats, MatchResult

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
