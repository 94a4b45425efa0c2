"""The store tier below the host (radixkv.cache.store.tier; docs/store.md): keys, writes,
match, load, faults and stats, over MemoryStore and LocalDiskStore with real per-block bytes.

``BytePools`` holds both pools as numpy byte arrays: it is the host tier's ``BlockCopier``
(device <-> host) and the store tier's ``ByteCopier`` (host <-> bytes), so every test can
check that what a load brings back is byte for byte what was computed.
"""

from __future__ import annotations

import gc
import hashlib
import logging
from collections.abc import Callable, Sequence
from pathlib import Path

import msgspec
import numpy as np
import pytest
from hypothesis import note, settings
from hypothesis import strategies as st
from hypothesis.stateful import initialize, invariant, rule
from test_host_tier_stateful import HostTierMachine, longest, tier_prefixes

from radixkv import BlockAllocator
from radixkv.cache import TieredRadixCache, place_prompt
from radixkv.cache.events import BlockRemoved, BlockStored
from radixkv.cache.hashing import ChainHasher, chain_hashes
from radixkv.cache.host import HostTier
from radixkv.cache.prefix_cache import namespace_key
from radixkv.cache.store import LocalDiskStore, MemoryStore, StoreKeyspace
from radixkv.cache.store.entry import HEADER_BYTES
from radixkv.cache.store.protocol import StoreStats
from radixkv.cache.store.tier import ByteCopier, StoreTier
from radixkv.errors import InvariantError

BS = 2
PAYLOAD = 64
MODEL = "ab" * 16


def keyspace(block_size: int = BS) -> StoreKeyspace:
    return StoreKeyspace(MODEL, "float32", block_size, 2, 1, 4)


def payload(namespace: object, prefix: Sequence[int]) -> bytes:
    """The bytes a block at the end of ``prefix`` holds: a function of what decides them."""
    return hashlib.sha256(repr((namespace, tuple(prefix))).encode()).digest() * (PAYLOAD // 32)


class BytePools:
    """Both pools as real bytes: BlockCopier (device <-> host) and ByteCopier (host <-> bytes)."""

    layout = "kv-v1"

    def __init__(self, num_device: int, num_host: int, bytes_per_block: int = PAYLOAD) -> None:
        self.bytes_per_block = bytes_per_block
        self.device = np.zeros((num_device, bytes_per_block), dtype=np.uint8)
        self.host = np.zeros((num_host, bytes_per_block), dtype=np.uint8)

    def backup(self, device: np.ndarray, host: np.ndarray) -> None:
        self.host[host] = self.device[device]

    def load(self, host: np.ndarray, device: np.ndarray) -> None:
        self.device[device] = self.host[host]

    def discard(self, device: np.ndarray) -> None:
        self.device[device] = 0xEE  # poison: a read of a freed block shows

    def host_blocks_to_bytes(self, host_ids: np.ndarray) -> list[bytes]:
        return [self.host[h].tobytes() for h in host_ids.tolist()]

    def bytes_to_host_blocks(self, values: Sequence[bytes], host_ids: np.ndarray) -> None:
        for h, p in zip(host_ids.tolist(), values, strict=True):
            self.host[h] = np.frombuffer(p, dtype=np.uint8)

    def compute(self, blocks: Sequence[int], tokens: Sequence[int], namespace: object) -> None:
        """What a forward pass does: block ``blocks[i]`` gets its position's bytes."""
        for i, b in enumerate(blocks):
            self.device[b] = np.frombuffer(payload(namespace, tokens[: (i + 1) * BS]), np.uint8)

    def holds(self, blocks: Sequence[int], tokens: Sequence[int], namespace: object) -> bool:
        return all(
            self.device[b].tobytes() == payload(namespace, tokens[: (i + 1) * BS])
            for i, b in enumerate(blocks)
        )


class Setup:
    """A tiered cache over BytePools with a store tier (or none)."""

    def __init__(
        self,
        store: object | None,
        *,
        num_device: int = 16,
        num_host: int = 16,
        policy: str = "write_back",
        host_policy: str = "write_back",
        events: bool = False,
        ks: StoreKeyspace | None = None,
    ) -> None:
        self.alloc = BlockAllocator(num_device, BS)
        self.halloc = BlockAllocator(num_host, BS)
        self.pools = BytePools(num_device, num_host)
        ks = ks or keyspace()
        self.tier = None if store is None else StoreTier(store, ks, self.pools, policy)
        host = HostTier(self.halloc, self.pools, host_policy, 0, store=self.tier)
        hasher = ChainHasher("xxhash") if events else None
        self.cache = TieredRadixCache(self.alloc, "lru", host=host, events=hasher)

    def serve(
        self, tokens: list[int], namespace: object = None, *, load: bool = True, check: bool = True
    ):
        """One request: load (or match), compute the rest, insert, let go; the result."""
        cache, alloc = self.cache, self.alloc
        m = cache.load(tokens, namespace) if load else cache.match(tokens, namespace)
        assert self.pools.holds(m.blocks, tokens, namespace), "a loaded block holds wrong bytes"
        need = len(tokens) // BS - len(m.blocks)
        if need > alloc.num_free:
            alloc.incref(m.blocks)
            cache.evict(need - alloc.num_free)
            alloc.decref(m.blocks)
        new = alloc.alloc(need)
        self.pools.compute(m.blocks + new, tokens, namespace)
        cache.insert(tokens, m.blocks + new, namespace)
        alloc.decref(m.blocks + new)
        if check:
            cache.check()
        return m

    def to_store(self) -> None:
        """Evict everything from the device, then from the host (write_back puts it)."""
        self.cache.evict(10**9)
        self.cache.evict_host(10**9)
        self.cache.check()
        assert self.cache.num_nodes == 0


TOKENS = list(range(100, 112))  # 6 blocks of 2


@pytest.fixture(params=["memory", "disk"])
def make_store(request: pytest.FixtureRequest, tmp_path: Path) -> Callable[..., object]:
    def make(capacity: int = 1 << 20, path: Path = tmp_path / "kv") -> object:
        if request.param == "memory":
            return MemoryStore(capacity)
        return LocalDiskStore(path, capacity)

    return make


# ------------------------------------------------------------------ keys
def test_a_nodes_store_keys_are_its_prefixs_block_keys_hashed_once(make_store) -> None:
    counted: list[int] = []

    class CountingKeyspace(StoreKeyspace):
        def chain_from(self, parent, tokens, namespace=None):  # type: ignore[override]
            counted.append(len(tokens) // self.block_size)
            return super().chain_from(parent, tokens, namespace)

    store = make_store()
    s = Setup(store, ks=CountingKeyspace(MODEL, "float32", BS, 2, 1, 4))
    s.serve(TOKENS[:8], check=False)  # (check() hashes every kept digest again)
    s.serve(TOKENS, check=False)  # a second leaf below the first, then a split by a third
    s.serve(TOKENS[:4] + [7, 7], check=False)
    s.cache.evict(10**9)
    s.cache.evict_host(10**9)
    keys = keyspace().block_keys(TOKENS)
    assert store.contains_run(keys) == 6
    assert store.contains_run(keyspace().block_keys(TOKENS[:4] + [7, 7])) == 3
    # each of the 7 cached blocks once (splits included), and each query's blocks past the
    # tree's match once per lookup (4 + 2 + 1)
    assert sum(counted) == 7 + 7
    s.serve(TOKENS, load=False, check=False)  # an empty tree: the lookup hashes the query
    assert sum(counted) == 14 + 6
    s.cache.check()


def test_a_namespace_is_part_of_the_key(make_store) -> None:
    s = Setup(make_store())
    s.serve(TOKENS, "tenant-a")
    s.to_store()
    assert s.cache.match(TOKENS, "tenant-b").store_num_tokens == 0
    assert s.cache.match(TOKENS, "tenant-a").store_num_tokens == len(TOKENS)


# ------------------------------------------------------------------ writes
def test_write_back_puts_a_host_only_leaf_when_host_eviction_deletes_it(make_store) -> None:
    store = make_store()
    s = Setup(store)
    s.serve(TOKENS)
    s.cache.evict(10**9)  # to the host: nothing in the store yet
    assert store.contains_run(keyspace().block_keys(TOKENS)) == 0
    assert s.tier.stats.put_blocks == 0
    s.cache.evict_host(10**9)
    assert store.contains_run(keyspace().block_keys(TOKENS)) == 6
    stats = s.tier.stats
    assert (stats.put_blocks, stats.stored_blocks, stats.stored_bytes) == (6, 6, 6 * PAYLOAD)
    assert stats.errors == 0


def test_write_back_does_not_put_a_host_mirror_of_a_device_node(make_store) -> None:
    s = Setup(make_store(), host_policy="write_through")  # host copies at insert: mirrors
    s.serve(TOKENS)
    assert s.cache.host_cached_blocks == 6
    s.cache.evict_host(10**9)  # the mirrors go, the nodes stay on the device
    assert s.tier.stats.put_blocks == 0 and s.cache.cached_blocks == 6


def test_write_through_puts_every_backup_to_the_host(make_store) -> None:
    store = make_store()
    s = Setup(store, policy="write_through")
    s.serve(TOKENS)
    s.cache.evict(10**9)  # the host's write_back backs up: the store gets it at once
    assert store.contains_run(keyspace().block_keys(TOKENS)) == 6
    s.cache.evict_host(10**9)  # and host eviction drops freely
    assert s.tier.stats.put_blocks == 6


# ------------------------------------------------------------------ match and load
def test_match_reports_the_stored_run_past_the_host_prefix(make_store) -> None:
    s = Setup(make_store())
    s.serve(TOKENS)
    s.to_store()
    s.serve(TOKENS[:2], load=False)  # computed again, though the store had them
    s.serve(TOKENS[:4], load=False)
    s.cache.evict(1)  # the second node to the host
    m = s.cache.match(TOKENS + [1])
    s.alloc.decref(m.blocks)
    assert (m.num_tokens, m.host_num_tokens, m.store_num_tokens) == (2, 2, 8)
    assert "store_num_tokens=8" in repr(m)
    assert s.tier.stats.found_blocks == 1 + 1 + 4


def test_a_match_ending_inside_a_node_continues_the_chain_from_there(make_store) -> None:
    s = Setup(make_store())
    s.serve(TOKENS[:6])
    s.to_store()
    other = TOKENS[:4] + [7, 7]
    s.serve(other, load=False)  # one node of 3 blocks, past which TOKENS[:6] diverges
    m = s.cache.match(TOKENS[:6])
    s.alloc.decref(m.blocks)
    assert (m.num_tokens, m.store_num_tokens) == (4, 2)
    m = s.serve(TOKENS[:6])
    assert (m.num_tokens, m.loaded_num_tokens) == (6, 2)


def test_load_brings_the_stored_run_back_byte_for_byte(make_store) -> None:
    s = Setup(make_store())
    s.serve(TOKENS)
    s.to_store()
    m = s.serve(TOKENS + [1])  # Setup.serve checks the bytes of every block it gets
    assert (m.num_tokens, m.loaded_num_tokens, m.host_num_tokens, m.store_num_tokens) == (
        12, 12, 0, 0
    )
    assert m.store_loaded_num_tokens == 12 and "store_loaded_num_tokens=12" in repr(m)
    stats = s.tier.stats
    assert (stats.loaded_blocks, stats.loaded_bytes) == (6, 6 * PAYLOAD)
    assert stats.load_seconds > 0 and stats.load_misses == stats.corrupt_blocks == 0
    assert s.cache.host_cached_blocks == 6  # it came through the host and keeps its copy


def test_load_below_a_split_host_node_and_a_device_prefix(make_store) -> None:
    s = Setup(make_store())
    s.serve(TOKENS)
    s.to_store()
    s.serve(TOKENS[:6])  # blocks 0-2 loaded from the store; 3-5 still only there
    s.cache.evict(1)  # block 2 to the host
    m = s.serve(TOKENS[:4] + [9, 9])  # ends inside nothing stored: no store run
    assert m.store_num_tokens == 0
    m = s.serve(TOKENS)
    assert (m.num_tokens, m.loaded_num_tokens, m.store_loaded_num_tokens) == (12, 8, 6)
    s.serve(TOKENS[:2] + [5] * 6)
    s.to_store()
    m = s.serve(TOKENS[:2] + [5] * 6)
    assert m.num_tokens == 8


def test_a_placement_splits_its_load_between_the_host_and_the_store(make_store) -> None:
    """place_prompt's num_store_blocks: the last of the loaded blocks, read from the store."""
    s = Setup(make_store())
    s.serve(TOKENS)
    s.to_store()
    s.serve(TOKENS[:6])  # blocks 0-2 loaded from the store; 3-5 still only there
    s.cache.evict(1)  # that node (blocks 0-2) to the host
    got = place_prompt(s.cache, TOKENS + [1])
    assert (got.num_hit_blocks, got.num_loaded_blocks, got.num_store_blocks) == (0, 6, 3)
    assert s.pools.holds(got.blocks, TOKENS, None)
    s.alloc.decref_distinct(got.blocks)
    got = place_prompt(s.cache, TOKENS)  # all on the device now: nothing loaded
    assert (got.num_hit_blocks, got.num_loaded_blocks, got.num_store_blocks) == (6, 0, 0)
    s.alloc.decref_distinct(got.blocks)
    s.cache.check()


def test_load_takes_what_host_room_there_is_and_the_rest_stays_in_the_store(make_store) -> None:
    store = make_store()
    s = Setup(store, num_host=2)
    s.serve(TOKENS[:4])
    s.to_store()
    s.serve(TOKENS[:6])
    s.to_store()
    assert store.contains_run(keyspace().block_keys(TOKENS[:6])) == 3
    m = s.cache.load(TOKENS[:6])
    assert (m.num_tokens, m.host_num_tokens, m.store_num_tokens) == (4, 0, 2)
    assert m.store_loaded_num_tokens == 4
    assert s.pools.holds(m.blocks, TOKENS, None)
    s.alloc.decref(m.blocks)
    s.cache.check()


def test_a_full_stores_run_is_loaded_whole_though_the_loads_host_eviction_writes_back(
    make_store,
) -> None:
    """The run is read before the host makes room for it: the write-back of that host
    eviction evicts the run from the full store, but its bytes are already in hand."""
    store = make_store(2 * (HEADER_BYTES + PAYLOAD))  # room for two blocks
    s = Setup(store, num_host=2)
    a, b = TOKENS[:4], [7, 7, 7, 7]
    s.serve(a)
    s.to_store()  # the store: a's two blocks (full)
    s.serve(b)
    s.cache.evict(10**9)  # the host: b's two blocks (full)
    m = s.serve(a)  # reading a into the host evicts b from it: b is put, a evicted
    assert (m.num_tokens, m.store_loaded_num_tokens) == (4, 4)
    stats = s.tier.stats
    assert (stats.found_blocks, stats.loaded_blocks, stats.load_misses) == (2, 2, 0)
    assert stats.unfilled_blocks == 0
    assert store.contains_run(keyspace().block_keys(b)) == 2
    assert store.contains_run(keyspace().block_keys(a)) == 0


def test_a_short_device_leaves_the_fetched_run_on_the_host(make_store) -> None:
    s = Setup(make_store(), num_device=4)
    s.serve(TOKENS[:8])
    s.to_store()
    held = s.alloc.alloc(2)  # a running request keeps half the pool
    m = s.cache.load(TOKENS[:8])
    assert (m.num_tokens, m.host_num_tokens, m.store_num_tokens) == (0, 8, 0)  # whole nodes
    assert m.store_loaded_num_tokens == 0  # fetched to the host, but nothing loaded
    s.alloc.decref(m.blocks)
    s.alloc.decref(held)
    s.cache.check()
    m = s.serve(TOKENS[:8])  # now the host has the rest
    assert m.num_tokens == 8 and s.tier.stats.loaded_blocks == 4


def test_a_corrupt_entry_stops_the_load_there_and_the_rest_is_recomputed(tmp_path: Path) -> None:
    store = LocalDiskStore(tmp_path, 1 << 20)
    s = Setup(store)
    s.serve(TOKENS)
    s.to_store()
    key = keyspace().block_keys(TOKENS)[3]
    path = tmp_path / key.hex()[:2] / key.hex()
    data = bytearray(path.read_bytes())
    data[-1] ^= 1
    path.write_bytes(bytes(data))
    m = s.serve(TOKENS)
    assert (m.num_tokens, m.store_num_tokens) == (6, 6)  # 3 blocks read; the rest recomputed
    assert store.stats.corrupt == 1 and s.tier.stats.load_misses == 1
    s.to_store()
    assert store.contains_run(keyspace().block_keys(TOKENS)) == 6  # written again


def test_events_record_a_fetched_run_as_stored_on_the_host_then_the_device() -> None:
    s = Setup(MemoryStore(1 << 20), events=True)
    s.serve(TOKENS[:4])
    s.to_store()
    s.cache.take_events()
    s.serve(TOKENS[:4])
    stored = [e for e in s.cache.take_events() if isinstance(e, BlockStored)]
    assert [e.medium for e in stored][:2] == ["CPU", "GPU"]
    assert sorted(s.cache.block_hashes("CPU")) == sorted(s.cache.block_hashes("GPU"))


def test_a_new_cache_over_the_same_folder_finds_and_reloads_identical_bytes(
    tmp_path: Path,
) -> None:
    first = Setup(LocalDiskStore(tmp_path, 1 << 20))
    first.serve(TOKENS, "t")
    first.to_store()
    before = first.tier.stats
    assert before.stored_blocks == 6
    del first  # a restart: a new process's cache, pools and store over the folder
    second = Setup(LocalDiskStore(tmp_path, 1 << 20))
    assert second.pools.device.sum() == second.pools.host.sum() == 0
    m = second.cache.match(TOKENS, "t")
    assert (m.num_tokens, m.store_num_tokens) == (0, 12)
    m = second.serve(TOKENS, "t")  # checks every byte
    assert m.num_tokens == 12 and second.tier.stats.loaded_blocks == 6


# ------------------------------------------------------------------ off
def test_off_a_match_reports_no_store_and_nodes_keep_no_digests() -> None:
    s = Setup(None)
    s.serve(TOKENS)
    s.cache.evict(10**9)
    m = s.cache.load(TOKENS)
    assert m.store_num_tokens == 0 and s.cache.store is None
    assert all(n.store_digests is None for n in s.cache._iter_nodes())
    s.alloc.decref(m.blocks)


# ------------------------------------------------------------------ faults
class FaultyStore:
    """A MemoryStore that misbehaves as told: ``mode`` in raise, garbage."""

    def __init__(self, mode: str, capacity: int = 1 << 20) -> None:
        self.inner = MemoryStore(capacity)
        self.mode = mode
        self.garbage: object = None

    @property
    def capacity_bytes(self) -> int:
        return self.inner.capacity_bytes

    @property
    def stats(self) -> StoreStats:
        return self.inner.stats

    def _answer(self, name: str, honest: Callable[[], object]) -> object:
        if self.mode == "raise":
            raise OSError(f"{name}: the store is down")
        if self.mode == "garbage":
            return self.garbage
        return honest()

    def contains_run(self, keys):
        return self._answer("contains_run", lambda: self.inner.contains_run(keys))

    def put_many(self, items):
        return self._answer("put_many", lambda: self.inner.put_many(items))

    def get_many(self, keys):
        return self._answer("get_many", lambda: self.inner.get_many(keys))

    def check(self) -> None:
        self.inner.check()


def test_a_store_that_raises_never_fails_a_cache_call_and_logs(caplog) -> None:
    store = FaultyStore("raise")
    s = Setup(store)
    with caplog.at_level(logging.WARNING, logger="radixkv.cache.store.tier"):
        s.serve(TOKENS)
        s.to_store()  # the put raises: skipped, the host blocks freed all the same
        m = s.serve(TOKENS)  # the lookup raises: a miss, recomputed
    assert m.num_tokens == 0 and m.store_num_tokens == 0
    assert s.tier.stats.errors == 3 and s.halloc.num_free == 16
    assert "the cache is whole" in caplog.text


@pytest.mark.parametrize(
    "answers",
    [
        {"contains_run": -1},
        {"contains_run": 10**9},
        {"contains_run": "6"},
        {"get_many": [b"x" * PAYLOAD]},  # one value for six keys
        {"get_many": None},
        {"get_many": "garbage"},
        {"put_many": "six"},
    ],
)
def test_a_store_answering_out_of_contract_is_a_counted_miss(answers: dict) -> None:
    store = FaultyStore("honest")
    s = Setup(store)
    s.serve(TOKENS)
    (op, answer), = answers.items()
    if op != "put_many":
        s.to_store()
    store.mode, store.garbage = "garbage", answer
    if op == "put_many":
        s.to_store()
        assert s.tier.stats.errors == 1
        return
    if op == "get_many":  # the lookup must find the run first
        store.contains_run = lambda keys: len(keys)  # type: ignore[method-assign]
    m = s.serve(TOKENS)
    assert m.num_tokens == 0  # nothing served: recomputed
    assert s.tier.stats.errors == 1 and s.tier.stats.loaded_blocks == 0
    assert s.halloc.num_free == 16 - s.cache.host_cached_blocks


@pytest.mark.parametrize("bad", [None, b"short", bytearray(PAYLOAD), "x" * PAYLOAD])
def test_a_value_that_is_no_payload_stops_the_load_there(bad: object) -> None:
    store = FaultyStore("honest")
    s = Setup(store)
    s.serve(TOKENS)
    s.to_store()
    honest = store.inner.get_many
    store.get_many = lambda keys: [*honest(keys)[:2], bad, *honest(keys)[3:]]  # type: ignore
    m = s.serve(TOKENS)
    assert m.num_tokens == 4  # two blocks came; from the third on, recomputed
    stats = s.tier.stats
    assert (stats.load_misses, stats.corrupt_blocks) == ((1, 0) if bad is None else (0, 1))
    assert stats.loaded_blocks == 2


def test_a_full_store_refuses_and_the_cache_goes_on() -> None:
    store = MemoryStore(PAYLOAD)  # smaller than one entry with its header
    s = Setup(store)
    s.serve(TOKENS)
    s.to_store()
    stats = s.tier.stats
    assert (stats.put_blocks, stats.stored_blocks, stats.errors) == (6, 0, 0)
    assert store.stats.rejected == 6
    assert s.serve(TOKENS).num_tokens == 0


def test_a_copier_that_raises_on_read_skips_the_write_and_evicts_all_the_same() -> None:
    s = Setup(MemoryStore(1 << 20))
    s.serve(TOKENS)

    def broken(host: np.ndarray) -> list[bytes]:
        raise RuntimeError("host pool unmapped")

    s.pools.host_blocks_to_bytes = broken  # type: ignore[method-assign]
    s.to_store()
    assert s.tier.stats.errors == 1 and s.halloc.num_free == 16


def test_a_copier_that_raises_on_write_frees_the_host_blocks_it_took() -> None:
    s = Setup(MemoryStore(1 << 20))
    s.serve(TOKENS)
    s.to_store()

    def broken(values: Sequence[bytes], host_ids: np.ndarray) -> None:
        raise RuntimeError("host pool unmapped")

    s.pools.bytes_to_host_blocks = broken  # type: ignore[method-assign]
    assert s.serve(TOKENS).num_tokens == 0
    stats = s.tier.stats
    assert (stats.errors, stats.loaded_blocks, stats.unfilled_blocks) == (1, 0, 6)
    s.cache.reset()
    assert s.halloc.num_free == 16


# ------------------------------------------------------------------ KV events on "STORAGE"
SEQUENCES = [  # what event_workload serves: (tokens, namespace)
    (TOKENS, None),
    ([*TOKENS[:6], 7, 8, 9, 10], None),
    (TOKENS, "t"),
    ([5] * 9, None),
    (list(range(200, 220)), None),
]


def event_workload(s: Setup) -> list:
    """A fixed workload over every tier: inserts sharing prefixes, a namespace, eviction to
    the host, loads back, host eviction (write_back puts there), loads from the store, a
    reset. Returns every event, oldest first."""
    events = []
    for tokens, ns in SEQUENCES[:4]:
        s.serve(tokens, ns)
    events += s.cache.take_events()
    s.cache.evict(10**9)
    s.serve(TOKENS)
    s.serve(SEQUENCES[4][0])
    events += s.cache.take_events()
    s.cache.evict_host(10**9)
    s.serve(TOKENS, "t")
    s.serve(SEQUENCES[1][0])
    s.cache.reset()
    s.serve(TOKENS)
    return events + s.cache.take_events()


@pytest.mark.parametrize(
    ("host_policy", "digest"),
    [
        ("write_back", "8db9d928c36780b9fe561c9d653c2d5d618010ef2e164b288d6b5d105642f2ad"),
        ("write_through", "16d2eba7748a5778402d9d1baf6e9a3032d15c81495d1b6e262f12eb27da5743"),
    ],
)
def test_without_a_store_the_event_stream_is_byte_for_byte_what_it_was(
    host_policy: str, digest: str
) -> None:
    """The msgpack bytes of event_workload's events with no store, pinned as they were before
    the store tier's puts became events (commit 340f329)."""
    events = event_workload(Setup(None, events=True, host_policy=host_policy))
    assert {e.medium for e in events if isinstance(e, BlockStored)} == {"GPU", "CPU"}
    assert hashlib.sha256(msgspec.msgpack.encode(events)).hexdigest() == digest


class RecordingStore(MemoryStore):
    """A MemoryStore that records, for each ``put_many``, the keys offered, how many it
    wrote and the run of them it holds right after."""

    def __init__(self, capacity: int) -> None:
        super().__init__(capacity)
        self.puts: list[tuple[list[bytes], int, int]] = []

    def put_many(self, items):
        keys = [k for k, _ in items]
        written = super().put_many(items)
        self.puts.append((keys, written, super().contains_run(keys)))
        return written


def chain_index(hasher: ChainHasher) -> tuple[dict[bytes, int], dict[int, tuple]]:
    """For every block of SEQUENCES: store key -> wire hash, and wire hash -> (parent wire
    hash or None, the block's tokens), computed from scratch."""
    by_key: dict[bytes, int] = {}
    block: dict[int, tuple] = {}
    for tokens, ns in SEQUENCES:
        wire = chain_hashes(hasher, tokens, BS, ns)
        by_key.update(zip(keyspace().block_keys(tokens, ns), wire, strict=True))
        for i, h in enumerate(wire):
            block[h] = (wire[i - 1] if i else None, tokens[i * BS : (i + 1) * BS])
    return by_key, block


@pytest.mark.parametrize("host_policy", ["write_back", "write_through"])
@pytest.mark.parametrize("policy", ["write_back", "write_through"])
def test_each_put_the_store_took_is_a_block_stored_on_storage(
    policy: str, host_policy: str
) -> None:
    """One BlockStored on "STORAGE" per put, in order, naming the event hashes (not the store
    keys) of the run the store holds after it, with their parent hash and tokens; a put of
    blocks stored already (a run fetched or computed again) is announced too."""
    store = RecordingStore(1 << 20)
    s = Setup(store, events=True, policy=policy, host_policy=host_policy)
    events = event_workload(s)
    for again in (True, False):
        s.cache.evict(10**9)
        s.cache.evict_host(10**9)
        if again:
            s.serve(TOKENS, load=False)  # computed again, not loaded: its put finds it stored
    events += s.cache.take_events()
    by_key, block = chain_index(s.cache.events_hasher)
    storage = [e for e in events if getattr(e, "medium", None) == "STORAGE"]
    assert all(isinstance(e, BlockStored) for e in storage)  # announced, never removed
    assert [e.block_hashes for e in storage] == [
        [by_key[k] for k in keys[:held]] for keys, _, held in store.puts if held
    ]
    assert any(written < len(keys) == held for keys, written, held in store.puts)
    for e in storage:
        first = e.block_hashes[0]
        assert e.parent_block_hash == block[first][0]
        assert e.token_ids == [t for h in e.block_hashes for t in block[h][1]]
        assert (e.block_size, e.group_idx, e.lora_id) == (BS, 0, None)


def test_a_put_the_store_took_in_part_announces_the_run_it_holds() -> None:
    """A store that keeps only the first blocks of a put: the event names those, below the
    node's parent."""
    store = RecordingStore(1 << 20)
    s = Setup(store, events=True)
    s.serve(TOKENS[:4])
    s.serve(TOKENS)  # a second node: blocks 2..5 below block 1
    honest = MemoryStore.put_many
    store.put_many = lambda items: honest(store, items[:2])  # type: ignore[method-assign]
    s.cache.evict(10**9)
    s.cache.take_events()
    s.cache.evict_host(1)  # the leaf (blocks 2..5) goes first
    hasher = s.cache.events_hasher
    wire = chain_hashes(hasher, TOKENS, BS, None)
    (event,) = [e for e in s.cache.take_events() if getattr(e, "medium", None) == "STORAGE"]
    assert (event.block_hashes, event.parent_block_hash) == (wire[2:4], wire[1])
    assert event.token_ids == TOKENS[4:8]


@pytest.mark.parametrize("policy", ["write_back", "write_through"])
@pytest.mark.parametrize("fault", ["raise", "garbage", "full", "confirm raises"])
def test_no_storage_event_when_the_store_refuses_or_fails(policy: str, fault: str) -> None:
    """No BlockStored on "STORAGE" for a put the store raised on, answered out of contract or
    refused; once it is honest again, the next put is announced."""
    store = FaultyStore("honest", PAYLOAD if fault == "full" else 1 << 20)  # full: refuses all
    if fault == "confirm raises":  # it wrote nothing, and asking what it holds raises
        store.put_many = lambda items: 0  # type: ignore[method-assign]
        store.mode = "raise"
    elif fault != "full":
        store.mode, store.garbage = fault, "six"
    s = Setup(store, events=True, policy=policy)
    s.serve(TOKENS)
    s.to_store()
    media = {e.medium for e in s.cache.take_events() if isinstance(e, BlockStored)}
    assert media == {"GPU", "CPU"} and s.tier.stats.put_blocks == 6
    store.inner, store.mode = MemoryStore(1 << 20), "honest"
    vars(store).pop("put_many", None)
    s.serve(TOKENS)
    s.to_store()
    storage = [e for e in s.cache.take_events() if getattr(e, "medium", None) == "STORAGE"]
    want = chain_hashes(s.cache.events_hasher, TOKENS, BS, None)
    assert [e.block_hashes for e in storage] == [want]


@pytest.mark.parametrize("events", [False, True])
def test_a_put_that_wrote_fewer_asks_the_store_again_only_with_events_on(events: bool) -> None:
    """The confirming ``contains_run`` after a put of blocks stored already is paid only by a
    cache whose events announce it."""
    store = FaultyStore("honest")
    s = Setup(store, events=events)
    s.serve(TOKENS)
    s.to_store()
    s.serve(TOKENS, load=False)  # computed again: its put finds every block stored
    asked = []
    honest = store.contains_run
    store.contains_run = lambda keys: asked.append(len(keys)) or honest(keys)  # type: ignore
    s.to_store()
    assert s.tier.stats.stored_blocks == 6 and asked == ([6] if events else [])


def test_block_hashes_nets_the_device_and_host_events_and_refuses_storage() -> None:
    s = Setup(MemoryStore(1 << 20), events=True, policy="write_through")
    net: dict[str, set[int]] = {"GPU": set(), "CPU": set(), "STORAGE": set()}
    announced = 0
    for e in event_workload(s):
        if isinstance(e, BlockStored):
            net[e.medium].update(e.block_hashes)
            announced += e.medium == "STORAGE"
        elif isinstance(e, BlockRemoved):
            net[e.medium].difference_update(e.block_hashes)
        else:
            net = {m: set() for m in net}
    for medium in ("GPU", "CPU"):
        assert sorted(s.cache.block_hashes(medium)) == sorted(net[medium]), medium
    assert announced
    with pytest.raises(ValueError, match="medium must be one of .* got 'STORAGE': a store"):
        s.cache.block_hashes("STORAGE")


# ------------------------------------------------------------------ arguments and checks
def test_bad_arguments_are_named() -> None:
    pools = BytePools(2, 2)
    with pytest.raises(TypeError, match="store must be a KVStore"):
        StoreTier(object(), keyspace(), pools)  # type: ignore[arg-type]
    with pytest.raises(TypeError, match="keyspace must be a StoreKeyspace"):
        StoreTier(MemoryStore(10), "ks", pools)  # type: ignore[arg-type]
    with pytest.raises(TypeError, match="copier must have layout, bytes_per_block"):
        StoreTier(MemoryStore(10), keyspace(), object())  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="copier.bytes_per_block"):
        StoreTier(MemoryStore(10), keyspace(), BytePools(2, 2, bytes_per_block=0))
    with pytest.raises(ValueError, match="copier.layout must be the keyspace's 'kv-v2'"):
        StoreTier(MemoryStore(10), StoreKeyspace(MODEL, "float32", BS, 2, 1, 4, "kv-v2"), pools)
    with pytest.raises(ValueError, match="write_policy must be one of"):
        StoreTier(MemoryStore(10), keyspace(), pools, "write_around")
    with pytest.raises(TypeError, match="store must be a StoreTier or None"):
        HostTier(BlockAllocator(2, BS), pools, store=MemoryStore(10))  # type: ignore[arg-type]
    tier = StoreTier(MemoryStore(10), keyspace(block_size=4), pools)
    with pytest.raises(ValueError, match="store.keyspace.block_size must equal"):
        HostTier(BlockAllocator(2, BS), pools, store=tier)
    assert isinstance(pools, ByteCopier)


def test_one_store_tier_serves_one_live_cache() -> None:
    s = Setup(MemoryStore(1 << 20))
    host = HostTier(BlockAllocator(4, BS), s.pools, store=s.tier)
    with pytest.raises(ValueError, match="store tier already serves"):
        TieredRadixCache(BlockAllocator(4, BS), host=host)
    del s
    gc.collect()
    TieredRadixCache(BlockAllocator(4, BS), host=host)  # the first cache is gone: free again


def test_check_finds_digests_that_are_not_the_chains() -> None:
    s = Setup(MemoryStore(1 << 20))
    s.serve(TOKENS)
    s.cache.evict(10**9)
    s.serve(TOKENS[:4] + [1, 1], load=False)  # a lookup hashes the matched path
    node = next(n for n in s.cache._iter_nodes() if n.store_digests)
    node.store_digests = bytes(len(node.store_digests))
    with pytest.raises(InvariantError, match="store digests are not its chain"):
        s.cache.check()


# ------------------------------------------------------------------ the state machine
class SpoilingStore(MemoryStore):
    """A MemoryStore whose next get_many answers one value badly, as a rule says."""

    spoil: tuple[int, str] | None = None

    def get_many(self, keys):
        values = super().get_many(keys)
        if self.spoil is not None:
            at, how = self.spoil
            self.spoil = None
            if at < len(values):
                values[at] = None if how == "miss" else b"short"
        return values


class StoreTierMachine(HostTierMachine):
    """HostTierMachine's rules and oracle, with a store tier below the host: every block a
    match or load hands out holds its position's bytes (what was stored is what comes back),
    ``store_num_tokens`` is the stored run past the tree (keys computed from scratch), a load
    conserves match's total and brings as much of that run to the host as the host pool can
    hold (its blocks but the ones the load holds) even when the store is small and the
    load's own host eviction writes back into it, and, with a store that holds everything,
    what the policy writes is in the store."""

    @initialize(
        num_device=st.integers(4, 24),
        num_host=st.integers(1, 12),
        policy=st.sampled_from(["write_back", "write_through"]),
        host_policy=st.sampled_from(["write_back", "write_through"]),
        hits=st.integers(0, 2),
        eviction=st.sampled_from(["lru", "level"]),
        store_blocks=st.one_of(st.none(), st.integers(1, 8)),  # None: room for everything
    )
    def setup(self, num_device, num_host, policy, host_policy, hits, eviction, store_blocks):  # type: ignore[override]
        self.bs = BS
        self.alloc = BlockAllocator(num_device, BS)
        self.host = BlockAllocator(num_host, BS)
        self.pools = BytePools(num_device, num_host)
        entry = HEADER_BYTES + PAYLOAD
        self.store = SpoilingStore(1 << 30 if store_blocks is None else store_blocks * entry)
        self.store_holds_all = store_blocks is None
        self.ks = keyspace()
        self.tier = StoreTier(self.store, self.ks, self.pools, policy)
        host = HostTier(self.host, self.pools, host_policy, hits, "lru", store=self.tier)
        self.cache = TieredRadixCache(self.alloc, eviction, host=host)
        self.policy = policy
        from collections import Counter

        self.refs: Counter[int] = Counter()
        self.host_policy = host_policy
        note(
            f"device={num_device} host={num_host} store {policy} host {host_policy}/{hits} "
            f"store blocks {store_blocks}"
        )

    def stored_run(self, tokens: list[int], namespace: object, start: int) -> int:
        keys = self.ks.block_keys(tokens, namespace)[start // BS :]
        return self.store.contains_run(keys) * BS

    @rule(
        target=HostTierMachine.requests,
        tokens=st.lists(st.integers(0, 1), min_size=0, max_size=12),  # prefixes meet often
        namespace=st.sampled_from([None, "lora-a"]),
        load=st.booleans(),
        keep=st.booleans(),
    )
    def serve(self, tokens, namespace, load, keep):  # type: ignore[override]
        cache = self.cache
        device, anywhere = tier_prefixes(cache)
        key = namespace_key(namespace)
        on_device = longest(device, key, tokens, BS)
        in_tree = longest(anywhere, key, tokens, BS)
        in_store = self.stored_run(tokens, namespace, in_tree)
        host_before, fetched_before = cache.stats.host_hit_tokens, self.tier.stats.loaded_blocks
        backed_up_before = cache.stats.backed_up_blocks
        spoiled = self.store.spoil is not None
        m = cache.load(tokens, namespace) if load else cache.match(tokens, namespace)
        total = m.num_tokens + m.host_num_tokens + m.store_num_tokens
        if load:
            assert on_device <= m.num_tokens and total <= in_tree + in_store
            # Nothing between the lookup and the read can drop the run but a write_through
            # host backup in match itself (it may evict the host under a store write_back):
            # otherwise the whole run comes to the host, or all of the host pool but the
            # host-only prefix the load holds.
            if not spoiled and (
                self.host_policy == "write_back" or cache.stats.backed_up_blocks == backed_up_before
            ):
                room = self.host.num_blocks - (in_tree - on_device) // BS
                got = self.tier.stats.loaded_blocks - fetched_before
                assert got == min(in_store // BS, room), "a load missed part of the found run"
                assert self.tier.stats.unfilled_blocks == 0
            # the store's part of the load: the whole fetched run or nothing, past the host's
            fetched = (self.tier.stats.loaded_blocks - fetched_before) * BS
            host_run = cache.stats.host_hit_tokens - host_before
            assert m.store_loaded_num_tokens in (0, fetched)
            assert m.store_loaded_num_tokens == max(0, m.loaded_num_tokens - host_run)
        else:
            assert (m.num_tokens, total) == (on_device, in_tree + in_store)
            assert m.store_loaded_num_tokens == 0
        assert self.pools.holds(m.blocks, tokens, namespace), "a block holds the wrong bytes"
        return self.place(list(m.blocks), tokens, namespace, keep)

    def compute(self, blocks: list, start: int, tokens: list, namespace: object) -> None:
        self.pools.compute(blocks, tokens, namespace)  # the matched ones are unchanged

    @rule(
        tokens=st.lists(st.integers(0, 1), min_size=2, max_size=12),
        namespace=st.sampled_from([None, "lora-a"]),
    )
    def round_trip(self, tokens, namespace):
        """A request, everything no request holds flushed through the host, the request again:
        what comes back (from the store, mostly) is checked as any load is."""
        self.serve(tokens, namespace, load=True, keep=False)
        self.evict_host_to_the_store(0, flush=True)
        self.serve(tokens, namespace, load=True, keep=False)

    @rule(
        run=st.lists(st.integers(0, 1), min_size=2, max_size=12),
        other=st.lists(st.integers(2, 3), min_size=2, max_size=12),
        namespace=st.sampled_from([None, "lora-a"]),
    )
    def load_past_the_hosts_write_backs(self, run, other, namespace):
        """``run`` flushed to the store, then ``other`` (no prefix in common) left on the
        host alone, then ``run`` again: making host room for its run writes ``other`` back,
        which a small store makes room for by evicting the run (checked as any load is)."""
        self.serve(run, namespace, load=True, keep=False)
        self.evict_host_to_the_store(0, flush=True)
        self.serve(other, namespace, load=True, keep=False)
        self.cache.evict(10**9)
        self.serve(run, namespace, load=True, keep=False)

    @rule(at=st.integers(0, 6), how=st.sampled_from(["miss", "short"]))
    def spoil_next_read(self, at, how):
        self.store.spoil = (at, how)

    @rule(n=st.integers(0, 30), flush=st.booleans())
    def evict_host_to_the_store(self, n, flush):
        if flush:  # everything no request holds to the host first (or gone, if it cannot go)
            self.cache.evict(10**9)
            n = 10**9
        _, before = tier_prefixes(self.cache)
        host_only = host_only_prefixes(self.cache)
        self.cache.evict_host(n)
        _, after = tier_prefixes(self.cache)
        if self.policy != "write_back" or not self.store_holds_all:
            return  # write_through: the invariant checks every host copy is written
        for ns_key, prefix in host_only & (before - after):
            ns = None if ns_key == namespace_key(None) else "lora-a"
            keys = self.ks.block_keys(list(prefix), ns)
            assert self.store.contains_run(keys[-1:]) == 1, f"{prefix} left the host unwritten"

    @invariant()
    def host_bytes_and_writes(self):
        if not hasattr(self, "cache"):
            return
        for ns_key, root in self.cache._roots.items():
            ns = None if ns_key == namespace_key(None) else "lora-a"
            stack = [(c, ()) for c in root.children.values()]
            while stack:
                node, before = stack.pop()
                toks = before + tuple(node.tokens().tolist())
                for i, h in enumerate(node.host_ids().tolist()):
                    prefix = toks[: len(before) + (i + 1) * BS]
                    assert self.pools.host[h].tobytes() == payload(ns, prefix), "host bytes"
                    if self.policy == "write_through" and self.store_holds_all:
                        keys = self.ks.block_keys(list(prefix), ns)
                        assert self.store.contains_run(keys[-1:]) == 1, "a backup not written"
                stack.extend((c, toks) for c in node.children.values())
        self.store.check()


def host_only_prefixes(cache: TieredRadixCache) -> set:
    out: set = set()
    for ns_key, root in cache._roots.items():
        stack = [(c, ()) for c in root.children.values()]
        while stack:
            node, before = stack.pop()
            toks = before + tuple(node.tokens().tolist())
            if not node.blocks and node.host is not None:
                for i in range(1, len(node.tokens()) // BS + 1):
                    out.add((ns_key, toks[: len(before) + i * BS]))
            stack.extend((c, toks) for c in node.children.values())
    return out


StoreTierMachine.TestCase.settings = settings(
    max_examples=100, stateful_step_count=30, deadline=None
)
TestStoreTier = StoreTierMachine.TestCase


# ------------------------------------------------------------------ the engine's codec
def test_the_engines_codec_is_a_byte_copier_and_round_trips_real_kv(tmp_path: Path) -> None:
    """KVBlockCodec (the model tier's) plugs in as the ByteCopier: K/V computed on a device
    pool go host -> store -> a new cache's pools and come back bit for bit."""
    torch = pytest.importorskip("torch")
    from radixkv.model.kv_bytes import KVBlockCodec
    from radixkv.model.kv_copy import KVCopier
    from radixkv.model.kvpool import KVPool

    def build():
        dev = KVPool(2, 8, BS, 1, 4, device="cpu")
        host = KVPool(2, 8, BS, 1, 4, device="cpu")
        codec = KVBlockCodec(host)
        assert isinstance(codec, ByteCopier)
        alloc, halloc = BlockAllocator(8, BS), BlockAllocator(8, BS)
        tier = StoreTier(LocalDiskStore(tmp_path, 1 << 20), keyspace(), codec)
        hosted = HostTier(halloc, KVCopier(dev, host), store=tier)
        return dev, alloc, TieredRadixCache(alloc, "lru", host=hosted), tier

    dev, alloc, cache, _ = build()
    blocks = alloc.alloc(3)
    torch.manual_seed(0)
    for t in (*dev.k, *dev.v):
        t.copy_(torch.randn_like(t))
    want = [torch.cat([t[b * BS : (b + 1) * BS] for b in blocks]) for t in (*dev.k, *dev.v)]
    cache.insert(TOKENS[:6], blocks)
    alloc.decref(blocks)
    cache.evict(10**9)
    cache.evict_host(10**9)
    dev, alloc, cache, tier = build()  # a restart: fresh pools, the same folder
    m = cache.load(TOKENS[:6])
    assert m.num_tokens == 6 and tier.stats.loaded_blocks == 3
    got = [torch.cat([t[b * BS : (b + 1) * BS] for b in m.blocks]) for t in (*dev.k, *dev.v)]
    for g, w in zip(got, want, strict=True):
        assert torch.equal(g, w)
    alloc.decref(m.blocks)
    cache.check()
