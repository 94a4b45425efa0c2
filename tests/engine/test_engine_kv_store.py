"""The engine with a KV store below its host tier (issue 35): restarts, faults, configuration.

Engine A serves the first turns of some chats over a ``LocalDiskStore`` folder and is
dropped; engine B, fresh, over the same folder serves the next turns. B finds the earlier
turns in the store (``cached_tokens``), its greedy outputs are a cache-off engine's, and
the K/V it loaded is A's bit for bit. A store that raises and a folder of corrupted
entries cost only the recompute: the outputs stay the same, the stats and the log say so.
"""

from __future__ import annotations

import logging
from pathlib import Path

import numpy as np
import pytest
import torch
from model_helpers import ENGINE_CONFIG

import radixkv.engine.engine as engine_module
from radixkv.cache.store import StoreStats
from radixkv.cache.store.entry import HEADER_BYTES
from radixkv.engine import Engine, EngineConfig, SamplingParams
from radixkv.engine.kv_store import KVStoreOpenError
from radixkv.engine.stats import TierStats
from radixkv.model import random_model

torch.set_num_threads(1)

BS = 4
NUM_BLOCKS = 160
MAX_NEW = 5


@pytest.fixture(scope="module")
def model():
    return random_model(ENGINE_CONFIG, seed=0)


def store_config(folder: Path, **over) -> EngineConfig:
    settings = {"block_size": BS, "num_blocks": NUM_BLOCKS, "kv_store": str(folder),
                "kv_store_capacity_bytes": 1 << 26}  # fmt: skip
    return EngineConfig(**{**settings, **over})


def chats(seed: int, num_users: int = 3, system_len: int = 10, user_len: int = 7):
    """Each user's system prompt (shared) and the new tokens of each of their turns."""
    rng = np.random.default_rng(seed)
    system = rng.integers(0, 256, system_len).tolist()
    return system, [[rng.integers(0, 256, user_len).tolist() for _ in range(4)]
                    for _ in range(num_users)]  # fmt: skip


def serve_turns(engine: Engine, histories: list[list[int]], turns: list[list[int]]):
    """One wave: each user's history plus this turn's tokens; greedy. Returns the
    completions; ``histories`` grow by the prompt's new tokens and the reply."""
    prompts = [h + t for h, t in zip(histories, turns, strict=True)]
    done = engine.generate(prompts, SamplingParams(max_new_tokens=MAX_NEW))
    engine.check()
    for k, c in enumerate(done):
        histories[k] = prompts[k] + c.output_ids
    return done


def device_kv(engine: Engine, tokens: list[int]) -> list[bytes]:
    """The bytes of K and V, per layer, of the cached device blocks of ``tokens``' prefix."""
    m = engine.cache.match(np.asarray(tokens, dtype=np.int32), stats=False)
    try:
        rows = torch.as_tensor(
            (np.asarray(m.blocks)[:, None] * BS + np.arange(BS)).reshape(-1), dtype=torch.long
        )
        pool = engine.kv_pool
        return [t[rows].numpy().tobytes() for t in (*pool.k, *pool.v)]
    finally:
        engine.allocator.decref(m.blocks)


def test_a_restart_loads_the_earlier_turns_from_the_store(model, tmp_path) -> None:
    system, user_turns = chats(seed=1)
    off = Engine(model, EngineConfig(block_size=BS, num_blocks=NUM_BLOCKS, cache=None))
    a = Engine(model, store_config(tmp_path))
    hist_off = [list(system) for _ in user_turns]
    hist_a = [list(system) for _ in user_turns]
    for turn in range(2):
        wave = [u[turn] for u in user_turns]
        want = serve_turns(off, hist_off, wave)
        got = serve_turns(a, hist_a, wave)
        assert [c.output_ids for c in got] == [c.output_ids for c in want]
    a_stats = a.tier_stats()
    assert a_stats.has_store and a_stats.store_stored_blocks > 0 and a_stats.store_errors == 0
    # What A computed of each history (all but its last token, which no step fed back).
    a_kv = [device_kv(a, h[:-1]) for h in hist_a]
    del a

    b = Engine(model, store_config(tmp_path))
    wave = [u[2] for u in user_turns]
    want = serve_turns(off, hist_off, wave)
    prior = [len(h) for h in hist_a]
    got = serve_turns(b, hist_a, wave)
    assert [c.output_ids for c in got] == [c.output_ids for c in want]
    # Every full block of a user's earlier turns came from the store: the first user's from
    # the store alone, the others' past the system prompt the first one loaded.
    cached = [c.stats.cached_tokens for c in got]
    assert cached == [(n - 1) // BS * BS for n in prior]
    b_stats = b.tier_stats()
    assert b_stats.store_loaded_blocks == sum(cached) // BS - (len(system) // BS) * 2
    assert b_stats.store_loaded_bytes == b_stats.store_loaded_blocks * b.kv_pool.bytes_per_block
    assert b_stats.store_corrupt_blocks == b_stats.store_errors == 0
    for k, n in enumerate(prior):  # the K/V B loaded is what A computed, bit for bit
        assert device_kv(b, hist_a[k][: (n - 1) // BS * BS]) == a_kv[k]


class RaisingStore:
    """A store that is down: every call raises."""

    capacity_bytes = 1 << 20

    @property
    def stats(self) -> StoreStats:
        return StoreStats()

    def contains_run(self, keys):
        raise ConnectionError("store is down")

    def put_many(self, items):
        raise ConnectionError("store is down")

    def get_many(self, keys):
        raise ConnectionError("store is down")

    def check(self) -> None:
        pass


def test_a_store_that_raises_never_fails_a_request(model, tmp_path, monkeypatch, caplog) -> None:
    monkeypatch.setattr(engine_module, "open_kv_store", lambda spec, capacity: RaisingStore())
    system, user_turns = chats(seed=2)
    off = Engine(model, EngineConfig(block_size=BS, num_blocks=NUM_BLOCKS, cache=None))
    down = Engine(model, store_config(tmp_path))
    hist_off = [list(system) for _ in user_turns]
    hist = [list(system) for _ in user_turns]
    with caplog.at_level(logging.WARNING, logger="radixkv.cache.store.tier"):
        for turn in range(2):
            wave = [u[turn] for u in user_turns]
            want = serve_turns(off, hist_off, wave)
            got = serve_turns(down, hist, wave)
            assert [c.output_ids for c in got] == [c.output_ids for c in want]
            assert all(c.finish_reason == "length" for c in got)
    stats = down.tier_stats()
    assert stats.store_errors > 0 and stats.store_stored_blocks == stats.store_loaded_blocks == 0
    assert any("served as a miss or a skipped write" in r.getMessage() for r in caplog.records)


def test_corrupted_entries_are_recomputed_never_served(model, tmp_path, caplog) -> None:
    system, user_turns = chats(seed=3, num_users=1)
    off = Engine(model, EngineConfig(block_size=BS, num_blocks=NUM_BLOCKS, cache=None))
    a = Engine(model, store_config(tmp_path))
    hist_off, hist = [list(system)], [list(system)]
    wave = [user_turns[0][0]]
    serve_turns(off, hist_off, wave)
    serve_turns(a, hist, wave)
    del a
    files = [p for p in tmp_path.rglob("*") if p.is_file()]
    assert files
    for path in files:  # one flipped bit in each payload
        data = bytearray(path.read_bytes())
        data[HEADER_BYTES + 5] ^= 0x10
        path.write_bytes(bytes(data))
    b = Engine(model, store_config(tmp_path))
    with caplog.at_level(logging.WARNING, logger="radixkv.cache.store.entry"):
        wave = [user_turns[0][1]]
        want = serve_turns(off, hist_off, wave)
        [got] = serve_turns(b, hist, wave)
    assert got.output_ids == want[0].output_ids
    assert got.stats.cached_tokens == 0
    stats = b.tier_stats()
    assert stats.store_corrupt_blocks >= 1 and stats.store_loaded_blocks == 0
    assert stats.store_load_misses >= 1
    assert any("failed its check" in r.getMessage() for r in caplog.records)


# ------------------------------------------------------------------ configuration
def test_a_store_adds_a_write_through_host_tier_as_large_as_the_pool(model, tmp_path) -> None:
    cfg = store_config(tmp_path)
    assert cfg.host_write() == ("write_through", 0)
    assert EngineConfig().host_write() == ("write_back", 2)
    assert store_config(tmp_path, host_write_policy="write_back").host_write() == (
        "write_back",
        0,
    )
    engine = Engine(model, cfg)
    assert engine.host_kv_pool is not None and engine.host_kv_pool.num_blocks == NUM_BLOCKS
    assert engine.store_tier is not None and engine.store_tier.write_policy == "write_through"
    sized = Engine(
        model, store_config(tmp_path, host_kv_blocks=24, kv_store_write_policy="write_back")
    )
    assert sized.host_kv_pool.num_blocks == 24 and sized.store_tier.write_policy == "write_back"


@pytest.mark.parametrize(
    ("over", "match"),
    [
        ({"kv_store": ""}, "kv_store must be a directory or mooncake://HOST:PORT, got ''"),
        ({"kv_store": "mooncake://"}, "kv_store must be mooncake://HOST:PORT"),
        ({"kv_store": 5}, "kv_store must be a directory"),
        ({"cache": "hash"}, "kv_store needs cache='radix'"),
        ({"kv_store_write_policy": "write_around"}, "kv_store_write_policy must be one of"),
        ({"kv_store_capacity_bytes": 0}, "kv_store_capacity_bytes"),
        # past 1 PiB is a typo, and a Mooncake client would try to lend that much memory
        ({"kv_store_capacity_bytes": 10**26}, "kv_store_capacity_bytes"),
        ({"host_write_through_hits": -1}, "host_write_through_hits"),
    ],
)
def test_bad_store_settings_are_refused_by_the_config(tmp_path, over, match) -> None:
    with pytest.raises(ValueError, match=match):
        store_config(tmp_path, **over)


def test_a_store_that_cannot_open_is_one_error_before_any_pool(model, tmp_path) -> None:
    afile = tmp_path / "a-file"
    afile.write_text("")
    with pytest.raises(KVStoreOpenError, match=r"^kv_store '.*a-file': path must be a dir"):
        Engine(model, store_config(afile))
    pytest.importorskip("mooncake.store")
    with pytest.raises(KVStoreOpenError, match="master_address must be reachable"):
        Engine(model, store_config(tmp_path, kv_store="mooncake://127.0.0.1:9"))


def test_a_cache_factory_refuses_a_store(model, tmp_path) -> None:
    from radixkv.cache.radix import RadixCache

    with pytest.raises(ValueError, match="kv_store=None"):
        Engine(model, store_config(tmp_path), cache_factory=RadixCache)


def test_tier_stats_without_a_store_have_none() -> None:
    from radixkv.cache.results import CacheStats

    stats = TierStats.of(CacheStats(), BS, 64)
    assert not stats.has_store and stats.store_loaded_blocks == 0
