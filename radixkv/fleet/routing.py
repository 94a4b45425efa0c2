"""The routing contract: one request to place, the replicas it may go to, the Router surface.

Every routing policy in :mod:`radixkv.fleet.router` has the :class:`Router`
surface, so the simulator (:mod:`radixkv.fleet.sim`) and a real serving front
(Ray Serve's request router, in the next layer) drive any of them the same way:
``choose`` a replica for each request, feed each replica's KV events to
``on_events``, tell ``on_finish`` when a request ends, ``drop_replica`` when one
dies. A policy that keeps state worth sizing (a prefix index) also has
:class:`MemoryReporting`'s ``memory_bytes()``; every built-in one has it (0 for
the policies without an index). Plain Python and numpy: no framework, no I/O.
"""

from __future__ import annotations

from collections.abc import Hashable, Sequence
from dataclasses import dataclass
from typing import Protocol, runtime_checkable

import numpy as np

from radixkv.cache.events import KVCacheEvent

__all__ = ["MemoryReporting", "ReplicaState", "RouteRequest", "Router"]


@dataclass(frozen=True)
class RouteRequest:
    """One request to place: its prompt tokens (int32), namespace and session.

    ``namespace`` scopes prefix sharing exactly as in the caches (requests of
    different namespaces never count as sharing). ``session`` (a conversation or
    user id, or None) is what session affinity keys on.
    """

    request_id: Hashable
    tokens: np.ndarray
    namespace: Hashable = None
    session: Hashable = None


@dataclass
class ReplicaState:
    """What the router knows of one replica when it decides.

    - ``in_flight``: requests the router sent there that have not finished
      (the router's own count: always current).
    - ``waiting`` / ``running``: the replica's queue, as last reported.
    - ``kv_usage``: fraction of its KV pool in use, as last reported (0..1).
    - ``capacity_blocks``: its pool size in blocks (sizes per-replica indexes).
    """

    replica_id: Hashable
    in_flight: int = 0
    waiting: int = 0
    running: int = 0
    kv_usage: float = 0.0
    capacity_blocks: int = 0


@runtime_checkable
class Router(Protocol):
    """A routing policy. Not thread-safe: one caller, or one lock around each call."""

    name: str

    def choose(self, request: RouteRequest, replicas: Sequence[ReplicaState]) -> Hashable:
        """The ``replica_id`` of the replica ``request`` goes to (one of ``replicas``).

        ``ValueError`` if ``replicas`` is empty. May record the decision (an
        index entry, a session binding).
        """
        ...

    def on_events(self, replica_id: Hashable, events: Sequence[KVCacheEvent]) -> None:
        """Apply a replica's KV events, oldest first (a no-op for policies without an index)."""
        ...

    def on_finish(self, replica_id: Hashable, request: RouteRequest) -> None:
        """``request``, sent to ``replica_id``, ended: finished, failed, or was aborted or
        rejected before it ran. Call it exactly once per ``choose`` that placed it there,
        with the same ``request_id``: the prefix-aware policies end the request's
        speculative entries and its place in their queue estimate here."""
        ...

    def drop_replica(self, replica_id: Hashable) -> None:
        """Forget everything about a replica that went away."""
        ...


@runtime_checkable
class MemoryReporting(Protocol):
    """A router that reports what its routing state takes (every policy of
    :mod:`radixkv.fleet.router`); the simulator's ``index_memory_bytes`` is 0 for any other."""

    def memory_bytes(self) -> int:
        """Approximate bytes of the policy's state: its prefix index's, 0 without one."""
        ...
