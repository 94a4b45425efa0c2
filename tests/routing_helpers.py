"""What the routing tests share: a tiny block size and hash, bounded waits, requests, the
events a real radix cache emits, a settable clock, a policy made to raise. Torch- and
Ray-free (the fleet tier's routing state and event feed are tested without either)."""

from __future__ import annotations

import time
from collections.abc import Callable, Hashable, Sequence
from typing import Any

import numpy as np
import pytest

from radixkv.cache.allocator import BlockAllocator
from radixkv.cache.hashing import ChainHasher
from radixkv.cache.radix import RadixCache
from radixkv.fleet.routing import RouteRequest

BS = 4
XX = ChainHasher("xxhash", seed=0)
LOCAL = "tcp://127.0.0.1:*"
DEADLINE_S = 5.0


def wait_for(done: Callable[[], Any], what: str, timeout: float = DEADLINE_S) -> Any:
    """Call ``done`` every 20 ms until it returns something truthy; fail after ``timeout``."""
    deadline = time.monotonic() + timeout
    while True:
        value = done()
        if value:
            return value
        if time.monotonic() > deadline:
            pytest.fail(f"timed out waiting for {what}")
        time.sleep(0.02)


def req(tokens: Sequence[int], rid: str = "r", namespace: Hashable = None) -> RouteRequest:
    return RouteRequest(rid, np.asarray(tokens, dtype=np.int32), namespace)


def stored(tokens: Sequence[int], bs: int = BS, hasher: ChainHasher = XX) -> list:
    """The events a real radix cache emits when it caches ``tokens``."""
    alloc = BlockAllocator(64, bs)
    cache = RadixCache(alloc, events=hasher)
    blocks = alloc.alloc(len(tokens) // bs)
    cache.insert(tokens, blocks)
    alloc.decref(blocks)
    return cache.take_events()


class Clock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


class Failing:
    """Makes a policy's ``choose`` or ``on_finish`` raise, as the exact policy's hashing did on
    a namespace it could not encode (issue 21.7)."""

    def __init__(self, policy: Any, hook: str) -> None:
        self.calls = 0

        def fail(*args: Any) -> None:
            self.calls += 1
            raise UnicodeEncodeError("utf-8", "\ud800", 0, 1, "surrogates not allowed")

        setattr(policy, hook, fail)
