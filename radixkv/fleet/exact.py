"""ExactIndex: which prefixes each replica holds, from its own KV events.

Fed each replica's ``BlockStored``, ``BlockRemoved`` and ``AllBlocksCleared``,
it holds exactly what the replica reported, plus *speculative* entries for the
requests routed there: from the decision until the request finishes or is
aborted (``release``); the replica's events make them real meanwhile. A
safety net, derived from the requests' observed lifetimes and order, ends a
request whose ``release`` was lost. Times come from an injectable clock; an explicit ``now``
must never go back. Not thread-safe.
"""

from __future__ import annotations

import math
import time
from collections import deque
from collections.abc import Hashable, Sequence
from dataclasses import dataclass

from radixkv.cache.events import (
    MEDIUM,
    AllBlocksCleared,
    BlockRemoved,
    BlockStored,
    KVCacheEvent,
)
from radixkv.checks import check_int, check_number
from radixkv.errors import invariant
from radixkv.fleet.index_base import Clock, _Clocked, _sizeof

__all__ = ["ExactIndex"]

_FREE: Hashable = object()  # an unused bit slot
_DEVICE_MEDIA = (MEDIUM, None)  # None: a vLLM that names no medium means the device


@dataclass(eq=False)
class _Ticket:
    """One routed request's claim on a replica: its hashes, since ``time``; ``mark`` is the
    replica's count of speculative blocks routed there, its own included."""

    replica_id: Hashable
    owner: Hashable
    hashes: list[int]
    time: float
    mark: int = 0


class ExactIndex(_Clocked):
    """Which blocks each replica holds, from its KV events, plus speculative entries.

    ``apply(r, events)`` replays replica ``r``'s events in order: a
    ``BlockStored`` adds its ``block_hashes``, a ``BlockRemoved`` removes its
    hashes, ``AllBlocksCleared`` empties the replica. The hashes are wire ints
    (``ChainHasher.wire``), so requests must be hashed with the replicas'
    recipe and seed (:func:`~radixkv.cache.hashing.chain_hashes`). Parent hashes are not needed: a
    request's chain is walked from its first block and stops at the first
    miss. The index tracks the device tier: events whose ``medium`` is
    neither ``"GPU"`` nor None are skipped (``"CPU"``, a replica's host tier,
    ``radixkv.cache.host``; ``"STORAGE"``, its store tier), so a host copy or
    a stored block neither adds a block nor keeps one the device dropped.

    Real entries live in a table ``hash -> bit mask of the replicas holding
    it`` (a bit slot per replica, reused after ``drop_replica``), so a match
    costs one lookup per matched block however many replicas share the
    prefix; for up to 8 replicas every mask is one of CPython's shared small
    ints. Events, which keep the table, arrive off the routing path.

    **Speculation follows the request.** ``speculate(r, hashes, owner)``
    records that request ``owner`` was routed to ``r``: it *claims* its
    hashes there (a set of live tickets per hash). A claimed hash the replica
    has not reported is speculative: it counts in ``match`` as held, since the
    replica will compute it before it serves anything queued behind. A
    ``BlockStored`` makes the hash real (the claim is then redundant); a
    ``BlockRemoved`` of a claimed hash leaves it speculative, since a request
    still queued there will compute it again. What a claim is worth in a
    match follows what the replica can still hold: once ``capacity`` more
    speculative blocks were routed there after its newest claimant
    (``set_capacity``; unknown: no bound), first-come admission will have
    evicted it before a request routed now runs, so the match stops there
    (the claim itself stays). A claim ends when
    ``release(r, owner)`` says the request finished or was aborted (what was
    not reported goes; real hashes stay), or when ``AllBlocksCleared`` voids
    what the index knew of ``r``.

    **The safety net** against a ``release`` that never comes. With
    ``spec_ttl=None`` (the default) a ticket is presumed lost when it is
    older than ``spec_ttl_factor`` times the longest decision-to-release
    time observed so far (no bound until one above 0 is) *and* a request
    routed to the same replica after it has already been released: replicas
    admit first come, first served, so its prefill has run and its blocks
    were reported (its claims add nothing any more). The bound follows the
    queueing the fleet shows; the second condition keeps a request that
    merely queues longer than anything before it (a burst, a prompt that
    waits for the whole pool) from losing its claims. A number fixes a plain
    time bound instead (any ticket older than ``spec_ttl`` goes).
    ``safety_expired`` counts what the net dropped (0 while nothing is lost).

    Invariants (:meth:`check`): the table is exactly the transpose of the real
    sets; every claim names live tickets of its replica that hold the hash;
    every live ticket is filed under its (replica, owner) and in the expiry
    queue, and none presumed lost has outlived the bound.
    """

    def __init__(
        self,
        *,
        spec_ttl: float | None = None,
        spec_ttl_factor: float = 4.0,
        block_size: int | None = None,
        clock: Clock = time.monotonic,
    ) -> None:
        super().__init__(clock)
        self.spec_ttl = check_number(
            "spec_ttl", spec_ttl, low=0, strict=True, finite=False, optional=True
        )
        self.spec_ttl_factor = check_number(
            "spec_ttl_factor", spec_ttl_factor, low=0, strict=True, finite=False
        )
        self.block_size = check_int("block_size", block_size, low=1, optional=True)
        self._table: dict[int, int] = {}
        self._slot: dict[Hashable, int] = {}
        self._ids: list[Hashable] = []  # replica id by slot, _FREE where unused
        self._free: list[int] = []
        self._real: dict[Hashable, set[int]] = {}
        # replica -> hash -> its claiming ticket, or its tickets oldest first (a dict kept in
        # ticket order) once a second request claims it: one int per hash in the common case
        self._claims: dict[Hashable, dict[int, int | dict[int, None]]] = {}
        self._routed: dict[Hashable, int] = {}  # replica -> speculative blocks routed there
        self._capacity: dict[Hashable, int] = {}  # replica -> its pool in blocks (0: unknown)
        self._tickets: dict[int, _Ticket] = {}
        self._owned: dict[tuple[Hashable, Hashable], list[int]] = {}  # (replica, owner) -> tickets
        self._order: deque[tuple[float, int]] = deque()  # (time, ticket), oldest first
        self._next_ticket = 0
        self._max_life = -math.inf
        self._done_upto: dict[Hashable, int] = {}  # replica -> newest ticket released there
        self.safety_expired = 0

    # ------------------------------------------------------------ reading
    def blocks(self, replica_id: Hashable) -> set[int]:
        """A copy of the real (event-reported) hashes ``replica_id`` holds; empty if unknown."""
        return set(self._real.get(replica_id, ()))

    def num_blocks(self, replica_id: Hashable) -> int:
        """How many real hashes ``replica_id`` holds (0 if unknown). O(1)."""
        real = self._real.get(replica_id)
        return 0 if real is None else len(real)

    def speculative(self, replica_id: Hashable, now: float | None = None) -> set[int]:
        """The hashes claimed on ``replica_id`` and not (yet) reported by it, at ``now``."""
        self.expire(now)
        claims = self._claims.get(replica_id, {})
        return set(claims).difference(self._real.get(replica_id, ()))

    def num_speculating(self, replica_id: Hashable | None = None) -> int:
        """Live requests with a claim (on ``replica_id``, or anywhere). O(live tickets)."""
        if replica_id is None:
            return len(self._tickets)
        return sum(t.replica_id == replica_id for t in self._tickets.values())

    @property
    def ttl_now(self) -> float:
        """The safety net's current bound in seconds (inf: no lifetime above 0 observed yet)."""
        if self.spec_ttl is not None:
            return self.spec_ttl
        return self.spec_ttl_factor * self._max_life if self._max_life > 0 else math.inf

    def replicas(self) -> list[Hashable]:
        """Every replica the index knows (from events or speculation), in slot order."""
        return [r for r in self._ids if r is not _FREE]

    def _bit(self, replica_id: Hashable) -> int:
        slot = self._slot.get(replica_id)
        if slot is None:
            if self._free:
                slot = self._free.pop()
                self._ids[slot] = replica_id
            else:
                slot = len(self._ids)
                self._ids.append(replica_id)
            self._slot[replica_id] = slot
            self._real[replica_id] = set()
        return 1 << slot

    # ------------------------------------------------------------ events
    def apply(self, replica_id: Hashable, events: Sequence[KVCacheEvent]) -> None:
        """Apply ``replica_id``'s events, oldest first.

        A ``BlockStored`` makes its hashes real (claims on them stay until
        their requests end). An ``AllBlocksCleared`` empties the replica,
        claims included, where it
        stands in the batch: the events after it apply to the emptied replica
        (a cache reset followed by inserts before the next ``take_events``,
        or vLLM's ``reset_prefix_cache``, gives such a batch).

        ``TypeError`` naming the event for anything but the three event types;
        ``ValueError`` naming ``block_size`` for a ``BlockStored`` of another
        block size than the index's (its hashes could never match). Events
        before the bad one stay applied. Complexity: O(hashes in the events).
        """
        table = self._table
        get = table.get
        bit = self._bit(replica_id)
        clear = ~bit
        real = self._real[replica_id]
        for ev in events:
            if getattr(ev, "medium", None) not in _DEVICE_MEDIA:
                continue  # the device tier only: a host copy or a stored block is no device hit
            if isinstance(ev, BlockStored):
                if self.block_size is not None and ev.block_size != self.block_size:
                    raise ValueError(
                        f"block_size must be {self.block_size} in replica {replica_id!r}'s "
                        f"BlockStored events, got {ev.block_size}"
                    )
                for h in ev.block_hashes:
                    if h not in real:
                        real.add(h)
                        table[h] = get(h, 0) | bit
            elif isinstance(ev, BlockRemoved):
                for h in ev.block_hashes:
                    if h in real:
                        real.discard(h)
                        mask = table[h] & clear
                        if mask:
                            table[h] = mask
                        else:
                            del table[h]
            elif isinstance(ev, AllBlocksCleared):
                self.reset_replica(replica_id)
            else:
                raise TypeError(f"events must be KV cache events, got {ev!r}")
        if not self._claims.get(replica_id, True):
            del self._claims[replica_id]

    # ------------------------------------------------------------ speculation
    def speculate(
        self, replica_id: Hashable, hashes: Sequence[int], owner: Hashable, now: float | None = None
    ) -> int:
        """Request ``owner`` was routed to ``replica_id``: claim its ``hashes`` there until
        :meth:`release` (or the safety net) ends the request.

        The same (replica, owner) may speculate again (a retry): each call is
        its own ticket, released oldest first. Returns how many hashes became
        speculative (neither real nor claimed there before).
        Complexity: O(len(hashes)), plus expiry.
        """
        now = self._tick(now)
        self.expire(now)
        self._bit(replica_id)
        real = self._real[replica_id]
        ticket = self._next_ticket
        self._next_ticket += 1
        hashes = list(hashes)
        self._tickets[ticket] = _Ticket(replica_id, owner, hashes, now)
        self._owned.setdefault((replica_id, owner), []).append(ticket)
        self._order.append((now, ticket))
        if not hashes:
            return 0
        claims = self._claims.get(replica_id)
        if claims is None:
            claims = self._claims[replica_id] = {}
        new = set(hashes)
        for h in new & claims.keys():  # claimed before: this ticket joins
            held = claims[h]
            if type(held) is int:
                claims[h] = {held: None, ticket: None}
            else:
                held[ticket] = None  # type: ignore[index]
            new.discard(h)
        claims.update(dict.fromkeys(new, ticket))
        fresh = len(new) - len(new & real)
        routed = self._routed[replica_id] = self._routed.get(replica_id, 0) + fresh
        self._tickets[ticket].mark = routed
        return fresh

    def set_capacity(self, replica_id: Hashable, capacity_blocks: int) -> None:
        """``replica_id``'s pool in blocks (0: unknown, no bound), for :meth:`match`'s bound on
        claims. ``ValueError`` naming ``capacity_blocks`` unless a non-negative int. O(1)."""
        c = capacity_blocks
        if type(c) is not int or c < 0:  # per decision: the common case costs no call
            c = check_int("capacity_blocks", c, low=0)
        self._capacity[replica_id] = c

    def release(self, replica_id: Hashable, owner: Hashable, now: float | None = None) -> int:
        """Request ``owner`` on ``replica_id`` finished or was aborted: its oldest ticket there
        ends, and its claims with it. Returns how many hashes stopped being speculative;
        0 for a request not speculating there. Its lifetime feeds the safety net's bound.
        Complexity: O(its hashes), plus expiry.
        """
        now = self._tick(now)
        tickets = self._owned.get((replica_id, owner))
        if not tickets:
            self.expire(now)
            return 0
        ticket = tickets[0]
        life = now - self._tickets[ticket].time
        if life > self._max_life:
            self._max_life = life
        if ticket > self._done_upto.get(replica_id, -1):
            self._done_upto[replica_id] = ticket
        dropped = self._end(ticket)
        self.expire(now)
        return dropped

    def expire(self, now: float | None = None) -> int:
        """The safety net: end the tickets presumed lost (see the class docstring); how many.

        Complexity: O(1) when no ticket is older than the bound, else
        O(tickets older than it).
        """
        now = self._tick(now)
        order, tickets = self._order, self._tickets
        while order and order[0][1] not in tickets:
            order.popleft()  # released already
        if not order:
            return 0
        cutoff = now - self.ttl_now
        if order[0][0] > cutoff:
            return 0
        fixed = self.spec_ttl is not None
        done = self._done_upto
        kept: list[tuple[float, int]] = []
        ended = 0
        while order and order[0][0] <= cutoff:
            item = order.popleft()
            t = tickets.get(item[1])
            if t is None:
                continue
            if fixed or done.get(t.replica_id, -1) > item[1]:
                self._end(item[1])
                ended += 1
            else:
                kept.append(item)  # still ahead of everything after it there: not lost
        order.extendleft(reversed(kept))
        self.safety_expired += ended
        return ended

    def _end(self, ticket: int) -> int:
        """Drop ``ticket``'s claims and file; how many hashes stopped being speculative."""
        t = self._tickets.pop(ticket)
        key = (t.replica_id, t.owner)
        owned = self._owned[key]
        owned.remove(ticket)
        if not owned:
            del self._owned[key]
        claims = self._claims.get(t.replica_id)
        if not claims:
            return 0
        real = self._real[t.replica_id]
        dropped = 0
        for h in t.hashes:
            held = claims.get(h)
            if held is None:
                continue
            if type(held) is int:
                if held != ticket:
                    continue
            else:
                held.pop(ticket, None)  # type: ignore[union-attr]
                if held:
                    continue
            del claims[h]
            dropped += h not in real
        if not claims:
            del self._claims[t.replica_id]
        return dropped

    def match(self, hashes: Sequence[int], now: float | None = None) -> dict[Hashable, int]:
        """Per replica, how many leading ``hashes`` it holds, really or speculatively at ``now``
        (replicas with 0 left out).

        Complexity: O(matched real blocks) through the table, plus per replica
        with claims one lookup and its speculative run, plus expiry.
        """
        self.expire(now)
        out: dict[Hashable, int] = {}
        n = len(hashes)
        if n == 0:
            return out
        get = self._table.get
        alive = get(hashes[0], 0)
        if alive:
            ids = self._ids
            for i in range(1, n + 1):
                mask = get(hashes[i], 0) & alive if i < n else 0
                if mask != alive:
                    gone = alive ^ mask
                    while gone:
                        low = gone & -gone
                        out[ids[low.bit_length() - 1]] = i
                        gone ^= low
                    if not mask:
                        break
                    alive = mask
        tickets = self._tickets
        for replica_id, claims in self._claims.items():
            k = out.get(replica_id, 0)
            if k >= n or hashes[k] not in claims:
                continue
            real = self._real[replica_id]
            cap = self._capacity.get(replica_id, 0)
            # A claim counts while fewer than `cap` speculative blocks were routed there after
            # its newest claimant: more, and first-come admission evicts it before we run.
            floor = self._routed.get(replica_id, 0) - cap if cap else -1
            start = k
            while k < n:
                h = hashes[k]
                if h not in real:
                    held = claims.get(h)
                    if held is None:
                        break
                    newest = held if type(held) is int else next(reversed(held))  # type: ignore[arg-type]
                    if tickets[newest].mark <= floor:
                        break
                k += 1
            if k > start:
                out[replica_id] = k
        return out

    # ------------------------------------------------------------ replicas
    def reset_replica(self, replica_id: Hashable) -> None:
        """Empty ``replica_id`` (its cache was cleared, or its event stream had a gap), its
        claims included, but keep knowing it and its requests' tickets (their ``release``
        still comes). Complexity: O(its entries)."""
        self._claims.pop(replica_id, None)
        slot = self._slot.get(replica_id)
        if slot is None:
            return
        table = self._table
        clear = ~(1 << slot)
        real = self._real[replica_id]
        for h in real:
            mask = table[h] & clear
            if mask:
                table[h] = mask
            else:
                del table[h]
        # Emptied in place, not replaced: ``apply`` holds this set across an
        # ``AllBlocksCleared`` and goes on adding the batch's later blocks to it.
        real.clear()

    def drop_replica(self, replica_id: Hashable) -> None:
        """Forget ``replica_id``, its tickets, and free its bit slot.
        Complexity: O(its entries + live tickets)."""
        self.reset_replica(replica_id)
        self._done_upto.pop(replica_id, None)
        self._routed.pop(replica_id, None)
        self._capacity.pop(replica_id, None)
        for key in [k for k in self._owned if k[0] == replica_id]:
            for ticket in self._owned.pop(key):
                del self._tickets[ticket]
        slot = self._slot.pop(replica_id, None)
        if slot is not None:
            del self._real[replica_id]
            self._ids[slot] = _FREE
            self._free.append(slot)

    # ------------------------------------------------------------ checks
    def check(self) -> None:
        """Raise ``InvariantError`` naming the first broken invariant. Complexity: O(entries)."""
        for r, slot in self._slot.items():
            invariant(
                self._ids[slot] == r, f"slot {slot} of replica {r!r} names {self._ids[slot]!r}"
            )
        used = len(self._ids) - len(self._free)
        invariant(used == len(self._slot), f"{used} slots in use for {len(self._slot)} replicas")
        invariant(self._real.keys() == self._slot.keys(), "real sets and slots name other replicas")
        total = 0
        for r, real in self._real.items():
            bit = 1 << self._slot[r]
            for h in real:
                invariant(
                    self._table.get(h, 0) & bit, f"hash {h} of replica {r!r} not in the table"
                )
            total += len(real)
        live = sum(1 << s for s in self._slot.values())
        bits = 0
        for h, mask in self._table.items():
            invariant(mask > 0, f"hash {h} has mask {mask} (empty entries must be deleted)")
            invariant(not mask & ~live, f"hash {h} has mask {mask:#x} naming a free slot")
            bits += mask.bit_count()
        invariant(bits == total, f"the table holds {bits} (hash, replica) pairs, real sets {total}")
        holds = {k: set(t.hashes) for k, t in self._tickets.items()}
        for r, claims in self._claims.items():
            invariant(claims, f"replica {r!r} has an empty claim map (should be removed)")
            invariant(r in self._slot, f"replica {r!r} has claims but no slot")
            for h, held in claims.items():
                tickets = [held] if type(held) is int else list(held)  # type: ignore[arg-type]
                invariant(tickets, f"hash {h} on {r!r} has an empty claim (should be removed)")
                invariant(
                    tickets == sorted(tickets), f"hash {h} on {r!r}: claims out of ticket order"
                )
                for k in tickets:
                    t = self._tickets.get(k)
                    invariant(t is not None, f"hash {h} on {r!r} is claimed by ended ticket {k}")
                    invariant(t.replica_id == r, f"ticket {k} of {t.replica_id!r} claims on {r!r}")
                    invariant(h in holds[k], f"ticket {k} claims hash {h} it does not hold")
        filed = [k for tickets in self._owned.values() for k in tickets]
        invariant(sorted(filed) == sorted(self._tickets), "live tickets and their filing disagree")
        for (r, owner), tickets in self._owned.items():
            invariant(tickets, f"request {owner!r} on {r!r} has an empty filing")
            for k in tickets:
                t = self._tickets[k]
                invariant((t.replica_id, t.owner) == (r, owner), f"ticket {k} is misfiled")
        queued = {k for _, k in self._order}
        invariant(queued >= self._tickets.keys(), "a live ticket is not queued for expiry")
        times = [t for t, _ in self._order]
        invariant(all(a <= b for a, b in zip(times, times[1:])), "expiry queue out of order")
        cutoff = self._last_now - self.ttl_now
        for k, t in self._tickets.items():
            lost = self.spec_ttl is not None or self._done_upto.get(t.replica_id, -1) > k
            invariant(
                t.time > cutoff or not lost,
                f"ticket {k} outlived the safety bound {self.ttl_now} though presumed lost",
            )

    def memory_bytes(self) -> int:
        """Measured size: ``sys.getsizeof`` of the table, the per-replica sets, claims, tickets
        and the expiry queue, hash ints, each object counted once.

        About 175 bytes per real (hash, replica) entry on 64-bit CPython 3.11
        (a set slot, a table slot, the hash int); the table's masks are shared
        small ints up to 8 replicas. Complexity: O(entries).
        """
        seen: set[int] = set()
        total = _sizeof((self, self._table, self._slot, self._ids, self._free), seen)
        total += _sizeof(self._table.keys(), seen) + _sizeof(self._table.values(), seen)
        total += _sizeof((self._real, self._claims, self._tickets, self._owned, self._order), seen)
        for real in self._real.values():
            total += _sizeof((real,), seen) + _sizeof(real, seen)
        for claims in self._claims.values():
            total += _sizeof((claims,), seen) + _sizeof(claims.keys(), seen)
            total += _sizeof(claims.values(), seen)
        for t in self._tickets.values():
            total += _sizeof((t, t.hashes), seen) + _sizeof(t.hashes, seen)
        for key, tickets in self._owned.items():
            total += _sizeof((key, tickets), seen)
        total += _sizeof(self._order, seen)
        return total
