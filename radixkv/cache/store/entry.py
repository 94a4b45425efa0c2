"""The on-store format of one block: a 64-byte header, then the payload.

::

    offset  size  field
    0       4     magic  b"RKVB"
    4       1     version (1)
    5       3     zero
    8       32    key: the block's store key, echoed (an entry under another name is refused)
    40      8     payload length, little-endian
    48      16    checksum: xxh3-128 of bytes 0..47 and the payload
    64      ...   payload

:func:`decode` returns the payload only when every field agrees: magic,
version, zero bytes, the key asked for, a length equal to what follows the
header, and the checksum. Anything else (a flipped bit anywhere, a truncated
or extended file, another block's entry, random bytes, an empty file) is None;
it never raises on what a store hands back. The checksum is not a MAC: it
catches corruption and accidents, while keys (content-addressed, see
:mod:`radixkv.cache.store.keys`) are what keep stores shared by several models
or tenants apart.
"""

from __future__ import annotations

import logging
import struct

import xxhash

from radixkv.cache.store.faultlog import log_due
from radixkv.cache.store.keys import KEY_BYTES

__all__ = [
    "log_corrupt",
    "HEADER_BYTES",
    "MAGIC",
    "VERSION",
    "decode",
    "decode_parts",
    "encode",
    "encode_header",
]

logger = logging.getLogger(__name__)

MAGIC = b"RKVB"
VERSION = 1
_HEAD = struct.Struct(f"<4sB3x{KEY_BYTES}sQ")  # what the checksum covers, with the payload
_SUM_BYTES = 16
HEADER_BYTES = _HEAD.size + _SUM_BYTES  # 64

Buffer = bytes | bytearray | memoryview


def _checksum(head: bytes, payload: Buffer) -> bytes:
    h = xxhash.xxh3_128(head)
    h.update(payload)
    return h.digest()


def encode_header(key: bytes, payload: Buffer) -> bytes:
    """The 64-byte header of ``payload``'s entry under ``key`` (write it, then the payload).
    Complexity: O(len(payload)) for the checksum."""
    head = _HEAD.pack(MAGIC, VERSION, key, memoryview(payload).nbytes)
    return head + _checksum(head, payload)


def encode(key: bytes, payload: Buffer) -> bytes:
    """``payload``'s whole entry under ``key``: header then payload. O(len(payload))."""
    return encode_header(key, payload) + payload


def decode(key: bytes, data: Buffer) -> bytes | None:
    """The payload of ``data`` if it is a sound entry for ``key``, else None; never raises
    for any bytes-like ``data``. Complexity: O(len(data)).

    >>> key = bytes(range(32))
    >>> decode(key, encode(key, b"kv")), decode(bytes(32), encode(key, b"kv"))
    (b'kv', None)
    """
    view = memoryview(data).cast("B")
    return decode_parts(key, view[:HEADER_BYTES].tobytes(), view[HEADER_BYTES:])


def decode_parts(key: bytes, header: bytes, payload: Buffer) -> bytes | None:
    """:func:`decode` of an entry read as its first :data:`HEADER_BYTES` bytes and the rest;
    ``payload`` itself is returned when it is ``bytes`` (no copy). Never raises for any
    bytes-like arguments. Complexity: O(len(payload)).
    """
    if len(header) != HEADER_BYTES:
        return None
    head = header[: _HEAD.size]
    magic, version, echo, length = _HEAD.unpack(head)
    size = memoryview(payload).nbytes
    if magic != MAGIC or version != VERSION or echo != key or length != size:
        return None
    # the pad bytes are covered by the checksum: a flipped zero byte fails it
    if _checksum(head, payload) != header[_HEAD.size :]:
        return None
    return payload if type(payload) is bytes else memoryview(payload).tobytes()


def log_corrupt(store: str, num_corrupt: int) -> None:
    """Log that ``store`` (a backend, named for a person) refused an unsound entry, its
    ``num_corrupt``-th, on :func:`~radixkv.cache.store.faultlog.log_due`'s schedule. The
    caller counts."""
    if log_due(num_corrupt):
        logger.warning(
            "kv store %s: an entry failed its check (bit rot, a torn write or a foreign "
            "value); dropped and served as a miss, the engine recomputes (%d so far)",
            store,
            num_corrupt,
        )
