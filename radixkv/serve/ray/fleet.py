"""A fleet of radixkv engine replicas on Ray Serve, behind radixkv's own prefix-aware router.

Two deployments make one Serve application:

```
HTTP -> Serve proxy -> FleetIngress (OpenAI API: parse, tokenize)          ingress.py
                        |  handle.generate(prompt_ids=..., namespace=...)  routed by PrefixRouter
                        v
                       EngineReplica x N (AsyncEngine + radix cache, KV events on ZMQ)
```

The proxy's router sees only opaque HTTP payloads, so the ingress turns each
request into token ids and calls the engine deployment through a handle: that
handle's request router (:class:`~radixkv.serve.ray.request_router.PrefixRouter`)
sees ``prompt_ids`` and places the request with a radixkv policy. Each
:class:`EngineReplica` publishes its cache's KV events (vLLM's wire format) on
its own endpoints, announced once through ``record_replica_metadata``, and its
load through ``record_routing_stats``.

``build_fleet_app(model, replicas=..., router=...)`` returns the application
(for ``serve.run`` in your own program); :func:`serve_fleet` is
``radixkv serve --replicas N --router NAME``, stopped by SIGINT or SIGTERM through
:func:`stop_on_signals`.
"""

from __future__ import annotations

import dataclasses
import logging
import math
import os
import signal
import sys
import threading
from collections.abc import AsyncIterator, Hashable, Iterator, Sequence
from contextlib import aclosing, contextmanager
from types import FrameType
from typing import Any

import ray
from ray import serve
from ray.serve.config import RequestRouterConfig

from radixkv.cache.radix import RadixCache
from radixkv.checks import check_int, check_number
from radixkv.engine.engine import DEFAULT_KV_STORE_BYTES
from radixkv.engine.request import SamplingParams
from radixkv.fleet.router import ROUTERS
from radixkv.fleet.transport import EventPublisher, offset_endpoint
from radixkv.serve.async_engine import AsyncEngine
from radixkv.serve.models import build_engine, check_engine_options, event_hasher
from radixkv.serve.openai.client import RequestOutput
from radixkv.serve.openai.metrics import DEFAULT_PREFIX, check_prefix
from radixkv.serve.ray.ingress import DRAIN_TIMEOUT_S, FleetIngress
from radixkv.serve.ray.request_router import (
    STORE_AWARE_POLICIES,
    PrefixRouter,
    PrefixRouterConfig,
    ReplicaInfo,
    keyspace_fields,
)
from radixkv.text.tokenizer import model_name

__all__ = [
    "FLEET_ROUTERS",
    "RAY_PREFIX_ROUTER",
    "SERVE_DEFAULT_ROUTER",
    "EngineReplica",
    "StopSignals",
    "build_fleet_app",
    "cache_block_hashes",
    "check_event_endpoints",
    "drain_fleet",
    "serve_fleet",
    "stop_on_signals",
]

log = logging.getLogger(__name__)

SERVE_DEFAULT_ROUTER = "serve"  # Serve's own power-of-two-choices router, untouched
# Ray's own prefix-aware router (a text prefix tree in a detached actor), for comparison.
RAY_PREFIX_ROUTER = "ray_prefix"
# (ray.serve.llm re-exports it, but importing that needs pyarrow: the internal path does not)
_RAY_PREFIX_CLASS = (
    "ray.llm._internal.serve.routing_policies.prefix_aware.prefix_aware_router"
    ".PrefixCacheAffinityRouter"
)
FLEET_ROUTERS = (*sorted(ROUTERS), SERVE_DEFAULT_ROUTER, RAY_PREFIX_ROUTER)
_APP_NAME = "radixkv"  # serve_fleet's Serve application


def cache_block_hashes(cache: RadixCache) -> list[int]:
    """The wire hashes (``ChainHasher.wire``) of every block a radix cache with events on
    holds, sorted: what its ``BlockStored`` / ``BlockRemoved`` events net out to
    (``RadixCache.block_hashes``). ``ValueError`` for a cache without events. Call it on
    the engine's thread (``AsyncEngine.call``). Complexity: O(cached blocks log cached
    blocks).
    """
    return sorted(cache.block_hashes())


@serve.deployment(name="EngineReplica")
class EngineReplica:
    """One radixkv engine as a Serve replica: an :class:`AsyncEngine` over
    ``build_engine(model, events=True, ...)`` whose KV events go out on an
    :class:`~radixkv.fleet.transport.EventPublisher`. By default it binds ports the OS
    picks on ``event_host`` (loopback: a one-machine fleet; give the node's address on a
    cluster); ``event_endpoint`` (and ``replay_endpoint``, else no replay socket) fix
    them instead, offset by the replica's rank as vLLM offsets a data-parallel rank's
    (:func:`~radixkv.fleet.transport.offset_endpoint`: rank 1 of ``tcp://*:5557``
    publishes on 5558). Either way the bound addresses are in :meth:`stats` (the
    ingress's ``/replicas``) and the replica's Serve metadata. ``torch_threads`` caps
    the model's CPU threads (replicas on one machine share its cores); ``hash_seed``
    (the driver's, passed by :func:`build_fleet_app`: a Ray worker's environment need
    not be the driver's), ``dtype``, ``attention_backend``, ``cuda_graphs`` and the
    ``kv_store*`` settings go to ``build_engine`` (every replica opens the same store).
    """

    async def __init__(
        self,
        model: str,
        *,
        block_size: int = 16,
        num_blocks: int | None = None,
        seed: int = 0,
        max_num_seqs: int = 64,
        event_host: str = "127.0.0.1",
        event_endpoint: str | None = None,
        replay_endpoint: str | None = None,
        torch_threads: int | None = None,
        hash_seed: int | str | None = None,
        dtype: str = "auto",
        attention_backend: str | None = None,
        cuda_graphs: bool = True,
        kv_store: str | None = None,
        kv_store_capacity_bytes: int | None = None,
        kv_store_write_policy: str | None = None,
    ) -> None:
        if torch_threads is not None:
            import torch

            torch.set_num_threads(torch_threads)
        engine = build_engine(
            model,
            block_size=block_size,
            num_blocks=num_blocks,
            events=True,
            hash_seed=hash_seed,
            seed=seed,
            max_num_seqs=max_num_seqs,
            dtype=dtype,
            attention_backend=attention_backend,
            cuda_graphs=cuda_graphs,
            kv_store=kv_store,
            kv_store_capacity_bytes=kv_store_capacity_bytes,
            kv_store_write_policy=kv_store_write_policy,
        )
        if event_endpoint is None:  # ports the OS picks, replay included
            event_endpoint = replay_endpoint = f"tcp://{event_host}:*"
        rank = serve.get_replica_context().rank.rank
        replay = None if replay_endpoint is None else offset_endpoint(replay_endpoint, rank)
        self._publisher = EventPublisher(offset_endpoint(event_endpoint, rank), replay)
        self.engine = AsyncEngine(engine, event_sink=self._publisher.publish)
        await self.engine.start()
        hasher = engine.cache.events_hasher
        alloc = engine.allocator
        self._has_host_tier = engine.host_kv_pool is not None  # asked for, or under a kv_store
        self.info = ReplicaInfo(
            event_endpoint=self._publisher.endpoint,
            replay_endpoint=self._publisher.replay_endpoint,
            capacity_blocks=alloc.num_blocks,
            block_size=alloc.block_size,
            hash_name=hasher.name,
            hash_seed=hasher.seed,
            store_keyspace=(
                None if engine.store_tier is None else keyspace_fields(engine.store_tier.keyspace)
            ),
        )

    def record_replica_metadata(self) -> dict[str, Any]:
        """Serve's once-per-replica hook: where this replica's KV events are, how it hashes."""
        return self.info.to_metadata()

    def limits(self) -> dict[str, int]:
        """What this replica accepts (:class:`~radixkv.engine.request.EngineLimits`'
        fields): the ingress checks requests against them before routing."""
        return dataclasses.asdict(self.engine.limits)

    def record_routing_stats(self) -> dict[str, Any]:
        """Serve's periodic hook (every ``request_routing_stats_period_s``): current load."""
        m = self.engine.metrics()
        return {"running": m.running, "waiting": m.waiting, "kv_usage": m.kv_usage}

    async def generate(
        self,
        hint: Any = None,
        *,
        prompt_ids: Sequence[int],
        params: SamplingParams,
        namespace: Hashable = None,
    ) -> AsyncIterator[RequestOutput]:
        """Stream one request's outputs (call with ``handle.options(stream=True)`` and the
        keyword ``prompt_ids``, which the router reads; ``hint``, ignored here, is the
        prompt as text for Ray's prefix router). The engine's ``TypeError``/``ValueError``
        for a bad request comes out of the first iteration; leaving early aborts the
        request."""
        async with aclosing(self.engine.generate(prompt_ids, params, namespace)) as stream:
            async for out in stream:
                yield out

    async def cache_state(self) -> dict[str, Any]:
        """This replica's id (as routers know it), actor name and the block hashes its cache
        holds right now (:func:`cache_block_hashes`, read on the engine thread)."""
        ctx = serve.get_replica_context()
        blocks = await self.engine.call(lambda engine: cache_block_hashes(engine.cache))
        return {
            "replica_id": ctx.replica_id.unique_id,
            "actor_name": ray.get_runtime_context().get_actor_name(),
            "blocks": blocks,
        }

    async def stats(self) -> dict[str, Any]:
        """This replica's id, its actor's id (Ray's, which names it in a dead actor's error),
        where its KV events are published, its engine's metrics (every ``EngineMetrics``
        field) and, under ``"tiers"``, its host tier's and KV store's counters (every
        ``TierStats`` field, read on the engine thread; None without a host tier)."""
        m = self.engine.metrics()
        tiers = None
        if self._has_host_tier and self.engine.is_running:
            stats = await self.engine.call(lambda engine: engine.tier_stats())
            tiers = dataclasses.asdict(stats)
        return {
            "replica_id": serve.get_replica_context().replica_id.unique_id,
            "actor_id": ray.get_runtime_context().get_actor_id(),
            "event_endpoint": self.info.event_endpoint,
            "replay_endpoint": self.info.replay_endpoint,
            **dataclasses.asdict(m),
            "tiers": tiers,
        }

    async def drain(self) -> None:
        """End every open request with ``"abort"`` and refuse new ones
        (``AsyncEngine.drain``): the fleet's first step on SIGINT/SIGTERM."""
        self.engine.drain()

    async def reset_prefix_cache(self) -> dict[str, Any]:
        """This replica's id and whether it emptied its prefix cache
        (``AsyncEngine.reset_prefix_cache``: not while a request runs or waits); its
        ``AllBlocksCleared`` goes out on its KV event stream."""
        return {
            "replica_id": serve.get_replica_context().replica_id.unique_id,
            "reset": await self.engine.reset_prefix_cache(),
        }

    def check_health(self) -> None:
        """Serve's health check: the engine thread must be alive."""
        if not self.engine.is_running:
            raise RuntimeError("the engine thread is not running")

    async def __del__(self) -> None:
        await self.engine.shutdown()
        self._publisher.close()


def build_fleet_app(
    model: str,
    *,
    replicas: int,
    router: str = "exact",
    block_size: int = 16,
    num_blocks: int | None = None,
    seed: int = 0,
    max_num_seqs: int = 64,
    replica_cpus: float = 1.0,
    ingress_replicas: int = 1,
    router_options: dict[str, Any] | None = None,
    event_host: str = "127.0.0.1",
    event_endpoint: str | None = None,
    replay_endpoint: str | None = None,
    metrics_prefix: str = DEFAULT_PREFIX,
    stats_period_s: float = 1.0,
    health_check_period_s: float = 10.0,
    dtype: str = "auto",
    attention_backend: str | None = None,
    cuda_graphs: bool = True,
    enable_cache_reset: bool = False,
    enable_router_view: bool = False,
    kv_store: str | None = None,
    kv_store_capacity_bytes: int | None = None,
    kv_store_write_policy: str | None = None,
    store_aware: bool = False,
) -> serve.Application:
    """The fleet as a Serve application: :class:`FleetIngress` over ``replicas`` x
    :class:`EngineReplica` of ``model``, routed by ``router``.

    ``router`` is a radixkv policy (a name in ``ROUTERS``; ``router_options``
    go to its constructor) run by :class:`PrefixRouter`, or ``"serve"`` for
    Serve's own power-of-two-choices router. The replicas' block size and
    chain hash are the router's (:func:`~radixkv.serve.models.event_hasher`), seeded
    by vLLM's rule in this process (``PYTHONHASHSEED``, else ``"vllm-none-hash"``) and
    passed to every replica, so all name a block as a vLLM server here would.
    Each replica reserves ``replica_cpus`` Ray CPUs and runs torch on as many
    threads (at least one); ``stats_period_s`` is how often Serve polls its
    load. ``event_endpoint`` / ``replay_endpoint`` fix where replica ``r`` publishes its
    KV events (each endpoint offset by ``r``; :class:`EngineReplica`), ``None``: ports the
    OS picks on ``event_host``. ``metrics_prefix`` names the ingress's ``/metrics``
    (``"vllm"``: vLLM's names). ``dtype``, ``attention_backend``, ``cuda_graphs`` and
    ``kv_store`` (with its capacity and write policy: one store every replica opens, a
    directory or a Mooncake master, so a block one replica computed is a hit on another)
    are each replica's (:func:`~radixkv.serve.models.build_engine`); ``store_aware`` (with
    ``kv_store`` and a prefix-aware ``router``, ``exact`` or ``approx``) has the router open
    that store too and price the blocks it holds as loads (:class:`PrefixRouterConfig`'s
    ``store``; ``route-sim --store-aware`` in the simulator). ``enable_cache_reset``
    and ``enable_router_view`` add the ingress's operator routes (:class:`FleetIngress`;
    off, they are a 404). ``ValueError`` naming a bad argument, two replicas' endpoints
    that would collide included.
    """
    replicas = check_int("replicas", replicas, low=1)
    check_engine_options(dtype, attention_backend, cuda_graphs)
    check_prefix(metrics_prefix)
    check_event_endpoints(event_endpoint, replay_endpoint, replicas)
    if router not in FLEET_ROUTERS:
        raise ValueError(f"router must be one of {list(FLEET_ROUTERS)}, got {router!r}")
    replica_cpus = check_number("replica_cpus", replica_cpus, low=0, strict=True)
    ingress_replicas = check_int("ingress_replicas", ingress_replicas, low=1)
    if not isinstance(store_aware, bool):
        raise ValueError(f"store_aware must be a bool, got {store_aware!r}")
    if store_aware and (kv_store is None or router not in STORE_AWARE_POLICIES):
        raise ValueError(
            f"store_aware needs a kv_store and a router in {STORE_AWARE_POLICIES}, got "
            f"kv_store={kv_store!r}, router={router!r}"
        )
    hasher = event_hasher()  # one seed for the router and every replica, read here
    options: dict[str, Any] = {
        "num_replicas": replicas,
        "max_ongoing_requests": 2 * max_num_seqs,  # the engine batches; the rest wait there
        "ray_actor_options": {"num_cpus": replica_cpus},
        "health_check_period_s": health_check_period_s,
    }
    stats = {"request_routing_stats_period_s": stats_period_s}
    if router == SERVE_DEFAULT_ROUTER:
        options["request_router_config"] = RequestRouterConfig(**stats)
    elif router == RAY_PREFIX_ROUTER:
        options["request_router_config"] = RequestRouterConfig(
            request_router_class=_RAY_PREFIX_CLASS, **stats
        )
    else:
        config = PrefixRouterConfig(
            policy=router,
            block_size=block_size,
            hash_name=hasher.name,
            hash_seed=hasher.seed,
            seed=seed,
            options=dict(router_options or {}),
            store=kv_store if store_aware else None,
            store_capacity_bytes=(
                None
                if not store_aware
                else kv_store_capacity_bytes or DEFAULT_KV_STORE_BYTES
            ),
        )
        config.build_router()  # a bad option fails here, not in every handle's router
        options["request_router_config"] = RequestRouterConfig(
            request_router_class=PrefixRouter,
            request_router_kwargs=config.to_kwargs(),
            **stats,
        )
    engine = EngineReplica.options(**options).bind(
        model,
        block_size=block_size,
        num_blocks=num_blocks,
        seed=seed,
        max_num_seqs=max_num_seqs,
        event_host=event_host,
        event_endpoint=event_endpoint,
        replay_endpoint=replay_endpoint,
        dtype=dtype,
        attention_backend=attention_backend,
        cuda_graphs=cuda_graphs,
        torch_threads=max(1, math.floor(replica_cpus)),
        hash_seed=hasher.seed,
        kv_store=kv_store,
        kv_store_capacity_bytes=kv_store_capacity_bytes,
        kv_store_write_policy=kv_store_write_policy,
    )
    ingress = FleetIngress.options(
        num_replicas=ingress_replicas,
        max_ongoing_requests=4 * max_num_seqs * replicas,
        ray_actor_options={"num_cpus": 0.1},
    )
    return ingress.bind(
        engine,
        model=model,
        model_name=model_name(model),
        send_prompt_text=router == RAY_PREFIX_ROUTER,
        metrics_prefix=metrics_prefix,
        enable_cache_reset=enable_cache_reset,
        enable_router_view=enable_router_view,
    )


def check_event_endpoints(event: str | None, replay: str | None, replicas: int) -> None:
    """``ValueError`` unless ``replicas`` publishers can bind ``event`` / ``replay`` offset by
    their ranks (:func:`~radixkv.fleet.transport.offset_endpoint`) without two sharing an
    address: a replay endpoint needs an event endpoint, and fixed ports of one host must
    lie ``replicas`` apart. Complexity: O(replicas)."""
    if event is None:
        if replay is not None:
            raise ValueError(f"replay_endpoint {replay!r} needs an event_endpoint")
        return
    taken: dict[str, str] = {}
    for name, base in (("event_endpoint", event), ("replay_endpoint", replay)):
        if base is None:
            continue
        for rank in range(replicas):
            address = offset_endpoint(base, rank)
            if address.endswith((":*", ":0")):
                break  # the OS picks every port: nothing collides
            # a TCP port is taken whatever host it is bound on (``*`` binds them all)
            key = address.rsplit(":", 1)[1] if address.startswith("tcp://") else address
            if key in taken:
                raise ValueError(
                    f"{name} {base!r} gives replica {rank} the address {address}, which "
                    f"{taken[key]} already has: give endpoints {replicas} ports apart"
                )
            taken[key] = f"the {name} of replica {rank}"


def drain_fleet(app_name: str, timeout_s: float = DRAIN_TIMEOUT_S) -> None:
    """Drain the fleet ``app_name`` before Serve stops it: every ingress replica's
    :meth:`~radixkv.serve.ray.ingress.FleetIngress.drain` (no new requests; every engine
    replica ends its open ones with ``"abort"``; wait until the ingress has sent those
    ends), at most ``timeout_s``. What fails (no such application, a replica that does
    not answer) is one line on stderr: Serve's own stop still follows."""
    try:
        ingress = serve.get_deployment_handle(FleetIngress.name, app_name)
        results = ingress.broadcast("drain", timeout_s).results(
            timeout_s=timeout_s + 5.0, return_exceptions=True
        )
    except Exception as exc:  # noqa: BLE001 - a drain that fails must not stop the stop
        results = [exc]
    for r in results:
        if isinstance(r, BaseException):
            first = (str(r).splitlines() or [""])[0]
            print(f"radixkv fleet: drain failed: {type(r).__name__}: {first}", file=sys.stderr)
        elif r:
            print(f"radixkv fleet: {r} responses still open after the drain", file=sys.stderr)


@dataclasses.dataclass
class StopSignals:
    """What :func:`stop_on_signals` yields: the first SIGINT or SIGTERM it caught (None
    until then), and ``exit_now``, which the caller sets before its last shutdown step."""

    received: signal.Signals | None = None
    exit_now: bool = False


@contextmanager
def stop_on_signals() -> Iterator[StopSignals]:
    """While open, SIGINT and SIGTERM raise ``KeyboardInterrupt`` in the main thread,
    wherever it is, as Ctrl-C does (Ray's blocking calls pass that one exception through,
    and only it), and the first is recorded in the yielded :class:`StopSignals`. So the
    caller shuts down in its ``except``/``finally``, and a later signal can cut a slow
    step of that shutdown short. Once the caller sets ``exit_now``, a signal ends the
    process at once with ``os._exit(128 + signum)``. On leaving, the handlers from before
    come back.

    Enter it after ``ray.init``: Ray's core worker puts Abseil's failure handler on
    SIGTERM (it prints ``*** SIGTERM received`` and a C++ stack, then aborts), and this
    replaces it for SIGINT and SIGTERM only, so a real crash (SIGSEGV, SIGABRT) still
    gets Ray's stack dump. Main thread only (``ValueError`` elsewhere, from ``signal``).
    """
    stop = StopSignals()

    def handle(signum: int, frame: FrameType | None) -> None:
        if stop.exit_now:
            os.write(2, f"radixkv fleet: {signal.Signals(signum).name}, exiting now\n".encode())
            os._exit(128 + signum)
        if stop.received is None:
            stop.received = signal.Signals(signum)
        raise KeyboardInterrupt

    previous = {sig: signal.signal(sig, handle) for sig in (signal.SIGINT, signal.SIGTERM)}
    try:
        yield stop
    finally:
        for sig, old in previous.items():
            signal.signal(sig, signal.SIG_DFL if old is None else old)


def serve_fleet(
    model: str,
    *,
    replicas: int,
    router: str,
    host: str,
    port: int,
    block_size: int,
    num_blocks: int | None,
    seed: int,
    event_endpoint: str | None = None,
    replay_endpoint: str | None = None,
    metrics_prefix: str = DEFAULT_PREFIX,
    dtype: str = "auto",
    attention_backend: str | None = None,
    cuda_graphs: bool = True,
    enable_cache_reset: bool = False,
    enable_router_view: bool = False,
    kv_store: str | None = None,
    kv_store_capacity_bytes: int | None = None,
    kv_store_write_policy: str | None = None,
    store_aware: bool = False,
) -> signal.Signals:
    """``radixkv serve --replicas N --router NAME``: run the fleet on ``host:port``, print
    the URL, each replica's KV-event endpoints (``event_endpoint`` / ``replay_endpoint``
    offset by rank, else ports the OS picks; :func:`build_fleet_app`) and a curl line, and
    serve until SIGINT or SIGTERM (:func:`stop_on_signals`);
    return that signal once the fleet is down. Each replica gets an equal share of the
    machine's CPUs, at most one. ``enable_cache_reset``, ``enable_router_view``, the
    ``kv_store*`` settings and ``store_aware`` go to :func:`build_fleet_app`.

    On a signal it drains the fleet first, as one server drains its engine
    (:func:`drain_fleet`): new requests get a 503, every open one ends with ``"abort"``
    (a stream with its final chunk and ``[DONE]``), and Serve stops only once the
    ingress has sent those ends, so its graceful stop finds no request to wait for.

    Without Ray running and without ``RAY_ADDRESS``, it starts a Ray cluster of its own
    and stops all of it (Serve, then every Ray process) on the way out. Attached to a
    cluster (``RAY_ADDRESS``, or Ray already initialized by the caller), it deletes only
    its own Serve application; the cluster and its other applications stay. A second
    signal skips Serve's graceful stop (Ray's own stop, about a second, still runs); one
    during Ray's stop exits at once."""
    if router not in FLEET_ROUTERS:  # before anything starts
        raise ValueError(f"router must be one of {list(FLEET_ROUTERS)}, got {router!r}")
    replicas = check_int("replicas", replicas, low=1)
    check_prefix(metrics_prefix)
    check_event_endpoints(event_endpoint, replay_endpoint, replicas)
    check_engine_options(dtype, attention_backend, cuda_graphs)
    connect = not ray.is_initialized()  # else the caller's Ray: it stays connected
    own_cluster = connect and not os.environ.get("RAY_ADDRESS")
    if connect:
        os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")
        # "local": a cluster of our own, never one `ray start` left on this machine,
        # which ray.init() alone would join and our shutdown would then have to spare.
        ray.init(address="local" if own_cluster else None, include_dashboard=False)
    with stop_on_signals() as stop:
        try:
            cpus = float(ray.cluster_resources().get("CPU", 1.0))
            share = max(0.1, min(1.0, (cpus - 0.5) / replicas))
            app = build_fleet_app(
                model,
                replicas=replicas,
                router=router,
                block_size=block_size,
                num_blocks=num_blocks,
                seed=seed,
                replica_cpus=round(share, 2),
                event_endpoint=event_endpoint,
                replay_endpoint=replay_endpoint,
                metrics_prefix=metrics_prefix,
                dtype=dtype,
                attention_backend=attention_backend,
                cuda_graphs=cuda_graphs,
                enable_cache_reset=enable_cache_reset,
                enable_router_view=enable_router_view,
                kv_store=kv_store,
                kv_store_capacity_bytes=kv_store_capacity_bytes,
                kv_store_write_policy=kv_store_write_policy,
                store_aware=store_aware,
            )
            serve.start(http_options={"host": host, "port": port})
            serve.run(app, name=_APP_NAME, route_prefix="/")
            url = f"http://{host}:{port}"
            name = model_name(model)
            print(f"radixkv fleet: {replicas} x {name}, router {router}, at {url}", flush=True)
            engines = serve.get_deployment_handle("EngineReplica", _APP_NAME)
            for row in sorted(
                engines.broadcast("stats").results(timeout_s=60), key=lambda r: r["replica_id"]
            ):
                replay = row["replay_endpoint"]
                print(
                    f"  replica {row['replica_id']}: KV events on {row['event_endpoint']}"
                    + (f", replay on {replay}" if replay else ""),
                    flush=True,
                )
            print(
                f"curl {url}/v1/completions -H 'Content-Type: application/json' "
                f'-d \'{{"model": "{name}", "prompt": "Hello", "max_tokens": 16}}\'',
                flush=True,
            )
            threading.Event().wait()  # until a signal interrupts it
        except KeyboardInterrupt:
            signum = stop.received or signal.SIGINT  # None: a KeyboardInterrupt of Ray's own
            print(f"radixkv fleet: {signum.name}, shutting down", file=sys.stderr, flush=True)
            return signum
        finally:
            try:  # the drain and Serve's graceful stop: a second signal skips both
                if stop.received is not None:
                    drain_fleet(_APP_NAME)
                if own_cluster:
                    serve.shutdown()
                elif _APP_NAME in serve.status().applications:  # not there: stopped early
                    serve.delete(_APP_NAME)
            except KeyboardInterrupt:
                pass
            finally:
                stop.exit_now = True  # Ray's own stop is bounded: a signal now exits at once
                if connect:
                    ray.shutdown(wait_for_processes=True)
