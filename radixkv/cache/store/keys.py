"""Store keys that can never name the wrong bytes: the chained block hash plus what the bytes mean.

A block's K/V bytes are decided by (1) the tokens of its whole prefix, (2) the
namespace it was computed under (a tenant, a LoRA adapter, a cache salt), and
(3) the model and the layout: the weights and config (``model_digest``), the
dtype, the block size, the layer and head geometry, and the byte layout the
engine writes (``layout``). A :class:`StoreKeyspace` holds (3); its
:meth:`~StoreKeyspace.block_keys` names each full block of a prompt by

    key = blake2b-256(person="radixkv/kvblock",
                      keyspace.digest || chain digest || namespace_bytes(namespace))

where the chain digest is ``radixkv.cache.hashing``'s ``BlockHasher("sha256")``
chain (the one hashing module: ``sha256(parent || block's int32 tokens ||
first-block namespace bytes)``, seeded by :data:`CHAIN_SEED`) and
``keyspace.digest`` is blake2b-256 of the keyspace's fields as canonical JSON.

**Why two blocks with different bytes cannot share a key.** The three inputs
are 32 bytes, 32 bytes, then the rest: the encoding is unambiguous, so equal
keys need equal inputs or a blake2b-256 collision. Equal keyspace digests need
equal fields (JSON of sorted fields is injective) or a blake2b collision; equal
chain digests need equal prefixes of tokens and namespace or a SHA-256
collision (the chain folds every earlier block in through its parent). Each
collision is a 2^-128 event at birthday scale, for any input, chosen or not:
no 64-bit hash (``ChainHasher("xxhash")``, ``hash()``) stands anywhere in the
chain, which is why the store does not reuse the KV-event hashes. The entry on
the store echoes its key (:mod:`radixkv.cache.store.entry`), so a file put
under the wrong name is refused too. Two namespaces of the same type and
``repr`` encode alike (``namespace_bytes``); give tenants distinct names.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Hashable, Sequence
from dataclasses import dataclass, field, fields

from radixkv.cache.arrays import TokenSeq, as_token_array
from radixkv.cache.hashing import BlockHasher, namespace_bytes
from radixkv.checks import check_int, check_str
from radixkv.errors import ArgumentTypeError

__all__ = ["CHAIN_SEED", "KEY_BYTES", "StoreKeyspace", "check_items", "check_keys"]

KEY_BYTES = 32  # every store key is a blake2b-256 digest
CHAIN_SEED = "radixkv/kv-store/v1"
_CHAIN = BlockHasher("sha256", hash_seed=CHAIN_SEED)
_MIN_DIGEST_HEX = 32  # a model identity of at least 128 bits


@dataclass(frozen=True)
class StoreKeyspace:
    """Everything besides the tokens and namespace that decides what a stored block's bytes mean.

    - ``model_digest``: a hex digest (at least 32 hex digits) of the model's weights and
      config, not its name: two checkpoints under one name never share blocks;
    - ``dtype``: the K/V dtype's name (``"float32"``, ``"bfloat16"``);
    - ``block_size``: tokens per block;
    - ``num_layers``, ``num_kv_heads``, ``head_dim``: the geometry of a block's K/V;
    - ``layout``: the name of the byte layout a payload is written in (a new layout is
      a new keyspace, so old entries are never misread).

    ``ValueError``/``TypeError`` naming the field and value at construction. ``digest``
    is blake2b-256 of the fields as canonical JSON (every field enters it).

    >>> ks = StoreKeyspace("ab" * 16, "float32", 16, 30, 3, 64)
    >>> len(ks.block_keys(list(range(40)))), len(ks.digest)
    (2, 32)
    """

    model_digest: str
    dtype: str
    block_size: int
    num_layers: int
    num_kv_heads: int
    head_dim: int
    layout: str = "kv-v1"
    digest: bytes = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        check_str("model_digest", self.model_digest)
        text = self.model_digest
        if len(text) < _MIN_DIGEST_HEX or any(c not in "0123456789abcdef" for c in text):
            raise ValueError(
                f"model_digest must be a lowercase hex digest of at least {_MIN_DIGEST_HEX} "
                f"digits (of the weights and config, not the model's name), got {text!r}"
            )
        for name in ("dtype", "layout"):
            check_str(name, getattr(self, name))
            if not getattr(self, name):
                raise ValueError(f"{name} must be a non-empty str, got ''")
        for name in ("block_size", "num_layers", "num_kv_heads", "head_dim"):
            object.__setattr__(self, name, check_int(name, getattr(self, name), low=1))
        values = {f.name: getattr(self, f.name) for f in fields(self) if f.init}
        text = json.dumps(values, sort_keys=True, separators=(",", ":"))
        digest = hashlib.blake2b(text.encode(), digest_size=KEY_BYTES, person=b"radixkv/keyspace")
        object.__setattr__(self, "digest", digest.digest())

    def block_keys(self, tokens: TokenSeq, namespace: Hashable = None) -> list[bytes]:
        """The store keys of the ``len(tokens) // block_size`` full blocks of ``tokens``:
        :meth:`key` of each :meth:`chain` digest. Raises as ``RadixCache.match`` for bad
        tokens. Complexity: O(len(tokens)).
        """
        return [self.key(d, namespace) for d in self.chain(tokens, namespace)]

    def chain(
        self, tokens: TokenSeq, namespace: Hashable = None, known: list[bytes] | None = None
    ) -> list[bytes]:
        """The chain digests (32 bytes each) of the full blocks of ``tokens`` under
        ``namespace``; ``known``, if given, the digests of the first ``len(known)`` of them
        (a caller's memo), not recomputed. Complexity: O(len(tokens)).
        """
        data = as_token_array(tokens).tobytes()
        return _CHAIN.chain(data, 4 * self.block_size, namespace_bytes(namespace), known)

    def chain_from(
        self, parent: bytes | None, tokens: TokenSeq, namespace: Hashable = None
    ) -> list[bytes]:
        """The chain digests of the full blocks of ``tokens`` where they continue a prefix
        whose last block's chain digest is ``parent`` (None: ``tokens`` start at the root,
        under ``namespace``, as :meth:`chain`). ``chain_from(c[-1], more)`` of
        ``c = chain(head, ns)`` is ``chain(head + more, ns)[len(c):]`` for a block-aligned
        ``head``. Complexity: O(len(tokens)).
        """
        if parent is None:
            return self.chain(tokens, namespace)
        return _CHAIN.extend(parent, as_token_array(tokens).tobytes(), 4 * self.block_size)

    def key(self, chain_digest: bytes, namespace: Hashable = None) -> bytes:
        """The store key of one block from its chain digest: see the module docstring."""
        h = hashlib.blake2b(self.digest, digest_size=KEY_BYTES, person=b"radixkv/kvblock")
        h.update(chain_digest)
        h.update(namespace_bytes(namespace))
        return h.digest()


def check_keys(name: str, keys: Sequence[object]) -> list[bytes]:
    """``keys`` as a list if each is ``bytes`` of :data:`KEY_BYTES`, else ``ValueError`` (a
    ``TypeError`` too) naming ``name[i]`` and the value. Complexity: O(len(keys))."""
    if isinstance(keys, (bytes, str)) or not isinstance(keys, Sequence):
        raise ArgumentTypeError(f"{name} must be a sequence of keys, got {type(keys).__name__}")
    out = list(keys)
    for i, key in enumerate(out):
        if type(key) is not bytes or len(key) != KEY_BYTES:
            raise ArgumentTypeError(
                f"{name}[{i}] must be bytes of length {KEY_BYTES} (a store key), got {key!r:.80}"
            )
    return out


def check_items(name: str, items: Sequence[object]) -> list[tuple[bytes, memoryview]]:
    """``items`` as ``(key, value)`` pairs with each value a flat byte view, else
    ``ValueError`` (a ``TypeError`` too) naming ``name[i]``. Complexity: O(len(items))."""
    if isinstance(items, (bytes, str)) or not isinstance(items, Sequence):
        raise ArgumentTypeError(f"{name} must be a sequence of (key, value), got {items!r:.80}")
    out = []
    for i, item in enumerate(items):
        if not isinstance(item, tuple) or len(item) != 2:
            raise ArgumentTypeError(f"{name}[{i}] must be a (key, value) tuple, got {item!r:.80}")
        (key,) = check_keys(f"{name}[{i}][0]", [item[0]])
        value = item[1]
        if not isinstance(value, (bytes, bytearray, memoryview)):
            raise ArgumentTypeError(
                f"{name}[{i}][1] must be bytes-like (a block's payload), got "
                f"{type(value).__name__}"
            )
        out.append((key, memoryview(value).cast("B")))
    return out

