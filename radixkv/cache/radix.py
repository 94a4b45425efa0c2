"""RadixCache: a compressed trie on token ids that owns refcounted KV blocks.

Each node but the root holds a block-aligned run of tokens and exactly one
block per ``block_size`` tokens. A node's tokens are stored once, as the bytes
of an int32 array: the child key is the first block's bytes (an injective
encoding of the tuple of its ``block_size`` token ids), and walking down is one
dict lookup plus one ``bytes.startswith`` (a memcmp) per node. Only where a
walk ends inside a node does the code compare tokens one by one (numpy), to
find the block boundary where they part. ``peek`` walks the same way and
changes nothing.

Reference ownership (docs/design.md):
- the tree holds exactly one reference on every block of every node;
- ``match`` gives the caller one more reference on each matched block;
- ``insert`` takes the tree's own reference on each block it adopts and never
  touches the caller's references.

Every leaf sits in a sorted index keyed by the eviction order, so ``evict``
pops victims from the front instead of scanning the tree. Leaves whose blocks
a request still holds (refcount > 1) are skipped and stay in the tree. The
index is lazy: a touch only bumps the node's clock and a leaf that gains a
child only forgets its entry; ``evict`` re-files an entry whose key went stale
and drops one that is no longer its node's, and the index is rebuilt when such
dead entries outnumber the live ones. Keys never decrease on a touch, so a
stale entry always sorts at or before where it belongs.

Each namespace has its own root, filed under ``namespace_key(namespace)``
(type and value); a root goes as soon as its last child is evicted, so a
namespace that holds no block (a per-request cache salt, say) costs nothing.

KV cache events (``events=ChainHasher(...)``, ``radixkv.cache.events``): each
node then also keeps its blocks' chained digests, concatenated in one bytes
object parallel to ``blocks`` (split with it); the digest of a node's last
block is the parent of its children's chains. ``insert`` hashes only the
blocks it adopts and records one ``BlockStored``; ``evict`` one
``BlockRemoved`` per block that leaves; ``reset`` one ``AllBlocksCleared``. A
split moves no block, so it records nothing. With events off (the default)
nodes keep no digest and the only cost is one ``is None`` test on the insert,
split, evict and reset paths.
"""

from __future__ import annotations

from collections.abc import Hashable, Iterator, Mapping
from dataclasses import replace
from types import MappingProxyType

import numpy as np
from sortedcontainers import SortedList

from radixkv.cache import kernels
from radixkv.cache.allocator import BlockAllocator, invariant
from radixkv.cache.arrays import (
    TOKEN_DTYPE,
    BlockSeq,
    TokenSeq,
    as_block_array,
    as_token_array,
    common_prefix_len,
)
from radixkv.cache.events import ChainHasher, EventLog, KVCacheEvent, namespace_extra_keys
from radixkv.cache.eviction import EvictionOrder, check_key, make_eviction_order
from radixkv.cache.protocol import check_num_blocks, held_array, namespace_key, release_held
from radixkv.cache.results import CacheStats, MatchResult

__all__ = ["CacheStats", "MatchResult", "RadixCache"]

_TOKEN_BYTES = np.dtype(TOKEN_DTYPE).itemsize
_ID_BYTES = 4  # a block id in a node's ``blocks``: int32
_EMPTY_BLOCKS = np.empty(0, dtype=np.int32)
# A leaf's children: one shared read-only empty mapping instead of an empty dict per leaf
# (64 bytes each, half the tree's nodes); a node gets a dict of its own with its first child.
_NO_CHILDREN: Mapping[bytes, _Node] = MappingProxyType({})


class _Node:
    """A run of tokens and its blocks. ``entry`` is its key in the leaf index, None when absent.

    ``digests`` is None with events off; with events on, the blocks' chained
    event digests concatenated (``digest_size`` bytes per block, in order).
    What an eviction order may read (``radixkv.cache.eviction.LeafView``):
    ``last_access`` (logical clock of the last match or insert through it),
    ``depth_end``, ``hits`` (matches through it), ``created`` (clock at its
    insert; a split's head keeps it), ``priority`` (the highest an insert
    through it gave) and ``num_blocks``.
    """

    __slots__ = (
        "key",
        "blocks",
        "children",
        "parent",
        "depth_end",
        "last_access",
        "entry",
        "digests",
        "hits",
        "created",
        "priority",
        "pinned",
    )

    def __init__(
        self,
        key: bytes,
        blocks: bytes,
        parent: _Node | None,
        depth_end: int,
        last_access: int,
        digests: bytes | None = None,
        priority: int = 0,
    ) -> None:
        self.key = key  # the node's tokens: int32 bytes, block-aligned
        # int32 block ids as bytes, one per block_size tokens: a bytes header is ~80 bytes
        # smaller than an ndarray's, and match joins them in one copy (_ids views one).
        self.blocks = blocks
        self.children: Mapping[bytes, _Node] = _NO_CHILDREN  # a dict once it has a child
        self.parent = parent
        self.depth_end = depth_end  # tokens from the root to the end of this node
        self.last_access = last_access
        self.entry: tuple | None = None
        self.digests = digests
        self.hits = 0
        self.created = last_access
        self.priority = priority
        self.pinned = 0  # pins covering this node (RadixCache.pin): never evicted while > 0

    @property
    def num_blocks(self) -> int:
        return len(self.blocks) // _ID_BYTES

    def block_ids(self) -> np.ndarray:
        """The node's blocks as a read-only int32 array (a view, no copy)."""
        return np.frombuffer(self.blocks, dtype=np.int32)

    def tokens(self) -> np.ndarray:
        return np.frombuffer(self.key, dtype=TOKEN_DTYPE)


class _Root(_Node):
    """A namespace's root: no tokens, no blocks; knows its namespace so evict can drop it."""

    __slots__ = ("namespace", "ns_key")

    def __init__(self, namespace: Hashable, ns_key: Hashable, last_access: int) -> None:
        super().__init__(b"", b"", None, 0, last_access)
        self.namespace = namespace  # as the caller gave it (for pretty)
        self.ns_key = ns_key  # its key in _roots


class RadixCache:
    """Block-level prefix cache over a ``BlockAllocator`` (SGLang-style radix tree).

    ``eviction`` is ``"level"`` (deepest leaves first, LRU within a depth),
    ``"lru"`` (least recently used leaf first) or an object with a
    ``key(node)`` method returning a tuple (see ``radixkv.cache.eviction``;
    ``TypeError`` naming the order if its key of a fresh node is no tuple).

    ``events``: a ``ChainHasher`` turns KV cache events on (module docstring;
    ``take_events``); None (the default) keeps them off at no cost.
    ``TypeError`` naming ``events`` for anything else.

    One cache per allocator: ``ValueError`` naming ``allocator`` if another
    live cache already claimed it (see ``radixkv.cache.allocator``). When
    this cache is garbage-collected its references go back to the allocator.

    >>> alloc = BlockAllocator(num_blocks=8, block_size=2)
    >>> cache = RadixCache(alloc)
    >>> blocks = alloc.alloc(2)
    >>> cache.insert([1, 2, 3, 4, 5], blocks)      # caches 2 full blocks
    0
    >>> alloc.decref(blocks)                       # the request lets go; the tree keeps them
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
        eviction: str | EvictionOrder = "level",
        *,
        events: ChainHasher | None = None,
        max_pinned_blocks: int | None = None,
    ) -> None:
        if not isinstance(allocator, BlockAllocator):
            raise TypeError(f"allocator must be a BlockAllocator, got {type(allocator).__name__}")
        if max_pinned_blocks is None:
            max_pinned_blocks = allocator.num_blocks // 2
        if (
            isinstance(max_pinned_blocks, bool)
            or not isinstance(max_pinned_blocks, int)
            or not 0 <= max_pinned_blocks < allocator.num_blocks
        ):
            raise ValueError(
                f"max_pinned_blocks must be an int in [0, {allocator.num_blocks}) (below the "
                f"pool, so pins never exhaust it), got {max_pinned_blocks!r}"
            )
        if events is not None and not isinstance(events, ChainHasher):
            raise TypeError(f"events must be a ChainHasher or None, got {type(events).__name__}")
        self._alloc = allocator
        self._order = make_eviction_order(eviction)
        check_key(self._order, self._order.key(_Node(b"", b"", None, 0, 0)))
        self._bs = allocator.block_size
        self._block_bytes = self._bs * _TOKEN_BYTES
        self._roots: dict[Hashable, _Root] = {}  # namespace_key(namespace) -> root
        self._leaves = SortedList()
        self._num_dead = 0  # entries in _leaves whose node is no longer a leaf
        self._held = np.zeros(allocator.num_blocks, dtype=np.bool_)
        # the allocator never replaces it; written here only by match (kernels.incref_held)
        self._rc = allocator.refcount_array
        self._num_cached = 0
        self._clock = 0
        self._uid = 0  # tie-breaker in index entries, so nodes themselves are never compared
        self._stats = CacheStats()
        self._events = None if events is None else EventLog(events, allocator.block_size)
        self._dsz = 0 if events is None else len(events.root)  # bytes per digest
        self._max_pinned = max_pinned_blocks
        self._num_pinned = 0  # blocks in nodes with pinned > 0
        # (namespace key, the full-block bytes pin() was given) -> pinned prefix lengths in
        # bytes, one per pin() not yet undone
        self._pins: dict[tuple[Hashable, bytes], list[int]] = {}
        allocator._claim(self, self._held)  # last: nothing below can fail

    # ----------------------------------------------------------- properties
    @property
    def allocator(self) -> BlockAllocator:
        return self._alloc

    @property
    def block_size(self) -> int:
        return self._bs

    @property
    def eviction(self) -> str:
        return getattr(self._order, "name", type(self._order).__name__)

    @property
    def events_hasher(self) -> ChainHasher | None:
        """The ``ChainHasher`` the events are hashed with; None when events are off."""
        return None if self._events is None else self._events.hasher

    def take_events(self) -> list[KVCacheEvent]:
        """The pending KV cache events, oldest first, and forget them; [] when events are off.

        Complexity: O(1).
        """
        return [] if self._events is None else self._events.take()

    @property
    def cached_blocks(self) -> int:
        """Blocks the tree holds a reference on. Complexity: O(1)."""
        return self._num_cached

    def held_blocks(self) -> np.ndarray:
        """The blocks the tree holds a reference on, as a new sorted int32 array.

        Complexity: O(num_blocks), vectorised.
        """
        return held_array(self._held)

    @property
    def evictable_blocks(self) -> int:
        """Blocks ``evict`` could free now: every cached block with no held block at or below it,
        outside pinned nodes.

        Complexity: O(nodes + cached blocks), vectorised per node.
        """
        rc = self._alloc.refcount_array
        last_busy = kernels.last_busy
        total = 0
        for root in self._roots.values():
            # Post-order: a node is evictable iff its blocks are free of requests and
            # every child is evictable (its children must go first).
            stack: list[tuple[_Node, bool]] = [(root, False)]
            ok: dict[int, bool] = {}
            while stack:
                node, expanded = stack.pop()
                if not expanded:
                    stack.append((node, True))
                    stack.extend((c, False) for c in node.children.values())
                    continue
                good = all(ok[id(c)] for c in node.children.values())
                if node.pinned:
                    good = False  # evict skips it, so nothing above it goes either
                elif node is not root and good:
                    # Blocks after the last held one can go (evict splits them off).
                    busy = last_busy(rc, node.block_ids())
                    total += node.num_blocks - (busy + 1)
                    good = busy < 0
                ok[id(node)] = good
        return total

    @property
    def num_nodes(self) -> int:
        """Nodes in the tree, roots excluded. Complexity: O(nodes)."""
        return sum(1 for _ in self._iter_nodes())

    @property
    def num_namespaces(self) -> int:
        """Namespaces holding at least one block (each has a root). Complexity: O(1)."""
        return len(self._roots)

    @property
    def stats(self) -> CacheStats:
        """A snapshot of the counters (and ``pinned_blocks``, the blocks pins hold now)."""
        return replace(self._stats, pinned_blocks=self._num_pinned)

    # ------------------------------------------------------------------ match
    def match(
        self, tokens: TokenSeq, namespace: Hashable = None, *, stats: bool = True
    ) -> MatchResult:
        """Longest cached block-aligned prefix of ``tokens`` under ``namespace``.

        The caller receives one reference on each returned block and must
        ``decref`` it when done. If the match ends inside a node, that node is
        split at the block boundary (so the prefix ends at a node). Touches the
        matched path for eviction order. Counts the query and its hit tokens in
        ``stats`` unless ``stats=False`` (a caller re-matching a prefix it
        already owns: not a new query). Raises ``TypeError``/``ValueError`` on
        bad input, before any change.

        Complexity: O(depth) dict lookups and memcmps, plus O(node length) for
        the one node where the walk ends inside, plus O(matched blocks) to
        build the result.
        """
        arr = as_token_array(tokens)
        node = self._root_of(namespace)
        bs, bb = self._bs, self._block_bytes
        n_blocks = len(arr) // bs
        self._clock += 1
        clock = self._clock
        counters = self._stats
        if stats:
            counters.num_matches += 1
            counters.query_tokens += len(arr)
        if node is None or n_blocks == 0:
            return MatchResult(_EMPTY_BLOCKS, 0)
        # The walk of ``_walk``, inlined: the hot path touches and collects as it goes.
        data = arr[: n_blocks * bs].tobytes()
        end = len(data)
        pos = 0
        parts = []
        while pos < end:
            child = node.children.get(data[pos : pos + bb])
            if child is None:
                break
            if data.startswith(child.key, pos):
                node = child
                node.last_access = clock
                node.hits += 1
                parts.append(node.blocks)
                pos += len(node.key)
                continue
            k = self._common_blocks(child, arr, pos // _TOKEN_BYTES, n_blocks * bs)
            node = self._split(child, k)
            node.last_access = clock
            node.hits += 1
            parts.append(node.blocks)
            pos += k * bb
            break
        if not parts:
            return MatchResult(_EMPTY_BLOCKS, 0)
        # One copy into a fresh writable buffer: the caller owns its result.
        blocks = np.frombuffer(bytearray().join(parts), dtype=np.int32)
        kernels.incref_held(self._rc, blocks)  # the tree's own blocks: in range, allocated
        num_tokens = pos // _TOKEN_BYTES
        if stats:
            counters.hit_tokens += num_tokens
        return MatchResult(blocks, num_tokens)

    def peek(self, tokens: TokenSeq, namespace: Hashable = None) -> int:
        """Tokens ``match(tokens, namespace)`` would return now, changing nothing.

        No reference is taken, no node is split, no counter in ``stats`` and no
        eviction clock moves, and an unseen namespace is not registered.
        Raises ``TypeError``/``ValueError`` on bad input, as ``match``.

        Complexity: O(depth) dict lookups and memcmps, plus O(node length) for
        the one node where the walk ends inside (whole agreeing blocks, rounded
        down, counted by a compiled loop).
        """
        arr = as_token_array(tokens)
        _, pos, _, _ = self._walk(self._root_of(namespace), arr)
        return pos // _TOKEN_BYTES

    # ----------------------------------------------------------------- insert
    def insert(
        self,
        tokens: TokenSeq,
        blocks: BlockSeq,
        namespace: Hashable = None,
        *,
        priority: int = 0,
    ) -> int:
        """Cache the full blocks of ``tokens``; return how many leading tokens were cached already.

        ``priority`` (an int, default 0) is what the ``"priority"`` eviction
        order reads: every node on the inserted path keeps the highest
        priority any insert through it gave (lower goes first).

        ``blocks[i]`` must hold tokens ``[i * bs, (i + 1) * bs)``: an ordered
        sequence (list, tuple, 1-D integer array or tensor) of at least
        ``len(tokens) // block_size`` entries, every one allocated (also those
        past the full blocks). The tree adopts (takes its own reference on)
        the blocks past the already-cached prefix and never touches the
        caller's references: the caller still owns and must ``decref`` all of
        ``blocks``. Raises ``ValueError`` (too few blocks, a free or
        out-of-range block, a repeated block, or a block the tree already
        caches at another position, naming its index in ``blocks``) and
        ``TypeError`` (``blocks`` a set, dict, iterator or other unordered or
        non-integer input), before any change.

        With events on, records one ``BlockStored`` for the adopted blocks.

        Complexity: as ``match`` for the walk, plus O(len(blocks)) to validate
        (one compiled pass), plus O(adopted blocks) (and, with events on, the
        hashing of the adopted blocks' tokens).
        """
        arr = as_token_array(tokens)
        ns_key = namespace_key(namespace)
        if isinstance(priority, bool) or not isinstance(priority, (int, np.integer)):
            raise TypeError(f"priority must be an int, got {priority!r}")
        priority = int(priority)
        root = self._roots.get(ns_key)
        bs, bb = self._bs, self._block_bytes
        n_blocks = len(arr) // bs
        blk = as_block_array(blocks)
        if len(blk) < n_blocks:
            raise ValueError(
                f"insert of {len(arr)} tokens needs {n_blocks} blocks of {bs}, "
                f"got {len(blk)} in blocks"
            )

        # Walk without changing anything, so validation can still fail cleanly.
        path, pos, split_child, split_at = self._walk(root, arr)
        node = path[-1] if path else root
        num_cached = pos // bb
        new = blk[num_cached:n_blocks]
        # Validates all of blk, and marks the adopted blocks held (undone if it fails).
        reason, i = kernels.claim_for_insert(self._rc, self._held, blk, num_cached, n_blocks)
        if reason:
            b = int(blk[i])
            if reason == 1 and not 0 <= b < self._alloc.num_blocks:
                why = f"out of range [0, {self._alloc.num_blocks})"
            else:
                why = {
                    1: "not allocated",
                    2: "already cached at another position",
                    3: "a repeat: adopted blocks must be distinct",
                }[reason]
            raise ValueError(f"blocks[{i}] is block {b}, which is {why}")

        self._clock += 1
        clock = self._clock
        stats = self._stats
        stats.num_inserts += 1
        if root is None:
            if not new.size:
                return num_cached * bs
            root = self._roots[ns_key] = _Root(namespace, ns_key, clock)
            node = root
        for n in path:
            n.last_access = clock
            if priority > n.priority:
                n.priority = priority
        if new.size:
            if split_child is not None:
                node = self._split(split_child, split_at)
                node.last_access = clock
                if priority > node.priority:
                    node.priority = priority
            added = arr[pos // _TOKEN_BYTES : n_blocks * bs]
            data = added.tobytes()
            digests = None if self._events is None else self._stored(node, added)
            leaf = _Node(
                data, new.tobytes(), node, node.depth_end + len(new) * bs, clock, digests, priority
            )
            if node.entry is not None:
                self._forget_entry(node)
            if node.children is _NO_CHILDREN:
                node.children = {}
            node.children[data[:bb]] = leaf
            self._index(leaf)
            self._alloc.incref_distinct(new)
            self._num_cached += len(new)
            stats.inserted_tokens += len(new) * bs
        return num_cached * bs

    # -------------------------------------------------------------------- pin
    @property
    def pinned_blocks(self) -> int:
        """Blocks in pinned nodes: never evicted while pinned."""
        return self._num_pinned

    @property
    def max_pinned_blocks(self) -> int:
        """The cap on :attr:`pinned_blocks` (below the pool size, so pins never exhaust it)."""
        return self._max_pinned

    def pin(self, tokens: TokenSeq, namespace: Hashable = None) -> int:
        """Keep the cached block-aligned prefix of ``tokens`` in the tree until :meth:`unpin`.

        A system prompt or few-shot block, pinned once it is cached, survives any
        eviction order; its blocks count in :attr:`pinned_blocks` and
        ``stats.pinned_blocks``. Pins nest: the same prefix pinned twice needs
        two unpins. Returns the tokens pinned (0 if nothing of ``tokens`` is
        cached: insert first). No reference is taken, no statistic counted; the
        pinned path is touched as by a match. ``ValueError`` naming
        ``max_pinned_blocks`` if the newly pinned blocks would pass the cap,
        ``TypeError``/``ValueError`` for bad input, before any change.
        Complexity: as ``match`` (a split where the prefix ends inside a node).
        """
        arr = as_token_array(tokens)
        ns_key = namespace_key(namespace)
        root = self._roots.get(ns_key)
        path, pos, split_child, split_at = self._walk(root, arr)
        if split_child is not None:
            path.append(split_child)  # only its first split_at blocks will be pinned
        added = sum(n.num_blocks for n in path if not n.pinned)
        if split_child is not None and not split_child.pinned:
            added -= split_child.num_blocks - split_at
        if self._num_pinned + added > self._max_pinned:
            raise ValueError(
                f"pinning {added} more blocks would pass max_pinned_blocks="
                f"{self._max_pinned} ({self._num_pinned} pinned)"
            )
        if pos == 0:
            return 0
        if split_child is not None:
            path[-1] = self._split(split_child, split_at)
        self._clock += 1
        for node in path:
            node.last_access = self._clock
            if not node.pinned:
                self._num_pinned += node.num_blocks
            node.pinned += 1
        n_bytes = len(arr) // self._bs * self._block_bytes
        self._pins.setdefault((ns_key, arr.tobytes()[:n_bytes]), []).append(pos)
        return pos // _TOKEN_BYTES

    def unpin(self, tokens: TokenSeq, namespace: Hashable = None) -> int:
        """Undo the latest :meth:`pin` of the same ``tokens`` and ``namespace``; return the
        tokens it had pinned. ``ValueError`` naming ``tokens`` if no such pin is in force
        (``reset`` drops every pin), before any change. Complexity: O(depth of the prefix).
        """
        arr = as_token_array(tokens)
        ns_key = namespace_key(namespace)
        n_bytes = len(arr) // self._bs * self._block_bytes
        key = (ns_key, arr.tobytes()[:n_bytes])
        stack = self._pins.get(key)
        if not stack:
            raise ValueError(
                f"tokens ({len(arr)} tokens) have no pin in force under namespace {namespace!r}"
            )
        pos = stack.pop()
        if not stack:
            del self._pins[key]
        path, matched, split_child, _ = self._walk(self._roots[ns_key], arr[: pos // _TOKEN_BYTES])
        invariant(
            matched == pos and split_child is None, "a pinned prefix no longer ends at a node"
        )
        for node in path:
            node.pinned -= 1
            if not node.pinned:
                self._num_pinned -= node.num_blocks
        return pos // _TOKEN_BYTES

    # ------------------------------------------------------------------ evict
    def evict(self, num_blocks: int) -> int:
        """Free at least ``num_blocks`` cached blocks if that many are evictable, else all it can.

        Victims are leaves in eviction order; a whole leaf goes at once (so
        maybe more than asked). A block some request holds (refcount > 1) is
        never freed and its node stays: a leaf whose last block is held is
        skipped; a leaf of which only a head part is held is split there and
        its free tail evicted. A parent becomes a candidate once its last child
        is gone; a namespace's root goes with its last child. Returns the
        number of blocks freed. ``num_blocks`` is any int ``>= 0`` (``10**30``
        too); ``ValueError`` / ``TypeError`` otherwise, before any change. A
        custom order whose key is no tuple raises ``TypeError`` (what was
        evicted before stays evicted; the index stays whole). With events on,
        records one ``BlockRemoved`` per block that leaves the tree.

        Complexity: O((evicted + skipped leaves) * log leaves), plus O(blocks freed).
        """
        check_num_blocks(num_blocks)
        alloc, leaves, held, bb = self._alloc, self._leaves, self._held, self._block_bytes
        rc = alloc.refcount_array
        last_busy = kernels.last_busy
        key = self._order.key
        log = self._events
        freed = 0
        skipped = []
        try:  # an order whose key turns bad mid-way (TypeError) leaves the index whole
            while freed < num_blocks and leaves:
                entry = leaves.pop(0)
                node = entry[-1]
                if node.entry is not entry:  # dead: the node gained a child or was evicted
                    self._num_dead -= 1
                    continue
                fresh = key(node)
                if entry[:-2] != fresh:  # touched since filed: re-file under its new key
                    if not isinstance(fresh, tuple):
                        skipped.append(entry)  # back into the index whole, then raise
                        check_key(self._order, fresh)
                    self._index(node)
                    continue
                if node.pinned:
                    skipped.append(entry)
                    continue
                ids = node.block_ids()
                busy = last_busy(rc, ids)
                if busy >= 0:
                    keep = busy + 1
                    if keep == len(ids):
                        skipped.append(entry)
                        continue
                    # Only a head part is held (a request kept blocks across a reset or
                    # re-insert): split it off; the node object stays the free tail.
                    self._split(node, keep)
                    ids = node.block_ids()
                node.entry = None
                parent = node.parent
                del parent.children[node.key[:bb]]  # a parent's children are a dict
                node.parent = None
                freed += alloc.decref_distinct(ids)
                if log is not None:
                    log.removed(self._digest_list(node.digests))
                kernels.set_flags(held, ids, False)
                self._num_cached -= len(ids)
                if not parent.children:
                    parent.children = _NO_CHILDREN
                    if parent.parent is not None:
                        self._index(parent)
                    else:  # the namespace holds nothing more: forget it
                        del self._roots[parent.ns_key]
        finally:
            for entry in skipped:
                leaves.add(entry)
            self._stats.evicted_blocks += freed
        return freed

    def reset(self) -> None:
        """Drop the tree's reference on every block it holds and empty the tree.

        Blocks no request holds become free; requests keep theirs. Stats are kept.
        With events on, records one ``AllBlocksCleared`` (and nothing per block).
        Complexity: O(cached blocks).
        """
        release_held(self._alloc, self._held)
        if self._events is not None:
            self._events.cleared()
        self._roots.clear()
        self._leaves.clear()
        self._num_dead = 0
        self._num_cached = 0
        self._pins.clear()
        self._num_pinned = 0

    # ------------------------------------------------------------- internals
    def _chain_start(self, node: _Node) -> tuple[bytes, bytes | None, tuple | None]:
        """Where a chain below ``node`` starts: (parent digest to hash from, event parent, extra).

        Below a root: the hasher's root, no event parent, the namespace's extra
        keys; below any other node: its last block's digest, twice, no extra.
        """
        if node.parent is None:
            assert isinstance(node, _Root)
            return self._events.hasher.root, None, namespace_extra_keys(node.namespace)
        last = node.digests[-self._dsz :]
        return last, last, None

    def _stored(self, node: _Node, tokens: np.ndarray) -> bytes:
        """Hash the blocks of ``tokens`` adopted below ``node``; record a ``BlockStored``.

        Returns their digests concatenated (the new leaf's ``digests``).
        """
        start, parent, extra = self._chain_start(node)
        log = self._events
        digests = log.hasher.hashes(start, tokens, self._bs, extra)
        log.stored(digests, parent, tokens, extra)
        return b"".join(digests)

    def _digest_list(self, digests: bytes) -> list[bytes]:
        dsz = self._dsz
        return [digests[i : i + dsz] for i in range(0, len(digests), dsz)]

    def _root_of(self, namespace: Hashable) -> _Root | None:
        """The namespace's root, None if it holds nothing; raises as ``namespace_key``."""
        return self._roots.get(namespace_key(namespace))

    def _walk(
        self, root: _Node | None, arr: np.ndarray
    ) -> tuple[list[_Node], int, _Node | None, int]:
        """Find the longest cached block-aligned prefix of ``arr`` below ``root``; change nothing.

        Returns ``(path, pos, split_child, split_at)``: the nodes wholly matched,
        in order; the matched length in bytes of int32 tokens; and, where the
        match ends ``split_at >= 1`` blocks inside a further node, that node
        (else None and 0). ``peek`` and ``insert`` use it; ``match`` inlines
        the same loop (measured: the call and the second pass cost ~5%).
        """
        bs, bb = self._bs, self._block_bytes
        n_blocks = len(arr) // bs
        path: list[_Node] = []
        if root is None or n_blocks == 0:
            return path, 0, None, 0
        data = arr[: n_blocks * bs].tobytes()
        end = len(data)
        node, pos = root, 0
        while pos < end:
            child = node.children.get(data[pos : pos + bb])
            if child is None:
                break
            if data.startswith(child.key, pos):
                node = child
                path.append(node)
                pos += len(node.key)
                continue
            # The first block agrees (it is the child's key), so split_at >= 1.
            split_at = self._common_blocks(child, arr, pos // _TOKEN_BYTES, n_blocks * bs)
            return path, pos + split_at * bb, child, split_at
        return path, pos, None, 0

    def _common_blocks(self, child: _Node, arr: np.ndarray, start: int, stop: int) -> int:
        """Whole blocks on which ``child``'s tokens and ``arr[start:stop]`` agree (rounded DOWN)."""
        return common_prefix_len(child.tokens(), arr[start:stop]) // self._bs

    def _split(self, node: _Node, k: int) -> _Node:
        """Split ``node`` after its first ``k`` blocks; return the new head.

        The head takes the node's place under its parent; the node object
        itself becomes the tail, keeping its children (so they need no
        re-parenting), its depth_end and its leaf-index entry.
        """
        bb = self._block_bytes
        cut = k * bb
        parent = node.parent
        head = _Node(
            node.key[:cut],
            node.blocks[: k * _ID_BYTES],
            parent,
            node.depth_end - (len(node.key) - cut) // _TOKEN_BYTES,
            node.last_access,
            None,
            node.priority,
        )
        head.hits = node.hits
        head.created = node.created
        head.pinned = node.pinned  # a pin covers the whole node, so both halves
        parent.children[node.key[:bb]] = head
        node.key = node.key[cut:]
        node.blocks = node.blocks[k * _ID_BYTES :]
        digests = node.digests
        if digests is not None:  # events on: the digests split with the blocks
            dcut = k * self._dsz
            head.digests = digests[:dcut]
            node.digests = digests[dcut:]
        node.parent = head
        head.children = {node.key[:bb]: node}
        return head

    def _index(self, node: _Node) -> None:
        key = self._order.key(node)
        if type(key) is not tuple:
            check_key(self._order, key)
        self._uid += 1
        node.entry = (*key, self._uid, node)
        self._leaves.add(node.entry)

    def _forget_entry(self, node: _Node) -> None:
        """``node`` stops being a leaf: its entry turns dead (dropped when popped)."""
        node.entry = None
        self._num_dead += 1
        if self._num_dead > 64 and self._num_dead > 2 * (len(self._leaves) - self._num_dead):
            live = [e for e in self._leaves if e[-1].entry is e]
            self._leaves = SortedList(live)
            self._num_dead = 0

    def _iter_nodes(self) -> Iterator[_Node]:
        for root in self._roots.values():
            stack = list(root.children.values())
            while stack:
                node = stack.pop()
                yield node
                stack.extend(node.children.values())

    # ------------------------------------------------------------ inspection
    def check(self) -> None:
        """Verify the tree's invariants (docs/design.md, 1-4 and 7, as far as the tree sees them).

        Raises ``InvariantError`` naming the first broken one (never built on
        ``assert``: ``python -O`` checks too). Also checks the allocator. With
        events on, also that every node's digests are a fresh recomputation of
        its chain from its parent's last digest (the root's: the hasher's root
        and the namespace's extra keys); with events off, that no node keeps any.
        Complexity: O(nodes + cached blocks + num_blocks), plus hashing every
        cached token with events on.
        """
        bb = self._block_bytes
        log = self._events
        key_of = self._order.key
        seen_blocks: list[np.ndarray] = []
        leaves = 0
        for ns_key, root in self._roots.items():
            invariant(
                isinstance(root, _Root) and root.ns_key == ns_key,
                f"root filed under {ns_key!r} is not that namespace's root",
            )
            invariant(
                root.parent is None and root.key == b"" and root.depth_end == 0,
                f"root of namespace {root.namespace!r} has a parent, tokens or depth",
            )
            invariant(root.entry is None, "a root is in the leaf index")
            invariant(root.children, f"namespace {root.namespace!r} keeps an empty root")
            stack: list[_Node] = [root]
            while stack:
                node = stack.pop()
                for key, child in node.children.items():
                    invariant(child.parent is node, "child's parent pointer is wrong")
                    invariant(len(child.key) > 0, "empty non-root node")
                    invariant(len(child.key) % bb == 0, "node tokens not block-aligned")
                    invariant(key == child.key[:bb], "child not keyed by its first block")
                    invariant(
                        child.num_blocks * bb == len(child.key), "blocks != tokens / block_size"
                    )
                    invariant(
                        child.depth_end == node.depth_end + len(child.key) // _TOKEN_BYTES,
                        "a node's depth_end is not its parent's plus its own tokens",
                    )
                    if log is None:
                        invariant(child.digests is None, "a node keeps digests with events off")
                    else:
                        start, _, extra = self._chain_start(node)
                        fresh_digests = log.hasher.hashes(start, child.tokens(), self._bs, extra)
                        invariant(
                            child.digests == b"".join(fresh_digests),
                            "a node's event digests are not its chain's hashes",
                        )
                    stack.append(child)
                if node is not root:
                    seen_blocks.append(node.block_ids())
                    if node.children:
                        invariant(node.entry is None, "an interior node is in the leaf index")
                    else:
                        leaves += 1
                        invariant(node.entry is not None, "a leaf is missing from the leaf index")
                        fresh = key_of(node)
                        invariant(
                            isinstance(fresh, tuple),
                            f"eviction order {self._order!r} returned a {type(fresh).__name__}",
                        )
                        invariant(
                            node.entry[:-2] <= fresh,
                            f"a leaf's filed key {node.entry[:-2]} exceeds its fresh key {fresh}: "
                            f"eviction order {self._order!r} lowered a key on a touch",
                        )
                        invariant(node.entry in self._leaves, "a leaf's entry is not in the index")
        want: dict[int, int] = {}
        for (ns_key, data), lengths in self._pins.items():
            for pos in lengths:
                root = self._roots.get(ns_key)
                invariant(root is not None, "a pin's namespace holds nothing")
                node, at = root, 0
                while at < pos:  # walk the pinned prefix node by node (it ends at a node)
                    child = node.children.get(data[at : at + bb])
                    invariant(child is not None, "a pinned prefix left the tree")
                    want[id(child)] = want.get(id(child), 0) + 1
                    node, at = child, at + len(child.key)
                invariant(at == pos, "a pinned prefix does not end at a node")
        pinned_blocks = 0
        for node in self._iter_nodes():
            invariant(node.pinned == want.get(id(node), 0), "a node's pin count is off")
            if node.pinned:
                pinned_blocks += node.num_blocks
        invariant(pinned_blocks == self._num_pinned, "pinned_blocks count is off")
        invariant(self._num_pinned <= self._max_pinned, "pins passed max_pinned_blocks")
        dead = sum(1 for e in self._leaves if e[-1].entry is not e)
        invariant(dead == self._num_dead, "dead leaf-index entries miscounted")
        invariant(leaves == len(self._leaves) - dead, "leaf index misses leaves or has extras")
        blocks = np.concatenate(seen_blocks) if seen_blocks else _EMPTY_BLOCKS
        invariant(len(np.unique(blocks)) == len(blocks), "a block is held by two nodes")
        invariant(len(blocks) == self._num_cached, "cached_blocks count is off")
        invariant(
            not blocks.size or (blocks.min() >= 0 and blocks.max() < self._alloc.num_blocks),
            "a node holds a block id out of range",
        )
        held = np.zeros_like(self._held)
        held[blocks] = True
        invariant((held == self._held).all(), "held-block map disagrees with the tree")
        invariant((self._alloc.refcounts(blocks) >= 1).all(), "the tree holds a free block")
        self._alloc.check()

    def pretty(self, max_tokens: int = 8, max_blocks: int = 6) -> str:
        """The tree as indented text: each node's tokens, blocks and refcounts, abbreviated."""
        lines = [
            f"RadixCache(block_size={self._bs}, eviction={self.eviction!r}, "
            f"cached_blocks={self._num_cached}, free={self._alloc.num_free})"
        ]
        for root in self._roots.values():
            lines.append(f"namespace {root.namespace!r}")
            self._pretty_children(root, "", lines, max_tokens, max_blocks)
        return "\n".join(lines)

    def _pretty_children(
        self, node: _Node, indent: str, lines: list[str], max_tokens: int, max_blocks: int
    ) -> None:
        children = list(node.children.values())
        for i, child in enumerate(children):
            last = i == len(children) - 1
            toks = _abbrev(child.tokens().tolist(), max_tokens)
            blocks = child.block_ids().tolist()
            rcs = self._alloc.refcounts(child.block_ids()).tolist()
            lines.append(
                f"{indent}{'└── ' if last else '├── '}{toks} ({len(child.key) // _TOKEN_BYTES} tok)"
                f" blocks {_abbrev(blocks, max_blocks)} rc {_abbrev(rcs, max_blocks)}"
            )
            self._pretty_children(
                child, indent + ("    " if last else "│   "), lines, max_tokens, max_blocks
            )

    def __str__(self) -> str:
        return self.pretty()

    def __repr__(self) -> str:
        return (
            f"RadixCache(block_size={self._bs}, eviction={self.eviction!r}, "
            f"cached_blocks={self._num_cached})"
        )


def _abbrev(values: list[int], limit: int) -> str:
    if len(values) <= limit:
        return "[" + " ".join(map(str, values)) + "]"
    head = " ".join(map(str, values[: limit - 2]))
    tail = " ".join(map(str, values[-2:]))
    return f"[{head} … {tail}]"
