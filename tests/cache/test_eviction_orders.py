"""The tree's eviction orders (issue 15, part A): each order's victim on a small example,
the fields the orders read, and the rule that keys never shrink on a touch.

The replay differential tests (tests/replay/test_replay_radix.py) check every order against a
brute-force tree on random and real traces; these pin each order's meaning directly.
"""

from __future__ import annotations

from types import SimpleNamespace

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from radixkv import BlockAllocator, RadixCache
from radixkv.cache.eviction import (
    EVICTION_ORDERS,
    DeepOrder,
    GhostOrder,
    LrfuOrder,
    Readmission,
)


def cache_with(order, num_blocks: int = 16) -> tuple[RadixCache, BlockAllocator]:
    alloc = BlockAllocator(num_blocks=num_blocks, block_size=1)
    return RadixCache(alloc, eviction=order), alloc


def put(cache: RadixCache, alloc: BlockAllocator, tokens: list[int], **kw) -> None:
    blocks = alloc.alloc(len(tokens))
    cache.insert(tokens, blocks, **kw)
    alloc.decref(blocks)


def hit(cache: RadixCache, alloc: BlockAllocator, tokens: list[int]) -> int:
    m = cache.match(tokens)
    alloc.decref_distinct(m.block_array)
    return m.num_tokens


def survivors(cache: RadixCache, prompts: list[list[int]]) -> list[bool]:
    return [cache.peek(p) == len(p) for p in prompts]


A, B, C = [1, 2], [3, 4], [5, 6]


def test_lru_evicts_the_least_recently_used_leaf() -> None:
    cache, alloc = cache_with("lru")
    for p in (A, B, C):
        put(cache, alloc, p)
    hit(cache, alloc, A)
    cache.evict(2)
    assert survivors(cache, [A, B, C]) == [True, False, True]


def test_lfu_keeps_the_most_hit_leaf_even_when_old() -> None:
    cache, alloc = cache_with("lfu")
    for p in (A, B, C):
        put(cache, alloc, p)
    hit(cache, alloc, A)
    hit(cache, alloc, A)
    hit(cache, alloc, B)
    cache.evict(2)  # C: no hits
    assert survivors(cache, [A, B, C]) == [True, True, False]
    cache.evict(2)  # B: one hit, A two
    assert survivors(cache, [A, B, C]) == [True, False, False]


def test_fifo_ignores_use() -> None:
    cache, alloc = cache_with("fifo")
    for p in (A, B, C):
        put(cache, alloc, p)
    for _ in range(3):
        hit(cache, alloc, A)
    cache.evict(2)
    assert survivors(cache, [A, B, C]) == [False, True, True]


def test_priority_goes_lowest_first_then_lru_and_keeps_the_highest_given() -> None:
    cache, alloc = cache_with("priority")
    put(cache, alloc, A, priority=5)
    put(cache, alloc, B, priority=1)
    put(cache, alloc, C, priority=1)
    hit(cache, alloc, B)
    cache.evict(2)  # C: priority 1 and older use than B
    assert survivors(cache, [A, B, C]) == [True, True, False]
    put(cache, alloc, B, priority=9)  # re-insert through B raises it
    put(cache, alloc, C, priority=0)
    cache.evict(4)
    assert survivors(cache, [A, B, C]) == [False, True, False]


def test_a_split_head_keeps_hits_creation_and_priority() -> None:
    cache, alloc = cache_with("lfu")
    put(cache, alloc, [1, 2, 3, 4], priority=3)
    hit(cache, alloc, [1, 2, 3, 4])
    hit(cache, alloc, [1, 2, 9])  # splits after [1, 2]; the head is hit again
    cache.check()
    root = cache._roots[None]
    [head] = root.children.values()
    [tail] = head.children.values()
    assert (head.hits, tail.hits) == (2, 1)
    assert head.created == tail.created and head.priority == tail.priority == 3


def test_lrfu_gives_each_hit_a_bonus_up_to_max_hits() -> None:
    cache, alloc = cache_with(LrfuOrder(boost=10, max_hits=2))
    put(cache, alloc, A)  # clock 1
    hit(cache, alloc, A)  # clock 2: key 2 + 10
    for p in ([7], [8], [9], [10], [11]):  # clocks 3..7: newer, no hits
        put(cache, alloc, p)
    cache.evict(1)
    assert survivors(cache, [A, [7]]) == [True, False]


def test_ghost_readmits_a_leaf_inserted_where_a_deleted_one_was() -> None:
    cache, alloc = cache_with(GhostOrder(boost=0, bonus=100))
    put(cache, alloc, [1, 2, 3])
    put(cache, alloc, [1, 2, 9])
    cache.evict(1)  # [3] is older: deleted, remembered as (depth 2, block 3)
    assert survivors(cache, [[1, 2, 3], [1, 2, 9]]) == [False, True]
    put(cache, alloc, [1, 2, 3, 4])  # the next turn: [3, 4] hangs where [3] was
    for p in ([7], [8], [10]):  # newer, never seen
        put(cache, alloc, p)
    cache.evict(2)
    assert survivors(cache, [[1, 2, 3, 4], [1, 2, 9], [7], [8]]) == [True, False, False, True]
    cache.check()


def test_ghost_readmissions_are_capped_and_the_oldest_lapses() -> None:
    order = GhostOrder(boost=0, bonus=100, readmission=Readmission(protect_ratio=0.25))
    cache, alloc = cache_with(order, num_blocks=16)  # at most 4 readmitted blocks
    for p in ([1, 1, 1], [2, 2, 2]):
        put(cache, alloc, p)
    cache.evict(6)
    put(cache, alloc, [1, 1, 1])  # readmitted: 3 blocks
    put(cache, alloc, [2, 2, 2])  # readmitted: 6 > 4, so [1, 1, 1]'s lapses
    assert [n.readmitted for n in cache._iter_nodes()].count(True) == 1
    put(cache, alloc, [5])
    cache.evict(1)  # [1, 1, 1] (lapsed, oldest) goes before the newer [5]
    assert survivors(cache, [[1, 1, 1], [2, 2, 2], [5]]) == [False, True, True]
    cache.check()


@pytest.mark.parametrize("field", ["ghost_ratio", "protect_ratio"])
@pytest.mark.parametrize("value", [-1, True, None, float("nan")])
def test_readmission_checks_its_fields_by_name(field: str, value: object) -> None:
    with pytest.raises(ValueError, match=field):
        Readmission(**{field: value})
    with pytest.raises(ValueError, match="protect_ratio"):
        Readmission(protect_ratio=1.5)


def test_deep_keeps_a_deep_leaf_over_newer_shallow_ones() -> None:
    cache, alloc = cache_with(DeepOrder(depth_credit=10, span_weight=0))
    deep = list(range(1, 9))
    put(cache, alloc, deep)  # clock 1, depth 8: key 1 + 10 * 3 = 31
    put(cache, alloc, [20])  # clock 2, depth 1: key 2
    put(cache, alloc, [21, 22])  # clock 3, depth 2: key 3 + 10 = 13
    cache.evict(1)
    assert survivors(cache, [deep, [20], [21, 22]]) == [True, False, True]
    cache.evict(1)  # LRU would take the deep leaf (last access 1) here
    assert survivors(cache, [deep, [20], [21, 22]]) == [True, False, False]


def test_deep_credits_a_hit_leaf_with_twice_its_span_of_use() -> None:
    cache, alloc = cache_with(DeepOrder(depth_credit=0, span_weight=2))
    for p in ([1], [2], [3]):  # clocks 1, 2, 3
        put(cache, alloc, p)
    hit(cache, alloc, [1])  # clock 4, created 1: key 4 + 2 * 3 = 10
    others = [[4], [5], [6], [7], [8]]  # clocks 5..9, never hit
    for p in others:
        put(cache, alloc, p)
    cache.evict(6)  # keys 2, 3, 5, 6, 7, 8 go; 9 and 10 stay (LRU would drop [1] third)
    assert survivors(cache, [[1], [2], [3], *others]) == [True] + [False] * 6 + [True]


def leaf(last: int, depth: int, hits: int = 0, created: int | None = None) -> SimpleNamespace:
    created = last if created is None else created
    return SimpleNamespace(last_access=last, depth_end=depth, hits=hits, created=created)


def test_deep_key_known_answers() -> None:
    order = DeepOrder(depth_credit=10, span_weight=2)
    assert order.key(leaf(5, 1)) == (5, 5)  # depth 1: no credit (log2 1 = 0)
    assert order.key(leaf(5, 2)) == (15, 5)
    assert order.key(leaf(5, 3)) == (5 + 15, 5)  # int(10 * 1.58): the credit is floored
    assert order.key(leaf(5, 1024)) == (105, 5)
    assert order.key(leaf(9, 1, created=2)) == (9, 9)  # touched by inserts, never hit: no span
    assert order.key(leaf(9, 1, hits=1, created=2)) == (9 + 2 * 7, 9)
    assert order.key(leaf(9, 4, hits=3, created=2)) == (9 + 20 + 2 * 7, 9)
    default = DeepOrder()  # the defaults docs/replay.md measured
    assert (default.depth_credit, default.span_weight) == (100, 2)


def test_deep_gives_no_span_credit_to_a_leaf_only_inserted_through() -> None:
    cache, alloc = cache_with(DeepOrder(depth_credit=0, span_weight=2))
    put(cache, alloc, [1])  # clock 1
    put(cache, alloc, [2])  # clock 2
    put(cache, alloc, [1])  # clock 3: inserted again, not hit: key 3, no span credit
    put(cache, alloc, [3])  # clock 4
    put(cache, alloc, [4])  # clock 5
    cache.evict(2)
    assert survivors(cache, [[1], [2], [3], [4]]) == [False, False, True, True]
    cache.check()


def test_deep_ties_go_to_the_least_recently_used() -> None:
    cache, alloc = cache_with(DeepOrder(depth_credit=2, span_weight=0))
    put(cache, alloc, [1])  # clock 1, depth 1
    put(cache, alloc, [5, 6])  # clock 2, depth 2: key 2 + 2 = 4
    put(cache, alloc, [1])  # clock 3
    put(cache, alloc, [1])  # clock 4: key 4, a tie with [5, 6], used later
    cache.evict(2)
    assert survivors(cache, [[1], [5, 6]]) == [True, False]
    cache.check()


@pytest.mark.parametrize(
    ("order", "arg"),
    [
        (LrfuOrder, "boost"),
        (LrfuOrder, "max_hits"),
        (DeepOrder, "depth_credit"),
        (DeepOrder, "span_weight"),
        (GhostOrder, "boost"),
        (GhostOrder, "bonus"),
    ],
)
@pytest.mark.parametrize("value", [-1, 1.5, True, None])
def test_order_arguments_are_checked_by_name(order: type, arg: str, value: object) -> None:
    with pytest.raises(ValueError, match=arg):
        order(**{arg: value})


@pytest.mark.parametrize("priority", [1.5, "2", True, None])
def test_priority_must_be_an_int_and_nothing_changes_on_refusal(priority: object) -> None:
    cache, alloc = cache_with("priority")
    blocks = alloc.alloc(2)
    with pytest.raises(TypeError, match="priority"):
        cache.insert(A, blocks, priority=priority)
    assert cache.cached_blocks == 0
    cache.check()


@settings(max_examples=60, deadline=None)
@given(
    order=st.sampled_from(sorted(EVICTION_ORDERS)),
    ops=st.lists(
        st.tuples(
            st.sampled_from(["insert", "match", "evict"]),
            st.lists(st.integers(0, 3), min_size=1, max_size=6),
            st.integers(-2, 2),
        ),
        max_size=40,
    ),
)
def test_every_order_keeps_the_tree_whole_under_any_workload(order, ops) -> None:
    """check() verifies, among the rest, that no filed key is larger than its fresh key."""
    cache, alloc = cache_with(order, num_blocks=24)
    for op, tokens, prio in ops:
        if op == "insert":
            if alloc.num_free < len(tokens):
                cache.evict(len(tokens) - alloc.num_free)
            n = min(len(tokens), alloc.num_free)
            if n:
                blocks = alloc.alloc(n)
                cache.insert(tokens[:n], blocks, priority=prio)
                alloc.decref(blocks)
        elif op == "match":
            hit(cache, alloc, tokens)
        else:
            cache.evict(len(tokens))
        cache.check()
    assert cache.cached_blocks + alloc.num_free == 24
    np.testing.assert_array_equal(alloc.refcounts(cache.held_blocks()), 1)


# ------------------------------------------------------------------ pins
@pytest.mark.parametrize("order", sorted(EVICTION_ORDERS))
def test_a_pinned_prefix_survives_any_order_until_unpinned(order: str) -> None:
    cache, alloc = cache_with(order)
    system = [9, 9, 9, 9]
    put(cache, alloc, system + A)
    put(cache, alloc, B)
    assert cache.pin(system) == 4
    assert cache.pinned_blocks == cache.stats.pinned_blocks == 4
    assert cache.evictable_blocks == 4  # A and B; the pinned 4 are not evictable
    cache.evict(100)
    assert cache.peek(system + A) == 4 and cache.peek(B) == 0  # the tail beyond the pin went
    cache.check()
    assert cache.unpin(system) == 4 and cache.pinned_blocks == 0
    cache.evict(100)
    assert cache.cached_blocks == 0 and alloc.num_free == 16
    cache.check()


def test_pins_nest_pin_only_what_is_cached_and_split_where_they_end() -> None:
    cache, alloc = cache_with("lru")
    assert cache.pin([1, 2, 3]) == 0  # nothing cached: nothing pinned
    put(cache, alloc, [1, 2, 3, 4])
    assert cache.pin([1, 2, 7]) == 2  # the cached prefix [1, 2]: split off and pinned
    assert cache.pin([1, 2, 7]) == 2
    cache.check()
    assert cache.unpin([1, 2, 7]) == 2
    cache.evict(100)
    assert cache.peek([1, 2, 3, 4]) == 2 and cache.pinned_blocks == 2
    cache.unpin([1, 2, 7])
    cache.evict(100)
    assert cache.cached_blocks == 0
    cache.check()


def test_pins_are_capped_and_a_refused_pin_changes_nothing() -> None:
    alloc = BlockAllocator(num_blocks=8, block_size=1)
    cache = RadixCache(alloc, "lru", max_pinned_blocks=3)
    put(cache, alloc, [1, 2, 3, 4])
    assert cache.pin([1, 2]) == 2
    with pytest.raises(ValueError, match="max_pinned_blocks=3"):
        cache.pin([1, 2, 3, 4])  # 2 more blocks: 4 > 3
    assert cache.pinned_blocks == 2
    cache.check()
    assert cache.pin([1, 2, 3]) == 3  # one more block: exactly at the cap
    cache.check()


@pytest.mark.parametrize("cap", [8, 9, -1, 2.0, True])
def test_the_pin_cap_stays_below_the_pool(cap: object) -> None:
    with pytest.raises(ValueError, match="max_pinned_blocks"):
        RadixCache(BlockAllocator(num_blocks=8, block_size=1), max_pinned_blocks=cap)


def test_unpin_without_a_pin_is_refused_and_reset_drops_pins() -> None:
    cache, alloc = cache_with("lru")
    put(cache, alloc, A)
    with pytest.raises(ValueError, match="no pin in force"):
        cache.unpin(A)
    cache.pin(A)
    with pytest.raises(ValueError, match="no pin in force"):
        cache.unpin(A, namespace="other")
    cache.reset()
    assert cache.pinned_blocks == 0
    with pytest.raises(ValueError, match="no pin in force"):
        cache.unpin(A)
    cache.check()


@settings(max_examples=80, deadline=None)
@given(
    order=st.sampled_from(sorted(EVICTION_ORDERS)),
    ops=st.lists(
        st.tuples(
            st.sampled_from(["insert", "match", "evict", "pin", "unpin"]),
            st.lists(st.integers(0, 3), min_size=1, max_size=6),
        ),
        max_size=40,
    ),
)
def test_pins_keep_their_blocks_through_any_workload(order, ops) -> None:
    cache, alloc = cache_with(order, num_blocks=24)
    pins: list[list[int]] = []
    for op, tokens in ops:
        if op == "insert":
            if alloc.num_free < len(tokens):
                cache.evict(len(tokens) - alloc.num_free)
            n = min(len(tokens), alloc.num_free)
            if n:
                blocks = alloc.alloc(n)
                cache.insert(tokens[:n], blocks)
                alloc.decref(blocks)
        elif op == "match":
            hit(cache, alloc, tokens)
        elif op == "evict":
            cache.evict(len(tokens))
        elif op == "pin":
            try:
                if cache.pin(tokens):
                    pins.append(tokens)
            except ValueError:
                assert cache.pinned_blocks <= cache.max_pinned_blocks
        elif pins:
            cache.unpin(pins.pop())
        cache.check()
        assert cache.evictable_blocks == cache.cached_blocks - cache.pinned_blocks
        for p in pins:  # every pinned prefix is still cached in full
            assert cache.peek(p) > 0
    evictable = cache.evictable_blocks
    assert cache.evict(10**6) == evictable  # what it says is evictable, and no more
    assert cache.cached_blocks == cache.pinned_blocks
    while pins:
        cache.unpin(pins.pop())
    cache.evict(10**6)
    assert cache.cached_blocks == 0 and alloc.num_free == 24


def test_a_low_priority_request_through_a_high_priority_prefix_does_not_demote_it() -> None:
    """Issue 26, item 1: insert keeps the highest priority along the path. Writing the new
    priority over the old one would let the low-priority request demote the prefix, and the
    prefix, matched but older than the low-priority leaf, would be evicted before it."""
    cache, alloc = cache_with("priority")
    high, low, other = [1, 2, 3, 4], [1, 2, 3, 4, 5, 6], [7, 8]
    put(cache, alloc, high, priority=5)
    put(cache, alloc, low, priority=0)  # through high's node: its new leaf is [5, 6]
    cache.check()
    assert hit(cache, alloc, high) == 4  # the high-priority branch is matched
    put(cache, alloc, other, priority=0)  # newer than everything on high's branch
    cache.check()
    cache.evict(1)  # [5, 6]: priority 0, older than [7, 8]; high's node is a leaf again
    assert survivors(cache, [high, low, other]) == [True, False, True]
    cache.evict(1)  # [7, 8]: priority 0 goes before 5, however recently used
    assert survivors(cache, [high, low, other]) == [True, False, False]
    cache.check()


def test_lrfu_stops_counting_hits_at_max_hits() -> None:
    """Issue 26: the hit cap. A leaf hit five times gets the same bonus as one hit twice
    (max_hits=2), so the more recently used of the two outlives it; uncapped, the five hits
    (500 ticks) would outweigh it."""
    cache, alloc = cache_with(LrfuOrder(boost=100, max_hits=2))
    put(cache, alloc, A)  # clock 1
    put(cache, alloc, B)  # clock 2
    for _ in range(5):  # clocks 3..7: key 7 + 2 * 100, not 7 + 5 * 100
        hit(cache, alloc, A)
    for _ in range(2):  # clocks 8, 9: key 9 + 2 * 100
        hit(cache, alloc, B)
    cache.evict(1)
    assert survivors(cache, [A, B]) == [False, True]
    cache.check()


def test_ghost_forgets_its_oldest_entry_first() -> None:
    """Issue 26: the ghost is a FIFO. With room for two blocks, deleting [1], [2], [3] in that
    order forgets [1], so re-inserting [3] readmits it (protected) and re-inserting [1] does
    not; a ghost that forgot its newest entry would have it the other way round."""
    order = GhostOrder(boost=0, bonus=100, readmission=Readmission(ghost_ratio=0.25))
    cache, alloc = cache_with(order, num_blocks=8)  # the ghost holds 2 blocks
    for p in ([1], [2], [3]):
        put(cache, alloc, p)
    for _ in range(3):
        assert cache.evict(1) == 1  # [1], then [2], then [3]
    assert cache.cached_blocks == 0
    put(cache, alloc, [3])  # remembered: readmitted
    put(cache, alloc, [1])  # forgotten: an ordinary new leaf
    put(cache, alloc, [9])  # newer, never seen
    cache.check()
    cache.evict(1)  # [1]: the oldest unprotected leaf; [3] is older but protected
    assert survivors(cache, [[1], [3], [9]]) == [False, True, True]
    cache.evict(1)  # [9] next: [3]'s protection outlasts it
    assert survivors(cache, [[1], [3], [9]]) == [False, True, False]
    cache.check()


# ------------------------------------------------------------------ hooks
def test_every_built_in_order_is_an_eviction_order_whose_hooks_do_nothing() -> None:
    from radixkv.cache.eviction import EvictionOrder
    from radixkv.cache.node import Node

    parent, leaf = Node(b"", b"", None, 0, 0), Node(b"\1\0\0\0", b"\0\0\0\0", None, 1, 0)
    for name, cls in EVICTION_ORDERS.items():
        order = cls()
        assert isinstance(order, EvictionOrder) and order.name == name
        if name == "ghost":
            continue  # the one order with state (below)
        assert order.bind(16, 1) is order  # no state: one object serves every tree
        assert order.on_insert(parent, leaf) == ()
        order.on_split(parent, leaf)
        order.on_evict(parent, leaf, True)
        order.on_reset()
        order.check([parent, leaf])
        assert not leaf.readmitted


def test_an_object_with_a_key_alone_is_an_order() -> None:
    class Newest:  # evicts the most recently used leaf first; no hooks, no name
        def key(self, node):
            return (-node.last_access,)

    cache, alloc = cache_with(Newest())
    assert cache.eviction == "Newest"
    for p in (A, B, C):
        put(cache, alloc, p)
    cache.evict(2)
    assert survivors(cache, [A, B, C]) == [True, True, False]
    cache.check()


def test_an_order_hears_every_hook_the_tree_calls() -> None:
    from radixkv.cache.eviction import LruOrder

    heard: list[tuple] = []

    class Listening(LruOrder):
        def bind(self, num_blocks, block_size):
            heard.append(("bind", num_blocks, block_size))
            return self

        def on_insert(self, parent, leaf):
            heard.append(("insert", leaf.tokens().tolist()))
            return ()

        def on_split(self, head, tail):
            heard.append(("split", head.tokens().tolist(), tail.tokens().tolist()))

        def on_evict(self, parent, node, deleted):
            heard.append(("evict", node.tokens().tolist(), deleted))

        def on_reset(self):
            heard.append(("reset",))

    cache, alloc = cache_with(Listening())
    put(cache, alloc, [1, 2, 3])
    hit(cache, alloc, [1, 9])  # splits [1, 2, 3] after [1]
    cache.evict(2)
    cache.reset()
    assert heard == [
        ("bind", 16, 1),
        ("insert", [1, 2, 3]),
        ("split", [1], [2, 3]),
        ("evict", [2, 3], True),
        ("reset",),
    ]


def test_one_ghost_order_object_gives_each_tree_its_own_ghost() -> None:
    """The ghost is state: two trees configured with one GhostOrder must not share it."""
    order = GhostOrder(boost=0, bonus=100)
    first, alloc_1 = cache_with(order)
    second, alloc_2 = cache_with(order)
    put(first, alloc_1, [1, 2])
    first.evict(2)  # the first tree's ghost remembers [1, 2]
    put(second, alloc_2, [1, 2])  # the second tree never deleted it: not readmitted
    assert [n.readmitted for n in second._iter_nodes()] == [False]
    put(first, alloc_1, [1, 2])
    assert [n.readmitted for n in first._iter_nodes()] == [True]
    first.check()
    second.check()
