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

from radixkv.cache.events import AllBlocksCleared, BlockRemoved, BlockStored, ChainHasher
from radixkv.fleet.index import chain_hashes
from radixkv.fleet.protocol import ReplicaState, Router, RouteRequest
from radixkv.fleet.router import ROUTERS, LoadAwareScoring, make_router

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
    with pytest.raises(ValueError, match="block_size must be an int >= 1, got 0"):
        make_router("round_robin", block_size=0)
    with pytest.raises(ValueError, match="hasher must be a ChainHasher or None"):
        make_router("exact", block_size=BS, hasher="xxhash")
    with pytest.raises(ValueError, match="load_factor must be a number >= 1, got 0.5"):
        make_router("chwbl", block_size=BS, load_factor=0.5)
    with pytest.raises(ValueError, match="tie_break must be 'index' or 'random'"):
        make_router("least_loaded", block_size=BS, tie_break="first")
    with pytest.raises(ValueError, match="kv_usage_threshold must be a number >= 0"):
        make_router("approx", block_size=BS, kv_usage_threshold=-1)
    with pytest.raises(ValueError, match="max_load_gap must be an int >= 0, got -2"):
        make_router("exact", block_size=BS, max_load_gap=-2)


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


@pytest.mark.parametrize("name", ["approx", "exact"])
def test_an_overloaded_replica_loses_its_affinity(name: str) -> None:
    # A heavy prefill weight: by cost alone the cached replica would win at any of these loads.
    router = make_router(name, block_size=BS, clock=FakeClock(), max_load_gap=3, prefill_weight=10)
    reps = states(0, 0, 0)
    home = router.choose(req(PROMPT), reps)
    hot = next(r for r in reps if r.replica_id == home)
    hot.in_flight = 3  # gap 3: still a candidate
    assert router.choose(req(PROMPT, 1), reps) == home
    hot.in_flight = 4  # gap 4 > 3: filtered out
    assert router.choose(req(PROMPT, 2), reps) != home
    hot.in_flight = 0
    hot.kv_usage = 0.99  # KV nearly full: filtered out too
    assert router.choose(req(PROMPT, 3), reps) != home
    for r in reps:
        r.kv_usage = 0.99  # all over the threshold: none is filtered
    assert router.choose(req(PROMPT, 4), reps) == home


@pytest.mark.parametrize("name", ["approx", "exact"])
@pytest.mark.parametrize("min_gain", [2, 3])
def test_a_small_gain_is_not_worth_affinity(name: str, min_gain: int) -> None:
    router = make_router(name, block_size=BS, clock=FakeClock(), min_gain_blocks=min_gain)
    reps = states(0, 0)
    assert router.choose(req(SYSTEM[:8]), reps) == "r0"
    reps[0].in_flight = 1
    # 2 of 4 blocks cached on r0: cost 2 * 2 + 2 (decode) < 2 * 4 on r1, but the gain is 2 blocks
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
    assert router.choose(req(PROMPT, 1), reps) == "r1"  # its chain now breaks at block 0
    router.on_events("r1", [AllBlocksCleared()])  # clears r1's speculative entries too
    assert router.index.match(hashes) == {}
    other = make_router("exact", block_size=BS, clock=FakeClock())  # another hash seed
    other.on_events("r2", [BlockStored(hashes, None, PROMPT[:104], BS, None, "GPU", None)])
    assert other.index.match(chain_hashes(other.hasher, PROMPT, BS, None)) == {}


def test_exact_speculation_lasts_until_its_ttl_or_the_events() -> None:
    clock = FakeClock()
    router = make_router("exact", block_size=BS, clock=clock, spec_ttl=2.0)
    reps = states(0, 0)
    assert router.choose(req(PROMPT), reps) == "r0"
    hashes = chain_hashes(router.hasher, PROMPT, BS, None)
    assert router.index.speculative("r0") == set(hashes)
    reps[0].in_flight = 1
    clock.now = 1.0
    assert router.choose(req(PROMPT, 1), reps) == "r0"  # speculative hit
    clock.now = 3.5  # past both deadlines, and no event came
    assert router.choose(req(PROMPT, 2), reps) == "r1"
    router.on_events("r1", [BlockStored(hashes, None, PROMPT[:104], BS, None, "GPU", None)])
    clock.now = 100.0
    reps[1].in_flight = 1
    reps[0].in_flight = 0
    assert router.choose(req(PROMPT, 3), reps) == "r1"  # real now: no expiry
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
def test_cost_weighs_uncached_prefill_against_decode_load() -> None:
    scoring = LoadAwareScoring(prefill_weight=1.0, min_gain_blocks=1)
    reps = [ReplicaState("hot", in_flight=2), ReplicaState("cold", in_flight=0)]

    def decode(per_request: float) -> object:
        return lambda r: r.in_flight * per_request

    # cost(hot) = 2 * (10 - 8) + 2 * d, cost(cold) = 2 * 10: hot wins while d < 8
    assert scoring.pick(reps, {"hot": 8}, 10, decode(7.5)).replica_id == "hot"
    assert scoring.pick(reps, {"hot": 8}, 10, decode(8.5)).replica_id == "cold"
    tie = scoring.pick(reps, {"hot": 8}, 10, decode(8.0))
    assert tie.replica_id == "cold"  # equal cost: fewer in flight
    heavy = LoadAwareScoring(prefill_weight=3.0, min_gain_blocks=1)
    assert heavy.pick(reps, {"hot": 8}, 10, decode(15.0)).replica_id == "hot"  # 8+30 < 40


def test_decode_load_follows_the_requests_in_flight() -> None:
    router = make_router("approx", block_size=BS, clock=FakeClock())
    fleet = Fleet(router, 2)
    long = req(list(range(400)), "long")  # 100 blocks
    assert fleet.send(long) == "r0"
    short = [req(list(range(1000 + 8 * k, 1008 + 8 * k)), k) for k in range(3)]  # 2 blocks
    fleet.send(short[0])
    assert router._decode_blocks(fleet.state("r0")) == 100
    assert router._decode_blocks(fleet.state("r1")) == 2
    assert fleet.send(short[1]) == "r0"  # one in flight each: the first
    assert router._decode_blocks(fleet.state("r0")) == 102  # 100 + 2 blocks in flight
    fleet.finish("long")
    assert router._decode_blocks(fleet.state("r0")) == 2
    fleet.finish(1)
    assert router._decode_blocks(fleet.state("r0")) == 0
