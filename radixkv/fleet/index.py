"""What a router knows of each replica's prefix cache: which chained block hashes it holds.

A request's prompt is cut into blocks of ``block_size`` tokens and named by
chained hashes (:func:`chain_hashes`: the caches' :class:`ChainHasher` recipe,
the namespace folded into the first block), so hash ``i`` names the whole
prefix up to block ``i``: a replica's longest cached prefix for a request is
the run of the request's hashes it holds, from the first, up to the first miss.
Requests of different namespaces never share a hash, so never a prefix.

Two indexes answer ``match(hashes) -> {replica_id: matched blocks}``:

- :class:`ApproxIndex` learns from the router's own decisions (the Gateway API
  inference extension's prefix-cache proposal): routing a request to a replica
  records its hashes there; a per-replica LRU sized like the replica's pool, a
  global cap on entries and a TTL stand in for the replica's own eviction.
- :class:`ExactIndex` is fed each replica's KV events (``BlockStored``,
  ``BlockRemoved``, ``AllBlocksCleared``): it holds exactly what the replica
  reported, plus short-lived *speculative* entries for requests just routed
  there, until the replica's own events confirm them.

Times come from an injectable clock (``time.monotonic`` by default); an
explicit ``now`` must never go back. Not thread-safe.
"""

from __future__ import annotations

import heapq
import math
import sys
import time
from collections import OrderedDict, deque
from collections.abc import Callable, Collection, Hashable, Iterable, Sequence

import numpy as np
import xxhash

from radixkv.cache.allocator import invariant
from radixkv.cache.events import (
    AllBlocksCleared,
    BlockRemoved,
    BlockStored,
    ChainHasher,
    KVCacheEvent,
    namespace_extra_keys,
)

__all__ = ["ApproxIndex", "Clock", "ExactIndex", "chain_hashes"]

Clock = Callable[[], float]
_FREE: Hashable = object()  # an unused bit slot
_WIRE = np.dtype(">u8")  # a wire hash: 8 bytes, big-endian
_BLOCK_TYPES: dict[int, np.dtype] = {}  # block_size -> a void dtype of one block of int32 tokens


def chain_hashes(
    hasher: ChainHasher, tokens: Sequence[int] | np.ndarray, block_size: int, namespace: Hashable
) -> list[int]:
    """The wire hashes of the full blocks of ``tokens``: what a replica built with ``hasher``
    reports in its ``BlockStored`` events for them.

    Equal to ``[hasher.wire(d) for d in hasher.hashes(hasher.root, tokens,
    block_size, namespace_extra_keys(namespace))]``. The xxhash recipe is
    inlined (the blocks cut in one numpy call, the chain kept in ints;
    ``tests/test_fleet_index.py`` pins the equality). ``ValueError`` naming
    ``block_size`` or ``tokens`` unless a positive int / 1-D. Complexity: O(len(tokens)).
    """
    if isinstance(block_size, bool) or not isinstance(block_size, int) or block_size < 1:
        raise ValueError(f"block_size must be a positive int, got {block_size!r}")
    arr = np.ascontiguousarray(tokens, dtype=np.int32)
    if arr.ndim != 1:
        raise ValueError(f"tokens must be 1-D, got shape {arr.shape}")
    n = len(arr) // block_size
    if n == 0:
        return []
    extra = namespace_extra_keys(namespace)
    if hasher.name != "xxhash":
        digests = hasher.hashes(hasher.root, arr, block_size, extra)
        # wire(d) is the digest's low 64 bits, big-endian: the last 8-byte word of each digest.
        return np.frombuffer(b"".join(digests), dtype=_WIRE).reshape(n, -1)[:, -1].tolist()
    digest = xxhash.xxh3_64_intdigest
    block_type = _BLOCK_TYPES.get(block_size)
    if block_type is None:
        block_type = _BLOCK_TYPES[block_size] = np.dtype((np.void, 4 * block_size))
    blocks = arr[: n * block_size].view(block_type).tolist()  # one bytes object per block
    head = b"" if extra is None else repr(extra).encode()
    parent = digest(blocks[0] + head, int.from_bytes(hasher.root, "big"))
    out = [parent]
    append = out.append
    for block in blocks[1:]:
        parent = digest(block, parent)
        append(parent)
    return out


def _check_positive(name: str, value: object) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not value > 0:
        raise ValueError(f"{name} must be a positive number, got {value!r}")
    return float(value)


def _check_count(name: str, value: object) -> int:
    if isinstance(value, bool) or not isinstance(value, (int, np.integer)) or value < 1:
        raise ValueError(f"{name} must be a positive int, got {value!r}")
    return int(value)


def _check_optional_count(name: str, value: object) -> int | None:
    return None if value is None else _check_count(name, value)


def _held(held: Collection[int], hashes: Sequence[int]) -> int:
    """How many leading ``hashes`` are in ``held``, for a prefix-closed ``held`` (every block
    there with all its ancestors): a binary search, O(log len(hashes)) lookups."""
    n = len(hashes)
    if n == 0 or hashes[0] not in held:
        return 0
    if hashes[-1] in held:
        return n
    lo, hi = 1, n - 1  # hashes[lo - 1] is held, hashes[hi] is not
    while lo < hi:
        mid = (lo + hi) >> 1
        if hashes[mid] in held:
            lo = mid + 1
        else:
            hi = mid
    return lo


def _sizeof(objects: Iterable[object], seen: set[int]) -> int:
    """``sys.getsizeof`` summed over ``objects`` not already in ``seen`` (ids), adding them."""
    total = 0
    for o in objects:
        if id(o) not in seen:
            seen.add(id(o))
            total += sys.getsizeof(o)
    return total


class _Clocked:
    """An injectable clock and the latest time seen."""

    def __init__(self, clock: Clock) -> None:
        if not callable(clock):
            raise ValueError(f"clock must be a callable returning seconds, got {clock!r}")
        self._clock = clock
        self._last_now = -math.inf

    def _tick(self, now: float | None) -> float:
        if now is None:
            # A clock that steps back (wall time) is clamped, not an error mid-routing.
            now = max(float(self._clock()), self._last_now)
        elif not now >= self._last_now:
            raise ValueError(f"now must not go back: got now={now!r} after {self._last_now!r}")
        self._last_now = now
        return now


class ApproxIndex(_Clocked):
    """Which prefixes each replica probably holds, learned from where requests were routed.

    ``record(r, hashes)`` says a request with those chained hashes went to
    replica ``r``, so its prefix is (probably) cached there now. The table is
    kept per replica: an LRU (``OrderedDict`` hash -> last routed time) of at
    most its capacity (``set_capacity``, the replica's pool in blocks; 0 means
    unknown and falls back to ``default_capacity_blocks``; None there leaves
    only the global bound). Over all replicas at most ``max_entries`` (hash,
    replica) entries are kept, the fleet's oldest dropped first. An entry not
    routed to for more than ``ttl`` seconds expires.

    A request's hashes are touched deepest first, so a block is always more
    recent than every block after it in any chain recorded, and every drop
    (capacity, cap, expiry) takes the oldest: each replica's set stays
    *prefix-closed* (a block is there only with all its ancestors). So a
    match is a binary search per replica, and a record knows without asking
    which of its blocks are new (appended) and which held (moved to the end).
    A transposed table (hash -> replicas, as in the proposal) would make a
    match one lookup per block but cost four more dict operations per block
    recorded and evicted: measured with 8 full 4,096-block LRUs, recording
    125 new blocks took 134 us with it and 35 us without.

    Invariants (:meth:`check`): each LRU is non-empty, within its capacity
    and in time order, its times at most the latest ``now``; the entry count
    is their total and at most ``max_entries``; the expiry bound is at most
    every LRU's oldest time. Prefix closure is the tests' oracle's business.
    """

    def __init__(
        self,
        *,
        ttl: float = 300.0,
        max_entries: int = 1_000_000,
        default_capacity_blocks: int | None = None,
        clock: Clock = time.monotonic,
    ) -> None:
        super().__init__(clock)
        self.ttl = _check_positive("ttl", ttl)
        self.max_entries = _check_count("max_entries", max_entries)
        self.default_capacity_blocks = _check_optional_count(
            "default_capacity_blocks", default_capacity_blocks
        )
        self._lru: dict[Hashable, OrderedDict[int, float]] = {}
        self._capacity: dict[Hashable, int] = {}
        self._num_entries = 0
        self._oldest = math.inf  # at most every LRU head's time: expire's O(1) exit

    def __len__(self) -> int:
        """The number of (hash, replica) entries."""
        return self._num_entries

    def num_entries(self, replica_id: Hashable) -> int:
        """The hashes recorded for ``replica_id`` (0 for a replica never seen)."""
        lru = self._lru.get(replica_id)
        return 0 if lru is None else len(lru)

    def hashes(self, replica_id: Hashable) -> dict[int, float]:
        """A copy of ``replica_id``'s entries, hash -> last routed time, oldest first."""
        return dict(self._lru.get(replica_id, {}))

    def capacity(self, replica_id: Hashable) -> int | None:
        """The most hashes ``replica_id`` keeps (None: only ``max_entries`` bounds it)."""
        cap = self._capacity.get(replica_id, 0)
        return cap if cap > 0 else self.default_capacity_blocks

    def set_capacity(self, replica_id: Hashable, capacity_blocks: int) -> None:
        """Size ``replica_id``'s LRU to its pool (0: unknown), dropping its oldest hashes if over.

        ``ValueError`` naming ``capacity_blocks`` unless a non-negative int.
        Complexity: O(1), plus O(hashes dropped) when it shrinks.
        """
        if self._capacity.get(replica_id) == capacity_blocks:
            return
        if (
            isinstance(capacity_blocks, bool)
            or not isinstance(capacity_blocks, (int, np.integer))
            or capacity_blocks < 0
        ):
            raise ValueError(f"capacity_blocks must be a non-negative int, got {capacity_blocks!r}")
        self._capacity[replica_id] = int(capacity_blocks)
        lru = self._lru.get(replica_id)
        cap = self.capacity(replica_id)
        if lru is not None and cap is not None and len(lru) > cap:
            self._drop_oldest(replica_id, lru, len(lru) - cap)

    def match(self, hashes: Sequence[int], now: float | None = None) -> dict[Hashable, int]:
        """Per replica, how many leading ``hashes`` are recorded there (replicas with 0 left out).

        Drops expired entries first. Complexity: O(replicas x log len(hashes))
        dict lookups (a binary search each, sound by prefix closure), plus expiry.
        """
        self.expire(now)
        out: dict[Hashable, int] = {}
        if not hashes:
            return out
        first = hashes[0]
        for replica_id, lru in self._lru.items():
            if first in lru:
                out[replica_id] = _held(lru, hashes)
        return out

    def record(self, replica_id: Hashable, hashes: Sequence[int], now: float | None = None) -> None:
        """A request with chained ``hashes`` was routed to ``replica_id`` at ``now``.

        Touches or adds its first ``capacity`` hashes, the first block most
        recent, then drops the replica's oldest hashes past its capacity and
        the fleet's oldest past ``max_entries``. Complexity: O(len(hashes)),
        plus O((replicas + dropped) log replicas) when the global cap binds.
        """
        now = self._tick(now)
        self.expire(now)
        cap = self.capacity(replica_id)
        keep = self.max_entries if cap is None else min(cap, self.max_entries)
        if len(hashes) > keep:
            hashes = hashes[:keep]
        if not hashes:
            return
        lru = self._lru.get(replica_id)
        if lru is None:
            lru = self._lru[replica_id] = OrderedDict()
            self._oldest = min(self._oldest, now)
        held = _held(lru, hashes)  # by prefix closure: exactly hashes[:held] are in lru
        size = len(lru)
        for h in reversed(hashes[held:]):
            lru[h] = now  # new: lands at the end, deepest first
        move = lru.move_to_end
        for h in reversed(hashes[:held]):
            lru[h] = now
            move(h)
        self._num_entries += len(lru) - size
        if cap is not None and len(lru) > cap:
            self._drop_oldest(replica_id, lru, len(lru) - cap)
        if self._num_entries > self.max_entries:
            self._evict_global(self._num_entries - self.max_entries)

    def expire(self, now: float | None = None) -> int:
        """Drop every entry last routed to more than ``ttl`` seconds before ``now``; how many.

        Complexity: O(1) when nothing is due, else O(replicas + expired).
        """
        now = self._tick(now)
        cutoff = now - self.ttl
        if self._oldest >= cutoff:
            return 0
        dropped = 0
        oldest = math.inf
        for replica_id, lru in list(self._lru.items()):
            n = 0
            for t in lru.values():
                if t >= cutoff:
                    oldest = min(oldest, t)
                    break
                n += 1
            if n:
                self._drop_oldest(replica_id, lru, n)
                dropped += n
        self._oldest = oldest
        return dropped

    def drop_replica(self, replica_id: Hashable) -> None:
        """Forget ``replica_id``: its hashes and capacity. Complexity: O(1)."""
        lru = self._lru.pop(replica_id, None)
        self._capacity.pop(replica_id, None)
        if lru is not None:
            self._num_entries -= len(lru)

    def _drop_oldest(self, replica_id: Hashable, lru: OrderedDict[int, float], n: int) -> None:
        pop = lru.popitem
        for _ in range(n):
            pop(last=False)
        self._num_entries -= n
        if not lru:
            del self._lru[replica_id]

    def _evict_global(self, n: int) -> None:
        """Drop the ``n`` oldest entries fleet-wide: a merge over the LRUs' heads."""
        heads = [(next(iter(lru.values())), i, r) for i, (r, lru) in enumerate(self._lru.items())]
        heapq.heapify(heads)
        for _ in range(n):
            _t, i, r = heapq.heappop(heads)
            lru = self._lru[r]
            self._drop_oldest(r, lru, 1)
            if lru:
                heapq.heappush(heads, (next(iter(lru.values())), i, r))

    def check(self) -> None:
        """Raise ``InvariantError`` naming the first broken invariant. Complexity: O(entries)."""
        total = 0
        for r, lru in self._lru.items():
            invariant(lru, f"replica {r!r} has an empty LRU (it should have been removed)")
            cap = self.capacity(r)
            invariant(
                cap is None or len(lru) <= cap,
                f"replica {r!r} holds {len(lru)} hashes, over its capacity {cap}",
            )
            times = list(lru.values())
            invariant(
                all(a <= b for a, b in zip(times, times[1:])),
                f"replica {r!r}'s LRU is out of time order",
            )
            invariant(times[-1] <= self._last_now, f"replica {r!r} has an entry stamped ahead")
            invariant(
                self._oldest <= times[0],
                f"expiry bound {self._oldest} is above replica {r!r}'s oldest entry {times[0]}",
            )
            total += len(lru)
        invariant(total == self._num_entries, f"entry count {self._num_entries} != {total}")
        invariant(total <= self.max_entries, f"{total} entries exceed max_entries")

    def memory_bytes(self) -> int:
        """Measured size: ``sys.getsizeof`` of the LRUs (their linked-list nodes included),
        hash ints and time floats, each object counted once.

        About 120 bytes per entry on 64-bit CPython 3.11 (one time float is
        shared by all the hashes of a ``record``): 4 MiB for 8 replicas of
        4,096 blocks. Complexity: O(entries).
        """
        seen: set[int] = set()
        total = _sizeof((self, self._lru, self._capacity), seen)
        for lru in self._lru.values():
            total += _sizeof((lru,), seen) + _sizeof(lru.keys(), seen) + _sizeof(lru.values(), seen)
        return total


class ExactIndex(_Clocked):
    """Which blocks each replica holds, from its KV events, plus speculative entries.

    ``apply(r, events)`` replays replica ``r``'s events in order: a
    ``BlockStored`` adds its ``block_hashes``, a ``BlockRemoved`` removes its
    hashes, ``AllBlocksCleared`` empties the replica. The hashes are wire ints
    (``ChainHasher.wire``), so requests must be hashed with the replicas'
    recipe and seed (:func:`chain_hashes`). Parent hashes are not needed: a
    request's chain is walked from its first block and stops at the first
    miss. The event ``medium`` is ignored (radixkv replicas report one tier).

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
        for h in self._real[replica_id]:
            mask = table[h] & clear
            if mask:
                table[h] = mask
            else:
                del table[h]
        self._real[replica_id] = set()

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
