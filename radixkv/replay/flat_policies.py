"""The flat block-cache policies (``FLAT_POLICIES``: LRU, LFU, S3FIFO) as numba replayers.

Every kernel replays a whole trace over dense ids (``ids``, ``offsets`` as in
``Trace``) and returns ``(hit_blocks, block_hits, resident)``:

- ``hit_blocks[i]``: the largest k such that request i's first k ids were all
  resident when it arrived (the prefix scan runs before any of its accesses);
- ``block_hits``: accesses that found their block resident (hit or miss is
  decided per access, in order, after the prefix scan);
- ``resident``: bool per dense id, the cache contents after the last request.

State lives in flat arrays indexed by dense id; every access is O(1) (LRU,
LFU; S3FIFO amortised, its second-chance loop requeueing at most ``max_freq``
times per block). Kernels are compiled on first use and cached on disk
(``cache=True``).
"""

from __future__ import annotations

import numpy as np
from numba import njit

__all__ = ["lfu_kernel", "lru_kernel", "orphan_count", "reachable_mask", "s3fifo_kernel"]

_NIL = -1


@njit(cache=True)
def _prefix_len(ids: np.ndarray, start: int, stop: int, resident: np.ndarray) -> int:
    k = 0
    while start + k < stop and resident[ids[start + k]]:
        k += 1
    return k


# ---------------------------------------------------------------------- LRU
@njit(cache=True)
def _unlink(prev: np.ndarray, nxt: np.ndarray, v: int, head: int, tail: int) -> tuple:
    """Take ``v`` out of the doubly linked list ``prev``/``nxt``; return the new (head, tail)."""
    p = prev[v]
    q = nxt[v]
    if p == _NIL:
        head = q
    else:
        nxt[p] = q
    if q == _NIL:
        tail = p
    else:
        prev[q] = p
    return head, tail


@njit(cache=True)
def lru_kernel(ids: np.ndarray, offsets: np.ndarray, num_ids: int, capacity: int):
    """LRU: a doubly linked list over dense ids, head = least recently used."""
    num_requests = offsets.size - 1
    prev = np.full(num_ids, _NIL, dtype=np.int32)
    nxt = np.full(num_ids, _NIL, dtype=np.int32)
    resident = np.zeros(num_ids, dtype=np.bool_)
    hit_blocks = np.zeros(num_requests, dtype=np.int64)
    head = _NIL
    tail = _NIL
    size = 0
    block_hits = 0
    for r in range(num_requests):
        start = offsets[r]
        stop = offsets[r + 1]
        hit_blocks[r] = _prefix_len(ids, start, stop, resident)
        for i in range(start, stop):
            h = ids[i]
            if resident[h]:
                block_hits += 1
                if h == tail:
                    continue
                head, tail = _unlink(prev, nxt, h, head, tail)
            else:
                if size == capacity:
                    v = head
                    head = nxt[v]
                    if head == _NIL:
                        tail = _NIL
                    else:
                        prev[head] = _NIL
                    resident[v] = False
                    size -= 1
                resident[h] = True
                size += 1
            # append h at the tail (most recently used)
            prev[h] = tail
            nxt[h] = _NIL
            if tail == _NIL:
                head = h
            else:
                nxt[tail] = h
            tail = h
    return hit_blocks, block_hits, resident


# ---------------------------------------------------------------------- LFU
@njit(cache=True)
def lfu_kernel(ids: np.ndarray, offsets: np.ndarray, num_ids: int, capacity: int):
    """LFU in O(1) per access: one doubly linked list per access count.

    A block enters the list of count c at the tail when an access brings it
    to c, so each list runs from least to most recently used and the victim
    is the head of the smallest non-empty count's list: the smallest count,
    ties to the least recently used. A new block starts at count 1 (the
    admitting access); counts are unbounded and forgotten on eviction; the
    victim is picked before the new block goes in.
    """
    num_requests = offsets.size - 1
    max_count = ids.size + 2  # a count never exceeds the number of accesses
    count = np.zeros(num_ids, dtype=np.int64)
    prev = np.full(num_ids, _NIL, dtype=np.int32)
    nxt = np.full(num_ids, _NIL, dtype=np.int32)
    bhead = np.full(max_count, _NIL, dtype=np.int32)
    btail = np.full(max_count, _NIL, dtype=np.int32)
    resident = np.zeros(num_ids, dtype=np.bool_)
    hit_blocks = np.zeros(num_requests, dtype=np.int64)
    size = 0
    min_count = 1
    block_hits = 0
    for r in range(num_requests):
        start = offsets[r]
        stop = offsets[r + 1]
        hit_blocks[r] = _prefix_len(ids, start, stop, resident)
        for i in range(start, stop):
            h = ids[i]
            if resident[h]:
                block_hits += 1
                c = count[h]
                bhead[c], btail[c] = _unlink(prev, nxt, h, bhead[c], btail[c])  # leave list c
                if bhead[c] == _NIL and min_count == c:
                    min_count = c + 1
                c += 1
                count[h] = c
            else:
                if size == capacity:
                    v = bhead[min_count]
                    q = nxt[v]
                    bhead[min_count] = q
                    if q == _NIL:
                        btail[min_count] = _NIL
                    else:
                        prev[q] = _NIL
                    resident[v] = False
                    count[v] = 0
                    size -= 1
                c = 1
                count[h] = 1
                min_count = 1
                resident[h] = True
                size += 1
            # append h at the tail of list c
            t = btail[c]
            prev[h] = t
            nxt[h] = _NIL
            if t == _NIL:
                bhead[c] = h
            else:
                nxt[t] = h
            btail[c] = h
    return hit_blocks, block_hits, resident


# ------------------------------------------------------------------- S3FIFO
# where[h]: which queue holds h
_NONE = 0
_SMALL = 1
_MAIN = 2
_GHOST = 3


@njit(cache=True)
def s3fifo_kernel(
    ids: np.ndarray,
    offsets: np.ndarray,
    num_ids: int,
    small_cap: int,
    main_cap: int,
    max_freq: int,
):
    """S3FIFO (Yang et al., SOSP'23) as the replay seed spells it.

    Small and main are ring buffers, the ghost a doubly linked list over dense
    ids (``ghost_cap = main_cap``). Resident means small or main; the ghost is
    metadata only.

    One miss moves at most one block into main (the ghost-hit block, or the
    small queue's warm head) and at most one block into the ghost (the small
    queue's cold head, or main's second-chance victim), so each is done once,
    in the seed's order: a ghost hit leaves the ghost before main's victim
    enters it. Appending the new block to small commutes with the main and
    ghost steps (they never touch small).
    """
    num_requests = offsets.size - 1
    ghost_cap = main_cap
    where = np.zeros(num_ids, dtype=np.int8)
    freq = np.zeros(num_ids, dtype=np.int64)
    # A queue never holds more than num_ids blocks, so its ring needs no more slots than that
    # (a huge capacity then costs no memory); "full" still compares against the capacity.
    s_len = max(1, min(small_cap, num_ids))
    m_len = max(1, min(main_cap, num_ids))
    sbuf = np.zeros(s_len, dtype=np.int32)
    mbuf = np.zeros(m_len, dtype=np.int32)
    gprev = np.full(num_ids, _NIL, dtype=np.int32)
    gnext = np.full(num_ids, _NIL, dtype=np.int32)
    s_head = 0
    s_size = 0
    m_head = 0
    m_size = 0
    g_head = _NIL
    g_tail = _NIL
    g_size = 0
    hit_blocks = np.zeros(num_requests, dtype=np.int64)
    block_hits = 0
    for r in range(num_requests):
        start = offsets[r]
        stop = offsets[r + 1]
        k = 0
        while start + k < stop:
            w = where[ids[start + k]]
            if w != _SMALL and w != _MAIN:
                break
            k += 1
        hit_blocks[r] = k
        for i in range(start, stop):
            h = ids[i]
            w = where[h]
            if w == _SMALL or w == _MAIN:
                block_hits += 1
                if freq[h] < max_freq:
                    freq[h] += 1
                continue
            to_main = _NIL  # block to admit to main, with freq to_main_freq
            to_main_freq = 0
            to_ghost = _NIL  # block to insert into the ghost
            if w == _GHOST:
                # leave the ghost first, then enter main with freq 0
                g_head, g_tail = _unlink(gprev, gnext, h, g_head, g_tail)
                g_size -= 1
                where[h] = _NONE
                to_main = h
            else:
                # admit to small: its head (if full) goes to main when warm, else to the ghost
                if s_size >= small_cap:
                    v = sbuf[s_head]
                    s_head += 1
                    if s_head == s_len:
                        s_head = 0
                    s_size -= 1
                    if freq[v] >= 1:
                        to_main = v
                        to_main_freq = freq[v]  # preserved, not reset
                    else:
                        to_ghost = v
                j = s_head + s_size
                if j >= s_len:
                    j -= s_len
                sbuf[j] = h
                s_size += 1
                freq[h] = 0
                where[h] = _SMALL
            if to_main != _NIL:
                # second chance: requeue warm heads at the tail with freq - 1 until a
                # freq-0 head is evicted to the ghost
                while m_size >= main_cap:
                    v = mbuf[m_head]
                    m_head += 1
                    if m_head == m_len:
                        m_head = 0
                    m_size -= 1
                    if freq[v] >= 1:
                        freq[v] -= 1
                        j = m_head + m_size
                        if j >= m_len:
                            j -= m_len
                        mbuf[j] = v
                        m_size += 1
                    else:
                        to_ghost = v
                        break
                j = m_head + m_size
                if j >= m_len:
                    j -= m_len
                mbuf[j] = to_main
                m_size += 1
                freq[to_main] = to_main_freq
                where[to_main] = _MAIN
            if to_ghost != _NIL:
                v = to_ghost  # resident until now, so not in the ghost already
                if g_size >= ghost_cap:
                    g = g_head
                    g_head, g_tail = _unlink(gprev, gnext, g, g_head, g_tail)
                    g_size -= 1
                    where[g] = _NONE
                gprev[v] = g_tail
                gnext[v] = _NIL
                if g_tail == _NIL:
                    g_head = v
                else:
                    gnext[g_tail] = v
                g_tail = v
                g_size += 1
                where[v] = _GHOST
    resident = (where == _SMALL) | (where == _MAIN)
    return hit_blocks, block_hits, resident


# ------------------------------------------------------------- reachability
@njit(cache=True)
def reachable_mask(ids: np.ndarray, offsets: np.ndarray, resident: np.ndarray) -> np.ndarray:
    """Resident ids that some request of the trace would hit now as part of its prefix.

    A request's prefix scan stops at its first non-resident id, so a resident
    id is reachable iff it lies before that point in at least one request.
    """
    reach = np.zeros(resident.size, dtype=np.bool_)
    for r in range(offsets.size - 1):
        for i in range(offsets[r], offsets[r + 1]):
            h = ids[i]
            if not resident[h]:
                break
            reach[h] = True
    return reach


@njit(cache=True)
def orphan_count(ids: np.ndarray, offsets: np.ndarray, resident: np.ndarray) -> int:
    """Resident ids whose parent id (the id before it where it first appears) is not resident.

    The direct test of the issue's wording; ``reachable_mask`` gives the
    transitive one (a resident id under a resident parent can still be cut off
    higher up). For chained ids every orphan is unreachable, not the converse.
    """
    parent = np.full(resident.size, -1, dtype=np.int64)
    seen = np.zeros(resident.size, dtype=np.bool_)
    for r in range(offsets.size - 1):
        for i in range(offsets[r], offsets[r + 1]):
            h = ids[i]
            if not seen[h]:
                seen[h] = True
                if i > offsets[r]:
                    parent[h] = ids[i - 1]
    count = 0
    for h in range(resident.size):
        if resident[h] and parent[h] >= 0 and not resident[parent[h]]:
            count += 1
    return count
