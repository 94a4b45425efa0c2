"""Radix tree hot paths: match, insert, evict, metadata memory; against a naive per-token trie.

Workloads (seeded):
  chat  100 conversations x 10 turns over 4 shared 1,000-token system prompts, each turn
        adding 150-250 tokens (vocabulary 32,000), requests interleaved at random while
        each conversation keeps its turn order. Insert builds the tree from empty; match
        runs the same requests on the built tree.
  long  100 prompts of 32k tokens sharing a 16k prefix.
  evict fill a cache with chat requests up to N tokens, then evict it in steps of 1% of
        its size; microseconds per freed block at several N (flat = O(log n) per leaf).

Timings are medians over --repeats runs of the whole workload, reported per request
(us/req) and as tokens/s; the naive trie is measured in the same run (ratio = naive /
radixkv). Each of insert and match runs for every input kind users pass (``INPUTS``:
int32 arrays, int64 token arrays, Python lists, CPU torch tensors), beside two same-run
baselines: ``conversion`` (one np.fromiter of each request's list: what a list must
cost at least once) and, for match, ``floor`` (read the query once, take one reference
per matched block). The note column gives a list row against int32 + conversion and the
int32 match against its floor.

    python benchmarks/bench_tree.py            # full run (several minutes)
    python benchmarks/bench_tree.py --quick    # smaller, for a smoke check
    python benchmarks/bench_tree.py --out benchmarks/results/bench_tree.csv   # record the run
"""

from __future__ import annotations

import argparse
import gc
import statistics
import sys
import time
import tracemalloc
from collections.abc import Callable
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).parent))
from bench_common import save_rows  # noqa: E402
from naive_trie import NaiveTrie  # noqa: E402

from radixkv import BlockAllocator, RadixCache  # noqa: E402


def chat_workload(
    rng: np.random.Generator, n_conv: int, n_turns: int, sys_len: int = 1000, vocab: int = 32000
) -> list[tuple[int, np.ndarray]]:
    """(conversation id, prompt tokens) in arrival order."""
    systems = [rng.integers(0, vocab, sys_len, dtype=np.int32) for _ in range(4)]
    convs = []
    for c in range(n_conv):
        turns = [
            rng.integers(0, vocab, int(rng.integers(150, 251)), dtype=np.int32)
            for _ in range(n_turns)
        ]
        convs.append(np.concatenate([systems[c % 4], *turns]))
        convs[-1] = (convs[-1], np.cumsum([sys_len] + [len(t) for t in turns])[1:])
    order = np.repeat(np.arange(n_conv), n_turns)
    rng.shuffle(order)
    next_turn = [0] * n_conv
    out = []
    for c in order:
        tokens, ends = convs[c]
        out.append((int(c), tokens[: ends[next_turn[c]]]))
        next_turn[c] += 1
    return out


def long_workload(rng: np.random.Generator, n: int, length: int, shared: int):
    prefix = rng.integers(0, 32000, shared, dtype=np.int32)
    return [
        (i, np.concatenate([prefix, rng.integers(0, 32000, length - shared, dtype=np.int32)]))
        for i in range(n)
    ]


def block_tables(requests, bs: int) -> tuple[list[np.ndarray], int]:
    """Give every distinct full block of tokens (by its whole prefix) one block id."""
    ids: dict[tuple[int, bytes], int] = {}  # (parent block id, this block's tokens) -> id
    tables = []
    for _, tokens in requests:
        n = len(tokens) // bs
        table = np.empty(n, dtype=np.int32)
        data = tokens.tobytes()
        parent = -1
        for i in range(n):
            key = (parent, data[i * bs * 4 : (i + 1) * bs * 4])
            parent = table[i] = ids.setdefault(key, len(ids))
        tables.append(table)
    return tables, len(ids)


def median_time(fn: Callable[[], object], repeats: int) -> tuple[float, float]:
    times = []
    for _ in range(repeats):
        gc.collect()
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(times), (max(times) - min(times))


INPUTS = ("int32", "int64", "list", "tensor")


def as_input(kind: str, tokens: np.ndarray, table: np.ndarray) -> tuple[object, object]:
    """One request's tokens and block table in the form a caller of ``kind`` passes:
    int32 arrays; int64 tokens (torch's and numpy's default) with an int32 table; Python
    lists of both (what ``alloc.alloc()`` returns); CPU torch int64 tensors of both."""
    if kind == "int32":
        return tokens, table
    if kind == "int64":
        return tokens.astype(np.int64), table
    if kind == "list":
        return tokens.tolist(), table.tolist()
    import torch

    return torch.from_numpy(tokens.astype(np.int64)), torch.from_numpy(table.astype(np.int64))


def _timed(fn: Callable[[], float], repeats: int) -> tuple[float, float]:
    """Median and spread of ``fn()``'s own measurement over ``repeats`` calls."""
    times = []
    for _ in range(repeats):
        gc.collect()
        times.append(fn())
    return statistics.median(times), max(times) - min(times)


def bench_match_insert(
    name: str, requests, bs: int, repeats: int, naive: bool, inputs: tuple[str, ...] = INPUTS
) -> list[dict]:
    """insert (empty tree, every request) and match (full tree, every request: all hits)
    for each input kind, plus three same-run baselines: ``conversion`` (one
    ``np.fromiter`` of the request's token list, and for insert its block list: what
    an array-based path must pay once for list input), ``floor`` (match's unavoidable
    work: read the query once, take one reference per matched block) and the naive
    per-token trie (lists)."""
    tables, n_ids = block_tables(requests, bs)
    n_req = len(requests)
    n_tok = sum(len(t) for _, t in requests)

    def build() -> RadixCache:
        alloc = BlockAllocator(num_blocks=max(n_ids, 1), block_size=bs)
        alloc.alloc_array(n_ids)  # every block id is "written" by its request
        return RadixCache(alloc)

    full = build()
    for (_, tokens), table in zip(requests, tables):
        full.insert(tokens, table)
    alloc = full.allocator
    measured: dict[tuple[str, str], tuple[float, float]] = {}
    for kind in inputs:
        if kind == "tensor":
            try:
                import torch  # noqa: F401
            except ImportError:
                continue
        pairs = [as_input(kind, t, tb) for (_, t), tb in zip(requests, tables)]

        def do_insert(pairs=pairs) -> float:
            insert = build().insert
            t0 = time.perf_counter()
            for tokens, table in pairs:
                insert(tokens, table)
            return time.perf_counter() - t0

        def do_match(pairs=pairs) -> float:
            match = full.match
            t0 = time.perf_counter()
            results = [match(tokens) for tokens, _ in pairs]
            dt = time.perf_counter() - t0
            for m in results:
                alloc.decref_distinct(m.block_array)
            return dt

        do_insert()  # warm-up: numba kernels load from their disk cache on first call
        do_match()
        measured[("insert", kind)] = _timed(do_insert, repeats)
        measured[("match", kind)] = _timed(do_match, repeats)

    lists = [(t.tolist(), tb.tolist()) for (_, t), tb in zip(requests, tables)]

    def convert_tokens() -> float:
        t0 = time.perf_counter()
        for tokens, _ in lists:
            np.fromiter(tokens, dtype=np.int32, count=len(tokens))
        return time.perf_counter() - t0

    def convert_both() -> float:
        t0 = time.perf_counter()
        for tokens, table in lists:
            np.fromiter(tokens, dtype=np.int32, count=len(tokens))
            np.fromiter(table, dtype=np.int32, count=len(table))
        return time.perf_counter() - t0

    def floor() -> float:
        t0 = time.perf_counter()
        for (_, tokens), table in zip(requests, tables):
            tokens.tobytes()  # one read of the query
            alloc.incref_distinct(table)  # one reference per matched block
        dt = time.perf_counter() - t0
        for table in tables:
            alloc.decref_distinct(table)
        return dt

    measured[("insert", "conversion")] = _timed(convert_both, repeats)
    measured[("match", "conversion")] = _timed(convert_tokens, repeats)
    measured[("match", "floor")] = _timed(floor, repeats)
    naive_time: dict[str, float] = {}
    if naive:
        holder: dict = {}

        def naive_insert() -> float:
            trie = NaiveTrie(bs)
            t0 = time.perf_counter()
            for tokens, table in lists:
                trie.insert(tokens, table)
            holder["t"] = trie
            return time.perf_counter() - t0

        def naive_match() -> float:
            trie = holder["t"]
            t0 = time.perf_counter()
            for tokens, _ in lists:
                trie.match(tokens)
            return time.perf_counter() - t0

        naive_time["insert"], _ = _timed(naive_insert, max(1, repeats // 2))
        naive_time["match"], _ = _timed(naive_match, max(1, repeats // 2))
    rows = []
    for (op, kind), (med, spread) in measured.items():
        row = {
            "workload": name,
            "block_size": bs,
            "op": op,
            "input": kind,
            "requests": n_req,
            "tokens": n_tok,
            "us_per_req": 1e6 * med / n_req,
            "spread_us": 1e6 * spread / n_req,
            "mtok_per_s": n_tok / med / 1e6,
        }
        if kind in INPUTS and op in naive_time:
            row["naive_us_per_req"] = 1e6 * naive_time[op] / n_req
            row["speedup_vs_naive"] = naive_time[op] / med
        rows.append(row)
    by = {(r["op"], r["input"]): r["us_per_req"] for r in rows}
    for r in rows:
        op = r["op"]
        if r["input"] == "list" and ("insert", "int32") in by:
            # the goal: a list never costs more than the int32 path plus one conversion
            r["bound_us"] = by[(op, "int32")] + by[(op, "conversion")]
        if op == "match" and r["input"] == "int32":
            r["vs_floor"] = r["us_per_req"] / by[("match", "floor")]
    rows.append(memory_row(name, requests, tables, n_ids, bs, full.cached_blocks))
    return rows


def memory_row(name: str, requests, tables, n_ids: int, bs: int, cached: int) -> dict:
    """Python heap the tree allocates for its metadata, per cached block and token."""
    alloc = BlockAllocator(num_blocks=max(n_ids, 1), block_size=bs)
    alloc.alloc_array(n_ids)
    gc.collect()
    tracemalloc.start()
    base = tracemalloc.get_traced_memory()[0]
    cache = RadixCache(alloc)
    for (_, tokens), table in zip(requests, tables):
        cache.insert(tokens, table)
    used = tracemalloc.get_traced_memory()[0] - base
    tracemalloc.stop()
    return {
        "workload": name,
        "block_size": bs,
        "op": "memory",
        "requests": len(requests),
        "tokens": cached * bs,
        "bytes_per_block": used / cached,
        "bytes_per_token": used / (cached * bs),
        "nodes": cache.num_nodes,
    }


def bench_evict(sizes: list[int], bs: int, repeats: int, naive_size: int) -> list[dict]:
    rows = []
    rng = np.random.default_rng(1)
    full = chat_workload(rng, 600, 10)
    for size in sizes:
        reqs, total, seen_len = [], 0, {}
        for c, tokens in full:  # enough requests for `size` distinct tokens
            reqs.append((c, tokens))
            total += len(tokens) - seen_len.get(c, 1000)  # the system prompts are shared
            seen_len[c] = len(tokens)
            if total >= size * 1.02:
                break
        tables, n_ids = block_tables(reqs, bs)
        per_block = []
        for _ in range(repeats):
            alloc = BlockAllocator(num_blocks=n_ids, block_size=bs)
            blocks = alloc.alloc_array(n_ids)
            cache = RadixCache(alloc)
            for (_, tokens), table in zip(reqs, tables):
                cache.insert(tokens, table)
                if cache.cached_blocks * bs >= size:
                    break
            alloc.decref_distinct(blocks[alloc.refcounts(blocks) > 1])  # requests are done
            cached = cache.cached_blocks
            step = max(1, cached // 100)
            gc.collect()
            t0 = time.perf_counter()
            freed = 0
            while cache.cached_blocks:
                freed += cache.evict(step)
            per_block.append((time.perf_counter() - t0) / freed)
        row = {
            "workload": "evict",
            "block_size": bs,
            "op": "evict 1% steps",
            "tokens": cached * bs,
            "us_per_block": 1e6 * statistics.median(per_block),
            "spread_us": 1e6 * (max(per_block) - min(per_block)),
        }
        if size <= naive_size:
            trie = NaiveTrie(bs)
            inserted = 0
            for (_, tokens), table in zip(reqs, tables):
                inserted += len(tokens) // bs * bs - trie.insert(tokens.tolist(), table.tolist())
                if inserted >= size:
                    break
            steps = 5
            t0 = time.perf_counter()
            nf = sum(trie.evict(step) for _ in range(steps))
            row["naive_us_per_block"] = 1e6 * (time.perf_counter() - t0) / nf
            row["speedup_vs_naive"] = row["naive_us_per_block"] / row["us_per_block"]
        rows.append(row)
    return rows


def print_table(rows: list[dict]) -> None:
    print(
        f"{'workload':<8} {'bs':>3} {'op':<7} {'input':<11} {'us/req':>9} {'±':>7} "
        f"{'Mtok/s':>8} {'naive us':>9} {'x naive':>8}  note"
    )
    for r in rows:
        if r["op"] == "memory":
            print(
                f"{r['workload']:<8} {r['block_size']:>3} {'memory':<19} "
                f"{r['bytes_per_token']:>8.2f} B/token  {r['bytes_per_block']:.1f} B/block  "
                f"{r['nodes']} nodes"
            )
        elif r["workload"] == "evict":
            extra = (
                f"{r['naive_us_per_block']:>10.2f} {r['speedup_vs_naive']:>8.1f}"
                if "naive_us_per_block" in r
                else ""
            )
            print(
                f"{'evict':<8} {r['block_size']:>3} {r['tokens']:>9} tokens cached "
                f"{r['us_per_block']:>7.3f} us/block {'':>8}{extra}"
            )
        else:
            note = ""
            if "bound_us" in r:
                ratio = r["us_per_req"] / r["bound_us"]
                note = f"int32 + conversion {r['bound_us']:.1f} (x{ratio:.2f})"
            elif "vs_floor" in r:
                note = f"x{r['vs_floor']:.2f} the floor"
            naive = (
                f"{r['naive_us_per_req']:>9.1f} {r['speedup_vs_naive']:>8.1f}"
                if "naive_us_per_req" in r
                else f"{'':>9} {'':>8}"
            )
            print(
                f"{r['workload']:<8} {r['block_size']:>3} {r['op']:<7} {r['input']:<11} "
                f"{r['us_per_req']:>9.2f} {r['spread_us']:>7.2f} {r['mtok_per_s']:>8.1f} "
                f"{naive}  {note}"
            )


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="smaller workloads, fewer repeats")
    ap.add_argument("--repeats", type=int, default=None)
    ap.add_argument("--no-naive", action="store_true", help="skip the naive trie floor")
    ap.add_argument("--out", type=Path, default=None, help="also write the table as CSV here")
    args = ap.parse_args()
    repeats = args.repeats or (3 if args.quick else 7)
    rng = np.random.default_rng(0)
    chat = chat_workload(rng, 20 if args.quick else 100, 10)
    long = long_workload(rng, 10 if args.quick else 100, 32768, 16384)
    sizes = [62_500, 125_000, 250_000] if args.quick else [125_000, 250_000, 500_000, 1_000_000]
    rows: list[dict] = []
    for bs in (1, 16):
        rows += bench_match_insert("chat", chat, bs, repeats, not args.no_naive)
        rows += bench_match_insert("long", long, bs, repeats, not args.no_naive)
        rows += bench_evict(sizes, bs, max(1, repeats // 2), 0 if args.no_naive else sizes[0])
    print_table(rows)
    save_rows(rows, args.out, "bench_tree_quick.csv" if args.quick else "bench_tree.csv")


if __name__ == "__main__":
    main()
