"""Paged attention backends: one loop of SDPA calls vs one padded call vs one varlen call.

Each scenario is one scheduler step of SmolLM2-135M's attention shape (9 query
heads, 3 KV heads, head_dim 64): some decode tokens with long contexts plus at
most one prefill chunk. Two measures per backend: ``attention``, one step's
attention over all layers (the per-step metadata build once, then
``num_layers`` calls of ``paged_attention``), and ``forward``, one whole
``Decoder.forward`` step of a random model of SmolLM2's shape (30 layers,
hidden 576, vocab 49152), including ``ForwardBatch.build`` (where the
metadata is made now). The ``loop`` backend is the baseline; the others are
reported as a ratio to it, measured round-robin in the same run.

    python benchmarks/bench_attention.py            # full: ~20 min on a busy 2-core box
    python benchmarks/bench_attention.py --quick    # ~1-2 min
    python benchmarks/bench_attention.py --device cuda  # on a GPU
    python benchmarks/bench_attention.py --quick --out benchmarks/results/attention_quick.csv

The table always prints; a CSV is written only with ``--out`` (the tracked results
are ``benchmarks/results/attention[_cuda][_quick].csv``).

On CUDA each timing synchronizes the device before reading the clock.
"""

from __future__ import annotations

import argparse
import statistics
import time
from functools import partial
from pathlib import Path

import numpy as np
import torch
from bench_common import Step, save_rows

from radixkv.model import Decoder, ModelConfig, random_model
from radixkv.model.attention import ATTENTION_BACKENDS, AttentionMetadata, paged_attention
from radixkv.model.kvpool import KVPool

HEADS, KV_HEADS, HEAD_DIM = 9, 3, 64


def make_step(
    num_decodes: int, decode_ctx: int, chunk: int, chunk_ctx: int, block_size: int, seed: int
) -> tuple[Step, torch.Tensor, torch.Tensor, torch.Tensor]:
    """A step, its queries, and one layer's K/V pool with every context slot filled."""
    gen = torch.Generator().manual_seed(seed)
    lens = [(1, decode_ctx)] * num_decodes + ([(chunk, chunk_ctx)] if chunk else [])
    need = sum(-(-c // block_size) for _, c in lens)
    perm = torch.randperm(need + 16, generator=gen).numpy()
    tables, start = [], 0
    for _, c in lens:
        n = -(-c // block_size)
        tables.append(perm[start : start + n])
        start += n
    num_slots = (need + 16) * block_size
    k = torch.randn(num_slots, KV_HEADS, HEAD_DIM, generator=gen)
    v = torch.randn(num_slots, KV_HEADS, HEAD_DIM, generator=gen)
    num_tokens = sum(q for q, _ in lens)
    step = Step(
        input_ids=np.zeros(num_tokens, dtype=np.int64),
        query_lens=[q for q, _ in lens],
        context_lens=[c for _, c in lens],
        block_tables=tables,
        num_blocks=need + 16,
    )
    q = torch.randn(num_tokens, HEADS, HEAD_DIM, generator=gen)
    return step, q, k, v


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def time_attention(backend: str, step: Step, q, k, v, num_layers: int, block_size: int) -> float:
    """Seconds for one step's attention: metadata build + ``num_layers`` backend calls."""
    sync(q.device)
    t0 = time.perf_counter()
    meta = AttentionMetadata.build(
        step.query_lens,
        step.context_lens,
        step.block_tables,
        block_size=block_size,
        group_size=HEADS // KV_HEADS,
        backend=backend,
        device=q.device,
    )
    for _ in range(num_layers):
        paged_attention(q, k, v, meta)
    sync(q.device)
    return time.perf_counter() - t0


def time_forward(backend: str, model: Decoder, pool: KVPool, step: Step) -> float:
    """Seconds for one whole step with ``backend``: ``ForwardBatch.build`` + ``Decoder.forward``."""
    sync(pool.device)
    t0 = time.perf_counter()
    batch = step.batch(pool, backend, model.config.group_size)
    model(batch, pool)
    sync(pool.device)
    return time.perf_counter() - t0


def smollm2_shaped(num_layers: int) -> ModelConfig:
    return ModelConfig(
        vocab_size=49152, hidden_size=576, intermediate_size=1536, num_layers=num_layers,
        num_heads=HEADS, num_kv_heads=KV_HEADS, head_dim=HEAD_DIM, rope_theta=1e5,
    )  # fmt: skip


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="fewer scenarios and repeats")
    ap.add_argument("--repeats", type=int, default=None)
    ap.add_argument("--layers", type=int, default=30)
    ap.add_argument("--block-size", type=int, default=16)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--device", default="cpu", help="cpu or cuda")
    ap.add_argument(
        "--no-forward", action="store_true", help="skip the whole-model forward timings"
    )
    ap.add_argument("--out", type=Path, default=None, help="also write the table as CSV here")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    device = torch.device(args.device)
    repeats = args.repeats or (3 if args.quick else 7)
    # (name, decodes, decode context, prefill chunk, chunk's context after the step)
    scenarios = [
        ("8 decodes@512 + chunk 128@640", 8, 512, 128, 640),
        ("32 decodes@1024 + chunk 256@1280", 32, 1024, 256, 1280),
        ("32 decodes@1024", 32, 1024, 0, 0),
        ("prefill 512@512", 0, 0, 512, 512),
        ("4 decodes@2048 + chunk 512@512", 4, 2048, 512, 512),
    ]
    if args.quick:
        scenarios = scenarios[:1] + scenarios[2:4]
    # the batch carries its backend's metadata, so one model runs them all
    model = None
    if not args.no_forward:
        model = random_model(smollm2_shaped(args.layers), seed=args.seed).to(device)
    rows = []
    for name, nd, dc, ch, cc in scenarios:
        step, q, k, v = make_step(nd, dc, ch, cc, args.block_size, args.seed)
        q, k, v = q.to(device), k.to(device), v.to(device)
        measures = {
            "attention": partial(
                time_attention,
                step=step,
                q=q,
                k=k,
                v=v,
                num_layers=args.layers,
                block_size=args.block_size,
            )  # fmt: skip
        }
        if model is not None:
            pool = KVPool(args.layers, step.num_blocks, args.block_size, KV_HEADS, HEAD_DIM,
                          device=device)  # fmt: skip
            measures["forward"] = partial(time_forward, model=model, pool=pool, step=step)
        for what, fn in measures.items():
            times: dict[str, list[float]] = {b: [] for b in ATTENTION_BACKENDS}
            for b in ATTENTION_BACKENDS:
                fn(b)  # warm-up
            for _ in range(repeats):  # round-robin, so machine noise hits every backend alike
                for b in ATTENTION_BACKENDS:
                    times[b].append(fn(b))
            base_med = statistics.median(times["loop"])
            for b, ts in times.items():
                med = statistics.median(ts)
                rows.append(
                    {
                        "scenario": name,
                        "measure": what,
                        "backend": b,
                        "median_ms": round(med * 1e3, 3),
                        "min_ms": round(min(ts) * 1e3, 3),
                        "max_ms": round(max(ts) * 1e3, 3),
                        "vs_loop": round(med / base_med, 3),
                    }
                )
    where = torch.cuda.get_device_name(device) if device.type == "cuda" else "CPU"
    print(
        f"one step over {args.layers} layers (SmolLM2-135M shape), {where}, "
        f"{args.threads} thread(s), "
        f"block_size {args.block_size}, {repeats} repeats: median and [min-max] ms"
    )
    print(f"{'scenario':34s} {'measure':9s} {'backend':7s} {'median':>8s} {'min-max':>15s} "
          f"{'vs loop':>7s}")  # fmt: skip
    for r in rows:
        spread = f"{r['min_ms']:.0f}-{r['max_ms']:.0f}"
        print(
            f"{r['scenario']:34s} {r['measure']:9s} {r['backend']:7s} {r['median_ms']:8.1f} "
            f"{spread:>15s} {r['vs_loop']:7.2f}"
        )
    kind = device.type
    parts = ["attention"] + ([kind] if kind != "cpu" else []) + (["quick"] if args.quick else [])
    save_rows(rows, args.out, f"{'_'.join(parts)}.csv")


if __name__ == "__main__":
    main()
