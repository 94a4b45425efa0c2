"""The radix tree's KV events: each node's chained digests and the event log, or nothing.

``RadixCache`` delegates every event-related step to one of two objects:
:class:`TreeEvents` (``events=ChainHasher(...)``) or :class:`NoTreeEvents`
(the default), which does nothing, keeps no digest and hashes nothing. The
tree calls its delegate unconditionally.

With events on, each node keeps its blocks' chained digests, concatenated in
one bytes object parallel to its ``blocks`` (``Node.digests``, split with
them); the digest of a node's last block is the parent of its children's
chains, and a root's children chain from the hasher's root and the
namespace's extra keys. A new leaf is hashed before the tree changes anything
(:meth:`TreeEvents.hash_leaf`), so a hasher that raises leaves the tree whole;
a split moves no block and records nothing.
"""

from __future__ import annotations

from collections.abc import Hashable, Iterable
from typing import Any, NamedTuple

import numpy as np

from radixkv.cache.events import HOST_MEDIUM, MEDIUM, STORAGE_MEDIUM, EventLog, KVCacheEvent
from radixkv.cache.hashing import ChainHasher, Digest, namespace_extra_keys
from radixkv.cache.node import Node, Root
from radixkv.errors import invariant

__all__ = ["NO_TREE_EVENTS", "LeafChain", "NoTreeEvents", "TreeEvents", "check_medium"]


class LeafChain(NamedTuple):
    """A new leaf's digests, hashed before the tree changes (``TreeEvents.hash_leaf``)."""

    digests: list[Digest]
    parent: Digest | None  # the event parent: None below a root
    extra: tuple[Any, ...] | None  # the namespace's extra keys below a root, else None


class TreeEvents:
    """Events on: node digests, and a log of what entered and left each tier.

    Owned by one ``RadixCache``; writes only the ``digests`` of the nodes the
    tree hands it. Every method is O(1) plus the digests it hashes or records.
    """

    __slots__ = ("_bs", "_dsz", "hasher", "log")

    def __init__(self, hasher: ChainHasher, block_size: int) -> None:
        self.hasher = hasher
        self.log = EventLog(hasher, block_size)
        self._bs = block_size
        self._dsz = len(hasher.root)  # bytes per digest

    def take(self) -> list[KVCacheEvent]:
        """The pending events, oldest first; the log starts empty again."""
        return self.log.take()

    def check_namespace(self, namespace: Hashable) -> None:
        """``ValueError`` naming ``namespace`` if the hasher cannot encode it. Changes nothing."""
        self.hasher.check_namespace(namespace)

    def hash_leaf(
        self,
        node: Node | None,
        split_child: Node | None,
        split_at: int,
        namespace: Hashable,
        tokens: np.ndarray,
    ) -> LeafChain:
        """The digests of a new leaf holding ``tokens``; changes nothing.

        The leaf goes below ``node`` (None: the root ``namespace`` does not have
        yet), or below the head of ``split_child`` cut after ``split_at`` blocks.
        Complexity: O(len(tokens)).
        """
        if split_child is not None:
            dsz = self._dsz
            start = parent = split_child.digests[(split_at - 1) * dsz : split_at * dsz]
            extra = None
        elif node is None:
            start, parent, extra = self.hasher.root, None, namespace_extra_keys(namespace)
        else:
            start, parent, extra = self._chain_start(node)
        return LeafChain(self.hasher.hashes(start, tokens, self._bs, extra), parent, extra)

    def store_leaf(self, chain: LeafChain, tokens: np.ndarray) -> bytes:
        """Record the new leaf's ``BlockStored`` (``chain`` from :meth:`hash_leaf`); return the
        ``digests`` the leaf keeps."""
        self.log.stored(chain.digests, chain.parent, tokens, chain.extra)
        return b"".join(chain.digests)

    def split(self, head: Node, tail: Node, k: int) -> None:
        """``head`` took the first ``k`` blocks of ``tail``: so do the digests."""
        cut = k * self._dsz
        digests = tail.digests
        head.digests = digests[:cut]
        tail.digests = digests[cut:]

    def stored(self, node: Node, medium: str = MEDIUM, num_blocks: int | None = None) -> None:
        """Record that ``node``'s blocks (hashed already), or its first ``num_blocks`` of them,
        entered the tier ``medium``."""
        _, parent, extra = self._chain_start(node.parent)
        digests = self._digest_list(node.digests)
        tokens = node.tokens()
        if num_blocks is not None:
            digests = digests[:num_blocks]
            tokens = tokens[: num_blocks * self._bs]
        self.log.stored(digests, parent, tokens, extra, medium)

    def removed(self, node: Node, medium: str = MEDIUM) -> None:
        """Record that ``node``'s blocks left the tier ``medium`` (one event per block)."""
        self.log.removed(self._digest_list(node.digests), medium)

    def cleared(self) -> None:
        """Record a reset."""
        self.log.cleared()

    def block_hashes(self, nodes: Iterable[Node], medium: str) -> list[int]:
        """The wire hashes of the blocks ``nodes`` hold in ``medium``: their device blocks for
        ``"GPU"``, their host copies for ``"CPU"``; node by node, in order. ``ValueError``
        naming ``medium`` for any other (``RadixCache.block_hashes`` says why not STORAGE)."""
        check_medium(medium)
        wire_list = self.hasher.wire_list
        device = medium == MEDIUM
        out: list[int] = []
        for node in nodes:
            if node.blocks if device else node.host is not None:
                out += wire_list(node.digests)
        return out

    def check(self, parent: Node, child: Node) -> None:
        """``InvariantError`` unless ``child``'s digests are a fresh hash of its chain below
        ``parent``. Complexity: O(child's tokens)."""
        start, _, extra = self._chain_start(parent)
        fresh = self.hasher.hashes(start, child.tokens(), self._bs, extra)
        invariant(
            child.digests == b"".join(fresh), "a node's event digests are not its chain's hashes"
        )

    def _chain_start(self, node: Node) -> tuple[Digest, Digest | None, tuple[Any, ...] | None]:
        """Where a chain below ``node`` starts: (parent digest to hash from, event parent, extra).

        Below a root: the hasher's root, no event parent, the namespace's extra
        keys; below any other node: its last block's digest, twice, no extra.
        """
        if isinstance(node, Root):
            return self.hasher.root, None, namespace_extra_keys(node.namespace)
        last = node.digests[-self._dsz :]
        return last, last, None

    def _digest_list(self, digests: bytes) -> list[Digest]:
        dsz = self._dsz
        return [digests[i : i + dsz] for i in range(0, len(digests), dsz)]


class NoTreeEvents:
    """Events off: nodes keep no digests, nothing is hashed or recorded; ``take()`` is []."""

    __slots__ = ()

    hasher = None

    def take(self) -> list[KVCacheEvent]:
        return []

    def check_namespace(self, namespace: Hashable) -> None:
        """Every namespace passes: nothing is hashed."""

    def hash_leaf(
        self,
        node: Node | None,
        split_child: Node | None,
        split_at: int,
        namespace: Hashable,
        tokens: np.ndarray,
    ) -> None:
        """Nothing to hash: no chain, so the tree stores none (the leaf keeps no digests)."""

    def split(self, head: Node, tail: Node, k: int) -> None:
        """No digests to split."""

    def stored(self, node: Node, medium: str = MEDIUM, num_blocks: int | None = None) -> None:
        """Records nothing."""

    def removed(self, node: Node, medium: str = MEDIUM) -> None:
        """Records nothing."""

    def cleared(self) -> None:
        """Records nothing."""

    def block_hashes(self, nodes: Iterable[Node], medium: str) -> list[int]:
        check_medium(medium)
        raise ValueError(
            "cache must be a radix cache with events on (events=ChainHasher(...)) for "
            "block_hashes: no block has a hash with events off"
        )

    def check(self, parent: Node, child: Node) -> None:
        invariant(child.digests is None, "a node keeps digests with events off")


NO_TREE_EVENTS = NoTreeEvents()

_MEDIA = (MEDIUM, HOST_MEDIUM)  # the media whose events a tree nets out: it sees every removal


def check_medium(medium: str) -> None:
    """``ValueError`` naming ``medium`` unless the tree can list its blocks there."""
    if medium == STORAGE_MEDIUM:
        raise ValueError(
            f"medium must be one of {_MEDIA}, got {medium!r}: a store drops entries this "
            "cache never sees, so its 'STORAGE' events are announcements with no removals "
            "to net against; ask the store (contains_run)"
        )
    if medium not in _MEDIA:
        raise ValueError(f"medium must be one of {_MEDIA}, got {medium!r}")
