"""``radixkv route-sim``: routers compared on a simulated fleet (:mod:`radixkv.fleet.sim`).

Every flag and output path is checked before anything runs; bad input exits 2
with one line on stderr. ``--json`` prints one strict JSON object keyed by
router name (an undefined figure, such as ``vs_single_cache`` when the single
cache hits nothing, is ``null``); otherwise a table (``n/a`` there).
``--csv`` writes the rows (an empty cell), ``--png`` a bar chart (needs
matplotlib: without it ``--png`` is bad input). A tqdm bar goes to stderr
unless ``--no-progress``. ``--synthetic`` makes exactly ``--requests``
requests (``groups`` needs at least one per group).
"""

from __future__ import annotations

import argparse
import csv
import json
import math
import os

from radixkv.cli_args import (
    fail,
    int_in,
    one_line_errors,
    output_problem,
    positive_int,
)
from radixkv.fleet.shared_store import (
    DEFAULT_HOST_LOAD_COST,
    DEFAULT_STORE_LOAD_COST,
    SharedStore,
)
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
from radixkv.fleet.workloads import (
    SYNTHETIC_WORKLOADS,
    group_sizes,
    grouped_prompts,
    hot_prompt,
)
from radixkv.replay.trace import TraceError, load_trace

__all__ = ["register", "run_route_sim"]

PROG = "radixkv route-sim"
_STORE_FLAGS = ("host_capacity", "store_write", "store_load_cost", "host_load_cost")
_COLUMNS = (
    "hit_rate",
    "ttft_p50",
    "ttft_p90",
    "ttft_p99",
    "max_mean_load",
    "max_mean_busy",
    "utilisation",
    "max_mean_utilisation",
    "regret",
    "decision_us_p50",
    "decision_us_p99",
    "index_memory_bytes",
)


def _positive_float(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a number, got {text!r}") from None
    if not (math.isfinite(value) and value > 0):
        raise argparse.ArgumentTypeError(f"must be a finite number > 0, got {text!r}")
    return value


def _nonneg_float(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a number, got {text!r}") from None
    if not (math.isfinite(value) and value >= 0):
        raise argparse.ArgumentTypeError(f"must be a finite number >= 0, got {text!r}")
    return value


def _fraction(text: str) -> float:
    value = _nonneg_float(text)
    if value > 1:
        raise argparse.ArgumentTypeError(f"must be in [0, 1], got {text!r}")
    return value


def _router_names(text: str) -> list[str]:
    from radixkv.fleet.router import ROUTERS

    names = [p.strip() for p in text.split(",") if p.strip()]
    if not names:
        raise argparse.ArgumentTypeError("give at least one router")
    for n in names:
        if n not in ROUTERS:
            raise argparse.ArgumentTypeError(
                f"router must be one of {', '.join(ROUTERS)}, got {n!r}"
            )
    return list(dict.fromkeys(names))


def _can_plot() -> bool:
    try:
        import matplotlib  # noqa: F401
    except ImportError:
        return False
    return True


def _requests(args: argparse.Namespace) -> list[SimRequest] | int:
    if args.synthetic == "groups":
        if args.requests < args.groups:
            return fail(
                PROG,
                f"--requests ({args.requests}) must be at least --groups ({args.groups}): "
                "every group needs a prompt",
            )
        sizes = group_sizes(args.requests, args.groups)
        return grouped_prompts(args.groups, sizes, system_len=args.system_len, seed=args.seed)
    if args.synthetic == "hot":
        return hot_prompt(
            args.requests,
            hot_fraction=args.hot_fraction,
            system_len=args.system_len,
            seed=args.seed,
        )
    try:
        trace = load_trace(args.trace)
    except TraceError as exc:
        return fail(PROG, str(exc))
    except OSError as exc:
        return fail(PROG, f"cannot read trace {args.trace}: {exc.strerror or exc}")
    if trace.num_requests == 0:
        return fail(PROG, f"trace {trace.source} has no requests")
    return requests_from_trace(trace, args.limit)


def _plot(results: dict[str, dict], path: str, title: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    names = list(results)
    panels = (
        ("hit_rate", "token hit rate"),
        ("ttft_p90", "TTFT p90 (s)"),
        ("max_mean_load", "max/mean load"),
        ("regret", "regret"),
    )
    fig, axes = plt.subplots(1, len(panels), figsize=(4 * len(panels), 3.5))
    for ax, (key, label) in zip(axes, panels, strict=True):
        ax.bar(names, [results[n][key] for n in names], color="tab:blue")
        ax.set_title(label)
        ax.tick_params(axis="x", rotation=45)
    fig.suptitle(title)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


def run_route_sim(args: argparse.Namespace) -> int:
    """Simulate the fleet once per router; print JSON or a table. Returns the exit code."""
    if (args.trace is None) == (args.synthetic is None):
        return fail(PROG, "give a TRACE or --synthetic (one of them)")
    try:
        routers = _router_names(args.routers)
    except argparse.ArgumentTypeError as exc:
        return fail(PROG, f"--routers: {exc}")
    for flag, path, suffix in (("--csv", args.csv, ".csv"), ("--png", args.png, ".png")):
        problem = path and output_problem(flag, path, suffix)
        if problem:
            return fail(PROG, problem)
    if args.png and not _can_plot():
        return fail(PROG, "--png needs matplotlib: pip install 'radixkv[plot]'")
    reqs = _requests(args)
    if isinstance(reqs, int):
        return reqs
    if args.synthetic and args.limit:
        reqs = reqs[: args.limit]
    service = SERVICE_PROFILES[args.profile].replace(
        prefill_per_token=args.prefill_per_token,
        attention_per_key=args.attention_per_key,
        decode_per_token=args.decode_per_token,
        step_overhead=args.step_overhead,
    )
    batch = None
    if args.service == "batched":
        if args.token_budget <= args.max_num_seqs:
            return fail(
                PROG,
                f"--token-budget ({args.token_budget}) must exceed --max-num-seqs "
                f"({args.max_num_seqs})",
            )
        batch = BatchConfig(args.token_budget, args.max_num_seqs)
    rate = args.rate
    if args.load is not None:
        busy = offered_load(reqs, service, args.replicas, batch=batch)
        if not busy > 0 or busy == float("inf"):
            return fail(PROG, "--load needs at least two requests with distinct arrival times")
        rate = args.load / busy
    if args.store_capacity is None:
        given = [f"--{f.replace('_', '-')}" for f in _STORE_FLAGS if getattr(args, f) is not None]
        if given or args.store_aware:
            flag = given[0] if given else "--store-aware"
            return fail(PROG, f"{flag} needs --store-capacity (a shared store)")
    baseline = single_cache_hit_rate(reqs, args.capacity * args.replicas, eviction=args.eviction)
    results: dict[str, dict] = {}
    for name in routers:
        clock = SimClock()
        store = _shared_store(args)
        view = store.view() if store is not None and args.store_aware else None
        router = build_router(name, clock, seed=args.seed, service=service, store=view)
        res = simulate(
            reqs,
            router,
            num_replicas=args.replicas,
            capacity_blocks=args.capacity,
            service=service,
            batch=batch,
            rate=rate,
            event_delay=args.event_delay,
            eviction=args.eviction,
            clock=clock,
            progress=not args.no_progress,
            store=store,
        )
        row = res.to_dict()
        row["single_cache_hit_rate"] = baseline
        # The single cache hit nothing (no block is ever reused): the ratio is undefined.
        row["vs_single_cache"] = res.hit_rate / baseline if baseline else None
        results[name] = row
    try:
        if args.csv:
            with open(args.csv, "w", newline="") as f:
                fields = ["router", *[k for k in results[routers[0]] if k != "router"]]
                w = csv.DictWriter(f, fieldnames=fields)
                w.writeheader()
                w.writerows(results.values())
        if args.png:
            src = args.synthetic or os.path.basename(args.trace)
            _plot(results, args.png, f"{src}: {args.replicas} replicas x {args.capacity} blocks")
    except OSError as exc:
        return fail(PROG, f"cannot write output: {exc}")
    if args.json:
        print(json.dumps(_json_ready(results), allow_nan=False))
        return 0
    width = max(len("router"), *(len(n) for n in routers))
    print(
        f"single cache with the fleet's capacity ({args.capacity * args.replicas} blocks): "
        f"hit rate {baseline:.4f}; {args.service} service, {args.profile} profile, "
        f"offered load {results[routers[0]]['offered_load']:.3g}"
    )
    columns = _COLUMNS
    if args.store_capacity is not None:  # the hit rate's part from each lower tier
        columns = ("hit_rate", "host_hit_rate", "store_hit_rate", *_COLUMNS[1:])
    print(f"{'router':<{width}} " + " ".join(f"{c:>12}" for c in ("vs_single", *columns)))
    for name, row in results.items():
        cells = [row["vs_single_cache"], *(row[c] for c in columns)]
        print(f"{name:<{width}} " + " ".join(_cell(v) for v in cells))
    return 0


def _shared_store(args: argparse.Namespace) -> SharedStore | None:
    """A fresh shared store for one run (None without ``--store-capacity``)."""
    if args.store_capacity is None:
        return None
    return SharedStore(
        args.store_capacity,
        host_capacity_blocks=args.host_capacity or args.capacity,
        write_policy=args.store_write or "write_back",
        load_cost=DEFAULT_STORE_LOAD_COST if args.store_load_cost is None else args.store_load_cost,
        host_load_cost=(
            DEFAULT_HOST_LOAD_COST if args.host_load_cost is None else args.host_load_cost
        ),
    )


def _json_ready(value: object) -> object:
    """``value`` with every non-finite float as None: strict JSON has no NaN or Infinity."""
    if isinstance(value, dict):
        return {k: _json_ready(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_json_ready(v) for v in value]
    if isinstance(value, float) and not math.isfinite(value):
        return None
    return value


def _cell(value: float | None) -> str:
    """A table cell: 4 significant digits, ``n/a`` for an undefined figure."""
    return f"{'n/a':>12}" if value is None else f"{value:>12.4g}"


def register(subparsers: argparse._SubParsersAction) -> None:
    """Add the ``route-sim`` subcommand (``func(args)`` returns the exit code)."""
    p = subparsers.add_parser(
        "route-sim",
        help="compare routers on a simulated fleet of radix caches (a trace or synthetic)",
        description="Simulate N replicas, each a radix cache with a FIFO queue and a calibrated "
        "service model (batched: continuous batching with chunked prefill; serial: one request "
        "at a time), behind each router in turn; print one row per router (hit rate, TTFT, load "
        "balance, measured utilisation, regret, decision time).",
    )
    one_line_errors(p)
    p.add_argument("trace", nargs="?", help="Mooncake JSONL trace (or give --synthetic)")
    p.add_argument("--replicas", type=int_in(1, 4096), required=True, help="replicas, >= 1")
    p.add_argument(
        "--capacity", type=positive_int, required=True, help="blocks per replica (trace blocks)"
    )
    p.add_argument(
        "--routers",
        default="round_robin,least_loaded,pow2,session,chwbl,approx,exact",
        help="comma-separated router names (default: all)",
    )
    pace = p.add_mutually_exclusive_group()
    pace.add_argument(
        "--rate",
        type=_positive_float,
        default=1.0,
        help="arrival speed multiplier: 2 = twice as fast as the trace (default 1)",
    )
    pace.add_argument(
        "--load",
        type=_positive_float,
        help="instead of --rate: pace arrivals so the fleet without a cache would be this "
        "busy (1 = exactly busy; the measured utilisation is reported beside it)",
    )
    p.add_argument(
        "--service",
        choices=("batched", "serial"),
        default="batched",
        help="batched: continuous batching with chunked prefill under --token-budget "
        "(default); serial: one request at a time per replica",
    )
    p.add_argument(
        "--profile",
        choices=tuple(SERVICE_PROFILES),
        default="h200",
        help="per-token costs: h200 (radixkv's engine on an NVIDIA H200, default) or cpu "
        "(SmolLM2-135M on a CPU); the four flags below override single figures",
    )
    for flag, what in (
        ("--prefill-per-token", "seconds per computed prompt token"),
        ("--attention-per-key", "seconds per (computed token, attended key)"),
        ("--decode-per-token", "seconds per decode token (per sequence in a step)"),
        ("--step-overhead", "seconds per batched step, whatever it holds"),
    ):
        p.add_argument(flag, type=_nonneg_float, help=f"{what} (default: the profile's)")
    p.add_argument(
        "--token-budget", type=positive_int, default=2048, help="batched: tokens per step"
    )
    p.add_argument(
        "--max-num-seqs", type=positive_int, default=256, help="batched: sequences at once"
    )
    p.add_argument("--limit", type=positive_int, help="only the first N requests")
    p.add_argument(
        "--event-delay",
        type=_nonneg_float,
        default=0.0,
        help="simulated seconds before a replica's KV events reach the router (default 0)",
    )
    p.add_argument("--eviction", choices=("lru", "level"), default="lru")
    store = p.add_argument_group(
        "a KV store shared by the fleet (docs/store.md, 'Fleet: a shared store')"
    )
    store.add_argument(
        "--store-capacity",
        type=positive_int,
        help="a store of this many blocks (trace blocks) shared by every replica, below a "
        "host tier per replica (default: none)",
    )
    store.add_argument(
        "--host-capacity",
        type=positive_int,
        help="host tier blocks per replica (default: --capacity)",
    )
    store.add_argument(
        "--store-write",
        choices=("write_back", "write_through"),
        help="write_back (default): what a replica's host evicts is put; write_through: "
        "every host backup is put",
    )
    store.add_argument(
        "--store-load-cost",
        type=_nonneg_float,
        help="seconds to load a token from the store, over --prefill-per-token "
        f"(default {DEFAULT_STORE_LOAD_COST})",
    )
    store.add_argument(
        "--host-load-cost",
        type=_nonneg_float,
        help="seconds to load a token from a replica's host, over --prefill-per-token "
        f"(default {DEFAULT_HOST_LOAD_COST})",
    )
    store.add_argument(
        "--store-aware",
        action="store_true",
        help="the prefix-aware routers count the blocks any replica can fetch from the "
        "store as loaded, not computed (at --store-load-cost)",
    )
    p.add_argument("--seed", type=int_in(0), default=0, help="seed for random routers/workloads")
    p.add_argument("--synthetic", choices=SYNTHETIC_WORKLOADS, help="a synthetic workload")
    p.add_argument(
        "--requests",
        type=positive_int,
        default=1000,
        help="synthetic: requests, exactly (groups: at least --groups, split evenly)",
    )
    p.add_argument("--groups", type=positive_int, default=16, help="synthetic groups: groups")
    p.add_argument(
        "--system-len", type=int_in(0), default=8, help="synthetic: system prompt blocks"
    )
    p.add_argument(
        "--hot-fraction", type=_fraction, default=0.9, help="synthetic hot: share of hot prompt"
    )
    p.add_argument("--json", action="store_true", help="one JSON object keyed by router")
    p.add_argument("--csv", help="also write the rows to this .csv")
    p.add_argument("--png", help="also write a bar chart to this .png (needs matplotlib)")
    p.add_argument("--no-progress", action="store_true", help="no progress bar")
    p.set_defaults(func=run_route_sim)
