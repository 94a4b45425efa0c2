"""Routing decision time for long prompts: 2,000 tokens at block size 16, 8 replicas.

The fleet simulator times ``choose`` on Mooncake prompts, which are short in
cache tokens (one token per 512-token block). A real router sees token ids: a
2,000-token prompt at block size 16 is 125 chained block hashes to compute and
look up. This benchmark routes a shared-prefix workload (``--groups`` system
prompts of 1,000 tokens, each request adding 1,000 tokens of its own) over 8
replicas that are real radix caches (LRU, events on): each decision is served at
once (match, insert, release) and the replica's events reach the router before
the next decision, so the indexes hold what a live fleet's would. Only
``choose`` is timed.

Rows: each router's median / p90 / p99 microseconds per decision, and its ratio
to the **hash floor** measured in the same run: computing the request's chained
block hashes alone (``chain_hashes``), which every prefix-aware router must do
once. Target (issue 12): a median <= 50 us at 8 replicas.

    python benchmarks/bench_router.py [--requests 2000] [--repeats 5] [--out F]
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))

from bench_common import save_rows  # noqa: E402

from radixkv.fleet.index import chain_hashes  # noqa: E402
from radixkv.fleet.routing import RouteRequest  # noqa: E402
from radixkv.fleet.sim import FLEET_HASHER, Replica, SimClock, build_router  # noqa: E402

BLOCK_SIZE = 16
REPLICAS = 8
ROUTERS = ("round_robin", "pow2", "chwbl", "approx", "exact")


def workload(num_requests: int, groups: int, seed: int = 0) -> list[np.ndarray]:
    """Prompts of 2,000 tokens: one of ``groups`` 1,000-token system prompts + 1,000 own."""
    rng = np.random.default_rng(seed)
    systems = rng.integers(0, 32000, (groups, 1000), dtype=np.int32)
    own = rng.integers(0, 32000, (num_requests, 1000), dtype=np.int32)
    pick = rng.integers(0, groups, num_requests)
    return [np.concatenate((systems[g], own[i])) for i, g in enumerate(pick)]


def time_router(name: str, prompts: list[np.ndarray], capacity: int) -> np.ndarray:
    """Microseconds per ``choose`` over ``prompts`` routed to a fresh fleet."""
    clock = SimClock()
    router = build_router(name, clock, block_size=BLOCK_SIZE)
    replicas = [Replica(k, capacity, BLOCK_SIZE, "lru") for k in range(REPLICAS)]
    states = [r.state for r in replicas]
    out = np.empty(len(prompts))
    perf = time.perf_counter
    for i, tokens in enumerate(prompts):
        clock.now = float(i)
        req = RouteRequest(i, tokens)
        t0 = perf()
        k = router.choose(req, states)
        out[i] = perf() - t0
        replica = replicas[k]
        replica.serve(tokens)
        router.on_events(k, replica.take_events())
        router.on_finish(k, req)
    return out * 1e6


def time_hashing(prompts: list[np.ndarray]) -> np.ndarray:
    """Microseconds per request to compute its chained block hashes (the floor)."""
    out = np.empty(len(prompts))
    perf = time.perf_counter
    for i, tokens in enumerate(prompts):
        t0 = perf()
        chain_hashes(FLEET_HASHER, tokens, BLOCK_SIZE, None)
        out[i] = perf() - t0
    return out * 1e6


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--requests", type=int, default=2000)
    ap.add_argument("--groups", type=int, default=20)
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--out", type=Path, help="write the rows as CSV here")
    args = ap.parse_args()
    prompts = workload(args.requests, args.groups)
    # Each replica holds about a quarter of the distinct blocks: eviction runs too.
    capacity = (args.groups * 1000 + args.requests * 1000) // BLOCK_SIZE // REPLICAS // 4
    runs: dict[str, list[np.ndarray]] = {"hash floor": []}
    for _ in range(args.repeats):
        runs["hash floor"].append(time_hashing(prompts))
        for name in ROUTERS:
            runs.setdefault(name, []).append(time_router(name, prompts, capacity))
    floor = float(np.median([np.median(r) for r in runs["hash floor"]]))
    rows = []
    for name, samples in runs.items():
        p50 = float(np.median([np.median(r) for r in samples]))
        rows.append(
            {
                "router": name,
                "replicas": REPLICAS,
                "block_size": BLOCK_SIZE,
                "prompt_tokens": 2000,
                "us_p50": p50,
                "us_p90": float(np.median([np.percentile(r, 90) for r in samples])),
                "us_p99": float(np.median([np.percentile(r, 99) for r in samples])),
                "vs_hash_floor": p50 / floor,
            }
        )
    print(
        f"{REPLICAS} replicas, {args.requests} prompts of 2,000 tokens at block size "
        f"{BLOCK_SIZE}, {args.groups} shared system prompts; medians of {args.repeats} runs"
    )
    print(f"{'router':<12} {'p50 us':>8} {'p90 us':>8} {'p99 us':>8} {'x hash floor':>13}")
    for r in rows:
        print(
            f"{r['router']:<12} {r['us_p50']:>8.1f} {r['us_p90']:>8.1f} {r['us_p99']:>8.1f} "
            f"{r['vs_hash_floor']:>13.2f}"
        )
    save_rows(rows, args.out, "bench_router.csv")


if __name__ == "__main__":
    main()
