"""The store tier: a ``KVStore`` below the host pool of a ``TieredRadixCache`` (docs/store.md).

``HostTier(..., store=StoreTier(store, keyspace, copier, write_policy))`` puts a
store below the host; without one the cache holds :data:`NO_STORE`, which
hashes nothing and calls nothing. The cache calls its tier at six points, and
the tier never raises out of any of them for a fault (only a ``BaseException``
such as ``KeyboardInterrupt`` passes):

- **keys** (:meth:`StoreTier.lookup`, :meth:`StoreTier.released`, ...): a node's
  store keys come from the chain digests of its path
  (:meth:`~radixkv.cache.store.keys.StoreKeyspace.chain_from` of its parent's
  last digest), kept on the node (``Node.store_digests``) the first time the tier
  needs them, so each cached block is hashed once; a split splits them.
- **writes**: under ``"write_back"`` (the default) a host-only leaf that host
  eviction deletes is put before its host blocks are freed
  (:meth:`StoreTier.released`); under ``"write_through"`` each backup to the host
  is put at once (:meth:`StoreTier.backed_up`) and host eviction drops freely.
  A node's bytes come from the host pool through the :class:`ByteCopier`. Both hooks
  return how many of the node's blocks the put left stored (all when the store wrote
  each; with ``confirm``, what ``contains_run`` finds when it wrote fewer), which the
  cache announces as ``BlockStored`` on ``"STORAGE"``.
- **match** (:meth:`StoreTier.lookup`): past the tree's whole match, the keys of
  the query's next full blocks are hashed and ``contains_run`` says how many are
  stored (``MatchResult.store_num_tokens``); the tier keeps that run for the
  ``load`` that follows (one cache per tier).
- **load**, in two steps: :meth:`StoreTier.read` ``get_many``s the run (no more
  blocks than the host pool could hold) and holds the bytes; the first block that is
  missing or not a payload of ``bytes_per_block`` bytes stops it there (the rest is
  recomputed). Only then does the cache make host room, so the write-backs of that
  host eviction cannot take the run away; :meth:`StoreTier.fill` copies the held
  bytes into the host blocks the cache took, through ``bytes_to_host_blocks``. The
  cache then files the run as a host-only node and loads it to the device as it
  loads any host-only node.
- **faults**: a store or copier that raises, answers out of contract (a run
  length out of range, a list of the wrong length, a value that is no payload)
  or refuses writes costs only what it would have saved: the call counts it
  (:class:`StoreTierStats`), logs a warning (the first, then at every power of
  two) and goes on as a miss or a skipped write. Every block the cache holds
  stays as it was. A slow store is as slow as it is: the time shows in
  ``load_seconds`` and ``store_seconds``.

The bytes a load serves are checked twice: the store checks each entry (key
echo and checksum, ``radixkv.cache.store.entry``; a backend written for the
protocol must too), the tier checks the payload's type and size before the
copier writes it. Torch-free: the copier is the one place that touches K/V.
"""

from __future__ import annotations

import logging
import time
import weakref
from collections.abc import Hashable, Sequence
from dataclasses import dataclass, replace
from typing import Protocol, runtime_checkable

import numpy as np

from radixkv.cache.node import Node
from radixkv.cache.store.faultlog import log_due
from radixkv.cache.store.keys import StoreKeyspace
from radixkv.cache.store.protocol import KVStore
from radixkv.checks import check_int
from radixkv.errors import invariant

__all__ = [
    "DIGEST_BYTES",
    "NO_STORE",
    "STORE_WRITE_POLICIES",
    "ByteCopier",
    "NoStore",
    "StoreTier",
    "StoreTierStats",
]

logger = logging.getLogger(__name__)

STORE_WRITE_POLICIES = ("write_back", "write_through")
DIGEST_BYTES = 32  # one store chain digest (sha256)


@runtime_checkable
class ByteCopier(Protocol):
    """Turns host blocks into bytes and back: what the store tier moves K/V with.

    ``radixkv.model.kv_bytes.KVBlockCodec`` is the engine's (layout ``"kv-v1"``). One
    payload per block, exactly ``bytes_per_block`` long, laid out as ``layout`` names
    (it must be the keyspace's: a new layout is a new keyspace, so old entries are
    never misread). Block ids are a 1-D int32 array of host pool blocks; a copier must
    not touch any block it was not named. Copies are synchronous: the bytes returned
    are the blocks' contents, and the blocks hold the values once the call returns.
    """

    layout: str
    bytes_per_block: int

    def host_blocks_to_bytes(self, host_ids: np.ndarray) -> list[bytes]:
        """The payload of each host block of ``host_ids``, in order."""
        ...

    def bytes_to_host_blocks(self, values: Sequence[bytes], host_ids: np.ndarray) -> None:
        """Make host block ``host_ids[i]`` hold ``values[i]`` (equal lengths)."""
        ...


@dataclass
class StoreTierStats:
    """A store tier's counters since it was built; blocks unless noted.

    - ``lookups``: ``contains_run`` asks (one per match with a full block past the
      tree); ``found_blocks``: blocks they reported stored;
    - ``loaded_blocks``/``loaded_bytes``: blocks read from the store and copied into the
      host pool; ``load_seconds``: time in ``get_many`` and ``bytes_to_host_blocks``;
      ``unfilled_blocks``: blocks read that were never copied into the host (it had less
      room than the read, or the copy failed; the cache reads no more than its host
      can take, so 0 but for copier faults);
    - ``load_misses``: loads that stopped at a block the store no longer gave
      (dropped since the lookup, or refused by the store as corrupt: the store's
      own ``stats.corrupt`` counts those); ``corrupt_blocks``: values the tier
      refused (no ``bytes``, or not ``bytes_per_block`` long);
    - ``put_blocks``: blocks offered to the store; ``stored_blocks``/``stored_bytes``:
      those it wrote (a block it had already is not written again);
      ``store_seconds``: time in ``host_blocks_to_bytes`` and ``put_many``;
    - ``errors``: calls to the store or the copier that raised or answered out of
      contract (answered as a miss or a skipped write).
    """

    lookups: int = 0
    found_blocks: int = 0
    loaded_blocks: int = 0
    loaded_bytes: int = 0
    load_seconds: float = 0.0
    load_misses: int = 0
    unfilled_blocks: int = 0
    corrupt_blocks: int = 0
    put_blocks: int = 0
    stored_blocks: int = 0
    stored_bytes: int = 0
    store_seconds: float = 0.0
    errors: int = 0


class StoreTier:
    """A ``KVStore`` below a cache's host pool: its keys, write policy, bytes and stats.

    - ``store``: the :class:`~radixkv.cache.store.protocol.KVStore` (``LocalDiskStore``,
      ``MemoryStore``, a remote store's client);
    - ``keyspace``: the :class:`~radixkv.cache.store.keys.StoreKeyspace` of the model
      whose K/V the host pool holds; its ``block_size`` must be the cache's
      (``ValueError`` from ``HostTier``);
    - ``copier``: a :class:`ByteCopier` over the host pool;
    - ``write_policy``: ``"write_back"`` (put what host eviction deletes) or
      ``"write_through"`` (put every backup to the host).

    ``TypeError``/``ValueError`` naming the argument and value at construction.
    One tier serves one live cache (``ValueError`` naming ``store`` for a second):
    it keeps the run the cache's last match found for its load.

    >>> from radixkv.cache.store import MemoryStore
    >>> class Pool:  # a host pool of 4 blocks of 8 bytes
    ...     layout, bytes_per_block = "kv-v1", 8
    ...     rows = np.zeros((4, 8), dtype=np.uint8)
    ...     def host_blocks_to_bytes(self, ids): return [self.rows[h].tobytes() for h in ids]
    ...     def bytes_to_host_blocks(self, values, ids):
    ...         for h, v in zip(ids, values): self.rows[h] = np.frombuffer(v, np.uint8)
    >>> ks = StoreKeyspace("ab" * 16, "float32", 2, 1, 1, 1)
    >>> tier = StoreTier(MemoryStore(1 << 20), ks, Pool())
    >>> tier.write_policy, tier.bytes_per_block
    ('write_back', 8)
    """

    def __init__(
        self,
        store: KVStore,
        keyspace: StoreKeyspace,
        copier: ByteCopier,
        write_policy: str = "write_back",
    ) -> None:
        if not isinstance(store, KVStore):
            raise TypeError(
                "store must be a KVStore (contains_run, put_many, get_many, capacity_bytes, "
                f"stats, check), got {type(store).__name__}"
            )
        if not isinstance(keyspace, StoreKeyspace):
            raise TypeError(f"keyspace must be a StoreKeyspace, got {type(keyspace).__name__}")
        if not isinstance(copier, ByteCopier):
            raise TypeError(
                "copier must have layout, bytes_per_block, host_blocks_to_bytes and "
                f"bytes_to_host_blocks (a ByteCopier), got {type(copier).__name__}"
            )
        if copier.layout != keyspace.layout:
            raise ValueError(
                f"copier.layout must be the keyspace's {keyspace.layout!r}, got "
                f"{copier.layout!r}"
            )
        self._bytes_per_block = check_int("copier.bytes_per_block", copier.bytes_per_block, low=1)
        if write_policy not in STORE_WRITE_POLICIES:
            raise ValueError(
                f"write_policy must be one of {STORE_WRITE_POLICIES}, got {write_policy!r}"
            )
        self._store = store
        self._keyspace = keyspace
        self._copier = copier
        self.write_policy = write_policy
        self._write_back = write_policy == "write_back"
        self._stats = StoreTierStats()
        self._owner: weakref.ref[object] | None = None
        # the run the last lookup found: its keys and chain digests, for the load that follows
        self._run_keys: list[bytes] = []
        self._run_digests: list[bytes] = []
        # the payloads read of that run (and their digests), held for the fill
        self._held: list[bytes] = []
        self._held_digests = b""

    # ------------------------------------------------------------ properties
    @property
    def store(self) -> KVStore:
        return self._store

    @property
    def keyspace(self) -> StoreKeyspace:
        return self._keyspace

    @property
    def copier(self) -> ByteCopier:
        return self._copier

    @property
    def bytes_per_block(self) -> int:
        """Bytes per block's payload (the copier's, read once at construction)."""
        return self._bytes_per_block

    @property
    def stats(self) -> StoreTierStats:
        """A snapshot of the counters (a new object)."""
        return replace(self._stats)

    # ------------------------------------------------------------ the cache's hooks
    def claim(self, owner: object) -> None:
        """Serve ``owner`` (a cache's constructor calls this): ``ValueError`` naming ``store``
        if another cache that is still alive claimed this tier. Complexity: O(1)."""
        other = self._owner() if self._owner is not None else None
        if other is not None and other is not owner:
            raise ValueError(
                f"store tier already serves {other!r}: one cache per StoreTier (it keeps the run "
                "a match found for the load that follows); build a StoreTier per cache over the "
                "same store"
            )
        self._owner = weakref.ref(owner)

    def lookup(
        self,
        path: list[Node],
        split_child: Node | None,
        split_at: int,
        tokens: np.ndarray,
        namespace: Hashable,
    ) -> int:
        """Blocks of ``tokens`` (the query's tokens past the tree's whole match, under
        ``namespace``) the store holds, from the first; kept for :meth:`read`.

        The match ends after the first ``split_at`` blocks of ``split_child`` if it
        is not None, else at the end of ``path`` (empty: at the root). Never raises
        for a fault: 0 then. Complexity: O(len(tokens)) hashing, the unhashed nodes
        of the path hashed once, plus one ``contains_run``.
        """
        self._run_keys = []
        self._run_digests = []
        self._held = []
        self._held_digests = b""
        if len(tokens) < self._keyspace.block_size:
            return 0
        if split_child is not None:
            tip, k = split_child, split_at
        elif path:
            tip = path[-1]
            k = tip.num_blocks
        else:
            tip, k = None, 0
        ks = self._keyspace
        stats = self._stats
        stats.lookups += 1
        try:
            if tip is None:
                parent = None
            else:
                digests, namespace = self._digests(tip)
                parent = digests[(k - 1) * DIGEST_BYTES : k * DIGEST_BYTES]
            chain = ks.chain_from(parent, tokens, namespace)
            keys = [ks.key(d, namespace) for d in chain]
        except Exception as exc:
            self._fault("contains_run", exc)
            return 0
        found = self._contains_run(keys)
        stats.found_blocks += found
        self._run_keys = keys[:found]
        self._run_digests = chain[:found]
        return found

    def read(self, limit: int) -> int:
        """Read (``get_many``) the first ``limit`` blocks of the last :meth:`lookup`'s run
        and hold their payloads for :meth:`fill`; return how many are held. Stops at the
        first block missing (``load_misses``) or refused (``corrupt_blocks``). Forgets the
        run. The bytes are held from here to the fill or the next lookup, so what the store
        does meanwhile (the puts of the host eviction that makes room for them) cannot take
        them away. Never raises for a fault: 0 then. Complexity: O(bytes read).
        """
        keys = self._run_keys[: max(limit, 0)]
        digests = self._run_digests
        self._run_keys = []
        self._run_digests = []
        self._held = []
        self._held_digests = b""
        if not keys:
            return 0
        stats = self._stats
        size = self._bytes_per_block
        start = time.perf_counter()
        try:
            values = self._store.get_many(keys)
        except Exception as exc:
            self._fault("get_many", exc)
            return 0
        finally:
            stats.load_seconds += time.perf_counter() - start
        if not isinstance(values, list) or len(values) != len(keys):
            self._fault("get_many", f"answered {type(values).__name__} for {len(keys)} keys")
            return 0
        good: list[bytes] = []
        for value in values:
            if value is None:
                stats.load_misses += 1
                break
            if type(value) is not bytes or len(value) != size:
                stats.corrupt_blocks += 1
                break
            good.append(value)
        self._held = good
        self._held_digests = b"".join(digests[: len(good)])
        return len(good)

    def fill(self, host: np.ndarray) -> bytes:
        """Copy the first ``len(host)`` payloads :meth:`read` holds (at most as many as it
        held) into host blocks ``host``; return the chain digests of those copied
        (concatenated, :data:`DIGEST_BYTES` each: the node that files them keeps them).
        Only these count as loaded; the held payloads not copied count in
        ``unfilled_blocks``. Lets the held bytes go. A copier that raises is a fault:
        nothing is loaded, ``b""`` (``host`` then holds nothing the cache will read).
        Never raises for a fault. Complexity: O(bytes copied).
        """
        held, digests = self._held, self._held_digests
        self._held = []
        self._held_digests = b""
        n = min(len(host), len(held))
        stats = self._stats
        stats.unfilled_blocks += len(held) - n
        if not n:
            return b""
        start = time.perf_counter()
        try:
            self._copier.bytes_to_host_blocks(held[:n], host[:n])
        except Exception as exc:
            self._fault("bytes_to_host_blocks", exc)
            stats.unfilled_blocks += n
            return b""
        finally:
            stats.load_seconds += time.perf_counter() - start
        stats.loaded_blocks += n
        stats.loaded_bytes += n * self._bytes_per_block
        return digests[: n * DIGEST_BYTES]

    def released(self, node: Node, *, confirm: bool = False) -> int:
        """Host eviction is about to free host-only leaf ``node``'s host blocks: under
        ``write_back``, put them. Returns how many of its blocks, from the first, the put
        left stored: all when the store wrote each; when it wrote fewer, what one more
        ``contains_run`` finds if ``confirm``, else 0; 0 under ``write_through`` or after a
        fault. Never raises for a fault. Complexity: O(bytes moved)."""
        return self._put(node, confirm) if self._write_back else 0

    def backed_up(self, node: Node, *, confirm: bool = False) -> int:
        """``node`` just got a host copy: under ``write_through``, put it. Returns as
        :meth:`released` (0 under ``write_back``). Never raises for a fault.
        Complexity: O(bytes moved)."""
        return 0 if self._write_back else self._put(node, confirm)

    def split(self, head: Node, tail: Node, k: int) -> None:
        """``head`` took the first ``k`` blocks of ``tail``: so do the digests."""
        digests = tail.store_digests
        if digests is not None:
            cut = k * DIGEST_BYTES
            head.store_digests = digests[:cut]
            tail.store_digests = digests[cut:]

    def check(self, nodes: list[Node]) -> None:
        """``InvariantError`` unless every node's kept digests are a fresh hash of its chain
        and its parent's are kept too (hashed nodes are closed upwards); the store's own
        invariants are its ``check``'s. Complexity: O(hashed tokens + nodes * depth).
        """
        ks = self._keyspace
        for node in nodes:
            digests = node.store_digests
            if digests is None:
                continue
            parent = node.parent
            invariant(
                parent.parent is None or parent.store_digests is not None,
                "a node keeps store digests but its parent does not",
            )
            root = parent
            while root.parent is not None:
                root = root.parent
            last = None if parent.parent is None else parent.store_digests[-DIGEST_BYTES:]
            fresh = ks.chain_from(last, node.tokens(), root.namespace)  # type: ignore[attr-defined]
            invariant(
                digests == b"".join(fresh), "a node's store digests are not its chain's hashes"
            )

    # ------------------------------------------------------------ internals
    def _digests(self, node: Node) -> tuple[bytes, Hashable]:
        """``node``'s store digests (hashing it and any ancestors not hashed yet, top-down)
        and its namespace. ``node`` is in the tree (its ancestors lead to a root)."""
        todo = []
        up = node
        while up.parent is not None:
            if up.store_digests is None:
                todo.append(up)
            up = up.parent
        namespace = up.namespace  # type: ignore[attr-defined]  # a Root
        ks = self._keyspace
        for n in reversed(todo):
            parent = n.parent
            last = None if parent.parent is None else parent.store_digests[-DIGEST_BYTES:]
            n.store_digests = b"".join(ks.chain_from(last, n.tokens(), namespace))
        return node.store_digests, namespace  # type: ignore[return-value]

    def _put(self, node: Node, confirm: bool) -> int:
        """Put ``node``'s blocks; return what :meth:`released` returns. A store that wrote
        fewer than offered had some stored already or refused some: ``put_many``'s count
        cannot tell which, so only ``contains_run`` can."""
        stats = self._stats
        host = node.host_ids()
        stats.put_blocks += len(host)
        start = time.perf_counter()
        try:
            digests, namespace = self._digests(node)
            ks = self._keyspace
            keys = [
                ks.key(digests[i : i + DIGEST_BYTES], namespace)
                for i in range(0, len(digests), DIGEST_BYTES)
            ]
            payloads = self._copier.host_blocks_to_bytes(host)
            size = self._bytes_per_block
            if (
                not isinstance(payloads, list)
                or len(payloads) != len(keys)
                or any(type(p) is not bytes or len(p) != size for p in payloads)
            ):
                why = f"gave no {len(keys)} payloads of {size} bytes"
                self._fault("host_blocks_to_bytes", why)
                return 0
            written = self._store.put_many(list(zip(keys, payloads, strict=True)))
        except Exception as exc:  # a write that fails is a write skipped
            self._fault("put_many", exc)
            return 0
        finally:
            stats.store_seconds += time.perf_counter() - start
        if type(written) is not int or not 0 <= written <= len(keys):
            self._fault("put_many", f"answered {written!r:.40} for {len(keys)} entries")
            return 0
        stats.stored_blocks += written
        stats.stored_bytes += written * self._bytes_per_block
        if written == len(keys):
            return written
        return self._contains_run(keys) if confirm else 0

    def _contains_run(self, keys: list[bytes]) -> int:
        """The store's ``contains_run(keys)``; 0 when it raises or answers out of contract."""
        try:
            found = self._store.contains_run(keys)
        except Exception as exc:  # a store that raises is a miss
            self._fault("contains_run", exc)
            return 0
        if type(found) is not int or not 0 <= found <= len(keys):
            self._fault("contains_run", f"answered {found!r:.40} for {len(keys)} keys")
            return 0
        return found

    def _fault(self, op: str, why: object) -> None:
        self._stats.errors += 1
        n = self._stats.errors
        if log_due(n):
            logger.warning(
                "kv store tier: %s failed (%s); served as a miss or a skipped write, the cache "
                "is whole (%d store tier faults so far)",
                op,
                why,
                n,
            )

    def __repr__(self) -> str:
        return (
            f"StoreTier({type(self._store).__name__}, block_size={self._keyspace.block_size}, "
            f"bytes_per_block={self._bytes_per_block}, write_policy={self.write_policy!r})"
        )


class NoStore:
    """No store below the host: every hook does nothing, nothing is hashed or called."""

    __slots__ = ()

    def claim(self, owner: object) -> None:
        """Nothing to claim."""

    def lookup(
        self,
        path: list[Node],
        split_child: Node | None,
        split_at: int,
        tokens: np.ndarray,
        namespace: Hashable,
    ) -> int:
        return 0

    def read(self, limit: int) -> int:
        """Nothing to read: 0 blocks held."""
        return 0

    def fill(self, host: np.ndarray) -> bytes:
        """Nothing held: no digests."""
        return b""

    def released(self, node: Node, *, confirm: bool = False) -> int:
        """Writes nothing: 0 blocks stored."""
        return 0

    def backed_up(self, node: Node, *, confirm: bool = False) -> int:
        """Writes nothing: 0 blocks stored."""
        return 0

    def split(self, head: Node, tail: Node, k: int) -> None:
        """No digests to split."""

    def check(self, nodes: list[Node]) -> None:
        invariant(
            all(n.store_digests is None for n in nodes), "a node keeps store digests with no store"
        )


NO_STORE = NoStore()
