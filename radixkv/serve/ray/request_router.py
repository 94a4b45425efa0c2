"""Ray Serve's request router driven by a radixkv routing policy: prefix-aware routing on Serve.

:class:`PrefixRouter` is a ``ray.serve.request_router.RequestRouter``: set it
as a deployment's ``request_router_class`` and every ``DeploymentHandle`` to
that deployment routes with the radixkv policy named in
``request_router_kwargs`` (:class:`PrefixRouterConfig`; any name in
``radixkv.fleet.router.ROUTERS``). Serve hosts the policy; the policy stays
plain Python (:mod:`radixkv.fleet.router`).

What a routed call must carry: the keyword argument ``prompt_ids`` (the
prompt's token ids) and optionally ``namespace``; the session is Serve's own
``handle.options(session_id=...)``. A call without ``prompt_ids`` (a control
method) goes to whichever replica Serve finds least loaded.

How the pieces meet:

- **Replicas** describe themselves once through Serve's
  ``record_replica_metadata`` hook (:class:`ReplicaInfo`: event endpoints,
  pool size, block size and hash recipe) and report load through
  ``record_routing_stats`` (``running``, ``waiting``, ``kv_usage``), which
  Serve polls every ``request_routing_stats_period_s``: a second or more
  stale, fine for load, not for cache contents.
- **Cache contents** come from each replica's KV event stream, read on a
  background thread (:class:`~radixkv.fleet.event_feed.EventFeed`, through
  :class:`ReplicaEvents`; :class:`NoReplicaEvents` for a router that reads none) and
  applied on the router's loop before each decision; the ``exact`` policy's
  speculative entries cover the time until a replica's events arrive.
- **In flight** is the router's own count
  (:class:`~radixkv.fleet.routing_state.RoutingState`): a
  decision counts from ``choose_replicas`` until ``on_request_completed``.
- **Failures stay here.** An exception from the policy or the bookkeeping
  is logged and never reaches Serve, whose routing task would die with it and
  leave the request it was placing unanswered forever: a call the policy
  fails on goes to whichever candidate Serve finds least loaded.

Serve unpickles this class by value in every process that routes, so state
that must be shared with the rest of the process lives in modules imported
normally (:mod:`radixkv.serve.ray.router_registry`). The state and the feed are plain
fleet-tier objects; this module is only Serve's callbacks around them.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import weakref
from collections.abc import Hashable, Iterator, Mapping
from dataclasses import asdict, dataclass, field, fields
from typing import Any

import numpy as np
from ray.serve.request_router import PendingRequest, ReplicaID, RequestRouter, RunningReplica

from radixkv.cache.hashing import CHAIN_HASHES, ChainHasher
from radixkv.cache.store.keys import StoreKeyspace
from radixkv.cache.store.opening import check_kv_store_spec, open_kv_store
from radixkv.checks import check_int, check_number, is_int
from radixkv.fleet.event_feed import EventFeed, FeedItem
from radixkv.fleet.router import ROUTERS, make_router
from radixkv.fleet.routing import Router, RouteRequest
from radixkv.fleet.routing_state import RoutingState
from radixkv.fleet.shared_store import DEFAULT_STORE_LOAD_COST, StoreView
from radixkv.serve.ray import router_registry

__all__ = [
    "STORE_AWARE_POLICIES",
    "NoReplicaEvents",
    "PrefixRouter",
    "PrefixRouterConfig",
    "ReplicaEvents",
    "ReplicaInfo",
    "route_request_of",
]

log = logging.getLogger(__name__)

STORE_AWARE_POLICIES = ("approx", "exact")  # the prefix-aware ones: they price a store's blocks


@dataclass(frozen=True)
class PrefixRouterConfig:
    """What :class:`PrefixRouter` routes with (``request_router_kwargs``, so JSON values only).

    - ``policy``: a name in ``ROUTERS``; ``options``: its constructor's keywords.
    - ``block_size``, ``hash_name``, ``hash_seed``: the replicas' block size and
      chain-hash recipe; a replica reporting another is routed by load only.
    - ``seed``: seeds the random policies.
    - ``events``: read the replicas' KV event streams (None: only for ``exact``,
      the one policy that uses them).
    - ``pending_ttl_s``: a decision Serve never confirms (the request was
      cancelled before a replica accepted it) stops counting after this long.
    - ``store``: the KV store the replicas share (``kv_store``: a directory or
      ``mooncake://HOST:PORT``), for a prefix-aware policy (``exact``, ``approx``) to price
      the blocks it holds past a replica's prefix as loads (store-aware routing,
      :class:`~radixkv.fleet.shared_store.StoreView`); None: blind to it. The router opens
      it (``store_capacity_bytes``, the replicas') once a replica reports its keyspace,
      and prices a block at ``store_load_cost`` x the policy's prefill per token.
    """

    policy: str = "exact"
    block_size: int = 16
    hash_name: str = "xxhash"
    hash_seed: int | str = 0
    seed: int = 0
    options: dict[str, Any] = field(default_factory=dict)
    events: bool | None = None
    pending_ttl_s: float = 30.0
    store: str | None = None
    store_capacity_bytes: int | None = None
    store_load_cost: float = DEFAULT_STORE_LOAD_COST

    def __post_init__(self) -> None:
        if self.policy not in ROUTERS:
            raise ValueError(f"policy must be one of {sorted(ROUTERS)}, got {self.policy!r}")
        # numbers are stored as plain ints and floats: the config travels as JSON
        block_size = check_int("block_size", self.block_size, low=1)
        if self.hash_name not in CHAIN_HASHES:
            raise ValueError(f"hash_name must be one of {CHAIN_HASHES}, got {self.hash_name!r}")
        if not (is_int(self.hash_seed) or isinstance(self.hash_seed, str)):
            raise ValueError(f"hash_seed must be an int or a str, got {self.hash_seed!r}")
        seed = check_int("seed", self.seed)
        if not isinstance(self.options, dict):
            raise ValueError(f"options must be a dict, got {self.options!r}")
        if self.events is not None and not isinstance(self.events, bool):
            raise ValueError(f"events must be a bool or None, got {self.events!r}")
        ttl = check_number("pending_ttl_s", self.pending_ttl_s, low=0, strict=True, finite=False)
        if self.store is not None:
            check_kv_store_spec(self.store)
            if self.policy not in STORE_AWARE_POLICIES:
                raise ValueError(
                    f"store needs a prefix-aware policy {STORE_AWARE_POLICIES}, "
                    f"got policy {self.policy!r}"
                )
        capacity = check_int(
            "store_capacity_bytes", self.store_capacity_bytes, low=1, optional=True
        )
        if self.store is not None and capacity is None:
            raise ValueError(f"store {self.store!r} needs store_capacity_bytes, got None")
        load_cost = check_number("store_load_cost", self.store_load_cost, low=0)
        hash_seed = self.hash_seed if isinstance(self.hash_seed, str) else int(self.hash_seed)
        for name, value in (
            ("block_size", block_size),
            ("seed", seed),
            ("hash_seed", hash_seed),
            ("pending_ttl_s", ttl),
            ("store_capacity_bytes", capacity),
            ("store_load_cost", load_cost),
        ):
            object.__setattr__(self, name, value)

    @property
    def subscribes(self) -> bool:
        """Whether the router reads the replicas' event streams."""
        return self.policy == "exact" if self.events is None else self.events

    def hasher(self) -> ChainHasher:
        """The chain hash the replicas' caches use."""
        return ChainHasher(self.hash_name, seed=self.hash_seed)

    def build_router(self) -> Router:
        """The configured policy (``make_router``'s errors name a bad option)."""
        return make_router(
            self.policy,
            block_size=self.block_size,
            hasher=self.hasher(),
            seed=self.seed,
            **self.options,
        )

    def to_kwargs(self) -> dict[str, Any]:
        """The ``request_router_kwargs`` that rebuild this config."""
        return asdict(self)


@dataclass(frozen=True)
class ReplicaInfo:
    """What an engine replica tells routers once, through Serve's ``record_replica_metadata``.

    ``event_endpoint`` / ``replay_endpoint``: its KV event publisher (None: it
    publishes none); ``capacity_blocks``: its KV pool; ``block_size``,
    ``hash_name``, ``hash_seed``: how its cache names blocks; ``store_keyspace``: the
    fields of its KV store's :class:`~radixkv.cache.store.StoreKeyspace` (None: no store),
    which a store-aware router keys prompts with.
    """

    event_endpoint: str | None
    replay_endpoint: str | None
    capacity_blocks: int
    block_size: int
    hash_name: str
    hash_seed: int | str
    store_keyspace: dict[str, Any] | None = None

    _KEY = "radixkv"

    def to_metadata(self) -> dict[str, Any]:
        """The JSON dict ``record_replica_metadata`` returns."""
        return {self._KEY: asdict(self)}

    @classmethod
    def from_metadata(cls, metadata: Mapping[str, Any]) -> ReplicaInfo | None:
        """The info in a replica's metadata; None for a replica that gives none (or a malformed
        one: logged), which is then routed by load only."""
        raw = metadata.get(cls._KEY) if isinstance(metadata, Mapping) else None
        if raw is None:
            return None
        try:
            return cls(**raw)
        except TypeError:
            log.error("ignoring malformed radixkv replica metadata %r", raw)
            return None

    def matches(self, config: PrefixRouterConfig) -> bool:
        """Whether this replica names blocks as ``config`` hashes requests."""
        return (self.block_size, self.hash_name, self.hash_seed) == (
            config.block_size,
            config.hash_name,
            config.hash_seed,
        )


def keyspace_fields(keyspace: StoreKeyspace) -> dict[str, Any]:
    """``keyspace``'s constructor fields as JSON values (:attr:`ReplicaInfo.store_keyspace`)."""
    return {f.name: getattr(keyspace, f.name) for f in fields(keyspace) if f.init}


def route_request_of(pending_request: PendingRequest | None) -> RouteRequest | None:
    """The :class:`RouteRequest` of a Serve call: its ``prompt_ids`` and ``namespace`` keyword
    arguments and Serve's ``session_id``; None for a call without integer ``prompt_ids``
    (routed by load). ``request_id`` is Serve's ``internal_request_id``."""
    if pending_request is None:
        return None
    kwargs = pending_request.kwargs
    prompt_ids = kwargs.get("prompt_ids")
    if prompt_ids is None:
        return None
    tokens = np.asarray(prompt_ids)
    if tokens.ndim != 1 or tokens.dtype.kind not in "iu":
        return None
    meta = pending_request.metadata
    return RouteRequest(
        request_id=meta.internal_request_id,
        tokens=tokens.astype(np.int32, copy=False),
        namespace=kwargs.get("namespace"),
        session=meta.session_id or None,
    )


def _uid(replica_id: ReplicaID) -> str:
    return replica_id.unique_id


class ReplicaEvents:
    """The replicas' KV event streams a router reads: an :class:`EventFeed` over every
    replica that publishes events and names blocks as ``config`` hashes requests.

    A replica that hashes otherwise is logged (an error: its cache is not indexed) and
    not subscribed. Methods as :class:`EventFeed`'s; :meth:`close` is idempotent.
    """

    def __init__(self, config: PrefixRouterConfig) -> None:
        self.config = config
        self.feed = EventFeed()

    def join(self, replica_id: str, info: ReplicaInfo) -> None:
        """Subscribe to ``replica_id``'s events (``info``: what it told Serve), if it publishes
        any and hashes blocks as the router does."""
        if info.event_endpoint is None:
            return
        if not info.matches(self.config):
            log.error(
                "replica %s hashes blocks as (block_size=%s, %s, seed=%r), the router as "
                "(block_size=%s, %s, seed=%r): its cache is not indexed",
                replica_id,
                info.block_size,
                info.hash_name,
                info.hash_seed,
                self.config.block_size,
                self.config.hash_name,
                self.config.hash_seed,
            )
            return
        self.feed.add(replica_id, info.event_endpoint, info.replay_endpoint)

    def forget(self, replica_id: str) -> None:
        """Stop reading ``replica_id``'s events (no-op for one not subscribed)."""
        self.feed.remove(replica_id)

    def drain(self) -> list[FeedItem]:
        """What arrived since the last drain, oldest first. Never blocks."""
        return self.feed.drain()

    def close(self, timeout: float = 5.0) -> None:
        """Stop the feed's thread and its subscribers."""
        self.feed.close(timeout)


class NoReplicaEvents:
    """The events of a router that reads none (``PrefixRouterConfig.subscribes`` false):
    joins nothing, logs nothing, drains nothing. :class:`ReplicaEvents`' surface."""

    def join(self, replica_id: str, info: ReplicaInfo) -> None:
        pass

    def forget(self, replica_id: str) -> None:
        pass

    def drain(self) -> list[FeedItem]:
        return []

    def close(self, timeout: float = 5.0) -> None:
        pass


class PrefixRouter(RequestRouter):
    """A Serve request router that routes with a radixkv policy (see the module docstring).

    ``choose_replicas`` returns two ranks: the replica the policy chose, then
    the others, so Serve falls back to the least loaded of the rest only when
    the chosen one is full (``max_ongoing_requests``); or, when the policy
    raised, one rank of every candidate, for Serve to pick the least loaded.
    No hook lets an exception into Serve (:meth:`_contained`). Do not mix in Serve's
    ``FIFOMixin``: it hands a found replica to the oldest pending request,
    which would undo every affinity decision.
    """

    config: PrefixRouterConfig
    state: RoutingState

    def initialize_state(self, **kwargs: Any) -> None:
        """Build the policy from ``request_router_kwargs`` (:class:`PrefixRouterConfig`'s fields;
        ``ValueError``/``TypeError`` naming a bad one)."""
        self.config = PrefixRouterConfig(**kwargs)
        self.state = RoutingState(
            self.config.build_router(),
            confirmations=self._use_replica_queue_len_cache,
            pending_ttl_s=self.config.pending_ttl_s,
        )
        self.replica_events: ReplicaEvents | NoReplicaEvents = (
            ReplicaEvents(self.config) if self.config.subscribes else NoReplicaEvents()
        )
        # Serve has no shutdown hook: the feed's thread ends with the router, or on close()
        self._finalizer = weakref.finalize(self, self.replica_events.close, 1.0)
        self._loop: asyncio.AbstractEventLoop | None = None
        self.store_view: StoreView | None = None  # store-aware: opened at the first keyspace
        self._store_tried = False
        router_registry.register(self)

    def close(self) -> None:
        """Stop reading the replicas' event streams now (else when the router is collected).
        Idempotent; the router routes by what it has indexed so far afterwards."""
        self._finalizer()

    @property
    def deployment_id(self) -> Any:
        """The deployment this router routes to (Serve's ``DeploymentID``)."""
        return self._deployment_id

    # ------------------------------------------------------------ membership
    def update_replicas(self, replicas: list[RunningReplica]) -> None:
        super().update_replicas(replicas)
        self._loop = self._event_loop  # the loop Serve runs this router on
        current = {_uid(r.replica_id): r for r in replicas}
        for replica_id in [r for r in self.state.replicas if r not in current]:
            with self._contained(f"dropping replica {replica_id}"):
                self._forget(replica_id)
        for replica_id, replica in current.items():
            if replica_id not in self.state.replicas:
                with self._contained(f"adding replica {replica_id}"):
                    self._join(replica_id, replica)

    def on_replica_actor_died(self, replica_id: ReplicaID) -> None:
        super().on_replica_actor_died(replica_id)
        with self._contained(f"dropping dead replica {_uid(replica_id)}"):
            self._forget(_uid(replica_id))

    def _join(self, replica_id: str, replica: RunningReplica) -> None:
        info = ReplicaInfo.from_metadata(replica.replica_metadata)
        if info is None:  # no metadata: routed by load only
            self.state.add_replica(replica_id, 0)
            return
        self.state.add_replica(replica_id, info.capacity_blocks)
        self.replica_events.join(replica_id, info)
        self._see_store(replica_id, info)

    def _see_store(self, replica_id: str, info: ReplicaInfo) -> None:
        """Store-aware (``config.store``): at the first replica that reports its store's
        keyspace, open the store and hand the policy a :class:`StoreView` of it. A store
        that does not open is logged once and the router stays blind to it."""
        store = self.config.store
        if store is None or self._store_tried or info.store_keyspace is None:
            return
        self._store_tried = True
        try:
            keyspace = StoreKeyspace(**info.store_keyspace)
            view = StoreView(
                open_kv_store(store, self.config.store_capacity_bytes),
                keyspace,
                self.config.store_load_cost,
            )
            self.state.router.use_store(view)  # type: ignore[attr-defined]
        except Exception:
            log.exception(
                "router %r: the store %r of replica %s could not be used; routing blind to it",
                self.config.policy,
                store,
                replica_id,
            )
            return
        self.store_view = view

    def _forget(self, replica_id: str) -> None:
        self.replica_events.forget(replica_id)
        self.state.drop_replica(replica_id)

    # ------------------------------------------------------------ routing
    @contextlib.contextmanager
    def _contained(self, what: str) -> Iterator[None]:
        """Log an exception raised inside instead of letting it into Serve's routing machinery
        (a routing task that dies takes the request it was placing with it)."""
        try:
            yield
        except Exception:
            log.exception("router %r: %s failed", self.config.policy, what)

    def _catch_up(self) -> None:
        """Apply the events that arrived since the last call (a batch the policy fails on is
        logged and skipped: the others still apply)."""
        for replica_id, item in self.replica_events.drain():
            with self._contained(f"applying replica {replica_id}'s events"):
                self.state.apply(replica_id, item)

    async def choose_replicas(
        self,
        candidate_replicas: list[RunningReplica],
        pending_request: PendingRequest | None = None,
    ) -> list[list[RunningReplica]]:
        try:
            return self._choose(candidate_replicas, pending_request)
        except Exception:
            log.exception(
                "router %r failed to place a request; routing it by load", self.config.policy
            )
            return [candidate_replicas]

    def _choose(
        self, candidate_replicas: list[RunningReplica], pending_request: PendingRequest | None
    ) -> list[list[RunningReplica]]:
        self._catch_up()
        ids = []
        for r in candidate_replicas:
            replica_id = _uid(r.replica_id)
            if replica_id not in self.state.replicas:
                self._join(replica_id, r)
            self.state.set_stats(replica_id, r.routing_stats)
            ids.append(replica_id)
        request = route_request_of(pending_request)
        if request is None or not candidate_replicas:
            return [candidate_replicas]
        chosen = self.state.decide(id(pending_request), request, ids, owner=pending_request)
        first = [r for r, i in zip(candidate_replicas, ids) if i == chosen]
        rest = [r for r, i in zip(candidate_replicas, ids) if i != chosen]
        return [first, rest] if rest else [first]

    def on_request_routed(
        self, pending_request: PendingRequest, replica_id: ReplicaID, result: Any
    ) -> None:
        with self._contained("confirming a request"):
            self.state.routed(id(pending_request), _uid(replica_id))

    def on_request_completed(self, replica_id: ReplicaID, internal_request_id: str) -> None:
        with self._contained("ending a request"):
            self.state.completed(internal_request_id, _uid(replica_id))

    # ------------------------------------------------------------ reporting
    def snapshot(self) -> dict[Hashable, dict[str, Any]]:
        """:meth:`RoutingState.snapshot` after applying the events that arrived. Call it on the
        router's event loop (:meth:`snapshot_threadsafe` from anywhere)."""
        self._catch_up()
        return self.state.snapshot()

    async def snapshot_threadsafe(self) -> dict[Hashable, dict[str, Any]]:
        """:meth:`snapshot`, run on the router's loop whatever loop awaits it."""
        loop = self._loop
        if loop is None or loop is asyncio.get_running_loop():
            return self.snapshot()

        async def on_loop() -> dict[Hashable, dict[str, Any]]:
            return self.snapshot()

        return await asyncio.wrap_future(asyncio.run_coroutine_threadsafe(on_loop(), loop))
