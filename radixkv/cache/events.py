"""KV cache events: what a cache tells the fleet when blocks enter and leave it.

A cache built with events on records one :class:`BlockStored` per insert that
adds blocks (their chained hashes, the parent's hash and the tokens), one
:class:`BlockRemoved` per block that leaves (eviction), and
:class:`AllBlocksCleared` on reset; ``cache.take_events()`` returns and clears
the pending list. A stream of (hash, parent) pairs is the cache's prefix tree,
serialized: a router that applies it holds an exact copy of which prefixes a
replica has (``radixkv.fleet``).

The classes are vLLM's (0.33) ``KVCacheEvent`` schema, field for field and in
order, as ``msgspec`` structs, so ``radixkv.fleet.wire`` encodes them
byte-compatibly with vLLM's ZMQ publisher and existing consumers (llm-d's
indexer, Dynamo's router) read a radixkv replica. They live beside the caches,
not in ``radixkv.fleet``, because the caches emit them and the cache tier
imports nothing above it.

Block hashes (:class:`ChainHasher`) are chained, so a block's hash names its
whole prefix, and reproducible across processes for a given seed:

- ``"sha256_cbor"``: vLLM's recipe, ``sha256(cbor2.dumps((parent, tuple(tokens),
  extra_keys), canonical=True))``; the first parent is the same hash of the
  seed. On the wire a hash is its digest's low 64 bits. Needs ``cbor2``.
- ``"xxhash"``: xxh3-64 of the block's int32 tokens (and, for the first block,
  the extra keys' bytes) seeded with the parent's 64 bits: much cheaper, for
  radixkv-to-radixkv fleets.

The namespace (a cache salt, a LoRA adapter, a tenant) enters the first block's
extra keys only, which changes every hash after it: chains of different
namespaces never meet.
"""

from __future__ import annotations

import hashlib
from collections.abc import Hashable, Sequence
from typing import Any

import msgspec
import numpy as np
import xxhash

__all__ = [
    "CHAIN_HASHES",
    "AllBlocksCleared",
    "AnyEvent",
    "BlockRemoved",
    "BlockStored",
    "ChainHasher",
    "EventBatch",
    "EventLog",
    "KVCacheEvent",
    "namespace_extra_keys",
]

MEDIUM = "GPU"  # vLLM's name for the device tier, whatever the device
HOST_MEDIUM = "CPU"  # vLLM's name for the host tier (CPU offloading)
SPEC_KIND = "full_attention"


class KVCacheEvent(msgspec.Struct, array_like=False, omit_defaults=True, gc=False, tag=True):
    """Base of every event; encoded as a map whose first key is ``type`` (the class name)."""


class BlockStored(KVCacheEvent):
    """Blocks that entered the cache: ``block_hashes[i]`` holds ``token_ids[i*bs:(i+1)*bs]``.

    ``parent_block_hash`` is the hash of the block before the first (None at
    the root). ``extra_keys`` has one entry per block: the first block's holds
    the namespace (None when there is none), the others None.
    """

    block_hashes: list[int]
    parent_block_hash: int | None
    token_ids: list[int]
    block_size: int
    lora_id: int | None
    medium: str | None
    lora_name: str | None
    extra_keys: list[tuple[Any, ...] | None] | None = None
    group_idx: int | None = None
    kv_cache_spec_kind: str | None = None
    kv_cache_spec_sliding_window: int | None = None
    locality: str | None = None
    ownership: str | None = None
    session_id: str | None = None
    lookahead_token_ids: list[int] | None = None


class BlockRemoved(KVCacheEvent):
    """Blocks that left the cache (vLLM sends one hash per event)."""

    block_hashes: list[int]
    medium: str | None
    group_idx: int | None = None
    locality: str | None = None
    ownership: str | None = None


class AllBlocksCleared(KVCacheEvent):
    """The cache dropped everything (``reset``)."""


AnyEvent = BlockStored | BlockRemoved | AllBlocksCleared


class EventBatch(msgspec.Struct, array_like=True, omit_defaults=True, gc=False):
    """One published message: ``[ts, events, data_parallel_rank]`` on the wire."""

    ts: float
    events: list[AnyEvent]
    data_parallel_rank: int | None = None


CHAIN_HASHES = ("sha256_cbor", "xxhash")

Digest = bytes  # a chain hash's full digest (32 bytes for sha256_cbor, 8 for xxhash)


def namespace_extra_keys(namespace: Hashable) -> tuple[Any, ...] | None:
    """The first block's extra keys for ``namespace``: None for the default namespace.

    A str, int or bytes namespace is the 1-tuple of itself (vLLM sends a
    ``cache_salt`` the same way); a tuple of those is the 1-tuple of it as a
    list (so ``("a",)`` and ``"a"`` stay apart); anything else is the 1-tuple of
    its type's qualified name and ``repr``. The type is kept (``True``, ``1``
    and ``1.0`` give different keys), as the caches tell namespaces apart.
    """
    if namespace is None:
        return None
    if isinstance(namespace, (str, bytes, int)) and not isinstance(namespace, bool):
        return (namespace,)
    if isinstance(namespace, tuple) and all(
        isinstance(v, (str, bytes, int)) and not isinstance(v, bool) for v in namespace
    ):
        return (list(namespace),)
    t = type(namespace)
    return (f"{t.__module__}.{t.__qualname__}:{namespace!r}",)


class ChainHasher:
    """Chained block hashes for events and routing, for one recipe and seed.

    ``root`` is the parent digest of every first block. :meth:`hashes` gives
    the digests of a run of full blocks; :meth:`wire` the 64-bit int an event
    carries; :meth:`check_namespace` refuses a namespace the recipe cannot
    encode. Immutable; ``ValueError`` for an unknown recipe, ``ImportError``
    (naming the package) when ``sha256_cbor`` is asked for without ``cbor2``.

    >>> h = ChainHasher("xxhash", seed=0)
    >>> d = h.hashes(h.root, np.arange(32, dtype=np.int32), 16)
    >>> len(d), d == ChainHasher("xxhash", seed=0).hashes(h.root, list(range(32)), 16)
    (2, True)
    """

    __slots__ = ("_cbor", "name", "root", "seed")

    def __init__(self, name: str = "xxhash", seed: str | int = 0) -> None:
        if name not in CHAIN_HASHES:
            raise ValueError(f"name must be one of {CHAIN_HASHES}, got {name!r}")
        if isinstance(seed, bool) or not isinstance(seed, (str, int)):
            raise ValueError(f"seed must be a str or an int, got {seed!r}")
        self.name = name
        self.seed = seed
        self._cbor = None
        if name == "sha256_cbor":
            try:
                import cbor2
            except ImportError as exc:  # pragma: no cover - cbor2 is in the fleet extra
                msg = "the sha256_cbor chain hash needs cbor2 (pip install cbor2)"
                raise ImportError(msg) from exc
            self._cbor = cbor2.dumps
            self.root = hashlib.sha256(self._cbor(seed, canonical=True)).digest()
        else:
            self.root = xxhash.xxh3_64_digest(repr(seed).encode())

    def hashes(
        self,
        parent: Digest,
        tokens: Sequence[int] | np.ndarray,
        block_size: int,
        first_extra: tuple[Any, ...] | None = None,
    ) -> list[Digest]:
        """Digests of the ``len(tokens) // block_size`` full blocks of ``tokens``, in order.

        The first block's parent is ``parent`` and its extra keys
        ``first_extra``; each later block's parent is the block before it.
        Complexity: O(len(tokens)).
        """
        arr = np.ascontiguousarray(tokens, dtype=np.int32)
        n = len(arr) // block_size
        out: list[Digest] = []
        extra = first_extra
        if self._cbor is not None:
            dumps = self._cbor
            rows = arr[: n * block_size].reshape(n, block_size).tolist()
            for row in rows:
                parent = hashlib.sha256(dumps((parent, tuple(row), extra), canonical=True)).digest()
                out.append(parent)
                extra = None
            return out
        # The parent is the seed of its child's hash: no bytes to concatenate per block.
        raw = arr.tobytes()
        step = 4 * block_size
        head = b"" if extra is None else repr(extra).encode()
        seed = int.from_bytes(parent[-8:], "big")
        for i in range(n):
            seed = xxhash.xxh3_64_intdigest(raw[i * step : (i + 1) * step] + head, seed)
            out.append(seed.to_bytes(8, "big"))
            head = b""
        return out

    def check_namespace(self, namespace: Hashable) -> tuple[Any, ...] | None:
        """``namespace_extra_keys(namespace)``, checked: this recipe can encode them.

        ``ValueError`` naming ``namespace`` and its value if it cannot: under
        ``sha256_cbor`` every str in the keys (the namespace, an entry of a
        tuple namespace, or the repr standing for any other namespace) must be
        valid UTF-8, which a lone surrogate (``"\\ud800"``, legal in JSON) is
        not; every ``xxhash`` namespace encodes. A cache with events on calls
        this before it hashes a namespace's first chain, so a namespace it
        refuses changes nothing. Changes nothing.
        Complexity: O(size of the namespace).

        >>> ChainHasher("xxhash").check_namespace("tenant-a")
        ('tenant-a',)
        """
        extra = namespace_extra_keys(namespace)
        if extra is None:
            return None
        try:
            if self._cbor is not None:
                self._cbor(extra, canonical=True)
            else:
                repr(extra).encode()
        except (ValueError, TypeError) as exc:  # UnicodeEncodeError; cbor2's encode errors
            # ascii(): the message itself must encode, wherever it is sent
            raise ValueError(
                f"namespace must be encodable by the {self.name} chain hash, got "
                f"{ascii(namespace)} ({ascii(str(exc))})"
            ) from None
        return extra

    @staticmethod
    def wire(digest: Digest) -> int:
        """The 64-bit int an event carries for ``digest``: its low 64 bits, big-endian."""
        return int.from_bytes(digest[-8:], "big")


class EventLog:
    """A cache's pending events: appended by the cache, taken by whoever publishes them.

    Owned by one cache. ``take()`` returns the pending list and starts a new
    one. Complexity: O(1) per event.
    """

    __slots__ = ("_pending", "block_size", "hasher")

    def __init__(self, hasher: ChainHasher, block_size: int) -> None:
        self.hasher = hasher
        self.block_size = block_size
        self._pending: list[KVCacheEvent] = []

    def stored(
        self,
        digests: Sequence[Digest],
        parent: Digest | None,
        tokens: Sequence[int] | np.ndarray,
        first_extra: tuple[Any, ...] | None,
        medium: str = MEDIUM,
    ) -> None:
        """Record that the blocks ``digests`` (holding ``tokens``) entered the cache.

        ``parent`` is the digest of the block before them, None at the root;
        ``first_extra`` the namespace's keys when the first block is at the root;
        ``medium`` the tier they entered (``"GPU"``, or ``"CPU"`` for a host copy).
        """
        wire = self.hasher.wire
        extra: list[tuple[Any, ...] | None] | None = None
        if first_extra is not None and parent is None:
            extra = [first_extra] + [None] * (len(digests) - 1)
        self._pending.append(
            BlockStored(
                block_hashes=[wire(d) for d in digests],
                parent_block_hash=None if parent is None else wire(parent),
                token_ids=np.asarray(tokens).tolist(),
                block_size=self.block_size,
                lora_id=None,
                medium=medium,
                lora_name=None,
                extra_keys=extra,
                group_idx=0,
                kv_cache_spec_kind=SPEC_KIND,
            )
        )

    def removed(self, digests: Sequence[Digest], medium: str = MEDIUM) -> None:
        """Record that the blocks ``digests`` left the tier ``medium`` (one event per block,
        as vLLM)."""
        wire = self.hasher.wire
        append = self._pending.append
        for d in digests:
            append(BlockRemoved(block_hashes=[wire(d)], medium=medium, group_idx=0))

    def cleared(self) -> None:
        """Record a reset; pending events before it still describe what happened first."""
        self._pending.append(AllBlocksCleared())

    def take(self) -> list[KVCacheEvent]:
        """The pending events, oldest first; the log starts empty again."""
        out, self._pending = self._pending, []
        return out

    def __len__(self) -> int:
        return len(self._pending)
