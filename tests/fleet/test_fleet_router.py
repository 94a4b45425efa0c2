"""Routing policies: each baseline's rule, CHWBL's load bound, and the prefix-aware routers'
affinity, load guards, namespaces, expiry, speculation and replica loss.

The caller keeps ``in_flight`` (as the protocol says); :class:`Fleet` plays that
caller: it routes, counts, and finishes requests through ``on_finish``.
"""

from __future__ import annotations

import math
from collections.abc import Hashable, Sequence

import numpy as np
import pytest
from hypothesis import example, given
from hypothesis import strategies as st

from radixkv.cache.events import AllBlocksCleared, BlockRemoved, BlockStored
from radixkv.cache.hashing import ChainHasher
from radixkv.fleet.index import chain_hashes
from radixkv.fleet.router import ROUTERS, make_router
from radixkv.fleet.routing import MemoryReporting, ReplicaState, Router, RouteRequest
from radixkv.fleet.scoring import Backlog, TimeCostScoring
from radixkv.fleet.service import ServiceModel

BS = 4
NAMES = sorted(ROUTERS)


class FakeClock:
    def __init__(self, now: float = 0.0) -> None:
        self.now = now

    def __call__(self) -> float:
        return self.now


def req(
    tokens: Sequence[int], rid: Hashable = 0, namespace: Hashable = None, session: Hashable = None
) -> RouteRequest:
    return RouteRequest(rid, np.asarray(tokens, dtype=np.int32), namespace, session)


def states(*in_flight: int, **kw: object) -> list[ReplicaState]:
    return [ReplicaState(f"r{i}", in_flight=n, **kw) for i, n in enumerate(in_flight)]


class Fleet:
    """The caller: routes through ``router``, keeps ``in_flight`` and finishes on request."""

    def __init__(self, router: Router, n: int, capacity_blocks: int = 0) -> None:
        self.router = router
        self.replicas = [ReplicaState(f"r{i}", capacity_blocks=capacity_blocks) for i in range(n)]
        self.running: dict[Hashable, tuple[Hashable, RouteRequest]] = {}

    def state(self, rid: Hashable) -> ReplicaState:
        return next(r for r in self.replicas if r.replica_id == rid)

    def send(self, request: RouteRequest) -> Hashable:
        rid = self.router.choose(request, self.replicas)
        self.state(rid).in_flight += 1
        self.running[request.request_id] = (rid, request)
        return rid

    def finish(self, request_id: Hashable) -> None:
        rid, request = self.running.pop(request_id)
        self.state(rid).in_flight -= 1
        self.router.on_finish(rid, request)

    def drop(self, rid: Hashable) -> None:
        self.replicas = [r for r in self.replicas if r.replica_id != rid]
        self.router.drop_replica(rid)


SYSTEM = list(range(1000, 1064))  # 16 blocks
PROMPT = SYSTEM + list(range(40))  # 26 blocks


# ------------------------------------------------------------------ every policy
@pytest.mark.parametrize("name", NAMES)
def test_every_policy_has_the_router_surface(name: str) -> None:
    router = make_router(name, block_size=BS)
    assert isinstance(router, Router) and router.name == name
    with pytest.raises(ValueError, match="replicas must not be empty"):
        router.choose(req(PROMPT), [])
    reps = states(0, 0, 0)
    assert router.choose(req(PROMPT), reps) in {"r0", "r1", "r2"}
    router.on_events("r0", [])
    router.on_finish("r0", req(PROMPT))
    router.drop_replica("never-seen")


@pytest.mark.parametrize("name", NAMES)
def test_every_policy_reports_its_memory(name: str) -> None:
    router = make_router(name, block_size=BS)
    assert isinstance(router, MemoryReporting)
    fleet = Fleet(router, 2)
    before = router.memory_bytes()
    for k in range(4):
        fleet.send(req(PROMPT[: 8 + 8 * k], k))
    if name in ("approx", "exact"):  # the index's bytes, which grow with its entries
        assert router.memory_bytes() == router.index.memory_bytes() > before
    else:
        assert router.memory_bytes() == before == 0


@pytest.mark.parametrize("name", NAMES)
def test_requests_keep_succeeding_after_a_replica_is_dropped(name: str) -> None:
    fleet = Fleet(make_router(name, block_size=BS), 3)
    for k in range(6):
        fleet.send(req(PROMPT, k, session="s"))
    gone = fleet.running[0][0]
    fleet.drop(gone)
    for k in range(6, 20):
        assert fleet.send(req(PROMPT, k, session="s")) != gone


def test_make_router_names_what_is_wrong() -> None:
    with pytest.raises(ValueError, match=r"name must be one of \[.*'approx'.*\], got 'nope'"):
        make_router("nope", block_size=BS)
    with pytest.raises(TypeError, match="router 'pow2': .*unexpected keyword argument 'ttl'"):
        make_router("pow2", block_size=BS, ttl=3.0)
    with pytest.raises(ValueError, match="block_size must be a positive int, got 0"):
        make_router("round_robin", block_size=0)
    with pytest.raises(ValueError, match="hasher must be a ChainHasher or None"):
        make_router("exact", block_size=BS, hasher="xxhash")
    with pytest.raises(ValueError, match="load_factor must be a number >= 1, got 0.5"):
        make_router("chwbl", block_size=BS, load_factor=0.5)
    with pytest.raises(ValueError, match="tie_break must be 'index' or 'random'"):
        make_router("least_loaded", block_size=BS, tie_break="first")
    with pytest.raises(ValueError, match="externality must be one of .*'extra'.*, got 'some'"):
        make_router("approx", block_size=BS, externality="some")
    with pytest.raises(ValueError, match=r"load_factor must be a number >= 1 or None, got 0.9"):
        make_router("exact", block_size=BS, load_factor=0.9)
    with pytest.raises(ValueError, match="min_gain_blocks must be a non-negative int, got -2"):
        make_router("exact", block_size=BS, min_gain_blocks=-2)
    with pytest.raises(ValueError, match="tokens_per_block must be a positive int, got 0"):
        make_router("exact", block_size=BS, tokens_per_block=0)
    with pytest.raises(ValueError, match=r"service must be a ServiceModel or one of"):
        make_router("approx", block_size=BS, service="tpu")
    with pytest.raises(ValueError, match="clock must be a callable"):
        make_router("exact", block_size=BS, clock=3.0)


# ------------------------------------------------------------------ baselines
def test_round_robin_cycles() -> None:
    router = make_router("round_robin", block_size=BS)
    reps = states(5, 0, 9)
    assert [router.choose(req(PROMPT), reps) for _ in range(7)] == [
        "r0",
        "r1",
        "r2",
        "r0",
        "r1",
        "r2",
        "r0",
    ]


@given(loads=st.lists(st.tuples(st.integers(0, 4), st.integers(0, 3)), min_size=1, max_size=8))
@example(loads=[(1, 0), (0, 2), (0, 1), (0, 1)])  # in flight first, then waiting, then index
def test_least_loaded_picks_the_minimum(loads: list[tuple[int, int]]) -> None:
    reps = [ReplicaState(i, in_flight=f, waiting=w) for i, (f, w) in enumerate(loads)]
    chosen = make_router("least_loaded", block_size=BS).choose(req(PROMPT), reps)
    assert chosen == min(range(len(loads)), key=lambda i: (loads[i], i))
    pick = make_router("least_loaded", block_size=BS, tie_break="random", seed=3)
    assert loads[pick.choose(req(PROMPT), reps)] == min(loads)


def test_least_loaded_random_ties_are_seeded() -> None:
    reps = states(1, 0, 0, 0, 2)

    def picks(seed: int) -> list[Hashable]:
        router = make_router("least_loaded", block_size=BS, tie_break="random", seed=seed)
        return [router.choose(req(PROMPT), reps) for _ in range(40)]

    assert picks(1) == picks(1)
    assert set(picks(1)) == {"r1", "r2", "r3"}


@given(
    loads=st.lists(st.integers(0, 20), min_size=2, max_size=8, unique=True),
    seed=st.integers(0, 100),
)
def test_pow2_never_picks_the_more_loaded_of_its_two(loads: list[int], seed: int) -> None:
    router = make_router("pow2", block_size=BS, seed=seed)
    reps = [ReplicaState(i, in_flight=n) for i, n in enumerate(loads)]
    worst = max(range(len(loads)), key=loads.__getitem__)
    picks = [router.choose(req(PROMPT), reps) for _ in range(30)]
    assert worst not in picks
    pair = make_router("pow2", block_size=BS, seed=seed)
    two = [ReplicaState("a", in_flight=loads[0]), ReplicaState("b", in_flight=loads[1])]
    assert pair.choose(req(PROMPT), two) == ("a" if loads[0] < loads[1] else "b")


def test_pow2_is_seeded() -> None:
    reps = states(0, 0, 0, 0, 0, 0)

    def picks(seed: int) -> list[Hashable]:
        router = make_router("pow2", block_size=BS, seed=seed)
        return [router.choose(req(PROMPT), reps) for _ in range(50)]

    assert picks(7) == picks(7) and picks(7) != picks(8)
    assert make_router("pow2", block_size=BS).choose(req(PROMPT), states(3)) == "r0"


def test_session_sticks_and_falls_back_when_its_replica_goes() -> None:
    fleet = Fleet(make_router("session", block_size=BS), 3)
    first = fleet.send(req(PROMPT, 0, session="alice"))
    assert first == "r0"  # least loaded, first of the ties
    for k in range(1, 6):
        assert fleet.send(req(PROMPT, k, session="alice")) == first  # however loaded
    assert fleet.send(req(PROMPT, 10, session="bob")) == "r1"
    assert fleet.send(req(PROMPT, 11)) == "r2"  # no session: least loaded
    fleet.drop(first)
    moved = fleet.send(req(PROMPT, 20, session="alice"))
    assert moved in {"r1", "r2"}
    assert fleet.send(req(PROMPT, 21, session="alice")) == moved


def test_session_rebinds_when_its_replica_is_not_offered() -> None:
    router = make_router("session", block_size=BS)
    assert router.choose(req(PROMPT, session="s"), states(0, 1)) == "r0"
    assert router.choose(req(PROMPT, session="s"), states(1, 0)[1:]) == "r1"
    assert router.choose(req(PROMPT, session="s"), states(0, 5)) == "r1"


def test_session_bindings_are_bounded() -> None:
    router = make_router("session", block_size=BS, max_sessions=2)
    reps = states(0, 0, 0)
    router.choose(req(PROMPT, session="a"), reps)
    reps[0].in_flight = 1
    router.choose(req(PROMPT, session="b"), reps)
    router.choose(req(PROMPT, session="a"), reps)  # a is now the most recent
    reps[1].in_flight = 1
    router.choose(req(PROMPT, session="c"), reps)  # forgets b
    assert router.replica_of("a") == "r0" and router.replica_of("b") is None
    assert router.replica_of("c") == "r2"


def test_chwbl_keeps_a_prefix_on_one_replica_while_under_the_bound() -> None:
    fleet = Fleet(make_router("chwbl", block_size=BS), 4)
    for r in fleet.replicas:
        r.in_flight = 4
    # total 16 -> bound ceil(1.25 * 17 / 4) = 6; then 17 -> 6; then 18 -> 6
    home = fleet.send(req(SYSTEM[:BS], 0))
    assert fleet.send(req(SYSTEM[:BS] + [1, 2, 3], 1)) == home  # the first block decides
    assert fleet.state(home).in_flight == 6
    assert fleet.send(req(SYSTEM[:BS] + [4], 2)) != home  # 7 > 6: on to the next on the ring


def test_chwbl_spreads_different_prefixes_over_the_ring() -> None:
    fleet = Fleet(make_router("chwbl", block_size=BS), 4)
    homes = set()
    for k in range(0, 400, 4):
        homes.add(fleet.send(req([k, k + 1, k + 2, k + 3], k)))
        fleet.finish(k)
    assert homes == {"r0", "r1", "r2", "r3"}


def test_chwbl_moves_an_overloaded_prefix() -> None:
    router = make_router("chwbl", block_size=BS)
    reps = states(0, 0, 0, 0)
    home = router.choose(req(PROMPT), reps)
    hot = next(r for r in reps if r.replica_id == home)
    hot.in_flight = 2  # total 2, n 4: bound ceil(1.25 * 3 / 4) = 1 < 2 + 1
    moved = router.choose(req(PROMPT), reps)
    assert moved != home
    hot.in_flight = 0
    assert router.choose(req(PROMPT), reps) == home


@given(
    ops=st.lists(st.tuples(st.integers(0, 7), st.booleans()), min_size=1, max_size=120),
    n=st.integers(1, 6),
    c=st.sampled_from([1.0, 1.25, 2.0]),
)
def test_chwbl_load_bound_holds_over_a_random_stream(
    ops: list[tuple[int, bool]], n: int, c: float
) -> None:
    fleet = Fleet(make_router("chwbl", block_size=BS, load_factor=c, vnodes=16), n)
    arrivals_only = True
    for k, (prefix, finish) in enumerate(ops):
        if finish and fleet.running:
            fleet.finish(next(iter(fleet.running)))
            arrivals_only = False
            continue
        rid = fleet.send(req([prefix] * BS + [k], k))
        loads = [r.in_flight for r in fleet.replicas]
        total = sum(loads)
        assert fleet.state(rid).in_flight <= math.ceil(c * total / n)
        if arrivals_only:
            assert max(loads) <= math.ceil(c * total / n)  # the +1 slack is never needed
        if c == 1.25:
            assert fleet.state(rid).in_flight <= math.ceil(1.25 * total / n) + 1


def test_chwbl_drop_replica_takes_its_points_off_the_ring() -> None:
    router = make_router("chwbl", block_size=BS, vnodes=8)
    reps = states(0, 0, 0)
    home = router.choose(req(PROMPT), reps)
    router.drop_replica(home)
    rest = [r for r in reps if r.replica_id != home]
    assert router.choose(req(PROMPT), rest) != home
    assert len(router._points) == 16
    assert router.choose(req(PROMPT), reps) == home  # back: it rejoins the ring where it was
    assert len(router._points) == 24


# ------------------------------------------------------------------ prefix-aware
@pytest.mark.parametrize("name", ["approx", "exact"])
def test_a_shared_prefix_follows_its_first_request(name: str) -> None:
    fleet = Fleet(make_router(name, block_size=BS, clock=FakeClock()), 4, capacity_blocks=1000)
    for k in range(3):  # some background load elsewhere
        fleet.send(req(list(range(500 + 100 * k, 600 + 100 * k)), f"bg{k}"))
    first = fleet.send(req(PROMPT, 0))
    assert first == "r3"  # the only idle replica
    again = fleet.send(req(SYSTEM + list(range(300, 340)), 1))
    assert again == first  # 16 of 26 blocks cached there; one more request in flight


def tail(k: int) -> list[int]:
    """The shared system prompt and 10 blocks of its own (26 blocks in all)."""
    return SYSTEM + list(range(5000 + 40 * k, 5040 + 40 * k))


@pytest.mark.parametrize("name", ["approx", "exact"])
def test_affinity_lasts_while_the_queue_costs_less_than_the_prefill_it_saves(name: str) -> None:
    clock = FakeClock()
    router = make_router(name, block_size=BS, clock=clock)
    fleet = Fleet(router, 3)
    svc = router.scoring.service
    full, part = svc.prefill(26 * BS, 0), svc.prefill(26 * BS, 16 * BS)
    home = fleet.send(req(tail(0), 0))
    clock.now = full  # its prefill is done: the system prompt is there
    # Each follower queues behind the ones before it on home (10 blocks each); an idle
    # replica would prefill all 26. While the queue costs less than that, home wins.
    k = 1
    while k * part < full:
        assert fleet.send(req(tail(k), k)) == home
        k += 1
    assert k > 1 and router.backlog.wait(home, clock.now) == pytest.approx((k - 1) * part)
    away = fleet.send(req(tail(k), k))
    assert away != home  # the queue now costs more than the 16 cached blocks save
    clock.now = 1e6  # the replicas worked their queues off
    assert router.backlog.wait(home, clock.now) == 0.0
    assert fleet.send(req(tail(k + 1), k + 1)) in {home, away}  # both hold the prefix


@pytest.mark.parametrize("name", ["approx", "exact"])
def test_under_load_the_externality_keeps_a_prefix_together(name: str) -> None:
    # Every replica has a queue: sending a request where its prefix is not cached makes
    # the requests queued there wait for the extra prefill too, so affinity holds longer.
    results = {}
    for externality in ("extra", "off"):
        clock = FakeClock()
        router = make_router(name, block_size=BS, clock=clock, externality=externality)
        fleet = Fleet(router, 2)
        fleet.send(req(list(range(9000, 9104)), "bg0"))  # 26 unshared blocks on each
        fleet.send(req(list(range(9200, 9304)), "bg1"))
        for k in range(4):
            fleet.send(req(list(range(9400 + 8 * k, 9408 + 8 * k)), f"small{k}"))
        home = fleet.send(req(tail(0), 0))
        sent = [fleet.send(req(tail(k), k)) for k in range(1, 6)]
        results[externality] = sum(r == home for r in sent)
    assert results["extra"] > results["off"]


@pytest.mark.parametrize("name", ["approx", "exact"])
def test_new_prefixes_spread_by_free_kv_then_in_turn_never_by_list_order(name: str) -> None:
    router = make_router(name, block_size=BS, clock=FakeClock())
    reps = [ReplicaState(f"r{i}", capacity_blocks=64) for i in range(4)]
    # Idle replicas, prefixes no one holds: equal time, so free KV, then fewest blocks taken.
    chosen = [router.choose(req(list(range(100 * k, 100 * k + 40)), k), reps) for k in range(8)]
    assert sorted(chosen) == ["r0", "r0", "r1", "r1", "r2", "r2", "r3", "r3"]
    if name == "exact":  # the events say r2 is nearly empty and the others full
        fresh = make_router(name, block_size=BS, clock=FakeClock())
        for i in (0, 1, 3):
            block = list(range(10_000 * (i + 1), 10_000 * (i + 1) + 64 * BS))
            hashes = chain_hashes(fresh.hasher, block, BS, None)
            fresh.on_events(f"r{i}", [BlockStored(hashes, None, block, BS, None, "GPU", None)])
        assert fresh.choose(req(list(range(40))), reps) == "r2"


@pytest.mark.parametrize("name", ["approx", "exact"])
def test_load_factor_bounds_in_flight_relative_to_the_fleet(name: str) -> None:
    picks = {}
    for factor in (None, 1.25):
        router = make_router(name, block_size=BS, clock=FakeClock(), load_factor=factor)
        reps = states(0, 0, 0, 0)
        home = router.choose(req(PROMPT), reps)
        router.backlog.drop(home)  # as if its prefill were done: home is the best by time
        next(r for r in reps if r.replica_id == home).in_flight = 2
        # bound ceil(1.25 * (2 + 1) / 4) = 1: home, at 2 in flight, is over it
        picks[factor] = router.choose(req(PROMPT, 1), reps) == home
    assert picks == {None: True, 1.25: False}
    router = make_router(name, block_size=BS, clock=FakeClock(), load_factor=1.25)
    reps = states(2, 2, 2, 2)  # all at the bound: none is filtered
    home = router.choose(req(PROMPT), reps)
    router.backlog.drop(home)
    assert router.choose(req(PROMPT, 1), reps) == home


@pytest.mark.parametrize("name", ["approx", "exact"])
@pytest.mark.parametrize("min_gain", [2, 3])
def test_a_small_gain_is_not_worth_affinity(name: str, min_gain: int) -> None:
    clock = FakeClock()
    router = make_router(name, block_size=BS, clock=clock, min_gain_blocks=min_gain)
    reps = states(0, 0)
    assert router.choose(req(SYSTEM[:8]), reps) == "r0"  # 2 blocks on r0
    clock.now = 10.0  # prefilled: no queue anywhere
    # 2 of 4 blocks cached on r0: the time cost says r0, but the gain over the replica
    # with the least wait and the most free KV (r1) is 2 blocks
    want = "r0" if min_gain <= 2 else "r1"
    assert router.choose(req(SYSTEM[:8] + [7] * 8, 1), reps) == want


@pytest.mark.parametrize("name", ["approx", "exact"])
def test_namespaces_never_count_as_sharing(name: str) -> None:
    router = make_router(name, block_size=BS, clock=FakeClock())
    reps = states(0, 0)
    assert router.choose(req(PROMPT, namespace="tenant-a"), reps) == "r0"
    reps[0].in_flight = 1
    assert router.choose(req(PROMPT, namespace="tenant-b"), reps) == "r1"
    assert router.choose(req(PROMPT), reps) in {"r0", "r1"}
    assert router.index.match(chain_hashes(router.hasher, PROMPT, BS, "tenant-c")) == {}
    reps[1].in_flight = 1
    assert router.choose(req(PROMPT, namespace="tenant-a"), reps) == "r0"


def test_approx_remembers_without_a_ttl_by_default() -> None:
    clock = FakeClock()
    router = make_router("approx", block_size=BS, clock=clock)
    fleet = Fleet(router, 2, capacity_blocks=1000)
    home = fleet.send(req(PROMPT, 0))
    fleet.finish(0)
    clock.now = 1e7  # no wall-clock guess: what it remembers follows capacity alone
    assert fleet.send(req(PROMPT, 1)) == home
    assert router.index.ttl == math.inf


def test_approx_affinity_expires_with_its_ttl() -> None:
    clock = FakeClock()
    router = make_router("approx", block_size=BS, clock=clock, ttl=30.0)
    reps = states(0, 0)
    assert router.choose(req(PROMPT), reps) == "r0"
    reps[0].in_flight = 1
    clock.now = 30.0
    assert router.choose(req(PROMPT, 1), reps) == "r0"  # renewed at 30
    clock.now = 60.5
    assert router.choose(req(PROMPT, 2), reps) == "r1"  # expired: least loaded


def test_approx_sizes_each_replica_index_from_its_capacity() -> None:
    router = make_router("approx", block_size=BS, clock=FakeClock())
    reps = [ReplicaState("r0", capacity_blocks=20)]
    for k in range(5):
        router.choose(req(list(range(100 * k, 100 * k + 60)), k), reps)
    assert router.index.num_entries("r0") == 20
    router.index.check()


def test_exact_routes_to_the_replica_whose_events_say_it_holds_the_prefix() -> None:
    hasher = ChainHasher("xxhash", seed=42)
    router = make_router("exact", block_size=BS, hasher=hasher, clock=FakeClock())
    hashes = chain_hashes(hasher, PROMPT, BS, None)
    router.on_events("r2", [BlockStored(hashes[:16], None, SYSTEM, BS, None, "GPU", None)])
    reps = states(1, 0, 1)
    assert router.choose(req(PROMPT), reps) == "r2"  # more loaded than r1, but 16 blocks cached
    router.on_events("r2", [BlockRemoved([hashes[0]], "GPU")])
    assert router.index.blocks("r2") == set(hashes[1:16])
    assert router.choose(req(PROMPT, 1), reps) == "r2"  # request 0, queued there, claims it
    router.on_finish("r2", req(PROMPT, 0))
    router.on_finish("r2", req(PROMPT, 1))
    third = router.choose(req(PROMPT, 2), reps)
    assert third != "r2"  # its chain now breaks at block 0
    router.on_events(third, [AllBlocksCleared()])  # clears the speculative entries there too
    assert router.index.match(hashes) == {}
    other = make_router("exact", block_size=BS, clock=FakeClock())  # another hash seed
    other.on_events("r2", [BlockStored(hashes, None, PROMPT[:104], BS, None, "GPU", None)])
    assert other.index.match(chain_hashes(other.hasher, PROMPT, BS, None)) == {}


def test_exact_speculation_lasts_until_the_request_ends_or_the_events() -> None:
    clock = FakeClock()
    router = make_router("exact", block_size=BS, clock=clock)
    fleet = Fleet(router, 2)
    hashes = chain_hashes(router.hasher, PROMPT, BS, None)
    assert fleet.send(req(PROMPT, 0)) == "r0"
    assert router.index.speculative("r0") == set(hashes)
    clock.now = 1000.0  # queued however long: no event came, the request still stands
    assert fleet.send(req(PROMPT, 1)) == "r0"  # speculative hit
    fleet.finish(0)
    assert router.index.speculative("r0") == set(hashes)  # request 1 still claims them
    fleet.finish(1)  # both ended without their blocks reported: the guess goes
    assert router.index.speculative("r0") == set()
    assert router.index.match(hashes) == {}
    home = fleet.send(req(PROMPT, 2))
    router.on_events(home, [BlockStored(hashes, None, PROMPT[:104], BS, None, "GPU", None)])
    fleet.finish(2)
    clock.now = 1e6
    assert router.index.match(hashes) == {home: 26}  # real now: it stays
    assert router.index.safety_expired == 0
    router.index.check()


@pytest.mark.parametrize("name", ["approx", "exact"])
def test_prefix_router_drop_replica_forgets_its_prefixes(name: str) -> None:
    fleet = Fleet(make_router(name, block_size=BS, clock=FakeClock()), 3)
    home = fleet.send(req(PROMPT, 0))
    fleet.drop(home)
    assert fleet.router.index.match(chain_hashes(fleet.router.hasher, PROMPT, BS, None)) == {}
    assert fleet.send(req(PROMPT, 1)) != home
    fleet.router.index.check()


# ------------------------------------------------------------------ the cost function
def test_backlog_drains_with_the_clock_and_settles_on_finish() -> None:
    b = Backlog()
    b.add("r", "a", 2.0, now=0.0)
    b.add("r", "b", 3.0, now=0.0)
    b.add("r", "c", 1.0, now=0.0)
    assert b.wait("r", 0.0) == 6.0 and b.queued("r", 0.0) == pytest.approx(3.0)
    assert b.wait("r", 4.0) == 2.0  # worked off at one second a second
    assert b.queued("r", 4.0) == pytest.approx(2.0 * 3 / 6.0)
    b.done("r", "b", now=1.0)  # b finished: a and b are past prefill; at most c's is left
    assert b.wait("r", 1.0) == 1.0
    b.done("r", "b", now=1.0)  # a second report changes nothing
    b.done("r", "c", now=1.5)
    assert b.wait("r", 1.5) == 0.0 and b.queued("r", 1.5) == 0.0
    b.add("r", "d", 1.0, now=10.0)  # an idle replica starts from now
    assert b.wait("r", 10.0) == 1.0
    b.drop("r")
    assert b.wait("r", 10.0) == 0.0 and b.wait("never", 0.0) == 0.0


def test_time_cost_prices_prefill_with_the_service_model() -> None:
    svc = ServiceModel(prefill_per_token=1.0, attention_per_key=0.0, step_overhead=0.0)
    scoring = TimeCostScoring(svc, tokens_per_block=2, externality="off")
    reps = [ReplicaState("hot"), ReplicaState("cold")]
    b = Backlog()
    b.add("hot", "q", 11.0, now=0.0)

    def pick(matched: dict, backlog: Backlog = b) -> tuple[str, float]:
        r, own = scoring.pick(reps, matched, 10, backlog, 0.0, lambda r: 0.0, lambda r: 0)
        return r.replica_id, own

    # hot: 11 s of queue + (10 - 8 blocks) x 2 tokens x 1 s = 15 s; cold: 20 s
    assert pick({"hot": 8}) == ("hot", 4.0)
    assert pick({"hot": 4}) == ("cold", 20.0)  # 11 + 12 > 20
    assert pick({}) == ("cold", 20.0)
    extra = TimeCostScoring(svc, tokens_per_block=2)  # default externality: "extra"
    b2 = Backlog()
    b2.add("hot", "q", 13.0, now=0.0)
    b2.add("cold", "x", 1.0, now=0.0)
    b2.add("cold", "y", 1.0, now=0.0)
    # hot: 13 + 10 = 23 s; cold: 2 + 20 = 22 s, plus its 2 queued requests waiting for the
    # 10 s of prefill hot would not need: 22 + 2 x 10 = 42 s
    r, _ = scoring.pick(reps, {"hot": 5}, 10, b2, 0.0, lambda r: 0.0, lambda r: 0)
    assert r.replica_id == "cold"
    r, _ = extra.pick(reps, {"hot": 5}, 10, b2, 0.0, lambda r: 0.0, lambda r: 0)
    assert r.replica_id == "hot"


@pytest.mark.parametrize("min_gain", [0, 1])
def test_exact_ties_go_round_in_turn_from_any_start(min_gain: int) -> None:
    # Three idle replicas, nothing cached, equal fill and blocks taken: the turn decides,
    # starting from replica turn % 3 (with min_gain_blocks, through the least-wait pick)
    scoring = TimeCostScoring(min_gain_blocks=min_gain)
    reps = [ReplicaState(f"r{i}") for i in range(3)]
    picks = [
        scoring.pick(reps, {}, 4, Backlog(), 0.0, lambda r: 0.0, lambda r: 0, turn=t)[0]
        for t in range(7)
    ]
    assert [r.replica_id for r in picks] == ["r0", "r1", "r2", "r0", "r1", "r2", "r0"]


def test_ties_go_to_free_kv_then_fewest_blocks_taken_then_the_turn() -> None:
    scoring = TimeCostScoring()
    reps = [ReplicaState(f"r{i}") for i in range(3)]
    fill = {"r0": 0.5, "r1": 0.1, "r2": 0.1}
    taken = {"r0": 0, "r1": 9, "r2": 3}

    def pick(turn: int) -> str:
        r, _ = scoring.pick(
            reps,
            {},
            4,
            Backlog(),
            0.0,
            lambda r: fill[r.replica_id],
            lambda r: taken[r.replica_id],
            turn=turn,
        )
        return r.replica_id

    assert [pick(t) for t in range(3)] == ["r2", "r2", "r2"]  # least fill, then fewest taken
    taken["r1"] = 3
    assert [pick(t) for t in range(3)] == ["r1", "r1", "r2"]  # r1 and r2 tie: the turn


def test_backlog_caps_at_a_finish_and_floors_at_the_replica_s_waiting() -> None:
    b = Backlog()
    b.add("r", "a", 2.0, now=0.0)
    b.add("r", "b", 2.0, now=0.0)
    b.add("r", "c", 2.0, now=0.0)
    b.done("r", "b", now=1.0)  # at most c's 2 s are left, from 1.0
    assert b.wait("r", 2.5) == 0.5  # and worked off with the clock since
    b.add("r", "d", 2.0, now=2.5)  # behind c's last half second
    assert b.wait("r", 2.5) == 2.5
    # the replica says 2 requests wait: a floor of 2 mean prefills (2 s each), up to the total
    assert b.wait("r", 4.5, waiting=2) == 4.0 and b.wait("r", 4.5) == 0.5
    assert b.wait("r", 4.5, waiting=9) == 4.0


def test_full_externality_charges_all_the_prefill_to_the_queue() -> None:
    svc = ServiceModel(prefill_per_token=1.0, attention_per_key=0.0, step_overhead=0.0)
    reps = [ReplicaState("hot"), ReplicaState("cold")]
    b = Backlog()
    for k in range(10):
        b.add("hot", k, 1.0, now=0.0)  # ten requests of 1 s queued on hot
    picks = {}
    for mode in ("extra", "full"):
        scoring = TimeCostScoring(svc, tokens_per_block=2, externality=mode)
        r, _ = scoring.pick(reps, {"hot": 8}, 10, b, 0.0, lambda r: 0.0, lambda r: 0)
        picks[mode] = r.replica_id
    # hot: 10 s of queue + 4 s own; cold: 20 s own. "extra": hot's own is the least, so it
    # costs the queue nothing: 14 < 20. "full": 14 + 4 x 10 queued = 54 > 20
    assert picks == {"extra": "hot", "full": "cold"}


def test_min_gain_falls_back_to_the_replica_with_the_least_wait_first() -> None:
    scoring = TimeCostScoring(min_gain_blocks=3)
    reps = [ReplicaState("busy"), ReplicaState("idle")]
    b = Backlog()
    b.add("busy", "q", 5.0, now=0.0)
    fill = {"busy": 0.0, "idle": 0.5}  # the busy one has more free KV
    r, _ = scoring.pick(reps, {}, 4, b, 0.0, lambda r: fill[r.replica_id], lambda r: 0)
    assert r.replica_id == "idle"


def test_the_load_bound_counts_the_request_being_placed() -> None:
    # CHWBL: in_flight + 1 <= ceil(load_factor * (total + 1) / n); total 3: ceil(4 / 3) = 2
    scoring = TimeCostScoring(load_factor=1.0)
    ids = [r.replica_id for r in scoring.eligible(states(2, 1, 0))]
    assert ids == ["r1", "r2"]
