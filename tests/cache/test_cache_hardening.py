"""Regression tests for issue 11, "The caches and the allocator" (items 8 to 16).

Each test names the item it holds. Every one of them failed (or hung) on the
code before the fix: the allocator's distinct-block hot paths wrote outside
the refcount array, the hash cache could not evict ``10**30`` blocks,
``namespace=True`` hit blocks cached under ``1``, per-namespace state lived
forever, a ``set`` passed as a block table was consumed in any order, a list
eviction key looped forever, ``check()`` passed everything under ``python
-O``, errors named the wrong thing, and two caches shared one allocator.
"""

from __future__ import annotations

import gc
import signal
import subprocess
import sys
import textwrap
from collections.abc import Callable, Iterator
from contextlib import contextmanager

import numpy as np
import pytest
from cache_helpers import hit, serve
from hypothesis import given
from hypothesis import strategies as st

from radixkv.cache import (
    BlockAllocator,
    HashBlockCache,
    InvariantError,
    NullCache,
    PrefixCache,
    RadixCache,
)
from radixkv.cache.prefix_cache import check_namespace, namespace_key

Factory = Callable[[BlockAllocator], PrefixCache]

CACHING: dict[str, Factory] = {
    "radix-level": lambda a: RadixCache(a, eviction="level"),
    "radix-lru": lambda a: RadixCache(a, eviction="lru"),
    "hash-sha256": lambda a: HashBlockCache(a, hash_fn="sha256", hash_seed=0),
    "hash-builtin": lambda a: HashBlockCache(a, hash_fn="builtin"),
}
FACTORIES: dict[str, Factory] = {**CACHING, "null": NullCache}


@pytest.fixture(params=sorted(CACHING))
def factory(request: pytest.FixtureRequest) -> Factory:
    return CACHING[request.param]


@pytest.fixture(params=sorted(FACTORIES))
def any_factory(request: pytest.FixtureRequest) -> Factory:
    return FACTORIES[request.param]


def make(factory: Factory, num_blocks: int = 64, block_size: int = 2):
    alloc = BlockAllocator(num_blocks=num_blocks, block_size=block_size)
    return alloc, factory(alloc)


def snapshot(alloc: BlockAllocator, cache: PrefixCache | None = None) -> tuple:
    state = (alloc.refcount_array.tolist(), alloc.num_free)
    if cache is None:
        return state
    return (*state, cache.cached_blocks, cache.evictable_blocks, cache.held_blocks().tolist())


@contextmanager
def time_limit(seconds: int) -> Iterator[None]:
    """Turn a hang (the old infinite eviction loop) into a failure."""

    def fire(signum, frame):
        raise TimeoutError(f"still running after {seconds}s")

    old = signal.signal(signal.SIGALRM, fire)
    signal.alarm(seconds)
    try:
        yield
    finally:
        signal.alarm(0)
        signal.signal(signal.SIGALRM, old)


# ------------------------------------------------ 8: incref/decref_distinct
@pytest.mark.parametrize("bad", [-1, -(2**31), 8, 2**31 - 1])
@pytest.mark.parametrize("op", ["incref_distinct", "decref_distinct"])
def test_distinct_ops_reject_out_of_range_blocks_and_change_nothing(op: str, bad: int) -> None:
    alloc = BlockAllocator(num_blocks=8, block_size=2)
    alloc.alloc(8)  # every block allocated: -1 used to hit block 7, silently
    before = snapshot(alloc)
    with pytest.raises(ValueError, match=f"block {bad} out of range"):
        getattr(alloc, op)(np.array([0, 1, bad, 2], dtype=np.int32))
    assert snapshot(alloc) == before
    alloc.check()


def test_decref_distinct_refuses_a_repeat_past_its_refcount() -> None:
    alloc = BlockAllocator(num_blocks=4, block_size=1)
    alloc.alloc(2)
    before = snapshot(alloc)
    with pytest.raises(ValueError, match="block 1 more times than its refcount 1"):
        alloc.decref_distinct(np.array([0, 1, 1], dtype=np.int32))  # used to go to -1
    assert snapshot(alloc) == before
    alloc.check()


@given(
    held=st.lists(st.integers(0, 3), min_size=8, max_size=8),
    ids=st.lists(st.integers(-3, 11), max_size=12),
    op=st.sampled_from(["incref_distinct", "decref_distinct"]),
)
def test_distinct_ops_match_a_reference_or_change_nothing(
    held: list[int], ids: list[int], op: str
) -> None:
    """Property: either the refcounts move exactly as a plain-Python model says, or the
    call raises ValueError and nothing moved; the allocator's invariants hold throughout."""
    alloc = BlockAllocator(num_blocks=8, block_size=1)
    blocks = alloc.alloc(8)
    alloc.decref([b for b, n in zip(blocks, held) for _ in range(1 - min(n, 1))])
    for b, n in zip(blocks, held):
        if n > 1:
            alloc.incref([b] * (n - 1))
    rc = alloc.refcount_array.tolist()
    model, ok = list(rc), True
    for b in ids:
        if not 0 <= b < 8 or model[b] <= 0 or rc[b] <= 0:
            ok = False
            break
        model[b] += 1 if op == "incref_distinct" else -1
    before = snapshot(alloc)
    if ok:
        freed = getattr(alloc, op)(np.array(ids, dtype=np.int32))
        assert alloc.refcount_array.tolist() == model
        if op == "decref_distinct":
            assert freed == sum(1 for a, m in zip(rc, model) if a > 0 and m == 0)
    else:
        with pytest.raises(ValueError):
            getattr(alloc, op)(np.array(ids, dtype=np.int32))
        assert snapshot(alloc) == before
    alloc.check()


# ------------------------------------------------------ 9: evict any k >= 0
@pytest.mark.parametrize("k", [10**30, sys.maxsize, sys.maxsize // 2 + 1, np.int64(2**62)])
def test_evict_takes_any_nonnegative_int(any_factory: Factory, k: int) -> None:
    alloc, cache = make(any_factory)
    for i in range(5):
        serve(alloc, cache, [i, i, 7, 7, 8, 8])
    held = cache.match([0, 0, 7, 7]).blocks  # stays: a request holds it
    expect = cache.evictable_blocks
    assert cache.evict(k) == expect
    assert cache.evictable_blocks == 0
    alloc.decref(held)
    rest = cache.cached_blocks
    assert cache.evict(k) == rest
    assert cache.cached_blocks == 0 and alloc.num_free == alloc.num_blocks
    cache.check()


# ---------------------------------------------- 10: namespaces by type and value
def typed_equal(a: object, b: object) -> bool:
    """The test's own notion of "same namespace": same type and equal, entry by entry."""
    if type(a) is not type(b):
        return False
    if isinstance(a, tuple):
        return len(a) == len(b) and all(typed_equal(x, y) for x, y in zip(a, b))
    return a == b


scalars = st.sampled_from([None, 0, 1, True, False, 1.0, 0.0, -0.0, "1", b"1", 2, np.int64(1)])
namespaces = st.one_of(scalars, st.tuples(scalars, scalars), st.tuples(scalars))


def test_equal_but_differently_typed_namespaces_share_nothing(factory: Factory) -> None:
    alloc, cache = make(factory)
    serve(alloc, cache, [1, 2, 3, 4], ns=1)
    serve(alloc, cache, [5, 6, 7, 8], ns=("lora", 1))
    for other in (True, 1.0, np.int64(1), (1,), "1"):
        assert cache.peek([1, 2, 3, 4], namespace=other) == 0, other
        assert hit(cache, [1, 2, 3, 4], namespace=other) == 0, other
    assert cache.peek([5, 6, 7, 8], namespace=("lora", True)) == 0
    assert hit(cache, [1, 2, 3, 4], namespace=1) == 4
    assert hit(cache, [5, 6, 7, 8], namespace=("lora", 1)) == 4
    cache.check()


@given(a=namespaces, b=namespaces)
def test_namespaces_meet_iff_same_type_and_value(a: object, b: object) -> None:
    """Property, on both caches: a block cached under ``a`` is found under ``b`` exactly
    when ``a`` and ``b`` have the same type and value (entry by entry for tuples)."""
    for make_cache in CACHING.values():
        alloc, cache = make(make_cache)
        serve(alloc, cache, [1, 2, 3, 4], ns=a)
        expect = 4 if typed_equal(a, b) else 0
        assert cache.peek([1, 2, 3, 4], namespace=b) == expect
        assert hit(cache, [1, 2, 3, 4], namespace=b) == expect
        serve(alloc, cache, [1, 2, 3, 4], ns=b)
        assert cache.cached_blocks == (2 if expect else 4)
        cache.check()
    assert (namespace_key(a) == namespace_key(b)) == typed_equal(a, b)


@pytest.mark.parametrize("ns", [float("nan"), ("lora", float("nan")), frozenset({float("nan")})])
def test_a_namespace_not_equal_to_itself_is_refused(any_factory: Factory, ns: object) -> None:
    alloc, cache = make(any_factory)
    serve(alloc, cache, [1, 2, 3, 4])
    blocks = alloc.alloc(2)
    before, stats = snapshot(alloc, cache), cache.stats
    for call in (
        lambda: cache.match([1, 2, 3, 4], namespace=ns),
        lambda: cache.peek([1, 2, 3, 4], namespace=ns),
        lambda: cache.insert([9, 9, 9, 9], blocks, namespace=ns),
        lambda: check_namespace(ns),
    ):
        with pytest.raises(ValueError, match="namespace must be equal to itself"):
            call()
    assert snapshot(alloc, cache) == before and cache.stats == stats
    cache.check()


def test_check_namespace_returns_the_namespace_itself() -> None:
    # The engine stores what check_namespace returns; the typed key stays inside the caches.
    for ns in (None, "a", 1, ("t", 2)):
        assert check_namespace(ns) is ns
    with pytest.raises(TypeError, match="namespace must be hashable"):
        check_namespace([1])


# ------------------------------------------- 11: per-namespace state released
@pytest.mark.parametrize("kind", ["radix-level", "radix-lru", "hash-sha256", "hash-builtin"])
def test_per_request_salts_leave_no_namespace_state(kind: str) -> None:
    alloc = BlockAllocator(num_blocks=64, block_size=4)
    cache = CACHING[kind](alloc)
    tokens = list(range(16))
    for salt in range(10_000):  # a fresh cache salt per request, the pool under pressure
        serve_quietly(alloc, cache, tokens, f"salt-{salt}")
        if salt % 2000 == 0:
            cache.check()
            assert cache.num_namespaces <= alloc.num_blocks // 4
    assert cache.evictable_blocks == cache.cached_blocks > 0
    assert cache.evict(alloc.num_blocks) == 64
    assert cache.num_namespaces == 0 and cache.evictable_blocks == cache.cached_blocks == 0
    assert internal_namespace_entries(cache) == 0
    cache.check()
    serve_quietly(alloc, cache, tokens, "salt-again")
    serve_quietly(alloc, cache, tokens, None)
    assert cache.num_namespaces == 2
    cache.reset()  # reset forgets them too (the hash cache used to keep them)
    assert cache.num_namespaces == 0 and internal_namespace_entries(cache) == 0
    assert alloc.num_free == alloc.num_blocks
    cache.check()


def serve_quietly(alloc: BlockAllocator, cache: PrefixCache, tokens: list[int], ns) -> None:
    """``serve`` without a ``check()`` per request (10k requests)."""
    m = cache.match(tokens, namespace=ns)
    need = len(tokens) // alloc.block_size - len(m.blocks)
    if need > alloc.num_free:
        cache.evict(need - alloc.num_free)
    blocks = m.blocks + alloc.alloc(need)
    cache.insert(tokens, blocks, namespace=ns)
    alloc.decref(blocks)


def internal_namespace_entries(cache: PrefixCache) -> int:
    """Every per-namespace entry the cache keeps, read off its internals (test-only)."""
    if isinstance(cache, RadixCache):
        return len(cache._roots)
    live_slots = sum(1 for rec in cache._slots if rec is not None)
    return len(cache._namespaces) + live_slots


@given(
    ops=st.lists(
        st.tuples(
            st.sampled_from(["serve", "serve", "serve", "evict", "hold", "reset"]),
            st.integers(0, 5),
            st.sampled_from([None, "a", 1, True, ("t", 1)]),
        ),
        max_size=40,
    ),
    kind=st.sampled_from(sorted(CACHING)),
)
def test_namespaces_live_exactly_as_long_as_their_blocks(ops: list, kind: str) -> None:
    """Property: after any mix of serves, evictions (some blocks held by requests),
    resets, ``check()`` holds (it verifies no namespace is kept without a block and the
    hash cache's per-namespace block counts), and once everything is evicted nothing
    per-namespace remains."""
    alloc = BlockAllocator(num_blocks=12, block_size=2)
    cache = CACHING[kind](alloc)
    holds: list[list[int]] = []
    for op, k, ns in ops:
        if op == "serve":
            serve_quietly(alloc, cache, [k, k + 1, k, 9, k], ns)
        elif op == "evict":
            cache.evict(k)
        elif op == "hold":
            holds.append(cache.match([k, k + 1, k, 9], namespace=ns).blocks)
        else:
            cache.reset()
        cache.check()
    for held in holds:
        alloc.decref(held)
    cache.evict(10**9)
    assert cache.cached_blocks == 0 and cache.num_namespaces == 0
    assert internal_namespace_entries(cache) == 0
    cache.check()


# -------------------------------------------- 12: block tables are ordered
UNORDERED = [
    lambda b: set(b),
    lambda b: dict.fromkeys(b),
    lambda b: frozenset(b),
    lambda b: (x for x in b),
    lambda b: iter(b),
    lambda b: None,
    lambda b: b[0],
]


@pytest.mark.parametrize("unordered", UNORDERED)
def test_block_tables_must_be_ordered_sequences(any_factory: Factory, unordered) -> None:
    alloc, cache = make(any_factory)
    serve(alloc, cache, [1, 2, 3, 4])
    mine = alloc.alloc(3)
    before, stats = snapshot(alloc, cache), cache.stats
    with pytest.raises(TypeError, match="blocks"):
        cache.insert([5, 6, 7, 8, 9, 10], unordered(mine))
    for op in (alloc.incref, alloc.decref):
        with pytest.raises(TypeError, match="blocks"):
            op(unordered(mine))
    assert snapshot(alloc, cache) == before and cache.stats == stats
    cache.check()


@pytest.mark.parametrize(
    "extra, why", [(-7, "out of range"), (10**6, "out of range"), ("free", "not allocated")]
)
def test_every_block_table_entry_must_be_allocated(
    any_factory: Factory, extra: object, why: str
) -> None:
    alloc, cache = make(any_factory)
    serve(alloc, cache, [1, 2, 3, 4])
    mine = alloc.alloc(3)
    if extra == "free":
        extra = alloc.alloc(1)[0]
        alloc.decref([extra])
    before, stats = snapshot(alloc, cache), cache.stats
    for table in (mine + [extra], np.array(mine + [extra]), tuple(mine + [extra])):
        # 5 tokens: 2 full blocks; entries 2 and 3 lie past them, and 3 is bad.
        with pytest.raises(ValueError, match=rf"blocks\[3\] is block {extra}.*{why}"):
            cache.insert([5, 6, 7, 8, 9], table)
    assert snapshot(alloc, cache) == before and cache.stats == stats
    assert cache.insert([5, 6, 7, 8, 9], mine) == 0  # the same table, valid, goes in
    alloc.decref(mine)
    cache.check()


def test_ordered_block_tables_of_every_kind_are_taken(any_factory: Factory) -> None:
    torch = pytest.importorskip("torch")
    for table in (
        list,
        tuple,
        np.array,
        lambda b: torch.tensor(b),
        lambda b: range(b[0], b[0] + 2),
    ):
        alloc, cache = make(any_factory)
        mine = alloc.alloc(2)
        cache.insert([1, 2, 3, 4], table(mine))
        alloc.decref(mine)
        assert hit(cache, [1, 2, 3, 4]) == (4 if any_factory is not NullCache else 0)
        cache.check()


# ------------------------------------------------ 13: eviction order keys
class ListKey:
    name = "list-key"

    def key(self, node) -> list:
        return [node.last_access]


class TurnsBad:
    """Returns a tuple for fresh nodes (it passes the construction probe), a list later."""

    name = "turns-bad"

    def key(self, node):
        return (node.last_access,) if node.last_access < 3 else [node.last_access]


class Decreasing:
    """Breaks "keys never decrease on a touch": a touch lowers the key."""

    name = "decreasing"

    def key(self, node) -> tuple:
        return (-node.last_access,)


def test_an_order_whose_key_is_not_a_tuple_is_refused_at_construction() -> None:
    alloc = BlockAllocator(num_blocks=8, block_size=1)
    with pytest.raises(TypeError, match="eviction order .*ListKey.*must return a tuple, got list"):
        RadixCache(alloc, eviction=ListKey())
    RadixCache(alloc)  # the refused cache did not claim the allocator


def test_a_key_that_turns_into_a_list_raises_instead_of_looping() -> None:
    alloc = BlockAllocator(num_blocks=8, block_size=1)
    cache = RadixCache(alloc, eviction=TurnsBad())
    serve(alloc, cache, [1, 2])  # filed under a tuple
    hit(cache, [1, 2])
    hit(cache, [1, 2])  # last_access is now 3: a fresh key is a list
    with time_limit(10), pytest.raises(TypeError, match="TurnsBad.*must return a tuple"):
        cache.evict(1)
    assert cache.cached_blocks == 2
    (leaf,) = [e[-1] for e in cache._leaves]  # the raise left the leaf index whole
    assert leaf.entry in cache._leaves
    with pytest.raises(InvariantError, match="TurnsBad.*returned a list"):
        cache.check()  # and check() names the order


def test_check_catches_a_key_that_decreases_on_a_touch() -> None:
    alloc = BlockAllocator(num_blocks=8, block_size=1)
    cache = RadixCache(alloc, eviction=Decreasing())
    serve(alloc, cache, [1, 2])
    cache.check()
    hit(cache, [1, 2])  # the touch lowers the key below the filed one
    with pytest.raises(InvariantError, match="lowered a key on a touch"):
        cache.check()


# ------------------------------------------------- 14: check() without assert
CORRUPT = textwrap.dedent(
    """
    import numpy as np
    from radixkv.cache import BlockAllocator, HashBlockCache, InvariantError, NullCache, RadixCache

    assert False, "this must run under python -O"  # noqa: B011 (skipped under -O)

    def corrupted(kind, how):
        alloc = BlockAllocator(num_blocks=16, block_size=2)
        cache = {"radix": RadixCache, "hash": HashBlockCache, "null": NullCache}[kind](alloc)
        blocks = alloc.alloc(2)
        cache.insert([1, 2, 3, 4], blocks)
        if how == "refcount":
            alloc.refcount_array[blocks[0]] += 5  # a reference nobody holds
        elif how == "free-list":
            alloc.refcount_array[15] = 1  # allocated, yet on the free list
        elif how == "structure" and kind == "radix":
            next(iter(next(iter(cache._roots.values())).children.values())).parent = None
        elif how == "structure" and kind == "hash":
            by_name = cache._namespaces[None].by_name
            by_name[next(iter(by_name))] = 9
        return cache

    for kind, how in [("radix", "free-list"), ("radix", "structure"), ("hash", "free-list"),
                      ("hash", "structure"), ("null", "free-list")]:
        try:
            corrupted(kind, how).check()
        except InvariantError as e:
            print(kind, how, "InvariantError:", e)
        else:
            print(kind, how, "PASSED A CORRUPTED CACHE")
    alloc = BlockAllocator(num_blocks=4, block_size=1)
    alloc.refcount_array[0] = -1
    try:
        alloc.check()
    except InvariantError as e:
        print("allocator InvariantError:", e)
    """
)


def test_check_raises_invariant_error_even_under_python_O() -> None:
    out = subprocess.run(
        [sys.executable, "-O", "-c", CORRUPT], capture_output=True, text=True, timeout=120
    )
    assert out.returncode == 0, out.stderr
    lines = out.stdout.splitlines()
    assert len(lines) == 6 and not any("PASSED" in line for line in lines), out.stdout
    assert all("InvariantError: " in line and line.split(": ", 1)[1] for line in lines)
    assert "child's parent pointer is wrong" in out.stdout
    assert "name maps elsewhere" in out.stdout
    assert "negative refcount" in out.stdout


@pytest.mark.parametrize("kind", ["radix", "hash"])
def test_check_names_the_broken_invariant(kind: str) -> None:
    alloc = BlockAllocator(num_blocks=16, block_size=2)
    cache = RadixCache(alloc) if kind == "radix" else HashBlockCache(alloc, hash_seed=0)
    blocks = alloc.alloc(2)
    cache.insert([1, 2, 3, 4], blocks)
    alloc.decref(blocks)
    cache.check()
    alloc.refcount_array[blocks[1]] = 0  # the cache's block looks free
    with pytest.raises(InvariantError, match="the (tree|cache) holds a free block") as e:
        cache.check()
    assert isinstance(e.value, AssertionError)  # what check() raised before: still caught


# ---------------------------------------------------- 15: error messages
def test_out_of_range_token_ids_are_named(any_factory: Factory) -> None:
    alloc, cache = make(any_factory)
    for tokens, exc, msg in [
        ([2**63, 1, 2], ValueError, r"tokens\[0\] is 9223372036854775808, outside the int32"),
        ([1, 2**64], ValueError, r"tokens\[1\] is 18446744073709551616"),
        ([1, -(2**63) - 1], ValueError, r"tokens\[1\] is -9223372036854775809"),
        ([1, 2**31], ValueError, r"tokens\[1\] is 2147483648"),
        (np.array([1, 2**40]), ValueError, r"tokens\[1\] is 1099511627776"),
        ([1, 2.5], TypeError, r"tokens\[1\] must be an int, got 2.5 \(float\)"),
        ([1, "2"], TypeError, r"tokens\[1\] must be an int, got '2' \(str\)"),
        ([1, None], TypeError, r"tokens\[1\] must be an int, got None"),
    ]:
        for call in (cache.match, cache.peek):
            with pytest.raises(exc, match=msg):
                call(tokens)
    assert alloc.num_free == alloc.num_blocks


def test_a_missing_block_table_is_named(any_factory: Factory) -> None:
    alloc, cache = make(any_factory)
    for bad in (None, 0, 1.5):
        with pytest.raises(TypeError, match="blocks must be an ordered sequence.*got"):
            cache.insert([1, 2], bad)  # type: ignore[arg-type]
        with pytest.raises(TypeError, match="blocks must be an ordered sequence.*got"):
            alloc.decref(bad)  # type: ignore[arg-type]
        with pytest.raises(TypeError, match="blocks must be an ordered sequence.*got"):
            alloc.incref(bad)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match=r"blocks\[1\] is 4294967296"):
        alloc.decref([0, 2**32])


def test_distinct_ops_take_any_block_sequence_without_a_numba_typing_error() -> None:
    alloc = BlockAllocator(num_blocks=8, block_size=2)
    blocks = alloc.alloc(3)
    alloc.incref_distinct(blocks)  # a list
    alloc.incref_distinct(np.array(blocks, dtype=np.int64))  # another dtype
    assert [alloc.refcount(b) for b in blocks] == [3, 3, 3]
    assert alloc.decref_distinct(tuple(blocks)) == 0
    for bad, exc in ((None, TypeError), ("ab", TypeError), ({1, 2}, TypeError), ([0.5], TypeError)):
        for op in (alloc.incref_distinct, alloc.decref_distinct):
            with pytest.raises(exc, match="blocks"):
                op(bad)
    assert [alloc.refcount(b) for b in blocks] == [2, 2, 2]
    alloc.check()


# -------------------------------------------------- 16: one cache per allocator
@pytest.mark.parametrize("second", sorted(CACHING))
def test_a_second_cache_on_one_allocator_is_refused(factory: Factory, second: str) -> None:
    alloc, first = make(factory)
    serve(alloc, first, [1, 2, 3, 4])
    before = snapshot(alloc, first)
    with pytest.raises(ValueError, match="allocator already serves"):
        CACHING[second](alloc)
    NullCache(alloc)  # holds no reference, so it blocks nothing: allowed
    assert snapshot(alloc, first) == before
    assert first.evict(10) == 2  # the first cache still evicts its blocks
    first.check()


def test_a_dropped_cache_frees_its_claim_and_its_references(factory: Factory) -> None:
    alloc, first = make(factory)
    serve(alloc, first, [1, 2, 3, 4])
    held = first.match([1, 2]).blocks  # a request outlives the cache
    assert alloc.num_free == alloc.num_blocks - 2
    del first
    gc.collect()
    assert alloc.num_free == alloc.num_blocks - 1  # the cache's references went with it
    assert alloc.refcount(held[0]) == 1  # the request's stayed
    second = factory(alloc)
    alloc.decref(held)
    assert alloc.num_free == alloc.num_blocks
    serve(alloc, second, [1, 2, 3, 4])
    assert second.evict(10) == 2
    second.check()


def test_a_failed_construction_claims_nothing() -> None:
    alloc = BlockAllocator(num_blocks=8, block_size=2)
    with pytest.raises(ValueError, match="hash_fn"):
        HashBlockCache(alloc, hash_fn="md5")
    with pytest.raises(ValueError, match="eviction"):
        RadixCache(alloc, eviction="mru")
    RadixCache(alloc).check()
