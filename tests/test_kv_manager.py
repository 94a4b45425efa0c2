"""KVCacheManager (radixkv.cache.manager): requests' blocks over every cache (radix, hash, null).

Example tests for each call, then a hypothesis state machine that runs requests
through match / allocate / compute / cache / free / evict / reset with a shadow
pool (the token each slot holds), and after every step checks reference
conservation (``kv.check``) and that every request's blocks hold its own tokens.
"""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule

from radixkv import BlockAllocator, RadixCache
from radixkv.cache.host import HostTier, NullCopier
from radixkv.cache.manager import CACHE_KINDS, Admission, KVCacheManager, make_cache

KINDS = [k for k in CACHE_KINDS]


def manager(kind: str | None, num_blocks: int = 16, block_size: int = 2) -> KVCacheManager:
    return KVCacheManager(make_cache(kind, BlockAllocator(num_blocks, block_size)))


@pytest.mark.parametrize("kind", KINDS)
def test_match_prefix_leaves_the_last_token_to_run(kind) -> None:
    kv = manager(kind)
    assert kv.match_prefix("a", [1, 2, 3, 4]) == 0
    assert kv.allocate_slots("a", 4)
    kv.free("a", [1, 2, 3, 4])
    # the whole prompt is cached, but its last token must run: one block short
    want = 0 if kind is None else 2
    assert kv.match_prefix("b", [1, 2, 3, 4]) == want
    assert len(kv.block_table("b")) == want // 2
    assert kv.num_cached_tokens([1, 2, 3, 4]) == want
    kv.free("b")
    kv.check()


@pytest.mark.parametrize("kind", KINDS)
def test_allocate_slots_says_no_and_changes_nothing_when_the_pool_is_short(kind) -> None:
    kv = manager(kind, num_blocks=4)
    kv.match_prefix("a", list(range(6)))
    assert kv.allocate_slots("a", 6)  # 3 blocks
    kv.match_prefix("b", [9, 9, 9])
    free_before = kv.allocator.num_free
    assert not kv.allocate_slots("b", 3)  # needs 2, 1 free, nothing evictable
    assert kv.block_table("b") == [] and kv.allocator.num_free == free_before
    assert kv.allocate_slots("b", 2)
    kv.check()


def test_allocate_slots_evicts_cached_blocks_under_pressure() -> None:
    kv = manager("radix", num_blocks=4)
    kv.match_prefix("a", list(range(7)))
    kv.allocate_slots("a", 7)
    kv.free("a", list(range(6)))  # 3 full blocks stay cached
    assert kv.allocator.num_free == 1 and kv.cache.cached_blocks == 3
    kv.match_prefix("b", [50, 51, 52, 53, 54])
    assert kv.allocate_slots("b", 5)
    assert kv.num_evicted_blocks >= 2
    kv.check()


@pytest.mark.parametrize("kind", KINDS)
def test_may_allocate_counts_free_and_unheld_cached_blocks_and_changes_nothing(kind) -> None:
    kv = manager(kind, num_blocks=8)
    kv.match_prefix("a", list(range(9)))
    assert kv.allocate_slots("a", 9)  # 5 blocks
    kv.free("a", list(range(8)))  # 4 full blocks stay cached (none without a cache)
    kv.match_prefix("b", [0, 1, 2, 3, 50])  # b holds 2 of them (none without a cache)
    assert kv.allocate_slots("b", 5)
    before = (kv.allocator.num_free, kv.cache.cached_blocks, kv.cache.stats)
    free, unheld = kv.allocator.num_free, 2 if kind is not None else 0
    assert kv.may_allocate(0) and kv.may_allocate(free)
    assert kv.may_allocate(free + unheld) and not kv.may_allocate(free + unheld + 1)
    assert (kv.allocator.num_free, kv.cache.cached_blocks, kv.cache.stats) == before
    with pytest.raises(ValueError, match="num_blocks"):
        kv.may_allocate(-1)
    with pytest.raises(TypeError, match="num_blocks"):
        kv.may_allocate(1.5)
    kv.check()


@pytest.mark.parametrize("kind", ["radix", "hash"])
def test_allocate_slots_evicts_nothing_when_eviction_could_not_free_enough(kind) -> None:
    # Regression: allocate_slots evicted every cached block it could, then said no anyway;
    # a request waiting for blocks emptied the cache of prefixes others could still hit.
    kv = manager(kind, num_blocks=8)
    kv.match_prefix("a", list(range(7)))
    assert kv.allocate_slots("a", 7)
    kv.free("a", list(range(6)))  # 3 full blocks stay cached, 5 free
    kv.match_prefix("b", [50] * 11)
    assert not kv.allocate_slots("b", 18)  # needs 9 blocks: 5 free + 3 evictable is short
    assert kv.block_table("b") == [] and kv.num_evicted_blocks == 0
    assert kv.cache.cached_blocks == 3 and kv.num_cached_tokens(list(range(7))) == 6
    assert kv.allocate_slots("b", 16)  # 8 blocks: evicting all 3 is enough
    assert kv.num_evicted_blocks == 3
    kv.check()


@pytest.mark.parametrize("kind", ["radix", "hash"])
def test_duplicates_switch_to_the_cached_blocks_and_are_freed(kind) -> None:
    kv = manager(kind, num_blocks=16)
    prompt = [1, 2, 3, 4, 5, 6, 7]
    for rid in ("a", "b"):  # both admitted before either computed anything
        assert kv.match_prefix(rid, prompt) == 0
        assert kv.allocate_slots(rid, len(prompt))
    a, b = list(kv.block_table("a")), list(kv.block_table("b"))
    assert set(a).isdisjoint(b)
    kv.cache_blocks("a", prompt)  # a's 3 full blocks enter the cache
    free_before = kv.allocator.num_free
    kv.cache_blocks("b", prompt)  # b computed the same tokens: it moves onto a's blocks
    assert kv.block_table("b")[:3] == a[:3]
    assert kv.block_table("b")[3] == b[3]  # the partial block stays its own
    assert kv.allocator.num_free == free_before + 3
    assert kv.num_switched_blocks == 3
    assert all(kv.allocator.refcount(x) == 0 for x in b[:3])
    kv.check()
    kv.free("a", prompt)
    kv.free("b", prompt + [8])
    kv.check()
    kv.cache.reset()
    assert kv.allocator.num_free == kv.allocator.num_blocks


@pytest.mark.parametrize("kind", ["radix", "hash"])
def test_trim_gives_back_the_matched_blocks_a_request_will_not_read(kind) -> None:
    kv = manager(kind, num_blocks=8)
    assert kv.match_prefix("a", [1, 2, 3, 4, 5, 6, 7]) == 0
    assert kv.allocate_slots("a", 7)
    kv.free("a", [1, 2, 3, 4, 5, 6])  # 3 blocks cached
    assert kv.match_prefix("b", [1, 2, 3, 4, 5, 6, 9]) == 6
    held = kv.block_table("b")[:]
    kv.trim("b", 1)
    assert kv.block_table("b") == held[:1]
    assert [kv.allocator.refcount(b) for b in held] == [2, 1, 1]  # the cache's own stay
    assert kv.allocate_slots("b", 7)  # computes positions 2.. in new blocks
    kv.check()
    kv.free("b", [1, 2, 3, 4, 5, 6])  # duplicates of cached blocks: freed
    kv.check()
    assert kv.allocator.num_free == 8 - 3


@pytest.mark.parametrize("kind", ["radix", "hash"])
def test_a_trimmed_request_switches_its_recomputed_blocks_to_the_cache_s(kind) -> None:
    kv = manager(kind, num_blocks=8)
    kv.match_prefix("a", [1, 2, 3, 4, 5, 6, 7])
    kv.allocate_slots("a", 7)
    kv.free("a", [1, 2, 3, 4, 5, 6])  # 3 blocks cached
    kv.match_prefix("b", [1, 2, 3, 4, 5, 6, 9])
    cached = kv.block_table("b")[:]
    kv.trim("b", 3)  # all of it: nothing changes
    assert kv.block_table("b") == cached
    kv.trim("b", 2)
    kv.trim("b", 1)  # the trimmed prefix is the matched one now: trimmed again
    kv.allocate_slots("b", 7)
    free_before = kv.allocator.num_free
    # b recomputed positions 2..5 into blocks of its own: caching them, it moves onto the
    # cache's copies and its two duplicates are freed
    kv.cache_blocks("b", [1, 2, 3, 4, 5, 6])
    assert kv.block_table("b")[:3] == cached
    assert kv.num_switched_blocks == 2 and kv.allocator.num_free == free_before + 2
    kv.check()


def test_trim_refuses_misuse_before_any_change() -> None:
    kv = manager("radix", num_blocks=8)
    kv.match_prefix("a", [1, 2, 3, 4, 5])
    kv.allocate_slots("a", 5)
    kv.free("a", [1, 2, 3, 4])
    kv.match_prefix("b", [1, 2, 3, 4, 5])
    with pytest.raises(ValueError, match=r"num_blocks must be .*, got 3"):
        kv.trim("b", 3)
    with pytest.raises(KeyError, match="unknown request 'c'"):
        kv.trim("c", 0)
    assert len(kv.block_table("b")) == 2
    kv.allocate_slots("b", 5)
    with pytest.raises(ValueError, match="only a matched prefix can be trimmed"):
        kv.trim("b", 1)
    assert len(kv.block_table("b")) == 3
    kv.check()


def test_cache_blocks_does_not_count_a_query() -> None:
    kv = manager("radix")
    prompt = list(range(9))
    for rid in ("a", "b"):
        kv.match_prefix(rid, prompt)
        kv.allocate_slots(rid, 9)
    kv.cache_blocks("a", prompt)
    kv.cache_blocks("b", prompt)  # switches: re-matches the cached prefix
    assert kv.cache.stats.num_matches == 2  # the two admissions only


def test_reset_cache_forgets_what_requests_had_cached() -> None:
    kv = manager("radix")
    prompt = list(range(8))
    kv.match_prefix("a", prompt)
    kv.allocate_slots("a", 8)
    kv.cache_blocks("a", prompt)
    kv.reset_cache()
    assert kv.cache.cached_blocks == 0
    kv.cache_blocks("a", prompt)  # offered again after the reset: adopted again
    assert kv.cache.cached_blocks == 4
    kv.check()


@pytest.mark.parametrize("kind", KINDS)
def test_misuse_is_refused_before_any_change(kind) -> None:
    kv = manager(kind)
    with pytest.raises(KeyError, match="unknown request 'x'"):
        kv.allocate_slots("x", 4)
    with pytest.raises(KeyError):
        kv.free("x")
    kv.match_prefix("a", [1, 2, 3])
    with pytest.raises(ValueError, match="already holds blocks"):
        kv.match_prefix("a", [1, 2, 3])
    with pytest.raises(ValueError, match="at least one token"):
        kv.match_prefix("b", [])
    with pytest.raises(TypeError, match="namespace"):
        kv.match_prefix("b", [1, 2], namespace=[])
    assert "b" not in kv
    kv.allocate_slots("a", 3)
    with pytest.raises(ValueError, match="need 3 blocks"):
        kv.cache_blocks("a", [1, 2, 3, 4, 5, 6])
    kv.check()


@pytest.mark.parametrize("kind", ["radix", "hash"])
def test_namespaces_share_nothing(kind) -> None:
    kv = manager(kind)
    prompt = [1, 2, 3, 4, 5]
    kv.match_prefix("a", prompt, namespace="t1")
    kv.allocate_slots("a", 5)
    kv.free("a", prompt)
    assert kv.match_prefix("b", prompt, namespace="t2") == 0
    assert kv.match_prefix("c", prompt, namespace="t1") == 4
    kv.check()


def test_check_catches_a_reference_nobody_owns() -> None:
    kv = manager("radix")
    kv.match_prefix("a", [1, 2, 3])
    kv.allocate_slots("a", 3)
    kv.allocator.incref(kv.block_table("a")[:1])  # a stray reference
    with pytest.raises(AssertionError, match="refcount of block"):
        kv.check()


def test_the_engine_package_still_names_the_cache_tiers_manager() -> None:
    import radixkv.engine

    for name in ("CACHE_KINDS", "KVCacheManager", "make_cache"):
        assert getattr(radixkv.engine, name) is globals()[name], name


# ------------------------------------------------------------------ admit / release
@pytest.mark.parametrize("kind", KINDS)
def test_admit_caches_the_full_blocks_and_a_second_admit_hits_them(kind) -> None:
    kv = manager(kind, num_blocks=8)
    first = kv.admit([1, 2, 3, 4, 5])  # 2 full blocks; the partial third is never cached
    assert isinstance(first, Admission)
    assert (first.num_hit_blocks, first.num_loaded_blocks, first.num_cached_tokens) == (0, 0, 0)
    assert len(first.blocks) == 2 and kv.allocator.num_free == 6
    kv.check()  # the admission's references are counted
    kv.release(first.blocks)
    kv.check()
    second = kv.admit([1, 2, 3, 4, 9, 9])
    caches = kind is not None
    assert second.num_hit_blocks == (2 if caches else 0)
    assert second.num_cached_tokens == (4 if caches else 0)
    if caches:
        assert second.blocks[:2].tolist() == first.blocks.tolist()
    assert len(second.blocks) == 3
    kv.release(second.blocks)
    kv.check()
    assert kv.allocator.num_free == (5 if caches else 8)


def test_admit_evicts_the_shortfall_and_an_exclusive_admit_takes_what_fits() -> None:
    kv = manager("radix", num_blocks=4)
    kv.release(kv.admit([1, 2, 3, 4, 5, 6]).blocks)  # 3 blocks stay cached, 1 free
    held = kv.admit([1, 2, 9, 9])  # hits block 0, needs 1: free
    assert held.num_hit_blocks == 1 and kv.allocator.num_free == 0
    # 4 new blocks needed, 2 can be evicted ([3, 4] and [5, 6]; [1, 2] is held): all of it goes
    # in, but only 2 blocks fit.
    big = kv.admit(list(range(20, 28)))
    assert big.num_hit_blocks == 0 and len(big.blocks) == 2 and kv.num_evicted_blocks == 2
    assert kv.cache.peek(list(range(20, 28))) == 4
    kv.check()
    kv.release(big.blocks)
    kv.release(held.blocks)
    kv.check()


def test_a_non_exclusive_admit_that_cannot_fit_gives_its_match_back() -> None:
    kv = manager("radix", num_blocks=4)
    kv.release(kv.admit([1, 2, 3, 4]).blocks)  # 2 cached blocks, 2 free
    other = kv.admit([7, 7, 8, 8])  # takes the 2 free ones: nothing free, 2 cached
    probe = kv.admit([1, 2])
    kv.release(probe.blocks)
    b12 = int(probe.blocks[0])
    # Needs 3 more blocks: only [3, 4] can be evicted ([1, 2] is matched, [7, 7, 8, 8] held).
    assert kv.admit([1, 2, 5, 5, 6, 6, 9, 9], exclusive=False) is None
    assert kv.num_evicted_blocks == 1 and kv.allocator.num_free == 1  # it evicted what it could
    assert kv.allocator.refcount(b12) == 1  # the match was given back: the cache's alone
    kv.check()
    kv.release(other.blocks)
    got = kv.admit([1, 2, 5, 5, 6, 6, 9, 9], exclusive=False)  # now [7,7,8,8] can go: fits
    assert got is not None and got.num_hit_blocks == 1 and len(got.blocks) == 4
    kv.release(got.blocks)
    kv.check()


def test_admit_loads_from_a_host_tier_and_counts_what_it_loaded() -> None:
    copier = NullCopier()
    host = HostTier(BlockAllocator(8, 1), copier, write_policy="write_back", eviction="lru")
    kv = KVCacheManager(RadixCache(BlockAllocator(4, 1), eviction="lru", host=host))
    kv.release(kv.admit([1, 2, 3]).blocks)
    kv.release(kv.admit([7, 8, 9, 6]).blocks)  # evicts [1, 2, 3]: backed up to the host
    got = kv.admit([1, 2, 3, 5])
    assert (got.num_hit_blocks, got.num_loaded_blocks, got.num_cached_tokens) == (0, 3, 3)
    assert copier.loaded == 3 == kv.cache.stats.loaded_blocks
    kv.check()
    kv.release(got.blocks)
    kv.check()


@pytest.mark.parametrize("kind", KINDS)
def test_admit_refuses_bad_input_before_any_change(kind) -> None:
    kv = manager(kind)
    with pytest.raises(TypeError, match="namespace"):
        kv.admit([1, 2, 3, 4], namespace=[])
    with pytest.raises((TypeError, ValueError)):
        kv.admit([[1, 2], [3, 4]])
    assert kv.allocator.num_free == kv.allocator.num_blocks
    kv.check()


def test_check_catches_a_released_admission_that_was_not_given_back() -> None:
    kv = manager("radix")
    got = kv.admit([1, 2, 3, 4])
    kv.allocator.decref_distinct(got.blocks)  # given back behind the manager's back
    with pytest.raises(AssertionError, match="admissions hold 2"):
        kv.check()


class ManagerMachine(RuleBasedStateMachine):
    """Requests over a small pool; a shadow pool records which token each slot holds."""

    @initialize(
        kind=st.sampled_from(KINDS),
        block_size=st.sampled_from([1, 2, 4]),
        num_blocks=st.integers(6, 24),
    )
    def setup(self, kind, block_size, num_blocks) -> None:
        self.kv = manager(kind, num_blocks, block_size)
        self.bs = block_size
        self.slot_token = np.full(num_blocks * block_size, -1, dtype=np.int64)
        self.prompts: dict[int, list[int]] = {}
        self.computed: dict[int, int] = {}
        self.admitted: list[tuple[list[int], Admission]] = []
        self.next_id = 0

    @property
    def running(self) -> list[int]:
        return sorted(self.prompts)

    def write(self, rid: int, start: int, stop: int) -> None:
        """'Compute' positions [start, stop): write the request's tokens into its slots."""
        table = self.kv.block_table(rid)
        for pos in range(start, stop):
            slot = table[pos // self.bs] * self.bs + pos % self.bs
            self.slot_token[slot] = self.prompts[rid][pos]

    @rule(
        stem=st.sampled_from([[], [1, 2, 3, 4], [1, 2, 3, 4, 5, 6, 7, 8]]),
        tail=st.lists(st.integers(1, 3), min_size=1, max_size=6),
        ns=st.sampled_from([None, None, "t"]),
    )
    def admit(self, stem, tail, ns) -> None:
        prompt = stem + tail
        rid = self.next_id
        self.next_id += 1
        cached = self.kv.match_prefix(rid, prompt, namespace=ns)
        assert cached % self.bs == 0 and cached < len(prompt)
        if not self.kv.allocate_slots(rid, len(prompt)):
            self.kv.free(rid)
            return
        self.prompts[rid] = prompt
        self.computed[rid] = cached
        self.check_contents(rid, cached)  # the matched blocks hold this prompt's tokens

    @precondition(lambda self: self.prompts)
    @rule(data=st.data())
    def compute(self, data) -> None:
        rid = data.draw(st.sampled_from(self.running))
        done, total = self.computed[rid], len(self.prompts[rid])
        if done == total:
            return
        stop = data.draw(st.integers(done + 1, total))
        self.write(rid, done, stop)
        self.computed[rid] = stop
        self.kv.cache_blocks(rid, self.prompts[rid][:stop])
        self.check_contents(rid, stop)

    @precondition(lambda self: self.prompts)
    @rule(data=st.data(), offer=st.booleans())
    def finish(self, data, offer) -> None:
        rid = data.draw(st.sampled_from(self.running))
        tokens = self.prompts[rid][: self.computed[rid]] if offer else None
        self.kv.free(rid, tokens)
        del self.prompts[rid], self.computed[rid]

    @rule(
        stem=st.sampled_from([[], [1, 2, 3, 4], [1, 2, 3, 4, 5, 6, 7, 8]]),
        tail=st.lists(st.integers(1, 3), max_size=6),
        ns=st.sampled_from([None, None, "t"]),
        exclusive=st.booleans(),
    )
    def admit_whole(self, stem, tail, ns, exclusive) -> None:
        prompt = stem + tail
        got = self.kv.admit(prompt, ns, exclusive=exclusive)
        if got is None:
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
        self.admitted.append((prompt, got))

    @precondition(lambda self: self.admitted)
    @rule(data=st.data())
    def release_admitted(self, data) -> None:
        i = data.draw(st.integers(0, len(self.admitted) - 1))
        _, got = self.admitted.pop(i)
        self.kv.release(got.blocks)

    @rule(n=st.integers(0, 8))
    def evict(self, n) -> None:
        self.kv.cache.evict(n)

    @rule()
    def reset(self) -> None:
        self.kv.reset_cache()

    def check_contents(self, rid: int, upto: int) -> None:
        table = self.kv.block_table(rid)
        for pos in range(upto):
            slot = table[pos // self.bs] * self.bs + pos % self.bs
            assert self.slot_token[slot] == self.prompts[rid][pos], (rid, pos)

    @invariant()
    def conserved(self) -> None:
        self.kv.check()
        for rid in self.running:
            self.check_contents(rid, self.computed[rid])
        for prompt, got in self.admitted:
            for pos in range(len(got.blocks) * self.bs):
                slot = int(got.blocks[pos // self.bs]) * self.bs + pos % self.bs
                assert self.slot_token[slot] == prompt[pos], ("admitted", pos)

    def teardown(self) -> None:
        for rid in self.running:
            self.kv.free(rid)
        for _, got in self.admitted:
            self.kv.release(got.blocks)
        self.kv.reset_cache()
        assert self.kv.allocator.num_free == self.kv.allocator.num_blocks


TestManagerMachine = ManagerMachine.TestCase
