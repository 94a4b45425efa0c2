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

from radixkv import BlockAllocator
from radixkv.cache.manager import CACHE_KINDS, KVCacheManager, make_cache

KINDS = [k for k in CACHE_KINDS]


def manager(kind: str | None, num_blocks: int = 16, block_size: int = 2) -> KVCacheManager:
    return KVCacheManager(make_cache(kind, BlockAllocator(num_blocks, block_size)))


@pytest.mark.parametrize("kind", KINDS)
def test_match_prefix_leaves_the_last_token_to_run(kind) -> None:
    kv = manager(kind)
    assert kv.match_prefix("a", [1, 2, 3, 4]) == 0
    assert kv.allocate_slots("a", 4)
    kv.cache_blocks("a", 4)  # the prompt ran
    kv.free("a")
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
    kv.append_output_tokens("a", [0])
    kv.free("a")  # 7 computed tokens: 3 full blocks stay cached
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
    kv.append_output_tokens("a", [0])
    kv.free("a")  # 9 computed tokens: 4 full blocks stay cached (none without a cache)
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
    kv.append_output_tokens("a", [0])
    kv.free("a")  # 3 full blocks stay cached, 5 free
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
    kv.cache_blocks("a", 7)  # a's 3 full blocks enter the cache
    free_before = kv.allocator.num_free
    kv.cache_blocks("b", 7)  # b computed the same tokens: it moves onto a's blocks
    assert kv.block_table("b")[:3] == a[:3]
    assert kv.block_table("b")[3] == b[3]  # the partial block stays its own
    assert kv.allocator.num_free == free_before + 3
    assert kv.num_switched_blocks == 3
    assert all(kv.allocator.refcount(x) == 0 for x in b[:3])
    kv.check()
    kv.free("a")
    kv.append_output_tokens("b", [8, 9])  # 8 computed: b's 4th block fills
    kv.free("b")
    kv.check()
    kv.cache.reset()
    assert kv.allocator.num_free == kv.allocator.num_blocks


@pytest.mark.parametrize("kind", ["radix", "hash"])
def test_trim_gives_back_the_matched_blocks_a_request_will_not_read(kind) -> None:
    kv = manager(kind, num_blocks=8)
    assert kv.match_prefix("a", [1, 2, 3, 4, 5, 6, 7]) == 0
    assert kv.allocate_slots("a", 7)
    kv.append_output_tokens("a", [0])
    kv.free("a")  # 3 blocks cached
    assert kv.match_prefix("b", [1, 2, 3, 4, 5, 6, 9]) == 6
    held = kv.block_table("b")[:]
    kv.trim("b", 1)
    assert kv.block_table("b") == held[:1]
    assert [kv.allocator.refcount(b) for b in held] == [2, 1, 1]  # the cache's own stay
    assert kv.allocate_slots("b", 7)  # computes positions 2.. in new blocks
    kv.check()
    kv.append_output_tokens("b", [0])
    kv.free("b")  # its first 3 blocks duplicate cached ones: freed
    kv.check()
    assert kv.allocator.num_free == 8 - 3


@pytest.mark.parametrize("kind", ["radix", "hash"])
def test_a_trimmed_request_switches_its_recomputed_blocks_to_the_cache_s(kind) -> None:
    kv = manager(kind, num_blocks=8)
    kv.match_prefix("a", [1, 2, 3, 4, 5, 6, 7])
    kv.allocate_slots("a", 7)
    kv.append_output_tokens("a", [0])
    kv.free("a")  # 3 blocks cached
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
    kv.cache_blocks("b", 6)
    assert kv.block_table("b")[:3] == cached
    assert kv.num_switched_blocks == 2 and kv.allocator.num_free == free_before + 2
    kv.check()


def test_trim_refuses_misuse_before_any_change() -> None:
    kv = manager("radix", num_blocks=8)
    kv.match_prefix("a", [1, 2, 3, 4, 5])
    kv.allocate_slots("a", 5)
    kv.append_output_tokens("a", [0])
    kv.free("a")
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
    kv.cache_blocks("a", 9)
    kv.cache_blocks("b", 9)  # switches: re-matches the cached prefix
    assert kv.cache.stats.num_matches == 2  # the two admissions only


def test_reset_cache_forgets_what_requests_had_cached() -> None:
    kv = manager("radix")
    prompt = list(range(8))
    kv.match_prefix("a", prompt)
    kv.allocate_slots("a", 8)
    kv.cache_blocks("a", 8)
    kv.reset_cache()
    assert kv.cache.cached_blocks == 0
    kv.cache_blocks("a", 8)  # offered again after the reset: adopted again
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
        kv.append_output_tokens("a", [4, 5, 6])  # 5 computed tokens: 3 blocks, 2 held
    with pytest.raises(ValueError, match=r"num_computed_tokens must be an int in \[0, 3\], got 4"):
        kv.cache_blocks("a", 4)  # more than the request's tokens
    with pytest.raises(TypeError, match="num_computed_tokens"):
        kv.cache_blocks("a", 2.0)
    with pytest.raises((TypeError, ValueError), match="tokens"):
        kv.append_output_tokens("a", [[4]])
    assert kv.tokens("a").tolist() == [1, 2, 3] and kv.num_computed_tokens("a") == 0
    kv.cache_blocks("a", 2)
    with pytest.raises(ValueError, match=r"must be an int in \[2, 3\], got 1"):
        kv.cache_blocks("a", 1)  # computed tokens do not go back
    with pytest.raises(ValueError, match="not both"):
        kv.free("a", [1, 2], cache=False)
    assert "a" in kv
    kv.check()


@pytest.mark.parametrize("kind", ["radix", "hash"])
def test_namespaces_share_nothing(kind) -> None:
    kv = manager(kind)
    prompt = [1, 2, 3, 4, 5]
    kv.match_prefix("a", prompt, namespace="t1")
    kv.allocate_slots("a", 5)
    kv.append_output_tokens("a", [0])
    kv.free("a")
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


def test_the_manager_is_imported_from_radixkv_and_the_engine_path_warns() -> None:
    import radixkv
    import radixkv.engine

    assert radixkv.KVCacheManager is KVCacheManager and radixkv.make_cache is make_cache
    for name in ("CACHE_KINDS", "KVCacheManager", "make_cache"):
        with pytest.warns(DeprecationWarning, match=f"radixkv.engine.{name} is deprecated"):
            assert getattr(radixkv.engine, name) is globals()[name], name
        assert name not in radixkv.engine.__all__


# ------------------------------------------------------------------ the kept tokens
PROMPT_TYPES = {
    "list": list,
    "int64": lambda t: np.array(t, dtype=np.int64),
    "int32": lambda t: np.array(t, dtype=np.int32),  # as_token_array's no-copy case
}


@pytest.mark.parametrize("prompt_type", [*PROMPT_TYPES, "torch"])
def test_the_manager_keeps_a_copy_of_the_prompt_and_caches_prompt_plus_output(
    prompt_type,
) -> None:
    """Whatever the prompt's type, the manager caches the tokens it saw: no caller join."""
    if prompt_type == "torch":
        torch = pytest.importorskip("torch")
        convert = torch.tensor
    else:
        convert = PROMPT_TYPES[prompt_type]
    kv = manager("radix")
    tokens = list(range(10, 17))  # 7 tokens
    prompt = convert(tokens)
    assert kv.match_prefix("a", prompt) == 0
    prompt[0] = 99  # the caller reuses its buffer: the manager's copy stands
    assert kv.allocate_slots("a", 10)
    kv.append_output_tokens("a", [20, 21])
    kv.append_output_tokens("a", np.array([22], dtype=np.int64))  # one decode step
    assert kv.tokens("a").tolist() == tokens + [20, 21, 22]
    assert kv.tokens("a").dtype == np.int32 and not kv.tokens("a").flags.writeable
    assert kv.num_computed_tokens("a") == 9  # all but the last sampled token
    kv.free("a")
    assert kv.cache.peek(tokens + [20, 21, 22]) == 8  # 9 computed: 4 full blocks
    assert kv.cache.peek([99, *tokens[1:]]) == 0
    kv.check()


def test_a_long_reply_appended_token_by_token_is_kept_whole() -> None:
    kv = manager("radix", num_blocks=64, block_size=4)
    kv.match_prefix("a", [1, 2, 3])
    assert kv.allocate_slots("a", 3 + 200)
    for t in range(200):
        kv.append_output_tokens("a", [1000 + t])
    assert kv.tokens("a").tolist() == [1, 2, 3, *range(1000, 1200)]
    assert kv.num_computed_tokens("a") == 202
    kv.check()
    kv.free("a")
    assert kv.cache.cached_blocks == 202 // 4


@pytest.mark.parametrize("kind", KINDS)
def test_free_with_cache_false_offers_nothing(kind) -> None:
    kv = manager(kind)
    kv.match_prefix("a", [1, 2, 3, 4, 5])
    kv.allocate_slots("a", 6)
    kv.append_output_tokens("a", [6])
    kv.free("a", cache=False)  # a failed step: its K/V is not trusted
    assert kv.cache.cached_blocks == 0 and kv.allocator.num_free == kv.allocator.num_blocks
    kv.check()


def test_the_old_token_forms_warn_and_still_cache_what_they_are_given() -> None:
    kv = manager("radix")
    kv.match_prefix("a", [1, 2, 3, 4, 5, 6, 7])
    kv.allocate_slots("a", 7)
    with pytest.warns(DeprecationWarning, match=r"cache_blocks\(request_id, tokens\)"):
        kv.cache_blocks("a", [1, 2, 3, 4])
    assert kv.cache.cached_blocks == 2
    with pytest.warns(DeprecationWarning, match=r"free\(request_id, tokens\)"):
        kv.free("a", [1, 2, 3, 4, 5, 6])
    assert kv.cache.cached_blocks == 3
    kv.check()


def test_check_is_the_plain_identity_a_reference_held_outside_fails_it() -> None:
    from radixkv.cache.placement import place_prompt

    kv = manager("radix")
    placed = place_prompt(kv.cache, [1, 2, 3, 4])  # a whole-prompt caller on the same cache
    with pytest.raises(AssertionError, match="refcount of block"):
        kv.check()
    kv.allocator.decref_distinct(placed.blocks)
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
        self.tokens: dict[int, list[int]] = {}
        self.computed: dict[int, int] = {}
        self.next_id = 0

    @property
    def running(self) -> list[int]:
        return sorted(self.tokens)

    def write(self, rid: int, start: int, stop: int) -> None:
        """'Compute' positions [start, stop): write the request's tokens into its slots."""
        table = self.kv.block_table(rid)
        for pos in range(start, stop):
            slot = table[pos // self.bs] * self.bs + pos % self.bs
            self.slot_token[slot] = self.tokens[rid][pos]

    @rule(
        stem=st.sampled_from([[], [1, 2, 3, 4], [1, 2, 3, 4, 5, 6, 7, 8]]),
        tail=st.lists(st.integers(1, 3), min_size=1, max_size=6),
        ns=st.sampled_from([None, None, "t"]),
    )
    def admit(self, stem, tail, ns) -> None:
        prompt = stem + tail
        rid = self.next_id
        self.next_id += 1
        cached = self.kv.match_prefix(rid, np.array(prompt), namespace=ns)
        assert cached % self.bs == 0 and cached < len(prompt)
        if not self.kv.allocate_slots(rid, len(prompt)):
            self.kv.free(rid)
            return
        self.tokens[rid] = prompt
        self.computed[rid] = cached
        self.check_contents(rid, cached)  # the matched blocks hold this prompt's tokens

    @precondition(lambda self: self.tokens)
    @rule(data=st.data())
    def compute(self, data) -> None:
        """A prefill chunk (of the prompt, or of a sampled token): cache_blocks says so."""
        rid = data.draw(st.sampled_from(self.running))
        done, total = self.computed[rid], len(self.tokens[rid])
        if done == total:
            return
        stop = data.draw(st.integers(done + 1, total))
        if not self.kv.allocate_slots(rid, stop):
            return
        self.write(rid, done, stop)
        self.computed[rid] = stop
        self.kv.cache_blocks(rid, stop)
        self.check_contents(rid, stop)

    @precondition(lambda self: self.tokens)
    @rule(data=st.data(), sampled=st.lists(st.integers(1, 3), min_size=1, max_size=3))
    def sample(self, data, sampled) -> None:
        """Tokens sampled once the whole request ran: each but the last then runs too."""
        rid = data.draw(st.sampled_from(self.running))
        n = len(self.tokens[rid])
        if self.computed[rid] != n:
            return
        stop = n + len(sampled) - 1  # the last sampled token has no K/V yet
        if not self.kv.allocate_slots(rid, stop):
            return
        self.tokens[rid].extend(sampled)
        self.write(rid, n, stop)
        self.kv.append_output_tokens(rid, sampled)
        self.computed[rid] = stop

    @precondition(lambda self: self.tokens)
    @rule(data=st.data(), offer=st.booleans())
    def finish(self, data, offer) -> None:
        rid = data.draw(st.sampled_from(self.running))
        self.kv.free(rid, cache=offer)
        del self.tokens[rid], self.computed[rid]

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
            assert self.slot_token[slot] == self.tokens[rid][pos], (rid, pos)

    @invariant()
    def conserved(self) -> None:
        self.kv.check()
        for rid in self.running:
            self.check_contents(rid, self.computed[rid])
            assert self.kv.tokens(rid).tolist() == self.tokens[rid], rid
            assert self.kv.num_computed_tokens(rid) == self.computed[rid], rid

    def teardown(self) -> None:
        for rid in self.running:
            self.kv.free(rid)
        self.kv.reset_cache()
        assert self.kv.allocator.num_free == self.kv.allocator.num_blocks


TestManagerMachine = ManagerMachine.TestCase
