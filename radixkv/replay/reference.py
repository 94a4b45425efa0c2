"""Plain reference replays of the flat policies (LRU, LFU, S3FIFO): the oracles.

Written to be obviously correct, straight from the replay rules (docs/replay.md),
over the ORIGINAL hash ids (no remapping), one Python step per access, with
``OrderedDict`` and ``deque``: slow, for checking ``replay()``'s compiled kernels
(the tests) and as the baseline they are timed against (benchmarks/bench_replay.py).
Each policy returns ``(hit_blocks, block_hits, resident)``: the per-request prefix
hit lengths, the number of accesses that found their block resident, and the final
resident set. No numpy, no numba.
"""

from __future__ import annotations

from collections import OrderedDict, deque
from collections.abc import Callable, Sequence

__all__ = [
    "REFERENCES",
    "Requests",
    "lfu_reference",
    "lru_reference",
    "orphan_reference",
    "prefix_len",
    "reference_replay",
    "s3fifo_reference",
    "unreachable_reference",
]

Requests = Sequence[Sequence[int]]  # each request's hash_ids
Outcome = tuple[list[int], int, set[int]]  # (hit_blocks, block_hits, resident)


def prefix_len(hash_ids: Sequence[int], is_resident: Callable[[int], bool]) -> int:
    """Largest k with hash_ids[0..k-1] all resident (stops at the first miss)."""
    k = 0
    while k < len(hash_ids) and is_resident(hash_ids[k]):
        k += 1
    return k


def lru_reference(requests: Requests, capacity: int) -> Outcome:
    """LRU: a hit moves the block to the most-recent end; a miss evicts the least recent."""
    cache: OrderedDict[int, None] = OrderedDict()  # first = least recently used
    hit_blocks, block_hits = [], 0
    for hash_ids in requests:
        hit_blocks.append(prefix_len(hash_ids, cache.__contains__))
        for h in hash_ids:
            if h in cache:
                block_hits += 1
                cache.move_to_end(h)
            else:
                if len(cache) == capacity:
                    cache.popitem(last=False)
                cache[h] = None
    return hit_blocks, block_hits, set(cache)


def lfu_reference(requests: Requests, capacity: int) -> Outcome:
    """LFU with O(1) buckets: count -> OrderedDict of its blocks, least recently used first."""
    count: dict[int, int] = {}
    buckets: dict[int, OrderedDict[int, None]] = {}
    min_count = 0
    hit_blocks, block_hits = [], 0
    for hash_ids in requests:
        hit_blocks.append(prefix_len(hash_ids, count.__contains__))
        for h in hash_ids:
            if h in count:
                block_hits += 1
                c = count[h]
                del buckets[c][h]
                if not buckets[c]:
                    del buckets[c]
                    if min_count == c:
                        min_count = c + 1
                count[h] = c + 1
                buckets.setdefault(c + 1, OrderedDict())[h] = None
                continue
            if len(count) == capacity:
                victim, _ = buckets[min_count].popitem(last=False)
                if not buckets[min_count]:
                    del buckets[min_count]
                del count[victim]
            count[h] = 1
            min_count = 1
            buckets.setdefault(1, OrderedDict())[h] = None
    return hit_blocks, block_hits, set(count)


def s3fifo_reference(
    requests: Requests, capacity: int, small_ratio: float = 0.1, max_freq: int = 3
) -> Outcome:
    """S3FIFO exactly as the seed's pseudocode: small/main deques, an ordered ghost, freq dict."""
    small_cap = round(capacity * small_ratio)
    main_cap = capacity - small_cap
    ghost_cap = main_cap
    assert small_cap >= 1 and main_cap >= 1
    small: deque[int] = deque()
    main: deque[int] = deque()
    ghost: OrderedDict[int, None] = OrderedDict()
    freq: dict[int, int] = {}  # resident blocks only

    def insert_to_ghost(h: int) -> None:
        if h in ghost:
            del ghost[h]
        elif len(ghost) >= ghost_cap:
            ghost.popitem(last=False)
        ghost[h] = None

    def admit_to_main(h: int, f: int) -> None:
        while len(main) >= main_cap:
            victim = main.popleft()
            if freq[victim] >= 1:
                freq[victim] -= 1
                main.append(victim)
            else:
                del freq[victim]
                insert_to_ghost(victim)
                break
        main.append(h)
        freq[h] = f

    def admit_to_small(h: int) -> None:
        while len(small) >= small_cap:
            victim = small.popleft()
            vf = freq[victim]
            if vf >= 1:
                admit_to_main(victim, vf)
            else:
                del freq[victim]
                insert_to_ghost(victim)
        small.append(h)
        freq[h] = 0

    hit_blocks, block_hits = [], 0
    for hash_ids in requests:
        hit_blocks.append(prefix_len(hash_ids, freq.__contains__))
        for h in hash_ids:
            if h in freq:  # resident: in small or main
                block_hits += 1
                freq[h] = min(freq[h] + 1, max_freq)
            elif h in ghost:
                del ghost[h]
                admit_to_main(h, 0)
            else:
                admit_to_small(h)
    assert set(small) | set(main) == set(freq) and len(small) + len(main) == len(freq)
    return hit_blocks, block_hits, set(freq)


REFERENCES: dict[str, Callable[[Requests, int], Outcome]] = {
    "lru": lru_reference,
    "lfu": lfu_reference,
    "s3fifo": s3fifo_reference,
}


def reference_replay(
    requests: Requests,
    policy: str,
    capacity: int,
    small_ratio: float = 0.1,
    max_freq: int = 3,
) -> Outcome:
    """``(hit_blocks, block_hits, resident)`` of a flat policy, the plain way."""
    if policy == "s3fifo":
        return s3fifo_reference(requests, capacity, small_ratio, max_freq)
    return REFERENCES[policy](requests, capacity)


def unreachable_reference(requests: Requests, resident: set[int]) -> int:
    """Resident blocks that no request would get as part of its prefix hit now."""
    reachable: set[int] = set()
    for hash_ids in requests:
        for h in hash_ids:
            if h not in resident:
                break
            reachable.add(h)
    return len(resident - reachable)


def orphan_reference(requests: Requests, resident: set[int]) -> int:
    """Resident blocks whose parent (the id before it at its first appearance) is not resident."""
    parent: dict[int, int | None] = {}
    for hash_ids in requests:
        for i, h in enumerate(hash_ids):
            parent.setdefault(h, hash_ids[i - 1] if i else None)
    return sum(1 for h in resident if parent[h] is not None and parent[h] not in resident)
