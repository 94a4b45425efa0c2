"""What a fleet simulation measured: the tally a run keeps, and its roll-up into a SimResult.

:class:`RunTally` is what the simulator (:mod:`radixkv.fleet.sim`) counts as
events happen: per request its replica, cache hit, TTFT and routing time, and
the regret's and the event feed's running totals. :func:`roll_up` turns a
finished run's tally and its replicas' counters into the figures of a
:class:`SimResult`; the definitions of those figures live here, in one place.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import asdict, dataclass, field
from typing import Any

import numpy as np

from radixkv.fleet.replica import Replica
from radixkv.fleet.routing import MemoryReporting, Router

__all__ = ["RunTally", "SimResult", "roll_up"]


@dataclass
class SimResult:
    """What one simulated run measured (see :mod:`radixkv.fleet.sim` for the model).

    - ``hit_rate``: hit tokens / prompt tokens over all requests (real tokens), every
      tier's; ``host_hit_rate`` / ``store_hit_rate``: the part of it loaded from the
      replicas' host tiers / the shared store (0 without them; the device's is the rest);
    - ``ttft_*``: modelled TTFT, seconds;
    - ``max_mean_load``: max over replicas of requests served / the mean;
      ``max_mean_busy``: the same for the time each had anything running;
    - ``offered_load``: the fleet's utilisation with no cache
      (:func:`~radixkv.fleet.sim.offered_load`); ``utilisation``: measured,
      each replica's work / the makespan, averaged over replicas (serial: busy
      time; batched: ``BatchConfig.work`` summed over what it computed);
      ``max_mean_utilisation``: max over replicas / mean;
    - ``regret``: NVIDIA Dynamo's, ``lost / (novel + lost)`` in blocks, where per
      request ``lost`` = best replica's cached overlap - the chosen one's and
      ``novel`` = prompt blocks - best overlap, both at decision time (``peek``);
    - ``decision_us_p50`` / ``_p99``: measured wall time of ``choose``, microseconds;
    - ``index_memory_bytes``: the router's ``memory_bytes()`` (``MemoryReporting``), else 0.

    Per-request arrays (``replica``, ``hit_ids``, ``ttft``) are kept for
    inspection; ``to_dict`` leaves them out.
    """

    router: str
    service: str
    num_replicas: int
    capacity_blocks: int
    num_requests: int
    prompt_tokens: int
    hit_tokens: int
    hit_rate: float
    host_hit_rate: float
    store_hit_rate: float
    ttft_p50: float
    ttft_p90: float
    ttft_p99: float
    ttft_mean: float
    max_mean_load: float
    max_mean_busy: float
    offered_load: float
    utilisation: float
    max_mean_utilisation: float
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
    host_ids: np.ndarray = field(repr=False)
    store_ids: np.ndarray = field(repr=False)

    def to_dict(self) -> dict[str, Any]:
        """The scalar figures (and ``served`` per replica) as a JSON-ready dict."""
        d = asdict(self)
        for k in ("replica", "hit_ids", "ttft", "host_ids", "store_ids"):
            d.pop(k)
        return d


class RunTally:
    """What one run of ``num_requests`` requests counts as it goes (the simulator writes it).

    Per request ``i`` (arrays, owned by the tally and handed to the result):
    ``replica[i]`` the replica index it was routed to (-1 until routed),
    ``hit_ids[i]`` its cache hit in trace ids (every tier's), ``host_ids[i]`` and
    ``store_ids[i]`` the part of it loaded from its replica's host tier and from the
    shared store (the last of the hit), ``ttft[i]`` its modelled TTFT
    (seconds), ``decision_ns[i]`` the wall time of its ``choose`` call. Totals:
    ``lost_blocks`` / ``novel_blocks`` (the regret's terms, see
    :class:`SimResult`) and ``events_delivered`` (KV events handed to the router).
    """

    __slots__ = (
        "decision_ns",
        "events_delivered",
        "hit_ids",
        "host_ids",
        "lost_blocks",
        "novel_blocks",
        "replica",
        "store_ids",
        "ttft",
    )

    def __init__(self, num_requests: int) -> None:
        self.replica = np.full(num_requests, -1, dtype=np.int64)
        self.hit_ids = np.zeros(num_requests, dtype=np.int64)
        self.host_ids = np.zeros(num_requests, dtype=np.int64)
        self.store_ids = np.zeros(num_requests, dtype=np.int64)
        self.ttft = np.zeros(num_requests, dtype=np.float64)
        self.decision_ns = np.zeros(num_requests, dtype=np.int64)
        self.lost_blocks = 0
        self.novel_blocks = 0
        self.events_delivered = 0

    def record_route(
        self, i: int, k: int, overlaps: Sequence[int], num_blocks: int, decision_ns: int
    ) -> None:
        """Request ``i`` (``num_blocks`` prompt blocks) went to replica ``k`` after ``decision_ns``.

        ``overlaps[j]`` is replica ``j``'s cached overlap with the prompt, in
        blocks, at decision time: the regret's ``lost`` grows by the best
        overlap minus the chosen one's, ``novel`` by the blocks past the best.
        Complexity: O(len(overlaps)).
        """
        self.replica[i] = k
        self.decision_ns[i] = decision_ns
        best = max(overlaps)
        self.lost_blocks += best - overlaps[k]
        self.novel_blocks += num_blocks - best


def roll_up(
    tally: RunTally,
    *,
    router: Router,
    service: str,
    replicas: Sequence[Replica],
    capacity_blocks: int,
    prompt_tokens: Sequence[int],
    tokens_per_id: int,
    offered_load: float,
    makespan: float,
) -> SimResult:
    """The figures of a finished run: its ``tally``, and its ``replicas``' counters.

    ``prompt_tokens[i]`` is request i's prompt length in real tokens; a hit of
    ``h`` ids serves ``min(h * tokens_per_id, prompt_tokens[i])`` of them (the
    partial last block capped). ``service`` names the discipline (``"serial"``
    or ``"batched"``); ``offered_load`` is passed through; ``makespan`` is the
    time of the last event (simulated seconds). Reads the replicas' ``served``,
    ``busy_time`` and ``work``, and the router's ``name`` and, where it reports one
    (``MemoryReporting``), ``memory_bytes()``. The result shares the tally's
    arrays. Complexity: O(requests + replicas), plus the percentiles' sorts.
    """
    n = len(prompt_tokens)
    num_replicas = len(replicas)
    served = [rep.served for rep in replicas]
    busy = [rep.busy_time for rep in replicas]
    work = [rep.work for rep in replicas]
    prompt = sum(prompt_tokens)
    hit_tokens = _real_tokens(tally.hit_ids, prompt_tokens, tokens_per_id)
    upper = _real_tokens(tally.hit_ids - tally.store_ids, prompt_tokens, tokens_per_id)
    device = _real_tokens(
        tally.hit_ids - tally.store_ids - tally.host_ids, prompt_tokens, tokens_per_id
    )
    mean_busy = sum(busy) / num_replicas
    mean_work = sum(work) / num_replicas
    us = tally.decision_ns / 1000.0
    ttft = tally.ttft
    lost, novel = tally.lost_blocks, tally.novel_blocks
    return SimResult(
        router=str(router.name),
        service=service,
        num_replicas=num_replicas,
        capacity_blocks=capacity_blocks,
        num_requests=n,
        prompt_tokens=int(prompt),
        hit_tokens=hit_tokens,
        hit_rate=hit_tokens / prompt if prompt else 0.0,
        host_hit_rate=(upper - device) / prompt if prompt else 0.0,
        store_hit_rate=(hit_tokens - upper) / prompt if prompt else 0.0,
        ttft_p50=_pct(ttft, 50),
        ttft_p90=_pct(ttft, 90),
        ttft_p99=_pct(ttft, 99),
        ttft_mean=float(ttft.mean()) if n else 0.0,
        max_mean_load=max(served) / (n / num_replicas) if n else 0.0,
        max_mean_busy=max(busy) / mean_busy if mean_busy > 0 else 0.0,
        offered_load=offered_load,
        utilisation=mean_work / makespan if makespan > 0 else 0.0,
        max_mean_utilisation=max(work) / mean_work if mean_work > 0 else 0.0,
        regret=lost / (novel + lost) if novel + lost else 0.0,
        lost_blocks=int(lost),
        novel_blocks=int(novel),
        decision_us_p50=_pct(us, 50),
        decision_us_p99=_pct(us, 99),
        index_memory_bytes=_memory_bytes(router),
        makespan_s=float(makespan),
        events_delivered=tally.events_delivered,
        served=served,
        replica=tally.replica,
        hit_ids=tally.hit_ids,
        ttft=ttft,
        host_ids=tally.host_ids,
        store_ids=tally.store_ids,
    )


def _real_tokens(ids: np.ndarray, prompt_tokens: Sequence[int], tokens_per_id: int) -> int:
    """Real tokens of hits of ``ids[i]`` trace ids: ``min(ids[i] x tokens_per_id,
    prompt_tokens[i])`` summed (the partial last block capped)."""
    return int(
        sum(min(int(h) * tokens_per_id, p) for h, p in zip(ids, prompt_tokens, strict=True))
    )


def _pct(a: np.ndarray, q: float) -> float:
    return float(np.percentile(a, q)) if len(a) else 0.0


def _memory_bytes(router: Router) -> int:
    """The router's ``memory_bytes()`` where it reports one (``MemoryReporting``), else 0."""
    return int(router.memory_bytes()) if isinstance(router, MemoryReporting) else 0
