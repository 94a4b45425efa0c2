"""Three-tier replay: device, host and a KV store tier on the Mooncake traces, both write policies.

For each trace, radix policy, device capacity C (blocks), host H = host multiplier x C and
store S = store multiplier x H (and S = 2**31 - 1, the largest the CLI allows, which holds
every block of either trace: the infinite store), the trace is replayed through
``radixkv.replay.replay(..., host_capacity=H, store_capacity=S, store_write_policy=P)``
for P in write_back and write_through, beside the one-tier (C) and two-tier (C, H) replays
and the infinite-cache ceiling. Hit rates are token hit rates with every tier's hits
counted (``combined_hit_rate``), over the whole trace and over each half of it by request
order (the replay is one pass; a half's rate counts its requests' hits).

Held out (docs/store.md): the default write policy is chosen on the first half of each
trace; the second half reports it.

    python benchmarks/replay_store_tier.py                              # prints the table
    python benchmarks/replay_store_tier.py --out benchmarks/results/replay_store.csv
    python benchmarks/replay_store_tier.py --quick                      # one store size

The traces are ``../shared/data/traces/{conversation,synthetic}_trace.jsonl`` beside the
checkout, or in the folder ``$RADIXKV_TRACES`` names.
"""

from __future__ import annotations

import argparse
import os
import resource
import sys
import time
from pathlib import Path

from bench_common import write_csv

from radixkv.replay import ReplayResult, Trace, load_trace, replay
from radixkv.replay.sweep import ceiling_row

ROOT = Path(__file__).resolve().parent.parent
TRACES = Path(os.environ.get("RADIXKV_TRACES") or ROOT.parent / "shared" / "data" / "traces")
TRACE_NAMES = ("conversation", "synthetic")
LARGEST = 2**31 - 1  # the largest --store-capacity: an infinite store for these traces
WRITE_POLICIES = ("write_back", "write_through")


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--traces", nargs="+", choices=TRACE_NAMES, default=list(TRACE_NAMES))
    p.add_argument("--capacities", type=int, nargs="+", default=[1024])
    p.add_argument("--host-multiplier", type=int, default=4)
    p.add_argument("--store-multipliers", type=int, nargs="+", default=[4, 16, 64])
    p.add_argument("--policies", nargs="+", default=["radix-lru"])
    p.add_argument("--quick", action="store_true", help="store multiplier 4 only")
    p.add_argument("--out", help="CSV path for the rows")
    return p.parse_args()


def halves(trace: Trace, r: ReplayResult) -> tuple[float, float]:
    """Combined token hit rate over the first and the second half of the requests."""
    served = r.hit_tokens + r.host_hit_tokens + r.store_hit_tokens
    half = trace.num_requests // 2
    prompts = r.prompt_tokens
    return (
        float(served[:half].sum() / prompts[:half].sum()),
        float(served[half:].sum() / prompts[half:].sum()),
    )


def row(name: str, trace: Trace, r: ReplayResult, seconds: float) -> dict[str, object]:
    c = r.config
    first, second = halves(trace, r)
    t = r.store_stats
    return {
        "trace": name,
        "policy": c.policy,
        "tiers": 1 + (c.host_capacity > 0) + (c.store_capacity > 0),
        "capacity": c.capacity,
        "host_capacity": c.host_capacity,
        "store_capacity": c.store_capacity,
        "store_write_policy": c.store_write_policy if c.store_capacity else "",
        "device_hit_rate": round(r.overall_hit_rate, 4),
        "host_hit_rate": round(r.host_hit_rate, 4),
        "store_hit_rate": round(r.store_hit_rate, 4),
        "combined_hit_rate": round(r.combined_hit_rate, 4),
        "first_half": round(first, 4),
        "second_half": round(second, 4),
        "store_loaded_blocks": 0 if t is None else t.loaded_blocks,
        "store_put_blocks": 0 if t is None else t.put_blocks,
        "store_stored_blocks": 0 if t is None else t.stored_blocks,
        "store_load_misses": 0 if t is None else t.load_misses,
        "skipped_backup_blocks": r.cache_stats.skipped_backup_blocks if r.cache_stats else 0,
        "seconds": round(seconds, 1),
    }


def main() -> int:
    args = parse_args()
    rows: list[dict[str, object]] = []
    multipliers = [4] if args.quick else args.store_multipliers
    for name in args.traces:
        path = TRACES / f"{name}_trace.jsonl"
        if not path.exists():
            print(f"missing trace {path}", file=sys.stderr)
            return 1
        trace = load_trace(path)
        ceiling = ceiling_row(trace)
        rows.append(
            {
                "trace": name,
                "policy": "infinite",
                "tiers": 1,
                "capacity": ceiling.capacity,
                "combined_hit_rate": round(ceiling.overall_hit_rate, 4),
            }
        )
        for policy in args.policies:
            for capacity in args.capacities:
                host = args.host_multiplier * capacity
                # stores smaller than the trace's distinct ids, then the largest allowed
                stores = [m * host for m in multipliers if m * host < trace.num_ids] + [LARGEST]
                configs = [(0, 0, "write_back"), (host, 0, "write_back")]
                configs += [(host, s, p) for s in stores for p in WRITE_POLICIES]
                for h, s, p in configs:
                    start = time.perf_counter()
                    r = replay(
                        trace,
                        policy,
                        capacity,
                        host_capacity=h,
                        store_capacity=s,
                        store_write_policy=p,
                    )
                    rows.append(row(name, trace, r, time.perf_counter() - start))
                    print(rows[-1], flush=True)
    rss_mb = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    print(f"peak RSS {rss_mb:.0f} MB", flush=True)
    if args.out:
        names = list(dict.fromkeys(k for r in rows for k in r))
        write_csv([{k: r.get(k, "") for k in names} for r in rows], Path(args.out))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
