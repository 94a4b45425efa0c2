"""A discrete-event fleet simulator: N replicas with real radix caches, one router in front.

Each replica is a real :class:`~radixkv.cache.radix.RadixCache` (``"lru"``
eviction by default) over its own ``BlockAllocator(capacity_blocks,
block_size)``, with KV events on when the cache supports them (hashed with
:data:`FLEET_HASHER`; build the router with the same hasher, as
:func:`build_router` does), its own FIFO queue and a :class:`ServiceModel`.

**Units.** A Mooncake trace names each 512-token block of a prompt by one hash
id; the simulator treats each id as one token of the caches (block size 1), as
:mod:`radixkv.replay` does. So cache figures (capacity, overlaps, regret) are
in trace blocks, and time figures (the service model) in real tokens:
``tokens_per_id`` (512) converts, and a request's hit in real tokens is
``min(hit_ids * 512, input_length)`` (the partial last block capped), exactly
replay's ``hit_tokens``.

**Service (kept simple).** A replica serves one request at a time, FIFO (no
batching, no chunked prefill, no preemption). At service start the cache
``match``es the prompt (the hit), the rest is computed: the pool is topped up
by ``evict``ing the shortfall, the whole prompt (as much as fits) is
``insert``ed, and the request's own references are released at once (the tree
keeps the blocks), as ``radixkv.replay``'s radix replayer does. The replica is
then busy for ``prefill + decode`` seconds; TTFT is queue wait + prefill.
Because a replica is serial, inserting at start rather than at the end of
prefill changes nothing any later request on that replica can see.

**Events.** After each service start the cache's pending events go to
``router.on_events`` at once, or ``event_delay`` simulated seconds later (the
publish gap that speculative entries cover). Routers with a clock (``approx``'s
TTL, ``exact``'s speculative TTL) read the simulation's :class:`SimClock`.

**Metrics** (:class:`SimResult`): fleet token hit rate, modelled TTFT
percentiles, load balance, Dynamo's regret (from ``peek`` on every replica at
decision time) and the measured wall time of every ``choose`` call.
"""

from __future__ import annotations

import heapq
import inspect
import time
from collections import deque
from collections.abc import Hashable, Iterable
from dataclasses import asdict, dataclass, field
from typing import Any

import numpy as np

from radixkv.cache.allocator import BlockAllocator
from radixkv.cache.events import ChainHasher, KVCacheEvent
from radixkv.cache.radix import RadixCache
from radixkv.fleet.protocol import ReplicaState, Router, RouteRequest
from radixkv.replay.trace import MOONCAKE_BLOCK_SIZE, Trace

__all__ = [
    "FLEET_HASHER",
    "FleetSim",
    "Replica",
    "ServiceModel",
    "SimClock",
    "SimRequest",
    "SimResult",
    "build_router",
    "offered_load",
    "requests_from_trace",
    "simulate",
    "single_cache_hit_rate",
]

FLEET_HASHER = ChainHasher("xxhash", seed=0)
"""The chain hash every simulated replica names its blocks with (routers must use it too)."""


# --------------------------------------------------------------------------- service model
@dataclass(frozen=True)
class ServiceModel:
    """Seconds a replica spends on a request, from its token counts (real tokens).

    - prefill of a prompt of ``P`` tokens whose first ``h`` are cached:
      ``a * u + b * keys`` with ``u = P - h`` computed tokens and
      ``keys = sum_{p=h}^{P-1} (p + 1) = u * (P + h + 1) / 2`` the keys they
      attend over (each uncached token times its mean context);
    - decode: ``c * output_tokens``.

    **Calibration** (the defaults): SmolLM2-135M on this repo's CPU, 1 thread,
    ``benchmarks/results/bench_engine_smollm2.csv`` (docs/engine.md): cache
    off, 96 requests computing 64,887 prompt tokens + 1,536 decode tokens took
    251.6 s for 15,693.7 GFLOP as ``bench_engine.model_flops`` counts them:
    16.0 ps/FLOP (62.4 GFLOP/s). ``model_flops`` charges SmolLM2 (hidden 576,
    30 layers, 9 query heads of 64, MLP 1,536) 2 x 3,538,944 x 30 = 212.3
    MFLOP of linear layers per token and 4 x 576 x 30 = 69,120 FLOP per
    (token, key) of attention. So ``a`` = 212.3e6 x 16.03e-12 = 3.40 ms per
    computed token, ``b`` = 69,120 x 16.03e-12 = 1.11 us per key. A decode
    token costs one token's linear layers at the same rate (``c = a``; its
    attention over ~12k keys would add ~13 ms at the same rate, but decode
    in a real engine is batched, so the linear cost is the honest marginal
    figure for a request served alone). Cross-check: the same constants put
    the cached run (8,231 computed tokens) at 2,476 GFLOP x 16.03 ps = 39.7 s
    against 47.3 s measured (its smaller steps run the CPU less efficiently).
    """

    prefill_per_token: float = 3.40e-3
    attention_per_key: float = 1.11e-6
    decode_per_token: float = 3.40e-3

    def __post_init__(self) -> None:
        for name in ("prefill_per_token", "attention_per_key", "decode_per_token"):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, (int, float)) or not v >= 0:
                raise ValueError(f"{name} must be a number >= 0, got {v!r}")

    def prefill(self, prompt_tokens: int, hit_tokens: int) -> float:
        """Seconds to prefill ``prompt_tokens`` of which the first ``hit_tokens`` are cached."""
        u = prompt_tokens - hit_tokens
        if u <= 0:
            return 0.0
        keys = u * (prompt_tokens + hit_tokens + 1) / 2.0
        return self.prefill_per_token * u + self.attention_per_key * keys

    def decode(self, output_tokens: int) -> float:
        """Seconds to decode ``output_tokens`` tokens."""
        return self.decode_per_token * output_tokens


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
) -> float:
    """The fleet's utilization with no cache at all: total service time / (span x replicas).

    ``span`` is the arrival span at ``rate``. Above 1 only caching keeps queues
    bounded. A benchmark picks ``rate = target / offered_load(..., rate=1)``.
    """
    reqs = _as_requests(requests)
    if len(reqs) < 2:
        return 0.0
    work = sum(service.prefill(r.prompt_tokens, 0) + service.decode(r.output_tokens) for r in reqs)
    span = (max(r.arrival for r in reqs) - min(r.arrival for r in reqs)) / rate
    return work / (span * num_replicas) if span > 0 else float("inf")


# --------------------------------------------------------------------------- clock / routers
class SimClock:
    """The simulation's clock, for routers that take a ``clock`` callable: ``now * scale``.

    The simulator sets ``now`` (simulated seconds). ``scale`` lets a router's
    TTLs run in another time base: with ``scale=rate`` they run in *trace*
    seconds, so when a slow service model is met by slowing the arrivals
    (``rate < 1``), a 2 s speculative TTL still spans what 2 s of the original
    traffic did.
    """

    __slots__ = ("now", "scale")

    def __init__(self, scale: float = 1.0) -> None:
        if isinstance(scale, bool) or not isinstance(scale, (int, float)) or not scale > 0:
            raise ValueError(f"scale must be a number > 0, got {scale!r}")
        self.now = 0.0
        self.scale = float(scale)

    def __call__(self) -> float:
        return self.now * self.scale


def build_router(
    name: str, clock: SimClock, *, block_size: int = 1, seed: int = 0, **options: Any
) -> Router:
    """``make_router(name, ...)`` for the simulator: :data:`FLEET_HASHER`, and ``clock``
    passed to the policies that take one (so their TTLs run in simulated seconds)."""
    from radixkv.fleet.router import ROUTERS, make_router

    factory = ROUTERS.get(name)
    if factory is not None and "clock" in inspect.signature(factory).parameters:
        options.setdefault("clock", clock)
    return make_router(name, block_size=block_size, hasher=FLEET_HASHER, seed=seed, **options)


# --------------------------------------------------------------------------- result
@dataclass
class SimResult:
    """What one simulated run measured (see the module docstring for the definitions).

    - ``hit_rate``: hit tokens / prompt tokens over all requests (real tokens);
    - ``ttft_*``: modelled TTFT (queue wait + prefill), seconds;
    - ``max_mean_load``: max over replicas of requests served / the mean;
      ``max_mean_busy``: the same for busy seconds;
    - ``regret``: NVIDIA Dynamo's, ``lost / (novel + lost)`` in blocks, where per
      request ``lost`` = best replica's cached overlap - the chosen one's and
      ``novel`` = prompt blocks - best overlap, both at decision time (``peek``);
    - ``decision_us_p50`` / ``_p99``: measured wall time of ``choose``, microseconds;
    - ``index_memory_bytes``: the router's (or its index's) ``memory_bytes()``, else 0.

    Per-request arrays (``replica``, ``hit_tokens``, ``ttft``) are kept for
    inspection; ``to_dict`` leaves them out.
    """

    router: str
    num_replicas: int
    capacity_blocks: int
    num_requests: int
    prompt_tokens: int
    hit_tokens: int
    hit_rate: float
    ttft_p50: float
    ttft_p90: float
    ttft_p99: float
    ttft_mean: float
    max_mean_load: float
    max_mean_busy: float
    regret: float
    lost_blocks: int
    novel_blocks: int
    decision_us_p50: float
    decision_us_p99: float
    index_memory_bytes: int
    makespan_s: float
    events_delivered: int
    served: list[int]
    replica: np.ndarray = field(repr=False)
    hit_ids: np.ndarray = field(repr=False)
    ttft: np.ndarray = field(repr=False)

    def to_dict(self) -> dict[str, Any]:
        """The scalar figures (and ``served`` per replica) as a JSON-ready dict."""
        d = asdict(self)
        for k in ("replica", "hit_ids", "ttft"):
            d.pop(k)
        return d


# --------------------------------------------------------------------------- the simulator
class Replica:
    """One simulated replica: its allocator, cache, FIFO queue and counters."""

    __slots__ = (
        "allocator",
        "busy",
        "busy_time",
        "cache",
        "capacity_blocks",
        "queue",
        "served",
        "state",
    )

    def __init__(self, rid: int, capacity_blocks: int, block_size: int, eviction: str) -> None:
        self.allocator = BlockAllocator(capacity_blocks, block_size)
        self.cache = RadixCache(self.allocator, eviction=eviction, events=FLEET_HASHER)
        self.capacity_blocks = capacity_blocks
        self.queue: deque[int] = deque()
        self.busy = False
        self.busy_time = 0.0
        self.served = 0
        self.state = ReplicaState(rid, capacity_blocks=capacity_blocks)

    def take_events(self) -> list[KVCacheEvent]:
        return self.cache.take_events()

    def serve(self, tokens: np.ndarray, namespace: Hashable = None) -> int:
        """Match, compute, insert, release (radix replay's step); return the hit in cache tokens."""
        alloc, cache = self.allocator, self.cache
        bs = alloc.block_size
        m = cache.match(tokens, namespace)
        matched = len(m.block_array)
        need = len(tokens) // bs - matched
        if need > 0:
            if alloc.num_free < need:
                cache.evict(need - alloc.num_free)
            new = alloc.alloc_array(min(need, alloc.num_free))
            if len(new):
                blocks = np.concatenate((m.block_array, new))
                cache.insert(tokens[: (matched + len(new)) * bs], blocks, namespace)
                alloc.decref_distinct(blocks)
                return m.num_tokens
        alloc.decref_distinct(m.block_array)
        return m.num_tokens


_FINISH, _DELIVER, _ARRIVE = 0, 1, 2  # same-time order: free a replica, inform, then route


class FleetSim:
    """``num_replicas`` replicas (:class:`Replica`, in ``replicas``) and the event loop.

    One ``run`` per instance (the caches keep what a run left, for inspection).
    """

    def __init__(
        self,
        *,
        num_replicas: int,
        capacity_blocks: int,
        block_size: int = 1,
        eviction: str = "lru",
        service: ServiceModel | None = None,
        tokens_per_id: int = MOONCAKE_BLOCK_SIZE,
        event_delay: float = 0.0,
        clock: SimClock | None = None,
    ) -> None:
        for name, v in (
            ("num_replicas", num_replicas),
            ("capacity_blocks", capacity_blocks),
            ("block_size", block_size),
            ("tokens_per_id", tokens_per_id),
        ):
            if isinstance(v, bool) or not isinstance(v, (int, np.integer)) or v < 1:
                raise ValueError(f"{name} must be an int >= 1, got {v!r}")
        if not (isinstance(event_delay, (int, float)) and event_delay >= 0):
            raise ValueError(f"event_delay must be a number >= 0, got {event_delay!r}")
        self.replicas = [
            Replica(i, int(capacity_blocks), int(block_size), eviction) for i in range(num_replicas)
        ]
        self.capacity_blocks = int(capacity_blocks)
        self.block_size = int(block_size)
        self.service = service if service is not None else ServiceModel()
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
        """Route and serve every request (arrivals divided by ``rate``); return the figures."""
        if isinstance(rate, bool) or not isinstance(rate, (int, float)) or not rate > 0:
            raise ValueError(f"rate must be a number > 0, got {rate!r}")
        reqs = _as_requests(requests)
        n = len(reqs)
        reps = self.replicas
        states = [r.state for r in reps]
        by_id = {r.state.replica_id: i for i, r in enumerate(reps)}
        service, tpi, clock, delay = self.service, self.tokens_per_id, self.clock, self.event_delay
        bs = self.block_size

        replica_of = np.full(n, -1, dtype=np.int64)
        hit_ids = np.zeros(n, dtype=np.int64)
        ttft = np.zeros(n, dtype=np.float64)
        decision_ns = np.zeros(n, dtype=np.int64)
        route_reqs: list[RouteRequest | None] = [None] * n
        lost = novel = 0
        delivered = 0

        heap: list[tuple[float, int, int, Any]] = []
        seq = 0
        for i, r in enumerate(reqs):
            heap.append((r.arrival / rate, _ARRIVE, seq, i))
            seq += 1
        heapq.heapify(heap)

        bar = None
        if progress:
            from tqdm import tqdm

            bar = tqdm(total=n, desc=f"route-sim {getattr(router, 'name', '?')}", unit="req")

        def publish(k: int, now: float) -> None:
            nonlocal seq, delivered
            events = reps[k].take_events()
            if not events:
                return
            if delay > 0:
                heapq.heappush(heap, (now + delay, _DELIVER, seq, (k, events)))
                seq += 1
            else:
                router.on_events(states[k].replica_id, events)
                delivered += len(events)

        def start(k: int, now: float) -> None:
            nonlocal seq
            rep = reps[k]
            i = rep.queue.popleft()
            req = reqs[i]
            hit = rep.serve(req.tokens, req.namespace)
            publish(k, now)
            hit_ids[i] = hit
            hit_tok = min(hit * tpi, req.prompt_tokens)
            pre = service.prefill(req.prompt_tokens, hit_tok)
            busy = pre + service.decode(req.output_tokens)
            ttft[i] = now - reqs[i].arrival / rate + pre
            rep.busy = True
            rep.busy_time += busy
            st = rep.state
            st.waiting = len(rep.queue)
            st.running = 1
            st.kv_usage = 1.0 - rep.allocator.num_free / rep.capacity_blocks
            heapq.heappush(heap, (now + busy, _FINISH, seq, (k, i)))
            seq += 1

        now = 0.0
        while heap:
            now, kind, _, payload = heapq.heappop(heap)
            clock.now = now
            if kind == _ARRIVE:
                i = payload
                req = reqs[i]
                overlaps = [rep.cache.peek(req.tokens, req.namespace) // bs for rep in reps]
                rr = RouteRequest(i, req.tokens, req.namespace, req.session)
                route_reqs[i] = rr
                t0 = time.perf_counter_ns()
                rid = router.choose(rr, states)
                decision_ns[i] = time.perf_counter_ns() - t0
                k = by_id[rid]
                best = max(overlaps)
                lost += best - overlaps[k]
                novel += len(req.tokens) // bs - best
                replica_of[i] = k
                rep = reps[k]
                rep.state.in_flight += 1
                rep.queue.append(i)
                rep.state.waiting = len(rep.queue)
                if not rep.busy:
                    start(k, now)
            elif kind == _FINISH:
                k, i = payload
                rep = reps[k]
                rep.busy = False
                rep.served += 1
                st = rep.state
                st.in_flight -= 1
                st.running = 0
                router.on_finish(st.replica_id, route_reqs[i])
                route_reqs[i] = None
                if bar is not None:
                    bar.update(1)
                if rep.queue:
                    start(k, now)
            else:
                k, events = payload
                router.on_events(states[k].replica_id, events)
                delivered += len(events)
        if bar is not None:
            bar.close()

        served = [rep.served for rep in reps]
        busy = [rep.busy_time for rep in reps]
        prompt = sum(r.prompt_tokens for r in reqs)
        hit_tokens = int(
            sum(min(int(h) * tpi, r.prompt_tokens) for h, r in zip(hit_ids, reqs, strict=True))
        )
        mean_served = n / len(reps)
        mean_busy = sum(busy) / len(reps)
        us = decision_ns / 1000.0
        return SimResult(
            router=str(getattr(router, "name", type(router).__name__)),
            num_replicas=len(reps),
            capacity_blocks=self.capacity_blocks,
            num_requests=n,
            prompt_tokens=int(prompt),
            hit_tokens=hit_tokens,
            hit_rate=hit_tokens / prompt if prompt else 0.0,
            ttft_p50=_pct(ttft, 50),
            ttft_p90=_pct(ttft, 90),
            ttft_p99=_pct(ttft, 99),
            ttft_mean=float(ttft.mean()) if n else 0.0,
            max_mean_load=max(served) / mean_served if n else 0.0,
            max_mean_busy=max(busy) / mean_busy if mean_busy > 0 else 0.0,
            regret=lost / (novel + lost) if novel + lost else 0.0,
            lost_blocks=int(lost),
            novel_blocks=int(novel),
            decision_us_p50=_pct(us, 50),
            decision_us_p99=_pct(us, 99),
            index_memory_bytes=_memory_bytes(router),
            makespan_s=float(now),
            events_delivered=delivered,
            served=served,
            replica=replica_of,
            hit_ids=hit_ids,
            ttft=ttft,
        )


def _pct(a: np.ndarray, q: float) -> float:
    return float(np.percentile(a, q)) if len(a) else 0.0


def _memory_bytes(router: object) -> int:
    for obj in (router, getattr(router, "index", None)):
        fn = getattr(obj, "memory_bytes", None)
        if callable(fn):
            return int(fn())
    return 0


def simulate(
    requests: Trace | Iterable[SimRequest],
    router: Router,
    *,
    num_replicas: int,
    capacity_blocks: int,
    block_size: int = 1,
    service: ServiceModel | None = None,
    rate: float = 1.0,
    event_delay: float = 0.0,
    eviction: str = "lru",
    tokens_per_id: int = MOONCAKE_BLOCK_SIZE,
    clock: SimClock | None = None,
    progress: bool = False,
) -> SimResult:
    """Serve ``requests`` on a fresh fleet behind ``router``; see :class:`FleetSim`.

    Pass the ``clock`` the router was built with (:func:`build_router`) so its
    TTLs run in simulated time. ``ValueError`` for bad sizes or rate.
    """
    sim = FleetSim(
        num_replicas=num_replicas,
        capacity_blocks=capacity_blocks,
        block_size=block_size,
        eviction=eviction,
        service=service,
        tokens_per_id=tokens_per_id,
        event_delay=event_delay,
        clock=clock,
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
