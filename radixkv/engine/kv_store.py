"""The engine's side of the KV store tier: which store, and the keyspace its blocks live in.

- :func:`open_kv_store` opens the store ``EngineConfig.kv_store`` names: a directory
  (:class:`~radixkv.cache.store.LocalDiskStore`) or ``mooncake://HOST:PORT``
  (:class:`~radixkv.cache.store.MooncakeStore`, a pool a fleet shares);
  :func:`check_kv_store_spec` checks the name's shape without opening anything.
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
from radixkv.cache.store.local import LocalDiskStore
from radixkv.cache.store.mooncake import MooncakeStore
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

MOONCAKE_SCHEME = "mooncake://"
"""``kv_store`` values that start with this name a Mooncake master (``mooncake://HOST:PORT``);
any other value is a directory."""


class KVStoreOpenError(ValueError):
    """The store ``kv_store`` names cannot be opened (a directory this process cannot write,
    a master that does not answer): a ``ValueError`` a caller can tell from the others."""


def check_kv_store_spec(spec: object) -> str:
    """``spec`` if it can name a store (a non-empty str without NUL; after
    ``mooncake://``, something), else ``ValueError`` naming ``kv_store``. Opens nothing:
    whether the directory is writable or the master answers is :func:`open_kv_store`'s
    to find out. O(len(spec))."""
    if not isinstance(spec, str) or not spec or "\0" in spec:
        raise ValueError(
            f"kv_store must be a directory or {MOONCAKE_SCHEME}HOST:PORT, got {spec!r}"
        )
    if spec.startswith(MOONCAKE_SCHEME) and not spec[len(MOONCAKE_SCHEME) :]:
        raise ValueError(f"kv_store must be {MOONCAKE_SCHEME}HOST:PORT, got {spec!r}")
    return spec


def open_kv_store(spec: str, capacity_bytes: int) -> KVStore:
    """The store ``spec`` names, holding at most ``capacity_bytes`` of entries: a
    :class:`~radixkv.cache.store.MooncakeStore` over the master at ``HOST:PORT`` for
    ``mooncake://HOST:PORT`` (lending the pool ``capacity_bytes`` of memory), else a
    :class:`~radixkv.cache.store.LocalDiskStore` in the directory ``spec`` (made if missing).

    ``ValueError`` naming ``kv_store`` for a bad spec; :class:`KVStoreOpenError` (a
    ``ValueError``) starting ``kv_store ...`` for a directory this process cannot write or a
    master that does not answer (one line, the store's reason in it);
    ``ImportError`` naming the package for ``mooncake://`` without Mooncake's client.
    Complexity: a directory's start-up scan (O(files)), or one client joining the pool.
    """
    check_kv_store_spec(spec)
    try:
        if spec.startswith(MOONCAKE_SCHEME):
            return MooncakeStore(spec[len(MOONCAKE_SCHEME) :], capacity_bytes)
        return LocalDiskStore(spec, capacity_bytes)
    except ValueError as exc:
        raise KVStoreOpenError(f"kv_store {spec!r}: {exc}") from None


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
