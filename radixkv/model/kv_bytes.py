"""KVBlockCodec: a host pool's blocks as bytes and back (the payload a KV store keeps).

The tensor half of the store tier, as :class:`~radixkv.model.kv_copy.KVCopier` is of
the host tier: the cache decides which host blocks go to or come from the store, and
this class turns each block's K and V, over all layers, into one ``bytes`` value, or
writes such values into host blocks. It reads and writes the host pool only (a CPU
:class:`~radixkv.model.kvpool.KVPool`); blocks reach the device through the host.

Layout ``"kv-v1"`` (:data:`KV_LAYOUT`), the one a :class:`~radixkv.cache.store.StoreKeyspace`
names: a block's payload is the C-order bytes of an array of shape
``[2, num_layers, block_size, num_kv_heads, head_dim]`` in the pool's dtype,
little-endian, where index 0 of the first axis is K and 1 is V. So the payload is K of
layer 0, K of layer 1, ..., then V of layer 0, ...; each ``[block_size, num_kv_heads,
head_dim]`` piece is exactly the pool's rows ``block * block_size`` to ``(block + 1) *
block_size`` of that layer's tensor, bit for bit (NaNs and signed zeros included).
Its length is :attr:`KVPool.bytes_per_block <radixkv.model.kvpool.KVPool.bytes_per_block>`.
The layout knows no dtype, block size or geometry of its own: those are the keyspace's
other fields, so a payload is only ever read back into a pool of the same ones.
"""

from __future__ import annotations

import sys
from collections.abc import Sequence

import numpy as np
import torch

from radixkv.checks import check_ints
from radixkv.errors import ArgumentTypeError
from radixkv.model.kvpool import KVPool

__all__ = ["KV_LAYOUT", "KVBlockCodec"]

KV_LAYOUT = "kv-v1"


class KVBlockCodec:
    """Converts whole blocks of a CPU ``host`` pool to ``bytes`` in layout ``"kv-v1"`` and back.

    Owns no memory of its own: it keeps byte views of the pool's tensors, so the pool must
    outlive it, and it writes only the blocks it is named. It does not order itself
    against other writers of the same blocks (the host tier's copier): the caller owns
    that, as it does for the copier. ``ValueError`` at construction if ``host`` is not a
    ``KVPool`` on the CPU, or (``RuntimeError``) on a big-endian machine, whose pools
    would not be in the layout's byte order.
    """

    layout = KV_LAYOUT

    def __init__(self, host: KVPool) -> None:
        if not isinstance(host, KVPool):
            raise ArgumentTypeError(f"host must be a KVPool, got {type(host).__name__}")
        if host.device.type != "cpu":
            raise ValueError(f"host pool must be on the CPU, got device {host.device}")
        if sys.byteorder != "little":
            raise RuntimeError(f"layout {KV_LAYOUT!r} is little-endian; this machine is not")
        self.host_pool = host
        self.bytes_per_block = host.bytes_per_block
        # Per K and V tensor of each layer (the layout's order), a [num_blocks, piece] byte
        # view: a block's piece of every layer is one row, so a payload is one join.
        self._pieces: list[np.ndarray] = [
            t.view(torch.uint8).numpy().reshape(host.num_blocks, -1) for t in (*host.k, *host.v)
        ]

    def host_blocks_to_bytes(self, host_ids: Sequence[int] | np.ndarray) -> list[bytes]:
        """The payload of each host block ``host_ids[i]``, in order (a block may repeat).

        Each value is a new ``bytes`` of :attr:`bytes_per_block` bytes, independent of the
        pool afterwards. ``ValueError`` (``ArgumentTypeError`` for a non-int) naming
        ``host_ids[i]`` if an id is not a block of the pool; nothing is read before.

        Complexity: O(len(host_ids) * bytes_per_block), one copy per block: the block's
        ``2 * num_layers`` pieces are joined straight into the new ``bytes`` (a batched
        gather first, one call per layer, copies twice and measured 2-4x slower).
        """
        ids = self._ids(host_ids)
        pieces = self._pieces
        return [b"".join([p[b] for p in pieces]) for b in ids]

    def bytes_to_host_blocks(
        self, values: Sequence[bytes | bytearray | memoryview], host_ids: Sequence[int] | np.ndarray
    ) -> None:
        """Write payload ``values[i]`` into host block ``host_ids[i]``, for every ``i``.

        Every argument is checked before any block is written: ``ValueError`` naming
        ``host_ids`` or ``host_ids[i]`` for an id outside the pool, a repeated id, or a
        length unlike ``values``'; naming ``values[i]`` for a value that is not
        ``bytes``/``bytearray``/``memoryview`` (``ArgumentTypeError``), not contiguous,
        or not exactly :attr:`bytes_per_block` bytes long. A value of the right length is
        taken as a payload of this layout: the store's entry checksum, not this method,
        is what tells a sound payload from a damaged one. The values are only read.

        Complexity: O(len(values) * bytes_per_block), one copy per block.
        """
        if isinstance(values, (bytes, bytearray, memoryview, str)) or not isinstance(
            values, Sequence
        ):
            raise ArgumentTypeError(
                f"values must be a sequence of payloads, got {type(values).__name__}"
            )
        ids = self._ids(host_ids)
        if len(values) != len(ids):
            raise ValueError(
                f"host_ids must have one block per value: {len(ids)} ids for "
                f"{len(values)} values"
            )
        first: dict[int, int] = {}
        for i, b in enumerate(ids):
            if first.setdefault(b, i) != i:
                raise ValueError(
                    f"host_ids[{i}] repeats block {b} (host_ids[{first[b]}]): a block is "
                    "written once a call"
                )
        size = self.bytes_per_block
        views = []
        for i, value in enumerate(values):
            if not isinstance(value, (bytes, bytearray, memoryview)):
                raise ArgumentTypeError(
                    f"values[{i}] must be bytes-like (a block's payload), got "
                    f"{type(value).__name__}"
                )
            view = memoryview(value)
            if not view.c_contiguous:
                raise ValueError(f"values[{i}] must be a contiguous buffer")
            if view.nbytes != size:
                raise ValueError(
                    f"values[{i}] must be {size} bytes (one block in layout {KV_LAYOUT!r}), "
                    f"got {view.nbytes}"
                )
            views.append(np.frombuffer(view.cast("B"), dtype=np.uint8))
        pieces = self._pieces
        num = len(pieces)
        for b, data in zip(ids, views, strict=True):
            for piece, row in zip(pieces, data.reshape(num, -1), strict=True):
                piece[b] = row

    def _ids(self, host_ids: Sequence[int] | np.ndarray) -> list[int]:
        """``host_ids`` as a list of ints, each a block of the pool, else the error."""
        if isinstance(host_ids, np.ndarray):
            if host_ids.ndim != 1:
                raise ValueError(f"host_ids must be 1-D, got shape {host_ids.shape}")
            host_ids = host_ids.tolist()
        elif isinstance(host_ids, (bytes, str)) or not isinstance(host_ids, Sequence):
            raise ArgumentTypeError(
                f"host_ids must be a sequence of block ids, got {type(host_ids).__name__}"
            )
        return check_ints("host_ids", host_ids, low=0, high=self.host_pool.num_blocks - 1)

    def __repr__(self) -> str:
        return f"KVBlockCodec(host_blocks={self.host_pool.num_blocks}, layout={KV_LAYOUT!r})"
