"""``radixkv serve --kv-events ENDPOINT[,REPLAY_ENDPOINT]`` (issue 24, item 5): one server
publishes its radix cache's KV events as vLLM does, and a subscriber written with plain
pyzmq and msgspec (nothing of radixkv's) reads them, live and by replay, and hears an
operator's cache reset (``--enable-cache-reset``). Waits are bounded.
"""

from __future__ import annotations

import http.client
import json
import subprocess
import sys
import time

import pytest

zmq = pytest.importorskip("zmq")
msgspec = pytest.importorskip("msgspec")
pytest.importorskip("fastapi")

from serve_helpers import TIMEOUT, spawn_serve  # noqa: E402

END = (-1).to_bytes(8, "big", signed=True)  # vLLM's end-of-replay seq frame
BLOCK = 4


def post(port: int, path: str, body: dict) -> tuple[int, dict]:
    """POST once the server answers (the port is bound before uvicorn listens)."""
    end = time.monotonic() + TIMEOUT
    while True:
        conn = http.client.HTTPConnection("127.0.0.1", port, timeout=TIMEOUT)
        try:
            conn.request("POST", path, json.dumps(body), {"Content-Type": "application/json"})
            resp = conn.getresponse()
            return resp.status, json.loads(resp.read())
        except ConnectionRefusedError:
            assert time.monotonic() < end, "the server never answered"
            time.sleep(0.05)
        finally:
            conn.close()


def stored(payload: bytes) -> list[list[int]]:
    """The token ids of every BlockStored event in one msgpack batch ``[ts, events, rank]``."""
    ts, events, _ = msgspec.msgpack.decode(payload)
    assert isinstance(ts, float)
    return [e["token_ids"] for e in events if e["type"] == "BlockStored"]


def test_a_single_server_publishes_vllms_kv_events_live_and_by_replay() -> None:
    proc, port = spawn_serve(
        "--kv-events", "tcp://127.0.0.1:0,tcp://127.0.0.1:0",
        "--block-size", str(BLOCK), "--num-blocks", "256", "--enable-cache-reset",
    )  # fmt: skip
    ctx = zmq.Context()
    try:
        proc.stdout.readline()  # the curl line
        line = proc.stdout.readline().strip()
        assert line.startswith("KV events on tcp://127.0.0.1:"), line
        live, replay = line.removeprefix("KV events on ").split(", replay on ")
        sub = ctx.socket(zmq.SUB)
        sub.setsockopt(zmq.SUBSCRIBE, b"")
        sub.connect(live)
        prompts: list[list[int]] = []
        frames = None
        end = time.monotonic() + TIMEOUT
        while frames is None:  # a SUB socket misses what is sent before it joins: retry
            prompts.append(list(f"{len(prompts):03d} events, as vLLM publishes them".encode()))
            body = {"prompt": prompts[-1], "max_tokens": 2, "temperature": 0}
            assert post(port, "/v1/completions", body)[0] == 200
            assert time.monotonic() < end, "no event reached the subscriber"
            if sub.poll(500):
                frames = sub.recv_multipart()
        topic, seq, payload = frames
        assert topic == b"" and len(seq) == 8
        blocks = stored(payload)
        while sub.poll(200):  # the rest of what was stored
            blocks += stored(sub.recv_multipart()[2])
        # each stored chain starts a prompt (each attempt's first block is new) and follows it
        full = len(prompts[0]) // BLOCK * BLOCK
        starts = [p for p in prompts for ids in blocks if ids[:BLOCK] == p[:BLOCK]]
        assert starts, (blocks, prompts)
        chain = next(ids for ids in blocks if ids[:BLOCK] == starts[0][:BLOCK])
        assert chain[:full] == starts[0][: min(full, len(chain))]
        assert all(len(ids) % BLOCK == 0 for ids in blocks)
        # replay from seq 0: every batch the server published, in order, then the end marker
        dealer = ctx.socket(zmq.DEALER)
        dealer.connect(replay)
        dealer.send_multipart([b"", (0).to_bytes(8, "big")])
        seqs, replayed = [], []
        while True:
            assert dealer.poll(TIMEOUT * 1000), "replay did not answer"
            _, seq_frame, data = dealer.recv_multipart()
            if seq_frame == END:
                break
            seqs.append(int.from_bytes(seq_frame, "big"))
            replayed += stored(data)
        assert seqs == list(range(len(seqs))) and seqs
        assert [t for ids in replayed for t in ids][:full] == prompts[0][:full]
        # --enable-cache-reset: SGLang's flush empties the cache, and subscribers hear it
        conn = http.client.HTTPConnection("127.0.0.1", port, timeout=TIMEOUT)
        try:
            conn.request("POST", "/flush_cache")
            assert conn.getresponse().status == 200
        finally:
            conn.close()
        kinds: list[str] = []
        while "AllBlocksCleared" not in kinds:
            assert sub.poll(TIMEOUT * 1000), f"no AllBlocksCleared reached the subscriber: {kinds}"
            kinds += [e["type"] for e in msgspec.msgpack.decode(sub.recv_multipart()[2])[1]]
        body = {"prompt": prompts[0], "max_tokens": 2, "temperature": 0}
        status, reply = post(port, "/v1/completions", body)
        assert status == 200, reply
        assert reply["usage"]["prompt_tokens_details"]["cached_tokens"] == 0, reply
    finally:
        ctx.destroy(linger=0)
        proc.terminate()
        proc.communicate(timeout=TIMEOUT)


@pytest.mark.parametrize(
    ("flags", "message"),
    [
        (["--kv-events", "tcp://127.0.0.1:0,tcp://127.0.0.1:0,tcp://x"],
         b"ENDPOINT[,REPLAY_ENDPOINT]"),
        (["--kv-events", "nonsense://here"], b"--kv-events: EventPublisher cannot bind"),
        # a fleet: replica r publishes on port + r, so these two ranges overlap
        (["--kv-events", "tcp://*:5557,tcp://*:5558", "--replicas", "2", "--router", "exact"],
         b"gives replica 0 the address tcp://*:5558, which the event_endpoint of replica 1"),
        (["--metrics-prefix", "9x", "--replicas", "2", "--router", "exact"],
         b"metrics prefix must be letters"),
        (["--no-enable-prefix-caching", "--kv-events", "tcp://127.0.0.1:0"],
         b"--kv-events needs the prefix cache"),
        (["--no-enable-prefix-caching", "--replicas", "2", "--router", "exact"],
         b"--no-enable-prefix-caching is for one server"),
    ],
)  # fmt: skip
def test_bad_kv_events_flags_exit_2_with_one_line(flags, message) -> None:
    argv = [sys.executable, "-m", "radixkv.cli", "serve", "--model", "random", "--port", "0"]
    done = subprocess.run([*argv, *flags], capture_output=True, timeout=120)
    assert done.returncode == 2, done.stderr
    assert done.stderr.count(b"\n") == 1 and message in done.stderr, done.stderr
