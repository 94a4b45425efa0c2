"""place_prompt (radixkv.cache.placement): the whole-prompt cycle over every cache.

Example tests for each outcome (hit, evict the shortfall, take what fits, give the
match back, load from a host tier, bad input), then a hypothesis state machine that
places and releases prompts over a small pool with a shadow pool (the token each slot
holds), and after every step checks that every block's refcount is the cache's
reference plus the placements holding it, and that every held block holds its prompt.
"""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule

from radixkv import BlockAllocator, PrefixCache, make_cache
from radixkv.cache import CACHE_KINDS, Placement, TieredRadixCache, place_prompt
from radixkv.cache.host import HostTier, NullCopier
from radixkv.errors import InvariantError

KINDS = list(CACHE_KINDS)


def cache_of(kind: str | None, num_blocks: int = 16, block_size: int = 2) -> PrefixCache:
    return make_cache(kind, BlockAllocator(num_blocks, block_size))


def release(cache: PrefixCache, placed: Placement) -> None:
    cache.allocator.decref_distinct(placed.blocks)


def check_held(cache: PrefixCache, held: list[Placement]) -> None:
    """Every block's refcount is the cache's reference plus the placements holding it."""
    alloc = cache.allocator
    expected = np.zeros(alloc.num_blocks, dtype=np.int64)
    expected[cache.held_blocks()] += 1
    for placed in held:
        np.add.at(expected, placed.blocks.astype(np.int64), 1)
    bad = np.flatnonzero(alloc.refcount_array != expected)
    if bad.size:
        raise InvariantError(f"block {int(bad[0])}: refcount off ({bad.size} blocks)")
    cache.check()


@pytest.mark.parametrize("kind", KINDS)
def test_the_full_blocks_are_cached_and_a_second_prompt_hits_them(kind) -> None:
    cache = cache_of(kind, num_blocks=8)
    first = place_prompt(cache, [1, 2, 3, 4, 5])  # 2 full blocks; the partial third never cached
    assert isinstance(first, Placement)
    assert (first.num_hit_blocks, first.num_loaded_blocks, first.num_cached_tokens) == (0, 0, 0)
    assert len(first.blocks) == 2 and cache.allocator.num_free == 6
    check_held(cache, [first])
    release(cache, first)
    check_held(cache, [])
    second = place_prompt(cache, np.array([1, 2, 3, 4, 9, 9]))
    caches = kind is not None
    assert second.num_hit_blocks == (2 if caches else 0)
    assert second.num_cached_tokens == (4 if caches else 0)
    if caches:
        assert second.blocks[:2].tolist() == first.blocks.tolist()
    assert len(second.blocks) == 3
    release(cache, second)
    check_held(cache, [])
    assert cache.allocator.num_free == (5 if caches else 8)


def test_the_shortfall_is_evicted_and_an_exclusive_call_takes_what_fits() -> None:
    cache = cache_of("radix", num_blocks=4)
    release(cache, place_prompt(cache, [1, 2, 3, 4, 5, 6]))  # 3 blocks stay cached, 1 free
    held = place_prompt(cache, [1, 2, 9, 9])  # hits block 0, needs 1: free
    assert held.num_hit_blocks == 1 and cache.allocator.num_free == 0
    # 4 new blocks needed, 2 can be evicted ([3, 4] and [5, 6]; [1, 2] is held): all of it goes
    # in, but only 2 blocks fit.
    big = place_prompt(cache, list(range(20, 28)))
    assert big.num_hit_blocks == 0 and len(big.blocks) == 2
    assert cache.stats.evicted_blocks == 2
    assert cache.peek(list(range(20, 28))) == 4
    check_held(cache, [held, big])
    release(cache, big)
    release(cache, held)
    check_held(cache, [])


def test_a_non_exclusive_call_that_cannot_fit_gives_its_match_back() -> None:
    cache = cache_of("radix", num_blocks=4)
    release(cache, place_prompt(cache, [1, 2, 3, 4]))  # 2 cached blocks, 2 free
    other = place_prompt(cache, [7, 7, 8, 8])  # takes the 2 free ones: nothing free, 2 cached
    probe = place_prompt(cache, [1, 2])
    release(cache, probe)
    b12 = int(probe.blocks[0])
    # Needs 3 more blocks: only [3, 4] can be evicted ([1, 2] is matched, [7, 7, 8, 8] held).
    assert place_prompt(cache, [1, 2, 5, 5, 6, 6, 9, 9], exclusive=False) is None
    assert cache.stats.evicted_blocks == 1 and cache.allocator.num_free == 1  # what it could
    assert cache.allocator.refcount(b12) == 1  # the match was given back: the cache's alone
    check_held(cache, [other])
    release(cache, other)
    got = place_prompt(cache, [1, 2, 5, 5, 6, 6, 9, 9], exclusive=False)  # [7,7,8,8] can go
    assert got is not None and got.num_hit_blocks == 1 and len(got.blocks) == 4
    release(cache, got)
    check_held(cache, [])


def test_a_host_tier_loads_and_the_placement_counts_what_it_loaded() -> None:
    copier = NullCopier()
    host = HostTier(BlockAllocator(8, 1), copier, write_policy="write_back", eviction="lru")
    cache = TieredRadixCache(BlockAllocator(4, 1), eviction="lru", host=host)
    release(cache, place_prompt(cache, [1, 2, 3]))
    release(cache, place_prompt(cache, [7, 8, 9, 6]))  # evicts [1, 2, 3]: backed up to the host
    got = place_prompt(cache, [1, 2, 3, 5])
    assert (got.num_hit_blocks, got.num_loaded_blocks, got.num_cached_tokens) == (0, 3, 3)
    assert got.num_store_blocks == 0  # no store tier: all from the host
    assert copier.loaded == 3 == cache.stats.loaded_blocks
    check_held(cache, [got])
    release(cache, got)
    check_held(cache, [])


@pytest.mark.parametrize("kind", KINDS)
def test_bad_input_is_refused_before_any_change(kind) -> None:
    cache = cache_of(kind)
    with pytest.raises(TypeError, match="namespace"):
        place_prompt(cache, [1, 2, 3, 4], namespace=[])
    with pytest.raises((TypeError, ValueError)):
        place_prompt(cache, [[1, 2], [3, 4]])
    with pytest.raises(TypeError, match="cache must be a PrefixCache, got BlockAllocator"):
        place_prompt(cache.allocator, [1, 2, 3, 4])  # type: ignore[call-overload]
    assert cache.allocator.num_free == cache.allocator.num_blocks
    check_held(cache, [])


class PlacementMachine(RuleBasedStateMachine):
    """Prompts placed and released over a small pool; a shadow pool records slot tokens."""

    @initialize(
        kind=st.sampled_from(KINDS),
        block_size=st.sampled_from([1, 2, 4]),
        num_blocks=st.integers(4, 16),
    )
    def setup(self, kind, block_size, num_blocks) -> None:
        self.cache = cache_of(kind, num_blocks, block_size)
        self.bs = block_size
        self.slot_token = np.full(num_blocks * block_size, -1, dtype=np.int64)
        self.held: list[tuple[list[int], Placement]] = []

    @rule(
        stem=st.sampled_from([[], [1, 2, 3, 4], [1, 2, 3, 4, 5, 6, 7, 8]]),
        tail=st.lists(st.integers(1, 3), max_size=6),
        ns=st.sampled_from([None, None, "t"]),
        exclusive=st.booleans(),
    )
    def place(self, stem, tail, ns, exclusive) -> None:
        prompt = stem + tail
        got = place_prompt(self.cache, prompt, ns, exclusive=exclusive)
        if got is None:
            assert not exclusive
            return
        bs = self.bs
        assert got.num_loaded_blocks == 0 and got.num_cached_tokens == got.num_hit_blocks * bs
        assert len(got.blocks) <= len(prompt) // bs
        for pos in range(len(got.blocks) * bs):
            slot = int(got.blocks[pos // bs]) * bs + pos % bs
            if pos < got.num_cached_tokens:
                assert self.slot_token[slot] == prompt[pos], pos  # a hit holds this prompt
            else:
                self.slot_token[slot] = prompt[pos]  # computed at once: the cache has it now
        self.held.append((prompt, got))

    @precondition(lambda self: self.held)
    @rule(data=st.data())
    def release(self, data) -> None:
        i = data.draw(st.integers(0, len(self.held) - 1))
        _, got = self.held.pop(i)
        release(self.cache, got)

    @rule(n=st.integers(0, 8))
    def evict(self, n) -> None:
        self.cache.evict(n)

    @rule()
    def reset(self) -> None:
        self.cache.reset()

    @invariant()
    def conserved(self) -> None:
        check_held(self.cache, [got for _, got in self.held])
        for prompt, got in self.held:
            for pos in range(len(got.blocks) * self.bs):
                slot = int(got.blocks[pos // self.bs]) * self.bs + pos % self.bs
                assert self.slot_token[slot] == prompt[pos], ("held", pos)

    def teardown(self) -> None:
        for _, got in self.held:
            release(self.cache, got)
        self.cache.reset()
        assert self.cache.allocator.num_free == self.cache.allocator.num_blocks


TestPlacementMachine = PlacementMachine.TestCase
