"""``radixkv replay`` and ``radixkv sweep``: the trace replayer on the command line.

Bad input (an unreadable, empty or malformed trace, a bad parameter or output
path) exits with code 2 and one line on stderr, before any replay runs; results
go to stdout. A trace path of ``-`` reads the trace from stdin (into memory, so
a sweep replays it as often as it needs).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from collections.abc import Callable
from typing import TypeVar

from radixkv.cache.store.tier import STORE_WRITE_POLICIES
from radixkv.cli_args import (
    fail,
    int_in,
    one_line_errors,
    open_unit_float,
    output_problem,
)
from radixkv.replay.config import _MAX_BLOCK_SIZE, _MAX_CAPACITY, REPLAY_POLICIES, ReplayConfig
from radixkv.replay.id_pools import STORE_ENTRY_BYTES
from radixkv.replay.replay import replay
from radixkv.replay.sweep import (
    can_plot,
    ceiling_row,
    plot_sweep,
    run_sweep,
    sweep_configs,
    write_csv,
)
from radixkv.replay.trace import (
    MOONCAKE_BLOCK_SIZE,
    Trace,
    TraceError,
    TraceLengthError,
    load_trace,
)

__all__ = ["register", "run_replay", "run_sweep_command"]

DEFAULT_CAPACITIES = (256, 1024, 4096, 16384, 65536)
STDIN = "-"
_PLOT_EXTRA = "pip install 'radixkv[plot]'"

_capacity = int_in(1, _MAX_CAPACITY)
_host_capacity = int_in(0, _MAX_CAPACITY)
_store_capacity = int_in(0, _MAX_CAPACITY)
# ReplayConfig's field names, as the flags that set them
_FLAGS = (
    ("store_capacities", "--store-capacities"),
    ("host_capacities", "--host-capacities"),
    ("store_write_policy", "--store-write-policy"),
    ("store_capacity", "--store-capacity"),
    ("host_capacity", "--host-capacity"),
)
_T = TypeVar("_T")


def _as_flags(message: str) -> str:
    """``message`` with ReplayConfig's field names written as the flags that set them."""
    for name, flag in _FLAGS:
        message = message.replace(name, flag)
    return message


def _load(prog: str, path: str, args: argparse.Namespace) -> Trace | int:
    """The trace at ``path`` (``-``: stdin), or the exit code after a one-line error.

    An empty trace is an error: a wrong path (``/dev/null``, an empty file) must not
    look like a result.
    """
    block_size = None if args.no_check_lengths else args.block_size
    try:
        if path == STDIN:
            trace = load_trace(sys.stdin.buffer, block_size)
        else:
            trace = load_trace(path, block_size)
    except TraceLengthError as exc:
        return fail(prog, f"{exc} (--block-size sets the block size; --no-check-lengths skips)")
    except TraceError as exc:
        return fail(prog, str(exc))
    except OSError as exc:
        return fail(prog, f"cannot read trace {path}: {exc.strerror or exc}")
    if trace.num_requests == 0:
        return fail(prog, f"trace {trace.source} has no requests")
    return trace


def _add_policy_params(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--block-size",
        type=int_in(1, _MAX_BLOCK_SIZE),
        default=MOONCAKE_BLOCK_SIZE,
        help=f"tokens per block, i.e. per hash id (default {MOONCAKE_BLOCK_SIZE}, Mooncake's)",
    )
    p.add_argument(
        "--small-ratio",
        type=open_unit_float,
        default=0.1,
        help="S3FIFO small-queue share, in (0, 1) (default 0.1)",
    )
    p.add_argument(
        "--max-freq",
        type=int_in(0, 2**62),
        default=3,
        help="S3FIFO saturating frequency cap, >= 0 (default 3)",
    )
    p.add_argument(
        "--no-check-lengths",
        action="store_true",
        help="accept lines where len(hash_ids) != ceil(input_length / block size) "
        "(Mooncake's rule, checked by default), for traces in other formats",
    )


def _add_store_policy(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--store-write-policy",
        choices=STORE_WRITE_POLICIES,
        default="write_back",
        help="when the store is written: write_back (what host eviction drops; the default) "
        "or write_through (every backup to the host)",
    )


def run_replay(args: argparse.Namespace) -> int:
    """Replay one trace; print one JSON object on stdout. Returns the exit code."""
    prog = "radixkv replay"
    try:
        ReplayConfig(
            args.policy,
            args.capacity,
            args.block_size,
            args.small_ratio,
            args.max_freq,
            args.host_capacity,
            args.store_capacity,
            args.store_write_policy,
        )
    except (TypeError, ValueError) as exc:
        return fail(prog, _as_flags(str(exc)))
    trace = _load(prog, args.trace, args)
    if isinstance(trace, int):
        return trace
    result = replay(
        trace,
        args.policy,
        args.capacity,
        args.block_size,
        args.small_ratio,
        args.max_freq,
        args.host_capacity,
        args.store_capacity,
        args.store_write_policy,
    )
    print(json.dumps(result.to_dict(per_request=args.per_request)))
    return 0


def _split_list(values: list[str], parse: Callable[[str], _T], flag: str) -> list[_T]:
    """Space- and comma-separated ``values``, each through ``parse``; ``ValueError`` naming
    ``flag`` and the bad part."""
    out = []
    for value in values:
        for part in value.split(","):
            part = part.strip()
            if not part:
                continue
            try:
                out.append(parse(part))
            except (ValueError, argparse.ArgumentTypeError) as exc:
                raise ValueError(f"{flag}: {exc}") from None
    if not out:
        raise ValueError(f"{flag}: give at least one value")
    return out


def _policy(text: str) -> str:
    if text not in REPLAY_POLICIES:
        raise ValueError(f"policy must be one of {', '.join(REPLAY_POLICIES)}, got {text!r}")
    return text


def run_sweep_command(args: argparse.Namespace) -> int:
    """Replay one trace for every policy x capacity; write a CSV and a PNG; print a table.

    Everything is checked before the trace is read: the parameters, and the output
    paths (``--csv`` must end in .csv, ``--png`` in .png, in existing writable
    directories). Without matplotlib (the ``plot`` extra) the PNG is skipped with a
    note, unless ``--png`` asks for one: that is bad input (exit 2, nothing run).
    """
    prog = "radixkv sweep"
    try:
        policies = _split_list(args.policies, _policy, "--policies")
        capacities = _split_list(args.capacities, _capacity, "--capacities")
        hosts = _split_list(args.host_capacities, _host_capacity, "--host-capacities")
        stores = _split_list(args.store_capacities, _store_capacity, "--store-capacities")
        tiers = {
            "block_size": args.block_size,
            "small_ratio": args.small_ratio,
            "max_freq": args.max_freq,
            "host_capacities": hosts,
            "store_capacities": stores,
            "store_write_policy": args.store_write_policy,
        }
        sweep_configs(policies, capacities, **tiers)
    except (TypeError, ValueError) as exc:
        return fail(prog, _as_flags(str(exc)))
    plot = can_plot()
    if args.png and not plot:
        return fail(prog, f"--png needs matplotlib: {_PLOT_EXTRA}")
    stem = "stdin" if args.trace == STDIN else os.path.splitext(os.path.basename(args.trace))[0]
    csv_path = args.csv or f"{stem}_sweep.csv"
    png_path = args.png or os.path.splitext(csv_path)[0] + ".png"
    problem = output_problem("--csv", csv_path, ".csv")
    if problem is None and plot:
        problem = output_problem("--png", png_path, ".png")
    if problem is not None:
        return fail(prog, problem)
    trace = _load(prog, args.trace, args)
    if isinstance(trace, int):
        return trace
    rows = run_sweep(trace, policies, capacities, **tiers, progress=not args.no_progress)
    ceiling = ceiling_row(trace, args.block_size)
    try:
        write_csv([*rows, ceiling], csv_path)
        if plot:
            plot_sweep(rows, ceiling, png_path, title=os.path.basename(trace.source))
    except OSError as exc:
        return fail(prog, f"cannot write output: {exc}")
    width = max(len(p) for p in [*policies, ceiling.policy])
    print(
        f"{'policy':<{width}} {'capacity':>9} {'host':>9} {'store':>10} {'hit_rate':>8} "
        f"{'combined':>8} {'final':>7} {'unreach':>7}"
    )
    for r in [*rows, ceiling]:
        print(
            f"{r.policy:<{width}} {r.capacity:>9} {r.host_capacity:>9} {r.store_capacity:>10} "
            f"{r.overall_hit_rate:>8.4f} {r.combined_hit_rate:>8.4f} "
            f"{r.final_cache_blocks:>7} {r.unreachable_blocks:>7}"
        )
    if plot:
        print(f"wrote {csv_path} and {png_path}")
    else:
        print(f"wrote {csv_path} (no PNG: matplotlib is not installed; {_PLOT_EXTRA})")
    return 0


_TRACE_HELP = (
    "JSONL trace (timestamp, input_length, output_length, hash_ids per line); - reads stdin"
)


def register(subparsers: argparse._SubParsersAction) -> None:
    """Add the ``replay`` and ``sweep`` subcommands (``func(args)`` returns the exit code)."""
    p = subparsers.add_parser(
        "replay",
        help="replay a Mooncake hash_ids trace through one cache policy",
        description="Replay a JSONL hash_ids trace through one cache policy; print one JSON "
        "object on stdout.",
    )
    one_line_errors(p)
    p.add_argument("trace", help=_TRACE_HELP)
    p.add_argument("--policy", required=True, choices=REPLAY_POLICIES)
    p.add_argument("--capacity", type=_capacity, required=True, help="cache size in blocks, >= 1")
    p.add_argument(
        "--host-capacity",
        type=_host_capacity,
        default=0,
        help="blocks in a host-memory tier under the tree (radix-* policies only; write-back, "
        "LRU host order): what the device evicts waits there and is loaded back on a hit; "
        "the JSON gains host_* fields (default 0: no host tier)",
    )
    p.add_argument(
        "--store-capacity",
        type=_store_capacity,
        default=0,
        help="blocks in a KV store tier below the host tier (needs --host-capacity > 0): what "
        "the host lets go of waits there, least recently used out first, and is read back "
        f"through the host on a hit; kept in memory as {STORE_ENTRY_BYTES}-byte entries "
        "(capacity in bytes = blocks x that); the JSON gains store_* fields (default 0: no "
        "store)",
    )
    _add_store_policy(p)
    _add_policy_params(p)
    p.add_argument(
        "--per-request",
        action="store_true",
        help="add a per_request list of {prompt_tokens, hit_tokens} in trace order "
        "(and host_hit_tokens with --host-capacity, store_hit_tokens with --store-capacity)",
    )
    p.set_defaults(func=run_replay)

    s = subparsers.add_parser(
        "sweep",
        help="replay a trace for several policies and capacities; CSV + PNG plot",
        description="Replay a trace for every policy x capacity (x host x store capacity for "
        "the radix-* policies), with a progress bar; write a CSV and a PNG of token hit rate, "
        "every tier's hits counted, vs device capacity (with the infinite-cache ceiling; the "
        "PNG needs matplotlib, the plot extra).",
    )
    one_line_errors(s)
    s.add_argument("trace", help=_TRACE_HELP)
    s.add_argument(
        "--policies",
        nargs="+",
        default=list(REPLAY_POLICIES),
        help=f"space- or comma-separated, from {', '.join(REPLAY_POLICIES)} (default: all)",
    )
    s.add_argument(
        "--capacities",
        nargs="+",
        default=[str(c) for c in DEFAULT_CAPACITIES],
        help="capacities in blocks (>= 1), space- or comma-separated (default: "
        f"{' '.join(map(str, DEFAULT_CAPACITIES))})",
    )
    s.add_argument(
        "--host-capacities",
        nargs="+",
        default=["0"],
        help="host tier sizes in blocks (>= 0; 0: none), space- or comma-separated, for the "
        "radix-* policies (default 0)",
    )
    s.add_argument(
        "--store-capacities",
        nargs="+",
        default=["0"],
        help="store tier sizes in blocks (>= 0; 0: none), space- or comma-separated; a store "
        "runs only under a host capacity above 0 (default 0)",
    )
    _add_store_policy(s)
    _add_policy_params(s)
    s.add_argument(
        "--csv",
        help="CSV output path, ending in .csv (default: <trace stem>_sweep.csv; "
        "stdin_sweep.csv for -)",
    )
    s.add_argument(
        "--png",
        help="PNG output path, ending in .png (default: the CSV path with .png; needs matplotlib)",
    )
    s.add_argument("--no-progress", action="store_true", help="no progress bar")
    s.set_defaults(func=run_sweep_command)
