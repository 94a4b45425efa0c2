"""RadixCache: a compressed trie on token ids that owns refcounted KV blocks.

Each node but the root holds a block-aligned run of tokens and one block per
``block_size`` tokens, stored once as the bytes of an int32 array: the child key is
the first block's bytes, and walking down is one dict lookup plus one
``bytes.startswith`` (a memcmp) per node. Only where a walk ends inside a node are
tokens compared one by one, to find the block boundary (rounded down) where they part.
The tree holds one reference on every block of every node (docs/design.md).

Every leaf sits in a sorted index keyed by the eviction order (``radixkv.cache.leaf_index``,
lazy), so ``evict`` pops victims from the front; leaves whose blocks a request holds are
skipped. Each namespace has its own root, dropped with its last child.

Collaborators: the eviction order (``radixkv.cache.eviction``), KV cache events
(``radixkv.cache.tree_events``; a do-nothing version when off), and, over nodes
rather than the tree, the leaf index, pins (``radixkv.cache.pins``) and inspection
(``radixkv.cache.inspection``). Tiers below the device are a subclass
(``radixkv.cache.tiered``, as SGLang's ``HiRadixCache``) that owns their state and
overrides the template hooks at the end of the class. This class never makes a node
without device blocks; a leaf is a node with device blocks and no child that has any,
so such a node, made by a subclass, needs no case of its own here.
"""

from __future__ import annotations

import warnings
from collections.abc import Hashable, Iterator
from dataclasses import replace
from typing import ClassVar

import numpy as np

from radixkv.cache import inspection, kernels
from radixkv.cache.allocator import BlockAllocator
from radixkv.cache.arrays import (
    BlockSeq,
    TokenSeq,
    as_block_array,
    as_token_array,
    common_prefix_len,
)
from radixkv.cache.events import MEDIUM, KVCacheEvent
from radixkv.cache.eviction import EvictionOrder, check_key, make_eviction_order
from radixkv.cache.hashing import ChainHasher
from radixkv.cache.leaf_index import LeafIndex
from radixkv.cache.node import EMPTY_BLOCKS as _EMPTY_BLOCKS
from radixkv.cache.node import ID_BYTES as _ID_BYTES
from radixkv.cache.node import NO_CHILDREN as _NO_CHILDREN
from radixkv.cache.node import TOKEN_BYTES as _TOKEN_BYTES
from radixkv.cache.node import Node as _Node
from radixkv.cache.node import Root as _Root
from radixkv.cache.node import has_device_child
from radixkv.cache.pins import Pins, pin_key
from radixkv.cache.prefix_cache import check_num_blocks, held_array, namespace_key, release_held
from radixkv.cache.results import CacheStats, MatchResult
from radixkv.cache.tree_events import NO_TREE_EVENTS, NoTreeEvents, TreeEvents
from radixkv.checks import check_int
from radixkv.errors import invariant

__all__ = ["CacheStats", "MatchResult", "RadixCache"]

class RadixCache:
    """Block-level prefix cache over a ``BlockAllocator`` (SGLang-style radix tree).

    ``eviction`` is ``"level"`` (deepest leaves first, LRU within a depth), ``"lru"``
    (least recently used leaf first), any other name in
    ``radixkv.cache.eviction.EVICTION_ORDERS``, or an object with a ``key(node)`` method
    returning a tuple (an ``EvictionOrder``, or any object: it then gets the default
    hooks; ``TypeError`` naming the order if its key of a fresh node is no tuple).

    ``events``: a ``ChainHasher`` turns KV cache events on (``take_events``: a
    ``BlockStored`` per insert that adopts blocks, a ``BlockRemoved`` per block evicted,
    ``AllBlocksCleared`` on reset); None (the default) keeps them off at no cost;
    ``TypeError`` naming ``events`` for anything else. With events on, every method
    taking a namespace refuses one the hasher cannot encode (``ValueError`` naming
    ``namespace``), before any change.

    A host tier is ``radixkv.cache.tiered.TieredRadixCache`` (or ``make_cache``).
    Deprecated, for one release: ``RadixCache(..., host=tier)`` still builds one, with
    a ``DeprecationWarning``; a subclass of this class given a ``host`` raises
    ``TypeError`` naming it.

    One cache per allocator: ``ValueError`` naming ``allocator`` if another live cache
    already claimed it (``radixkv.cache.allocator``). When this cache is
    garbage-collected its references go back to the allocator.

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

    # What the deprecated RadixCache(..., host=tier) builds: the tiered subclass files itself
    # here (``__init_subclass__``), so this module never imports it.
    _tiered_class: ClassVar[type[RadixCache] | None] = None

    def __init_subclass__(cls, *, builds_host_tier: bool = False, **kwargs: object) -> None:
        super().__init_subclass__(**kwargs)
        if builds_host_tier:
            RadixCache._tiered_class = cls

    def __new__(cls, *args: object, **kwargs: object) -> RadixCache:
        if cls is RadixCache and "host" in kwargs:
            warnings.warn(
                "RadixCache(..., host=...) is deprecated and goes in the next release: build "
                "TieredRadixCache(..., host=tier), RadixCache(...) without a tier, or "
                "make_cache('radix', ..., host=tier)",
                DeprecationWarning,
                stacklevel=2,
            )
            if kwargs["host"] is not None:
                cls = RadixCache._tiered_class or cls
        return super().__new__(cls)

    def __init__(
        self,
        allocator: BlockAllocator,
        eviction: str | EvictionOrder = "level",
        *,
        events: ChainHasher | None = None,
        max_pinned_blocks: int | None = None,
        host: None = None,
    ) -> None:
        if not isinstance(allocator, BlockAllocator):
            raise TypeError(f"allocator must be a BlockAllocator, got {type(allocator).__name__}")
        if host is not None:  # only the deprecated spelling passes one (__new__)
            raise TypeError(
                f"host must be None for {type(self).__name__}: a host tier needs "
                f"TieredRadixCache, got {type(host).__name__}"
            )
        if max_pinned_blocks is None:
            max_pinned_blocks = allocator.num_blocks // 2
        # below the pool, so pins never exhaust it
        max_pinned_blocks = check_int(
            "max_pinned_blocks", max_pinned_blocks, low=0, high=allocator.num_blocks - 1
        )
        if events is not None and not isinstance(events, ChainHasher):
            raise TypeError(f"events must be a ChainHasher or None, got {type(events).__name__}")
        self._alloc = allocator
        order = make_eviction_order(eviction)
        check_key(order, order.key(_Node(b"", b"", None, 0, 0)))
        self._order = order.bind(allocator.num_blocks, allocator.block_size)
        self._bs = allocator.block_size
        self._block_bytes = self._bs * _TOKEN_BYTES
        self._roots: dict[Hashable, _Root] = {}  # namespace_key(namespace) -> root
        self._leaves = LeafIndex(self._order)
        self._held = np.zeros(allocator.num_blocks, dtype=np.bool_)
        # the allocator never replaces it; written here only by match (kernels.incref_held)
        self._rc = allocator.refcount_array
        self._num_cached = 0
        self._clock = 0
        self._stats = CacheStats()
        self._pins = Pins(max_pinned_blocks)
        self._events: TreeEvents | NoTreeEvents = (
            NO_TREE_EVENTS if events is None else TreeEvents(events, allocator.block_size)
        )
        self._claim_pools()  # last: nothing after it can fail

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
        return self._events.hasher

    def take_events(self) -> list[KVCacheEvent]:
        """The pending KV cache events, oldest first, and forget them; [] when events are off.

        Complexity: O(1).
        """
        return self._events.take()

    def block_hashes(self, medium: str = MEDIUM) -> list[int]:
        """The wire hashes (``ChainHasher.wire``) of every block the tree holds in ``medium``:
        what its ``BlockStored`` / ``BlockRemoved`` events of that medium net out to.

        ``medium`` is ``"GPU"`` (the device blocks, the default) or ``"CPU"`` (the host
        copies, with a host tier). Unordered (tree order); sort it to compare.
        ``ValueError`` naming ``medium`` for another value, ``"STORAGE"`` included (a
        store drops entries unseen, so its events are never removed and net out to
        nothing the cache could list: docs/store.md), and ``ValueError`` if events
        are off (no block has a hash). Changes nothing. Complexity: O(cached blocks).
        """
        return self._events.block_hashes(self._iter_nodes(), medium)

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
        return inspection.evictable_blocks(self._roots.values(), self._alloc.refcount_array)

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
        return replace(self._stats, pinned_blocks=self._pins.num_blocks)

    # ------------------------------------------------------------------ match
    def match(
        self, tokens: TokenSeq, namespace: Hashable = None, *, stats: bool = True
    ) -> MatchResult:
        """Longest cached block-aligned prefix of ``tokens`` under ``namespace``.

        ``PrefixCache.match``'s contract: one reference on each returned block for the
        caller, who must ``decref`` it; counted in ``stats`` unless ``stats=False`` (a
        caller re-matching a prefix it owns). A match ending inside a node splits it at
        the block boundary. Touches the matched path for the eviction order.
        ``TypeError``/``ValueError`` on bad input, before any change. Complexity:
        O(depth) dict lookups and memcmps, plus O(node length) for the one node where
        the walk ends inside, plus O(matched blocks) to build the result.
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
        # The walk of ``_walk``, inlined: the hot path touches and collects as it goes
        # (measured: the call and a second pass cost ~5%).
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

    def check_namespace(self, namespace: Hashable) -> None:
        """Raise what ``match`` would raise for ``namespace``; change nothing (``PrefixCache``)."""
        self._lookup_root(namespace)

    def peek(self, tokens: TokenSeq, namespace: Hashable = None) -> int:
        """Tokens ``match(tokens, namespace)`` would return now, changing nothing.

        No reference is taken, no node is split, no counter in ``stats`` and no eviction
        clock moves, and an unseen namespace is not registered. Raises as ``match``.
        Complexity: as ``match``, without the result.
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

        ``PrefixCache.insert``'s contract: ``blocks[i]`` holds tokens ``[i * bs, (i + 1) *
        bs)``; the tree adopts (takes its own reference on) the blocks past the cached
        prefix and never touches the caller's, who still owns and must ``decref`` all of
        ``blocks``. ``priority`` (an int, default 0) is what the ``"priority"`` eviction
        order reads: every node on the inserted path keeps the highest priority any insert
        through it gave (lower goes first).

        Raises ``ValueError`` (too few blocks, a free or out-of-range block, also past
        the full blocks, a repeated block, or a block the tree already caches at another
        position, naming its index in ``blocks``) and ``TypeError`` (``blocks`` a set,
        dict, iterator or other unordered or non-integer input), before any change.
        With events on, records one ``BlockStored`` for the adopted blocks, hashed
        before anything changes: a hasher that raises leaves the tree, every refcount
        and the event log as they were.

        Complexity: as ``match`` for the walk, plus O(len(blocks)) to validate
        (one compiled pass), plus O(adopted blocks) (and, with events on, the
        hashing of the adopted blocks' tokens).
        """
        arr = as_token_array(tokens)
        ns_key, root = self._lookup_root(namespace)
        if type(priority) is not int:  # the insert path's common case costs no call
            priority = check_int("priority", priority)
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
        # Nodes held only below the device (past dev_pos) adopt the caller's first new blocks.
        # The device nodes are a root-connected subtree: if the deepest one has blocks, all do.
        if (path and not path[-1].blocks) or (split_child is not None and not split_child.blocks):
            dev_path, dev_pos, _, _ = self._device_part(path, pos, split_child, split_at)
        else:
            dev_path, dev_pos = path, pos
        num_cached = dev_pos // bb
        new = blk[num_cached:n_blocks]
        added = arr[pos // _TOKEN_BYTES : n_blocks * bs]  # the new leaf's tokens
        # Hash the new leaf's blocks before anything changes: a hasher that raises finds the
        # tree, the held map and the event log as they were.
        chain = (
            self._events.hash_leaf(node, split_child, split_at, namespace, added)
            if added.size
            else None
        )
        # Validates all of blk, and marks the adopted blocks held (undone if it fails).
        reason, i = kernels.claim_for_insert(self._rc, self._held, blk, num_cached, n_blocks)
        if reason:
            raise kernels.claim_error(reason, i, blk, self._alloc.num_blocks)

        self._clock += 1
        clock = self._clock
        stats = self._stats
        stats.num_inserts += 1
        leaf = None
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
            rest = new
            if split_child is not None:
                node = self._split(split_child, split_at)
                node.last_access = clock
                if priority > node.priority:
                    node.priority = priority
            if dev_pos != pos:
                hosted = path[len(dev_path) :]
                if split_child is not None:
                    hosted.append(node)  # the split's head has no device blocks either
                rest = self._promote(hosted, new)
            if rest.size:
                data = added.tobytes()
                # what hash_leaf hashed (nothing with events off) goes in the log and the leaf
                digests = None if chain is None else self._events.store_leaf(chain, added)
                leaf = _Node(
                    data,
                    rest.tobytes(),
                    node,
                    node.depth_end + len(rest) * bs,
                    clock,
                    digests,
                    priority,
                )
                if node.entry is not None:
                    self._leaves.forget(node)
                if node.children is _NO_CHILDREN:
                    node.children = {}
                node.children[data[:bb]] = leaf
                lapsed = self._order.on_insert(node, leaf)
                self._leaves.file(leaf)
                for n in lapsed:  # keys the order lowered: re-filed at once
                    if n.entry is not None:
                        self._leaves.forget(n)
                        self._leaves.file(n)
            self._alloc.incref_distinct(new)
            self._num_cached += len(new)
            stats.inserted_tokens += len(new) * bs
            # Last, once the tree is whole: a tier below that raises leaves the leaf cached.
            if leaf is not None:
                self._on_new_leaf(leaf)
        return num_cached * bs

    # -------------------------------------------------------------------- pin
    @property
    def pinned_blocks(self) -> int:
        """Blocks in pinned nodes: never evicted while pinned."""
        return self._pins.num_blocks

    @property
    def max_pinned_blocks(self) -> int:
        """The cap on :attr:`pinned_blocks` (below the pool size, so pins never exhaust it)."""
        return self._pins.max_blocks

    def pin(self, tokens: TokenSeq, namespace: Hashable = None) -> int:
        """Keep the cached block-aligned prefix of ``tokens`` in the tree until :meth:`unpin`.

        A pinned prefix (a system prompt) survives any eviction order; its blocks count in
        :attr:`pinned_blocks`. Pins nest. Returns the tokens pinned (0 if nothing of
        ``tokens`` is cached). No reference is taken, no statistic counted; the path is
        touched as by a match. ``ValueError`` naming ``max_pinned_blocks`` if the newly
        pinned blocks would pass the cap, ``TypeError``/``ValueError`` for bad input,
        before any change. Complexity: as ``match``.
        """
        arr = as_token_array(tokens)
        ns_key, root = self._lookup_root(namespace)
        # Only the device prefix can be pinned: a node below it is already evicted.
        path, pos, split_child, split_at = self._device_part(*self._walk(root, arr))
        self._pins.check_room(path, split_child, split_at)
        if pos == 0:
            return 0
        if split_child is not None:
            path = [*path, self._split(split_child, split_at)]
        self._clock += 1
        for node in path:
            node.last_access = self._clock
        self._pins.add(pin_key(ns_key, arr, self._block_bytes), path)
        return pos // _TOKEN_BYTES

    def unpin(self, tokens: TokenSeq, namespace: Hashable = None) -> int:
        """Undo the latest :meth:`pin` of the same ``tokens`` and ``namespace``; return the
        tokens it had pinned. ``ValueError`` naming ``tokens`` if no such pin is in force
        (``reset`` drops every pin), before any change. Complexity: O(depth of the prefix).
        """
        arr = as_token_array(tokens)
        key = pin_key(namespace_key(namespace), arr, self._block_bytes)
        tokens_pinned = self._pins.remove(key)
        if tokens_pinned is None:
            raise ValueError(
                f"tokens ({len(arr)} tokens) have no pin in force under namespace {namespace!r}"
            )
        return tokens_pinned

    # ------------------------------------------------------------------ evict
    def evict(self, num_blocks: int) -> int:
        """Free at least ``num_blocks`` cached blocks if that many are evictable, else all it can.

        ``PrefixCache.evict``'s contract. Victims are leaves in eviction order, each whole
        (so maybe more than asked). A block a request holds is never freed: a leaf whose
        last block is held is skipped; one of which only a head part is held is split
        there and its tail evicted. A parent becomes a candidate once its last child is
        gone; a root goes with its last child. A custom order whose key is no tuple raises
        ``TypeError`` (what was evicted stays evicted; the index stays whole). With events
        on, records one ``BlockRemoved`` per block that leaves the device.

        Complexity: O((evicted + skipped leaves) * log leaves), plus O(blocks freed).
        """
        check_num_blocks(num_blocks)
        leaves = self._leaves
        rc = self._alloc.refcount_array
        last_busy = kernels.last_busy
        freed = 0
        skipped = []
        try:  # an order whose key turns bad mid-way (TypeError) leaves the index whole
            while freed < num_blocks:
                entry = leaves.pop()
                if entry is None:
                    break
                node = entry[-1]
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
                try:
                    freed += self._evict_leaf(node, ids)
                except BaseException:
                    if node.entry is entry:  # the backup failed: the leaf is as it was
                        skipped.append(entry)
                    raise
                self._on_freed(ids)  # last: a tier below that raises finds the tree whole
        finally:
            leaves.put_back(skipped)
            self._stats.evicted_blocks += freed
        return freed

    def _evict_leaf(self, node: _Node, ids: np.ndarray) -> int:
        """Free leaf ``node``'s device blocks ``ids`` (no request holds them) and delete the node;
        return the blocks freed. A template step (the hooks below): a tier below may keep
        the node instead, raising (if at all) before any change."""
        node.entry = None
        self._order.on_evict(node.parent, node, True)
        freed = self._release(node, ids)
        self._unlink(node)
        return freed

    def _release(self, node: _Node, ids: np.ndarray) -> int:
        """Give back the tree's references on ``node``'s device blocks ``ids``; return the blocks
        freed. The caller takes the node's blocks and index entry."""
        freed = self._alloc.decref_distinct(ids)
        kernels.set_flags(self._held, ids, False)
        self._num_cached -= len(ids)
        self._events.removed(node)
        return freed

    def _unlink(self, node: _Node) -> None:
        """Delete ``node`` (no device blocks of its own left, no children) from its parent;
        file the parent if it became a leaf; a root goes with its last child. A template
        step: a tier below also deletes what it keeps of the node and files the parent
        as its own candidate."""
        parent = node.parent
        del parent.children[node.key[: self._block_bytes]]  # a parent's children are a dict
        node.parent = None
        if not parent.children:
            parent.children = _NO_CHILDREN
            if parent.parent is None:  # the namespace holds nothing more: forget it
                del self._roots[parent.ns_key]
                return
        self._file_leaf(parent)

    def _file_leaf(self, node: _Node) -> None:
        """Index ``node`` if it is a leaf (device blocks, no child with any) and unindexed."""
        if node.blocks and node.entry is None and not has_device_child(node):
            self._leaves.file(node)

    def reset(self) -> None:
        """Drop the tree's reference on every block it holds and empty the tree.

        Blocks no request holds become free; requests keep theirs. Stats are kept.
        With events on, records one ``AllBlocksCleared`` (and nothing per block).
        Complexity: O(cached blocks).
        """
        release_held(self._alloc, self._held)
        self._events.cleared()
        self._roots.clear()
        self._leaves.clear()
        self._num_cached = 0
        self._pins.clear()
        self._order.on_reset()

    # --------------------------------------------------------- template hooks
    # Where a tier below the device acts (radixkv.cache.tiered overrides each). Here each is
    # the tree alone: a no-op, or the whole walk. ``_evict_leaf`` and ``_unlink`` above are
    # steps such a subclass extends.
    def _claim_pools(self) -> None:
        """Claim the pools this cache holds references in (``BlockAllocator._claim``), the
        constructor's last step: a tier below claims its own first, then the device's."""
        self._alloc._claim(self, self._held)

    def _device_part(
        self, path: list[_Node], pos: int, split_child: _Node | None, split_at: int
    ) -> tuple[list[_Node], int, _Node | None, int]:
        """A ``_walk`` result cut to its part on the device (what ``insert`` has cached and
        ``pin`` may pin): all of it here."""
        return path, pos, split_child, split_at

    def _promote(self, nodes: list[_Node], new: np.ndarray) -> np.ndarray:
        """``insert`` walked through ``nodes`` (past ``_device_part``, top-down): they take the
        first of the caller's ``new`` blocks; return the rest. The caller takes the
        references, flags and counts. Here the walk is all on the device: none."""
        invariant(not nodes, "insert met nodes off the device in a tree with no tier below it")
        return new

    def _on_split(self, head: _Node, tail: _Node, k: int) -> None:
        """``head`` took the first ``k`` blocks of ``tail``: a tier below splits its part alike."""

    def _on_new_leaf(self, leaf: _Node) -> None:
        """``insert`` made ``leaf`` and the tree is whole; may raise (the leaf stays cached)."""

    def _on_freed(self, ids: np.ndarray) -> None:
        """``evict`` just freed device blocks ``ids``; may raise (the tree is whole)."""

    # ------------------------------------------------------------- internals
    def _root_of(self, namespace: Hashable) -> _Root | None:
        """The namespace's root, None if it holds nothing; raises as ``_lookup_root``."""
        return self._lookup_root(namespace)[1]

    def _lookup_root(self, namespace: Hashable) -> tuple[Hashable, _Root | None]:
        """``namespace_key(namespace)`` and the namespace's root (None if it holds nothing).

        Raises as ``namespace_key``; with events on, ``ValueError`` naming
        ``namespace`` if the hasher cannot encode it (``check_namespace``), checked
        only when no root has it: a root's namespace passed when it was made.
        """
        ns_key = namespace_key(namespace)
        root = self._roots.get(ns_key)
        if root is None:
            self._events.check_namespace(namespace)
        return ns_key, root

    def _walk(
        self, root: _Node | None, arr: np.ndarray
    ) -> tuple[list[_Node], int, _Node | None, int]:
        """Find the longest cached block-aligned prefix of ``arr`` below ``root``; change nothing.

        Returns ``(path, pos, split_child, split_at)``: the nodes wholly matched,
        in order; the matched length in bytes of int32 tokens; and, where the
        match ends ``split_at >= 1`` blocks inside a further node, that node
        (else None and 0). Every walk but ``match``'s uses it; ``match`` inlines
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

        The head takes the node's place under its parent; the node object itself becomes
        the tail, keeping its children, its depth_end and its leaf-index entry. The events,
        the order and a tier below (``_on_split``) split their parts alongside.
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
        self._events.split(head, node, k)
        node.parent = head
        head.children = {node.key[:bb]: node}
        self._order.on_split(head, node)
        self._on_split(head, node, k)
        return head

    def _iter_nodes(self) -> Iterator[_Node]:
        return inspection.iter_nodes(self._roots.values())

    # ------------------------------------------------------------ inspection
    def check(self) -> None:
        """Verify the tree's invariants (docs/design.md, 1-4 and 7, as far as the tree sees them).

        ``InvariantError`` (also under ``python -O``) naming the first broken one of: the
        structure and digests (``inspection.check_structure``), the leaf index, the pins,
        the eviction order's state, the held blocks and their count, the allocator.
        Complexity: O(nodes + cached blocks + num_blocks), plus rehashing with events on.
        """
        nodes = inspection.check_structure(self._roots, self._block_bytes, self._events)
        leaves: list[_Node] = []
        others: list[_Node] = []
        for n in nodes:
            (leaves if n.blocks and not has_device_child(n) else others).append(n)
        self._leaves.check(leaves, others)
        self._pins.check(nodes, self._roots)
        self._order.check(nodes)
        blocks = np.concatenate([n.block_ids() for n in nodes]) if nodes else _EMPTY_BLOCKS
        inspection.check_held_blocks(blocks, self._held, "device")
        invariant(len(blocks) == self._num_cached, "cached_blocks count is off")
        invariant((self._alloc.refcounts(blocks) >= 1).all(), "the tree holds a free block")
        self._alloc.check()

    def pretty(self, max_tokens: int = 8, max_blocks: int = 6) -> str:
        """The tree as indented text: each node's tokens, blocks and refcounts, abbreviated."""
        header = (
            f"RadixCache(block_size={self._bs}, eviction={self.eviction!r}, "
            f"cached_blocks={self._num_cached}, free={self._alloc.num_free})"
        )
        rc = self._alloc.refcount_array
        return inspection.render(header, self._roots.values(), rc, max_tokens, max_blocks)

    __str__ = pretty

    def __repr__(self) -> str:
        return (
            f"RadixCache(block_size={self._bs}, eviction={self.eviction!r}, "
            f"cached_blocks={self._num_cached})"
        )
