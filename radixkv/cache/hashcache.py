"""HashBlockCache: vLLM-style prefix caching with chained block hashes.

Each full block of a request is named by ``H(parent name, block tokens, extra
keys)`` (a chained hash from ``radixkv.cache.hashing``); each namespace's dict
maps name -> block. Lookup walks the names left to right and stops at the first
miss. Only full blocks are named. The namespace enters the first block's extra
keys, and each namespace looks its names up in its own dict, so different
namespaces never share a block (even two whose encodings coincide).

How vLLM's lifecycle maps onto radixkv's ownership contract
------------------------------------------------------------
In vLLM the block pool owns refcounts and sees every release. Here the caller
releases a request's references with ``allocator.decref``, which the cache
never sees. So, like the radix tree, the cache holds one reference on every
block it caches, and:

- vLLM's "free queue" = the cached blocks whose refcount is exactly 1 (only
  the cache holds them). All cached blocks sit in one ordered queue (an
  ``OrderedDict`` block -> name: a C doubly linked list with O(1) removal from
  the middle and O(1) append); the ones with refcount > 1 are "live" and
  ``evict`` skips them where it meets them.
- vLLM's "touch" (a hit pulls a block out of the free queue) = ``match`` moves
  every matched block to the tail (``peek`` looks the same chain up and moves
  nothing). A running request's blocks thus sit at the
  tail while it runs, far from the head.
- vLLM's "free a finished request, tail-first" = ``insert``, which the serving
  loop calls as a request finishes (docs/design.md's data flow): it moves the
  request's whole chain to the tail deepest block first, so the request's
  unique tail is nearest the head (evicted first) and the shared root the
  furthest (evicted last). Because every match and insert touches a chain from
  its root, a parent always sits behind all its children in the queue: with
  no in-use blocks, ``evict`` takes leaves first, like the radix tree.
- vLLM's "evict when the allocator reuses the block" = ``evict(k)``, which the
  serving loop calls when the pool runs short: it takes the first ``k``
  blocks with refcount 1 from the head, removes their names and gives back the
  cache's reference (freeing them). O(k) plus the in-use blocks it skips.

A block can outlive its parent's name (when a parent is evicted before a
child that a request held). Its name stays valid because names depend on
content only: once the parent prefix is cached again, the child is reachable
again. Until then it is unreachable but still evictable, so nothing leaks.

For names that may collide (``hash_fn="builtin"``, callables, and the 64-bit
``xxhash`` event hash), the cache keeps each block's token bytes and checks
them on every name hit; a mismatch counts as a miss, and ``insert`` stops
caching at that block.

Namespaces are filed by ``namespace_key`` (type and value), each with its
first block's extra, its name dict and a count of the cached blocks its chains
own (a block belongs to the namespace that inserted it: every name in a chain
derives from the first block's extra). A namespace whose count falls to 0 is
forgotten, so per-request cache salts leave nothing behind.

KV cache events (``events=ChainHasher(...)``, ``radixkv.cache.events``): the
cache then names its blocks with the ChainHasher (``hash_fn`` is not used), so
a block's name is the digest its events carry (a router hashes requests with
the same recipe, whatever cache a replica runs) and each block is hashed once.
``insert`` records one ``BlockStored`` per contiguous run of adopted blocks (a
run can start after a block that outlived its evicted parent), ``evict`` one
``BlockRemoved`` per block, ``reset`` one ``AllBlocksCleared``. Equal tokens
and namespace give the same event hashes here as in ``RadixCache``. With
events off (the default) the cache records into ``NO_EVENTS``, which drops
everything.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Hashable
from dataclasses import replace
from itertools import islice

import numpy as np

from radixkv.cache.allocator import BlockAllocator
from radixkv.cache.arrays import TOKEN_DTYPE, BlockSeq, TokenSeq, as_token_array
from radixkv.cache.events import NO_EVENTS, EventLog, KVCacheEvent, NullEventLog
from radixkv.cache.hashing import (
    BlockHasher,
    BlockName,
    BlockNamer,
    ChainHasher,
    NameFn,
    namespace_extra_keys,
)
from radixkv.cache.prefix_cache import (
    check_insert_blocks,
    check_num_blocks,
    held_array,
    namespace_key,
    release_held,
)
from radixkv.cache.results import CacheStats, MatchResult
from radixkv.errors import invariant

__all__ = ["HashBlockCache"]

_TOKEN_BYTES = np.dtype(TOKEN_DTYPE).itemsize
_EMPTY_BLOCKS = np.empty(0, dtype=np.int32)


class _Namespace:
    """A namespace with cached blocks: its first block's extra, its names and its block count."""

    __slots__ = ("namespace", "key", "extra", "keys", "slot", "num_blocks", "by_name")

    def __init__(self, namespace: Hashable, key: Hashable, extra: object, slot: int) -> None:
        self.namespace = namespace  # as the caller gave it
        self.key = key  # namespace_key(namespace): its key in _namespaces
        self.extra = extra  # the namer's first_extra(namespace)
        self.keys = namespace_extra_keys(namespace)  # what a first block's BlockStored carries
        self.slot = slot  # its index in _slots, stored per block in _block_ns
        self.num_blocks = 0
        self.by_name: dict[BlockName, int] = {}  # its cached blocks by name


class HashBlockCache:
    """Block-level prefix cache over a ``BlockAllocator`` keyed by chained block hashes.

    Same public surface and ownership rules as ``RadixCache``
    (``radixkv.cache.prefix_cache.PrefixCache``). ``hash_fn`` is ``"sha256"``,
    ``"xxhash"``, ``"builtin"`` or a callable ``f(parent, block_bytes, extra)``;
    ``hash_seed`` (str, bytes or int) fixes the root name so names are stable
    across processes (sha256 / xxhash); None draws a random root. ``events``:
    a ``ChainHasher`` turns KV cache events on and names the blocks (module
    docstring; ``take_events``); None (the default) keeps them off.
    ``TypeError`` naming ``events`` for anything else. With events on,
    ``match``, ``peek`` and ``insert`` refuse a namespace the hasher cannot
    encode (``ChainHasher.check_namespace``: ``ValueError`` naming
    ``namespace``), before any change.

    One cache per allocator: ``ValueError`` naming ``allocator`` if another
    live cache already claimed it (see ``radixkv.cache.allocator``). When
    this cache is garbage-collected its references go back to the allocator.

    >>> alloc = BlockAllocator(num_blocks=8, block_size=2)
    >>> cache = HashBlockCache(alloc, hash_seed=0)
    >>> blocks = alloc.alloc(2)
    >>> cache.insert([1, 2, 3, 4, 5], blocks)      # caches 2 full blocks
    0
    >>> alloc.decref(blocks)                       # the request lets go; the cache keeps them
    0
    >>> m = cache.match([1, 2, 3, 9])
    >>> m.blocks, m.num_tokens
    ([0], 2)
    >>> alloc.decref(m.blocks)
    0
    """

    def __init__(
        self,
        allocator: BlockAllocator,
        hash_fn: str | NameFn = "sha256",
        hash_seed: str | bytes | int | None = None,
        *,
        events: ChainHasher | None = None,
    ) -> None:
        if not isinstance(allocator, BlockAllocator):
            raise TypeError(f"allocator must be a BlockAllocator, got {type(allocator).__name__}")
        if events is not None and not isinstance(events, ChainHasher):
            raise TypeError(f"events must be a ChainHasher or None, got {type(events).__name__}")
        self._hash_fn = hash_fn
        hasher = BlockHasher(hash_fn, hash_seed)  # checks hash_fn and hash_seed either way
        # The names: the event hash with events on, so a block's name is what its events carry.
        self._namer: BlockNamer = hasher if events is None else events
        self._events: EventLog | NullEventLog = (
            NO_EVENTS if events is None else EventLog(events, allocator.block_size)
        )
        self._alloc = allocator
        self._bs = allocator.block_size
        self._bb = self._bs * _TOKEN_BYTES
        self._verify = self._namer.verifies_tokens
        # Every cached block, head = evicted first. Values are the blocks' names.
        self._queue: OrderedDict[int, BlockName] = OrderedDict()
        self._tokens: dict[int, bytes] = {}  # block -> its token bytes, only when verifying
        self._held = np.zeros(allocator.num_blocks, dtype=bool)
        # Namespaces owning at least one cached block, by namespace_key; the slot of each
        # cached block's namespace; slots free for reuse.
        self._namespaces: dict[Hashable, _Namespace] = {}
        self._slots: list[_Namespace | None] = []
        self._free_slots: list[int] = []
        self._block_ns = np.zeros(allocator.num_blocks, dtype=np.int32)
        self._stats = CacheStats()
        # The names the last match computed: (extra, token bytes they cover, names). The
        # serving loop inserts right after it matched, so insert re-hashes nothing it named.
        self._memo: tuple[object, bytes, list[BlockName]] = (None, b"", [])
        allocator._claim(self, self._held)  # last: nothing below can fail

    # ----------------------------------------------------------- properties
    @property
    def allocator(self) -> BlockAllocator:
        return self._alloc

    @property
    def block_size(self) -> int:
        return self._bs

    @property
    def hash_fn(self) -> str | NameFn:
        """The names' hash function as given (unused with events on: the event hash names)."""
        return self._hash_fn

    @property
    def events_hasher(self) -> ChainHasher | None:
        """The ``ChainHasher`` the events are hashed with; None when events are off."""
        return self._events.hasher

    def take_events(self) -> list[KVCacheEvent]:
        """The pending KV cache events, oldest first, and forget them; [] when events are off.

        Complexity: O(1).
        """
        return self._events.take()

    @property
    def cached_blocks(self) -> int:
        """Blocks the cache holds a reference on (reachable or not). Complexity: O(1)."""
        return len(self._queue)

    def held_blocks(self) -> np.ndarray:
        """The blocks the cache holds a reference on, as a new sorted int32 array.

        Complexity: O(num_blocks), vectorised.
        """
        return held_array(self._held)

    @property
    def evictable_blocks(self) -> int:
        """Cached blocks no request holds (refcount 1): what ``evict`` could free now.

        Where requests hold whole chains from the root (the serving loop's
        case) this equals the tree's count. Unlike the tree, a block counts even
        when a request holds one of its descendants only; evicting it leaves
        that descendant named but unreachable until the prefix returns.
        Complexity: O(num_blocks), vectorised.
        """
        return int(np.count_nonzero(self._alloc.refcounts(held_array(self._held)) == 1))

    @property
    def num_namespaces(self) -> int:
        """Namespaces owning at least one cached block. Complexity: O(1)."""
        return len(self._namespaces)

    @property
    def stats(self) -> CacheStats:
        """A snapshot of the counters."""
        return replace(self._stats)

    # ------------------------------------------------------------------ names
    def block_names(self, tokens: TokenSeq, namespace: Hashable = None) -> list[BlockName]:
        """Names of the full blocks of ``tokens`` under ``namespace`` (with events on, the
        digests its events carry).

        Read-only: an unseen namespace is not registered. ``ValueError`` naming
        ``namespace`` if the namer cannot encode it. Complexity: O(len(tokens)).
        """
        arr = as_token_array(tokens)
        rec = self._namespaces.get(namespace_key(namespace))
        extra = rec.extra if rec is not None else self._namer.first_extra(namespace)
        n = len(arr) // self._bs
        return self._namer.chain(arr[: n * self._bs].tobytes(), self._bb, extra)

    def _namespace(self, namespace: Hashable) -> tuple[Hashable, _Namespace | None]:
        """``namespace_key(namespace)`` and its record (None if it owns no block).

        Raises as ``namespace_key``; ``ValueError`` naming ``namespace`` if the
        namer cannot encode it (with events on, ``ChainHasher.check_namespace``),
        checked only when no record has it: a record's namespace passed when its
        first block was adopted.
        """
        key = namespace_key(namespace)
        rec = self._namespaces.get(key)
        if rec is None:
            self._namer.check_namespace(namespace)
        return key, rec

    def _add_namespace(self, namespace: Hashable, key: Hashable, extra: object) -> _Namespace:
        slot = self._free_slots.pop() if self._free_slots else len(self._slots)
        rec = _Namespace(namespace, key, extra, slot)
        if slot == len(self._slots):
            self._slots.append(rec)
        else:
            self._slots[slot] = rec
        self._namespaces[key] = rec
        return rec

    def _release_blocks(self, blocks: np.ndarray) -> None:
        """Uncount ``blocks`` (no longer cached) from their namespaces; forget emptied ones."""
        slots = self._block_ns[blocks]
        if slots.size == 1 or (slots.size and slots.min() == slots.max()):
            uniq, counts = [int(slots[0])], [int(slots.size)]
        else:
            u, c = np.unique(slots, return_counts=True)
            uniq, counts = u.tolist(), c.tolist()
        for slot, count in zip(uniq, counts):
            rec = self._slots[slot]
            rec.num_blocks -= count
            if rec.num_blocks == 0:
                del self._namespaces[rec.key]
                self._slots[slot] = None
                self._free_slots.append(slot)

    # ------------------------------------------------------------------ match
    def match(
        self, tokens: TokenSeq, namespace: Hashable = None, *, stats: bool = True
    ) -> MatchResult:
        """Longest cached block-aligned prefix of ``tokens`` under ``namespace``.

        Walks the chain of names from the first block and stops at the first
        miss (or, when verifying, the first name hit whose tokens differ). The
        caller receives one reference on each returned block and must
        ``decref`` it. Matched blocks move to the queue tail, deepest first.
        Counts the query and its hit tokens in ``stats`` unless ``stats=False``
        (a caller re-matching a prefix it already owns: not a new query).
        Raises ``TypeError``/``ValueError`` on bad input, before any change.

        Complexity: O(matched blocks + 1) hashes and dict lookups.
        """
        arr = as_token_array(tokens)
        _, rec = self._namespace(namespace)
        counters = self._stats
        if stats:
            counters.num_matches += 1
            counters.query_tokens += len(arr)
        if rec is None:
            return MatchResult(_EMPTY_BLOCKS, 0)
        found, names, data = self._lookup(arr, rec)
        if names:
            self._memo = (rec.extra, data[: len(names) * self._bb], names)
        if not found:
            return MatchResult(_EMPTY_BLOCKS, 0)
        move = self._queue.move_to_end
        for block in reversed(found):
            move(block)
        blocks = np.array(found, dtype=np.int32)
        self._alloc.incref_distinct(blocks)
        num_tokens = len(found) * self._bs
        if stats:
            counters.hit_tokens += num_tokens
        return MatchResult(blocks, num_tokens)

    def check_namespace(self, namespace: Hashable) -> None:
        """Raise what ``match`` would raise for ``namespace``; change nothing (``PrefixCache``)."""
        self._namespace(namespace)

    def peek(self, tokens: TokenSeq, namespace: Hashable = None) -> int:
        """Tokens ``match(tokens, namespace)`` would return now, changing nothing.

        No reference is taken, the queue order and ``stats`` stay as they are,
        and an unseen namespace is not registered. Raises ``TypeError`` /
        ``ValueError`` on bad input, as ``match``.

        Complexity: O(matched blocks + 1) hashes and dict lookups.
        """
        arr = as_token_array(tokens)
        _, rec = self._namespace(namespace)
        if rec is None:
            return 0
        found, _, _ = self._lookup(arr, rec)
        return len(found) * self._bs

    def _lookup(self, arr: np.ndarray, rec: _Namespace) -> tuple[list[int], list[BlockName], bytes]:
        """Cached blocks of the longest named prefix of ``arr`` under ``rec``; change nothing.

        Returns ``(found, names, data)``: the blocks; the names computed (those
        of ``found`` plus the first miss, if any); the full blocks' token bytes.
        """
        bs, bb = self._bs, self._bb
        n = len(arr) // bs
        if n == 0:
            return [], [], b""
        data = arr[: n * bs].tobytes()
        namer = self._namer
        name_fn = namer.block_name
        get = rec.by_name.get
        found: list[int] = []
        append = found.append
        names: list[BlockName] = []
        parent = namer.root
        extra, no_extra = rec.extra, namer.no_extra
        verify = self._tokens if self._verify else None
        for start in range(0, n * bb, bb):
            chunk = data[start : start + bb]
            parent = name_fn(parent, chunk, extra)
            names.append(parent)
            extra = no_extra
            block = get(parent)
            if block is None or (verify is not None and verify[block] != chunk):
                break
            append(block)
        return found, names, data

    # ----------------------------------------------------------------- insert
    def insert(self, tokens: TokenSeq, blocks: BlockSeq, namespace: Hashable = None) -> int:
        """Cache the full blocks of ``tokens``; return how many leading tokens were cached already.

        ``blocks[i]`` must hold tokens ``[i * bs, (i + 1) * bs)``: an ordered
        sequence (list, tuple, 1-D integer array or tensor) of at least
        ``len(tokens) // block_size`` entries, every one allocated (also those
        past the full blocks). The cache adopts
        (takes its own reference on) the block at every position whose name it
        lacks, and never touches the caller's references: the caller still owns
        and must ``decref`` all of ``blocks``. The request's chain then moves to
        the queue tail deepest first (the vLLM release order). Raises
        ``ValueError`` (too few blocks, a free or out-of-range block, a
        repeated block, or a block already cached under another name) and
        ``TypeError`` (``blocks`` a set, dict, iterator or other unordered or
        non-integer input), before any change. With events on, records one
        ``BlockStored`` per contiguous run of adopted blocks, their names being
        their digests; every name is computed before anything changes, so an
        exception from the hasher leaves the cache, every refcount and the event
        log as they were.

        Complexity: O(full blocks) hashes and dict operations.
        """
        arr = as_token_array(tokens)
        ns_key, rec = self._namespace(namespace)
        bs, bb = self._bs, self._bb
        n = len(arr) // bs
        blk = check_insert_blocks(self._alloc, blocks, len(arr))
        if rec is None:  # a new namespace: nothing is named in it yet
            extra, by_name = self._namer.first_extra(namespace), {}
        else:
            extra, by_name = rec.extra, rec.by_name

        # Name every block and look it up, without changing anything, so validation can
        # still fail cleanly.
        data = arr[: n * bs].tobytes()
        memo_extra, memo_data, memo_names = self._memo
        known = memo_names if memo_extra == extra and data.startswith(memo_data) else None
        names = self._namer.chain(data, bb, extra, known)
        get = by_name.get
        found = [get(name) for name in names]
        if self._verify:  # stop at a name collision: nothing past it can be named safely
            tokens_of = self._tokens
            seen: set[BlockName] = set()
            for i, block in enumerate(found):
                if block is None:
                    collides = names[i] in seen  # two new blocks of this request, one name
                    seen.add(names[i])
                else:
                    collides = tokens_of[block] != data[i * bb : (i + 1) * bb]
                if collides:
                    del names[i:], found[i:]
                    break
        adopt = [i for i, block in enumerate(found) if block is None]
        num_cached = adopt[0] if adopt else len(found)
        blk_list = blk.tolist()
        new = np.array([blk_list[i] for i in adopt], dtype=np.int32)
        if new.size:
            if new.size > 1 and len(np.unique(new)) != new.size:
                _, first = np.unique(new, return_index=True)
                i = adopt[int(np.setdiff1d(np.arange(new.size), first)[0])]
                raise ValueError(
                    f"blocks[{i}] is block {blk_list[i]}, a repeat: adopted blocks must be distinct"
                )
            held = self._held[new]
            if held.any():
                i = adopt[int(np.argmax(held))]
                raise ValueError(
                    f"blocks[{i}] is block {blk_list[i]}, already cached under another name"
                )

        stats = self._stats
        stats.num_inserts += 1
        if new.size and rec is None:
            rec = self._add_namespace(namespace, ns_key, extra)
            by_name = rec.by_name
        queue = self._queue
        move = queue.move_to_end
        for i in range(len(found) - 1, -1, -1):  # deepest first: the root ends at the tail
            block = found[i]
            if block is None:
                block = blk_list[i]
                name = names[i]
                by_name[name] = block
                queue[block] = name
                if self._verify:
                    self._tokens[block] = data[i * bb : (i + 1) * bb]
            else:
                move(block)
        if new.size:
            self._events.stored_runs(names, adopt, arr, rec.keys)
            self._alloc.incref_distinct(new)
            self._held[new] = True
            self._block_ns[new] = rec.slot
            rec.num_blocks += int(new.size)
            stats.inserted_tokens += int(new.size) * bs
        return num_cached * bs

    # ------------------------------------------------------------------ evict
    def evict(self, num_blocks: int) -> int:
        """Free ``min(num_blocks, evictable_blocks)`` cached blocks from the queue head.

        Blocks a request holds (refcount > 1) are skipped and stay cached.
        Returns the number of blocks freed. ``num_blocks`` is any int ``>= 0``
        (``10**30`` too); ``ValueError`` / ``TypeError`` otherwise, before any
        change. A namespace left with no block is forgotten. With events on,
        records one ``BlockRemoved`` per evicted block.

        Complexity: O(num_blocks + skipped in-use blocks), refcounts read in
        vectorised chunks.
        """
        check_num_blocks(num_blocks)
        queue = self._queue
        if num_blocks == 0 or not queue:
            return 0
        rc = self._alloc.refcounts
        keys = iter(queue)
        victims: list[np.ndarray] = []
        size = len(queue)
        need = min(int(num_blocks), size)  # islice takes at most sys.maxsize
        chunk = max(need, 16)
        while need > 0:
            part = np.fromiter(islice(keys, chunk), dtype=np.int32)
            if not part.size:
                break
            free_now = part[rc(part) == 1][:need]
            victims.append(free_now)
            need -= len(free_now)
            chunk = min(2 * chunk, size)
        del keys
        out = np.concatenate(victims) if victims else _EMPTY_BLOCKS
        if out.size:
            gone = out.tolist()
            names = [queue.pop(block) for block in gone]
            recs, tokens_of = self._slots, self._tokens
            for name, slot in zip(names, self._block_ns[out].tolist()):
                del recs[slot].by_name[name]
            for block in gone:
                tokens_of.pop(block, None)
            self._release_blocks(out)
            self._events.removed(names)
        self._held[out] = False
        freed = self._alloc.decref_distinct(out)
        self._stats.evicted_blocks += freed
        return freed

    def reset(self) -> None:
        """Drop the cache's reference on every block it holds and forget every name.

        Blocks no request holds become free; requests keep theirs. Stats are kept.
        With events on, records one ``AllBlocksCleared`` (and nothing per block).
        Complexity: O(cached blocks).
        """
        release_held(self._alloc, self._held)
        self._events.cleared()
        self._queue.clear()
        self._tokens.clear()
        self._namespaces.clear()
        self._slots.clear()
        self._free_slots.clear()

    # ------------------------------------------------------------ inspection
    def check(self) -> None:
        """Verify every invariant: the name map, the queue, the held map and the namespaces agree.

        Raises ``InvariantError`` naming the first broken one (never built on
        ``assert``: ``python -O`` checks too). Also checks the allocator.
        Complexity: O(cached blocks + num_blocks).
        """
        queue = self._queue
        blocks = np.fromiter(queue.keys(), dtype=np.int32, count=len(queue))
        invariant(
            not blocks.size or (blocks.min() >= 0 and blocks.max() < self._alloc.num_blocks),
            "the queue holds a block id out of range",
        )
        held = np.zeros_like(self._held)
        held[blocks] = True
        invariant((held == self._held).all(), "held-block map disagrees with the queue")
        invariant((self._alloc.refcounts(blocks) >= 1).all(), "the cache holds a free block")
        if self._verify:
            invariant(self._tokens.keys() == queue.keys(), "token bytes missing for a block")
            invariant(all(len(t) == self._bb for t in self._tokens.values()), "bad token bytes")
        else:
            invariant(not self._tokens, "token bytes kept without verification")
        slots = self._block_ns[blocks]
        invariant(
            not slots.size or (slots.min() >= 0 and slots.max() < len(self._slots)),
            "a cached block's namespace slot is out of range",
        )
        counts = np.bincount(slots, minlength=len(self._slots)) if slots.size else None
        free_slots = set(self._free_slots)
        invariant(len(free_slots) == len(self._free_slots), "a namespace slot is free twice")
        for slot, rec in enumerate(self._slots):
            if rec is None:
                invariant(slot in free_slots, f"namespace slot {slot} is lost")
                invariant(counts is None or counts[slot] == 0, f"blocks owned by freed slot {slot}")
                continue
            invariant(rec.slot == slot, f"namespace {rec.namespace!r} is in the wrong slot")
            invariant(
                self._namespaces.get(rec.key) is rec,
                f"namespace {rec.namespace!r} is not filed under its key",
            )
            invariant(rec.num_blocks > 0, f"namespace {rec.namespace!r} is kept with no blocks")
            invariant(
                rec.extra == self._namer.first_extra(rec.namespace),
                f"namespace {rec.namespace!r} keeps another namespace's first-block extra",
            )
            invariant(
                counts is not None and counts[slot] == rec.num_blocks,
                f"namespace {rec.namespace!r} counts {rec.num_blocks} blocks, owns "
                f"{0 if counts is None else int(counts[slot])}",
            )
        invariant(
            len(self._namespaces) + len(self._free_slots) == len(self._slots),
            "namespace map, slots and free slots disagree",
        )
        # Every cached block's name is in its namespace's dict, and the dicts hold nothing else.
        invariant(
            len(queue) == sum(len(rec.by_name) for rec in self._namespaces.values()),
            "name maps and queue differ in size",
        )
        recs = self._slots
        for (block, name), slot in zip(queue.items(), slots.tolist()):
            invariant(recs[slot].by_name.get(name) == block, f"block {block}'s name maps elsewhere")
        self._alloc.check()

    def __repr__(self) -> str:
        return (
            f"HashBlockCache(block_size={self._bs}, hash_fn={self._hash_fn!r}, "
            f"cached_blocks={len(self._queue)})"
        )
