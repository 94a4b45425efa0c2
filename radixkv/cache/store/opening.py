"""Opening the KV store a name says: a directory or ``mooncake://HOST:PORT``.

Torch-free, so a process that only routes (a fleet's ingress, whose store-aware router asks
the replicas' store what it holds) opens the same store the engines open
(:mod:`radixkv.engine.kv_store` re-exports these).
"""

from __future__ import annotations

from radixkv.cache.store.local import LocalDiskStore
from radixkv.cache.store.mooncake import MooncakeStore, check_master
from radixkv.cache.store.protocol import KVStore

__all__ = [
    "MOONCAKE_SCHEME",
    "KVStoreOpenError",
    "check_kv_store",
    "check_kv_store_spec",
    "open_kv_store",
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


def check_kv_store(spec: str, capacity_bytes: int) -> None:
    """What :func:`open_kv_store` would refuse, found without joining a pool: a directory is
    opened (and left), a Mooncake master is only probed (``mooncake.check_master``), so a
    fleet's driver can say one line before any replica starts. Raises as
    :func:`open_kv_store` (``KVStoreOpenError`` for a store that cannot be opened).
    Complexity: a directory's start-up scan, or one TCP connect."""
    check_kv_store_spec(spec)
    if not spec.startswith(MOONCAKE_SCHEME):
        open_kv_store(spec, capacity_bytes)
        return
    try:
        check_master(spec[len(MOONCAKE_SCHEME) :])
    except ValueError as exc:
        raise KVStoreOpenError(f"kv_store {spec!r}: {exc}") from None


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
