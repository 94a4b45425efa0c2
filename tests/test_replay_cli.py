"""``radixkv replay`` and ``radixkv sweep``: output format, agreement with replay(), bad input."""

from __future__ import annotations

import csv
import json
import subprocess
import sys

import pytest
from trace_paths import TRACES

from radixkv.cli import main
from radixkv.replay import load_trace, replay
from radixkv.replay.sweep import read_csv

KEYS = [
    "policy",
    "cache_capacity_blocks",
    "block_size",
    "num_requests",
    "total_prompt_tokens",
    "total_hit_tokens",
    "overall_hit_rate",
    "final_cache_blocks",
    "block_hits",
    "block_misses",
    "unreachable_blocks",
    "orphan_blocks",
]


@pytest.fixture
def small_trace(tmp_path):
    rows = [
        {"timestamp": 0, "input_length": 1100, "output_length": 3, "hash_ids": [1, 2, 3]},
        {"timestamp": 5, "input_length": 1300, "output_length": 3, "hash_ids": [1, 2, 4]},
        {"timestamp": 9, "input_length": 600, "output_length": 3, "hash_ids": [1, 2]},
        {"timestamp": 9, "input_length": 900, "output_length": 3, "hash_ids": [5, 2]},
    ]
    path = tmp_path / "small.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def run_cli(capsys, *argv):
    code = main([str(a) for a in argv])
    out, err = capsys.readouterr()
    return code, out, err


@pytest.mark.parametrize("policy", ["lru", "lfu", "s3fifo", "radix-level", "radix-lru"])
def test_replay_prints_one_json_object(capsys, small_trace, policy):
    code, out, err = run_cli(
        capsys, "replay", small_trace, "--policy", policy, "--capacity", 10, "--per-request"
    )
    assert code == 0 and err == ""
    assert out.count("\n") == 1
    d = json.loads(out)
    assert list(d) == [*KEYS, "per_request"]
    # [1 2 3]: 0; [1 2 4]: k=2 -> 1024; [1 2]: k=2 -> min(1024, 600); [5 2]: 0.
    # S3FIFO (small queue of 1): 1 and 2 pass through small into the ghost, so [1 2 4]
    # misses; its ghost hits move 1 and 2 to main, so [1 2] hits.
    hit_tokens = [0, 0, 600, 0] if policy == "s3fifo" else [0, 1024, 600, 0]
    prompt_tokens = [1100, 1300, 600, 900]
    assert d["per_request"] == [
        {"prompt_tokens": p, "hit_tokens": h}
        for p, h in zip(prompt_tokens, hit_tokens, strict=True)
    ]
    assert d["total_hit_tokens"] == sum(hit_tokens) and d["total_prompt_tokens"] == 3900
    assert d["overall_hit_rate"] == sum(hit_tokens) / 3900
    assert d == replay(load_trace(small_trace), policy, 10).to_dict(per_request=True)


def test_replay_options_reach_the_replay(capsys):
    path = TRACES / "synthetic_trace.jsonl"
    argv = ["replay", path, "--policy", "s3fifo", "--capacity", 2000]
    argv += ["--block-size", 256, "--small-ratio", 0.25, "--max-freq", 1]
    code, out, _ = run_cli(capsys, *argv)
    assert code == 0
    expected = replay(load_trace(path), "s3fifo", 2000, 256, 0.25, 1).to_dict()
    assert json.loads(out) == expected
    assert "per_request" not in expected and expected["block_size"] == 256


def test_replay_as_a_process():
    cmd = [sys.executable, "-m", "radixkv.cli", "replay", str(TRACES / "conversation_trace.jsonl")]
    cmd += ["--policy", "lru", "--capacity", "4096"]
    proc = subprocess.run(cmd, capture_output=True, text=True, check=True)
    d = json.loads(proc.stdout)
    assert d["num_requests"] == 12031 and d["total_prompt_tokens"] == 144793823
    assert d["cache_capacity_blocks"] == 4096 and d["final_cache_blocks"] == 4096


BAD_ARGS = [
    (["--policy", "lru", "--capacity", "0"], "capacity must be in"),
    (["--policy", "lru", "--capacity", "-3"], "capacity must be in"),
    (["--policy", "lru", "--capacity", "abc"], "invalid int value"),
    (["--policy", "mru", "--capacity", "8"], "invalid choice"),
    (["--policy", "lru"], "required"),
    (["--policy", "lru", "--capacity", "8", "--block-size", "0"], "block_size must be in"),
    (["--policy", "lru", "--capacity", "8", "--small-ratio", "1.5"], "small_ratio"),
    (["--policy", "lru", "--capacity", "8", "--small-ratio", "nan"], "small_ratio"),
    (["--policy", "s3fifo", "--capacity", "8", "--max-freq", "-1"], "max_freq"),
    (["--policy", "s3fifo", "--capacity", "4"], "small queue empty"),
    (["--policy", "lru", "--capacity", "8", "--bogus"], "unrecognized arguments: --bogus"),
]


@pytest.mark.parametrize(("args", "message"), BAD_ARGS)
def test_bad_arguments_exit_2_with_one_line(capsys, small_trace, args, message):
    try:
        code = main(["replay", str(small_trace), *args])
    except SystemExit as exc:  # argparse's own usage errors
        code = exc.code
    out, err = capsys.readouterr()
    assert code == 2 and out == ""
    assert err.count("\n") == 1 and err.startswith("radixkv replay: error: ")
    assert message in err


def test_bad_trace_files_exit_2_with_one_line(capsys, tmp_path):
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"timestamp": 0, "input_length": 1, "output_length": 1, "hash_ids": [1]}\n{\n')
    for path, message in [
        (bad, f"{bad}:2: invalid JSON"),
        (tmp_path / "absent.jsonl", "No such file"),
        (tmp_path, "Is a directory"),
    ]:
        code, out, err = run_cli(capsys, "replay", path, "--policy", "lru", "--capacity", 4)
        assert code == 2 and out == ""
        assert err.count("\n") == 1 and message in err


def test_sweep_writes_csv_png_and_table(capsys, small_trace, tmp_path):
    csv_path = tmp_path / "out.csv"
    code, out, err = run_cli(
        capsys,
        "sweep",
        small_trace,
        "--policies",
        "lru,s3fifo",
        "radix-lru",
        "--capacities",
        "2",
        "10",
        "--small-ratio",
        "0.5",
        "--csv",
        csv_path,
    )
    assert code == 0
    assert "sweep small.jsonl" in err  # the progress bar
    with open(csv_path) as f:
        rows = list(csv.DictReader(f))
    assert [(r["policy"], int(r["capacity"])) for r in rows] == [
        ("lru", 2),
        ("lru", 10),
        ("s3fifo", 2),
        ("s3fifo", 10),
        ("radix-lru", 2),
        ("radix-lru", 10),
        ("infinite", 5),
    ]
    trace = load_trace(small_trace)
    for r in rows[:-1]:
        expected = replay(trace, r["policy"], int(r["capacity"]), small_ratio=0.5)
        assert int(r["total_hit_tokens"]) == expected.total_hit_tokens
        assert float(r["overall_hit_rate"]) == expected.overall_hit_rate
    assert int(rows[-1]["total_hit_tokens"]) == 1624  # nothing evicted: [0, 1024, 600, 0]
    back = read_csv(csv_path)
    assert [(r.policy, r.capacity, r.total_hit_tokens) for r in back] == [
        (r["policy"], int(r["capacity"]), int(r["total_hit_tokens"])) for r in rows
    ]
    assert back[0].small_ratio == 0.5 and isinstance(back[0].overall_hit_rate, float)
    png = csv_path.with_suffix(".png")
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert "radix-lru" in out and str(csv_path) in out


def test_sweep_bad_input_runs_nothing(capsys, small_trace, tmp_path):
    csv_path = tmp_path / "out.csv"
    for args, message in [
        (["--policies", "lru", "s3fifo", "--capacities", "64", "4"], "small queue empty"),
        (["--capacities", "8,x"], "not a valid int"),
        (["--policies", "lru,bogus", "--capacities", "8"], "policy must be one of"),
    ]:
        code, out, err = run_cli(capsys, "sweep", small_trace, *args, "--csv", csv_path)
        assert code == 2 and out == "" and err.count("\n") == 1 and message in err
        assert not csv_path.exists()
