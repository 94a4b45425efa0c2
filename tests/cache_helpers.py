"""Test helpers shared by the prefix-cache suites: one request's life, a probe, and vLLM's
own block hashes."""

from __future__ import annotations

import numpy as np

from radixkv.cache.allocator import BlockAllocator
from radixkv.cache.hashing import ChainHasher
from radixkv.cache.host import HostTier
from radixkv.cache.prefix_cache import PrefixCache
from radixkv.cache.store import MemoryStore, StoreKeyspace
from radixkv.cache.store.tier import StoreTier
from radixkv.cache.tiered import TieredRadixCache

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


class HostBytes:
    """A host pool as rows of bytes: the store tier's ``ByteCopier`` (8 bytes a block)."""

    layout, bytes_per_block = "kv-v1", 8

    def __init__(self, num_blocks: int) -> None:
        self.rows = np.zeros((num_blocks, self.bytes_per_block), dtype=np.uint8)

    def host_blocks_to_bytes(self, host_ids: np.ndarray) -> list[bytes]:
        return [self.rows[h].tobytes() for h in host_ids.tolist()]

    def bytes_to_host_blocks(self, values, host_ids: np.ndarray) -> None:
        for h, v in zip(host_ids.tolist(), values, strict=True):
            self.rows[h] = np.frombuffer(v, dtype=np.uint8)


def cache_with_store(
    hasher: ChainHasher, block_size: int, num_blocks: int, write_policy: str = "write_back"
) -> tuple[BlockAllocator, TieredRadixCache]:
    """A tiered cache with events on: ``num_blocks`` device blocks, twice that on a
    ``write_back`` host, and a ``MemoryStore`` below it under ``write_policy``."""
    dev, host = BlockAllocator(num_blocks, block_size), BlockAllocator(2 * num_blocks, block_size)
    keyspace = StoreKeyspace("ab" * 16, "float32", block_size, 1, 1, 1)
    store = StoreTier(MemoryStore(1 << 20), keyspace, HostBytes(host.num_blocks), write_policy)
    cache = TieredRadixCache(dev, "lru", events=hasher, host=HostTier(host, store=store))
    return dev, cache
