"""ExactIndex: which prefixes each replica holds, from its own KV events.

Fed each replica's ``BlockStored``, ``BlockRemoved`` and ``AllBlocksCleared``,
it holds exactly what the replica reported, plus short-lived *speculative*
entries for requests just routed there, until the replica's own events
confirm them. Times come from an injectable clock; an explicit ``now`` must
never go back. Not thread-safe.
"""

from __future__ import annotations

import time
from collections import deque
from collections.abc import Hashable, Sequence

from radixkv.cache.allocator import invariant
from radixkv.cache.events import (
    HOST_MEDIUM,
    AllBlocksCleared,
    BlockRemoved,
    BlockStored,
    KVCacheEvent,
)
from radixkv.fleet.index_base import (
    Clock,
    _check_optional_count,
    _check_positive,
    _Clocked,
    _sizeof,
)

__all__ = ["ExactIndex"]

_FREE: Hashable = object()  # an unused bit slot


class ExactIndex(_Clocked):
    """Which blocks each replica holds, from its KV events, plus speculative entries.

    ``apply(r, events)`` replays replica ``r``'s events in order: a
    ``BlockStored`` adds its ``block_hashes``, a ``BlockRemoved`` removes its
    hashes, ``AllBlocksCleared`` empties the replica. The hashes are wire ints
    (``ChainHasher.wire``), so requests must be hashed with the replicas'
    recipe and seed (:func:`~radixkv.fleet.chain.chain_hashes`). Parent hashes are not needed: a
    request's chain is walked from its first block and stops at the first
    miss. The index tracks the device tier: events whose ``medium`` is
    ``"CPU"`` (a replica's host tier, ``radixkv.cache.host``) are skipped, so
    a host copy neither adds a block nor keeps one the device dropped.

    Real entries live in a table ``hash -> bit mask of the replicas holding
    it`` (a bit slot per replica, reused after ``drop_replica``), so a match
    costs one lookup per matched block however many replicas share the
    prefix; for up to 8 replicas every mask is one of CPython's shared small
    ints. Events, which keep the table, arrive off the routing path.

    ``speculate(r, hashes)`` enters a just-routed request's hashes for ``r``
    until ``now + spec_ttl``: the replica has not computed them yet, but the
    next request with that prefix should follow this one. A ``BlockStored``
    for such a hash makes it real, a ``BlockRemoved`` removes it, expiry drops
    it. Speculative entries sit per replica (hash -> deadline) beside the
    table, expired in batches (one per ``speculate``), so speculating costs two
    dict operations per new block. ``blocks(r)`` is the real hashes only.

    Invariants (:meth:`check`): the table is exactly the transpose of the real
    sets; each replica's real and speculative hashes are disjoint; every
    speculative entry is alive and queued for expiry at its deadline.
    """

    def __init__(
        self,
        *,
        spec_ttl: float = 2.0,
        block_size: int | None = None,
        clock: Clock = time.monotonic,
    ) -> None:
        super().__init__(clock)
        self.spec_ttl = _check_positive("spec_ttl", spec_ttl)
        self.block_size = _check_optional_count("block_size", block_size)
        self._table: dict[int, int] = {}
        self._slot: dict[Hashable, int] = {}
        self._ids: list[Hashable] = []  # replica id by slot, _FREE where unused
        self._free: list[int] = []
        self._real: dict[Hashable, set[int]] = {}
        self._spec: dict[Hashable, dict[int, float]] = {}
        # (deadline, replica, hashes) per speculate call, in deadline order; an entry whose
        # deadline moved on (re-speculated) or that turned real is skipped when its batch expires.
        self._batches: deque[tuple[float, Hashable, list[int]]] = deque()

    def blocks(self, replica_id: Hashable) -> set[int]:
        """A copy of the real (event-reported) hashes ``replica_id`` holds; empty if unknown."""
        return set(self._real.get(replica_id, ()))

    def speculative(self, replica_id: Hashable, now: float | None = None) -> set[int]:
        """The speculative hashes of ``replica_id`` alive at ``now`` (expiring the rest)."""
        self.expire(now)
        return set(self._spec.get(replica_id, ()))

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

    def apply(self, replica_id: Hashable, events: Sequence[KVCacheEvent]) -> None:
        """Apply ``replica_id``'s events, oldest first.

        An ``AllBlocksCleared`` empties the replica where it stands in the
        batch: the events after it apply to the emptied replica (a cache reset
        followed by inserts before the next ``take_events``, or vLLM's
        ``reset_prefix_cache``, gives such a batch).

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
            if getattr(ev, "medium", None) == HOST_MEDIUM:
                continue  # the device tier only: a host copy is not a device hit
            if isinstance(ev, BlockStored):
                if self.block_size is not None and ev.block_size != self.block_size:
                    raise ValueError(
                        f"block_size must be {self.block_size} in replica {replica_id!r}'s "
                        f"BlockStored events, got {ev.block_size}"
                    )
                spec = self._spec.get(replica_id)
                for h in ev.block_hashes:
                    if h not in real:
                        real.add(h)
                        table[h] = get(h, 0) | bit
                        if spec:
                            spec.pop(h, None)
            elif isinstance(ev, BlockRemoved):
                spec = self._spec.get(replica_id)
                for h in ev.block_hashes:
                    if h in real:
                        real.discard(h)
                        mask = table[h] & clear
                        if mask:
                            table[h] = mask
                        else:
                            del table[h]
                    elif spec:
                        spec.pop(h, None)
            elif isinstance(ev, AllBlocksCleared):
                self.reset_replica(replica_id)
            else:
                raise TypeError(f"events must be KV cache events, got {ev!r}")
        if not self._spec.get(replica_id, True):
            del self._spec[replica_id]

    def speculate(
        self, replica_id: Hashable, hashes: Sequence[int], now: float | None = None
    ) -> int:
        """Enter ``hashes`` for ``replica_id`` until ``now + spec_ttl``, except real ones.

        A hash already speculative there gets the new deadline. Returns how
        many entries were entered or renewed. Complexity: O(len(hashes)).
        """
        now = self._tick(now)
        self.expire(now)
        self._bit(replica_id)
        real = self._real[replica_id]
        fresh = [h for h in hashes if h not in real]
        if not fresh:
            return 0
        deadline = now + self.spec_ttl
        spec = self._spec.get(replica_id)
        if spec is None:
            spec = self._spec[replica_id] = {}
        spec.update(dict.fromkeys(fresh, deadline))
        self._batches.append((deadline, replica_id, fresh))
        return len(fresh)

    def expire(self, now: float | None = None) -> int:
        """Drop the speculative entries whose deadline is at or before ``now``; how many.

        Complexity: O(1) when none is due, else O(hashes in the due batches).
        """
        now = self._tick(now)
        batches = self._batches
        dropped = 0
        while batches and batches[0][0] <= now:
            deadline, replica_id, hashes = batches.popleft()
            spec = self._spec.get(replica_id)
            if spec is None:
                continue
            for h in hashes:
                if spec.get(h) == deadline:
                    del spec[h]
                    dropped += 1
            if not spec:
                del self._spec[replica_id]
        return dropped

    def match(self, hashes: Sequence[int], now: float | None = None) -> dict[Hashable, int]:
        """Per replica, how many leading ``hashes`` it holds, really or speculatively at ``now``
        (replicas with 0 left out).

        Complexity: O(matched real blocks) through the table, plus per replica
        with speculative entries one lookup and its speculative run, plus expiry.
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
        for replica_id, spec in self._spec.items():
            k = out.get(replica_id, 0)
            if k < n and hashes[k] in spec:
                real = self._real[replica_id]
                k += 1
                while k < n and (hashes[k] in spec or hashes[k] in real):
                    k += 1
                out[replica_id] = k
        return out

    def reset_replica(self, replica_id: Hashable) -> None:
        """Empty ``replica_id`` (its cache was cleared, or its event stream had a gap) but keep
        knowing it. Complexity: O(its entries)."""
        self._spec.pop(replica_id, None)
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
        """Forget ``replica_id`` and free its bit slot. Complexity: O(its entries)."""
        self.reset_replica(replica_id)
        slot = self._slot.pop(replica_id, None)
        if slot is not None:
            del self._real[replica_id]
            self._ids[slot] = _FREE
            self._free.append(slot)

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
        queued = {(r, h, d) for d, r, hs in self._batches for h in hs}
        deadlines = [d for d, _r, _hs in self._batches]
        invariant(
            all(a <= b for a, b in zip(deadlines, deadlines[1:])),
            "speculation batches are out of deadline order",
        )
        for r, spec in self._spec.items():
            invariant(spec, f"replica {r!r} has an empty speculative map (should be removed)")
            invariant(r in self._slot, f"replica {r!r} has speculative entries but no slot")
            invariant(not (spec.keys() & self._real[r]), f"{r!r} has hashes real and speculative")
            for h, d in spec.items():
                invariant(d > self._last_now, f"speculative {h} on {r!r} outlived its deadline {d}")
                invariant((r, h, d) in queued, f"speculative {h} on {r!r} is queued for no expiry")

    def memory_bytes(self) -> int:
        """Measured size: ``sys.getsizeof`` of the table, the per-replica sets, speculative maps
        and expiry batches, hash ints and deadlines, each object counted once.

        About 175 bytes per real (hash, replica) entry on 64-bit CPython 3.11
        (a set slot, a table slot, the hash int); the table's masks are shared
        small ints up to 8 replicas. Complexity: O(entries).
        """
        seen: set[int] = set()
        total = _sizeof((self, self._table, self._slot, self._ids, self._free), seen)
        total += _sizeof(self._table.keys(), seen) + _sizeof(self._table.values(), seen)
        total += _sizeof((self._real, self._spec, self._batches), seen)
        for real in self._real.values():
            total += _sizeof((real,), seen) + _sizeof(real, seen)
        for spec in self._spec.values():
            total += _sizeof((spec,), seen) + _sizeof(spec.keys(), seen)
            total += _sizeof(spec.values(), seen)
        for batch in self._batches:
            total += _sizeof(batch, seen) + _sizeof(batch[2], seen)
        return total
