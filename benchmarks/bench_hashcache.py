"""HashBlockCache hot paths per block, beside RadixCache (same run) and vLLM's reference figures.

Paths, each timed per KV block at ``--block-size`` (16, vLLM's default) on
prompts of ``--prompt-len`` tokens:

- ``hit``: ``match`` of a fully cached prompt (hashing every block, lookups,
  touching the queue, one incref per block) plus the request's ``decref``.
- ``miss``: a prompt no one has seen: ``match`` (one miss), ``evict`` to make
  room (the pool is kept full of cached blocks, as in steady state),
  ``alloc``, ``insert`` (hash + adopt every block) and ``decref``: vLLM's
  "allocate + cache + free".
- ``hash``: naming the blocks alone (``BlockHasher.chain``), as tokens/s.

RadixCache runs the same hit and miss paths in the same process and is
reported as the baseline ratio (radix time / hash time: > 1 means the hash
cache is faster). vLLM 0.33's BlockPool reference (measured by its authors,
not here): ~0.62 us/block hit, ~1.5 us/block miss, sha256 ~11M tokens/s.

    python benchmarks/bench_hashcache.py            # ~1 minute
    python benchmarks/bench_hashcache.py --quick    # a few seconds
    python benchmarks/bench_hashcache.py --out benchmarks/results/bench_hashcache.csv
"""

from __future__ import annotations

import argparse
import statistics
import time
from collections.abc import Callable
from pathlib import Path

import numpy as np
from bench_common import save_rows

from radixkv import BlockAllocator
from radixkv.cache.hashcache import HashBlockCache
from radixkv.cache.hashing import BlockHasher
from radixkv.cache.prefix_cache import PrefixCache
from radixkv.cache.radix import RadixCache

VLLM_REFERENCE = {"hit": 0.62, "miss": 1.5, "sha256": 11e6}  # us/block, us/block, tokens/s


def make_cache(kind: str, alloc: BlockAllocator) -> PrefixCache:
    if kind == "radix":
        return RadixCache(alloc, eviction="level")
    return HashBlockCache(alloc, hash_fn=kind.split("-", 1)[1], hash_seed=0)


def time_hit(kind: str, prompts: list[np.ndarray], block_size: int) -> float:
    """Seconds per block to match a fully cached prompt and release it."""
    n_blocks = sum(len(p) // block_size for p in prompts)
    alloc = BlockAllocator(num_blocks=n_blocks + 1, block_size=block_size)
    cache = make_cache(kind, alloc)
    for p in prompts:
        blocks = alloc.alloc_array(len(p) // block_size)
        cache.insert(p, blocks)
        alloc.decref_distinct(blocks)
    match, decref = cache.match, alloc.decref_distinct
    t0 = time.perf_counter()
    for p in prompts:
        decref(match(p).block_array)
    dt = time.perf_counter() - t0
    assert cache.stats.hit_tokens == n_blocks * block_size
    return dt / n_blocks


def time_miss(kind: str, prompts: list[np.ndarray], block_size: int) -> float:
    """Seconds per block for a new prompt: miss, evict, alloc, insert, free."""
    per = len(prompts[0]) // block_size
    alloc = BlockAllocator(num_blocks=4 * per, block_size=block_size)
    cache = make_cache(kind, alloc)
    rng = np.random.default_rng(1)
    for _ in range(4):  # fill the pool with cached blocks: steady state
        p = rng.integers(0, 32000, len(prompts[0]), dtype=np.int32)
        blocks = alloc.alloc_array(per)
        cache.insert(p, blocks)
        alloc.decref_distinct(blocks)
    match, insert, evict = cache.match, cache.insert, cache.evict
    alloc_array, decref = alloc.alloc_array, alloc.decref_distinct
    t0 = time.perf_counter()
    for p in prompts:
        m = match(p)
        need = len(p) // block_size - len(m.block_array)
        if need > alloc.num_free:
            evict(need - alloc.num_free)
        blocks = alloc_array(need)
        insert(p, blocks)
        decref(blocks)
    dt = time.perf_counter() - t0
    assert cache.stats.hit_tokens == 0
    return dt / (per * len(prompts))


def time_hash(hash_fn: str, data: bytes, block_size: int) -> float:
    """Tokens per second naming the blocks of ``data``."""
    hasher = BlockHasher(hash_fn, hash_seed=0)
    t0 = time.perf_counter()
    hasher.chain(data, block_size * 4)
    return len(data) // 4 / (time.perf_counter() - t0)


def repeat(fn: Callable[[], float], repeats: int) -> tuple[float, float, float]:
    fn()  # warm-up
    xs = [fn() for _ in range(repeats)]
    return statistics.median(xs), min(xs), max(xs)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="fewer prompts and repeats")
    ap.add_argument("--block-size", type=int, default=16)
    ap.add_argument("--prompt-len", type=int, default=2048)
    ap.add_argument("--prompts", type=int, default=200)
    ap.add_argument("--repeats", type=int, default=7)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--out", type=Path, default=None, help="also write the table as CSV here")
    args = ap.parse_args()
    if args.quick:
        args.prompts, args.repeats = 30, 3
    bs = args.block_size
    rng = np.random.default_rng(args.seed)
    prompts = [rng.integers(0, 32000, args.prompt_len, dtype=np.int32) for _ in range(args.prompts)]
    kinds = ["radix", "hash-sha256", "hash-xxhash", "hash-builtin"]
    rows = []
    for path, timer in (("hit", time_hit), ("miss", time_miss)):
        base = None
        for kind in kinds:
            med, lo, hi = repeat(lambda k=kind, t=timer: t(k, prompts, bs), args.repeats)
            base = med if kind == "radix" else base
            rows.append(
                {
                    "path": path,
                    "cache": kind,
                    "unit": "us/block",
                    "median": med * 1e6,
                    "min": lo * 1e6,
                    "max": hi * 1e6,
                    "radix_over_this": base / med,
                    "vllm_0.33_reference": VLLM_REFERENCE[path],
                }
            )
    data = np.concatenate(prompts).tobytes()
    for hash_fn in ("sha256", "xxhash", "builtin"):
        med, lo, hi = repeat(lambda h=hash_fn: time_hash(h, data, bs), args.repeats)
        rows.append(
            {
                "path": "hash",
                "cache": hash_fn,
                "unit": "Mtokens/s",
                "median": med / 1e6,
                "min": lo / 1e6,
                "max": hi / 1e6,
                "radix_over_this": float("nan"),
                "vllm_0.33_reference": VLLM_REFERENCE["sha256"] / 1e6
                if hash_fn == "sha256"
                else "",
            }
        )
    print(
        f"block_size={bs} prompt_len={args.prompt_len} prompts={args.prompts} "
        f"repeats={args.repeats} (median [min, max])"
    )
    print(
        f"{'path':6} {'cache':13} {'median':>9} {'min':>9} {'max':>9}  unit       "
        f"{'radix/this':>10}  vLLM ref"
    )
    for r in rows:
        ratio = "" if r["path"] == "hash" else f"{r['radix_over_this']:10.2f}"
        print(
            f"{r['path']:6} {r['cache']:13} {r['median']:9.3f} {r['min']:9.3f} {r['max']:9.3f}"
            f"  {r['unit']:10} {ratio:>10}  {r['vllm_0.33_reference']}"
        )
    save_rows(rows, args.out, "bench_hashcache_quick.csv" if args.quick else "bench_hashcache.csv")


if __name__ == "__main__":
    main()
