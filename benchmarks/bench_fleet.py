"""Routers on a simulated fleet over a grid of workloads x replicas x capacity x load.

Each replica is a real radix cache (LRU) serving with continuous batching and
chunked prefill (2,048-token steps), its costs the ``"h200"`` profile
(radixkv's engine on an NVIDIA H200; radixkv.fleet.service). The grid
(benchmarks/fleet_grid.py): the two Mooncake traces plus the synthetic
``groups`` and ``hot`` workloads; replicas {2, 4, 8, 12}; capacity per replica
{256, 512, 1024, 2048, 4096} blocks; load {0.25, 0.5, 0.75, 1, 2, 4} (arrivals
paced so the fleet without a cache would be that busy) and the workload's own
arrival times ("rate1"); every router. Knobs are tuned on ``groups``, ``hot``
and the synthetic trace; the conversation trace is held out.

Printed per split and router: in how many cells it is best (within 0.005 hit
rate), its worst hit rate / best-in-cell, its worst TTFT p90 / best-in-cell,
the most it falls below CHWBL's hit rate, its worst max/mean utilisation where
the offered load is <= 0.75, its median hit rate / the single cache's and in how
many of the cells where some router reaches 0.9 x the single cache it does too,
and its median decision time at 8 and 12 replicas; then the targets, met or not.

    python benchmarks/bench_fleet.py [--quick] [--jobs 2] [--out benchmarks/results/bench_fleet.csv]
    python benchmarks/bench_fleet.py --sweep [--out benchmarks/results/bench_fleet_sweep.csv]

``--quick``: replicas {4, 8}, capacity {512, 2048}, load {0.5, 1, 4, rate1}, the
first 3,000 requests of each trace. ``--sweep``: the quick grid on the tuning
workloads only, with the prefix routers' knobs varied one at a time (the
measurement behind their defaults). ``--workloads``, ``--replicas``,
``--capacities``, ``--loads`` pick a subset; ``--summarize CSV`` reprints a
saved run's summary (several CSVs: one grid run in parts).
"""

from __future__ import annotations

import argparse
import csv
import sys
import time
from concurrent.futures import ProcessPoolExecutor
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

import fleet_grid as grid  # noqa: E402
from bench_common import save_rows  # noqa: E402

from radixkv.fleet.router import ROUTERS  # noqa: E402

BASELINES = ("round_robin", "least_loaded", "pow2", "session", "chwbl")
SWEEP: list[grid.Variant] = [
    ("exact", "exact", {}),
    ("exact no externality", "exact", {"externality": "off"}),
    ("exact externality=full", "exact", {"externality": "full"}),
    ("exact load_factor=1.25", "exact", {"load_factor": 1.25}),
    ("exact load_factor=1.5", "exact", {"load_factor": 1.5}),
    ("exact load_factor=2", "exact", {"load_factor": 2.0}),
    ("exact load_factor=3", "exact", {"load_factor": 3.0}),
    ("exact min_gain=1", "exact", {"min_gain_blocks": 1}),
    ("exact min_gain=4", "exact", {"min_gain_blocks": 4}),
    ("exact spec_ttl_factor=1", "exact", {"spec_ttl_factor": 1.0}),
    ("exact spec_ttl_factor=2", "exact", {"spec_ttl_factor": 2.0}),
    ("approx", "approx", {}),
    ("approx no externality", "approx", {"externality": "off"}),
    ("approx externality=full", "approx", {"externality": "full"}),
    ("approx load_factor=1.5", "approx", {"load_factor": 1.5}),
    ("approx load_factor=2", "approx", {"load_factor": 2.0}),
]

_REQS: dict[str, list] = {}  # workload -> requests, loaded before the workers fork


def _run(cell: grid.Cell, variants: list[grid.Variant]) -> list[dict]:
    return grid.run_cell(cell, _REQS[cell.workload], variants)


def _floats(text: str) -> tuple[float | str, ...]:
    return tuple(p if p == "rate1" else float(p) for p in text.split(","))


def _ints(text: str) -> tuple[int, ...]:
    return tuple(int(p) for p in text.split(","))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--quick", action="store_true", help="a small subset of the grid")
    ap.add_argument("--sweep", action="store_true", help="the prefix routers' knobs")
    ap.add_argument("--workloads", help=f"comma-separated subset of {','.join(grid.WORKLOADS)}")
    ap.add_argument("--replicas", type=_ints, help="comma-separated replica counts")
    ap.add_argument("--capacities", type=_ints, help="comma-separated blocks per replica")
    ap.add_argument("--loads", type=_floats, help="comma-separated loads (or rate1)")
    ap.add_argument("--jobs", type=int, default=1, help="worker processes (default 1)")
    ap.add_argument("--out", type=Path, help="write the rows as CSV here")
    ap.add_argument(
        "--summarize", type=Path, nargs="+", help="only reprint the summary of saved CSVs"
    )
    args = ap.parse_args()

    if args.summarize:
        rows = []
        for path in args.summarize:
            with path.open() as f:
                rows += [_typed(r) for r in csv.DictReader(f)]
        labels = list(dict.fromkeys(r["router"] for r in rows))
        _report(rows, labels)
        return

    quick = args.quick or args.sweep
    workloads = grid.TUNING if args.sweep else grid.WORKLOADS
    if args.workloads:
        workloads = tuple(args.workloads.split(","))
    replicas = args.replicas or (grid.QUICK_REPLICAS if quick else grid.REPLICAS)
    capacities = args.capacities or (grid.QUICK_CAPACITIES if quick else grid.CAPACITIES)
    loads = args.loads or (grid.QUICK_LOADS if quick else grid.LOADS)
    variants: list[grid.Variant] = [(name, name, {}) for name in ROUTERS]
    if args.sweep:
        variants = [(name, name, {}) for name in BASELINES] + SWEEP

    for w in workloads:
        if w in ("conversation", "synthetic") and not (grid.TRACES / f"{w}_trace.jsonl").exists():
            print(f"skipping {w}: not in {grid.TRACES}")
            continue
        _REQS[w] = grid.load_workload(w, grid.QUICK_LIMIT if quick else None)
    cells = [
        grid.Cell(w, n, c, load)
        for w in workloads
        if w in _REQS
        for n in replicas
        for c in capacities
        for load in loads
    ]
    # Largest first, so the workers finish together.
    cells.sort(key=lambda c: -len(_REQS[c.workload]) * c.replicas)
    t0 = time.perf_counter()
    rows: list[dict] = []
    if args.jobs > 1:
        with ProcessPoolExecutor(args.jobs) as pool:
            for out in pool.map(_run, cells, [variants] * len(cells)):
                rows.extend(out)
    else:
        for k, cell in enumerate(cells):
            rows.extend(_run(cell, variants))
            print(f"\r{k + 1}/{len(cells)} cells", end="", file=sys.stderr, flush=True)
        print(file=sys.stderr)
    print(f"{len(cells)} cells x {len(variants)} routers in {time.perf_counter() - t0:.0f} s")
    _report(rows, [label for label, _, _ in variants])
    name = "bench_fleet_sweep" if args.sweep else "bench_fleet"
    save_rows(rows, args.out, f"{name}_quick.csv" if args.quick else f"{name}.csv")


def _report(rows: list[dict], labels: list[str]) -> None:
    summary = []
    for split in ("tuning", "held_out"):
        summary += grid.summarize(rows, labels, split)
    grid.print_summary(summary)
    print()
    for line in grid.targets(summary):
        print(line)
    for label in ("exact", "approx"):
        if any(r["router"] == label for r in rows):
            print(f"\nworst cells for {label}:")
            print("\n".join(grid.misses(rows, label)))


def _typed(row: dict) -> dict:
    out: dict = {}
    for k, v in row.items():
        try:
            out[k] = int(v)
        except ValueError:
            try:
                out[k] = float(v)
            except ValueError:
                out[k] = v
    return out


if __name__ == "__main__":
    main()
