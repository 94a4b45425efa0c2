"""A fleet of engine replicas on Ray Serve behind radixkv's prefix router (radixkv.serve.ray).

Two parts (the plain routing state and event feed the router runs on are tested without
Ray in test_routing_state.py and test_event_feed.py):

- The adapter without Ray running: the config and metadata records;
  :class:`PrefixRouter` over real ZMQ publishers on 127.0.0.1, with stand-in objects
  for Serve's replicas (the four read-only attributes the router reads).
- One Ray Serve instance (module fixture, 2 CPUs) running two fleets of 2
  random-model replicas: one routed by ``exact``, one by Serve's own
  power-of-two router. The same shared-prefix workload goes to both over
  HTTP; the tests compare hit rates (from the responses' usage), outputs
  (against one local engine), errors (against a single server), the
  router's index (against each replica's cache), make the policy raise, abort a
  request, and kill a replica.

Every wait is bounded by a deadline.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import os
import secrets
import shutil
import socket
import tempfile
import threading
import time
from typing import Any

import numpy as np
import pytest

# Ray reads these at import: no usage report, a throwaway auth token (none written to $HOME).
os.environ.setdefault("RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER", "0")
os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")
os.environ.setdefault("RAY_AUTH_TOKEN", secrets.token_hex(16))
ray = pytest.importorskip("ray")
requests = pytest.importorskip("requests")

from ray import serve  # noqa: E402
from ray.serve._private.common import (  # noqa: E402
    DeploymentHandleSource,
    DeploymentID,
    ReplicaID,
    RequestMetadata,
)
from ray.serve.request_router import PendingRequest  # noqa: E402
from routing_helpers import BS, DEADLINE_S, LOCAL, XX, Failing, stored, wait_for  # noqa: E402

from radixkv.cache.allocator import BlockAllocator  # noqa: E402
from radixkv.cache.radix import RadixCache  # noqa: E402
from radixkv.fleet.index import chain_hashes  # noqa: E402
from radixkv.fleet.transport import EventPublisher  # noqa: E402
from radixkv.serve.ray.request_router import (  # noqa: E402
    NoReplicaEvents,
    PrefixRouter,
    PrefixRouterConfig,
    ReplicaEvents,
    ReplicaInfo,
    route_request_of,
)


# ------------------------------------------------------------------ config and records
@pytest.mark.parametrize(
    ("field", "value", "message"),
    [
        ("policy", "nearest", "policy must be one of"),
        ("block_size", 0, "block_size must be a positive int, got 0"),
        ("hash_name", "md5", "hash_name must be one of"),
        ("hash_seed", 1.5, "hash_seed must be an int or a str, got 1.5"),
        ("seed", "x", "seed must be an int, got 'x'"),
        ("options", [1], r"options must be a dict, got \[1\]"),
        ("events", "yes", "events must be a bool or None, got 'yes'"),
        ("pending_ttl_s", -1, "pending_ttl_s must be a positive number, got -1"),
    ],
)
def test_router_config_names_the_bad_field(field: str, value: object, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        PrefixRouterConfig(**{field: value})


def test_router_config_round_trips_through_json_kwargs() -> None:
    config = PrefixRouterConfig(policy="approx", block_size=8, options={"ttl": 10.0})
    kwargs = json.loads(json.dumps(config.to_kwargs()))
    assert PrefixRouterConfig(**kwargs) == config
    assert not config.subscribes and PrefixRouterConfig().subscribes
    assert config.build_router().index.ttl == 10.0
    with pytest.raises(TypeError, match="router 'exact'.*bogus"):
        PrefixRouterConfig(options={"bogus": 1}).build_router()


def test_replica_info_round_trips_through_serve_metadata() -> None:
    info = ReplicaInfo("tcp://127.0.0.1:1", "tcp://127.0.0.1:2", 256, 16, "xxhash", 0)
    metadata = json.loads(json.dumps(info.to_metadata()))
    assert ReplicaInfo.from_metadata(metadata) == info
    assert ReplicaInfo.from_metadata({}) is None
    assert ReplicaInfo.from_metadata({"radixkv": {"event_endpoint": "x"}}) is None
    assert info.matches(PrefixRouterConfig(block_size=16, hash_name="xxhash", hash_seed=0))
    assert not info.matches(PrefixRouterConfig(block_size=16, hash_name="xxhash", hash_seed=1))


def pending(kwargs: dict[str, Any], iid: str = "i1", session: str = "") -> PendingRequest:
    """A real PendingRequest (its future needs a running loop: call inside one)."""
    meta = RequestMetadata(request_id="x", internal_request_id=iid, session_id=session)
    return PendingRequest(args=[], kwargs=kwargs, metadata=meta)


def test_route_request_of_reads_the_keyword_arguments() -> None:
    async def run() -> None:
        r = route_request_of(pending({"prompt_ids": [5, 6, 7], "namespace": "t1"}, session="s"))
        assert r is not None
        assert (r.request_id, r.namespace, r.session) == ("i1", "t1", "s")
        assert r.tokens.dtype == np.int32 and r.tokens.tolist() == [5, 6, 7]
        assert route_request_of(pending({"prompt_ids": [1]})).session is None
        assert route_request_of(pending({})) is None  # a control call: by load
        assert route_request_of(pending({"prompt_ids": [0.5]})) is None
        assert route_request_of(pending({"prompt_ids": [[1, 2]]})) is None
        assert route_request_of(None) is None

    asyncio.run(run())


class StandInReplica:
    """What PrefixRouter reads of a Serve ``RunningReplica``: its id, stats and metadata."""

    def __init__(self, uid: str, metadata: dict[str, Any], stats: dict[str, Any] | None = None):
        self.replica_id = ReplicaID(uid, DeploymentID(name="Engine", app_name="app"))
        self.replica_metadata = metadata
        self.routing_stats = stats or {}
        self.max_ongoing_requests = 8


def prefix_router() -> PrefixRouter:
    """A real PrefixRouter, built as Serve builds it (no Ray needed to construct one)."""
    router = PrefixRouter(
        deployment_id=DeploymentID(name="Engine", app_name="app"),
        handle_source=DeploymentHandleSource.UNKNOWN,
        use_replica_queue_len_cache=True,
    )
    router.initialize_state(**PrefixRouterConfig(block_size=BS).to_kwargs())
    return router


def test_prefix_router_routes_on_its_replicas_events_and_serve_s_callbacks(caplog) -> None:
    caplog.set_level(logging.ERROR)
    prefix = list(range(200, 224))
    with EventPublisher(LOCAL, LOCAL) as pa, EventPublisher(LOCAL, LOCAL) as pb:

        def meta(pub: EventPublisher, seed: int = 0) -> ReplicaInfo:
            return ReplicaInfo(pub.endpoint, pub.replay_endpoint, 64, BS, "xxhash", seed)

        a = StandInReplica("a", meta(pa).to_metadata(), {"running": 1, "kv_usage": 0.25})
        b = StandInReplica("b", meta(pb).to_metadata())
        c = StandInReplica("c", meta(pb, seed=1).to_metadata())  # hashes otherwise
        router = prefix_router()

        async def run() -> None:
            control = pending({})
            assert await router.choose_replicas([a, b, c], control) == [[a, b, c]]
            snap = router.snapshot()
            assert snap["a"]["running"] == 1 and snap["a"]["capacity_blocks"] == 64

            expected = sorted(chain_hashes(XX, prefix, BS, None))
            deadline = time.monotonic() + DEADLINE_S
            while router.snapshot()["b"]["blocks"] != expected:  # the feed runs on its thread
                assert time.monotonic() < deadline, "b's events never reached the index"
                pb.publish(stored(prefix))
                await asyncio.sleep(0.05)
            call = pending({"prompt_ids": prefix + [1, 2]}, iid="i2")
            assert await router.choose_replicas([a, b], call) == [[b], [a]]
            assert router.state.in_flight("b") == 1
            router.on_request_routed(call, b.replica_id, None)
            router.on_request_completed(b.replica_id, "i2")
            assert router.state.in_flight("b") == 0
            router.state.check()
            router.on_replica_actor_died(b.replica_id)
            assert "b" not in router.snapshot()
            assert await router.choose_replicas([a], pending({"prompt_ids": prefix})) == [[a]]
            assert "b" not in router.snapshot()

        asyncio.run(run())
        assert "replica c hashes blocks as" in caplog.text
        assert isinstance(router.replica_events, ReplicaEvents)
        assert router.replica_events.feed.running
        router.close()
        assert not router.replica_events.feed.running
        router.close()  # idempotent


def test_a_router_that_reads_no_events_joins_no_feed_and_logs_no_hash_mismatch(caplog) -> None:
    """``events=False`` (or a policy other than ``exact``): the router's events are a
    ``NoReplicaEvents``, so a replica that hashes otherwise is routed by load, unlogged."""
    caplog.set_level(logging.ERROR)
    router = PrefixRouter(
        deployment_id=DeploymentID(name="Engine", app_name="app"),
        handle_source=DeploymentHandleSource.UNKNOWN,
        use_replica_queue_len_cache=True,
    )
    router.initialize_state(**PrefixRouterConfig(block_size=BS, events=False).to_kwargs())
    assert isinstance(router.replica_events, NoReplicaEvents)
    info = ReplicaInfo("tcp://127.0.0.1:1", None, 64, BS, "xxhash", 7)  # another seed
    a = StandInReplica("a", info.to_metadata(), {"running": 2})

    async def run() -> None:
        call = pending({"prompt_ids": [1, 2, 3, 4, 5]})
        assert await router.choose_replicas([a], call) == [[a]]
        snap = router.snapshot()
        assert snap["a"]["capacity_blocks"] == 64 and snap["a"]["blocks"] == []
        router.on_replica_actor_died(a.replica_id)
        assert "a" not in router.snapshot()

    asyncio.run(run())
    assert "hashes blocks as" not in caplog.text
    assert router.replica_events.drain() == []
    router.close()


def test_prefix_router_routes_by_load_when_its_policy_raises(caplog) -> None:
    """Issue 21.7: an exception out of ``choose_replicas`` ends Serve's routing task and the
    request it was placing is never answered. The router logs it and offers every
    candidate in one rank instead (Serve takes the least loaded); its other hooks log too."""
    caplog.set_level(logging.ERROR, logger="radixkv.serve.ray.request_router")
    a, b = StandInReplica("a", {}), StandInReplica("b", {})  # no metadata: routed by load
    router = prefix_router()

    async def run() -> None:
        failing = Failing(router.state.router, "choose")
        call = pending({"prompt_ids": [1, 2, 3, 4, 5]}, iid="i1")
        assert await router.choose_replicas([a, b], call) == [[a, b]]
        assert failing.calls == 1
        router.on_request_routed(call, a.replica_id, None)  # no decision stands: ignored
        router.on_request_completed(a.replica_id, "i1")
        router.state.check()
        assert router.state.in_flight("a") == 0
        # a decision whose end the policy fails on: logged, counts right, nothing raised
        del router.state.router.choose
        call = pending({"prompt_ids": [1, 2, 3, 4, 5]}, iid="i2")
        [[chosen], _] = await router.choose_replicas([a, b], call)
        router.on_request_routed(call, chosen.replica_id, None)
        Failing(router.state.router, "on_finish")
        router.on_request_completed(chosen.replica_id, "i2")
        router.on_replica_actor_died(b.replica_id)
        router.state.check()
        assert router.state.in_flight("a") == 0

    try:
        asyncio.run(run())
    finally:
        router.close()
    assert "failed to place a request; routing it by load" in caplog.text
    assert "ending a request failed" in caplog.text


def test_a_store_aware_router_opens_the_replicas_store_in_their_keyspace(tmp_path, caplog):
    """Issue 35, item 5: ``StoreView`` (route-sim --store-aware) was the simulator's only. A
    Serve router configured with the replicas' store opens it when the first replica reports
    its store keyspace (metadata) and hands the policy a view of it: what a replica wrote
    to the folder, the policy sees, and prices as loads rather than prefill."""
    from radixkv.cache.store import LocalDiskStore, StoreKeyspace
    from radixkv.fleet.shared_store import StoreView
    from radixkv.serve.ray.request_router import keyspace_fields

    keyspace = StoreKeyspace("ab" * 32, "float32", BS, 2, 1, 8)
    prompt = list(range(500, 500 + 6 * BS))
    keys = keyspace.block_keys(prompt)
    LocalDiskStore(tmp_path, 1 << 20).put_many([(k, b"kv") for k in keys[:4]])  # a replica's
    info = ReplicaInfo(None, None, 64, BS, "xxhash", 0, keyspace_fields(keyspace))
    a, b = (StandInReplica(u, info.to_metadata()) for u in "ab")
    router = PrefixRouter(
        deployment_id=DeploymentID(name="Engine", app_name="app"),
        handle_source=DeploymentHandleSource.UNKNOWN,
        use_replica_queue_len_cache=True,
    )
    config = PrefixRouterConfig(block_size=BS, store=str(tmp_path), store_capacity_bytes=1 << 20)
    router.initialize_state(**json.loads(json.dumps(config.to_kwargs())))
    assert router.store_view is None  # no replica has reported a keyspace yet

    async def run() -> None:
        assert await router.choose_replicas([a, b], pending({"prompt_ids": prompt}))

    asyncio.run(run())
    view = router.store_view
    assert isinstance(view, StoreView) and router.state.router.store is view
    assert view.keyspace == keyspace and view.store.contains_run(keys) == 4
    policy = router.state.router
    service = policy.scoring.service
    price = view.pricer(np.asarray(prompt), None, 6, service, BS)
    assert price(0) < service.prefill(6 * BS, 0)  # 4 of its 6 blocks load instead
    router.close()

    # a store the router cannot open: logged once, the router routes blind to it
    caplog.set_level(logging.ERROR, logger="radixkv.serve.ray.request_router")
    (tmp_path / "a-file").write_text("")
    blind = PrefixRouter(
        deployment_id=DeploymentID(name="Engine", app_name="app"),
        handle_source=DeploymentHandleSource.UNKNOWN,
        use_replica_queue_len_cache=True,
    )
    config = PrefixRouterConfig(
        block_size=BS, store=str(tmp_path / "a-file"), store_capacity_bytes=1 << 20
    )
    blind.initialize_state(**config.to_kwargs())

    async def run_blind() -> None:
        for _ in range(2):
            assert await blind.choose_replicas([a, b], pending({"prompt_ids": prompt}))

    asyncio.run(run_blind())
    assert blind.store_view is None and blind.state.router.store.pricer(
        np.asarray(prompt), None, 6, service, BS) is None  # fmt: skip
    assert caplog.text.count("could not be used; routing blind to it") == 1
    blind.close()


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"policy": "round_robin", "store": "/tmp/x", "store_capacity_bytes": 1},
         "store needs a prefix-aware policy"),
        ({"store": "/tmp/x"}, "store '/tmp/x' needs store_capacity_bytes, got None"),
        ({"store": "", "store_capacity_bytes": 1}, "kv_store must be a directory"),
        ({"store_capacity_bytes": 0}, "store_capacity_bytes must be a positive int or None, got 0"),
        ({"store_load_cost": -1}, "store_load_cost must be"),
    ],
)  # fmt: skip
def test_router_config_names_a_bad_store_field(kwargs: dict[str, Any], message: str) -> None:
    with pytest.raises(ValueError, match=message):
        PrefixRouterConfig(**kwargs)


def test_build_fleet_app_wires_store_awareness_to_the_router_only_with_a_store() -> None:
    pytest.importorskip("torch")
    from radixkv.engine.engine import DEFAULT_KV_STORE_BYTES
    from radixkv.serve.ray.fleet import build_fleet_app

    def router_kwargs(**kwargs: Any) -> dict[str, Any]:
        app = build_fleet_app("random", replicas=2, **kwargs)
        engine = app._bound_deployment.init_args[0]._bound_deployment
        return engine._deployment_config.request_router_config.request_router_kwargs

    on = router_kwargs(kv_store="/tmp/rk-store", store_aware=True)
    assert (on["store"], on["store_capacity_bytes"]) == ("/tmp/rk-store", DEFAULT_KV_STORE_BYTES)
    off = router_kwargs(kv_store="/tmp/rk-store")
    assert off["store"] is None
    for bad in [{"store_aware": True}, {"store_aware": True, "kv_store": "/x", "router": "serve"},
                {"store_aware": "yes", "kv_store": "/x"}]:  # fmt: skip
        with pytest.raises(ValueError, match="store_aware"):
            build_fleet_app("random", replicas=2, **bad)


def test_cache_block_hashes_are_the_chain_hashes_of_what_the_cache_holds() -> None:
    pytest.importorskip("torch")
    from radixkv.serve.ray.fleet import cache_block_hashes

    alloc = BlockAllocator(64, BS)
    cache = RadixCache(alloc, events=XX)
    a, b = list(range(300, 316)), list(range(300, 308)) + [1] * 8  # b splits a's node
    for tokens in (a, b):
        blocks = alloc.alloc(len(tokens) // BS)
        cache.insert(tokens, blocks)
        alloc.decref(blocks)
    expected = set(chain_hashes(XX, a, BS, None)) | set(chain_hashes(XX, b, BS, None))
    assert cache_block_hashes(cache) == sorted(expected)
    assert cache.evict(1) >= 1  # a whole leaf goes
    after = cache_block_hashes(cache)
    assert len(after) == cache.cached_blocks < len(expected) and set(after) < expected
    with pytest.raises(ValueError, match="cache must be a radix cache with events on"):
        cache_block_hashes(RadixCache(BlockAllocator(8, BS)))


def test_fleet_event_endpoints_that_would_collide_are_refused() -> None:
    from radixkv.serve.ray.fleet import check_event_endpoints

    check_event_endpoints(None, None, 4)
    check_event_endpoints("tcp://*:5557", "tcp://*:5561", 4)  # 5557-5560, 5561-5564
    check_event_endpoints("tcp://*:*", "tcp://*:*", 4)
    with pytest.raises(
        ValueError,
        match="replica 0 the address tcp://127.0.0.1:5560, which "
        "the event_endpoint of replica 3 already has: give endpoints 4 ports",
    ):
        check_event_endpoints("tcp://*:5557", "tcp://127.0.0.1:5560", 4)
    with pytest.raises(ValueError, match="replay_endpoint 'tcp://\\*:1' needs an event_endpoint"):
        check_event_endpoints(None, "tcp://*:1", 2)


def test_build_fleet_app_names_a_bad_argument() -> None:
    pytest.importorskip("torch")
    from radixkv.serve.ray.fleet import build_fleet_app

    with pytest.raises(ValueError, match="router must be one of .*'serve'.*got 'nearest'"):
        build_fleet_app("random", replicas=2, router="nearest")
    with pytest.raises(ValueError, match="replicas must be a positive int, got 0"):
        build_fleet_app("random", replicas=0)
    with pytest.raises(ValueError, match="replica_cpus must be a positive number, got 0"):
        build_fleet_app("random", replicas=1, replica_cpus=0)
    with pytest.raises(TypeError, match="router 'chwbl'.*spread"):
        build_fleet_app("random", replicas=1, router="chwbl", router_options={"spread": 2})


def test_ray_prefix_router_is_wired_with_the_prompt_as_text() -> None:
    """--router ray_prefix runs Ray's PrefixCacheAffinityRouter, which reads a positional
    argument with a ``prompt`` attribute: the ingress is told to send one."""
    pytest.importorskip("torch")
    from radixkv.serve.ray.fleet import RAY_PREFIX_ROUTER, build_fleet_app
    from radixkv.serve.ray.ingress import PromptText

    app = build_fleet_app("random", replicas=2, router=RAY_PREFIX_ROUTER)
    ingress = app._bound_deployment
    assert ingress.init_kwargs["send_prompt_text"] is True
    engine = ingress.init_args[0]
    config = engine._bound_deployment._deployment_config.request_router_config
    assert config.request_router_class.endswith("PrefixCacheAffinityRouter")
    assert PromptText("abc").prompt == "abc"
    other = build_fleet_app("random", replicas=2, router="exact")
    assert other._bound_deployment.init_kwargs["send_prompt_text"] is False


@pytest.mark.parametrize("router", ["exact", "serve"])
def test_every_replica_gets_the_driver_s_hash_seed(monkeypatch, router: str) -> None:
    """The chain hash's seed follows vLLM's rule where the app is built, and goes to every
    replica explicitly (a Ray worker's environment need not be the driver's) and to the
    router: all name a block as a vLLM server in the driver's environment would."""
    pytest.importorskip("torch")
    from radixkv.serve.ray.fleet import build_fleet_app

    for env, seed in [("7", "7"), (None, "vllm-none-hash")]:
        if env is None:
            monkeypatch.delenv("PYTHONHASHSEED", raising=False)
        else:
            monkeypatch.setenv("PYTHONHASHSEED", env)
        engine = build_fleet_app("random", replicas=2, router=router)._bound_deployment
        replicas = engine.init_args[0]._bound_deployment
        assert replicas.init_kwargs["hash_seed"] == seed
        if router == "exact":
            config = replicas._deployment_config.request_router_config
            assert config.request_router_kwargs["hash_seed"] == seed


class StandInHandle:
    """What ``collect_stats`` uses of the engine deployment's handle: ``broadcast("stats")``
    answering ``results`` (or raising ``fails`` as a whole)."""

    def __init__(self, results: list[Any], fails: Exception | None = None) -> None:
        self.results, self.fails = results, fails

    def broadcast(self, method: str) -> StandInHandle:
        assert method == "stats"
        return self

    async def results_async(self, *, timeout_s: float, return_exceptions: bool) -> list[Any]:
        if self.fails is not None:
            raise self.fails
        errors = [r for r in self.results if isinstance(r, Exception)]
        if errors and not return_exceptions:
            raise errors[0]
        return self.results


def test_replica_stats_report_a_dead_replica_as_unreachable() -> None:
    """Issue 21.8: GET /replicas was a plain 500 while one replica was dead (Serve had not
    dropped it yet): the live ones are reported, the dead one as unreachable."""
    pytest.importorskip("torch")
    from ray.exceptions import ActorDiedError

    from radixkv.serve.openai.errors import ApiError
    from radixkv.serve.ray.ingress import collect_stats

    def row(replica: str, actor: str) -> dict[str, Any]:
        return {"replica_id": replica, "actor_id": actor, "requests_finished": 3}

    def died(actor: str) -> ActorDiedError:
        e = ActorDiedError()
        e.actor_id = actor
        return e

    names: dict[str, str] = {}
    live = asyncio.run(collect_stats(StandInHandle([row("r1", "A1"), row("r2", "A2")]), names))
    assert {r: v["state"] for r, v in live.items()} == {"r1": "running", "r2": "running"}
    assert names == {"A1": "r1", "A2": "r2"}
    # r2's actor died: named from the earlier answer
    rows = asyncio.run(collect_stats(StandInHandle([row("r1", "A1"), died("A2")]), names))
    assert rows["r1"] == {**row("r1", "A1"), "state": "running"}
    assert rows["r2"]["state"] == "unreachable" and rows["r2"]["actor_id"] == "A2"
    assert rows["r2"]["error"].startswith("ActorDiedError: The actor died")
    # an actor never seen answering is named by its actor id
    rows = asyncio.run(collect_stats(StandInHandle([row("r1", "A1"), died("A9")]), {}))
    assert rows["A9"]["replica_id"] is None and rows["A9"]["state"] == "unreachable"
    # none answers: OpenAI's error body, 503
    for handle in (StandInHandle([died("A1")]), StandInHandle([], TimeoutError("timed out"))):
        with pytest.raises(ApiError) as info:
            asyncio.run(collect_stats(handle, names))
        assert info.value.status == 503
        assert info.value.body["error"]["type"] == "service_unavailable"
        assert "no engine replica answered" in info.value.body["error"]["message"]


# ------------------------------------------------------------------ a fleet on Ray Serve
NUM_BLOCKS = 256
GROUPS, PER_GROUP, MAX_TOKENS = 6, 4, 6


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def free_ports(n: int) -> int:
    """The first of ``n`` consecutive ports free on 127.0.0.1 now."""
    rng = np.random.default_rng()
    for _ in range(200):
        base = int(rng.integers(20000, 60000))
        try:
            with contextlib.ExitStack() as stack:
                for port in range(base, base + n):
                    s = stack.enter_context(socket.socket())
                    s.bind(("127.0.0.1", port))
            return base
        except OSError:
            continue
    raise AssertionError(f"no {n} consecutive free ports")


EVENT_PORTS = free_ports(4)  # the exact fleet's fixed KV-event ports: 2 replicas x 2 sockets


@pytest.fixture(scope="module")
def fleet():
    """Ray on 2 CPUs with two fleets of 2 random-model replicas: ``/exact`` (its KV events
    on fixed ports from ``EVENT_PORTS``, offset by rank; ``/router`` and the cache reset
    enabled) and ``/serve`` (the operator routes off, as by default)."""
    from radixkv.serve.ray.fleet import build_fleet_app

    temp = tempfile.mkdtemp(prefix="rk", dir="/tmp")  # Ray's socket paths must stay short
    port = free_port()
    ray.init(
        num_cpus=2,
        include_dashboard=False,
        object_store_memory=int(2e8),
        _temp_dir=temp,
        log_to_driver=False,
    )
    try:
        serve.start(http_options={"host": "127.0.0.1", "port": port})
        common = dict(
            replicas=2,
            num_blocks=NUM_BLOCKS,
            replica_cpus=0.25,
            stats_period_s=0.5,
            health_check_period_s=1.0,
        )
        serve.run_many(
            [
                serve.RunTarget(
                    build_fleet_app(
                        "random",
                        router="exact",
                        event_endpoint=f"tcp://127.0.0.1:{EVENT_PORTS}",
                        replay_endpoint=f"tcp://127.0.0.1:{EVENT_PORTS + 2}",
                        enable_router_view=True,
                        enable_cache_reset=True,
                        **common,
                    ),
                    name="exact",
                    route_prefix="/exact",
                ),
                serve.RunTarget(
                    build_fleet_app("random", router="serve", **common),
                    name="serve",
                    route_prefix="/serve",
                ),
            ]
        )
        yield f"http://127.0.0.1:{port}"
    finally:
        serve.shutdown()
        ray.shutdown()
        shutil.rmtree(temp, ignore_errors=True)


def post(url: str, body: dict[str, Any]) -> dict[str, Any]:
    r = requests.post(url, json=body, timeout=60)
    assert r.status_code == 200, r.text
    return r.json()


def workload() -> list[str]:
    """GROUPS x PER_GROUP prompts; a group shares a 100-byte (6-block) prefix."""
    prompts = []
    for g in range(GROUPS):
        prefix = f"[group {g}] You are a terse assistant; answer in one word. " * 2
        prefix = prefix[:100]
        prompts += [f"{prefix} Question {g}.{i}: what is {i} + {g}?" for i in range(PER_GROUP)]
    return prompts


@pytest.fixture(scope="module")
def answers(fleet: str) -> dict[str, list[dict[str, Any]]]:
    """The workload's responses from each fleet, sent one at a time, greedy, with token ids."""
    out: dict[str, list[dict[str, Any]]] = {}
    for name in ("exact", "serve"):
        out[name] = [
            post(
                f"{fleet}/{name}/v1/completions",
                {"prompt": p, "max_tokens": MAX_TOKENS, "temperature": 0, "return_token_ids": True},
            )
            for p in workload()
        ]
    return out


def hit_rate(responses: list[dict[str, Any]]) -> float:
    cached = sum(r["usage"]["prompt_tokens_details"]["cached_tokens"] for r in responses)
    return cached / sum(r["usage"]["prompt_tokens"] for r in responses)


def test_exact_routing_beats_serve_s_power_of_two_on_shared_prefixes(answers) -> None:
    exact, pow2 = hit_rate(answers["exact"]), hit_rate(answers["serve"])
    # every request after a group's first finds the group's 6 prefix blocks (96 tokens)
    for i, r in enumerate(answers["exact"]):
        cached = r["usage"]["prompt_tokens_details"]["cached_tokens"]
        assert cached >= (0 if i % PER_GROUP == 0 else 96), (i, cached)
    # power of two picks at random between two idle replicas: about half the followers miss
    print(f"hit rate: exact {exact:.3f}, Serve's power of two {pow2:.3f}")
    assert exact > pow2, (exact, pow2)


def test_outputs_equal_one_local_engine_s_greedy_outputs(fleet: str, answers) -> None:
    from radixkv.engine.request import SamplingParams
    from radixkv.serve.models import build_engine
    from radixkv.text.tokenizer import ByteTokenizer

    tok = ByteTokenizer()
    engine = build_engine("random", num_blocks=NUM_BLOCKS, seed=0)
    params = SamplingParams(max_new_tokens=MAX_TOKENS, stop_token_ids=tok.stop_token_ids)
    local = [c.output_ids for c in engine.generate([tok.encode(p) for p in workload()], params)]
    for name in ("exact", "serve"):
        assert [r["choices"][0]["token_ids"] for r in answers[name]] == local, name
    # streamed through the ingress: the same ids and text, chunk by chunk
    prompt = workload()[1]
    body = {"prompt": prompt, "max_tokens": MAX_TOKENS, "temperature": 0}
    with requests.post(
        f"{fleet}/exact/v1/completions",
        json={**body, "stream": True, "return_token_ids": True},
        stream=True,
        timeout=60,
    ) as r:
        assert r.status_code == 200
        lines = [x for x in r.iter_lines(decode_unicode=True) if x]
    assert lines[-1] == "data: [DONE]"
    chunks = [json.loads(x[len("data: ") :]) for x in lines[:-1]]
    ids = [t for c in chunks for t in c["choices"][0].get("token_ids") or []]
    assert ids == local[1]
    text = "".join(c["choices"][0]["text"] for c in chunks)
    assert text == answers["exact"][1]["choices"][0]["text"]


def test_a_bad_request_is_a_400_naming_the_problem(fleet: str) -> None:
    r = requests.post(
        f"{fleet}/exact/v1/completions", json={"prompt": "x", "max_tokens": 10**6}, timeout=60
    )
    assert r.status_code == 400
    error = r.json()["error"]
    assert "max_tokens is 1000000" in error["message"]
    assert (error["param"], error["code"]) == ("max_tokens", "context_length_exceeded")
    r = requests.post(f"{fleet}/exact/v1/completions", json={"prompt": 5}, timeout=60)
    assert r.status_code == 400 and r.json()["error"]["param"] == "prompt"


class SingleServer:
    """``radixkv serve`` without ``--replicas``: one engine built as each fleet replica is
    (``build_app`` under uvicorn, on a free 127.0.0.1 port, in a thread of its own)."""

    def __init__(self) -> None:
        import uvicorn

        from radixkv.serve.app import build_app
        from radixkv.serve.async_engine import AsyncEngine
        from radixkv.serve.models import build_engine
        from radixkv.text.tokenizer import model_name

        engine = AsyncEngine(build_engine("random", num_blocks=NUM_BLOCKS, seed=0))
        app = build_app(engine, model_name=model_name("random"))
        self.port = free_port()
        config = uvicorn.Config(app, host="127.0.0.1", port=self.port, log_level="warning")
        self.server = uvicorn.Server(config)
        self.thread = threading.Thread(target=self.server.run, daemon=True)

    def __enter__(self) -> str:
        self.thread.start()
        wait_for(lambda: self.server.started, "the single server to start", timeout=60)
        return f"http://127.0.0.1:{self.port}"

    def __exit__(self, *exc: object) -> None:
        self.server.should_exit = True
        self.thread.join(30)


def test_a_request_the_pool_cannot_hold_gets_the_single_server_s_error(fleet: str) -> None:
    """Issue 21.9: the fleet left these checks to the chosen replica, whose errors had no
    ``param`` or ``code`` and named ``max_new_tokens``. The ingress now has the replicas'
    limits: the same request gets the same error body from a fleet and from one engine."""
    pool = NUM_BLOCKS * 16  # tokens: the default block size
    bad = [
        ("/v1/completions", {"prompt": "x", "max_tokens": 10**6}),
        ("/v1/completions", {"prompt": "y" * (pool + 10)}),
        ("/v1/completions", {"prompt": [1, 2, 10**6]}),
        ("/v1/completions", {"prompt": "x" * 10, "max_tokens": pool - 5}),
        ("/v1/chat/completions", {"messages": [{"role": "user", "content": "z" * pool}]}),
    ]
    with SingleServer() as single:
        for path, body in bad:
            one = requests.post(f"{single}{path}", json=body, timeout=60)
            many = requests.post(f"{fleet}/exact{path}", json=body, timeout=60)
            assert one.status_code == 400, (path, body, one.text)
            assert (many.status_code, many.json()) == (one.status_code, one.json()), body
        assert one.json()["error"]["code"] == "context_length_exceeded"
        card = requests.get(f"{single}/v1/models", timeout=30).json()["data"][0]
    fleet_card = requests.get(f"{fleet}/exact/v1/models", timeout=30).json()["data"][0]
    assert fleet_card["max_model_len"] == card["max_model_len"] == pool


def test_the_ingress_serves_what_the_single_server_serves(fleet: str) -> None:
    """Issue 24: the fleet's ingress answered only completions, chat and /v1/models, parsed
    bodies only with a JSON Content-Type, and took a body of any size. Now it reads bodies
    as the single server does (radixkv.serve.openai.bodies) and offers the same routes: the same
    request gets the same status and body from both."""
    from radixkv.serve.openai.bodies import default_max_body_bytes
    from radixkv.text.tokenizer import model_name

    pool = NUM_BLOCKS * 16
    limit = default_max_body_bytes(pool)
    prompt = {"prompt": "hello", "max_tokens": 2, "temperature": 0}
    with SingleServer() as single:
        for method, path, kwargs in [
            ("get", f"/v1/models/{model_name('random')}", {}),
            ("get", "/v1/models/nope", {}),
            ("get", "/version", {}),
            ("post", "/tokenize", {"json": {"prompt": "hello"}}),
            ("post", "/detokenize", {"json": {"tokens": [104, 105]}}),
            ("get", "/tokenizer_info", {}),
            ("post", "/v1/completions", {"data": json.dumps(prompt)}),  # no Content-Type
            ("post", "/v1/completions", {"data": b"x" * (limit + 1)}),  # over the limit: 413
        ]:
            one = getattr(requests, method)(f"{single}{path}", timeout=60, **kwargs)
            many = getattr(requests, method)(f"{fleet}/exact{path}", timeout=60, **kwargs)
            assert one.status_code == many.status_code, (path, one.text, many.text)
            if path == "/v1/completions" and one.ok:
                assert many.json()["choices"][0]["text"] == one.json()["choices"][0]["text"]
            else:  # a model card's "created" is each server's start time
                same = [{k: v for k, v in r.json().items() if k != "created"} for r in (one, many)]
                assert same[0] == same[1], (path, one.text, many.text)
        assert one.status_code == 413


def cache_states(app: str) -> dict[str, dict[str, Any]]:
    handle = serve.get_deployment_handle("EngineReplica", app)
    return {s["replica_id"]: s for s in handle.broadcast("cache_state").results(timeout_s=30)}


def test_fleet_metrics_label_each_replica_and_add_up_to_the_work_done(fleet: str, answers) -> None:
    """GET /metrics on the ingress: every metric once per replica (label ``replica``), and the
    finished-request counters over the replicas equal what /replicas reports."""
    text = requests.get(f"{fleet}/exact/metrics", timeout=30).text
    stats = requests.get(f"{fleet}/exact/replicas", timeout=30).json()
    finished: dict[str, float] = {}
    hits = 0.0
    for line in text.splitlines():
        if line.startswith("#"):
            continue
        name_labels, value = line.rsplit(" ", 1)
        name, labels = name_labels.split("{", 1)
        if 'replica="' not in labels:  # the ingress's request histograms
            continue
        replica = labels.split('replica="', 1)[1].split('"', 1)[0]
        if name == "radixkv:request_finished_total":
            finished[replica] = float(value)
        elif name == "radixkv:prefix_cache_hits_total":
            hits += float(value)
    assert set(finished) == set(stats) and len(finished) == 2
    assert finished == {r: float(s["requests_finished"]) for r, s in stats.items()}
    assert sum(finished.values()) >= len(answers["exact"]) and hits > 0


def test_fleet_metrics_have_the_ingress_s_request_histograms(fleet: str, answers) -> None:
    """Issue 24: the ingress kept no latency histograms. It now records every request as
    the single server does (the same handlers and ServerMetrics): on ``/serve``, which no
    other test sends to, each histogram counts exactly the workload's requests."""
    from prometheus_client.parser import text_string_to_metric_families

    text = requests.get(f"{fleet}/serve/metrics", timeout=30).text
    samples: dict[str, float] = {}
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            if "replica" not in s.labels:
                key = ",".join(f"{k}={v}" for k, v in sorted(s.labels.items()))
                samples[f"{s.name}{{{key}}}"] = s.value

    def value(name: str, **labels: str) -> float:
        key = ",".join(f"{k}={v}" for k, v in sorted({**labels, "model_name": "random"}.items()))
        return samples[f"radixkv:{name}{{{key}}}"]

    n = len(answers["serve"])
    assert n == GROUPS * PER_GROUP
    for name in ("time_to_first_token_seconds", "e2e_request_latency_seconds",
                 "request_queue_time_seconds", "request_prefill_time_seconds",
                 "request_prompt_tokens", "request_generation_tokens",
                 "request_params_n"):  # fmt: skip
        assert value(f"{name}_count") == n, name
    assert (
        value("request_success_total", finished_reason="length")
        + value("request_success_total", finished_reason="stop")
        == n
    )
    usage = [r["usage"] for r in answers["serve"]]
    assert value("request_prompt_tokens_sum") == sum(u["prompt_tokens"] for u in usage)
    generated = sum(u["completion_tokens"] for u in usage)
    assert value("request_generation_tokens_sum") == generated
    assert value("inter_token_latency_seconds_count") == generated - n


def test_the_router_s_index_equals_each_replica_s_cache(fleet: str, answers) -> None:
    def same() -> tuple | None:
        caches = cache_states("exact")
        view = requests.get(f"{fleet}/exact/router", timeout=30).json()
        if {r: v["blocks"] for r, v in view.items()} == {r: s["blocks"] for r, s in caches.items()}:
            return caches, view
        return None

    caches, view = wait_for(same, "the index to match the caches", timeout=10)
    assert len(caches) == 2
    # every group's prefix (6 blocks) is cached somewhere; nothing is left in flight
    assert sum(len(s["blocks"]) for s in caches.values()) >= 6 * GROUPS, caches
    assert all(v["in_flight"] == 0 for v in view.values())


def test_a_policy_that_raises_routes_by_load_instead_of_losing_the_request(
    fleet: str, answers, caplog
) -> None:
    """Issue 21.7 on a live fleet: the ``exact`` policy's hashing raised inside Serve's
    request router and the request hung forever. Sent through a handle in this process,
    whose router can be reached (the ingress's lives in its replica), with the policy made
    to raise: the request is served all the same."""
    from radixkv.engine.request import SamplingParams
    from radixkv.serve.ray import router_registry

    caplog.set_level(logging.ERROR, logger="radixkv.serve.ray.request_router")
    handle = serve.get_deployment_handle("EngineReplica", "exact").options(stream=True)
    params = SamplingParams(max_new_tokens=2)

    def generate(prompt_ids: list[int]) -> list[Any]:
        async def run() -> list[Any]:
            call = handle.generate.remote(prompt_ids=prompt_ids, params=params)

            async def outputs() -> list[Any]:
                return [out async for out in call]

            try:
                return await asyncio.wait_for(outputs(), timeout=30)
            except TimeoutError:
                call.cancel()
                pytest.fail("the request was never answered")

        return asyncio.run(run())

    assert generate(list(range(40, 80)))[-1].finished  # Serve builds this handle's router
    routers = router_registry.live_routers("EngineReplica", "exact")
    assert routers
    failing = [Failing(r.state.router, "choose") for r in routers]
    try:
        outs = generate(list(range(100, 140)))
    finally:
        for r in routers:
            del r.state.router.choose
    assert sum(f.calls for f in failing) >= 1  # the policy was asked, and raised
    assert outs[-1].finish_reason == "length" and len(outs[-1].output_ids) == 2
    assert "failed to place a request; routing it by load" in caplog.text
    assert generate(list(range(40, 80)))[-1].finished  # and the policy routes again


def test_an_aborted_request_s_claims_leave_the_live_router_s_index(fleet: str, answers) -> None:
    """Issue 22 on a live fleet: a call cancelled mid-generation (what the ingress does when
    its client goes away) is reported completed by Serve, and the router ends its
    speculative claims and its in-flight count. Through a handle in this process, whose
    router can be reached."""
    from radixkv.engine.request import SamplingParams
    from radixkv.serve.ray import router_registry

    handle = serve.get_deployment_handle("EngineReplica", "exact").options(stream=True)
    params = SamplingParams(max_new_tokens=2000)  # runs for seconds: cancelled long before

    def routers() -> list[Any]:
        return router_registry.live_routers("EngineReplica", "exact")

    def claims() -> int:
        return sum(r.state.router.index.num_speculating() for r in routers())

    async def run() -> None:
        call = handle.generate.remote(prompt_ids=list(range(200, 240)), params=params)
        first = await asyncio.wait_for(call.__anext__(), timeout=30)
        assert not first.finished
        assert claims() >= 1  # the request runs: its claim stands
        call.cancel()
        deadline = time.monotonic() + DEADLINE_S
        while claims() or any(r.state.in_flight(i) for r in routers() for i in r.state.replicas):
            assert time.monotonic() < deadline, "the aborted request's claim never ended"
            await asyncio.sleep(0.05)

    asyncio.run(run())
    for r in routers():
        r.state.check()
        r.state.router.index.check()


def test_killing_a_replica_fails_no_later_request(fleet: str, answers) -> None:
    caches = cache_states("exact")
    # the replica holding the workload's prefixes: the router's index still sends them there
    victim, survivor = sorted(caches, key=lambda r: -len(caches[r]["blocks"]))
    assert caches[victim]["blocks"]
    ray.kill(ray.get_actor(caches[victim]["actor_name"], namespace="serve"), no_restart=True)
    # issue 21.8: until Serve drops it, the dead replica is reported as such, not a 500
    r = requests.get(f"{fleet}/exact/replicas", timeout=60)
    assert r.status_code == 200, r.text
    rows = r.json()
    assert rows[survivor]["state"] == "running" and "requests_finished" in rows[survivor]
    for key, row in rows.items():
        if row["state"] == "unreachable":  # named if this ingress saw it answer before
            assert row["replica_id"] in (victim, None) and row["actor_id"], rows
        else:
            assert key != victim and row["state"] == "running", rows
    for p in workload():
        r = post(f"{fleet}/exact/v1/completions", {"prompt": p, "max_tokens": 2})
        assert r["choices"][0]["finish_reason"] in ("length", "stop")

    def dropped() -> bool:
        view = requests.get(f"{fleet}/exact/router", timeout=30).json()
        return victim not in view and survivor in view

    wait_for(dropped, "the dead replica to leave the router's view", timeout=15)


def test_replicas_publish_on_their_ranks_endpoints_and_replicas_lists_them(fleet: str) -> None:
    """Issue 24, item 5: a fleet's KV-event endpoints are settable (offset by rank, as vLLM's
    data-parallel ranks) and listed in /replicas; a plain subscriber on each replica's
    listed endpoints gets the stream (and the replay) of its cache."""
    from radixkv.fleet.transport import EventSubscriber

    def both_running() -> dict[str, Any] | None:
        rows = requests.get(f"{fleet}/exact/replicas", timeout=30).json()
        up = {k: r for k, r in rows.items() if r["state"] == "running"}
        return up if len(up) == 2 else None

    # a replica an earlier test killed comes back with its rank, and so its ports
    rows = wait_for(both_running, "2 running replicas", timeout=60)
    events = sorted(r["event_endpoint"] for r in rows.values())
    replays = sorted(r["replay_endpoint"] for r in rows.values())
    base = EVENT_PORTS
    assert events == [f"tcp://127.0.0.1:{base}", f"tcp://127.0.0.1:{base + 1}"]
    assert replays == [f"tcp://127.0.0.1:{base + 2}", f"tcp://127.0.0.1:{base + 3}"]
    subs = [EventSubscriber(r["event_endpoint"], r["replay_endpoint"]) for r in rows.values()]
    try:
        for sub in subs:
            assert sub.wait_connected(int(DEADLINE_S * 1000))
        prompt = "A prompt no other test sends, long enough to fill blocks: " * 3
        post(f"{fleet}/exact/v1/completions", {"model": "random", "prompt": prompt,
                                                "max_tokens": 2})  # fmt: skip
        got: list = []
        deadline = time.monotonic() + DEADLINE_S
        while not got and time.monotonic() < deadline:
            for sub in subs:
                got += [m for m in sub.poll(timeout_ms=50) if isinstance(m, tuple)]
        assert got, "no KV event batch reached a subscriber of the listed endpoints"
    finally:
        for sub in subs:
            sub.close()


def test_operator_routes_are_a_404_by_default_and_a_reset_empties_every_replica(
    fleet: str,
) -> None:
    """``GET /router`` handed any client every replica's block hashes, and a fleet had no
    cache reset. Both are now off unless enabled (``/serve``: a 404, as an unknown path);
    on ``/exact``, ``POST /reset_prefix_cache`` empties every replica's cache, their
    ``AllBlocksCleared`` empty the router's index, and a repeated prompt finds nothing."""
    for method, path in [("GET", "/router"), ("POST", "/reset_prefix_cache"),
                         ("POST", "/flush_cache")]:  # fmt: skip
        r = requests.request(method, f"{fleet}/serve{path}", timeout=30)
        assert r.status_code == 404, (path, r.text)
        assert r.json()["error"]["message"] == f"Invalid URL ({method} /serve{path})"
    body = {"prompt": workload()[0], "max_tokens": 2}
    post(f"{fleet}/exact/v1/completions", body)
    repeat = post(f"{fleet}/exact/v1/completions", body)
    assert repeat["usage"]["prompt_tokens_details"]["cached_tokens"] > 0
    assert any(s["blocks"] for s in cache_states("exact").values())

    r = requests.post(f"{fleet}/exact/reset_prefix_cache", timeout=60)
    assert (r.status_code, r.content) == (200, b""), r.text
    assert all(not s["blocks"] for s in cache_states("exact").values())

    def index_empty() -> bool:
        view = requests.get(f"{fleet}/exact/router", timeout=30).json()
        return len(view) == 2 and all(not v["blocks"] for v in view.values())

    wait_for(index_empty, "the replicas' AllBlocksCleared to empty the router's index")
    after = post(f"{fleet}/exact/v1/completions", body)
    assert after["usage"]["prompt_tokens_details"]["cached_tokens"] == 0


# ------------------------------------------------------------------ a fleet over one KV store
STORE_BYTES = 64 << 20  # each replica's store capacity (and a Mooncake client's lent segment)


def mooncake_master() -> Any:
    """A started ``MooncakeMaster``, or None when Mooncake's client does not import here or
    its master is not installed (the fleet then shares a folder: both are a shared store)."""
    from radixkv.cache.store.mooncake import MooncakeMaster

    try:
        import mooncake.store  # noqa: F401
    except ImportError:  # the client, or the RDMA verbs library it links
        return None
    try:
        master = MooncakeMaster()
    except FileNotFoundError:
        return None
    master.start()
    return master


@pytest.fixture(scope="module")
def store_fleet(fleet: str) -> Any:
    """On the ``fleet`` fixture's Ray: a third fleet of 2 random-model replicas over ONE KV
    store, routed round robin, as the app ``store``: a Mooncake pool (a ``MooncakeMaster`` on
    127.0.0.1, the distributed store a fleet shares) where Mooncake's client imports, else a
    folder (one fleet start either way: the suite's budget; a folder shared by processes is
    ``tests/cache/test_kv_store.py``'s two-process race). Yields (its URL, its app name, the
    store's ``kv_store`` spec), and deletes the app (and the store) afterwards."""
    from radixkv.serve.ray.fleet import build_fleet_app

    name = "store"
    folder = tempfile.mkdtemp(prefix="rkstore", dir="/tmp")
    master = mooncake_master()
    spec = folder if master is None else f"mooncake://{master.address}"
    try:
        app = build_fleet_app(
            "random",
            replicas=2,
            router="round_robin",
            num_blocks=NUM_BLOCKS,
            replica_cpus=0.25,
            stats_period_s=0.5,
            health_check_period_s=1.0,
            kv_store=spec,
            kv_store_capacity_bytes=STORE_BYTES,
        )
        serve.run(app, name=name, route_prefix=f"/{name}")
        yield f"{fleet}/{name}", name, spec
    finally:
        with contextlib.suppress(Exception):
            serve.delete(name)
        if master is not None:
            master.stop()
        shutil.rmtree(folder, ignore_errors=True)


def served_by(url: str, body: dict[str, Any]) -> tuple[dict[str, Any], str]:
    """``body``'s completion and the replica that served it (the one whose finished count
    rose; requests go one at a time), once every replica is idle again."""

    def rows() -> dict[str, Any]:
        return requests.get(f"{url}/replicas", timeout=30).json()

    before = rows()
    reply = post(f"{url}/v1/completions", body)

    def idle() -> dict[str, Any] | None:
        now = rows()
        return now if all(r["running"] == 0 and r["waiting"] == 0 for r in now.values()) else None

    after = wait_for(idle, "the replicas to go idle")
    [replica] = [r for r in after if after[r]["requests_finished"] > before.get(r, {}).get(
        "requests_finished", 0)]  # fmt: skip
    return reply, replica


def on_two_replicas(url: str, prompt: str) -> tuple[dict, str, dict, str]:
    """``prompt`` (greedy, with token ids) on one replica, then again until it reaches the
    other (round robin: the next request): (first reply, its replica, the other's reply,
    the other replica)."""
    body = {"prompt": prompt, "max_tokens": MAX_TOKENS, "temperature": 0,
            "return_token_ids": True}  # fmt: skip
    first, a = served_by(url, body)
    for _ in range(4):
        reply, b = served_by(url, body)
        if b != a:
            return first, a, reply, b
    pytest.fail("round robin never sent the prompt to the second replica")


def test_a_prefix_one_replica_computed_is_a_store_hit_on_the_other(store_fleet) -> None:
    """Issue 35, item 5: every replica of a fleet opens the same store, so a prompt replica
    A computed is found on replica B, which never saw it (its device and host tiers are its
    own): ``cached_tokens`` > 0 there, and the outputs are a store-off engine's."""
    from radixkv.engine.request import SamplingParams
    from radixkv.serve.models import build_engine
    from radixkv.text.tokenizer import ByteTokenizer

    url, app, spec = store_fleet
    prompt = "A system prompt the store fleet keeps for every chat it serves. " * 2
    first, _, reply, _ = on_two_replicas(url, prompt)
    assert first["usage"]["prompt_tokens_details"]["cached_tokens"] == 0
    n = len(prompt.encode())
    assert reply["usage"]["prompt_tokens"] == n
    # every full block before the prompt's last token (computed, whatever is cached), from
    # the store: B's own tiers never held it
    assert reply["usage"]["prompt_tokens_details"]["cached_tokens"] == (n - 1) // 16 * 16 > 0

    tok = ByteTokenizer()
    engine = build_engine("random", num_blocks=NUM_BLOCKS, seed=0)  # no store
    params = SamplingParams(max_new_tokens=MAX_TOKENS, stop_token_ids=tok.stop_token_ids)
    [local] = [c.output_ids for c in engine.generate([tok.encode(prompt)], params)]
    assert first["choices"][0]["token_ids"] == reply["choices"][0]["token_ids"] == local

    # what a store-aware router keys prompts with: the keyspace each replica reports in its
    # Serve metadata finds the prompt's blocks in the same store, opened anew
    from radixkv.cache.store import StoreKeyspace
    from radixkv.cache.store.opening import open_kv_store

    handle = serve.get_deployment_handle("EngineReplica", app)
    meta = handle.record_replica_metadata.remote().result(timeout_s=30)
    keyspace = StoreKeyspace(**ReplicaInfo.from_metadata(meta).store_keyspace)
    store = open_kv_store(spec, STORE_BYTES)
    try:
        assert store.contains_run(keyspace.block_keys(tok.encode(prompt))) == n // 16
    finally:
        if hasattr(store, "close"):
            store.close()


def test_fleet_metrics_carry_each_replica_s_store_counters(store_fleet) -> None:
    """Issue 35, item 5: the ingress's /metrics had no ``kv_store_*`` (nor ``host_cache_*``)
    series. Now each replica's are there, labelled ``replica``, equal to what /replicas
    reports for it: A wrote the prompt's blocks to the store, B loaded them from it."""
    from prometheus_client.parser import text_string_to_metric_families

    url, _, _ = store_fleet
    prompt = "Another prefix, for the metrics: what the store holds is counted once. " * 2
    _, a, reply, b = on_two_replicas(url, prompt)
    blocks = reply["usage"]["prompt_tokens_details"]["cached_tokens"] // 16
    assert blocks > 0
    text = requests.get(f"{url}/metrics", timeout=30).text
    rows = requests.get(f"{url}/replicas", timeout=30).json()
    per: dict[tuple[str, str], float] = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            if "replica" in sample.labels and sample.name.startswith("radixkv:kv_store_"):
                per[sample.name, sample.labels["replica"]] = sample.value
    for replica in (a, b):
        tiers = rows[replica]["tiers"]
        assert tiers["has_store"], tiers
        for series, field in [("kv_store_loaded_blocks_total", "store_loaded_blocks"),
                              ("kv_store_stored_blocks_total", "store_stored_blocks"),
                              ("kv_store_errors_total", "store_errors"),
                              ("kv_store_entries", "store_entries")]:  # fmt: skip
            assert per[f"radixkv:{series}", replica] == tiers[field], (series, replica)
    assert rows[b]["tiers"]["store_loaded_blocks"] >= blocks
    assert rows[a]["tiers"]["store_stored_blocks"] >= blocks
    assert rows[a]["tiers"]["store_errors"] == rows[b]["tiers"]["store_errors"] == 0
