"""Scheduler bookkeeping without a model: block tables, slot mappings, budgets, preemption, cache.

The driver keeps a *shadow pool*: for every slot, the token and position last
written there. Before each step it asserts that every scheduled request's
context slots (cached positions included) hold exactly that request's tokens,
which catches a wrong block table, a slot mapping not filled from matched
blocks, a block freed or reused while still read, and two sequences writing
one slot. The next token is a fixed function of the whole sequence, so outputs
do not depend on scheduling and every cache mode must produce the same ones.
"""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

from radixkv.cache.allocator import BlockAllocator
from radixkv.cache.host import HostTier
from radixkv.cache.manager import KVCacheManager, make_cache
from radixkv.engine.request import FinishReason, Request, RequestStatus, SamplingParams
from radixkv.engine.scheduler import LPM_MAX_QUEUE, Scheduler, SchedulerConfig, SchedulerOutput
from radixkv.workloads import ChatWorkload, IdealPrefill

VOCAB = 50


def next_token(tokens: np.ndarray) -> int:
    """A deterministic 'model': depends on the whole sequence, not on the batch."""
    t = tokens.astype(np.int64)
    return int((t[-1] * 31 + t[0] * 17 + t.size * 7 + int(t[-3:].sum())) % VOCAB)


class Driver:
    """Runs a Scheduler to completion with a shadow pool standing in for the model's K/V."""

    def __init__(self, sched: Scheduler) -> None:
        self.sched = sched
        n = sched.allocator.num_blocks * sched.allocator.block_size
        self.tok = np.full(n, -1, dtype=np.int64)
        self.pos = np.full(n, -1, dtype=np.int64)
        self.steps = 0
        self.step_tokens: list[int] = []
        self.finished: list[Request] = []

    def step(self) -> list[Request]:
        out = self.sched.schedule()
        assert out, "no progress"
        return self.apply(out)

    def apply(self, out: SchedulerOutput) -> list[Request]:
        """Check and write the shadow pool for a scheduled step, then postprocess it."""
        sched = self.sched
        sched.check()
        assert out.num_tokens <= sched.config.max_num_batched_tokens
        written = []
        for seq in out.seqs:
            req = seq.request
            assert seq.start == req.num_computed_tokens and seq.num_new_tokens >= 1
            ctx = slots(sched, req, 0, seq.start)
            assert (self.tok[ctx] == req.tokens[: seq.start]).all(), f"{req}: context corrupted"
            assert (self.pos[ctx] == np.arange(seq.start)).all(), f"{req}: context misplaced"
            written.append(slots(sched, req, seq.start, seq.stop))
        allw = np.concatenate(written)
        assert np.unique(allw).size == allw.size, "two tokens written to one slot"
        toks = []
        for seq, new in zip(out.seqs, written, strict=True):
            req = seq.request
            self.tok[new] = req.tokens[seq.start : seq.stop]
            self.pos[new] = np.arange(seq.start, seq.stop)
            toks.append(next_token(req.tokens) if seq.samples else None)
        done = sched.postprocess(out, toks)
        sched.check()
        self.steps += 1
        self.step_tokens.append(out.num_tokens)
        self.finished.extend(done)
        return done

    def run(self, reqs: list[Request]) -> list[Request]:
        for r in reqs:
            self.sched.add_request(r)
        while self.sched.has_unfinished():
            self.step()
            assert self.steps < 100_000
        return reqs


def slots(sched: Scheduler, req: Request, start: int, stop: int) -> np.ndarray:
    """Slots of positions [start, stop) through the request's block table (the test's own
    formula, independent of the model runner's)."""
    table = np.asarray(sched.kv_manager.block_table(req.request_id), dtype=np.int64)
    pos = np.arange(start, stop)
    assert len(table) * sched.block_size >= stop, f"{req}: block table too short"
    return table[pos // sched.block_size] * sched.block_size + pos % sched.block_size


def expected_output(prompt: np.ndarray, n: int) -> list[int]:
    seq = list(prompt)
    for _ in range(n):
        seq.append(next_token(np.asarray(seq)))
    return seq[len(prompt) :]


def make_sched(cache: str | None, num_blocks: int, bs: int, **cfg) -> Scheduler:
    """A scheduler over a fresh pool; without a cache nothing waits for a shared prefill."""
    cfg.setdefault("wait_for_shared_prefill", cache is not None)
    kv = KVCacheManager(make_cache(cache, BlockAllocator(num_blocks, bs)))
    return Scheduler(kv, SchedulerConfig(**cfg))


def assert_no_leaks(sched: Scheduler) -> None:
    assert not sched.has_unfinished()
    assert sched.kv_manager.num_requests == 0
    sched.cache.check()
    sched.cache.reset()
    sched.allocator.check()
    assert sched.allocator.num_free == sched.allocator.num_blocks


def chat_waves(driver: Driver, wl: ChatWorkload, max_new: int) -> list[list[Request]]:
    """Run every turn of ``wl`` as a wave; return the requests per wave."""
    histories = None
    waves = []
    for turn in range(wl.num_turns):
        prompts = wl.turn_prompts(turn, histories)
        reqs = driver.run([Request(p, SamplingParams(max_new_tokens=max_new)) for p in prompts])
        for r in reqs:
            assert r.output_ids == expected_output(r.prompt, max_new)
        histories = [r.tokens.copy() for r in reqs]
        waves.append(reqs)
    return waves


# ------------------------------------------------------------------ the acceptance case
@pytest.mark.parametrize("cache", ["radix", "hash"])
@pytest.mark.parametrize(("bs", "cached", "computed"), [(1, 97, 5), (16, 96, 6)])
def test_shared_97_token_prefix_computes_only_the_tail(cache, bs, cached, computed):
    # Seed's case: a 97-token shared prefix + 5 new tokens, 20 new tokens each.
    # bs=1: all 97 shared tokens match, the 5 new ones run.
    # bs=16: 97 = 6 * 16 + 1, so 6 blocks (96 tokens) match and 6 tokens run.
    # The last prompt token always runs, and 19 decode steps follow the first token.
    rng = np.random.default_rng(0)
    prefix = rng.integers(0, VOCAB, 97)
    a = np.concatenate([prefix, [1, 2, 3, 4, 5]])
    b = np.concatenate([prefix, [6, 7, 8, 9, 10]])
    for mode in (cache, None):
        d = Driver(make_sched(mode, 64 if bs == 16 else 1024, bs))
        [ra] = d.run([Request(a, SamplingParams(max_new_tokens=20))])
        [rb] = d.run([Request(b, SamplingParams(max_new_tokens=20))])
        assert (ra.stats().prefill_tokens, ra.stats().cached_tokens) == (102, 0)
        if mode is None:
            assert (rb.stats().prefill_tokens, rb.stats().cached_tokens) == (102, 0)
        else:
            assert (rb.stats().prefill_tokens, rb.stats().cached_tokens) == (computed, cached)
        assert rb.stats().decode_tokens == 19
        assert rb.output_ids == expected_output(b, 20)
        assert_no_leaks(d.sched)


@pytest.mark.parametrize("cache", ["radix", "hash"])
@pytest.mark.parametrize(("bs", "computed"), [(1, 1), (4, 4), (16, 16)])
def test_a_fully_cached_prompt_still_runs_its_last_token(cache, bs, computed):
    # 32 tokens, all cached after the first run: only prompt[:-1] may match, so the
    # block holding the last token (rounded down) is recomputed.
    prompt = np.arange(1, 33)
    d = Driver(make_sched(cache, 64, bs))
    [first] = d.run([Request(prompt, SamplingParams(max_new_tokens=3))])
    [again] = d.run([Request(prompt, SamplingParams(max_new_tokens=3))])
    assert again.stats().prefill_tokens == computed
    assert again.stats().cached_tokens == 32 - computed
    assert again.output_ids == first.output_ids == expected_output(prompt, 3)
    assert_no_leaks(d.sched)


class ReadAtMost:
    """A prefix reader that lets requests read at most ``limit`` matched blocks."""

    def __init__(self, limit: int) -> None:
        self.limit = limit
        self.asked: list[int] = []

    def usable_blocks(self, request: Request, num_blocks: int) -> int:
        self.asked.append(num_blocks)
        return min(num_blocks, self.limit)


@pytest.mark.parametrize("cache", ["radix", "hash"])
@pytest.mark.parametrize("limit", [0, 2])
def test_a_prefix_reader_limits_what_a_request_reads_and_it_computes_the_rest(cache, limit):
    prompt = np.arange(1, 30)
    kv = KVCacheManager(make_cache(cache, BlockAllocator(64, 4)))
    reader = ReadAtMost(limit)
    d = Driver(Scheduler(kv, SchedulerConfig(), prefix_reader=reader))
    [first] = d.run([Request(prompt, SamplingParams(max_new_tokens=3))])
    [again] = d.run([Request(prompt, SamplingParams(max_new_tokens=3))])
    assert reader.asked == [0, 7]  # asked once per lookup, with what was matched
    assert again.stats().cached_tokens == 4 * limit
    assert again.stats().prefill_tokens == 29 - 4 * limit
    assert again.output_ids == first.output_ids == expected_output(prompt, 3)
    assert_no_leaks(d.sched)


# ------------------------------------------------------------------ slot mapping pitfall
@pytest.mark.parametrize("cache", ["radix", "hash"])
def test_matched_blocks_populate_the_slot_mapping(cache):
    bs = 4
    sched = make_sched(cache, 32, bs)
    d = Driver(sched)
    prompt = np.arange(1, 23)  # 22 tokens
    d.run([Request(prompt, SamplingParams(max_new_tokens=2))])
    held = sched.cache.match(prompt[:21])
    sched.allocator.decref(held.blocks)
    assert held.num_tokens == 20
    req = Request(np.concatenate([prompt, [7, 7]]), SamplingParams(max_new_tokens=2))
    sched.add_request(req)
    out = sched.schedule()
    [seq] = out.seqs
    assert seq.start == 20 == req.num_computed_tokens
    assert sched.kv_manager.block_table(req.request_id)[:5] == held.blocks
    expected = np.array([b * bs + o for b in held.blocks for o in range(bs)])
    assert (slots(sched, req, 0, 20) == expected).all()
    # the shadow pool agrees: the cached slots hold this prompt's tokens
    assert (d.tok[slots(sched, req, 0, 20)] == req.tokens[:20]).all()
    d.apply(out)
    while sched.has_unfinished():
        d.step()
    assert_no_leaks(sched)


# ------------------------------------------------------------------ budgets and chunks
def test_chunked_prefill_respects_the_token_budget():
    sched = make_sched(None, 64, 4, max_num_batched_tokens=32)
    d = Driver(sched)
    d.run([Request(np.arange(100) % VOCAB, SamplingParams(max_new_tokens=3))])
    assert d.step_tokens == [32, 32, 32, 4, 1, 1]  # the 4th chunk samples; then 2 decodes
    assert_no_leaks(sched)


def test_decodes_and_prefill_chunks_share_the_budget():
    sched = make_sched(None, 128, 4, max_num_batched_tokens=16)
    d = Driver(sched)
    first = Request(np.arange(10), SamplingParams(max_new_tokens=8))
    sched.add_request(first)
    d.step()  # prefill of the first: 10 tokens
    second = Request(np.arange(10, 50) % VOCAB, SamplingParams(max_new_tokens=2))
    sched.add_request(second)
    out = sched.schedule()
    assert [(s.request, s.num_new_tokens) for s in out.seqs] == [(first, 1), (second, 15)]
    d.apply(out)
    while sched.has_unfinished():
        d.step()
    assert first.output_ids == expected_output(first.prompt, 8)
    assert second.output_ids == expected_output(second.prompt, 2)
    assert_no_leaks(sched)


def test_max_num_seqs_limits_running_requests():
    sched = make_sched(None, 256, 4, max_num_seqs=2)
    d = Driver(sched)
    reqs = [Request(np.arange(i, i + 9), SamplingParams(max_new_tokens=4)) for i in range(5)]
    for r in reqs:
        sched.add_request(r)
    while sched.has_unfinished():
        d.step()
        assert len(sched.running) <= 2
    assert_no_leaks(sched)


# ------------------------------------------------------------------ eviction / preemption
@pytest.mark.parametrize("cache", [None, "radix"])
def test_preemption_takes_the_most_recent_request_and_recomputes_it(cache):
    bs = 4
    sched = make_sched(cache, 12, bs, max_num_batched_tokens=64)
    d = Driver(sched)
    a = Request(np.arange(1, 17), SamplingParams(max_new_tokens=20))  # up to 9 blocks
    b = Request(np.arange(20, 28), SamplingParams(max_new_tokens=20))  # up to 7 blocks
    sched.add_request(a)
    sched.add_request(b)
    d.step()  # both admitted: 4 + 2 blocks
    assert sched.running == [a, b]
    while b.num_preemptions == 0:
        d.step()
        assert a.num_preemptions == 0, "the older request was preempted"
    assert b.status is RequestStatus.WAITING and b.request_id not in sched.kv_manager
    while sched.has_unfinished():
        d.step()
    assert a.output_ids == expected_output(a.prompt, 20)
    assert b.output_ids == expected_output(b.prompt, 20)
    assert sched.num_preemptions >= 1
    # b recomputed its prompt and the outputs it had: more prefill than its prompt
    assert b.stats().prefill_tokens > b.prompt_len
    # Its cached tokens are its first admission's (issue 26, item 2), though with a cache
    # its readmission matched the blocks it had computed (a shares nothing with b).
    assert a.stats().cached_tokens == b.stats().cached_tokens == 0
    assert (sched.cache.stats.hit_tokens > 0) == (cache is not None)
    assert_no_leaks(sched)


@pytest.mark.parametrize("cache", [None, "radix"])
def test_a_preempted_request_goes_back_to_the_front_of_the_queue(cache):
    # Issue 26, item 3: under fcfs the preempted request is first in `waiting`, ahead of a
    # request that arrived after it and waited all along, and is admitted before it.
    sched = make_sched(cache, 12, 4, max_num_batched_tokens=64, max_num_seqs=2)
    d = Driver(sched)
    a = Request(np.arange(1, 17), SamplingParams(max_new_tokens=20))
    b = Request(np.arange(20, 28), SamplingParams(max_new_tokens=20))
    c = Request(np.arange(30, 34), SamplingParams(max_new_tokens=2))
    for r in (a, b, c):
        sched.add_request(r)
    d.step()
    assert sched.running == [a, b] and list(sched.waiting) == [c]
    while b.num_preemptions == 0:
        d.step()
    assert list(sched.waiting) == [b, c]
    while c.status is RequestStatus.WAITING:  # one slot is free at a time: one admission
        d.step()
    assert b.status is not RequestStatus.WAITING, "c was admitted before the preempted b"
    while sched.has_unfinished():
        d.step()
    for r in (a, b, c):
        assert r.output_ids == expected_output(r.prompt, r.params.max_new_tokens)
    assert_no_leaks(sched)


@pytest.mark.parametrize("cache", [None, "radix", "hash"])
@pytest.mark.parametrize("policy", ["fcfs", "lpm"])
@pytest.mark.parametrize("bs", [1, 4, 16])
def test_chat_workload_small_pool_evicts_and_preempts(cache, policy, bs):
    wl = ChatWorkload(system_len=40, num_users=6, num_turns=3, user_len=(3, 12), vocab_size=VOCAB)
    num_blocks = -(-140 // bs)  # about two requests' worth
    sched = make_sched(cache, num_blocks, bs, max_num_batched_tokens=48, schedule_policy=policy)
    d = Driver(sched)
    chat_waves(d, wl, max_new=10)
    assert sched.num_preemptions > 0
    assert (sched.num_evicted_blocks > 0) == (cache is not None)
    assert_no_leaks(sched)


@pytest.mark.parametrize("cache", ["radix", "hash"])
@pytest.mark.parametrize("policy", ["fcfs", "lpm"])
@pytest.mark.parametrize("bs", [1, 16])
def test_chat_workload_computes_exactly_the_ideal_prefill(cache, policy, bs):
    wl = ChatWorkload(system_len=100, num_users=5, num_turns=3, user_len=(5, 20), vocab_size=VOCAB)
    sched = make_sched(cache, 4096 // bs, bs, max_num_batched_tokens=64, schedule_policy=policy)
    d = Driver(sched)
    waves = chat_waves(d, wl, max_new=6)
    ideal = IdealPrefill(bs)
    for reqs in waves:
        want = [ideal.admit(r.prompt) for r in reqs]
        got = [r.stats().prefill_tokens for r in reqs]
        assert sorted(got) == sorted(want)  # admission order may differ from submission
        assert sum(got) == sum(want)
        for r in reqs:
            ideal.finish(r.tokens[:-1])
    assert sched.num_preemptions == 0 and sched.num_evicted_blocks == 0
    assert_no_leaks(sched)


def test_without_waiting_shared_prefixes_are_computed_twice():
    # The ablation: the same workload without wait_for_shared_prefill does more work.
    wl = ChatWorkload(system_len=100, num_users=5, num_turns=1, user_len=(5, 20), vocab_size=VOCAB)
    totals = []
    for wait in (True, False):
        d = Driver(
            make_sched("radix", 256, 4, max_num_batched_tokens=256, wait_for_shared_prefill=wait)
        )
        [reqs] = chat_waves(d, wl, max_new=4)
        totals.append(sum(r.stats().prefill_tokens for r in reqs))
    assert totals[0] < totals[1]


@given(
    seed=st.integers(0, 10_000),
    bs=st.sampled_from([1, 2, 4, 8]),
    cache=st.sampled_from([None, "radix", "hash"]),
    policy=st.sampled_from(["fcfs", "lpm"]),
    budget=st.integers(8, 64),
    pool_tokens=st.integers(60, 400),
)
def test_random_workloads_keep_every_invariant(seed, bs, cache, policy, budget, pool_tokens):
    rng = np.random.default_rng(seed)
    prefixes = [rng.integers(0, VOCAB, int(rng.integers(0, 30))) for _ in range(3)]
    num_blocks = max(-(-pool_tokens // bs), -(-60 // bs))
    sched = make_sched(cache, num_blocks, bs, max_num_batched_tokens=budget, schedule_policy=policy)
    d = Driver(sched)
    for _ in range(2):
        reqs = []
        for _ in range(int(rng.integers(1, 6))):
            p = prefixes[int(rng.integers(0, 3))]
            tail = rng.integers(0, VOCAB, int(rng.integers(1, 15)))
            reqs.append(
                Request(np.concatenate([p, tail]), SamplingParams(int(rng.integers(1, 12))))
            )
        d.run(reqs)
        for r in reqs:
            assert r.output_ids == expected_output(r.prompt, r.params.max_new_tokens)
    assert_no_leaks(sched)


# ------------------------------------------------------------------ policies
def _cold_and_warm_queued(policy: str) -> tuple[Scheduler, Driver, Request, Request]:
    """A cached 32-token prefix, then a cold and a warm request queued in that order and
    one step taken with room for a single running request."""
    sched = make_sched("radix", 64, 4, max_num_seqs=1, schedule_policy=policy)
    d = Driver(sched)
    hot = np.arange(1, 33)
    d.run([Request(hot, SamplingParams(max_new_tokens=1))])
    cold = Request(np.arange(40, 50), SamplingParams(max_new_tokens=2))
    warm = Request(np.concatenate([hot, [5, 6]]), SamplingParams(max_new_tokens=2))
    sched.add_request(cold)
    sched.add_request(warm)
    d.step()
    return sched, d, cold, warm


def test_fcfs_admits_in_arrival_order():
    sched, d, cold, warm = _cold_and_warm_queued("fcfs")
    assert sched.running == [cold]
    while sched.has_unfinished():
        d.step()
    assert d.finished[-2:] == [cold, warm]
    assert_no_leaks(sched)


def test_lpm_admits_the_longest_cached_prefix_first():
    sched, d, cold, warm = _cold_and_warm_queued("lpm")
    assert sched.running == [warm]
    assert warm.cached_tokens == 32
    while sched.has_unfinished():
        d.step()
    assert d.finished[-2:] == [warm, cold]
    assert_no_leaks(sched)


@pytest.mark.parametrize("bound", [10, SchedulerConfig().lpm_max_wait_steps])
def test_lpm_admits_a_cold_request_within_lpm_max_wait_steps(bound):
    # Regression (issue 21, item 14): under lpm a request with no cached prefix waited for as
    # long as hot-prefix requests kept arriving (here: never admitted, one slot, a new hot
    # request every step). Once it has waited lpm_max_wait_steps steps it goes first.
    sched = make_sched(
        "radix", 256, 4, max_num_seqs=1, schedule_policy="lpm", lpm_max_wait_steps=bound
    )
    d = Driver(sched)
    hot = np.arange(1, 33)
    d.run([Request(hot, SamplingParams(max_new_tokens=1))])
    cold = Request(np.arange(40, 50), SamplingParams(max_new_tokens=2))
    sched.add_request(cold)
    hots = []
    for waited in range(1, bound + 20):  # the step cold is admitted in counts as waited
        hots.append(Request(np.concatenate([hot, [waited % VOCAB, 7]]), SamplingParams(2)))
        sched.add_request(hots[-1])
        d.step()
        if cold.status is not RequestStatus.WAITING:
            break
    assert cold.status is RequestStatus.RUNNING, f"still waiting after {waited} steps"
    assert bound <= waited <= bound + 1  # a hot request frees the one slot every other step
    assert sum(h.status is not RequestStatus.WAITING for h in hots) >= bound // 2 - 1
    while sched.has_unfinished():
        d.step()
    assert cold.output_ids == expected_output(cold.prompt, 2)
    assert all(h.output_ids == expected_output(h.prompt, 2) for h in hots)
    assert_no_leaks(sched)


@pytest.mark.parametrize("bound", [1, 2, 3, 4, 7])
def test_lpm_promotes_a_starved_request_at_exactly_lpm_max_wait_steps(bound):
    """The aging boundary, for odd and even bounds: a cold request queued behind a hot
    request a step (one slot; each hot request finishes in the step that admits it, so the
    slot is free every step) loses to the hot one in its first ``bound - 1`` schedule calls
    and is admitted in its ``bound``-th, as lpm_max_wait_steps says."""
    sched = make_sched(
        "radix", 256, 4, max_num_seqs=1, schedule_policy="lpm", lpm_max_wait_steps=bound
    )
    d = Driver(sched)
    hot = np.arange(1, 33)
    d.run([Request(hot, SamplingParams(max_new_tokens=1))])
    cold = Request(np.arange(40, 50), SamplingParams(max_new_tokens=1))
    sched.add_request(cold)
    ran = []
    for waited in range(1, bound + 1):
        sched.add_request(Request(np.concatenate([hot, [waited, 7]]), SamplingParams(1)))
        out = sched.schedule()
        ran.append([s.request for s in out.seqs])
        d.apply(out)
    assert all(len(r) == 1 and r[0] is not cold for r in ran[:-1])
    assert ran[-1] == [cold] and cold.output_ids == expected_output(cold.prompt, 1)
    while sched.has_unfinished():
        d.step()
    assert_no_leaks(sched)


def test_lpm_ages_a_preempted_request_from_its_return_to_the_queue():
    """lpm_max_wait_steps counts from a preempted request's re-entry into the queue, not from
    the start: preempted at step 6 (bound 3), it is not overdue at step 7, so a request with
    a longer cached prefix goes first."""
    sched = make_sched("radix", 8, 4, max_num_seqs=2, schedule_policy="lpm", lpm_max_wait_steps=3)
    d = Driver(sched)
    first = Request(np.arange(1, 17), SamplingParams(8))
    later = Request(np.arange(30, 36), SamplingParams(6))
    sched.add_request(first)
    sched.add_request(later)
    while sched.num_preemptions == 0:
        d.step()
    assert later.status is RequestStatus.WAITING and sched.num_steps == 6
    warm = Request(np.concatenate([first.prompt, [20, 21]]), SamplingParams(2))
    sched.add_request(warm)
    kv = sched.kv_manager
    assert kv.num_cached_tokens(warm.tokens, None) > kv.num_cached_tokens(later.tokens, None)
    d.step()
    assert sched.running == [first, warm] and later.status is RequestStatus.WAITING
    while sched.has_unfinished():
        d.step()
    assert later.output_ids == expected_output(later.prompt, 6)
    assert_no_leaks(sched)


@pytest.mark.parametrize(
    ("num_waiting", "ranked"), [(LPM_MAX_QUEUE, True), (LPM_MAX_QUEUE + 1, False)]
)
def test_lpm_ranks_at_most_lpm_max_queue_waiting_requests(num_waiting, ranked):
    """Up to LPM_MAX_QUEUE waiting requests lpm admits the warm one (queued last) first; past
    that it falls back to arrival order (SGLang's rule)."""
    sched = make_sched("radix", 64, 4, max_num_seqs=1, schedule_policy="lpm")
    d = Driver(sched)
    hot = np.arange(1, 33)
    d.run([Request(hot, SamplingParams(max_new_tokens=1))])
    cold_prompts = [[40, 41, k % VOCAB, k // VOCAB] for k in range(num_waiting - 1)]
    colds = [Request(p, SamplingParams(1)) for p in cold_prompts]
    warm = Request(np.concatenate([hot, [5, 6]]), SamplingParams(1))
    for req in [*colds, warm]:
        sched.add_request(req)
    d.step()
    assert d.finished[-1] is (warm if ranked else colds[0])


# ------------------------------------------------------------------ errors
def test_request_larger_than_the_pool_is_rejected_before_queueing():
    sched = make_sched("radix", 8, 4)
    fits = Request(np.arange(30), SamplingParams(max_new_tokens=3))  # 32 tokens = 8 blocks
    sched.add_request(fits)
    big = Request(np.arange(30), SamplingParams(max_new_tokens=4))  # 33 tokens = 9 blocks
    with pytest.raises(ValueError, match="needs 9 blocks .* whole pool has 8"):
        sched.add_request(big)
    assert list(sched.waiting) == [fits]
    Driver(sched).run([])
    assert fits.output_ids == expected_output(fits.prompt, 3)
    assert_no_leaks(sched)


def test_postprocess_rejects_a_missing_token():
    sched = make_sched(None, 8, 4)
    sched.add_request(Request([1, 2, 3], SamplingParams()))
    out = sched.schedule()
    with pytest.raises(ValueError, match="need a token"):
        sched.postprocess(out, [None])
    with pytest.raises(ValueError, match="need 1 next tokens"):
        sched.postprocess(out, [])


def test_scheduler_takes_a_kv_manager():
    with pytest.raises(TypeError, match="KVCacheManager"):
        Scheduler(make_cache("radix", BlockAllocator(8, 4)))


@pytest.mark.parametrize(
    ("kwargs", "field"),
    [
        ({"max_num_batched_tokens": 0}, "max_num_batched_tokens"),
        ({"max_num_seqs": -1}, "max_num_seqs"),
        ({"schedule_policy": "lifo"}, "schedule_policy"),
        ({"lpm_max_wait_steps": 0}, "lpm_max_wait_steps"),
        ({"lpm_max_wait_steps": 2.5}, "lpm_max_wait_steps"),
        ({"lpm_max_wait_steps": True}, "lpm_max_wait_steps"),
    ],
)
def test_scheduler_config_validation(kwargs, field):
    with pytest.raises(ValueError, match=field):
        SchedulerConfig(**kwargs)


@pytest.mark.parametrize(
    ("kwargs", "field"),
    [
        ({"max_new_tokens": 0}, "max_new_tokens"),
        ({"temperature": -1.0}, "temperature"),
        ({"top_p": 0.0}, "top_p"),
        ({"seed": 1.5}, "seed"),
        ({"stop_token_ids": (-1,)}, "stop_token_ids"),
    ],
)
def test_sampling_params_validation(kwargs, field):
    with pytest.raises(ValueError, match=field):
        SamplingParams(**kwargs)


def test_request_stats_time_the_tokens_after_the_first():
    """ttft runs from arrival to the first token; decode_tps counts the tokens after the
    first over the time from the first token to the finish."""
    req = Request([1, 2, 3], SamplingParams(5))
    for token in (4, 5, 6, 7, 8):
        req.append_token(token)
    req.arrival_time, req.first_token_time, req.finish_time = 1.0, 1.5, 3.5
    s = req.stats()
    assert (s.ttft, s.decode_tps, s.latency) == (0.5, 2.0, 2.5)
    assert (s.output_tokens, s.finish_reason) == (5, "length")


def test_stop_token_finishes_early_and_is_kept():
    prompt = np.arange(1, 9)
    want = expected_output(prompt, 10)
    stop = want[3]
    first = want.index(stop)
    sched = make_sched("radix", 32, 4)
    [req] = Driver(sched).run([Request(prompt, SamplingParams(10, stop_token_ids=(stop,)))])
    assert req.output_ids == want[: first + 1]
    assert req.stats().finish_reason == "stop"
    assert_no_leaks(sched)


@given(
    seed=st.integers(0, 10_000),
    bs=st.sampled_from([1, 2, 4, 8]),
    cache=st.sampled_from(["radix", "hash"]),
    policy=st.sampled_from(["fcfs", "lpm"]),
    budget=st.integers(4, 64),
)
def test_random_waves_compute_exactly_the_ideal_prefill(seed, bs, cache, policy, budget):
    # With a pool that never evicts, every wave's prefill work equals the ideal cache's:
    # shared prefixes inside a wave are computed once, earlier waves' tokens are reused.
    rng = np.random.default_rng(seed)
    roots = [rng.integers(0, VOCAB, int(rng.integers(0, 25))) for _ in range(3)]
    sched = make_sched(cache, 4096 // bs, bs, max_num_batched_tokens=budget, schedule_policy=policy)
    d = Driver(sched)
    ideal = IdealPrefill(bs)
    done: list[np.ndarray] = []
    for _ in range(3):
        prompts = []
        for _ in range(int(rng.integers(1, 6))):
            base = done[int(rng.integers(0, len(done)))] if done and rng.random() < 0.5 else None
            if base is None:
                base = roots[int(rng.integers(0, 3))]
            prompts.append(np.concatenate([base, rng.integers(0, VOCAB, int(rng.integers(1, 9)))]))
        reqs = d.run([Request(p, SamplingParams(int(rng.integers(1, 6)))) for p in prompts])
        want = sum(ideal.admit(r.prompt) for r in reqs)
        assert sum(r.stats().prefill_tokens for r in reqs) == want
        for r in reqs:
            ideal.finish(r.tokens[:-1])
            done.append(r.tokens.copy())
    assert sched.num_preemptions == 0 and sched.num_evicted_blocks == 0
    assert_no_leaks(sched)


@pytest.mark.parametrize("cache", ["radix", "hash"])
def test_lpm_ranks_without_touching_the_cache_stats(cache):
    # Regression: lpm used to rank with match + decref, counting every waiting request
    # each step (155 matches for 12 requests). Ranking now peeks; each admission counts once.
    wl = ChatWorkload(system_len=64, num_users=6, num_turns=2, user_len=(4, 12), vocab_size=VOCAB)
    stats = {}
    for policy in ("fcfs", "lpm"):
        sched = make_sched(cache, 1024, 4, max_num_batched_tokens=32, schedule_policy=policy)
        waves = chat_waves(Driver(sched), wl, max_new=4)
        reqs = [r for w in waves for r in w]
        assert sched.num_preemptions == 0
        s = sched.cache.stats
        assert s.num_matches == len(reqs)
        assert s.query_tokens == sum(r.prompt_len - 1 for r in reqs)
        assert s.hit_tokens == sum(r.stats().cached_tokens for r in reqs)
        stats[policy] = (s.num_matches, s.query_tokens, s.hit_tokens)
        assert_no_leaks(sched)
    assert stats["lpm"] == stats["fcfs"]


def test_namespaces_isolate_requests_in_the_scheduler():
    prompt = np.arange(1, 30)
    sched = make_sched("radix", 64, 4)
    d = Driver(sched)
    d.run([Request(prompt, SamplingParams(2), namespace="a")])
    [b] = d.run([Request(prompt, SamplingParams(2), namespace="b")])
    [a] = d.run([Request(prompt, SamplingParams(2), namespace="a")])
    assert b.stats().cached_tokens == 0 and a.stats().cached_tokens == 28
    assert a.output_ids == b.output_ids == expected_output(prompt, 2)
    assert_no_leaks(sched)


# ------------------------------------------------------------------ a request waiting for blocks
class ShadowCopier:
    """A host tier's copier for the shadow pool: moves a block's tokens and positions, and
    wipes a block the device drops, so a wrong reload shows up as corrupted context."""

    def __init__(self, num_blocks: int, bs: int) -> None:
        self.bs = bs
        self.tok = np.full(num_blocks * bs, -1, dtype=np.int64)
        self.pos = np.full(num_blocks * bs, -1, dtype=np.int64)
        self.driver: Driver | None = None

    def _slots(self, blocks: np.ndarray) -> np.ndarray:
        return (np.asarray(blocks, dtype=np.int64)[:, None] * self.bs + np.arange(self.bs)).ravel()

    def backup(self, device: np.ndarray, host: np.ndarray) -> None:
        src, dst = self._slots(device), self._slots(host)
        self.tok[dst], self.pos[dst] = self.driver.tok[src], self.driver.pos[src]

    def load(self, host: np.ndarray, device: np.ndarray) -> None:
        src, dst = self._slots(host), self._slots(device)
        self.driver.tok[dst], self.driver.pos[dst] = self.tok[src], self.pos[src]

    def discard(self, device: np.ndarray) -> None:
        self.driver.tok[self._slots(device)] = -1


def tiered_sched(num_blocks: int, bs: int, host_blocks: int = 64) -> tuple[Scheduler, Driver]:
    """A radix scheduler with a host tier whose copier keeps the driver's shadow pool."""
    copier = ShadowCopier(host_blocks, bs)
    tier = HostTier(BlockAllocator(host_blocks, bs), copier)
    cache = make_cache("radix", BlockAllocator(num_blocks, bs), host=tier)
    d = Driver(Scheduler(KVCacheManager(cache), SchedulerConfig()))
    copier.driver = d
    return d.sched, d


def run_counting_waits(d: Driver, w: Request) -> int:
    """Step ``d`` to the end; return the steps ``w`` spent waiting."""
    waited = 0
    while d.sched.has_unfinished():
        waited += w.status is RequestStatus.WAITING
        d.step()
    return waited


def test_a_request_waiting_for_blocks_is_looked_up_once():
    # Regression (issue 21, item 4): admission matched a request's prefix every step it
    # could not get blocks, then freed it: here 9 lookups (72 hit tokens) for one admission.
    # w's cached prefix is what makes the pool's counts say it may fit, so it is looked up
    # once, finds too few blocks, and keeps its prefix until a finishes.
    sched = make_sched("radix", 10, 4)
    d = Driver(sched)
    prefix = np.arange(1, 9)
    d.run([Request(prefix, SamplingParams(max_new_tokens=1))])  # 2 blocks cached
    before = sched.cache.stats
    a = Request(np.arange(200, 225), SamplingParams(max_new_tokens=8))  # 7 blocks, then 8
    w = Request(np.concatenate([prefix, [9, 10, 11, 12, 13]]), SamplingParams(max_new_tokens=2))
    sched.add_request(a)
    sched.add_request(w)
    assert run_counting_waits(d, w) >= 5
    s = sched.cache.stats
    assert s.num_matches - before.num_matches == 2
    assert s.query_tokens - before.query_tokens == (a.prompt_len - 1) + (w.prompt_len - 1)
    assert s.hit_tokens - before.hit_tokens == w.cached_tokens == 8
    assert w.output_ids == expected_output(w.prompt, 2)
    assert_no_leaks(sched)


def _held_behind(pool_blocks: int) -> tuple[Scheduler, Driver, Request, Request]:
    """A 2-block prefix cached, then ``a`` (21 tokens, 8 new) and ``w`` (the prefix + 5) queued
    and one step taken: a runs on 6 blocks, and w, counting its own prefix as evictable,
    matched it and found too few blocks, so it holds it."""
    sched = make_sched("radix", pool_blocks, 4)
    d = Driver(sched)
    prefix = np.arange(1, 9)
    d.run([Request(prefix, SamplingParams(max_new_tokens=1))])
    a = Request(np.arange(200, 221), SamplingParams(max_new_tokens=8))
    w = Request(np.concatenate([prefix, [9, 10, 11, 12, 13]]), SamplingParams(max_new_tokens=2))
    sched.add_request(a)
    sched.add_request(w)
    d.step()
    assert sched.running == [a] and w.status is RequestStatus.WAITING
    assert len(sched.kv_manager.block_table(w.request_id)) == 2  # its prefix, nothing more
    return sched, d, a, w


def test_a_running_request_takes_blocks_from_the_held_request_before_preempting():
    # 8 blocks: a's 6, w's 2. When a's decode reaches a 7th block, w gives its prefix back
    # (it computed nothing) instead of a being preempted, and waits without blocks.
    sched, d, a, w = _held_behind(8)
    while w.request_id in sched.kv_manager and w.status is RequestStatus.WAITING:
        d.step()
    assert w.status is RequestStatus.WAITING and sched.num_preemptions == 0
    assert len(sched.kv_manager.block_table(a.request_id)) == 7
    while sched.has_unfinished():
        d.step()
    assert sched.num_preemptions == 0
    assert a.output_ids == expected_output(a.prompt, 8)
    assert w.output_ids == expected_output(w.prompt, 2)
    assert_no_leaks(sched)


def test_finishing_the_held_request_gives_its_prefix_back():
    sched, d, a, w = _held_behind(8)
    sched.finish(w, FinishReason.ABORT)
    sched.check()
    assert w.request_id not in sched.kv_manager and list(sched.waiting) == []
    assert sched.cache.evictable_blocks == 2  # the prefix, held by nobody now
    while sched.has_unfinished():
        d.step()
    assert w.status is RequestStatus.FINISHED and w.output_ids == []
    assert_no_leaks(sched)


def test_a_waiting_request_is_reloaded_from_the_host_once():
    # Regression (issue 21, item 4): with a host tier, every lookup of a request that could
    # not be admitted reloaded its prefix, and running requests evicted it again: here 5
    # lookups and 3 reloads (24 blocks) of one 8-token prefix. Now w is not looked up
    # until the pool's counts say it may fit, and then its prefix comes back once.
    sched, d = tiered_sched(18, 1)
    prefix = np.arange(1, 9)
    d.run([Request(prefix, SamplingParams(max_new_tokens=1))])
    d.run([Request(np.arange(100, 117), SamplingParams(max_new_tokens=1))])
    assert sched.cache.peek(prefix) == 0  # the prefix is on the host alone
    before = sched.cache.stats
    shapes = [(3, 2), (2, 2), (3, 4), (2, 4)]  # (prompt, max_new_tokens): they fill the pool
    short = [
        Request(np.arange(p) + 200 + 10 * i, SamplingParams(m)) for i, (p, m) in enumerate(shapes)
    ]
    w = Request(np.concatenate([prefix, [9, 10]]), SamplingParams(max_new_tokens=2))
    for r in [*short, w]:
        sched.add_request(r)
    assert run_counting_waits(d, w) >= 3
    s = sched.cache.stats
    assert s.num_matches - before.num_matches == len(short) + 1
    assert s.host_hit_tokens - before.host_hit_tokens == w.cached_tokens == 8
    assert s.loaded_blocks - before.loaded_blocks == 8
    for r in [*short, w]:
        assert r.output_ids == expected_output(r.prompt, r.params.max_new_tokens)
    assert_no_leaks(sched)
