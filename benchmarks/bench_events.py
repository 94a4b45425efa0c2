"""What KV cache events cost: chain hashing, and the caches' insert with events off vs on.

Rows:

- ``hash``: ``ChainHasher.hashes`` over a 1,024-token prompt at ``--block-size``, per
  recipe (``xxhash``, ``sha256_cbor``), µs per prompt.
- ``insert``: inserting every prompt of a chat-like mix (8 shared system prompts of
  64-1,024 tokens plus 64-512 unique tokens, ``--requests`` of them) into an empty
  cache with enough blocks, µs per request, per cache and events setting; the events
  are taken (``take_events``) after each insert, as a publisher would. The baseline,
  measured in the same run, is the same cache with events off; ``x off`` is the ratio.

Medians of ``--repeats`` runs on fresh caches.

    python benchmarks/bench_events.py                 # ~30 s
    python benchmarks/bench_events.py --out benchmarks/results/bench_events.csv
"""

from __future__ import annotations

import argparse
import statistics
import time
from pathlib import Path

import numpy as np
from bench_common import save_rows

from radixkv import BlockAllocator, HashBlockCache, RadixCache
from radixkv.cache.hashing import ChainHasher


def workload(num_requests: int, rng: np.random.Generator) -> list[np.ndarray]:
    systems = [
        rng.integers(0, 32000, n, dtype=np.int32) for n in (64, 128, 256, 384, 512, 640, 768, 1024)
    ]
    return [
        np.concatenate(
            [
                systems[rng.integers(len(systems))],
                rng.integers(0, 32000, rng.integers(64, 513), dtype=np.int32),
            ]
        )
        for _ in range(num_requests)
    ]


def time_inserts(
    kind: str, hasher: ChainHasher | None, prompts: list[np.ndarray], bs: int
) -> float:
    """µs per request to insert every prompt (and take the events) into a fresh cache."""
    alloc = BlockAllocator(sum(len(p) // bs for p in prompts) + 1, bs)
    cache = (
        RadixCache(alloc, eviction="lru", events=hasher)
        if kind == "radix"
        else HashBlockCache(alloc, hash_seed=0, events=hasher)
    )
    tables = [alloc.alloc_array(len(p) // bs) for p in prompts]
    insert, take = cache.insert, cache.take_events
    t0 = time.perf_counter()
    for p, t in zip(prompts, tables, strict=True):
        insert(p, t)
        take()
    return (time.perf_counter() - t0) / len(prompts) * 1e6


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--block-size", type=int, default=16)
    ap.add_argument("--requests", type=int, default=2000)
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--out", type=Path, default=None, help="also write the table as CSV here")
    args = ap.parse_args()
    bs, rng = args.block_size, np.random.default_rng(0)
    prompts = workload(args.requests, rng)
    rows: list[dict] = []

    tokens = rng.integers(0, 32000, 1024, dtype=np.int32)
    for name in ("xxhash", "sha256_cbor"):
        h = ChainHasher(name, seed=0)
        h.hashes(h.root, tokens, bs)
        times = []
        for _ in range(args.repeats):
            t0 = time.perf_counter()
            for _ in range(20):
                h.hashes(h.root, tokens, bs)
            times.append((time.perf_counter() - t0) / 20 * 1e6)
        rows.append(
            {
                "row": "hash",
                "cache": "-",
                "events": name,
                "us": round(statistics.median(times), 2),
                "x_off": "",
            }
        )

    for kind in ("radix", "hash"):
        base = None
        for name in (None, "xxhash", "sha256_cbor"):
            hasher = None if name is None else ChainHasher(name, seed=0)
            us = statistics.median(
                time_inserts(kind, hasher, prompts, bs) for _ in range(args.repeats)
            )
            base = us if name is None else base
            rows.append(
                {
                    "row": "insert",
                    "cache": kind,
                    "events": name or "off",
                    "us": round(us, 2),
                    "x_off": round(us / base, 2),
                }
            )

    print(f"{'row':7} {'cache':6} {'events':12} {'us':>9} {'x off':>6}")
    for r in rows:
        print(f"{r['row']:7} {r['cache']:6} {r['events']:12} {r['us']:9.2f} {r['x_off']!s:>6}")
    save_rows(rows, args.out, "bench_events.csv")


if __name__ == "__main__":
    main()
