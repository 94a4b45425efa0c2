"""One behavioural suite for the PrefixCache contract, run against every implementation.

Everything docs/design.md promises about a prefix cache: reference ownership,
full blocks only, rounding down, namespaces, input types, errors that change
nothing, eviction that never frees in-use blocks, reset, side-effect-free
``peek``, uncounted ``match(stats=False)``, ``held_blocks``. Each test runs on
RadixCache (both eviction orders) and HashBlockCache (every hash function);
the tests that hold for a cache that never caches run on NullCache too, and a
few more check that it never hits and never holds a reference.
"""

from __future__ import annotations

from collections.abc import Callable

import numpy as np
import pytest
from cache_helpers import hit, serve
from hypothesis import given
from hypothesis import strategies as st

from radixkv import BlockAllocator, NullCache
from radixkv.cache.arrays import as_token_array, common_prefix_len
from radixkv.cache.hashcache import HashBlockCache
from radixkv.cache.prefix_cache import PrefixCache
from radixkv.cache.radix import RadixCache

Factory = Callable[[BlockAllocator], PrefixCache]

# The caches that cache: every test runs on them.
CACHING: dict[str, Factory] = {
    "radix-level": lambda a: RadixCache(a, eviction="level"),
    "radix-lru": lambda a: RadixCache(a, eviction="lru"),
    "hash-sha256": lambda a: HashBlockCache(a, hash_fn="sha256", hash_seed=0),
    "hash-xxhash": lambda a: HashBlockCache(a, hash_fn="xxhash", hash_seed=0),
    "hash-builtin": lambda a: HashBlockCache(a, hash_fn="builtin"),
}
# Every implementation: the tests whose point is not a hit run on these.
FACTORIES: dict[str, Factory] = {**CACHING, "null": NullCache}


@pytest.fixture(params=sorted(FACTORIES))
def any_factory(request: pytest.FixtureRequest) -> Factory:
    """Every implementation, NullCache included."""
    return FACTORIES[request.param]


@pytest.fixture(params=sorted(CACHING))
def factory(request: pytest.FixtureRequest) -> Factory:
    """The implementations that cache (the tests whose point is a hit)."""
    return CACHING[request.param]


def caches(cache: PrefixCache) -> bool:
    """Whether ``cache`` caches at all (NullCache does not)."""
    return not isinstance(cache, NullCache)


def make(factory: Factory, num_blocks: int = 64, block_size: int = 2):
    alloc = BlockAllocator(num_blocks=num_blocks, block_size=block_size)
    return alloc, factory(alloc)


def snapshot(alloc: BlockAllocator, cache: PrefixCache) -> tuple:
    rcs = alloc.refcounts(np.arange(alloc.num_blocks)).tolist()
    held = cache.held_blocks().tolist()
    return rcs, alloc.num_free, cache.cached_blocks, cache.evictable_blocks, held


# ------------------------------------------------------------------ surface
def test_satisfies_the_protocol(any_factory: Factory) -> None:
    alloc, cache = make(any_factory)
    assert isinstance(cache, PrefixCache)
    assert cache.allocator is alloc and cache.block_size == 2


def test_events_are_on_the_surface_and_off_by_default(any_factory: Factory) -> None:
    alloc, cache = make(any_factory)
    assert cache.events_hasher is None
    serve(alloc, cache, [1, 2, 3, 4])
    assert cache.take_events() == [] and cache.take_events() == []


def test_the_cache_package_names_the_protocol() -> None:
    import radixkv.cache
    import radixkv.cache.prefix_cache as new

    assert radixkv.cache.PrefixCache is new.PrefixCache is PrefixCache


def test_a_cache_without_the_event_surface_is_not_a_prefix_cache() -> None:
    class NoEvents:  # every method of the protocol but the two event members
        allocator = block_size = cached_blocks = evictable_blocks = stats = None

        def match(self, tokens, namespace=None, *, stats=True): ...
        def peek(self, tokens, namespace=None): ...
        def check_namespace(self, namespace): ...
        def insert(self, tokens, blocks, namespace=None): ...
        def evict(self, num_blocks): ...
        def reset(self): ...
        def held_blocks(self): ...
        def check(self): ...

    assert not isinstance(NoEvents(), PrefixCache)

    class WithEvents(NoEvents):
        events_hasher = None

        def take_events(self):
            return []

    assert isinstance(WithEvents(), PrefixCache)


def test_empty_cache_matches_nothing(any_factory: Factory) -> None:
    alloc, cache = make(any_factory)
    m = cache.match([1, 2, 3, 4])
    assert (m.blocks, m.num_tokens, len(m.block_array)) == ([], 0, 0)
    assert cache.peek([1, 2, 3, 4]) == 0
    assert cache.cached_blocks == cache.evictable_blocks == 0
    assert cache.held_blocks().tolist() == []
    assert cache.evict(5) == 0
    assert hit(cache, []) == 0
    assert alloc.num_free == alloc.num_blocks
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
        best = max(common_prefix_len(as_token_array(q), as_token_array(s)) for s in seqs)
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


def test_unhashable_namespace_raises_and_changes_nothing(any_factory: Factory) -> None:
    alloc, cache = make(any_factory)
    serve(alloc, cache, [1, 2, 3, 4])
    before, stats = snapshot(alloc, cache), cache.stats
    blocks = alloc.alloc(2)
    with pytest.raises(TypeError):
        cache.match([1, 2], namespace=["unhashable"])
    with pytest.raises(TypeError):
        cache.peek([1, 2], namespace=["unhashable"])
    with pytest.raises(TypeError):
        cache.check_namespace(["unhashable"])
    with pytest.raises(ValueError, match="equal to itself"):
        cache.check_namespace(("t", float("nan")))
    cache.check_namespace(("lora", 1))
    with pytest.raises(TypeError):
        cache.insert([5, 6, 7, 8], blocks, namespace={"a": 1})
    alloc.decref(blocks)
    assert snapshot(alloc, cache) == before and cache.stats == stats


# -------------------------------------------------------------- input types
def test_all_token_input_types_agree(any_factory: Factory) -> None:
    torch = pytest.importorskip("torch")
    alloc, cache = make(any_factory)
    serve(alloc, cache, torch.tensor([5, 6, 7, 8]))
    expect = 4 if caches(cache) else 0
    for tokens in (
        [5, 6, 7, 8],
        (5, 6, 7, 8),
        np.array([5, 6, 7, 8], dtype=np.int64),
        np.array([5, 6, 7, 8], dtype=np.int32),
        np.array([5, 6, 7, 8], dtype=np.uint16),
        np.array([0, 5, 6, 7, 8])[1:],  # a view with an offset
        torch.tensor([5, 6, 7, 8], dtype=torch.int32),
    ):
        assert cache.peek(tokens) == expect
        assert hit(cache, tokens) == expect


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
def test_bad_tokens_raise_and_change_nothing(any_factory: Factory, bad: object, exc: type) -> None:
    alloc, cache = make(any_factory)
    serve(alloc, cache, [1, 2, 3, 4])
    blocks = alloc.alloc(2)
    before, stats = snapshot(alloc, cache), cache.stats
    with pytest.raises(exc):
        cache.match(bad)  # type: ignore[arg-type]
    with pytest.raises(exc):
        cache.match(bad, stats=False)  # type: ignore[arg-type]
    with pytest.raises(exc):
        cache.peek(bad)  # type: ignore[arg-type]
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
        *bad_block_tables(mine),
        ([9, 9, 9, 9], [mine[0], mine[0]], ValueError),  # repeated
        ([9, 9, 9, 9], [mine[0], cached[0]], ValueError),  # cached under other content
    ]
    for tokens, blocks, exc in cases:
        with pytest.raises(exc):
            cache.insert(tokens, blocks)
        assert snapshot(alloc, cache) == before and cache.stats == stats
    cache.check()


def bad_block_tables(mine: list[int]) -> list[tuple]:
    """Block tables every cache rejects, adopting or not (pool of 64, ``mine`` allocated)."""
    return [
        ([9, 9, 9, 9], mine[:1], ValueError),  # too few
        ([9, 9, 9, 9], [mine[0], 63], ValueError),  # a free block
        ([9, 9, 9, 9], [mine[0], 64], ValueError),  # out of range
        ([9, 9, 9, 9], [mine[0], -1], ValueError),  # negative
        ([9, 9, 9, 9], [0.5, 1.5], TypeError),  # not ints
        ([9, 9, 9, 9], "ab", TypeError),  # not a sequence of ints
    ]


def test_bad_evict_args(any_factory: Factory) -> None:
    alloc, cache = make(any_factory)
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


def test_serving_loop_under_pressure_never_runs_out(any_factory: Factory) -> None:
    rng = np.random.default_rng(0)
    alloc, cache = make(any_factory, num_blocks=12, block_size=2)
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
def test_stats_count_tokens(any_factory: Factory) -> None:
    alloc, cache = make(any_factory, block_size=2)
    serve(alloc, cache, [1, 2, 3, 4, 5])  # query 5, hit 0, insert 4
    serve(alloc, cache, [1, 2, 3, 4, 6, 6])  # query 6, hit 4, insert 2
    hit(cache, [8, 8])  # query 2, hit 0
    cache.peek([1, 2, 3, 4])  # not a query
    cache.evict(100)
    s = cache.stats
    if caches(cache):
        assert (s.num_matches, s.query_tokens, s.hit_tokens) == (3, 13, 4)
        assert (s.num_inserts, s.inserted_tokens, s.evicted_blocks) == (2, 6, 3)
        assert s.hit_rate == pytest.approx(4 / 13)
    else:
        assert (s.num_matches, s.query_tokens, s.hit_tokens) == (3, 13, 0)
        assert (s.num_inserts, s.inserted_tokens, s.evicted_blocks) == (2, 0, 0)
        assert s.hit_rate == 0.0


def test_match_with_stats_off_counts_nothing_else_as_match(any_factory: Factory) -> None:
    alloc, cache = make(any_factory)
    serve(alloc, cache, [1, 2, 3, 4, 5])
    stats = cache.stats
    quiet = cache.match([1, 2, 3, 4, 9], stats=False)
    assert cache.stats == stats  # not a query: no counter moved
    loud = cache.match([1, 2, 3, 4, 9])
    assert quiet == loud and quiet.num_tokens == (4 if caches(cache) else 0)
    s = cache.stats
    assert (s.num_matches, s.query_tokens) == (stats.num_matches + 1, stats.query_tokens + 5)
    assert s.hit_tokens == stats.hit_tokens + loud.num_tokens
    # The caller got a reference from each, as from any match.
    assert [alloc.refcount(b) for b in quiet.blocks] == [3] * len(quiet.blocks)
    alloc.decref(quiet.blocks + loud.blocks)
    cache.check()


# --------------------------------------------------------------------- peek
def test_peek_is_match_without_side_effects(any_factory: Factory) -> None:
    alloc, cache = make(any_factory, block_size=2)
    serve(alloc, cache, [1, 2, 3, 4, 5, 6])
    serve(alloc, cache, [1, 2, 7, 7], ns="x")
    probes = [
        ([1, 2, 3, 4, 5, 6, 7], None),
        ([1, 2, 3, 9], None),  # ends inside a node: the radix tree would split on match
        ([1, 2, 3], None),
        ([1], None),
        ([], None),
        ([1, 2, 7, 7], "x"),
        ([1, 2, 7, 7], "never-seen"),
    ]
    for tokens, ns in probes:
        before, stats = snapshot(alloc, cache), cache.stats
        nodes = getattr(cache, "num_nodes", None)
        got = cache.peek(tokens, namespace=ns)
        assert snapshot(alloc, cache) == before and cache.stats == stats
        assert getattr(cache, "num_nodes", None) == nodes  # no split
        assert got == hit(cache, tokens, namespace=ns)
    if caches(cache):
        assert cache.peek([1, 2, 3, 4, 5, 6]) == 6 and cache.peek([1, 2, 7, 7], "x") == 4
    cache.check()


def test_peek_does_not_register_a_namespace(factory: Factory) -> None:
    # A namespace first seen by peek must behave exactly as one never seen.
    alloc, cache = make(factory)
    assert cache.peek([1, 2], namespace="new") == 0
    serve(alloc, cache, [1, 2], ns="new")
    assert cache.peek([1, 2], namespace="new") == 2 and cache.peek([1, 2]) == 0
    cache.check()


# ------------------------------------------------------------- held blocks
def test_held_blocks_are_the_blocks_the_cache_holds_a_reference_on(any_factory: Factory) -> None:
    alloc, cache = make(any_factory, num_blocks=16)
    held: list[int] = []
    for seq in ([1, 2, 3, 4, 5, 6], [1, 2, 9, 9], [4, 4], [8, 8, 8, 8]):
        blocks = serve(alloc, cache, seq)
        m = cache.match(seq)  # a request holds these too: the cache's reference is separate
        held += m.blocks
        h = cache.held_blocks()
        assert h.dtype == np.int32 and h.tolist() == sorted(set(h.tolist()))
        assert len(h) == cache.cached_blocks
        mine = np.zeros(alloc.num_blocks, dtype=np.int64)
        np.add.at(mine, held, 1)
        by_cache = alloc.refcounts(np.arange(alloc.num_blocks)) - mine
        assert h.tolist() == np.flatnonzero(by_cache).tolist()
        # Every block cached so far is matched and held by the test.
        assert h.tolist() == (sorted(set(held)) if caches(cache) else [])
        assert set(blocks) <= set(held) or not caches(cache)
    h = cache.held_blocks()
    h[:] = -1  # a copy: writing to it changes nothing
    assert (cache.held_blocks() >= 0).all()
    assert cache.evict(100) == 0  # the test holds every cached block
    assert cache.held_blocks().tolist() == (sorted(set(held)) if caches(cache) else [])
    alloc.decref(held)
    if caches(cache):
        assert cache.evict(2) >= 2 and len(cache.held_blocks()) == cache.cached_blocks
    cache.reset()
    assert cache.held_blocks().tolist() == [] and alloc.num_free == alloc.num_blocks
    cache.check()


# --------------------------------------------------------------- NullCache
def test_null_cache_never_hits_and_never_holds_a_reference() -> None:
    alloc = BlockAllocator(num_blocks=16, block_size=2)
    cache = NullCache(alloc)
    for seq in ([1, 2, 3, 4], [1, 2, 3, 4], [1, 2, 3, 4, 5, 6], [1, 2, 3, 4]):
        m = cache.match(seq)
        assert (m.blocks, m.num_tokens) == ([], 0) and cache.peek(seq) == 0
        blocks = alloc.alloc(len(seq) // 2)
        assert cache.insert(seq, blocks) == 0
        # Refcounts are exactly the caller's: one each, nothing more.
        assert [alloc.refcount(b) for b in blocks] == [1] * len(blocks)
        assert cache.cached_blocks == cache.evictable_blocks == 0
        assert cache.held_blocks().tolist() == [] and cache.evict(100) == 0
        assert alloc.decref(blocks) == len(blocks)  # the caller's decref frees them all
        assert alloc.num_free == alloc.num_blocks
        cache.check()
    s = cache.stats
    assert (s.num_matches, s.query_tokens, s.hit_tokens, s.hit_rate) == (4, 18, 0, 0.0)
    assert (s.num_inserts, s.inserted_tokens, s.evicted_blocks) == (4, 0, 0)
    cache.reset()
    assert cache.stats == s


def test_null_cache_insert_validates_like_the_others() -> None:
    alloc = BlockAllocator(num_blocks=64, block_size=2)
    cache = NullCache(alloc)
    mine = alloc.alloc(3)
    before, stats = snapshot(alloc, cache), cache.stats
    for tokens, blocks, exc in bad_block_tables(mine):
        with pytest.raises(exc):
            cache.insert(tokens, blocks)
        assert snapshot(alloc, cache) == before and cache.stats == stats
    with pytest.raises(TypeError):
        cache.insert([1.5, 2.5], mine)
    with pytest.raises(TypeError):
        cache.insert([1, 2], mine, namespace=[])
    assert snapshot(alloc, cache) == before and cache.stats == stats
    # It adopts nothing, so a repeated block (which no cache adopts twice) is no error.
    assert cache.insert([9, 9, 9, 9], [mine[0], mine[0]]) == 0
    assert cache.insert([9], []) == 0  # no full block: no block needed
    with pytest.raises(TypeError, match="BlockAllocator"):
        NullCache("not an allocator")  # type: ignore[arg-type]


def test_null_cache_is_exported() -> None:
    import radixkv
    import radixkv.cache

    assert radixkv.NullCache is radixkv.cache.NullCache is NullCache
    assert "NullCache" in radixkv.__all__ and "NullCache" in radixkv.cache.__all__


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
    block holds exactly the content (namespace, prefix) the query asks for. For NullCache
    the cache's share is always 0: every refcount is exactly the test's."""
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
            assert cache.held_blocks().tolist() == np.flatnonzero(by_cache).tolist(), name
            if name == "null":
                assert cache.cached_blocks == 0, name
        for blocks in held:
            alloc.decref(blocks)
        cache.reset()
        assert alloc.num_free == alloc.num_blocks, name
