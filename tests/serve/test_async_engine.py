"""AsyncEngine: the engine on its own thread behind asyncio (radixkv/serve/async_engine.py).

Every test drives a real engine over a tiny random decoder and ends by checking that
nothing per-request is left: no stream awaiting output, no request on the engine
thread, no request in the engine, every block back once the cache lets go.
"""

from __future__ import annotations

import asyncio
import contextlib
import gc
import logging
import threading

import numpy as np
import pytest
from serve_helpers import TINY_CONFIG

from radixkv.cache.events import BlockStored
from radixkv.cache.hashing import ChainHasher
from radixkv.cache.radix import RadixCache
from radixkv.engine import Engine, EngineConfig, SamplingParams
from radixkv.model import random_model
from radixkv.serve import EngineMetrics, RequestOutput
from radixkv.serve.async_engine import AsyncEngine
from radixkv.serve.worker import NO_EVENT_RELAY, EventRelay
from radixkv.text.tokenizer import ByteTokenizer

CFG = TINY_CONFIG
BLOCK_SIZE = 4
NUM_BLOCKS = 256
TIMEOUT = 20.0  # seconds: a bound on every wait, never reached when things work


@pytest.fixture(scope="module")
def model():
    return random_model(CFG, seed=0)


def make_engine(model, **kw) -> Engine:
    kw.setdefault("num_blocks", NUM_BLOCKS)
    kw.setdefault("block_size", BLOCK_SIZE)
    return Engine(model, EngineConfig(**kw), tokenizer=ByteTokenizer())


def prompts(n: int, shared: int = 24, own: int = 9, seed: int = 0) -> list[list[int]]:
    """``n`` prompts sharing a ``shared``-token head (distinct tails)."""
    rng = np.random.default_rng(seed)
    head = rng.integers(0, 256, shared).tolist()
    return [head + rng.integers(0, 256, own).tolist() for _ in range(n)]


def run(coro):
    return asyncio.run(asyncio.wait_for(coro, TIMEOUT))


async def assert_nothing_kept(ae: AsyncEngine) -> None:
    """No per-request state anywhere; every block not cached is free."""
    await ae.check()
    assert ae.num_requests == 0

    def state(engine: Engine) -> tuple:
        alloc = engine.allocator
        return (
            engine.scheduler.has_unfinished(),
            engine.kv_manager.num_requests,
            len(engine._generators),
            alloc.num_free + engine.cache.cached_blocks == alloc.num_blocks,
        )

    assert await ae.call(state) == (False, 0, 0, True)
    assert ae._worker.by_stream == {} and ae._worker.by_engine == {}


async def until(predicate, timeout: float = 5.0) -> None:
    """Wait (bounded) until ``predicate()`` holds."""
    loop = asyncio.get_running_loop()
    end = loop.time() + timeout
    while not predicate():
        assert loop.time() < end, "timed out"
        await asyncio.sleep(0.005)


async def drain(stream) -> list[RequestOutput]:
    return [out async for out in stream]


# ------------------------------------------------------------------ outputs
def test_concurrent_streams_match_engine_generate(model) -> None:
    ps = prompts(12)
    params = SamplingParams(max_new_tokens=10)
    want = [c.output_ids for c in make_engine(model).generate(ps, params)]

    async def main() -> None:
        async with AsyncEngine(make_engine(model)) as ae:
            results = await asyncio.gather(*(drain(ae.generate(p, params)) for p in ps))
            for outs, expected in zip(results, want, strict=True):
                assert outs[-1].finished and outs[-1].finish_reason == "length"
                assert not any(o.finished for o in outs[:-1])
                assert outs[-1].output_ids == expected
                assert sum((o.new_token_ids for o in outs), []) == expected
                assert all(o.prompt_tokens == len(ps[0]) for o in outs)
            # the shared head was computed once: later requests found it cached
            cached = [outs[-1].cached_tokens for outs in results]
            assert sum(c > 0 for c in cached) >= len(ps) - 1
            await assert_nothing_kept(ae)

    run(main())


def test_slow_consumer_gets_merged_outputs(model) -> None:
    async def main() -> None:
        async with AsyncEngine(make_engine(model)) as ae:
            stream = ae.generate(prompts(1)[0], SamplingParams(max_new_tokens=20))
            first = await stream.__anext__()
            await until(lambda: ae.metrics().running == 0)  # the engine finished meanwhile
            rest = await drain(stream)
            assert len(rest) == 1 and rest[0].finished
            assert first.new_token_ids + rest[0].new_token_ids == rest[0].output_ids
            assert len(rest[0].output_ids) == 20
            await assert_nothing_kept(ae)

    run(main())


def test_sampled_requests_with_a_seed_repeat(model) -> None:
    params = SamplingParams(max_new_tokens=8, temperature=0.8, top_p=0.9, seed=7)

    async def main() -> None:
        async with AsyncEngine(make_engine(model)) as ae:
            p = prompts(1)[0]
            a, b = await asyncio.gather(
                drain(ae.generate(p, params)), drain(ae.generate(p, params))
            )
            assert a[-1].output_ids == b[-1].output_ids
            await assert_nothing_kept(ae)

    run(main())


# ------------------------------------------------------------- validation
@pytest.mark.parametrize(
    ("prompt", "params", "namespace", "error", "match"),
    [
        ("abc", SamplingParams(), None, TypeError, "prompt: tokens must be"),
        ([], SamplingParams(), None, ValueError, "prompt must hold"),
        ([1, -1], SamplingParams(), None, ValueError, "prompt token ids must be >= 0"),
        ([1.5], SamplingParams(), None, TypeError, r"prompt: tokens\[0\] must be an int"),
        ([1, 259], SamplingParams(), None, ValueError, r"token id 259.*vocab_size 259"),
        ([1], SamplingParams(stop_token_ids=(300,)), None, ValueError, r"stop_token_ids.*300"),
        ([1] * 1000, SamplingParams(max_new_tokens=100), None, ValueError, "max_new_tokens"),
        ([1], {"max_new_tokens": 3}, None, TypeError, "params must be SamplingParams"),
        ([1], SamplingParams(), ["unhashable"], TypeError, "namespace|unhashable"),
        ([1], SamplingParams(), float("nan"), ValueError, "namespace|equal"),
    ],
)
def test_bad_requests_raise_before_anything_is_queued(
    model, prompt, params, namespace, error, match
) -> None:
    async def main() -> None:
        async with AsyncEngine(make_engine(model)) as ae:
            with pytest.raises(error, match=match):
                ae.generate(prompt, params, namespace)
            assert ae.num_requests == 0
            await assert_nothing_kept(ae)
            assert ae.metrics().requests_finished == 0
            # and it still serves
            outs = await drain(ae.generate([1, 2, 3], SamplingParams(max_new_tokens=2)))
            assert outs[-1].finished

    run(main())


def test_a_namespace_the_cache_cannot_encode_is_refused_by_generate(model) -> None:
    """The engine's one check of a request covers the cache's namespace check: a namespace
    the cache's hasher cannot encode raises from ``generate`` itself, nothing queued (not
    later, from the stream, after the request reached the engine thread)."""

    pytest.importorskip("cbor2")

    async def main() -> None:
        engine = Engine(
            model,
            EngineConfig(num_blocks=NUM_BLOCKS, block_size=BLOCK_SIZE),
            events=ChainHasher("sha256_cbor"),
        )
        async with AsyncEngine(engine) as ae:
            with pytest.raises(ValueError, match=r"^namespace .*sha256_cbor"):
                ae.generate([1, 2, 3], SamplingParams(max_new_tokens=2), "salt\udfff")
            assert ae.num_requests == 0
            outs = await drain(ae.generate([1, 2, 3], SamplingParams(max_new_tokens=2), "ok"))
            assert outs[-1].finished
            await assert_nothing_kept(ae)

    run(main())


def test_max_new_tokens_is_what_the_pool_holds(model) -> None:
    async def main() -> None:
        async with AsyncEngine(make_engine(model, num_blocks=8)) as ae:  # 32 tokens
            # prompt plus max_new_tokens within max_model_len, the 32 tokens the pool holds
            assert ae.max_new_tokens(10) == 22
            assert ae.max_new_tokens(31) == 1 and ae.max_new_tokens(32) == 0
            outs = await drain(ae.generate(list(range(10)), SamplingParams(max_new_tokens=22)))
            assert len(outs[-1].output_ids) == 22
            with pytest.raises(ValueError, match="leaves room for 22 within max_model_len 32"):
                ae.generate(list(range(10)), SamplingParams(max_new_tokens=23))
            await assert_nothing_kept(ae)

    run(main())


def test_generate_needs_the_loop_it_serves(model) -> None:
    ae = AsyncEngine(make_engine(model))
    with pytest.raises(RuntimeError):  # no running loop
        ae.generate([1, 2], SamplingParams())

    async def start() -> None:
        await ae.start()

    async def other() -> None:
        with pytest.raises(RuntimeError, match="another event loop"):
            ae.generate([1, 2], SamplingParams())

    loop = asyncio.new_event_loop()
    try:
        loop.run_until_complete(start())
        asyncio.run(other())
        loop.run_until_complete(ae.shutdown())
    finally:
        loop.close()
    assert not ae.is_running


def test_constructor_checks_its_arguments(model) -> None:
    with pytest.raises(TypeError, match="engine must be an Engine"):
        AsyncEngine(model)
    with pytest.raises(TypeError, match="event_sink"):
        AsyncEngine(make_engine(model), event_sink=42)


# ------------------------------------------------------------------ aborts
LONG = SamplingParams(max_new_tokens=400)  # far more steps than any test waits for


@pytest.mark.parametrize("how", ["aclose", "break", "cancel", "abort"])
def test_a_request_whose_consumer_leaves_is_aborted(model, how: str) -> None:
    async def main() -> None:
        async with AsyncEngine(make_engine(model)) as ae:
            other = asyncio.create_task(drain(ae.generate(prompts(1)[0], SamplingParams())))
            stream = ae.generate(prompts(1, seed=1)[0], LONG)
            if how == "aclose":
                await stream.__anext__()
                await stream.aclose()
                await stream.aclose()  # idempotent
            elif how == "break":
                async for _ in stream:
                    break
                del stream  # dropped without aclose: garbage collection aborts it
                gc.collect()
            elif how == "cancel":
                started = asyncio.Event()

                async def consume() -> None:
                    async for _ in stream:
                        started.set()

                task = asyncio.create_task(consume())
                await started.wait()
                task.cancel()
                with contextlib.suppress(asyncio.CancelledError):
                    await task
            else:
                first = await stream.__anext__()
                await ae.abort(first.request_id)
                outs = await drain(stream)
                assert outs[-1].finished and outs[-1].finish_reason == "abort"
                assert len(outs[-1].output_ids) < LONG.max_new_tokens
            await until(lambda: ae.metrics().running == 0 and ae.metrics().waiting == 0)
            assert (await other)[-1].finish_reason == "length"  # the neighbour is unaffected
            m = ae.metrics()
            assert m.requests_finished == 2
            assert m.generation_tokens < LONG.max_new_tokens
            await assert_nothing_kept(ae)

    run(main())


def test_abort_of_an_unknown_or_finished_request_is_a_no_op(model) -> None:
    async def main() -> None:
        async with AsyncEngine(make_engine(model)) as ae:
            outs = await drain(ae.generate([1, 2, 3], SamplingParams(max_new_tokens=2)))
            await ae.abort(outs[-1].request_id)
            await ae.abort(12345)
            await assert_nothing_kept(ae)

    run(main())


def test_shutdown_ends_open_streams_with_abort(model) -> None:
    async def main() -> None:
        ae = AsyncEngine(make_engine(model))
        await ae.start()
        streams = [ae.generate(p, LONG) for p in prompts(3)]
        await streams[0].__anext__()
        await ae.shutdown()
        assert not ae.is_running and ae.loop is None
        for s in streams:
            outs = await drain(s)
            assert outs[-1].finished and outs[-1].finish_reason == "abort"
        assert ae.num_requests == 0 and ae._worker.by_stream == {}
        ae.engine.check()
        assert not ae.engine.scheduler.has_unfinished()
        # a stopped AsyncEngine starts again on demand
        outs = await drain(ae.generate([5, 6, 7], SamplingParams(max_new_tokens=2)))
        assert outs[-1].finish_reason == "length"
        await assert_nothing_kept(ae)
        await ae.shutdown()

    run(main())


def test_drain_aborts_open_requests_and_refuses_new_ones(model) -> None:
    """What a server does on SIGINT/SIGTERM (issue 21, item 16): every open stream ends with
    "abort" at once (not after its max_new_tokens), new requests are refused until
    shutdown, and the engine serves again once restarted."""

    async def main() -> None:
        ae = AsyncEngine(make_engine(model))
        ae.drain()  # not running: a no-op
        await ae.start()
        assert ae.is_serving
        streams = [ae.generate(p, LONG) for p in prompts(3)]
        await streams[0].__anext__()
        ae.drain()
        assert ae.is_running and not ae.is_serving
        with pytest.raises(RuntimeError, match="shutting down"):
            ae.generate([1, 2, 3], SamplingParams(max_new_tokens=2))
        for s in streams:
            outs = await drain(s)
            assert outs[-1].finish_reason == "abort"
            assert len(outs[-1].output_ids) < LONG.max_new_tokens
        await assert_nothing_kept(ae)
        await ae.shutdown()
        assert not ae.is_serving
        outs = await drain(ae.generate([5, 6, 7], SamplingParams(max_new_tokens=2)))
        assert outs[-1].finish_reason == "length" and ae.is_serving
        await assert_nothing_kept(ae)
        await ae.shutdown()

    run(main())


# ---------------------------------------------------------- failing steps
POISON = 13


def poisoned_model():
    """A decoder whose forward raises when the batch holds token ``POISON`` (a stand-in for
    a kernel error or an OOM), as in tests/engine/test_engine_hardening.py."""
    m = random_model(CFG, seed=0)
    inner = m.forward

    def forward(batch, kv):
        if bool((batch.input_ids == POISON).any()):
            raise RuntimeError(f"poisoned batch (token {POISON})")
        return inner(batch, kv)

    m.forward = forward
    return m


def test_a_failing_step_ends_its_requests_with_an_error_and_serving_goes_on() -> None:
    async def main() -> None:
        async with AsyncEngine(make_engine(poisoned_model())) as ae:
            bad = await drain(ae.generate([1, 2, POISON, 4], SamplingParams(max_new_tokens=3)))
            assert bad[-1].finish_reason == "error" and "poisoned" in bad[-1].error
            good = await drain(ae.generate([1, 2, 3, 4], SamplingParams(max_new_tokens=3)))
            assert good[-1].finish_reason == "length" and good[-1].error is None
            assert ae.metrics().failed_steps == 1
            assert ae.is_running
            await assert_nothing_kept(ae)

    run(main())


# --------------------------------------------------- events and metrics
def test_event_sink_gets_the_caches_events_on_the_engine_thread(model) -> None:
    received: list[tuple[str, list]] = []

    def sink(events: list) -> None:
        received.append((threading.current_thread().name, events))

    hasher = ChainHasher("xxhash", seed=0)
    engine = Engine(
        model,
        EngineConfig(num_blocks=NUM_BLOCKS, block_size=BLOCK_SIZE),
        cache_factory=lambda alloc: RadixCache(alloc, events=hasher),
    )

    async def main() -> None:
        async with AsyncEngine(engine, event_sink=sink) as ae:
            p = list(range(1, 18))  # four full blocks of prompt
            await drain(ae.generate(p, SamplingParams(max_new_tokens=2)))
            await assert_nothing_kept(ae)

    run(main())
    assert received and all(name == "radixkv-engine" for name, _ in received)
    stored = [e for _, events in received for e in events if isinstance(e, BlockStored)]
    assert stored[0].token_ids == list(range(1, 17))
    root_chain = hasher.hashes(hasher.root, list(range(1, 17)), BLOCK_SIZE)
    assert stored[0].block_hashes == [hasher.wire(d) for d in root_chain]
    assert engine.cache.take_events() == []  # the sink took them all


def test_without_a_sink_the_cache_keeps_its_events(model) -> None:
    engine = Engine(
        model,
        EngineConfig(num_blocks=NUM_BLOCKS, block_size=BLOCK_SIZE),
        cache_factory=lambda alloc: RadixCache(alloc, events=ChainHasher("xxhash", seed=0)),
    )

    async def main() -> None:
        async with AsyncEngine(engine) as ae:  # the do-nothing relay: takes nothing
            await drain(ae.generate(list(range(1, 18)), SamplingParams(max_new_tokens=2)))

    run(main())
    assert any(isinstance(e, BlockStored) for e in engine.cache.take_events())


def test_the_event_relay_hands_over_batches_and_outlives_a_broken_sink(caplog) -> None:
    class Source:
        def __init__(self, *batches: list) -> None:
            self.batches = list(batches)

        def take_events(self) -> list:
            return self.batches.pop(0) if self.batches else []

    got: list[list] = []
    relay = EventRelay(Source([], ["e1", "e2"], ["e3"]), got.append)
    for _ in range(4):
        relay.relay()
    assert got == [["e1", "e2"], ["e3"]]  # an empty batch is not handed over

    def broken(events: list) -> None:
        raise RuntimeError("the publisher is gone")

    source = Source(["e1"], ["e2"])
    relay = EventRelay(source, broken)
    with caplog.at_level(logging.ERROR, logger="radixkv.serve.worker"):
        relay.relay()
        relay.relay()
    assert caplog.text.count("the event sink failed; 1 events dropped") == 2
    assert source.batches == []
    NO_EVENT_RELAY.relay()  # takes and hands over nothing


def test_metrics_follow_the_engine(model) -> None:
    async def main() -> None:
        async with AsyncEngine(make_engine(model)) as ae:
            m0 = ae.metrics()
            assert isinstance(m0, EngineMetrics)
            assert (m0.running, m0.waiting, m0.kv_usage, m0.requests_finished) == (0, 0, 0.0, 0)
            stream = ae.generate(prompts(1)[0], LONG)
            await stream.__anext__()
            m1 = ae.metrics()
            assert m1.running == 1 and m1.kv_usage > 0
            await stream.aclose()
            ps = prompts(4, seed=3)
            await asyncio.gather(
                *(drain(ae.generate(p, SamplingParams(max_new_tokens=4))) for p in ps)
            )
            await until(lambda: ae.metrics().running == 0)
            m2 = ae.metrics()
            assert m2.kv_usage == 0.0  # only the cache holds blocks now
            assert m2.requests_finished == 5
            assert m2.prompt_tokens == 5 * len(ps[0])
            assert m2.generation_tokens >= 16
            assert m2.prefix_cache_queries >= 5 * (len(ps[0]) - 1)
            assert m2.prefix_cache_hits > 0  # the four share their head
            assert m2.failed_steps == 0
            await assert_nothing_kept(ae)

    run(main())
