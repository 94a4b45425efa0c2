"""The KV store tier (radixkv.cache.store): one contract suite over every backend, the keys,
the entry format, the disk store's files, and a state machine against a dict oracle. The
suite runs over MemoryStore, LocalDiskStore and MooncakeStore (a master on 127.0.0.1 for the
session; tests/cache/test_store_mooncake.py has its own cases).

docs/store.md: a store keeps bytes under content-addressed keys that fold in the
model identity, dtype, block size, geometry and namespace; every entry carries its
key and a checksum, and anything unsound is a counted miss, never served; the disk
store writes atomically, keeps its capacity least recently used out first, and
finds its entries (in the same order) after a restart.
"""

from __future__ import annotations

import hashlib
import multiprocessing
import os
import shutil
import tempfile
from collections import OrderedDict
from collections.abc import Callable, Iterator
from dataclasses import replace
from pathlib import Path

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, rule
from mooncake_helpers import pool_store

from radixkv.cache.store import KEY_BYTES, KVStore, LocalDiskStore, MemoryStore, StoreKeyspace
from radixkv.cache.store.entry import HEADER_BYTES, decode, encode
from radixkv.cache.store.faultlog import log_due
from radixkv.cache.store.keys import CHAIN_SEED
from radixkv.cache.store.local import STALE_TMP_SECONDS
from radixkv.cache.store.mooncake import MooncakeStore

HEADER = HEADER_BYTES


def key_of(i: int) -> bytes:
    return i.to_bytes(4, "big") * (KEY_BYTES // 4)


_CYCLE = bytes(range(251))


def value_of(i: int, size: int = 100) -> bytes:
    start = i * 7 % 251
    return (_CYCLE * (size // 251 + 2))[start : start + size]


def disk_files(path: Path) -> set[bytes]:
    """The keys of the entries in a disk store's folder (its fan-out layout)."""
    return {bytes.fromhex(p.name) for p in path.glob("??/*") if not p.name.endswith(".tmp")}


# ------------------------------------------------------------ the contract suite
Factory = Callable[[int], KVStore]


@pytest.fixture(params=["memory", "disk", "mooncake"])
def make_store(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[Factory]:
    if request.param == "memory":
        yield MemoryStore
    elif request.param == "disk":
        yield lambda capacity: LocalDiskStore(tmp_path / "store", capacity)
    else:  # skips, saying why, without Mooncake's client
        pool = request.getfixturevalue("mooncake_pool")
        made: list[MooncakeStore] = []

        def make(capacity: int) -> MooncakeStore:
            made.append(pool_store(pool, capacity))
            return made[-1]

        yield make
        for store in made:
            store.close()


def test_put_get_and_contains_run(make_store: Factory) -> None:
    store = make_store(1 << 20)
    assert isinstance(store, KVStore)
    keys = [key_of(i) for i in range(4)]
    assert store.put_many([(keys[0], value_of(0)), (keys[1], value_of(1))]) == 2
    assert store.put_many([(keys[3], bytearray(value_of(3)))]) == 1  # any bytes-like value
    assert store.contains_run(keys) == 2  # the stored prefix stops at the first missing key
    assert store.contains_run(keys[3:]) == 1 and store.contains_run([]) == 0
    assert store.get_many(keys) == [value_of(0), value_of(1), None, value_of(3)]
    s = store.stats
    size = HEADER + 100
    assert (s.puts, s.put_bytes, s.gets, s.hits, s.misses, s.corrupt) == (3, 3 * size, 4, 3, 1, 0)
    assert (s.used_bytes, s.num_entries, s.hit_bytes) == (3 * (HEADER + 100), 3, 300)
    store.check()


def test_a_stored_key_is_not_rewritten(make_store: Factory) -> None:
    store = make_store(1 << 20)
    store.put_many([(key_of(0), value_of(0))])
    assert store.put_many([(key_of(0), value_of(0))]) == 0
    assert store.stats.puts == 1
    assert store.get_many([key_of(0)]) == [value_of(0)]


def test_capacity_evicts_least_recently_used_first(make_store: Factory) -> None:
    size = HEADER + 100
    store = make_store(3 * size)
    store.put_many([(key_of(i), value_of(i)) for i in range(3)])
    store.get_many([key_of(0)])  # a hit is a use: 1 is now the oldest
    store.put_many([(key_of(1), value_of(1))])  # so is a put of a stored key: 2 is now
    store.put_many([(key_of(3), value_of(3))])
    assert [v is not None for v in store.get_many([key_of(i) for i in range(4)])] == [
        True,
        True,
        False,
        True,
    ]
    s = store.stats
    assert (s.evicted, s.evicted_bytes, s.used_bytes, s.num_entries) == (1, size, 3 * size, 3)
    store.check()


def test_a_value_larger_than_the_capacity_is_refused_and_evicts_nothing(
    make_store: Factory,
) -> None:
    store = make_store(2 * (HEADER + 100))
    store.put_many([(key_of(0), value_of(0))])
    assert store.put_many([(key_of(1), value_of(1, 300))]) == 0
    assert store.stats.rejected == 1 and store.stats.evicted == 0
    assert store.get_many([key_of(0), key_of(1)]) == [value_of(0), None]


@pytest.mark.parametrize(
    ("call", "match"),
    [
        (lambda s: s.put_many([(key_of(1), b"x"), (b"short", b"x")]), r"items\[1\]\[0\]"),
        (lambda s: s.put_many([(key_of(1), b"x"), (key_of(2), "text")]), r"items\[1\]\[1\]"),
        (lambda s: s.put_many([(key_of(1), b"x"), key_of(2)]), r"items\[1\] must be"),
        (lambda s: s.put_many(key_of(1)), "items must be"),
        (lambda s: s.get_many([key_of(0), bytearray(key_of(0))]), r"keys\[1\]"),
        (lambda s: s.contains_run([key_of(0), "00" * KEY_BYTES]), r"keys\[1\]"),
        (lambda s: s.contains_run(key_of(0)), "keys must be"),
    ],
)
def test_a_bad_argument_raises_naming_it_and_changes_nothing(
    make_store: Factory, call: Callable[[KVStore], object], match: str
) -> None:
    store = make_store(1 << 20)
    store.put_many([(key_of(0), value_of(0))])
    before = store.stats
    with pytest.raises(ValueError, match=match):
        call(store)
    assert store.stats == before
    assert store.contains_run([key_of(0), key_of(1)]) == 1


@pytest.mark.parametrize("kind", [MemoryStore, LocalDiskStore])
def test_a_bad_capacity_is_a_value_error_naming_it(kind: type, tmp_path: Path) -> None:
    args = () if kind is MemoryStore else (tmp_path,)
    for bad in (0, -1, 1.5, True, (1 << 50) + 1):
        with pytest.raises(ValueError, match="capacity_bytes"):
            kind(*args, bad)


# ------------------------------------------------------------ keys
KEYSPACE = StoreKeyspace("0123456789abcdef" * 4, "float32", 16, 30, 3, 64)


def test_keys_follow_the_documented_recipe_and_are_known_answers() -> None:
    """The keys as radixkv.cache.store.keys documents them, recomputed here from hashlib; and
    pinned, since a change of recipe orphans every store on disk."""
    fields = (
        '{"block_size":16,"dtype":"float32","head_dim":64,"layout":"kv-v1",'
        f'"model_digest":"{"0123456789abcdef" * 4}","num_kv_heads":3,"num_layers":30}}'
    )
    space = hashlib.blake2b(fields.encode(), digest_size=32, person=b"radixkv/keyspace").digest()
    assert KEYSPACE.digest == space
    root = hashlib.sha256(b"radixkv/block-hash-seed\x00s" + CHAIN_SEED.encode()).digest()
    ns = repr(("tenant-a",)).encode()
    tokens = np.arange(40, dtype=np.int32)
    first = hashlib.sha256(root + tokens[:16].tobytes() + ns).digest()
    second = hashlib.sha256(first + tokens[16:32].tobytes()).digest()
    want = [
        hashlib.blake2b(space + d + ns, digest_size=32, person=b"radixkv/kvblock").digest()
        for d in (first, second)
    ]
    keys = KEYSPACE.block_keys(tokens, "tenant-a")
    assert keys == want
    assert KEYSPACE.digest.hex()[:16] == "1a80b088cac95246"
    assert [k.hex()[:16] for k in keys] == ["272b0e591ef50638", "560424c66bc56b66"]


FIELD_CHANGES = {
    "model_digest": "fedcba9876543210" * 4,
    "dtype": "bfloat16",
    "block_size": 16,  # replaced below by a different value
    "num_layers": 29,
    "num_kv_heads": 4,
    "head_dim": 32,
    "layout": "kv-v2",
}


@given(
    field=st.sampled_from(sorted(FIELD_CHANGES)),
    tokens=st.lists(st.integers(0, 2**31 - 1), min_size=32, max_size=64),
    namespace=st.sampled_from([None, "a", "b", 1, ("a",)]),
)
def test_keys_differ_when_anything_that_decides_the_bytes_differs(
    field: str, tokens: list[int], namespace: object
) -> None:
    other = replace(KEYSPACE, **{field: FIELD_CHANGES[field]})
    if field == "block_size":
        other = replace(KEYSPACE, block_size=8)
    assert other.digest != KEYSPACE.digest
    mine = KEYSPACE.block_keys(tokens, namespace)
    assert not set(mine) & set(other.block_keys(tokens, namespace))
    for ns in (None, "a", "b", 1, ("a",)):  # namespaces never share a key either
        if ns != namespace or type(ns) is not type(namespace):
            assert not set(mine) & set(KEYSPACE.block_keys(tokens, ns))


@given(
    tokens=st.lists(st.integers(0, 1000), min_size=48, max_size=48),
    at=st.integers(0, 47),
    delta=st.integers(1, 1000),
)
def test_a_block_key_names_its_whole_prefix(tokens: list[int], at: int, delta: int) -> None:
    """Changing one token changes the key of its block and of every block after it."""
    changed = list(tokens)
    changed[at] += delta
    a, b = KEYSPACE.block_keys(tokens), KEYSPACE.block_keys(changed)
    first = at // KEYSPACE.block_size
    assert a[:first] == b[:first]
    assert all(x != y for x, y in zip(a[first:], b[first:], strict=True))
    chain = KEYSPACE.chain(changed)
    assert KEYSPACE.chain(changed, known=chain[:1]) == chain  # the memo resumes the chain


def test_equal_keyspaces_give_equal_keys() -> None:
    twin = StoreKeyspace("0123456789abcdef" * 4, "float32", 16, 30, 3, 64)
    assert twin == KEYSPACE and twin.digest == KEYSPACE.digest
    assert twin.block_keys([5] * 32, "t") == KEYSPACE.block_keys([5] * 32, "t")


@pytest.mark.parametrize(
    ("change", "match"),
    [
        ({"model_digest": "smollm2-135m"}, "model_digest"),  # a name is not an identity
        ({"model_digest": "ABCDEF" * 8}, "model_digest"),
        ({"model_digest": "ab" * 8}, "model_digest"),
        ({"dtype": ""}, "dtype"),
        ({"layout": 3}, "layout"),
        ({"block_size": 0}, "block_size"),
        ({"num_kv_heads": 2.0}, "num_kv_heads"),
    ],
)
def test_a_bad_keyspace_field_is_named(change: dict, match: str) -> None:
    with pytest.raises(ValueError, match=match):
        replace(KEYSPACE, **change)


# ------------------------------------------------------------ the entry format
@given(payload=st.binary(max_size=200), data=st.data())
def test_any_flipped_byte_or_truncation_is_refused(payload: bytes, data: st.DataObject) -> None:
    key = key_of(7)
    blob = encode(key, payload)
    assert decode(key, blob) == payload
    at = data.draw(st.integers(0, len(blob) - 1))
    bit = data.draw(st.integers(0, 7))
    flipped = bytearray(blob)
    flipped[at] ^= 1 << bit
    assert decode(key, flipped) is None
    assert decode(key, blob[: data.draw(st.integers(0, len(blob) - 1))]) is None
    assert decode(key, blob + b"\0") is None
    assert decode(key_of(8), blob) is None  # another block's entry


@given(garbage=st.binary(max_size=300))
def test_garbage_decodes_to_none_without_raising(garbage: bytes) -> None:
    assert decode(key_of(1), garbage) is None


# ------------------------------------------------------------ the disk store
def test_a_new_store_over_the_folder_finds_the_blocks_in_the_same_order(tmp_path: Path) -> None:
    size = HEADER + 100
    store = LocalDiskStore(tmp_path, 3 * size)
    store.put_many([(key_of(i), value_of(i)) for i in range(3)])
    store.get_many([key_of(0)])  # 1 is now the least recently used
    again = LocalDiskStore(tmp_path, 3 * size)
    assert again.stats.num_entries == 3 and again.stats.used_bytes == 3 * size
    assert again.contains_run([key_of(i) for i in range(3)]) == 3
    again.put_many([(key_of(3), value_of(3))])
    assert disk_files(tmp_path) == {key_of(0), key_of(2), key_of(3)}
    smaller = LocalDiskStore(tmp_path, 2 * size)  # the capacity shrank: the oldest goes
    assert disk_files(tmp_path) == {key_of(0), key_of(3)}
    assert smaller.get_many([key_of(0), key_of(3)]) == [value_of(0), value_of(3)]


def test_a_crashed_writers_temp_file_is_ignored_then_removed_when_stale(tmp_path: Path) -> None:
    store = LocalDiskStore(tmp_path, 1 << 20)
    store.put_many([(key_of(0), value_of(0))])
    folder = next(tmp_path.glob("??"))
    fresh, stale = folder / ".a.1.x.tmp", folder / ".b.1.y.tmp"
    fresh.write_bytes(b"half")
    stale.write_bytes(b"half")
    old = os.stat(stale).st_mtime - 2 * STALE_TMP_SECONDS
    os.utime(stale, (old, old))
    again = LocalDiskStore(tmp_path, 1 << 20)
    assert again.stats.num_entries == 1 and again.stats.used_bytes == HEADER + 100
    assert fresh.exists() and not stale.exists()  # a live writer's temp file is left alone


@pytest.mark.parametrize("how", ["is a file", "under a file"])
def test_an_unwritable_path_is_one_clear_value_error(tmp_path: Path, how: str) -> None:
    (tmp_path / "f").write_text("x")
    path = tmp_path / "f" if how == "is a file" else tmp_path / "f" / "store"
    with pytest.raises(ValueError, match=r"path must be a directory this process can write, got"):
        LocalDiskStore(path, 1 << 20)


def corrupt_flip(path: Path) -> None:
    data = bytearray(path.read_bytes())
    data[HEADER + 3] ^= 0x10
    path.write_bytes(data)


def corrupt_truncate(path: Path) -> None:
    path.write_bytes(path.read_bytes()[:-1])


def corrupt_header(path: Path) -> None:
    data = bytearray(path.read_bytes())
    data[45] ^= 1  # the payload length
    path.write_bytes(data)


@pytest.mark.parametrize("corrupt", [corrupt_flip, corrupt_truncate, corrupt_header])
def test_a_corrupt_entry_is_a_counted_miss_dropped_then_rewritten(
    tmp_path: Path, corrupt: Callable[[Path], None]
) -> None:
    store = LocalDiskStore(tmp_path, 1 << 20)
    store.put_many([(key_of(0), value_of(0)), (key_of(1), value_of(1))])
    path = tmp_path / key_of(0).hex()[:2] / key_of(0).hex()
    corrupt(path)
    assert store.get_many([key_of(0), key_of(1)]) == [None, value_of(1)]
    s = store.stats
    assert (s.corrupt, s.hits, s.misses, s.num_entries) == (1, 1, 0, 1)
    assert not path.exists()
    assert store.put_many([(key_of(0), value_of(0))]) == 1  # recomputed, stored again
    assert store.get_many([key_of(0)]) == [value_of(0)]
    store.check()


def test_a_foreign_entry_under_a_key_is_refused(tmp_path: Path) -> None:
    """Another block's (or another model's) sound entry copied under a key is a miss."""
    store = LocalDiskStore(tmp_path, 1 << 20)
    store.put_many([(key_of(0), value_of(0))])
    target = tmp_path / key_of(1).hex()[:2] / key_of(1).hex()
    target.parent.mkdir(exist_ok=True)
    shutil.copy(tmp_path / key_of(0).hex()[:2] / key_of(0).hex(), target)
    assert store.contains_run([key_of(1)]) == 1  # a file is there ...
    assert store.get_many([key_of(1)]) == [None]  # ... but it is not key 1's
    assert store.stats.corrupt == 1 and not target.exists()


@pytest.mark.timeout(30)  # main's get_many waited forever on a pipe: fail, do not stall
@pytest.mark.parametrize("kind", ["folder", "pipe"])
def test_a_folder_or_pipe_named_like_an_entry_is_a_miss(tmp_path: Path, kind: str) -> None:
    """Only a regular file is an entry: not adopted by contains_run or put_many, a plain
    miss for get_many (not a fault), and nothing is indexed."""
    store = LocalDiskStore(tmp_path, 1 << 20)
    store.put_many([(key_of(0), value_of(0))])
    path = tmp_path / key_of(1).hex()[:2] / key_of(1).hex()
    path.parent.mkdir(exist_ok=True)
    path.mkdir() if kind == "folder" else os.mkfifo(path)
    assert store.contains_run([key_of(0), key_of(1)]) == 1
    assert store.get_many([key_of(1), key_of(0)]) == [None, value_of(0)]
    s = store.stats
    assert (s.misses, s.hits, s.errors, s.num_entries) == (1, 1, 0, 1)
    # a write renames its file over a pipe; a folder stays in its way (a fault, counted)
    written = store.put_many([(key_of(1), value_of(1))])
    assert (written, store.stats.errors) == ((0, 1) if kind == "folder" else (1, 0))
    assert store.get_many([key_of(1)]) == [None if kind == "folder" else value_of(1)]
    store.check()


def test_an_entry_another_process_deleted_is_a_miss_and_is_written_again(tmp_path: Path) -> None:
    store = LocalDiskStore(tmp_path, 1 << 20)
    store.put_many([(key_of(0), value_of(0)), (key_of(1), value_of(1))])
    path = tmp_path / key_of(0).hex()[:2] / key_of(0).hex()
    path.unlink()
    assert store.put_many([(key_of(0), value_of(0))]) == 1
    (tmp_path / key_of(1).hex()[:2] / key_of(1).hex()).unlink()
    assert store.get_many([key_of(0), key_of(1)]) == [value_of(0), None]
    assert store.stats.misses == 1 and store.stats.num_entries == 1
    store.check()


def test_a_block_another_process_wrote_is_adopted_within_the_capacity(tmp_path: Path) -> None:
    small = LocalDiskStore(tmp_path, 2 * (HEADER + 100))
    big = LocalDiskStore(tmp_path, 1 << 20)
    big.put_many([(key_of(i), value_of(i)) for i in range(3)] + [(key_of(3), value_of(3, 500))])
    assert small.contains_run([key_of(0), key_of(1), key_of(2)]) == 3  # adopted, oldest out
    assert small.get_many([key_of(3)]) == [value_of(3, 500)]  # served, but too big to index
    s = small.stats
    assert (s.num_entries, s.used_bytes, s.evicted) == (2, 2 * (HEADER + 100), 1)
    small.check()


def test_a_failing_disk_never_raises_it_counts_and_logs(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    store = LocalDiskStore(tmp_path, 1 << 20)
    store.put_many([(key_of(0), value_of(0))])
    folder = key_of(0).hex()[:2]
    shutil.rmtree(tmp_path / folder)
    (tmp_path / folder).write_bytes(b"not a folder")  # every write and read under it fails
    with caplog.at_level("WARNING", logger="radixkv.cache.store.local"):
        assert store.put_many([(key_of(1), value_of(1))]) == 0  # same folder: "00"
        assert store.get_many([key_of(0)]) == [None]
    assert store.stats.errors == 2 and store.stats.puts == 1
    assert "put failed" in caplog.text and "get failed" in caplog.text
    assert not list(tmp_path.glob("**/*.tmp"))
    store.check()


def test_a_fault_counter_logs_the_first_then_at_every_power_of_two() -> None:
    """One schedule for every fault log (the tier's, each backend's, a corrupt entry's)."""
    assert [n for n in range(1, 1100) if log_due(n)] == [1 << i for i in range(11)]
    # a call that adds several faults at once (Mooncake counts a batch's keys) logs once when
    # the counter passed a power of two on the way, and only then
    count, logged = 0, []
    for added in [1, 1, 1, 1, 3, 1, 5, 0, 9, 2, 1000, 10]:
        count += added
        if log_due(count, added):
            logged.append(count)
    assert logged == [1, 2, 4, 8, 22, 1024]


def _write_same_blocks(path: str, keys: list[bytes], size: int, barrier, errors) -> None:
    store = LocalDiskStore(path, 1 << 30)
    barrier.wait()
    store.put_many([(k, value_of(k[3], size)) for k in keys])
    errors.put(store.stats.errors)


def test_two_processes_writing_the_same_blocks_leave_sound_entries(tmp_path: Path) -> None:
    ctx = multiprocessing.get_context("fork")
    keys = [key_of(i) for i in range(6)]
    size = 2 << 20  # big enough that the two writes of a block overlap
    barrier, errors = ctx.Barrier(2), ctx.Queue()
    procs = [
        ctx.Process(target=_write_same_blocks, args=(str(tmp_path), keys, size, barrier, errors))
        for _ in range(2)
    ]
    for p in procs:
        p.start()
    for p in procs:
        p.join(60)
        assert p.exitcode == 0
    assert [errors.get(timeout=5) for _ in procs] == [0, 0]
    store = LocalDiskStore(tmp_path, 1 << 30)
    assert store.get_many(keys) == [value_of(k[3], size) for k in keys]
    assert store.stats.corrupt == 0 and not list(tmp_path.glob("**/*.tmp"))


# ------------------------------------------------------------ the state machine
NUM_KEYS = 7
SIZES = [HEADER + s for s in (40, 90, 150, 220, 300, 60, 1200)]  # the last never fits
CAPACITY = 700


class DiskStoreMachine(RuleBasedStateMachine):
    """LocalDiskStore against an LRU dict with the same capacity, across restarts and
    corruption: every answer, the files in the folder and the usage agree after each step."""

    @initialize()
    def open(self) -> None:
        self.path = Path(tempfile.mkdtemp(prefix="kvstore-"))
        self.store = LocalDiskStore(self.path, CAPACITY)
        self.oracle: OrderedDict[bytes, bool] = OrderedDict()  # key -> entry is sound

    def teardown(self) -> None:
        shutil.rmtree(self.path, ignore_errors=True)

    def _value(self, i: int) -> bytes:
        return value_of(i, SIZES[i] - HEADER)

    def _size(self, key: bytes) -> int:
        return SIZES[key[3]]

    @rule(ids=st.lists(st.integers(0, NUM_KEYS - 1), max_size=4))
    def put(self, ids: list[int]) -> None:
        written = self.store.put_many([(key_of(i), self._value(i)) for i in ids])
        expect = 0
        for i in ids:
            key = key_of(i)
            if key in self.oracle:
                self.oracle.move_to_end(key)
                continue
            if SIZES[i] > CAPACITY:
                continue
            while sum(map(self._size, self.oracle)) + SIZES[i] > CAPACITY:
                self.oracle.popitem(last=False)
            self.oracle[key] = True
            expect += 1
        assert written == expect

    @rule(ids=st.lists(st.integers(0, NUM_KEYS - 1), max_size=4))
    def get(self, ids: list[int]) -> None:
        before = self.store.stats.corrupt
        got = self.store.get_many([key_of(i) for i in ids])
        corrupt = 0
        for i, value in zip(ids, got, strict=True):
            key = key_of(i)
            if key not in self.oracle:
                assert value is None
            elif self.oracle[key]:
                assert value == self._value(i)
                self.oracle.move_to_end(key)
            else:
                assert value is None
                del self.oracle[key]
                corrupt += 1
        assert self.store.stats.corrupt - before == corrupt

    @rule(ids=st.lists(st.integers(0, NUM_KEYS - 1), max_size=4))
    def contains_run(self, ids: list[int]) -> None:
        n = 0
        for i in ids:
            if key_of(i) not in self.oracle:
                break
            n += 1
        assert self.store.contains_run([key_of(i) for i in ids]) == n

    @rule()
    def restart(self) -> None:
        self.store = LocalDiskStore(self.path, CAPACITY)

    @rule(i=st.integers(0, NUM_KEYS - 1), at=st.integers(0, 10_000))
    def corrupt(self, i: int, at: int) -> None:
        key = key_of(i)
        # Not twice: flipping the same byte again would restore the entry (a sound hit).
        if not self.oracle.get(key, False):
            return
        path = self.path / key.hex()[:2] / key.hex()
        st_ = path.stat()
        data = bytearray(path.read_bytes())
        data[at % len(data)] ^= 0xFF
        path.write_bytes(data)
        os.utime(path, ns=(st_.st_atime_ns, st_.st_mtime_ns))  # its place in the order stays
        self.oracle[key] = False

    @invariant()
    def agrees(self) -> None:
        self.store.check()
        assert disk_files(self.path) == set(self.oracle)
        s = self.store.stats
        assert s.used_bytes == sum(map(self._size, self.oracle)) <= CAPACITY
        assert s.num_entries == len(self.oracle)


DiskStoreMachine.TestCase.settings = settings(
    max_examples=60, stateful_step_count=25, deadline=None
)
TestDiskStore = DiskStoreMachine.TestCase
