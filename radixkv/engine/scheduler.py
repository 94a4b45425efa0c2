"""Scheduler: continuous batching over a block allocator and an optional prefix cache.

Bookkeeping only (plain ints and numpy; no tensor here). Each step:

1. ``schedule()`` gives running requests their tokens first, in admission order
   (one decode token, or the next prefill chunk), from a token budget shared by
   the whole batch; blocks are allocated as tokens need them. When the pool is
   short it evicts from the cache, then preempts the most recently admitted
   running request (its blocks go back, it waits again and is recomputed).
   Leftover budget admits waiting requests (``fcfs`` or ``lpm`` order): each
   one matches its longest cached prefix (``cache.match(tokens[:-1])``: the
   last token always runs, for its logits); the matched blocks head its block
   table, so cached positions read their K/V from the matched blocks' slots.
2. The engine runs the model on the scheduled tokens.
3. ``postprocess(output, next_tokens)`` advances each request, appends sampled
   tokens, and on finish hands the computed tokens' blocks to the cache
   (``cache.insert``) before giving back the request's references (``decref``).

Two choices go beyond the minimum, both so that a shared prefix is computed
once when requests arrive together (all users of a system prompt at once):
the match happens at admission, not at submission, and a request whose
block-aligned prefix is being prefilled right now by a running request waits
for it (its blocks enter the cache after every prefill chunk) instead of
computing the same tokens in parallel.
"""

from __future__ import annotations

import time
from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import numpy as np

from radixkv.cache.allocator import BlockAllocator
from radixkv.cache.protocol import PrefixCache
from radixkv.engine.request import Request, RequestStatus

__all__ = ["POLICIES", "ScheduledSeq", "Scheduler", "SchedulerConfig", "SchedulerOutput"]

POLICIES = ("fcfs", "lpm")
# lpm ranks by matching every waiting request; beyond this many it falls back to
# fcfs (SGLang does the same) so a long queue does not cost a tree walk per entry.
LPM_MAX_QUEUE = 128


@dataclass(frozen=True)
class SchedulerConfig:
    """Per-step limits and the admission policy.

    - ``max_num_batched_tokens``: token budget of one step, shared by decodes
      and prefill chunks (a longer prompt prefills over several steps).
    - ``max_num_seqs``: most requests running at once.
    - ``policy``: ``"fcfs"`` (arrival order) or ``"lpm"`` (longest cached
      prefix first, arrival order among equals).
    - ``wait_for_shared_prefill``: hold back a request whose prefix a running
      request is prefilling right now (only with a cache).
    """

    max_num_batched_tokens: int = 512
    max_num_seqs: int = 64
    policy: str = "fcfs"
    wait_for_shared_prefill: bool = True

    def __post_init__(self) -> None:
        for name in ("max_num_batched_tokens", "max_num_seqs"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"{name} must be a positive int, got {value!r}")
        if self.policy not in POLICIES:
            raise ValueError(f"policy must be one of {POLICIES}, got {self.policy!r}")


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
    """Admits, batches, preempts and finishes requests over ``allocator`` and ``cache``.

    Ownership: every block in a running request's ``block_table`` carries one
    reference owned by that request; the scheduler gives it back on finish or
    preemption. Waiting and finished requests hold no blocks. ``cache`` is any
    object with the :class:`~radixkv.cache.protocol.PrefixCache` surface over the
    same allocator, or None (no caching).
    """

    def __init__(
        self,
        allocator: BlockAllocator,
        cache: PrefixCache | None = None,
        config: SchedulerConfig | None = None,
        clock: Callable[[], float] = time.perf_counter,
    ) -> None:
        if not isinstance(allocator, BlockAllocator):
            raise TypeError(f"allocator must be a BlockAllocator, got {type(allocator).__name__}")
        if cache is not None and cache.allocator is not allocator:
            raise ValueError("cache must be built over the scheduler's allocator")
        self.allocator = allocator
        self.cache = cache
        self.config = config or SchedulerConfig()
        self.clock = clock
        self.block_size = allocator.block_size
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []  # admission order: the last is preempted first
        self.num_preemptions = 0
        self.num_evicted_blocks = 0

    # ------------------------------------------------------------ requests
    def add_request(self, request: Request) -> None:
        """Queue ``request``; ``ValueError`` (nothing queued) if it could never fit the pool.

        A request fits when its prompt plus ``max_new_tokens - 1`` tokens (the
        last output token never needs K/V) fit in all of the pool's blocks.
        """
        self.validate(request)
        self.waiting.append(request)

    def validate(self, request: Request) -> None:
        """``ValueError`` if ``request`` was scheduled before or could never fit the pool."""
        if request.status is not RequestStatus.WAITING or request.block_table:
            raise ValueError(f"request {request.request_id} was already scheduled")
        need = -(-request.max_kv_tokens // self.block_size)
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

        Mutates request block tables, the queues and the allocator; touches no
        tensor. Complexity: O(running + waiting * prefix blocks) per step.
        """
        out = SchedulerOutput()
        budget = self.config.max_num_batched_tokens
        i = 0
        while i < len(self.running) and budget > 0:
            req = self.running[i]
            n = min(req.num_tokens - req.num_computed_tokens, budget)
            if not self._reserve(
                req.num_blocks_for(req.num_computed_tokens + n, self.block_size), keep=i, out=out
            ):
                continue  # req itself was preempted; running[i] is now the next one
            self._extend(req, req.num_computed_tokens + n)
            out.seqs.append(ScheduledSeq(req, req.num_computed_tokens, n))
            budget -= n
            i += 1
        if out.num_preempted == 0 and budget > 0:
            self._admit(out, budget)
        return out

    def _reserve(self, need: int, keep: int, out: SchedulerOutput) -> bool:
        """Make ``need`` blocks free: evict, then preempt running requests after index ``keep``.

        Returns False if it had to preempt ``running[keep]`` itself.
        """
        alloc = self.allocator
        while alloc.num_free < need:
            if self._evict(need - alloc.num_free, out):
                continue
            victim = len(self.running) - 1
            self._preempt(self.running[victim], out)
            if victim == keep:
                return False
        return True

    def _evict(self, num_blocks: int, out: SchedulerOutput) -> int:
        if self.cache is None or self.cache.evictable_blocks == 0:
            return 0
        freed = self.cache.evict(num_blocks)
        out.num_evicted_blocks += freed
        self.num_evicted_blocks += freed
        return freed

    def _preempt(self, req: Request, out: SchedulerOutput) -> None:
        """Give back `req`'s blocks (cached first: recomputing can reuse them); requeue it."""
        self._release(req)
        req.num_computed_tokens = 0
        req.status = RequestStatus.WAITING
        req.num_preemptions += 1
        self.running.remove(req)
        self.waiting.appendleft(req)
        out.num_preempted += 1
        self.num_preemptions += 1

    def _release(self, req: Request) -> None:
        """Offer ``req``'s computed full blocks to the cache, then drop its references."""
        if self.cache is not None and req.num_computed_tokens >= self.block_size:
            self.cache.insert(req.tokens[: req.num_computed_tokens], req.block_table)
        self.allocator.decref(req.block_table)
        req.block_table = []

    def _extend(self, req: Request, num_tokens: int) -> None:
        """Grow ``req``'s block table to cover ``num_tokens`` positions (blocks already free)."""
        need = req.num_blocks_for(num_tokens, self.block_size)
        if need:
            req.block_table.extend(self.allocator.alloc(need))

    def _admit(self, out: SchedulerOutput, budget: int) -> None:
        """Move waiting requests to running while budget, sequence slots and blocks last."""
        cfg = self.config
        candidates = self._admission_order()
        admitted: set[int] = set()
        for req in candidates:
            if budget <= 0 or len(self.running) >= cfg.max_num_seqs:
                break
            if self._waits_for_prefill(req):
                continue
            prefix = req.tokens[: req.num_tokens - 1]
            if self.cache is not None:
                m = self.cache.match(prefix)
                blocks, cached = m.blocks, m.num_tokens
            else:
                blocks, cached = [], 0
            n = min(req.num_tokens - cached, budget)
            need = -(-(cached + n) // self.block_size) - len(blocks)
            if self.allocator.num_free < need:
                self._evict(need - self.allocator.num_free, out)
            if self.allocator.num_free < need:
                if blocks:
                    self.allocator.decref(blocks)
                break  # admission never preempts; try again next step
            req.block_table = blocks + self.allocator.alloc(need)
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
        """Waiting requests in the order the policy admits them."""
        waiting = list(self.waiting)
        if (
            self.config.policy == "fcfs"
            or self.cache is None
            or len(waiting) < 2
            or len(waiting) > LPM_MAX_QUEUE
        ):
            return waiting
        cached = []
        for req in waiting:
            m = self.cache.match(req.tokens[: req.num_tokens - 1])
            if m.blocks:
                self.allocator.decref(m.blocks)  # ranking only: give the references back
            cached.append(m.num_tokens)
        order = sorted(range(len(waiting)), key=lambda k: -cached[k])  # stable: arrival ties
        return [waiting[k] for k in order]

    def _waits_for_prefill(self, req: Request) -> bool:
        """True if a running request is prefilling a block-aligned prefix ``req`` shares.

        Admitting ``req`` now would compute those tokens a second time; once
        the running request's chunk lands, its blocks are in the cache.
        """
        if self.cache is None or not self.config.wait_for_shared_prefill:
            return False
        bs = self.block_size
        mine = req.tokens[: req.num_tokens - 1]
        for other in self.running:
            if other.num_computed_tokens >= other.prefill_end:
                continue
            done = (other.num_computed_tokens // bs) * bs  # already in the cache
            theirs = other.tokens[: other.prefill_end]
            limit = min(mine.size, theirs.size)
            if limit - done < bs or not np.array_equal(mine[: done + bs], theirs[: done + bs]):
                continue  # they share nothing beyond what is cached already
            return True
        return False

    # --------------------------------------------------------- postprocess
    def postprocess(self, out: SchedulerOutput, next_tokens: Sequence[int | None]) -> list[Request]:
        """Advance every scheduled request after the model ran; return those that finished.

        ``next_tokens[k]`` is the token sampled for ``out.seqs[k]`` when it
        ``samples``, else ignored (None). A finished request's computed tokens
        (prompt + output but the last) go to the cache with their blocks, then
        its references are given back. Prefill progress also enters the cache
        right away, so requests waiting on a shared prefix can match it.
        """
        if len(next_tokens) != len(out.seqs):
            raise ValueError(f"need {len(out.seqs)} next tokens, got {len(next_tokens)}")
        now = self.clock()
        finished: list[Request] = []
        for seq, token in zip(out.seqs, next_tokens, strict=True):
            req = seq.request
            if req.num_computed_tokens != seq.start or req.status is not RequestStatus.RUNNING:
                raise RuntimeError(f"request {req.request_id} changed since it was scheduled")
            prefill = max(0, min(seq.stop, req.prefill_end) - seq.start)
            req.num_prefill_tokens += prefill
            req.num_decode_tokens += seq.num_new_tokens - prefill
            req.num_computed_tokens = seq.stop
            if prefill and self.cache is not None and seq.stop >= self.block_size:
                self.cache.insert(req.tokens[: seq.stop], req.block_table)
            if not seq.samples:
                continue
            if token is None:
                raise ValueError(f"request {req.request_id} reached its last token: need a token")
            req.append_token(int(token))
            if req.first_token_time is None:
                req.first_token_time = now
            if req.finish_reason is not None:
                self._release(req)
                req.status = RequestStatus.FINISHED
                req.finish_time = now
                self.running.remove(req)
                finished.append(req)
        return finished

    # ---------------------------------------------------------- invariants
    def check(self) -> None:
        """Assert the bookkeeping invariants; ``AssertionError`` naming the first broken.

        Running requests' tables cover their computed tokens and hold
        allocated blocks; waiting requests hold none; each block's refcount is
        at least the number of requests holding it, and exactly that (plus
        nothing) without a cache. Complexity: O(num_blocks + held blocks).
        """
        bs = self.block_size
        held = np.zeros(self.allocator.num_blocks, dtype=np.int64)
        for req in self.running:
            assert req.status is RequestStatus.RUNNING, f"{req} in running"
            assert len(req.block_table) * bs >= req.num_computed_tokens, f"{req} table too short"
            assert len(set(req.block_table)) == len(req.block_table), f"{req} repeats a block"
            np.add.at(held, np.asarray(req.block_table, dtype=np.int64), 1)
        for req in self.waiting:
            assert req.status is RequestStatus.WAITING, f"{req} in waiting"
            assert not req.block_table and req.num_computed_tokens == 0, f"{req} holds blocks"
        assert len(self.running) <= self.config.max_num_seqs, "too many running requests"
        rc = self.allocator.refcounts(np.arange(self.allocator.num_blocks))
        assert (rc >= held).all(), "a request holds a block without a reference"
        if self.cache is None:
            assert (rc == held).all(), "a block is referenced by no request and no cache"
