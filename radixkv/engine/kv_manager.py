"""Moved to :mod:`radixkv.cache.manager`; this path re-exports it for one release."""

from radixkv.cache.manager import CACHE_KINDS, KVCacheManager, make_cache

__all__ = ["CACHE_KINDS", "KVCacheManager", "make_cache"]
