"""``radixkv replay`` and ``radixkv sweep``: output format, agreement with replay(), bad input."""

from __future__ import annotations

import csv
import io
import json
import subprocess
import sys

import pytest
from trace_paths import FULL_TRACES, TRACES

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
    # The trace's ids are 512-token blocks: another block size needs --no-check-lengths.
    argv += ["--block-size", 256, "--small-ratio", 0.25, "--max-freq", 1, "--no-check-lengths"]
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
    # the full trace, or the excerpt's figures in tests/data/mooncake/README.md
    expected = (12031, 144793823) if FULL_TRACES else (500, 7124855)
    assert (d["num_requests"], d["total_prompt_tokens"]) == expected
    assert d["cache_capacity_blocks"] == 4096 and d["final_cache_blocks"] == 4096


BAD_ARGS = [
    (["--policy", "lru", "--capacity", "0"], "argument --capacity: must be >= 1, got 0"),
    (["--policy", "lru", "--capacity", "-3"], "argument --capacity: must be >= 1, got -3"),
    (["--policy", "lru", "--capacity", "2147483648"], "argument --capacity: must be <= "),
    (["--policy", "lru", "--capacity", "abc"], "--capacity: expected an integer, got 'abc'"),
    (["--policy", "mru", "--capacity", "8"], "invalid choice"),
    (["--policy", "lru"], "required"),
    (["--policy", "lru", "--capacity", "8", "--block-size", "0"], "argument --block-size: must"),
    (["--policy", "lru", "--capacity", "8", "--small-ratio", "1.5"], "--small-ratio: must be in"),
    (["--policy", "lru", "--capacity", "8", "--small-ratio", "nan"], "--small-ratio: must be in"),
    (["--policy", "s3fifo", "--capacity", "8", "--max-freq", "-1"], "--max-freq: must be >= 0"),
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


@pytest.mark.parametrize("command", ["replay", "sweep"])
@pytest.mark.parametrize("value", ["[" * 5000 + "]" * 5000, '{"a": ' * 5000 + "1" + "}" * 5000])
def test_a_deeply_nested_line_is_a_one_line_error(capsys, tmp_path, monkeypatch, command, value):
    """A line nested ~5,000 deep gets the loader's ``FILE:LINE`` error and rc 2, not a
    RecursionError traceback."""
    monkeypatch.chdir(tmp_path)  # sweep's default CSV would land here
    path = tmp_path / "deep.jsonl"
    good = '{"timestamp": 0, "input_length": 1, "output_length": 1, "hash_ids": [1]}'
    path.write_text(f"{good}\n{value}\n")
    args = ["--policy", "lru", "--capacity", 4] if command == "replay" else ["--no-progress"]
    code, out, err = run_cli(capsys, command, path, *args)
    assert code == 2 and out == ""
    assert err == f"radixkv {command}: error: {path}:2: invalid JSON: it nests too deeply\n"
    assert list(tmp_path.glob("*_sweep.*")) == []


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
        (["--capacities", "8,x"], "--capacities: expected an integer, got 'x'"),
        (["--policies", "lru,bogus", "--capacities", "8"], "policy must be one of"),
    ]:
        code, out, err = run_cli(capsys, "sweep", small_trace, *args, "--csv", csv_path)
        assert code == 2 and out == "" and err.count("\n") == 1 and message in err
        assert not csv_path.exists()


def test_sweep_bad_capacities_name_the_flag(capsys, small_trace, tmp_path):
    csv_path = tmp_path / "out.csv"
    for bad in ["0", "-4", "2147483648"]:
        code, out, err = run_cli(capsys, "sweep", small_trace, "--capacities", f"8,{bad}")
        assert code == 2 and out == "" and err.count("\n") == 1
        assert err.startswith("radixkv sweep: error: --capacities: must be ") and bad in err
    assert not csv_path.exists()


# ---------------------------------------------------------------- issue 11, item 17
@pytest.mark.parametrize("command", ["replay", "sweep"])
@pytest.mark.parametrize("content", [None, "", "\n  \n"])
def test_empty_trace_exits_2(capsys, tmp_path, monkeypatch, command, content):
    """An empty trace (a wrong path such as /dev/null) is an error, not a zero result."""
    monkeypatch.chdir(tmp_path)  # sweep's default CSV would land here
    if content is None:
        path = "/dev/null"
    else:
        path = tmp_path / "empty.jsonl"
        path.write_text(content)
    args = ["--policy", "lru", "--capacity", 4] if command == "replay" else ["--no-progress"]
    code, out, err = run_cli(capsys, command, path, *args)
    assert code == 2 and out == ""
    assert err == f"radixkv {command}: error: trace {path} has no requests\n"
    assert list(tmp_path.glob("*_sweep.*")) == []


# ---------------------------------------------------------------- issue 11, item 18
def test_hash_ids_must_cover_input_length(capsys, tmp_path):
    """Mooncake's rule len(hash_ids) == ceil(input_length / block_size), checked per line."""
    path = tmp_path / "t.jsonl"
    good = {"timestamp": 0, "input_length": 1025, "output_length": 1, "hash_ids": [1, 2, 3]}
    bad = {**good, "input_length": 10, "hash_ids": [1, 2, 3, 4, 5, 6, 7, 8]}
    path.write_text(json.dumps(good) + "\n" + json.dumps(bad) + "\n")
    for command, args in [
        ("replay", ["--policy", "lru", "--capacity", 8]),
        ("sweep", ["--capacities", 8, "--csv", tmp_path / "o.csv", "--no-progress"]),
    ]:
        code, out, err = run_cli(capsys, command, path, *args)
        assert code == 2 and out == "" and err.count("\n") == 1
        assert f"{path}:2: 8 hash_ids, but input_length 10 at block size 512" in err
        assert "ceil(10 / 512) = 1" in err and "--no-check-lengths" in err
        code, out, err = run_cli(capsys, command, path, *args, "--no-check-lengths")
        assert code == 0
    # --block-size is the block size checked: at 1024 the first line's 3 ids are too many.
    code, out, err = run_cli(
        capsys, "replay", path, "--policy", "lru", "--capacity", 8, "--block-size", 1024
    )
    assert code == 2 and f"{path}:1: 3 hash_ids" in err


def test_real_trace_at_another_block_size_is_rejected_at_line_1(capsys):
    path = TRACES / "synthetic_trace.jsonl"
    code, out, err = run_cli(
        capsys, "replay", path, "--policy", "lru", "--capacity", 8, "--block-size", 256
    )
    assert code == 2 and out == "" and err.count("\n") == 1
    assert f"{path}:1: " in err and "at block size 256" in err


# ---------------------------------------------------------------- issue 11, item 20
@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--png", "o.txt"], "--png: the file name must end in .png, got 'o.txt'"),
        (["--csv", "o.txt"], "--csv: the file name must end in .csv, got 'o.txt'"),
        (["--csv", "{tmp}/missing/o.csv"], "--csv: directory '{tmp}/missing' does not exist"),
        (["--png", "{tmp}/missing/o.png"], "--png: directory '{tmp}/missing' does not exist"),
        (["--csv", "{tmp}/dir.csv"], "--csv: '{tmp}/dir.csv' is a directory"),
    ],
)
def test_sweep_checks_output_paths_before_anything_runs(
    capsys, tmp_path, monkeypatch, args, message
):
    import radixkv.replay.cli as replay_cli

    def never(*a, **k):
        raise AssertionError("replayed before checking the output paths")

    monkeypatch.setattr(replay_cli, "run_sweep", never)
    monkeypatch.setattr(replay_cli, "load_trace", never)
    monkeypatch.chdir(tmp_path)
    (tmp_path / "dir.csv").mkdir()
    args = [a.replace("{tmp}", str(tmp_path)) for a in args]
    code, out, err = run_cli(capsys, "sweep", tmp_path / "absent.jsonl", *args)
    assert code == 2 and out == ""
    assert err.count("\n") == 1
    assert err.startswith(f"radixkv sweep: error: {message.replace('{tmp}', str(tmp_path))}")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["dir.csv"]


# ---------------------------------------------------------------- issue 11, item 22
def _stdin(monkeypatch, data: bytes) -> None:
    monkeypatch.setattr(sys, "stdin", io.TextIOWrapper(io.BytesIO(data)))


def test_replay_reads_the_trace_from_stdin(capsys, small_trace, monkeypatch):
    argv = ["--policy", "s3fifo", "--capacity", 10, "--small-ratio", 0.5, "--per-request"]
    code, from_file, _ = run_cli(capsys, "replay", small_trace, *argv)
    assert code == 0
    _stdin(monkeypatch, small_trace.read_bytes())
    code, from_stdin, err = run_cli(capsys, "replay", "-", *argv)
    assert code == 0 and err == "" and from_stdin == from_file


def test_sweep_reads_stdin_once_and_replays_it_many_times(
    capsys, small_trace, tmp_path, monkeypatch
):
    argv = ["--policies", "lru,lfu,radix-lru", "--capacities", "2,10", "--no-progress"]
    code, _, _ = run_cli(capsys, "sweep", small_trace, *argv, "--csv", tmp_path / "file.csv")
    assert code == 0
    monkeypatch.chdir(tmp_path)
    _stdin(monkeypatch, small_trace.read_bytes())
    code, out, _ = run_cli(capsys, "sweep", "-", *argv)
    assert code == 0 and "stdin_sweep.csv" in out

    def key(rows):
        return [(r.policy, r.capacity, r.total_hit_tokens, r.final_cache_blocks) for r in rows]

    from_stdin = read_csv(tmp_path / "stdin_sweep.csv")
    assert len(from_stdin) == 7  # 3 policies x 2 capacities + the ceiling
    assert key(from_stdin) == key(read_csv(tmp_path / "file.csv"))
    assert (tmp_path / "stdin_sweep.png").exists()
