"""The pool-pressure path: what a scheduler pays to make room, against the tree's size.

A request of ``--need`` new blocks arrives while the pool is full of cached
blocks (every block is in the radix tree; nothing is free), so each admission
evicts; when it finishes its blocks enter the cache, so the pool stays full.
Two ways to do it, timed in the same run on the same trees:

- ``count+evict`` (the baseline; what the scheduler did before the KV manager):
  read ``cache.evictable_blocks`` (a walk of the whole tree) before each
  ``evict``, allocate, insert, release;
- ``manager``: ``KVCacheManager.allocate_slots`` evicts exactly the shortfall,
  then ``free`` caches and releases: no whole-tree count on the path.

Trees have ``leaves`` leaves of 2 blocks under 64 shared 4-block prefixes
(block size 16). Per size: median over ``--repeats`` fresh trees of the mean
time per admission over ``--ops`` admissions. The manager's cost should stay
flat as the tree grows; the baseline's grows with it.

    python benchmarks/bench_pressure.py            # ~1 minute
    python benchmarks/bench_pressure.py --quick    # a few seconds
    python benchmarks/bench_pressure.py --out benchmarks/results/pressure.csv
"""

from __future__ import annotations

import argparse
import statistics
import time
from pathlib import Path

import numpy as np
from bench_common import save_rows

from radixkv import BlockAllocator, RadixCache
from radixkv.cache.manager import KVCacheManager

BLOCK = 16
PREFIXES = 64


def build_tree(num_leaves: int, seed: int) -> RadixCache:
    """A full pool: 64 prefixes of 4 blocks, ``num_leaves`` leaves of 2 blocks under them."""
    num_blocks = PREFIXES * 4 + num_leaves * 2
    alloc = BlockAllocator(num_blocks, BLOCK)
    cache = RadixCache(alloc, eviction="lru")
    rng = np.random.default_rng(seed)
    prefixes = [rng.integers(0, 32000, 4 * BLOCK, dtype=np.int32) for _ in range(PREFIXES)]
    for i in range(num_leaves):
        tail = rng.integers(0, 32000, 2 * BLOCK, dtype=np.int32)
        tokens = np.concatenate([prefixes[i % PREFIXES], tail])
        m = cache.match(tokens)
        blocks = np.concatenate([m.block_array, alloc.alloc_array(6 - len(m.block_array))])
        cache.insert(tokens, blocks)
        alloc.decref_distinct(blocks)
    assert alloc.num_free == 0
    return cache


def requests(ops: int, need: int) -> list[np.ndarray]:
    """Prompts of ``need`` full blocks plus one token, sharing nothing with the tree."""
    rng = np.random.default_rng(1)
    return [rng.integers(40000, 50000, need * BLOCK + 1, dtype=np.int32) for _ in range(ops)]


def run_baseline(cache: RadixCache, prompts: list[np.ndarray]) -> float:
    """Seconds per admission: count evictable blocks, evict the shortfall, alloc, cache, release."""
    alloc = cache.allocator
    t0 = time.perf_counter()
    for tokens in prompts:
        need = len(tokens) // BLOCK
        if alloc.num_free < need and cache.evictable_blocks > 0:
            cache.evict(need - alloc.num_free)
        blocks = alloc.alloc(need)
        cache.insert(tokens, blocks)
        alloc.decref(blocks)
    return (time.perf_counter() - t0) / len(prompts)


def run_manager(cache: RadixCache, prompts: list[np.ndarray]) -> float:
    """Seconds per admission through the KV manager: match, allocate (evicting), cache, free."""
    kv = KVCacheManager(cache)
    t0 = time.perf_counter()
    for i, tokens in enumerate(prompts):
        kv.match_prefix(i, tokens)
        if not kv.allocate_slots(i, len(tokens) - 1):
            raise RuntimeError("the pool could not make room")
        kv.cache_blocks(i, len(tokens) - 1)  # the prompt's full blocks ran
        kv.free(i)
    return (time.perf_counter() - t0) / len(prompts)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="small trees, few repeats")
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--ops", type=int, default=200, help="admissions timed per tree")
    parser.add_argument("--need", type=int, default=4, help="blocks per admission")
    parser.add_argument("--out", type=Path, help="write the table as CSV here")
    args = parser.parse_args()
    sizes = [1_000, 5_000] if args.quick else [1_000, 5_000, 20_000, 80_000]
    repeats = 2 if args.quick else args.repeats

    rows = []
    print(f"{'leaves':>8} {'nodes':>8} {'count+evict µs':>15} {'manager µs':>11} {'ratio':>7}")
    for size in sizes:
        times: dict[str, list[float]] = {"baseline": [], "manager": []}
        prompts = requests(args.ops, args.need)
        for r in range(repeats):
            for name, run in (("baseline", run_baseline), ("manager", run_manager)):
                cache = build_tree(size, seed=r)
                times[name].append(run(cache, prompts))
                assert cache.allocator.num_free < args.need, "the pool was not under pressure"
                cache.check()
        base = statistics.median(times["baseline"]) * 1e6
        mgr = statistics.median(times["manager"]) * 1e6
        nodes = size + PREFIXES
        print(f"{size:>8} {nodes:>8} {base:>15.1f} {mgr:>11.1f} {base / mgr:>6.1f}x")
        rows.append(
            {
                "leaves": size,
                "nodes": nodes,
                "baseline_us": round(base, 2),
                "manager_us": round(mgr, 2),
                "ratio": round(base / mgr, 2),
                "baseline_spread_us": round(
                    (max(times["baseline"]) - min(times["baseline"])) * 1e6, 2
                ),
                "manager_spread_us": round(
                    (max(times["manager"]) - min(times["manager"])) * 1e6, 2
                ),
            }
        )
    save_rows(rows, args.out, "pressure.csv")


if __name__ == "__main__":
    main()
