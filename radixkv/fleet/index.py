"""What a router knows of each replica's prefix cache: which chained block hashes it holds.

A request's prompt is cut into blocks of ``block_size`` tokens and named by
chained hashes (:func:`chain_hashes`: the caches' :class:`ChainHasher` recipe,
the namespace folded into the first block), so hash ``i`` names the whole
prefix up to block ``i``: a replica's longest cached prefix for a request is
the run of the request's hashes it holds, from the first, up to the first miss.
Requests of different namespaces never share a hash, so never a prefix.

Two indexes answer ``match(hashes) -> {replica_id: matched blocks}``:

- :class:`ApproxIndex` learns from the router's own decisions (the Gateway API
  inference extension's prefix-cache proposal): routing a request to a replica
  records its hashes there; a per-replica LRU sized like the replica's pool and
  a global cap on entries stand in for the replica's own eviction.
- :class:`ExactIndex` is fed each replica's KV events (``BlockStored``,
  ``BlockRemoved``, ``AllBlocksCleared``): it holds exactly what the replica
  reported, plus *speculative* entries for the requests routed there, from the
  decision until the replica's events confirm them or the request ends.

Times come from an injectable clock (``time.monotonic`` by default); an
explicit ``now`` must never go back. Not thread-safe.

This module gathers the names; each lives in a module of its own:
:func:`~radixkv.cache.hashing.chain_hashes`, :mod:`~radixkv.fleet.approx`,
:mod:`~radixkv.fleet.exact` and :mod:`~radixkv.fleet.index_base` (the clock).
"""

from __future__ import annotations

from radixkv.cache.hashing import chain_hashes
from radixkv.fleet.approx import ApproxIndex
from radixkv.fleet.exact import ExactIndex
from radixkv.fleet.index_base import Clock

__all__ = ["ApproxIndex", "Clock", "ExactIndex", "chain_hashes"]
