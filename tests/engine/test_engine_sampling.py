"""The engine's sampler (issue 24, item 3): vLLM's sampling parameters, batched.

Known answers on the engine's own logits: a recording sampler keeps every step's
logits and each request's state before the pick, and a plain numpy reference applies
logit_bias, min_tokens, the repetition / frequency / presence penalties, temperature,
min_p, top-k and top-p to them; the engine's picks must be the reference's (greedy)
or lie where the reference allows (sampled). Seeded requests repeat whatever runs
beside them; requests using none of the new parameters pick exactly as before (the
argmax of the raw logits; cache on == off); logprobs are the raw model's.
"""

from __future__ import annotations

import dataclasses
import math
import pickle

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import radixkv.engine.engine as engine_module
from radixkv.engine import Engine, EngineConfig
from radixkv.engine.request import Request, SamplingParams
from radixkv.engine.sampler import Sampler
from radixkv.model import ModelConfig, random_model

torch.set_num_threads(1)

CFG = ModelConfig(
    vocab_size=96,
    hidden_size=32,
    intermediate_size=64,
    num_layers=2,
    num_heads=2,
    num_kv_heads=1,
    head_dim=16,
)
PROMPTS = [list(range(5, 5 + n)) for n in (7, 13, 21)]


@pytest.fixture(scope="module")
def model():
    return random_model(CFG, seed=3)


class Recorder(Sampler):
    """A sampler that keeps, per step, the logits and each sampling request's id, outputs
    and prompt as they were before the pick, and the picks."""

    def __init__(self) -> None:
        self.steps: list[tuple[np.ndarray, list, list]] = []

    def sample(self, logits, reqs, generators):
        before = [
            None if r is None else (r.request_id, list(r.output_ids), r.prompt.tolist())
            for r in reqs
        ]
        picks = super().sample(logits, reqs, generators)
        self.steps.append((logits.double().cpu().numpy().copy(), before, picks))
        return picks

    def rows(self, request_id: int):
        """``(logits row, outputs before, prompt, pick)`` of one request, step by step."""
        for logits, before, picks in self.steps:
            for k, b in enumerate(before):
                if b is not None and b[0] == request_id:
                    yield logits[k], b[1], b[2], picks[k]


def engine_of(model, **kw) -> tuple[Engine, Recorder]:
    kw.setdefault("num_blocks", 128)
    kw.setdefault("block_size", 4)
    engine = Engine(model, EngineConfig(**kw))
    recorder = Recorder()
    engine.sampler = recorder
    return engine, recorder


def adjusted(row: np.ndarray, params: SamplingParams, out: list[int], prompt: list[int]):
    """vLLM's adjustments of one row, in numpy: bias, min_tokens, then the penalties."""
    x = row.astype(np.float64).copy()
    for t, b in params.logit_bias:
        x[t] += b
    if len(out) < params.min_tokens:
        x[list(params.stop_token_ids)] = -np.inf
    counts = np.bincount(np.asarray(out, dtype=np.int64), minlength=len(x)).astype(np.float64)
    rep = params.repetition_penalty
    if rep != 1.0:
        hit = (counts > 0) | np.isin(np.arange(len(x)), prompt)
        x = np.where(hit, np.where(x > 0, x / rep, x * rep), x)
    return x - params.frequency_penalty * counts - params.presence_penalty * (counts > 0)


def truncated(x: np.ndarray, params: SamplingParams) -> tuple[np.ndarray, np.ndarray]:
    """The token ids by probability, descending (stable), and their probabilities at the
    temperature after min_p, top-k and top-p (zero where dropped; not renormalised)."""
    z = (x - x.max()) / params.temperature
    p = np.exp(z - np.log(np.exp(z).sum()))
    allowed = p >= params.min_p * p.max()
    p = np.where(allowed, p, 0.0)
    order = np.argsort(-p, kind="stable")
    ps = p[order]
    if params.top_k:
        ps[params.top_k :] = 0.0
    before = np.cumsum(ps) - ps
    ps = np.where(before < params.top_p * ps.sum(), ps, 0.0)
    return order, ps


def kept(x: np.ndarray, params: SamplingParams) -> np.ndarray:
    """The tokens sampling may pick from adjusted logits ``x``: min_p, top-k, top-p."""
    order, ps = truncated(x, params)
    return order[ps > 0]


# ------------------------------------------------------------- known answers, greedy
@settings(max_examples=25, deadline=None)
@given(
    rep=st.sampled_from([1.0, 0.5, 1.3, 2.0]),
    freq=st.sampled_from([0.0, 0.7, -0.5, 2.0]),
    pres=st.sampled_from([0.0, 1.0, -1.5]),
    bias=st.lists(
        st.tuples(st.integers(0, 95), st.floats(-100, 100, width=32, allow_subnormal=False)),
        max_size=4,
    ),
    min_tokens=st.integers(0, 6),
)
def test_greedy_adjustments_equal_the_reference_on_the_same_logits(
    model, rep, freq, pres, bias, min_tokens
) -> None:
    engine, rec = engine_of(model)
    [plain] = engine.generate([PROMPTS[0]], SamplingParams(8))
    params = SamplingParams(
        8,
        repetition_penalty=rep,
        frequency_penalty=freq,
        presence_penalty=pres,
        logit_bias=bias,
        min_tokens=min_tokens,
        stop_token_ids=(plain.output_ids[0], plain.output_ids[1]),
    )
    ids = [engine.add_request(p, params) for p in PROMPTS]
    while engine.scheduler.has_unfinished():
        engine.step()
    for rid in ids:
        rows = list(rec.rows(rid))
        assert rows
        for row, out, prompt, pick in rows:
            x = adjusted(row, params, out, prompt)
            assert pick == int(np.argmax(x)), (rid, out)
            if len(out) < min_tokens:
                assert pick not in params.stop_token_ids


def test_plain_requests_pick_the_raw_argmax_and_report_raw_logprobs(model) -> None:
    """A request using none of the new parameters picks exactly as before: the argmax of the
    raw logits (ties to the lowest id), with the raw log-softmax as its logprob; beside
    requests that adjust theirs, in the same batch."""
    engine, rec = engine_of(model)
    plain = [engine.add_request(p, SamplingParams(6)) for p in PROMPTS]
    engine.add_request(PROMPTS[1], SamplingParams(6, repetition_penalty=1.8, logit_bias={7: 5}))
    done = {}
    while engine.scheduler.has_unfinished():
        done.update({r.request_id: r for r in engine.step()})
    for rid in plain:
        rows = list(rec.rows(rid))
        for (row, _, _, pick), lp in zip(rows, done[rid].logprobs, strict=True):
            assert pick == int(np.argmax(row))
            logp = torch.log_softmax(torch.tensor(row, dtype=torch.float32), dim=-1)
            assert lp == pytest.approx(float(logp[pick]), abs=1e-6)


@pytest.mark.parametrize("cache", [None, "radix"])
def test_cache_on_equals_cache_off_with_penalties(model, cache) -> None:
    params = SamplingParams(10, repetition_penalty=1.4, presence_penalty=0.5, logit_bias={9: 3.0})
    prompts = [PROMPTS[2], PROMPTS[2][:-3] + [1, 2, 3], PROMPTS[2]]
    want = [
        c.output_ids
        for c in Engine(model, EngineConfig(num_blocks=128, block_size=4, cache=None)).generate(
            prompts, params
        )
    ]
    engine = Engine(model, EngineConfig(num_blocks=128, block_size=4, cache=cache))
    assert [c.output_ids for c in engine.generate(prompts, params)] == want


# ------------------------------------------------------------ sampled
@pytest.mark.parametrize("seed", range(6))
def test_top_k_one_and_min_p_one_are_greedy_at_any_temperature(model, seed) -> None:
    """The issue's example: ``top_k: 1`` at temperature 2 gave a different text per seed."""
    engine, _ = engine_of(model)
    [greedy] = engine.generate([PROMPTS[1]], SamplingParams(10))
    for params in (
        SamplingParams(10, temperature=2.0, top_k=1, seed=seed),
        SamplingParams(10, temperature=2.0, min_p=1.0, seed=seed),
    ):
        [c] = engine.generate([PROMPTS[1]], params)
        assert c.output_ids == greedy.output_ids


@pytest.mark.parametrize(
    "params",
    [
        SamplingParams(12, temperature=1.5, top_k=3, seed=1),
        SamplingParams(12, temperature=1.5, min_p=0.2, seed=2),
        SamplingParams(12, temperature=1.0, top_p=0.6, seed=3),
        SamplingParams(12, temperature=1.2, top_k=5, top_p=0.8, min_p=0.05, seed=4),
        SamplingParams(12, temperature=0.9, top_k=4, repetition_penalty=1.5, seed=5),
    ],
    ids=["top_k", "min_p", "top_p", "all three", "top_k+penalty"],
)
def test_sampled_tokens_lie_where_the_reference_allows(model, params) -> None:
    engine, rec = engine_of(model)
    ids = [engine.add_request(p, params) for p in PROMPTS]
    while engine.scheduler.has_unfinished():
        engine.step()
    for rid in ids:
        for row, out, prompt, pick in rec.rows(rid):
            assert pick in kept(adjusted(row, params, out, prompt), params), (rid, out)


@pytest.mark.parametrize(
    "params",
    [
        SamplingParams(12, temperature=0.6, seed=21),
        SamplingParams(12, temperature=1.7, seed=22),
        SamplingParams(12, temperature=1.5, top_k=3, min_p=0.05, seed=23),
        SamplingParams(12, temperature=1.2, top_p=0.8, presence_penalty=0.5, seed=24),
    ],
    ids=["cold", "hot", "top_k+min_p", "top_p+penalty"],
)
def test_sampled_tokens_are_the_inverse_cdf_of_the_requests_own_uniforms(model, params) -> None:
    """Known answers for sampled rows: each pick is the reference's inverse-CDF pick (the
    token whose cumulative mass first exceeds ``u`` times the kept mass, over the tokens
    sorted when the row truncates, by id when not) at the uniform ``u`` the request's own
    generator (seeded ``params.seed``) draws that step. A temperature, truncation or draw
    handled wrongly picks another token at some step."""
    engine, rec = engine_of(model)
    rid = engine.add_request(PROMPTS[2], params)
    while engine.scheduler.has_unfinished():
        engine.step()
    gen = torch.Generator().manual_seed(params.seed)
    rows = list(rec.rows(rid))
    assert len(rows) == 12
    for row, out, prompt, pick in rows:
        u = torch.rand((), generator=gen, dtype=torch.float64).item()
        order, ps = truncated(adjusted(row, params, out, prompt), params)
        if not params.truncates:  # the sampler sorts only rows that truncate
            by_id = np.empty_like(ps)
            by_id[order] = ps
            order, ps = np.arange(len(ps)), by_id
        cdf = np.cumsum(ps)
        k = min(int(np.searchsorted(cdf, u * cdf[-1], side="right")), len(cdf) - 1)
        assert pick == order[k], (out, u)


def test_top_k_samples_more_than_one_token_when_allowed(model) -> None:
    """top_k = 3 at a high temperature is not silently greedy: over seeds, several texts."""
    engine, _ = engine_of(model)
    params = [SamplingParams(6, temperature=2.0, top_k=3, seed=s) for s in range(12)]
    outs = {tuple(engine.generate([PROMPTS[0]], p)[0].output_ids) for p in params}
    assert len(outs) > 1


def test_seeded_requests_repeat_whatever_runs_beside_them(model) -> None:
    params = [
        SamplingParams(10, temperature=1.3, top_k=6, seed=11),
        SamplingParams(10, temperature=0.8, min_p=0.1, repetition_penalty=1.2, seed=12),
        SamplingParams(10, temperature=1.1, top_p=0.9, frequency_penalty=0.5, seed=13),
        SamplingParams(10, temperature=1.0, seed=14, logit_bias={3: 2.0}),
    ]
    alone = [
        engine_of(model)[0].generate([p], [sp])[0].output_ids
        for p, sp in zip(PROMPTS + [PROMPTS[0]], params, strict=True)
    ]
    for budget in (512, 8):  # all in one batch; chunked prefill mixing them step by step
        engine, _ = engine_of(model, max_num_batched_tokens=budget)
        together = engine.generate(PROMPTS + [PROMPTS[0]], params)
        assert [c.output_ids for c in together] == alone


def test_unseeded_sampled_requests_each_draw_their_own_samples() -> None:
    """Requests without a seed get each its own generator (the engine's seed and the
    arrival order): n forks of one prompt, and the same prompt in a later call, sample
    different outputs; a fresh engine with the same seed repeats them, another seed not.

    Why equal outputs cannot happen by chance: with an untied head of small weights the
    logits of any context lie in a range ``R`` bounded by the weights (the final RMSNorm's
    output has norm at most ``max|norm weight| * sqrt(hidden)``), so at temperature 1 no
    token has probability above ``p = 1 / (1 + (vocab - 1) e^-R)`` (~0.09 here). Two
    independent 20-token samples are equal with probability at most ``p**20`` (< 1e-20);
    over the 10 pairs below, < 1e-19.
    """
    flat = random_model(dataclasses.replace(CFG, tie_word_embeddings=False), seed=3, std=0.02)
    head = flat.lm_head.weight.detach().double()
    scale = flat.norm.weight.detach().double().abs().max().item() * math.sqrt(CFG.hidden_size)
    spread = 2 * head.norm(dim=1).max().item() * scale
    p_max = 1 / (1 + (CFG.vocab_size - 1) * math.exp(-spread))
    assert p_max**20 < 1e-20  # the premise of the argument above
    params = SamplingParams(20, temperature=1.0)
    engine, _ = engine_of(flat)
    forks = [c.output_ids for c in engine.generate([PROMPTS[0]] * 4, params)]
    [later] = engine.generate([PROMPTS[0]], params)
    assert len({tuple(o) for o in [*forks, later.output_ids]}) == 5
    again = engine_of(flat)[0].generate([PROMPTS[0]] * 4, params)
    assert [c.output_ids for c in again] == forks
    other = engine_of(flat, seed=1)[0].generate([PROMPTS[0]] * 4, params)
    assert not {tuple(c.output_ids) for c in other} & {tuple(o) for o in forks}


def test_min_tokens_holds_back_the_stop_tokens(model) -> None:
    engine, _ = engine_of(model)
    [free] = engine.generate([PROMPTS[0]], SamplingParams(12))
    stop = free.output_ids[0]
    [short] = engine.generate([PROMPTS[0]], SamplingParams(12, stop_token_ids=(stop,)))
    assert short.output_ids == [stop] and short.finish_reason == "stop"
    [held] = engine.generate([PROMPTS[0]], SamplingParams(12, stop_token_ids=(stop,), min_tokens=4))
    assert len(held.output_ids) >= 4 and stop not in held.output_ids[:4]


@pytest.mark.parametrize("min_tokens", [0, 1, 3, 4])
def test_a_stop_token_may_end_the_output_once_min_tokens_exist(model, min_tokens) -> None:
    """The boundary of ``min_tokens``: a stop token the logits force is masked while fewer
    than ``min_tokens`` tokens exist and picked as soon as that many do, so the output is
    ``min_tokens`` other tokens, then the stop token."""
    stop = 42
    params = SamplingParams(
        12, stop_token_ids=(stop,), logit_bias={stop: 100.0}, min_tokens=min_tokens
    )
    engine, _ = engine_of(model)
    [c] = engine.generate([PROMPTS[0]], params)
    assert c.finish_reason == "stop" and len(c.output_ids) == min_tokens + 1
    assert c.output_ids[-1] == stop and stop not in c.output_ids[:-1]


def test_logit_bias_forces_and_forbids(model) -> None:
    engine, _ = engine_of(model)
    [free] = engine.generate([PROMPTS[1]], SamplingParams(6))
    [forced] = engine.generate([PROMPTS[1]], SamplingParams(6, logit_bias={42: 100.0}))
    assert forced.output_ids == [42] * 6
    banned = dict.fromkeys(free.output_ids, -100.0)
    [other] = engine.generate([PROMPTS[1]], SamplingParams(6, logit_bias=banned))
    assert not set(other.output_ids) & set(free.output_ids)


class Unreadable(tuple):
    """A tuple that may be counted but not read: a step that iterates it fails."""

    def __iter__(self):
        raise AssertionError("a step iterated a per-request list")

    def __getitem__(self, item):
        raise AssertionError("a step indexed a per-request list")


def test_a_steps_host_work_does_not_read_the_bias_or_stop_lists() -> None:
    """The issue's example: a full-vocabulary logit_bias (and, smaller, stop_token_ids under
    min_tokens) was turned from Python pairs into tensors at every step, for every fork:
    seconds per step with n 16. Now each request's tensors are built the first time it
    samples and kept on it; later steps index them and never read the lists again."""
    vocab = CFG.vocab_size
    bias = {t: float(t % 7) - 3.0 for t in range(vocab)}
    stops = tuple(range(0, vocab, 3))
    params = SamplingParams(
        8, temperature=1.0, logit_bias=bias, min_tokens=6, stop_token_ids=stops,
        repetition_penalty=1.2,
    )  # fmt: skip
    reqs = [Request(PROMPTS[0], params) for _ in range(3)]
    generators = {r.request_id: torch.Generator().manual_seed(r.request_id) for r in reqs}
    logits = torch.randn(len(reqs), vocab)
    sampler = Sampler()
    for r, t in zip(reqs, sampler.sample(logits, reqs, generators), strict=True):
        r.append_token(t)
    for r in reqs:
        state = r.sampler_state
        assert state is not None
        assert state.bias_ids.tolist() == list(bias) and len(state.bias_values) == vocab
        assert state.stop_ids.tolist() == list(params.stop_token_ids)
        assert state.in_prompt.nonzero()[:, 0].tolist() == sorted(set(PROMPTS[0]))
    object.__setattr__(params, "logit_bias", Unreadable(params.logit_bias))
    object.__setattr__(params, "stop_token_ids", Unreadable(params.stop_token_ids))
    for _ in range(4):
        picks = sampler.sample(logits, reqs, generators)
        for r, t in zip(reqs, picks, strict=True):
            assert t % 3 != 0  # min_tokens holds back the stop ids
            r.append_token(t)


def test_a_forks_copy_keeps_the_checked_lists() -> None:
    """A fork is ``dataclasses.replace(params, seed=...)``: it shares the checked bias and
    stop ids (and the bias's arrays) instead of checking them again, O(entries) per fork."""
    params = SamplingParams(logit_bias={5: 1.0, 2: -1.0}, stop_token_ids=[4, 1])
    fork = dataclasses.replace(params, seed=7)
    assert fork.logit_bias is params.logit_bias and fork.stop_token_ids is params.stop_token_ids
    assert fork.logit_bias == ((2, -1.0), (5, 1.0)) and fork.stop_token_ids == (4, 1)
    ids, values = fork.logit_bias_arrays
    assert ids.tolist() == [2, 5] and values.tolist() == [-1.0, 1.0]
    assert ids.dtype == np.int64 and values.dtype == np.float32 and not ids.flags.writeable
    # a plain tuple given anew is checked as ever
    with pytest.raises(ValueError, match=r"stop_token_ids\[0\] must be a non-negative int"):
        dataclasses.replace(params, stop_token_ids=(-1,))
    with pytest.raises(ValueError, match="logit_bias token id must be a non-negative int"):
        dataclasses.replace(params, logit_bias=((-1, 1.0),))
    assert pickle.loads(pickle.dumps(fork)) == fork


# ------------------------------------------------------------ logprobs
def test_top_logprobs_are_the_raw_distributions_likeliest(model) -> None:
    engine, rec = engine_of(model)
    rid = engine.add_request(PROMPTS[2], SamplingParams(6, temperature=0.7, seed=1, top_logprobs=4))
    done = []
    while engine.scheduler.has_unfinished():
        done += engine.step()
    [req] = done
    assert req.request_id == rid and len(req.top_logprobs) == len(req.output_ids) == 6
    for (row, _, _, pick), top, lp in zip(
        rec.rows(rid), req.top_logprobs, req.logprobs, strict=True
    ):
        logp = torch.log_softmax(torch.tensor(row, dtype=torch.float32), dim=-1).double()
        values, ids = logp.topk(4)
        assert [t for t, _ in top] == ids.tolist()
        assert [v for _, v in top] == pytest.approx(values.tolist(), abs=1e-6)
        assert lp == pytest.approx(float(logp[pick]), abs=1e-6)
    [plain] = engine.generate([PROMPTS[2]], SamplingParams(3))
    assert plain.top_logprobs == []


def test_top_logprobs_of_a_batch_are_each_requests_own_count(model) -> None:
    """Requests asking for different ``top_logprobs`` counts share every step's batch; each
    gets exactly its own count at each position, the same as when it runs alone."""
    counts = (2, 5, 0)
    params = [SamplingParams(6, top_logprobs=k) for k in counts]
    prompts = [list(range(start, start + 9)) for start in (3, 30, 60)]  # no shared prefix
    alone = [engine_of(model)[0].generate([p], [sp])[0] for p, sp in zip(prompts, params)]
    engine, rec = engine_of(model)
    together = engine.generate(prompts, params)
    ids = [c.request_id for c in together]
    assert all(sorted(b[0] for b in before if b) == sorted(ids) for _, before, _ in rec.steps)
    for k, c, a in zip(counts, together, alone, strict=True):
        assert c.output_ids == a.output_ids
        assert len(c.top_logprobs) == (6 if k else 0)
        for top, want in zip(c.top_logprobs, a.top_logprobs, strict=True):
            assert len(top) == k
            assert [t for t, _ in top] == [t for t, _ in want]
            assert [v for _, v in top] == pytest.approx([v for _, v in want], abs=1e-5)


def test_prompt_logprobs_score_the_prompt_without_the_cache(model) -> None:
    engine, _ = engine_of(model)
    prompt = PROMPTS[2]
    engine.generate([prompt], SamplingParams(2))  # cached now: scoring must not read it
    [c] = engine.generate([prompt], SamplingParams(2, prompt_logprobs=3))
    pl = c.prompt_logprobs
    assert pl is not None and len(pl.logprobs) == len(pl.ranks) == len(pl.top) == len(prompt) - 1
    logp = torch.log_softmax(model.forward_dense(torch.tensor(prompt))[:-1].float(), dim=-1)
    for j, (lp, rank, top) in enumerate(zip(pl.logprobs, pl.ranks, pl.top, strict=True)):
        row = logp[j].double().numpy()
        assert lp == pytest.approx(row[prompt[j + 1]], abs=1e-4)  # paged prefill vs dense
        assert rank == 1 + int((row > row[prompt[j + 1]]).sum())
        assert [t for t, _ in top] == np.argsort(-row, kind="stable")[:3].tolist()
    assert engine.score_prompt([7]).logprobs == []


def test_score_prompt_refuses_a_prompt_too_long_to_score_at_once(model, monkeypatch) -> None:
    monkeypatch.setattr(engine_module, "MAX_PROMPT_LOGPROB_ELEMENTS", 10 * CFG.vocab_size)
    engine, _ = engine_of(model)
    with pytest.raises(ValueError, match="score_prompt .* 11 tokens is over the 10"):
        engine.score_prompt(list(range(11)))
    # Requests are scored chunk by chunk in the prefill: no such limit.
    [c] = engine.generate([list(range(11))], SamplingParams(2, prompt_logprobs=0))
    assert c.prompt_logprobs is not None and len(c.prompt_logprobs.logprobs) == 10
    engine.check()


# ------------------------------------------------------------ checks
FLOAT32_TINY = float(np.finfo(np.float32).tiny)
FLOAT32_MAX = float(np.finfo(np.float32).max)
F32 = r" that float32 holds \(0 or a magnitude in \[1.18e-38, 3.4e\+38\]\)"
FINITE_F32 = f"a finite number{F32}"
POSITIVE_F32 = r"a positive number that float32 holds \(a magnitude in \[1.18e-38, 3.4e\+38\]\)"


@pytest.mark.parametrize(
    ("kw", "message"),
    [
        ({"top_k": -1}, "top_k must be a non-negative int, got -1"),
        ({"min_p": 1.5}, r"min_p must be a number in \[0, 1\], got 1.5"),
        ({"repetition_penalty": 0.0}, f"repetition_penalty must be {POSITIVE_F32}, got 0.0"),
        ({"presence_penalty": float("nan")}, f"presence_penalty must be {FINITE_F32}, got nan"),
        ({"frequency_penalty": "x"}, f"frequency_penalty must be {FINITE_F32}, got 'x'"),
        ({"logit_bias": {-1: 1.0}}, "logit_bias token id must be a non-negative int, got -1"),
        ({"logit_bias": [(1, float("inf"))]}, rf"logit_bias\[1\] must be {FINITE_F32}, got inf"),
        ({"logit_bias": "ab"}, "logit_bias must hold"),
        ({"min_tokens": 20}, r"min_tokens must be an int in \[0, 16\], got 20"),
        ({"top_logprobs": -1}, "top_logprobs must be a non-negative int, got -1"),
        ({"prompt_logprobs": 1.5}, "prompt_logprobs must be a non-negative int or None, got 1.5"),
    ],
)
def test_bad_sampling_params_name_the_field(kw, message) -> None:
    with pytest.raises(ValueError, match=message):
        SamplingParams(**kw)


@pytest.mark.parametrize(
    ("kw", "message"),
    [
        ({"repetition_penalty": 1e-40}, f"repetition_penalty must be {POSITIVE_F32}, got 1e-40"),
        ({"repetition_penalty": 1e-300}, f"repetition_penalty must be {POSITIVE_F32}, got 1e-300"),
        ({"repetition_penalty": 1e39}, f"repetition_penalty must be {POSITIVE_F32}, got 1e\\+39"),
        ({"presence_penalty": -1e39}, f"presence_penalty must be {FINITE_F32}, got -1e\\+39"),
        ({"frequency_penalty": 1e-40}, f"frequency_penalty must be {FINITE_F32}, got 1e-40"),
        ({"logit_bias": {3: -1e-45}}, rf"logit_bias\[3\] must be {FINITE_F32}, got -1e-45"),
        ({"logit_bias": {3: 4e38}}, rf"logit_bias\[3\] must be {FINITE_F32}, got 4e\+38"),
    ],
)
def test_floats_the_devices_float32_cannot_hold_are_refused(kw, message) -> None:
    """The issue's example: a repetition penalty of 1e-40 or 1e-300 was accepted, became 0
    in the sampler's float32 tensor, and a sampled request returned an arbitrary token.
    The penalties and bias values, which adjust the float32 logits, are refused below
    float32's smallest normal magnitude (subnormal or 0 there) or above its largest
    (infinity), naming the field; 0 and the range's ends pass. The temperature, top_p and
    min_p act in float64 and take any finite value."""
    with pytest.raises(ValueError, match=message):
        SamplingParams(**kw)
    edge = SamplingParams(
        repetition_penalty=FLOAT32_TINY,
        presence_penalty=-FLOAT32_MAX,
        frequency_penalty=0.0,
        logit_bias={3: FLOAT32_TINY, 4: 0.0},
    )
    assert edge.repetition_penalty == FLOAT32_TINY
    SamplingParams(temperature=5e-324, top_p=1e-300, min_p=1e-300)


def test_a_logit_pushed_past_float32_is_held_at_its_largest(model) -> None:
    """A repetition penalty float32 holds (1e-37) still divides a logit past float32's
    largest: the infinity made the sampled row's probabilities NaN and the pick an
    arbitrary token (the vocabulary's last). Held at float32's largest, the prompt's
    tokens are what sampling picks from."""
    logits = torch.full((1, CFG.vocab_size), -5.0)
    logits[0, 7] = 40.0
    logits[0, 9] = 1.0
    prompt = [7, 8, 9]
    for seed in range(4):
        req = Request(prompt, SamplingParams(4, temperature=1.0, repetition_penalty=1e-37))
        generators = {req.request_id: torch.Generator().manual_seed(seed)}
        [pick] = Sampler().sample(logits, [req], generators)
        assert pick in (7, 9)


def test_token_ids_outside_the_vocabulary_are_refused_before_queueing(model) -> None:
    engine, _ = engine_of(model)
    with pytest.raises(ValueError, match=r"logit_bias token ids \[96\]"):
        engine.add_request([1, 2], SamplingParams(logit_bias={96: 1.0}))
    with pytest.raises(ValueError, match="top_logprobs is 97"):
        engine.add_request([1, 2], SamplingParams(top_logprobs=97))
    assert not engine.scheduler.has_unfinished()


def test_the_vocabularys_last_token_is_in_and_the_next_is_out(model) -> None:
    """The vocabulary bounds of each field, exactly: the last id and the whole vocabulary
    are taken, one past them refused."""
    vocab = CFG.vocab_size
    engine, _ = engine_of(model)
    last = SamplingParams(2, stop_token_ids=(vocab - 1,), logit_bias={vocab - 1: -1.0})
    whole = SamplingParams(2, top_logprobs=vocab, prompt_logprobs=vocab)
    [a, b] = engine.generate([PROMPTS[0], PROMPTS[1]], [last, whole])
    assert len(a.output_ids) >= 1 and all(len(top) == vocab for top in b.top_logprobs)
    assert b.prompt_logprobs is not None and len(b.prompt_logprobs.top[0]) == vocab
    for kw, field in (
        ({"stop_token_ids": (vocab,)}, "stop_token_ids"),
        ({"logit_bias": {vocab: 1.0}}, "logit_bias"),
        ({"top_logprobs": vocab + 1}, "top_logprobs"),
        ({"prompt_logprobs": vocab + 1}, "prompt_logprobs"),
    ):
        with pytest.raises(ValueError, match=field):
            engine.add_request([1, 2], SamplingParams(**kw))
    assert not engine.scheduler.has_unfinished()


def test_requests_carry_their_first_scheduling_time(model) -> None:
    engine, _ = engine_of(model)
    rid = engine.add_request(PROMPTS[0], SamplingParams(2))
    req: Request | None = engine.get(rid)
    assert req is not None and req.scheduled_time is None
    engine.step()
    assert req.scheduled_time is not None and req.scheduled_time >= req.arrival_time
