"""The engine end to end on a small random decoder: cache on == cache off, counts, leaks.

Greedy outputs with the cache on must equal the cache off token for token on
the same device and dtype, over workloads with shared prefixes, chunked
prefill, eviction and preemption. Log-probabilities agree to ~1e-5, not bit for
bit: see docs/engine.md ("What is identical, and how it is measured") for why.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from model_helpers import (
    DEVICES,
    ENGINE_CONFIG,
    FAST_CPU_BACKENDS,
    on_device,
    skip_unless_runs,
)

from radixkv.engine import Engine, EngineConfig, EngineStats
from radixkv.engine.request import SamplingParams
from radixkv.model import DECODER_BACKENDS, random_model
from radixkv.model.kvpool import KVPool
from radixkv.workloads import ChatWorkload, IdealPrefill

torch.set_num_threads(1)

CFG = ENGINE_CONFIG


@pytest.fixture(autouse=True)
def check_every_step(monkeypatch):
    """Every engine step here is followed by ``Engine.check()``: the scheduler's queues, the
    cache's structure and per-block reference conservation (refcount == requests holding
    the block + 1 if the cache holds it)."""
    step = Engine.step

    def checked(self: Engine):
        finished = step(self)
        self.check()
        return finished

    monkeypatch.setattr(Engine, "step", checked)


@pytest.fixture(scope="module")
def model():
    """The default decoder: it runs the device's preferred attention backend."""
    return random_model(CFG, seed=0)


@pytest.fixture(scope="module")
def backends():
    return {b: random_model(CFG, seed=0, attention_backend=b) for b in FAST_CPU_BACKENDS}


def run_chat(engine: Engine, wl: ChatWorkload, params: SamplingParams):
    """Every turn of ``wl`` as a wave through ``engine``; returns the completions per wave."""
    histories = None
    waves = []
    for turn in range(wl.num_turns):
        prompts = wl.turn_prompts(turn, histories)
        outs = engine.generate(prompts, params)
        engine.check()
        histories = [np.concatenate([p, o.output_ids]) for p, o in zip(prompts, outs, strict=True)]
        waves.append(outs)
    return waves


def assert_no_leaks(engine: Engine) -> None:
    engine.check()
    engine.reset_cache()
    engine.allocator.check()
    assert engine.allocator.num_free == engine.allocator.num_blocks


SCENARIOS = {
    # name: (EngineConfig kwargs, workload, expect preemption+eviction)
    "shared_prefix": (
        {"block_size": 16, "num_blocks": 256, "max_num_batched_tokens": 512},
        ChatWorkload(system_len=70, num_users=5, num_turns=2, user_len=(4, 12), vocab_size=256),
        False,
    ),
    "chunked_prefill": (
        {"block_size": 4, "num_blocks": 512, "max_num_batched_tokens": 24},
        ChatWorkload(system_len=70, num_users=4, num_turns=2, user_len=(4, 12), vocab_size=256),
        False,
    ),
    "evict_and_preempt": (
        {"block_size": 4, "num_blocks": 48, "max_num_batched_tokens": 40},
        ChatWorkload(system_len=50, num_users=5, num_turns=3, user_len=(3, 9), vocab_size=256),
        True,
    ),
}


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("scenario", list(SCENARIOS))
def test_greedy_outputs_with_cache_equal_cache_off(model, scenario, device):
    model = on_device(model, device)
    kwargs, wl, pressure = SCENARIOS[scenario]
    params = SamplingParams(max_new_tokens=16)
    results = {}
    for cache in (None, "radix", "hash"):
        engine = Engine(model, EngineConfig(cache=cache, **kwargs))
        assert engine.kv_pool.device.type == device  # the pool follows the model
        results[cache] = run_chat(engine, wl, params)
        if cache is not None:
            stats = EngineStats.of([o.stats for w in results[cache] for o in w], 1.0)
            assert stats.cached_tokens > 0
        if pressure:
            assert engine.scheduler.num_preemptions > 0
            if cache is not None:
                assert engine.scheduler.num_evicted_blocks > 0
        assert_no_leaks(engine)
    base = [o for w in results[None] for o in w]
    for cache in ("radix", "hash"):
        got = [o for w in results[cache] for o in w]
        assert [o.output_ids for o in got] == [o.output_ids for o in base]
        lp, lp0 = (np.concatenate([o.logprobs for o in x]) for x in (got, base))
        assert np.abs(lp - lp0).max() < 1e-3


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize(
    "backend",
    # triton runs in Triton's interpreter without a GPU: ~40 s a scenario on 2 cores
    [pytest.param(b, marks=pytest.mark.slow) if b == "triton" else b for b in DECODER_BACKENDS],
)
@pytest.mark.parametrize("scenario", list(SCENARIOS))
def test_every_backend_with_cache_equals_loop_without(scenario, backend, device):
    """Each attention backend, fed by either cache, gives loop's cache-off greedy tokens."""
    skip_unless_runs(backend, device)
    kwargs, wl, pressure = SCENARIOS[scenario]
    # Triton's interpreter (no GPU) costs ~100x per step: there, evict_and_preempt alone
    # (its prompts share a system prompt and are chunked: every path of the other two),
    # with fewer decode steps; the prefills (shared, chunked, recomputed) are the same.
    interpreted = backend == "triton" and device == "cpu"
    if interpreted and scenario != "evict_and_preempt":
        pytest.skip("Triton's interpreter runs evict_and_preempt only (it covers the others)")
    params = SamplingParams(max_new_tokens=6 if interpreted else 16)
    loop = random_model(CFG, seed=0, attention_backend="loop").to(device)
    base = run_chat(Engine(loop, EngineConfig(cache=None, **kwargs)), wl, params)
    model = random_model(CFG, seed=0, attention_backend=backend).to(device)
    for cache in ("radix", "hash"):
        engine = Engine(model, EngineConfig(cache=cache, **kwargs))
        got = run_chat(engine, wl, params)
        assert [o.output_ids for w in got for o in w] == [o.output_ids for w in base for o in w]
        if pressure:
            assert engine.scheduler.num_preemptions > 0
            assert engine.scheduler.num_evicted_blocks > 0
        assert_no_leaks(engine)


@pytest.mark.slow
@settings(max_examples=25)
@given(
    seed=st.integers(0, 10_000),
    bs=st.sampled_from([1, 2, 4, 16]),
    budget=st.integers(4, 96),
    pool_tokens=st.integers(80, 600),
    policy=st.sampled_from(["fcfs", "lpm"]),
    backend=st.sampled_from(FAST_CPU_BACKENDS),
)
def test_random_workloads_cache_on_equals_off(
    backends, seed, bs, budget, pool_tokens, policy, backend
):
    model = backends[backend]
    rng = np.random.default_rng(seed)
    prefixes = [rng.integers(0, 256, int(rng.integers(0, 40))) for _ in range(2)]
    waves = [
        [
            np.concatenate([prefixes[int(rng.integers(0, 2))], rng.integers(0, 256, n)])
            for n in rng.integers(1, 12, int(rng.integers(1, 5)))
        ]
        for _ in range(2)
    ]
    num_blocks = -(-max(pool_tokens, 80) // bs)
    outs = {}
    for cache in (None, "radix", "hash"):
        cfg = EngineConfig(
            block_size=bs,
            num_blocks=num_blocks,
            max_num_batched_tokens=budget,
            cache=cache,
            schedule_policy=policy,
        )
        engine = Engine(model, cfg)
        outs[cache] = [o.output_ids for w in waves for o in engine.generate(w, SamplingParams(6))]
        assert_no_leaks(engine)
    assert outs["radix"] == outs[None] == outs["hash"]


@pytest.mark.parametrize("device", DEVICES)
def test_engine_matches_the_dense_reference(model, device):
    model = on_device(model, device)
    rng = np.random.default_rng(3)
    shared = rng.integers(0, 256, 40)
    prompts = [np.concatenate([shared, rng.integers(0, 256, n)]) for n in (3, 9, 17)]
    engine = Engine(model, EngineConfig(block_size=8, num_blocks=64, max_num_batched_tokens=32))
    outs = engine.generate(prompts, SamplingParams(max_new_tokens=6))
    for p, o in zip(prompts, outs, strict=True):
        assert o.output_ids == model.greedy_dense(torch.as_tensor(p), 6)
    assert outs[1].stats.cached_tokens == 40 and outs[2].stats.cached_tokens == 40
    assert_no_leaks(engine)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize(("bs", "cached", "computed"), [(1, 97, 5), (16, 96, 6)])
def test_seed_acceptance_97_shared_plus_5_new(model, bs, cached, computed, device):
    model = on_device(model, device)
    # 97 shared tokens + 5 new; 20 new tokens. bs=1: the 5 new run (5 + 19 decodes = 24
    # tokens). bs=16: 6 blocks = 96 tokens match, 6 run (6 + 19 = 25, as in the seed).
    rng = np.random.default_rng(1)
    prefix = rng.integers(0, 256, 97)
    a = np.concatenate([prefix, [1, 2, 3, 4, 5]])
    b = np.concatenate([prefix, [6, 7, 8, 9, 10]])
    params = SamplingParams(max_new_tokens=20)
    outs = {}
    for cache in (None, "radix"):
        engine = Engine(model, EngineConfig(block_size=bs, num_blocks=4096 // bs, cache=cache))
        engine.generate([a], params)
        [outs[cache]] = engine.generate([b], params)
        assert_no_leaks(engine)
    on, off = outs["radix"].stats, outs[None].stats
    assert (on.cached_tokens, on.prefill_tokens, on.decode_tokens) == (cached, computed, 19)
    assert (off.cached_tokens, off.prefill_tokens, off.decode_tokens) == (0, 102, 19)
    assert outs["radix"].output_ids == outs[None].output_ids


def test_prefill_work_equals_the_ideal_on_a_chat_workload(model):
    wl = ChatWorkload(system_len=90, num_users=6, num_turns=2, user_len=(5, 15), vocab_size=256)
    engine = Engine(model, EngineConfig(block_size=16, num_blocks=512, max_num_batched_tokens=64))
    waves = run_chat(engine, wl, SamplingParams(max_new_tokens=5))
    ideal = IdealPrefill(16)
    for outs in waves:
        want = sum(ideal.admit(o.prompt_ids) for o in outs)
        assert sum(o.stats.prefill_tokens for o in outs) == want
        for o in outs:
            ideal.finish(o.prompt_ids + o.output_ids[:-1])
    assert_no_leaks(engine)


def test_sampling_is_reproducible_per_seed_whatever_the_batch(model):
    rng = np.random.default_rng(5)
    prompts = [rng.integers(0, 256, n) for n in (12, 30, 21)]
    runs = []
    for cache, budget in ((None, 512), ("radix", 8)):
        engine = Engine(
            model,
            EngineConfig(block_size=4, num_blocks=128, cache=cache, max_num_batched_tokens=budget),
        )
        params = [SamplingParams(10, temperature=0.9, top_p=0.9, seed=s) for s in (1, 2, 3)]
        runs.append([o.output_ids for o in engine.generate(prompts, params)])
    assert runs[0] == runs[1]
    engine = Engine(model, EngineConfig(block_size=4, num_blocks=128))
    other = engine.generate(
        prompts, [SamplingParams(10, temperature=0.9, seed=s) for s in (7, 8, 9)]
    )
    assert [o.output_ids for o in other] != runs[0]


def test_top_p_tiny_is_greedy(model):
    prompt = np.arange(10, 30)
    engine = Engine(model, EngineConfig(block_size=4, num_blocks=64))
    [greedy] = engine.generate([prompt], SamplingParams(8))
    [nucleus] = engine.generate([prompt], SamplingParams(8, temperature=1.0, top_p=1e-6, seed=0))
    assert nucleus.output_ids == greedy.output_ids


def test_stop_token_and_stats(model):
    prompt = np.arange(40, 70)
    engine = Engine(model, EngineConfig(block_size=4, num_blocks=64))
    [full] = engine.generate([prompt], SamplingParams(12))
    stop = full.output_ids[4]
    [short] = engine.generate([prompt], SamplingParams(12, stop_token_ids=(stop,)))
    k = full.output_ids.index(stop)
    assert short.output_ids == full.output_ids[: k + 1]
    assert short.finish_reason == "stop" and full.finish_reason == "length"
    s = short.stats
    assert s.prompt_tokens == 30 and s.output_tokens == k + 1
    assert s.cached_tokens + s.prefill_tokens == 30  # no preemption: every prompt token once
    assert s.decode_tokens == k and s.ttft > 0
    assert len(short.logprobs) == k + 1 and all(lp <= 0 for lp in short.logprobs)
    agg = EngineStats.of([full.stats, short.stats], wall_time=2.0)
    assert agg.prompt_tokens == 60 and agg.cached_tokens == s.cached_tokens
    assert agg.hit_rate == s.cached_tokens / 60
    assert agg.throughput == (12 + k + 1) / 2.0
    assert_no_leaks(engine)


def test_too_large_request_is_rejected_before_anything_is_queued(model):
    engine = Engine(model, EngineConfig(block_size=4, num_blocks=8))
    ok, big = np.arange(20), np.arange(40)
    with pytest.raises(ValueError, match="whole pool has 8"):
        engine.generate([ok, big], SamplingParams(4))
    assert not engine.scheduler.has_unfinished()
    [out] = engine.generate([ok], SamplingParams(4))
    assert len(out.output_ids) == 4
    assert_no_leaks(engine)


def test_pool_sized_from_a_memory_budget(model):
    per_block = KVPool.block_bytes(
        CFG.num_layers, 16, CFG.num_kv_heads, CFG.head_dim, torch.float32
    )
    engine = Engine(model, EngineConfig(num_blocks=None, kv_memory_bytes=per_block * 37 + 5))
    assert engine.allocator.num_blocks == engine.kv_pool.num_blocks == 37


def test_the_pools_keep_their_old_names_for_a_release(model):
    engine = Engine(model, EngineConfig(num_blocks=8, block_size=4, host_kv_blocks=8))
    assert engine.kv is engine.kv_pool and engine.host_kv is engine.host_kv_pool
    assert engine.host_kv_pool is not None and engine.host_kv_pool.device.type == "cpu"
    assert Engine(model, EngineConfig(num_blocks=8, block_size=4)).host_kv is None


def test_engine_config_validation():
    with pytest.raises(ValueError, match="cache"):
        EngineConfig(cache="lru")
    with pytest.raises(ValueError, match="num_blocks"):
        EngineConfig(num_blocks=0)
    with pytest.raises(ValueError, match="block_size"):
        EngineConfig(block_size=0)
    with pytest.raises(ValueError, match="kv_dtype"):
        EngineConfig(kv_dtype=torch.int8)
    for field, bad in (
        ("lpm_max_wait_steps", 0),
        ("cuda_graph_max_context", -1),
        ("cuda_graphs", 1),
    ):
        with pytest.raises(ValueError, match=field):
            EngineConfig(**{field: bad})


def test_engine_passes_lpm_max_wait_steps_to_its_scheduler(model):
    engine = Engine(model, EngineConfig(block_size=4, num_blocks=16, lpm_max_wait_steps=7))
    assert engine.scheduler.config.lpm_max_wait_steps == 7


def test_generate_text_needs_a_tokenizer(model):
    engine = Engine(model, EngineConfig(block_size=4, num_blocks=16))
    with pytest.raises(ValueError, match="tokenizer"):
        engine.generate_text(["hello"])


def test_demo_runs_with_the_random_model(capsys):
    from radixkv.cli import main

    argv = ["demo", "--random-model", "--conversations", "2", "--turns", "2"]
    assert main([*argv, "--max-new-tokens", "4", "--threads", "1"]) == 0
    out = capsys.readouterr().out
    assert "RANDOM-weight decoder" in out
    assert "radix cache" in out and "cache off" in out
    assert "Greedy outputs identical with and without the cache: yes" in out
