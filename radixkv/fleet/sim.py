"""A discrete-event fleet simulator: N replicas with real radix caches, one router in front.

Each replica (:class:`~radixkv.fleet.replica.Replica`) is a real
:class:`~radixkv.cache.radix.RadixCache` (``"lru"`` eviction by default) over
its own ``BlockAllocator(capacity_blocks, block_size)``, with KV events on
(hashed with :data:`FLEET_HASHER`; build the router with the same hasher, as
:func:`build_router` does), a FIFO queue and a :class:`ServiceModel`.

**Units.** A Mooncake trace names each 512-token block of a prompt by one hash
id; the simulator treats each id as one token of the caches (block size 1), as
:mod:`radixkv.replay` does. So cache figures (capacity, overlaps, regret) are
in trace blocks, and time figures (the service model) in real tokens:
``tokens_per_id`` (512) converts, and a request's hit in real tokens is
``min(hit_ids * 512, input_length)`` (the partial last block capped), exactly
replay's ``hit_tokens``.

**Service.** Two disciplines (:mod:`radixkv.fleet.replica`):

- *serial* (``batch=None``): one request at a time, FIFO, busy for prefill +
  decode; the cache step (match, evict, insert, release) runs when the
  request starts, as ``radixkv.replay``'s radix replayer does, so one replica
  equals one replayed cache. TTFT is queue wait + prefill.
- *batched* (a :class:`BatchConfig`): continuous batching with chunked
  prefill under a token budget; admitted requests hold their blocks until they
  finish, and a request waits while the cache cannot hold it. TTFT is the end
  of its prefill's last chunk.

**A shared store** (``store=``, :mod:`radixkv.fleet.shared_store`): each
replica's cache is a ``TieredRadixCache`` with a host tier of its own over one
real store tier each, all over one ``MemoryStore``; a prompt's blocks found on
the host or in the store are loaded rather than computed, and the replica pays
the load (``SharedStore.load_seconds``) before the prefill, synchronously.
Without it (the default) every replica is a plain ``RadixCache``.

**Events.** After each cache step the replica's pending events go to
``router.on_events`` at once, or ``event_delay`` simulated seconds later (the
publish gap that speculative entries cover). When a request finishes, the
router hears ``on_finish``. Routers with a clock read the simulation's
:class:`SimClock` (simulated seconds).

**Metrics** (:class:`~radixkv.fleet.results.SimResult`, rolled up in
:mod:`radixkv.fleet.results`): fleet token hit rate, modelled TTFT
percentiles, load balance, the offered load and the measured utilisation,
Dynamo's regret (from ``peek`` on every replica at decision time) and the
measured wall time of every ``choose`` call.

**The loop.** One handler per event kind (an arrival is routed, a replica's
wake-up advances its scheduler, a delayed event batch reaches the router);
the run's measurements go into a :class:`~radixkv.fleet.results.RunTally`.
"""

from __future__ import annotations

import heapq
import inspect
import math
import time
from collections.abc import Hashable, Iterable
from dataclasses import dataclass
from typing import Any, Protocol

import numpy as np

from radixkv.cache.events import KVCacheEvent
from radixkv.checks import check_int, check_number
from radixkv.fleet.replica import FLEET_HASHER, Replica, make_schedulers
from radixkv.fleet.results import RunTally, SimResult, roll_up
from radixkv.fleet.routing import Router, RouteRequest
from radixkv.fleet.service import SERVICE_PROFILES, BatchConfig, ServiceModel
from radixkv.fleet.shared_store import DEVICE_ONLY, SharedStore, StoreView, Tiers
from radixkv.replay.trace import MOONCAKE_BLOCK_SIZE, Trace

__all__ = [
    "FLEET_HASHER",
    "SERVICE_PROFILES",
    "BatchConfig",
    "FleetSim",
    "Replica",
    "ServiceModel",
    "SimClock",
    "SimRequest",
    "SharedStore",
    "SimResult",
    "build_router",
    "offered_load",
    "requests_from_trace",
    "simulate",
    "single_cache_hit_rate",
]


# --------------------------------------------------------------------------- requests
@dataclass(frozen=True)
class SimRequest:
    """One request: arrival (s), prompt ``tokens`` (int32 ids, one per trace block), and its
    real token counts (``prompt_tokens``, ``output_tokens``) for the service model."""

    request_id: int
    arrival: float
    tokens: np.ndarray
    prompt_tokens: int
    output_tokens: int
    session: Hashable = None
    namespace: Hashable = None


def requests_from_trace(trace: Trace, limit: int | None = None) -> list[SimRequest]:
    """The first ``limit`` (all: None) requests of ``trace``, arrivals in seconds from the first.

    Mooncake timestamps are milliseconds. Tokens are the dense ids (one per
    512-token block). Complexity: O(total ids).
    """
    n = trace.num_requests if limit is None else min(limit, trace.num_requests)
    if n == 0:
        return []
    ts = trace.timestamps[:n].astype(np.float64)
    arrivals = (ts - ts[0]) / 1000.0
    return [
        SimRequest(
            request_id=i,
            arrival=float(arrivals[i]),
            tokens=trace.request_ids(i),
            prompt_tokens=int(trace.input_lengths[i]),
            output_tokens=int(trace.output_lengths[i]),
        )
        for i in range(n)
    ]


def _as_requests(requests: Trace | Iterable[SimRequest]) -> list[SimRequest]:
    if isinstance(requests, Trace):
        return requests_from_trace(requests)
    out = list(requests)
    for r in out:
        if not isinstance(r, SimRequest):
            raise TypeError(f"requests must be a Trace or SimRequests, got {type(r).__name__}")
    return out


def offered_load(
    requests: Trace | Iterable[SimRequest],
    service: ServiceModel,
    num_replicas: int,
    rate: float = 1.0,
    batch: BatchConfig | None = None,
) -> float:
    """The fleet's utilisation with no cache at all: total work / (span x replicas).

    A request's work is its service time alone (serial: prefill + decode) or
    its share of a saturated batched replica (``BatchConfig.work``). ``span``
    is the arrival span at ``rate``. Above 1 only caching keeps queues
    bounded. A benchmark picks ``rate = target / offered_load(..., rate=1)``.
    """
    reqs = _as_requests(requests)
    if len(reqs) < 2:
        return 0.0
    work = sum(_work(service, batch, r.prompt_tokens, 0, r.output_tokens) for r in reqs)
    span = (max(r.arrival for r in reqs) - min(r.arrival for r in reqs)) / rate
    return work / (span * num_replicas) if span > 0 else float("inf")


def _work(
    service: ServiceModel, batch: BatchConfig | None, prompt: int, hit: int, output: int
) -> float:
    if batch is None:
        return service.prefill(prompt, hit) + service.decode(output)
    return batch.work(service, prompt, hit, output)


# --------------------------------------------------------------------------- clock / routers
class SimClock:
    """The simulation's clock, for routers that take a ``clock`` callable: ``now * scale``.

    The simulator sets ``now`` (simulated seconds). ``scale`` lets a router's
    clock run in another time base (``scale=rate``: trace seconds). The
    prefix-aware routers' queue estimates are in simulated seconds, so
    :func:`build_router`'s callers keep the default 1.
    """

    __slots__ = ("now", "scale")

    def __init__(self, scale: float = 1.0) -> None:
        self.scale = check_number("scale", scale, low=0, strict=True, finite=False)
        self.now = 0.0

    def __call__(self) -> float:
        return self.now * self.scale


def build_router(
    name: str,
    clock: SimClock,
    *,
    block_size: int = 1,
    seed: int = 0,
    service: ServiceModel | None = None,
    tokens_per_id: int = MOONCAKE_BLOCK_SIZE,
    store: StoreView | None = None,
    **options: Any,
) -> Router:
    """``make_router(name, ...)`` for the simulator: :data:`FLEET_HASHER`; ``clock`` to the
    policies that take one (so their clocks run in simulated seconds); to the policies
    that score in time, the simulator's ``service`` model (default: ``ServiceModel()``) and
    ``tokens_per_block`` = ``block_size * tokens_per_id`` real tokens per block; and
    ``store`` (a shared store's :meth:`SharedStore.view`; None: none) to the policies that
    take one (the prefix-aware ones: store-aware routing), ignored by the others."""
    from radixkv.fleet.router import ROUTERS, make_router

    factory = ROUTERS.get(name)
    if factory is not None:
        params: set[str] = set()  # the keywords of its __init__ and every base's
        for cls in factory.__mro__:
            if "__init__" in vars(cls):
                params.update(inspect.signature(vars(cls)["__init__"]).parameters)
        if "clock" in params:
            options.setdefault("clock", clock)
        if "service" in params:
            options.setdefault("service", service if service is not None else ServiceModel())
            options.setdefault("tokens_per_block", block_size * tokens_per_id)
        if "store" in params and store is not None:
            options.setdefault("store", store)
    return make_router(name, block_size=block_size, hasher=FLEET_HASHER, seed=seed, **options)


# --------------------------------------------------------------------------- the simulator
_WAKE, _DELIVER, _ARRIVE = 0, 1, 2  # same-time order: advance replicas, inform, then route
_EVENTS_PER_REQUEST = 16  # runs that progress measured at most 4 (the tests, the shared traces)


class _Progress(Protocol):
    """What a run reports finished requests to: a tqdm bar, or nothing."""

    def update(self, n: int) -> object: ...

    def close(self) -> None: ...


class _NoProgress:
    """The progress bar when ``progress`` is off: does nothing."""

    def update(self, n: int) -> None:
        pass

    def close(self) -> None:
        pass


class _Run:
    """One run: the event heap, one handler per event kind, and what the schedulers call.

    The heap holds ``(time, kind, seq, payload)``: at equal times a wake-up
    (payload ``(k, version)``) goes before a delayed event delivery (``(k,
    events)``), and both before an arrival (the request's index), so replicas
    are brought up to date, then the router is informed, then it routes;
    ``seq`` keeps the push order among equals. What the run measures goes into
    ``tally`` (:class:`~radixkv.fleet.results.RunTally`).
    """

    def __init__(self, sim: FleetSim, reqs: list[SimRequest], router: Router, rate: float) -> None:
        n = len(reqs)
        self.sim, self.reqs, self.router, self.rate = sim, reqs, router, rate
        self.service = sim.service
        self.replicas = sim.replicas
        self.states = [r.state for r in sim.replicas]
        self.by_id = {st.replica_id: k for k, st in enumerate(self.states)}
        self.tally = RunTally(n)
        self.route_reqs: list[RouteRequest | None] = [None] * n
        self.version = [0] * len(sim.replicas)
        self.bar: _Progress = _NoProgress()
        self.schedulers = make_schedulers(sim.replicas, self, sim.batch)
        self.heap: list[tuple[float, int, int, Any]] = [
            (r.arrival / rate, _ARRIVE, i, i) for i, r in enumerate(reqs)
        ]
        heapq.heapify(self.heap)
        self.seq = n

    def push(self, t: float, kind: int, payload: Any) -> None:
        heapq.heappush(self.heap, (t, kind, self.seq, payload))
        self.seq += 1

    def loop(self) -> float:
        """Handle every event in time order; return the time of the last (the makespan).

        A request brings one arrival and at most one event delivery; a replica
        plans a wake-up (one at a time) on an arrival or on a wake-up that
        gave a request its first token or finished one, so a run handles a
        few events per request. ``RuntimeError`` past
        :data:`_EVENTS_PER_REQUEST` per request: a scheduler planning
        wake-ups that make no progress, which would otherwise spin forever.
        """
        handlers = {_WAKE: self.on_wake, _DELIVER: self.on_deliver, _ARRIVE: self.on_arrive}
        heap, clock = self.heap, self.sim.clock
        left = _EVENTS_PER_REQUEST * (len(self.reqs) + 1)
        now = 0.0
        while heap:
            left -= 1
            if left < 0:
                raise RuntimeError(
                    f"the simulation handled {_EVENTS_PER_REQUEST} events per request for "
                    f"{len(self.reqs)} requests and is at {now} s: a replica's scheduler "
                    "plans wake-ups that make no progress"
                )
            now, kind, _, payload = heapq.heappop(heap)
            clock.now = now
            handlers[kind](now, payload)
        return now

    # ---------------------------------------------------------------- event handlers
    def on_arrive(self, now: float, i: int) -> None:
        """Request ``i`` arrives: measure every replica's overlap, route it, queue it there."""
        req = self.reqs[i]
        bs = self.sim.block_size
        overlaps = [rep.cache.peek(req.tokens, req.namespace) // bs for rep in self.replicas]
        rr = RouteRequest(i, req.tokens, req.namespace, req.session)
        self.route_reqs[i] = rr
        t0 = time.perf_counter_ns()
        rid = self.router.choose(rr, self.states)
        elapsed = time.perf_counter_ns() - t0
        k = self.by_id[rid]
        self.tally.record_route(i, k, overlaps, len(req.tokens) // bs, elapsed)
        self.replicas[k].state.in_flight += 1
        self.schedulers[k].arrive(i, now)

    def on_wake(self, now: float, payload: tuple[int, int]) -> None:
        """Replica ``k``'s planned wake-up, unless a later ``schedule`` replaced it."""
        k, version = payload
        if version == self.version[k]:
            self.schedulers[k].wake(now)

    def on_deliver(self, now: float, payload: tuple[int, list[KVCacheEvent]]) -> None:
        """Replica ``k``'s delayed KV events reach the router."""
        k, events = payload
        self.router.on_events(self.states[k].replica_id, events)
        self.tally.events_delivered += len(events)

    # ---------------------------------------------------------------- the scheduler's host
    def prompt(self, i: int) -> tuple[int, int]:
        r = self.reqs[i]
        return r.prompt_tokens, r.output_tokens

    def admit(self, k: int, i: int, exclusive: bool) -> tuple[int, np.ndarray, float] | None:
        req = self.reqs[i]
        rep = self.replicas[k]
        got = rep.place(req.tokens, req.namespace, exclusive=exclusive)
        if got is None:
            return None
        hit, blocks, host, store = got
        self.publish(k, rep.take_events())
        tally = self.tally
        tally.hit_ids[i] = hit
        tally.host_ids[i] = host
        tally.store_ids[i] = store
        # real tokens: the partial last block capped, the lower tiers' part last in the hit
        per, prompt = self.sim.tokens_per_id, req.prompt_tokens
        real = min(hit * per, prompt)
        upper = min((hit - store) * per, prompt)
        device = min((hit - store - host) * per, prompt)
        load = rep.tiers.load_seconds(self.service, upper - device, real - upper)
        return real, blocks, load

    def first_token(self, i: int, t: float) -> None:
        self.tally.ttft[i] = t - self.reqs[i].arrival / self.rate

    def finish(self, k: int, i: int, t: float) -> None:
        rep = self.replicas[k]
        rep.served += 1
        rep.state.in_flight -= 1
        self.router.on_finish(rep.state.replica_id, self.route_reqs[i])
        self.route_reqs[i] = None
        self.bar.update(1)

    def schedule(self, k: int, t: float) -> None:
        self.version[k] += 1
        if t < math.inf:
            self.push(t, _WAKE, (k, self.version[k]))

    def publish(self, k: int, events: list[KVCacheEvent]) -> None:
        """Hand replica ``k``'s new KV events to the router now, or ``event_delay`` later."""
        if not events:
            return
        delay = self.sim.event_delay
        if delay > 0:
            self.push(self.sim.clock.now + delay, _DELIVER, (k, events))
        else:
            self.router.on_events(self.states[k].replica_id, events)
            self.tally.events_delivered += len(events)


class FleetSim:
    """``num_replicas`` replicas (:class:`Replica`, in ``replicas``) and the event loop.

    ``batch`` None serves one request at a time per replica; a
    :class:`BatchConfig` batches (see the module docstring). ``store`` (None:
    none) puts a host tier below each replica's device and one
    :class:`~radixkv.fleet.shared_store.SharedStore` below them all; a request's
    loads from them cost its replica ``SharedStore.load_seconds`` before its
    prefill. One ``run`` per instance (the caches and the store keep what a run
    left, for inspection).
    """

    def __init__(
        self,
        *,
        num_replicas: int,
        capacity_blocks: int,
        block_size: int = 1,
        eviction: str = "lru",
        service: ServiceModel | None = None,
        batch: BatchConfig | None = None,
        tokens_per_id: int = MOONCAKE_BLOCK_SIZE,
        event_delay: float = 0.0,
        clock: SimClock | None = None,
        store: SharedStore | None = None,
    ) -> None:
        for name, v in (
            ("num_replicas", num_replicas),
            ("capacity_blocks", capacity_blocks),
            ("block_size", block_size),
            ("tokens_per_id", tokens_per_id),
        ):
            check_int(name, v, low=1)
        check_number("event_delay", event_delay, low=0, finite=False)
        if batch is not None and not isinstance(batch, BatchConfig):
            raise ValueError(f"batch must be a BatchConfig or None, got {batch!r}")
        if store is not None and not isinstance(store, SharedStore):
            raise ValueError(f"store must be a SharedStore or None, got {store!r}")
        tiers: Tiers = DEVICE_ONLY if store is None else store
        self.store = store
        self.replicas = [
            Replica(i, int(capacity_blocks), int(block_size), eviction, tiers)
            for i in range(num_replicas)
        ]
        self.capacity_blocks = int(capacity_blocks)
        self.block_size = int(block_size)
        self.service = service if service is not None else ServiceModel()
        self.batch = batch
        self.tokens_per_id = int(tokens_per_id)
        self.event_delay = float(event_delay)
        self.clock = clock if clock is not None else SimClock()

    def run(
        self,
        requests: Trace | Iterable[SimRequest],
        router: Router,
        *,
        rate: float = 1.0,
        progress: bool = False,
    ) -> SimResult:
        """Route and serve every request (arrivals divided by ``rate``); return the figures.

        ``ValueError`` for a ``rate`` that is not a number > 0, ``TypeError`` for
        requests that are neither a ``Trace`` nor ``SimRequest`` objects, before
        anything runs; ``RuntimeError`` if a replica's scheduler stops making
        progress (a bug). Mutates the replicas (caches, counters) and the router.
        """
        check_number("rate", rate, low=0, strict=True, finite=False)
        reqs = _as_requests(requests)
        run = _Run(self, reqs, router, rate)
        if progress:
            from tqdm import tqdm

            run.bar = tqdm(total=len(reqs), desc=f"route-sim {router.name}", unit="req")
        makespan = run.loop()
        run.bar.close()
        return roll_up(
            run.tally,
            router=router,
            service="serial" if self.batch is None else "batched",
            replicas=self.replicas,
            capacity_blocks=self.capacity_blocks,
            prompt_tokens=[r.prompt_tokens for r in reqs],
            tokens_per_id=self.tokens_per_id,
            offered_load=offered_load(reqs, self.service, len(self.replicas), rate, self.batch),
            makespan=makespan,
        )


def simulate(
    requests: Trace | Iterable[SimRequest],
    router: Router,
    *,
    num_replicas: int,
    capacity_blocks: int,
    block_size: int = 1,
    service: ServiceModel | None = None,
    batch: BatchConfig | None = None,
    rate: float = 1.0,
    event_delay: float = 0.0,
    eviction: str = "lru",
    tokens_per_id: int = MOONCAKE_BLOCK_SIZE,
    clock: SimClock | None = None,
    progress: bool = False,
    store: SharedStore | None = None,
) -> SimResult:
    """Serve ``requests`` on a fresh fleet behind ``router``; see :class:`FleetSim`.

    Pass the ``clock`` the router was built with (:func:`build_router`) so it
    runs in simulated time. ``ValueError`` for bad sizes or rate.
    """
    sim = FleetSim(
        num_replicas=num_replicas,
        capacity_blocks=capacity_blocks,
        block_size=block_size,
        eviction=eviction,
        service=service,
        batch=batch,
        tokens_per_id=tokens_per_id,
        event_delay=event_delay,
        clock=clock,
        store=store,
    )
    return sim.run(requests, router, rate=rate, progress=progress)


def single_cache_hit_rate(
    requests: Trace | Iterable[SimRequest],
    capacity_blocks: int,
    *,
    block_size: int = 1,
    eviction: str = "lru",
    tokens_per_id: int = MOONCAKE_BLOCK_SIZE,
) -> float:
    """Token hit rate of one cache of ``capacity_blocks`` seeing every request in arrival order.

    The baseline a fleet is compared against (give it the fleet's total
    capacity): no routing loss, no split capacity. Same step as each replica.
    """
    reqs = sorted(_as_requests(requests), key=lambda r: r.arrival)
    rep = Replica(0, capacity_blocks, block_size, eviction)
    prompt = hit = 0
    for r in reqs:
        h = rep.serve(r.tokens, r.namespace)
        rep.take_events()
        prompt += r.prompt_tokens
        hit += min(h * tokens_per_id, r.prompt_tokens)
    return hit / prompt if prompt else 0.0
