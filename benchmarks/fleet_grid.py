"""The fleet benchmark's grid: workloads, cells, one cell's runs, and the per-router summary.

Used by ``bench_fleet.py``. A *cell* is (workload, replicas, capacity per
replica, load); every router (or knob variant) runs on the same requests in
it. ``load`` is an offered load (arrivals paced so the fleet without a cache
would be that busy: ``offered_load``) or ``"rate1"`` (the workload's own
arrival times). Service: batched (``BatchConfig()``: 2,048-token steps, 256
sequences) with the ``"h200"`` profile (radixkv's engine on an H200).

Workloads: the two Mooncake traces (``conversation``, ``synthetic``) and two
synthetic ones sized so that capacity matters across the grid: ``groups``
(64 system prompts of 32 blocks, 2,000 requests, 4-block questions: 2,048
distinct prefix blocks) and ``hot`` (one 32-block system prompt in 90% of
2,000 requests, the rest unshared). Knobs are tuned on ``TUNING`` and
reported on ``HELD_OUT``.
"""

from __future__ import annotations

import math
import os
import statistics
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from radixkv.fleet.router import ExactPrefixRouter
from radixkv.fleet.sim import (
    SERVICE_PROFILES,
    BatchConfig,
    SimClock,
    SimRequest,
    build_router,
    offered_load,
    requests_from_trace,
    simulate,
    single_cache_hit_rate,
)
from radixkv.fleet.workloads import group_sizes, grouped_prompts, hot_prompt
from radixkv.replay.trace import load_trace

TRACES = Path(
    os.environ.get("RADIXKV_TRACES")
    or Path(__file__).resolve().parents[2] / "shared" / "data" / "traces"
)
WORKLOADS = ("conversation", "synthetic", "groups", "hot")
TUNING = ("groups", "hot", "synthetic")
HELD_OUT = ("conversation",)
REPLICAS = (2, 4, 8, 12)
CAPACITIES = (256, 512, 1024, 2048, 4096)
LOADS: tuple[float | str, ...] = (0.25, 0.5, 0.75, 1.0, 2.0, 4.0, "rate1")
QUICK_REPLICAS = (4, 8)
QUICK_CAPACITIES = (512, 2048)
QUICK_LOADS: tuple[float | str, ...] = (0.5, 1.0, 4.0, "rate1")
QUICK_LIMIT = 3000  # requests of each trace in --quick runs
SERVICE = SERVICE_PROFILES["h200"]
BATCH = BatchConfig()
HIT_TIE = 0.005  # a router is best in a cell within this much hit rate of the best


def load_workload(name: str, limit: int | None = None) -> list[SimRequest]:
    """The requests of workload ``name`` (the first ``limit`` of a trace)."""
    if name == "groups":
        return grouped_prompts(64, group_sizes(2000, 64), system_len=32, question_len=4, seed=1)
    if name == "hot":
        return hot_prompt(2000, hot_fraction=0.9, system_len=32, question_len=4, seed=2)
    path = TRACES / f"{name}_trace.jsonl"
    return requests_from_trace(load_trace(path), limit)


@dataclass(frozen=True)
class Cell:
    workload: str
    replicas: int
    capacity: int
    load: float | str

    @property
    def low_load(self) -> bool:
        return isinstance(self.load, float) and self.load <= 0.75


Variant = tuple[str, str, dict]  # (label, router name, options)


def run_cell(cell: Cell, reqs: list[SimRequest], variants: Sequence[Variant]) -> list[dict]:
    """Every variant on ``cell``: one row each."""
    n = cell.replicas
    if cell.load == "rate1":
        rate = 1.0
    else:
        rate = float(cell.load) / offered_load(reqs, SERVICE, n, batch=BATCH)
    single = single_cache_hit_rate(reqs, n * cell.capacity)
    rows = []
    for label, name, options in variants:
        clock = SimClock()
        router = build_router(name, clock, service=SERVICE, **options)
        t0 = time.perf_counter()
        res = simulate(
            reqs,
            router,
            num_replicas=n,
            capacity_blocks=cell.capacity,
            service=SERVICE,
            batch=BATCH,
            rate=rate,
            clock=clock,
        )
        # only the exact index has a safety net whose expiries count
        expired = router.index.safety_expired if isinstance(router, ExactPrefixRouter) else ""
        rows.append(
            {
                "workload": cell.workload,
                "split": "held_out" if cell.workload in HELD_OUT else "tuning",
                "replicas": n,
                "capacity_per_replica": cell.capacity,
                "load": cell.load,
                "router": label,
                "requests": res.num_requests,
                "rate": rate,
                "offered_load": res.offered_load,
                "utilisation": res.utilisation,
                "max_mean_utilisation": res.max_mean_utilisation,
                "hit_rate": res.hit_rate,
                "single_cache_hit_rate": single,
                "vs_single": res.hit_rate / single if single else float("nan"),
                "ttft_p50_s": res.ttft_p50,
                "ttft_p90_s": res.ttft_p90,
                "ttft_p99_s": res.ttft_p99,
                "max_mean_load": res.max_mean_load,
                "regret": res.regret,
                "decision_us_p50": res.decision_us_p50,
                "decision_us_p99": res.decision_us_p99,
                "safety_expired": expired,
                "wall_s": time.perf_counter() - t0,
            }
        )
    return rows


def _fmt(x: float) -> str:
    return "n/a" if x is None or (isinstance(x, float) and math.isnan(x)) else f"{x:.3f}"


def summarize(rows: list[dict], labels: Sequence[str], split: str | None) -> list[dict]:
    """Per router label over the cells of ``split`` (None: all): the issue's figures."""
    cells: dict[tuple, dict[str, dict]] = {}
    for r in rows:
        if split is None or r["split"] == split:
            key = (r["workload"], r["replicas"], r["capacity_per_replica"], r["load"])
            cells.setdefault(key, {})[r["router"]] = r
    out = []
    for label in labels:
        best = 0
        hit_ratios, ttft_ratios, below_chwbl, low_util, vs1 = [], [], [], [], []
        ceiling_cells = ceiling_met = 0
        us8, us12, expired = [], [], 0
        for (_w, n, _c, _load), by in cells.items():
            r = by.get(label)
            if r is None:
                continue
            top = max(x["hit_rate"] for x in by.values())
            fastest = min(x["ttft_p90_s"] for x in by.values())
            best += r["hit_rate"] >= top - HIT_TIE
            if top > 0:
                hit_ratios.append(r["hit_rate"] / top)
            if fastest > 0:
                ttft_ratios.append(r["ttft_p90_s"] / fastest)
            if "chwbl" in by:
                below_chwbl.append(by["chwbl"]["hit_rate"] - r["hit_rate"])
            if r["offered_load"] <= 0.75 + 1e-9:
                low_util.append(r["max_mean_utilisation"])
            if not math.isnan(r["vs_single"]):
                vs1.append(r["vs_single"])
                if max(x["vs_single"] for x in by.values()) >= 0.9:
                    ceiling_cells += 1
                    ceiling_met += r["vs_single"] >= 0.9
            if n == 8:
                us8.append(r["decision_us_p50"])
            if n == 12:
                us12.append(r["decision_us_p50"])
            if r["safety_expired"] != "":
                expired += int(r["safety_expired"])
        if not hit_ratios:
            continue
        out.append(
            {
                "split": split or "all",
                "router": label,
                "cells": len(hit_ratios),
                "best_cells": best,
                "worst_hit_vs_best": min(hit_ratios),
                "worst_ttft_p90_vs_best": max(ttft_ratios) if ttft_ratios else float("nan"),
                "max_below_chwbl": max(below_chwbl) if below_chwbl else float("nan"),
                "max_util_ratio_low_load": max(low_util) if low_util else float("nan"),
                "median_vs_single": statistics.median(vs1) if vs1 else float("nan"),
                "ceiling_cells": ceiling_cells,
                "ceiling_met": ceiling_met,
                "decision_us_p50_n8": statistics.median(us8) if us8 else float("nan"),
                "decision_us_p50_n12": statistics.median(us12) if us12 else float("nan"),
                "safety_expired": expired,
            }
        )
    return out


def print_summary(summary: list[dict]) -> None:
    print(
        f"{'split':<9} {'router':<22} {'cells':>5} {'best':>5} {'hit/best':>8} {'p90/best':>8} "
        f"{'<chwbl':>7} {'util<=.75':>9} {'med vs1':>7} {'>=.9 ceil':>9} {'us50 N8':>7} "
        f"{'us50 N12':>8} {'safety':>6}"
    )
    for s in summary:
        print(
            f"{s['split']:<9} {s['router']:<22} {s['cells']:>5} {s['best_cells']:>5} "
            f"{_fmt(s['worst_hit_vs_best']):>8} {_fmt(s['worst_ttft_p90_vs_best']):>8} "
            f"{_fmt(s['max_below_chwbl']):>7} {_fmt(s['max_util_ratio_low_load']):>9} "
            f"{_fmt(s['median_vs_single']):>7} "
            f"{s['ceiling_met']:>4}/{s['ceiling_cells']:<4} "
            f"{s['decision_us_p50_n8']:>7.1f} {s['decision_us_p50_n12']:>8.1f} "
            f"{s['safety_expired']:>6}"
        )


def targets(summary: list[dict]) -> list[str]:
    """The issue's targets, met or not, per split, for exact and approx."""
    lines = []
    for s in summary:
        r = s["router"]
        checks: list[tuple[str, bool]] = []
        if r == "exact":
            checks = [
                ("hit >= 0.98 x best", s["worst_hit_vs_best"] >= 0.98),
                ("TTFT p90 <= 1.05 x best", s["worst_ttft_p90_vs_best"] <= 1.05),
                ("never below chwbl by > 0.01", s["max_below_chwbl"] <= 0.01),
                ("max/mean util <= 1.25 at load <= 0.75", s["max_util_ratio_low_load"] <= 1.25),
                ("0.9 x single where any router is", s["ceiling_met"] == s["ceiling_cells"]),
                ("decision p50 <= 50 us at 8", not s["decision_us_p50_n8"] > 50),
                ("decision p50 <= 100 us at 12", not s["decision_us_p50_n12"] > 100),
            ]
        elif r == "approx":
            checks = [
                ("hit >= 0.95 x best", s["worst_hit_vs_best"] >= 0.95),
                ("never below chwbl by > 0.01", s["max_below_chwbl"] <= 0.01),
                ("max/mean util <= 1.25 at load <= 0.75", s["max_util_ratio_low_load"] <= 1.25),
            ]
        for what, ok in checks:
            lines.append(f"{s['split']:<9} {r:<7} {what:<40} {'met' if ok else 'MISSED'}")
    return lines


def misses(rows: list[dict], label: str, limit: int = 8) -> list[str]:
    """The cells where ``label`` is furthest from the best hit rate and TTFT p90."""
    cells: dict[tuple, dict[str, dict]] = {}
    for r in rows:
        key = (r["workload"], r["replicas"], r["capacity_per_replica"], r["load"])
        cells.setdefault(key, {})[r["router"]] = r
    scored = []
    for key, by in cells.items():
        r = by.get(label)
        if r is None:
            continue
        top = max(by.values(), key=lambda x: x["hit_rate"])
        fast = min(by.values(), key=lambda x: x["ttft_p90_s"])
        scored.append(
            (
                min(r["hit_rate"] / top["hit_rate"] if top["hit_rate"] else 1.0, 1.0),
                r["ttft_p90_s"] / fast["ttft_p90_s"] if fast["ttft_p90_s"] else 1.0,
                key,
                top["router"],
                fast["router"],
                r,
            )
        )
    out = []
    for h, t, key, top, fast, r in sorted(scored, key=lambda s: s[0])[:limit]:
        out.append(
            f"  hit {h:.3f} of {top:<12} p90 {t:.2f}x {fast:<12} {key} util {r['utilisation']:.2f}"
        )
    for h, t, key, top, fast, r in sorted(scored, key=lambda s: -s[1])[:limit]:
        out.append(
            f"  p90 {t:.2f}x {fast:<12} hit {h:.3f} of {top:<12} {key} util {r['utilisation']:.2f}"
        )
    return out
