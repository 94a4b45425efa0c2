"""HashBlockCache specifics: chained names, seeds, collisions, the free-queue order, orphans.

The contract every prefix cache shares is tested in test_prefix_cache_contract.py.
"""

from __future__ import annotations

import hashlib
import subprocess
import sys

import numpy as np
import pytest
import xxhash
from cache_helpers import hit, serve

from radixkv import BlockAllocator
from radixkv.cache import hashing
from radixkv.cache.hashcache import HashBlockCache
from radixkv.cache.hashing import BlockHasher, namespace_bytes


def make(num_blocks: int = 64, block_size: int = 2, **kw):
    alloc = BlockAllocator(num_blocks=num_blocks, block_size=block_size)
    return alloc, HashBlockCache(alloc, **kw)


def tok(*ids: int) -> bytes:
    return np.array(ids, dtype=np.int32).tobytes()


# ------------------------------------------------------------------ names
def test_sha256_names_are_the_documented_chain() -> None:
    """Known answer: name_i = sha256(name_{i-1} + int32 token bytes [+ namespace bytes])."""
    root = hashlib.sha256(b"radixkv/block-hash-seed\x00" + b"i42").digest()
    n0 = hashlib.sha256(root + tok(1, 2)).digest()
    n1 = hashlib.sha256(n0 + tok(3, 4)).digest()
    alloc, cache = make(hash_fn="sha256", hash_seed=42)
    assert cache.block_names([1, 2, 3, 4, 5]) == [n0, n1]
    ns0 = hashlib.sha256(root + tok(1, 2) + namespace_bytes("t")).digest()
    ns1 = hashlib.sha256(ns0 + tok(3, 4)).digest()  # extra keys on the first block only
    assert cache.block_names([1, 2, 3, 4], namespace="t") == [ns0, ns1]


def test_xxhash_names_are_the_documented_chain() -> None:
    root = hashlib.sha256(b"radixkv/block-hash-seed\x00" + b"sseed").digest()[:16]
    n0 = xxhash.xxh3_128_digest(root + tok(5, 6))
    alloc, cache = make(hash_fn="xxhash", hash_seed="seed")
    assert cache.block_names([5, 6]) == [n0]


@pytest.mark.parametrize("hash_fn", ["sha256", "xxhash", "builtin"])
def test_names_depend_on_seed_and_are_random_without_one(hash_fn: str) -> None:
    a = BlockHasher(hash_fn, hash_seed=1).chain(tok(1, 2, 3, 4), 8)
    assert a == BlockHasher(hash_fn, hash_seed=1).chain(tok(1, 2, 3, 4), 8)
    assert a != BlockHasher(hash_fn, hash_seed=2).chain(tok(1, 2, 3, 4), 8)
    assert BlockHasher(hash_fn).chain(tok(1, 2), 8) != BlockHasher(hash_fn).chain(tok(1, 2), 8)


def test_a_different_first_token_changes_every_name() -> None:
    h = BlockHasher("sha256", hash_seed=0)
    a = h.chain(tok(1, 2, 3, 4, 5, 6), 8)
    b = h.chain(tok(9, 2, 3, 4, 5, 6), 8)
    assert all(x != y for x, y in zip(a, b, strict=True))


def test_seeded_names_are_stable_across_processes() -> None:
    code = (
        "from radixkv.cache.hashcache import HashBlockCache; from radixkv import BlockAllocator;"
        "c = HashBlockCache(BlockAllocator(4, 2), hash_fn='{}', hash_seed=7);"
        "print([n.hex() for n in c.block_names([1, 2, 3, 4], namespace='x')])"
    )
    for hash_fn in ("sha256", "xxhash"):
        out = subprocess.run(
            [sys.executable, "-c", code.format(hash_fn)], capture_output=True, text=True, check=True
        ).stdout.strip()
        _, cache = make(hash_fn=hash_fn, hash_seed=7)
        assert out == str([n.hex() for n in cache.block_names([1, 2, 3, 4], namespace="x")])


def test_block_names_is_read_only() -> None:
    alloc, cache = make(hash_seed=0)
    assert len(cache.block_names([1, 2, 3, 4, 5], namespace="new")) == 2
    assert cache.cached_blocks == 0 and cache.num_namespaces == 0


def test_bad_construction() -> None:
    alloc = BlockAllocator(4, 2)
    with pytest.raises(ValueError, match="hash_fn"):
        HashBlockCache(alloc, hash_fn="md5")
    with pytest.raises(TypeError, match="hash_seed"):
        HashBlockCache(alloc, hash_seed=1.5)  # type: ignore[arg-type]
    with pytest.raises(TypeError, match="allocator"):
        HashBlockCache("alloc")  # type: ignore[arg-type]


def test_namespaces_with_equal_repr_are_still_isolated() -> None:
    class Tenant:
        def __init__(self, name: str) -> None:
            self.name = name

        def __repr__(self) -> str:
            return "Tenant"

    alloc, cache = make(hash_seed=0)
    a, b = Tenant("a"), Tenant("b")
    serve(alloc, cache, [1, 2, 3, 4], ns=a)
    assert hit(cache, [1, 2, 3, 4], namespace=b) == 0
    serve(alloc, cache, [1, 2, 3, 4], ns=b)
    assert cache.cached_blocks == 4
    assert hit(cache, [1, 2, 3, 4], namespace=a) == hit(cache, [1, 2, 3, 4], namespace=b) == 4


# ------------------------------------------------------------- collisions
def _colliding(parent, block: bytes, extra: bytes):
    """A deliberately weak hash: only the first token of each block counts."""
    return hash((parent, block[:4], extra))


@pytest.mark.parametrize("how", ["callable", "builtin"])
def test_token_ids_are_verified_on_a_name_hit(how: str, monkeypatch) -> None:
    if how == "builtin":
        monkeypatch.setattr(hashing, "_builtin_name", _colliding)
        alloc, cache = make(hash_fn="builtin")
    else:
        alloc, cache = make(hash_fn=_colliding)
    serve(alloc, cache, [1, 2, 3, 4])
    assert cache.block_names([1, 9]) == cache.block_names([1, 2])  # names collide
    assert hit(cache, [1, 9, 3, 4]) == 0  # but the tokens differ: a miss
    assert hit(cache, [1, 2, 3, 9]) == 2
    # Inserting colliding content stops at the collision; the caller's decref frees the rest.
    blocks = alloc.alloc(2)
    assert cache.insert([1, 9, 3, 4], blocks) == 0
    assert alloc.decref(blocks) == 2
    assert cache.cached_blocks == 2 and hit(cache, [1, 2, 3, 4]) == 4
    cache.check()


def test_sha256_does_not_keep_token_bytes() -> None:
    alloc, cache = make(hash_fn="sha256", hash_seed=0)
    serve(alloc, cache, [1, 2, 3, 4])
    assert cache._tokens == {}
    alloc, cache = make(hash_fn="builtin")
    serve(alloc, cache, [1, 2, 3, 4])
    assert sorted(cache._tokens.values()) == [tok(1, 2), tok(3, 4)]


# ------------------------------------------------------------ queue order
def test_a_finished_request_is_evicted_tail_first() -> None:
    alloc, cache = make(block_size=1, hash_seed=0)
    serve(alloc, cache, [1, 2, 3, 4])
    for left in (3, 2, 1, 0):
        assert cache.evict(1) == 1
        assert hit(cache, [1, 2, 3, 4]) == left
        assert cache.cached_blocks == left


def test_least_recently_released_goes_first_and_shared_roots_live_longest() -> None:
    alloc, cache = make(block_size=2, hash_seed=0)
    serve(alloc, cache, [0, 0, 1, 1, 1, 1])  # A: root + 2 own blocks
    serve(alloc, cache, [0, 0, 2, 2])  # B: root + 1 own block
    serve(alloc, cache, [7, 7])  # C
    assert cache.evict(2) == 2  # A's tail blocks, least recently released
    assert hit(cache, [0, 0, 1, 1]) == 2 and hit(cache, [0, 0, 2, 2]) == 4
    # Those two probes touched the root then B: the queue is now C, B's block, root.
    assert cache.evict(1) == 1
    assert hit(cache, [7, 7]) == 0 and hit(cache, [0, 0, 2, 2]) == 4
    assert cache.evict(1) == 1
    assert hit(cache, [0, 0]) == 2 and cache.cached_blocks == 1


def test_a_hit_pulls_blocks_out_of_the_eviction_path() -> None:
    alloc, cache = make(block_size=2, hash_seed=0)
    serve(alloc, cache, [1, 1])
    serve(alloc, cache, [2, 2])
    m = cache.match([1, 1])  # a running request: touched and in use
    assert cache.evict(1) == 1
    assert hit(cache, [2, 2]) == 0
    assert cache.evict(1) == 0  # the in-use block is skipped, not freed
    alloc.decref(m.blocks)
    assert cache.evict(1) == 1 and alloc.num_free == alloc.num_blocks


def test_evict_skips_in_use_blocks_at_the_head() -> None:
    alloc, cache = make(num_blocks=128, block_size=1, hash_seed=0)
    held = []
    for i in range(50):
        serve(alloc, cache, [i])
        held.append(cache.match([i]))
    serve(alloc, cache, [100, 101, 102])
    # Release order put the 50 held blocks at the head; evict must skip them all.
    assert cache.evict(3) == 3
    assert cache.cached_blocks == 50 and cache.evictable_blocks == 0
    for m in held:
        alloc.decref(m.blocks)
    assert cache.evictable_blocks == 50 and cache.evict(100) == 50


def test_orphaned_block_is_relinked_when_its_parent_returns() -> None:
    alloc, cache = make(block_size=2, hash_seed=0)
    blocks = serve(alloc, cache, [1, 2, 3, 4])
    alloc.incref([blocks[1]])  # someone holds the child but not the parent
    assert cache.evict(100) == 1  # the parent goes; the held child stays, unreachable
    assert cache.cached_blocks == 1 and hit(cache, [1, 2, 3, 4]) == 0
    new = alloc.alloc(2)
    assert cache.insert([1, 2, 3, 4], new) == 0  # parent adopted; child's name still known
    assert [alloc.refcount(b) for b in new] == [2, 1]
    alloc.decref(new)
    m = cache.match([1, 2, 3, 4])
    assert m.blocks == [new[0], blocks[1]]
    alloc.decref(m.blocks + [blocks[1]])
    assert cache.evict(100) == 2 and alloc.num_free == alloc.num_blocks
    cache.check()


def test_check_catches_a_broken_name_map() -> None:
    alloc, cache = make(hash_seed=0)
    serve(alloc, cache, [1, 2, 3, 4])
    by_name = cache._namespaces[None].by_name
    name = next(iter(by_name))
    by_name[name] = 63
    with pytest.raises(AssertionError, match="name maps elsewhere"):
        cache.check()


def test_two_new_blocks_of_one_request_with_one_name_stop_the_insert() -> None:
    alloc, cache = make(hash_fn=lambda parent, block, extra: block[:4])  # ignores the chain
    blocks = alloc.alloc(3)
    assert cache.insert([1, 2, 1, 3, 5, 5], blocks) == 0
    assert [alloc.refcount(b) for b in blocks] == [2, 1, 1]  # cached up to the collision
    alloc.decref(blocks)
    assert cache.cached_blocks == 1 and hit(cache, [1, 2, 1, 3]) == 2
    cache.check()


def test_insert_reuses_the_names_its_match_computed_and_only_those() -> None:
    calls = []

    def counting(parent, block: bytes, extra: bytes):
        calls.append(block)
        return hashlib.sha256(repr(parent).encode() + block + extra).digest()

    alloc, cache = make(block_size=2, hash_fn=counting)
    serve(alloc, cache, [1, 2, 3, 4])
    calls.clear()
    m = cache.match([1, 2, 3, 4, 5, 6, 7, 8])  # hits 2 blocks, names the 3rd, misses
    assert len(calls) == 3
    blocks = m.blocks + alloc.alloc(2)
    assert cache.insert([1, 2, 3, 4, 5, 6, 7, 8], blocks) == 4
    assert len(calls) == 4  # only the 4th block was hashed again
    # A different namespace or different tokens must not reuse the memo.
    calls.clear()
    other = alloc.alloc(4)
    assert cache.insert([1, 2, 3, 4, 5, 6, 7, 8], other, namespace="x") == 0
    third = alloc.alloc(4)
    assert cache.insert([1, 2, 3, 9, 5, 6, 7, 8], third) == 2
    assert len(calls) == 8
    alloc.decref(blocks + other + third)
    assert hit(cache, [1, 2, 3, 4, 5, 6, 7, 8]) == 8 and hit(cache, [1, 2, 3, 9]) == 4
    assert hit(cache, [1, 2, 3, 4, 5, 6, 7, 8], namespace="x") == 8
    cache.check()


def test_names_fold_in_the_one_namespace_encoding() -> None:
    """The namespace enters a name as namespace_bytes: the repr of the extra keys the events
    carry (one encoding for every recipe), so ``1``, ``True``, ``"1"`` and ``(1,)`` differ."""
    from radixkv.cache.hashing import namespace_extra_keys

    assert namespace_bytes(None) == b""
    assert namespace_bytes("t") == b"('t',)" == repr(namespace_extra_keys("t")).encode()
    keys = {namespace_bytes(ns) for ns in (1, True, "1", (1,), 1.0, b"1")}
    assert len(keys) == 6
    h = BlockHasher("sha256", hash_seed=0)
    assert h.first_extra("t") == namespace_bytes("t")
    assert h.chain(tok(1, 2), 8, h.first_extra("t")) == [
        hashlib.sha256(h.root + tok(1, 2) + b"('t',)").digest()
    ]
