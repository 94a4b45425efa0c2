"""KV cache events: what a cache tells the fleet when blocks enter and leave it.

A cache built with events on records one :class:`BlockStored` per insert that
adds blocks (their chained hashes, the parent's hash and the tokens), one
:class:`BlockRemoved` per block that leaves (eviction), and
:class:`AllBlocksCleared` on reset; ``cache.take_events()`` returns and clears
the pending list. A stream of (hash, parent) pairs is the cache's prefix tree,
serialized: a router that applies it holds an exact copy of which prefixes a
replica has (``radixkv.fleet``).

An event's ``medium`` is the tier the blocks entered or left: ``"GPU"`` (the
device), ``"CPU"`` (a host copy, ``radixkv.cache.tiered``) or ``"STORAGE"`` (a
put a store below the host took; announced, never removed: docs/store.md).

The classes are vLLM's (0.33) ``KVCacheEvent`` schema, field for field and in
order, as ``msgspec`` structs, so ``radixkv.fleet.wire`` encodes them
byte-compatibly with vLLM's ZMQ publisher and existing consumers (llm-d's
indexer, Dynamo's router) read a radixkv replica. They live beside the caches,
not in ``radixkv.fleet``, because the caches emit them and the cache tier
imports nothing above it.

Block hashes (:class:`~radixkv.cache.hashing.ChainHasher`, ``"sha256_cbor"`` or ``"xxhash"``) are
chained, so a block's hash names its whole prefix, and reproducible across
processes for a given seed; the namespace enters the first block's extra keys
(:func:`~radixkv.cache.hashing.namespace_extra_keys`). Every recipe lives in
:mod:`radixkv.cache.hashing`.

``HashBlockCache`` records through an :class:`EventLog`; with events off it
holds :data:`NO_EVENTS`, a :class:`NullEventLog` that records nothing, so its
paths carry no ``if events`` branch (the radix tree's own delegate, which also
keeps its nodes' digests, is :mod:`radixkv.cache.tree_events`).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import msgspec
import numpy as np

from radixkv.cache.hashing import ChainHasher, Digest

__all__ = [
    "AllBlocksCleared",
    "AnyEvent",
    "BlockRemoved",
    "BlockStored",
    "EventBatch",
    "EventLog",
    "KVCacheEvent",
    "NO_EVENTS",
    "NullEventLog",
]

MEDIUM = "GPU"  # vLLM's name for the device tier, whatever the device
HOST_MEDIUM = "CPU"  # vLLM's name for the host tier (CPU offloading)
STORAGE_MEDIUM = "STORAGE"  # vLLM's name for a store below the host (disk, a remote pool)
SPEC_KIND = "full_attention"


class KVCacheEvent(msgspec.Struct, array_like=False, omit_defaults=True, gc=False, tag=True):
    """Base of every event; encoded as a map whose first key is ``type`` (the class name)."""


class BlockStored(KVCacheEvent):
    """Blocks that entered the cache: ``block_hashes[i]`` holds ``token_ids[i*bs:(i+1)*bs]``.

    ``parent_block_hash`` is the hash of the block before the first (None at
    the root). ``extra_keys`` has one entry per block: the first block's holds
    the namespace (None when there is none), the others None.
    """

    block_hashes: list[int]
    parent_block_hash: int | None
    token_ids: list[int]
    block_size: int
    lora_id: int | None
    medium: str | None
    lora_name: str | None
    extra_keys: list[tuple[Any, ...] | None] | None = None
    group_idx: int | None = None
    kv_cache_spec_kind: str | None = None
    kv_cache_spec_sliding_window: int | None = None
    locality: str | None = None
    ownership: str | None = None
    session_id: str | None = None
    lookahead_token_ids: list[int] | None = None


class BlockRemoved(KVCacheEvent):
    """Blocks that left the cache (vLLM sends one hash per event)."""

    block_hashes: list[int]
    medium: str | None
    group_idx: int | None = None
    locality: str | None = None
    ownership: str | None = None


class AllBlocksCleared(KVCacheEvent):
    """The cache dropped everything (``reset``)."""


AnyEvent = BlockStored | BlockRemoved | AllBlocksCleared


class EventBatch(msgspec.Struct, array_like=True, omit_defaults=True, gc=False):
    """One published message: ``[ts, events, data_parallel_rank]`` on the wire."""

    ts: float
    events: list[AnyEvent]
    data_parallel_rank: int | None = None


class EventLog:
    """A cache's pending events: appended by the cache, taken by whoever publishes them.

    Owned by one cache. ``hasher`` is the ``ChainHasher`` whose digests the
    cache passes in; ``take()`` returns the pending list and starts a new one.
    Complexity: O(1) per event.
    """

    __slots__ = ("_pending", "block_size", "hasher")

    def __init__(self, hasher: ChainHasher, block_size: int) -> None:
        self.hasher = hasher
        self.block_size = block_size
        self._pending: list[KVCacheEvent] = []

    def check_namespace(self, namespace: object) -> None:
        """``ValueError`` naming ``namespace`` if the hasher cannot encode it
        (``ChainHasher.check_namespace``). Changes nothing."""
        self.hasher.check_namespace(namespace)

    def stored_runs(
        self,
        digests: Sequence[Digest],
        positions: Sequence[int],
        tokens: np.ndarray,
        first_extra: tuple[Any, ...] | None,
    ) -> None:
        """Record one ``BlockStored`` per run of consecutive ``positions`` (ascending) of a chain.

        ``digests[i]`` is block ``i``'s digest and holds ``tokens[i * bs:(i + 1) * bs]``;
        a run from position 0 has no parent and carries ``first_extra`` (the
        namespace's keys), a later run's parent is the block before it (cached
        already, or a block that outlived its evicted parent).
        Complexity: O(blocks in the runs).
        """
        bs = self.block_size
        k, n = 0, len(positions)
        while k < n:
            first = last = positions[k]
            k += 1
            while k < n and positions[k] == last + 1:
                last = positions[k]
                k += 1
            parent = digests[first - 1] if first else None
            self.stored(
                digests[first : last + 1],
                parent,
                tokens[first * bs : (last + 1) * bs],
                None if first else first_extra,
            )

    def stored(
        self,
        digests: Sequence[Digest],
        parent: Digest | None,
        tokens: Sequence[int] | np.ndarray,
        first_extra: tuple[Any, ...] | None,
        medium: str = MEDIUM,
    ) -> None:
        """Record that the blocks ``digests`` (holding ``tokens``) entered the cache.

        ``parent`` is the digest of the block before them, None at the root;
        ``first_extra`` the namespace's keys when the first block is at the root;
        ``medium`` the tier they entered (``"GPU"``, ``"CPU"`` for a host copy, or
        ``"STORAGE"`` for a put a store took).
        """
        wire = self.hasher.wire
        extra: list[tuple[Any, ...] | None] | None = None
        if first_extra is not None and parent is None:
            extra = [first_extra] + [None] * (len(digests) - 1)
        self._pending.append(
            BlockStored(
                block_hashes=[wire(d) for d in digests],
                parent_block_hash=None if parent is None else wire(parent),
                token_ids=np.asarray(tokens).tolist(),
                block_size=self.block_size,
                lora_id=None,
                medium=medium,
                lora_name=None,
                extra_keys=extra,
                group_idx=0,
                kv_cache_spec_kind=SPEC_KIND,
            )
        )

    def removed(self, digests: Sequence[Digest], medium: str = MEDIUM) -> None:
        """Record that the blocks ``digests`` left the tier ``medium`` (one event per block,
        as vLLM)."""
        wire = self.hasher.wire
        append = self._pending.append
        for d in digests:
            append(BlockRemoved(block_hashes=[wire(d)], medium=medium, group_idx=0))

    def cleared(self) -> None:
        """Record a reset; pending events before it still describe what happened first."""
        self._pending.append(AllBlocksCleared())

    def take(self) -> list[KVCacheEvent]:
        """The pending events, oldest first; the log starts empty again."""
        out, self._pending = self._pending, []
        return out

    def __len__(self) -> int:
        return len(self._pending)


class NullEventLog:
    """The event log of a cache with events off: records nothing, ``take()`` is [].

    Every recording method accepts ``EventLog``'s arguments and ignores them,
    so a cache calls its log unconditionally. Stateless; share :data:`NO_EVENTS`.
    """

    __slots__ = ()

    hasher = None

    def check_namespace(self, namespace: object) -> None:
        """Every namespace passes: nothing is hashed."""

    def stored(self, *args: object, **kwargs: object) -> None:
        """Records nothing."""

    def stored_runs(self, *args: object) -> None:
        """Records nothing."""

    def removed(self, *args: object) -> None:
        """Records nothing."""

    def cleared(self) -> None:
        """Records nothing."""

    def take(self) -> list[KVCacheEvent]:
        """Always ``[]``."""
        return []

    def __len__(self) -> int:
        return 0


NO_EVENTS = NullEventLog()
