"""Radix policies in replay: exact agreement with a brute-force trie, invariants after every
request, hand-derived eviction answers, and agreement with flat LRU when nothing is evicted.

The brute-force oracle (``replay_reference.radix_reference``) restates the tree's rules
over plain token lists and scans every node for each victim. The invariants pin down what
must hold whatever the victims: the hit is the longest resident prefix, nothing appears
that was not requested, everything that fits is cached, nothing is evicted while there is
room, no block leaks, and no resident block is unreachable.
"""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import assume, given
from hypothesis import strategies as st
from replay_reference import check_sanity, hits, radix_reference, random_requests, reqs
from trace_paths import TRACES

from radixkv.replay import RADIX_POLICIES, Trace, load_trace, replay
from radixkv.replay.radix_policy import RadixReplayer


def resident_paths(replayer: RadixReplayer) -> set[tuple[int, ...]]:
    """Every cached prefix (one per block), read off the tree (test-only private access)."""
    root = replayer.cache._roots.get(None)
    paths: set[tuple[int, ...]] = set()
    if root is None:
        return paths
    stack = [(child, ()) for child in root.children.values()]
    while stack:
        node, prefix = stack.pop()
        path = prefix
        for token in node.tokens().tolist():
            path = (*path, token)
            paths.add(path)
        stack.extend((child, path) for child in node.children.values())
    return paths


def longest_resident_prefix(seq: tuple[int, ...], paths: set[tuple[int, ...]]) -> int:
    k = 0
    while k < len(seq) and seq[: k + 1] in paths:
        k += 1
    return k


def replay_checking_invariants(trace: Trace, policy: str, capacity: int, check_tree: bool):
    replayer = RadixReplayer(policy, capacity)
    alloc, cache = replayer.alloc, replayer.cache
    before = resident_paths(replayer)
    out = []
    for i in range(trace.num_requests):
        seq_arr = trace.request_ids(i)
        seq = tuple(seq_arr.tolist())
        expected = longest_resident_prefix(seq, before)
        k = replayer.step(seq_arr)
        assert k == expected, f"request {i}: hit {k}, longest resident prefix {expected}"
        after = resident_paths(replayer)
        own = {seq[:j] for j in range(1, len(seq) + 1)}
        assert after <= before | own, "a path appeared that no request asked for"
        if len(seq) <= capacity:
            assert own <= after, "the request fits but was not cached whole"
        else:
            # everything else was evicted, and the longest prefix that fits is cached
            assert after == {seq[:j] for j in range(1, capacity + 1)}
        new_paths = len(own - before)
        if len(before) + new_paths <= capacity:
            assert before <= after, "evicted although the pool had room"
        assert len(after) == cache.cached_blocks <= capacity
        assert alloc.num_free + cache.cached_blocks == capacity, "a block leaked"
        if check_tree:
            cache.check()
        before = after
        out.append(k)
    return out


@given(
    seqs=random_requests(),
    policy=st.sampled_from(RADIX_POLICIES),
    capacity=st.integers(1, 14),
)
def test_radix_invariants_random(seqs, policy, capacity):
    trace = Trace.from_requests(reqs(seqs))
    ks = replay_checking_invariants(trace, policy, capacity, check_tree=True)
    result = replay(trace, policy, capacity, block_size=1)
    assert result.hit_blocks.tolist() == ks
    assert result.unreachable_blocks == 0
    check_sanity(reqs(seqs), result)


@pytest.mark.parametrize("policy", RADIX_POLICIES)
def test_radix_invariants_real_trace_slice(policy):
    trace = load_trace(TRACES / "synthetic_trace.jsonl")[:150]
    ks = replay_checking_invariants(trace, policy, 600, check_tree=False)
    result = replay(trace, policy, 600)
    assert result.hit_blocks.tolist() == ks
    assert result.unreachable_blocks == 0


def test_level_evicts_deepest_leaf_lru_evicts_oldest():
    # cap 3: [2 3] and [1] fill the pool; [2 3] is touched again; [4] needs one block.
    # level: the deepest leaf [2 3] goes (whole), so [1] still hits;
    # lru: the least recently used leaf [1] goes, so [1] misses.
    seqs = [[2, 3], [1], [2, 3], [4], [1]]
    assert hits(seqs, "radix-level", 3) == [0, 0, 2, 0, 1]
    assert hits(seqs, "radix-lru", 3) == [0, 0, 2, 0, 0]


@pytest.mark.parametrize("policy", RADIX_POLICIES)
def test_radix_never_evicts_the_requests_own_path(policy):
    # cap 3: [1 2]; [1 2 3 4] matches [1 2] (held), so only one block is free: it caches
    # [1 2 3]. Flat LRU instead evicts 1 while admitting 4, and [1 2 3] then misses.
    seqs = [[1, 2], [1, 2, 3, 4], [1, 2, 3]]
    assert hits(seqs, policy, 3) == [0, 2, 3]
    assert hits(seqs, "lru", 3) == [0, 2, 0]
    # after the second request LRU holds {2 3 4}: 1 is gone, so none of them can be hit
    assert replay(reqs(seqs[:2]), "lru", 3, block_size=1).unreachable_blocks == 3
    assert replay(reqs(seqs[:2]), policy, 3, block_size=1).unreachable_blocks == 0


@pytest.mark.parametrize("policy", RADIX_POLICIES)
def test_radix_request_longer_than_capacity_keeps_its_head(policy):
    r = replay(reqs([[1, 2, 3], [1, 2, 3], [9]]), policy, 2, block_size=1)
    assert r.hit_tokens.tolist() == [0, 2, 0]
    assert r.final_cache_blocks == 1  # [9] evicted the [1 2] leaf whole


def chained(seqs):
    """Only traces whose ids are chained (an id fixes its whole prefix) mean the same thing to
    the flat caches and the tree; random_requests' chained branch and real traces are."""
    parent: dict[int, tuple[int, ...]] = {}
    for s in seqs:
        for j, h in enumerate(s):
            if parent.setdefault(h, tuple(s[:j])) != tuple(s[:j]):
                return False
    return True


@given(seqs=random_requests(), policy=st.sampled_from(RADIX_POLICIES))
def test_radix_equals_lru_when_nothing_is_evicted_random(seqs, policy):
    assume(chained(seqs))
    capacity = max(1, sum(len(s) for s in seqs))
    radix = replay(reqs(seqs), policy, capacity, block_size=1)
    lru = replay(reqs(seqs), "lru", capacity, block_size=1)
    assert radix.hit_blocks.tolist() == lru.hit_blocks.tolist()
    assert radix.final_cache_blocks == lru.final_cache_blocks


@pytest.mark.parametrize("policy", RADIX_POLICIES)
def test_radix_equals_lru_when_nothing_is_evicted_real(policy):
    trace = load_trace(TRACES / "conversation_trace.jsonl")[:3000]
    radix = replay(trace, policy, trace.num_ids)
    lru = replay(trace, "lru", trace.num_ids)
    assert np.array_equal(radix.hit_tokens, lru.hit_tokens)
    assert radix.to_dict() == {**lru.to_dict(), "policy": policy}


def test_radix_never_wastes_capacity_where_flat_caches_do():
    trace = load_trace(TRACES / "conversation_trace.jsonl")[:3000]
    flat = {p: replay(trace, p, 1024).unreachable_blocks for p in ("lru", "lfu", "s3fifo")}
    radix = {p: replay(trace, p, 1024).unreachable_blocks for p in RADIX_POLICIES}
    assert radix == dict.fromkeys(RADIX_POLICIES, 0)
    assert max(flat.values()) > 0


# ------------------------------------------------- differential: tree == brute force
@given(
    seqs=random_requests(),
    policy=st.sampled_from(RADIX_POLICIES),
    capacity=st.integers(1, 14),
)
def test_radix_equals_bruteforce_random(seqs, policy, capacity):
    eviction = policy.removeprefix("radix-")
    expected_hits, expected_final = radix_reference(seqs, capacity, eviction)
    result = replay(reqs(seqs), policy, capacity, block_size=1)
    assert result.hit_blocks.tolist() == expected_hits
    assert result.final_cache_blocks == expected_final


@pytest.mark.parametrize("policy", RADIX_POLICIES)
@pytest.mark.parametrize(
    ("name", "num_requests", "capacity"),
    [
        ("conversation", 2000, 1024),
        ("synthetic", None, 4096),
    ],
)
def test_radix_equals_bruteforce_real(policy, name, num_requests, capacity):
    trace = load_trace(TRACES / f"{name}_trace.jsonl")[:num_requests]
    expected_hits, expected_final = radix_reference(
        [r.hash_ids for r in trace], capacity, policy.removeprefix("radix-")
    )
    result = replay(trace, policy, capacity)
    assert result.hit_blocks.tolist() == expected_hits
    assert result.final_cache_blocks == expected_final
