"""MooncakeStore: a KVStore in a Mooncake Store pool, shared by every server of a fleet.

`Mooncake Store <https://github.com/kvcache-ai/Mooncake>`_ is a distributed object
store for KV cache: a master (``mooncake_master``) places objects in memory segments
that its clients contribute, and clients put and get objects by key over TCP or RDMA.
This module talks to it through Mooncake's Python client (``mooncake.store``, from
the ``mooncake-transfer-engine-non-cuda`` wheel; on Linux it needs the RDMA verbs
library, Debian's ``libibverbs1``, even over TCP). The client is imported when a
store is made, never at ``import radixkv``.

**Keys and entries.** A block's key is stored as ``key_prefix + key.hex()``; its value
is the whole entry (:mod:`radixkv.cache.store.entry`), checked on every get as
:class:`~radixkv.cache.store.memory.MemoryStore` checks it: a corrupt or foreign
value is a miss, counted in ``corrupt`` and removed from the pool. Keys are
content-addressed, so an object already in the pool (another server put it) is
used as it is, never rewritten.

**Capacity.** The pool is shared; the master evicts under pressure (an entry may
vanish at any time: a miss). Each store also bounds what it knows of, as
:class:`~radixkv.cache.store.local.LocalDiskStore` does in a shared folder: its own
puts and the entries it meets (a get or a put that finds one), least recently used
out first, removed from the pool (forcibly: a reader caught mid-transfer fails the
checksum and misses).

**Batches.** ``contains_run``, ``put_many`` and ``get_many`` each make one round trip
(``batch_is_exist``, ``put_batch``, ``batch_get_buffer``) per chunk of at most
three quarters of ``local_buffer_size`` bytes, the client's staging buffer; a
``get_many`` that meets a missing key adds one ``batch_is_exist`` to tell a miss
from a fault, and a ``put_many`` that evicts adds one ``batch_remove``.

**Faults never raise.** A failed call answers misses or skips the puts, counts
``errors`` and logs a warning (the first, then at every power of two). A master that
stops answering (an RPC failure) marks the connection down: for ``retry_after_s``
seconds every call answers at once without touching the client, then a TCP connect
to the master decides whether to try it again. An unreachable master or metadata
server at construction is one ``ValueError``.
"""

from __future__ import annotations

import logging
import os
import shutil
import socket
import subprocess
import sys
import time
from collections.abc import Iterator, Sequence
from types import TracebackType
from typing import Any
from urllib.parse import urlsplit

from radixkv.cache.store.entry import HEADER_BYTES, decode_parts, encode, log_corrupt
from radixkv.cache.store.faultlog import log_due
from radixkv.cache.store.keys import check_items, check_keys
from radixkv.cache.store.lru import LruStore
from radixkv.checks import check_int, check_number, check_str

__all__ = ["MIN_SEGMENT_BYTES", "PACKAGE", "MooncakeMaster", "MooncakeStore", "check_master"]

logger = logging.getLogger(__name__)

PACKAGE = "mooncake-transfer-engine-non-cuda"
"""The PyPI package of Mooncake's Python client (CPU build); ``radixkv[store-mooncake]``."""
MIN_SEGMENT_BYTES = 16 << 20
"""The least ``global_segment_size`` and ``local_buffer_size`` a Mooncake client accepts."""
_RPC_FAIL = -900  # Mooncake's ErrorCode::RPC_FAIL: the master did not answer
_NOT_FOUND = -704  # ErrorCode::OBJECT_NOT_FOUND
_ASSUMED_ENTRY_BYTES = 1 << 20  # a get's chunking guess for an entry this store never saw


def _import_client() -> Any:
    try:
        from mooncake.store import MooncakeDistributedStore
    except ImportError as exc:
        raise ImportError(
            f"MooncakeStore needs Mooncake's Python client: pip install 'radixkv[store-mooncake]'"
            f" (the {PACKAGE} package) and, on Debian or Ubuntu, apt-get install libibverbs1 "
            f"(the RDMA verbs library it loads even over TCP); the import failed: {exc}"
        ) from exc
    return MooncakeDistributedStore


def _host_port(name: str, value: object) -> tuple[str, int]:
    text = check_str(name, value)
    host, sep, port = text.rpartition(":")
    if not sep or not host or not port.isdigit() or not 0 < int(port) < 65536:
        raise ValueError(f"{name} must be 'host:port', got {value!r}")
    return host.strip("[]"), int(port)


def _probe(name: str, value: str, host: str, port: int, timeout_s: float) -> str:
    """Connect to ``host:port`` and hang up; the local address that reaches it. ``ValueError``
    naming ``name`` if nothing answers there."""
    try:
        with socket.create_connection((host, port), timeout=timeout_s) as sock:
            return sock.getsockname()[0]
    except OSError as exc:
        raise ValueError(
            f"{name} must be reachable, got {value!r} ({exc.strerror or exc})"
        ) from None


def check_master(master_address: str, timeout_s: float = 5.0) -> None:
    """``ValueError`` naming ``master_address`` unless it is ``HOST:PORT`` and something
    accepts a TCP connection there within ``timeout_s``: what :class:`MooncakeStore` checks
    first, without Mooncake's client or lending the pool memory (a fleet's driver checks
    the master its replicas will join before it starts them). Complexity: one connect."""
    host, port = _host_port("master_address", master_address)
    _probe("master_address", master_address, host, port, timeout_s)


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


class MooncakeMaster:
    """A ``mooncake_master`` process on free 127.0.0.1 ports, for one machine (tests,
    benchmarks, a single-node pool); :attr:`address` is what :class:`MooncakeStore` takes.
    :meth:`start` after :meth:`stop` serves on the same ports (a fresh master: an empty pool).

    ``binary`` defaults to the ``mooncake_master`` beside this Python (the wheel's), else
    on ``PATH``; ``FileNotFoundError`` naming the package if there is none.
    """

    def __init__(self, binary: str | None = None) -> None:
        beside = os.path.join(os.path.dirname(sys.executable), "mooncake_master")
        found = binary or (beside if os.path.exists(beside) else shutil.which("mooncake_master"))
        if found is None:
            raise FileNotFoundError(
                f"mooncake_master is not installed: pip install 'radixkv[store-mooncake]' "
                f"(the {PACKAGE} package)"
            )
        self.binary = found
        self.rpc_port, self.metrics_port = _free_port(), _free_port()
        self.address = f"127.0.0.1:{self.rpc_port}"
        self._proc: subprocess.Popen | None = None

    def start(self, timeout_s: float = 30.0) -> None:
        """Start it and wait until it accepts connections; ``RuntimeError`` if it exits or
        ``timeout_s`` passes first."""
        self._proc = subprocess.Popen(
            [
                self.binary,
                "--rpc_address=127.0.0.1",
                f"--rpc_port={self.rpc_port}",
                f"--metrics_port={self.metrics_port}",
            ],
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
        )
        deadline = time.monotonic() + timeout_s
        while True:
            try:
                socket.create_connection(("127.0.0.1", self.rpc_port), timeout=1).close()
                return
            except OSError:
                if self._proc.poll() is not None or time.monotonic() > deadline:
                    self.stop()
                    raise RuntimeError(f"mooncake_master did not start on {self.address}") from None
                time.sleep(0.05)

    def stop(self) -> None:
        """Kill it (SIGKILL: as a crash would) and wait for it to exit. Idempotent."""
        if self._proc is not None:
            self._proc.kill()
            self._proc.wait()
            self._proc = None

    def __enter__(self) -> MooncakeMaster:
        self.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()


class _Connection:
    """One Mooncake client, shared by the stores of :meth:`MooncakeStore.share`; closed with
    the last of them. Holds the down-marker every sharing store obeys."""

    def __init__(self, client: Any, master: tuple[str, int], retry_after_s: float) -> None:
        self.client = client
        self.master = master
        self.retry_after_s = retry_after_s
        self.users = 1
        self.down_until: float | None = None

    def available(self) -> bool:
        """False while the master is marked down; past ``retry_after_s``, a TCP connect to
        it decides (and re-arms the marker if nothing answers)."""
        if self.down_until is None:
            return True
        if time.monotonic() < self.down_until:
            return False
        try:
            socket.create_connection(self.master, timeout=0.5).close()
        except OSError:
            self.mark_down()
            return False
        self.down_until = None
        return True

    def mark_down(self) -> None:
        self.down_until = time.monotonic() + self.retry_after_s

    def release(self) -> None:
        self.users -= 1
        if self.users == 0:
            self.client.close()
            self.client = None


class MooncakeStore(LruStore):
    """A :class:`~radixkv.cache.store.protocol.KVStore` in a Mooncake Store pool whose master
    serves at ``master_address`` (``'host:port'``, its RPC port); at most ``capacity_bytes``
    of the entries this store knows of (payload plus the 64-byte header). See the module
    docstring.

    The client joins the pool as Mooncake's own clients do: ``metadata_server`` is
    ``'P2PHANDSHAKE'`` (clients exchange metadata directly), an HTTP metadata server
    URL (``mooncake_master --enable_http_metadata_server``) or an etcd address;
    ``local_hostname`` is the address other clients reach this one at (default: the
    local address that reaches the master); ``protocol`` ``'tcp'`` or ``'rdma'`` (with
    ``device_name``); ``global_segment_size`` the bytes of memory this client lends
    the pool (default: ``capacity_bytes``, at least :data:`MIN_SEGMENT_BYTES`);
    ``local_buffer_size`` its staging buffer for transfers. Stored keys are
    ``key_prefix + key.hex()``, so other users of the pool keep to their own names.

    Raises, before connecting: ``ValueError`` naming the argument for a bad value, or
    a ``master_address`` or HTTP ``metadata_server`` that does not accept a TCP
    connection within ``connect_timeout_s``; a client ``setup`` that fails is a
    ``ValueError`` with Mooncake's code. ``ImportError`` naming the package when
    Mooncake's client is not installed. Not thread-safe: one caller at a time (any
    number of processes and machines may share the pool). :meth:`close` (or ``with``)
    leaves the pool; closing takes the client about 2 s.
    """

    def __init__(
        self,
        master_address: str,
        capacity_bytes: int,
        *,
        metadata_server: str = "P2PHANDSHAKE",
        local_hostname: str | None = None,
        protocol: str = "tcp",
        device_name: str = "",
        global_segment_size: int | None = None,
        local_buffer_size: int = 64 << 20,
        key_prefix: str = "radixkv/",
        retry_after_s: float = 2.0,
        connect_timeout_s: float = 2.0,
    ) -> None:
        super().__init__(capacity_bytes)
        master = _host_port("master_address", master_address)
        check_str("metadata_server", metadata_server)
        check_str("local_hostname", local_hostname, optional=True)
        check_str("protocol", protocol)
        check_str("device_name", device_name)
        segment = check_int(
            "global_segment_size", global_segment_size, low=MIN_SEGMENT_BYTES, optional=True
        )
        if segment is None:
            segment = max(capacity_bytes, MIN_SEGMENT_BYTES)
        buffer = check_int("local_buffer_size", local_buffer_size, low=MIN_SEGMENT_BYTES)
        self._prefix = check_str("key_prefix", key_prefix)
        retry = check_number("retry_after_s", retry_after_s, low=0.0)
        timeout = check_number("connect_timeout_s", connect_timeout_s, low=0.0, strict=True)
        client_type = _import_client()
        here = _probe("master_address", master_address, *master, timeout)
        url = urlsplit(metadata_server)
        if url.scheme in ("http", "https"):
            port = url.port or (443 if url.scheme == "https" else 80)
            _probe("metadata_server", metadata_server, url.hostname or "", port, timeout)
        client = client_type()
        code = client.setup(
            local_hostname or here,
            metadata_server,
            segment,
            buffer,
            protocol,
            device_name,
            master_address,
        )
        if code != 0:
            raise ValueError(
                f"a Mooncake client could not join the pool at master_address="
                f"{master_address!r} with metadata_server={metadata_server!r} and "
                f"protocol={protocol!r} (setup returned {code})"
            )
        self._conn = _Connection(client, master, retry)
        self._chunk_bytes = buffer * 3 // 4
        self._closed = False

    def share(self, capacity_bytes: int, *, key_prefix: str | None = None) -> MooncakeStore:
        """A new store over this store's client (no second connection, segment or buffer):
        its own capacity, index and stats, ``key_prefix`` (default: this store's). The
        client leaves the pool when the last store sharing it closes. ``ValueError`` as
        the constructor's for a bad argument or if this store is closed. O(1)."""
        if self._closed:
            raise ValueError("share needs an open store, got a closed one")
        other = object.__new__(MooncakeStore)
        LruStore.__init__(other, capacity_bytes)
        other._prefix = self._prefix if key_prefix is None else check_str("key_prefix", key_prefix)
        other._conn = self._conn
        other._chunk_bytes = self._chunk_bytes
        other._closed = False
        self._conn.users += 1
        return other

    @property
    def client(self) -> Any:
        """Mooncake's client (``mooncake.store.MooncakeDistributedStore``), shared with the
        stores of :meth:`share`, for what this class does not wrap; None once closed. Its
        calls raise or block as Mooncake's do: none of this class's guarantees hold there."""
        return None if self._closed else self._conn.client

    def close(self) -> None:
        """Stop using the pool; the client leaves it with the last store sharing it (its
        entries stay until the master evicts them). Idempotent."""
        if not self._closed:
            self._closed = True
            self._conn.release()

    def __enter__(self) -> MooncakeStore:
        return self

    def __exit__(
        self, kind: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        self.close()

    # ------------------------------------------------------------ the surface
    def contains_run(self, keys: Sequence[bytes]) -> int:
        """Complexity: one ``batch_is_exist`` round trip per chunk of keys."""
        keys = check_keys("keys", keys)
        if not keys:
            return 0
        found = self._exist([self._name(k) for k in keys], "contains_run")
        if found is None:
            return 0
        n = 0
        for key, there in zip(keys, found):
            if not there:
                self._index.remove(key)  # the master evicted it, or another store removed it
                break
            n += 1
        return n

    def put_many(self, items: Sequence[tuple[bytes, bytes]]) -> int:
        """Complexity: O(bytes written); a ``batch_is_exist``, a ``put_batch`` per chunk, and a
        ``batch_remove`` when it evicts."""
        items = check_items("items", items)
        if not items:
            return 0
        found = self._exist([self._name(k) for k, _ in items], "put", len(items))
        if found is None:
            return 0
        index, stats = self._index, self._stats
        pending: dict[bytes, memoryview] = {}
        victims: list[bytes] = []
        written = 0
        for (key, value), there in zip(items, found):
            size = HEADER_BYTES + value.nbytes
            if key in pending or there:
                if not index.touch(key) and size <= index.capacity_bytes:
                    victims += self._make_room(size, pending)  # another store put it: adopt
                    index.add(key, size)
                continue
            index.remove(key)  # known here, but gone from the pool: write it again
            if size > index.capacity_bytes or size > self._chunk_bytes:
                stats.rejected += 1
                continue
            victims += self._make_room(size, pending)
            index.add(key, size)
            pending[key] = value
            written += 1  # a key evicted by a later one of this batch counts as written
        self._remove(victims, "evict")
        for chunk in self._chunks(list(pending), lambda k: HEADER_BYTES + pending[k].nbytes):
            landed = self._put_chunk(chunk, [pending[k] for k in chunk])
            for key in chunk:
                if key in landed:
                    stats.puts += 1
                    stats.put_bytes += HEADER_BYTES + pending[key].nbytes
                else:
                    index.remove(key)
                    written -= 1
        return written

    def get_many(self, keys: Sequence[bytes]) -> list[bytes | None]:
        """Complexity: O(bytes read): a ``batch_get_buffer`` per chunk (one copy of each
        value out of the client's buffer), a ``batch_is_exist`` when one comes back empty."""
        keys = check_keys("keys", keys)
        index, stats = self._index, self._stats
        stats.gets += len(keys)
        out: list[bytes | None] = [None] * len(keys)
        if not keys:
            return out
        if not self._conn.available():
            self._fault("get", "the master is marked down", len(keys))
            return out
        empty: list[int] = []
        bad: list[bytes] = []
        victims: list[bytes] = []

        def size_of(i: int) -> int:
            return index.size(keys[i]) or _ASSUMED_ENTRY_BYTES

        for chunk in self._chunks(list(range(len(keys))), size_of):
            handles = self._conn.client.batch_get_buffer([self._name(keys[i]) for i in chunk])
            for i, handle in zip(chunk, handles):
                if handle is None:
                    empty.append(i)
                    continue
                key, view = keys[i], memoryview(handle).cast("B")
                value = decode_parts(key, view[:HEADER_BYTES].tobytes(), view[HEADER_BYTES:])
                if value is None:
                    stats.corrupt += 1
                    log_corrupt("mooncake {}:{}".format(*self._conn.master), stats.corrupt)
                    index.remove(key)
                    bad.append(key)
                    continue
                stats.hits += 1
                stats.hit_bytes += len(value)
                if not index.touch(key) and view.nbytes <= index.capacity_bytes:
                    victims += self._make_room(view.nbytes, {})  # another store put it
                    index.add(key, view.nbytes)
                out[i] = value
            del handles  # gives the client's buffer back before the next chunk
        if empty:
            found = self._exist([self._name(keys[i]) for i in empty], "get", len(empty))
            if found is not None:
                lost = 0
                for i, there in zip(empty, found):
                    if there:
                        lost += 1  # stored, but not read: a transfer failed
                    else:
                        stats.misses += 1
                        index.remove(keys[i])
                if lost:
                    self._fault("get", "stored entries could not be read", lost)
        self._remove(bad + victims, "remove")
        return out

    def check(self) -> None:
        """The index's invariants (what other clients and the master do to the pool is not
        checked)."""
        self._index.check()

    # ------------------------------------------------------------ the client
    def _name(self, key: bytes) -> str:
        return self._prefix + key.hex()

    def _chunks(self, things: list, size_of: Any) -> Iterator[list]:
        """``things`` in runs whose sizes fit the client's staging buffer."""
        run: list = []
        total = 0
        for thing in things:
            size = size_of(thing)
            if run and total + size > self._chunk_bytes:
                yield run
                run, total = [], 0
            run.append(thing)
            total += size
        if run:
            yield run

    def _exist(self, names: list[str], op: str, cost: int = 1) -> list[bool] | None:
        """Which of ``names`` are in the pool; None after a fault (counted as ``cost``)."""
        if not self._conn.available():
            self._fault(op, "the master is marked down", cost)
            return None
        found: list[bool] = []
        for chunk in self._chunks(names, lambda _: 1 << 10):
            codes = self._conn.client.batch_is_exist(chunk)
            failed = [c for c in codes if c < 0] or [0]
            if len(codes) != len(chunk) or failed[0]:
                self._rpc_fault(op, f"batch_is_exist returned {failed[0]}", cost, failed[0])
                return None
            found += [c == 1 for c in codes]
        return found

    def _put_chunk(self, keys: list[bytes], values: list[memoryview]) -> set[bytes]:
        """Put one chunk; the keys that landed in the pool."""
        names = [self._name(k) for k in keys]
        code = self._conn.client.put_batch(names, [encode(k, v) for k, v in zip(keys, values)])
        if code == 0:
            return set(keys)
        if code == _RPC_FAIL:
            self._rpc_fault("put", f"put_batch returned {code}", len(keys), code)
            return set()
        codes = self._conn.client.batch_is_exist(names)  # which ones landed before the failure
        landed = {k for k, c in zip(keys, codes) if c == 1}
        lost = len(keys) - len(landed)
        self._fault("put", f"put_batch returned {code} (is the pool full?)", lost)
        return landed

    def _remove(self, keys: list[bytes], op: str) -> None:
        if not keys or not self._conn.available():
            return  # the master evicts what stays behind
        codes = self._conn.client.batch_remove([self._name(k) for k in keys], True)
        failed = [c for c in codes if c < 0 and c != _NOT_FOUND]
        if failed:
            self._rpc_fault(op, f"batch_remove returned {failed[0]}", len(failed), failed[0])

    def _make_room(self, size: int, pending: dict[bytes, memoryview]) -> list[bytes]:
        """Index room for ``size`` bytes; the victims to remove from the pool (a victim still
        ``pending`` is not written at all)."""
        stats = self._stats
        victims = []
        for key, old in self._index.make_room(size):
            stats.evicted += 1
            stats.evicted_bytes += old
            value = pending.pop(key, None)
            if value is None:
                victims.append(key)
            else:  # written then evicted by the same batch, as MemoryStore counts it
                stats.puts += 1
                stats.put_bytes += old
        return victims

    def _rpc_fault(self, op: str, detail: str, cost: int, code: int) -> None:
        """A fault with Mooncake's error ``code``; the master not answering marks it down."""
        if code == _RPC_FAIL:
            self._conn.mark_down()
        self._fault(op, detail, cost)

    def _fault(self, op: str, detail: str, cost: int) -> None:
        stats = self._stats
        stats.errors += cost
        if log_due(stats.errors, cost):
            logger.warning(
                "kv store mooncake %s:%d: %s failed (%s); served as a miss, the engine "
                "recomputes (%d store faults so far)",
                *self._conn.master,
                op,
                detail,
                stats.errors,
            )
