"""RadixCache behaviour, edges, and one regression test per pitfall in docs/design.md."""

from __future__ import annotations

import numpy as np
import pytest
from cache_helpers import hit, serve

from radixkv import BlockAllocator, MatchResult, OutOfBlocks, RadixCache


def make(num_blocks: int = 64, block_size: int = 2, eviction: str = "level"):
    alloc = BlockAllocator(num_blocks=num_blocks, block_size=block_size)
    return alloc, RadixCache(alloc, eviction=eviction)


def release(alloc: BlockAllocator, m: MatchResult) -> None:
    alloc.decref(m.blocks)


# ---------------------------------------------------------------- basics
def test_empty_tree_matches_nothing() -> None:
    alloc, cache = make()
    m = cache.match([1, 2, 3, 4])
    assert (m.blocks, m.num_tokens) == ([], 0)
    assert cache.cached_blocks == 0 and cache.evictable_blocks == 0
    assert cache.evict(5) == 0
    cache.check()


def test_empty_query_and_short_query() -> None:
    alloc, cache = make(block_size=4)
    serve(alloc, cache, list(range(8)))
    assert hit(cache, []) == 0
    assert hit(cache, [0, 1, 2]) == 0  # shorter than one block


def test_exact_match_returns_blocks_with_a_reference_each() -> None:
    alloc, cache = make(block_size=2)
    blocks = alloc.alloc(3)
    assert cache.insert([1, 2, 3, 4, 5, 6], blocks) == 0
    assert [alloc.refcount(b) for b in blocks] == [2, 2, 2]
    alloc.decref(blocks)
    m = cache.match([1, 2, 3, 4, 5, 6])
    assert m.blocks == blocks and m.num_tokens == 6
    assert m.block_array.dtype == np.int32
    assert [alloc.refcount(b) for b in blocks] == [2, 2, 2]
    release(alloc, m)
    assert [alloc.refcount(b) for b in blocks] == [1, 1, 1]


def test_match_result_does_not_alias_the_tree() -> None:
    alloc, cache = make(block_size=2)
    serve(alloc, cache, [1, 2, 3, 4])
    m = cache.match([1, 2, 3, 4])
    blocks = list(m.blocks)
    m.block_array[:] = 0  # the caller scribbles on its result
    assert cache.match([1, 2, 3, 4]).blocks == blocks != [0, 0]
    cache.check()


def test_only_full_blocks_are_cached() -> None:
    alloc, cache = make(block_size=4)
    blocks = alloc.alloc(2)
    cache.insert([1, 2, 3, 4, 5, 6, 7], blocks)  # 7 tokens: one full block
    assert cache.cached_blocks == 1
    assert alloc.refcount(blocks[1]) == 1  # the partial block was not adopted
    assert hit(cache, [1, 2, 3, 4, 5, 6, 7, 8]) == 4


def test_one_block_tree() -> None:
    alloc, cache = make(block_size=3)
    serve(alloc, cache, [7, 8, 9])
    assert hit(cache, [7, 8, 9, 1]) == 3
    assert hit(cache, [7, 8, 1]) == 0


def test_insert_returns_cached_prefix_and_keeps_the_trees_blocks() -> None:
    alloc, cache = make(block_size=2)
    first = alloc.alloc(2)
    cache.insert([1, 2, 3, 4], first)
    second = alloc.alloc(3)
    assert cache.insert([1, 2, 3, 4, 5, 6], second) == 4
    # The tree keeps its own blocks for the shared prefix and adopts only the third.
    assert [alloc.refcount(b) for b in second] == [1, 1, 2]
    assert cache.match([1, 2, 3, 4, 5, 6]).blocks == [first[0], first[1], second[2]]


@pytest.mark.parametrize("block_size", [1, 2, 4])
def test_split_at_every_block_boundary(block_size: int) -> None:
    n_blocks = 5
    base = list(range(100, 100 + n_blocks * block_size))
    for k in range(1, n_blocks):
        alloc, cache = make(block_size=block_size)
        serve(alloc, cache, base)
        diverged = base[: k * block_size] + [1] * block_size
        m = cache.match(diverged)
        assert m.num_tokens == k * block_size
        cache.check()
        release(alloc, m)
        serve(alloc, cache, diverged)
        assert hit(cache, base) == len(base)
        assert hit(cache, diverged) == len(diverged)
        assert cache.num_nodes == 3
        cache.check()


def test_divergence_inside_a_block_rounds_down() -> None:
    alloc, cache = make(block_size=4)
    serve(alloc, cache, [1, 2, 3, 4, 5, 6, 7, 8])
    assert hit(cache, [1, 2, 3, 4, 5, 6, 7, 99]) == 4
    assert hit(cache, [1, 2, 3, 99, 5, 6, 7, 8]) == 0


def test_match_splits_so_the_prefix_ends_at_a_node() -> None:
    alloc, cache = make(block_size=1)
    serve(alloc, cache, [1, 2, 3, 4])
    assert cache.num_nodes == 1
    m = cache.match([1, 2, 9])
    assert m.num_tokens == 2 and cache.num_nodes == 2
    cache.check()


def test_namespaces_isolate() -> None:
    alloc, cache = make(block_size=2)
    serve(alloc, cache, [1, 2, 3, 4], ns="lora-a")
    assert hit(cache, [1, 2, 3, 4]) == 0
    assert hit(cache, [1, 2, 3, 4], namespace="lora-b") == 0
    assert hit(cache, [1, 2, 3, 4], namespace="lora-a") == 4
    serve(alloc, cache, [1, 2, 3, 4], ns=("tenant", 7))
    a = cache.match([1, 2], namespace="lora-a").blocks
    b = cache.match([1, 2], namespace=("tenant", 7)).blocks
    assert set(a).isdisjoint(b)


def test_stats_count_tokens() -> None:
    alloc, cache = make(block_size=2)
    serve(alloc, cache, [1, 2, 3, 4])
    serve(alloc, cache, [1, 2, 3, 4, 5])
    s = cache.stats
    assert (s.num_matches, s.query_tokens, s.hit_tokens) == (2, 9, 4)
    assert s.inserted_tokens == 4 and s.hit_rate == pytest.approx(4 / 9)


def test_pretty_shows_tokens_blocks_and_refcounts() -> None:
    alloc, cache = make(block_size=2)
    serve(alloc, cache, list(range(20)))
    serve(alloc, cache, list(range(4)) + [99, 98])
    text = cache.pretty()
    assert "cached_blocks=11" in text and "…" in text and "rc [1" in text
    assert str(cache) == text


# ---------------------------------------------------------------- input types
def test_all_token_input_types_agree() -> None:
    torch = pytest.importorskip("torch")
    alloc, cache = make(block_size=2)
    serve(alloc, cache, [5, 6, 7, 8])
    for tokens in (
        [5, 6, 7, 8],
        (5, 6, 7, 8),
        np.array([5, 6, 7, 8], dtype=np.int64),
        np.array([5, 6, 7, 8], dtype=np.uint16),
        torch.tensor([5, 6, 7, 8]),
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
def test_bad_tokens_raise_and_change_nothing(bad: object, exc: type) -> None:
    alloc, cache = make(block_size=2)
    serve(alloc, cache, [1, 2, 3, 4])
    before = cache.pretty(), cache.stats
    with pytest.raises(exc):
        cache.match(bad)  # type: ignore[arg-type]
    blocks = alloc.alloc(2)
    with pytest.raises(exc):
        cache.insert(bad, blocks)  # type: ignore[arg-type]
    assert (cache.pretty(), cache.stats) == (before[0].replace("free=62", "free=60"), before[1])
    cache.check()


def test_insert_bad_blocks_raise_before_any_change() -> None:
    alloc, cache = make(block_size=2)
    serve(alloc, cache, [1, 2, 3, 4])
    tree_blocks = cache.match([1, 2, 3, 4]).blocks
    mine = alloc.alloc(3)
    before = cache.pretty(), [alloc.refcount(b) for b in range(alloc.num_blocks)]
    cases = [
        ([9, 9, 9, 9], mine[:1], "needs 2 blocks"),  # too few
        ([9, 9, 9, 9], [mine[0], 63], "not allocated"),  # a free block
        ([9, 9, 9, 9], [mine[0], 64], "out of range"),
        ([9, 9, 9, 9], [mine[0], mine[0]], "distinct"),  # repeated
        ([9, 9, 9, 9], [mine[0], tree_blocks[0]], "already cached"),  # cached elsewhere
    ]
    for tokens, blocks, message in cases:
        with pytest.raises(ValueError, match=message):
            cache.insert(tokens, blocks)
        assert (cache.pretty(), [alloc.refcount(b) for b in range(alloc.num_blocks)]) == before
    with pytest.raises(TypeError):
        cache.match([1, 2], namespace=["unhashable"])


def test_bad_construction_and_evict_args() -> None:
    alloc = BlockAllocator(num_blocks=4, block_size=2)
    with pytest.raises(ValueError, match="eviction must be one of"):
        RadixCache(alloc, eviction="mru")
    with pytest.raises(TypeError):
        RadixCache("not an allocator")  # type: ignore[arg-type]
    cache = RadixCache(alloc)
    with pytest.raises(ValueError):
        cache.evict(-1)
    with pytest.raises(TypeError):
        cache.evict(1.5)  # type: ignore[arg-type]


# ---------------------------------------------------------------- eviction
def test_evict_to_zero_frees_everything() -> None:
    alloc, cache = make(num_blocks=32, block_size=2)
    for seq in ([1, 2, 3, 4, 5, 6], [1, 2, 3, 4, 7, 8], [9, 9, 9, 9]):
        serve(alloc, cache, seq)
    assert cache.evictable_blocks == cache.cached_blocks == 6
    assert cache.evict(100) == 6
    assert cache.cached_blocks == 0 and alloc.num_free == 32
    assert hit(cache, [1, 2, 3, 4]) == 0
    cache.check()


def test_evict_takes_a_whole_leaf_and_may_free_more() -> None:
    alloc, cache = make(num_blocks=32, block_size=1)
    serve(alloc, cache, [1, 2, 3, 4, 5])
    assert cache.evict(1) == 5


def test_blocks_held_by_a_running_request_are_never_evicted() -> None:
    alloc, cache = make(num_blocks=32, block_size=2)
    serve(alloc, cache, [1, 2, 3, 4, 5, 6])
    serve(alloc, cache, [7, 8, 9, 10])
    m = cache.match([1, 2, 3, 4, 5, 6])  # a running request holds this path
    assert cache.evictable_blocks == 2
    assert cache.evict(100) == 2
    assert hit(cache, [1, 2, 3, 4, 5, 6]) == 6
    assert [alloc.refcount(b) for b in m.blocks] == [2, 2, 2]
    alloc.decref(m.blocks)
    assert cache.evict(100) == 3 and alloc.num_free == 32
    cache.check()


def test_leaf_held_only_at_its_head_gives_up_its_free_tail() -> None:
    # A request keeps a block across reset; a re-insert puts it at the head of a new leaf.
    alloc, cache = make(num_blocks=8, block_size=1)
    serve(alloc, cache, [5])
    m = cache.match([5])
    cache.reset()
    tail = alloc.alloc(2)
    cache.insert([5, 6, 7], m.blocks + tail)
    alloc.decref(tail)
    assert cache.num_nodes == 1 and cache.evictable_blocks == 2
    assert cache.evict(1) == 2
    assert hit(cache, [5, 6, 7]) == 1 and cache.num_nodes == 1
    cache.check()
    alloc.decref(m.blocks)


def test_parent_becomes_candidate_when_last_child_goes() -> None:
    alloc, cache = make(num_blocks=32, block_size=1)
    serve(alloc, cache, [1, 2, 3])
    serve(alloc, cache, [1, 2, 9, 9])
    # tree: [1 2] -> {[3], [9 9]}; evict all leaves, then the parent.
    assert cache.evict(3) == 3
    assert cache.cached_blocks == 2 and hit(cache, [1, 2]) == 2
    cache.check()


def test_level_order_evicts_deepest_first_then_lru() -> None:
    alloc, cache = make(num_blocks=64, block_size=1, eviction="level")
    serve(alloc, cache, [1, 1, 1, 1, 1, 1])  # depth 6, oldest
    serve(alloc, cache, [2, 2])  # depth 2
    serve(alloc, cache, [3, 3, 3, 3, 3, 3])  # depth 6, newer
    cache.evict(1)
    assert hit(cache, [1] * 6) == 0  # deepest, least recently used
    assert hit(cache, [3] * 6) == 6
    cache.evict(1)
    assert hit(cache, [3] * 6) == 0
    assert hit(cache, [2, 2]) == 2


def test_lru_order_evicts_oldest_whatever_its_depth() -> None:
    alloc, cache = make(num_blocks=64, block_size=1, eviction="lru")
    serve(alloc, cache, [2, 2])  # shallow, oldest
    serve(alloc, cache, [1, 1, 1, 1, 1, 1])
    cache.evict(1)
    assert hit(cache, [2, 2]) == 0
    assert hit(cache, [1] * 6) == 6


def test_match_refreshes_recency() -> None:
    alloc, cache = make(num_blocks=64, block_size=1, eviction="lru")
    serve(alloc, cache, [1, 1])
    serve(alloc, cache, [2, 2])
    release(alloc, cache.match([1, 1]))  # 1 1 is now the most recent
    cache.evict(1)
    assert hit(cache, [1, 1]) == 2 and hit(cache, [2, 2]) == 0


def test_level_depth_is_stable_under_splits() -> None:
    alloc, cache = make(num_blocks=64, block_size=1, eviction="level")
    serve(alloc, cache, [1, 2, 3, 4, 5, 6])  # one leaf, depth 6
    serve(alloc, cache, [9, 9, 9, 9, 9])  # depth 5
    release(alloc, cache.match([1, 2, 7]))  # splits the first leaf at 2: tail keeps depth 6
    cache.evict(1)
    assert hit(cache, [1, 2, 3, 4, 5, 6]) == 2
    assert hit(cache, [9] * 5) == 5


def test_reset_lets_go_and_requests_keep_theirs() -> None:
    alloc, cache = make(num_blocks=16, block_size=2)
    serve(alloc, cache, [1, 2, 3, 4])
    m = cache.match([1, 2, 3, 4])
    cache.reset()
    assert cache.cached_blocks == 0 and alloc.num_free == 14
    assert [alloc.refcount(b) for b in m.blocks] == [1, 1]
    alloc.decref(m.blocks)
    assert alloc.num_free == 16
    cache.check()


def test_serving_loop_with_eviction_never_runs_out() -> None:
    rng = np.random.default_rng(0)
    alloc, cache = make(num_blocks=24, block_size=2)
    system = [1, 2, 3, 4, 5, 6]
    for _ in range(200):
        tokens = system + rng.integers(0, 4, size=int(rng.integers(1, 12))).tolist()
        serve(alloc, cache, tokens)
    cache.reset()
    assert alloc.num_free == alloc.num_blocks


# ---------------------------------------------------------------- pitfalls (docs/design.md)
def test_pitfall_common_prefix_rounded_down_not_up() -> None:
    alloc, cache = make(block_size=2)
    serve(alloc, cache, [1, 2, 3, 5])
    m = cache.match([1, 2, 3, 99])
    assert m.num_tokens == 2 and len(m.blocks) == 1


def test_pitfall_children_dict_holds_the_subtree() -> None:
    # A `node.child = ...` typo would leave `children` empty and orphan the subtree.
    alloc, cache = make(block_size=1)
    serve(alloc, cache, [1, 2, 3])
    serve(alloc, cache, [1, 2, 4])
    assert hit(cache, [1, 2, 3]) == 3 and hit(cache, [1, 2, 4]) == 3
    assert cache.num_nodes == 3
    cache.check()


def test_pitfall_evicted_node_really_leaves_the_tree() -> None:
    # Iterating keys instead of values in evict would leave the node linked to a freed
    # block, which a later match would hand out after the allocator recycled it.
    alloc, cache = make(num_blocks=4, block_size=1)
    serve(alloc, cache, [1, 2, 3, 4])
    cache.evict(4)
    recycled = alloc.alloc(4)
    assert hit(cache, [1, 2, 3, 4]) == 0
    alloc.decref(recycled)
    cache.check()


def test_pitfall_adopted_blocks_sliced_by_block_count() -> None:
    alloc, cache = make(block_size=4)
    first = alloc.alloc(1)
    cache.insert([1, 2, 3, 4], first)
    second = alloc.alloc(3)
    cache.insert(list(range(1, 13)), second)  # 4 tokens cached = 1 block, not 4
    assert cache.match(list(range(1, 13))).blocks == [first[0], second[1], second[2]]


def test_pitfall_match_and_insert_take_references() -> None:
    alloc, cache = make(num_blocks=4, block_size=1)
    blocks = alloc.alloc(2)
    cache.insert([1, 2], blocks)
    assert [alloc.refcount(b) for b in blocks] == [2, 2]  # insert's own reference
    alloc.decref(blocks)
    m = cache.match([1, 2])
    assert [alloc.refcount(b) for b in m.blocks] == [2, 2]  # match's reference
    cache.evict(10)  # must not free what the request reads
    assert alloc.num_free == 2 and hit(cache, [1, 2]) == 2


def test_pitfall_duplicate_blocks_are_freed_by_the_callers_decref() -> None:
    alloc, cache = make(num_blocks=8, block_size=2)
    serve(alloc, cache, [1, 2, 3, 4])
    dup = alloc.alloc(2)  # a second request computed the same prefix itself
    assert cache.insert([1, 2, 3, 4], dup) == 4
    assert [alloc.refcount(b) for b in dup] == [1, 1]
    assert alloc.decref(dup) == 2  # nothing leaks
    cache.reset()
    assert alloc.num_free == 8


def test_pitfall_matched_blocks_fill_slot_indices() -> None:
    # The engine turns matched blocks into slots; every cached position has one.
    alloc, cache = make(block_size=4)
    serve(alloc, cache, list(range(12)))
    m = cache.match(list(range(12)) + [50])
    slots = [b * 4 + o for b in m.blocks for o in range(4)]
    assert len(slots) == m.num_tokens == 12


def test_pitfall_split_keeps_grandchildren_reachable() -> None:
    alloc, cache = make(num_blocks=64, block_size=1)
    serve(alloc, cache, [1, 2, 3, 4])
    serve(alloc, cache, [1, 2, 3, 4, 5, 6])  # grandchild under [1 2 3 4]
    serve(alloc, cache, [1, 2, 9])  # splits [1 2 3 4] -> [1 2] + [3 4] with the grandchild
    cache.check()
    assert cache.evict(2) == 2  # the deepest leaf, [5 6]
    cache.check()
    assert hit(cache, [1, 2, 3, 4, 5, 6]) == 4
    assert cache.evict(1) == 2  # then [3 4] (depth 4), before [9] (depth 3)
    assert hit(cache, [1, 2, 9]) == 3


def test_pitfall_siblings_sharing_a_first_token() -> None:
    alloc, cache = make(block_size=2)
    serve(alloc, cache, [1, 2, 3, 4])
    serve(alloc, cache, [1, 5, 6, 7])  # same first token, different first block
    assert hit(cache, [1, 2, 3, 4]) == 4
    assert hit(cache, [1, 5, 6, 7]) == 4
    cache.check()


def test_pitfall_evict_never_frees_an_interior_node() -> None:
    alloc, cache = make(num_blocks=8, block_size=1)
    serve(alloc, cache, [1, 2])
    serve(alloc, cache, [1, 2, 3, 4])
    m = cache.match([1, 2, 3, 4])  # the leaf [3 4] is in use
    assert cache.evict(8) == 0  # [1 2] is interior: not a candidate
    alloc.decref(m.blocks)
    assert cache.evict(8) == 4
    cache.reset()
    assert alloc.num_free == 8


def test_out_of_blocks_is_raised_by_alloc_not_the_cache() -> None:
    alloc, cache = make(num_blocks=2, block_size=1)
    with pytest.raises(OutOfBlocks):
        alloc.alloc(3)


# ------------------------------------------------------------ block_hashes
def test_block_hashes_are_the_chain_hashes_of_the_cached_blocks() -> None:
    from radixkv.cache.hashing import ChainHasher, chain_hashes

    hasher = ChainHasher("xxhash", seed=1)
    alloc = BlockAllocator(num_blocks=16, block_size=2)
    cache = RadixCache(alloc, "lru", events=hasher)
    a, b = [1, 2, 3, 4, 5, 6], [1, 2, 3, 4, 9, 9]  # b splits a's node after two blocks
    for tokens, ns in ((a, None), (b, None), (a, "t")):
        blocks = alloc.alloc(3)
        cache.insert(tokens, blocks, ns)
        alloc.decref(blocks)
    want = [*chain_hashes(hasher, a, 2, None), *chain_hashes(hasher, b, 2, None)[2:]]
    want += chain_hashes(hasher, a, 2, "t")
    assert sorted(cache.block_hashes()) == sorted(want)
    assert len(cache.block_hashes()) == cache.cached_blocks == 7
    cache.evict(1)  # the least recently used leaf: a's tail
    assert sorted(cache.block_hashes()) == sorted(set(want) - {chain_hashes(hasher, a, 2, None)[2]})
    cache.reset()
    assert cache.block_hashes() == []


def test_block_hashes_need_events_and_a_known_medium() -> None:
    from radixkv.cache.hashing import ChainHasher

    cache = RadixCache(BlockAllocator(num_blocks=4, block_size=2))
    with pytest.raises(ValueError, match="cache must be a radix cache with events on"):
        cache.block_hashes()
    cache = RadixCache(BlockAllocator(num_blocks=4, block_size=2), events=ChainHasher())
    assert cache.block_hashes() == cache.block_hashes("CPU") == []
    with pytest.raises(ValueError, match="medium"):
        cache.block_hashes("gpu")
