"""Test helpers for the serving tier: one tiny random decoder over the byte tokenizer's
vocabulary, shared by the async-engine and server tests; :class:`Server`, a real uvicorn
server on 127.0.0.1 in a thread; :func:`spawn_serve`, ``radixkv serve`` as a process."""

from __future__ import annotations

import asyncio
import http.client
import json
import os
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from typing import TYPE_CHECKING

from radixkv.model import ModelConfig
from radixkv.text.tokenizer import ByteTokenizer

if TYPE_CHECKING:
    from radixkv.engine import Engine
    from radixkv.serve.async_engine import AsyncEngine

TINY_CONFIG = ModelConfig(
    vocab_size=ByteTokenizer.vocab_size,
    hidden_size=64,
    intermediate_size=128,
    num_layers=2,
    num_heads=4,
    num_kv_heads=2,
    head_dim=16,
)

TIMEOUT = 30.0  # seconds: a bound on every wait, never reached when things work


class Server:
    """A uvicorn server for ``app`` on a free 127.0.0.1 port, in a thread of its own."""

    def __init__(self, app) -> None:
        import uvicorn

        self.sock = socket.socket()
        self.sock.bind(("127.0.0.1", 0))
        self.port = self.sock.getsockname()[1]
        config = uvicorn.Config(app, log_level="warning", lifespan="on")
        self.server = uvicorn.Server(config)
        self.thread = threading.Thread(target=self.server.run, kwargs={"sockets": [self.sock]})

    def __enter__(self) -> Server:
        self.thread.start()
        end = time.monotonic() + TIMEOUT
        while not self.server.started:
            assert time.monotonic() < end and self.thread.is_alive(), "server did not start"
            time.sleep(0.01)
        return self

    def __exit__(self, *exc: object) -> None:
        self.server.should_exit = True
        self.thread.join(TIMEOUT)
        self.sock.close()

    def request(
        self,
        method: str,
        path: str,
        body: object = None,
        raw: bytes | None = None,
        headers: dict[str, str] | None = None,
    ) -> tuple[int, bytes, http.client.HTTPResponse]:
        """One request on a fresh connection; JSON ``body`` (or ``raw`` bytes) is sent as
        ``application/json`` unless ``headers`` say otherwise."""
        conn = http.client.HTTPConnection("127.0.0.1", self.port, timeout=TIMEOUT)
        try:
            data = raw if raw is not None else None if body is None else json.dumps(body).encode()
            if headers is None:
                headers = {"Content-Type": "application/json"} if data is not None else {}
            conn.request(method, path, body=data, headers=headers)
            resp = conn.getresponse()
            return resp.status, resp.read(), resp
        finally:
            conn.close()

    def post(self, path: str, body: object) -> tuple[int, dict]:
        status, data, _ = self.request("POST", path, body)
        return status, json.loads(data)

    def stream(self, path: str, body: dict) -> list[dict]:
        """The events of a streamed reply, parsed; asserts it ends with ``[DONE]``."""
        status, data, resp = self.request("POST", path, {**body, "stream": True})
        assert status == 200, data
        assert resp.getheader("content-type").startswith("text/event-stream")
        events = [e for e in data.decode().split("\n\n") if e]
        assert all(e.startswith("data: ") for e in events), events
        assert events[-1] == "data: [DONE]"
        return [json.loads(e[len("data: ") :]) for e in events[:-1]]


def tiny_engine(model, *, num_blocks: int, block_size: int, **config) -> Engine:
    """An ``Engine`` over ``model`` with the byte tokenizer: what the server tests serve."""
    from radixkv.engine import Engine, EngineConfig

    cfg = EngineConfig(num_blocks=num_blocks, block_size=block_size, **config)
    return Engine(model, cfg, tokenizer=ByteTokenizer())


@contextmanager
def served_engine(engine: Engine, model_name: str) -> Iterator[tuple[Server, AsyncEngine]]:
    """``engine`` behind ``build_app`` on a :class:`Server`, with its ``AsyncEngine``."""
    from radixkv.serve.app import build_app
    from radixkv.serve.async_engine import AsyncEngine

    ae = AsyncEngine(engine)
    with Server(build_app(ae, model_name=model_name)) as server:
        yield server, ae


def spawn_serve(*flags: str) -> tuple[subprocess.Popen, int]:
    """``radixkv serve --model random --port 0 FLAGS`` as a process (stdout and stderr
    piped, text), once it has printed its URL; and its port. The caller ends it."""
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    argv = [sys.executable, "-m", "radixkv.cli", "serve", "--model", "random", "--port", "0"]
    proc = subprocess.Popen(
        [*argv, *flags], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env
    )
    line = proc.stdout.readline()  # blocks until the model is loaded and the port bound
    if not line.startswith("radixkv serve: "):
        proc.kill()
        raise AssertionError(f"radixkv serve did not start: {line!r} {proc.stderr.read()}")
    url = line.split(" at ", 1)[1].split()[0]
    return proc, int(url.rsplit(":", 1)[1].split("/")[0])


def wait_answering(port: int) -> None:
    """Wait (at most ``TIMEOUT``) until a spawned server on ``port`` answers ``GET /health``:
    :func:`spawn_serve` returns once the port is bound, before uvicorn listens on it."""
    end = time.monotonic() + TIMEOUT
    while True:
        conn = http.client.HTTPConnection("127.0.0.1", port, timeout=TIMEOUT)
        try:
            conn.request("GET", "/health")
            if conn.getresponse().status == 200:
                return
        except ConnectionRefusedError:
            pass
        finally:
            conn.close()
        assert time.monotonic() < end, "the server never answered"
        time.sleep(0.05)


def wait_idle(ae: AsyncEngine) -> None:
    """Wait (at most ``TIMEOUT``) until ``ae`` has no running, waiting or open request."""
    end = time.monotonic() + TIMEOUT
    while ae.metrics().running or ae.metrics().waiting or ae.num_requests:
        assert time.monotonic() < end, f"engine still busy: {ae.metrics()}"
        time.sleep(0.01)


def check_engine(ae: AsyncEngine) -> None:
    """Once ``ae`` is idle, run its engine's invariant check on its own thread."""
    wait_idle(ae)
    asyncio.run_coroutine_threadsafe(ae.check(), ae.loop).result(TIMEOUT)
