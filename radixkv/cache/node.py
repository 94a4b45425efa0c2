"""The radix tree's nodes: a run of tokens, its device blocks and (with a host tier) its host copy.

Internal to ``radixkv.cache``: ``RadixCache`` owns every node. Besides the tree,
only these write one, each its own fields: the events (``digests``,
``radixkv.cache.tree_events``), the pins (``pinned``, ``radixkv.cache.pins``), the
host tier's subclass (``host``, ``host_entry``, ``radixkv.cache.tiered``), the store
tier (``store_digests``, ``radixkv.cache.store.tier``) and the eviction order's hooks
(``readmitted``); eviction orders read nodes through ``LeafView``.
"""

from __future__ import annotations

from collections.abc import Hashable, Mapping
from types import MappingProxyType

import numpy as np

from radixkv.cache.arrays import TOKEN_DTYPE

TOKEN_BYTES = np.dtype(TOKEN_DTYPE).itemsize
ID_BYTES = 4  # a block id in a node's ``blocks``: int32
EMPTY_BLOCKS = np.empty(0, dtype=np.int32)
# A leaf's children: one shared read-only empty mapping instead of an empty dict per leaf
# (64 bytes each, half the tree's nodes); a node gets a dict of its own with its first child.
NO_CHILDREN: Mapping[bytes, Node] = MappingProxyType({})


class Node:
    """A run of tokens and its blocks. ``entry`` is its key in the leaf index, None when absent.

    ``digests`` is None with events off; with events on, the blocks' chained
    event digests concatenated (``digest_size`` bytes per block, in order).
    What an eviction order may read (``radixkv.cache.eviction.LeafView``):
    ``last_access`` (logical clock of the last match or insert through it),
    ``depth_end``, ``hits`` (matches through it), ``created`` (clock at its
    insert; a split's head keeps it), ``priority`` (the highest an insert
    through it gave), ``num_blocks`` and ``readmitted``.
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
        "host",
        "host_entry",
        "store_digests",
        "readmitted",
    )

    def __init__(
        self,
        key: bytes,
        blocks: bytes,
        parent: Node | None,
        depth_end: int,
        last_access: int,
        digests: bytes | None = None,
        priority: int = 0,
    ) -> None:
        self.key = key  # the node's tokens: int32 bytes, block-aligned
        # int32 block ids as bytes, one per block_size tokens: a bytes header is ~80 bytes
        # smaller than an ndarray's, and match joins them in one copy (_ids views one).
        self.blocks = blocks
        self.children: Mapping[bytes, Node] = NO_CHILDREN  # a dict once it has a child
        self.parent = parent
        self.depth_end = depth_end  # tokens from the root to the end of this node
        self.last_access = last_access
        self.entry: tuple | None = None
        self.digests = digests
        self.hits = 0
        self.created = last_access
        self.priority = priority
        self.pinned = 0  # pins covering this node (RadixCache.pin): never evicted while > 0
        # With a host tier: the host copy's int32 block ids as bytes (None: no copy), and the
        # node's key in the host eviction index (None when not filed). Device-evicted nodes
        # keep ``blocks == b""`` and always have a host copy.
        self.host: bytes | None = None
        self.host_entry: tuple | None = None
        # With a store tier: the blocks' store chain digests, 32 bytes each, concatenated
        # (None: not hashed yet; never set with the store off).
        self.store_digests: bytes | None = None
        # Inserted where the ghost remembered a deleted leaf (GhostOrder's hooks write it)
        self.readmitted = False

    @property
    def num_blocks(self) -> int:
        """Blocks of tokens the node spans (on the device, or on the host alone once evicted)."""
        return (len(self.blocks) or len(self.host or b"")) // ID_BYTES

    def block_ids(self) -> np.ndarray:
        """The node's blocks as a read-only int32 array (a view, no copy)."""
        return np.frombuffer(self.blocks, dtype=np.int32)

    def host_ids(self) -> np.ndarray:
        """The host copy's blocks as a read-only int32 array (empty when there is none)."""
        return np.frombuffer(self.host or b"", dtype=np.int32)

    def tokens(self) -> np.ndarray:
        return np.frombuffer(self.key, dtype=TOKEN_DTYPE)


class Root(Node):
    """A namespace's root: no tokens, no blocks; knows its namespace so evict can drop it."""

    __slots__ = ("namespace", "ns_key")

    def __init__(self, namespace: Hashable, ns_key: Hashable, last_access: int) -> None:
        super().__init__(b"", b"", None, 0, last_access)
        self.namespace = namespace  # as the caller gave it (for pretty)
        self.ns_key = ns_key  # its key in _roots


def has_device_child(node: Node) -> bool:
    """Whether a child of ``node`` holds device blocks (a leaf of the tree's index has none)."""
    for child in node.children.values():
        if child.blocks:
            return True
    return False
