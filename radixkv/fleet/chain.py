"""Chained block hashes of a prompt, as the replicas' caches name their blocks.

A request's prompt is cut into blocks of ``block_size`` tokens and named by
chained hashes (the caches' :class:`~radixkv.cache.events.ChainHasher` recipe,
the namespace folded into the first block), so hash ``i`` names the whole
prefix up to block ``i``. Both prefix indexes (:mod:`radixkv.fleet.approx`,
:mod:`radixkv.fleet.exact`) and every prefix-aware router speak these hashes.
"""

from __future__ import annotations

from collections.abc import Hashable, Sequence

import numpy as np
import xxhash

from radixkv.cache.events import ChainHasher, namespace_extra_keys

__all__ = ["chain_hashes"]

_WIRE = np.dtype(">u8")  # a wire hash: 8 bytes, big-endian
_BLOCK_TYPES: dict[int, np.dtype] = {}  # block_size -> a void dtype of one block of int32 tokens


def chain_hashes(
    hasher: ChainHasher, tokens: Sequence[int] | np.ndarray, block_size: int, namespace: Hashable
) -> list[int]:
    """The wire hashes of the full blocks of ``tokens``: what a replica built with ``hasher``
    reports in its ``BlockStored`` events for them.

    Equal to ``[hasher.wire(d) for d in hasher.hashes(hasher.root, tokens,
    block_size, namespace_extra_keys(namespace))]``. The xxhash recipe is
    inlined (the blocks cut in one numpy call, the chain kept in ints;
    ``tests/test_fleet_index.py`` pins the equality). ``ValueError`` naming
    ``block_size`` or ``tokens`` unless a positive int / 1-D. Complexity: O(len(tokens)).
    """
    if isinstance(block_size, bool) or not isinstance(block_size, int) or block_size < 1:
        raise ValueError(f"block_size must be a positive int, got {block_size!r}")
    arr = np.ascontiguousarray(tokens, dtype=np.int32)
    if arr.ndim != 1:
        raise ValueError(f"tokens must be 1-D, got shape {arr.shape}")
    n = len(arr) // block_size
    if n == 0:
        return []
    extra = namespace_extra_keys(namespace)
    if hasher.name != "xxhash":
        digests = hasher.hashes(hasher.root, arr, block_size, extra)
        # wire(d) is the digest's low 64 bits, big-endian: the last 8-byte word of each digest.
        return np.frombuffer(b"".join(digests), dtype=_WIRE).reshape(n, -1)[:, -1].tolist()
    digest = xxhash.xxh3_64_intdigest
    block_type = _BLOCK_TYPES.get(block_size)
    if block_type is None:
        block_type = _BLOCK_TYPES[block_size] = np.dtype((np.void, 4 * block_size))
    blocks = arr[: n * block_size].view(block_type).tolist()  # one bytes object per block
    head = b"" if extra is None else repr(extra).encode()
    parent = digest(blocks[0] + head, int.from_bytes(hasher.root, "big"))
    out = [parent]
    append = out.append
    for block in blocks[1:]:
        parent = digest(block, parent)
        append(parent)
    return out
