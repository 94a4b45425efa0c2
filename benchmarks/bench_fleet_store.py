"""Routers on a simulated fleet with a KV store shared by the replicas (docs/store.md).

Each replica is a real radix cache (LRU, ``--capacity`` blocks) with a host tier of
its own (``--host-capacity``, default the same) over one shared ``MemoryStore``
(``--store-capacity`` blocks, write-back), serving with continuous batching and
chunked prefill at the ``"h200"`` costs (benchmarks/fleet_grid.py's service), arrivals
paced to an offered load of ``--load``. Per cell (workload, replicas, store load
cost) the routers:

- ``round_robin``: the baseline that ignores every cache;
- ``exact``: the exact router, blind to the store (it sees each replica's device);
- ``exact+store``: the exact router counting what any replica can fetch from the
  store, priced at the store's load cost (``StoreView``); ``exact+store xK``: priced
  at K times it (a router that assumes loads dearer than they are);
- ``exact (no store)``: the exact router on the same fleet without host tiers or
  store: what the tiers below the device add.

Printed and written (``--out``): the hit rate of every tier and of each (device,
host, store), modelled TTFT p50/p90/mean, the measured utilisation, and the
store's own counters. The store-aware pricing is chosen on the synthetic trace
(``--sweep``: load costs x router multipliers at 4 replicas) and reported on the
conversation trace (held out).

    python benchmarks/bench_fleet_store.py [--workloads synthetic,conversation]
        [--replicas 2,4,8] [--load-costs 0.1] [--limit 3000] [--out CSV]
    python benchmarks/bench_fleet_store.py --sweep --workloads synthetic --replicas 4
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

import fleet_grid as grid  # noqa: E402
from bench_common import save_rows  # noqa: E402

from radixkv.fleet.shared_store import DEFAULT_STORE_LOAD_COST, SharedStore  # noqa: E402
from radixkv.fleet.sim import SimClock, build_router, offered_load, simulate  # noqa: E402

# (label, router, store on, store-aware router's price multiplier or None: blind)
Variant = tuple[str, str, bool, float | None]
VARIANTS: list[Variant] = [
    ("round_robin", "round_robin", True, None),
    ("exact", "exact", True, None),
    ("exact+store", "exact", True, 1.0),
    ("exact (no store)", "exact", False, None),
]
SWEEP_EXTRA: list[Variant] = [
    ("exact+store x2", "exact", True, 2.0),
    ("exact+store x4", "exact", True, 4.0),
]


def run_cell(
    workload: str,
    reqs: list,
    replicas: int,
    load_cost: float,
    args: argparse.Namespace,
    variants: list[Variant],
) -> list[dict]:
    """Every variant on one (workload, replicas, load cost) cell: one row each."""
    rate = args.load / offered_load(reqs, grid.SERVICE, replicas, batch=grid.BATCH)
    rows = []
    for label, name, with_store, price in variants:
        store = None
        if with_store:
            store = SharedStore(
                args.store_capacity,
                host_capacity_blocks=args.host_capacity or args.capacity,
                load_cost=load_cost,
            )
        view = store.view(load_cost * price) if store is not None and price else None
        clock = SimClock()
        router = build_router(name, clock, service=grid.SERVICE, store=view)
        t0 = time.perf_counter()
        res = simulate(
            reqs,
            router,
            num_replicas=replicas,
            capacity_blocks=args.capacity,
            service=grid.SERVICE,
            batch=grid.BATCH,
            rate=rate,
            clock=clock,
            store=store,
        )
        stats = store.store.stats if store is not None else None
        rows.append(
            {
                "workload": workload,
                "split": "held_out" if workload in grid.HELD_OUT else "tuning",
                "replicas": replicas,
                "capacity_per_replica": args.capacity,
                "host_capacity_per_replica": (args.host_capacity or args.capacity)
                if with_store
                else 0,
                "store_capacity": args.store_capacity if with_store else 0,
                "load": args.load,
                "store_load_cost": load_cost if with_store else "",
                "router": label,
                "requests": res.num_requests,
                "hit_rate": res.hit_rate,
                "device_hit_rate": res.hit_rate - res.host_hit_rate - res.store_hit_rate,
                "host_hit_rate": res.host_hit_rate,
                "store_hit_rate": res.store_hit_rate,
                "ttft_p50_s": res.ttft_p50,
                "ttft_p90_s": res.ttft_p90,
                "ttft_mean_s": res.ttft_mean,
                "utilisation": res.utilisation,
                "max_mean_utilisation": res.max_mean_utilisation,
                "store_puts": stats.puts if stats else "",
                "store_hits": stats.hits if stats else "",
                "store_evicted": stats.evicted if stats else "",
                "decision_us_p50": res.decision_us_p50,
                "wall_s": time.perf_counter() - t0,
            }
        )
        r = rows[-1]
        print(
            f"{workload:>12} n={replicas} cost={load_cost:<5} {label:<18} "
            f"hit {r['hit_rate']:.4f} (dev {r['device_hit_rate']:.4f} host "
            f"{r['host_hit_rate']:.4f} store {r['store_hit_rate']:.4f}) ttft p50 "
            f"{r['ttft_p50_s']:.3f} p90 {r['ttft_p90_s']:.3f} mean {r['ttft_mean_s']:.3f} "
            f"util {r['utilisation']:.3f} [{r['wall_s']:.0f} s]",
            flush=True,
        )
    return rows


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--workloads", default="synthetic,conversation")
    ap.add_argument("--replicas", default="2,4,8")
    ap.add_argument("--load-costs", default=str(DEFAULT_STORE_LOAD_COST))
    ap.add_argument("--capacity", type=int, default=512, help="device blocks per replica")
    ap.add_argument("--host-capacity", type=int, help="host blocks per replica (--capacity)")
    ap.add_argument("--store-capacity", type=int, default=4096, help="shared store blocks")
    ap.add_argument("--load", type=float, default=1.0, help="offered load (no cache)")
    ap.add_argument("--limit", type=int, default=grid.QUICK_LIMIT, help="requests a trace")
    ap.add_argument("--sweep", action="store_true", help="add the router price multipliers")
    ap.add_argument("--out", type=Path, help="write the rows as CSV here")
    args = ap.parse_args()
    variants = VARIANTS + (SWEEP_EXTRA if args.sweep else [])
    rows: list[dict] = []
    for workload in args.workloads.split(","):
        reqs = grid.load_workload(workload, args.limit)
        for n in (int(x) for x in args.replicas.split(",")):
            for k, cost in enumerate(float(x) for x in args.load_costs.split(",")):
                # the fleet without a store does not depend on the load cost: once a cell
                todo = [v for v in variants if v[2] or k == 0]
                rows += run_cell(workload, reqs, n, cost, args, todo)
    name = "bench_fleet_store_sweep.csv" if args.sweep else "bench_fleet_store.csv"
    save_rows(rows, args.out, name)


if __name__ == "__main__":
    main()
