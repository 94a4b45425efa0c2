"""The operator's cache reset on one server: vLLM's ``POST /reset_prefix_cache`` and SGLang's
``POST /flush_cache``, off unless ``enable_cache_reset`` (``radixkv serve
--enable-cache-reset``). Enabled, a reset empties the prefix cache while no request runs
(its ``AllBlocksCleared`` reaches a KV-event subscriber, and a repeated prompt finds
nothing cached) and is a 409 that changes nothing while one does. Real servers on
127.0.0.1; every wait is bounded. The CLI flag, with a plain pyzmq subscriber, is in
test_serve_kv_events.py.
"""

from __future__ import annotations

import asyncio
import json
import socket
import time
from collections.abc import Iterator
from contextlib import contextmanager

import pytest

pytest.importorskip("fastapi")
pytest.importorskip("uvicorn")
pytest.importorskip("zmq")

from routing_helpers import LOCAL  # noqa: E402
from serve_helpers import (  # noqa: E402
    TIMEOUT,
    TINY_CONFIG,
    Server,
    check_engine,
    wait_idle,
)

from radixkv.cache.events import AllBlocksCleared, BlockStored  # noqa: E402
from radixkv.cache.hashing import ChainHasher  # noqa: E402
from radixkv.engine import Engine, EngineConfig  # noqa: E402
from radixkv.fleet.transport import EventPublisher, EventSubscriber  # noqa: E402
from radixkv.model import random_model  # noqa: E402
from radixkv.serve.app import build_app  # noqa: E402
from radixkv.serve.async_engine import AsyncEngine  # noqa: E402
from radixkv.text.tokenizer import ByteTokenizer  # noqa: E402

BLOCK_SIZE = 4
PROMPT = {"prompt": "A prompt long enough to fill several blocks.", "max_tokens": 2}
ROUTES = ("/reset_prefix_cache", "/flush_cache")


@pytest.fixture(scope="module")
def model():
    return random_model(TINY_CONFIG, seed=0)


@contextmanager
def served(model, **app_options: bool) -> Iterator[tuple[Server, AsyncEngine, EventSubscriber]]:
    """A tiny engine with KV events on, published on 127.0.0.1, behind ``build_app``; and
    a subscriber of its events (replaying from the start: it misses none)."""
    config = EngineConfig(num_blocks=256, block_size=BLOCK_SIZE)
    engine = Engine(model, config, tokenizer=ByteTokenizer(), events=ChainHasher("xxhash", 0))
    with EventPublisher(LOCAL, LOCAL) as publisher:
        ae = AsyncEngine(engine, event_sink=publisher.publish)
        sub = EventSubscriber(publisher.endpoint, publisher.replay_endpoint)
        try:
            assert sub.wait_connected(int(TIMEOUT * 1000))
            with Server(build_app(ae, model_name="tiny", **app_options)) as server:
                yield server, ae, sub
        finally:
            sub.close()


def cached_tokens(server: Server) -> int:
    status, reply = server.post("/v1/completions", PROMPT)
    assert status == 200, reply
    return reply["usage"]["prompt_tokens_details"]["cached_tokens"]


def cached_blocks(ae: AsyncEngine) -> int:
    return asyncio.run_coroutine_threadsafe(
        ae.call(lambda e: e.cache.cached_blocks), ae.loop
    ).result(TIMEOUT)


def events_until(sub: EventSubscriber, kind: type) -> list:
    """Every event the subscriber gets until (and with) the first of type ``kind``."""
    got: list = []
    end = time.monotonic() + TIMEOUT
    while not any(isinstance(e, kind) for e in got):
        assert time.monotonic() < end, f"no {kind.__name__} reached the subscriber: {got}"
        got += [e for m in sub.poll(timeout_ms=50) if isinstance(m, tuple) for e in m[1].events]
    return got


def test_the_reset_routes_are_a_404_unless_enabled_then_empty_the_cache(model) -> None:
    with served(model) as (server, _, _):
        for path in ROUTES:
            status, reply = server.post(path, {})
            assert status == 404, reply
            assert reply["error"]["message"] == f"Invalid URL (POST {path})"
    with served(model, enable_cache_reset=True) as (server, ae, sub):
        for path in ROUTES:
            cached_tokens(server)
            assert cached_tokens(server) > 0  # the repeat finds the first's blocks
            assert any(isinstance(e, BlockStored) for e in events_until(sub, BlockStored))
            wait_idle(ae)
            status, data, _ = server.request("POST", path)
            assert (status, data) == (200, b""), data  # vLLM's answer: 200, no body
            assert cached_blocks(ae) == 0
            assert ae.engine.allocator.num_free == ae.engine.allocator.num_blocks
            check_engine(ae)
            assert isinstance(events_until(sub, AllBlocksCleared)[-1], AllBlocksCleared)
            assert cached_tokens(server) == 0, path  # nothing of it is left


def test_a_reset_while_a_request_runs_is_a_409_and_changes_nothing(model) -> None:
    with served(model, enable_cache_reset=True) as (server, ae, sub):
        cached_tokens(server)
        wait_idle(ae)
        before = cached_blocks(ae)
        assert before > 0
        body = {"prompt": "x", "max_tokens": 1000, "ignore_eos": True, "stream": True}
        data = json.dumps(body).encode()
        with socket.create_connection(("127.0.0.1", server.port), timeout=TIMEOUT) as sock:
            head = f"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Length: {len(data)}"
            sock.sendall(head.encode() + b"\r\n\r\n" + data)
            got = b""
            while got.count(b"data: {") < 2:  # the request is running
                chunk = sock.recv(65536)
                assert chunk, got
                got += chunk
            for path in ROUTES:
                status, reply = server.post(path, {})
                assert status == 409, reply
                assert reply["error"]["type"] == "conflict"
                assert "requests are running or waiting" in reply["error"]["message"]
            assert cached_blocks(ae) >= before  # untouched
        wait_idle(ae)  # the client left: its request is aborted
        assert server.request("POST", ROUTES[0])[0] == 200
        assert cached_blocks(ae) == 0
        check_engine(ae)
        events = events_until(sub, AllBlocksCleared)  # every event since the server started
        assert sum(isinstance(e, AllBlocksCleared) for e in events) == 1  # none for a 409
