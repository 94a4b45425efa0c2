"""Test helpers shared by the prefix-cache suites: one request's life, a probe, and vLLM's
own block hashes."""

from __future__ import annotations

from radixkv.cache.allocator import BlockAllocator
from radixkv.cache.prefix_cache import PrefixCache

# vLLM 0.33.0's kv_cache_utils for the tokens 1000..1031 (sha256_cbor, block size 16, the
# wire's low 64 bits), by PYTHONHASHSEED (None: unset): the two blocks' hashes, and the
# first block's with cache_salt "tenant-x" (extra keys ("tenant-x",)).
VLLM_SHA256_CBOR_HASHES = {
    None: ([3753563854825738204, 2378715151359315973], 1388530249300785770),
    "0": ([17507053300047258101, 14424512966625972522], 4098180400426386630),
}


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
