"""MooncakeStore (radixkv.cache.store.mooncake) beyond the contract suite
(tests/cache/test_kv_store.py runs that over it too): configuration errors, foreign and
corrupt values in the pool, two servers sharing one pool, and a master killed mid-run.

docs/store.md: a Mooncake pool is shared by a fleet; a value the store cannot vouch for is a
counted miss, removed from the pool; a master that goes away makes puts skip and gets
miss, counted in ``errors`` and logged, never an exception; an unreachable master at
construction is one ``ValueError``. The cases that need Mooncake skip, saying why, where
its client or ``libibverbs1`` is missing.
"""

from __future__ import annotations

import socket
import sys
import time

import pytest
from mooncake_helpers import new_master, pool_store

from radixkv.cache.store import KEY_BYTES, KVStore, MooncakeStore
from radixkv.cache.store.entry import encode
from radixkv.cache.store.mooncake import PACKAGE, MooncakeMaster


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def key_of(i: int) -> bytes:
    return i.to_bytes(4, "big") * (KEY_BYTES // 4)


def value_of(i: int, size: int = 1000) -> bytes:
    return bytes([i % 251]) * size


@pytest.mark.parametrize(
    ("address", "capacity", "extra", "match"),
    [
        ("127.0.0.1", 1 << 20, {}, "master_address must be 'host:port', got '127.0.0.1'"),
        ("127.0.0.1:99999", 1 << 20, {}, "master_address must be 'host:port'"),
        (("127.0.0.1", 50051), 1 << 20, {}, "master_address must be a str"),
        ("127.0.0.1:50051", 0, {}, "capacity_bytes"),
        ("127.0.0.1:50051", 1 << 20, {"local_buffer_size": 1 << 20}, "local_buffer_size"),
        ("127.0.0.1:50051", 1 << 20, {"global_segment_size": 1.5}, "global_segment_size"),
        ("127.0.0.1:50051", 1 << 20, {"retry_after_s": -1}, "retry_after_s"),
        ("127.0.0.1:50051", 1 << 20, {"key_prefix": None}, "key_prefix"),
    ],
)
def test_a_bad_argument_is_named_before_anything_connects(
    address: object, capacity: object, extra: dict, match: str
) -> None:
    with pytest.raises(ValueError, match=match):
        MooncakeStore(address, capacity, **extra)


def test_without_the_client_the_error_names_the_package(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(sys.modules, "mooncake", None)
    monkeypatch.setitem(sys.modules, "mooncake.store", None)
    with pytest.raises(ImportError, match=rf"pip install 'radixkv\[store-mooncake\]'.*{PACKAGE}"):
        MooncakeStore("127.0.0.1:50051", 1 << 20)


def test_an_unreachable_master_is_one_clear_value_error(mooncake_master: MooncakeMaster) -> None:
    address = f"127.0.0.1:{free_port()}"  # nothing listens there
    with pytest.raises(ValueError, match=rf"master_address must be reachable, got '{address}'"):
        MooncakeStore(address, 1 << 20)
    url = f"http://127.0.0.1:{free_port()}/metadata"
    with pytest.raises(ValueError, match=rf"metadata_server must be reachable, got '{url}'"):
        MooncakeStore(mooncake_master.address, 1 << 20, metadata_server=url)


def test_a_foreign_or_corrupt_value_in_the_pool_is_a_counted_miss(
    mooncake_pool: MooncakeStore,
) -> None:
    prefix = "test-foreign/"
    store = mooncake_pool.share(1 << 20, key_prefix=prefix)
    client = store.client
    assert store.put_many([(key_of(0), value_of(0))]) == 1
    # another writer to the pool: block 0's sound entry under block 1's name, and garbage
    assert client.put(prefix + key_of(1).hex(), encode(key_of(0), value_of(0))) == 0
    assert client.put(prefix + key_of(2).hex(), b"\x00" * 2000) == 0
    assert store.contains_run([key_of(0), key_of(1), key_of(2)]) == 3  # there ...
    assert store.get_many([key_of(0), key_of(1), key_of(2)]) == [value_of(0), None, None]
    s = store.stats
    assert (s.hits, s.corrupt, s.misses, s.errors) == (1, 2, 0, 0)
    assert store.contains_run([key_of(1)]) == 0 and store.contains_run([key_of(2)]) == 0  # gone
    assert store.put_many([(key_of(2), value_of(2))]) == 1  # recomputed, stored again
    assert store.get_many([key_of(2)]) == [value_of(2)]
    store.check()
    store.close()


def test_two_servers_share_one_pool(mooncake_pool: MooncakeStore) -> None:
    """What one server puts another finds (and adopts into its own capacity); an entry one
    removes is a miss for the other, which forgets it."""
    size = 64 + 1000
    a = pool_store(mooncake_pool, 1 << 20)
    b = a.share(2 * size)  # same key prefix: the same names
    assert isinstance(b, KVStore)
    assert a.put_many([(key_of(i), value_of(i)) for i in range(3)]) == 3
    assert b.contains_run([key_of(i) for i in range(3)]) == 3
    assert b.put_many([(key_of(0), value_of(0))]) == 0  # there already: used, not rewritten
    assert b.get_many([key_of(1), key_of(2)]) == [value_of(1), value_of(2)]
    s = b.stats
    assert (s.puts, s.hits, s.num_entries, s.evicted) == (0, 2, 2, 1)  # 0 made room for 2
    assert a.get_many([key_of(0), key_of(1)]) == [None, value_of(1)]  # b evicted 0 from the pool
    assert a.stats.misses == 1 and a.stats.num_entries == 2
    a.check(), b.check()
    a.close(), b.close()


def test_a_master_killed_mid_run_makes_misses_never_exceptions(
    caplog: pytest.LogCaptureFixture,
) -> None:
    with new_master() as master:
        store = MooncakeStore(master.address, 1 << 20, retry_after_s=0.2)
        keys = [key_of(i) for i in range(4)]
        assert store.put_many([(k, value_of(i)) for i, k in enumerate(keys[:2])]) == 2
        master.stop()
        with caplog.at_level("WARNING", logger="radixkv.cache.store.mooncake"):
            for _ in range(3):  # the first call meets the dead master, the rest the marker
                assert store.put_many([(keys[2], value_of(2))]) == 0
                assert store.get_many(keys[:2]) == [None, None]
                assert store.contains_run(keys) == 0
        s = store.stats
        assert s.errors >= 3 * (1 + 2 + 1) and s.puts == 2 and s.hits == 0
        assert "put failed" in caplog.text and "get failed" in caplog.text
        store.check()
        master.start()  # a fresh master on the same port: an empty pool
        deadline = time.monotonic() + 60
        while store.put_many([(keys[3], value_of(3))]) == 0:  # the client reconnects
            assert time.monotonic() < deadline, "the store never came back"
            time.sleep(0.1)
        assert store.get_many([keys[0], keys[3]]) == [None, value_of(3)]
        store.close()
