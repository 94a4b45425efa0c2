"""What both prefix indexes share: an injectable clock, the prefix lookup over a
prefix-closed set, and memory accounting (internal to radixkv.fleet)."""

from __future__ import annotations

import math
import sys
from collections.abc import Callable, Collection, Iterable, Sequence

__all__ = ["Clock"]

Clock = Callable[[], float]


def _held(held: Collection[int], hashes: Sequence[int]) -> int:
    """How many leading ``hashes`` are in ``held``, for a prefix-closed ``held`` (every block
    there with all its ancestors): a binary search, O(log len(hashes)) lookups."""
    n = len(hashes)
    if n == 0 or hashes[0] not in held:
        return 0
    if hashes[-1] in held:
        return n
    lo, hi = 1, n - 1  # hashes[lo - 1] is held, hashes[hi] is not
    while lo < hi:
        mid = (lo + hi) >> 1
        if hashes[mid] in held:
            lo = mid + 1
        else:
            hi = mid
    return lo


def _sizeof(objects: Iterable[object], seen: set[int]) -> int:
    """``sys.getsizeof`` summed over ``objects`` not already in ``seen`` (ids), adding them."""
    total = 0
    for o in objects:
        if id(o) not in seen:
            seen.add(id(o))
            total += sys.getsizeof(o)
    return total


class _Clocked:
    """An injectable clock and the latest time seen."""

    def __init__(self, clock: Clock) -> None:
        if not callable(clock):
            raise ValueError(f"clock must be a callable returning seconds, got {clock!r}")
        self._clock = clock
        self._last_now = -math.inf

    def _tick(self, now: float | None) -> float:
        if now is None:
            # A clock that steps back (wall time) is clamped, not an error mid-routing.
            now = max(float(self._clock()), self._last_now)
        elif not now >= self._last_now:
            raise ValueError(f"now must not go back: got now={now!r} after {self._last_now!r}")
        self._last_now = now
        return now
