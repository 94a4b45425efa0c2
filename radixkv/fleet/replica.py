"""One simulated replica: its radix cache, and how it serves its queue (serial or batched).

:class:`Replica` owns a real :class:`~radixkv.cache.radix.RadixCache` over its
own block pool, with KV events on (hashed with :data:`FLEET_HASHER`). Its
``place`` is the cache tier's ``place_prompt``, the step replay takes (match,
evict the shortfall, allocate, insert), and leaves the request holding its
blocks until ``release``.

A scheduler runs the replica's queue in simulated time and reports to its
:class:`Host` (the simulator): ``admit`` when a request's prefill starts (the
cache step; it may refuse for want of free blocks), ``first_token`` and
``finish``, and ``schedule`` for the time of its next internal event.

- :class:`SerialScheduler`: one request at a time, FIFO; it holds no blocks
  (released at once, as the radix replayer does), so one replica equals one
  replayed cache.
- :class:`BatchedScheduler`: continuous batching with chunked prefill
  (:class:`~radixkv.fleet.service.BatchConfig`): each step gives one token to
  every decoding sequence and the rest of the token budget to prefill, first
  come first served. Admitted requests hold their blocks until they finish; a
  request waits while the free and evictable blocks cannot hold it (unless
  nothing else runs: then it takes what fits, as the serial step does).

The batched scheduler advances as a fluid between events: while the batch's
make-up holds, steps of the same shape repeat, so it jumps to the next
event (a prefill completing, a sequence finishing) in one computation, with
fractional steps; a prefill chunk's cost counts the exact keys it attends.
"""

from __future__ import annotations

import heapq
import math
from collections import deque
from collections.abc import Hashable, Sequence
from typing import Protocol

import numpy as np

from radixkv.cache.allocator import BlockAllocator
from radixkv.cache.events import KVCacheEvent
from radixkv.cache.hashing import ChainHasher
from radixkv.fleet.routing import ReplicaState
from radixkv.fleet.service import BatchConfig, ServiceModel
from radixkv.fleet.shared_store import DEVICE_ONLY, Placed, Tiers

__all__ = [
    "FLEET_HASHER",
    "BatchedScheduler",
    "Host",
    "Replica",
    "SerialScheduler",
]

FLEET_HASHER = ChainHasher("xxhash", seed=0)
"""The chain hash every simulated replica names its blocks with (routers must use it too)."""


class Replica:
    """One simulated replica: its allocator, cache, state (as a router sees it) and counters.

    :meth:`place` (``place_prompt`` over ``cache``) is the replica's cache
    step. ``tiers`` (:mod:`radixkv.fleet.shared_store`) makes the cache and runs
    the step: :data:`~radixkv.fleet.shared_store.DEVICE_ONLY` (the default, a
    ``RadixCache``) or a :class:`~radixkv.fleet.shared_store.SharedStore` (a host
    tier over the fleet's store). ``work`` is the replica's
    service time as a saturated replica would spend it (serial: prefill +
    decode; batched: ``BatchConfig.work``), ``busy_time`` the time it had
    anything running.
    """

    __slots__ = (
        "allocator",
        "busy_time",
        "cache",
        "capacity_blocks",
        "served",
        "state",
        "tiers",
        "work",
    )

    def __init__(
        self,
        rid: Hashable,
        capacity_blocks: int,
        block_size: int,
        eviction: str,
        tiers: Tiers = DEVICE_ONLY,
    ) -> None:
        self.allocator = BlockAllocator(capacity_blocks, block_size)
        self.tiers = tiers
        self.cache = tiers.make_cache(self.allocator, eviction, FLEET_HASHER)
        self.capacity_blocks = capacity_blocks
        self.busy_time = 0.0
        self.work = 0.0
        self.served = 0
        self.state = ReplicaState(rid, capacity_blocks=capacity_blocks)

    def take_events(self) -> list[KVCacheEvent]:
        return self.cache.take_events()

    def place(
        self, tokens: np.ndarray, namespace: Hashable = None, *, exclusive: bool = True
    ) -> Placed | None:
        """Match (loading from the tiers below), evict the shortfall, allocate, insert: the
        :class:`~radixkv.fleet.shared_store.Placed` (hit in cache tokens, blocks held,
        what of the hit the host and the store served).

        ``place_prompt``: the caller holds one reference on each
        returned block until :meth:`release`. When the free and evictable
        blocks cannot hold the uncached part, a non-``exclusive`` call gives its
        match back and returns None (the request waits); an ``exclusive`` one
        (nothing else running) inserts as much as fits. Complexity: the cache's
        match, evict and insert.
        """
        return self.tiers.place(self.cache, tokens, namespace, exclusive)

    def release(self, blocks: np.ndarray) -> None:
        """Give back the references :meth:`place` returned."""
        self.allocator.decref_distinct(blocks)

    def serve(self, tokens: np.ndarray, namespace: Hashable = None) -> int:
        """Place and release at once (radix replay's step); the hit in cache tokens."""
        placed = self.tiers.place(self.cache, tokens, namespace, True)
        self.allocator.decref_distinct(placed.blocks)  # type: ignore[union-attr]  # exclusive
        return placed.num_cached_tokens  # type: ignore[union-attr]


class Host(Protocol):
    """What a scheduler reports to (the simulator's run)."""

    service: ServiceModel

    def prompt(self, i: int) -> tuple[int, int]:
        """Request ``i``'s (prompt tokens, output tokens), real tokens."""
        ...

    def admit(self, k: int, i: int, exclusive: bool) -> tuple[int, np.ndarray, float] | None:
        """Start request ``i``'s prefill on replica ``k``: (hit in real tokens, blocks held,
        seconds the replica spends loading the part of the hit its lower tiers served)."""
        ...

    def first_token(self, i: int, t: float) -> None: ...

    def finish(self, k: int, i: int, t: float) -> None: ...

    def schedule(self, k: int, t: float) -> None:
        """Wake replica ``k`` at ``t`` (a later call replaces an earlier one; ``inf``: never)."""
        ...


class SerialScheduler:
    """One request at a time, FIFO: busy for prefill + decode; blocks released at the start."""

    __slots__ = ("current", "host", "k", "queue", "replica")

    def __init__(self, k: int, replica: Replica, host: Host) -> None:
        self.k, self.replica, self.host = k, replica, host
        self.queue: deque[int] = deque()
        self.current = -1

    def arrive(self, i: int, now: float) -> None:
        self.queue.append(i)
        if self.current < 0:
            self._start(now)
        self.replica.state.waiting = len(self.queue)

    def wake(self, now: float) -> None:
        i, self.current = self.current, -1
        self.replica.state.running = 0
        self.host.finish(self.k, i, now)
        if self.queue:
            self._start(now)

    def _start(self, now: float) -> None:
        host, rep = self.host, self.replica
        i = self.queue.popleft()
        hit, blocks, load = host.admit(self.k, i, True)  # type: ignore[misc]  # exclusive
        rep.release(blocks)
        prompt, output = host.prompt(i)
        pre = host.service.prefill(prompt, hit) + load
        busy = pre + host.service.decode(output)
        host.first_token(i, now + pre)
        rep.busy_time += busy
        rep.work += busy
        self.current = i
        st = rep.state
        st.waiting = len(self.queue)
        st.running = 1
        st.kv_usage = 1.0 - rep.allocator.num_free / rep.capacity_blocks
        host.schedule(self.k, now + busy)


class BatchedScheduler:
    """Continuous batching with chunked prefill (see the module docstring).

    State between events: ``t`` (when it was last brought up to date), the
    prefill ``head`` (its uncached tokens ``left`` and ``pos``, the tokens
    before its next chunk), the ``decoding`` heap keyed by the decode-step
    count ``steps`` at which each finishes, the planned interval
    (``plan_steps`` steps, ``plan_tokens`` of them prefill tokens), and
    ``stall``: seconds of loads from the tiers below the device that admitted
    requests still owe. A load is synchronous, as the store tier's is: the
    replica runs no step while it loads, so the next interval starts with it.
    """

    __slots__ = (
        "batch",
        "decoding",
        "head",
        "held",
        "host",
        "k",
        "left",
        "plan_steps",
        "plan_tokens",
        "pos",
        "replica",
        "stall",
        "steps",
        "t",
        "waiting",
    )

    def __init__(self, k: int, replica: Replica, host: Host, batch: BatchConfig) -> None:
        self.k, self.replica, self.host, self.batch = k, replica, host, batch
        self.waiting: deque[int] = deque()
        self.decoding: list[tuple[float, int]] = []
        self.held: dict[int, np.ndarray] = {}
        self.head = -1
        self.left = 0.0
        self.pos = 0.0
        self.steps = 0.0
        self.t = 0.0
        self.plan_steps = 0.0
        self.plan_tokens = 0.0
        self.stall = 0.0

    def arrive(self, i: int, now: float) -> None:
        self.waiting.append(i)
        if self.head < 0:  # prefill idle: the step's shape changes now
            self._advance_decode(now)
            self._admit(now)
            self._plan()
        self._report()

    def wake(self, now: float) -> None:
        n, x = self.plan_steps, self.plan_tokens
        stall, self.stall = self.stall, 0.0  # the plan paid it first
        self._account(n, len(self.decoding), x, self.pos, now - self.t - stall)
        self._pay(stall)
        self.steps += n
        self.t = now
        if self.head >= 0:
            if x >= self.left * (1 - 1e-12):
                i, self.head = self.head, -1
                self.host.first_token(i, now)
                self._join(i, now)
            else:
                self.left -= x
                self.pos += x
        decoding = self.decoding
        while decoding and decoding[0][0] <= self.steps + 1e-9:
            self._finish(heapq.heappop(decoding)[1], now)
        self._admit(now)
        self._plan()
        self._report()

    # ------------------------------------------------------------ internals
    def _account(self, n: float, d: int, x: float, pos: float, dt: float) -> None:
        if n <= 0 or (d == 0 and x <= 0):
            return
        svc = self.host.service
        rep = self.replica
        rep.busy_time += dt
        rep.work += (
            svc.prefill(pos + x, pos)
            + svc.decode_per_token * d * n
            + svc.step_overhead * (x + d * n) / self.batch.token_budget
        )

    def _pay(self, seconds: float) -> None:
        """The replica spent ``seconds`` loading: busy, and work."""
        rep = self.replica
        rep.busy_time += seconds
        rep.work += seconds

    def _advance_decode(self, now: float) -> None:
        """Bring a decode-only batch (no prefill running) up to ``now``: what it owes of
        loads first, then decode steps."""
        if self.stall and now > self.t:
            paid = min(self.stall, now - self.t)
            self._pay(paid)
            self.stall -= paid
            self.t += paid
        d = len(self.decoding)
        if d and now > self.t:
            svc = self.host.service
            n = (now - self.t) / (svc.step_overhead + svc.decode_per_token * d)
            if n > 0:
                self._account(n, d, 0.0, 0.0, now - self.t)
                self.steps += n
        self.t = now

    def _admit(self, now: float) -> None:
        """Fill the prefill slot from the queue while sequences and blocks allow."""
        host, waiting = self.host, self.waiting
        limit = self.batch.max_num_seqs
        while self.head < 0 and waiting and len(self.decoding) < limit:
            i = waiting[0]
            got = host.admit(self.k, i, not self.decoding)
            if got is None:
                return  # not enough blocks: waits for a finish
            waiting.popleft()
            hit, blocks, load = got
            self.held[i] = blocks
            self.stall += load
            prompt, _ = host.prompt(i)
            if prompt - hit <= 0:
                host.first_token(i, now + self.stall)
                self._join(i, now)
            else:
                self.head, self.left, self.pos = i, float(prompt - hit), float(hit)

    def _join(self, i: int, now: float) -> None:
        _, output = self.host.prompt(i)
        if output <= 1:
            self._finish(i, now)
        else:
            heapq.heappush(self.decoding, (self.steps + output - 1, i))

    def _finish(self, i: int, now: float) -> None:
        self.replica.release(self.held.pop(i))
        self.host.finish(self.k, i, now)

    def _plan(self) -> None:
        """Plan the interval to the next event and ask the host to wake the replica then."""
        svc = self.host.service
        d = len(self.decoding)
        n = self.decoding[0][0] - self.steps if d else math.inf
        x = 0.0
        if self.head >= 0:
            budget = self.batch.token_budget - d
            if self.left / budget <= n:
                n, x = self.left / budget, self.left
            else:
                x = n * budget
        if n == math.inf:
            self.plan_steps = self.plan_tokens = 0.0
            # idle (a wake planned before is cancelled), or only a load left to finish
            self.host.schedule(self.k, self.t + self.stall if self.stall else math.inf)
            return
        n = max(n, 0.0)
        self.plan_steps, self.plan_tokens = n, x
        dt = self.stall + n * (svc.step_overhead + svc.decode_per_token * d)
        if x > 0:
            dt += svc.prefill(self.pos + x, self.pos)
        self.host.schedule(self.k, self.t + dt)

    def _report(self) -> None:
        rep = self.replica
        st = rep.state
        st.waiting = len(self.waiting)
        st.running = len(self.decoding) + (self.head >= 0)
        st.kv_usage = 1.0 - rep.allocator.num_free / rep.capacity_blocks


def make_schedulers(
    replicas: Sequence[Replica], host: Host, batch: BatchConfig | None
) -> list[SerialScheduler] | list[BatchedScheduler]:
    """One scheduler per replica: serial when ``batch`` is None, else batched."""
    if batch is None:
        return [SerialScheduler(k, r, host) for k, r in enumerate(replicas)]
    return [BatchedScheduler(k, r, host, batch) for k, r in enumerate(replicas)]
