"""Chained block names for the hash-map block cache (vLLM's prefix-caching hash).

A full block's name is ``H(parent_name, block_token_bytes, extra_key_bytes)``:
the parent's name folds the whole prefix into every name, so a hit on block
``i`` proves blocks ``0..i-1`` agree too. The first block's parent is a
constant root derived from ``hash_seed`` (or random per hasher when the seed is
None, so names are then deliberately not portable). Extra keys (the
namespace: a tenant, LoRA adapter or cache salt) enter the first block only,
which poisons the whole chain.

Block tokens enter as the bytes of their int32 array, which has a fixed length
per block size; the parent name also has a fixed length, so the concatenation
``parent + tokens + extra`` is unambiguous.

Hash functions:

- ``"sha256"``: 32-byte digests; stable across processes when ``hash_seed`` is
  given; collisions are not a practical concern, tokens are not re-checked.
- ``"xxhash"``: xxh3_128 16-byte digests (vLLM's fast option); same stability.
- ``"builtin"``: Python's ``hash`` of a tuple, a 64-bit int. Fast, but
  collisions are possible and ``hash(bytes)`` is salted per process
  (PYTHONHASHSEED), so names are stable only inside one process. The cache
  verifies the token ids on every name hit (``verifies_tokens``).
- a callable ``f(parent, block_bytes, extra) -> Hashable``: for experiments and
  tests; the root is a 32-byte seed digest and tokens are verified on hit.
"""

from __future__ import annotations

import hashlib
import os
from collections.abc import Callable, Hashable

import xxhash

__all__ = ["HASH_FNS", "BlockHasher", "BlockName", "namespace_bytes"]

HASH_FNS = ("sha256", "xxhash", "builtin")

BlockName = Hashable  # bytes for sha256 / xxhash, int for builtin
NameFn = Callable[[BlockName, bytes, bytes], BlockName]

_SEED_TAG = b"radixkv/block-hash-seed\x00"


def _sha256_name(parent: bytes, block: bytes, extra: bytes) -> bytes:
    return hashlib.sha256(parent + block + extra).digest()


def _xxhash_name(parent: bytes, block: bytes, extra: bytes) -> bytes:
    return xxhash.xxh3_128_digest(parent + block + extra)


def _builtin_name(parent: int, block: bytes, extra: bytes) -> int:
    return hash((parent, block, extra))


def _seed_bytes(hash_seed: str | bytes | int | None) -> bytes:
    if hash_seed is None:
        return os.urandom(32)
    if isinstance(hash_seed, bytes):
        return hash_seed
    if isinstance(hash_seed, str):
        return b"s" + hash_seed.encode()
    if isinstance(hash_seed, int) and not isinstance(hash_seed, bool):
        return b"i" + str(hash_seed).encode()
    raise TypeError(f"hash_seed must be str, bytes, int or None, got {type(hash_seed).__name__}")


class BlockHasher:
    """Names full blocks of tokens as a chain, for one hash function and seed.

    ``root`` is the constant parent of every first block. Immutable after
    construction. Raises ``ValueError`` for an unknown ``hash_fn`` name and
    ``TypeError`` for a seed of the wrong type.

    >>> h = BlockHasher("sha256", hash_seed=0)
    >>> a = h.name(h.root, bytes(8), b"")
    >>> a == BlockHasher("sha256", hash_seed=0).name(h.root, bytes(8), b"")
    True
    >>> len(a)
    32
    """

    __slots__ = ("hash_fn", "name", "root", "verifies_tokens")

    def __init__(
        self, hash_fn: str | NameFn = "sha256", hash_seed: str | bytes | int | None = None
    ) -> None:
        seed = _seed_bytes(hash_seed)
        digest = hashlib.sha256(_SEED_TAG + seed).digest()
        self.hash_fn = hash_fn
        self.name: NameFn
        self.root: BlockName
        if callable(hash_fn):
            self.name, self.root, self.verifies_tokens = hash_fn, digest, True
        elif hash_fn == "sha256":
            self.name, self.root, self.verifies_tokens = _sha256_name, digest, False
        elif hash_fn == "xxhash":
            self.name, self.root, self.verifies_tokens = _xxhash_name, digest[:16], False
        elif hash_fn == "builtin":
            root = int.from_bytes(digest[:8], "little", signed=True)
            self.name, self.root, self.verifies_tokens = _builtin_name, root, True
        else:
            raise ValueError(f"hash_fn must be one of {HASH_FNS} or a callable, got {hash_fn!r}")

    def chain(
        self,
        data: bytes,
        block_bytes: int,
        extra: bytes = b"",
        known: list[BlockName] | None = None,
    ) -> list[BlockName]:
        """Names of the ``len(data) // block_bytes`` full blocks of ``data``, in order.

        ``known``, if given, must be the names of the first ``len(known)``
        blocks of this same ``data`` and ``extra`` (a caller's memo); hashing
        resumes after them. Returns a new list. Complexity: O(len(data)) hashing.
        """
        n = len(data) // block_bytes
        if n == 0:
            return []
        name = self.name
        if known:
            out: list[BlockName] = list(known[:n])
            parent = out[-1]
        else:
            parent = name(self.root, data[:block_bytes], extra)
            out = [parent]
        append = out.append
        for start in range(len(out) * block_bytes, n * block_bytes, block_bytes):
            parent = name(parent, data[start : start + block_bytes], b"")
            append(parent)
        return out


def namespace_bytes(namespace: Hashable) -> bytes:
    """The first block's extra-key bytes for ``namespace``: empty for None.

    Built from the namespace's type and ``repr``, so it is stable across
    processes for str, int, bytes and tuples of them. Two unequal namespaces
    with the same type and repr would collide here; ``HashBlockCache``
    disambiguates them inside one cache. Never fails to encode: a lone
    surrogate in a custom ``repr`` passes through as its UTF-8 pattern.
    """
    if namespace is None:
        return b""
    t = type(namespace)
    return f"\x00ns:{t.__module__}.{t.__qualname__}:{namespace!r}".encode("utf-8", "surrogatepass")
