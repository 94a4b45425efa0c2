"""Two-tier replay: device x host capacity sweeps on the Mooncake traces, with a cost model.

For each trace, radix policy, device capacity C (blocks) and host multiplier m, the
trace is replayed through a ``RadixCache`` of C blocks with a host tier of m * C blocks
(``radixkv.replay.replay(..., host_capacity=m * C)``: write-back, LRU host order;
m = 0 is the one-tier replay). Per configuration: the device hit rate (prefixes resident
on the device at arrival), the host hit rate (blocks right after them loaded back from
the host), their sum, the one-tier hit rate of the same policy with the whole memory on
the device (capacity (1 + m) * C), the blocks reloaded and backed up, and the cost model
of ``radixkv.replay.cost.TierCostModel``: per request, recomputed tokens times the
prefill cost per token plus reloaded blocks times block size times the reload cost per
token; "effective prefill tokens saved" is the no-cache cost minus that, in prefill
tokens. Reference columns: the best flat one-tier policy (LRU, LFU, S3FIFO) at C, and
the infinite-cache ceiling.

    python benchmarks/replay_host_tier.py                          # prints the tables
    python benchmarks/replay_host_tier.py --out-dir benchmarks/results   # and records them
    python benchmarks/replay_host_tier.py --measure-reload        # KVCopier.load GB/s (torch)
    python benchmarks/replay_host_tier.py --quick                 # 3 capacities, m in {0, 4}

Outputs with --out-dir: ``replay_host_<trace>.csv`` (one row per configuration) and
``replay_host_tables.md`` (the markdown tables docs/replay.md quotes); with
--measure-reload also ``replay_host_reload.csv``. The traces are
``../shared/data/traces/{conversation,synthetic}_trace.jsonl`` beside the checkout, or in
the folder ``$RADIXKV_TRACES`` names.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from pathlib import Path

from bench_common import write_csv

from radixkv.replay import ReplayResult, Trace, load_trace, replay
from radixkv.replay.cost import (
    DEFAULT_PREFILL_S_PER_TOKEN,
    DEFAULT_RELOAD_GBPS,
    KV_BYTES_PER_TOKEN,
    TierCostModel,
)

ROOT = Path(__file__).resolve().parent.parent
TRACES = Path(os.environ.get("RADIXKV_TRACES") or ROOT.parent / "shared" / "data" / "traces")
TRACE_NAMES = ("conversation", "synthetic")
CAPACITIES = tuple(2**k for k in range(10, 18))
MULTIPLIERS = (0, 1, 4, 8)
POLICIES = ("radix-lru", "radix-deep")
FLAT = ("lru", "lfu", "s3fifo")


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--traces", nargs="+", choices=TRACE_NAMES, default=list(TRACE_NAMES))
    p.add_argument("--capacities", type=int, nargs="+", default=list(CAPACITIES))
    p.add_argument("--host-multipliers", type=int, nargs="+", default=list(MULTIPLIERS))
    p.add_argument("--policies", nargs="+", default=list(POLICIES))
    p.add_argument(
        "--prefill-s-per-token",
        type=float,
        default=DEFAULT_PREFILL_S_PER_TOKEN,
        help=f"seconds to prefill one token (default {DEFAULT_PREFILL_S_PER_TOKEN}: SmolLM2-135M, "
        "CPU, 1 thread)",
    )
    p.add_argument(
        "--reload-gbps",
        type=float,
        default=DEFAULT_RELOAD_GBPS,
        help=f"host-to-device KV copy rate in GB/s (default {DEFAULT_RELOAD_GBPS}, measured "
        "with --measure-reload)",
    )
    p.add_argument(
        "--kv-bytes-per-token",
        type=int,
        default=KV_BYTES_PER_TOKEN,
        help=f"KV bytes per token (default {KV_BYTES_PER_TOKEN}: SmolLM2-135M, float32)",
    )
    p.add_argument("--measure-reload", action="store_true", help="time KVCopier.load and exit")
    p.add_argument("--quick", action="store_true", help="capacities 1024 4096 16384, m in {0, 4}")
    p.add_argument("--out-dir", type=Path, default=None, help="write CSVs and tables here")
    args = p.parse_args()
    if args.quick:
        args.capacities, args.host_multipliers = [1024, 4096, 16384], [0, 4]
    if any(c < 1 for c in args.capacities) or any(m < 0 for m in args.host_multipliers):
        p.error("capacities must be >= 1 and host multipliers >= 0")
    return args


# ----------------------------------------------------------------------------- reload speed
def measure_reload(out_dir: Path | None) -> int:
    """Time ``KVCopier.load`` between two CPU pools of SmolLM2-135M's KV shape (float32).

    Pools are zero-filled at construction (pre-touched). Each setting loads ``per_call``
    random host blocks into random device blocks, 12 calls, the median of the last 10.
    """
    import numpy as np

    from radixkv.model.kv_copy import KVCopier
    from radixkv.model.kvpool import KVPool

    layers, heads, dim = 30, 3, 64
    rows = []
    for block_size, num_blocks, per_call in ((16, 1024, 32), (16, 1024, 128), (512, 32, 4)):
        device = KVPool(layers, num_blocks, block_size, heads, dim)
        host = KVPool(layers, num_blocks, block_size, heads, dim)
        copier = KVCopier(device, host)
        rng = np.random.default_rng(0)
        times = []
        for _ in range(12):
            h = rng.choice(num_blocks, per_call, replace=False).astype(np.int32)
            d = rng.choice(num_blocks, per_call, replace=False).astype(np.int32)
            start = time.perf_counter()
            copier.load(h, d)
            times.append(time.perf_counter() - start)
        med = statistics.median(times[2:])
        tokens = per_call * block_size
        nbytes = per_call * device.bytes_per_block
        row = {
            "block_size": block_size,
            "blocks_per_call": per_call,
            "tokens_per_call": tokens,
            "bytes_per_token": nbytes // tokens,
            "median_ms": round(med * 1e3, 3),
            "gb_per_s": round(nbytes / med / 1e9, 2),
            "us_per_token": round(med / tokens * 1e6, 2),
        }
        rows.append(row)
        print(row, flush=True)
        del device, host, copier
    if out_dir is not None:
        write_csv(rows, out_dir / "replay_host_reload.csv")
    return 0


# ----------------------------------------------------------------------------- the sweep
def row_for(
    name: str,
    result: ReplayResult,
    multiplier: int,
    same_total: ReplayResult,
    best_flat: tuple[str, float],
    ceiling: float,
    model: TierCostModel,
    seconds: float,
) -> dict:
    """One CSV row: the replay's figures, its references and its cost."""
    c = result.config
    stats = result.cache_stats
    reloaded_tokens = result.host_block_hits * c.block_size
    backed_up = stats.backed_up_blocks if stats is not None else 0
    return {
        "trace": name,
        "policy": c.policy,
        "device_capacity": c.capacity,
        "host_multiplier": multiplier,
        "host_capacity": c.host_capacity,
        "block_size": c.block_size,
        "num_requests": result.num_requests,
        "total_prompt_tokens": result.total_prompt_tokens,
        "device_hit_tokens": result.total_hit_tokens,
        "host_hit_tokens": result.total_host_hit_tokens,
        "device_hit_rate": round(result.overall_hit_rate, 6),
        "host_hit_rate": round(result.host_hit_rate, 6),
        "combined_hit_rate": round(result.combined_hit_rate, 6),
        "one_tier_same_total_hit_rate": round(same_total.overall_hit_rate, 6),
        "best_flat_policy": best_flat[0],
        "best_flat_hit_rate": round(best_flat[1], 6),
        "ceiling_hit_rate": round(ceiling, 6),
        "device_block_hits": result.block_hits,
        "reloaded_blocks": result.host_block_hits,
        "backed_up_blocks": backed_up,
        "host_evicted_blocks": stats.host_evicted_blocks if stats is not None else 0,
        "skipped_backup_blocks": stats.skipped_backup_blocks if stats is not None else 0,
        "final_device_blocks": result.final_cache_blocks,
        "final_host_blocks": result.final_host_blocks,
        "recompute_tokens": int(result.recompute_tokens.sum()),
        "prefill_s_per_token": model.prefill_s_per_token,
        "reload_s_per_token": model.reload_s_per_token,
        "cost_s": round(model.seconds(result), 3),
        "no_cache_cost_s": round(model.no_cache_seconds(result), 3),
        "reload_s": round(reloaded_tokens * model.reload_s_per_token, 3),
        "backup_s": round(backed_up * c.block_size * model.reload_s_per_token, 3),
        "effective_tokens_saved": round(model.tokens_saved(result)),
        "replay_seconds": round(seconds, 3),
    }


def sweep_trace(name: str, trace: Trace, args: argparse.Namespace, model: TierCostModel) -> list:
    ceiling = replay(trace, "lru", max(trace.num_ids, 1)).overall_hit_rate
    one_tier: dict[tuple[str, int], tuple[ReplayResult, float]] = {}

    def one(policy: str, capacity: int) -> tuple[ReplayResult, float]:
        """The one-tier replay and its time, memoised."""
        key = (policy, capacity)
        if key not in one_tier:
            start = time.perf_counter()
            result = replay(trace, policy, capacity)
            one_tier[key] = (result, time.perf_counter() - start)
        return one_tier[key]

    rows = []
    for capacity in args.capacities:
        flats = [(p, one(p, capacity)[0].overall_hit_rate) for p in FLAT]
        best_flat = max(flats, key=lambda pr: pr[1])
        for policy in args.policies:
            for m in args.host_multipliers:
                if m == 0:
                    result, seconds = one(policy, capacity)
                else:
                    start = time.perf_counter()
                    result = replay(trace, policy, capacity, host_capacity=m * capacity)
                    seconds = time.perf_counter() - start
                same_total = one(policy, (1 + m) * capacity)[0]
                rows.append(
                    row_for(name, result, m, same_total, best_flat, ceiling, model, seconds)
                )
                r = rows[-1]
                print(
                    f"{name:<12} {policy:<10} C={capacity:>6} m={m} device "
                    f"{r['device_hit_rate']:.4f} host {r['host_hit_rate']:.4f} combined "
                    f"{r['combined_hit_rate']:.4f} (one tier at {(1 + m) * capacity}: "
                    f"{r['one_tier_same_total_hit_rate']:.4f}) {seconds:.2f} s",
                    flush=True,
                )
    add_gains(rows)
    return rows


def add_gains(rows: list[dict]) -> None:
    """Add ``host_tier_gain_tokens`` and ``breakeven_ratio`` to every row with an m = 0 twin.

    The gain is the tokens served by either tier minus what the same policy and device
    capacity serve with no host tier. Every reloaded and backed-up block is a copy of
    ``block_size`` tokens; with copies costing ``ratio`` prefill tokens each, the tier pays
    for itself while ``ratio < gain / copied tokens`` (the break-even ratio; blank when
    nothing was copied). Counting backups charges write-back's device-to-host copies as if
    they were on the request path (they are in radixkv's synchronous ``KVCopier``).
    """
    base = {
        (r["policy"], r["device_capacity"]): r["device_hit_tokens"]
        for r in rows
        if r["host_multiplier"] == 0
    }
    for r in rows:
        key = (r["policy"], r["device_capacity"])
        if key not in base:
            r["host_tier_gain_tokens"], r["breakeven_ratio"] = "", ""
            continue
        gain = r["device_hit_tokens"] + r["host_hit_tokens"] - base[key]
        copied = (r["reloaded_blocks"] + r["backed_up_blocks"]) * r["block_size"]
        r["host_tier_gain_tokens"] = gain
        r["breakeven_ratio"] = round(gain / copied, 5) if copied else ""


# ----------------------------------------------------------------------------- tables
def _short(policy: str) -> str:
    return policy.replace("radix-", "r-")


def hit_table(name: str, rows: list[dict], args: argparse.Namespace) -> str:
    """Combined (device + host) hit rate per device capacity, one column per policy x m."""
    cols = [(p, m) for p in args.policies for m in args.host_multipliers]
    head = [f"{name}: C (blocks)"] + [f"{_short(p)} m={m}" for p, m in cols]
    head += ["best flat, 1 tier", "infinite"]
    lines = ["| " + " | ".join(head) + " |", "|" + "---:|" * len(head)]
    for capacity in args.capacities:
        here = [r for r in rows if r["device_capacity"] == capacity]
        at = {(r["policy"], r["host_multiplier"]): r for r in here}
        cells = [f"{capacity:,}"] + [f"{at[c]['combined_hit_rate']:.4f}" for c in cols]
        first = at[cols[0]]
        cells += [
            f"{first['best_flat_hit_rate']:.4f} ({first['best_flat_policy']})",
            f"{first['ceiling_hit_rate']:.4f}",
        ]
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def detail_table(name: str, rows: list[dict], policy: str) -> str:
    """Per (C, m > 0) for one policy: the split, the same memory on one tier, and the cost.

    "tokens saved" is the cost model's effective prefill tokens saved; "vs m=0" the
    difference from the same policy and C without a host tier, in tokens and in prefill
    seconds; "reload s" / "backup s" the copy time of the reloaded / backed-up blocks;
    "break-even r" the reload/prefill cost ratio at which the tier stops paying (``add_gains``).
    """
    head = [
        f"{name}, {_short(policy)}: C",
        "m",
        "device hit",
        "host hit",
        "combined",
        "1 tier at (1+m)C",
        "reloaded blocks",
        "backed up blocks",
        "tokens saved (M)",
        "vs m=0 (M)",
        "reload s",
        "backup s",
        "vs m=0 (s)",
        "break-even r",
    ]
    lines = ["| " + " | ".join(head) + " |", "|" + "---:|" * len(head)]
    base = {
        r["device_capacity"]: r["effective_tokens_saved"]
        for r in rows
        if r["policy"] == policy and r["host_multiplier"] == 0
    }
    for r in rows:
        if r["policy"] != policy or r["host_multiplier"] == 0:
            continue
        saved = r["effective_tokens_saved"]
        extra = saved - base[r["device_capacity"]] if r["device_capacity"] in base else float("nan")
        lines.append(
            "| "
            + " | ".join(
                [
                    f"{r['device_capacity']:,}",
                    str(r["host_multiplier"]),
                    f"{r['device_hit_rate']:.4f}",
                    f"{r['host_hit_rate']:.4f}",
                    f"{r['combined_hit_rate']:.4f}",
                    f"{r['one_tier_same_total_hit_rate']:.4f}",
                    f"{r['reloaded_blocks']:,}",
                    f"{r['backed_up_blocks']:,}",
                    f"{saved / 1e6:.2f}",
                    f"{extra / 1e6:+.2f}",
                    f"{r['reload_s']:.1f}",
                    f"{r['backup_s']:.1f}",
                    f"{extra * r['prefill_s_per_token']:,.0f}",
                    f"{r['breakeven_ratio']:.3f}" if r["breakeven_ratio"] != "" else "-",
                ]
            )
            + " |"
        )
    return "\n".join(lines)


def main() -> int:
    args = parse_args()
    if args.out_dir is not None:
        args.out_dir.mkdir(parents=True, exist_ok=True)
    if args.measure_reload:
        return measure_reload(args.out_dir)
    model = TierCostModel.from_bandwidth(
        args.prefill_s_per_token, args.reload_gbps, args.kv_bytes_per_token
    )
    print(
        f"cost model: prefill {model.prefill_s_per_token:.3g} s/token, reload "
        f"{model.reload_s_per_token:.3g} s/token ({args.kv_bytes_per_token} B/token at "
        f"{args.reload_gbps} GB/s), ratio {model.ratio:.4g}",
        flush=True,
    )
    sections = [
        f"Cost model: prefill {model.prefill_s_per_token:.3g} s/token, reload "
        f"{model.reload_s_per_token:.3g} s/token ({args.kv_bytes_per_token:,} B/token at "
        f"{args.reload_gbps} GB/s), reload/prefill ratio {model.ratio:.4g}.",
    ]
    start = time.perf_counter()
    for name in args.traces:
        path = TRACES / f"{name}_trace.jsonl"
        trace = load_trace(path)
        rows = sweep_trace(name, trace, args, model)
        if args.out_dir is not None:
            write_csv(rows, args.out_dir / f"replay_host_{name}.csv")
        sections.append(f"### {name}: combined hit rate\n\n{hit_table(name, rows, args)}")
        for policy in args.policies:
            if any(m > 0 for m in args.host_multipliers):
                sections.append(
                    f"### {name}, {policy}: split and cost\n\n{detail_table(name, rows, policy)}"
                )
    elapsed = time.perf_counter() - start
    sections.append(f"Sweep time: {elapsed:.0f} s.")
    text = "\n\n".join(sections) + "\n"
    print(text)
    if args.out_dir is not None:
        out = args.out_dir / "replay_host_tables.md"
        out.write_text(text)
        print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
