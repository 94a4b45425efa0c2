"""Routing policies: which replica a request goes to (the :class:`~radixkv.fleet.routing.Router`
surface).

Baselines that ignore the caches: ``round_robin``, ``least_loaded`` (fewest
in flight), ``pow2`` (the better of two random picks), ``session`` (a session
sticks to its first replica) and ``chwbl`` (KubeAI's consistent hashing with
bounded loads on the prompt's first block). Prefix-aware: ``approx`` (an
:class:`~radixkv.fleet.approx.ApproxIndex` learned from its own decisions) and
``exact`` (an :class:`~radixkv.fleet.exact.ExactIndex` fed by the replicas' KV
events, with speculative entries), both scored by
:class:`~radixkv.fleet.scoring.TimeCostScoring` (expected time to first token).

``make_router(name, block_size=..., ...)`` builds one by name; ``ROUTERS``
maps each name to its class. Every class takes the keywords ``block_size``,
``hasher`` and ``seed`` (see :func:`make_router`) plus its own options. Every
policy reads load from the ``ReplicaState`` it is given (the caller keeps
``in_flight`` current) and keeps no request count of its own; the
prefix-aware ones also keep a backlog of predicted prefill seconds per
replica (``choose`` adds, ``on_finish`` settles). Not thread-safe: one
caller, or one lock around each call.
"""

from __future__ import annotations

import bisect
import math
import random
import time
from collections import OrderedDict
from collections.abc import Callable, Hashable, Sequence
from typing import Any, ClassVar

import numpy as np
import xxhash

from radixkv.cache.events import KVCacheEvent
from radixkv.cache.hashing import ChainHasher, chain_hashes, namespace_bytes
from radixkv.checks import check_int, check_number
from radixkv.fleet.approx import ApproxIndex
from radixkv.fleet.exact import ExactIndex
from radixkv.fleet.index_base import Clock
from radixkv.fleet.routing import ReplicaState, Router, RouteRequest
from radixkv.fleet.scoring import Backlog, TimeCostScoring
from radixkv.fleet.service import ServiceModel, service_model
from radixkv.fleet.shared_store import NO_STORE_VIEW, NoStoreView, StoreView

__all__ = [
    "ROUTERS",
    "ApproxPrefixRouter",
    "CHWBLRouter",
    "ExactPrefixRouter",
    "LeastLoadedRouter",
    "PowerOfTwoRouter",
    "RoundRobinRouter",
    "SessionRouter",
    "make_router",
]


def _check_replicas(replicas: Sequence[ReplicaState]) -> None:
    if not replicas:
        raise ValueError(f"replicas must not be empty, got {replicas!r}")


def _least_loaded(replicas: Sequence[ReplicaState]) -> ReplicaState:
    """The replica with the fewest in flight, then the fewest waiting, then the first."""
    best = replicas[0]
    for r in replicas:
        if r.in_flight < best.in_flight or (
            r.in_flight == best.in_flight and r.waiting < best.waiting
        ):
            best = r
    return best


class _BaseRouter:
    """What every policy shares: ``block_size``, ``hasher``, ``seed`` and the no-op hooks.

    ``ValueError`` naming the argument for a ``block_size`` below 1, a
    ``hasher`` that is not a ``ChainHasher`` or a ``seed`` that is not an int.
    """

    name: ClassVar[str]

    def __init__(
        self, *, block_size: int, hasher: ChainHasher | None = None, seed: int = 0
    ) -> None:
        self.block_size = check_int("block_size", block_size, low=1)
        if hasher is not None and not isinstance(hasher, ChainHasher):
            raise ValueError(f"hasher must be a ChainHasher or None, got {hasher!r}")
        self.hasher = ChainHasher("xxhash", seed=0) if hasher is None else hasher
        self.seed = check_int("seed", seed)

    def on_events(self, replica_id: Hashable, events: Sequence[KVCacheEvent]) -> None:
        """Ignored: this policy keeps no index of the replicas' caches."""

    def on_finish(self, replica_id: Hashable, request: RouteRequest) -> None:
        """Ignored: load comes from ``ReplicaState.in_flight``."""

    def drop_replica(self, replica_id: Hashable) -> None:
        """Nothing to forget: this policy keeps no per-replica state."""

    def memory_bytes(self) -> int:
        """0: this policy keeps no prefix index (``MemoryReporting``). O(1)."""
        return 0


class RoundRobinRouter(_BaseRouter):
    """Each request to the next replica in the order given, cycling. O(1)."""

    name = "round_robin"

    def __init__(self, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self._next = 0

    def choose(self, request: RouteRequest, replicas: Sequence[ReplicaState]) -> Hashable:
        _check_replicas(replicas)
        i = self._next % len(replicas)
        self._next = i + 1
        return replicas[i].replica_id


class LeastLoadedRouter(_BaseRouter):
    """The replica with the fewest requests in flight; ties by fewest waiting, then the first
    given (``tie_break="index"``) or a seeded random one (``"random"``). O(replicas)."""

    name = "least_loaded"

    def __init__(self, *, tie_break: str = "index", **kwargs: Any) -> None:
        super().__init__(**kwargs)
        if tie_break not in ("index", "random"):
            raise ValueError(f"tie_break must be 'index' or 'random', got {tie_break!r}")
        self.tie_break = tie_break
        self._rng = random.Random(self.seed)

    def choose(self, request: RouteRequest, replicas: Sequence[ReplicaState]) -> Hashable:
        _check_replicas(replicas)
        b = _least_loaded(replicas)
        if self.tie_break == "random":
            tied = [r for r in replicas if r.in_flight == b.in_flight and r.waiting == b.waiting]
            return self._rng.choice(tied).replica_id
        return b.replica_id


class PowerOfTwoRouter(_BaseRouter):
    """Two distinct replicas drawn at random (seeded); the one with fewer in flight (then fewer
    waiting, then the first drawn). Never the more loaded of the two. O(1)."""

    name = "pow2"

    def __init__(self, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self._rng = random.Random(self.seed)

    def choose(self, request: RouteRequest, replicas: Sequence[ReplicaState]) -> Hashable:
        _check_replicas(replicas)
        n = len(replicas)
        if n == 1:
            return replicas[0].replica_id
        i = self._rng.randrange(n)
        j = self._rng.randrange(n - 1)
        a, b = replicas[i], replicas[j + (j >= i)]
        return (b if (b.in_flight, b.waiting) < (a.in_flight, a.waiting) else a).replica_id


class SessionRouter(_BaseRouter):
    """Session affinity: a session's requests go where its first one went.

    A new session, a request without one, or a session whose replica is not
    offered any more (dropped, or left out of ``replicas``) goes to the least
    loaded replica, and the session is bound there. At most ``max_sessions``
    bindings are kept, the least recently used forgotten first. O(replicas).
    """

    name = "session"

    def __init__(self, *, max_sessions: int = 1_000_000, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.max_sessions = check_int("max_sessions", max_sessions, low=1)
        self._bindings: OrderedDict[Hashable, Hashable] = OrderedDict()
        self._sessions: dict[Hashable, set[Hashable]] = {}  # replica -> its sessions

    def choose(self, request: RouteRequest, replicas: Sequence[ReplicaState]) -> Hashable:
        _check_replicas(replicas)
        session = request.session
        if session is None:
            return _least_loaded(replicas).replica_id
        bound = self._bindings.get(session)
        if bound is not None:
            for r in replicas:
                if r.replica_id == bound:
                    self._bindings.move_to_end(session)
                    return bound
            self._unbind(session)
        chosen = _least_loaded(replicas).replica_id
        self._bindings[session] = chosen
        self._sessions.setdefault(chosen, set()).add(session)
        if len(self._bindings) > self.max_sessions:
            self._unbind(next(iter(self._bindings)))
        return chosen

    def replica_of(self, session: Hashable) -> Hashable | None:
        """The replica ``session`` is bound to, or None."""
        return self._bindings.get(session)

    def _unbind(self, session: Hashable) -> None:
        replica_id = self._bindings.pop(session)
        sessions = self._sessions[replica_id]
        sessions.discard(session)
        if not sessions:
            del self._sessions[replica_id]

    def drop_replica(self, replica_id: Hashable) -> None:
        """Unbind its sessions (they rebind on their next request). O(its sessions)."""
        for session in self._sessions.pop(replica_id, ()):
            del self._bindings[session]


def _prefix_key(tokens: np.ndarray, prefix_len: int, namespace: Hashable) -> int:
    """The ring position of a prompt: xxh3 of its first ``prefix_len`` tokens and namespace."""
    head = np.ascontiguousarray(tokens[:prefix_len], dtype=np.int32).tobytes()
    return xxhash.xxh3_64_intdigest(head + namespace_bytes(namespace))


class CHWBLRouter(_BaseRouter):
    """Consistent hashing with bounded loads (Mirrokni et al. 2016; KubeAI's prefix hash).

    Each replica owns ``vnodes`` points on a 64-bit ring (xxh3 of its id's
    ``repr`` and the point's number). A request hashes its first
    ``prefix_len`` tokens (default ``block_size``) and its namespace onto the
    ring and walks clockwise to the first replica whose load after taking it
    stays within the bound: ``in_flight + 1 <= ceil(load_factor * (total + 1)
    / n)``, ``total`` the in-flight sum over the ``n`` offered replicas. Some
    replica always fits (the least loaded one has at most ``total / n``). So
    one prefix keeps one replica while that stays under the bound, and moves
    to the next on the ring when it is not. Replicas join the ring when first
    offered; ``drop_replica`` takes their points out. Complexity: O(log points)
    to find the start, plus the points walked (usually a few).
    """

    name = "chwbl"

    def __init__(
        self,
        *,
        load_factor: float = 1.25,
        vnodes: int = 256,
        prefix_len: int | None = None,
        **kwargs: Any,
    ) -> None:
        super().__init__(**kwargs)
        self.load_factor = check_number("load_factor", load_factor, low=1, finite=False)
        self.vnodes = check_int("vnodes", vnodes, low=1)
        self.prefix_len = (
            self.block_size if prefix_len is None else check_int("prefix_len", prefix_len, low=1)
        )
        self._points: list[int] = []
        self._owners: list[Hashable] = []
        self._members: set[Hashable] = set()

    def _join(self, replica_id: Hashable) -> None:
        name = repr(replica_id)
        for v in range(self.vnodes):
            p = xxhash.xxh3_64_intdigest(f"{name}#{v}".encode())
            k = bisect.bisect_left(self._points, p)
            self._points.insert(k, p)
            self._owners.insert(k, replica_id)
        self._members.add(replica_id)

    def choose(self, request: RouteRequest, replicas: Sequence[ReplicaState]) -> Hashable:
        _check_replicas(replicas)
        members = self._members
        by_id: dict[Hashable, ReplicaState] = {}
        total = 0
        for r in replicas:
            if r.replica_id not in members:
                self._join(r.replica_id)
            by_id[r.replica_id] = r
            total += r.in_flight
        bound = math.ceil(self.load_factor * (total + 1) / len(replicas))
        points, owners = self._points, self._owners
        n = len(points)
        start = bisect.bisect_left(
            points, _prefix_key(request.tokens, self.prefix_len, request.namespace)
        )
        tried: set[Hashable] = set()
        for k in range(start, start + n):
            owner = owners[k % n]
            if owner in tried:
                continue
            state = by_id.get(owner)
            if state is not None and state.in_flight + 1 <= bound:
                return owner
            tried.add(owner)
            if len(tried) == len(members):
                break
        # Unreachable while the bound holds (see the class docstring); kept as a safe answer.
        return _least_loaded(replicas).replica_id  # pragma: no cover

    def drop_replica(self, replica_id: Hashable) -> None:
        """Take its points off the ring. O(points)."""
        if replica_id not in self._members:
            return
        keep = [k for k, o in enumerate(self._owners) if o != replica_id]
        self._points = [self._points[k] for k in keep]
        self._owners = [self._owners[k] for k in keep]
        self._members.discard(replica_id)


class _PrefixRouter(_BaseRouter):
    """A prefix index plus :class:`~radixkv.fleet.scoring.TimeCostScoring`; the subclasses say
    how the index learns.

    Options: ``service`` (a :class:`~radixkv.fleet.service.ServiceModel` or a
    profile name, ``"cpu"`` or ``"h200"``: the replicas' costs, in the
    ``clock``'s seconds), ``tokens_per_block`` (real tokens a block; default
    ``block_size``), ``externality`` (``"extra"``), ``load_factor`` and
    ``min_gain_blocks`` (both off), ``clock``, and ``store``: a
    :class:`~radixkv.fleet.shared_store.StoreView` of a KV store the replicas
    share (None, the default: none), whose blocks past a replica's prefix count
    as loaded rather than computed on every replica (docs/store.md, "Fleet: a
    shared store"); its keyspace's block size must be ``block_size``.
    """

    index: ApproxIndex | ExactIndex

    def __init__(
        self,
        *,
        service: ServiceModel | str = "cpu",
        tokens_per_block: int | None = None,
        load_factor: float | None = None,
        min_gain_blocks: int = 0,
        externality: str = "extra",
        clock: Clock = time.monotonic,
        store: StoreView | None = None,
        **kwargs: Any,
    ) -> None:
        super().__init__(**kwargs)
        if not callable(clock):
            raise ValueError(f"clock must be a callable returning seconds, got {clock!r}")
        self.store: StoreView | NoStoreView = NO_STORE_VIEW
        self.use_store(store)
        self.clock = clock
        self.scoring = TimeCostScoring(
            service_model(service),
            self.block_size if tokens_per_block is None else tokens_per_block,
            load_factor,
            min_gain_blocks,
            externality,
        )
        self.backlog = Backlog()
        self._taken: dict[Hashable, int] = {}  # replica -> new (uncached) blocks routed there
        self._turn = 0

    def use_store(self, store: StoreView | None) -> None:
        """Price the blocks ``store`` holds from the next decision on (None: none), for a
        router that learns of the replicas' store after it is built (a fleet's, from its
        replicas' metadata). ``ValueError`` for a ``store`` that is not a ``StoreView`` or
        whose keyspace's block size is not the router's, before any change. O(1)."""
        if store is not None:
            if not isinstance(store, StoreView):
                raise ValueError(f"store must be a StoreView or None, got {store!r}")
            if store.keyspace.block_size != self.block_size:
                raise ValueError(
                    f"store.keyspace.block_size must be the router's block_size "
                    f"{self.block_size}, got {store.keyspace.block_size}"
                )
        self.store = NO_STORE_VIEW if store is None else store

    def _fill(self, replica: ReplicaState) -> float:
        """The fraction of ``replica``'s pool the index says is in use (blocks if no capacity)."""
        raise NotImplementedError

    def _learn(self, replica: ReplicaState, hashes: list[int], request: RouteRequest) -> None:
        raise NotImplementedError

    def choose(self, request: RouteRequest, replicas: Sequence[ReplicaState]) -> Hashable:
        """Hash the prompt once, match it in the index, pick the lowest expected time to first
        token, then enter the decision in the index (same hashes) and the backlog.
        ``ValueError`` if ``replicas`` is empty.
        Complexity: O(prompt tokens + replicas) plus the index's match and update."""
        _check_replicas(replicas)
        hashes = chain_hashes(self.hasher, request.tokens, self.block_size, request.namespace)
        n = len(hashes)
        now = self.clock()
        matched = self.index.match(hashes)
        taken = self._taken
        scoring = self.scoring
        chosen, own = scoring.pick(
            replicas,
            matched,
            n,
            self.backlog,
            now,
            self._fill,
            lambda r: taken.get(r.replica_id, 0),
            self._turn,
            self.store.pricer(
                request.tokens, request.namespace, n, scoring.service, scoring.tokens_per_block
            ),
        )
        self._turn += 1
        rid = chosen.replica_id
        self._learn(chosen, hashes, request)
        self.backlog.add(rid, request.request_id, own, now)
        taken[rid] = taken.get(rid, 0) + n - matched.get(rid, 0)
        return rid

    def on_finish(self, replica_id: Hashable, request: RouteRequest) -> None:
        """``request`` (and what was routed to ``replica_id`` before it) is past prefill. O(1)
        amortized."""
        self.backlog.done(replica_id, request.request_id, self.clock())

    def drop_replica(self, replica_id: Hashable) -> None:
        """Forget the replica in the index and the backlog. O(its index entries)."""
        self.index.drop_replica(replica_id)
        self.backlog.drop(replica_id)
        self._taken.pop(replica_id, None)

    def memory_bytes(self) -> int:
        """The prefix index's approximate bytes (``MemoryReporting``). O(its entries)."""
        return self.index.memory_bytes()


class ApproxPrefixRouter(_PrefixRouter):
    """Prefix-aware on an :class:`ApproxIndex` of its own decisions (no events needed).

    Options: the index's ``ttl`` (None: no wall-clock bound), ``max_entries``
    and ``default_capacity_blocks``, and the scoring's (:class:`_PrefixRouter`).
    Each replica's LRU is sized from ``ReplicaState.capacity_blocks`` when it
    is chosen. Events are ignored.
    """

    name = "approx"

    def __init__(
        self,
        *,
        ttl: float | None = None,
        max_entries: int = 1_000_000,
        default_capacity_blocks: int | None = None,
        **kwargs: Any,
    ) -> None:
        super().__init__(**kwargs)
        self.index = ApproxIndex(
            ttl=ttl,
            max_entries=max_entries,
            default_capacity_blocks=default_capacity_blocks,
            clock=self.clock,
        )

    def _fill(self, replica: ReplicaState) -> float:
        n = self.index.num_entries(replica.replica_id)
        return n / replica.capacity_blocks if replica.capacity_blocks > 0 else float(n)

    def _learn(self, replica: ReplicaState, hashes: list[int], request: RouteRequest) -> None:
        self.index.set_capacity(replica.replica_id, replica.capacity_blocks)
        self.index.record(replica.replica_id, hashes)


class ExactPrefixRouter(_PrefixRouter):
    """Prefix-aware on an :class:`ExactIndex` of the replicas' KV events.

    ``hasher`` must be the replicas' (recipe and seed), else nothing matches.
    After each decision the request's hashes count as held on the chosen
    replica (speculative until its events report them) until ``on_finish`` ends the request
    (finished, failed or aborted: call it once per ``choose``, with the same
    ``request_id``). Options: the index's ``spec_ttl`` (None: the safety net
    derived from observed lifetimes) and ``spec_ttl_factor``, and the
    scoring's (:class:`_PrefixRouter`).
    """

    name = "exact"

    def __init__(
        self, *, spec_ttl: float | None = None, spec_ttl_factor: float = 4.0, **kwargs: Any
    ) -> None:
        super().__init__(**kwargs)
        self.index = ExactIndex(
            spec_ttl=spec_ttl,
            spec_ttl_factor=spec_ttl_factor,
            block_size=self.block_size,
            clock=self.clock,
        )

    def _fill(self, replica: ReplicaState) -> float:
        n = self.index.num_blocks(replica.replica_id)
        return n / replica.capacity_blocks if replica.capacity_blocks > 0 else float(n)

    def _learn(self, replica: ReplicaState, hashes: list[int], request: RouteRequest) -> None:
        self.index.set_capacity(replica.replica_id, replica.capacity_blocks)
        self.index.speculate(replica.replica_id, hashes, request.request_id)

    def on_events(self, replica_id: Hashable, events: Sequence[KVCacheEvent]) -> None:
        """Apply ``replica_id``'s events to the index (see :meth:`ExactIndex.apply`)."""
        self.index.apply(replica_id, events)

    def on_finish(self, replica_id: Hashable, request: RouteRequest) -> None:
        """End ``request``'s speculation on ``replica_id`` (what its events did not report
        goes) and its place in the backlog. O(its blocks)."""
        super().on_finish(replica_id, request)
        self.index.release(replica_id, request.request_id)


ROUTERS: dict[str, Callable[..., Router]] = {
    cls.name: cls
    for cls in (
        RoundRobinRouter,
        LeastLoadedRouter,
        PowerOfTwoRouter,
        SessionRouter,
        CHWBLRouter,
        ApproxPrefixRouter,
        ExactPrefixRouter,
    )
}


def make_router(
    name: str,
    *,
    block_size: int,
    hasher: ChainHasher | None = None,
    seed: int = 0,
    **options: object,
) -> Router:
    """The ``name``d policy (a key of ``ROUTERS``) for replicas of ``block_size`` tokens a block.

    ``hasher`` names blocks as the replicas do (``exact`` needs the replicas'
    own; None: ``ChainHasher("xxhash", seed=0)``); ``seed`` seeds the random
    policies. ``options`` go to the policy's constructor. ``ValueError``
    naming ``name`` for an unknown policy, or the bad option and its value;
    ``TypeError`` naming an option the policy does not take.
    """
    factory = ROUTERS.get(name)
    if factory is None:
        raise ValueError(f"name must be one of {sorted(ROUTERS)}, got {name!r}")
    try:
        return factory(block_size=block_size, hasher=hasher, seed=seed, **options)
    except TypeError as exc:
        raise TypeError(f"router {name!r}: {exc}") from exc
