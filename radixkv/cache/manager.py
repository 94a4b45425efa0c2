"""KVCacheManager: the one room for the blocks requests hold, over any prefix cache.

A serving loop asks four things of its KV memory, and this class answers each in
one call (the shape of vLLM's ``KVCacheManager``; SGLang's ``cache_unfinished_req``
for the switch onto cached blocks). The manager keeps each request's tokens (a
copy of its prompt, then the output tokens the loop appends) and how many of
them have K/V, so no call after the first takes tokens:

- :meth:`~KVCacheManager.match_prefix`: a new request's cached prefix becomes the
  head of its block table (at most ``len(tokens) - 1`` tokens: the last one must
  run for its logits);
- :meth:`~KVCacheManager.allocate_slots`: grow the table to hold ``n`` tokens,
  evicting from the cache when the pool is short, and answering ``False``
  (nothing allocated) when even eviction is not enough;
  :meth:`~KVCacheManager.may_allocate` asks the same of the pool with no side
  effect, so a request that cannot fit is not looked up;
- :meth:`~KVCacheManager.append_output_tokens` records sampled tokens (every
  token before the last sampled one has K/V), and
  :meth:`~KVCacheManager.cache_blocks` says a prefill chunk ran: the cache adopts
  the request's newly full computed blocks; where it already holds those tokens
  in other blocks (two requests computed the same prefix at once), the request
  switches to the cache's blocks at once and its duplicates are freed;
- :meth:`~KVCacheManager.free`: offer the computed blocks, then give back every
  reference.

A loop that computes a whole prompt at once with no request to track (trace
replay, the fleet simulator) calls :func:`~radixkv.cache.placement.place_prompt`
on the cache instead.

Plain ints and numpy only (no tensor): the tables become tensors in the model
runner. Not thread-safe: one thread, or one lock around each call.

>>> from radixkv import BlockAllocator, RadixCache
>>> manager = KVCacheManager(RadixCache(BlockAllocator(num_blocks=8, block_size=2)))
>>> manager.match_prefix("a", [1, 2, 3, 4, 5])      # nothing cached yet
0
>>> manager.allocate_slots("a", 6), manager.block_table("a")
(True, [0, 1, 2])
>>> manager.append_output_tokens("a", [7])           # sampled: the 5 prompt tokens have K/V
>>> manager.free("a")                                # their 2 full blocks stay cached
>>> manager.match_prefix("b", [1, 2, 3, 4, 9])
4
>>> manager.block_table("b")
[0, 1]
"""

from __future__ import annotations

import warnings
from collections.abc import Hashable
from dataclasses import dataclass
from typing import Protocol

import numpy as np

from radixkv.cache.allocator import BlockAllocator
from radixkv.cache.arrays import TOKEN_DTYPE, TokenSeq, as_token_array
from radixkv.cache.hashcache import HashBlockCache
from radixkv.cache.hashing import ChainHasher
from radixkv.cache.host import HostTier
from radixkv.cache.null import NullCache
from radixkv.cache.prefix_cache import (
    LoadingCache,
    PrefixCache,
    check_namespace,
    check_num_blocks,
)
from radixkv.cache.radix import RadixCache
from radixkv.cache.results import MatchResult
from radixkv.cache.tiered import TieredRadixCache
from radixkv.checks import check_bool, check_int
from radixkv.errors import InvariantError

__all__ = ["CACHE_KINDS", "KVCacheManager", "make_cache"]


class _Lookup(Protocol):
    """How the manager finds a cached prefix: ``match``, or ``load`` for a ``LoadingCache``."""

    def find(self, tokens: TokenSeq, namespace: Hashable) -> MatchResult:
        """The cached prefix, as ``PrefixCache.match`` (one reference per block to the caller)."""
        ...


class _DeviceLookup:
    """A cache with no ``load`` (hash, null): the prefix is what ``match`` finds, nothing loads."""

    __slots__ = ("find",)

    def __init__(self, cache: PrefixCache) -> None:
        self.find = cache.match


class _LoadingLookup:
    """A ``LoadingCache``: ``load`` brings the part of the prefix held below the device back.

    The blocks it loaded are the last of the result (``MatchResult.loaded_num_tokens``).
    """

    __slots__ = ("find",)

    def __init__(self, cache: LoadingCache) -> None:
        self.find = cache.load


def _lookup_for(cache: PrefixCache) -> _Lookup:
    """The lookup for ``cache``: through ``load`` where it has one (a ``LoadingCache``, such as
    ``TieredRadixCache``, which loads from the tiers below the device), else ``match``."""
    if isinstance(cache, LoadingCache):
        return _LoadingLookup(cache)
    return _DeviceLookup(cache)


# Room for a few output tokens past the prompt before the first doubling.
_SPARE_TOKENS = 16


@dataclass
class _Entry:
    """One request: its blocks (``table[i]`` holds positions ``[i * bs, (i + 1) * bs)``)
    and its tokens.

    ``buf[:num_tokens]`` holds the request's tokens (its prompt, then the output
    tokens appended; ``buf`` grows by doubling), and the first ``num_computed_tokens``
    of them have K/V in the table's blocks. The first ``num_cached_blocks`` entries
    of the table are known to be the cache's own blocks (matched, or adopted by an
    earlier :meth:`KVCacheManager.cache_blocks`).
    """

    table: list[int]
    namespace: Hashable
    buf: np.ndarray
    num_tokens: int
    num_computed_tokens: int
    num_cached_blocks: int = 0

    @property
    def tokens(self) -> np.ndarray:
        return self.buf[: self.num_tokens]

    def append(self, ids: np.ndarray) -> None:
        """Append ``ids`` to the tokens (amortised O(len(ids)): ``buf`` doubles when full)."""
        stop = self.num_tokens + len(ids)
        if stop > len(self.buf):
            buf = np.empty(max(stop, 2 * len(self.buf)), dtype=TOKEN_DTYPE)
            buf[: self.num_tokens] = self.tokens
            self.buf = buf
        self.buf[self.num_tokens : stop] = ids
        self.num_tokens = stop


class KVCacheManager:
    """Every block a request holds, over ``cache`` and its allocator.

    Ownership: each block in a request's table carries one reference owned by
    the manager on that request's behalf, given back by :meth:`free` (and for a
    duplicate, by :meth:`cache_blocks`). The cache holds its own references as
    usual; :meth:`check` assumes nobody else holds any (a whole-prompt caller,
    :func:`~radixkv.cache.placement.place_prompt`, uses a cache of its own). The
    manager keeps a copy of each request's tokens and counts those with K/V.
    Requests are named by any hashable ``request_id``; one
    id is one request until it is freed. Pass a
    :class:`~radixkv.cache.null.NullCache` to serve without caching. With a
    cache that has tiers below the device (a ``LoadingCache``, such as a
    ``TieredRadixCache``), lookups load the part of a prefix
    held below the device back (``load``).
    """

    def __init__(self, cache: PrefixCache) -> None:
        if not isinstance(cache, PrefixCache):
            raise TypeError(f"cache must be a PrefixCache, got {type(cache).__name__}")
        self._cache = cache
        self._alloc: BlockAllocator = cache.allocator
        self._bs = self._alloc.block_size
        self._entries: dict[Hashable, _Entry] = {}
        self._lookup = _lookup_for(cache)
        self.num_evicted_blocks = 0
        """Blocks the cache freed to make room for new blocks, in total."""
        self.num_switched_blocks = 0
        """Duplicate blocks :meth:`cache_blocks` replaced by the cache's own, in total."""

    # -------------------------------------------------------------- properties
    @property
    def cache(self) -> PrefixCache:
        return self._cache

    @property
    def allocator(self) -> BlockAllocator:
        return self._alloc

    @property
    def block_size(self) -> int:
        return self._bs

    @property
    def num_requests(self) -> int:
        """Requests holding (or registered to hold) blocks."""
        return len(self._entries)

    def __contains__(self, request_id: Hashable) -> bool:
        return request_id in self._entries

    def num_blocks_for(self, num_tokens: int) -> int:
        """Blocks that hold ``num_tokens`` positions: ``ceil(num_tokens / block_size)``."""
        return -(-num_tokens // self._bs)

    def block_table(self, request_id: Hashable) -> list[int]:
        """The request's blocks in position order: the manager's own list, to read, never mutate.

        ``KeyError`` for an unknown request. Complexity: O(1).
        """
        return self._entry(request_id).table

    def tokens(self, request_id: Hashable) -> np.ndarray:
        """The request's tokens: its prompt, then the output tokens appended (read-only int32).

        A view of the manager's copy, valid until the next append. ``KeyError``
        for an unknown request. Complexity: O(1).
        """
        view = self._entry(request_id).tokens
        view.flags.writeable = False
        return view

    def num_computed_tokens(self, request_id: Hashable) -> int:
        """How many of the request's first tokens have K/V in its blocks (vLLM's name).

        The matched prefix at first; then as :meth:`cache_blocks` and
        :meth:`append_output_tokens` say. ``KeyError`` for an unknown request.
        """
        return self._entry(request_id).num_computed_tokens

    # ---------------------------------------------------------------- requests
    def num_cached_tokens(self, tokens: TokenSeq, namespace: Hashable = None) -> int:
        """What :meth:`match_prefix` would find for ``tokens`` now, with no side effect.

        Uses the cache's ``peek``: no reference, no split, no stats, no change to
        eviction order (the admission policy ranks waiting requests with it).
        Complexity: the cache's ``peek``.
        """
        arr = as_token_array(tokens)
        return self._cache.peek(arr[: max(len(arr) - 1, 0)], namespace)

    def match_prefix(
        self, request_id: Hashable, tokens: TokenSeq, namespace: Hashable = None
    ) -> int:
        """Register a request, keep a copy of ``tokens``, and start its table with their
        longest cached prefix.

        Matches at most ``len(tokens) - 1`` tokens, block-aligned. The manager
        takes one reference on each matched block for the request. Returns the
        number of cached tokens (the request's first computed position). Counts
        one query in the cache's stats. With a host tier (``TieredRadixCache.load``),
        the host-resident part of the prefix is copied back to the device first
        and counts as cached: the scheduler budgets only what is left to compute.
        ``ValueError`` if the id is already
        registered or ``tokens`` is empty, ``TypeError`` for bad tokens or an
        unhashable namespace, before any change. Complexity: the cache's ``match``,
        plus O(len(tokens)) for the copy.

        The copy (int32, whatever the type of ``tokens``: a list, a numpy array, a
        torch tensor) is the request's tokens from now on; the matched prefix is
        its first computed tokens (:meth:`num_computed_tokens`).
        """
        if request_id in self._entries:
            raise ValueError(f"request {request_id!r} already holds blocks")
        arr = as_token_array(tokens)
        if len(arr) == 0:
            raise ValueError("tokens must hold at least one token")
        namespace = check_namespace(namespace)
        m = self._lookup.find(arr[: len(arr) - 1], namespace)
        blocks = m.blocks
        buf = np.empty(len(arr) + _SPARE_TOKENS, dtype=TOKEN_DTYPE)
        buf[: len(arr)] = arr
        entry = _Entry(list(blocks), namespace, buf, len(arr), m.num_tokens, len(blocks))
        self._entries[request_id] = entry
        return m.num_tokens

    def trim(self, request_id: Hashable, num_blocks: int) -> None:
        """Keep only the first ``num_blocks`` blocks of a request's just-matched prefix.

        For a caller that will not read part of what :meth:`match_prefix` found
        (prompt logprobs need scores the cache does not hold for every block):
        the dropped blocks' references go back, and the request computes those
        positions itself (its computed tokens are the kept blocks'). Only before
        the request has allocated anything past its match: ``ValueError`` if its
        table holds more than its matched blocks or ``num_blocks`` is not an int
        in ``[0, len(table)]``, ``KeyError`` for an unknown request, before any
        change. Complexity: O(dropped blocks).
        """
        entry = self._entry(request_id)
        table = entry.table
        if len(table) != entry.num_cached_blocks:
            raise ValueError(
                f"request {request_id!r} holds {len(table)} blocks past its "
                f"{entry.num_cached_blocks} matched ones: only a matched prefix can be trimmed"
            )
        num_blocks = check_int("num_blocks", num_blocks, low=0, high=len(table))
        dropped = table[num_blocks:]
        if dropped:
            del table[num_blocks:]
            entry.num_cached_blocks = num_blocks
            entry.num_computed_tokens = num_blocks * self._bs
            self._alloc.decref(dropped)

    def may_allocate(self, num_blocks: int) -> bool:
        """False if ``num_blocks`` new blocks cannot be had now, even by evicting; no side effect.

        Counts the free blocks, then (only if they are too few) the cache's
        blocks no request holds, which bound what eviction can free: False is
        certain, True means eviction may free enough (the cache may keep some
        of those blocks, a pinned prefix say). ``TypeError`` / ``ValueError``
        for a ``num_blocks`` that is not an int ``>= 0``. Complexity: O(1) when
        enough blocks are free, else O(num_blocks), vectorised.

        >>> manager = KVCacheManager(RadixCache(BlockAllocator(num_blocks=4, block_size=2)))
        >>> manager.match_prefix("a", [1, 2, 3, 4, 5]), manager.allocate_slots("a", 5)
        (0, True)
        >>> manager.cache_blocks("a", 5)               # the prompt ran: its 2 full blocks cached
        >>> manager.free("a")                          # 2 blocks stay cached, 2 are free
        >>> manager.may_allocate(4), manager.may_allocate(5)
        (True, False)
        """
        check_num_blocks(num_blocks)
        free = self._alloc.num_free
        if num_blocks <= free:
            return True
        unheld = np.count_nonzero(self._alloc.refcounts(self._cache.held_blocks()) == 1)
        return num_blocks <= free + int(unheld)

    def allocate_slots(self, request_id: Hashable, num_tokens: int) -> bool:
        """Grow the request's table to hold ``num_tokens`` positions; False if the pool cannot.

        Evicts from the cache when fewer blocks are free than needed. Returns
        False, with the table unchanged and nothing allocated, when even
        eviction does not free enough (the caller waits, or preempts someone);
        when :meth:`may_allocate` already says so, nothing is evicted either.
        ``KeyError`` for an unknown request. Complexity: O(new blocks) plus, when
        the pool is short, :meth:`may_allocate` and the eviction's cost, which is
        proportional to the blocks it frees (and the leaves held by running
        requests that it skips), not to the cache's size.
        """
        entry = self._entry(request_id)
        need = self.num_blocks_for(num_tokens) - len(entry.table)
        if need <= 0:
            return True
        alloc = self._alloc
        if alloc.num_free < need:
            if not self.may_allocate(need):
                return False
            self._evict_shortfall(need)
            if alloc.num_free < need:
                return False
        entry.table.extend(alloc.alloc(need))
        return True

    def append_output_tokens(self, request_id: Hashable, token_ids: TokenSeq) -> None:
        """Append sampled tokens to the request's: every token before the last one has K/V now.

        A token is sampled from the logits of the position before it, so once
        ``token_ids`` are sampled (in order: one decode step's token, or a whole
        reply), every token of the request but the last has run through the
        model: :meth:`num_computed_tokens` becomes ``len(tokens) - 1``. The last
        one has no K/V until it runs. Nothing is offered to the cache here
        (:meth:`free` offers the computed blocks). Empty ``token_ids`` change
        nothing. ``ValueError`` if the request's blocks cannot hold the computed
        tokens (allocate first), ``TypeError`` / ``ValueError`` for bad token ids,
        ``KeyError`` for an unknown request, before any change.
        Complexity: amortised O(len(token_ids)).
        """
        entry = self._entry(request_id)
        ids = as_token_array(token_ids)
        if len(ids) == 0:
            return
        computed = entry.num_tokens + len(ids) - 1
        self._check_holds(request_id, entry, computed)
        entry.append(ids)
        entry.num_computed_tokens = computed

    def cache_blocks(self, request_id: Hashable, num_computed_tokens: int) -> None:
        """Record that the request's first ``num_computed_tokens`` tokens have K/V (a prefill
        chunk ran), and offer their full blocks to the cache.

        The cache adopts the blocks past what it already holds. Where it held
        some of these positions in other blocks (a prefix two requests computed
        at once), the request switches to the cache's blocks and gives back its
        duplicates, which frees them: the K/V is the same, so later reads are
        unaffected and the pool does not carry two copies. ``ValueError`` if
        ``num_computed_tokens`` is not an int from :meth:`num_computed_tokens` to
        ``len(tokens)`` or the request's blocks cannot hold that many,
        ``KeyError`` for an unknown request, before any change. Complexity: the
        cache's ``insert``, plus a ``match`` (not counted in stats) when a
        switch happens.

        Deprecated: ``cache_blocks(request_id, tokens)``, with the computed tokens
        themselves (the form from before the manager kept them), still offers
        their full blocks, with a ``DeprecationWarning``; it goes in the next release.
        """
        entry = self._entry(request_id)
        if hasattr(num_computed_tokens, "__len__"):  # a token sequence: the old form
            _deprecated("cache_blocks(request_id, tokens)", "cache_blocks(request_id, n)")
            self._offer(entry, as_token_array(num_computed_tokens), switch=True)
            return
        n = check_int(
            "num_computed_tokens",
            num_computed_tokens,
            low=entry.num_computed_tokens,
            high=entry.num_tokens,
        )
        self._check_holds(request_id, entry, n)
        entry.num_computed_tokens = n
        self._offer(entry, entry.tokens[:n], switch=True)

    def free(
        self, request_id: Hashable, tokens: TokenSeq | None = None, *, cache: bool = True
    ) -> None:
        """Offer the request's computed full blocks to the cache, then give back every reference.

        Blocks the cache did not keep become free. The id may then be registered
        again. ``cache=False`` offers nothing (after a failed step, whose K/V is
        not trusted). ``KeyError`` for an unknown request, before any change.
        Complexity: O(table) plus the insert.

        Deprecated: ``free(request_id, tokens)`` offers the full blocks of
        ``tokens`` instead of the kept computed ones (the form from before the
        manager kept them), with a ``DeprecationWarning``; it goes in the next
        release. ``ValueError`` if it is given with ``cache=False``.
        """
        entry = self._entry(request_id)
        if not check_bool("cache", cache):
            if tokens is not None:
                raise ValueError("free takes tokens (deprecated) or cache=False, not both")
        elif tokens is not None:
            _deprecated("free(request_id, tokens)", "free(request_id)")
            self._offer(entry, as_token_array(tokens), switch=False)
        else:
            self._offer(entry, entry.tokens[: entry.num_computed_tokens], switch=False)
        del self._entries[request_id]
        if entry.table:
            self._alloc.decref(entry.table)

    def reset_cache(self) -> None:
        """Empty the cache (requests keep their blocks; they are no longer known to be cached)."""
        self._cache.reset()
        for entry in self._entries.values():
            entry.num_cached_blocks = 0

    # ---------------------------------------------------------------- helpers
    def _entry(self, request_id: Hashable) -> _Entry:
        try:
            return self._entries[request_id]
        except KeyError:
            raise KeyError(f"unknown request {request_id!r}") from None

    def _check_holds(self, request_id: Hashable, entry: _Entry, num_tokens: int) -> None:
        """``ValueError`` unless the request's blocks hold ``num_tokens`` positions."""
        need = self.num_blocks_for(num_tokens)
        if need > len(entry.table):
            raise ValueError(
                f"{num_tokens} computed tokens need {need} blocks; request {request_id!r} "
                f"holds {len(entry.table)} (allocate_slots first)"
            )

    def _evict_shortfall(self, need: int) -> None:
        """Ask the cache to free the blocks ``need`` lacks beyond the free ones; count them."""
        self.num_evicted_blocks += self._cache.evict(need - self._alloc.num_free)

    def _offer(self, entry: _Entry, tokens: np.ndarray, switch: bool) -> None:
        bs = self._bs
        num_full = len(tokens) // bs
        if num_full > len(entry.table):
            raise ValueError(
                f"{len(tokens)} tokens need {num_full} blocks; the request holds {len(entry.table)}"
            )
        if num_full <= entry.num_cached_blocks:
            return
        cache = self._cache
        full = tokens[: num_full * bs]
        num_old = cache.insert(full, entry.table[:num_full], entry.namespace) // bs
        known = entry.num_cached_blocks
        entry.num_cached_blocks = num_full
        if not switch or num_old <= known:
            return
        # Positions [known, num_old) were cached before, in blocks that may not be ours.
        m = cache.match(full[: num_old * bs], entry.namespace, stats=False)
        ours = entry.table[:num_old]
        theirs = m.blocks
        # One reference back per position: the match's extra one where the block is
        # the same, our duplicate's where it differs.
        self._alloc.decref(ours)
        entry.table[:num_old] = theirs
        self.num_switched_blocks += sum(a != b for a, b in zip(ours, theirs, strict=True))

    # --------------------------------------------------------------- invariants
    def check(self) -> None:
        """Verify reference conservation and each request's counts; ``InvariantError``
        naming the first broken rule.

        For every block: refcount == (tables holding it) + (1 if the cache holds
        it), so a block is free exactly when nobody holds it. Assumes the
        manager's requests and the cache are the only holders (true inside the
        engine). Per request: its table repeats no block and holds its computed
        tokens, which are at most its tokens; its known-cached blocks are at
        most its table. Also the cache's and the allocator's own invariants.
        Complexity: O(num_blocks + held blocks).
        """
        alloc = self._alloc
        expected = np.zeros(alloc.num_blocks, dtype=np.int64)
        for request_id, entry in self._entries.items():
            table = np.asarray(entry.table, dtype=np.int64)
            if np.unique(table).size != table.size:
                raise InvariantError(f"request {request_id!r}'s block table repeats a block")
            if entry.num_cached_blocks > table.size:
                raise InvariantError(f"request {request_id!r} claims more cached blocks than held")
            if not 0 <= entry.num_computed_tokens <= entry.num_tokens <= len(entry.buf):
                raise InvariantError(
                    f"request {request_id!r} counts {entry.num_computed_tokens} computed of "
                    f"{entry.num_tokens} tokens"
                )
            if self.num_blocks_for(entry.num_computed_tokens) > table.size:
                raise InvariantError(f"request {request_id!r}'s blocks lack its computed tokens")
            np.add.at(expected, table, 1)
        expected[self._cache.held_blocks()] += 1
        actual = alloc.refcount_array
        bad = np.flatnonzero(actual != expected)
        if bad.size:
            b = int(bad[0])
            raise InvariantError(
                f"refcount of block {b} is {int(actual[b])}, but requests and the cache "
                f"hold {int(expected[b])} references ({bad.size} blocks off)"
            )
        self._cache.check()

    def __repr__(self) -> str:
        return (
            f"KVCacheManager(cache={self._cache!r}, requests={len(self._entries)}, "
            f"free={self._alloc.num_free})"
        )


def _deprecated(old: str, new: str) -> None:
    """Warn a caller of a ``KVCacheManager`` form that passes tokens the manager now keeps."""
    warnings.warn(
        f"KVCacheManager.{old} is deprecated and goes in the next release: the manager keeps "
        f"each request's tokens since match_prefix; call {new}",
        DeprecationWarning,
        stacklevel=3,
    )


CACHE_KINDS = ("radix", "hash", None)


def make_cache(
    kind: str | None,
    allocator: BlockAllocator,
    eviction: str = "level",
    host: HostTier | None = None,
    events: ChainHasher | None = None,
) -> PrefixCache:
    """The cache named by ``kind`` over ``allocator``: a ``RadixCache`` (with ``eviction``
    and, optionally, KV ``events``; a ``TieredRadixCache`` with a ``host`` tier), a
    ``HashBlockCache`` (sha256, seed 0), or for None a ``NullCache`` that caches nothing.

    ``ValueError`` for an unknown kind or eviction order, or a host tier or events on
    a cache other than ``"radix"``.
    """
    if (host is not None or events is not None) and kind != "radix":
        what = "a host tier" if host is not None else "KV events"
        raise ValueError(f"{what} needs cache='radix', got cache={kind!r}")
    if kind == "radix" and host is not None:
        return TieredRadixCache(allocator, eviction=eviction, host=host, events=events)
    if kind == "radix":
        return RadixCache(allocator, eviction=eviction, events=events)
    if kind == "hash":
        return HashBlockCache(allocator, hash_seed=0)
    if kind is None:
        return NullCache(allocator)
    raise ValueError(f"cache must be one of {CACHE_KINDS}, got {kind!r}")
