"""BlockAllocator: reference-counted KV blocks over a fixed pool.

A block id indexes ``block_size`` consecutive slots of the KV pool
(``slot = block * block_size + offset``). The allocator only does bookkeeping:
it never touches a tensor. A block's refcount is the number of holders (running
requests plus 1 if a cache holds it); a block is free exactly when its refcount
is 0.

Refcounts live in one numpy array and the free list is a numpy stack, so that
the caches can take or drop references on thousands of blocks in one
compiled pass (``incref_distinct`` / ``decref_distinct``).

One cache per allocator: a cache reads every reference it does not hold as a
request's, so two caches on one pool would each keep the other's blocks from
being evicted. ``RadixCache`` and ``HashBlockCache`` claim their allocator at
construction (``ValueError`` if another live cache has it); the claim and the
cache's references go when the cache is garbage-collected.

``check()`` (here and on every cache) raises ``InvariantError`` naming the
broken invariant, also under ``python -O``: it is never built on ``assert``.
"""

from __future__ import annotations

import weakref

import numpy as np

from radixkv.cache import kernels
from radixkv.cache.arrays import BLOCK_DTYPE, BlockSeq, as_block_array
from radixkv.checks import check_int
from radixkv.errors import InvariantError, invariant  # re-exported: the public path of old

__all__ = ["BlockAllocator", "InvariantError", "OutOfBlocks", "invariant"]

_BLOCK = np.dtype(BLOCK_DTYPE)
_NDARRAY = np.ndarray  # a module global: one lookup fewer on the hot paths' type check


class OutOfBlocks(RuntimeError):
    """Raised by ``alloc(n)`` when fewer than ``n`` blocks are free; nothing is allocated."""

    def __init__(self, requested: int, num_free: int) -> None:
        super().__init__(f"cannot allocate {requested} blocks: only {num_free} free")
        self.requested = requested
        self.num_free = num_free


class BlockAllocator:
    """Fixed pool of ``num_blocks`` KV blocks with reference counts.

    Ownership: ``alloc`` hands the caller one reference on each block; every
    ``incref`` adds one; every ``decref`` gives one back. The caller that took
    a reference is the one that must give it back.

    Errors are raised before any state changes: a failed call leaves every
    refcount and the free list exactly as they were.

    >>> a = BlockAllocator(num_blocks=4, block_size=16)
    >>> a.alloc(2)
    [0, 1]
    >>> a.incref([1]); a.refcount(1)
    2
    >>> a.decref([0, 1])
    1
    >>> a.num_free
    3
    """

    __slots__ = ("_block_size", "_num_blocks", "_refcount", "_free", "_num_free", "_mark", "_cache")

    def __init__(self, num_blocks: int, block_size: int) -> None:
        check_int("num_blocks", num_blocks, low=1)
        check_int("block_size", block_size, low=1)
        if num_blocks > np.iinfo(BLOCK_DTYPE).max:
            raise ValueError(f"num_blocks must fit in int32, got {num_blocks}")
        self._block_size = int(block_size)
        self._num_blocks = int(num_blocks)
        self._refcount = np.zeros(num_blocks, dtype=np.int32)
        # Free stack: the top is at index _num_free - 1. Initially ascending ids
        # come off the top first, so a fresh allocator hands out 0, 1, 2, ...
        self._free = np.arange(num_blocks - 1, -1, -1, dtype=BLOCK_DTYPE)
        self._num_free = int(num_blocks)
        # Scratch space for O(n) duplicate detection without sorting.
        self._mark = np.zeros(num_blocks, dtype=np.int64)
        self._cache: weakref.ref | None = None  # the one cache over this pool (_claim)

    # ------------------------------------------------------------------ sizes
    @property
    def block_size(self) -> int:
        """Tokens per block."""
        return self._block_size

    @property
    def num_blocks(self) -> int:
        """Blocks in the pool, free or not."""
        return self._num_blocks

    @property
    def num_free(self) -> int:
        """Blocks with refcount 0."""
        return self._num_free

    # ------------------------------------------------------------ public API
    def alloc(self, n: int) -> list[int]:
        """Take ``n`` free blocks; each starts with refcount 1, owned by the caller.

        Raises ``OutOfBlocks`` if ``n > num_free`` (nothing allocated) and
        ``ValueError`` if ``n`` is negative. Complexity: O(n).
        """
        return self.alloc_array(n).tolist()

    def alloc_array(self, n: int) -> np.ndarray:
        """``alloc`` returning an int32 numpy array instead of a list."""
        if type(n) is not int or n < 0:  # the admit path's common case costs no call
            n = check_int("n", n, low=0)
        if n > self._num_free:
            raise OutOfBlocks(int(n), self._num_free)
        top = self._num_free
        out = self._free[top - n : top][::-1].copy()
        self._num_free = top - int(n)
        self._refcount[out] = 1
        return out

    def unalloc(self, blocks: np.ndarray) -> None:
        """Undo the latest ``alloc_array``: ``blocks`` is what it returned, each block still
        at refcount 1, nothing allocated or freed since. The free list is then exactly as
        before the alloc (for a caller whose next step failed: a cache's copy, say).

        ``ValueError`` as ``decref_distinct`` if a block is out of range or free, before
        any change. Complexity: O(len(blocks)).
        """
        self.decref_distinct(np.ascontiguousarray(blocks[::-1]))  # a stack: last out, first in

    def incref(self, blocks: BlockSeq) -> None:
        """Add one reference per occurrence in ``blocks`` (a block may repeat).

        ``blocks``: an ordered sequence of block ids (see ``as_block_array``).
        Raises ``TypeError`` for any other type and ``ValueError`` if any
        block is out of range or free; nothing changes then.
        Complexity: O(len(blocks)).
        """
        arr = self._as_block_array(blocks)
        if arr.size == 0:
            return
        self._require_allocated(arr)
        np.add.at(self._refcount, arr, 1)

    def decref(self, blocks: BlockSeq) -> int:
        """Give back one reference per occurrence in ``blocks``; return how many were freed.

        A block whose refcount reaches 0 returns to the free list. Raises
        ``TypeError`` unless ``blocks`` is an ordered sequence of ints (see
        ``as_block_array``) and ``ValueError`` if any block is out of range,
        free, or listed more times than it has references; nothing changes
        then. Complexity: O(len(blocks)).
        """
        arr = self._as_block_array(blocks)
        if arr.size == 0:
            return 0
        self._require_allocated(arr)
        if self._has_duplicates(arr):
            uniq, counts = np.unique(arr, return_counts=True)
            short = self._refcount[uniq] < counts
            if short.any():
                b = int(uniq[np.argmax(short)])
                raise ValueError(
                    f"decref of block {b} more times than its refcount {self.refcount(b)}"
                )
            np.subtract.at(self._refcount, arr, 1)
            return self._push_free(uniq[self._refcount[uniq] == 0])
        return self.decref_distinct(arr)

    def refcount(self, block: int) -> int:
        """Current refcount of ``block`` (0 when free). ``ValueError`` if out of range."""
        check_int("block", block)
        if not 0 <= block < self._num_blocks:
            raise ValueError(f"block {block} out of range [0, {self._num_blocks})")
        return int(self._refcount[block])

    # ------------------------------------------------ vectorised hot paths
    def incref_distinct(self, blocks: BlockSeq) -> None:
        """``incref`` for distinct blocks (the caches' hot path): one compiled pass, no sort.

        Meant for a 1-D int32 numpy array (other block sequences are converted
        first, as ``incref`` does). Every block is checked in the same pass:
        ``ValueError`` naming the first one out of range or free, nothing
        changed then. A repeated block simply gets one reference per
        occurrence. Complexity: O(n).
        """
        if type(blocks) is not _NDARRAY or blocks.dtype is not _BLOCK or blocks.ndim != 1:
            blocks = as_block_array(blocks)
        bad = kernels.incref_distinct(self._refcount, blocks)
        if bad >= 0:
            raise ValueError(self._bad_block(int(blocks[bad])))

    def decref_distinct(self, blocks: BlockSeq) -> int:
        """``decref`` for distinct blocks (the caches' hot path); returns blocks freed.

        Meant for a 1-D int32 numpy array (other block sequences are converted
        first, as ``decref`` does). Every block is checked in the compiled
        pass: ``ValueError`` naming the first one out of range, free, or
        repeated more times than its refcount, nothing changed then.
        Complexity: O(n).
        """
        if type(blocks) is not _NDARRAY or blocks.dtype is not _BLOCK or blocks.ndim != 1:
            blocks = as_block_array(blocks)
        top = kernels.decref_distinct(self._refcount, blocks, self._free, self._num_free)
        if top < 0:
            i = -1 - top
            b = int(blocks[i])
            if 0 <= b < self._num_blocks and self._refcount[b] > 0:
                raise ValueError(
                    f"decref of block {b} more times than its refcount {self.refcount(b)}"
                )
            raise ValueError(self._bad_block(b))
        freed = top - self._num_free
        self._num_free = top
        return freed

    def refcounts(self, blocks: np.ndarray) -> np.ndarray:
        """Refcounts of an int array of blocks in range (a copy; unchecked, numpy indexing).

        Complexity: O(n), vectorised.
        """
        return self._refcount[blocks]

    @property
    def refcount_array(self) -> np.ndarray:
        """The live int32 refcount array, indexed by block. Read it; never write it."""
        return self._refcount

    # ---------------------------------------------------------- invariants
    def check(self) -> None:
        """Verify every invariant; ``InvariantError`` naming the first broken one (even under -O).

        Complexity: O(num_blocks).
        """
        rc = self._refcount
        invariant(
            rc.shape == (self._num_blocks,) and self._free.shape == (self._num_blocks,),
            "the refcount array or the free stack changed size",
        )
        invariant(0 <= self._num_free <= self._num_blocks, f"num_free is {self._num_free}")
        invariant((rc >= 0).all(), f"block {int(np.argmin(rc))} has a negative refcount")
        free = self._free[: self._num_free]
        invariant(
            not free.size or (free.min() >= 0 and free.max() < self._num_blocks),
            "the free list holds a block id out of range",
        )
        invariant(len(np.unique(free)) == len(free), "a block is on the free list twice")
        invariant((rc[free] == 0).all(), "a block on the free list has a nonzero refcount")
        invariant(int((rc == 0).sum()) == self._num_free, "a block with refcount 0 is not free")

    def __repr__(self) -> str:
        return (
            f"BlockAllocator(num_blocks={self._num_blocks}, block_size={self._block_size}, "
            f"num_free={self._num_free})"
        )

    # ------------------------------------------------------------- helpers
    def _claim(self, cache: object, held: np.ndarray) -> None:
        """Make ``cache`` the one cache over this pool (called by a cache's constructor, last).

        ``held`` is the cache's bool map of the blocks it holds a reference on
        (mutated in place, never replaced). ``ValueError`` naming
        ``allocator`` if another cache that is still alive has claimed it.
        When ``cache`` is garbage-collected the references it held go back,
        so a cache built after it finds the pool as the requests alone left
        it. Complexity: O(1).
        """
        other = self._cache() if self._cache is not None else None
        if other is not None and other is not cache:
            raise ValueError(
                f"allocator already serves {other!r}: one cache per allocator (each would read "
                "the other's references as requests' and never evict those blocks); use a "
                "second BlockAllocator, or drop the first cache before building another"
            )
        self._cache = weakref.ref(cache)
        weakref.finalize(cache, self._give_back, held).atexit = False

    def _give_back(self, held: np.ndarray) -> None:
        """A collected cache's references: decref every block flagged in ``held``.

        Skips blocks already free: a finalizer cannot report a pool corrupted
        by hand (``check()`` does), and must not corrupt it further.
        """
        self.decref_distinct(np.flatnonzero(held & (self._refcount > 0)).astype(BLOCK_DTYPE))
        held[:] = False

    def _bad_block(self, b: int) -> str:
        if not 0 <= b < self._num_blocks:
            return f"block {b} out of range [0, {self._num_blocks})"
        return f"block {b} is not allocated (refcount 0)"

    def _push_free(self, freed: np.ndarray) -> int:
        n = int(freed.size)
        top = self._num_free
        self._free[top : top + n] = freed
        self._num_free = top + n
        return n

    def _as_block_array(self, blocks: BlockSeq) -> np.ndarray:
        arr = as_block_array(blocks)
        if arr.size and (arr.min() < 0 or arr.max() >= self._num_blocks):
            bad = arr[(arr < 0) | (arr >= self._num_blocks)][0]
            raise ValueError(f"block {int(bad)} out of range [0, {self._num_blocks})")
        return arr

    def _require_allocated(self, arr: np.ndarray) -> None:
        free = self._refcount[arr] <= 0
        if free.any():
            raise ValueError(f"block {int(arr[np.argmax(free)])} is not allocated (refcount 0)")

    def _has_duplicates(self, arr: np.ndarray) -> bool:
        if arr.size < 2:
            return False
        mark = self._mark
        idx = np.arange(arr.size, dtype=np.int64)
        mark[arr] = idx
        return bool((mark[arr] != idx).any())
