"""A host-memory tier for the radix tree (HiCache-style): where an evicted prefix goes to wait.

A ``HostTier`` is a second ``BlockAllocator`` (same block size as the device
pool; its blocks index a host ``KVPool`` of the same per-layer layout), a
``BlockCopier`` that moves KV between the two pools, and the write policy.
``TieredRadixCache(allocator, host=HostTier(...))`` (``radixkv.cache.tiered``, the
tree's side of the tier) keeps the host copies in the tree's nodes, as SGLang's
HiRadixCache does: a node holds device blocks, host blocks, or both.

- **Write policy.** ``"write_back"`` (the default) copies a node to host when
  the device evicts it; ``"write_through"`` copies it as soon as it has been
  matched ``write_through_hits`` times (0: at insert), and the device then
  evicts a node not yet copied without copying it.
- **Device eviction** drops a backed-up node's device blocks and keeps the
  node (host-only); a node that cannot be backed up (no host space even after
  host eviction) is deleted with its host-only subtree and counted in
  ``CacheStats.skipped_backup_blocks``; it never raises.
- **Host eviction** runs its own order (``eviction``) over two kinds of
  candidates: host-only leaves (deleted) and host mirrors of device-resident
  nodes (the mirror goes, the node stays on device). Considering mirrors too
  is what keeps a host pool full of mirrors from starving.
- **Load** (``TieredRadixCache.load``): top-down, node by node, all-or-nothing per
  node: device blocks are allocated (evicting first if short), the host blocks
  are copied in, and the caller gets references as for a device hit.

The copier is the one place that touches KV tensors (the cache tier itself
never does): ``NullCopier`` for bookkeeping alone (trace replay),
``radixkv.model.kv_copy.KVCopier`` for a model's pools. Copies are
synchronous from the tree's point of view: a copier returns only once the
data it was asked to move may be read and the source may be reused (on CUDA,
``KVCopier`` orders its copy stream against compute with stream waits).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Protocol, runtime_checkable

import numpy as np

from radixkv.cache.allocator import BlockAllocator
from radixkv.cache.eviction import EVICTION_ORDERS
from radixkv.cache.store.tier import StoreTier
from radixkv.checks import check_int

__all__ = ["WRITE_POLICIES", "BlockCopier", "HostTier", "NullCopier"]

WRITE_POLICIES = ("write_back", "write_through")


@runtime_checkable
class BlockCopier(Protocol):
    """Moves whole KV blocks between the device pool and the host pool.

    Every argument is a 1-D int32 array of block ids, the two of a call of
    equal length, pairwise: block ``device[i]`` and block ``host[i]`` hold the
    same positions. A copier must not touch any block it was not named.
    """

    def backup(self, device: np.ndarray, host: np.ndarray) -> None:
        """Copy device blocks to host blocks."""
        ...

    def load(self, host: np.ndarray, device: np.ndarray) -> None:
        """Copy host blocks to device blocks."""
        ...

    def discard(self, device: np.ndarray) -> None:
        """The tree just freed these device blocks (a debug copier poisons them)."""
        ...


class NullCopier:
    """A copier that moves nothing: the host tier as bookkeeping alone (trace replay, tests).

    Counts the blocks it was asked to move, so a test can check the tree asked.
    """

    def __init__(self) -> None:
        self.backed_up = 0
        self.loaded = 0
        self.discarded = 0

    def backup(self, device: np.ndarray, host: np.ndarray) -> None:
        self.backed_up += len(device)

    def load(self, host: np.ndarray, device: np.ndarray) -> None:
        self.loaded += len(device)

    def discard(self, device: np.ndarray) -> None:
        self.discarded += len(device)


@dataclass
class HostTier:
    """The host tier's pool, copier and policy (``TieredRadixCache(..., host=HostTier(...))``).

    - ``allocator``: the host pool's ``BlockAllocator``; its block size must
      equal the device pool's (``ValueError`` from ``TieredRadixCache`` otherwise).
      The tree holds the one reference on every host block it uses; nothing
      else may allocate from it.
    - ``copier``: a :class:`BlockCopier` (default :class:`NullCopier`).
    - ``write_policy``: ``"write_back"`` or ``"write_through"``.
    - ``write_through_hits``: with ``write_through``, the matches a node needs
      before it is copied (0: at insert; SGLang's selective policy is 2).
    - ``eviction``: the host's own eviction order, a name in
      ``radixkv.cache.eviction.EVICTION_ORDERS``.
    - ``store``: a :class:`~radixkv.cache.store.tier.StoreTier` below the host (None,
      the default: none); its keyspace's block size must be the pool's.

    ``TypeError``/``ValueError`` naming the field and value at construction.
    One tier serves one cache.
    """

    allocator: BlockAllocator
    copier: BlockCopier = field(default_factory=NullCopier)
    write_policy: str = "write_back"
    write_through_hits: int = 2
    eviction: str = "lru"
    store: StoreTier | None = None

    def __post_init__(self) -> None:
        if not isinstance(self.allocator, BlockAllocator):
            raise TypeError(
                f"allocator must be a BlockAllocator, got {type(self.allocator).__name__}"
            )
        if not isinstance(self.copier, BlockCopier):
            raise TypeError(
                "copier must have backup, load and discard methods (a BlockCopier), got "
                f"{type(self.copier).__name__}"
            )
        if self.write_policy not in WRITE_POLICIES:
            raise ValueError(
                f"write_policy must be one of {WRITE_POLICIES}, got {self.write_policy!r}"
            )
        check_int("write_through_hits", self.write_through_hits, low=0)
        if self.eviction not in EVICTION_ORDERS:
            raise ValueError(
                f"eviction must be one of {', '.join(EVICTION_ORDERS)}, got {self.eviction!r}"
            )
        if self.store is not None:
            if not isinstance(self.store, StoreTier):
                raise TypeError(
                    f"store must be a StoreTier or None, got {type(self.store).__name__}"
                )
            if self.store.keyspace.block_size != self.allocator.block_size:
                raise ValueError(
                    f"store.keyspace.block_size must equal allocator.block_size "
                    f"{self.allocator.block_size}, got {self.store.keyspace.block_size}"
                )

    @property
    def num_blocks(self) -> int:
        """Blocks in the host pool."""
        return self.allocator.num_blocks

    @property
    def used_blocks(self) -> int:
        """Host blocks holding a copy now."""
        return self.allocator.num_blocks - self.allocator.num_free
