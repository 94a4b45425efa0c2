"""numba kernels for the per-block loops on the caches' hot paths.

A match at block size 1 hands out thousands of references; numpy fancy
indexing costs several passes and an index conversion per call, a compiled
loop one pass. Each kernel that can fail checks everything first and changes
nothing unless all is well, so callers keep the "raise before any change" rule.
Kernels that index the refcount array by a block id check the id's range in
the same pass: an id out of range would otherwise read or write outside it.
The one exception is ``incref_held``, for blocks a cache holds (in range and
allocated by the cache's invariant, which ``check()`` verifies): ``match``
hands out thousands of those, and the per-block test is a quarter of its time.
Compiled lazily on first call and cached on disk (``cache=True``).

These are internal: they take 1-D int32 numpy arrays and check nothing about
their arguments' types (a list raises numba's ``TypingError``). The checked
entry points are ``BlockAllocator``'s methods and the caches.
"""

from __future__ import annotations

import numpy as np
from numba import njit

__all__ = [
    "claim_error",
    "claim_for_insert",
    "common_prefix_len",
    "decref_distinct",
    "incref_distinct",
    "incref_held",
    "last_busy",
    "narrow_int32",
    "set_flags",
]


@njit(cache=True)
def incref_distinct(rc: np.ndarray, blocks: np.ndarray) -> int:
    """rc[b] += 1 for each b; returns -1, or the index of the first block out of range or
    free (nothing done). A repeated block gets one reference per occurrence."""
    n = rc.size
    for i in range(blocks.size):
        b = blocks[i]
        if b < 0 or b >= n or rc[b] <= 0:
            for j in range(i):  # undo: the common case pays for one pass only
                rc[blocks[j]] -= 1
            return i
        rc[b] += 1
    return -1


@njit(cache=True)
def incref_held(rc: np.ndarray, blocks: np.ndarray) -> None:
    """rc[b] += 1 for each b, unchecked: only for blocks the cache itself holds (each in
    range with a reference already, by the cache's invariant)."""
    for i in range(blocks.size):
        rc[blocks[i]] += 1


@njit(cache=True)
def decref_distinct(rc: np.ndarray, blocks: np.ndarray, free: np.ndarray, top: int) -> int:
    """rc[b] -= 1 for each b, pushing blocks that reach 0 onto ``free`` at ``top``.

    Returns the new top, or ``-1 - i`` where ``blocks[i]`` is out of range, free, or
    repeated more times than its refcount (nothing done then).
    """
    n = rc.size
    for i in range(blocks.size):
        b = blocks[i]
        if b < 0 or b >= n or rc[b] <= 0:
            return -1 - i
    for i in range(blocks.size):
        b = blocks[i]
        if rc[b] <= 0:  # a repeat that already took the last reference: undo
            for j in range(i):
                rc[blocks[j]] += 1
            return -1 - i
        rc[b] -= 1
        if rc[b] == 0:
            free[top] = b
            top += 1
    return top


@njit(cache=True)
def claim_for_insert(
    rc: np.ndarray, held: np.ndarray, blocks: np.ndarray, start: int, stop: int
) -> tuple:
    """Validate an insert's block table and mark the blocks it adopts as held.

    Every block (all of ``blocks``, also past ``stop``) must be in range and
    allocated (reason 1); those in ``[start, stop)``, which the cache adopts,
    must not be held by it already (reason 2) and must be distinct (reason 3).
    Returns (0, -1) with ``held`` set for ``blocks[start:stop]``, or (reason,
    index) with ``held`` exactly as it was.
    """
    n = rc.size
    for i in range(blocks.size):
        b = blocks[i]
        if b < 0 or b >= n or rc[b] <= 0:
            return 1, i
    for i in range(start, stop):
        b = blocks[i]
        if held[b]:
            reason = 2
            for j in range(start, i):  # set by this call: a repeat, not an old holding
                if blocks[j] == b:
                    reason = 3
            for j in range(start, i):
                held[blocks[j]] = False
            return reason, i
        held[b] = True
    return 0, -1


_CLAIM_REASONS = {
    1: "not allocated",
    2: "already cached at another position",
    3: "a repeat: adopted blocks must be distinct",
}


def claim_error(reason: int, i: int, blocks: np.ndarray, num_blocks: int) -> ValueError:
    """The error for ``claim_for_insert``'s ``(reason, i)`` (reason > 0), naming ``blocks[i]``
    and its block in a pool of ``num_blocks`` (a plain function: it builds a message)."""
    b = int(blocks[i])
    if reason == 1 and not 0 <= b < num_blocks:
        why = f"out of range [0, {num_blocks})"
    else:
        why = _CLAIM_REASONS[reason]
    return ValueError(f"blocks[{i}] is block {b}, which is {why}")


@njit(cache=True)
def set_flags(flags: np.ndarray, blocks: np.ndarray, value: bool) -> None:
    """flags[b] = value for each b."""
    for i in range(blocks.size):
        flags[blocks[i]] = value


@njit(cache=True)
def last_busy(rc: np.ndarray, blocks: np.ndarray) -> int:
    """Index of the last block with refcount > 1 (someone besides the cache holds it), or -1."""
    for i in range(blocks.size - 1, -1, -1):
        if rc[blocks[i]] > 1:
            return i
    return -1


@njit(cache=True)
def common_prefix_len(a: np.ndarray, b: np.ndarray) -> int:
    """Length of the longest common prefix of two int arrays."""
    n = min(a.size, b.size)
    for i in range(n):
        if a[i] != b[i]:
            return i
    return n


@njit(cache=True)
def narrow_int32(src: np.ndarray, dst: np.ndarray) -> int:
    """dst[i] = src[i] for an integer array ``src`` whose entries fit int32; returns -1, or the
    index of the first entry outside [-2**31, 2**31) (``dst`` then holds garbage).

    The copy and a running min/max share one branch-free pass, which vectorises
    (4 us for 32k int64 entries here, against 18 us with a test per entry and
    three passes for numpy's min, max and astype); only a failure pays a
    second pass to find the first bad entry."""
    lo = 0
    hi = 0
    for i in range(src.size):
        v = src[i]
        dst[i] = v
        lo = min(lo, v)
        hi = max(hi, v)
    if lo >= -2147483648 and hi <= 2147483647:
        return -1
    for i in range(src.size):
        v = src[i]
        if v < -2147483648 or v > 2147483647:
            return i
    return -1
