"""LocalDiskStore: the embedded KVStore, one file per block in a directory on local disk.

**Layout.** ``<path>/<k[0:2]>/<k>`` for a key whose hex is ``k`` (256 fan-out
folders, made as needed); each file is one entry (:mod:`radixkv.cache.store.entry`).
Only a regular file is: a folder or a pipe under an entry's name is a miss.

**Atomic writes.** An entry is written to a temp file in its folder
(``.<k>.<pid>.<random>.tmp``) and renamed over its name (``os.replace``): a
reader sees no file or a whole one. Two processes writing the same block
each rename a complete file of the same bytes (keys are content-addressed),
so whichever lands last leaves a sound entry. There is no fsync: after a
power loss a torn file fails its checksum and is a miss, never served.

**Capacity and order.** Least recently used out first, tracked in memory
(:class:`~radixkv.cache.store.lru.LruIndex`). Each write and hit stamps the
file's mtime with a per-store clock that only moves forward (at least the wall
clock), so a new ``LocalDiskStore`` over the same folder rebuilds the same
order from the files' mtimes at start-up (it survives restarts), evicting
down to its capacity if that shrank. Temp files left by a crash are removed
at start-up once they are older than :data:`STALE_TMP_SECONDS`.

**Several processes.** Each store bounds the entries it knows of (its own
writes, the folder's at start-up, and another process's it meets: a
``contains_run``, ``put_many`` or ``get_many`` that finds a file its index
lacks adopts it). An entry another process deleted is a miss. The folder can
exceed one store's capacity by what the others wrote since it started.

**Faults.** An ``OSError`` on a put (disk full, permissions changed) skips
that entry, on a get answers a miss; both count in ``stats.errors`` and log a
warning (the first, then at every power of two). A corrupt entry is deleted
and counted in ``stats.corrupt``. Nothing but a bad argument raises, before
any change.
"""

from __future__ import annotations

import logging
import os
import stat
import time
from collections.abc import Sequence
from pathlib import Path

from radixkv.cache.store.entry import HEADER_BYTES, decode_parts, encode_header, log_corrupt
from radixkv.cache.store.faultlog import log_due
from radixkv.cache.store.keys import KEY_BYTES, check_items, check_keys
from radixkv.cache.store.lru import LruStore

__all__ = ["STALE_TMP_SECONDS", "LocalDiskStore"]

logger = logging.getLogger(__name__)

STALE_TMP_SECONDS = 600.0
_HEX = frozenset("0123456789abcdef")


class LocalDiskStore(LruStore):
    """A :class:`~radixkv.cache.store.protocol.KVStore` in the directory ``path``, at most
    ``capacity_bytes`` of entries (payload plus the 64-byte header); see the module docstring.

    ``path`` is made if missing. ``ValueError`` naming ``path`` if it is not a directory this
    process can write (one line, the OS's reason in it), ``capacity_bytes`` unless a
    positive int. Start-up is O(files in the folder). Not thread-safe: one caller at a
    time (processes may share the folder).

    >>> import tempfile
    >>> store = LocalDiskStore(tempfile.mkdtemp(), 1 << 20)
    >>> store.put_many([(bytes(32), b"kv")]), store.get_many([bytes(32)])
    (1, [b'kv'])
    """

    def __init__(self, path: str | os.PathLike[str], capacity_bytes: int) -> None:
        super().__init__(capacity_bytes)
        if not isinstance(path, (str, os.PathLike)):
            raise TypeError(f"path must be a str or a path, got {type(path).__name__}")
        self.path = Path(path)
        self._clock = time.time_ns()
        try:
            self.path.mkdir(parents=True, exist_ok=True)
            probe = self.path / f".probe.{os.getpid()}.{os.urandom(4).hex()}.tmp"
            probe.write_bytes(b"")
            probe.unlink()
        except OSError as exc:
            raise ValueError(
                f"path must be a directory this process can write, got {str(path)!r} "
                f"({exc.strerror or exc})"
            ) from None
        self._scan()

    # ------------------------------------------------------------ the surface
    def contains_run(self, keys: Sequence[bytes]) -> int:
        """Complexity: O(run), a ``stat`` for each key the index lacks."""
        n = 0
        for key in check_keys("keys", keys):
            if key not in self._index and not self._adopt(key):
                break
            n += 1
        return n

    def put_many(self, items: Sequence[tuple[bytes, bytes]]) -> int:
        """Complexity: O(bytes written), a ``stat`` and a rename per new key."""
        index, stats = self._index, self._stats
        written = 0
        for key, value in check_items("items", items):
            if (key in index or self._adopt(key)) and self._stamp(self._file(key)):
                index.touch(key)
                continue
            index.remove(key)  # indexed, but another process deleted the file: write it again
            size = HEADER_BYTES + value.nbytes
            if size > index.capacity_bytes:
                stats.rejected += 1
                continue
            self._drop(index.make_room(size))
            if self._write(key, value):
                index.add(key, size)
                stats.puts += 1
                stats.put_bytes += size
                written += 1
        return written

    def get_many(self, keys: Sequence[bytes]) -> list[bytes | None]:
        """Complexity: O(bytes read), an open and a read per key."""
        keys = check_keys("keys", keys)
        index, stats = self._index, self._stats
        out: list[bytes | None] = []
        for key in keys:
            stats.gets += 1
            path = self._file(key)
            value = None
            try:
                parts = self._read(path)
            except OSError as exc:
                self._fault("get", exc)
                out.append(None)
                continue
            if parts is None:  # another process deleted it, or it is no entry
                index.remove(key)
                stats.misses += 1
            else:
                header, payload = parts
                value = decode_parts(key, header, payload)
                size = len(header) + len(payload)
                if value is None:
                    stats.corrupt += 1
                    log_corrupt(str(self.path), stats.corrupt)
                    index.remove(key)
                    self._unlink(path)
                else:
                    stats.hits += 1
                    stats.hit_bytes += len(value)
                    if not index.touch(key) and size <= index.capacity_bytes:
                        self._drop(index.make_room(size))  # another process wrote it
                        index.add(key, size)
                    self._stamp(path)
            out.append(value)
        return out

    def check(self) -> None:
        """The index's invariants (what another process does to the folder is not checked)."""
        self._index.check()

    # ------------------------------------------------------------ files
    def _file(self, key: bytes) -> Path:
        name = key.hex()
        return self.path / name[:2] / name

    def _tick(self) -> int:
        """The next stamp: after every earlier one, and at least the wall clock."""
        self._clock = max(self._clock + 1, time.time_ns())
        return self._clock

    def _stamp(self, path: Path) -> bool:
        """Mark ``path`` used now (its mtime is its place in the order after a restart);
        False if the file is gone."""
        t = self._tick()
        try:
            os.utime(path, ns=(t, t))
        except FileNotFoundError:
            return False
        except OSError:
            pass  # not ours to stamp: the order in memory is still right
        return True

    @staticmethod
    def _read(path: Path) -> tuple[bytes, bytes] | None:
        """The header and the rest of the file at ``path``; None if there is none, or it is not
        a regular file (a folder or a pipe under an entry's name is no entry). Any other
        ``OSError`` is raised."""
        try:
            fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK)  # opening a pipe does not wait
        except FileNotFoundError:
            return None
        try:
            if not stat.S_ISREG(os.fstat(fd).st_mode):
                return None
            with open(fd, "rb", buffering=0, closefd=False) as f:  # no buffer to copy out of
                return f.read(HEADER_BYTES), f.readall()
        finally:
            os.close(fd)

    def _write(self, key: bytes, value: memoryview) -> bool:
        path = self._file(key)
        tmp = path.parent / f".{path.name}.{os.getpid()}.{os.urandom(4).hex()}.tmp"
        try:
            path.parent.mkdir(exist_ok=True)
            with open(tmp, "wb") as f:
                f.write(encode_header(key, value))
                f.write(value)
            t = self._tick()
            os.utime(tmp, ns=(t, t))
            os.replace(tmp, path)
        except OSError as exc:
            try:
                tmp.unlink(missing_ok=True)
            except OSError:
                pass  # the folder itself is what failed: the put's fault is what counts
            self._fault("put", exc)
            return False
        return True

    def _adopt(self, key: bytes) -> bool:
        """Index a file another process wrote, if there is one (a regular file: a folder or a
        pipe under an entry's name is no entry)."""
        try:
            st = self._file(key).stat()
        except OSError:
            return False
        size = st.st_size
        if not stat.S_ISREG(st.st_mode) or size > self._index.capacity_bytes:
            return False
        self._drop(self._index.make_room(size))
        self._index.add(key, size)
        return True

    def _drop(self, victims: list[tuple[bytes, int]]) -> None:
        stats = self._stats
        for key, size in victims:
            self._unlink(self._file(key))
            stats.evicted += 1
            stats.evicted_bytes += size

    def _unlink(self, path: Path) -> None:
        try:
            path.unlink()
        except FileNotFoundError:
            pass
        except OSError as exc:
            self._fault("delete", exc)

    def _fault(self, op: str, exc: OSError) -> None:
        self._stats.errors += 1
        n = self._stats.errors
        if log_due(n):
            logger.warning(
                "kv store %s: %s failed (%s); served as a miss, the engine recomputes "
                "(%d store faults so far)",
                self.path,
                op,
                exc,
                n,
            )

    def _scan(self) -> None:
        """Index the folder's entries, oldest stamp first; drop stale temp files."""
        found: list[tuple[int, str, int]] = []
        stale = time.time() - STALE_TMP_SECONDS
        with os.scandir(self.path) as top:
            folders = [e.path for e in top if len(e.name) == 2 and set(e.name) <= _HEX]
        for folder in folders:
            try:
                with os.scandir(folder) as it:
                    entries = list(it)
            except OSError as exc:
                self._fault("scan", exc)
                continue
            for e in entries:
                try:
                    st = e.stat()
                except OSError:
                    continue
                if e.name.endswith(".tmp"):
                    if st.st_mtime < stale:
                        self._unlink(Path(e.path))
                elif len(e.name) == 2 * KEY_BYTES and set(e.name) <= _HEX and e.is_file():
                    found.append((st.st_mtime_ns, e.name, st.st_size))
        found.sort()
        index = self._index
        for mtime, name, size in found:
            key = bytes.fromhex(name)
            if size > index.capacity_bytes:
                self._unlink(self._file(key))
                continue
            self._drop(index.make_room(size))
            index.add(key, size)
            self._clock = max(self._clock, mtime)
