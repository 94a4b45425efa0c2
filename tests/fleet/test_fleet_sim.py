"""The fleet simulator: hand-computed hits, conservation, regret, the single-cache baseline, CLI."""

from __future__ import annotations

import json

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from radixkv.cli import main
from radixkv.fleet.replica import BatchedScheduler, Replica
from radixkv.fleet.results import RunTally, SimResult, roll_up
from radixkv.fleet.routing import ReplicaState, RouteRequest
from radixkv.fleet.sim import (
    SERVICE_PROFILES,
    BatchConfig,
    FleetSim,
    ServiceModel,
    SimClock,
    SimRequest,
    build_router,
    offered_load,
    requests_from_trace,
    simulate,
    single_cache_hit_rate,
)
from radixkv.fleet.workloads import group_sizes, grouped_prompts, hot_prompt
from radixkv.replay.replay import replay
from radixkv.replay.trace import load_trace
from tests.trace_paths import TRACES

CONVERSATION = TRACES / "conversation_trace.jsonl"
needs_trace = pytest.mark.skipif(not CONVERSATION.exists(), reason="shared traces not present")


class RoundRobin:
    """A trivial router of our own, so the simulator is tested without the router module."""

    name = "rr"

    def __init__(self) -> None:
        self.next = 0
        self.finished: list = []

    def choose(self, request, replicas):
        r = replicas[self.next % len(replicas)]
        self.next += 1
        return r.replica_id

    def on_events(self, replica_id, events):
        pass

    def on_finish(self, replica_id, request):
        self.finished.append(request.request_id)

    def drop_replica(self, replica_id):
        pass


class Oracle(RoundRobin):
    """Picks the replica whose cache holds the longest prefix now (peeks the sim's caches)."""

    name = "oracle"

    def __init__(self, sim: FleetSim) -> None:
        super().__init__()
        self.sim = sim

    def choose(self, request: RouteRequest, replicas: list[ReplicaState]):
        overlaps = [rep.cache.peek(request.tokens) for rep in self.sim.replicas]
        return replicas[int(np.argmax(overlaps))].replica_id


def req(i: int, arrival: float, tokens: list[int], out: int = 1) -> SimRequest:
    return SimRequest(i, arrival, np.asarray(tokens, dtype=np.int32), len(tokens) * 512, out)


FAST = ServiceModel(prefill_per_token=1e-3, attention_per_key=0.0, decode_per_token=1e-3)


def check_clean(sim: FleetSim) -> None:
    """Every allocator consistent; after reset every block is free (no leaked reference)."""
    for rep in sim.replicas:
        rep.allocator.check()
        rep.cache.reset()
        assert rep.allocator.num_free == rep.capacity_blocks


# ------------------------------------------------------------------ hand-computed
def test_round_robin_on_two_replicas_matches_hand_computed_hits() -> None:
    # Requests alternate replicas 0, 1, 0, 1. Replica 0 sees [1,2,3] then [1,2,9]: hit 2.
    # Replica 1 sees [1,2,4] (cold) then [1,2,4,5]: hit 3.
    reqs = [
        req(0, 0.0, [1, 2, 3]),
        req(1, 10.0, [1, 2, 4]),
        req(2, 20.0, [1, 2, 9]),
        req(3, 30.0, [1, 2, 4, 5]),
    ]
    sim = FleetSim(num_replicas=2, capacity_blocks=16, service=FAST)
    res = sim.run(reqs, RoundRobin())
    assert res.replica.tolist() == [0, 1, 0, 1]
    assert res.hit_ids.tolist() == [0, 0, 2, 3]
    assert res.hit_tokens == 5 * 512
    assert res.hit_rate == pytest.approx(5 / 13)
    # Regret at decision: request 1 could have had 2 on replica 0 (lost 2, novel 1);
    # request 2 got its best (2); request 3: replica 1 holds 3, replica 0 holds 2.
    assert res.lost_blocks == 2
    assert res.novel_blocks == 3 + 1 + 1 + 1
    assert res.regret == pytest.approx(2 / 8)
    assert res.served == [2, 2]
    assert res.max_mean_load == 1.0
    check_clean(sim)


def test_index_memory_is_the_routers_own_report_else_zero() -> None:
    reqs = [req(i, 10.0 * i, [1, 2, i + 3]) for i in range(4)]
    res = FleetSim(num_replicas=2, capacity_blocks=16, service=FAST).run(reqs, RoundRobin())
    assert res.router == "rr" and res.index_memory_bytes == 0  # no memory_bytes(): 0

    class Sized(RoundRobin):
        def memory_bytes(self) -> int:
            return 1234

    res = FleetSim(num_replicas=2, capacity_blocks=16, service=FAST).run(reqs, Sized())
    assert res.index_memory_bytes == 1234


def test_the_tally_counts_regret_and_the_roll_up_derives_the_figures() -> None:
    tally = RunTally(3)
    # Request 0 (4 blocks): replica 1 holds 3, the router picks replica 0 (holds 1).
    tally.record_route(0, 0, [1, 3], 4, 2000)
    tally.record_route(1, 1, [0, 2], 5, 4000)  # its best: lost 0, novel 3
    tally.record_route(2, 0, [0, 0], 2, 6000)
    assert tally.replica.tolist() == [0, 1, 0]
    assert (tally.lost_blocks, tally.novel_blocks) == (2, 1 + 3 + 2)
    tally.hit_ids[:] = [1, 2, 0]
    tally.ttft[:] = [1.0, 2.0, 3.0]
    reps = [Replica(k, 16, 1, "lru") for k in range(2)]
    reps[0].served, reps[0].busy_time, reps[0].work = 2, 3.0, 3.0
    reps[1].served, reps[1].busy_time, reps[1].work = 1, 1.0, 1.0
    res = roll_up(
        tally,
        router=RoundRobin(),
        service="serial",
        replicas=reps,
        capacity_blocks=16,
        prompt_tokens=[2000, 2560, 1024],
        tokens_per_id=512,
        offered_load=0.5,
        makespan=4.0,
    )
    assert res.hit_tokens == 512 + 1024 and res.hit_rate == pytest.approx(1536 / 5584)
    assert res.regret == pytest.approx(2 / 8) and res.lost_blocks == 2
    assert res.ttft_p50 == 2.0 and res.ttft_mean == 2.0
    assert res.decision_us_p50 == 4.0
    assert res.max_mean_load == 2 / 1.5 and res.max_mean_busy == 3.0 / 2.0
    assert res.utilisation == 2.0 / 4.0 and res.max_mean_utilisation == 3.0 / 2.0
    assert (res.router, res.service, res.served, res.offered_load) == ("rr", "serial", [2, 1], 0.5)
    assert res.replica is tally.replica and "replica" not in res.to_dict()


def test_sim_result_is_public_where_it_was_and_in_the_fleet_package() -> None:
    import radixkv.fleet
    import radixkv.fleet.sim

    assert radixkv.fleet.SimResult is radixkv.fleet.sim.SimResult is SimResult


def test_queueing_and_ttft_follow_the_service_model() -> None:
    # Two requests at t=0 on one replica: the second waits for the first's prefill + decode.
    svc = ServiceModel(prefill_per_token=0.001, attention_per_key=0.0, decode_per_token=0.01)
    reqs = [req(0, 0.0, [1, 2], out=10), req(1, 0.0, [1, 2, 3], out=10)]
    res = simulate(reqs, RoundRobin(), num_replicas=1, capacity_blocks=8, service=svc)
    first = 1024 * 0.001
    assert res.ttft[0] == pytest.approx(first)
    # second: waits first + 0.1 decode, then prefills only its 512 uncached tokens
    assert res.ttft[1] == pytest.approx(first + 0.1 + 512 * 0.001)
    assert res.hit_ids.tolist() == [0, 2]


def test_service_model_attention_term_counts_keys() -> None:
    svc = ServiceModel(prefill_per_token=0.0, attention_per_key=1.0, decode_per_token=0.0)
    assert svc.prefill(4, 0) == 1 + 2 + 3 + 4
    assert svc.prefill(4, 2) == 3 + 4
    assert svc.prefill(4, 4) == 0.0
    with pytest.raises(ValueError, match="prefill_per_token"):
        ServiceModel(prefill_per_token=-1.0)


def test_rate_scales_arrivals() -> None:
    reqs = [req(0, 0.0, [1]), req(1, 100.0, [2])]
    slow = simulate(reqs, RoundRobin(), num_replicas=1, capacity_blocks=4, service=FAST)
    fast = simulate(reqs, RoundRobin(), num_replicas=1, capacity_blocks=4, service=FAST, rate=4.0)
    assert slow.makespan_s > fast.makespan_s
    assert fast.makespan_s == pytest.approx(25.0 + FAST.prefill(512, 0) + FAST.decode(1))


@pytest.mark.parametrize("batch", [None, BatchConfig()])
def test_ttft_runs_from_the_scaled_arrival(batch: BatchConfig | None) -> None:
    # At rate 4 request 1 arrives at 25 s (trace: 100 s) on an idle replica: its TTFT is its
    # prefill alone, not measured from the trace's 100 s
    reqs = [req(0, 0.0, [1]), req(1, 100.0, [2])]
    res = simulate(
        reqs, RoundRobin(), num_replicas=1, capacity_blocks=4, service=FAST, batch=batch, rate=4.0
    )
    first = res.ttft[0]
    assert first > 0 and res.ttft.tolist() == pytest.approx([first, first])


def test_offered_load_divides_the_span_by_the_rate() -> None:
    reqs = [req(0, 0.0, [1, 2]), req(1, 100.0, [3]), req(2, 200.0, [4])]
    work = 2 * (FAST.prefill(512, 0) + FAST.decode(1)) + FAST.prefill(1024, 0) + FAST.decode(1)
    # span 200 s at rate 1, 50 s at rate 4, over 2 replicas
    assert offered_load(reqs, FAST, 2) == pytest.approx(work / 400.0)
    assert offered_load(reqs, FAST, 2, rate=4.0) == pytest.approx(work / 100.0)
    res = simulate(reqs, RoundRobin(), num_replicas=2, capacity_blocks=4, service=FAST, rate=4.0)
    assert res.offered_load == pytest.approx(work / 100.0)


def test_offered_load_of_fewer_than_two_requests_is_zero() -> None:
    assert offered_load([req(0, 5.0, [1])], FAST, 1) == 0.0
    assert offered_load([], FAST, 1) == 0.0


class Recorder(RoundRobin):
    """Round robin that records the in-flight counts it is shown and when events arrive."""

    def __init__(self, clock: SimClock) -> None:
        super().__init__()
        self.clock = clock
        self.shown: list[list[int]] = []
        self.heard: list[tuple[float, int]] = []
        self.calls: list[tuple[str, float]] = []

    def choose(self, request, replicas):
        self.shown.append([r.in_flight for r in replicas])
        self.calls.append(("choose", self.clock()))
        return super().choose(request, replicas)

    def on_events(self, replica_id, events):
        self.heard.append((self.clock(), len(events)))
        self.calls.append(("events", self.clock()))


def test_routers_see_in_flight_counts_and_hear_events_after_the_delay() -> None:
    clock = SimClock()
    router = Recorder(clock)
    reqs = [req(0, 0.0, [1, 2]), req(1, 0.0, [3]), req(2, 0.0, [4]), req(3, 100.0, [5])]
    reqs.append(req(4, 105.0, [6]))  # arrives as request 3's events do
    sim = FleetSim(num_replicas=2, capacity_blocks=8, service=FAST, event_delay=5.0, clock=clock)
    res = sim.run(reqs, router)
    assert router.shown == [[0, 0], [1, 0], [1, 1], [0, 0], [0, 0]]
    assert sorted(router.finished) == [0, 1, 2, 3, 4]
    assert [r.state.in_flight for r in sim.replicas] == [0, 0]
    # each request's blocks reach the router event_delay after it started
    r2_start = FAST.prefill(1024, 0) + FAST.decode(1)  # behind request 0 on replica 0
    heard = [5.0, 5.0, 5.0 + r2_start, 105.0, 110.0]
    assert [t for t, _ in router.heard] == pytest.approx(heard)
    assert res.events_delivered == sum(n for _, n in router.heard) == 5  # a BlockStored each
    # at equal times the router is informed before it routes
    assert router.calls[-3:] == [("events", 105.0), ("choose", 105.0), ("events", 110.0)]


def test_a_request_s_hit_is_capped_at_its_prompt() -> None:
    # two ids (1024 tokens of blocks) for a 700-token prompt: the second request's hit of
    # both ids is its 700 tokens
    reqs = [SimRequest(i, 100.0 * i, np.array([1, 2], dtype=np.int32), 700, 1) for i in range(2)]
    res = simulate(reqs, RoundRobin(), num_replicas=1, capacity_blocks=8, service=FAST)
    assert res.hit_ids.tolist() == [0, 2] and res.hit_tokens == 700


def test_a_replaced_wake_up_is_ignored() -> None:
    # r0 decodes from 0.9 s, its finish planned for 4.9 s; r1 (2 s) and r2 (4.7 s) arrive
    # while it decodes, each replacing that plan: their prefills share a step with r0's
    # decode (7 of the 8 tokens) and take 4/7 step + 0.4 s each, whatever was planned before
    svc = ServiceModel(
        prefill_per_token=0.1, attention_per_key=0.0, decode_per_token=0.0, step_overhead=1.0
    )
    reqs = [
        SimRequest(i, t, np.array([i + 1], dtype=np.int32), 4, out)
        for i, (t, out) in enumerate([(0.0, 5), (2.0, 1), (4.7, 1)])
    ]
    batch = BatchConfig(token_budget=8, max_num_seqs=4)
    res = simulate(reqs, RoundRobin(), num_replicas=1, capacity_blocks=8, service=svc, batch=batch)
    assert res.ttft.tolist() == pytest.approx([0.5 + 0.4, 4 / 7 + 0.4, 4 / 7 + 0.4])


def test_a_scheduler_that_makes_no_progress_fails_instead_of_spinning(monkeypatch) -> None:
    # A wake-up that only plans the next one at the same time (as a scheduler bug would)
    monkeypatch.setattr(BatchedScheduler, "wake", lambda self, now: self.host.schedule(self.k, now))
    reqs = [req(i, float(i), [i + 1], out=3) for i in range(4)]
    with pytest.raises(RuntimeError, match="16 events per request for 4 requests"):
        simulate(reqs, RoundRobin(), num_replicas=2, capacity_blocks=4, batch=BatchConfig())


# ------------------------------------------------------------------ batched service
STEP = ServiceModel(
    prefill_per_token=0.001, attention_per_key=0.0, decode_per_token=0.0, step_overhead=0.01
)


def test_batched_prefill_chunks_share_the_step_with_decodes() -> None:
    # Budget 2048 tokens a step. r0 (2 ids = 1024 tokens) prefills alone in half a step;
    # r1 waits for the prefill slot, then hits r0's 2 ids and prefills 512 tokens beside
    # r0's decode (1 token a step: 2047 left for prefill).
    reqs = [req(0, 0.0, [1, 2], out=3), req(1, 0.0, [1, 2, 3], out=3)]
    batch = BatchConfig(token_budget=2048, max_num_seqs=4)
    res = simulate(reqs, RoundRobin(), num_replicas=1, capacity_blocks=8, service=STEP, batch=batch)
    first = 0.5 * 0.01 + 1024 * 0.001
    assert res.ttft[0] == pytest.approx(first)
    assert res.ttft[1] == pytest.approx(first + 512 / 2047 * 0.01 + 512 * 0.001)
    assert res.hit_ids.tolist() == [0, 2]
    assert res.service == "batched"


def test_batched_decode_steps_cost_the_overhead_and_a_token_each() -> None:
    svc = ServiceModel(
        prefill_per_token=0.0, attention_per_key=0.0, decode_per_token=0.002, step_overhead=0.01
    )
    reqs = [req(0, 0.0, [1], out=5), req(1, 0.0, [2], out=5)]
    res = simulate(
        reqs, RoundRobin(), num_replicas=1, capacity_blocks=8, service=svc, batch=BatchConfig()
    )
    # r0's 512 tokens fill a quarter step; then r1's 512 share steps with r0's decode
    # (2047 tokens left a step); then both decode (4 steps each after the first token).
    r1_steps = 512 / 2047
    assert res.ttft[0] == pytest.approx(0.25 * 0.01)
    assert res.ttft[1] == pytest.approx(0.25 * 0.01 + r1_steps * 0.012)
    both = 4.25 - (0.25 + r1_steps)  # until r0's last token
    alone = (0.25 + r1_steps + 4) - 4.25
    assert res.makespan_s == pytest.approx(res.ttft[1] + both * 0.014 + alone * 0.012)


def test_batched_request_waits_while_the_cache_cannot_hold_it() -> None:
    # 4 blocks: r0 holds 3 while it runs, so r1 (3 others) waits for r0 to finish.
    reqs = [req(0, 0.0, [1, 2, 3], out=10), req(1, 0.0, [4, 5, 6], out=1)]
    batch = BatchConfig(token_budget=2048, max_num_seqs=4)
    res = simulate(reqs, RoundRobin(), num_replicas=1, capacity_blocks=4, service=STEP, batch=batch)
    r0_done = 1536 / 2048 * 0.01 + 1536 * 0.001 + 9 * 0.01
    assert res.ttft[1] == pytest.approx(r0_done + 1536 / 2048 * 0.01 + 1536 * 0.001)


@pytest.mark.parametrize("seqs", [2, 3])
def test_batched_admits_at_most_max_num_seqs(seqs: int) -> None:
    svc = ServiceModel(
        prefill_per_token=0.0, attention_per_key=0.0, decode_per_token=0.0, step_overhead=1.0
    )
    reqs = [SimRequest(i, 0.0, np.array([10 + i], dtype=np.int32), 1, 3) for i in range(3)]
    batch = BatchConfig(token_budget=8, max_num_seqs=seqs)
    res = simulate(reqs, RoundRobin(), num_replicas=1, capacity_blocks=8, service=svc, batch=batch)
    # Each needs 2 decode steps (1 s each) after its first token: with room for two, the
    # third starts only when one of them is done; with room for three, at once.
    waited = res.ttft[2] >= min(res.ttft[:2]) + 2.0
    assert waited == (seqs == 2)


def test_batch_config_and_profiles_name_bad_values() -> None:
    with pytest.raises(ValueError, match=r"token_budget must exceed max_num_seqs \(256\), got 256"):
        BatchConfig(token_budget=256)
    with pytest.raises(ValueError, match="max_num_seqs must be a positive int, got 0"):
        BatchConfig(max_num_seqs=0)
    with pytest.raises(ValueError, match="step_overhead must be a non-negative number, got -1.0"):
        ServiceModel(step_overhead=-1.0)
    with pytest.raises(ValueError, match="batch must be a BatchConfig or None"):
        FleetSim(num_replicas=1, capacity_blocks=1, batch=2048)  # type: ignore[arg-type]
    h200 = SERVICE_PROFILES["h200"]
    assert h200.decode(32) == pytest.approx(32 * (1.79e-3 + 2e-6))
    assert h200.replace(prefill_per_token=1.0).prefill_per_token == 1.0
    assert h200.replace(prefill_per_token=None) == h200


# ------------------------------------------------------------------ invariants
workloads = st.lists(
    st.tuples(
        st.floats(0.0, 5.0),
        st.lists(st.integers(0, 6), min_size=1, max_size=12),
        st.integers(0, 50),
    ),
    min_size=1,
    max_size=30,
)


@settings(max_examples=40, deadline=None)
@given(workloads, st.integers(1, 4), st.integers(1, 24), st.booleans())
def test_every_request_is_served_once_and_nothing_leaks(wl, n, capacity, oracle) -> None:
    arrivals = np.cumsum([a for a, _, _ in wl])
    reqs = [req(i, float(t), toks, out) for i, (t, (_, toks, out)) in enumerate(zip(arrivals, wl))]
    sim = FleetSim(num_replicas=n, capacity_blocks=capacity, service=FAST)
    router = Oracle(sim) if oracle else RoundRobin()
    res = sim.run(reqs, router)
    assert sorted(router.finished) == list(range(len(reqs)))
    assert sum(res.served) == len(reqs) and (res.replica >= 0).all()
    assert (res.ttft >= 0).all()
    assert 0.0 <= res.hit_rate <= 1.0 and 0.0 <= res.regret <= 1.0
    for rep in sim.replicas:
        assert rep.state.in_flight == 0 and rep.state.waiting == 0 and rep.state.running == 0
    if n == 1 or oracle:
        assert res.lost_blocks == 0 and res.regret == 0.0
    check_clean(sim)


@settings(max_examples=40, deadline=None)
@given(workloads, st.integers(1, 4), st.integers(1, 24), st.integers(3, 6), st.integers(1, 3))
def test_batched_serves_every_request_once_and_releases_every_block(
    wl, n, capacity, budget, seqs
) -> None:
    arrivals = np.cumsum([a for a, _, _ in wl])
    reqs = [req(i, float(t), toks, out) for i, (t, (_, toks, out)) in enumerate(zip(arrivals, wl))]
    svc = ServiceModel(prefill_per_token=1e-3, attention_per_key=1e-7, step_overhead=1e-2)
    sim = FleetSim(
        num_replicas=n, capacity_blocks=capacity, service=svc, batch=BatchConfig(budget * 512, seqs)
    )
    router = RoundRobin()
    res = sim.run(reqs, router)
    assert sorted(router.finished) == list(range(len(reqs)))
    assert sum(res.served) == len(reqs)
    assert (res.ttft >= 0).all() and 0.0 <= res.hit_rate <= 1.0
    assert 0.0 <= res.utilisation <= 1.0 + 1e-9
    for rep in sim.replicas:
        assert rep.state.in_flight == 0 and rep.state.waiting == 0 and rep.state.running == 0
        assert rep.work <= rep.busy_time + 1e-9
    check_clean(sim)  # every block the running requests held was given back


@settings(max_examples=25, deadline=None)
@given(workloads, st.integers(1, 24))
def test_batched_one_replica_without_overlap_equals_the_single_cache(wl, capacity) -> None:
    # Arrivals far enough apart that each request finishes before the next: batching changes
    # nothing any request sees, so one batched replica is the single cache too.
    reqs = [req(i, 1e6 * i, toks, out) for i, (_, toks, out) in enumerate(wl)]
    res = simulate(
        reqs, RoundRobin(), num_replicas=1, capacity_blocks=capacity, batch=BatchConfig()
    )
    assert res.hit_rate == pytest.approx(single_cache_hit_rate(reqs, capacity))


@settings(max_examples=25, deadline=None)
@given(workloads, st.integers(1, 24))
def test_one_replica_equals_the_single_cache_baseline(wl, capacity) -> None:
    # One FIFO replica serves in arrival order: exactly the single cache of the same size.
    arrivals = np.cumsum([a for a, _, _ in wl])
    reqs = [req(i, float(t), toks, out) for i, (t, (_, toks, out)) in enumerate(zip(arrivals, wl))]
    res = simulate(reqs, RoundRobin(), num_replicas=1, capacity_blocks=capacity, service=FAST)
    assert res.hit_rate == pytest.approx(single_cache_hit_rate(reqs, capacity))


def test_synthetic_workloads_have_the_advertised_sharing() -> None:
    g = grouped_prompts(3, 5, system_len=4, question_len=2, seed=1)
    assert len(g) == 15 and all(len(r.tokens) == 6 for r in g)
    assert len({tuple(r.tokens[:4]) for r in g}) == 3
    assert len({tuple(r.tokens[4:]) for r in g}) == 15
    assert all(b.arrival >= a.arrival for a, b in zip(g, g[1:]))
    h = hot_prompt(200, hot_fraction=0.9, system_len=4, seed=2)
    heads = [tuple(r.tokens[:4]) for r in h]
    top = max(set(heads), key=heads.count)
    assert 0.8 < heads.count(top) / 200 < 1.0
    # With 1 replica and enough room: every group's prompt after the first hits its system prompt.
    res = simulate(g, RoundRobin(), num_replicas=1, capacity_blocks=100, service=FAST)
    assert res.hit_tokens == (15 - 3) * 4 * 512


# ------------------------------------------------------------------ real trace
@needs_trace
@pytest.mark.parametrize("capacity", [64, 300, 5000])
def test_single_cache_baseline_equals_replay_radix_lru(capacity: int) -> None:
    trace = load_trace(CONVERSATION)[:300]
    expected = replay(trace, "radix-lru", capacity, block_size=512).overall_hit_rate
    assert single_cache_hit_rate(trace, capacity) == pytest.approx(expected)
    res = simulate(trace, RoundRobin(), num_replicas=1, capacity_blocks=capacity, rate=1e-3)
    assert res.hit_rate == pytest.approx(expected)


@needs_trace
def test_trace_requests_arrive_in_seconds_from_the_first() -> None:
    trace = load_trace(CONVERSATION)[:50]
    reqs = requests_from_trace(trace, limit=20)
    assert len(reqs) == 20 and reqs[0].arrival == 0.0
    ts = trace.timestamps
    assert reqs[-1].arrival == pytest.approx((ts[19] - ts[0]) / 1000.0)
    assert reqs[3].prompt_tokens == trace.input_lengths[3]


@needs_trace
@pytest.mark.parametrize("name", ["round_robin", "least_loaded", "chwbl", "approx", "exact"])
def test_real_routers_on_a_trace_prefix(name: str) -> None:
    trace = load_trace(CONVERSATION)[:300]
    clock = SimClock(scale=0.01)
    sim = FleetSim(num_replicas=4, capacity_blocks=500, clock=clock)
    res = sim.run(trace, build_router(name, clock), rate=0.01)
    assert sum(res.served) == 300
    assert res.decision_us_p50 > 0
    check_clean(sim)


@pytest.mark.parametrize("name", ["approx", "exact"])
def test_build_router_gives_prefix_routers_the_sims_clock_and_service(name: str) -> None:
    # Regression: the options were looked up on the subclass's own signature only, so the
    # prefix routers silently ran on the wall clock and the default service model.
    clock = SimClock()
    h200 = SERVICE_PROFILES["h200"]
    router = build_router(name, clock, service=h200)
    assert router.clock is clock
    assert router.scoring.service == h200 and router.scoring.tokens_per_block == 512
    clock.now = 123.0
    assert router.clock() == 123.0


def test_exact_router_gets_events_and_wins_on_groups() -> None:
    g = grouped_prompts(4, 30, system_len=8, question_len=1, arrival_rate=0.05, seed=3)
    out = {}
    for name in ("round_robin", "exact"):
        clock = SimClock()
        out[name] = simulate(
            g, build_router(name, clock), num_replicas=4, capacity_blocks=64, clock=clock
        )
    assert out["exact"].events_delivered > 0
    assert out["exact"].hit_rate > out["round_robin"].hit_rate


# ------------------------------------------------------------------ CLI
def run_cli(capsys, *argv: str) -> tuple[int, str, str]:
    try:
        code = main(list(argv))
    except SystemExit as exc:
        code = exc.code
    out, err = capsys.readouterr()
    return code, out, err


@needs_trace
def test_cli_json_has_every_router_and_field(capsys) -> None:
    code, out, _ = run_cli(
        capsys,
        "route-sim",
        str(CONVERSATION),
        "--replicas",
        "2",
        "--capacity",
        "200",
        "--routers",
        "round_robin,approx",
        "--limit",
        "40",
        "--json",
        "--no-progress",
    )
    assert code == 0
    data = json.loads(out)
    assert set(data) == {"round_robin", "approx"}
    for row in data.values():
        for key in ("hit_rate", "ttft_p50", "ttft_p90", "max_mean_load", "regret"):
            assert key in row
        assert "decision_us_p50" in row and row["num_requests"] == 40


def test_cli_synthetic_table(capsys) -> None:
    code, out, _ = run_cli(
        capsys,
        "route-sim",
        "--synthetic",
        "hot",
        "--requests",
        "60",
        "--replicas",
        "3",
        "--capacity",
        "64",
        "--routers",
        "round_robin",
        "--no-progress",
    )
    assert code == 0
    assert "round_robin" in out and "hit_rate" in out


@pytest.mark.parametrize(
    "argv, needle",
    [
        (["--replicas", "0", "--capacity", "10"], "--replicas"),
        (["--replicas", "2", "--capacity", "x"], "--capacity"),
        (["--replicas", "2", "--capacity", "10", "--routers", "nope"], "nope"),
        (["--replicas", "2", "--capacity", "10", "--rate", "0"], "--rate"),
        (["--replicas", "2", "--capacity", "10", "--csv", "/no/such/dir/x.csv"], "--csv"),
        (["--replicas", "2", "--capacity", "10", "--limit", "0"], "--limit"),
        (["--replicas", "2", "--capacity", "10", "--load", "-1"], "--load"),
        (["--replicas", "2", "--capacity", "10", "--load", "1", "--rate", "2"], "--rate"),
        (["--replicas", "2", "--capacity", "10", "--load", "1"], "--load"),
        (["--replicas", "2", "--capacity", "10", "--token-budget", "64"], "--token-budget"),
        (["--replicas", "2", "--capacity", "10", "--prefill-per-token", "-1"], "--prefill"),
        (["--replicas", "2", "--capacity", "10", "--profile", "tpu"], "--profile"),
        (["--replicas", "2", "--capacity", "10", "--service", "fast"], "--service"),
    ],
)
def test_cli_bad_flags_exit_2_with_one_line(capsys, tmp_path, argv, needle) -> None:
    trace = tmp_path / "t.jsonl"
    trace.write_text('{"timestamp": 0, "input_length": 10, "output_length": 1, "hash_ids": [1]}\n')
    code, out, err = run_cli(capsys, "route-sim", str(trace), *argv)
    assert code == 2 and out == ""
    assert len(err.strip().splitlines()) == 1 and needle in err


def test_cli_load_paces_arrivals_to_the_cacheless_utilization(capsys) -> None:
    """--load 1 slows arrivals until the fleet without a cache is exactly busy: the
    same requests at --load 4 queue far longer."""
    ttft = {}
    for load in ("1", "4"):
        code, out, _ = run_cli(
            capsys,
            "route-sim",
            "--synthetic",
            "hot",
            "--requests",
            "80",
            "--replicas",
            "2",
            "--capacity",
            "64",
            "--routers",
            "round_robin",
            "--load",
            load,
            "--json",
            "--no-progress",
        )
        assert code == 0
        ttft[load] = json.loads(out)["round_robin"]["ttft_p90"]
    assert ttft["4"] > 2 * ttft["1"]


def test_cli_service_profile_and_cost_flags_reach_the_simulator(capsys) -> None:
    """--service picks the discipline, --profile the costs, a cost flag overrides one
    figure; the JSON says which service ran and reports the measured utilisation."""
    base = ["route-sim", "--synthetic", "groups", "--requests", "64", "--replicas", "2"]
    base += ["--capacity", "64", "--routers", "exact", "--json", "--no-progress"]
    rows = {}
    for name, extra in (
        ("h200", []),
        ("serial", ["--service", "serial", "--profile", "cpu"]),
        ("slow", ["--prefill-per-token", "0.001"]),
    ):
        code, out, _ = run_cli(capsys, *base, *extra)
        assert code == 0
        rows[name] = strict_json(out)["exact"]
    assert rows["h200"]["service"] == "batched" and rows["serial"]["service"] == "serial"
    assert 0 < rows["h200"]["utilisation"] <= 1 and rows["h200"]["max_mean_utilisation"] >= 1
    assert rows["slow"]["ttft_p50"] > 5 * rows["h200"]["ttft_p50"]  # 1 ms a token, not 50 us
    assert rows["serial"]["ttft_p50"] > rows["h200"]["ttft_p50"]  # the CPU profile


def test_cli_missing_trace_exits_2(capsys, tmp_path) -> None:
    code, _, err = run_cli(
        capsys, "route-sim", str(tmp_path / "none.jsonl"), "--replicas", "2", "--capacity", "9"
    )
    assert code == 2 and len(err.strip().splitlines()) == 1 and "none.jsonl" in err


def strict_json(text: str) -> dict:
    """``json.loads`` that refuses NaN and Infinity, as a strict JSON parser does."""

    def refuse(constant: str) -> None:
        raise ValueError(f"not strict JSON: {constant}")

    return json.loads(text, parse_constant=refuse)


def groups_argv(requests: int, *extra: str) -> list[str]:
    """``route-sim`` over the synthetic ``groups`` fleet: 2 replicas of 64 blocks."""
    return ["route-sim", "--synthetic", "groups", "--requests", str(requests),
            "--replicas", "2", "--capacity", "64", "--no-progress", *extra]  # fmt: skip


@pytest.mark.parametrize("requests", [16, 20, 33, 1000])
def test_cli_synthetic_groups_simulates_exactly_the_requests_asked(capsys, requests) -> None:
    code, out, _ = run_cli(capsys, *groups_argv(requests, "--routers", "round_robin", "--json"))
    assert code == 0
    assert strict_json(out)["round_robin"]["num_requests"] == requests


@pytest.mark.parametrize("requests", [1, 5, 15])
def test_cli_synthetic_groups_refuses_fewer_requests_than_groups(capsys, requests) -> None:
    code, out, err = run_cli(capsys, *groups_argv(requests))
    assert code == 2 and out == "" and len(err.strip().splitlines()) == 1
    assert f"--requests ({requests}) must be at least --groups (16)" in err


def test_group_sizes_split_a_total_evenly() -> None:
    assert group_sizes(20, 16) == [2] * 4 + [1] * 12
    assert group_sizes(32, 16) == [2] * 16
    assert sum(group_sizes(1000, 16)) == 1000
    with pytest.raises(ValueError, match=r"num_requests must be >= groups \(16\).*got 5"):
        group_sizes(5, 16)
    g = grouped_prompts(3, [1, 4, 2], system_len=2, seed=0)
    heads = [tuple(r.tokens[:2]) for r in g]
    assert sorted(heads.count(h) for h in set(heads)) == [1, 2, 4]
    assert [r.request_id for r in g] == list(range(7))
    # Equal counts give what one count for every group gives (same seed, same workload).
    same, one = grouped_prompts(3, [2, 2, 2], seed=4), grouped_prompts(3, 2, seed=4)
    assert [r.tokens.tolist() for r in same] == [r.tokens.tolist() for r in one]
    with pytest.raises(ValueError, match=r"prompts_per_group must have one count per group \(3\)"):
        grouped_prompts(3, [1, 2])
    with pytest.raises(ValueError, match=r"prompts_per_group\[1\] must be a positive int, got 0"):
        grouped_prompts(3, [1, 0, 2])


def test_cli_json_is_strict_when_a_ratio_is_undefined(capsys, tmp_path) -> None:
    """No block is ever reused (nor full): the single cache hits nothing, so ``vs_single_cache``
    is undefined: ``null`` in JSON (never ``NaN``), ``n/a`` in the table, empty in the CSV."""
    trace = tmp_path / "short.jsonl"
    trace.write_text(
        '{"timestamp": 0, "input_length": 10, "output_length": 1, "hash_ids": [1]}\n'
        '{"timestamp": 5, "input_length": 10, "output_length": 1, "hash_ids": [2]}\n'
    )
    argv = ["route-sim", str(trace), "--replicas", "2", "--capacity", "4", "--no-progress"]
    code, out, _ = run_cli(capsys, *argv, "--routers", "round_robin,exact", "--json")
    assert code == 0
    data = strict_json(out)
    for row in data.values():
        assert row["single_cache_hit_rate"] == 0.0 and row["vs_single_cache"] is None
    csv_path = tmp_path / "rows.csv"
    code, out, _ = run_cli(capsys, *argv, "--routers", "round_robin", "--csv", str(csv_path))
    assert code == 0
    assert out.splitlines()[2].split()[:2] == ["round_robin", "n/a"]
    assert csv_path.read_text().splitlines()[1].endswith(",0.0,")
