"""Reading contexts out of the paged pool: per-slot vs whole-block gather, fresh vs reused buffers.

Every paged-attention step copies each sequence's context K/V out of the pool
(``paged_attention``'s ``loop`` backend). Three ways to do it, on one
engine-like step (decodes with long contexts plus a prefill chunk, block tables
scattered over a pool of ``--layers`` layers, so nothing stays in cache):

- ``slot``: ``index_select`` over every context slot into new tensors (the
  baseline: what the engine did first);
- ``block``: ``index_select`` over whole blocks into new tensors;
- ``block+ws``: whole blocks into a reused :class:`~radixkv.model.gather.GatherWorkspace`
  (what the engine does now).

``gather`` times the copies of one step over all layers (K and V);
``forward`` times one whole step (``ForwardBatch.build`` and ``Decoder.forward``)
with and without the workspace (``block`` vs ``block+ws``). Medians of round-robin repeats, as a
ratio to the baseline measured in the same run.

    python benchmarks/bench_gather.py            # SmolLM2-135M shape, 30 layers
    python benchmarks/bench_gather.py --quick
    python benchmarks/bench_gather.py --out benchmarks/results/gather.csv   # record the run
"""

from __future__ import annotations

import argparse
import statistics
import time
from collections.abc import Callable
from pathlib import Path

import numpy as np
import torch
from bench_common import Step, save_rows

from radixkv.model import Decoder, ModelConfig, random_model
from radixkv.model.gather import GatherWorkspace, gather_kv  # the engine's own gather
from radixkv.model.kvpool import KVPool


def engine_step(
    config: ModelConfig, num_decodes: int, ctx: int, chunk: int, block_size: int, seed: int
) -> Step:
    """A step of ``num_decodes`` decodes at ``ctx`` tokens plus one ``chunk`` ending at ``ctx``.

    Tables are a random permutation of the pool, as after a long run; the pool
    has ``num_blocks`` blocks.
    """
    gen = torch.Generator().manual_seed(seed)
    lens = [(1, ctx)] * num_decodes + [(chunk, ctx)]
    per_seq = -(-ctx // block_size)
    num_blocks = per_seq * len(lens) + 8
    perm = torch.randperm(num_blocks, generator=gen).numpy()
    num_tokens = sum(q for q, _ in lens)
    return Step(
        input_ids=torch.randint(0, config.vocab_size, (num_tokens,), generator=gen).numpy(),
        query_lens=[q for q, _ in lens],
        context_lens=[c for _, c in lens],
        block_tables=[perm[i * per_seq : (i + 1) * per_seq] for i in range(len(lens))],
        num_blocks=num_blocks,
    )


def gather_ways(
    pool_k: list[torch.Tensor], pool_v: list[torch.Tensor], step: Step, block_size: int
) -> dict[str, Callable[[], None]]:
    """The three gathers of one step over every layer, as callables."""
    nb = [-(-c // block_size) for c in step.context_lens]
    blocks = torch.from_numpy(
        np.concatenate([t[:n] for t, n in zip(step.block_tables, nb, strict=True)])
    ).long()
    slots = (blocks[:, None] * block_size + torch.arange(block_size)).reshape(-1)
    ws = GatherWorkspace()

    def run(index: torch.Tensor, rows: int, workspace: GatherWorkspace | None) -> None:
        for k, v in zip(pool_k, pool_v, strict=True):
            gather_kv(k, v, index, rows, workspace)

    def slot() -> None:
        run(slots, 1, None)

    def block() -> None:
        run(blocks, block_size, None)

    def block_ws() -> None:
        run(blocks, block_size, ws)

    return {"slot": slot, "block": block, "block+ws": block_ws}


def forward(model: Decoder, pool: KVPool, step: Step) -> None:
    """One whole step: the batch for the model's backend, then ``Decoder.forward``."""
    batch = step.batch(pool, model.backend_for(pool.device), model.config.group_size)
    model(batch, pool)


def median_ms(fns: dict[str, Callable[[], None]], repeats: int) -> dict[str, list[float]]:
    times: dict[str, list[float]] = {name: [] for name in fns}
    for fn in fns.values():
        fn()  # warm-up
    for _ in range(repeats):  # round-robin, so machine noise hits every way alike
        for name, fn in fns.items():
            t0 = time.perf_counter()
            fn()
            times[name].append((time.perf_counter() - t0) * 1e3)
    return times


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="fewer layers and repeats")
    ap.add_argument("--layers", type=int, default=None, help="default 30 (quick: 8)")
    ap.add_argument("--decodes", type=int, default=32)
    ap.add_argument("--ctx", type=int, default=1200)
    ap.add_argument("--chunk", type=int, default=128)
    ap.add_argument("--block-size", type=int, default=16)
    ap.add_argument("--repeats", type=int, default=None, help="default 9 (quick: 3)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--out", type=Path, default=None, help="also write the table as CSV here")
    args = ap.parse_args()
    torch.set_num_threads(1)
    layers = args.layers or (8 if args.quick else 30)
    repeats = args.repeats or (3 if args.quick else 9)
    config = ModelConfig(
        vocab_size=49152, hidden_size=576, intermediate_size=1536, num_layers=layers,
        num_heads=9, num_kv_heads=3, head_dim=64, rope_theta=1e5,
    )  # fmt: skip
    step = engine_step(config, args.decodes, args.ctx, args.chunk, args.block_size, args.seed)
    model = random_model(config, seed=args.seed)
    pool = model.make_kv_pool(step.num_blocks, args.block_size)
    for t in (*pool.k, *pool.v):
        t.normal_()
    rows = []
    gathers = median_ms(gather_ways(pool.k, pool.v, step, args.block_size), repeats)
    fresh = random_model(config, seed=args.seed)
    fresh.gather_workspace = None  # paged_attention then allocates its gather tensors per layer
    forwards = median_ms(
        {
            "block": lambda: forward(fresh, pool, step),
            "block+ws": lambda: forward(model, pool, step),
        },
        repeats,
    )
    for measure, times in (("gather", gathers), ("forward", forwards)):
        base = statistics.median(next(iter(times.values())))
        for way, ts in times.items():
            med = statistics.median(ts)
            rows.append(
                {
                    "measure": measure,
                    "way": way,
                    "median_ms": round(med, 2),
                    "min_ms": round(min(ts), 2),
                    "max_ms": round(max(ts), 2),
                    "vs_baseline": round(med / base, 3),
                }
            )
    ctx_mib = sum(step.context_lens) * config.num_kv_heads * config.head_dim * 4 * 2 / 2**20
    print(
        f"one step: {args.decodes} decodes at {args.ctx} tokens + a {args.chunk}-token chunk, "
        f"{layers} layers (SmolLM2-135M shape), block size {args.block_size}: "
        f"{ctx_mib:.1f} MiB of K/V gathered per layer; {repeats} repeats, 1 thread"
    )
    print(f"{'measure':8s} {'way':9s} {'median ms':>10s} {'min-max':>13s} {'vs first':>8s}")
    for r in rows:
        spread = f"{r['min_ms']:.1f}-{r['max_ms']:.1f}"
        print(
            f"{r['measure']:8s} {r['way']:9s} {r['median_ms']:10.1f} {spread:>13s} "
            f"{r['vs_baseline']:8.2f}"
        )
    save_rows(rows, args.out, f"gather{'_quick' if args.quick else ''}.csv")


if __name__ == "__main__":
    main()
