"""Routers on a simulated fleet: both Mooncake traces, 4 and 8 replicas, every router.

Each replica is a real radix cache (LRU) with a FIFO queue and the CPU-calibrated
``ServiceModel`` (radixkv.fleet.sim). Capacity: the fleet's *total* is fixed per
trace (conversation 16,384 blocks, synthetic 8,192; per replica = total / N),
where one cache of that size reaches a clearly sub-maximal hit rate (0.271 of
0.374, 0.385 of 0.651: benchmarks/results/replay_sweep_*.csv), so where a prefix
lands matters. Arrivals are slowed (``rate``) so that the fleet *without any
cache* would be exactly busy (offered load 1.0): caching is what gives headroom,
and a router that loses hits queues. Router clocks run in trace time
(``SimClock(scale=rate)``), so their TTLs keep their real-traffic meaning.

Targets (reported, not asserted): exact hit rate >= 0.9 x the single cache,
max/mean load <= 1.25, exact beats approx, chwbl and round robin on hit rate and
TTFT p90, decision median <= 50 us at 8 replicas.

    python benchmarks/bench_fleet.py [--quick] [--out benchmarks/results/bench_fleet.csv]

``--sweep`` instead runs the exact router alone over a grid of its scoring knobs
(``max_load_gap`` x ``prefill_weight``, ``min_gain_blocks=1``) at 8 replicas on
both traces: the measurement behind ``LoadAwareScoring``'s defaults.
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from bench_common import save_rows  # noqa: E402

from radixkv.fleet.router import ROUTERS  # noqa: E402
from radixkv.fleet.sim import (  # noqa: E402
    ServiceModel,
    SimClock,
    build_router,
    offered_load,
    requests_from_trace,
    simulate,
    single_cache_hit_rate,
)
from radixkv.replay.trace import load_trace  # noqa: E402

TRACES = Path(
    os.environ.get("RADIXKV_TRACES")
    or Path(__file__).resolve().parents[2] / "shared" / "data" / "traces"
)
FLEET_CAPACITY = {"conversation_trace.jsonl": 16384, "synthetic_trace.jsonl": 8192}
REPLICAS = (4, 8)
LOAD = 1.0
SWEEP_GAPS = (1, 2, 4, 8)
SWEEP_WEIGHTS = (1.0, 16.0, 256.0, 1000.0)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--quick", action="store_true", help="first 2,000 requests of each trace")
    ap.add_argument("--sweep", action="store_true", help="the exact router's knobs, 8 replicas")
    ap.add_argument("--out", type=Path, help="write the rows as CSV here")
    args = ap.parse_args()
    service = ServiceModel()
    rows = []
    if args.sweep:
        runs = [
            ("exact", {"max_load_gap": g, "prefill_weight": w, "min_gain_blocks": 1})
            for g in SWEEP_GAPS
            for w in SWEEP_WEIGHTS
        ]
        replica_counts: tuple[int, ...] = (8,)
    else:
        runs = [(name, {}) for name in ROUTERS]
        replica_counts = REPLICAS
    for trace_name, total in FLEET_CAPACITY.items():
        path = TRACES / trace_name
        if not path.exists():
            print(f"skipping {trace_name}: not in {TRACES}")
            continue
        reqs = requests_from_trace(load_trace(path), 2000 if args.quick else None)
        single = single_cache_hit_rate(reqs, total)
        for n in replica_counts:
            rate = LOAD / offered_load(reqs, service, n)
            for name, options in runs:
                clock = SimClock(scale=rate)
                t0 = time.perf_counter()
                res = simulate(
                    reqs,
                    build_router(name, clock, **options),
                    num_replicas=n,
                    capacity_blocks=total // n,
                    service=service,
                    rate=rate,
                    clock=clock,
                )
                rows.append(
                    {
                        "trace": trace_name.removesuffix(".jsonl"),
                        "replicas": n,
                        "capacity_per_replica": total // n,
                        "router": name,
                        "max_load_gap": options.get("max_load_gap", ""),
                        "prefill_weight": options.get("prefill_weight", ""),
                        "requests": res.num_requests,
                        "rate": rate,
                        "hit_rate": res.hit_rate,
                        "single_cache_hit_rate": single,
                        "vs_single": res.hit_rate / single if single else float("nan"),
                        "ttft_p50_s": res.ttft_p50,
                        "ttft_p90_s": res.ttft_p90,
                        "ttft_p99_s": res.ttft_p99,
                        "max_mean_load": res.max_mean_load,
                        "max_mean_busy": res.max_mean_busy,
                        "regret": res.regret,
                        "decision_us_p50": res.decision_us_p50,
                        "decision_us_p99": res.decision_us_p99,
                        "index_memory_bytes": res.index_memory_bytes,
                        "events": res.events_delivered,
                        "wall_s": time.perf_counter() - t0,
                    }
                )
    head = (
        f"{'trace':<13} {'N':>2} {'router':<12} {'gap':>3} {'weight':>6} {'hit':>6} {'vs1':>5} "
        f"{'ttft50':>8} "
        f"{'ttft90':>8} {'load':>5} {'busy':>5} {'regret':>6} {'us50':>6} {'index_B':>9}"
    )
    print(head)
    for r in rows:
        print(
            f"{r['trace']:<13} {r['replicas']:>2} {r['router']:<12} {r['max_load_gap']!s:>3} "
            f"{r['prefill_weight']!s:>6} {r['hit_rate']:>6.3f} "
            f"{r['vs_single']:>5.2f} {r['ttft_p50_s']:>8.1f} {r['ttft_p90_s']:>8.1f} "
            f"{r['max_mean_load']:>5.2f} {r['max_mean_busy']:>5.2f} {r['regret']:>6.3f} "
            f"{r['decision_us_p50']:>6.1f} {r['index_memory_bytes']:>9}"
        )
    name = "bench_fleet_sweep" if args.sweep else "bench_fleet"
    save_rows(rows, args.out, f"{name}_quick.csv" if args.quick else f"{name}.csv")


if __name__ == "__main__":
    main()
