"""A server over a KV store (issue 35): a restart answers from the store, ``/metrics`` says
so, and ``radixkv serve --kv-store`` refuses a bad store in one line."""

from __future__ import annotations

import socket
from pathlib import Path

import pytest
import torch

pytest.importorskip("fastapi")
pytest.importorskip("uvicorn")

from prometheus_client.parser import text_string_to_metric_families  # noqa: E402
from serve_helpers import TINY_CONFIG, Server, tiny_engine, wait_idle  # noqa: E402

from radixkv.cli import main  # noqa: E402
from radixkv.model import random_model  # noqa: E402
from radixkv.serve.app import build_app  # noqa: E402
from radixkv.serve.async_engine import AsyncEngine  # noqa: E402

torch.set_num_threads(1)
MODEL = "tiny-random"


@pytest.fixture(scope="module")
def model():
    return random_model(TINY_CONFIG, seed=0)


def completion(server: Server, prompt: list[int]) -> dict:
    status, reply = server.post(
        "/v1/completions", {"model": MODEL, "prompt": prompt, "max_tokens": 4, "temperature": 0}
    )
    assert status == 200, reply
    return reply


def metrics(server: Server) -> dict[str, float]:
    status, data, _ = server.request("GET", "/metrics")
    assert status == 200
    return {
        s.name: s.value
        for family in text_string_to_metric_families(data.decode())
        for s in family.samples
    }


def serve_one(model, tmp_path: Path, prompt: list[int], **config) -> tuple[dict, dict]:
    """``prompt`` through a fresh server (an engine over the store in ``tmp_path`` unless
    ``config`` says otherwise); its reply and its ``/metrics`` once idle."""
    settings = {"kv_store": str(tmp_path), "kv_store_capacity_bytes": 1 << 26, **config}
    ae = AsyncEngine(tiny_engine(model, num_blocks=64, block_size=4, **settings))
    with Server(build_app(ae, model_name=MODEL)) as server:
        reply = completion(server, prompt)
        wait_idle(ae)
        return reply, metrics(server)


def test_a_restarted_server_answers_from_the_store(model, tmp_path) -> None:
    first = [(7 * k) % 200 + 1 for k in range(30)]
    _, before = serve_one(model, tmp_path, first)
    assert before["radixkv:kv_store_stored_blocks_total"] == (30 + 4 - 1) // 4  # and the reply
    assert before["radixkv:kv_store_loaded_blocks_total"] == 0

    follow_up = first + [(3 * k) % 200 + 1 for k in range(9)]
    reply, after = serve_one(model, tmp_path, follow_up)  # a new engine over the same folder
    assert reply["usage"]["prompt_tokens_details"]["cached_tokens"] == 28
    assert after["radixkv:kv_store_loaded_blocks_total"] == 7
    assert after["radixkv:kv_store_loaded_bytes_total"] == 7 * model.make_kv_pool(
        1, 4, device="cpu"
    ).bytes_per_block
    assert after["radixkv:kv_store_errors_total"] == 0
    assert after["radixkv:kv_store_corrupt_blocks_total"] == 0
    assert after["radixkv:kv_store_entries"] >= 7 and after["radixkv:host_cache_blocks"] > 0
    cold, _ = serve_one(model, tmp_path, follow_up, kv_store=None, cache=None)
    assert reply["choices"][0]["text"] == cold["choices"][0]["text"]


# ------------------------------------------------------------ radixkv serve --kv-store
def exit_code(argv: list[str]) -> int:
    try:
        return main(argv)
    except SystemExit as exc:
        return int(exc.code or 0)


SERVE = ["serve", "--model", "random", "--port", "0"]


@pytest.mark.parametrize(
    ("flags", "start"),
    [
        (["--kv-store-capacity", "1000"], "--kv-store-capacity needs --kv-store"),
        (["--kv-store-write-policy", "write_back"], "--kv-store-write-policy needs --kv-store"),
        (["--kv-store", ""], "--kv-store: kv_store must be a directory or mooncake://"),
        (["--kv-store", "mooncake://"], "--kv-store: kv_store must be mooncake://HOST:PORT"),
        (["--kv-store", "{file}"], "--kv-store: kv_store '{file}': path must be a directory"),
        (["--kv-store", "{file}", "--replicas", "2", "--router", "exact"],
         "--kv-store: kv_store '{file}': path must be a directory"),
        (["--kv-store", "mooncake://127.0.0.1:{port}", "--replicas", "2", "--router", "exact"],
         "--kv-store: kv_store 'mooncake://127.0.0.1:{port}': master_address must be "
         "reachable, got '127.0.0.1:{port}'"),
        (["--kv-store", "{dir}", "--no-enable-prefix-caching"],
         "--kv-store needs the prefix cache"),
        (["--kv-store", "{dir}", "--kv-store-capacity", "99999999999999999999999999"],
         "argument --kv-store-capacity: must be <="),
        (["--store-aware"], "--store-aware is for a fleet's router: it needs --replicas > 1"),
        (["--store-aware", "--replicas", "2", "--router", "exact"],
         "--store-aware needs --kv-store"),
        (["--store-aware", "--kv-store", "{dir}", "--replicas", "2", "--router", "round_robin"],
         "--store-aware needs a prefix-aware --router ('approx', 'exact'), got 'round_robin'"),
    ],
)  # fmt: skip
def test_serve_refuses_a_bad_store_in_one_line(capsys, tmp_path, flags, start) -> None:
    afile = tmp_path / "a-file"
    afile.write_text("")
    with socket.socket() as sock:  # a port nothing listens on once it is closed
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    names = {"file": str(afile), "dir": str(tmp_path / "store"), "port": port}
    assert exit_code([*SERVE, *(f.format(**names) for f in flags)]) == 2
    out, err = capsys.readouterr()
    assert out == "" and err.count("\n") == 1, err
    assert err.startswith(f"radixkv serve: error: {start.format(**names)}"), err


def test_serve_passes_the_store_flags_to_the_engine(monkeypatch, tmp_path) -> None:
    import radixkv.serve.models as models

    seen: list[dict] = []

    def build_engine(spec: object, **settings: object) -> None:
        seen.append(settings)
        raise ValueError("stop here")

    monkeypatch.setattr(models, "build_engine", build_engine)
    flags = ["--kv-store", str(tmp_path), "--kv-store-capacity", "123456",
             "--kv-store-write-policy", "write_back"]  # fmt: skip
    assert exit_code([*SERVE, *flags]) == 2
    [settings] = seen
    assert settings["kv_store"] == str(tmp_path)
    assert settings["kv_store_capacity_bytes"] == 123456
    assert settings["kv_store_write_policy"] == "write_back"


def test_the_host_tier_a_store_adds_counts_against_the_memory(capsys, monkeypatch, tmp_path):
    """--kv-store adds a host tier as large as the pool: the memory check counts it."""
    import radixkv.serve.cli as serve_cli
    from radixkv.model.kvpool import KVPool
    from radixkv.model.loading import RANDOM_CONFIG as c

    if torch.cuda.is_available():
        pytest.skip("the device pool is on the GPU: the two pools do not share the memory")
    per_block = KVPool.block_bytes(c.num_layers, 16, c.num_kv_heads, c.head_dim, torch.float32)
    monkeypatch.setattr(serve_cli, "_available_memory", lambda device: 1500 * per_block)
    argv = [*SERVE, "--num-blocks", "1000", "--kv-store", str(tmp_path / "store")]
    assert exit_code(argv) == 2
    _, err = capsys.readouterr()
    assert err.startswith("radixkv serve: error: --num-blocks 1000 (") and err.count("\n") == 1
    assert "the host tier of --kv-store (" in err and "together" in err
