"""The tiers below a simulated replica's device: none, or a host tier over a store the fleet shares.

A replica of :mod:`radixkv.fleet.sim` delegates its cache's making and its
cache step to a *tiers* collaborator (:class:`Tiers`):

- :data:`DEVICE_ONLY` (the default): a plain ``RadixCache`` and
  ``place_prompt``; nothing below the device, every load costs nothing, so a
  run is what it was before tiers existed (``benchmarks/bench_fleet.py --quick``
  is the check);
- :class:`SharedStore`: every replica's cache is a real ``TieredRadixCache``
  with a host tier of its own (``host_capacity_blocks``) over a real
  :class:`~radixkv.cache.store.tier.StoreTier`, and every replica's tier writes to
  and reads from **one** :class:`~radixkv.cache.store.MemoryStore` of
  ``capacity_blocks`` entries. What one replica's host lets go of (``write_back``)
  or copies (``write_through``) any other replica can then load.

**Bytes.** The simulator has no K/V, so the tier's byte copier is
:class:`NullByteCopier`: every payload is :data:`PAYLOAD_BYTES` zero bytes and a
load writes nothing (the host tier's copier is ``NullCopier`` likewise). The
store checks every entry it serves (key echo, checksum) as it does for real
K/V, and its capacity counts whole entries (a 64-byte header and the payload),
so it holds exactly ``capacity_blocks`` blocks. The keys are the real recipe
(:class:`~radixkv.cache.store.keys.StoreKeyspace` over :func:`sim_keyspace`'s
fixed digest): the exact router's store view (:class:`StoreView`) hashes a
prompt to the same keys.

**Cost.** A prompt's tokens served by a lower tier are not computed: the
replica prefills from past them, and pays a load instead, ``load_cost x
prefill_per_token`` seconds per token from the store and ``host_load_cost x
prefill_per_token`` from its host (the linear part of computing the token: a
load moves a token's K/V bytes whatever its position, while computing it also
attends to every key before it). The defaults and where they come from:
docs/store.md, "Fleet: a shared store".
"""

from __future__ import annotations

from collections.abc import Callable, Hashable, Sequence
from typing import NamedTuple, Protocol

import numpy as np

from radixkv.cache.allocator import BlockAllocator
from radixkv.cache.hashing import ChainHasher
from radixkv.cache.host import HostTier, NullCopier
from radixkv.cache.placement import place_prompt
from radixkv.cache.radix import RadixCache
from radixkv.cache.store import KVStore, MemoryStore, StoreKeyspace
from radixkv.cache.store.entry import HEADER_BYTES
from radixkv.cache.store.tier import STORE_WRITE_POLICIES, StoreTier
from radixkv.cache.tiered import TieredRadixCache
from radixkv.checks import check_int, check_number
from radixkv.fleet.service import ServiceModel

__all__ = [
    "DEFAULT_HOST_LOAD_COST",
    "DEFAULT_STORE_LOAD_COST",
    "DEVICE_ONLY",
    "PAYLOAD_BYTES",
    "NO_STORE_VIEW",
    "DeviceOnly",
    "NoStoreView",
    "NullByteCopier",
    "Placed",
    "SharedStore",
    "StoreView",
    "Tiers",
    "sim_keyspace",
]

DEFAULT_STORE_LOAD_COST = 0.1
"""A token loaded from the shared store costs this times ``prefill_per_token`` (docs/store.md)."""
DEFAULT_HOST_LOAD_COST = 0.02
"""A token loaded from a replica's own host tier costs this times ``prefill_per_token``."""
PAYLOAD_BYTES = 8  # one simulated block's payload: the sim moves no K/V
# "the simulated model": SHA-256 of b"radixkv/fleet-sim" (a constant: hashing lives in
# radixkv/cache/hashing.py alone)
_SIM_MODEL_DIGEST = "e20c5b068804f13a776e092da30fe3e75cb1b8275e4b778777dad6c997939fd5"


def sim_keyspace(block_size: int) -> StoreKeyspace:
    """The keyspace of the simulator's blocks: a fixed digest naming "the simulated model",
    ``block_size`` tokens a block, a one-element geometry. ``ValueError`` for a bad size."""
    return StoreKeyspace(_SIM_MODEL_DIGEST, "float32", block_size, 1, 1, 1)


class NullByteCopier:
    """A :class:`~radixkv.cache.store.tier.ByteCopier` for a host pool that holds no K/V (the
    simulator's): each block's payload is :data:`PAYLOAD_BYTES` zero bytes; a load writes
    nothing. Counts the blocks it was asked to move."""

    layout = "kv-v1"
    bytes_per_block = PAYLOAD_BYTES

    def __init__(self) -> None:
        self.to_bytes = 0
        self.from_bytes = 0

    def host_blocks_to_bytes(self, host_ids: np.ndarray) -> list[bytes]:
        self.to_bytes += len(host_ids)
        return [bytes(PAYLOAD_BYTES)] * len(host_ids)

    def bytes_to_host_blocks(self, values: Sequence[bytes], host_ids: np.ndarray) -> None:
        self.from_bytes += len(host_ids)


class Placed(NamedTuple):
    """One request's cache step on a replica (cache tokens: trace ids in the simulator).

    ``num_cached_tokens`` is its whole hit (the first position to compute): the device
    prefix, then ``host_tokens`` loaded from the replica's host, then ``store_tokens``
    loaded from the shared store. ``blocks`` are the blocks the caller now holds one
    reference on (``place_prompt``'s).
    """

    num_cached_tokens: int
    blocks: np.ndarray
    host_tokens: int
    store_tokens: int


class Tiers(Protocol):
    """What a simulated replica delegates to: its cache, its cache step, its loads' cost."""

    def make_cache(
        self, allocator: BlockAllocator, eviction: str, events: ChainHasher
    ) -> RadixCache:
        """A new cache over ``allocator`` (KV events on, hashed with ``events``)."""
        ...

    def place(
        self, cache: RadixCache, tokens: np.ndarray, namespace: Hashable, exclusive: bool
    ) -> Placed | None:
        """``place_prompt`` on ``cache`` (made by :meth:`make_cache`), by tier."""
        ...

    def load_seconds(self, service: ServiceModel, host_tokens: int, store_tokens: int) -> float:
        """Seconds a replica spends loading that many real tokens from its host and the store."""
        ...


class DeviceOnly:
    """No tier below the device: a plain ``RadixCache``; nothing is ever loaded."""

    def make_cache(
        self, allocator: BlockAllocator, eviction: str, events: ChainHasher
    ) -> RadixCache:
        return RadixCache(allocator, eviction=eviction, events=events)

    def place(
        self, cache: RadixCache, tokens: np.ndarray, namespace: Hashable, exclusive: bool
    ) -> Placed | None:
        placed = place_prompt(cache, tokens, namespace, exclusive=exclusive)
        if placed is None:
            return None
        return Placed(placed.num_cached_tokens, placed.blocks, 0, 0)

    def load_seconds(self, service: ServiceModel, host_tokens: int, store_tokens: int) -> float:
        return 0.0


DEVICE_ONLY = DeviceOnly()


class SharedStore:
    """One store of ``capacity_blocks`` blocks shared by a simulated fleet, a host tier of
    ``host_capacity_blocks`` per replica above it (see the module docstring).

    - ``write_policy``: the store tier's (``"write_back"``: what a replica's host
      eviction deletes is put; ``"write_through"``: every backup to a host is put);
      the host tiers back up on device eviction (``HostTier``'s ``"write_back"``);
    - ``load_cost`` / ``host_load_cost``: a loaded token's seconds over
      ``prefill_per_token`` (>= 0).

    The host tier must hold a prompt to pass a store run through it (a fetch takes
    what host room eviction can make; a node that finds no host room is not
    backed up and never reaches the store), so give it at least the longest
    prompt's blocks. ``ValueError`` naming the argument and value. ``store`` is the
    shared :class:`~radixkv.cache.store.MemoryStore` (its ``stats`` count puts, hits
    and evictions); one instance per simulated run.
    """

    def __init__(
        self,
        capacity_blocks: int,
        *,
        host_capacity_blocks: int,
        block_size: int = 1,
        write_policy: str = "write_back",
        load_cost: float = DEFAULT_STORE_LOAD_COST,
        host_load_cost: float = DEFAULT_HOST_LOAD_COST,
    ) -> None:
        self.capacity_blocks = check_int("capacity_blocks", capacity_blocks, low=1)
        self.host_capacity_blocks = check_int("host_capacity_blocks", host_capacity_blocks, low=1)
        self.block_size = check_int("block_size", block_size, low=1)
        if write_policy not in STORE_WRITE_POLICIES:
            raise ValueError(
                f"write_policy must be one of {STORE_WRITE_POLICIES}, got {write_policy!r}"
            )
        self.write_policy = write_policy
        self.load_cost = check_number("load_cost", load_cost, low=0)
        self.host_load_cost = check_number("host_load_cost", host_load_cost, low=0)
        self.keyspace = sim_keyspace(self.block_size)
        self.store = MemoryStore(self.capacity_blocks * (HEADER_BYTES + PAYLOAD_BYTES))
        self.tiers: list[StoreTier] = []  # one per cache made, in order

    def make_cache(
        self, allocator: BlockAllocator, eviction: str, events: ChainHasher
    ) -> RadixCache:
        """A ``TieredRadixCache`` over ``allocator``: a host pool of its own and a
        ``StoreTier`` of its own over the shared store. ``ValueError`` if ``allocator``'s
        block size is not this store's."""
        if allocator.block_size != self.block_size:
            raise ValueError(
                f"allocator.block_size must be the store's {self.block_size}, "
                f"got {allocator.block_size}"
            )
        tier = StoreTier(self.store, self.keyspace, NullByteCopier(), self.write_policy)
        self.tiers.append(tier)
        host = HostTier(
            BlockAllocator(self.host_capacity_blocks, self.block_size),
            NullCopier(),
            eviction=eviction,
            store=tier,
        )
        return TieredRadixCache(allocator, eviction=eviction, events=events, host=host)

    def place(
        self, cache: RadixCache, tokens: np.ndarray, namespace: Hashable, exclusive: bool
    ) -> Placed | None:
        """``place_prompt``, its load split by tier (``Placement.num_store_blocks`` came
        from the store, the rest of the load from the host). Complexity: ``place_prompt``'s."""
        placed = place_prompt(cache, tokens, namespace, exclusive=exclusive)
        if placed is None:
            return None
        bs = self.block_size
        host = (placed.num_loaded_blocks - placed.num_store_blocks) * bs
        return Placed(placed.num_cached_tokens, placed.blocks, host, placed.num_store_blocks * bs)

    def load_seconds(self, service: ServiceModel, host_tokens: int, store_tokens: int) -> float:
        """``(host_load_cost x host_tokens + load_cost x store_tokens) x prefill_per_token``."""
        return (
            self.host_load_cost * host_tokens + self.load_cost * store_tokens
        ) * service.prefill_per_token

    def view(self, load_cost: float | None = None) -> StoreView:
        """The router's view of this store (:class:`StoreView`), pricing a fetched block at
        ``load_cost`` (None: this store's)."""
        cost = self.load_cost if load_cost is None else load_cost
        return StoreView(self.store, self.keyspace, cost)


class NoStoreView:
    """A router that knows of no shared store: every block it does not see cached is computed."""

    def pricer(
        self,
        tokens: np.ndarray,
        namespace: Hashable,
        num_blocks: int,
        service: ServiceModel,
        tokens_per_block: int,
    ) -> None:
        """None: the scoring prices the plain prefill."""
        return None


NO_STORE_VIEW = NoStoreView()


class StoreView:
    """What a router knows of a shared store: which blocks any replica could fetch from it.

    At decision time it asks the store itself (``contains_run``, one call per distinct
    device prefix among the replicas) for the run of the prompt's blocks it holds
    past a replica's prefix, and prices those blocks as a load: ``load_cost x
    prefill_per_token`` seconds a token instead of their prefill. ``keyspace`` must be
    the replicas' store keyspace (the prompt is keyed with it). A store that answers
    out of contract (not an int in range) counts as holding nothing. ``ValueError``
    naming the argument and value.
    """

    def __init__(self, store: KVStore, keyspace: StoreKeyspace, load_cost: float) -> None:
        if not isinstance(store, KVStore):
            raise ValueError(f"store must be a KVStore, got {type(store).__name__}")
        if not isinstance(keyspace, StoreKeyspace):
            raise ValueError(f"keyspace must be a StoreKeyspace, got {type(keyspace).__name__}")
        self.store = store
        self.keyspace = keyspace
        self.load_cost = check_number("load_cost", load_cost, low=0)

    def pricer(
        self,
        tokens: np.ndarray,
        namespace: Hashable,
        num_blocks: int,
        service: ServiceModel,
        tokens_per_block: int,
    ) -> Callable[[int], float]:
        """The request's own prefill seconds on a replica holding its first ``m`` blocks,
        as a function of ``m``: the store's run past ``m`` (``s`` blocks) loads, the rest
        is computed: ``prefill(n t, (m + s) t) + load_cost x prefill_per_token x s t``
        (``n`` = ``num_blocks``, ``t`` = ``tokens_per_block``). The prompt is keyed once,
        on the first call that needs it. Complexity: O(prompt) hashing once, then one
        ``contains_run`` per call."""
        t = tokens_per_block
        total = num_blocks * t
        prefill = service.prefill
        per_block = self.load_cost * service.prefill_per_token * t
        keys: list[bytes] = []
        store = self.store

        def price(m: int) -> float:
            if m >= num_blocks:
                return prefill(total, m * t)
            if not keys:
                bs = self.keyspace.block_size
                keys.extend(self.keyspace.block_keys(tokens[: num_blocks * bs], namespace))
            s = store.contains_run(keys[m:])
            if type(s) is not int or not 0 <= s <= num_blocks - m:
                s = 0
            return prefill(total, (m + s) * t) + per_block * s

        return price
