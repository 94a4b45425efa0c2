"""BlockAllocator: reference-counted KV blocks over a fixed pool.

A block id indexes ``block_size`` consecutive slots of the KV pool
(``slot = block * block_size + offset``). The allocator only does bookkeeping:
it never touches a tensor. A block's refcount is the number of holders (running
requests plus 1 if a cache holds it); a block is free exactly when its refcount
is 0.

Refcounts live in one numpy array and the free list is a numpy stack, so that
the caches can take or drop references on thousands of blocks in one
vectorised step (``incref_distinct`` / ``decref_distinct``).
"""

from __future__ import annotations

from collections.abc import Iterable

import numpy as np

from radixkv.cache import kernels
from radixkv.cache.arrays import BLOCK_DTYPE, as_block_array

__all__ = ["BlockAllocator", "OutOfBlocks"]


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

    __slots__ = ("_block_size", "_num_blocks", "_refcount", "_free", "_num_free", "_mark")

    def __init__(self, num_blocks: int, block_size: int) -> None:
        _check_positive_int("num_blocks", num_blocks)
        _check_positive_int("block_size", block_size)
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
        if isinstance(n, bool) or not isinstance(n, (int, np.integer)):
            raise TypeError(f"n must be an int, got {type(n).__name__}")
        if n < 0:
            raise ValueError(f"n must be >= 0, got {n}")
        if n > self._num_free:
            raise OutOfBlocks(int(n), self._num_free)
        top = self._num_free
        out = self._free[top - n : top][::-1].copy()
        self._num_free = top - int(n)
        self._refcount[out] = 1
        return out

    def incref(self, blocks: Iterable[int]) -> None:
        """Add one reference per occurrence in ``blocks`` (a block may repeat).

        Raises ``ValueError`` if any block is out of range or free; nothing
        changes then. Complexity: O(len(blocks)).
        """
        arr = self._as_block_array(blocks)
        if arr.size == 0:
            return
        self._require_allocated(arr)
        np.add.at(self._refcount, arr, 1)

    def decref(self, blocks: Iterable[int]) -> int:
        """Give back one reference per occurrence in ``blocks``; return how many were freed.

        A block whose refcount reaches 0 returns to the free list. Raises
        ``ValueError`` if any block is out of range, free, or listed more times
        than it has references; nothing changes then. Complexity: O(len(blocks)).
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
        if isinstance(block, bool) or not isinstance(block, (int, np.integer)):
            raise TypeError(f"block must be an int, got {type(block).__name__}")
        if not 0 <= block < self._num_blocks:
            raise ValueError(f"block {block} out of range [0, {self._num_blocks})")
        return int(self._refcount[block])

    # ------------------------------------------------ vectorised hot paths
    def incref_distinct(self, blocks: np.ndarray) -> None:
        """``incref`` for an int array of distinct, allocated blocks (the caches' hot path).

        Allocation is checked (``ValueError``, nothing changed); distinctness is
        the caller's promise. Complexity: O(n), one compiled pass.
        """
        bad = kernels.incref_distinct(self._refcount, blocks)
        if bad >= 0:
            raise ValueError(f"block {int(blocks[bad])} is not allocated (refcount 0)")

    def decref_distinct(self, blocks: np.ndarray) -> int:
        """``decref`` for an int array of distinct, allocated blocks; returns blocks freed."""
        top = kernels.decref_distinct(self._refcount, blocks, self._free, self._num_free)
        if top < 0:
            raise ValueError(f"block {int(blocks[-1 - top])} is not allocated (refcount 0)")
        freed = top - self._num_free
        self._num_free = top
        return freed

    def refcounts(self, blocks: np.ndarray) -> np.ndarray:
        """Refcounts of an int array of blocks (a copy). Complexity: O(n), vectorised."""
        return self._refcount[blocks]

    @property
    def refcount_array(self) -> np.ndarray:
        """The live int32 refcount array, indexed by block. Read it; never write it."""
        return self._refcount

    # ---------------------------------------------------------- invariants
    def check(self) -> None:
        """Assert every invariant; raise ``AssertionError`` naming the first broken one.

        Complexity: O(num_blocks).
        """
        rc = self._refcount
        assert (rc >= 0).all(), "negative refcount"
        free = self._free[: self._num_free]
        assert len(np.unique(free)) == len(free), "a block is on the free list twice"
        assert (rc[free] == 0).all(), "a block on the free list has a nonzero refcount"
        assert int((rc == 0).sum()) == self._num_free, "a block with refcount 0 is not free"

    def __repr__(self) -> str:
        return (
            f"BlockAllocator(num_blocks={self._num_blocks}, block_size={self._block_size}, "
            f"num_free={self._num_free})"
        )

    # ------------------------------------------------------------- helpers
    def _push_free(self, freed: np.ndarray) -> int:
        n = int(freed.size)
        top = self._num_free
        self._free[top : top + n] = freed
        self._num_free = top + n
        return n

    def _as_block_array(self, blocks: Iterable[int]) -> np.ndarray:
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


def _check_positive_int(name: str, value: object) -> None:
    if isinstance(value, bool) or not isinstance(value, (int, np.integer)):
        raise TypeError(f"{name} must be an int, got {type(value).__name__}")
    if value < 1:
        raise ValueError(f"{name} must be >= 1, got {value}")
