"""The storage tier below the host: a KV store keyed so that it can never serve the wrong bytes.

Torch-free: a store keeps bytes; the engine turns K/V into bytes.

- :mod:`~radixkv.cache.store.protocol`: ``KVStore`` (a run's existence, batched put
  and get, capacity, stats) and ``StoreStats``;
- :mod:`~radixkv.cache.store.keys`: ``StoreKeyspace`` (the model identity, dtype,
  block size, geometry) and the block keys (keyspace, namespace, chained hash);
- :mod:`~radixkv.cache.store.entry`: the on-store format (header, key echo,
  checksum); a bad entry decodes to None;
- :mod:`~radixkv.cache.store.lru`: ``LruIndex``, the capacity accounting the backends share;
- :mod:`~radixkv.cache.store.local`: ``LocalDiskStore``, the embedded default
  (a directory on local disk);
- :mod:`~radixkv.cache.store.memory`: ``MemoryStore``, in this process's memory;
- :mod:`~radixkv.cache.store.mooncake`: ``MooncakeStore``, a Mooncake Store pool shared by
  a fleet (Mooncake's client is imported when one is made).

docs/store.md describes the tier.
"""

from radixkv.cache.store.keys import KEY_BYTES, StoreKeyspace
from radixkv.cache.store.local import LocalDiskStore
from radixkv.cache.store.memory import MemoryStore
from radixkv.cache.store.mooncake import MooncakeStore
from radixkv.cache.store.protocol import KVStore, StoreStats

__all__ = [
    "KEY_BYTES",
    "KVStore",
    "LocalDiskStore",
    "MemoryStore",
    "MooncakeStore",
    "StoreKeyspace",
    "StoreStats",
]
