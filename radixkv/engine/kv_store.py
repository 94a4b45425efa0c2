"""The engine's side of the KV store tier: the keyspace its model and pool compute blocks in.

A :class:`~radixkv.cache.store.StoreKeyspace` says what a stored block's bytes mean;
:func:`store_keyspace` fills it from what decides them here: the model's weights and
config (:func:`~radixkv.model.digest.model_digest`), the pool's dtype, block size and
geometry, and the byte layout the model tier's
:class:`~radixkv.model.kv_bytes.KVBlockCodec` writes (:data:`~radixkv.model.kv_bytes.KV_LAYOUT`).
"""

from __future__ import annotations

from radixkv.cache.store.keys import StoreKeyspace
from radixkv.model.decoder import Decoder
from radixkv.model.digest import dtype_name, model_digest
from radixkv.model.kv_bytes import KV_LAYOUT
from radixkv.model.kvpool import KVPool

__all__ = ["store_keyspace"]


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
