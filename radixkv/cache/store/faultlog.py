"""When the store tier and its backends log a fault: the first, then at every power of two.

A store that is down fails every call; one warning per call would flood the log,
none would hide it. Each fault counter (``StoreStats.errors``, ``corrupt``,
``StoreTierStats.errors``) logs when it reaches 1, 2, 4, 8, ...: a fault rate is
visible at a cost of log2(faults) lines. :func:`log_due` is that schedule; each
caller counts and writes its own message.
"""

from __future__ import annotations

__all__ = ["log_due"]


def log_due(count: int, added: int = 1) -> bool:
    """Whether a fault counter that just reached ``count`` by adding ``added`` (one call's
    faults, 0 <= ``added`` <= ``count``) passed 1 or a power of two: log then. A call that
    adds several faults at once logs once however many powers it passed. O(1).

    >>> [n for n in range(1, 20) if log_due(n)]
    [1, 2, 4, 8, 16]
    >>> log_due(9, added=6), log_due(7, added=3)
    (True, False)
    """
    return count.bit_length() > (count - added).bit_length()
