"""The single server as OpenAI and vLLM define the API (issue 24, items 1, 3 and 4).

Real uvicorn servers on 127.0.0.1 over a tiny random decoder and the byte tokenizer,
checked against ``Engine.generate`` and the model's dense forward on the same weights:

1. prompts as a string, strings, token ids or token-id lists; ``n`` forks sharing
   their prompt's blocks; ``best_of``; choice indices, streamed and whole; usage.
3. sampling parameters reach the engine; logprobs (completions, chat, echo, vLLM's
   prompt_logprobs) equal the model's; chat's ``add_generation_prompt`` and
   ``continue_final_message``; every field radixkv does not implement is a 400
   naming it, every neutral value of one is accepted.
4. ``/v1/models/{id}``, ``/version``, ``/tokenize``, ``/detokenize``; ``max_model_len``
   the model's context; histograms and ``request_success`` in ``/metrics`` under
   either prefix; the host tier's counters.

And the bodies real clients send: lm-evaluation-harness's ``local-completions``
(loglikelihood and generate_until batches), SGLang's ``bench_serving`` and ``vllm
bench serve``, written from what those tools send (they are not installed here).
"""

from __future__ import annotations

import asyncio
import dataclasses
import json
import socket
import subprocess
import sys
import time
from collections.abc import AsyncIterator, Iterator
from pathlib import Path
from typing import Any

import pytest
import torch

pytest.importorskip("fastapi")
pytest.importorskip("uvicorn")

from prometheus_client.parser import text_string_to_metric_families  # noqa: E402
from serve_helpers import (  # noqa: E402
    TIMEOUT,
    TINY_CONFIG,
    Server,
    check_engine,
    served_engine,
    spawn_serve,
    tiny_engine,
    wait_answering,
    wait_idle,
)

from radixkv.engine import Engine, EngineConfig, SamplingParams  # noqa: E402
from radixkv.engine.request import EngineLimits  # noqa: E402
from radixkv.model import random_model  # noqa: E402
from radixkv.serve.app import build_app  # noqa: E402
from radixkv.serve.async_engine import AsyncEngine  # noqa: E402
from radixkv.serve.openai.client import EngineMetrics, RequestOutput  # noqa: E402
from radixkv.serve.openai.handlers import OpenAIHandlers  # noqa: E402
from radixkv.serve.openai.metrics import ServerMetrics  # noqa: E402
from radixkv.serve.openai.protocol import (  # noqa: E402
    NOT_IMPLEMENTED,
    ChatCompletionRequest,
    CompletionRequest,
)
from radixkv.text.stream import TextStream  # noqa: E402
from radixkv.text.tokenizer import (  # noqa: E402
    ByteTokenizer,
    ChatTokenizer,
    context_length,
    load_tokenizer,
    render_chat,
)

BLOCK_SIZE = 4
NUM_BLOCKS = 512
MODEL = "tiny-random"
TOK = ByteTokenizer()
STOPS = TOK.stop_token_ids


@pytest.fixture(scope="module")
def model():
    return random_model(TINY_CONFIG, seed=0)


def make_engine(model, **kw) -> Engine:
    kw.setdefault("num_blocks", NUM_BLOCKS)
    kw.setdefault("block_size", BLOCK_SIZE)
    return tiny_engine(model, **kw)


@pytest.fixture(scope="module")
def served(model) -> Iterator[tuple[Server, AsyncEngine]]:
    with served_engine(make_engine(model), MODEL) as pair:
        yield pair


@pytest.fixture
def server(served) -> Server:
    return served[0]


def reference(model, ids: list[int], max_tokens: int, **kw: Any) -> list[int]:
    """``Engine.generate``'s output for a prompt, stopping where the server does."""
    kw.setdefault("stop_token_ids", STOPS)
    [c] = make_engine(model).generate([ids], SamplingParams(max_new_tokens=max_tokens, **kw))
    return c.output_ids


def dense_logprobs(model, ids: list[int]) -> torch.Tensor:
    """``[len(ids) - 1, vocab]``: the model's log-probabilities after each prefix of ``ids``."""
    logits = model.forward_dense(torch.tensor(ids))
    return torch.log_softmax(logits[:-1].float(), dim=-1).double()


def visible(ids: list[int]) -> str:
    if ids and ids[-1] in STOPS:
        ids = ids[:-1]
    return TOK.decode(ids)


def ok(server: Server, path: str, body: dict) -> dict:
    status, reply = server.post(path, body)
    assert status == 200, reply
    return reply


def error(server: Server, path: str, body: dict, param: str | None) -> str:
    status, reply = server.post(path, body)
    assert status == 400, reply
    err = reply["error"]
    assert err["param"] == param and err["type"] == "invalid_request_error", err
    return err["message"]


CHAT = [{"role": "user", "content": "hi there"}]


# ============================================================ item 1: prompts and choices
PROMPT_FORMS = [
    ("a string", "The radix tree", ["The radix tree"]),
    ("strings", ["The radix", "tree keeps", "x"], ["The radix", "tree keeps", "x"]),
    ("token ids", [5, 6, 7, 8, 9], [[5, 6, 7, 8, 9]]),
    ("token-id lists", [[5, 6, 7], [40, 41, 42, 43, 44, 45], [9]], None),
]


@pytest.mark.parametrize(
    ("form", "prompt", "prompts"), PROMPT_FORMS, ids=[f[0] for f in PROMPT_FORMS]
)
def test_every_prompt_form_gets_n_choices_in_order(model, server, form, prompt, prompts) -> None:
    prompts = prompts if prompts is not None else prompt
    ids = [TOK.encode(p) if isinstance(p, str) else p for p in prompts]
    body = {"prompt": prompt, "n": 2, "max_tokens": 6, "temperature": 0, "return_token_ids": True}
    reply = ok(server, "/v1/completions", body)
    choices = reply["choices"]
    assert [c["index"] for c in choices] == list(range(2 * len(ids)))
    for k, c in enumerate(choices):
        want = reference(model, ids[k // 2], 6)
        assert c["token_ids"] == want, (form, k)
        assert c["text"] == visible(want)
    usage = reply["usage"]
    assert usage["prompt_tokens"] == sum(len(i) for i in ids)  # once per prompt, not per fork
    assert usage["completion_tokens"] == sum(len(c["token_ids"]) for c in choices)


def test_forks_share_their_prompts_blocks(served) -> None:
    """n forks of one prompt: the first computes it, the others hit its blocks."""
    server, ae = served
    wait_idle(ae)
    prompt = [
        int(t) for t in torch.randint(0, 256, (41,), generator=torch.Generator().manual_seed(9))
    ]
    before = ae.metrics()
    body = {"prompt": prompt, "n": 4, "max_tokens": 3, "ignore_eos": True, "cache_salt": "forks"}
    reply = ok(server, "/v1/completions", body)
    assert len(reply["choices"]) == 4
    assert reply["usage"]["prompt_tokens"] == 41 and reply["usage"]["completion_tokens"] == 12
    wait_idle(ae)
    after = ae.metrics()
    full = (41 // BLOCK_SIZE) * BLOCK_SIZE  # the forks hit every full block of the prompt
    assert after.prefix_cache_hits - before.prefix_cache_hits >= 3 * full
    assert after.requests_finished - before.requests_finished == 4
    check_engine(ae)


def test_seeded_forks_are_requests_with_seed_plus_index(model, server) -> None:
    """vLLM's rule: fork i of a request seeded s samples as a request seeded s + i."""
    body = {"prompt": "Sample me", "n": 3, "max_tokens": 8, "temperature": 1.5, "seed": 40,
            "ignore_eos": True, "return_token_ids": True}  # fmt: skip
    reply = ok(server, "/v1/completions", body)
    ids = TOK.encode("Sample me")
    for i, c in enumerate(reply["choices"]):
        assert c["token_ids"] == reference(
            model, ids, 8, temperature=1.5, seed=40 + i, stop_token_ids=()
        )
    one = ok(server, "/v1/completions", {**body, "n": 1, "seed": 41})
    assert one["choices"][0]["token_ids"] == reply["choices"][1]["token_ids"]


def test_a_client_that_hangs_up_has_every_choice_aborted(served) -> None:
    server, ae = served
    wait_idle(ae)
    before = ae.metrics()
    body = {"prompt": ["long story", "another"], "n": 2, "max_tokens": 400,
            "ignore_eos": True, "stream": True}  # fmt: skip
    data = json.dumps(body).encode()
    sock = socket.create_connection(("127.0.0.1", server.port), timeout=TIMEOUT)
    try:
        sock.sendall(
            b"POST /v1/completions HTTP/1.1\r\nHost: 127.0.0.1\r\n"
            b"Content-Type: application/json\r\n"
            + f"Content-Length: {len(data)}\r\n\r\n".encode()
            + data
        )
        got = b""
        while got.count(b"data: {") < 4:  # every choice is running
            chunk = sock.recv(4096)
            assert chunk, "the server closed the stream"
            got += chunk
    finally:
        sock.close()
    wait_idle(ae)
    after = ae.metrics()
    assert after.requests_finished == before.requests_finished + 4
    assert after.generation_tokens - before.generation_tokens < 4 * 400
    check_engine(ae)


def test_best_of_one_or_n_is_accepted(server) -> None:
    for extra in ({"best_of": 1}, {"n": 2, "best_of": 2}, {"n": 3, "best_of": 1}):
        reply = ok(server, "/v1/completions", {"prompt": "hi", "max_tokens": 2, **extra})
        assert len(reply["choices"]) == extra.get("n", 1)
    message = error(server, "/v1/completions", {"prompt": "hi", "n": 2, "best_of": 4}, "best_of")
    assert message == "best_of must be 1 or equal to n (2), got 4"


@pytest.mark.parametrize("path", ["/v1/completions", "/v1/chat/completions"])
def test_continuous_usage_stats_put_the_usage_so_far_on_every_chunk(server, path) -> None:
    """vLLM's ``continuous_usage_stats`` (GuideLLM streams with it): every chunk carries the
    request's usage so far, growing to the final usage; without ``include_usage`` none."""
    body = {"prompt": "Count"} if path == "/v1/completions" else {"messages": CHAT}
    body = {**body, "max_tokens": 6, "temperature": 0, "n": 2}
    whole = ok(server, path, body)
    options = {"include_usage": True, "continuous_usage_stats": True}
    *chunks, last = server.stream(path, {**body, "stream_options": options})
    counts = ("prompt_tokens", "completion_tokens", "total_tokens")
    assert last["choices"] == []
    assert [last["usage"][k] for k in counts] == [whole["usage"][k] for k in counts]
    done = [c["usage"]["completion_tokens"] for c in chunks]
    assert done == sorted(done) and done[-1] == whole["usage"]["completion_tokens"]
    assert {c["usage"]["prompt_tokens"] for c in chunks} == {whole["usage"]["prompt_tokens"]}
    quiet = server.stream(path, {**body, "stream_options": {"continuous_usage_stats": True}})
    assert not any("usage" in c for c in quiet)


@pytest.mark.parametrize("path", ["/v1/completions", "/v1/chat/completions"])
def test_streamed_choices_carry_their_index_and_add_up_to_the_whole(server, path) -> None:
    if path == "/v1/completions":
        body = {"prompt": ["Stream one", "Stream two"], "n": 2}
    else:
        body = {"messages": CHAT, "n": 3}
    body = {**body, "max_tokens": 10, "temperature": 0, "return_token_ids": True}
    whole = ok(server, path, body)
    events = server.stream(path, {**body, "stream_options": {"include_usage": True}})
    *chunks, last = events
    assert (
        last["choices"] == []
        and last["usage"]["completion_tokens"] == (whole["usage"]["completion_tokens"])
    )
    assert last["usage"]["prompt_tokens"] == whole["usage"]["prompt_tokens"]
    texts: dict[int, str] = {}
    ids: dict[int, list[int]] = {}
    finishes: dict[int, list[str]] = {}
    for chunk in chunks:
        [c] = chunk["choices"]
        i = c["index"]
        piece = c["text"] if path == "/v1/completions" else c["delta"].get("content", "")
        texts[i] = texts.get(i, "") + piece
        ids.setdefault(i, []).extend(c.get("token_ids", []))
        if c["finish_reason"] is not None:
            finishes.setdefault(i, []).append(c["finish_reason"])
    for c in whole["choices"]:
        i = c["index"]
        text = c["text"] if path == "/v1/completions" else c["message"]["content"]
        assert texts[i] == text and ids[i] == c["token_ids"]
        assert finishes[i] == [c["finish_reason"]]  # exactly one finish per choice
    assert sorted(texts) == [c["index"] for c in whole["choices"]]
    if path == "/v1/chat/completions":  # a role chunk opens every choice
        roles = [c["choices"][0]["index"] for c in chunks if "role" in c["choices"][0]["delta"]]
        assert roles == [0, 1, 2]


# ============================================================ item 3: sampling parameters
@pytest.mark.parametrize("seed", [1, 2, 3])
def test_top_k_one_at_temperature_two_is_greedy_whatever_the_seed(server, seed) -> None:
    """The issue's example: top_k was accepted and ignored."""
    body = {"prompt": "Choose", "max_tokens": 12, "ignore_eos": True}
    greedy = ok(server, "/v1/completions", {**body, "temperature": 0})["choices"][0]["text"]
    sampled = {**body, "temperature": 2.0, "top_k": 1, "seed": seed}
    assert ok(server, "/v1/completions", sampled)["choices"][0]["text"] == greedy


SAMPLED = [
    {"top_k": 5, "temperature": 1.3},
    {"min_p": 0.1, "temperature": 1.1},
    {"repetition_penalty": 1.3, "presence_penalty": 0.4, "frequency_penalty": 0.6},
    {"top_p": 0.8, "top_k": 20, "min_p": 0.02, "temperature": 0.9},
]


@pytest.mark.parametrize("extra", SAMPLED, ids=["top_k", "min_p", "penalties", "all"])
def test_sampling_parameters_reach_the_engine(model, server, extra) -> None:
    """The server's reply equals ``Engine.generate`` with the same parameters and seed."""
    body = {"prompt": "Parameters", "max_tokens": 10, "seed": 5, "ignore_eos": True,
            "return_token_ids": True, **extra}  # fmt: skip
    got = ok(server, "/v1/completions", body)["choices"][0]["token_ids"]
    want = reference(model, TOK.encode("Parameters"), 10, seed=5, stop_token_ids=(),
                     temperature=extra.get("temperature", 1.0),
                     **{k: v for k, v in extra.items() if k != "temperature"})  # fmt: skip
    assert got == want


def test_logit_bias_and_min_tokens_reach_the_engine(server) -> None:
    body = {"prompt": "Bias", "max_tokens": 5, "temperature": 0, "return_token_ids": True}
    reply = ok(server, "/v1/completions", {**body, "logit_bias": {"65": 100}})
    assert reply["choices"][0]["text"] == "AAAAA"
    first = ok(server, "/v1/completions", {**body, "ignore_eos": True})["choices"][0]["token_ids"][
        0
    ]
    stopped = ok(server, "/v1/completions", {**body, "stop_token_ids": [first]})
    assert stopped["choices"][0]["token_ids"] == [first]
    held = ok(server, "/v1/completions", {**body, "stop_token_ids": [first], "min_tokens": 3})
    ids = held["choices"][0]["token_ids"]
    assert len(ids) >= 3 and first not in ids[:3]


def test_min_tokens_defers_stop_strings() -> None:
    stream = TextStream(lambda ids: bytes(ids).decode(), stop=["b"], min_tokens=3)
    assert stream.push(list(b"ab"), False) == "a"  # "b" may begin a stop string: held back
    assert stream.push(list(b"abc"), False) == "bc"  # it came too early to stop: text
    assert stream.push(list(b"abcb"), False) == "" and stream.stopped
    assert stream.text == "abc"


# ---------------------------------------------------------------- logprobs
def test_completion_logprobs_are_the_models(model, server) -> None:
    body = {"prompt": "Log probabilities", "max_tokens": 6, "temperature": 0, "logprobs": 3,
            "ignore_eos": True, "return_token_ids": True}  # fmt: skip
    [c] = ok(server, "/v1/completions", body)["choices"]
    lp = c["logprobs"]
    ids = TOK.encode(body["prompt"]) + c["token_ids"]
    dense = dense_logprobs(model, ids)
    p = len(ids) - len(c["token_ids"])
    assert lp["tokens"] == [TOK.decode([t]) for t in c["token_ids"]]
    for j, (t, value, top) in enumerate(
        zip(c["token_ids"], lp["token_logprobs"], lp["top_logprobs"])
    ):
        row = dense[p - 1 + j]
        assert value == pytest.approx(float(row[t]), abs=1e-4)
        best = row.topk(3)
        want = {TOK.decode([int(i)]): float(v) for i, v in zip(best.indices, best.values)}
        assert set(want) <= set(top) and TOK.decode([t]) in top and len(top) <= 4
    offsets = [0]
    for token in lp["tokens"][:-1]:
        offsets.append(offsets[-1] + len(token))
    assert lp["text_offset"] == offsets


def test_echo_with_logprobs_scores_the_prompt(model, server) -> None:
    """lm-eval's loglikelihood request: the prompt's logprobs come first, then the token's."""
    prompt = TOK.encode("The cat sat on the mat")
    body = {"prompt": prompt, "max_tokens": 1, "temperature": 0, "logprobs": 1, "echo": True}
    [c] = ok(server, "/v1/completions", body)["choices"]
    lp = c["logprobs"]
    assert c["text"].startswith("The cat sat on the mat")
    assert len(lp["token_logprobs"]) == len(prompt) + 1
    assert lp["token_logprobs"][0] is None and lp["top_logprobs"][0] is None
    dense = dense_logprobs(model, prompt)
    for j in range(1, len(prompt)):
        assert lp["token_logprobs"][j] == pytest.approx(float(dense[j - 1, prompt[j]]), abs=1e-4)
        top = lp["top_logprobs"][j]
        assert TOK.decode([prompt[j]]) in top and len(top) <= 2
        assert max(top.values()) == pytest.approx(float(dense[j - 1].max()), abs=1e-4)


def test_echo_with_max_tokens_zero_returns_the_prompt(served) -> None:
    server, ae = served
    wait_idle(ae)
    before = ae.metrics().requests_finished
    reply = ok(server, "/v1/completions", {"prompt": "Just this", "max_tokens": 0, "echo": True})
    [c] = reply["choices"]
    assert c["text"] == "Just this" and c["finish_reason"] == "length"
    assert reply["usage"]["completion_tokens"] == 0
    wait_idle(ae)
    assert ae.metrics().requests_finished == before  # nothing to run
    body = {"prompt": [7, 8, 9, 10], "max_tokens": 0, "echo": True, "logprobs": 0}
    [c] = ok(server, "/v1/completions", body)["choices"]
    assert c["text"] == TOK.decode([7, 8, 9, 10])
    assert len(c["logprobs"]["token_logprobs"]) == 4  # the prompt only
    message = error(server, "/v1/completions", {"prompt": "x", "max_tokens": 0}, "max_tokens")
    assert message == "max_tokens must be at least 1, got 0 (0 is allowed only with echo)"
    message = error(server, "/v1/chat/completions", {"messages": CHAT, "max_tokens": 0},
                    "max_tokens")  # fmt: skip
    assert message == "max_tokens must be at least 1, got 0"


def test_chat_logprobs_and_top_logprobs(model, server) -> None:
    body = {"messages": CHAT, "max_tokens": 5, "temperature": 0, "logprobs": True,
            "top_logprobs": 2, "return_token_ids": True}  # fmt: skip
    [c] = ok(server, "/v1/chat/completions", body)["choices"]
    content = c["logprobs"]["content"]
    assert len(content) == len(c["token_ids"])
    ids = TOK.apply_chat_template(CHAT) + c["token_ids"]
    dense = dense_logprobs(model, ids)
    p = len(ids) - len(c["token_ids"])
    for j, (t, entry) in enumerate(zip(c["token_ids"], content)):
        assert entry["token"] == TOK.decode([t])
        assert entry["bytes"] == list(entry["token"].encode())
        assert entry["logprob"] == pytest.approx(float(dense[p - 1 + j, t]), abs=1e-4)
        assert len(entry["top_logprobs"]) == 2
        assert entry["top_logprobs"][0]["logprob"] >= entry["top_logprobs"][1]["logprob"]
    [plain] = ok(server, "/v1/chat/completions", {**body, "logprobs": False, "top_logprobs": 0})[
        "choices"
    ]
    assert plain["logprobs"] is None


@pytest.mark.parametrize("path", ["/v1/completions", "/v1/chat/completions"])
def test_streamed_logprobs_add_up_to_the_whole(server, path) -> None:
    if path == "/v1/completions":
        body = {"prompt": "Stream logprobs", "logprobs": 2, "echo": True}
    else:
        body = {"messages": CHAT, "logprobs": True, "top_logprobs": 2}
    body = {**body, "max_tokens": 8, "temperature": 0, "ignore_eos": True}
    [whole] = ok(server, path, body)["choices"]
    pieces = [e["choices"][0]["logprobs"] for e in server.stream(path, body) if e["choices"]]
    pieces = [p for p in pieces if p is not None]
    # the second request reads the first's cached blocks: its logits agree to float rounding
    if path == "/v1/completions":
        joined = {k: [x for p in pieces for x in p[k]] for k in whole["logprobs"]}
        assert joined["tokens"] == whole["logprobs"]["tokens"]
        assert joined["text_offset"] == whole["logprobs"]["text_offset"]
        assert joined["token_logprobs"][0] is None is whole["logprobs"]["token_logprobs"][0]
        assert joined["token_logprobs"][1:] == pytest.approx(
            whole["logprobs"]["token_logprobs"][1:], abs=1e-4
        )
        for got, want in zip(joined["top_logprobs"], whole["logprobs"]["top_logprobs"]):
            assert got == want or got == pytest.approx(want, abs=1e-4)
    else:
        content = [x for p in pieces for x in p["content"]]
        want = whole["logprobs"]["content"]
        assert [c["token"] for c in content] == [c["token"] for c in want]
        for got, expected in zip(content, want):
            assert got["logprob"] == pytest.approx(expected["logprob"], abs=1e-4)
            assert [t["token"] for t in got["top_logprobs"]] == [
                t["token"] for t in expected["top_logprobs"]
            ]


def test_prompt_logprobs_in_vllms_shape(model, server) -> None:
    prompt = [10, 20, 30, 40, 50]
    body = {"prompt": prompt, "max_tokens": 1, "prompt_logprobs": 2}
    [c] = ok(server, "/v1/completions", body)["choices"]
    entries = c["prompt_logprobs"]
    assert entries[0] is None and len(entries) == len(prompt)
    dense = dense_logprobs(model, prompt)
    for j in range(1, len(prompt)):
        entry = entries[j]
        actual = entry[str(prompt[j])]
        assert actual["logprob"] == pytest.approx(float(dense[j - 1, prompt[j]]), abs=1e-4)
        assert actual["rank"] == 1 + int((dense[j - 1] > dense[j - 1, prompt[j]]).sum())
        ranks = sorted(e["rank"] for t, e in entry.items() if t != str(prompt[j]))
        assert ranks[: len(entry) - 1] == list(range(1, len(entry)))[: len(ranks)]


def check_prompt_logprobs(model, prompt: list[int], entries: list) -> None:
    """``entries`` are vLLM's ``prompt_logprobs`` of ``prompt``: the model's own."""
    assert entries[0] is None and len(entries) == len(prompt)
    dense = dense_logprobs(model, prompt)
    for j in range(1, len(prompt)):
        actual = entries[j][str(prompt[j])]
        assert actual["logprob"] == pytest.approx(float(dense[j - 1, prompt[j]]), abs=1e-4)
        assert actual["rank"] == 1 + int((dense[j - 1] > dense[j - 1, prompt[j]]).sum())


def test_chat_prompt_logprobs_come_beside_usage_as_vllm_puts_them(model, served) -> None:
    """The issue's example: chat with prompt_logprobs answered 200 without them. They are
    the response's (vLLM's place: every choice has the same prompt), and a 400 naming them
    with stream (vLLM's rule: a chat chunk has no place for them)."""
    server, ae = served
    body = {"messages": CHAT, "max_tokens": 2, "prompt_logprobs": 2, "n": 2}
    reply = ok(server, "/v1/chat/completions", body)
    prompt = TOK.apply_chat_template(CHAT)
    assert reply["usage"]["prompt_tokens"] == len(prompt)
    check_prompt_logprobs(model, prompt, reply["prompt_logprobs"])
    assert all(len(e) <= 3 for e in reply["prompt_logprobs"][1:])  # 2 likeliest + the token
    assert all("prompt_logprobs" not in c for c in reply["choices"])
    assert "prompt_logprobs" not in ok(server, "/v1/chat/completions", {**body, "n": 1,
                                                                      "prompt_logprobs": None})
    wait_idle(ae)
    before = ae.metrics().requests_finished
    message = error(server, "/v1/chat/completions", {**body, "stream": True}, "prompt_logprobs")
    assert message.startswith("prompt_logprobs are not available with stream: true in chat")
    wait_idle(ae)
    assert ae.metrics().requests_finished == before


def test_truncate_prompt_tokens_keeps_the_last_k_and_refuses_0(model, served) -> None:
    """The issue's example: ``truncate_prompt_tokens: 0`` kept the whole prompt (``ids[-0:]``).
    k >= 1 keeps the last k tokens and -1 as many as the model takes, as in vLLM; 0 is a
    400 naming the field (vLLM's SamplingParams refuses it too)."""
    server, ae = served
    prompt = list(range(10, 30))
    body = {"prompt": prompt, "max_tokens": 3, "temperature": 0, "return_token_ids": True}
    for k, kept in ((5, prompt[-5:]), (1, prompt[-1:]), (-1, prompt), (100, prompt)):
        reply = ok(server, "/v1/completions", {**body, "truncate_prompt_tokens": k})
        assert reply["usage"]["prompt_tokens"] == len(kept), k
        assert reply["choices"][0]["token_ids"] == reference(model, kept, 3), k
    wait_idle(ae)
    before = ae.metrics().requests_finished
    for path, base in (("/v1/completions", body), ("/v1/chat/completions", {"messages": CHAT})):
        field = "truncate_prompt_tokens"
        message = error(server, path, {**base, field: 0}, field)
        assert message == (
            "truncate_prompt_tokens: must be -1 (as many tokens as the model takes) or at "
            "least 1 (keep the prompt's last k tokens), got 0"
        )
    wait_idle(ae)
    assert ae.metrics().requests_finished == before


def test_return_tokens_as_token_ids(server) -> None:
    body = {"prompt": "ids", "max_tokens": 3, "logprobs": 1, "return_tokens_as_token_ids": True,
            "return_token_ids": True, "ignore_eos": True}  # fmt: skip
    [c] = ok(server, "/v1/completions", body)["choices"]
    assert c["logprobs"]["tokens"] == [f"token_id:{t}" for t in c["token_ids"]]


# ---------------------------------------------------------------- chat rendering
FINAL = [{"role": "user", "content": "Name a tree"}, {"role": "assistant", "content": "The oak"}]


def test_add_generation_prompt_and_continue_final_message(model, server) -> None:
    header = TOK.apply_chat_template(FINAL[:1])
    without = TOK.apply_chat_template(FINAL[:1], add_generation_prompt=False)
    assert ok(server, "/tokenize", {"messages": FINAL[:1]})["tokens"] == header
    got = ok(server, "/tokenize", {"messages": FINAL[:1], "add_generation_prompt": False})
    assert got["tokens"] == without
    body = {"messages": FINAL, "add_generation_prompt": False, "continue_final_message": True}
    open_ids = ok(server, "/tokenize", body)["tokens"]
    closed = TOK.apply_chat_template(FINAL, add_generation_prompt=False)
    assert open_ids == closed[:-2]  # no <|im_end|> and newline after "The oak"
    assert TOK.decode(open_ids).endswith("The oak")
    assert (
        render_chat(TOK, FINAL, add_generation_prompt=False, continue_final_message=True)
        == open_ids
    )
    reply = ok(server, "/v1/chat/completions", {**body, "max_tokens": 6, "temperature": 0,
                                                  "return_token_ids": True})  # fmt: skip
    assert reply["choices"][0]["token_ids"] == reference(model, open_ids, 6)
    assert reply["usage"]["prompt_tokens"] == len(open_ids)


# ---------------------------------------------------------------- chat_template_kwargs
@pytest.fixture(scope="module")
def templated(tmp_path_factory) -> Iterator[tuple[Server, ChatTokenizer]]:
    """A server whose model's chat template reads ``enable_thinking`` and ``greeting``
    (test_text's template, over the tiny GGUF vocabulary), and its tokenizer."""
    pytest.importorskip("gguf")
    from text_helpers import VARIABLES_TEMPLATE, train_reference, write_tokenizer_gguf

    path = tmp_path_factory.mktemp("templated") / "tok.gguf"
    write_tokenizer_gguf(train_reference(), path, template=VARIABLES_TEMPLATE)
    tok = load_tokenizer(str(path))
    assert isinstance(tok, ChatTokenizer)
    config = dataclasses.replace(TINY_CONFIG, vocab_size=tok.vocab_size)
    cfg = EngineConfig(num_blocks=NUM_BLOCKS, block_size=BLOCK_SIZE)
    engine = Engine(random_model(config, seed=0), cfg, tokenizer=tok)
    with served_engine(engine, MODEL) as (server, _):
        yield server, tok


def test_chat_template_kwargs_reach_the_template(templated) -> None:
    server, tok = templated
    plain = ok(server, "/tokenize", {"messages": CHAT})["tokens"]
    kwargs = {"enable_thinking": False, "greeting": "Be brief"}
    body = {"messages": CHAT, "chat_template_kwargs": kwargs}
    got = ok(server, "/tokenize", body)["tokens"]
    assert got == render_chat(tok, CHAT, variables=kwargs) != plain
    text = tok.tokenizer.decode(got, skip_special_tokens=False)
    assert text.startswith("<|im_start|>system\nBe brief<|im_end|>\n")
    assert text.endswith("<|im_start|>assistant\n<think>\n\n</think>\n\n")
    reply = ok(server, "/v1/chat/completions", {**body, "max_tokens": 2, "temperature": 0})
    assert reply["usage"]["prompt_tokens"] == len(got)
    streamed = server.stream(
        "/v1/chat/completions",
        {**body, "max_tokens": 2, "stream_options": {"include_usage": True}},
    )
    assert streamed[-1]["usage"]["prompt_tokens"] == len(got)
    # a variable the template does not read changes nothing, as in vLLM
    unread = {"messages": CHAT, "chat_template_kwargs": {"unread": [1, {"a": None}]}}
    assert ok(server, "/tokenize", unread)["tokens"] == plain


def test_reasoning_effort_is_a_template_variable_as_in_vllm(templated, served) -> None:
    """The issue's example: ``reasoning_effort`` was refused, where vLLM takes it for any model
    and passes it to the chat template. A template that reads it renders it; one that does
    not (ChatML in ids) renders as without it; a value outside OpenAI's and vLLM's, or the
    variable sent twice, is a 400 naming it."""
    server, tok = templated
    plain = ok(server, "/tokenize", {"messages": CHAT})["tokens"]
    body = {"messages": CHAT, "max_tokens": 2, "temperature": 0, "reasoning_effort": "low"}
    reply = ok(server, "/v1/chat/completions", body)
    want = render_chat(tok, CHAT, variables={"reasoning_effort": "low"})
    assert want != plain and "Reasoning: low" in tok.tokenizer.decode(want)
    assert reply["usage"]["prompt_tokens"] == len(want)
    chatml, _ = served
    got = ok(chatml, "/v1/chat/completions", {**body, "reasoning_effort": "none"})
    assert got["usage"]["prompt_tokens"] == len(TOK.apply_chat_template(CHAT))
    message = error(chatml, "/v1/chat/completions", {**body, "reasoning_effort": "huge"},
                    "reasoning_effort")  # fmt: skip
    assert message.startswith("reasoning_effort: Input should be 'none', 'minimal', 'low'")
    twice = {**body, "chat_template_kwargs": {"reasoning_effort": "high"}}
    message = error(chatml, "/v1/chat/completions", twice, "reasoning_effort")
    assert message.endswith("send it once")


def test_chat_template_kwargs_change_nothing_for_chatml_in_ids(served) -> None:
    """The random model's ByteTokenizer builds ChatML in ids and reads no variable."""
    server, ae = served
    body = {"messages": CHAT, "chat_template_kwargs": {"enable_thinking": False}}
    assert ok(server, "/tokenize", body)["tokens"] == TOK.apply_chat_template(CHAT)
    reply = ok(server, "/v1/chat/completions", {**body, "max_tokens": 2})
    assert reply["usage"]["prompt_tokens"] == len(TOK.apply_chat_template(CHAT))


CTK_ERRORS = [
    ({"add_generation_prompt": False},
     'chat_template_kwargs["add_generation_prompt"] is the request\'s add_generation_prompt '
     "field, which a template variable cannot replace"),
    ({"bos_token": "<s>"},
     'chat_template_kwargs["bos_token"] is the tokenizer\'s BOS token, which a template '
     "variable cannot replace"),
    ({"x": [1, "a\ud800"]},
     'chat_template_kwargs["x"][1]: a lone surrogate \'\\ud800\' at character 1 is not valid '
     "UTF-8 text"),
    ({"\ud800": 1},
     'the key of chat_template_kwargs["\\ud800"]: a lone surrogate \'\\ud800\' at character 0 '
     "is not valid UTF-8 text"),
    ([1], "chat_template_kwargs: Input should be a valid dictionary, got [1]"),
]  # fmt: skip


@pytest.mark.parametrize("path", ["/v1/chat/completions", "/tokenize"])
@pytest.mark.parametrize(("kwargs", "message"), CTK_ERRORS)
def test_bad_chat_template_kwargs_are_a_400_naming_them(served, path, kwargs, message) -> None:
    server, ae = served
    wait_idle(ae)
    before = ae.metrics().requests_finished
    body = {"messages": CHAT, "max_tokens": 1, "chat_template_kwargs": kwargs}
    if path == "/tokenize":
        del body["max_tokens"]
    assert error(server, path, body, "chat_template_kwargs") == message
    wait_idle(ae)
    assert ae.metrics().requests_finished == before  # refused before the engine saw it


def test_chat_template_kwargs_need_messages_and_json_numbers(server) -> None:
    body = {"prompt": "hi", "chat_template_kwargs": {"a": 1}}
    message = error(server, "/tokenize", body, "chat_template_kwargs")
    assert message.startswith("chat_template_kwargs are variables of the chat template")
    assert ok(server, "/tokenize", {"prompt": "hi", "chat_template_kwargs": {}})["count"] == 2
    # Python's json reads NaN, which is no JSON number
    raw = b'{"messages": [{"role": "user", "content": "x"}], "chat_template_kwargs": {"t": NaN}}'
    status, data, _ = server.request("POST", "/v1/chat/completions", raw=raw)
    err = json.loads(data)["error"]
    assert status == 400 and err["param"] == "chat_template_kwargs", err
    assert err["message"] == 'chat_template_kwargs["t"] is nan, not a finite number'


# ---------------------------------------------------------------- what is not implemented
def neutral_and_not(table: dict[str, tuple]) -> list[tuple[str, Any, bool]]:
    cases = []
    for name, neutrals in table.items():
        cases += [(name, n, True) for n in neutrals]
        cases.append((name, {"unsupported": True}, False))
    return cases


@pytest.mark.parametrize("path", ["/v1/completions", "/v1/chat/completions"])
def test_unimplemented_fields_are_refused_unless_neutral(served, path) -> None:
    """Every field OpenAI or vLLM defines and radixkv does not implement: its neutral values
    are served, anything else is a 400 naming it (never silently ignored)."""
    server, ae = served
    base = {"prompt": "x"} if path == "/v1/completions" else {"messages": CHAT}
    base = {**base, "max_tokens": 1}
    wait_idle(ae)
    before = ae.metrics().requests_finished
    served_ok = 0
    for name, value, neutral in neutral_and_not(NOT_IMPLEMENTED[path]):
        body = {**base, name: value}
        if neutral:
            assert server.post(path, body)[0] == 200, (name, value)
            served_ok += 1
        else:
            message = error(server, path, body, name)
            assert message.startswith(f"{name}: not supported by this server"), message
            assert message.count('{"unsupported": true}') == 1, message
    assert server.post(path, {**base, "frobnicate": [1]})[0] == 200  # outside the API: ignored
    wait_idle(ae)
    assert ae.metrics().requests_finished == before + served_ok + 1


ERRORS = [
    ({"prompt": "hi", "n": 200}, "n", "n: Input should be less than or equal to 128, got 200"),
    ({"prompt": "hi", "top_k": -3}, "top_k",
     "top_k: Input should be greater than or equal to -1, got -3"),
    ({"prompt": [[1, 2], "x"]}, "prompt",
     "prompt: must be a string, a list of strings, a list of token ids or a list of "
     'token-id lists, got [[1, 2], "x"]'),
    ({"prompt": [[1, 2], []]}, "prompt", "prompt: prompt[1] must hold at least one token"),
    ({"prompt": "hi", "logit_bias": {"5": 150}}, "logit_bias",
     "logit_bias: biases lie in [-100, 100], got 150.0 for token 5"),
    ({"prompt": "hi", "max_tokens": 2, "min_tokens": 3}, "min_tokens",
     "min_tokens must be at most max_tokens (2), got 3"),
]  # fmt: skip


@pytest.mark.parametrize(("body", "param", "message"), ERRORS)
def test_errors_name_the_parameter_and_value_once(server, body, param, message) -> None:
    got = error(server, "/v1/completions", body, param)
    assert got == message
    assert "Value error" not in got and got.count("got ") <= 1


# ============================================================ item 4: endpoints
def test_model_card_version_and_404(server) -> None:
    status, data, _ = server.request("GET", f"/v1/models/{MODEL}")
    card = json.loads(data)
    assert status == 200 and card["id"] == MODEL and card["object"] == "model"
    assert card == json.loads(server.request("GET", "/v1/models")[1])["data"][0]
    status, data, _ = server.request("GET", "/v1/models/other")
    assert status == 404 and json.loads(data)["error"]["code"] == "model_not_found"
    status, data, _ = server.request("GET", "/version")
    assert status == 200 and json.loads(data)["version"]


def test_tokenize_and_detokenize(server) -> None:
    got = ok(server, "/tokenize", {"prompt": "héllo", "return_token_strs": True})
    assert got["tokens"] == TOK.encode("héllo") and got["count"] == len(got["tokens"])
    assert got["max_model_len"] == NUM_BLOCKS * BLOCK_SIZE
    assert got["token_strs"] == [TOK.decode([t]) for t in got["tokens"]]
    chat = ok(server, "/tokenize", {"messages": CHAT})
    assert chat["tokens"] == TOK.apply_chat_template(CHAT) and chat["token_strs"] is None
    assert ok(server, "/detokenize", {"tokens": got["tokens"]}) == {"prompt": "héllo"}
    assert error(server, "/detokenize", {"tokens": [1, 259]}, "tokens")
    assert error(server, "/detokenize", {"tokens": [-1]}, "tokens")
    assert error(server, "/tokenize", {}, "prompt")
    assert error(server, "/tokenize", {"prompt": "a", "messages": CHAT}, "prompt")
    status, reply = server.post("/tokenize", {"prompt": "a", "model": "other"})
    assert status == 404
    # the tokenizer adds a prompt's special tokens, the template a chat's: only that is served
    assert ok(server, "/tokenize", {"prompt": "a", "add_special_tokens": True})["count"] == 1
    assert ok(server, "/tokenize", {"messages": CHAT, "add_special_tokens": False})["count"]
    # vllm bench serve's probe: the prompt's own ids (this tokenizer adds none anyway)
    assert ok(server, "/tokenize", {"prompt": "a", "add_special_tokens": False})["tokens"] == [97]
    assert error(server, "/tokenize", {"messages": CHAT, "add_special_tokens": True},
                 "add_special_tokens")  # fmt: skip


def test_tokenizer_info_says_what_a_remote_tokenizer_needs(server, templated) -> None:
    """vLLM's ``GET /tokenizer_info``, which lm-eval's default (``auto``) tokenizer probes:
    the byte tokenizer's specials have no text (None); a GGUF tokenizer's EOS text encodes,
    through ``/tokenize`` as lm-eval does, to the EOS id, and its template is given."""
    status, data, _ = server.request("GET", "/tokenizer_info")
    info = json.loads(data)
    assert status == 200 and info["tokenizer_class"] == "ByteTokenizer"
    assert info["eos_token"] is None and info["chat_template"] is None
    assert info["model_max_length"] == NUM_BLOCKS * BLOCK_SIZE
    gguf_server, tok = templated
    status, data, _ = gguf_server.request("GET", "/tokenizer_info")
    info = json.loads(data)
    assert status == 200 and info["tokenizer_class"] == "GGUFTokenizer"
    assert info["chat_template"] == tok.tokenizer.chat_template
    eos = ok(gguf_server, "/tokenize", {"prompt": info["eos_token"], "add_special_tokens": False})
    assert eos["tokens"] == [tok.tokenizer.eos_token_id]


def test_max_model_len_is_the_models_context(model) -> None:
    ae = AsyncEngine(make_engine(model))
    with Server(build_app(ae, model_name=MODEL, max_model_len=64)) as server:
        card = json.loads(server.request("GET", "/v1/models")[1])["data"][0]
        assert card["max_model_len"] == 64
        message = error(server, "/v1/completions", {"prompt": [1] * 60, "max_tokens": 10},
                        "max_tokens")  # fmt: skip
        assert "room for 4 within max_model_len 64 (the model's context length)" in message
        assert error(server, "/v1/completions", {"prompt": [1] * 64}, "prompt")
        reply = ok(server, "/v1/completions", {"prompt": [1] * 60, "ignore_eos": True})
        assert reply["usage"]["completion_tokens"] == 4  # the default 16, capped
    with pytest.raises(ValueError, match="max_model_len"):
        build_app(AsyncEngine(make_engine(model)), model_name=MODEL, max_model_len=0)


@pytest.mark.parametrize(("context", "engine_limit"), [(None, None), (4096, None), (None, 40)])
def test_the_advertised_max_model_len_is_what_a_request_gets(model, context, engine_limit):
    """``/v1/models``' ``max_model_len`` is the largest prompt plus ``max_tokens`` that gets a
    200, and one more token is a 400: a pool of 16 blocks of 4 advertised 64 (or the context,
    4096, past the pool) but took 65."""
    limited = {} if engine_limit is None else {"max_model_len": engine_limit}
    engine = make_engine(model, num_blocks=16, **limited)
    with Server(build_app(AsyncEngine(engine), model_name=MODEL, max_model_len=context)) as srv:
        limit = json.loads(srv.request("GET", "/v1/models")[1])["data"][0]["max_model_len"]
        assert limit == (engine_limit or 16 * 4)
        assert ok(srv, "/tokenize", {"prompt": "a"})["max_model_len"] == limit
        for prompt_len in (1, limit // 2, limit - 1):
            body = {"prompt": [1] * prompt_len, "max_tokens": limit - prompt_len,
                    "ignore_eos": True}  # fmt: skip
            reply = ok(srv, "/v1/completions", body)
            assert reply["usage"]["completion_tokens"] == limit - prompt_len
            body["max_tokens"] += 1
            assert "max_tokens" in error(srv, "/v1/completions", body, "max_tokens")
        assert error(srv, "/v1/completions", {"prompt": [1] * limit}, "prompt")


def test_an_engine_refuses_a_max_model_len_its_pool_cannot_hold(model) -> None:
    with pytest.raises(ValueError, match=r"max_model_len=65 is more than the 64 tokens the KV"):
        make_engine(model, num_blocks=16, max_model_len=65)


def test_context_length_comes_from_the_models_metadata(tmp_path: Path) -> None:
    assert context_length("random") is None
    (tmp_path / "config.json").write_text(json.dumps({"max_position_embeddings": 4096}))
    assert context_length(str(tmp_path)) == 4096
    (tmp_path / "config.json").write_text(json.dumps({}))
    assert context_length(str(tmp_path)) is None
    from radixkv.text.tokenizer import smollm2_gguf_path

    if smollm2_gguf_path() is not None:
        assert context_length("smollm2") == 8192  # SmolLM2's llama.context_length


# ---------------------------------------------------------------- metrics
def scrape(server: Server) -> dict[str, float]:
    """``{sample name + labels: value}`` of ``/metrics``, parsed by prometheus_client."""
    status, data, resp = server.request("GET", "/metrics")
    assert status == 200 and resp.getheader("content-type").startswith("text/plain")
    out = {}
    for family in text_string_to_metric_families(data.decode()):
        for s in family.samples:
            labels = ",".join(f"{k}={v}" for k, v in sorted(s.labels.items()) if k != "model_name")
            assert s.labels.get("model_name") == MODEL, s
            out[f"{s.name}{{{labels}}}" if labels else s.name] = s.value
    return out


def test_histograms_and_success_by_reason_move(served) -> None:
    server, ae = served
    wait_idle(ae)
    before = scrape(server)
    body = {"prompt": "Metrics move", "max_tokens": 5, "ignore_eos": True, "temperature": 0}
    text = ok(server, "/v1/completions", body)["choices"][0]["text"]
    ok(server, "/v1/completions", {**body, "stop": [text[2:4]], "n": 2})
    wait_idle(ae)
    after = scrape(server)

    def moved(name: str) -> float:
        return after[name] - before.get(name, 0.0)

    p = "radixkv:"
    assert moved(p + "request_success_total{finished_reason=length}") == 1
    assert moved(p + "request_success_total{finished_reason=stop}") == 2  # a stop string
    assert moved(p + "time_to_first_token_seconds_count") == 3
    assert moved(p + "e2e_request_latency_seconds_count") == 3
    assert moved(p + "request_queue_time_seconds_count") == 3
    assert moved(p + "inter_token_latency_seconds_count") >= 4
    assert moved(p + "request_prompt_tokens_sum") == 3 * len(TOK.encode(body["prompt"]))
    assert moved(p + "request_generation_tokens_sum") >= 5
    assert moved(p + "request_params_n_sum") == 3  # n=1, then n=2
    assert moved(p + "request_params_max_tokens_sum") == 10
    assert after[p + "time_to_first_token_seconds_sum"] > before.get(
        p + "time_to_first_token_seconds_sum", 0
    )
    for name in ("num_requests_running", "kv_cache_usage_perc", "prefix_cache_hits_total",
                 "request_finished_total", "generation_tokens_total"):  # fmt: skip
        assert p + name in after


def test_metrics_prefix_vllm_emits_vllms_names(model) -> None:
    ae = AsyncEngine(make_engine(model))
    with Server(build_app(ae, model_name=MODEL, metrics_prefix="vllm")) as server:
        ok(server, "/v1/completions", {"prompt": "vllm names", "max_tokens": 3})
        names = set(scrape(server))
    assert all(n.startswith("vllm:") for n in names), names
    for name in ("vllm:num_requests_running", "vllm:num_requests_waiting",
                 "vllm:kv_cache_usage_perc", "vllm:prefix_cache_queries_total",
                 "vllm:prefix_cache_hits_total", "vllm:prompt_tokens_total",
                 "vllm:generation_tokens_total", "vllm:num_preemptions_total",
                 "vllm:time_to_first_token_seconds_bucket{le=0.1}",
                 "vllm:e2e_request_latency_seconds_count",
                 "vllm:inter_token_latency_seconds_count",
                 "vllm:time_per_output_token_seconds_count",
                 "vllm:request_queue_time_seconds_count",
                 "vllm:request_prompt_tokens_count", "vllm:request_generation_tokens_count",
                 "vllm:request_success_total{finished_reason=length}"):  # fmt: skip
        assert name in names, name
    with pytest.raises(ValueError, match="metrics prefix"):
        build_app(AsyncEngine(make_engine(model)), model_name=MODEL, metrics_prefix="v:llm")


class ScriptedCall:
    """An engine call that yields ``n`` tokens one at a time, stamped as the engine stamps
    them, then finishes with ``"length"``."""

    def __init__(self, prompt_len: int, n: int) -> None:
        self.prompt_len, self.n = prompt_len, n

    async def __aiter__(self) -> AsyncIterator[RequestOutput]:
        arrived = time.perf_counter()
        for k in range(self.n):
            last = k == self.n - 1
            yield RequestOutput(
                request_id=0,
                new_token_ids=[65],
                output_ids=[65] * (k + 1),
                finished=last,
                finish_reason="length" if last else None,
                prompt_tokens=self.prompt_len,
                cached_tokens=0,
                error=None,
                logprobs=[0.0],
                top_logprobs=[[]],
                token_times=[time.perf_counter()],
                arrival_time=arrived,
                scheduled_time=arrived,
            )

    async def aclose(self) -> None:
        pass

    async def abort(self) -> None:
        pass


class ScriptedClient:
    """An :class:`~radixkv.serve.openai.client.EngineClient` over :class:`ScriptedCall`s: what the
    handlers see of a fleet's routed calls, without Ray."""

    tokenizer = TOK
    limits = EngineLimits(TOK.vocab_size, 1024)

    async def generate(
        self, prompt_ids: list[int], params: SamplingParams, namespace: Any
    ) -> ScriptedCall:
        return ScriptedCall(len(prompt_ids), params.max_new_tokens)


def engine_snapshot(finished: int) -> EngineMetrics:
    return EngineMetrics(running=0, waiting=0, kv_usage=0.0, prefix_cache_queries=10,
                         prefix_cache_hits=4, preemptions=0, requests_finished=finished,
                         prompt_tokens=10, generation_tokens=5, failed_steps=0)  # fmt: skip


@pytest.mark.parametrize("prefix", ["radixkv", "vllm"])
def test_the_handlers_record_a_fleet_s_requests_beside_its_replicas(prefix: str) -> None:
    """The path the fleet's ingress takes (tests/fleet/test_serve_fleet.py runs it on Ray): the
    handlers over a routed client record every choice in ``ServerMetrics.requests``, and
    ``render_fleet`` writes those histograms beside each replica's engine metrics."""
    metrics = ServerMetrics(MODEL, prefix, max_model_len=1024)
    api = OpenAIHandlers(ScriptedClient(), MODEL, metrics=metrics.requests)

    async def run() -> None:
        await api.completions(CompletionRequest.model_validate({"prompt": "ab", "max_tokens": 3}))
        await api.completions(
            CompletionRequest.model_validate({"prompt": "abc", "max_tokens": 2, "n": 2})
        )
        chat = ChatCompletionRequest.model_validate(
            {"messages": CHAT, "max_tokens": 4, "stream": True}
        )
        response = await api.chat(chat)
        async for _ in response.body_iterator:  # the stream records as it ends
            pass

    asyncio.run(run())
    text = metrics.render_fleet({"r1": engine_snapshot(3), "r2": engine_snapshot(1)})
    samples = {}
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            assert s.name.startswith(f"{prefix}:") and s.labels["model_name"] == MODEL, s
            labels = ",".join(f"{k}={v}" for k, v in sorted(s.labels.items()) if k != "model_name")
            samples[f"{s.name}{{{labels}}}"] = s.value
    p = f"{prefix}:"
    choices = 4  # 1 + 2 forks + 1 chat choice
    for name in ("time_to_first_token_seconds", "e2e_request_latency_seconds",
                 "request_queue_time_seconds", "request_prefill_time_seconds",
                 "request_prompt_tokens", "request_generation_tokens"):  # fmt: skip
        assert samples[f"{p}{name}_count{{}}"] == choices, name
    assert samples[f"{p}request_success_total{{finished_reason=length}}"] == choices
    assert samples[f"{p}request_generation_tokens_sum{{}}"] == 3 + 2 * 2 + 4
    chat_len = len(TOK.apply_chat_template(CHAT))
    assert samples[f"{p}request_prompt_tokens_sum{{}}"] == 2 + 2 * 3 + chat_len
    assert samples[f"{p}inter_token_latency_seconds_count{{}}"] == 2 + 2 * 1 + 3
    assert samples[f"{p}request_params_n_count{{}}"] == 3  # per request
    # the engine's metrics: once per replica
    assert samples[f"{p}request_finished_total{{replica=r1}}"] == 3
    assert samples[f"{p}request_finished_total{{replica=r2}}"] == 1


# Every series each engine's own Grafana dashboard queries, as its JSON reads them:
# vllm-project/vllm examples/online_serving/prometheus_grafana/grafana.json (the version
# whose cache panel reads kv_cache_usage_perc, vLLM V1's name), and sgl-project/sglang
# examples/monitoring/grafana/dashboards/json/sglang-dashboard.json.
VLLM_DASHBOARD = (
    "vllm:e2e_request_latency_seconds_bucket",
    "vllm:e2e_request_latency_seconds_sum",
    "vllm:e2e_request_latency_seconds_count",
    "vllm:prompt_tokens_total",
    "vllm:generation_tokens_total",
    "vllm:time_per_output_token_seconds_bucket",
    "vllm:time_per_output_token_seconds_sum",
    "vllm:time_per_output_token_seconds_count",
    "vllm:num_requests_running",
    "vllm:num_requests_waiting",
    "vllm:time_to_first_token_seconds_bucket",
    "vllm:time_to_first_token_seconds_sum",
    "vllm:time_to_first_token_seconds_count",
    "vllm:kv_cache_usage_perc",
    "vllm:request_prompt_tokens_bucket",
    "vllm:request_generation_tokens_bucket",
    "vllm:request_success_total",
    "vllm:request_queue_time_seconds_sum",
    "vllm:request_prefill_time_seconds_sum",
    "vllm:request_decode_time_seconds_sum",
    "vllm:request_max_num_generation_tokens_sum",
)
SGLANG_DASHBOARD = (
    "sglang:e2e_request_latency_seconds_bucket",
    "sglang:e2e_request_latency_seconds_sum",
    "sglang:e2e_request_latency_seconds_count",
    "sglang:time_to_first_token_seconds_bucket",
    "sglang:time_to_first_token_seconds_sum",
    "sglang:time_to_first_token_seconds_count",
    "sglang:num_running_reqs",
    "sglang:gen_throughput",
    "sglang:cache_hit_rate",
    "sglang:num_queue_reqs",
)


@pytest.mark.parametrize(
    ("prefix", "dashboard"), [("vllm", VLLM_DASHBOARD), ("sglang", SGLANG_DASHBOARD)]
)
def test_each_engines_dashboard_reads_every_series_it_queries(prefix, dashboard) -> None:
    """``--metrics-prefix vllm`` / ``sglang`` serve every series that engine's dashboard
    reads; ``request_max_num_generation_tokens`` is observed once per prompt, the longest of
    its ``n`` outputs (vLLM's parallel-sampling parent)."""
    metrics = ServerMetrics(MODEL, prefix, max_model_len=1024)
    api = OpenAIHandlers(ScriptedClient(), MODEL, metrics=metrics.requests)

    async def run() -> None:
        for body in ({"prompt": "ab", "max_tokens": 3}, {"prompt": "abc", "max_tokens": 2, "n": 2},
                     {"prompt": ["a", "b"], "max_tokens": 4}):  # fmt: skip
            await api.completions(CompletionRequest.model_validate(body))

    asyncio.run(run())
    text = metrics.render(engine_snapshot(4))
    samples = {s.name: s.value for f in text_string_to_metric_families(text) for s in f.samples}
    assert [name for name in dashboard if name not in samples] == []
    assert all(name.startswith(f"{prefix}:") for name in samples)
    assert samples[f"{prefix}:cache_hit_rate"] == 4 / 10
    if prefix == "vllm":
        assert samples["vllm:request_max_num_generation_tokens_count"] == 4  # prompts
        assert samples["vllm:request_max_num_generation_tokens_sum"] == 3 + 2 + 4 + 4
        assert samples["vllm:request_generation_tokens_count"] == 5  # choices
    else:  # the series both engines define carry SGLang's names only
        assert samples["sglang:queue_time_seconds_count"] == 5
        assert samples["sglang:num_requests_total"] == 4
        assert "sglang:num_requests_running" not in samples
        assert "sglang:request_queue_time_seconds_count" not in samples


def test_host_tier_counters(model) -> None:
    """An engine with a host tier reports it: prefixes evicted from a small pool come back
    from host memory."""
    engine = make_engine(model, num_blocks=24, host_kv_blocks=64)
    ae = AsyncEngine(engine)
    with Server(build_app(ae, model_name=MODEL)) as server:
        first = [int(t) for t in torch.arange(40) % 200 + 1]
        ok(server, "/v1/completions", {"prompt": first, "max_tokens": 2})
        for k in range(3):  # push it out of the device pool
            ok(server, "/v1/completions", {"prompt": [k + 3] * 40, "max_tokens": 2})
        ok(server, "/v1/completions", {"prompt": first, "max_tokens": 2})
        wait_idle(ae)
        metrics = scrape(server)
    assert metrics["radixkv:host_cache_hit_tokens_total"] > 0
    assert metrics["radixkv:host_cache_loaded_bytes_total"] > 0
    assert metrics["radixkv:host_cache_backed_up_blocks_total"] > 0
    assert "radixkv:host_cache_blocks" in metrics


def test_cli_metrics_prefix_flag() -> None:
    import http.client

    proc, port = spawn_serve("--metrics-prefix", "vllm", "--num-blocks", "64")
    try:
        wait_answering(port)
        conn = http.client.HTTPConnection("127.0.0.1", port, timeout=TIMEOUT)
        try:
            conn.request("GET", "/metrics")
            text = conn.getresponse().read().decode()
        finally:
            conn.close()
        assert "vllm:num_requests_running" in text and "radixkv:" not in text
    finally:
        proc.terminate()
        proc.communicate(timeout=TIMEOUT)
    argv = [sys.executable, "-m", "radixkv.cli", "serve", "--model", "random", "--port", "0"]
    done = subprocess.run([*argv, "--metrics-prefix", "9x"], capture_output=True, timeout=120)
    assert done.returncode == 2 and done.stderr.count(b"\n") == 1
    assert b"--metrics-prefix" in done.stderr


@pytest.mark.slow
def test_cli_no_enable_prefix_caching_computes_every_prompt() -> None:
    """vLLM's ``--no-enable-prefix-caching`` (the baseline of an A/B run): a repeated prompt
    finds nothing cached; without the flag it does."""
    import http.client

    def cached_twice(*flags: str) -> list[int]:
        proc, port = spawn_serve("--num-blocks", "64", "--log-level", "warning", *flags)
        try:
            wait_answering(port)
            body = json.dumps({"model": "random", "prompt": "x" * 40, "max_tokens": 1})
            found = []
            for _ in range(2):
                conn = http.client.HTTPConnection("127.0.0.1", port, timeout=TIMEOUT)
                try:
                    conn.request("POST", "/v1/completions", body, {"Content-Type": "json"})
                    reply = json.loads(conn.getresponse().read())
                    found.append(reply["usage"]["prompt_tokens_details"]["cached_tokens"])
                finally:
                    conn.close()
            return found
        finally:
            proc.terminate()
            proc.communicate(timeout=TIMEOUT)

    assert cached_twice("--no-enable-prefix-caching") == [0, 0]
    assert cached_twice()[1] > 0


@pytest.mark.slow
def test_cli_dtype_attention_backend_and_enforce_eager_reach_the_engine() -> None:
    """``--dtype bfloat16 --attention-backend padded --enforce-eager`` serve what
    ``build_engine`` builds with those settings: the same greedy tokens and logprobs,
    which differ from the float32 model's. A backend that does not exist is exit 2."""
    import http.client

    from radixkv.engine import SamplingParams
    from radixkv.serve.models import build_engine

    flags = ("--dtype", "bfloat16", "--attention-backend", "padded", "--enforce-eager")
    proc, port = spawn_serve("--num-blocks", "64", "--log-level", "warning", *flags)
    prompt = list(range(40, 70))
    try:
        wait_answering(port)
        body = json.dumps({"model": "random", "prompt": prompt, "max_tokens": 4, "logprobs": 0,
                           "temperature": 0})  # fmt: skip
        conn = http.client.HTTPConnection("127.0.0.1", port, timeout=TIMEOUT)
        try:
            conn.request("POST", "/v1/completions", body, {"Content-Type": "json"})
            reply = json.loads(conn.getresponse().read())
        finally:
            conn.close()
    finally:
        proc.terminate()
        proc.communicate(timeout=TIMEOUT)
    served = reply["choices"][0]["logprobs"]["token_logprobs"]
    greedy = SamplingParams(max_new_tokens=4)
    options = {"dtype": "bfloat16", "attention_backend": "padded", "cuda_graphs": False}
    [want] = build_engine("random", num_blocks=64, **options).generate([prompt], greedy)
    [full] = build_engine("random", num_blocks=64).generate([prompt], greedy)
    assert served == pytest.approx(want.logprobs, abs=1e-6)
    assert served != pytest.approx(full.logprobs, abs=1e-6)
    argv = [sys.executable, "-m", "radixkv.cli", "serve", "--model", "random", "--port", "0"]
    fleet = ["--replicas", "2", "--router", "exact"]
    for bad in (["--attention-backend", "flash"], ["--attention-backend", "flash", *fleet]):
        done = subprocess.run([*argv, *bad], capture_output=True, timeout=120)
        assert done.returncode == 2 and done.stderr.count(b"\n") == 1, done.stderr
        assert b"--attention-backend: attention_backend must be one of" in done.stderr


# ============================================================ clients nobody here wrote
def lm_eval_parse_logprobs(reply: dict, ctxlens: list[int]) -> list[tuple[float, bool]]:
    """lm-evaluation-harness 0.4's ``LocalCompletionsAPI.parse_logprobs``, as it reads a reply."""
    out = []
    for choice, ctxlen in zip(sorted(reply["choices"], key=lambda c: c["index"]), ctxlens):
        logprobs = choice["logprobs"]["token_logprobs"][ctxlen:-1]
        tops = choice["logprobs"]["top_logprobs"][ctxlen:-1]
        greedy = all(tok == max(top.values()) for tok, top in zip(logprobs, tops))
        out.append((sum(logprobs), greedy))
    return out


def test_lm_eval_local_completions_loglikelihood_batch(model, server) -> None:
    """``--model local-completions --batch_size 4``: context + continuation token ids per
    request, a batch of them, echo and logprobs 1, one token (then dropped by the client)."""
    pairs = [("Question: 2+2?", " Answer: 4"), ("The sky is", " blue"), ("a b c", " d"),
             ("Hello", " world")]  # fmt: skip
    prompts = [TOK.encode(c + x) for c, x in pairs]
    ctxlens = [len(TOK.encode(c)) for c, _ in pairs]
    body = {"model": MODEL, "prompt": prompts, "temperature": 0, "max_tokens": 1, "logprobs": 1,
            "seed": 1234, "echo": True}  # fmt: skip
    got = lm_eval_parse_logprobs(ok(server, "/v1/completions", body), ctxlens)
    for (total, greedy), ids, ctxlen in zip(got, prompts, ctxlens):
        dense = dense_logprobs(model, ids)
        want = sum(float(dense[j - 1, ids[j]]) for j in range(ctxlen, len(ids)))
        assert total == pytest.approx(want, abs=1e-3)
        argmax = all(int(dense[j - 1].argmax()) == ids[j] for j in range(ctxlen, len(ids)))
        assert greedy == argmax


def test_lm_eval_local_completions_generate_until_batch(model, server) -> None:
    prompts = [TOK.encode(p) for p in ("Q: one\nA:", "Q: two\nA:", "Q: three\nA:")]
    until = ["\n\n", "Question:", "<|endoftext|>"]
    body = {"prompt": prompts, "model": MODEL, "max_tokens": 12, "temperature": 0,
            "stop": until, "seed": 1234}  # fmt: skip
    reply = ok(server, "/v1/completions", body)
    texts = [c["text"] for c in sorted(reply["choices"], key=lambda c: c["index"])]
    for ids, text in zip(prompts, texts):
        full = visible(reference(model, ids, 12))
        cut = min([i for s in until if (i := full.find(s)) >= 0], default=len(full))
        assert text == full[:cut]


@pytest.mark.parametrize("stream", [True, False])
def test_sglang_bench_serving_completions_body(server, stream) -> None:
    body = {"model": MODEL, "prompt": "benchmark prompt " * 4, "temperature": 0.0, "best_of": 1,
            "max_tokens": 7, "stream": stream, "ignore_eos": True}  # fmt: skip
    if not stream:
        assert ok(server, "/v1/completions", body)["usage"]["completion_tokens"] == 7
        return
    events = server.stream("/v1/completions", {**body, "stream_options": {"include_usage": True}})
    assert events[-1]["usage"]["completion_tokens"] == 7
    assert events[-2]["choices"][0]["finish_reason"] == "length"


def test_vllm_bench_serve_bodies(server) -> None:
    completion = {"model": MODEL, "prompt": "vllm bench", "repetition_penalty": 1.0,
                  "max_tokens": 6, "logprobs": None, "stream": True,
                  "stream_options": {"include_usage": True}, "ignore_eos": True}  # fmt: skip
    events = server.stream("/v1/completions", completion)
    assert events[-1]["usage"]["completion_tokens"] == 6
    assert "".join(e["choices"][0]["text"] for e in events[:-1])
    chat = {"model": MODEL, "temperature": 0.0, "max_completion_tokens": 6, "stream": True,
            "messages": [{"role": "user", "content": [{"type": "text", "text": "vllm bench"}]}],
            "stream_options": {"include_usage": True}, "ignore_eos": True}  # fmt: skip
    events = server.stream("/v1/chat/completions", chat)
    assert events[-1]["usage"]["completion_tokens"] == 6
    # older vllm benchmark_serving.py: temperature 0, best_of 1, no stream_options
    old = {"model": MODEL, "prompt": "vllm bench", "temperature": 0.0, "best_of": 1,
           "max_tokens": 6, "stream": True, "ignore_eos": True}  # fmt: skip
    events = server.stream("/v1/completions", old)
    assert sum(1 for e in events if e["choices"][0]["finish_reason"]) == 1


def test_min_tokens_past_the_capped_default_is_a_400_naming_it(model) -> None:
    ae = AsyncEngine(make_engine(model))
    with Server(build_app(ae, model_name=MODEL, max_model_len=64)) as server:
        message = error(server, "/v1/completions", {"prompt": [1] * 60, "min_tokens": 10},
                        "min_tokens")  # fmt: skip
        assert message == "min_tokens must be an int in [0, 4], got 10"
