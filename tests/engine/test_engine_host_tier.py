"""The engine with a host-memory tier: greedy outputs bit-identical to cache off, KV round trips.

Three runs of each workload: cache off; a device pool large enough to keep
every prefix (device hits); and a device pool too small for the prefixes with
a host tier behind it, in the poison debug mode (freed device blocks are NaN),
so prefixes come back by host reload and any copy from a freed block would
show up in the outputs.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from model_helpers import DEVICES, ENGINE_CONFIG, on_device

from radixkv.engine import Engine, EngineConfig, SamplingParams
from radixkv.model import random_model
from radixkv.model.kv_copy import KVCopier
from radixkv.model.kvpool import KVPool

torch.set_num_threads(1)

CFG = ENGINE_CONFIG


@pytest.fixture(scope="module")
def model():
    return random_model(CFG, seed=0)


def conversations(rng, num_users, turns, system_len, user_len, namespaces=(None,)):
    """Multi-turn prompts: per user, each turn extends the last (a shared system prompt)."""
    system = rng.integers(0, 256, system_len)
    users = [(system.copy(), namespaces[u % len(namespaces)]) for u in range(num_users)]
    for _ in range(turns):
        wave = []
        for u, (hist, ns) in enumerate(users):
            hist = np.concatenate([hist, rng.integers(0, 256, user_len)])
            users[u] = (hist, ns)
            wave.append((hist, ns))
        yield wave


def run(model, cfg: EngineConfig, seed: int, **shape):
    """Every wave through one engine; outputs per request, and the engine after the run."""
    engine = Engine(model, cfg)
    outs = []
    for wave in conversations(np.random.default_rng(seed), **shape):
        ids = [engine.add_request(p, SamplingParams(6), namespace=ns) for p, ns in wave]
        done = {}
        while len(done) < len(ids):
            for req in engine.step():
                done[req.request_id] = list(req.output_ids)
            engine.check()
        outs += [done[i] for i in ids]
    return outs, engine


def three_ways(model, bs, small_blocks, seed, **shape):
    base, _ = run(
        model, EngineConfig(block_size=bs, num_blocks=4096 // bs, cache=None), seed, **shape
    )
    hit, big = run(model, EngineConfig(block_size=bs, num_blocks=4096 // bs), seed, **shape)
    cfg = EngineConfig(
        block_size=bs,
        num_blocks=small_blocks,
        host_kv_blocks=4096 // bs,
        poison_freed_kv=True,
        max_num_batched_tokens=64,
    )
    reload, tiered = run(model, cfg, seed, **shape)
    return base, hit, reload, big, tiered


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("bs", [1, 4, 16])
def test_greedy_outputs_equal_cache_off_device_hit_and_host_reload(model, bs, device):
    model = on_device(model, device)
    shape = {"num_users": 4, "turns": 3, "system_len": 37, "user_len": 9}
    small = -(-120 // bs) + 2  # one conversation at a time fits, not four
    base, hit, reload, big, tiered = three_ways(model, bs, small, seed=bs, **shape)
    assert hit == base
    assert reload == base
    t = tiered.tier_stats()
    assert t.loaded_tokens > 0 and t.backed_up_blocks > 0 and t.host_hit_tokens > 0
    assert big.tier_stats().loaded_tokens == 0
    assert tiered.host_kv_pool is not None and tiered.host_kv_pool.device.type == "cpu"


def test_namespaces_and_preemption_with_host_reload(model):
    shape = {
        "num_users": 6,
        "turns": 3,
        "system_len": 30,
        "user_len": 7,
        "namespaces": (None, "tenant-a", ("lora", 2)),
    }
    base, hit, reload, _, tiered = three_ways(model, 4, small_blocks=36, seed=5, **shape)
    assert hit == base and reload == base
    assert tiered.scheduler.num_preemptions > 0
    assert tiered.tier_stats().loaded_tokens > 0


@settings(max_examples=12, deadline=None)
@given(
    seed=st.integers(0, 10_000),
    bs=st.sampled_from([2, 4, 8]),
    small=st.integers(24, 64),
    policy=st.sampled_from(["write_back", "write_through"]),
    host=st.integers(4, 200),
)
def test_random_pools_and_policies_keep_greedy_outputs(model, seed, bs, small, policy, host):
    shape = {"num_users": 3, "turns": 3, "system_len": 21, "user_len": 5}
    base, _ = run(model, EngineConfig(block_size=bs, num_blocks=512, cache=None), seed, **shape)
    cfg = EngineConfig(
        block_size=bs,
        num_blocks=max(small, -(-90 // bs) + 1),
        host_kv_blocks=host,
        host_write_policy=policy,
        host_write_through_hits=1,
        poison_freed_kv=True,
        max_num_batched_tokens=48,
    )
    got, engine = run(model, cfg, seed, **shape)
    assert got == base
    engine.reset_cache()
    assert engine.allocator.num_free == engine.allocator.num_blocks
    assert engine.cache.host.allocator.num_free == host


def test_poison_shows_a_copy_made_after_a_free(model):
    """The debug mode's point: a copier that reads freed blocks produces a wrong output."""
    shape = {"num_users": 4, "turns": 3, "system_len": 37, "user_len": 9}
    base, _ = run(model, EngineConfig(block_size=4, num_blocks=1024, cache=None), 1, **shape)
    cfg = EngineConfig(block_size=4, num_blocks=32, host_kv_blocks=1024, poison_freed_kv=True)
    engine = Engine(model, cfg)
    copier = engine.cache.host.copier
    backup = copier.backup
    copier.backup = lambda d, h: (copier.discard(d), backup(d, h))  # free, then copy: the bug
    outs = []
    for wave in conversations(np.random.default_rng(1), **shape):
        outs += [o.output_ids for o in engine.generate([p for p, _ in wave], SamplingParams(6))]
    assert engine.tier_stats().loaded_tokens > 0
    assert outs != base


def test_config_rejects_a_host_tier_it_cannot_build():
    with pytest.raises(ValueError, match="host_kv_blocks"):
        EngineConfig(host_kv_blocks=-1)
    with pytest.raises(ValueError, match="cache='radix'"):
        EngineConfig(host_kv_blocks=8, cache="hash")
    with pytest.raises(ValueError, match="host_write_policy"):
        EngineConfig(host_kv_blocks=8, host_write_policy="write_around")
    with pytest.raises(ValueError, match="poison_freed_kv"):
        EngineConfig(poison_freed_kv=True)


# ------------------------------------------------------------------ KV copier
def pools(num_device=6, num_host=5, bs=2):
    dev = KVPool(2, num_device, bs, 2, 4)
    host = KVPool(2, num_host, bs, 2, 4)
    for i, t in enumerate((*dev.k, *dev.v)):
        t.copy_(torch.randn(t.shape, generator=torch.Generator().manual_seed(i)))
    return dev, host


def snapshot(pool):
    return [t.clone() for t in (*pool.k, *pool.v)]


def test_round_trip_restores_the_values_at_backup_time():
    dev, host = pools()
    copier = KVCopier(dev, host)
    before = snapshot(dev)
    copier.backup(np.array([4, 1], dtype=np.int32), np.array([0, 3], dtype=np.int32))
    for t in (*dev.k, *dev.v):
        t.view(6, 2, 2, 4)[[4, 1]] = -7.0  # the device reuses the blocks
    copier.load(np.array([3, 0], dtype=np.int32), np.array([2, 5], dtype=np.int32))
    for b, a in zip(before, (*dev.k, *dev.v), strict=True):
        b, a = b.view(6, 2, 2, 4), a.view(6, 2, 2, 4)
        assert torch.equal(a[2], b[1]) and torch.equal(a[5], b[4])
        assert torch.equal(a[0], b[0]) and torch.equal(a[3], b[3])  # unmapped: untouched
    assert (copier.backed_up_blocks, copier.loaded_blocks) == (2, 2)


def test_backup_leaves_the_source_and_other_host_blocks_untouched():
    dev, host = pools()
    copier = KVCopier(dev, host)
    before_dev, before_host = snapshot(dev), snapshot(host)
    copier.backup(np.array([3], dtype=np.int32), np.array([2], dtype=np.int32))
    assert all(torch.equal(a, b) for a, b in zip(before_dev, snapshot(dev), strict=True))
    for b, a in zip(before_host, snapshot(host), strict=True):
        b, a = b.view(5, 2, 2, 4), a.view(5, 2, 2, 4)
        assert torch.equal(a[[0, 1, 3, 4]], b[[0, 1, 3, 4]])


def test_poison_fills_only_the_discarded_blocks():
    dev, host = pools()
    before = snapshot(dev)
    KVCopier(dev, host, poison=True).discard(np.array([1], dtype=np.int32))
    for b, a in zip(before, snapshot(dev), strict=True):
        b, a = b.view(6, 2, 2, 4), a.view(6, 2, 2, 4)
        assert torch.isnan(a[1]).all() and torch.equal(a[[0, 2, 3, 4, 5]], b[[0, 2, 3, 4, 5]])


def test_copier_rejects_pools_of_another_layout():
    dev = KVPool(2, 4, 2, 2, 4)
    with pytest.raises(ValueError, match="head_dim"):
        KVCopier(dev, KVPool(2, 4, 2, 2, 8))
    with pytest.raises(ValueError, match="block_size"):
        KVCopier(dev, KVPool(2, 4, 4, 2, 4))


def test_a_reload_that_ends_inside_a_node_equals_cache_off(model):
    """Prompt b shares 40 of prompt a's 64 tokens: its reload splits a's host-only node."""
    rng = np.random.default_rng(11)
    a = rng.integers(0, 256, 64)
    b = np.concatenate([a[:40], rng.integers(0, 256, 30)])
    params = SamplingParams(6)
    off = Engine(model, EngineConfig(block_size=4, num_blocks=256, cache=None))
    want = [o.output_ids for o in off.generate([a, b], params)]
    engine = Engine(model, EngineConfig(block_size=4, num_blocks=64, host_kv_blocks=64,
                                        poison_freed_kv=True))  # fmt: skip
    [out_a] = engine.generate([a], params)
    engine.cache.evict(10**9)  # every block of a to the host
    assert engine.cache.cached_blocks == 0 and engine.cache.host_cached_blocks > 0
    [out_b] = engine.generate([b], params)
    assert [out_a.output_ids, out_b.output_ids] == want
    assert out_b.stats.cached_tokens == 40
    assert engine.tier_stats().loaded_tokens == 40
    engine.check()


def test_serving_engine_with_a_host_tier_and_events():
    pytest.importorskip("fastapi")
    from radixkv.serve.models import build_engine

    engine = build_engine("random", num_blocks=16, events=True, host_kv_blocks=64)
    assert engine.cache.host is not None and engine.cache.events_hasher is not None
    a, b = [i % 200 + 1 for i in range(150)], [i % 190 + 3 for i in range(150)]
    for prompt in (a, b, [*a, 7]):  # b does not fit beside a: a goes to the host, then back
        engine.generate([prompt], SamplingParams(4))
    mediums = {e.medium for e in engine.cache.take_events() if hasattr(e, "medium")}
    assert mediums == {"GPU", "CPU"}  # the second prompt pushed the first to the host
    assert engine.tier_stats().loaded_tokens > 0


def test_a_cache_factory_cannot_take_a_host_tier_or_events(model):
    from radixkv.cache.hashing import ChainHasher
    from radixkv.cache.radix import RadixCache

    with pytest.raises(ValueError, match="cache_factory"):
        Engine(model, EngineConfig(host_kv_blocks=8), cache_factory=RadixCache)
    with pytest.raises(ValueError, match="cache_factory"):
        Engine(model, EngineConfig(), cache_factory=RadixCache, events=ChainHasher())
    with pytest.raises(ValueError, match="KV events needs cache='radix'"):
        Engine(model, EngineConfig(cache="hash"), events=ChainHasher())


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_copier_reloads_bit_identical_kv(device, dtype):
    """Backup, poison the freed blocks, load elsewhere: every reloaded bit is the original's.

    Twice over fresh pools: on CUDA the first version registered each host pool with
    ``cudaHostRegister`` and never unregistered it, so a second pool at a reused address
    failed (error 712) on the first GPU run.
    """
    for _ in range(2):
        _round_trip(device, dtype)


def _round_trip(device: str, dtype: torch.dtype) -> None:
    dev = KVPool(2, 10, 4, 2, 8, dtype=dtype, device=device)
    host = KVPool(2, 6, 4, 2, 8, dtype=dtype, device="cpu")
    gen = torch.Generator().manual_seed(0)
    for t in (*dev.k, *dev.v):
        t.copy_(torch.randn(t.shape, generator=gen).to(dtype))
    copier = KVCopier(dev, host, poison=True)
    blocks = [t.view(10, 4, 2, 8)[[7, 2, 5]].clone() for t in (*dev.k, *dev.v)]
    copier.backup(np.array([7, 2, 5]), np.array([0, 4, 1]))
    copier.discard(np.array([7, 2, 5]))
    assert all(t.view(10, 4, 2, 8)[[7, 2, 5]].isnan().all() for t in (*dev.k, *dev.v))
    copier.load(np.array([0, 4, 1]), np.array([3, 9, 0]))
    for t, want in zip((*dev.k, *dev.v), blocks, strict=True):
        assert torch.equal(t.view(10, 4, 2, 8)[[3, 9, 0]], want)
    assert copier.backed_up_blocks == copier.loaded_blocks == 3
