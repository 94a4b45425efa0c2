"""TieredRadixCache: the radix tree with tiers below the device (host memory; HiCache-style).

``TieredRadixCache(allocator, host=HostTier(...))`` (or ``make_cache("radix", ...,
host=...)``) is a subclass of the tree, as SGLang's ``HiRadixCache`` is: it owns all
of the tiers' state, overrides the tree's template hooks (no-ops in
``radixkv.cache.radix``) and has its own ``match``, ``peek``, ``load``, ``evict_host``,
``reset`` and ``check``; the base tree stays whole. What each write policy means is
``radixkv.cache.host``'s docstring.

**The chain of tiers.** Residency goes down a chain: the device (a node's
``blocks``), then the host (``Node.host``, a copy in the host pool). A node
below the device keeps its place in the tree with ``blocks == b""``; device
nodes form a root-connected subtree, and every node a lower tier keeps is one
the tier above dropped or mirrored. The tree calls one hook per event (a
split, a new leaf, a device leaf evicted or unlinked, freed blocks, the walk's
device part, an insert through nodes off the device), and this class forwards
each event down the chain: the host, and below it the store tier
(``HostTier.store``, ``radixkv.cache.store.tier``; ``NoStore`` when there is none).

**Where a tier below the host plugs in** (a KV store on local disk or a
distributed store: does a run of blocks exist, batched put and get, keyed by
the chained block hashes), all in this class and none in ``radixkv.cache.radix``:
host eviction (``_evict_host``: a deleted host-only leaf is written to the store
first under ``write_back``), backup (``_backup``: written through to the store
under ``write_through``), ``match`` (asks the store for the run past the host
prefix) and ``load`` (brings that run through the host); the store also splits
its digests with a node (``_on_split``), claims itself with the pools and adds
its own invariants to ``check``. Each write reports the run of the node's blocks
the store took, which the event log records as a ``BlockStored`` on
``"STORAGE"`` (``_announce_stored``; nothing records a store's evictions).

**The host tier's state** (all of it here): the host pool's held-block map,
the host eviction index over two kinds of candidates (host-only leaves,
deleted when chosen, and host mirrors of device-resident nodes, whose copy
alone goes), keyed by the host's own eviction order and kept in
``Node.host_entry``, and the nodes a load is bringing in (never deleted
meanwhile).
"""

from __future__ import annotations

from collections.abc import Hashable
from dataclasses import replace

import numpy as np
from sortedcontainers import SortedList

from radixkv.cache import inspection, kernels
from radixkv.cache.allocator import BlockAllocator
from radixkv.cache.arrays import TokenSeq, as_token_array
from radixkv.cache.events import HOST_MEDIUM, STORAGE_MEDIUM
from radixkv.cache.eviction import EvictionOrder, make_eviction_order
from radixkv.cache.hashing import ChainHasher
from radixkv.cache.host import HostTier
from radixkv.cache.node import EMPTY_BLOCKS, ID_BYTES, NO_CHILDREN, TOKEN_BYTES, Node, Root
from radixkv.cache.prefix_cache import check_num_blocks, release_held
from radixkv.cache.radix import RadixCache
from radixkv.cache.results import CacheStats, MatchResult
from radixkv.cache.store.tier import DIGEST_BYTES, NO_STORE, NoStore, StoreTier
from radixkv.errors import invariant

__all__ = ["TieredRadixCache", "check_host_tier"]


def check_host_tier(host: object, allocator: object) -> None:
    """``TypeError``/``ValueError`` naming ``host`` unless it is a ``HostTier`` whose pool is
    its own and has ``allocator``'s block size (when ``allocator`` is a ``BlockAllocator``:
    the tree's constructor names any other)."""
    if host is None:
        raise TypeError("host must be a HostTier for a TieredRadixCache, got None")
    if not isinstance(host, HostTier):
        raise TypeError(f"host must be a HostTier or None, got {type(host).__name__}")
    if host.allocator is allocator:
        raise ValueError("host.allocator must be a pool of its own, not the device's")
    if isinstance(allocator, BlockAllocator) and host.allocator.block_size != allocator.block_size:
        raise ValueError(
            f"host.allocator.block_size must equal the device pool's "
            f"{allocator.block_size}, got {host.allocator.block_size}"
        )


class TieredRadixCache(RadixCache, builds_host_tier=True):
    """A ``RadixCache`` whose evicted prefixes wait in host memory (``host=HostTier(...)``).

    Takes ``RadixCache``'s arguments, ``host`` required: ``TypeError``/``ValueError``
    naming ``host`` unless its pool is a separate allocator of the device's block
    size; ``ValueError`` naming ``allocator`` if another live cache claimed the
    host pool. Every ``RadixCache`` method keeps its contract; a node holds device
    blocks, a host copy or both, and:

    - ``match`` stops at the device boundary and reports the host-only tokens past
      it (``MatchResult.host_num_tokens``); ``load`` copies them back (this class is
      a ``LoadingCache``: the KV manager looks prefixes up through ``load``);
    - ``insert`` gives host-only nodes on its path the caller's blocks again; under
      ``write_through`` with 0 hits it backs the new leaf up at once (a copier that
      raises leaves the leaf cached, without a host copy);
    - ``evict`` keeps a node that has (or, under ``write_back``, gets now) a host
      copy as a host-only node; one that cannot be backed up is deleted with its
      host-only subtree and counted in ``skipped_backup_blocks``;
    - ``evict_host`` frees host blocks; ``stats.host_blocks`` counts the host blocks
      in use; ``check`` adds the tiers' invariants (docs/design.md, invariant 9).

    >>> alloc = BlockAllocator(num_blocks=4, block_size=2)
    >>> cache = TieredRadixCache(alloc, "lru", host=HostTier(BlockAllocator(8, 2)))
    >>> blocks = alloc.alloc(2)
    >>> cache.insert([1, 2, 3, 4], blocks)
    0
    >>> alloc.decref(blocks), cache.evict(2)          # the device lets go; the host keeps a copy
    (0, 2)
    >>> m = cache.match([1, 2, 3, 4, 5])
    >>> m.num_tokens, m.host_num_tokens
    (0, 4)
    >>> m = cache.load([1, 2, 3, 4, 5])               # back on the device: refs as for a hit
    >>> m.num_tokens, m.loaded_num_tokens
    (4, 4)
    >>> alloc.decref(m.blocks)
    0
    """

    def __init__(
        self,
        allocator: BlockAllocator,
        eviction: str | EvictionOrder = "level",
        *,
        host: HostTier | None = None,
        events: ChainHasher | None = None,
        max_pinned_blocks: int | None = None,
    ) -> None:
        check_host_tier(host, allocator)
        self._tier = host
        self._host_alloc = host.allocator
        self._copier = host.copier
        self._host_order = make_eviction_order(host.eviction)
        self._host_held = np.zeros(host.allocator.num_blocks, dtype=np.bool_)
        self._host_leaves = SortedList()  # host eviction candidates: (*key, uid, node)
        self._host_uid = 0
        self._write_through = host.write_policy == "write_through"
        self._write_through_hits = host.write_through_hits
        self._loading: set[Node] = set()  # nodes a load is bringing in: never deleted
        self._store: StoreTier | NoStore = NO_STORE if host.store is None else host.store
        # the tree's own arguments and state; it claims both pools last (_claim_pools)
        super().__init__(allocator, eviction, events=events, max_pinned_blocks=max_pinned_blocks)
        # with events on, a put that wrote fewer blocks than it offered asks what is stored
        self._confirm_puts = self._events.hasher is not None

    # ------------------------------------------------------------ properties
    @property
    def host(self) -> HostTier:
        """The host tier (``radixkv.cache.host``)."""
        return self._tier

    @property
    def host_cached_blocks(self) -> int:
        """Host blocks holding a copy of some node. Complexity: O(1)."""
        return self._tier.used_blocks

    @property
    def stats(self) -> CacheStats:
        """``RadixCache.stats``, and ``host_blocks``: the host blocks holding a copy now."""
        return replace(super().stats, host_blocks=self._tier.used_blocks)

    @property
    def store(self) -> StoreTier | None:
        """The store tier below the host (``HostTier.store`` at construction), None without one."""
        return self._store if isinstance(self._store, StoreTier) else None

    # ------------------------------------------------------------ the walks
    def match(
        self, tokens: TokenSeq, namespace: Hashable = None, *, stats: bool = True
    ) -> MatchResult:
        """``RadixCache.match``: the device prefix, and the host-only tokens past it.

        ``num_tokens`` is the longest prefix on the device (its blocks the
        caller's, one reference each), ``host_num_tokens`` how far the
        prefix goes on past it on the host alone, and ``store_num_tokens`` how
        far on past both the store tier holds it (``HostTier.store``; one
        ``contains_run``, never an error: a faulty store finds 0). Touches (and counts a hit on)
        every matched node of both tiers; with ``write_through``, backs up each
        device node of the prefix whose hits reach the threshold (a copier that
        raises leaves the node without a copy, before the caller gets any
        reference). Complexity: as ``RadixCache.match``, plus the backups, plus with a
        store the hashing of the query's tokens past the tree's match.
        """
        arr = as_token_array(tokens)
        root = self._root_of(namespace)
        self._clock += 1
        clock = self._clock
        counters = self._stats
        if stats:
            counters.num_matches += 1
            counters.query_tokens += len(arr)
        path, pos, split_child, split_at = self._walk(root, arr)
        rest = arr[pos // TOKEN_BYTES :]
        store_tokens = self._store.lookup(path, split_child, split_at, rest, namespace) * self._bs
        dev_path, dev_pos, dev_split, dev_split_at = self._device_part(
            path, pos, split_child, split_at
        )
        touched = path
        if dev_split is not None:
            head = self._split(dev_split, dev_split_at)
            dev_path = [*dev_path, head]
            touched = dev_path
        for node in touched:
            node.last_access = clock
            node.hits += 1
        if self._write_through:
            need = self._write_through_hits
            for node in dev_path:
                if node.host is None and node.hits >= need:
                    self._backup(node)
        num_tokens = dev_pos // TOKEN_BYTES
        host_tokens = (pos - dev_pos) // TOKEN_BYTES
        if stats:
            counters.hit_tokens += num_tokens
            counters.host_hit_tokens += host_tokens
        if not dev_path:
            return MatchResult(EMPTY_BLOCKS, 0, host_tokens, 0, store_tokens)
        blocks = np.frombuffer(bytearray().join(n.blocks for n in dev_path), dtype=np.int32)
        kernels.incref_held(self._rc, blocks)
        return MatchResult(blocks, num_tokens, host_tokens, 0, store_tokens)

    def peek(self, tokens: TokenSeq, namespace: Hashable = None) -> int:
        """``RadixCache.peek``: the device prefix ``match`` would return, changing nothing."""
        arr = as_token_array(tokens)
        _, pos, _, _ = self._device_part(*self._walk(self._root_of(namespace), arr))
        return pos // TOKEN_BYTES

    def load(
        self, tokens: TokenSeq, namespace: Hashable = None, *, stats: bool = True
    ) -> MatchResult:
        """``match``, then bring the host-resident part of the prefix back to the device.

        When nothing of the prefix is on the host alone or in the store, this is
        ``match``. The store's run (``store_num_tokens``) is read first, as much of it
        as the host pool can hold (a block the store no longer gives, or gives
        unsound, ends the run there: the rest is recomputed), its bytes held while
        the host makes room for them (evicting; write-backs to the store cannot take
        them away), then copied into host blocks and filed as a host-only node past
        the others: unless the store dropped some of it since ``match``'s lookup (a
        ``write_through`` backup in ``match`` itself may) or the host pool cannot
        hold it, the whole run comes. Then the host-only nodes past
        the device prefix are loaded
        top-down, node by node and all-or-nothing per node (a prefix ending
        inside a node splits it first): device blocks are allocated, evicting
        first when the pool is short (the loading nodes cannot be deleted
        meanwhile, and the matched prefix is held by the caller so it cannot be
        evicted), the host blocks are copied in (``HostTier.copier``), and the
        node becomes device-resident again with its host copy kept. The load
        stops at the first node the pool cannot take. The caller gets one
        reference on every returned block, as from ``match``;
        ``host_num_tokens`` is what is still on the host alone,
        ``store_num_tokens`` what of the store's run did not reach the host,
        ``loaded_num_tokens`` what was loaded (the last blocks of the result);
        the three with ``num_tokens`` add up to ``match``'s. ``store_loaded_num_tokens``
        is the store's run when it was loaded too (the last of ``loaded_num_tokens``),
        else 0: a run that reached the host alone is loaded, from the host, by a later
        ``load``.
        Counts ``loaded_blocks``; with events on, records a ``BlockStored``
        (medium ``"GPU"``) per loaded node.

        Raises as ``match``, before any change. If the copier (or an eviction's
        backup) raises, the caller gets no reference: the nodes loaded before
        stay loaded, the failing one stays host-only, and the tree is whole.
        Complexity: ``match``, plus a second walk, plus the eviction and the
        copy of the loaded blocks.
        """
        m = self.match(tokens, namespace, stats=stats)
        if not m.host_num_tokens and not m.store_num_tokens:
            return m
        arr = as_token_array(tokens)
        path, pos, split_child, split_at = self._walk(self._root_of(namespace), arr)
        nodes = [n for n in path if not n.blocks]
        tip = path[-1] if path else None
        if split_child is not None and not split_child.blocks:
            tip = self._split(split_child, split_at)
            nodes.append(tip)
        alloc = self._alloc
        parts = [m.block_array]
        loaded = fetched = from_store = 0
        fetched_node = None
        self._loading.update(nodes)
        try:
            # The store's run starts where match's walk ended (its backups may have cut it).
            if m.store_num_tokens and pos // TOKEN_BYTES == m.num_tokens + m.host_num_tokens:
                fetched_node = self._fetch(
                    tip, arr[pos // TOKEN_BYTES :], namespace, m.store_num_tokens
                )
                if fetched_node is not None:
                    self._loading.add(fetched_node)
                    nodes.append(fetched_node)
                    fetched = len(fetched_node.key) // TOKEN_BYTES
            need = sum(n.num_blocks for n in nodes)
            if alloc.num_free < need:
                self.evict(need - alloc.num_free)
            for node in nodes:
                k = node.num_blocks
                if alloc.num_free < k:
                    break
                ids = alloc.alloc_array(k)  # the tree's reference
                try:
                    self._copier.load(node.host_ids(), ids)
                except BaseException:
                    alloc.unalloc(ids)  # the node stays host-only
                    raise
                kernels.set_flags(self._held, ids, True)
                self._num_cached += k
                self._attach(node, ids)
                alloc.incref_distinct(ids)  # the caller's: the next eviction cannot take it
                parts.append(ids)
                loaded += k
                if node is fetched_node:  # the last of nodes: all of the store's run
                    from_store = k
        except BaseException:
            for part in parts:  # the caller never gets them: give its references back
                alloc.decref_distinct(part)
            raise
        finally:
            self._loading.difference_update(nodes)
            self._stats.loaded_blocks += loaded
        moved = loaded * self._bs
        blocks = np.concatenate(parts) if loaded else m.block_array
        host_tokens = m.host_num_tokens + fetched - moved
        return MatchResult(
            blocks,
            m.num_tokens + moved,
            host_tokens,
            moved,
            m.store_num_tokens - fetched,
            from_store * self._bs,
        )

    def _fetch(
        self, tip: Node | None, tokens: np.ndarray, namespace: Hashable, num_tokens: int
    ) -> Node | None:
        """Bring the run the store tier's last lookup found (``num_tokens`` of ``tokens``)
        into fresh host blocks, filed as a host-only leaf below ``tip`` (None: the
        namespace's root); None when nothing came.

        The run is read first, no more of it than the host pool can hold once every host
        block but those of the nodes this load holds is evicted, and its bytes are held
        (``StoreTier.read``); then the host makes room for what was read, and under
        ``write_back`` the puts of that eviction may evict store entries, but not the
        bytes in hand; then they fill the host blocks (``StoreTier.fill``). A block the
        store no longer gives ends the run there, and no host room is made past it."""
        halloc = self._host_alloc
        pinned = sum(len(n.host) for n in self._loading) // ID_BYTES  # no eviction frees these
        n = self._store.read(min(num_tokens // self._bs, halloc.num_blocks - pinned))
        if not n:
            return None
        if halloc.num_free < n:
            self._evict_host(n - halloc.num_free)
        hids = halloc.alloc_array(min(n, halloc.num_free))  # the tree's reference, if kept
        try:
            digests = self._store.fill(hids)
        except BaseException:
            halloc.unalloc(hids)
            raise
        n = len(digests) // DIGEST_BYTES
        if n < len(hids):
            halloc.decref_distinct(hids[n:])
        if not n:
            return None
        return self._graft(tip, tokens[: n * self._bs], hids[:n], namespace, digests)

    def _graft(
        self,
        tip: Node | None,
        tokens: np.ndarray,
        hids: np.ndarray,
        namespace: Hashable,
        digests: bytes,
    ) -> Node:
        """A new host-only leaf: ``tokens`` on host blocks ``hids`` (the tree's reference)
        below ``tip`` (None: the namespace's root, made if absent), keeping ``digests``."""
        ns_key, root = self._lookup_root(namespace)
        parent = root if tip is None else tip
        chain = self._events.hash_leaf(parent, None, 0, namespace, tokens)
        if parent is None:
            parent = self._roots[ns_key] = Root(namespace, ns_key, self._clock)
        data = tokens.tobytes()
        leaf = Node(
            data,
            b"",
            parent,
            parent.depth_end + len(tokens),
            self._clock,
            None if chain is None else b"".join(chain.digests),
        )
        leaf.host = hids.tobytes()
        leaf.store_digests = digests
        kernels.set_flags(self._host_held, hids, True)
        if parent.children is NO_CHILDREN:
            parent.children = {}
        parent.children[data[: self._block_bytes]] = leaf
        self._host_index(leaf)  # a host-only leaf: a host eviction candidate
        self._events.stored(leaf, HOST_MEDIUM)
        return leaf


    # ------------------------------------------------- nodes back on the device
    def _device_part(
        self, path: list[Node], pos: int, split_child: Node | None, split_at: int
    ) -> tuple[list[Node], int, Node | None, int]:
        """A ``_walk`` result cut to its device-resident part: the nodes down to the first one
        with no device blocks, their length in bytes, and the split only if its node is on
        the device."""
        for i, node in enumerate(path):
            if not node.blocks:
                return path[:i], path[i - 1].depth_end * TOKEN_BYTES if i else 0, None, 0
        if split_child is not None and not split_child.blocks:
            return path, pos - split_at * self._block_bytes, None, 0
        return path, pos, split_child, split_at

    def _promote(self, nodes: list[Node], new: np.ndarray) -> np.ndarray:
        """Give ``nodes`` (top-down, a chain, no device blocks) the caller's ``new`` blocks.

        An insert computed these positions again; the nodes become device-resident
        (the host keeps its copy). Returns the blocks past them. The caller
        takes the references, flags and counts, as for any adopted block.
        """
        at = 0
        for node in nodes:
            k = node.num_blocks
            self._attach(node, new[at : at + k])
            at += k
        return new[at:]

    def _attach(self, node: Node, ids: np.ndarray) -> None:
        """Make ``node`` (no device blocks) device-resident on ``ids`` (its parent is, or is a
        root): a leaf of the tree, and with its host copy a mirror, a host eviction
        candidate. The caller takes the references, flags and counts."""
        node.blocks = ids.tobytes()
        parent = node.parent
        if parent.entry is not None:
            self._leaves.forget(parent)  # it has a device child now
        self._leaves.file(node)  # its children, if any, have no device blocks
        if node.host_entry is None:
            self._host_index(node)
        self._events.stored(node)

    # ------------------------------------------------------------ host eviction
    def evict_host(self, num_blocks: int) -> int:
        """Free at least ``num_blocks`` host blocks if that many can go, else all it can.

        Candidates, in the host tier's own order: host-only leaves (deleted
        from the tree) and host mirrors of device-resident nodes (the copy goes,
        the node stays). Nodes a load holds are skipped. Returns the host blocks
        freed. ``ValueError``/``TypeError`` for a bad ``num_blocks``, before any
        change. Complexity: O((freed + skipped candidates) * log candidates).
        """
        check_num_blocks(num_blocks)
        return self._evict_host(num_blocks)

    def _evict_host(self, num_blocks: int) -> int:
        # self._host_leaves, never a local alias: re-filing an entry (_host_index) may rebuild
        # the index into a new list, and what this loop pops and puts back must be that one.
        key = self._host_order.key
        loading = self._loading
        freed = 0
        skipped = []
        try:
            while freed < num_blocks and self._host_leaves:
                entry = self._host_leaves.pop(0)
                node = entry[-1]
                if node.host_entry is not entry:
                    continue  # dead: re-filed, or its copy is gone
                if node.host is None or (not node.blocks and node.children):
                    node.host_entry = None  # not a candidate now; re-filed when it is
                    continue
                fresh = key(node)
                if entry[:-2] != fresh:
                    self._host_index(node)
                    continue
                if node in loading:
                    skipped.append(entry)
                    continue
                node.host_entry = None
                if not node.blocks:  # write_back: to the store before it goes
                    put = self._store.released(node, confirm=self._confirm_puts)
                    self._announce_stored(node, put)
                freed += self._release_copy(node)
                if not node.blocks:
                    self._unlink(node)
        finally:
            self._host_leaves.update(skipped)
        return freed

    def _backup(self, node: Node) -> bool:
        """Copy device-resident ``node`` to newly taken host blocks; False if none can be had.

        Evicts from the host first when it is short (never ``node`` itself, which
        has no copy yet). A copier that raises leaves ``node`` without a copy and
        its host blocks free (what the host eviction freed stays free).
        Complexity: O(blocks) plus the host eviction and the copy.
        """
        k = node.num_blocks
        halloc = self._host_alloc
        if halloc.num_free < k:
            self._evict_host(k - halloc.num_free)
            if halloc.num_free < k:
                return False
        hids = halloc.alloc_array(k)  # the tree's one reference
        try:
            self._copier.backup(node.block_ids(), hids)
        except BaseException:
            halloc.unalloc(hids)  # a copy that failed holds no host block
            raise
        node.host = hids.tobytes()
        kernels.set_flags(self._host_held, hids, True)
        self._host_index(node)
        self._stats.backed_up_blocks += k
        self._events.stored(node, HOST_MEDIUM)
        # write_through: to the store as well
        self._announce_stored(node, self._store.backed_up(node, confirm=self._confirm_puts))
        return True

    def _announce_stored(self, node: Node, num_blocks: int) -> None:
        """The store tier's put left ``node``'s first ``num_blocks`` blocks stored: with events
        on, a ``BlockStored`` on ``"STORAGE"`` for them (no store eviction is ever seen, so
        none is removed: docs/store.md, "KV events")."""
        if num_blocks:
            self._events.stored(node, STORAGE_MEDIUM, num_blocks)

    def _release_copy(self, node: Node) -> int:
        """Drop ``node``'s host copy; return its blocks."""
        hids = node.host_ids()
        self._host_alloc.decref_distinct(hids)
        kernels.set_flags(self._host_held, hids, False)
        node.host = None
        self._stats.host_evicted_blocks += len(hids)
        self._events.removed(node, HOST_MEDIUM)
        return len(hids)

    def _host_index(self, node: Node) -> None:
        """File ``node`` as a host eviction candidate under its fresh key."""
        key = self._host_order.key(node)
        self._host_uid += 1
        node.host_entry = (*key, self._host_uid, node)
        leaves = self._host_leaves
        leaves.add(node.host_entry)
        if len(leaves) > 64 + 2 * self._tier.used_blocks:  # mostly dead entries: rebuild
            self._host_leaves = SortedList(e for e in leaves if e[-1].host_entry is e)

    # ------------------------------------------- the tree's template hooks, for the host
    def _claim_pools(self) -> None:
        """The store and the host pool first, then the device's (the tree's)."""
        self._store.claim(self)
        self._host_alloc._claim(self, self._host_held)
        super()._claim_pools()

    def _on_split(self, head: Node, tail: Node, k: int) -> None:
        """A host copy (and the store digests) split at the same boundary as the node."""
        self._store.split(head, tail, k)
        host = tail.host
        if host is not None:
            head.host = host[: k * ID_BYTES]
            tail.host = host[k * ID_BYTES :]
            if head.blocks:  # a mirror of a device-resident node: a host eviction candidate
                self._host_index(head)

    def _on_new_leaf(self, leaf: Node) -> None:
        """Under ``write_through`` with 0 hits, a new leaf is backed up at once."""
        if self._write_through and not self._write_through_hits:
            self._backup(leaf)

    def _evict_leaf(self, node: Node, ids: np.ndarray) -> int:
        """A leaf with a host copy stays, host-only (a host eviction candidate once it has no
        children). Under ``write_back`` a node without a copy is backed up now; one that
        cannot be (no host space even after host eviction) counts in
        ``skipped_backup_blocks`` and is deleted as in the tree, with the nodes below it."""
        if node.host is None and not self._write_through and not self._backup(node):
            self._stats.skipped_backup_blocks += node.num_blocks
        if node.host is None:
            return super()._evict_leaf(node, ids)
        node.entry = None
        parent = node.parent
        self._order.on_evict(parent, node, False)
        freed = self._release(node, ids)
        node.blocks = b""
        self._file_leaf(parent)
        if not node.children and node.host_entry is None:
            self._host_index(node)
        return freed

    def _unlink(self, node: Node) -> None:
        """Also delete the nodes below ``node`` (all host-only: its device blocks went), and
        file a host-only parent left with no children as a host eviction candidate."""
        if node.children:
            self._drop_below(node)
        parent = node.parent
        super()._unlink(node)
        if (
            parent.parent is not None
            and not parent.blocks
            and not parent.children
            and parent.host_entry is None
        ):
            self._host_index(parent)

    def _drop_below(self, node: Node) -> None:
        """Delete every node below ``node`` (all host-only, as its device blocks are going)."""
        stack = list(node.children.values())
        while stack:
            child = stack.pop()
            invariant(child not in self._loading, "a host node a load holds was deleted")
            child.host_entry = None
            self._release_copy(child)
            child.parent = None
            stack.extend(child.children.values())
        node.children = NO_CHILDREN

    def _on_freed(self, ids: np.ndarray) -> None:
        """The copier may poison the freed device blocks (``BlockCopier.discard``)."""
        self._copier.discard(ids)

    def reset(self) -> None:
        """``RadixCache.reset``; every host block goes back too."""
        super().reset()
        release_held(self._host_alloc, self._host_held)
        self._host_leaves.clear()

    def check(self) -> None:
        """``RadixCache.check``, then the host tier's invariants (docs/design.md, invariant 9).

        Device nodes form a root-connected subtree, an evicted node has a host
        copy spanning its tokens, host blocks are distinct and held by the tree
        alone, every host candidate is indexed, no node is marked loading
        outside a load, and the host allocator's own.
        Complexity: O(nodes + cached and host blocks + both pools).
        """
        super().check()
        nodes = list(self._iter_nodes())
        bb = self._block_bytes
        invariant(not self._loading, "nodes are still marked loading outside a load")
        live = set(map(id, self._host_leaves))
        copies: list[np.ndarray] = []
        for node in nodes:
            parent = node.parent
            if node.blocks:
                invariant(
                    parent.parent is None or parent.blocks,
                    "device-resident nodes are not a root-connected subtree",
                )
            else:
                invariant(node.host is not None, "an evicted node has no host copy")
            if node.host is None:
                continue
            invariant(
                len(node.host) // ID_BYTES * bb == len(node.key),
                "a node's host copy does not span its tokens (a split cut the tiers apart)",
            )
            copies.append(node.host_ids())
            if node.blocks or not node.children:
                entry = node.host_entry
                invariant(
                    entry is not None and id(entry) in live and entry[-1] is node,
                    "a host eviction candidate is missing from the host index",
                )
        ids = np.concatenate(copies) if copies else EMPTY_BLOCKS
        halloc = self._host_alloc
        inspection.check_held_blocks(ids, self._host_held, "host")
        invariant(
            (halloc.refcount_array == self._host_held).all(),
            "a host block is held by someone besides the tree, or a copy's block is free",
        )
        invariant(self._tier.used_blocks <= halloc.num_blocks, "host usage passed its capacity")
        halloc.check()
        self._store.check(nodes)
