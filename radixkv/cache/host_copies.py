"""The radix tree's host tier: host copies of its nodes, their eviction index, backup and load.

``RadixCache(allocator, host=HostTier(...))`` delegates everything about host
copies to a :class:`HostCopies`; without a host tier it holds
:data:`NO_HOST_COPIES`, which keeps none (SGLang's HiCache, likewise, is a
structure beside the tree). The tree still owns the nodes: a node holds device
blocks, a host copy (``Node.host``), or both; this object decides when a copy
is made (the write policy), keeps the host eviction candidates in its own
sorted index (``Node.host_entry``), and frees host blocks (``evict``). What
each policy means is ``radixkv.cache.host``'s docstring.

Host eviction can delete host-only leaves from the tree: the tree passes its
deletion step in (``unlink``) and this object holds it weakly, so the tree is
never kept alive by its own tier (the allocator takes the tree's references
back when it is collected).
"""

from __future__ import annotations

import weakref
from collections.abc import Callable, Iterable

import numpy as np
from sortedcontainers import SortedList

from radixkv.cache import kernels
from radixkv.cache.allocator import BlockAllocator
from radixkv.cache.events import HOST_MEDIUM
from radixkv.cache.eviction import make_eviction_order
from radixkv.cache.host import HostTier
from radixkv.cache.node import EMPTY_BLOCKS, ID_BYTES, NO_CHILDREN, TOKEN_BYTES, Node
from radixkv.cache.prefix_cache import release_held
from radixkv.cache.results import CacheStats
from radixkv.cache.tree_events import NoTreeEvents, TreeEvents
from radixkv.errors import invariant

__all__ = ["NO_HOST_COPIES", "HostCopies", "NoHostCopies", "check_host_tier"]

Path = tuple[list[Node], int, "Node | None", int]  # RadixCache._walk's result


def check_host_tier(host: object, allocator: BlockAllocator) -> None:
    """``TypeError``/``ValueError`` naming ``host`` unless it is a ``HostTier`` (or None) whose
    pool is its own and has ``allocator``'s block size."""
    if host is None:
        return
    if not isinstance(host, HostTier):
        raise TypeError(f"host must be a HostTier or None, got {type(host).__name__}")
    if host.allocator is allocator:
        raise ValueError("host.allocator must be a pool of its own, not the device's")
    if host.allocator.block_size != allocator.block_size:
        raise ValueError(
            f"host.allocator.block_size must equal the device pool's "
            f"{allocator.block_size}, got {host.allocator.block_size}"
        )


class HostCopies:
    """A tree's host tier (``RadixCache(..., host=tier)``): copies, their index, the policy.

    Owned by one tree. Writes ``Node.host`` and ``Node.host_entry`` of the
    tree's nodes, the host pool's refcounts (one reference per host block in a
    copy) and the host counters of ``stats``; records ``"CPU"`` events through
    ``events``. ``unlink(node)`` is the tree's deletion of a host-only leaf.
    """

    tiered = True  # the tree's match dispatches once, at entry, on this

    def __init__(
        self,
        tier: HostTier,
        device: BlockAllocator,
        stats: CacheStats,
        events: TreeEvents | NoTreeEvents,
        unlink: Callable[[Node], None],
    ) -> None:
        check_host_tier(tier, device)
        self.tier = tier
        self._alloc = tier.allocator
        self._copier = tier.copier
        self._order = make_eviction_order(tier.eviction)
        self._held = np.zeros(tier.allocator.num_blocks, dtype=np.bool_)
        self._leaves = SortedList()  # host eviction candidates: (*key, uid, node)
        self._uid = 0
        self._write_through = tier.write_policy == "write_through"
        self._write_through_hits = tier.write_through_hits
        self._loading: set[Node] = set()  # nodes a load is bringing in: never deleted
        self._block_bytes = device.block_size * TOKEN_BYTES
        self._stats = stats
        self._events = events
        self._unlink = weakref.WeakMethod(unlink)  # type: ignore[arg-type]

    def claim(self, cache: object) -> None:
        """Make ``cache`` the one cache over the host pool (``BlockAllocator._claim``)."""
        self._alloc._claim(cache, self._held)

    @property
    def used_blocks(self) -> int:
        """Host blocks holding a copy now. Complexity: O(1)."""
        return self.tier.used_blocks

    # ------------------------------------------------------------ the walk
    def device_part(
        self, path: list[Node], pos: int, split_child: Node | None, split_at: int
    ) -> Path:
        """A ``_walk`` result cut to its device-resident part: the nodes down to the first
        host-only one, their length in bytes, and the split only if its node is on the device."""
        for i, node in enumerate(path):
            if not node.blocks:
                return path[:i], path[i - 1].depth_end * TOKEN_BYTES if i else 0, None, 0
        if split_child is not None and not split_child.blocks:
            return path, pos - split_at * self._block_bytes, None, 0
        return path, pos, split_child, split_at

    # ------------------------------------------------------------ backup
    def matched(self, nodes: list[Node]) -> None:
        """A match touched the device ``nodes``: under ``write_through``, back up each one whose
        hits reached the threshold."""
        if self._write_through:
            need = self._write_through_hits
            for node in nodes:
                if node.host is None and node.hits >= need:
                    self.backup(node)

    def inserted(self, leaf: Node) -> None:
        """A new device ``leaf``: backed up at once under ``write_through`` with 0 hits."""
        if self._write_through and not self._write_through_hits:
            self.backup(leaf)

    def backup(self, node: Node) -> bool:
        """Copy device-resident ``node`` to newly taken host blocks; False if none can be had.

        Evicts from the host first when it is short (never ``node`` itself, which
        has no copy yet). A copier that raises leaves ``node`` without a copy and
        its host blocks free (what the host eviction freed stays free).
        Complexity: O(blocks) plus the host eviction and the copy.
        """
        k = node.num_blocks
        halloc = self._alloc
        if halloc.num_free < k:
            self.evict(k - halloc.num_free)
            if halloc.num_free < k:
                return False
        hids = halloc.alloc_array(k)  # the tree's one reference
        try:
            self._copier.backup(node.block_ids(), hids)
        except BaseException:
            halloc.unalloc(hids)  # a copy that failed holds no host block
            raise
        node.host = hids.tobytes()
        kernels.set_flags(self._held, hids, True)
        self._index(node)
        self._stats.backed_up_blocks += k
        self._events.stored(node, HOST_MEDIUM)
        return True

    def keeps(self, node: Node) -> bool:
        """Device eviction is taking leaf ``node``'s blocks: whether a host copy keeps the node.

        Under ``write_back`` a node without a copy is backed up now; one that
        cannot be (no host space even after host eviction) counts in
        ``skipped_backup_blocks``. Only the copier can raise, before any change.
        """
        if node.host is None and not self._write_through and not self.backup(node):
            self._stats.skipped_backup_blocks += node.num_blocks
        return node.host is not None

    def offloaded(self, node: Node) -> None:
        """``node`` is host-only now (its device blocks went, or its last child): a host
        eviction candidate once it has no children."""
        if not node.children and node.host_entry is None:
            self._index(node)

    def attached(self, node: Node) -> None:
        """Host-only ``node`` is device-resident again: its copy is a mirror, a candidate."""
        if node.host_entry is None:
            self._index(node)

    def split(self, head: Node, tail: Node, k: int) -> None:
        """``head`` took the first ``k`` blocks of ``tail``: a copy splits at the same boundary."""
        host = tail.host
        if host is not None:
            head.host = host[: k * ID_BYTES]
            tail.host = host[k * ID_BYTES :]
            if head.blocks:  # a mirror of a device-resident node: a host eviction candidate
                self._index(head)

    def drop_below(self, node: Node) -> None:
        """Delete every node below ``node`` (all host-only, as its device blocks are going)."""
        stack = list(node.children.values())
        while stack:
            child = stack.pop()
            invariant(child not in self._loading, "a host node a load holds was deleted")
            child.host_entry = None
            self._release(child)
            child.parent = None
            stack.extend(child.children.values())
        node.children = NO_CHILDREN

    def discard(self, ids: np.ndarray) -> None:
        """The tree just freed device blocks ``ids`` (the copier may poison them)."""
        self._copier.discard(ids)

    # ------------------------------------------------------------ load
    def hold(self, nodes: Iterable[Node]) -> None:
        """A load is bringing ``nodes`` in: no eviction may delete them until :meth:`release`."""
        self._loading.update(nodes)

    def release(self, nodes: Iterable[Node]) -> None:
        self._loading.difference_update(nodes)

    def copy_in(self, node: Node, ids: np.ndarray) -> None:
        """Copy ``node``'s host copy into device blocks ``ids`` (the copier's ``load``)."""
        self._copier.load(node.host_ids(), ids)

    # ------------------------------------------------------------ eviction
    def evict(self, num_blocks: int) -> int:
        """Free at least ``num_blocks`` host blocks if that many can go, else all it can.

        Candidates, in the host tier's own order: host-only leaves (deleted
        from the tree) and host mirrors of device-resident nodes (the copy goes,
        the node stays). Nodes a load holds are skipped. Returns the host blocks
        freed. Complexity: O((freed + skipped candidates) * log candidates).
        """
        # self._leaves, never a local alias: re-filing an entry (self._index) may rebuild
        # the index into a new list, and what this loop pops and puts back must be that one.
        key = self._order.key
        loading = self._loading
        unlink = self._unlink()
        freed = 0
        skipped = []
        try:
            while freed < num_blocks and self._leaves:
                entry = self._leaves.pop(0)
                node = entry[-1]
                if node.host_entry is not entry:
                    continue  # dead: re-filed, or its copy is gone
                if node.host is None or (not node.blocks and node.children):
                    node.host_entry = None  # not a candidate now; re-filed when it is
                    continue
                fresh = key(node)
                if entry[:-2] != fresh:
                    self._index(node)
                    continue
                if node in loading:
                    skipped.append(entry)
                    continue
                node.host_entry = None
                freed += self._release(node)
                if not node.blocks:
                    unlink(node)
        finally:
            self._leaves.update(skipped)
        return freed

    def reset(self) -> None:
        """The tree dropped every node: every host block goes back."""
        release_held(self._alloc, self._held)
        self._leaves.clear()

    def _release(self, node: Node) -> int:
        """Drop ``node``'s host copy; return its blocks."""
        hids = node.host_ids()
        self._alloc.decref_distinct(hids)
        kernels.set_flags(self._held, hids, False)
        node.host = None
        self._stats.host_evicted_blocks += len(hids)
        self._events.removed(node, HOST_MEDIUM)
        return len(hids)

    def _index(self, node: Node) -> None:
        key = self._order.key(node)
        self._uid += 1
        node.host_entry = (*key, self._uid, node)
        leaves = self._leaves
        leaves.add(node.host_entry)
        if len(leaves) > 64 + 2 * self.tier.used_blocks:  # mostly dead entries: rebuild
            self._leaves = SortedList(e for e in leaves if e[-1].host_entry is e)

    # ------------------------------------------------------------ inspection
    def check(self, nodes: list[Node]) -> None:
        """The host tier's invariants over every node of the tree (``RadixCache.check``).

        Device nodes form a root-connected subtree, an evicted node has a host
        copy spanning its tokens, host blocks are distinct and held by the tree
        alone, every host candidate is indexed, and the host allocator's own.
        Complexity: O(nodes + host blocks).
        """
        bb = self._block_bytes
        invariant(not self._loading, "nodes are still marked loading outside a load")
        live = set(map(id, self._leaves))
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
        halloc = self._alloc
        invariant(len(np.unique(ids)) == len(ids), "a host block is held by two nodes")
        invariant(
            not ids.size or (ids.min() >= 0 and ids.max() < halloc.num_blocks),
            "a node holds a host block id out of range",
        )
        held = np.zeros_like(self._held)
        held[ids] = True
        invariant((held == self._held).all(), "host held-block map disagrees with the tree")
        invariant(
            (halloc.refcount_array == held).all(),
            "a host block is held by someone besides the tree, or a copy's block is free",
        )
        invariant(self.tier.used_blocks <= halloc.num_blocks, "host usage passed its capacity")
        halloc.check()


class NoHostCopies:
    """No host tier: no node has a copy, device eviction deletes, ``evict`` frees nothing.

    Stateless; the tree never reaches the methods that only a host-only node
    would call for (there is none). Share :data:`NO_HOST_COPIES`.
    """

    __slots__ = ()

    tiered = False
    tier = None
    used_blocks = 0

    def claim(self, cache: object) -> None:
        """No host pool to claim."""

    def device_part(
        self, path: list[Node], pos: int, split_child: Node | None, split_at: int
    ) -> Path:
        """Every node is on the device: the walk as it is."""
        return path, pos, split_child, split_at

    def matched(self, nodes: list[Node]) -> None:
        """Nothing to back up."""

    def inserted(self, leaf: Node) -> None:
        """Nothing to back up."""

    def keeps(self, node: Node) -> bool:
        """No copy keeps an evicted node: it is deleted."""
        return False

    def offloaded(self, node: Node) -> None:
        """Never called: no node is host-only."""

    def attached(self, node: Node) -> None:
        """Never called: no node is host-only."""

    def split(self, head: Node, tail: Node, k: int) -> None:
        """No copy to split."""

    def drop_below(self, node: Node) -> None:
        """A device leaf has no host-only nodes below it."""

    def discard(self, ids: np.ndarray) -> None:
        """No copier to tell."""

    def hold(self, nodes: Iterable[Node]) -> None:
        """Never called: nothing to load."""

    def release(self, nodes: Iterable[Node]) -> None:
        """Never called: nothing to load."""

    def copy_in(self, node: Node, ids: np.ndarray) -> None:
        invariant(False, "a load asked for a host copy with no host tier")

    def evict(self, num_blocks: int) -> int:
        """No host block to free."""
        return 0

    def reset(self) -> None:
        """No host block to give back."""

    def check(self, nodes: list[Node]) -> None:
        invariant(all(n.host is None for n in nodes), "a node has a host copy with no host tier")


NO_HOST_COPIES = NoHostCopies()
