"""``radixkv replay`` and ``radixkv sweep``: the trace replayer on the command line.

Bad input (an unreadable or malformed trace, a bad parameter) exits with code 2
and one line on stderr; results go to stdout.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from typing import NoReturn

from radixkv.replay.config import REPLAY_POLICIES, ReplayConfig
from radixkv.replay.replay import replay
from radixkv.replay.sweep import can_plot, ceiling_row, plot_sweep, run_sweep, write_csv
from radixkv.replay.trace import Trace, TraceError, load_trace

__all__ = ["register", "run_replay", "run_sweep_command"]

EXIT_BAD_INPUT = 2
DEFAULT_CAPACITIES = (256, 1024, 4096, 16384, 65536)
_PLOT_EXTRA = "pip install 'radixkv[plot]'"


def _fail(prog: str, message: str) -> int:
    print(f"{prog}: error: {' '.join(str(message).split())}", file=sys.stderr)
    return EXIT_BAD_INPUT


def _one_line_errors(parser: argparse.ArgumentParser) -> None:
    """Make argparse usage errors one line on stderr (exit code 2, as argparse's own)."""

    def error(message: str) -> NoReturn:
        _fail(parser.prog, message)
        sys.exit(EXIT_BAD_INPUT)

    parser.error = error  # type: ignore[method-assign]

    # Unknown options would otherwise travel up to the top-level parser, whose error
    # prints the usage too; reject them here, in one line.
    parse_known_args = parser.parse_known_args

    def parse_strict(
        args: list[str] | None = None, namespace: argparse.Namespace | None = None
    ) -> tuple[argparse.Namespace, list[str]]:
        namespace, extras = parse_known_args(args, namespace)
        if extras:
            error(f"unrecognized arguments: {' '.join(extras)}")
        return namespace, extras

    parser.parse_known_args = parse_strict  # type: ignore[method-assign]


def _load(prog: str, path: str) -> Trace | int:
    try:
        return load_trace(path)
    except TraceError as exc:
        return _fail(prog, str(exc))
    except OSError as exc:
        return _fail(prog, f"cannot read trace {path}: {exc.strerror or exc}")


def _add_policy_params(p: argparse.ArgumentParser) -> None:
    p.add_argument("--block-size", type=int, default=512, help="tokens per block (default 512)")
    p.add_argument(
        "--small-ratio", type=float, default=0.1, help="S3FIFO small-queue share (default 0.1)"
    )
    p.add_argument(
        "--max-freq", type=int, default=3, help="S3FIFO saturating frequency cap (default 3)"
    )


def run_replay(args: argparse.Namespace) -> int:
    """Replay one trace; print one JSON object on stdout. Returns the exit code."""
    prog = "radixkv replay"
    try:
        ReplayConfig(args.policy, args.capacity, args.block_size, args.small_ratio, args.max_freq)
    except (TypeError, ValueError) as exc:
        return _fail(prog, str(exc))
    trace = _load(prog, args.trace)
    if isinstance(trace, int):
        return trace
    result = replay(
        trace, args.policy, args.capacity, args.block_size, args.small_ratio, args.max_freq
    )
    print(json.dumps(result.to_dict(per_request=args.per_request)))
    return 0


def _split_list(values: list[str], kind: type, name: str) -> list:
    out = []
    for value in values:
        for part in value.split(","):
            part = part.strip()
            if not part:
                continue
            try:
                out.append(kind(part))
            except ValueError:
                raise ValueError(f"{name}: not a valid {kind.__name__}: {part!r}") from None
    if not out:
        raise ValueError(f"{name}: give at least one value")
    return out


def run_sweep_command(args: argparse.Namespace) -> int:
    """Replay one trace for every policy x capacity; write a CSV and a PNG; print a table.

    Without matplotlib (the ``plot`` extra) the PNG is skipped with a note, unless
    ``--png`` asks for one: that is bad input (exit 2, nothing run).
    """
    prog = "radixkv sweep"
    try:
        policies = _split_list(args.policies, str, "--policies")
        capacities = _split_list(args.capacities, int, "--capacities")
        for p in policies:
            for c in capacities:
                ReplayConfig(p, c, args.block_size, args.small_ratio, args.max_freq)
    except (TypeError, ValueError) as exc:
        return _fail(prog, str(exc))
    plot = can_plot()
    if args.png and not plot:
        return _fail(prog, f"--png needs matplotlib: {_PLOT_EXTRA}")
    trace = _load(prog, args.trace)
    if isinstance(trace, int):
        return trace
    stem = os.path.splitext(os.path.basename(args.trace))[0]
    csv_path = args.csv or f"{stem}_sweep.csv"
    png_path = args.png or os.path.splitext(csv_path)[0] + ".png"
    rows = run_sweep(
        trace,
        policies,
        capacities,
        block_size=args.block_size,
        small_ratio=args.small_ratio,
        max_freq=args.max_freq,
        progress=not args.no_progress,
    )
    ceiling = ceiling_row(trace, args.block_size)
    try:
        write_csv([*rows, ceiling], csv_path)
        if plot:
            plot_sweep(rows, ceiling, png_path, title=f"{os.path.basename(args.trace)}")
    except OSError as exc:
        return _fail(prog, f"cannot write output: {exc}")
    width = max(len(p) for p in [*policies, ceiling.policy])
    print(f"{'policy':<{width}} {'capacity':>9} {'hit_rate':>8} {'final':>7} {'unreach':>7}")
    for r in [*rows, ceiling]:
        print(
            f"{r.policy:<{width}} {r.capacity:>9} {r.overall_hit_rate:>8.4f} "
            f"{r.final_cache_blocks:>7} {r.unreachable_blocks:>7}"
        )
    if plot:
        print(f"wrote {csv_path} and {png_path}")
    else:
        print(f"wrote {csv_path} (no PNG: matplotlib is not installed; {_PLOT_EXTRA})")
    return 0


def register(subparsers: argparse._SubParsersAction) -> None:
    """Add the ``replay`` and ``sweep`` subcommands (``func(args)`` returns the exit code)."""
    p = subparsers.add_parser(
        "replay",
        help="replay a Mooncake hash_ids trace through one cache policy",
        description="Replay a JSONL hash_ids trace through one cache policy; print one JSON "
        "object on stdout.",
    )
    _one_line_errors(p)
    p.add_argument("trace", help="JSONL trace: timestamp, input_length, output_length, hash_ids")
    p.add_argument("--policy", required=True, choices=REPLAY_POLICIES)
    p.add_argument("--capacity", type=int, required=True, help="cache size in blocks")
    _add_policy_params(p)
    p.add_argument(
        "--per-request",
        action="store_true",
        help="add a per_request list of {prompt_tokens, hit_tokens} in trace order",
    )
    p.set_defaults(func=run_replay)

    s = subparsers.add_parser(
        "sweep",
        help="replay a trace for several policies and capacities; CSV + PNG plot",
        description="Replay a trace for every policy x capacity, with a progress bar; write a "
        "CSV and a PNG of token hit rate vs capacity (with the infinite-cache ceiling; the PNG "
        "needs matplotlib, the plot extra).",
    )
    _one_line_errors(s)
    s.add_argument("trace", help="JSONL trace")
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
        help="capacities in blocks, space- or comma-separated (default: "
        f"{' '.join(map(str, DEFAULT_CAPACITIES))})",
    )
    _add_policy_params(s)
    s.add_argument("--csv", help="CSV output path (default: <trace stem>_sweep.csv)")
    s.add_argument(
        "--png", help="PNG output path (default: the CSV path with .png; needs matplotlib)"
    )
    s.add_argument("--no-progress", action="store_true", help="no progress bar")
    s.set_defaults(func=run_sweep_command)
