"""Scheduler: continuous batching over a KV cache manager.

Bookkeeping only (plain ints and numpy; no tensor here). Every block a request
holds lives in the :class:`~radixkv.cache.manager.KVCacheManager`; the scheduler
decides who runs and asks the manager for blocks. Each step:

1. ``schedule()`` gives running requests their tokens first, in admission order
   (one decode token, or the next prefill chunk), from a token budget shared by
   the whole batch; the manager allocates blocks as tokens need them, evicting
   from the cache when the pool is short. When even that is not enough, the most
   recently admitted running request is preempted (its blocks go back, it goes
   to the front of the queue and is recomputed). Leftover budget admits waiting
   requests (``fcfs`` or ``lpm`` order): the manager matches each one's longest
   cached prefix (all but the last token, which must run for its logits), and
   those blocks head its table, so cached positions read their K/V from the
   cache's blocks.
2. The engine runs the model on the scheduled tokens.
3. ``postprocess(output, next_tokens)`` advances each request, appends sampled
   tokens (to the request and to the manager, which keeps a copy of each
   request's tokens), offers each prefill chunk's full blocks to the cache, and
   on finish frees the request's blocks (the cache keeps what it adopted).

Two choices go beyond the minimum, both so that a shared prefix is computed
once when requests arrive together (all users of a system prompt at once):
the match happens at admission, not at submission, and a request whose
block-aligned prefix is being prefilled right now by a running request waits
for it (its blocks enter the cache after every prefill chunk) instead of
computing the same tokens in parallel.

A request is looked up (counted in the cache's stats, its prefix touched for
eviction order and reloaded from a host tier) only when the pool's counts say
it may fit: its cached prefix is peeked first, with no side effect. If, looked
up, it still finds too few blocks (its own prefix was among the blocks the
counts took for evictable, or a reload took them), it keeps what it matched
(the *held* request: at most one) and is tried first next step with no second
lookup. A running request that needs blocks takes them from the held request
before preempting anyone; the held request then looks up again when it may fit.
"""

from __future__ import annotations

import time
from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Protocol

from radixkv.cache.allocator import BlockAllocator
from radixkv.cache.manager import KVCacheManager
from radixkv.cache.prefix_cache import PrefixCache
from radixkv.checks import check_bool, check_int
from radixkv.engine.request import FinishReason, Request, RequestStatus
from radixkv.errors import InvariantError

__all__ = [
    "SCHEDULE_POLICIES",
    "PrefixReader",
    "ReadWholePrefix",
    "ScheduledSeq",
    "Scheduler",
    "SchedulerConfig",
    "SchedulerOutput",
]

SCHEDULE_POLICIES = ("fcfs", "lpm")
# lpm ranks the queue by each request's cached prefix (a side-effect-free peek);
# beyond this many waiting requests it falls back to fcfs, as SGLang does.
LPM_MAX_QUEUE = 128


@dataclass(frozen=True)
class SchedulerConfig:
    """Per-step limits and the admission policy.

    - ``max_num_batched_tokens``: token budget of one step, shared by decodes
      and prefill chunks (a longer prompt prefills over several steps).
    - ``max_num_seqs``: most requests running at once.
    - ``schedule_policy``: the admission order, ``"fcfs"`` (arrival order) or ``"lpm"``
      (longest cached prefix first, arrival order among equals).
    - ``lpm_max_wait_steps``: under ``lpm``, a request that has waited this
      many steps (``schedule`` calls since it entered the queue, or re-entered
      it after a preemption) goes ahead of every request that has not, in
      queue order: without it, a request with no cached prefix waits as long
      as requests with a hot prefix keep arriving. The default is a bound on
      starvation picked without a workload study, not a tuned value.
    - ``wait_for_shared_prefill``: hold back a request whose prefix a running
      request is prefilling right now (turn it off when nothing is cached).
    """

    max_num_batched_tokens: int = 512
    max_num_seqs: int = 64
    schedule_policy: str = "fcfs"
    lpm_max_wait_steps: int = 100
    wait_for_shared_prefill: bool = True

    def __post_init__(self) -> None:
        for name in ("max_num_batched_tokens", "max_num_seqs", "lpm_max_wait_steps"):
            object.__setattr__(self, name, check_int(name, getattr(self, name), low=1))
        if self.schedule_policy not in SCHEDULE_POLICIES:
            raise ValueError(
                f"schedule_policy must be one of {SCHEDULE_POLICIES}, got {self.schedule_policy!r}"
            )
        wait = check_bool("wait_for_shared_prefill", self.wait_for_shared_prefill)
        object.__setattr__(self, "wait_for_shared_prefill", wait)


class PrefixReader(Protocol):
    """Says how much of a request's matched prefix it will read from the cache."""

    def usable_blocks(self, request: Request, num_blocks: int) -> int:
        """How many of the ``num_blocks`` blocks just matched for ``request`` (in position
        order) it reads, from the first: the rest it computes itself. At most ``num_blocks``."""
        ...


class ReadWholePrefix:
    """Every request reads its whole matched prefix (the default)."""

    def usable_blocks(self, request: Request, num_blocks: int) -> int:
        return num_blocks


@dataclass(frozen=True)
class ScheduledSeq:
    """One request's share of a step: positions ``[start, start + num_new_tokens)``."""

    request: Request
    start: int
    num_new_tokens: int

    @property
    def stop(self) -> int:
        return self.start + self.num_new_tokens

    @property
    def samples(self) -> bool:
        """True when this step reaches the request's last token, so its logits pick the next."""
        return self.stop == self.request.num_tokens


@dataclass
class SchedulerOutput:
    """What one step runs, in batch order, and what scheduling it cost."""

    seqs: list[ScheduledSeq] = field(default_factory=list)
    num_preempted: int = 0
    num_evicted_blocks: int = 0

    @property
    def num_tokens(self) -> int:
        return sum(s.num_new_tokens for s in self.seqs)

    def __bool__(self) -> bool:
        return bool(self.seqs)


class Scheduler:
    """Admits, batches, preempts and finishes requests; their blocks live in ``kv_manager``.

    Ownership: a running request's blocks are held in ``kv_manager`` under its
    ``request_id``; the scheduler frees them on finish or preemption. Finished
    requests hold none, and waiting requests none but the held one (the module
    docstring): exactly its matched prefix, given back when it is admitted,
    finished, or a running request needs the blocks. Not thread-safe: one
    thread drives ``schedule`` / ``postprocess``.
    """

    def __init__(
        self,
        kv_manager: KVCacheManager,
        config: SchedulerConfig | None = None,
        clock: Callable[[], float] = time.perf_counter,
        prefix_reader: PrefixReader | None = None,
    ) -> None:
        if not isinstance(kv_manager, KVCacheManager):
            raise TypeError(f"kv_manager must be a KVCacheManager, got {type(kv_manager).__name__}")
        self.kv_manager = kv_manager
        self.config = config or SchedulerConfig()
        self.clock = clock
        self.prefix_reader: PrefixReader = prefix_reader or ReadWholePrefix()
        """Asked, at each lookup, how much of the matched prefix the request reads."""
        self.block_size = kv_manager.block_size
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []  # admission order: the last is preempted first
        self._unfinished: dict[int, Request] = {}  # waiting and running, by id
        # The waiting request that keeps its matched prefix (at most one; it goes first).
        self._held: Request | None = None
        # The step at which each waiting request (re-)entered the queue (lpm's aging).
        self._queued_at: dict[int, int] = {}
        self.num_steps = 0
        """Calls of :meth:`schedule` so far."""
        self.num_preemptions = 0
        self.num_evicted_blocks = 0

    @property
    def allocator(self) -> BlockAllocator:
        return self.kv_manager.allocator

    @property
    def cache(self) -> PrefixCache:
        return self.kv_manager.cache

    # ------------------------------------------------------------ requests
    def add_request(self, request: Request) -> None:
        """Queue ``request``; ``ValueError`` (nothing queued) if it could never fit the pool.

        A request fits when its prompt plus ``max_new_tokens - 1`` tokens (the
        last output token never needs K/V) fit in all of the pool's blocks.
        """
        self.validate(request)
        self.waiting.append(request)
        self._unfinished[request.request_id] = request
        self._queued_at[request.request_id] = self.num_steps

    def get(self, request_id: int) -> Request | None:
        """The waiting or running request with this id; None if unknown or finished."""
        return self._unfinished.get(request_id)

    def finish(self, request: Request, reason: FinishReason, error: str | None = None) -> None:
        """End a waiting or running ``request`` now (an abort, a failed step).

        A running request's blocks go back to the pool; for any reason but
        ``ERROR`` its computed full blocks are offered to the cache first (after
        a failure nothing it holds is trusted). Sets ``finish_reason``,
        ``error`` and ``finish_time``. The held request gives back its matched
        prefix. ``ValueError`` if ``request`` is not waiting or running here,
        before any change. Complexity: O(queue length) to unlink it, plus the
        manager's ``free``.
        """
        if self._unfinished.get(request.request_id) is not request:
            raise ValueError(f"request {request.request_id} is not waiting or running here")
        if request.status is RequestStatus.RUNNING:
            self.kv_manager.free(request.request_id, cache=reason is not FinishReason.ERROR)
            self.running.remove(request)
        else:
            if request is self._held:
                self._release_held()
            self.waiting.remove(request)
            del self._queued_at[request.request_id]
        del self._unfinished[request.request_id]
        request.status = RequestStatus.FINISHED
        request.finish_reason = reason
        request.error = error
        request.finish_time = self.clock()

    def validate(self, request: Request) -> None:
        """``ValueError`` if ``request`` was scheduled before or could never fit the pool."""
        if request.status is not RequestStatus.WAITING or request.request_id in self.kv_manager:
            raise ValueError(f"request {request.request_id} was already scheduled")
        need = self.kv_manager.num_blocks_for(request.max_kv_tokens)
        if need > self.allocator.num_blocks:
            raise ValueError(
                f"request {request.request_id} needs {need} blocks ({request.prompt_len} prompt "
                f"+ {request.params.max_new_tokens} new tokens at block_size {self.block_size}) "
                f"but the whole pool has {self.allocator.num_blocks}"
            )

    def has_unfinished(self) -> bool:
        return bool(self.waiting or self.running)

    # ------------------------------------------------------------ schedule
    def schedule(self) -> SchedulerOutput:
        """Pick this step's tokens, allocating blocks for them (evicting / preempting if short).

        Mutates the queues and, through ``kv_manager``, the block tables and the
        allocator; touches no tensor. Each admission attempt looks a request's
        prefix up once (the held request's is kept); a request that finds too
        few blocks becomes the held one and ends the step's admissions.
        Complexity: O(running + admitted) manager calls, plus O(waiting) to
        order the queue and, under ``lpm``, O(waiting) peeks.
        """
        self.num_steps += 1
        out = SchedulerOutput()
        evicted_before = self.kv_manager.num_evicted_blocks
        budget = self.config.max_num_batched_tokens
        i = 0
        while i < len(self.running) and budget > 0:
            req = self.running[i]
            n = min(req.num_tokens - req.num_computed_tokens, budget)
            if not self._allocate(req, req.num_computed_tokens + n, keep=i, out=out):
                continue  # req itself was preempted; running[i] is now the next one
            out.seqs.append(ScheduledSeq(req, req.num_computed_tokens, n))
            budget -= n
            i += 1
        if out.num_preempted == 0 and budget > 0:
            self._admit(out, budget)
        out.num_evicted_blocks = self.kv_manager.num_evicted_blocks - evicted_before
        self.num_evicted_blocks += out.num_evicted_blocks
        return out

    def _allocate(self, req: Request, num_tokens: int, keep: int, out: SchedulerOutput) -> bool:
        """Blocks for ``num_tokens`` of ``req``, preempting running requests after index ``keep``.

        The held request's prefix goes back first: it has computed nothing.
        Returns False if it had to preempt ``running[keep]`` (``req``) itself.
        """
        while not self.kv_manager.allocate_slots(req.request_id, num_tokens):
            if self._held is not None:
                self._release_held()
                continue
            victim = len(self.running) - 1
            self._preempt(self.running[victim], out)
            if victim == keep:
                return False
        return True

    def _preempt(self, req: Request, out: SchedulerOutput) -> None:
        """Free ``req``'s blocks (computed ones offered to the cache first); requeue it."""
        self.kv_manager.free(req.request_id)
        req.num_computed_tokens = 0
        req.status = RequestStatus.WAITING
        req.num_preemptions += 1
        self.running.remove(req)
        self.waiting.appendleft(req)
        self._queued_at[req.request_id] = self.num_steps
        out.num_preempted += 1
        self.num_preemptions += 1

    def _admit(self, out: SchedulerOutput, budget: int) -> None:
        """Move waiting requests to running while budget, sequence slots and blocks last.

        Admission never preempts, and stops at the first request that does not
        fit. One that cannot fit by the pool's counts (``may_allocate``, with
        its cached prefix peeked) is not looked up; one that is looked up and
        still finds too few blocks keeps its matched prefix (the held request).
        """
        cfg, manager, bs = self.config, self.kv_manager, self.block_size
        admitted: set[int] = set()
        for req in self._admission_order():
            if budget <= 0 or len(self.running) >= cfg.max_num_seqs:
                break
            if req is self._held:
                cached = len(manager.block_table(req.request_id)) * bs
            elif self._waits_for_prefill(req):
                continue
            else:
                peeked = manager.num_cached_tokens(req.tokens, req.namespace)
                stop = min(req.num_tokens, peeked + budget)
                if not manager.may_allocate(manager.num_blocks_for(stop) - peeked // bs):
                    break
                cached = manager.match_prefix(req.request_id, req.tokens, req.namespace)
                usable = self.prefix_reader.usable_blocks(req, cached // bs)
                if usable * bs < cached:
                    manager.trim(req.request_id, usable)
                    cached = usable * bs
            n = min(req.num_tokens - cached, budget)
            if not manager.allocate_slots(req.request_id, cached + n):
                self._held = req
                break
            self._held = None
            del self._queued_at[req.request_id]
            req.num_computed_tokens = cached
            req.prefill_end = req.num_tokens
            if req.cached_tokens < 0:
                req.cached_tokens = cached
            req.status = RequestStatus.RUNNING
            self.running.append(req)
            admitted.add(req.request_id)
            out.seqs.append(ScheduledSeq(req, cached, n))
            budget -= n
        if admitted:
            self.waiting = deque(r for r in self.waiting if r.request_id not in admitted)

    def _admission_order(self) -> list[Request]:
        """Waiting requests in the order the policy admits them (no side effect on the cache).

        The held request first; then, under ``lpm``, requests that have waited
        ``lpm_max_wait_steps`` steps in queue order, then the rest by cached prefix.
        """
        held = self._held
        waiting = [r for r in self.waiting if r is not held]
        if self.config.schedule_policy == "lpm" and 1 < len(waiting) <= LPM_MAX_QUEUE:
            waiting = self._lpm_order(waiting)
        return waiting if held is None else [held, *waiting]

    def _lpm_order(self, waiting: list[Request]) -> list[Request]:
        """``waiting`` by cached prefix (arrival order among equals), overdue requests first."""
        due = self.num_steps - self.config.lpm_max_wait_steps
        queued_at = self._queued_at
        overdue = [r for r in waiting if queued_at[r.request_id] <= due]
        rest = [r for r in waiting if queued_at[r.request_id] > due]
        peek = self.kv_manager.num_cached_tokens
        cached = [peek(req.tokens, req.namespace) for req in rest]
        order = sorted(range(len(rest)), key=lambda k: -cached[k])  # stable: arrival ties
        return overdue + [rest[k] for k in order]

    def _release_held(self) -> None:
        """The held request, if any, gives back its matched prefix and waits as any other."""
        if self._held is not None:
            self.kv_manager.free(self._held.request_id)
            self._held = None

    def _waits_for_prefill(self, req: Request) -> bool:
        """True if a running request is prefilling a block-aligned prefix ``req`` shares.

        Admitting ``req`` now would compute those tokens a second time; once
        the running request's chunk lands, its blocks are in the cache.
        """
        if not self.config.wait_for_shared_prefill:
            return False
        bs = self.block_size
        mine = req.tokens[: req.num_tokens - 1]
        for other in self.running:
            if other.num_computed_tokens >= other.prefill_end or other.namespace != req.namespace:
                continue
            done = (other.num_computed_tokens // bs) * bs  # already in the cache
            theirs = other.tokens[: other.prefill_end]
            limit = min(mine.size, theirs.size)
            if limit - done < bs or not (mine[: done + bs] == theirs[: done + bs]).all():
                continue  # they share nothing beyond what is cached already
            return True
        return False

    # --------------------------------------------------------- postprocess
    def postprocess(self, out: SchedulerOutput, next_tokens: Sequence[int | None]) -> list[Request]:
        """Advance every scheduled request after the model ran; return those that finished.

        ``next_tokens[k]`` is the token sampled for ``out.seqs[k]`` when it
        ``samples``, else ignored (None). Each prefill chunk's full blocks enter
        the cache right away, so requests waiting on a shared prefix can match
        it; a finished request's computed tokens (prompt + output but the last)
        are offered to the cache, then its blocks are freed.
        """
        if len(next_tokens) != len(out.seqs):
            raise ValueError(f"need {len(out.seqs)} next tokens, got {len(next_tokens)}")
        now = self.clock()
        manager = self.kv_manager
        finished: list[Request] = []
        for seq, token in zip(out.seqs, next_tokens, strict=True):
            req = seq.request
            if req.num_computed_tokens != seq.start or req.status is not RequestStatus.RUNNING:
                raise RuntimeError(f"request {req.request_id} changed since it was scheduled")
            prefill = max(0, min(seq.stop, req.prefill_end) - seq.start)
            req.num_prefill_tokens += prefill
            req.num_decode_tokens += seq.num_new_tokens - prefill
            req.num_computed_tokens = seq.stop
            if prefill:
                manager.cache_blocks(req.request_id, seq.stop)
            if not seq.samples:
                continue
            if token is None:
                raise ValueError(f"request {req.request_id} reached its last token: need a token")
            req.append_token(int(token))
            manager.append_output_tokens(req.request_id, req.tokens[-1:])  # int32: no conversion
            if req.first_token_time is None:
                req.first_token_time = now
            if req.finish_reason is not None:
                manager.free(req.request_id)
                req.status = RequestStatus.FINISHED
                req.finish_time = now
                self.running.remove(req)
                del self._unfinished[req.request_id]
                finished.append(req)
        return finished

    # ---------------------------------------------------------- invariants
    def check(self) -> None:
        """Verify the bookkeeping; ``InvariantError`` naming the first broken rule.

        Running requests hold blocks covering their computed tokens, and the
        manager keeps their tokens and computed count as they are; waiting
        ones hold none but the held request, which waits holding its matched
        prefix and nothing more; at most ``max_num_seqs`` run; and
        (``kv_manager.check``) every block's refcount equals the references
        requests and the cache hold. Complexity: O(num_blocks + held blocks +
        running requests' tokens).
        """
        manager = self.kv_manager
        for req in self.running:
            if req.status is not RequestStatus.RUNNING:
                raise InvariantError(f"{req} is in the running queue")
            if req.request_id not in manager:
                raise InvariantError(f"{req} runs without blocks")
            if len(manager.block_table(req.request_id)) * self.block_size < req.num_computed_tokens:
                raise InvariantError(f"{req}'s blocks do not cover its computed tokens")
            if manager.num_computed_tokens(req.request_id) != req.num_computed_tokens:
                raise InvariantError(f"the manager counts other computed tokens than {req}")
            kept = manager.tokens(req.request_id)
            if kept.shape != req.tokens.shape or not (kept == req.tokens).all():
                raise InvariantError(f"the manager keeps other tokens than {req}'s")
        for req in self.waiting:
            if req.status is not RequestStatus.WAITING:
                raise InvariantError(f"{req} is in the waiting queue")
            if req.num_computed_tokens or (req.request_id in manager and req is not self._held):
                raise InvariantError(f"{req} waits while holding blocks")
        held = self._held
        if held is not None:
            if held.status is not RequestStatus.WAITING or held not in self.waiting:
                raise InvariantError(f"held {held} is not waiting")
            if held.request_id not in manager:
                raise InvariantError(f"held {held} holds no matched prefix")
            if len(manager.block_table(held.request_id)) * self.block_size >= held.num_tokens:
                raise InvariantError(f"held {held} holds more than a matched prefix")
        if len(self.running) > self.config.max_num_seqs:
            raise InvariantError("more requests run than max_num_seqs")
        if manager.num_requests != len(self.running) + (held is not None):
            raise InvariantError(
                f"the manager holds {manager.num_requests} requests; {len(self.running)} run and "
                f"{int(held is not None)} is held"
            )
        if len(self._unfinished) != len(self.running) + len(self.waiting) or any(
            self._unfinished.get(r.request_id) is not r for r in (*self.running, *self.waiting)
        ):
            raise InvariantError("the id index does not match the waiting and running queues")
        if self._queued_at.keys() != {r.request_id for r in self.waiting}:
            raise InvariantError("the queue times do not match the waiting queue")
        manager.check()
