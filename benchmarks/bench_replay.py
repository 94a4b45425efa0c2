"""Trace replay speed: the numba fast path against the plain OrderedDict/deque reference.

Setup: the Mooncake conversation trace (12,031 requests, 288,500 block accesses, 182,790
distinct hash ids), block size 512, capacities 1024, 4096 and 16384 blocks, policies LRU,
LFU and S3FIFO (ratio 0.1, max_freq 3). Both sides start from a loaded trace and produce
the same outputs: per-request hit lengths and hit tokens, block hits, the final resident
set and the unreachable-block count (checked equal in every run). The fast side is the
public ``replay()``; the plain side is ``radixkv.replay.reference`` (the tests' oracles).

Each measurement is the median of --repeats whole replays after one warm-up (the fast
side takes 5x as many, being cheap), with the spread as min..max; throughput is block
accesses per second, and the ratio is plain time / fast time in the same run. "core"
times the plain policy loop alone (no hit tokens, no unreachable count), the most
conservative baseline; the target is checked against it. JIT cost is reported
separately: the first call of each kernel in this process (a compile, or a load from
numba's on-disk cache; --cold-jit points numba at an empty cache directory to force a
compile).

The radix policies are timed once each, for reference (their engine is RadixCache, Python).

    python benchmarks/bench_replay.py            # full run (about a minute)
    python benchmarks/bench_replay.py --quick    # capacity 4096 only, fewer repeats
    python benchmarks/bench_replay.py --out benchmarks/results/bench_replay.csv  # record it

The trace is ``../shared/data/traces/conversation_trace.jsonl`` beside the checkout, or
in the folder ``$RADIXKV_TRACES`` names, or ``--trace``.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

from bench_common import save_rows

ROOT = Path(__file__).resolve().parent.parent
TRACES = Path(os.environ.get("RADIXKV_TRACES") or ROOT.parent / "shared" / "data" / "traces")
TRACE = TRACES / "conversation_trace.jsonl"
FLAT = ("lru", "lfu", "s3fifo")


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--trace", type=Path, default=TRACE)
    p.add_argument("--capacities", type=int, nargs="+", default=[1024, 4096, 16384])
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--block-size", type=int, default=512)
    p.add_argument("--quick", action="store_true", help="capacity 4096, 3 repeats")
    p.add_argument("--no-radix", action="store_true", help="skip the radix policies")
    p.add_argument("--cold-jit", action="store_true", help="compile kernels from scratch")
    p.add_argument("--out", type=Path, default=None, help="also write the table as CSV here")
    args = p.parse_args()
    if args.quick:
        args.capacities, args.repeats = [4096], 3
    return args


def timed(
    fn: Callable[[], object], repeats: int, warmup: bool = True
) -> tuple[float, float, float, object]:
    """(median, min, max) seconds over ``repeats`` calls after one warm-up; last result."""
    out = fn() if warmup else None
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        out = fn()
        times.append(time.perf_counter() - start)
    return statistics.median(times), min(times), max(times), out


def main() -> int:
    args = parse_args()
    if args.cold_jit:
        os.environ["NUMBA_CACHE_DIR"] = tempfile.mkdtemp(prefix="radixkv-numba-")
    from radixkv.replay import flat_policies as pf
    from radixkv.replay import load_trace, replay
    from radixkv.replay.reference import reference_replay, unreachable_reference

    trace = load_trace(args.trace)
    seqs = [r.hash_ids for r in trace]
    lengths = trace.input_lengths.tolist()
    bs = args.block_size
    n_acc = trace.num_accesses
    print(
        f"trace {args.trace.name}: {trace.num_requests} requests, {n_acc} block accesses, "
        f"{trace.num_ids} distinct ids; block_size {bs}; median of {args.repeats}"
    )

    # JIT: the first call of each kernel (compile or cache load), on a one-request trace.
    tiny = trace[:1]
    jit = {}
    kernels = {
        "lru": pf.lru_kernel,
        "lfu": pf.lfu_kernel,
        "s3fifo": pf.s3fifo_kernel,
        "reachable": pf.reachable_mask,
    }
    for policy in FLAT:
        start = time.perf_counter()
        replay(tiny, policy, 16)
        jit[policy] = time.perf_counter() - start
    stats = {k: (v.stats.cache_hits, v.stats.cache_misses) for k, v in kernels.items()}
    loaded = all(sum(h.values()) > 0 for h, _ in stats.values())
    how = "loaded from numba's disk cache" if loaded else "compiled"
    print(
        "first call (JIT, "
        + how
        + "): "
        + ", ".join(f"{p} {jit[p] * 1e3:.0f} ms" for p in FLAT)
        + " (the first includes the reachability kernel)"
    )

    def plain_core(policy: str, capacity: int):
        return reference_replay(seqs, policy, capacity)

    def plain(policy: str, capacity: int):
        ks, block_hits, resident = reference_replay(seqs, policy, capacity)
        hit_tokens = [min(k * bs, n) for k, n in zip(ks, lengths, strict=True)]
        return ks, hit_tokens, block_hits, len(resident), unreachable_reference(seqs, resident)

    def fast(policy: str, capacity: int):
        r = replay(trace, policy, capacity, bs)
        return (
            r.hit_blocks.tolist(),
            r.hit_tokens.tolist(),
            r.block_hits,
            r.final_cache_blocks,
            r.unreachable_blocks,
        )

    rows = []
    header = (
        f"{'policy':<11} {'capacity':>8} {'fast ms':>8} {'(min..max)':>15} {'fast Macc/s':>11}"
        f" {'plain ms':>9} {'(min..max)':>15} {'plain Macc/s':>12} {'speedup':>8}"
        f" {'core ms':>8} {'core x':>7} {'hit rate':>9}"
    )
    print(header)
    print("-" * len(header))
    fast_repeats = 5 * args.repeats  # cheap; more samples steady the median on a busy machine
    for policy in FLAT:
        for capacity in args.capacities:
            f_med, f_min, f_max, f_out = timed(
                lambda p=policy, c=capacity: fast(p, c), fast_repeats
            )
            p_med, p_min, p_max, p_out = timed(
                lambda p=policy, c=capacity: plain(p, c), args.repeats
            )
            c_med = timed(lambda p=policy, c=capacity: plain_core(p, c), args.repeats)[0]
            assert f_out == p_out, f"fast and plain disagree: {policy} @ {capacity}"
            hit_rate = sum(f_out[1]) / int(trace.input_lengths.sum())
            rows.append(
                {
                    "policy": policy,
                    "capacity": capacity,
                    "block_accesses": n_acc,
                    "fast_median_s": f_med,
                    "fast_min_s": f_min,
                    "fast_max_s": f_max,
                    "plain_median_s": p_med,
                    "plain_min_s": p_min,
                    "plain_max_s": p_max,
                    "plain_core_median_s": c_med,
                    "fast_accesses_per_s": n_acc / f_med,
                    "plain_accesses_per_s": n_acc / p_med,
                    "speedup": p_med / f_med,
                    "core_speedup": c_med / f_med,
                    "speedup_of_minima": p_min / f_min,
                    "jit_first_call_s": jit[policy],
                    "hit_rate": hit_rate,
                }
            )
            print(
                f"{policy:<11} {capacity:>8} {f_med * 1e3:>8.2f} "
                f"{f'({f_min * 1e3:.2f}..{f_max * 1e3:.2f})':>15} {n_acc / f_med / 1e6:>11.1f}"
                f" {p_med * 1e3:>9.1f} {f'({p_min * 1e3:.1f}..{p_max * 1e3:.1f})':>15}"
                f" {n_acc / p_med / 1e6:>12.2f} {p_med / f_med:>7.1f}x"
                f" {c_med * 1e3:>8.1f} {c_med / f_med:>6.1f}x {hit_rate:>9.4f}"
            )
    if not args.no_radix:
        for policy in ("radix-level", "radix-lru"):
            for capacity in args.capacities:
                med, lo, hi, r = timed(
                    lambda p=policy, c=capacity: replay(trace, p, c, bs), 1, False
                )
                rows.append(
                    {
                        "policy": policy,
                        "capacity": capacity,
                        "block_accesses": n_acc,
                        "fast_median_s": med,
                        "fast_min_s": lo,
                        "fast_max_s": hi,
                        "fast_accesses_per_s": n_acc / med,
                        "hit_rate": r.overall_hit_rate,
                    }
                )
                print(
                    f"{policy:<11} {capacity:>8} {med * 1e3:>8.0f} "
                    f"{f'({lo * 1e3:.0f}..{hi * 1e3:.0f})':>15} {n_acc / med / 1e6:>11.2f}"
                    f" {'':>9} {'':>15} {'':>12} {'(tree)':>8} {r.overall_hit_rate:>9.4f}"
                )
    worst = min(r["core_speedup"] for r in rows if "core_speedup" in r)
    print(f"slowest flat speedup against the plain policy loop alone: {worst:.1f}x (target >= 20x)")
    save_rows(rows, args.out, "bench_replay_quick.csv" if args.quick else "bench_replay.csv")
    return 0


if __name__ == "__main__":
    sys.exit(main())
