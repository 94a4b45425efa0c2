"""Chained block hashes: every recipe radixkv names blocks with, and the one namespace encoding.

A chained hash names a full block of tokens by ``H(parent, block, extra)``:
the parent's hash folds the whole prefix in, so a hit on block ``i`` proves
blocks ``0..i-1`` agree too. Block tokens enter as the bytes of their int32
array (a fixed length per block size). The namespace (a tenant, a LoRA
adapter, a cache salt) enters the first block's ``extra`` only, which changes
every hash after it: chains of different namespaces never meet.

**The namespace encoding** (one, for every recipe):

- :func:`namespace_extra_keys`: the first block's extra keys as KV events
  carry them (vLLM's ``extra_keys``): None for the default namespace;
- :func:`namespace_bytes`: the same keys as bytes (``repr(keys)``, UTF-8;
  empty for the default namespace), what the byte-level recipes fold in.

**Recipes.** :class:`ChainHasher` is the KV-events family, what a replica
publishes and a router computes (:func:`chain_hashes` gives a prompt's wire
hashes fast); :func:`vllm_hash_seed` is the seed vLLM's servers root them at:

- ``"sha256_cbor"``: vLLM's recipe, ``sha256(cbor2.dumps((parent,
  tuple(tokens), extra_keys), canonical=True))``; the first parent is the same
  hash of the seed's text (``str(seed)``), as vLLM hashes ``PYTHONHASHSEED``'s.
  On the wire a hash is its digest's low 64 bits. Needs ``cbor2``.
- ``"xxhash"``: xxh3-64 of the block's int32 tokens (and, for the first block,
  ``namespace_bytes``) seeded with the parent's 64 bits: much cheaper, for
  radixkv-to-radixkv fleets.

:class:`BlockHasher` is ``HashBlockCache``'s own names when events are off:

- ``"sha256"``: ``sha256(parent + block + namespace_bytes)``, 32-byte names;
- ``"xxhash"``: xxh3_128 of the same, 16-byte names (vLLM's fast option);
- ``"builtin"``: Python's ``hash`` of ``(parent, block, extra)``, a 64-bit int:
  fast, but collisions are possible and ``hash(bytes)`` is salted per process;
- a callable ``f(parent, block_bytes, extra) -> Hashable``: experiments and tests.

Both are :class:`BlockNamer`\\ s, the surface ``HashBlockCache`` names blocks
through: with events on it names them with its ``ChainHasher``, so a block's
name is the hash its events carry and each block is hashed once. A namer whose
names are shorter than 128 bits (``builtin``, a callable, xxh3-64) sets
``verifies_tokens``: the cache then checks the tokens on every name hit.
"""

from __future__ import annotations

import hashlib
import os
from collections.abc import Callable, Hashable, Mapping, Sequence
from typing import Any, Protocol

import numpy as np
import xxhash

from radixkv.checks import check_int, is_int
from radixkv.errors import ArgumentTypeError

__all__ = [
    "CHAIN_HASHES",
    "HASH_FNS",
    "BlockHasher",
    "BlockName",
    "BlockNamer",
    "ChainHasher",
    "Digest",
    "VLLM_NONE_HASH_SEED",
    "chain_hashes",
    "namespace_bytes",
    "namespace_extra_keys",
    "vllm_hash_seed",
]

CHAIN_HASHES = ("sha256_cbor", "xxhash")
HASH_FNS = ("sha256", "xxhash", "builtin")

Digest = bytes  # a ChainHasher digest (32 bytes for sha256_cbor, 8 for xxhash)
BlockName = Hashable  # bytes for every recipe but builtin (an int) and a callable's
NameFn = Callable[[Any, bytes, Any], Any]  # (parent, block bytes, extra) -> name

VLLM_NONE_HASH_SEED = "vllm-none-hash"  # vLLM's seed when PYTHONHASHSEED is unset
_SEED_TAG = b"radixkv/block-hash-seed\x00"
_WIRE = np.dtype(">u8")  # a wire hash: 8 bytes, big-endian
_BLOCK_TYPES: dict[int, np.dtype] = {}  # block_size -> a void dtype of one block of int32 tokens


# ------------------------------------------------------------ namespaces
def namespace_extra_keys(namespace: Hashable) -> tuple[Any, ...] | None:
    """The first block's extra keys for ``namespace``: None for the default namespace.

    A str, int or bytes namespace is the 1-tuple of itself (vLLM sends a
    ``cache_salt`` the same way); a tuple of those is the 1-tuple of it as a
    list (so ``("a",)`` and ``"a"`` stay apart); anything else is the 1-tuple of
    its type's qualified name and ``repr``. The type is kept (``True``, ``1``
    and ``1.0`` give different keys), as the caches tell namespaces apart.
    Complexity: O(size of the namespace).
    """
    if namespace is None:
        return None
    # Not checks.is_int: a numpy int keeps the repr encoding below (the hashes must not change).
    if isinstance(namespace, (str, bytes, int)) and not isinstance(namespace, bool):
        return (namespace,)
    if isinstance(namespace, tuple) and all(
        isinstance(v, (str, bytes, int)) and not isinstance(v, bool) for v in namespace
    ):
        return (list(namespace),)
    t = type(namespace)
    return (f"{t.__module__}.{t.__qualname__}:{namespace!r}",)


def namespace_bytes(namespace: Hashable) -> bytes:
    """``namespace_extra_keys(namespace)`` as bytes: ``repr(keys)`` in UTF-8, b"" for None.

    Never fails: ``repr`` escapes a lone surrogate, wherever it sits. Two
    unequal namespaces of the same type and ``repr`` give equal bytes; a cache
    keeps them apart by its own namespace key. Complexity: O(size of the namespace).

    >>> namespace_bytes("t1"), namespace_bytes(None)
    (b"('t1',)", b'')
    """
    keys = namespace_extra_keys(namespace)
    return b"" if keys is None else repr(keys).encode()


# ------------------------------------------------------------ the namer surface
class BlockNamer(Protocol):
    """What a hash-map cache names its blocks through (``BlockHasher``, ``ChainHasher``).

    ``root`` is the parent of every first block; ``block_name(parent, block, extra)``
    one block's name, with ``extra`` what :meth:`first_extra` gave for the first
    block and ``no_extra`` for every later one; ``verifies_tokens`` says names
    may collide (a cache must then compare tokens on a hit).
    """

    root: BlockName
    no_extra: Any
    verifies_tokens: bool

    def block_name(self, parent: BlockName, block: bytes, extra: Any) -> BlockName:
        """One block's name: ``block`` (int32 token bytes) below ``parent``."""
        ...

    def first_extra(self, namespace: Hashable) -> Any:
        """The first block's ``extra`` for ``namespace``; ``ValueError`` naming ``namespace``
        if this recipe cannot encode it."""
        ...

    def check_namespace(self, namespace: Hashable) -> tuple[Any, ...] | None:
        """``namespace_extra_keys(namespace)``; ``ValueError`` naming ``namespace`` if this
        recipe cannot encode it."""
        ...

    def chain(
        self, data: bytes, block_bytes: int, extra: Any, known: list[BlockName] | None = None
    ) -> list[BlockName]:
        """Names of the ``len(data) // block_bytes`` full blocks of ``data``, in order."""
        ...


# ------------------------------------------------------------ KV-event hashes
def vllm_hash_seed(environ: Mapping[str, str] | None = None) -> str:
    """The seed a vLLM (0.33) server roots its ``sha256_cbor`` block hashes at.

    ``PYTHONHASHSEED``'s text when it is set in ``environ`` (``os.environ`` by
    default; an empty value counts as set, as vLLM reads it), else
    :data:`VLLM_NONE_HASH_SEED`. ``ChainHasher("sha256_cbor", seed=vllm_hash_seed())``
    names every block as a vLLM server in the same environment does, so an indexer
    that recomputes a request's hashes from its tokens finds them. Complexity: O(1).

    >>> vllm_hash_seed({}), vllm_hash_seed({"PYTHONHASHSEED": "0"})
    ('vllm-none-hash', '0')
    """
    return (os.environ if environ is None else environ).get("PYTHONHASHSEED", VLLM_NONE_HASH_SEED)


def _xxh64_name(parent: Digest, block: bytes, keys: tuple[Any, ...] | None) -> Digest:
    if keys is not None:  # the first block: namespace_bytes follows the tokens
        block += repr(keys).encode()
    # xxh3_64_digest is the big-endian bytes of xxh3_64_intdigest: the chain keeps 8-byte digests
    return xxhash.xxh3_64_digest(block, int.from_bytes(parent, "big"))


def _sha256_cbor_namer(dumps: Callable[..., bytes]) -> NameFn:
    def name(parent: Digest, block: bytes, keys: tuple[Any, ...] | None) -> Digest:
        row = tuple(memoryview(block).cast("i"))  # the block's int32 tokens as ints
        return hashlib.sha256(dumps((parent, row, keys), canonical=True)).digest()

    return name


class ChainHasher:
    """Chained block hashes for events and routing, for one recipe and seed.

    ``root`` is the parent digest of every first block: for ``sha256_cbor`` the
    recipe's hash of ``str(seed)``, as vLLM hashes ``PYTHONHASHSEED`` (an int seed
    ``n`` and the string ``str(n)`` are the same root; :func:`vllm_hash_seed` is a
    vLLM server's seed), for ``xxhash`` xxh3-64 of ``repr(seed)``. :meth:`hashes` gives
    the digests of a run of full blocks; :meth:`wire` the 64-bit int an event
    carries; :meth:`check_namespace` refuses a namespace the recipe cannot
    encode. A :class:`BlockNamer` too (``HashBlockCache`` names its blocks with
    it when its events are on): ``block_name(parent, block, keys)`` is one
    block's digest, equal to the matching entry of :meth:`hashes`, with
    ``keys`` the namespace's extra keys for the first block and None after;
    :meth:`chain` hashes through :meth:`hashes`. Immutable; ``ValueError`` for an unknown recipe
    or a bad seed, ``ImportError`` (naming the package) when ``sha256_cbor`` is
    asked for without ``cbor2``.

    >>> h = ChainHasher("xxhash", seed=0)
    >>> d = h.hashes(h.root, np.arange(32, dtype=np.int32), 16)
    >>> len(d), d == ChainHasher("xxhash", seed=0).hashes(h.root, list(range(32)), 16)
    (2, True)
    """

    __slots__ = ("_cbor", "block_name", "name", "no_extra", "root", "seed", "verifies_tokens")

    def __init__(self, name: str = "xxhash", seed: str | int = 0) -> None:
        if name not in CHAIN_HASHES:
            raise ValueError(f"name must be one of {CHAIN_HASHES}, got {name!r}")
        if not isinstance(seed, str):
            if not is_int(seed):
                raise ArgumentTypeError(f"seed must be a str or an int, got {seed!r}")
            seed = int(seed)  # a numpy int's repr would change the root
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
            # vLLM hashes the seed as text (PYTHONHASHSEED's value): 0 and "0" are one root.
            self.root = hashlib.sha256(self._cbor(str(seed), canonical=True)).digest()
            self.block_name: NameFn = _sha256_cbor_namer(self._cbor)
            self.verifies_tokens = False  # 256-bit digests
        else:
            self.root = xxhash.xxh3_64_digest(repr(seed).encode())
            self.block_name = _xxh64_name
            self.verifies_tokens = True  # 64-bit digests can collide
        self.no_extra = None  # a later block's extra keys

    def hashes(
        self,
        parent: Digest,
        tokens: Sequence[int] | np.ndarray,
        block_size: int,
        first_extra: tuple[Any, ...] | None = None,
    ) -> list[Digest]:
        """Digests of the ``len(tokens) // block_size`` full blocks of ``tokens``, in order.

        The first block's parent is ``parent`` and its extra keys
        ``first_extra`` (``namespace_extra_keys``); each later block's parent
        is the block before it. Complexity: O(len(tokens)).
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

    # -------------------------------------------------------- BlockNamer
    def first_extra(self, namespace: Hashable) -> tuple[Any, ...] | None:
        """The first block's extra for :meth:`block_name` and :meth:`chain`: the namespace's
        extra keys, checked (``ValueError`` as :meth:`check_namespace`)."""
        return self.check_namespace(namespace)

    def chain(
        self,
        data: bytes,
        block_bytes: int,
        extra: tuple[Any, ...] | None,
        known: list[Digest] | None = None,
    ) -> list[Digest]:
        """Digests of the full blocks of ``data`` (int32 token bytes) from :attr:`root`, the first
        with the extra keys ``extra``; ``known``, if given, the digests of the first
        ``len(known)`` of them (a caller's memo), not recomputed. :meth:`hashes` does the
        hashing. Complexity: O(len(data))."""
        n = len(data) // block_bytes
        block_size = block_bytes // 4
        if not known:
            return self.hashes(
                self.root, np.frombuffer(data[: n * block_bytes], np.int32), block_size, extra
            )
        out = list(known[:n])
        start = len(out) * block_bytes
        if start < n * block_bytes:
            tail = np.frombuffer(data[start : n * block_bytes], np.int32)
            out += self.hashes(out[-1], tail, block_size)
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

    def wire_list(self, digests: bytes) -> list[int]:
        """``wire`` of each digest in ``digests``, the digests concatenated (a tree node's).
        Complexity: O(len(digests)), vectorised."""
        words = np.frombuffer(digests, dtype=_WIRE).reshape(-1, len(self.root) // 8)
        return words[:, -1].tolist()


def chain_hashes(
    hasher: ChainHasher, tokens: Sequence[int] | np.ndarray, block_size: int, namespace: Hashable
) -> list[int]:
    """The wire hashes of the full blocks of ``tokens``: what a replica built with ``hasher``
    reports in its ``BlockStored`` events for them.

    Equal to ``[hasher.wire(d) for d in hasher.hashes(hasher.root, tokens,
    block_size, namespace_extra_keys(namespace))]``. The xxhash recipe is
    inlined (the blocks cut in one numpy call, the chain kept in ints;
    ``tests/fleet/test_fleet_index.py`` pins the equality). ``ValueError`` naming
    ``block_size`` or ``tokens`` unless a positive int / 1-D. Complexity: O(len(tokens)).
    """
    if type(block_size) is not int or block_size < 1:  # a router's per-request path: no call
        block_size = check_int("block_size", block_size, low=1)
    arr = np.ascontiguousarray(tokens, dtype=np.int32)
    if arr.ndim != 1:
        raise ValueError(f"tokens must be 1-D, got shape {arr.shape}")
    n = len(arr) // block_size
    if n == 0:
        return []
    if hasher.name != "xxhash":
        digests = hasher.hashes(hasher.root, arr, block_size, namespace_extra_keys(namespace))
        return hasher.wire_list(b"".join(digests))
    digest = xxhash.xxh3_64_intdigest
    block_type = _BLOCK_TYPES.get(block_size)
    if block_type is None:
        block_type = _BLOCK_TYPES[block_size] = np.dtype((np.void, 4 * block_size))
    blocks = arr[: n * block_size].view(block_type).tolist()  # one bytes object per block
    parent = digest(blocks[0] + namespace_bytes(namespace), int.from_bytes(hasher.root, "big"))
    out = [parent]
    append = out.append
    for block in blocks[1:]:
        parent = digest(block, parent)
        append(parent)
    return out


# ------------------------------------------------------------ HashBlockCache's names
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
    if is_int(hash_seed):
        return b"i" + str(int(hash_seed)).encode()
    raise ArgumentTypeError(f"hash_seed must be a str, bytes, an int or None, got {hash_seed!r}")


class BlockHasher:
    """``HashBlockCache``'s block names with events off: one hash function and seed.

    ``root`` is the constant parent of every first block, derived from
    ``hash_seed`` (random when None, so names are then deliberately not
    portable). The first block's extra is ``namespace_bytes``. Immutable after
    construction. Raises ``ValueError`` for an unknown ``hash_fn`` name and
    ``TypeError`` for a seed of the wrong type.

    >>> h = BlockHasher("sha256", hash_seed=0)
    >>> a = h.block_name(h.root, bytes(8), b"")
    >>> a == BlockHasher("sha256", hash_seed=0).block_name(h.root, bytes(8), b"")
    True
    >>> len(a)
    32
    """

    __slots__ = ("block_name", "hash_fn", "root", "verifies_tokens")

    no_extra = b""

    def __init__(
        self, hash_fn: str | NameFn = "sha256", hash_seed: str | bytes | int | None = None
    ) -> None:
        seed = _seed_bytes(hash_seed)
        digest = hashlib.sha256(_SEED_TAG + seed).digest()
        self.hash_fn = hash_fn
        self.block_name: NameFn  # (parent, block bytes, extra) -> name: the recipe itself
        self.root: BlockName
        if callable(hash_fn):
            self.block_name, self.root, self.verifies_tokens = hash_fn, digest, True
        elif hash_fn == "sha256":
            self.block_name, self.root, self.verifies_tokens = _sha256_name, digest, False
        elif hash_fn == "xxhash":
            self.block_name, self.root, self.verifies_tokens = _xxhash_name, digest[:16], False
        elif hash_fn == "builtin":
            root = int.from_bytes(digest[:8], "little", signed=True)
            self.block_name, self.root, self.verifies_tokens = _builtin_name, root, True
        else:
            raise ValueError(f"hash_fn must be one of {HASH_FNS} or a callable, got {hash_fn!r}")

    def first_extra(self, namespace: Hashable) -> bytes:
        """``namespace_bytes(namespace)``: every namespace encodes."""
        return namespace_bytes(namespace)

    def check_namespace(self, namespace: Hashable) -> tuple[Any, ...] | None:
        """``namespace_extra_keys(namespace)``: every namespace encodes."""
        return namespace_extra_keys(namespace)

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
        if known:
            out: list[BlockName] = list(known[:n])
        else:
            out = [self.block_name(self.root, data[:block_bytes], extra)]
        return out + self.extend(out[-1], data, block_bytes, len(out))

    def extend(
        self, parent: BlockName, data: bytes, block_bytes: int, start: int = 0
    ) -> list[BlockName]:
        """Names of the full blocks of ``data`` from block ``start`` on, in order, the first
        chained from ``parent`` (the name of the block before it) and each later one from
        the one before: a chain continued past a name a caller kept. Returns a new list.
        Complexity: O(hashed bytes).
        """
        name = self.block_name
        out: list[BlockName] = []
        append = out.append
        for pos in range(start * block_bytes, len(data) // block_bytes * block_bytes, block_bytes):
            parent = name(parent, data[pos : pos + block_bytes], b"")
            append(parent)
        return out
