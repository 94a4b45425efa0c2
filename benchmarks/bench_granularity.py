"""Radix vs hash-map granularity: reuse, lookup/insert time and metadata memory per block size.

For each workload (``granularity_workloads.py``) and block size, the same
requests go through RadixCache and HashBlockCache (sha256, vLLM's default)
over their own allocator, sized so nothing is ever evicted. The serving loop
per request: ``match(prompt)``, allocate the uncached blocks, ``insert``,
``decref``. Measured:

- hit tokens as a fraction of the ideal (token-level reuse with an infinite
  cache: each prompt's longest common prefix with any earlier prompt, computed
  by brute force independently of both caches);
- lookup and insert time per request (mean over the workload; median and
  min/max over ``--repeats`` passes);
- metadata bytes per cached token (tracemalloc, in a separate untimed pass:
  every Python/numpy allocation the cache makes; the allocator is excluded);
- a micro-benchmark of one request's time against prompt length (hit and miss).

Both structures run in the same process on the same requests; the radix
tree is the baseline the hash map is compared with (docs/granularity.md).

    python benchmarks/bench_granularity.py --img docs/img   # full, ~8 min: tables + doc plots
    python benchmarks/bench_granularity.py --quick          # 1/4 size, one pass, ~1 min
    python benchmarks/bench_granularity.py --out benchmarks/results/granularity.csv --img docs/img

``--out X.csv`` writes the study to ``X.csv`` and the length sweep to
``X_length.csv``; without it nothing is written but the plots ``--img`` asks for.
"""

from __future__ import annotations

import argparse
import statistics
import time
import tracemalloc
from pathlib import Path

import numpy as np
from bench_common import save_rows
from granularity_workloads import WORKLOADS, ideal_hit_tokens

from radixkv import BlockAllocator
from radixkv.cache.hashcache import HashBlockCache
from radixkv.cache.prefix_cache import PrefixCache
from radixkv.cache.radix import RadixCache

CACHES = ("radix", "hash")


def make_cache(kind: str, alloc: BlockAllocator, hash_fn: str = "sha256") -> PrefixCache:
    if kind == "radix":
        return RadixCache(alloc, eviction="level")
    return HashBlockCache(alloc, hash_fn=hash_fn, hash_seed=0)


def replay(kind: str, prompts: list[np.ndarray], bs: int, trace_memory: bool = False) -> dict:
    """Serve every prompt once with no eviction; per-request hits and times, total memory."""
    alloc = BlockAllocator(num_blocks=sum(len(p) // bs for p in prompts) + 1, block_size=bs)
    cache = make_cache(kind, alloc)
    n = len(prompts)
    hits = np.zeros(n, dtype=np.int64)
    t_lookup = np.zeros(n)
    t_insert = np.zeros(n)
    clock = time.perf_counter
    match, insert = cache.match, cache.insert
    alloc_array, decref = alloc.alloc_array, alloc.decref_distinct
    if trace_memory:
        tracemalloc.start()
        mem0 = tracemalloc.get_traced_memory()[0]
    for i, p in enumerate(prompts):
        t0 = clock()
        m = match(p)
        t1 = clock()
        blocks = np.concatenate([m.block_array, alloc_array(len(p) // bs - len(m.block_array))])
        t2 = clock()
        insert(p, blocks)
        t3 = clock()
        decref(blocks)
        hits[i] = m.num_tokens
        t_lookup[i] = t1 - t0
        t_insert[i] = t3 - t2
    del m, blocks
    memory = 0
    if trace_memory:
        memory = tracemalloc.get_traced_memory()[0] - mem0
        tracemalloc.stop()
    cache.check()
    return {
        "hits": hits,
        "lookup": t_lookup,
        "insert": t_insert,
        "memory": memory,
        "cached_tokens": cache.cached_blocks * bs,
    }


def study(args: argparse.Namespace) -> list[dict]:
    rows = []
    for wname in args.workloads:
        prompts = WORKLOADS[wname](args.seed, args.scale)
        ideal = ideal_hit_tokens(prompts)
        query = int(sum(len(p) for p in prompts))
        print(
            f"{wname}: {len(prompts)} requests, {query} tokens, ideal reuse "
            f"{ideal.sum() / query:.3f} of query tokens",
            flush=True,
        )
        for bs in args.block_sizes:
            for kind in CACHES:
                passes = [replay(kind, prompts, bs) for _ in range(args.repeats)]
                mem = replay(kind, prompts, bs, trace_memory=True)
                hits = passes[0]["hits"]
                assert all((p["hits"] == hits).all() for p in passes)
                assert (mem["hits"] == hits).all()
                if bs == 1:  # token-level caches must reach the brute-force ideal exactly
                    assert (hits == ideal).all(), (wname, kind)
                lookups = [p["lookup"].mean() * 1e6 for p in passes]
                inserts = [p["insert"].mean() * 1e6 for p in passes]
                rows.append(
                    {
                        "workload": wname,
                        "block_size": bs,
                        "cache": kind,
                        "requests": len(prompts),
                        "query_tokens": query,
                        "ideal_tokens": int(ideal.sum()),
                        "hit_tokens": int(hits.sum()),
                        "frac_of_ideal": hits.sum() / max(1, ideal.sum()),
                        "lookup_us": statistics.median(lookups),
                        "lookup_us_min": min(lookups),
                        "lookup_us_max": max(lookups),
                        "insert_us": statistics.median(inserts),
                        "insert_us_min": min(inserts),
                        "insert_us_max": max(inserts),
                        "cached_tokens": mem["cached_tokens"],
                        "bytes_per_cached_token": mem["memory"] / max(1, mem["cached_tokens"]),
                    }
                )
            r, h = rows[-2], rows[-1]
            assert r["hit_tokens"] == h["hit_tokens"], (wname, bs)  # the differential check
            print(
                f"  bs={bs:<4} reuse {r['frac_of_ideal']:.3f} of ideal | lookup us/req "
                f"radix {r['lookup_us']:9.1f} hash {h['lookup_us']:9.1f} | insert us/req "
                f"radix {r['insert_us']:9.1f} hash {h['insert_us']:9.1f} | B/token "
                f"radix {r['bytes_per_cached_token']:7.1f} hash {h['bytes_per_cached_token']:7.1f}",
                flush=True,
            )
    return rows


def length_sweep(args: argparse.Namespace) -> list[dict]:
    """One request's time against prompt length: hit (fully cached) and miss (new prompt)."""
    rows = []
    rng = np.random.default_rng([args.seed, 99])
    for length in args.lengths:
        prompts = [rng.integers(0, 32000, length, dtype=np.int32) for _ in range(args.sweep_n)]
        for bs in (1, 16):
            for kind in ("radix", "hash-sha256", "hash-xxhash"):
                hit_t, miss_t = [], []
                for _ in range(args.repeats + 1):  # the first pass is a warm-up
                    alloc = BlockAllocator(2 * args.sweep_n * (length // bs) + 1, bs)
                    cache = make_cache(kind.split("-")[0], alloc, kind.split("-")[-1])
                    t0 = time.perf_counter()
                    for p in prompts:  # misses: match, alloc, insert, free
                        alloc.decref_distinct(cache.match(p).block_array)
                        blocks = alloc.alloc_array(length // bs)
                        cache.insert(p, blocks)
                        alloc.decref_distinct(blocks)
                    t1 = time.perf_counter()
                    for p in prompts:  # hits
                        alloc.decref_distinct(cache.match(p).block_array)
                    t2 = time.perf_counter()
                    miss_t.append((t1 - t0) / len(prompts) * 1e6)
                    hit_t.append((t2 - t1) / len(prompts) * 1e6)
                rows.append(
                    {
                        "prompt_len": length,
                        "block_size": bs,
                        "cache": kind,
                        "hit_us": statistics.median(hit_t[1:]),
                        "miss_us": statistics.median(miss_t[1:]),
                    }
                )
        print(
            f"  len={length:<6} "
            + " ".join(
                f"{r['cache']}/bs{r['block_size']}: hit {r['hit_us']:.0f} miss {r['miss_us']:.0f}"
                for r in rows[-6:]
            ),
            flush=True,
        )
    return rows


def plot(rows: list[dict], sweep: list[dict], img: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    img.mkdir(parents=True, exist_ok=True)
    workloads = list(dict.fromkeys(r["workload"] for r in rows))
    sizes = sorted({r["block_size"] for r in rows})
    style = {"radix": dict(marker="o", ls="-"), "hash": dict(marker="x", ls="--")}

    def series(w: str, kind: str, key: str) -> list[float]:
        by = {r["block_size"]: r[key] for r in rows if r["workload"] == w and r["cache"] == kind}
        return [by[b] for b in sizes]

    fig, ax = plt.subplots(figsize=(7, 4.5))
    for w in workloads:
        (line,) = ax.plot(sizes, series(w, "radix", "frac_of_ideal"), label=w, **style["radix"])
        ax.plot(sizes, series(w, "hash", "frac_of_ideal"), color=line.get_color(), **style["hash"])
    ax.set(
        xscale="log", xlabel="block size (tokens)", ylabel="hit tokens / ideal token-level reuse"
    )
    ax.set_xticks(sizes, [str(b) for b in sizes])
    ax.set_ylim(min(0.5, min(r["frac_of_ideal"] for r in rows) - 0.05), 1.02)
    ax.set_title("Reuse vs block size (radix o-, hash x--: identical with no eviction)")
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(img / "granularity_reuse.png", dpi=110)

    for key, name, label in (
        ("bytes_per_cached_token", "granularity_memory.png", "metadata bytes per cached token"),
        ("request_us", "granularity_request_time.png", "lookup + insert, us per request"),
    ):
        fig, ax = plt.subplots(figsize=(7, 4.5))
        for w in workloads:
            color = None
            for kind in CACHES:
                if key == "request_us":
                    ys = [
                        a + b
                        for a, b in zip(
                            series(w, kind, "lookup_us"), series(w, kind, "insert_us"), strict=True
                        )
                    ]
                else:
                    ys = series(w, kind, key)
                (line,) = ax.plot(sizes, ys, color=color, label=f"{w} {kind}", **style[kind])
                color = line.get_color()
        ax.set(xscale="log", yscale="log", xlabel="block size (tokens)", ylabel=label)
        ax.set_xticks(sizes, [str(b) for b in sizes])
        ax.set_title(f"{label}: radix (o-) vs hash sha256 (x--)")
        ax.legend(fontsize=6, ncol=2)
        fig.tight_layout()
        fig.savefig(img / name, dpi=110)

    fig, axes = plt.subplots(1, 2, figsize=(10, 4.2), sharey=True)
    for ax, key, title in zip(
        axes, ("hit_us", "miss_us"), ("hit (fully cached)", "miss"), strict=True
    ):
        for kind in ("radix", "hash-sha256", "hash-xxhash"):
            for bs, ls in ((1, ":"), (16, "-")):
                pts = [
                    (r["prompt_len"], r[key])
                    for r in sweep
                    if r["cache"] == kind and r["block_size"] == bs
                ]
                ax.plot(*zip(*pts, strict=True), ls=ls, marker="o", label=f"{kind} bs={bs}")
        ax.set(xscale="log", yscale="log", xlabel="prompt length (tokens)", title=title)
    axes[0].set_ylabel("us per request")
    axes[1].legend(fontsize=8)
    fig.suptitle("One request's cache time vs prompt length")
    fig.tight_layout()
    fig.savefig(img / "granularity_time.png", dpi=110)
    plt.close("all")
    print(f"wrote plots under {img}")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="quarter-size workloads, one pass")
    ap.add_argument("--workloads", nargs="+", default=list(WORKLOADS), choices=list(WORKLOADS))
    ap.add_argument("--block-sizes", nargs="+", type=int, default=[1, 4, 16, 64, 256])
    ap.add_argument("--scale", type=float, default=1.0, help="workload size multiplier")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--lengths", nargs="+", type=int, default=[256, 1024, 4096, 16384, 65536])
    ap.add_argument("--sweep-n", type=int, default=20, help="prompts per length in the sweep")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument(
        "--out", type=Path, default=None, help="write the study CSV here (and <stem>_length.csv)"
    )
    ap.add_argument("--img", type=Path, default=None, help="write PNG plots here (docs/img)")
    args = ap.parse_args()
    if args.quick:
        args.scale, args.repeats, args.lengths, args.sweep_n = 0.25, 1, [256, 2048, 16384], 5
    stem = "granularity_quick" if args.quick else "granularity"
    rows = study(args)
    save_rows(rows, args.out, f"{stem}.csv")
    print("length sweep (us per request):", flush=True)
    sweep = length_sweep(args)
    save_rows(
        sweep, args.out and args.out.with_name(f"{args.out.stem}_length.csv"), f"{stem}_length.csv"
    )
    if args.img is not None:
        plot(rows, sweep, args.img)


if __name__ == "__main__":
    main()
