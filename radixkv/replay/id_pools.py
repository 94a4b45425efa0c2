"""IdPools: the replay's stand-in for K/V bytes, so a three-tier replay moves real payloads.

A trace has no K/V, only block ids. With a store tier, replay still moves bytes
through every tier: each device and host block holds the id of the position it
caches (one int32), the host tier's copier moves ids between the pools, and the
store tier's byte copier turns a host block's id into a 4-byte payload and back
(an entry of :data:`STORE_ENTRY_BYTES` in the store, header included). The
replayer writes the ids of the blocks it computes and checks (``check``) that
every block a request is served from the cache holds the id of its position:
a load from the host or the store that brought the wrong block back is an
``InvariantError``, not a silently wrong hit rate.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from radixkv.cache.store.entry import HEADER_BYTES
from radixkv.cache.store.keys import StoreKeyspace
from radixkv.errors import invariant

__all__ = ["REPLAY_KEYSPACE", "STORE_ENTRY_BYTES", "IdPools"]

_ID = np.dtype("<i4")
PAYLOAD_BYTES = _ID.itemsize
STORE_ENTRY_BYTES = HEADER_BYTES + PAYLOAD_BYTES
"""Bytes one block takes in the store: the entry header and a 4-byte id. A store of N
blocks is a ``MemoryStore(N * STORE_ENTRY_BYTES)``: it holds exactly N entries."""

# A keyspace of its own (layout "replay-ids-v1"): replay's payloads are never K/V bytes.
REPLAY_KEYSPACE = StoreKeyspace(
    "5265706c61792069647320706f6f6c73", "int32", 1, 1, 1, 1, layout="replay-ids-v1"
)
_FREE = -1


class IdPools:
    """The device and host pools as one int32 id per block (``device``, ``host`` arrays).

    A :class:`~radixkv.cache.host.BlockCopier` (device <-> host) and a
    :class:`~radixkv.cache.store.tier.ByteCopier` (host <-> 4-byte payloads, layout
    ``REPLAY_KEYSPACE.layout``). A freed device block is reset to -1, which no
    trace id is. Complexity: O(blocks named) per call.
    """

    layout = REPLAY_KEYSPACE.layout
    bytes_per_block = PAYLOAD_BYTES

    def __init__(self, num_device: int, num_host: int) -> None:
        self.device = np.full(num_device, _FREE, dtype=_ID)
        self.host = np.full(num_host, _FREE, dtype=_ID)

    # ---------------------------------------------------------------- BlockCopier
    def backup(self, device: np.ndarray, host: np.ndarray) -> None:
        self.host[host] = self.device[device]

    def load(self, host: np.ndarray, device: np.ndarray) -> None:
        self.device[device] = self.host[host]

    def discard(self, device: np.ndarray) -> None:
        self.device[device] = _FREE

    # ---------------------------------------------------------------- ByteCopier
    def host_blocks_to_bytes(self, host_ids: np.ndarray) -> list[bytes]:
        data = self.host[host_ids].tobytes()
        return [data[i : i + PAYLOAD_BYTES] for i in range(0, len(data), PAYLOAD_BYTES)]

    def bytes_to_host_blocks(self, values: Sequence[bytes], host_ids: np.ndarray) -> None:
        self.host[host_ids] = np.frombuffer(b"".join(values), dtype=_ID)

    # ---------------------------------------------------------------- the replayer's side
    def computed(self, blocks: np.ndarray, ids: np.ndarray) -> None:
        """Device ``blocks`` were just computed for positions holding trace ``ids``."""
        self.device[blocks] = ids

    def check(self, blocks: np.ndarray, ids: np.ndarray) -> None:
        """``InvariantError`` unless device ``blocks`` hold ``ids`` (what a hit must serve)."""
        invariant(
            bool(np.array_equal(self.device[blocks], ids)),
            "a block served from the cache holds another position's id",
        )
