"""Serving end to end: one engine, then a Ray Serve fleet under each router, same chat load.

Starts ``radixkv serve`` as a subprocess on 127.0.0.1 (one engine, then
``--replicas N --router R`` for each router), plays the same multi-turn chat
workload against each from concurrent clients (``loadgen.py`` beside it: chats
in groups sharing a system prompt, each turn extending the last), and prints,
per setup, TTFT p50/p90 (client-side), throughput (completion tokens/s), the
fleet's prefix-cache hit rate (cached over prompt tokens, from each response's
``usage``) and requests per replica (max/mean, from the fleet's ``GET /replicas``
before and after the run). Routers: radixkv's policies by name, ``serve`` (Serve's
own power-of-two router) and ``ray_prefix`` (Ray's ``PrefixCacheAffinityRouter``),
all measured in the same run. ``--docs`` rewrites the table in docs/serving.md.

    python benchmarks/bench_serve.py [--model random] [--replicas 2]
        [--routers serve,ray_prefix,pow2,chwbl,approx,exact] [--out F] [--docs]

``--routers ''`` plays the one-engine row alone; ``--serve-args`` passes more
flags to every server (``--dtype``, ``--attention-backend``, ``--enforce-eager``,
``--no-enable-prefix-caching``: one engine's variants, as ``gpu_smollm2.sh`` runs them).
"""

from __future__ import annotations

import argparse
import http.client
import json
import shlex
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from bench_common import save_rows  # noqa: E402
from loadgen import ChatTraffic, LoadResult, run_chat_workload  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
DOCS = ROOT / "docs" / "serving.md"
BEGIN, END = "<!-- bench_serve:begin -->", "<!-- bench_serve:end -->"


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def wait_healthy(port: int, proc: subprocess.Popen, timeout: float) -> None:
    """Poll ``/health`` until it answers 200; ``RuntimeError`` if the server dies or times out."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"server exited with {proc.returncode}")
        try:
            conn = http.client.HTTPConnection("127.0.0.1", port, timeout=2)
            conn.request("GET", "/health")
            if conn.getresponse().status == 200:
                return
        except OSError:
            pass
        time.sleep(0.5)
    raise RuntimeError(f"server on port {port} not healthy after {timeout:.0f} s")


def replica_counts(port: int) -> dict[str, int]:
    """Requests each live replica has finished (the fleet's ``GET /replicas``; {} for one
    engine). A replica the ingress could not reach (``state`` ``"unreachable"``) is left out."""
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=30)
    conn.request("GET", "/replicas")
    resp = conn.getresponse()
    if resp.status != 200:
        return {}
    rows = json.loads(resp.read()).items()
    return {k: v["requests_finished"] for k, v in rows if v.get("state", "running") == "running"}


def run_setup(
    args: argparse.Namespace, router: str | None, workload: ChatTraffic
) -> tuple[LoadResult, float, dict[str, int]]:
    """Start a server (one engine if ``router`` is None), play the workload, stop it."""
    port = free_port()
    cmd = [sys.executable, "-m", "radixkv.cli", "serve", "--model", args.model]
    cmd += ["--port", str(port), "--num-blocks", str(args.num_blocks), "--log-level", "warning"]
    cmd += shlex.split(args.serve_args)
    if router is not None:
        cmd += ["--replicas", str(args.replicas), "--router", router]
    t0 = time.perf_counter()
    proc = subprocess.Popen(cmd, cwd=ROOT, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    try:
        wait_healthy(port, proc, timeout=180)
        startup = time.perf_counter() - t0
        # One warm-up chat outside the measured workload (first-call compilation, imports).
        run_chat_workload(
            f"http://127.0.0.1:{port}",
            ChatTraffic(conversations=1, turns=1, seed=workload.seed + 1),
            concurrency=1,
        )
        before = replica_counts(port)
        result = run_chat_workload(
            f"http://127.0.0.1:{port}", workload, concurrency=args.concurrency
        )
        after = replica_counts(port)
        served = {k: after[k] - before.get(k, 0) for k in after}
        return result, startup, served
    finally:
        stop_server(proc)


def stop_server(proc: subprocess.Popen, timeout: float = 60) -> None:
    """Stop a server as Ctrl-C does (it drains and exits); kill it if it has not within
    ``timeout`` seconds."""
    proc.send_signal(signal.SIGINT)
    try:
        proc.wait(timeout=timeout)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()


def table(rows: list[dict]) -> str:
    lines = [
        "| setup | router | requests | errors | TTFT p50 ms | TTFT p90 ms | tokens/s "
        "| hit rate | requests per replica | max/mean |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        lines.append(
            f"| {r['setup']} | {r['router']} | {r['requests']} | {r['errors']} "
            f"| {r['ttft_p50_ms']:.0f} | {r['ttft_p90_ms']:.0f} | {r['tokens_per_s']:.0f} "
            f"| {r['hit_rate']:.3f} | {r['per_replica']} | {r['max_mean_load']:.2f} |"
        )
    return "\n".join(lines) + "\n"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default="random", help="random | smollm2 | a path (default random)")
    ap.add_argument("--replicas", type=int, default=2)
    ap.add_argument("--routers", default="serve,ray_prefix,pow2,chwbl,approx,exact")
    ap.add_argument("--conversations", type=int, default=24)
    ap.add_argument("--turns", type=int, default=3)
    ap.add_argument("--groups", type=int, default=6)
    ap.add_argument("--concurrency", type=int, default=8)
    ap.add_argument("--num-blocks", type=int, default=512, help="KV blocks per engine")
    ap.add_argument("--no-single", action="store_true", help="skip the one-engine row")
    ap.add_argument(
        "--serve-args",
        default="",
        help="more flags for every server, e.g. '--dtype bfloat16 --enforce-eager'",
    )
    ap.add_argument("--out", type=Path, help="write the rows as CSV here")
    ap.add_argument("--docs", action="store_true", help="rewrite the table in docs/serving.md")
    args = ap.parse_args()
    workload = ChatTraffic(
        conversations=args.conversations, turns=args.turns, groups=args.groups, seed=0
    )
    setups: list[tuple[str, str | None]] = [] if args.no_single else [("1 engine", None)]
    setups += [(f"{args.replicas} replicas, Ray Serve", r) for r in args.routers.split(",") if r]
    rows = []
    for setup, router in setups:
        print(f"{setup}: {router or '-'} ...", flush=True)
        try:
            res, startup, per = run_setup(args, router, workload)
        except RuntimeError as exc:
            print(f"  skipped: {exc}", flush=True)
            continue
        counts = sorted(per.values())
        rows.append(
            {
                "setup": setup,
                "router": router or "-",
                "model": args.model,
                "serve_args": args.serve_args,
                "requests": len(res.records),
                "errors": res.num_errors,
                "ttft_p50_ms": 1e3 * res.ttft_p50,
                "ttft_p90_ms": 1e3 * res.ttft_p90,
                "tokens_per_s": res.throughput,
                "hit_rate": res.hit_rate,
                "per_replica": " / ".join(map(str, counts)) or "-",
                "max_mean_load": max(counts) / (sum(counts) / len(counts)) if counts else 1.0,
                "startup_s": startup,
                "wall_s": res.wall_time,
            }
        )
        print("  " + table(rows[-1:]).splitlines()[-1], flush=True)
    print()
    print(table(rows), end="")
    save_rows(rows, args.out, "bench_serve.csv")
    if args.docs:
        text = DOCS.read_text()
        if BEGIN not in text or END not in text:
            raise SystemExit(f"{DOCS} has no {BEGIN} ... {END} block to rewrite")
        head, rest = text.split(BEGIN, 1)
        _, tail = rest.split(END, 1)
        day = time.strftime("%Y-%m-%d")
        stamp = f"`python benchmarks/bench_serve.py --model {args.model}`, {day}"
        DOCS.write_text(f"{head}{BEGIN}\n{stamp}\n\n{table(rows)}{END}{tail}")
        print(f"rewrote the table in {DOCS}")


if __name__ == "__main__":
    main()
