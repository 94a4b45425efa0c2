"""``radixkv demo``: a few chat-like requests through the radix cache (tree only, no model)."""

from __future__ import annotations

import argparse

import numpy as np

from radixkv.allocator import BlockAllocator
from radixkv.radix import RadixCache


def run_demo(args: argparse.Namespace) -> int:
    rng = np.random.default_rng(args.seed)
    alloc = BlockAllocator(num_blocks=args.num_blocks, block_size=args.block_size)
    cache = RadixCache(alloc)
    system = rng.integers(0, 32000, size=64).tolist()
    histories = [list(system) for _ in range(3)]
    print(f"{'request':>8} {'prompt':>7} {'hit':>5}")
    for turn in range(3):
        for user, history in enumerate(histories):
            history.extend(rng.integers(0, 32000, size=int(rng.integers(10, 30))).tolist())
            m = cache.match(history[:-1])
            need = -(-len(history) // args.block_size) - len(m.blocks)
            if need > alloc.num_free:
                cache.evict(need - alloc.num_free)
            blocks = m.blocks + alloc.alloc(need)
            print(f"{f'u{user}t{turn}':>8} {len(history):>7} {m.num_tokens:>5}")
            cache.insert(history, blocks)
            alloc.decref(blocks)
    print(cache.pretty())
    stats = cache.stats
    print(f"hit rate {stats.hit_rate:.3f} ({stats.hit_tokens}/{stats.query_tokens} tokens)")
    return 0


def register(subparsers: argparse._SubParsersAction) -> None:
    p = subparsers.add_parser("demo", help="chat-like requests through the radix cache")
    p.add_argument("--block-size", type=int, default=16)
    p.add_argument("--num-blocks", type=int, default=256)
    p.add_argument("--seed", type=int, default=0)
    p.set_defaults(func=run_demo)
