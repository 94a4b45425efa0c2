"""Test helpers shared by the prefix-cache suites: one request's life and a probe."""

from __future__ import annotations

from radixkv.cache.allocator import BlockAllocator
from radixkv.cache.prefix_cache import PrefixCache


def serve(alloc: BlockAllocator, cache: PrefixCache, tokens, ns=None) -> list[int]:
    """One request: match, alloc the rest (evicting if short), insert, let go.

    Returns the request's block table (the matched blocks, then the new ones).
    """
    m = cache.match(tokens, namespace=ns)
    need = len(tokens) // alloc.block_size - len(m.blocks)
    if need > alloc.num_free:
        cache.evict(need - alloc.num_free)
    blocks = m.blocks + alloc.alloc(need)
    cache.insert(tokens, blocks, namespace=ns)
    alloc.decref(blocks)
    cache.check()
    return blocks


def hit(cache: PrefixCache, tokens, namespace=None) -> int:
    """Matched tokens of a probe that lets go of its references at once."""
    m = cache.match(tokens, namespace=namespace)
    cache.allocator.decref(m.blocks)
    return m.num_tokens
