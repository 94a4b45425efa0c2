"""RoutingState: what a serving front's request router keeps between its callbacks and a policy.

Serve tells a request router three things about each call: that it should
pick replicas for it (``choose_replicas``, possibly several times: a replica
that was full or rejected the call makes Serve ask again), that a replica
accepted it (``on_request_routed``) and that it ended
(``on_request_completed``, also for attempts a replica rejected). A radixkv
:class:`~radixkv.fleet.routing.Router` wants one ``choose`` per placed
request, one ``on_finish`` per ended one, and current ``in_flight`` counts.
:class:`RoutingState` turns the first into the second. Plain Python: no Ray,
no I/O, no threads; Ray Serve's adapter
(:class:`~radixkv.serve.ray.request_router.PrefixRouter`) only forwards its callbacks.

What a routing snapshot shows of a policy's prefix index is an :class:`IndexView`
collaborator, chosen once from the policy (:func:`index_view`): the blocks an
``exact`` or ``approx`` policy indexes per replica, nothing for the others.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Hashable, Mapping, Sequence
from dataclasses import asdict, dataclass
from typing import Any, Protocol

from radixkv.cache.events import AllBlocksCleared, KVCacheEvent
from radixkv.checks import check_number, is_number
from radixkv.errors import invariant
from radixkv.fleet.approx import ApproxIndex
from radixkv.fleet.exact import ExactIndex
from radixkv.fleet.router import ApproxPrefixRouter, ExactPrefixRouter
from radixkv.fleet.routing import ReplicaState, Router, RouteRequest
from radixkv.fleet.wire import Reset

__all__ = ["NO_INDEX_VIEW", "IndexView", "RoutingState", "index_view"]


class IndexView(Protocol):
    """What a routing snapshot shows of one replica in a policy's prefix index."""

    def describe(self, replica_id: Hashable) -> dict[str, Any]:
        """Fields to add to ``replica_id``'s snapshot row ({} for a policy without an index)."""
        ...


class _NoIndexView:
    """The view of a policy that keeps no prefix index: adds nothing."""

    def describe(self, replica_id: Hashable) -> dict[str, Any]:
        return {}


NO_INDEX_VIEW: IndexView = _NoIndexView()


class _ExactIndexView:
    """``blocks``: the hashes an :class:`ExactIndex` holds as reported by the replica's events
    (speculative entries left out), sorted."""

    def __init__(self, index: ExactIndex) -> None:
        self.index = index

    def describe(self, replica_id: Hashable) -> dict[str, Any]:
        return {"blocks": sorted(self.index.blocks(replica_id))}


class _ApproxIndexView:
    """``blocks``: the hashes an :class:`ApproxIndex` recorded for the replica, sorted."""

    def __init__(self, index: ApproxIndex) -> None:
        self.index = index

    def describe(self, replica_id: Hashable) -> dict[str, Any]:
        return {"blocks": sorted(self.index.hashes(replica_id))}


def index_view(router: Router) -> IndexView:
    """The view of ``router``'s prefix index: the ``exact`` and ``approx`` policies' (their
    ``index``), :data:`NO_INDEX_VIEW` for any other policy. O(1)."""
    if isinstance(router, ExactPrefixRouter):
        return _ExactIndexView(router.index)
    if isinstance(router, ApproxPrefixRouter):
        return _ApproxIndexView(router.index)
    return NO_INDEX_VIEW


@dataclass(eq=False)  # decisions are told apart by identity
class _Decision:
    key: Hashable  # the Serve call it was made for (the pending request's id)
    owner: object  # that pending request, kept alive so its id is not reused meanwhile
    request_id: str
    replica_id: Hashable
    request: RouteRequest
    time: float
    accepted: bool = False
    counted: bool = True  # the policy counted it on replica_id (its on_finish is owed)


class RoutingState:
    """The adapter's bookkeeping between Serve's callbacks and a radixkv :class:`Router`.

    Owns one :class:`ReplicaState` per known replica; ``in_flight`` is the
    number of decisions standing on it. A decision (:meth:`decide`) counts
    from the moment it is made; Serve may then

    - confirm it (:meth:`routed`), possibly on another replica than chosen
      when the chosen one was full and Serve fell back to the next rank;
    - make a new one for the same call (a rejected or never-sent attempt):
      the old one is undone;
    - report the call finished (:meth:`completed`): the confirmed decision on
      that replica ends and the policy's ``on_finish`` runs.

    With ``confirmations=False`` (Serve without its rejection protocol, which
    never confirms) a decision counts as confirmed when made. An unconfirmed
    decision older than ``pending_ttl_s`` is dropped at the next decision (its
    call was cancelled). Serve also reports rejected attempts as completed;
    those are told apart only by not being confirmed yet, so a late report of
    a rejected attempt can end a later confirmed decision for the same call
    and replica early (in flight reads one low until it finishes).

    The policy is called after the bookkeeping it follows, so an exception
    from it passes through with :meth:`check`'s invariants intact. Not
    thread-safe: one event loop drives it.

    Each ended decision the policy counted gets exactly one ``on_finish`` (completed,
    undone for a new attempt, moved by Serve's fallback, expired unconfirmed): what
    ends an ``exact`` policy's speculative entries for an aborted request.
    ``index`` is what :meth:`snapshot` shows of the policy's prefix index (default:
    :func:`index_view` of ``router``).
    """

    def __init__(
        self,
        router: Router,
        *,
        confirmations: bool = True,
        pending_ttl_s: float = 30.0,
        clock: Callable[[], float] = time.monotonic,
        index: IndexView | None = None,
    ) -> None:
        ttl = check_number("pending_ttl_s", pending_ttl_s, low=0, strict=True, finite=False)
        self.router = router
        self.index = index_view(router) if index is None else index
        self.confirmations = bool(confirmations)
        self.pending_ttl_s = ttl
        self._clock = clock
        self.replicas: dict[Hashable, ReplicaState] = {}
        self._latest: dict[Hashable, _Decision] = {}  # call -> its latest decision, until settled
        self._accepted: dict[str, list[_Decision]] = {}  # Serve request id -> confirmed decisions
        self._last_sweep = -float("inf")

    # ------------------------------------------------------------ replicas
    def add_replica(self, replica_id: Hashable, capacity_blocks: int = 0) -> ReplicaState:
        """Know ``replica_id`` (idempotent; updates its capacity). O(1)."""
        state = self.replicas.get(replica_id)
        if state is None:
            state = self.replicas[replica_id] = ReplicaState(replica_id)
        state.capacity_blocks = int(capacity_blocks)
        return state

    def drop_replica(self, replica_id: Hashable) -> bool:
        """Forget ``replica_id`` here and in the policy (its index entries go); False if unknown.

        Decisions standing on it stay until Serve settles them; they no longer
        count anywhere. Complexity: the policy's ``drop_replica``.
        """
        if self.replicas.pop(replica_id, None) is None:
            return False
        self.router.drop_replica(replica_id)
        return True

    def set_stats(self, replica_id: Hashable, stats: Mapping[str, Any]) -> None:
        """Take a replica's reported ``running``, ``waiting`` and ``kv_usage`` (missing or
        malformed values keep the last ones)."""
        state = self.replicas.get(replica_id)
        if state is None or not isinstance(stats, Mapping):
            return
        for name, kind in (("running", int), ("waiting", int), ("kv_usage", float)):
            value = stats.get(name)
            if is_number(value):
                setattr(state, name, kind(value))

    def apply(self, replica_id: Hashable, item: Sequence[KVCacheEvent] | Reset) -> None:
        """Feed a replica's events (or a ``Reset``: forget what it reported) to the policy;
        ignored for a replica not known (dropped)."""
        if replica_id not in self.replicas:
            return
        if isinstance(item, Reset):
            self.router.on_events(replica_id, [AllBlocksCleared()])
        else:
            self.router.on_events(replica_id, item)

    # ------------------------------------------------------------ decisions
    def decide(
        self,
        key: Hashable,
        request: RouteRequest,
        candidates: Sequence[Hashable],
        owner: object = None,
    ) -> Hashable:
        """The replica the policy picks for ``request`` among ``candidates`` (unknown ones are
        added), made for the call ``key``; a standing decision for ``key`` is undone first.
        ``owner`` (the object ``key`` names, if it is an ``id``) is kept alive until the
        decision is settled. ``ValueError`` if ``candidates`` is empty or the policy picks
        another replica; the policy's own exceptions pass through, and whatever raised, no
        new decision stands. Complexity: the policy's ``choose``, plus O(unconfirmed
        decisions) once a second for expiry."""
        if not candidates:
            raise ValueError(f"candidates must not be empty, got {candidates!r}")
        now = self._clock()
        self._sweep(now)
        old = self._latest.pop(key, None)
        if old is not None:
            self._end(old)
        states = [self.replicas.get(r) or self.add_replica(r) for r in candidates]
        replica_id = self.router.choose(request, states)
        if replica_id not in candidates:
            raise ValueError(f"the policy chose {replica_id!r}, not one of {list(candidates)}")
        d = _Decision(key, owner, str(request.request_id), replica_id, request, now)
        self.replicas[replica_id].in_flight += 1
        self._latest[key] = d
        if not self.confirmations:
            self._accept(d)
        return replica_id

    def routed(self, key: Hashable, replica_id: Hashable) -> bool:
        """Serve's confirmation that call ``key`` was accepted by ``replica_id``; False if no
        decision stands for it (expired, or not made here). O(1)."""
        d = self._latest.get(key)
        if d is None:
            return False
        if self.confirmations:
            del self._latest[key]
            d.owner = None  # the key is settled: its object may go
        if d.replica_id != replica_id:  # Serve fell back to a lower rank
            self._uncount(d)
            d.replica_id = replica_id
            state = self.replicas.get(replica_id)
            if state is not None:
                state.in_flight += 1
        if not d.accepted:
            self._accept(d)
        return True

    def completed(self, request_id: str, replica_id: Hashable) -> bool:
        """Serve's report that its request ``request_id`` on ``replica_id`` ended: one confirmed
        decision for them ends; False if none stands (a rejected attempt, a control call).
        Complexity: O(calls sharing ``request_id``)."""
        decisions = self._accepted.get(request_id)
        if not decisions:
            return False
        d = next((d for d in decisions if d.replica_id == replica_id), None)
        if d is None:
            return False
        self._end(d)
        return True

    def in_flight(self, replica_id: Hashable) -> int:
        """Decisions standing on ``replica_id`` (0 if unknown)."""
        state = self.replicas.get(replica_id)
        return 0 if state is None else state.in_flight

    @property
    def num_pending(self) -> int:
        """Decisions not yet confirmed."""
        return sum(not d.accepted for d in self._latest.values())

    def _accept(self, d: _Decision) -> None:
        d.accepted = True
        self._accepted.setdefault(d.request_id, []).append(d)

    def _uncount(self, d: _Decision) -> None:
        """Take ``d`` off its replica's count and the policy's (the call is not there); the
        policy last, so an exception from its ``on_finish`` leaves these counts right."""
        state = self.replicas.get(d.replica_id)
        if state is not None:
            state.in_flight -= 1
        if d.counted:
            d.counted = False
            if state is not None:  # a dropped replica is already forgotten by the policy
                self.router.on_finish(d.replica_id, d.request)

    def _end(self, d: _Decision) -> None:
        """``d`` stops standing, wherever it is filed (unfiled before the policy hears)."""
        if d.accepted:
            decisions = self._accepted[d.request_id]
            decisions.remove(d)
            if not decisions:
                del self._accepted[d.request_id]
        if self._latest.get(d.key) is d:
            del self._latest[d.key]
        self._uncount(d)

    def _sweep(self, now: float) -> None:
        """End unconfirmed decisions older than ``pending_ttl_s`` (at most once a second)."""
        if now - self._last_sweep < 1.0:
            return
        self._last_sweep = now
        cutoff = now - self.pending_ttl_s
        for d in [d for d in self._latest.values() if not d.accepted and d.time < cutoff]:
            self._end(d)

    # ------------------------------------------------------------ checks
    def check(self) -> None:
        """Raise ``InvariantError`` naming the first broken invariant: each known replica's
        ``in_flight`` equals the decisions standing on it; every confirmed decision is filed
        under its request, and only those; no empty filing. O(decisions)."""
        standing: dict[Hashable, int] = {}
        seen: set[int] = set()
        for d in self._latest.values():
            seen.add(id(d))
            standing[d.replica_id] = standing.get(d.replica_id, 0) + 1
            filed = any(x is d for x in self._accepted.get(d.request_id, ()))
            invariant(
                filed == d.accepted, f"decision {d.key!r}: confirmed {d.accepted}, filed {filed}"
            )
        for request_id, decisions in self._accepted.items():
            invariant(decisions, f"request {request_id!r} has an empty filing")
            for d in decisions:
                invariant(
                    d.accepted and d.request_id == request_id,
                    f"decision {d.key!r} is misfiled under {request_id!r}",
                )
                if id(d) not in seen:
                    seen.add(id(d))
                    standing[d.replica_id] = standing.get(d.replica_id, 0) + 1
        for replica_id, state in self.replicas.items():
            n = standing.get(replica_id, 0)
            invariant(
                state.in_flight == n,
                f"replica {replica_id!r} counts {state.in_flight} in flight, {n} decisions stand",
            )

    def snapshot(self) -> dict[Hashable, dict[str, Any]]:
        """Per known replica: its load as the router sees it and what :attr:`index` shows of
        it (``exact``, ``approx``: the block hashes indexed there, reported by events or
        recorded). Complexity: O(replicas) plus the view's."""
        return {
            replica_id: {**asdict(s), **self.index.describe(replica_id)}
            for replica_id, s in self.replicas.items()
        }
