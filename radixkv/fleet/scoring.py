"""How the prefix-aware routers pick a replica: the expected time to the request's first token.

:class:`Backlog` is the router's estimate of the prefill work queued on each
replica, kept from its own decisions and the finish notifications (no replica
report needed). :class:`TimeCostScoring` adds the request's own uncached
prefill there, priced by the same :class:`~radixkv.fleet.service.ServiceModel`
the simulator serves with, and what the choice costs the requests queued
behind it, and picks the lowest; where that ties (no queue and the same
cached prefix, typically a prefix no replica holds), the replica with the
most free KV, then the one that has taken the fewest new blocks, then the
next in turn: never list order. Plain Python; not thread-safe.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Hashable, Sequence
from dataclasses import dataclass

from radixkv.checks import check_int, check_number
from radixkv.fleet.routing import ReplicaState
from radixkv.fleet.service import ServiceModel

__all__ = ["EXTERNALITIES", "Backlog", "TimeCostScoring"]


class Backlog:
    """Per replica, the seconds of prefill routed there and not yet known to be done.

    ``add`` queues a decision's predicted prefill behind what is there (a
    fluid estimate: the replica works it off at one second per second of the
    router's clock, so ``free_at`` is when it would be done). ``done`` says a
    request finished: replicas prefill first come, first served, so it and
    everything routed there before it are past prefill, which caps the
    estimate at the prefill of what was routed after it. ``wait`` is the lower
    of the two, raised to the replica's own report of requests waiting when
    it gives one. Complexity: O(1) per call, amortized.
    """

    __slots__ = ("_free_at", "_pending", "_total")

    def __init__(self) -> None:
        self._free_at: dict[Hashable, float] = {}
        self._pending: dict[Hashable, dict[Hashable, float]] = {}  # in routing order
        self._total: dict[Hashable, float] = {}

    def add(self, replica_id: Hashable, owner: Hashable, seconds: float, now: float) -> None:
        """Queue ``seconds`` of prefill for request ``owner`` on ``replica_id`` at ``now``."""
        self._free_at[replica_id] = max(self._free_at.get(replica_id, now), now) + seconds
        pending = self._pending.setdefault(replica_id, {})
        pending[owner] = pending.get(owner, 0.0) + seconds
        self._total[replica_id] = self._total.get(replica_id, 0.0) + seconds

    def done(self, replica_id: Hashable, owner: Hashable, now: float) -> None:
        """Request ``owner`` on ``replica_id`` finished (or was aborted) at ``now``."""
        pending = self._pending.get(replica_id)
        if not pending or owner not in pending:
            return
        total = self._total[replica_id]
        while pending:
            key = next(iter(pending))
            total -= pending.pop(key)
            if key == owner:
                break
        if not pending:
            del self._pending[replica_id]
            total = 0.0
        self._total[replica_id] = max(total, 0.0)
        self._free_at[replica_id] = min(self._free_at[replica_id], now + max(total, 0.0))

    def mean(self, replica_id: Hashable) -> float:
        """The mean prefill seconds of what is pending at ``replica_id`` (0 if nothing)."""
        pending = self._pending.get(replica_id)
        return self._total[replica_id] / len(pending) if pending else 0.0

    def queued(self, replica_id: Hashable, now: float, waiting: int = 0) -> float:
        """About how many requests' prefill is ahead at ``replica_id``: :meth:`wait` over the
        mean prefill pending there (0 when none is)."""
        mean = self.mean(replica_id)
        return self.wait(replica_id, now, waiting) / mean if mean > 0 else 0.0

    def wait(self, replica_id: Hashable, now: float, waiting: int = 0) -> float:
        """Seconds of prefill ahead of a request routed to ``replica_id`` at ``now``.

        ``waiting``, the replica's own count of requests not yet started (its
        last report; 0 if none), sets a floor of that many mean prefills: a
        replica short of KV blocks starts requests slower than its prefill
        rate, which the fluid estimate cannot see.
        """
        free_at = self._free_at.get(replica_id)
        fluid = 0.0
        if free_at is not None and free_at > now:
            fluid = min(free_at - now, self._total.get(replica_id, 0.0))
        if waiting > 0:
            return max(fluid, min(waiting * self.mean(replica_id), self._total[replica_id]))
        return fluid

    def drop(self, replica_id: Hashable) -> None:
        """Forget ``replica_id``."""
        self._free_at.pop(replica_id, None)
        self._pending.pop(replica_id, None)
        self._total.pop(replica_id, None)


EXTERNALITIES = ("extra", "full", "off")


@dataclass(frozen=True)
class TimeCostScoring:
    """Expected time to first token, per replica, and the pick.

    For a request of ``n`` full blocks with ``m`` of them cached (or
    speculative) on a replica, its own prefill there is ``own =
    service.prefill(n * t, m * t)``, ``t`` = ``tokens_per_block`` (real tokens
    a block: ``block_size``, or ``block_size x 512`` for the simulator's
    Mooncake ids). The cost is ``wait + own``, ``wait`` the replica's
    :class:`Backlog`, plus what the choice costs the requests behind it
    (``externality``):

    - ``"extra"`` (default): ``(own - floor) * queued``, ``floor`` the least
      ``own`` over the replicas and ``queued`` the requests queued at this
      one: prefill a better-cached replica would not have needed delays
      about as many later requests there as wait there now. Idle replicas
      pay nothing (pure time to first token); under load, a cached prefix
      keeps its requests (affinity grows with the queues).
    - ``"full"``: ``own * queued`` (all of the work, not only the extra);
    - ``"off"``: none.

    Lowest cost wins; ties go to the replica with the lowest fill (blocks
    indexed / its capacity: spread new prefixes over the fleet's memory),
    then the fewest new blocks taken so far, then the next in turn from a
    rotating start: never list order.

    ``load_factor`` (None: off) first drops replicas above CHWBL's bound,
    ``in_flight + 1 > ceil(load_factor * (total + 1) / n)``;
    ``min_gain_blocks`` (0: off) sends a request to the replica with the
    least wait unless the best prefix beats that replica's by that many
    blocks. Defaults measured by ``benchmarks/bench_fleet.py --sweep``
    (docs/fleet.md). ``ValueError`` naming the field for a bad value.
    """

    service: ServiceModel = ServiceModel()
    tokens_per_block: int = 1
    load_factor: float | None = None
    min_gain_blocks: int = 0
    externality: str = "extra"

    def __post_init__(self) -> None:
        if not isinstance(self.service, ServiceModel):
            raise ValueError(f"service must be a ServiceModel, got {self.service!r}")
        check_int("tokens_per_block", self.tokens_per_block, low=1)
        check_number("load_factor", self.load_factor, low=1, finite=False, optional=True)
        check_int("min_gain_blocks", self.min_gain_blocks, low=0)
        if self.externality not in EXTERNALITIES:
            raise ValueError(
                f"externality must be one of {EXTERNALITIES}, got {self.externality!r}"
            )

    def eligible(self, replicas: Sequence[ReplicaState]) -> Sequence[ReplicaState]:
        """The replicas within the load bound (all of them when it is off). O(replicas)."""
        if self.load_factor is None:
            return replicas
        total = sum(r.in_flight for r in replicas)
        bound = math.ceil(self.load_factor * (total + 1) / len(replicas))
        return [r for r in replicas if r.in_flight + 1 <= bound] or replicas

    def pick(
        self,
        replicas: Sequence[ReplicaState],
        matched: dict[Hashable, int],
        num_blocks: int,
        backlog: Backlog,
        now: float,
        fill: Callable[[ReplicaState], float],
        taken: Callable[[ReplicaState], float],
        turn: int = 0,
        own: Callable[[int], float] | None = None,
    ) -> tuple[ReplicaState, float]:
        """The replica to route to and the request's predicted prefill seconds there.

        ``matched``: each replica's cached leading blocks (missing: 0);
        ``backlog`` at ``now``: each replica's wait and queue; ``fill`` and
        ``taken``: its fill fraction and new blocks taken so far; ``turn``
        rotates the last tie-break; ``own``: the request's own prefill seconds
        on a replica holding ``m`` leading blocks (None: ``service.prefill(n t,
        m t)``; a shared store's view prices what it can load,
        :meth:`radixkv.fleet.shared_store.StoreView.pricer`), called once per
        distinct ``m``. ``floor`` is the least of those. ``replicas`` must not
        be empty. Complexity: O(replicas).
        """
        cands = self.eligible(replicas)
        prefill = self.service.prefill
        t = self.tokens_per_block
        tokens = num_blocks * t
        price = own if own is not None else (lambda m: prefill(tokens, m * t))
        get = matched.get
        n = len(cands)
        mode = self.externality
        ms = [get(r.replica_id, 0) for r in cands]
        owns = {m: price(m) for m in set(ms)}  # one price per distinct match
        floor = min(owns.values())
        best: ReplicaState = cands[0]
        best_cost = math.inf
        best_rest: tuple[float, float, int] = (0.0, 0.0, 0)
        least: ReplicaState = cands[0]
        least_key: tuple[float, float, float, int] | None = None
        top = max(ms)
        for i, r in enumerate(cands):
            rid = r.replica_id
            own = owns[ms[i]]
            w = backlog.wait(rid, now, r.waiting)
            cost = w + own
            if mode == "extra":
                if own > floor:
                    cost += (own - floor) * backlog.queued(rid, now, r.waiting)
            elif mode == "full":
                cost += own * backlog.queued(rid, now, r.waiting)
            if cost < best_cost:
                best, best_cost = r, cost
                best_rest = (fill(r), taken(r), (i - turn) % n)
            elif cost == best_cost:  # tie: free KV, then fewest blocks taken, then in turn
                rest = (fill(r), taken(r), (i - turn) % n)
                if rest < best_rest:
                    best, best_rest = r, rest
            if self.min_gain_blocks:
                key = (w, fill(r), taken(r), (i - turn) % n)
                if least_key is None or key < least_key:
                    least, least_key = r, key
        best_own = owns[get(best.replica_id, 0)]
        if self.min_gain_blocks and top - get(least.replica_id, 0) < self.min_gain_blocks:
            return least, owns[get(least.replica_id, 0)]
        return best, best_own
