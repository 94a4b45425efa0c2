"""KV store benchmark: put and get throughput and latency per backend and block size.

For each block size (default: 737,280 bytes, one 16-token block of SmolLM2-135M's K/V in
float32, and 46,080 bytes, one token of it) and each backend:

- ``memory``: ``MemoryStore`` (the entry format's cost alone: header, checksum, copies);
- ``disk``: ``LocalDiskStore`` in a fresh temporary folder (``--dir`` picks where);
- ``mooncake`` (with ``--mooncake``): ``MooncakeStore`` over TCP in the pool of a
  ``mooncake_master`` this script starts on 127.0.0.1 (or the one at ``--mooncake
  HOST:PORT``); one client, a store per repeat sharing it, the pool emptied after each;
- ``raw``: the baseline, measured in the same run: the same payloads written to and read
  back from plain files in the same kind of folder (``open``/``write``/``read``, no
  header, checksum, temp file or rename; the values read are kept until the batch is
  done, as ``get_many`` keeps them). Every row reports its ratio to it.

A repeat writes ``--blocks`` new blocks in one ``put_many`` into a fresh store, then
reads them all back in one ``get_many``; per repeat the time per block and the GB/s;
reported: medians over ``--repeats`` repeats with [min, max]. The reads are warm: the
blocks were just written, so they come from the page cache. ``--cold`` adds a third
pass to the folder backends (``raw``, ``disk``): ``sync``, drop the page cache
(``/proc/sys/vm/drop_caches``, root only: a clear error otherwise), and read every
block again from the device (op ``cold_get``). There is no fsync in the store or in
the timed writes.

    python benchmarks/bench_store.py --quick   # a few seconds
    python benchmarks/bench_store.py --out benchmarks/results/bench_store.csv
    python benchmarks/bench_store.py --mooncake local   # needs radixkv[store-mooncake]
    python benchmarks/bench_store.py --cold             # as root: reads from the device too
"""

from __future__ import annotations

import argparse
import contextlib
import itertools
import os
import shutil
import statistics
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

import numpy as np
from bench_common import save_rows

from radixkv.cache.store import KEY_BYTES, LocalDiskStore, MemoryStore, MooncakeStore
from radixkv.cache.store.mooncake import MooncakeMaster

SMOLLM2_BLOCK = 30 * 2 * 3 * 64 * 4 * 16  # layers x (K, V) x kv heads x head dim x fp32 x tokens


def payloads(num_blocks: int, block_bytes: int, seed: int) -> list[tuple[bytes, bytes]]:
    rng = np.random.default_rng(seed)
    return [
        (rng.bytes(KEY_BYTES), rng.standard_normal(block_bytes // 4, np.float32).tobytes())
        for _ in range(num_blocks)
    ]


Round = tuple[float, ...]  # put seconds, get seconds[, cold get seconds]


def drop_page_cache() -> None:
    """Write dirty pages back, then drop the clean ones, so the next read comes from the
    device. ``SystemExit`` saying why if this process may not (it needs root)."""
    os.sync()
    try:
        with open("/proc/sys/vm/drop_caches", "w") as f:
            f.write("1\n")
    except OSError as exc:
        raise SystemExit(f"--cold needs to drop the page cache (as root): {exc}") from None


def reads(put_seconds: float, read: Callable[[], float], cold: bool) -> Round:
    """The round of a put that took ``put_seconds``: a warm ``read()``, and with ``cold``
    one more after :func:`drop_page_cache`."""
    warm = read()
    if not cold:
        return put_seconds, warm
    drop_page_cache()
    return put_seconds, warm, read()


def raw_round(folder: Path, items: list[tuple[bytes, bytes]], cold: bool = False) -> Round:
    """Seconds to write, then read, ``items`` as plain files (the baseline); with ``cold``,
    to read them again after :func:`drop_page_cache`."""

    def read() -> float:
        t0 = time.perf_counter()
        got = []  # kept, as get_many keeps every value it returns (fresh pages to fault in)
        for key, _ in items:
            with open(folder / key.hex(), "rb") as f:
                got.append(f.read())
        seconds = time.perf_counter() - t0
        assert [len(g) for g in got] == [len(v) for _, v in items]
        return seconds

    t0 = time.perf_counter()
    for key, value in items:
        with open(folder / key.hex(), "wb") as f:
            f.write(value)
    return reads(time.perf_counter() - t0, read, cold)


def store_round(store: object, items: list[tuple[bytes, bytes]], cold: bool = False) -> Round:
    """Seconds for one ``put_many`` of ``items``, then one ``get_many`` of their keys; with
    ``cold``, one more ``get_many`` after :func:`drop_page_cache`."""
    keys = [k for k, _ in items]

    def read() -> float:
        t0 = time.perf_counter()
        got = store.get_many(keys)
        seconds = time.perf_counter() - t0
        assert all(
            g is not None and len(g) == len(v) for g, (_, v) in zip(got, items, strict=True)
        )
        return seconds

    t0 = time.perf_counter()
    assert store.put_many(items) == len(items)
    return reads(time.perf_counter() - t0, read, cold)


_PREFIXES = itertools.count()


def mooncake_round(pool: MooncakeStore, items: list[tuple[bytes, bytes]]) -> Round:
    """:func:`store_round` in a fresh store sharing ``pool``'s client, then empty the pool."""
    capacity = 2 * sum(len(v) + 64 for _, v in items)
    with pool.share(capacity, key_prefix=f"bench{next(_PREFIXES)}/") as store:
        try:
            return store_round(store, items)
        finally:
            pool.client.remove_all(True)


def measure(
    backend: str,
    base: Path,
    items: list[tuple[bytes, bytes]],
    repeats: int,
    pool: MooncakeStore | None = None,
    cold: bool = False,
) -> list[Round]:
    """``repeats`` :data:`Round` s, each in a fresh store, after a warm-up; ``cold`` adds the
    cold get to the folder backends."""
    capacity = 2 * sum(len(v) + 64 for _, v in items)

    def once() -> Round:
        folder = Path(tempfile.mkdtemp(dir=base))
        try:
            if backend == "raw":
                return raw_round(folder, items, cold)
            if backend == "memory":
                return store_round(MemoryStore(capacity), items)
            if backend == "mooncake":
                return mooncake_round(pool, items)
            return store_round(LocalDiskStore(folder, capacity), items, cold)
        finally:
            shutil.rmtree(folder)

    once()  # warm-up: first-touch of the folder, the allocator's arenas
    return [once() for _ in range(repeats)]


def summarize(xs: list[float]) -> tuple[float, float, float]:
    return statistics.median(xs), min(xs), max(xs)


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="fewer blocks and repeats")
    ap.add_argument("--sizes", type=int, nargs="+", default=[SMOLLM2_BLOCK, SMOLLM2_BLOCK // 16])
    ap.add_argument("--blocks", type=int, default=64, help="blocks per put_many / get_many")
    ap.add_argument("--repeats", type=int, default=7)
    ap.add_argument("--dir", type=Path, default=None, help="where the folders go (default: TMP)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--out", type=Path, default=None, help="also write the table as CSV here")
    ap.add_argument(
        "--mooncake",
        default=None,
        metavar="local|HOST:PORT",
        help="also measure MooncakeStore: 'local' starts a mooncake_master on 127.0.0.1",
    )
    ap.add_argument(
        "--cold",
        action="store_true",
        help="also read raw and disk blocks after dropping the page cache (needs root)",
    )
    args = ap.parse_args(argv)
    if args.quick:
        args.blocks, args.repeats = 16, 3
    base = Path(tempfile.mkdtemp(prefix="bench-store-", dir=args.dir))
    rows: list[dict] = []
    backends = ["raw", "memory", "disk"] + (["mooncake"] if args.mooncake else [])
    with contextlib.ExitStack() as stack:
        pool = None
        if args.mooncake:
            address = args.mooncake
            if address == "local":
                address = stack.enter_context(MooncakeMaster()).address
            biggest = max(args.sizes) + 64
            pool = stack.enter_context(
                MooncakeStore(
                    address,
                    1 << 20,
                    global_segment_size=max(256 << 20, 4 * args.blocks * biggest),
                    local_buffer_size=max(64 << 20, 2 * args.blocks * biggest),
                )
            )
        run_all(args, base, backends, rows, pool)
    fs = os.statvfs(args.dir or tempfile.gettempdir())
    print(
        f"blocks per batch={args.blocks} repeats={args.repeats} (median [min, max]); "
        f"folder under {args.dir or tempfile.gettempdir()} ({fs.f_bsize}-byte fs blocks)"
    )
    print(f"{'bytes':>8} {'backend':8} {'op':8} {'ms/block':>9} {'[min':>8} {'max]':>8} "
          f"{'GB/s':>6} {'vs raw':>6}")
    for r in rows:
        print(
            f"{r['block_bytes']:>8} {r['backend']:8} {r['op']:8} {r['ms_per_block']:9.3f} "
            f"{r['ms_per_block_min']:8.3f} {r['ms_per_block_max']:8.3f} {r['gb_per_s']:6.2f} "
            f"{r['vs_raw']:6.2f}"
        )
    save_rows(rows, args.out, "bench_store.csv")


def run_all(
    args: argparse.Namespace,
    base: Path,
    backends: list[str],
    rows: list[dict],
    pool: MooncakeStore | None,
) -> None:
    """Measure every backend at every size into ``rows``."""
    try:
        for size in args.sizes:
            items = payloads(args.blocks, size, args.seed)
            raw: dict[str, float] = {}
            for backend in backends:
                runs = measure(backend, base, items, args.repeats, pool, args.cold)
                for op, idx in (("put", 0), ("get", 1), ("cold_get", 2))[: len(runs[0])]:
                    med, lo, hi = summarize([r[idx] for r in runs])
                    if backend == "raw":
                        raw[op] = med
                    rows.append(
                        {
                            "block_bytes": size,
                            "backend": backend,
                            "op": op,
                            "blocks": args.blocks,
                            "repeats": args.repeats,
                            "ms_per_block": 1e3 * med / args.blocks,
                            "ms_per_block_min": 1e3 * lo / args.blocks,
                            "ms_per_block_max": 1e3 * hi / args.blocks,
                            "gb_per_s": size * args.blocks / med / 1e9,
                            "vs_raw": med / raw[op],
                        }
                    )
    finally:
        shutil.rmtree(base, ignore_errors=True)


if __name__ == "__main__":
    main()
