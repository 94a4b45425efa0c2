"""PrefixCache: the surface every block-level prefix cache in radixkv offers.

``RadixCache`` (token-level radix tree), ``HashBlockCache`` (vLLM-style
chained block hashes) and ``NullCache`` (caches nothing: the cache-off
baseline) all satisfy this protocol structurally, so a serving loop, the trace
replayer or a benchmark can take any one. ``LoadingCache`` is the one capability
beyond it: a ``load`` that brings back what tiers below the device hold
(``TieredRadixCache``). Below the protocols, the input checks and the reference
bookkeeping the implementations share.

Reference ownership, common to every implementation (docs/design.md):

- A block's refcount is the number of running requests holding it, plus 1
  while the cache holds it. The cache holds exactly one reference on each
  block it caches.
- ``match`` hands the caller one new reference on every returned block.
- ``insert`` takes the cache's own reference on each block it adopts and never
  touches the caller's references; the caller always ends a request with
  ``allocator.decref(request_blocks)``, which frees the duplicates the cache
  did not adopt.
- ``evict`` and ``reset`` give back only the cache's own references; a block a
  request still holds (refcount > 1) is never freed by ``evict``.
- ``peek``, ``held_blocks`` and the properties change nothing.
- Every method validates its input first: on ``TypeError`` / ``ValueError``
  neither the cache nor any refcount has changed.
- Namespaces are told apart by type and value (``namespace_key``): ``True``,
  ``1`` and ``1.0`` are three namespaces. A namespace not equal to itself
  (``float("nan")``) is refused. A namespace holding no block costs nothing:
  the caches drop its state once its last block goes.
- One cache per allocator (``BlockAllocator``'s module docstring).

KV cache events are part of the surface, on or off: ``RadixCache`` and
``HashBlockCache`` built with ``events=ChainHasher(...)`` record what enters
and leaves them (``radixkv.cache.events``) and hand it out with
``take_events() -> list[KVCacheEvent]``; ``events_hasher`` is that
``ChainHasher``. With events off (and in ``NullCache``, which never has a
block to report) ``take_events()`` is ``[]`` and ``events_hasher`` None, so a
caller asks any cache directly, never with ``getattr``. With events on,
every method taking a namespace refuses one the hasher cannot encode
(``ValueError`` naming ``namespace``; ``ChainHasher.check_namespace``),
before any change: a caller checks a namespace up front with
``cache.check_namespace(namespace)``.
"""

from __future__ import annotations

from collections.abc import Hashable
from typing import Protocol, runtime_checkable

import numpy as np

from radixkv.cache.allocator import BlockAllocator
from radixkv.cache.arrays import BlockSeq, TokenSeq, as_block_array
from radixkv.cache.events import KVCacheEvent
from radixkv.cache.hashing import ChainHasher
from radixkv.cache.results import CacheStats, MatchResult
from radixkv.checks import check_int

__all__ = [
    "LoadingCache",
    "PrefixCache",
    "check_insert_blocks",
    "check_namespace",
    "check_num_blocks",
    "held_array",
    "namespace_key",
    "release_held",
]


@runtime_checkable
class PrefixCache(Protocol):
    """A block-level prefix cache over a ``BlockAllocator``.

    ``tokens`` arguments accept a list/tuple of ints, a 1-D integer numpy
    array or a 1-D integer torch tensor (see ``radixkv.cache.arrays``); anything
    else raises ``TypeError`` / ``ValueError`` with the cache unchanged.
    ``namespace`` is any hashable equal to itself (a tenant, a LoRA adapter,
    a cache salt), told apart by type and value: equal tokens under different
    namespaces never share blocks.
    """

    @property
    def allocator(self) -> BlockAllocator:
        """The allocator whose blocks the cache holds references on."""
        ...

    @property
    def block_size(self) -> int:
        """Tokens per block (the allocator's)."""
        ...

    def match(
        self, tokens: TokenSeq, namespace: Hashable = None, *, stats: bool = True
    ) -> MatchResult:
        """Longest cached block-aligned prefix of ``tokens`` under ``namespace``.

        Ownership: the caller receives one reference on each block of the
        result and must ``decref`` it. ``num_tokens == len(blocks) *
        block_size``; a block that only partly agrees with ``tokens`` is never
        matched (rounded down). Marks the matched blocks recently used. Counts
        the query and its hit tokens in ``stats`` unless ``stats=False`` (for a
        caller re-matching a prefix it already owns: not a new query).
        """
        ...

    def peek(self, tokens: TokenSeq, namespace: Hashable = None) -> int:
        """``match(tokens, namespace).num_tokens`` as of now, with no side effect at all.

        Takes no reference, changes no structure, counter or eviction order,
        and registers no namespace. Same input validation as ``match``
        (``TypeError`` / ``ValueError``).
        """
        ...

    def check_namespace(self, namespace: Hashable) -> None:
        """Raise what every method taking ``namespace`` would raise for it; change nothing.

        ``TypeError`` / ``ValueError`` as :func:`check_namespace`, and with events on
        ``ValueError`` naming ``namespace`` if the hasher cannot encode it. For a caller
        that checks a namespace before it queues work under it. Complexity: O(1) for a
        namespace the cache holds blocks of, else O(size of the namespace).
        """
        ...

    def insert(self, tokens: TokenSeq, blocks: BlockSeq, namespace: Hashable = None) -> int:
        """Cache the ``len(tokens) // block_size`` full blocks of ``tokens``.

        ``blocks[i]`` holds tokens ``[i * bs, (i + 1) * bs)``: an ordered
        sequence (list, tuple, 1-D integer array or tensor) of at least that
        many entries, every entry allocated (also those past the full
        blocks), distinct where adopted. Returns how many
        leading tokens were cached already (a multiple of ``block_size``).
        Ownership: the cache takes its own reference on each block it adopts;
        blocks whose content is already cached are not adopted. The caller's
        references are untouched. ``ValueError`` / ``TypeError`` before any
        change.
        """
        ...

    def evict(self, num_blocks: int) -> int:
        """Free at least ``num_blocks`` cached blocks if that many are evictable, else all it can.

        Returns the number of blocks freed. Never frees a block a request
        holds. Any int ``>= 0`` (``10**30`` too); ``ValueError`` for a
        negative count, ``TypeError`` for a non-int, before any change.
        """
        ...

    def reset(self) -> None:
        """Give back the cache's reference on every block it holds and forget them all.

        Blocks no request holds become free; requests keep theirs. Stats are kept.
        """
        ...

    @property
    def cached_blocks(self) -> int:
        """Blocks the cache holds a reference on."""
        ...

    def held_blocks(self) -> np.ndarray:
        """The blocks the cache holds a reference on: a new sorted int32 array.

        ``len(held_blocks()) == cached_blocks``. Complexity: O(num_blocks).
        """
        ...

    @property
    def evictable_blocks(self) -> int:
        """Of the cached blocks, how many ``evict`` could free now."""
        ...

    @property
    def stats(self) -> CacheStats:
        """A snapshot of the cumulative counters (tokens unless noted)."""
        ...

    @property
    def events_hasher(self) -> ChainHasher | None:
        """The ``ChainHasher`` the KV cache events are hashed with; None when events are off."""
        ...

    def take_events(self) -> list[KVCacheEvent]:
        """The pending KV cache events, oldest first, and forget them; ``[]`` with events off.

        Ownership: the caller owns the returned list. Complexity: O(1).
        """
        ...

    def check(self) -> None:
        """Verify every invariant of the structure and its allocator.

        Raises ``radixkv.cache.InvariantError`` (an ``AssertionError``) naming
        the first broken one, also under ``python -O``.
        """
        ...


@runtime_checkable
class LoadingCache(Protocol):
    """A prefix cache that may hold a prefix in tiers below the device, and brings it back.

    ``TieredRadixCache`` is one (its ``load`` copies the host-only part back); a
    ``RadixCache`` without a tier, ``HashBlockCache`` and ``NullCache`` are not:
    their ``match`` finds all there is. The KV manager looks prefixes up through
    ``load`` where a cache has it (``radixkv.cache.manager``).
    """

    def load(
        self, tokens: TokenSeq, namespace: Hashable = None, *, stats: bool = True
    ) -> MatchResult:
        """``match``, then the part of the prefix held only below the device, brought back.

        Ownership: one reference per returned block, for the caller, as from
        ``match``; ``loaded_num_tokens`` are the last of them, the ones brought back.
        """
        ...


# What the implementations share: the same input checks and the same bookkeeping of
# the one reference a cache holds per cached block (a bool map over the allocator).


def check_namespace(namespace: object) -> Hashable:
    """``namespace`` itself, checked: every namespace check of the package goes through here.

    ``TypeError`` naming its type if it is unhashable; ``ValueError`` if it
    (or an entry of a tuple/frozenset namespace) is not equal to itself, as
    ``float("nan")``: such a namespace could never be found again.
    Complexity: O(size of the namespace).
    """
    namespace_key(namespace)
    return namespace


def namespace_key(namespace: object) -> Hashable:
    """The key a cache files ``namespace`` under: None for None, else its type and value.

    ``True``, ``1`` and ``1.0`` are equal in Python but are three namespaces
    here; tuples and frozensets are keyed entry by entry, so ``(1, "a")`` and
    ``(True, "a")`` differ too. Raises as ``check_namespace``. Call it once
    per cache call. Complexity: O(1) for None, str, int and the like;
    O(size of the namespace) for a tuple.
    """
    if namespace is None:
        return None
    try:
        hash(namespace)
    except TypeError:
        raise TypeError(f"namespace must be hashable, got {type(namespace).__name__}") from None
    return _typed_key(namespace, namespace)


def _typed_key(value: object, namespace: object) -> Hashable:
    t = type(value)
    if isinstance(value, tuple):
        return (t, tuple([_typed_key(v, namespace) for v in value]))
    if isinstance(value, frozenset):
        return (t, frozenset([_typed_key(v, namespace) for v in value]))
    if not value == value:
        raise ValueError(
            f"namespace must be equal to itself, got {namespace!r} (it could never be matched)"
        )
    return (t, value)


def check_num_blocks(num_blocks: object) -> None:
    """``TypeError`` unless an int (bool excluded), ``ValueError`` if negative (``check_int``)."""
    if type(num_blocks) is not int or num_blocks < 0:  # evict's common case costs no call
        check_int("num_blocks", num_blocks, low=0)


def check_insert_blocks(allocator: BlockAllocator, blocks: BlockSeq, num_tokens: int) -> np.ndarray:
    """The first ``num_tokens // block_size`` entries of an insert's ``blocks`` as int32.

    ``blocks`` must be an ordered sequence (``as_block_array``; ``TypeError``
    naming ``blocks`` otherwise). ``ValueError`` if it has fewer entries, or
    any entry (also past the full blocks) is out of range or free, naming its
    index and value. Changes nothing. Complexity: O(len(blocks)), vectorised.
    """
    bs = allocator.block_size
    n = num_tokens // bs
    blk = as_block_array(blocks)
    if len(blk) < n:
        raise ValueError(
            f"insert of {num_tokens} tokens needs {n} blocks of {bs}, got {len(blk)} in blocks"
        )
    if blk.size:
        if blk.min() < 0 or blk.max() >= allocator.num_blocks:
            i = int(np.flatnonzero((blk < 0) | (blk >= allocator.num_blocks))[0])
            raise ValueError(
                f"blocks[{i}] is block {int(blk[i])}, out of range [0, {allocator.num_blocks})"
            )
        free = allocator.refcounts(blk) <= 0
        if free.any():
            i = int(np.argmax(free))
            raise ValueError(f"blocks[{i}] is block {int(blk[i])}, which is not allocated")
    return blk[:n]


def held_array(held: np.ndarray) -> np.ndarray:
    """The blocks flagged in ``held`` as a new sorted int32 array. Complexity: O(num_blocks)."""
    return np.flatnonzero(held).astype(np.int32)


def release_held(allocator: BlockAllocator, held: np.ndarray) -> None:
    """Give back the cache's reference on every block flagged in ``held``; clear the flags.

    Mutates ``held`` and the allocator's refcounts. Complexity: O(num_blocks).
    """
    allocator.decref_distinct(held_array(held))
    held[:] = False
