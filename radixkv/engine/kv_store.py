"""The engine's side of the KV store tier: which store, and the keyspace its blocks live in.

- :func:`open_kv_store` opens the store ``EngineConfig.kv_store`` names: a directory
  (:class:`~radixkv.cache.store.LocalDiskStore`) or ``mooncake://HOST:PORT``
  (:class:`~radixkv.cache.store.MooncakeStore`, a pool a fleet shares);
  :func:`check_kv_store_spec` checks the name's shape without opening anything (both
  torch-free, in :mod:`radixkv.cache.store.opening`, for a fleet's router; re-exported here).
- :func:`store_keyspace`: a :class:`~radixkv.cache.store.StoreKeyspace` says what a stored
  block's bytes mean; it is filled from what decides them here: the model's weights and
  config (:func:`~radixkv.model.digest.model_digest`), the pool's dtype, block size and
  geometry, and the byte layout the model tier's
  :class:`~radixkv.model.kv_bytes.KVBlockCodec` writes (:data:`~radixkv.model.kv_bytes.KV_LAYOUT`).
- :func:`store_tier`: the :class:`~radixkv.cache.store.tier.StoreTier` an engine puts below
  its host pool (the keyspace, the codec over the host pool, the write policy).
"""

from __future__ import annotations

from radixkv.cache.store.keys import StoreKeyspace
from radixkv.cache.store.opening import (
    MOONCAKE_SCHEME,
    KVStoreOpenError,
    check_kv_store_spec,
    open_kv_store,
)
from radixkv.cache.store.protocol import KVStore
from radixkv.cache.store.tier import StoreTier
from radixkv.model.decoder import Decoder
from radixkv.model.digest import dtype_name, model_digest
from radixkv.model.kv_bytes import KV_LAYOUT, KVBlockCodec
from radixkv.model.kvpool import KVPool

__all__ = [
    "MOONCAKE_SCHEME",
    "KVStoreOpenError",
    "check_kv_store_spec",
    "open_kv_store",
    "store_keyspace",
    "store_tier",
]

def store_tier(model: Decoder, host_pool: KVPool, store: KVStore, write_policy: str) -> StoreTier:
    """The store tier below a host pool: ``store`` in the keyspace of ``model`` and
    ``host_pool`` (:func:`store_keyspace`: hashes every weight once), moved through a
    :class:`~radixkv.model.kv_bytes.KVBlockCodec` over ``host_pool``, under
    ``write_policy`` (``"write_back"`` or ``"write_through"``: ``ValueError`` naming it).
    Complexity: O(total weight bytes)."""
    return StoreTier(store, store_keyspace(model, host_pool), KVBlockCodec(host_pool), write_policy)


def store_keyspace(model: Decoder, pool: KVPool) -> StoreKeyspace:
    """The keyspace of the blocks ``model`` computes into ``pool`` (the device pool or a
    host pool of the same layout: they share it).

    ``ValueError`` naming ``pool.num_layers``, ``pool.num_kv_heads`` or ``pool.head_dim``
    when the pool is not shaped for the model. Hashes every weight once
    (:func:`~radixkv.model.digest.model_digest`): call it once at start-up.

    Complexity: O(total weight bytes).
    """
    c = model.config
    for name, want in (
        ("num_layers", c.num_layers),
        ("num_kv_heads", c.num_kv_heads),
        ("head_dim", c.head_dim),
    ):
        got = getattr(pool, name)
        if got != want:
            raise ValueError(f"pool.{name} must equal the model's {want}, got {got}")
    return StoreKeyspace(
        model_digest=model_digest(model),
        dtype=dtype_name(pool.dtype),
        block_size=pool.block_size,
        num_layers=pool.num_layers,
        num_kv_heads=pool.num_kv_heads,
        head_dim=pool.head_dim,
        layout=KV_LAYOUT,
    )
