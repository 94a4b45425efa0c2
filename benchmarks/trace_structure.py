"""The structure of a Mooncake trace that decides which eviction order wins on it.

Prints, per trace: how requests share prefixes (first ids, how deep reuse goes, how often
a request's prompt is a whole earlier prompt: rarely, since the last block is partial and
the next turn re-hashes it), how many new blocks a continuing turn adds, how many new
blocks arrive between a turn and its predecessor (the reuse distance a cache must span),
and the chance that a conversation goes on after its n-th turn. Then, for a few policies
and capacities, the prefix-hit blocks each gets as a share of the infinite cache's, by
the request's turn number (turn 0 starts a chain; turn n reuses a prefix last used by a
turn n-1). docs/replay.md ("Eviction orders on the Mooncake traces") quotes these.

    python benchmarks/trace_structure.py                      # both traces
    python benchmarks/trace_structure.py --capacities 1024 16384 --policies lru radix-level

The traces are in ``../shared/data/traces`` beside the checkout, or in ``$RADIXKV_TRACES``.
"""

from __future__ import annotations

import argparse
import os
from pathlib import Path

import numpy as np

from radixkv.replay import Trace, load_trace, replay

ROOT = Path(__file__).resolve().parent.parent
TRACES = Path(os.environ.get("RADIXKV_TRACES") or ROOT.parent / "shared" / "data" / "traces")
TURN_BUCKETS = ((1, 2), (2, 3), (3, 5), (5, 10**9))


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--traces", nargs="+", default=["conversation", "synthetic"])
    p.add_argument("--capacities", type=int, nargs="+", default=[1024, 16384])
    p.add_argument("--policies", nargs="+", default=["lru", "s3fifo", "radix-level", "radix-deep"])
    return p.parse_args()


def chains(trace: Trace) -> dict[str, np.ndarray]:
    """Per request: ``reuse`` (prefix blocks some earlier request had), ``turn``, ``gap``
    (new blocks since the request that last used the deepest reused block; -1 if none)
    and ``whole`` (the reused prefix is that request's whole prompt)."""
    ids, offsets = trace.ids, trace.offsets
    n = trace.num_requests
    last_user = np.full(trace.num_ids, -1, dtype=np.int64)
    new_before = np.zeros(n + 1, dtype=np.int64)  # new blocks in requests [0, r)
    out = {k: np.zeros(n, dtype=np.int64) for k in ("reuse", "turn", "whole")}
    out["gap"] = np.full(n, -1, dtype=np.int64)
    for r in range(n):
        seq = ids[offsets[r] : offsets[r + 1]]
        seen = last_user[seq] >= 0
        k = len(seq) if seen.all() else int(np.argmin(seen))
        out["reuse"][r] = k
        if k > 1:  # more than the first block: a continued chain
            prev = int(last_user[seq[k - 1]])
            out["turn"][r] = out["turn"][prev] + 1
            out["gap"][r] = new_before[r] - new_before[prev + 1]
            out["whole"][r] = k == offsets[prev + 1] - offsets[prev]
        new_before[r + 1] = new_before[r] + int((~seen).sum())
        last_user[seq] = r
    return out


def describe(name: str, trace: Trace, c: dict[str, np.ndarray]) -> None:
    ids, offsets = trace.ids, trace.offsets
    lengths = np.diff(offsets)
    firsts = ids[offsets[:-1]]
    reuse, turn, gap = c["reuse"], c["turn"], c["gap"]
    deep = reuse > 1
    print(
        f"== {name}: {trace.num_requests} requests, {trace.num_accesses} blocks, "
        f"{trace.num_ids} ids; prompt blocks median {np.median(lengths):.0f}, "
        f"p90 {np.percentile(lengths, 90):.0f}"
    )
    print(
        f"  distinct first ids: {len(np.unique(firsts))}; requests reusing only their first block: "
        f"{int((reuse == 1).sum())}; reusing more: {int(deep.sum())} "
        f"(median {np.median(reuse[deep]):.0f} blocks)"
    )
    print(
        f"  reused prefix is the whole earlier prompt: {int(c['whole'].sum())} of "
        f"{int(deep.sum())}; new blocks per continuing turn: median "
        f"{np.median((lengths - reuse)[deep]):.0f}, mean {(lengths - reuse)[deep].mean():.1f}"
    )
    q = np.percentile(gap[deep], [25, 50, 75, 90])
    print(
        "  new blocks between a turn and its predecessor: p25 {:.0f}, median {:.0f}, "
        "p75 {:.0f}, p90 {:.0f}".format(*q)
    )
    counts = np.bincount(turn)
    goes_on = [f"{counts[t + 1] / counts[t]:.2f}" for t in range(min(6, len(counts) - 1))]
    print(
        f"  requests by turn 0..5: {counts[:6].tolist()}; P(another turn | turn 0..5): "
        f"{', '.join(goes_on)}"
    )


def hits_by_turn(trace: Trace, c: dict[str, np.ndarray], policies, capacities) -> None:
    reuse, turn = c["reuse"], c["turn"]
    head = " ".join(
        f"turn {lo}{'+' if hi > 10**8 else '' if hi == lo + 1 else f'-{hi - 1}'}"
        for lo, hi in TURN_BUCKETS
    )
    print(f"  prefix-hit blocks as % of the infinite cache's, by turn: {head}")
    for cap in capacities:
        for policy in policies:
            hit = replay(trace, policy, cap).hit_blocks
            shares = []
            for lo, hi in TURN_BUCKETS:
                m = (turn >= lo) & (turn < hi)
                shares.append(f"{100 * hit[m].sum() / max(1, reuse[m].sum()):6.1f}")
            print(f"    {policy:12s} {cap:7d}: " + " ".join(shares))


def main() -> None:
    args = parse_args()
    for name in args.traces:
        trace = load_trace(TRACES / f"{name}_trace.jsonl")
        c = chains(trace)
        describe(name, trace, c)
        hits_by_turn(trace, c, args.policies, args.capacities)


if __name__ == "__main__":
    main()
