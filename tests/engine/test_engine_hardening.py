"""The engine under bad input and misuse: nothing wedges it, nothing leaks, every error names
its field (issue 11, items 1-7). Each test names the item it guards."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from radixkv.cache.hashing import ChainHasher
from radixkv.engine import Engine, EngineConfig
from radixkv.engine.request import FinishReason, Request, SamplingParams
from radixkv.errors import ArgumentTypeError
from radixkv.model import ModelConfig, random_model

torch.set_num_threads(1)

CFG = ModelConfig(
    vocab_size=64,
    hidden_size=32,
    intermediate_size=64,
    num_layers=1,
    num_heads=2,
    num_kv_heads=1,
    head_dim=16,
)
POISON = 13  # the flaky model raises on any batch holding this token


@pytest.fixture(scope="module")
def model():
    return random_model(CFG, seed=0)


def flaky_model(poison: int = POISON):
    """A decoder whose forward raises whenever the batch holds ``poison``: a stand-in for any
    failure inside a step (a kernel error, an OOM) that validation could not foresee."""
    m = random_model(CFG, seed=0)
    inner = m.forward

    def forward(batch, kv):
        if bool((batch.input_ids == poison).any()):
            raise RuntimeError(f"poisoned batch (token {poison})")
        return inner(batch, kv)

    m.forward = forward
    return m


def engine_of(model, **kw) -> Engine:
    kw.setdefault("num_blocks", 64)
    kw.setdefault("block_size", 4)
    return Engine(model, EngineConfig(**kw))


def drain(engine: Engine) -> list[Request]:
    done: list[Request] = []
    while engine.scheduler.has_unfinished():
        done.extend(engine.step())
        engine.check()
    return done


def assert_nothing_held(engine: Engine) -> None:
    """No request state left anywhere, and every block back once the cache lets go."""
    engine.check()
    assert not engine.scheduler.has_unfinished()
    assert engine.kv_manager.num_requests == 0
    assert engine._generators == {}
    engine.reset_cache()
    assert engine.allocator.num_free == engine.allocator.num_blocks


# --------------------------------------------------------------------------- item 1
def test_token_outside_vocab_is_rejected_before_queueing(model):
    engine = engine_of(model)
    with pytest.raises(ValueError, match=r"prompt holds token id 64, .*vocab_size 64"):
        engine.add_request([1, 2, 64])
    with pytest.raises(ValueError, match=r"vocab_size 64"):
        engine.generate([[1, 2, 3], [5, 99]])  # one bad prompt: none queued
    assert not engine.scheduler.has_unfinished()
    [c] = engine.generate([[1, 2, 3]], SamplingParams(max_new_tokens=2))
    assert c.finish_reason == "length" and len(c.output_ids) == 2


def test_stop_id_outside_vocab_is_rejected(model):
    engine = engine_of(model)
    with pytest.raises(ValueError, match=r"stop_token_ids \[64\]"):
        engine.add_request([1, 2], SamplingParams(stop_token_ids=(3, 64)))
    assert not engine.scheduler.has_unfinished()


def test_seed_out_of_torch_range_is_rejected_and_the_bounds_work(model):
    for bad in (2**64, -(2**63) - 1):
        with pytest.raises(ValueError, match="seed"):
            SamplingParams(temperature=1.0, seed=bad)
    engine = engine_of(model)
    params = [
        SamplingParams(temperature=1.0, seed=s, max_new_tokens=3) for s in (2**64 - 1, -(2**63))
    ]
    outs = engine.generate([[1, 2, 3], [1, 2, 3]], params)
    assert all(len(c.output_ids) == 3 for c in outs)
    assert_nothing_held(engine)


def test_failed_step_finishes_its_requests_with_error_and_engine_keeps_serving():
    engine = engine_of(flaky_model(), max_num_seqs=2)
    bad = engine.add_request([1, 2, POISON, 4, 5])
    mate = engine.add_request([7, 8, 9])  # shares the failing step
    later = engine.add_request([20, 21, 22, 23, 24])  # waits: max_num_seqs=2
    finished = engine.step()
    assert {r.request_id for r in finished} == {bad, mate}
    for req in finished:
        assert req.finish_reason is FinishReason.ERROR
        assert "poisoned batch" in req.error
        assert engine.completion(req).finish_reason == "error"
    engine.check()
    assert engine.num_failed_steps == 1
    done = drain(engine)
    assert [r.request_id for r in done] == [later]
    assert done[0].finish_reason is FinishReason.LENGTH
    outs = engine.generate([[30, 31, 32], [1, 2, 3, 4]], SamplingParams(max_new_tokens=4))
    assert all(c.finish_reason == "length" and len(c.output_ids) == 4 for c in outs)
    assert_nothing_held(engine)


def test_failure_during_decode_releases_cached_and_own_blocks():
    """The poison is a token the request itself samples: it prefills (caching its full
    blocks), decodes, then fails in the step that feeds the poison back; its blocks come
    back, the cache keeps what the prefill computed, and the outputs so far stay readable."""
    prompt = list(range(1, 10))  # 9 tokens: 2 full blocks of 4
    params = SamplingParams(max_new_tokens=6)
    [ref] = engine_of(flaky_model(poison=-1)).generate([prompt], params)
    poison = next(t for t in ref.output_ids if t not in prompt)
    k = ref.output_ids.index(poison)
    engine = engine_of(flaky_model(poison=poison))
    [c] = engine.generate([prompt], params)
    assert c.finish_reason == "error" and "poisoned batch" in c.error
    assert c.output_ids == ref.output_ids[: k + 1]
    assert c.logprobs == pytest.approx(ref.logprobs[: k + 1], abs=1e-5)
    assert engine.cache.cached_blocks >= 2
    assert_nothing_held(engine)


# --------------------------------------------------------------------------- item 2
def test_add_request_returns_the_id_and_abort_ends_waiting_and_running(model):
    engine = engine_of(model, max_num_seqs=1)
    prompt = list(range(1, 11))  # 10 tokens: 2 full blocks of 4, then a partial one
    first = engine.add_request(prompt, SamplingParams(max_new_tokens=50))
    second = engine.add_request([40, 41, 42])
    assert isinstance(first, int) and isinstance(second, int)
    engine.step()
    engine.step()
    assert engine.get(first).num_output_tokens == 2
    waiting = engine.abort_request(second)
    assert waiting.finish_reason is FinishReason.ABORT and waiting.output_ids == []
    running = engine.abort_request(first)
    assert running.finish_reason is FinishReason.ABORT and len(running.output_ids) == 2
    assert engine.abort_request(first) is None  # already finished
    assert engine.abort_request(10**9) is None  # unknown
    assert engine.get(first) is None
    assert engine.step() == []  # aborted requests are not returned again
    # The aborted request's computed full blocks stayed in the cache for the next one.
    [c] = engine.generate([prompt + [50]], SamplingParams(max_new_tokens=1))
    assert c.stats.cached_tokens == 8
    assert_nothing_held(engine)


def test_abort_of_a_sampled_request_drops_its_generator(model):
    engine = engine_of(model)
    rid = engine.add_request([1, 2, 3], SamplingParams(temperature=1.0, max_new_tokens=9))
    engine.step()
    assert engine.abort_request(rid) is not None
    assert_nothing_held(engine)


# --------------------------------------------------------------------------- item 3
def test_max_new_tokens_beyond_the_pool_is_a_value_error_before_any_allocation(model):
    engine = engine_of(model)  # 64 blocks of 4 tokens
    huge = SamplingParams(max_new_tokens=2**40)
    with pytest.raises(ValueError, match=r"max_new_tokens is \d+ but a prompt of 3 .* pool has 64"):
        engine.add_request([1, 2, 3], huge)
    req = Request([1, 2, 3], huge)  # building the request allocates nothing of that size
    assert req._buf.nbytes < 1024


def test_request_buffer_grows_as_tokens_arrive():
    req = Request([5, 6], SamplingParams(max_new_tokens=100))
    for t in range(100):
        req.append_token(t)
    assert req.output_ids == list(range(100))
    assert req.tokens.tolist() == [5, 6, *range(100)]
    with pytest.raises(RuntimeError, match="max_new_tokens"):
        req.append_token(1)


# --------------------------------------------------------------------------- item 4
@pytest.mark.parametrize("cache", ["radix", "hash"])
def test_same_prompt_under_two_namespaces_shares_nothing(model, cache):
    engine = engine_of(model, cache=cache)
    prompt = list(range(1, 18))
    params = SamplingParams(max_new_tokens=2)
    [a] = engine.generate([prompt], params, namespace="tenant-a")
    [b] = engine.generate([prompt], params, namespace="tenant-b")
    [a2] = engine.generate([prompt], params, namespace="tenant-a")
    [d] = engine.generate([prompt], params)  # the default namespace is one more
    assert (a.stats.cached_tokens, b.stats.cached_tokens) == (0, 0)
    assert a2.stats.cached_tokens == 16 and d.stats.cached_tokens == 0
    assert a.output_ids == b.output_ids == a2.output_ids  # isolation changes no output
    assert_nothing_held(engine)


def test_namespace_per_prompt_and_per_request(model):
    engine = engine_of(model)
    prompt = list(range(1, 18))
    params = SamplingParams(max_new_tokens=1)
    engine.generate([prompt], params, namespace="x")
    outs = engine.generate([prompt, prompt], params, namespace=["x", "y"])
    assert [c.stats.cached_tokens for c in outs] == [16, 0]
    rid = engine.add_request(prompt, params, namespace="y")
    assert engine.get(rid).namespace == "y"
    [req] = drain(engine)
    assert req.stats().cached_tokens == 16
    with pytest.raises(ValueError, match="2 namespaces for 3 prompts"):
        engine.generate([prompt] * 3, params, namespace=["x", "y"])
    with pytest.raises(TypeError, match="namespace"):
        engine.add_request(prompt, params, namespace={"not": "hashable"})
    assert_nothing_held(engine)


# --------------------------------------------------------------------------- item 5
def test_step_loop_reads_outputs_and_logprobs_and_keeps_nothing(model):
    prompts = [[1, 2, 3, 4, 5], [1, 2, 3, 9], [30, 31]]
    params = [
        SamplingParams(max_new_tokens=5),
        SamplingParams(max_new_tokens=3, temperature=0.8, seed=7),
        SamplingParams(max_new_tokens=4, temperature=1.0),
    ]
    ref = engine_of(model).generate(prompts, params)
    engine = engine_of(model)
    ids = [engine.add_request(p, sp) for p, sp in zip(prompts, params, strict=True)]
    done = {r.request_id: engine.completion(r) for r in drain(engine)}
    assert sorted(done) == sorted(ids)
    for rid, want in zip(ids, ref, strict=True):
        got = done[rid]
        assert got.output_ids == want.output_ids
        assert got.logprobs == pytest.approx(want.logprobs, abs=1e-5)
        assert len(got.logprobs) == len(got.output_ids)
    assert_nothing_held(engine)


# --------------------------------------------------------------------------- item 6
def test_default_seed_does_not_depend_on_what_ran_before_in_the_process(model):
    prompts = [[1, 2, 3], [1, 2, 3]]
    params = SamplingParams(temperature=1.0, max_new_tokens=12)
    first = [c.output_ids for c in engine_of(model).generate(prompts, params)]
    for _ in range(1000):  # consume process-wide request ids
        Request([1], SamplingParams())
    engine_of(model).generate([[5, 6]], params)  # another engine's requests
    again = [c.output_ids for c in engine_of(model).generate(prompts, params)]
    assert again == first
    assert first[0] != first[1]  # each request still draws its own stream
    other = engine_of(model, seed=1).generate(prompts, params)
    assert [c.output_ids for c in other] != first


# --------------------------------------------------------------------------- item 7
@pytest.mark.parametrize(
    ("kwargs", "field"),
    [
        ({"eviction": "bogus"}, "eviction"),
        ({"eviction": "bogus", "cache": "hash"}, "eviction"),
        ({"device": "banana"}, "device"),
        ({"device": 3}, "device"),
        ({"seed": -1}, "seed"),
        ({"block_size": 0}, "block_size"),
        ({"schedule_policy": "random"}, "schedule_policy"),
    ],
)
def test_engine_config_errors_name_the_field_and_value(kwargs, field):
    with pytest.raises(ValueError, match=field) as info:
        EngineConfig(**kwargs)
    assert repr(next(iter(kwargs.values()))) in str(info.value) or field == "eviction"


def test_engine_config_stores_numpy_ints_as_ints_and_refuses_bools():
    """One rule for every int field (radixkv.checks): a numpy int is an int, a bool is not."""
    cfg = EngineConfig(block_size=np.int64(8), num_blocks=np.int32(16), seed=np.uint8(3))
    assert (cfg.block_size, cfg.num_blocks, cfg.seed) == (8, 16, 3)
    assert all(type(v) is int for v in (cfg.block_size, cfg.num_blocks, cfg.seed))
    with pytest.raises(ArgumentTypeError, match=r"^block_size must be a positive int, got True$"):
        EngineConfig(block_size=True)
    with pytest.raises(ArgumentTypeError, match=r"^cuda_graphs must be a bool, got 1$"):
        EngineConfig(cuda_graphs=1)


@pytest.mark.skipif(torch.cuda.is_available(), reason="CUDA is present")
def test_cuda_device_without_cuda_is_a_config_error():
    with pytest.raises(ValueError, match="CUDA is not available"):
        EngineConfig(device="cuda")


@pytest.mark.parametrize(
    ("kwargs", "shown"),
    [
        ({"top_p": None}, "top_p must be a finite number, got None"),
        ({"top_p": 0.0}, "top_p must be a number in (0, 1], got 0.0"),
        ({"temperature": "hot"}, "temperature must be a non-negative number, got 'hot'"),
        ({"temperature": float("nan")}, "temperature must be a non-negative number, got nan"),
        ({"max_new_tokens": 2.5}, "max_new_tokens must be a positive int, got 2.5"),
        (
            {"seed": "7"},
            f"seed must be an int in [{-(2**63)}, {2**64 - 1}] or None, got '7'",
        ),
        ({"stop_token_ids": 5}, "stop_token_ids must be a sequence of ints, got 5"),
        ({"stop_token_ids": "ab"}, "stop_token_ids must be a sequence of ints, got 'ab'"),
        ({"stop_token_ids": [1, -2]}, "stop_token_ids[1] must be a non-negative int, got -2"),
    ],
)
def test_sampling_params_errors_name_the_field_and_value(kwargs, shown):
    with pytest.raises(ValueError) as info:
        SamplingParams(**kwargs)
    assert str(info.value) == shown


def test_params_of_the_wrong_type_are_refused_not_iterated(model):
    engine = engine_of(model)
    with pytest.raises(TypeError, match="params must be SamplingParams"):
        engine.generate([[1, 2]], {"max_new_tokens": 3})
    with pytest.raises(TypeError, match="params must be SamplingParams"):
        engine.add_request([1, 2], {"max_new_tokens": 3})
    with pytest.raises(TypeError, match=r"params\[1\]"):
        engine.generate([[1, 2], [3]], [SamplingParams(), {"max_new_tokens": 3}])
    assert not engine.scheduler.has_unfinished()


# ------------------------------------------------------------- all of it, at random
@pytest.fixture(scope="module")
def flaky():
    return flaky_model()


@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    ops=st.lists(
        st.one_of(
            st.tuples(
                st.just("add"),
                st.lists(st.integers(0, 70), min_size=1, max_size=14),
                st.integers(1, 6),
                st.sampled_from([None, "a", "b"]),
            ),
            st.tuples(st.just("abort"), st.integers(0, 20)),
            st.tuples(st.just("step"), st.integers(1, 3)),
        ),
        max_size=30,
    )
)
def test_any_mix_of_requests_aborts_and_failures_leaves_the_engine_whole(flaky, ops):
    """Random prompts (some outside the vocabulary, some poisoned), aborts and steps: every
    step leaves reference conservation intact, and draining returns every block."""
    engine = engine_of(flaky, num_blocks=24, max_num_seqs=3, max_num_batched_tokens=16)
    ids: list[int] = []
    for op in ops:
        if op[0] == "add":
            _, prompt, n, ns = op
            try:
                ids.append(engine.add_request(prompt, SamplingParams(max_new_tokens=n), ns))
            except ValueError:
                assert max(prompt) >= CFG.vocab_size
        elif op[0] == "abort":
            if ids:
                engine.abort_request(ids[op[1] % len(ids)])
        else:
            for _ in range(op[1]):
                if engine.scheduler.has_unfinished():
                    for req in engine.step():
                        assert req.finish_reason is not None
                        if req.finish_reason is FinishReason.ERROR:
                            assert "poisoned batch" in req.error
                    engine.check()
    drain(engine)
    assert_nothing_held(engine)


# ----------------------------------------------------------------- issue 21, item 5
@pytest.mark.parametrize("bad", ["\ud800", ("tenant", "\udfff")], ids=["str", "tuple"])
def test_a_namespace_the_event_hasher_cannot_encode_is_refused_before_queueing(model, bad):
    """With events on (sha256_cbor, the fleet's default), a namespace holding a lone
    surrogate (legal JSON) is a ValueError naming it at add_request, not a corrupt cache
    at the request's first insert."""
    pytest.importorskip("cbor2")
    engine = Engine(
        model, EngineConfig(num_blocks=64, block_size=4), events=ChainHasher("sha256_cbor")
    )
    prompt = list(range(1, 18))
    params = SamplingParams(max_new_tokens=2)
    with pytest.raises(ValueError, match=r"^namespace .*sha256_cbor") as err:
        engine.add_request(prompt, params, namespace=bad)
    assert ascii(bad) in str(err.value)
    with pytest.raises(ValueError, match="namespace"):  # one bad namespace: none queued
        engine.generate([prompt, prompt], params, namespace=["ok", bad])
    assert not engine.scheduler.has_unfinished()
    engine.check()
    [a] = engine.generate([prompt], params, namespace="ok")
    [b] = engine.generate([prompt], params, namespace="ok")
    assert b.stats.cached_tokens == 16 and a.output_ids == b.output_ids
    assert engine.cache.take_events()
    assert_nothing_held(engine)


def test_a_tiny_temperature_samples_the_greedy_token():
    """Dividing unshifted logits by 5e-324 overflowed to inf and the softmax to NaN: a failed
    step (found through the server, issue 21). Shifted by the top logit it is the argmax."""
    from model_helpers import ENGINE_CONFIG

    from radixkv.engine import Engine, EngineConfig, SamplingParams
    from radixkv.model import random_model

    model = random_model(ENGINE_CONFIG, seed=0)
    prompt = list(range(1, 20))
    greedy = Engine(model, EngineConfig(block_size=4, num_blocks=64)).generate(
        [prompt], SamplingParams(max_new_tokens=6)
    )[0]
    for temperature in (5e-324, 1e-300):
        engine = Engine(model, EngineConfig(block_size=4, num_blocks=64))
        [out] = engine.generate(
            [prompt], SamplingParams(max_new_tokens=6, temperature=temperature, seed=3)
        )
        assert out.finish_reason == "length" and out.error is None
        assert out.output_ids == greedy.output_ids


def test_stop_tokens_are_looked_up_as_a_set():
    from radixkv.engine import SamplingParams

    params = SamplingParams(stop_token_ids=[5, 9, 5])
    assert params.stop_token_ids == (5, 9, 5)
    assert params.is_stop(9) and params.is_stop(5) and not params.is_stop(4)
