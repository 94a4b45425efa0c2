"""Prompt logprobs scored in the prefill and kept with cached blocks (issue 24, item 2).

Differential: every request's ``prompt_logprobs`` equal the dense reference
(``Engine.score_prompt``: one forward of the whole prompt, no cache) within the
engine's tolerance, whether its prefix was read from records, computed, chunked,
preempted, or scored with the records off (vLLM's behaviour). And the point of it:
a scoring request over a scored context computes only what follows the context.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from model_helpers import DEVICES, ENGINE_CONFIG, TOL, on_device

from radixkv.engine import Engine, EngineConfig
from radixkv.engine.prompt_scores import TOP_KEPT, BlockScores, PromptScoring
from radixkv.engine.request import PromptLogprobs, SamplingParams
from radixkv.errors import InvariantError
from radixkv.model import random_model

torch.set_num_threads(1)

CONTEXT = [int(t) for t in np.random.default_rng(0).integers(1, 96, 37)]
CONTINUATIONS = [[11, 12, 13], [40, 41], [7, 8, 9, 10, 11], [90]]


@pytest.fixture(scope="module")
def model():
    return random_model(ENGINE_CONFIG, seed=5)


def engine_of(model, **kw) -> Engine:
    kw.setdefault("num_blocks", 128)
    kw.setdefault("block_size", 4)
    return Engine(model, EngineConfig(**kw))


def score(engine: Engine, prompts, top: int = 1) -> list:
    """One request per prompt, run one after another (each sees what the others cached)."""
    return [engine.generate([p], SamplingParams(1, prompt_logprobs=top))[0] for p in prompts]


def assert_matches_dense(engine: Engine, prompt: list[int], got: PromptLogprobs, top: int) -> None:
    ref = engine.score_prompt(prompt, top)
    assert len(got.logprobs) == len(prompt) - 1
    assert got.logprobs == pytest.approx(ref.logprobs, rel=TOL["rtol"], abs=TOL["atol"])
    assert got.ranks == ref.ranks
    assert [[t for t, _ in row] for row in got.top] == [[t for t, _ in row] for row in ref.top]
    for row, ref_row in zip(got.top, ref.top, strict=True):
        assert [v for _, v in row] == pytest.approx(
            [v for _, v in ref_row], rel=TOL["rtol"], abs=TOL["atol"]
        )


# ------------------------------------------------------------ the point
def test_a_scored_context_is_read_not_recomputed(model) -> None:
    engine = engine_of(model)
    prompts = [CONTEXT + c for c in CONTINUATIONS]
    done = score(engine, prompts)
    first, rest = done[0], done[1:]
    assert first.stats.cached_tokens == 0
    bs = engine.config.block_size
    aligned = len(CONTEXT) // bs * bs  # the context's full blocks
    for c, p in zip(rest, prompts[1:], strict=True):
        assert c.stats.cached_tokens == aligned
        assert c.stats.prefill_tokens == len(p) - aligned
    for c, p in zip(done, prompts, strict=True):
        assert c.prompt_logprobs is not None
        assert_matches_dense(engine, p, c.prompt_logprobs, 1)
    assert engine.scorer.num_read_positions == len(rest) * (aligned - 1)
    engine.check()


@pytest.mark.parametrize("device", DEVICES)
def test_records_on_the_model_s_device_give_the_dense_scores(model, device) -> None:
    """On CUDA the hidden states are kept on the GPU and scoring steps leave the CUDA-graph
    runner for the eager one (``GraphRunner.hidden``); the scores are the same."""
    here = on_device(model, device)
    engine = engine_of(here, max_num_batched_tokens=16)
    prompts = [CONTEXT + c for c in CONTINUATIONS]
    done = score(engine, prompts)
    assert [c.stats.cached_tokens for c in done[1:]] == [len(CONTEXT) // 4 * 4] * 3
    for c, p in zip(done, prompts, strict=True):
        assert_matches_dense(engine, p, c.prompt_logprobs, 1)
    engine.check()


def test_the_records_off_recompute_every_prompt_as_vllm_does(model) -> None:
    engine = engine_of(model, prompt_score_cache=False)
    prompts = [CONTEXT + c for c in CONTINUATIONS]
    done = score(engine, prompts)
    assert [c.stats.cached_tokens for c in done] == [0] * len(prompts)
    for c, p in zip(done, prompts, strict=True):
        assert_matches_dense(engine, p, c.prompt_logprobs, 1)
    # The cache itself still serves requests that score nothing.
    [plain] = engine.generate([CONTEXT + [5]], SamplingParams(1))
    assert plain.stats.cached_tokens > 0


def test_records_on_and_off_give_the_same_scores(model) -> None:
    prompts = [CONTEXT + c for c in CONTINUATIONS]
    on = score(engine_of(model), prompts)
    off = score(engine_of(model, prompt_score_cache=False), prompts)
    for a, b in zip(on, off, strict=True):
        assert a.prompt_logprobs.logprobs == pytest.approx(
            b.prompt_logprobs.logprobs, rel=TOL["rtol"], abs=TOL["atol"]
        )
        assert a.prompt_logprobs.ranks == b.prompt_logprobs.ranks
        assert a.output_ids == b.output_ids


def test_a_block_ending_on_a_chunk_s_first_row_is_kept(model) -> None:
    # Chunks of 7 start at 7 and 35: the last positions of blocks 1 (4..7) and 8 (32..35).
    # Those rows are scored in the chunk after the one that computed the rest of the block.
    engine = engine_of(model, max_num_batched_tokens=7)
    first, second = score(engine, [CONTEXT + [11, 12, 13], CONTEXT + [40, 41]])
    aligned = len(CONTEXT) // 4 * 4  # 36: nine blocks, every one of them kept
    assert second.stats.cached_tokens == aligned
    assert engine.scorer.num_read_positions == aligned - 1
    assert_matches_dense(engine, CONTEXT + [40, 41], second.prompt_logprobs, 1)
    engine.check()


def test_a_context_cached_without_scores_is_scored_once_then_read(model) -> None:
    engine = engine_of(model)
    engine.generate([CONTEXT + [3]], SamplingParams(2))  # cached, but nothing scored it
    a, b = score(engine, [CONTEXT + [11, 12], CONTEXT + [40]])
    assert a.stats.cached_tokens == 0  # no records: computed again (onto the cache's blocks)
    assert b.stats.cached_tokens == len(CONTEXT) // 4 * 4
    assert_matches_dense(engine, CONTEXT + [40], b.prompt_logprobs, 1)
    engine.check()


def test_more_top_tokens_than_a_record_keeps_read_no_cached_prefix(model) -> None:
    engine = engine_of(model)
    score(engine, [CONTEXT + [1]])
    [c] = score(engine, [CONTEXT + [2]], top=TOP_KEPT + 2)
    assert c.stats.cached_tokens == 0
    assert_matches_dense(engine, CONTEXT + [2], c.prompt_logprobs, TOP_KEPT + 2)
    [d] = score(engine, [CONTEXT + [3]], top=0)  # fewer than a record keeps: reads
    assert d.stats.cached_tokens > 0
    assert_matches_dense(engine, CONTEXT + [3], d.prompt_logprobs, 0)


def test_requests_that_score_nothing_read_the_whole_prefix(model) -> None:
    engine = engine_of(model)
    score(engine, [CONTEXT + [1]])
    [c] = engine.generate([CONTEXT + [2]], SamplingParams(3))
    assert c.stats.cached_tokens == len(CONTEXT) // 4 * 4
    assert c.prompt_logprobs is None


def test_scores_arrive_with_the_first_token_in_a_batch_of_mixed_requests(model) -> None:
    engine = engine_of(model, max_num_batched_tokens=8)  # chunked prefills, shared steps
    prompts = [CONTEXT + c for c in CONTINUATIONS]
    score(engine, prompts[:1])
    params = [SamplingParams(3, prompt_logprobs=1), SamplingParams(3)] * 2
    done = engine.generate(prompts, params)
    for c, p, sp in zip(done, prompts, params, strict=True):
        if sp.prompt_logprobs is None:
            assert c.prompt_logprobs is None
        else:
            assert_matches_dense(engine, p, c.prompt_logprobs, 1)
    engine.check()


def test_a_one_token_prompt_has_no_scores(model) -> None:
    engine = engine_of(model)
    [c] = score(engine, [[9]])
    assert c.prompt_logprobs == PromptLogprobs([], [], [])


def test_the_hash_cache_reads_records_too(model) -> None:
    engine = engine_of(model, cache="hash")
    prompts = [CONTEXT + c for c in CONTINUATIONS[:2]]
    a, b = score(engine, prompts)
    assert b.stats.cached_tokens == len(CONTEXT) // 4 * 4
    assert_matches_dense(engine, prompts[1], b.prompt_logprobs, 1)


def test_scoring_survives_preemption(model) -> None:
    # A pool too small for all at once: requests are preempted and recomputed.
    engine = engine_of(model, num_blocks=14, max_num_batched_tokens=16)
    prompts = [CONTEXT + c for c in CONTINUATIONS]
    done = engine.generate(prompts, SamplingParams(6, prompt_logprobs=1))
    assert engine.scheduler.num_preemptions > 0
    for c, p in zip(done, prompts, strict=True):
        assert_matches_dense(engine, p, c.prompt_logprobs, 1)
    engine.check()


@settings(
    max_examples=25, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)
@given(
    block_size=st.sampled_from([1, 3, 4, 8]),
    chunk=st.integers(4, 40),
    context_len=st.integers(1, 30),
    tails=st.lists(st.lists(st.integers(0, 95), min_size=0, max_size=6), min_size=1, max_size=4),
    top=st.sampled_from([0, 1, 2]),
    cache=st.sampled_from(["radix", "hash"]),
)
def test_any_mix_of_shared_contexts_scores_as_the_dense_forward(
    model, block_size, chunk, context_len, tails, top, cache
) -> None:
    engine = engine_of(
        model, block_size=block_size, max_num_batched_tokens=chunk, num_blocks=96, cache=cache
    )
    context = CONTEXT[:context_len]
    for tail in tails:
        prompt = context + tail
        [c] = score(engine, [prompt], top)
        assert_matches_dense(engine, prompt, c.prompt_logprobs, top)
    engine.check()


# ------------------------------------------------------------ the store
def record(value: float, bs: int = 2):
    return (
        np.full(bs, value, np.float32),
        np.arange(bs, dtype=np.int32),
        np.full(bs, 7, np.int32),
        np.full(bs, -value, np.float32),
    )


def test_block_scores_find_the_leading_run_and_drop_the_least_recent() -> None:
    store = BlockScores(2, 2, 3, torch.device("cpu"), torch.float32)
    assert store.lookup([b"a"]) == []
    store.put(b"a", record(1.0), torch.ones(3))
    store.put(b"b", record(2.0), torch.full((3,), 2.0))
    rows = store.lookup([b"a", b"b", b"c"])
    assert len(rows) == 2 and len(store) == 2
    logprobs, ranks, top_ids, top_lps = store.read(rows)
    assert logprobs.tolist() == [1.0, 1.0, 2.0, 2.0] and top_lps.tolist()[-1] == -2.0
    assert store.hidden_of(rows[1]).tolist() == [2.0] * 3
    store.lookup([b"a"])  # a is now the most recent
    store.put(b"c", record(3.0), torch.zeros(3))  # b goes
    assert len(store.lookup([b"a"])) == 1 and store.lookup([b"b"]) == []
    assert len(store.lookup([b"c"])) == 1
    store.put(b"c", record(9.0), torch.zeros(3))  # the same tokens again: the record stands
    assert store.read(store.lookup([b"c"]))[0].tolist() == [3.0, 3.0]
    assert store.bytes_per_record == 16 * 2 + 3 * 4 + 16


def test_block_scores_put_of_a_held_record_makes_it_the_most_recent() -> None:
    store = BlockScores(2, 2, 3, torch.device("cpu"), torch.float32)
    store.put(b"a", record(1.0), torch.ones(3))
    store.put(b"b", record(2.0), torch.ones(3))
    store.put(b"a", record(1.0), torch.ones(3))  # scored again: a is now the most recent
    store.put(b"c", record(3.0), torch.zeros(3))  # so b goes, not a (LRU, not FIFO)
    assert store.lookup([b"b"]) == [] and len(store.lookup([b"a"])) == 1
    assert len(store) == 2


def test_a_prompt_scoring_refuses_to_hand_out_unscored_positions() -> None:
    scoring = PromptScoring(np.arange(5), 1, 2)
    with pytest.raises(InvariantError, match=r"positions \[1, 2, 3, 4\] were never scored"):
        scoring.result()
    scoring.fill(record(0.5, bs=4))
    scoring.known[4] = True
    assert scoring.result().logprobs == [0.5, 0.5, 0.5, 0.0]


# ------------------------------------------------------------ through the server
def test_lm_eval_shaped_echo_requests_compute_the_context_once() -> None:
    """lm-eval's loglikelihood request (token ids, ``echo``, ``logprobs: 1``,
    ``max_tokens: 1``): the second choice of a context reads it (``cached_tokens``), and
    its prompt logprobs equal the first-choice-free engine's (records off)."""
    from serve_helpers import TINY_CONFIG, served_engine, tiny_engine

    tiny = random_model(TINY_CONFIG, seed=0)
    context = [int(t) for t in np.random.default_rng(1).integers(3, 200, 40)]
    bodies = [
        {"model": "m", "prompt": context + tail, "echo": True, "logprobs": 1, "max_tokens": 1}
        for tail in ([50, 51, 52], [60, 61])
    ]
    replies = {}
    for keep in (True, False):
        engine = tiny_engine(tiny, num_blocks=64, block_size=4, prompt_score_cache=keep)
        with served_engine(engine, "m") as (server, _):
            replies[keep] = [server.post("/v1/completions", b) for b in bodies]
    for keep, pairs in replies.items():
        assert [status for status, _ in pairs] == [200, 200]
        cached = [r["usage"]["prompt_tokens_details"]["cached_tokens"] for _, r in pairs]
        assert cached == ([0, 40] if keep else [0, 0])
    for (_, on), (_, off) in zip(replies[True], replies[False], strict=True):
        lp_on = on["choices"][0]["logprobs"]["token_logprobs"]
        lp_off = off["choices"][0]["logprobs"]["token_logprobs"]
        assert lp_on[0] is None and lp_off[0] is None
        assert lp_on[1:] == pytest.approx(lp_off[1:], rel=TOL["rtol"], abs=TOL["atol"])
        tops_on = on["choices"][0]["logprobs"]["top_logprobs"]
        tops_off = off["choices"][0]["logprobs"]["top_logprobs"]
        assert tops_on[0] is None and len(tops_on) == len(tops_off)
        for a, b in zip(tops_on[1:], tops_off[1:], strict=True):
            assert a.keys() == b.keys()
            assert list(a.values()) == pytest.approx(
                list(b.values()), rel=TOL["rtol"], abs=TOL["atol"]
            )


def test_a_namespace_reads_only_records_its_own_requests_left(model) -> None:
    engine = engine_of(model)
    salted = SamplingParams(1, prompt_logprobs=1)
    engine.generate([CONTEXT + [1]], salted, namespace="a")  # scored in "a"
    engine.generate([CONTEXT + [2]], SamplingParams(2), namespace="b")  # cached in "b"
    [b1] = engine.generate([CONTEXT + [3]], salted, namespace="b")
    assert b1.stats.cached_tokens == 0  # "b" has the blocks, but not the scores: "a" has
    [b2] = engine.generate([CONTEXT + [4]], salted, namespace="b")
    assert b2.stats.cached_tokens == len(CONTEXT) // 4 * 4
    assert_matches_dense(engine, CONTEXT + [4], b2.prompt_logprobs, 1)
