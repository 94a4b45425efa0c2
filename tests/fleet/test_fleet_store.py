"""A KV store shared by a simulated fleet, and the prefix routers' store-aware cost.

Hand-computed store hits and load costs in the simulator (write-back and
write-through), the router's pricing of what any replica can fetch from the
store, the off path pinned bit for bit, and ``route-sim``'s store flags.
"""

from __future__ import annotations

import hashlib
import json

import numpy as np
import pytest
from test_fleet_sim import RoundRobin, run_cli, strict_json

from radixkv.cache.allocator import BlockAllocator
from radixkv.cache.hashing import ChainHasher
from radixkv.cache.store import MemoryStore
from radixkv.fleet.replica import FLEET_HASHER, Replica
from radixkv.fleet.router import make_router
from radixkv.fleet.routing import ReplicaState, RouteRequest
from radixkv.fleet.scoring import Backlog, TimeCostScoring
from radixkv.fleet.service import ServiceModel
from radixkv.fleet.shared_store import (
    PAYLOAD_BYTES,
    DeviceOnly,
    NullByteCopier,
    SharedStore,
    StoreView,
    sim_keyspace,
)
from radixkv.fleet.sim import (
    SERVICE_PROFILES,
    BatchConfig,
    FleetSim,
    SimClock,
    SimRequest,
    build_router,
    offered_load,
    simulate,
)
from radixkv.fleet.workloads import group_sizes, grouped_prompts

A = 1e-3  # seconds per computed token
FAST = ServiceModel(prefill_per_token=A, attention_per_key=0.0, decode_per_token=1e-3)


def req(i: int, arrival: float, tokens: list[int]) -> SimRequest:
    return SimRequest(i, arrival, np.asarray(tokens, dtype=np.int32), len(tokens) * 512, 1)


# ------------------------------------------------------------------ the simulator
@pytest.mark.parametrize("policy", ["write_back", "write_through"])
def test_a_prefix_one_replica_let_go_of_is_a_store_hit_on_another(policy) -> None:
    """Round robin over 2 replicas of 4 device and 4 host blocks. Replica 0 computes A,
    then C (A goes to its host) and D (C goes to the host, A out of it). A then
    reaches the store: at the host's eviction (write_back) or at its backup
    (write_through). Replica 1, which never saw A, loads all of it from the store:
    its TTFT is the load alone, 0.25 x A a token, as it computes nothing."""
    a, b, c, d, e = ([10 * k + j for j in range(4)] for k in range(1, 6))
    reqs = [req(0, 0.0, a), req(1, 10.0, b), req(2, 20.0, c), req(3, 30.0, e),
            req(4, 40.0, d), req(5, 50.0, a)]  # fmt: skip
    store = SharedStore(64, host_capacity_blocks=4, write_policy=policy, load_cost=0.25)
    sim = FleetSim(num_replicas=2, capacity_blocks=4, service=FAST, store=store)
    res = sim.run(reqs, RoundRobin())
    assert res.replica.tolist() == [0, 1, 0, 1, 0, 1]
    assert res.hit_ids.tolist() == [0, 0, 0, 0, 0, 4]
    assert res.store_ids.tolist() == [0, 0, 0, 0, 0, 4]
    assert res.host_ids.tolist() == [0] * 6
    assert res.store_hit_rate == res.hit_rate == pytest.approx(4 / 24)
    assert res.host_hit_rate == 0.0
    assert res.ttft[5] == pytest.approx(0.25 * A * 4 * 512)  # the load, no prefill
    assert res.ttft[4] == pytest.approx(FAST.prefill(2048, 0))
    assert store.store.stats.hits == 4
    for rep in sim.replicas:
        rep.cache.check()
    store.store.check()


def test_host_hits_and_store_hits_are_told_apart_and_costed_apart() -> None:
    """Serial service, one replica of 5 device and 8 host blocks (write_back). [1..4],
    [5..8], [9..12] each send the one before to the host; [13..16] sends [9..12] there,
    pushing [1..4] out into the store. [1..4, 17]: 4 blocks loaded from the store, 1
    computed; making room on the device sends [13..16] to the host. [13..16, 18]: 4
    loaded from the host, 1 computed. Each pays its own tier's load."""
    a, b, c, d = ([4 * k + j for j in range(1, 5)] for k in range(4))
    reqs = [req(0, 0.0, a), req(1, 10.0, b), req(2, 20.0, c), req(3, 30.0, d),
            req(4, 40.0, [*a, 17]), req(5, 50.0, [*d, 18])]  # fmt: skip
    store = SharedStore(64, host_capacity_blocks=8, load_cost=0.5, host_load_cost=0.125)
    sim = FleetSim(num_replicas=1, capacity_blocks=5, service=FAST, store=store)
    res = sim.run(reqs, RoundRobin())
    assert res.hit_ids.tolist() == [0, 0, 0, 0, 4, 4]
    assert res.store_ids.tolist() == [0, 0, 0, 0, 4, 0]
    assert res.host_ids.tolist() == [0, 0, 0, 0, 0, 4]
    assert res.ttft[4] == pytest.approx(0.5 * A * 2048 + FAST.prefill(2560, 2048))
    assert res.ttft[5] == pytest.approx(0.125 * A * 2048 + FAST.prefill(2560, 2048))
    assert res.hit_rate == pytest.approx(res.store_hit_rate + res.host_hit_rate)
    sim.replicas[0].cache.check()


def test_batched_replicas_stall_for_their_loads_and_count_them_as_work() -> None:
    """Batched service: a load stalls the replica before the steps that follow it, so a
    store hit's TTFT is its load plus its remaining prefill, and the load is work."""
    reqs = [req(0, 0.0, [1, 2, 3, 4]), req(1, 10.0, [5, 6, 7, 8]), req(2, 20.0, [9, 10, 11, 12]),
            req(3, 30.0, [1, 2, 3, 4, 13])]  # fmt: skip
    store = SharedStore(64, host_capacity_blocks=4, load_cost=0.5)
    sim = FleetSim(
        num_replicas=1, capacity_blocks=5, service=FAST, batch=BatchConfig(), store=store
    )
    res = sim.run(reqs, RoundRobin())
    assert res.store_ids.tolist() == [0, 0, 0, 4]
    assert res.ttft[3] == pytest.approx(0.5 * A * 2048 + FAST.prefill(2560, 2048))
    rep = sim.replicas[0]
    computed = 3 * FAST.prefill(2048, 0) + FAST.prefill(2560, 2048)
    assert rep.work == pytest.approx(computed + 0.5 * A * 2048)


def test_the_shared_store_is_real_and_sized_in_blocks() -> None:
    store = SharedStore(3, host_capacity_blocks=2)
    assert store.store.capacity_bytes == 3 * (64 + PAYLOAD_BYTES)
    ks = sim_keyspace(1)
    keys = ks.block_keys([1, 2, 3, 4])
    assert store.store.put_many([(k, bytes(PAYLOAD_BYTES)) for k in keys]) == 4
    assert store.store.stats.num_entries == 3  # one evicted: exactly 3 blocks fit
    copier = NullByteCopier()
    assert copier.host_blocks_to_bytes(np.arange(2, dtype=np.int32)) == [bytes(8)] * 2
    with pytest.raises(ValueError, match="allocator.block_size must be the store's 1, got 2"):
        store.make_cache(BlockAllocator(4, 2), "lru", ChainHasher("xxhash", seed=0))


@pytest.mark.parametrize(
    "kwargs, needle",
    [
        ({"capacity_blocks": 0}, "capacity_blocks"),
        ({"host_capacity_blocks": 0}, "host_capacity_blocks"),
        ({"write_policy": "later"}, "write_policy must be one of"),
        ({"load_cost": -0.5}, "load_cost"),
        ({"host_load_cost": float("nan")}, "host_load_cost"),
        ({"block_size": 0}, "block_size"),
    ],
)
def test_shared_store_refuses_bad_arguments(kwargs, needle) -> None:
    args = {"capacity_blocks": 8, "host_capacity_blocks": 8, **kwargs}
    with pytest.raises(ValueError, match=needle):
        SharedStore(args.pop("capacity_blocks"), **args)


def test_fleet_sim_refuses_a_store_that_is_not_a_shared_store() -> None:
    with pytest.raises(ValueError, match="store must be a SharedStore or None"):
        FleetSim(num_replicas=1, capacity_blocks=4, store=MemoryStore(100))  # type: ignore[arg-type]


# Known answers, computed on the code before the shared store existed (main at aa0d5fd):
# sha256 of (replica, hit_ids, ttft) per run. The store's hooks are in the scheduler's
# arithmetic (a load of 0.0 s) and the router's pricing (the plain prefill): off, every
# request must go where it went, hit what it hit, and see the same TTFT to the bit.
PINNED = {
    ("batched", "round_robin"): "bf798ea91c6ce734",
    ("batched", "approx"): "d5dbabaedfdeccd6",
    ("batched", "exact"): "abea36618c6149ea",
    ("serial", "round_robin"): "4bc1d62d0b3cfc66",
    ("serial", "approx"): "1ea9ad9263693bf8",
    ("serial", "exact"): "c084a6d1cb48d521",
}


@pytest.mark.parametrize("key", sorted(PINNED))
def test_without_a_store_every_run_is_bit_identical_to_before(key) -> None:
    service_name, name = key
    svc = SERVICE_PROFILES["h200"]
    reqs = grouped_prompts(8, group_sizes(240, 8), system_len=8, seed=3)
    batch = BatchConfig() if service_name == "batched" else None
    rate = 2.0 / offered_load(reqs, svc, 3, batch=batch)
    clock = SimClock()
    r = simulate(reqs, build_router(name, clock, service=svc), num_replicas=3,
                 capacity_blocks=40, service=svc, batch=batch, rate=rate, clock=clock)  # fmt: skip
    got = hashlib.sha256(r.replica.tobytes() + r.hit_ids.tobytes() + r.ttft.tobytes())
    assert got.hexdigest()[:16] == PINNED[key]
    assert r.host_hit_rate == r.store_hit_rate == 0.0


def test_device_only_places_as_place_prompt_does() -> None:
    tiers = DeviceOnly()
    cache = tiers.make_cache(BlockAllocator(8, 1), "lru", ChainHasher("xxhash", seed=0))
    first = tiers.place(cache, np.array([1, 2, 3], np.int32), None, True)
    cache.allocator.decref_distinct(first.blocks)
    again = tiers.place(cache, np.array([1, 2, 4], np.int32), None, True)
    assert (again.num_cached_tokens, again.host_tokens, again.store_tokens) == (2, 0, 0)
    assert tiers.load_seconds(FAST, 100, 100) == 0.0


# ------------------------------------------------------------------ the router's cost
SVC = ServiceModel(prefill_per_token=50e-6, attention_per_key=0.0, decode_per_token=1e-6)
PROMPT = np.arange(100, 110, dtype=np.int32)  # 10 blocks of 1 token (512 real tokens each)


def view_holding(blocks: int, load_cost: float = 0.1) -> StoreView:
    """A view of a store holding the first ``blocks`` blocks of PROMPT."""
    ks = sim_keyspace(1)
    store = MemoryStore(1 << 20)
    store.put_many([(k, b"x") for k in ks.block_keys(PROMPT[:blocks])])
    return StoreView(store, ks, load_cost)


def test_the_store_prices_what_any_replica_can_fetch_below_recompute() -> None:
    """A replica with nothing cached, the store holding the whole prompt: 10 blocks loaded
    at 0.1 x the prefill per token, not computed. Past a replica's own prefix, only
    the store's run beyond it counts; with nothing stored, the plain prefill."""
    price = view_holding(10).pricer(PROMPT, None, 10, SVC, 512)
    recompute = SVC.prefill(5120, 0)
    assert price(0) == pytest.approx(0.1 * 50e-6 * 5120) and price(0) < recompute / 9
    assert price(4) == pytest.approx(0.1 * 50e-6 * 6 * 512)
    assert price(10) == 0.0
    partial = view_holding(3).pricer(PROMPT, None, 10, SVC, 512)
    assert partial(0) == pytest.approx(0.1 * 50e-6 * 3 * 512 + SVC.prefill(5120, 1536))
    assert partial(5) == SVC.prefill(5120, 2560)  # the store holds nothing past block 5
    empty = view_holding(0).pricer(PROMPT, None, 10, SVC, 512)
    assert [empty(m) for m in range(11)] == [SVC.prefill(5120, m * 512) for m in range(11)]


def test_store_awareness_moves_a_request_off_a_busy_replica_holding_its_prefix() -> None:
    """"hot" holds the prompt but has 0.1 s queued; "cold" holds nothing. Recomputing on
    cold costs 0.256 s: without the store, hot wins. With the store holding the prompt,
    cold loads it in 0.0256 s and wins; with a load as dear as compute, hot again."""
    scoring = TimeCostScoring(SVC, tokens_per_block=512, externality="off")
    reps = [ReplicaState("hot"), ReplicaState("cold")]
    b = Backlog()
    b.add("hot", "q", 0.1, now=0.0)

    def pick(view: StoreView | None) -> tuple[str, float]:
        own = None if view is None else view.pricer(PROMPT, None, 10, SVC, 512)
        r, cost = scoring.pick(reps, {"hot": 10}, 10, b, 0.0, lambda r: 0.0, lambda r: 0, 0, own)
        return r.replica_id, cost

    assert pick(None) == ("hot", 0.0)
    assert pick(view_holding(0)) == ("hot", 0.0)  # an empty store changes nothing
    name, cost = pick(view_holding(10))
    assert name == "cold" and cost == pytest.approx(0.0256)
    assert pick(view_holding(10, load_cost=1.0))[0] == "hot"


def test_exact_router_with_a_store_view_routes_by_it_and_without_one_does_not() -> None:
    """End to end through ``on_events`` and ``choose``: replica "a" reports the prompt
    cached and has 0.1 s of prefill queued; "b" is idle and empty. The plain router
    keeps the request on "a" (recomputing on "b" costs 0.256 s); the store-aware one,
    whose store holds the prompt, sends it to "b" (a 0.0128 s load)."""
    cached = Replica("a", 16, 1, "lru")
    cached.serve(PROMPT)
    events = cached.take_events()
    chosen = {}
    for aware in (False, True):
        view = view_holding(10, load_cost=0.05) if aware else None
        router = make_router("exact", block_size=1, hasher=FLEET_HASHER, service=SVC,
                             tokens_per_block=512, clock=lambda: 0.0, store=view)  # fmt: skip
        router.on_events("a", events)
        router.backlog.add("a", "busy", 0.1, now=0.0)
        reps = [ReplicaState("a"), ReplicaState("b")]
        chosen[aware] = router.choose(RouteRequest(0, PROMPT), reps)
    assert chosen == {False: "a", True: "b"}


def test_router_refuses_a_store_view_of_another_block_size() -> None:
    view = StoreView(MemoryStore(1024), sim_keyspace(2), 0.1)
    with pytest.raises(ValueError, match="store.keyspace.block_size must be the router's"):
        make_router("exact", block_size=1, store=view)
    with pytest.raises(ValueError, match="store must be a StoreView or None"):
        make_router("exact", block_size=1, store="mooncake")
    with pytest.raises(ValueError, match="load_cost"):
        StoreView(MemoryStore(1024), sim_keyspace(1), -1.0)


def test_a_store_aware_fleet_run_keeps_every_tier_whole() -> None:
    """groups on 3 replicas too small for the groups, a store that holds them: both exact
    routers run clean; the store serves hits; every cache and the store check out."""
    svc = SERVICE_PROFILES["h200"]
    reqs = grouped_prompts(8, group_sizes(160, 8), system_len=8, seed=5)
    rate = 1.0 / offered_load(reqs, svc, 3, batch=BatchConfig())
    for aware in (False, True):
        store = SharedStore(512, host_capacity_blocks=16)
        clock = SimClock()
        router = build_router("exact", clock, service=svc, store=store.view() if aware else None)
        sim = FleetSim(num_replicas=3, capacity_blocks=16, service=svc, batch=BatchConfig(),
                       clock=clock, store=store)  # fmt: skip
        res = sim.run(reqs, router, rate=rate)
        assert res.store_hit_rate > 0
        assert res.hit_rate >= res.store_hit_rate + res.host_hit_rate
        for rep in sim.replicas:
            rep.cache.check()
        store.store.check()
        router.index.check()


# ------------------------------------------------------------------ CLI
def store_argv(*extra: str) -> list[str]:
    return ["route-sim", "--synthetic", "groups", "--requests", "64", "--replicas", "2",
            "--capacity", "16", "--no-progress", *extra]  # fmt: skip


def test_cli_store_flags_reach_the_simulator(capsys) -> None:
    code, out, _ = run_cli(
        capsys, *store_argv("--routers", "round_robin,exact", "--store-capacity", "256",
                            "--store-aware", "--store-load-cost", "0.2", "--json")  # fmt: skip
    )
    assert code == 0
    rows = strict_json(out)
    for row in rows.values():
        assert row["store_hit_rate"] > 0 and "host_hit_rate" in row
    code, out, _ = run_cli(capsys, *store_argv("--routers", "exact", "--json"))
    assert strict_json(out)["exact"]["store_hit_rate"] == 0.0
    code, out, _ = run_cli(capsys, *store_argv("--routers", "exact", "--store-capacity", "64"))
    assert code == 0 and "store_hit_rate" in out


@pytest.mark.parametrize(
    "argv, needle",
    [
        (["--store-capacity", "0"], "--store-capacity"),
        (["--store-capacity", "x"], "--store-capacity"),
        (["--store-capacity", "8", "--host-capacity", "0"], "--host-capacity"),
        (["--store-capacity", "8", "--store-write", "later"], "--store-write"),
        (["--store-capacity", "8", "--store-load-cost", "-1"], "--store-load-cost"),
        (["--store-capacity", "8", "--host-load-cost", "inf"], "--host-load-cost"),
        (["--store-aware"], "--store-aware needs --store-capacity"),
        (["--host-capacity", "8"], "--host-capacity needs --store-capacity"),
        (["--store-write", "write_through"], "--store-write needs --store-capacity"),
        (["--store-load-cost", "0.5"], "--store-load-cost needs --store-capacity"),
    ],
)
def test_cli_bad_store_flags_exit_2_with_one_line(capsys, argv, needle) -> None:
    code, out, err = run_cli(capsys, *store_argv(*argv))
    assert code == 2 and out == ""
    assert len(err.strip().splitlines()) == 1 and needle in err


def test_cli_json_rows_are_strict_with_a_store(capsys) -> None:
    code, out, _ = run_cli(
        capsys, *store_argv("--routers", "approx", "--store-capacity", "32", "--json")
    )
    assert code == 0 and json.loads(out)["approx"]["num_requests"] == 64
