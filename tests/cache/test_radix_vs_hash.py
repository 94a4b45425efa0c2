"""Differential test: with no eviction and the same block size, RadixCache and HashBlockCache
give the same matched length and insert result for any sequence of requests, and both equal
a brute-force oracle (the longest block-aligned prefix of any inserted sequence)."""

from __future__ import annotations

import numpy as np
from hypothesis import given
from hypothesis import strategies as st

from radixkv import BlockAllocator
from radixkv.cache.arrays import as_token_array, common_prefix_len
from radixkv.cache.hashcache import HashBlockCache
from radixkv.cache.radix import RadixCache

token_seqs = st.lists(st.integers(0, 3), max_size=24)
ops = st.lists(
    st.tuples(st.sampled_from(["insert", "match"]), token_seqs, st.sampled_from([None, "b"])),
    max_size=40,
)


@given(
    block_size=st.integers(1, 5),
    ops=ops,
    hash_fn=st.sampled_from(["sha256", "xxhash", "builtin"]),
    eviction=st.sampled_from(["level", "lru"]),
)
def test_radix_and_hash_agree_without_eviction(
    block_size: int, ops: list, hash_fn: str, eviction: str
) -> None:
    caches = []
    for make in (
        lambda a: RadixCache(a, eviction=eviction),
        lambda a: HashBlockCache(a, hash_fn=hash_fn, hash_seed=0),
    ):
        alloc = BlockAllocator(num_blocks=40 * 24 + 1, block_size=block_size)
        caches.append((alloc, make(alloc)))
    inserted: dict[object, list[np.ndarray]] = {}
    for op, seq, ns in ops:
        q = as_token_array(seq)
        best = max((common_prefix_len(q, s) for s in inserted.get(ns, [])), default=0)
        expect = best // block_size * block_size
        got = []
        for alloc, cache in caches:
            assert cache.peek(seq, namespace=ns) == expect
            m = cache.match(seq, namespace=ns)
            if op == "insert":
                blocks = m.blocks + alloc.alloc(len(seq) // block_size - len(m.blocks))
                got.append((m.num_tokens, cache.insert(seq, blocks, namespace=ns)))
                alloc.decref(blocks)
            else:
                got.append((m.num_tokens, None))
                alloc.decref(m.blocks)
        assert got[0] == got[1], (op, seq, ns)
        assert got[0][0] == expect
        if op == "insert":
            assert got[0][1] == expect
            inserted.setdefault(ns, []).append(q)
    (ra, radix), (ha, hashed) = caches
    assert radix.cached_blocks == hashed.cached_blocks
    assert ra.num_free == ha.num_free
    assert radix.stats == hashed.stats
    radix.check()
    hashed.check()
