"""One behavioural suite for the PrefixCache contract, run against every implementation.

Everything ARCHITECTURE.md promises about a prefix cache: reference ownership,
full blocks only, rounding down, namespaces, input types, errors that change
nothing, eviction that never frees in-use blocks, reset. Each test runs on
RadixCache (both eviction orders) and HashBlockCache (every hash function).
"""

from __future__ import annotations

from collections.abc import Callable

import numpy as np
import pytest
from cache_helpers import hit, lcp, serve
from hypothesis import given
from hypothesis import strategies as st

from radixkv import BlockAllocator
from radixkv.cache.hashcache import HashBlockCache
from radixkv.cache.protocol import PrefixCache
from radixkv.cache.radix import RadixCache

Factory = Callable[[BlockAllocator], PrefixCache]

FACTORIES: dict[str, Factory] = {
    "radix-level": lambda a: RadixCache(a, eviction="level"),
    "radix-lru": lambda a: RadixCache(a, eviction="lru"),
    "hash-sha256": lambda a: HashBlockCache(a, hash_fn="sha256", hash_seed=0),
    "hash-xxhash": lambda a: HashBlockCache(a, hash_fn="xxhash", hash_seed=0),
    "hash-builtin": lambda a: HashBlockCache(a, hash_fn="builtin"),
}


@pytest.fixture(params=sorted(FACTORIES))
def factory(request: pytest.FixtureRequest) -> Factory:
    return FACTORIES[request.param]


def make(factory: Factory, num_blocks: int = 64, block_size: int = 2):
    alloc = BlockAllocator(num_blocks=num_blocks, block_size=block_size)
    return alloc, factory(alloc)


def snapshot(alloc: BlockAllocator, cache: PrefixCache) -> tuple:
    rcs = alloc.refcounts(np.arange(alloc.num_blocks)).tolist()
    return rcs, alloc.num_free, cache.cached_blocks, cache.evictable_blocks


# ------------------------------------------------------------------ surface
def test_satisfies_the_protocol(factory: Factory) -> None:
    alloc, cache = make(factory)
    assert isinstance(cache, PrefixCache)
    assert cache.allocator is alloc and cache.block_size == 2


def test_empty_cache_matches_nothing(factory: Factory) -> None:
    alloc, cache = make(factory)
    m = cache.match([1, 2, 3, 4])
    assert (m.blocks, m.num_tokens, len(m.block_array)) == ([], 0, 0)
    assert cache.cached_blocks == cache.evictable_blocks == 0
    assert cache.evict(5) == 0
    assert hit(cache, []) == 0
    cache.check()


# -------------------------------------------------------------- ownership
def test_match_hands_the_caller_one_reference_per_block(factory: Factory) -> None:
    alloc, cache = make(factory)
    blocks = alloc.alloc(3)
    assert cache.insert([1, 2, 3, 4, 5, 6], blocks) == 0
    assert [alloc.refcount(b) for b in blocks] == [2, 2, 2]  # caller + cache
    alloc.decref(blocks)
    m = cache.match([1, 2, 3, 4, 5, 6, 7])
    assert m.blocks == blocks and m.num_tokens == 6
    assert m.block_array.dtype == np.int32 and m.block_array.tolist() == blocks
    assert [alloc.refcount(b) for b in blocks] == [2, 2, 2]
    alloc.decref(m.blocks)
    assert [alloc.refcount(b) for b in blocks] == [1, 1, 1]
    cache.check()


def test_insert_accepts_list_and_numpy_blocks(factory: Factory) -> None:
    alloc, cache = make(factory)
    arr = alloc.alloc_array(2)
    assert cache.insert(np.array([1, 2, 3, 4]), arr) == 0
    assert cache.cached_blocks == 2 and hit(cache, [1, 2, 3, 4]) == 4
    alloc.decref(arr)
    cache.check()


def test_insert_does_not_adopt_duplicates_and_the_callers_decref_frees_them(
    factory: Factory,
) -> None:
    alloc, cache = make(factory)
    first = alloc.alloc(2)
    cache.insert([1, 2, 3, 4], first)
    alloc.decref(first)
    dup = alloc.alloc(3)  # same first two blocks of content, in other physical blocks
    assert cache.insert([1, 2, 3, 4, 5, 6], dup) == 4
    assert [alloc.refcount(b) for b in dup] == [1, 1, 2]  # only the new tail is adopted
    free_before = alloc.num_free
    assert alloc.decref(dup) == 2
    assert alloc.num_free == free_before + 2
    assert cache.cached_blocks == 3
    m = cache.match([1, 2, 3, 4, 5, 6])
    assert m.blocks == [*first, dup[2]]
    alloc.decref(m.blocks)
    cache.check()


def test_only_full_blocks_are_cached(factory: Factory) -> None:
    alloc, cache = make(factory, block_size=4)
    blocks = alloc.alloc(1)
    assert cache.insert([1, 2, 3, 4, 5, 6], blocks) == 0  # 1 full block + 2 loose tokens
    alloc.decref(blocks)
    assert cache.cached_blocks == 1
    assert hit(cache, [1, 2, 3, 4, 5, 6, 7, 8]) == 4
    assert hit(cache, [1, 2, 3]) == 0  # shorter than a block


def test_divergence_inside_a_block_rounds_down(factory: Factory) -> None:
    alloc, cache = make(factory, block_size=4)
    serve(alloc, cache, list(range(12)))
    for cut in range(12):
        probe = list(range(12))
        probe[cut] = 999
        assert hit(cache, probe) == (cut // 4) * 4


def test_siblings_sharing_a_first_token(factory: Factory) -> None:
    alloc, cache = make(factory, block_size=4)
    serve(alloc, cache, [7, 1, 1, 1, 5, 5, 5, 5])
    serve(alloc, cache, [7, 2, 2, 2, 6, 6, 6, 6])
    assert hit(cache, [7, 1, 1, 1, 5, 5, 5, 5]) == 8
    assert hit(cache, [7, 2, 2, 2, 6, 6, 6, 6]) == 8
    assert hit(cache, [7, 1, 1, 1, 6, 6, 6, 6]) == 4
    assert cache.cached_blocks == 4


@pytest.mark.parametrize("block_size", [1, 2, 3])
def test_match_equals_the_longest_inserted_prefix(factory: Factory, block_size: int) -> None:
    alloc, cache = make(factory, num_blocks=200, block_size=block_size)
    seqs = [[1, 2, 3, 4, 5, 6], [1, 2, 3, 9, 9], [1, 2, 3, 4, 5, 6, 7, 8], [4, 4]]
    for s in seqs:
        serve(alloc, cache, s)
    for q in ([1, 2, 3, 4, 5, 6, 7, 8, 9], [1, 2, 3, 9, 9, 9], [1, 2], [4, 4, 4], [5]):
        best = max(lcp(q, s) for s in seqs)
        assert hit(cache, q) == (best // block_size) * block_size


# -------------------------------------------------------------- namespaces
def test_namespaces_isolate(factory: Factory) -> None:
    alloc, cache = make(factory)
    serve(alloc, cache, [1, 2, 3, 4], ns="tenant-a")
    assert hit(cache, [1, 2, 3, 4], namespace="tenant-a") == 4
    for other in (None, "tenant-b", ("lora", 1), 7):
        assert hit(cache, [1, 2, 3, 4], namespace=other) == 0
    serve(alloc, cache, [1, 2, 3, 4], ns=("lora", 1))
    assert cache.cached_blocks == 4  # equal tokens, no shared blocks
    a = cache.match([1, 2, 3, 4], namespace="tenant-a")
    b = cache.match([1, 2, 3, 4], namespace=("lora", 1))
    assert not set(a.blocks) & set(b.blocks)
    alloc.decref(a.blocks + b.blocks)
    cache.check()


def test_unhashable_namespace_raises_and_changes_nothing(factory: Factory) -> None:
    alloc, cache = make(factory)
    serve(alloc, cache, [1, 2, 3, 4])
    before, stats = snapshot(alloc, cache), cache.stats
    blocks = alloc.alloc(2)
    with pytest.raises(TypeError):
        cache.match([1, 2], namespace=["unhashable"])
    with pytest.raises(TypeError):
        cache.insert([5, 6, 7, 8], blocks, namespace={"a": 1})
    alloc.decref(blocks)
    assert snapshot(alloc, cache) == before and cache.stats == stats


# -------------------------------------------------------------- input types
def test_all_token_input_types_agree(factory: Factory) -> None:
    torch = pytest.importorskip("torch")
    alloc, cache = make(factory)
    serve(alloc, cache, torch.tensor([5, 6, 7, 8]))
    for tokens in (
        [5, 6, 7, 8],
        (5, 6, 7, 8),
        np.array([5, 6, 7, 8], dtype=np.int64),
        np.array([5, 6, 7, 8], dtype=np.int32),
        np.array([5, 6, 7, 8], dtype=np.uint16),
        np.array([0, 5, 6, 7, 8])[1:],  # a view with an offset
        torch.tensor([5, 6, 7, 8], dtype=torch.int32),
    ):
        assert hit(cache, tokens) == 4


@pytest.mark.parametrize(
    "bad, exc",
    [
        ("abcd", TypeError),
        ([1.0, 2.0], TypeError),
        (np.zeros((2, 2), dtype=int), ValueError),
        ({1, 2}, TypeError),
        (np.array([2**40, 1]), ValueError),
        (None, TypeError),
    ],
)
def test_bad_tokens_raise_and_change_nothing(factory: Factory, bad: object, exc: type) -> None:
    alloc, cache = make(factory)
    serve(alloc, cache, [1, 2, 3, 4])
    blocks = alloc.alloc(2)
    before, stats = snapshot(alloc, cache), cache.stats
    with pytest.raises(exc):
        cache.match(bad)  # type: ignore[arg-type]
    with pytest.raises(exc):
        cache.insert(bad, blocks)  # type: ignore[arg-type]
    assert snapshot(alloc, cache) == before and cache.stats == stats
    cache.check()


def test_insert_bad_blocks_raise_before_any_change(factory: Factory) -> None:
    alloc, cache = make(factory)
    serve(alloc, cache, [1, 2, 3, 4])
    cached = cache.match([1, 2, 3, 4]).blocks
    mine = alloc.alloc(3)
    before, stats = snapshot(alloc, cache), cache.stats
    cases = [
        ([9, 9, 9, 9], mine[:1], ValueError),  # too few
        ([9, 9, 9, 9], [mine[0], 63], ValueError),  # a free block
        ([9, 9, 9, 9], [mine[0], 64], ValueError),  # out of range
        ([9, 9, 9, 9], [mine[0], -1], ValueError),  # negative
        ([9, 9, 9, 9], [mine[0], mine[0]], ValueError),  # repeated
        ([9, 9, 9, 9], [mine[0], cached[0]], ValueError),  # cached under other content
        ([9, 9, 9, 9], [0.5, 1.5], TypeError),  # not ints
    ]
    for tokens, blocks, exc in cases:
        with pytest.raises(exc):
            cache.insert(tokens, blocks)
        assert snapshot(alloc, cache) == before and cache.stats == stats
    cache.check()


def test_bad_evict_args(factory: Factory) -> None:
    alloc, cache = make(factory)
    serve(alloc, cache, [1, 2, 3, 4])
    before = snapshot(alloc, cache)
    for bad, exc in ((-1, ValueError), (1.5, TypeError), ("2", TypeError), (True, TypeError)):
        with pytest.raises(exc):
            cache.evict(bad)  # type: ignore[arg-type]
    assert snapshot(alloc, cache) == before


# ---------------------------------------------------------------- eviction
def test_evict_everything_frees_exactly_the_evictable_blocks(factory: Factory) -> None:
    alloc, cache = make(factory, num_blocks=32)
    for seq in ([1, 2, 3, 4, 5, 6], [1, 2, 3, 4, 7, 8], [9, 9, 9, 9]):
        serve(alloc, cache, seq)
    assert cache.evictable_blocks == cache.cached_blocks == 6
    assert cache.evict(0) == 0
    freed = cache.evict(2)
    assert freed >= 2 and cache.cached_blocks == 6 - freed and alloc.num_free == 26 + freed
    assert cache.evict(100) == 6 - freed
    assert cache.cached_blocks == cache.evictable_blocks == 0 and alloc.num_free == 32
    assert hit(cache, [1, 2, 3, 4]) == 0
    cache.check()


def test_evict_never_frees_blocks_a_request_holds(factory: Factory) -> None:
    alloc, cache = make(factory, num_blocks=32)
    serve(alloc, cache, [1, 2, 3, 4, 5, 6])
    serve(alloc, cache, [1, 2, 3, 4, 8, 8, 8, 8])
    serve(alloc, cache, [7, 8, 9, 10])
    m = cache.match([1, 2, 3, 4, 5, 6])  # a running request holds this chain
    assert cache.evictable_blocks == 4
    assert cache.evict(100) == 4
    assert [alloc.refcount(b) for b in m.blocks] == [2, 2, 2]
    assert hit(cache, [1, 2, 3, 4, 5, 6]) == 6
    assert hit(cache, [7, 8, 9, 10]) == 0 and hit(cache, [1, 2, 3, 4, 8, 8]) == 4
    alloc.decref(m.blocks)
    assert cache.evictable_blocks == 3
    assert cache.evict(100) == 3 and alloc.num_free == 32
    cache.check()


def test_serving_loop_under_pressure_never_runs_out(factory: Factory) -> None:
    rng = np.random.default_rng(0)
    alloc, cache = make(factory, num_blocks=12, block_size=2)
    prefixes = [rng.integers(0, 5, 6).tolist() for _ in range(3)]
    for _ in range(60):
        seq = prefixes[int(rng.integers(3))] + rng.integers(0, 5, int(rng.integers(0, 12))).tolist()
        serve(alloc, cache, seq[:24])
        assert alloc.num_free + cache.cached_blocks == alloc.num_blocks
    cache.reset()
    assert alloc.num_free == alloc.num_blocks


# ------------------------------------------------------------------- reset
def test_reset_lets_go_and_requests_keep_theirs(factory: Factory) -> None:
    alloc, cache = make(factory, num_blocks=16)
    serve(alloc, cache, [1, 2, 3, 4, 5, 6])
    serve(alloc, cache, [9, 9], ns="x")
    m = cache.match([1, 2, 3, 4])
    stats = cache.stats
    cache.reset()
    assert cache.cached_blocks == cache.evictable_blocks == 0
    assert [alloc.refcount(b) for b in m.blocks] == [1, 1]  # the request's own
    assert alloc.num_free == 14
    cache.check()
    assert cache.stats == stats
    assert hit(cache, [1, 2, 3, 4]) == 0 and hit(cache, [9, 9], namespace="x") == 0
    alloc.decref(m.blocks)
    assert alloc.num_free == alloc.num_blocks
    serve(alloc, cache, [1, 2, 3, 4])  # usable after reset
    assert hit(cache, [1, 2, 3, 4]) == 4


# ------------------------------------------------------------------- stats
def test_stats_count_tokens(factory: Factory) -> None:
    alloc, cache = make(factory, block_size=2)
    serve(alloc, cache, [1, 2, 3, 4, 5])  # query 5, hit 0, insert 4
    serve(alloc, cache, [1, 2, 3, 4, 6, 6])  # query 6, hit 4, insert 2
    hit(cache, [8, 8])  # query 2, hit 0
    cache.evict(100)
    s = cache.stats
    assert (s.num_matches, s.query_tokens, s.hit_tokens) == (3, 13, 4)
    assert (s.num_inserts, s.inserted_tokens, s.evicted_blocks) == (2, 6, 3)
    assert s.hit_rate == pytest.approx(4 / 13)


# ---------------------------------------------------- refcount accounting
@given(
    ops=st.lists(
        st.tuples(
            st.sampled_from(["serve", "hold", "release", "evict"]),
            st.lists(st.integers(0, 3), max_size=10),
            st.sampled_from([None, "a"]),
            st.integers(0, 6),
        ),
        max_size=30,
    )
)
def test_random_ops_keep_refcounts_and_block_contents_exact(ops: list) -> None:
    """For each cache: refcount == cache's 1 + references the test holds; every matched
    block holds exactly the content (namespace, prefix) the query asks for."""
    for name in sorted(FACTORIES):
        alloc = BlockAllocator(num_blocks=10, block_size=2)
        cache = FACTORIES[name](alloc)
        content: dict[int, tuple] = {}  # block -> (namespace, the prefix it ends)
        held: list[list[int]] = []
        for op, seq, ns, k in ops:
            if op == "evict":
                cache.evict(k)
            elif op == "release" and held:
                alloc.decref(held.pop(k % len(held)))
            elif op in ("serve", "hold"):
                m = cache.match(seq, namespace=ns)
                for i, b in enumerate(m.blocks):
                    assert content[b] == (ns, tuple(seq[: (i + 1) * 2])), name
                need = len(seq) // 2 - len(m.blocks)
                if need > alloc.num_free:
                    cache.evict(need - alloc.num_free)
                if need > alloc.num_free:
                    alloc.decref(m.blocks)  # no room: preempt this request
                    continue
                new = alloc.alloc(need)
                for j, b in enumerate(new, start=len(m.blocks)):
                    content[b] = (ns, tuple(seq[: (j + 1) * 2]))
                cache.insert(seq, m.blocks + new, namespace=ns)
                if op == "hold":
                    held.append(m.blocks + new)
                else:
                    alloc.decref(m.blocks + new)
            cache.check()
            mine = np.zeros(alloc.num_blocks, dtype=np.int64)
            for blocks in held:
                np.add.at(mine, blocks, 1)
            by_cache = alloc.refcounts(np.arange(alloc.num_blocks)) - mine
            assert set(by_cache.tolist()) <= {0, 1}, name
            assert int(by_cache.sum()) == cache.cached_blocks, name
        for blocks in held:
            alloc.decref(blocks)
        cache.reset()
        assert alloc.num_free == alloc.num_blocks, name
