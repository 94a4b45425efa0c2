"""Cache mutations are atomic (issue 21, item 5, the cache side).

A namespace the events' hasher cannot encode (a lone surrogate, legal in JSON) is refused
with a ``ValueError`` naming it, by every method that takes a namespace, before any change.
And a call that fails part-way (the hasher raises on some block, the host copier raises)
leaves the cache as it was: each test runs the same script on two caches, one of which
fails once, and checks after every step that both agree on everything a caller can see
(structure, refcounts, free blocks, stats, events), so "as it was" means exactly that.
"""

from __future__ import annotations

import numpy as np
import pytest

from radixkv.cache import BlockAllocator, HashBlockCache, NullCache, RadixCache, TieredRadixCache
from radixkv.cache.hashing import ChainHasher
from radixkv.cache.host import HostTier, NullCopier

try:
    import cbor2  # noqa: F401

    RECIPES = ["xxhash", "sha256_cbor"]
except ImportError:  # pragma: no cover - cbor2 is the fleet extra's
    RECIPES = ["xxhash"]

needs_cbor = pytest.mark.skipif("sha256_cbor" not in RECIPES, reason="needs cbor2")
CACHES = {"radix": RadixCache, "hash": HashBlockCache}


class Failure(Exception):
    """What the injected faults raise."""


class FlakyHasher(ChainHasher):
    """A ``ChainHasher`` that raises once armed, at the ``fail_at``-th block it is asked to hash
    (counted from 0 across calls), then disarms: ``check()``'s recomputation runs clean."""

    def __init__(self, name: str = "xxhash") -> None:
        super().__init__(name, seed=0)
        self.fail_at: int | None = None

    def hashes(self, parent, tokens, block_size, first_extra=None):
        if self.fail_at is not None:
            n = len(tokens) // block_size
            if self.fail_at < n:
                self.fail_at = None
                raise Failure("hasher failed")
            self.fail_at -= n
        return super().hashes(parent, tokens, block_size, first_extra)


class FlakyCopier(NullCopier):
    """A copier whose next ``fail`` call (``"backup"``, ``"load"`` or ``"discard"``) raises."""

    def __init__(self) -> None:
        super().__init__()
        self.fail: str | None = None

    def _maybe_fail(self, what: str) -> None:
        if self.fail == what:
            self.fail = None
            raise Failure(f"copier failed in {what}")

    def backup(self, device, host):
        self._maybe_fail("backup")
        super().backup(device, host)

    def load(self, host, device):
        self._maybe_fail("load")
        super().load(host, device)

    def discard(self, device):
        self._maybe_fail("discard")
        super().discard(device)


def make(kind: str, hasher: ChainHasher | None, *, host: dict | None = None, **kw):
    alloc = BlockAllocator(num_blocks=32, block_size=2)
    if host is not None:
        host = dict(host)
        copier = host.pop("copier", FlakyCopier())
        kw["host"] = HostTier(BlockAllocator(32, 2), copier, **host)
        return alloc, TieredRadixCache(alloc, events=hasher, **kw)
    return alloc, CACHES[kind](alloc, events=hasher, **kw)


def state(alloc: BlockAllocator, cache) -> tuple:
    """What a caller can see of a cache and its pool (events taken: they must match too)."""
    seen = (
        alloc.refcount_array.tolist(),
        alloc.num_free,
        cache.held_blocks().tolist(),
        cache.cached_blocks,
        cache.evictable_blocks,
        cache.num_namespaces,
        cache.stats,
        cache.take_events(),
    )
    if isinstance(cache, RadixCache):
        tiered = isinstance(cache, TieredRadixCache)
        host_refs = cache.host.allocator.refcount_array.tolist() if tiered else None
        seen += (cache.pretty(max_tokens=99, max_blocks=99), host_refs)
    return seen


def request(alloc, cache, tokens, ns=None, *, insert=True) -> None:
    """One request's life: match, allocate the rest (evicting if short), insert, let go.

    With ``insert=False`` the insert is skipped: the twin of a request whose insert failed.
    The blocks are let go whatever happens, as a serving loop does.
    """
    m = cache.match(tokens, ns)
    need = len(tokens) // alloc.block_size - len(m.blocks)
    if need > alloc.num_free:
        cache.evict(need - alloc.num_free)
    blocks = m.blocks + alloc.alloc(need)
    try:
        if insert:
            cache.insert(tokens, blocks, ns)
    finally:
        alloc.decref(blocks)


def agree(a, b) -> None:
    (alloc_a, cache_a), (alloc_b, cache_b) = a, b
    cache_a.check()
    cache_b.check()
    assert state(alloc_a, cache_a) == state(alloc_b, cache_b)


def replay_after(a, b, script) -> None:
    """Run the rest of ``script`` on both and make them agree after each step, then reset."""
    for tokens, ns in script:
        for alloc, cache in (a, b):
            request(alloc, cache, tokens, ns)
        agree(a, b)
    for _, cache in (a, b):
        cache.evict(10**9)
    agree(a, b)
    for _, cache in (a, b):
        cache.reset()
    agree(a, b)


# --------------------------------------------------------------- unencodable namespaces
class OddRepr:
    """A hashable namespace whose repr holds a lone surrogate (any custom type may)."""

    def __repr__(self) -> str:
        return "odd\udc80"


BAD_NAMESPACES = ["\ud800", ("tenant", "\udfff"), OddRepr()]


@needs_cbor
@pytest.mark.parametrize("kind", [*CACHES, "tiered"])
@pytest.mark.parametrize("ns", BAD_NAMESPACES, ids=["str", "tuple", "repr"])
def test_a_namespace_the_hasher_cannot_encode_is_refused_by_name_before_any_change(kind, ns):
    tiered = kind == "tiered"
    hasher, host = ChainHasher("sha256_cbor"), {} if tiered else None
    alloc, cache = make("radix" if tiered else kind, hasher, host=host)
    request(alloc, cache, [1, 2, 3, 4, 5], "ok")
    cache.take_events()
    before = state(alloc, cache)
    blocks = alloc.alloc(2)
    calls = {
        "insert": lambda: cache.insert([1, 2, 3, 4], blocks, ns),
        "match": lambda: cache.match([1, 2, 3, 4], ns),
        "peek": lambda: cache.peek([1, 2, 3, 4], ns),
        "peek of no tokens": lambda: cache.peek([], ns),
        "check_namespace": lambda: cache.check_namespace(ns),
    }
    if kind != "hash":
        calls["pin"] = lambda: cache.pin([1, 2, 3, 4], ns)
    if tiered:
        calls["load"] = lambda: cache.load([1, 2, 3, 4], ns)
    for name, call in calls.items():
        with pytest.raises(ValueError, match=r"^namespace .*sha256_cbor.*got ") as err:
            call()
        assert ascii(ns) in str(err.value), name
        assert type(err.value) is ValueError, name  # not the codec's UnicodeEncodeError
    alloc.decref(blocks)
    cache.check()
    assert state(alloc, cache) == before
    # the cache still serves, resets and serves again
    request(alloc, cache, [1, 2, 3, 4, 5, 6], "ok")
    cache.check()
    cache.reset()
    cache.check()
    assert alloc.num_free == alloc.num_blocks
    request(alloc, cache, [1, 2, 3, 4], "ok")
    assert cache.peek([1, 2, 3, 4], "ok") == 4


@pytest.mark.parametrize("kind", CACHES)
@pytest.mark.parametrize("ns", BAD_NAMESPACES, ids=["str", "tuple", "repr"])
def test_the_same_namespaces_are_fine_where_nothing_must_encode_them(kind, ns):
    """xxhash events hash a repr (always encodable); with events off nothing is encoded,
    and the hash cache's block names pass a lone surrogate through."""
    for hasher in (ChainHasher("xxhash"), None):
        alloc, cache = make(kind, hasher)
        cache.check_namespace(ns)
        request(alloc, cache, [1, 2, 3, 4, 5], ns)
        cache.check()
        assert cache.peek([1, 2, 3, 4], ns) == 4
        assert cache.peek([1, 2, 3, 4]) == 0


@needs_cbor
def test_check_namespace_returns_the_extra_keys_and_names_the_bad_value():
    for name in RECIPES:
        h = ChainHasher(name)
        assert h.check_namespace(None) is None
        assert h.check_namespace(("a", 1)) == (["a", 1],)
        assert h.check_namespace(b"\xff") == (b"\xff",)
    with pytest.raises(ValueError, match=r"namespace must be encodable by the sha256_cbor"):
        ChainHasher("sha256_cbor").check_namespace("a\ud800b")


def test_the_null_cache_takes_any_hashable_namespace():
    alloc = BlockAllocator(8, 2)
    cache = NullCache(alloc)
    assert cache.match([1, 2], "\ud800").num_tokens == 0


# --------------------------------------------------------------- a hasher that fails
RADIX_CASES = {
    # (setup script, failing request, the block it fails at)
    "new namespace": ([([1, 2, 3, 4, 5, 6], None)], ([1, 2, 3, 4], "t"), 1),
    "extends a leaf": ([([1, 2, 3, 4], None)], ([1, 2, 3, 4, 5, 6, 7, 8], None), 1),
    "splits a node": ([([1, 2, 3, 4, 5, 6], None)], ([1, 2, 3, 4, 9, 9, 8, 8], None), 0),
    "first block": ([([1, 2], None)], ([7, 7, 7, 7], None), 0),
}
REST = [([1, 2, 3, 4, 5, 6, 7, 8], None), ([1, 2, 3, 4, 9, 9, 8, 8], "t"), ([5, 5, 5], None)]


@pytest.mark.parametrize("recipe", RECIPES)
@pytest.mark.parametrize("eviction", ["level", "ghost"])
@pytest.mark.parametrize("case", RADIX_CASES)
def test_radix_insert_whose_hasher_fails_changes_nothing(recipe, eviction, case):
    setup, (tokens, ns), fail_at = RADIX_CASES[case]
    a = make("radix", FlakyHasher(recipe), eviction=eviction)
    b = make("radix", FlakyHasher(recipe), eviction=eviction)
    for pair in (a, b):
        # under the ghost order, the failing insert readmits where this one was deleted
        request(*pair, tokens, ns)
        pair[1].evict(10**9)
        for t, n in setup:
            request(*pair, t, n)
    agree(a, b)
    a[1].events_hasher.fail_at = fail_at
    with pytest.raises(Failure):
        request(*a, tokens, ns)
    request(*b, tokens, ns, insert=False)
    agree(a, b)
    replay_after(a, b, [(tokens, ns), *REST])


HOST_CASES = {
    # the failing insert adopts caller blocks for host-only nodes, then hashes its new leaf
    "promotes, then a new leaf": [1, 2, 3, 4, 5, 6, 7, 8],
    "splits a host-only node": [1, 2, 3, 4, 9, 9],
}


@pytest.mark.parametrize("recipe", RECIPES)
@pytest.mark.parametrize("policy", ["write_back", "write_through"])
@pytest.mark.parametrize("case", HOST_CASES)
def test_radix_insert_over_host_only_nodes_whose_hasher_fails_changes_nothing(recipe, policy, case):
    tokens = HOST_CASES[case]
    tier = {"write_policy": policy, "write_through_hits": 0}
    a = make("radix", FlakyHasher(recipe), host=tier, eviction="lru")
    b = make("radix", FlakyHasher(recipe), host=tier, eviction="lru")
    for pair in (a, b):
        request(*pair, [1, 2, 3, 4, 5, 6])
        pair[1].evict(3)  # the node goes host-only
        assert pair[1].match([1, 2, 3, 4, 5, 6], stats=False).host_num_tokens == 6
    agree(a, b)
    a[1].events_hasher.fail_at = 0
    with pytest.raises(Failure):
        request(*a, tokens)
    request(*b, tokens, insert=False)
    agree(a, b)
    assert a[1].match([1, 2, 3, 4, 5, 6], stats=False).host_num_tokens == 6  # still host-only
    agree(a, b)
    replay_after(a, b, [(tokens, None), *REST])


def hold_middle(alloc, cache) -> list[int]:
    """Cache [1..6] as three blocks, then evict around a held middle block: the chain's
    first and last blocks go, the middle one stays (named, unreachable). Returns the hold."""
    request(alloc, cache, [1, 2, 3, 4, 5, 6])
    m = cache.match([1, 2, 3, 4, 5, 6])
    held = [m.blocks[1]]
    alloc.decref([m.blocks[0], m.blocks[2]])
    cache.evict(10**9)
    return held


@pytest.mark.parametrize("recipe", RECIPES)
@pytest.mark.parametrize("fail_at", [0, 1])
def test_hash_insert_whose_hasher_fails_on_any_run_changes_nothing(recipe, fail_at):
    """The insert adopts blocks 0 and 2 around the cached block 1: two runs, two events.
    A failure in the second run must not leave the first run's digests or event behind."""
    a = make("hash", FlakyHasher(recipe), hash_seed=0)
    b = make("hash", FlakyHasher(recipe), hash_seed=0)
    holds = [hold_middle(*a), hold_middle(*b)]
    agree(a, b)
    a[1].events_hasher.fail_at = fail_at
    with pytest.raises(Failure):
        request(*a, [1, 2, 3, 4, 5, 6])
    request(*b, [1, 2, 3, 4, 5, 6], insert=False)
    agree(a, b)
    for (alloc, _), held in zip((a, b), holds, strict=True):
        alloc.decref(held)
    agree(a, b)
    replay_after(a, b, [([1, 2, 3, 4, 5, 6], None), ([1, 2, 3, 4, 5, 6], "t"), *REST])


@pytest.mark.parametrize("recipe", RECIPES)
def test_hash_insert_under_a_new_namespace_whose_hasher_fails_changes_nothing(recipe):
    a = make("hash", FlakyHasher(recipe), hash_seed=0)
    b = make("hash", FlakyHasher(recipe), hash_seed=0)
    for pair in (a, b):
        request(*pair, [1, 2, 3, 4])
    a[1].events_hasher.fail_at = 1
    with pytest.raises(Failure):
        request(*a, [1, 2, 3, 4, 5, 6], "t")
    request(*b, [1, 2, 3, 4, 5, 6], "t", insert=False)
    agree(a, b)
    assert a[1].num_namespaces == 1
    replay_after(a, b, [([1, 2, 3, 4, 5, 6], "t"), *REST])


def test_hash_insert_whose_block_namer_fails_changes_nothing():
    """The block names' own hasher (a callable ``hash_fn``) failing mid-chain (events off:
    with events on the event hash names the blocks, and the FlakyHasher tests cover it)."""
    calls = {"left": None}

    def name(parent, block, extra):
        if calls["left"] is not None:
            calls["left"] -= 1
            if calls["left"] < 0:
                calls["left"] = None
                raise Failure("namer failed")
        return hash((parent, block, extra))

    a = make("hash", None, hash_fn=name, hash_seed=0)
    b = make("hash", None, hash_fn=name, hash_seed=0)
    for pair in (a, b):
        request(*pair, [1, 2, 3, 4])
    agree(a, b)
    # the failing request's match names 3 blocks (2 hits, a miss); its insert fails naming
    # the fourth
    calls["left"] = 3
    with pytest.raises(Failure):
        request(*a, [1, 2, 3, 4, 5, 6, 7, 8])
    request(*b, [1, 2, 3, 4, 5, 6, 7, 8], insert=False)
    agree(a, b)
    replay_after(a, b, [([1, 2, 3, 4, 5, 6, 7, 8], None), *REST])


# --------------------------------------------------------------- a host copier that fails
@pytest.mark.parametrize("events", [None, "xxhash"])
def test_write_through_insert_whose_backup_fails_keeps_the_leaf_and_no_host_block(events):
    hasher = None if events is None else ChainHasher(events)
    tier = {"write_policy": "write_through", "write_through_hits": 0}
    alloc, cache = make("radix", hasher, host=tier, eviction="lru")
    host_alloc, copier = cache.host.allocator, cache.host.copier
    request(alloc, cache, [1, 2, 3, 4])
    host_free = host_alloc.num_free
    copier.fail = "backup"
    with pytest.raises(Failure):
        request(alloc, cache, [5, 6, 7, 8])
    cache.check()
    assert host_alloc.num_free == host_free  # the failed copy's host blocks went back
    assert cache.peek([5, 6, 7, 8]) == 4  # documented: the leaf stays, without a copy
    m = cache.match([5, 6, 7, 8], stats=False)
    assert (m.num_tokens, m.host_num_tokens) == (4, 0)
    alloc.decref(m.blocks)
    assert cache.evict(10**9) == 4  # the copy-less leaf is deleted, the other goes host-only
    cache.check()
    cache.reset()
    cache.check()
    assert alloc.num_free == alloc.num_blocks and host_alloc.num_free == host_alloc.num_blocks


@pytest.mark.parametrize("events", [None, "xxhash"])
def test_eviction_whose_backup_fails_evicts_nothing_more_and_keeps_the_leaf(events):
    hasher = None if events is None else ChainHasher(events)
    a = make("radix", hasher, host={}, eviction="lru")
    b = make("radix", hasher, host={}, eviction="lru")
    for pair in (a, b):
        request(*pair, [1, 2, 3, 4])
        request(*pair, [5, 6, 7, 8])
    a[1].host.copier.fail = "backup"
    with pytest.raises(Failure):
        a[1].evict(10**9)
    agree(a, b)
    assert a[1].peek([1, 2, 3, 4]) == 4
    replay_after(a, b, REST)


@pytest.mark.parametrize("events", [None, "xxhash"])
def test_eviction_whose_discard_fails_leaves_the_tree_whole(events):
    hasher = None if events is None else ChainHasher(events)
    alloc, cache = make("radix", hasher, host={}, eviction="lru")
    request(alloc, cache, [1, 2, 3, 4])
    request(alloc, cache, [5, 6, 7, 8])
    cache.host.copier.fail = "discard"
    with pytest.raises(Failure):
        cache.evict(1)
    cache.check()  # the failing discard came after the eviction's bookkeeping
    assert cache.cached_blocks == 2 and cache.host_cached_blocks == 2
    assert cache.match([1, 2, 3, 4], stats=False).host_num_tokens == 4
    assert cache.evict(10**9) == 2
    cache.check()


@pytest.mark.parametrize("events", [None, "xxhash"])
@pytest.mark.parametrize("fail_in", ["load", "backup"])
def test_load_whose_copier_fails_hands_the_caller_no_reference(events, fail_in):
    """A load brings two host-only nodes back. ``load``: the second node's copy fails.
    ``backup``: the pool is short, and the backup of the leaf the load evicts to make room
    fails. Either way the caller gets no reference; a node loaded before the failure stays
    loaded (the cache's own blocks), the rest stay host-only, and the tree is whole."""
    hasher = None if events is None else ChainHasher(events)
    alloc, cache = make("radix", hasher, host={}, eviction="lru")
    request(alloc, cache, [1, 2, 3, 4])
    request(alloc, cache, [1, 2, 3, 4, 5, 6, 7, 8])  # two nodes: [1..4], [5..8]
    cache.evict(10**9)
    assert cache.cached_blocks == 0 and cache.host_cached_blocks == 4
    copier = cache.host.copier
    others: list[int] = []  # blocks another request holds, outside the cache
    if fail_in == "backup":
        others = alloc.alloc(alloc.num_free - 3)
        request(alloc, cache, [100, 101, 102, 103])  # a free 2-block leaf; 1 block free
        copier.fail = "backup"
    else:

        def load_then_fail(host, device):
            NullCopier.load(copier, host, device)
            if copier.loaded > 2:  # the second node
                raise Failure("copier failed in load")

        copier.load = load_then_fail
    free_before = alloc.num_free
    with pytest.raises(Failure):
        cache.load([1, 2, 3, 4, 5, 6, 7, 8])
    cache.check()
    if fail_in == "load":
        del copier.load  # the class's method again
        assert cache.cached_blocks == 2  # the first node came back, the second did not
        assert alloc.num_free == free_before - 2
        m = cache.match([1, 2, 3, 4, 5, 6, 7, 8], stats=False)
        assert (m.num_tokens, m.host_num_tokens) == (4, 4)
        alloc.decref(m.blocks)
    else:
        assert alloc.num_free == free_before
        assert cache.peek([100, 101, 102, 103]) == 4  # the leaf whose backup failed stays
    # every reference is the cache's or the other request's: none leaked to the caller
    assert int(alloc.refcount_array.sum()) == cache.cached_blocks + len(others)
    alloc.decref(others)
    m = cache.load([1, 2, 3, 4, 5, 6, 7, 8])
    assert m.num_tokens == 8
    alloc.decref(m.blocks)
    cache.check()
    cache.reset()
    cache.check()
    assert alloc.num_free == alloc.num_blocks
    assert np.all(cache.host.allocator.refcount_array == 0)


def test_unalloc_puts_the_free_list_back_exactly():
    a, b = BlockAllocator(8, 2), BlockAllocator(8, 2)
    for alloc in (a, b):
        alloc.decref(alloc.alloc(5)[1:4])  # a free list no longer in id order
    taken = a.alloc_array(3)
    a.unalloc(taken)
    assert a.alloc(6) == b.alloc(6)
    a.check()
