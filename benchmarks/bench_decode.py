"""GPU step benchmark: a decode step and prefill attention, padded vs triton vs CUDA graphs.

Three tables, on one device in one run (SmolLM2-135M's shape with random weights:
30 layers, hidden 576, 9 heads / 3 KV heads of 64, vocab 49152):

1. **Floors.** Measured device-to-device copy bandwidth (bytes read + written);
   the time to read the weights once at that bandwidth; the time to read every
   running context's K/V once; and the launch floor, the replay of a CUDA graph
   holding one tiny kernel.
2. **Decode step** of ``--seqs`` running sequences with contexts drawn from
   ``--ctx LO-HI``: host metadata to logits, synchronized, median of
   ``--repeats``. ``padded`` and ``triton`` build a ``ForwardBatch`` and run
   ``Decoder.forward``; ``triton+graphs`` fills the static buffers and replays
   (``DecodeGraphs.run``). The logits of all three are compared.
3. **Prefill attention**, one layer: the ``triton`` extend kernel over a paged
   pool against one dense ``scaled_dot_product_attention`` call on the same
   shapes without paging (``enable_gqa``, ``is_causal``), as tokens per second;
   and ``padded`` over the same pool. Timed as launched (CUDA events around a
   call Python launches) and as kernels (``triton.testing.do_bench``: device time).

``--profile`` ranks the graphed step's kernels by device time (``torch.profiler``),
to say where a step's milliseconds go. ``--sweep`` also times other launch configs
of the triton kernels (by ``do_bench``) and picks, per kernel and dtype, the one
closest to each shape's best (geometric mean); ``--save-configs F`` writes the
pick, ``--configs F`` runs with it: choose on the selection shapes, then report
held-out shapes (``gpu_check.sh`` does both).

    python benchmarks/bench_decode.py --device cuda --out benchmarks/results/decode_cuda.csv

Needs a GPU (the triton backend compiles for CUDA); prints its tables and, with
``--out``, writes them as one CSV. ``--device cpu`` with ``TRITON_INTERPRET=1`` is a
dry run on tiny sizes (no floors, no graphs; e.g. ``--seqs 2 --ctx 20-30 --layers 1
--prefill-shapes 1x32``), to check the script before spending GPU time.
"""

from __future__ import annotations

import argparse
import ast
import json
import statistics
import time
from functools import partial
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F
from bench_attention import HEAD_DIM, HEADS, KV_HEADS, smollm2_shaped
from bench_common import save_rows

from radixkv.model import ForwardBatch, random_model
from radixkv.model.attention import AttentionMetadata, paged_attention
from radixkv.model.cuda_graphs import DecodeGraphs
from radixkv.model.triton_attention import TritonAttention, decode_splits

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def sync() -> None:
    if torch.cuda.is_available():
        torch.cuda.synchronize()


def cuda_time(fn, repeats: int, warmup: int = 3) -> list[float]:
    """Seconds per call of ``fn`` (host clock around a synchronized call), ``repeats`` times."""
    for _ in range(warmup):
        fn()
    sync()
    out = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        sync()
        out.append(time.perf_counter() - t0)
    return out


def event_time(fn, repeats: int, warmup: int = 3) -> float:
    """Median milliseconds of ``fn`` by CUDA events (device time, launches queued back to back)."""
    if not torch.cuda.is_available():  # a dry run: host time
        return statistics.median(cuda_time(fn, repeats, warmup)) * 1e3
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(repeats):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end))
    return statistics.median(times)


def kernel_time(fn, repeats: int) -> float:
    """Median milliseconds of ``fn``'s kernels alone, by ``triton.testing.do_bench``.

    Each timed call follows an L2 flush that keeps the GPU busy while Python
    launches it, so the figure is device time without the host's launch cost (which
    ``event_time`` includes). The dry run falls back to ``event_time``.
    """
    if not torch.cuda.is_available():
        return event_time(fn, repeats)
    from triton.testing import do_bench

    return float(do_bench(fn, warmup=5, rep=max(20, repeats * 2), return_mode="median"))


def best_config(timings: dict[str, dict[str, float]]) -> str:
    """The config (key of ``timings[shape]``) with the lowest geometric mean of its time / each
    shape's best time, over the shapes every config ran on."""
    shapes = [s for s in timings if timings[s]]
    configs = set.intersection(*(set(timings[s]) for s in shapes))

    def score(config: str) -> float:
        return float(np.exp(np.mean([
            np.log(timings[s][config] / min(timings[s].values())) for s in shapes
        ])))  # fmt: skip

    return min(sorted(configs), key=score)


PREFILL_SWEEP = (
    {"BLOCK_M": 64, "BLOCK_N": 64, "num_warps": 4, "num_stages": 2},
    {"BLOCK_M": 64, "BLOCK_N": 64, "num_warps": 4, "num_stages": 3},
    {"BLOCK_M": 64, "BLOCK_N": 128, "num_warps": 4, "num_stages": 2},
    {"BLOCK_M": 128, "BLOCK_N": 64, "num_warps": 8, "num_stages": 2},
    {"BLOCK_M": 128, "BLOCK_N": 64, "num_warps": 8, "num_stages": 3},
    {"BLOCK_M": 128, "BLOCK_N": 64, "num_warps": 4, "num_stages": 3},
    {"BLOCK_M": 128, "BLOCK_N": 128, "num_warps": 8, "num_stages": 2},
    {"BLOCK_M": 128, "BLOCK_N": 32, "num_warps": 4, "num_stages": 3},
    {"BLOCK_M": 64, "BLOCK_N": 32, "num_warps": 4, "num_stages": 3},
    # one query head per tile, as FlashAttention's (the triton kernel folds GQA heads by default)
    {"BLOCK_M": 64, "BLOCK_N": 64, "num_warps": 4, "num_stages": 3, "FOLD_GQA": False},
    {"BLOCK_M": 128, "BLOCK_N": 64, "num_warps": 8, "num_stages": 3, "FOLD_GQA": False},
    {"BLOCK_M": 128, "BLOCK_N": 64, "num_warps": 4, "num_stages": 3, "FOLD_GQA": False},
)
DECODE_SWEEP = (
    ({"BLOCK_N": 32, "num_warps": 4, "num_stages": 2}, 256),
    ({"BLOCK_N": 64, "num_warps": 4, "num_stages": 2}, 256),
    ({"BLOCK_N": 128, "num_warps": 4, "num_stages": 2}, 256),
    ({"BLOCK_N": 64, "num_warps": 8, "num_stages": 2}, 256),
    ({"BLOCK_N": 64, "num_warps": 4, "num_stages": 3}, 256),
    ({"BLOCK_N": 64, "num_warps": 4, "num_stages": 2}, 128),
    ({"BLOCK_N": 64, "num_warps": 4, "num_stages": 2}, 512),
)


def copy_bandwidth() -> float:
    """Bytes per second of a 1 GiB device-to-device copy, counting bytes read plus written."""
    src = torch.empty(1 << 28, dtype=torch.float32, device="cuda").normal_()
    dst = torch.empty_like(src)
    ms = event_time(lambda: dst.copy_(src), 10)
    return 2 * src.numel() * 4 / (ms / 1e3)


def launch_floor() -> float:
    """Milliseconds to replay a CUDA graph holding one tiny kernel (host call to done)."""
    x = torch.zeros(16, device="cuda")
    stream = torch.cuda.Stream()
    with torch.cuda.stream(stream):
        x.add_(1)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        x.add_(1)
    return statistics.median(cuda_time(graph.replay, 50)) * 1e3


def decode_step(args, dtype: torch.dtype, rows: list[dict], sweeps) -> None:
    cfg = smollm2_shaped(args.layers)
    dev = args.device
    rng = np.random.default_rng(args.seed)
    lo, hi = (int(x) for x in args.ctx.split("-"))
    ctx = rng.integers(lo, hi + 1, args.seqs).tolist()
    bs = 16
    need = [-(-c // bs) for c in ctx]
    num_blocks = sum(need) + 64
    perm = rng.permutation(num_blocks)
    tables, start = [], 0
    for n in need:
        tables.append(perm[start : start + n])
        start += n
    ids = rng.integers(100, cfg.vocab_size, args.seqs).tolist()
    models = {
        b: random_model(cfg, seed=args.seed, attention_backend=b).to(dev, dtype)
        for b in ("padded", "triton")
    }
    pool = models["padded"].make_kv_pool(num_blocks, bs)
    for t in (*pool.k, *pool.v):
        t.normal_()
    weight_bytes = sum(p.numel() * p.element_size() for p in models["padded"].parameters())
    kv_bytes = sum(ctx) * 2 * cfg.num_layers * cfg.num_kv_heads * cfg.head_dim * dtype.itemsize
    on_gpu = dev == "cuda"
    bw = copy_bandwidth() if on_gpu else float("nan")
    floor = launch_floor() if on_gpu else float("nan")
    print(
        f"floors: copy bandwidth {bw / 1e12:.2f} TB/s; weights {weight_bytes / 2**20:.0f} MiB "
        f"-> {weight_bytes / bw * 1e3:.3f} ms; contexts' K/V {kv_bytes / 2**20:.0f} MiB -> "
        f"{kv_bytes / bw * 1e3:.3f} ms; launch floor (1-kernel graph replay) {floor:.3f} ms"
    )
    rows += [
        {"table": "floor", "what": "copy_bandwidth_TBps", "value": round(bw / 1e12, 3)},
        {"table": "floor", "what": "weights_read_ms", "value": round(weight_bytes / bw * 1e3, 4)},
        {"table": "floor", "what": "kv_read_ms", "value": round(kv_bytes / bw * 1e3, 4)},
        {"table": "floor", "what": "graph_launch_ms", "value": round(floor, 4)},
    ]

    def eager(backend: str):
        model = models[backend]

        def run() -> torch.Tensor:
            batch = ForwardBatch.build(
                ids, [1] * len(ids), ctx, tables, block_size=bs, num_blocks=num_blocks,
                backend=backend, group_size=cfg.group_size, device=dev,
            )  # fmt: skip
            return model(batch, pool)

        return run

    # the yardstick for every dtype: the same weights and K/V in float32, padded backend
    ref_model = random_model(cfg, seed=args.seed, attention_backend="padded").to(dev)
    ref_pool = ref_model.make_kv_pool(num_blocks, bs)
    for dst, src in zip((*ref_pool.k, *ref_pool.v), (*pool.k, *pool.v), strict=True):
        dst.copy_(src)
    ref_batch = ForwardBatch.build(
        ids, [1] * len(ids), ctx, tables, block_size=bs, num_blocks=num_blocks,
        backend="padded", group_size=cfg.group_size, device=dev,
    )  # fmt: skip
    reference = ref_model(ref_batch, ref_pool).float()
    del ref_model, ref_pool
    decode_attention(args, dtype, pool, ids, ctx, tables, rows, sweeps)

    t0 = time.perf_counter()
    graphs = DecodeGraphs(models["triton"], pool, args.seqs, hi + 1, capture=on_gpu)
    capture = time.perf_counter() - t0
    runs = {
        "padded": eager("padded"),
        "triton": eager("triton"),
        "triton+graphs": lambda: graphs.run(ids, ctx, tables),
    }
    logits = {name: fn().float().clone() for name, fn in runs.items()}
    base = None
    print(
        f"decode step, {args.seqs} seqs, contexts {lo}-{hi} (mean {np.mean(ctx):.0f}), "
        f"{str(dtype)[6:]}; graphs captured for {graphs.sizes} in {capture:.2f} s"
    )
    for name, fn in runs.items():
        ts = cuda_time(fn, args.repeats)
        med = statistics.median(ts) * 1e3
        base = base or med
        diff = float((logits[name] - reference).abs().max())
        agree = float((logits[name].argmax(-1) == reference.argmax(-1)).float().mean())
        print(
            f"  {name:<14} {med:8.3f} ms  [{min(ts) * 1e3:.3f}-{max(ts) * 1e3:.3f}]  "
            f"{base / med:6.2f}x padded  vs fp32 padded: max|logit diff| {diff:.2e}, "
            f"argmax agrees {agree:.0%}"
        )
        rows.append(
            {"table": "decode", "what": name, "dtype": str(dtype)[6:], "seqs": args.seqs,
             "ctx": args.ctx, "median_ms": round(med, 4), "min_ms": round(min(ts) * 1e3, 4),
             "max_ms": round(max(ts) * 1e3, 4), "vs_padded": round(base / med, 3),
             "max_logit_diff_vs_fp32": diff, "argmax_agree_vs_fp32": agree,
             "capture_s": round(capture, 3) if "graphs" in name else ""}
        )  # fmt: skip
    if args.profile:
        profile_step(runs["triton+graphs"], f"{str(dtype)[6:]} triton+graphs", rows)


def profile_step(fn, label: str, rows: list[dict], steps: int = 5) -> None:
    """Where a step's time goes, kernel by kernel: ``torch.profiler`` over ``steps`` calls
    of ``fn``; prints the top kernels by device time and adds a ``profile`` row for each
    (milliseconds per step). On the CPU (a dry run) it ranks CPU ops instead."""
    from torch.profiler import ProfilerActivity, profile

    on_gpu = torch.cuda.is_available()
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if on_gpu else [])
    fn()
    sync()
    with profile(activities=activities) as prof:
        for _ in range(steps):
            fn()
        sync()
    key = "self_device_time_total" if on_gpu else "self_cpu_time_total"
    events = sorted(prof.key_averages(), key=lambda e: getattr(e, key), reverse=True)
    total = sum(getattr(e, key) for e in events) / steps / 1e3
    print(f"profile, {label}: {total:.3f} ms of {key} per step, top kernels:")
    for e in events[:15]:
        ms = getattr(e, key) / steps / 1e3
        if ms <= 0:
            break
        print(f"  {ms:8.4f} ms  {e.count // steps:5d} calls/step  {e.key[:90]}")
        rows.append(
            {"table": "profile", "what": e.key[:200], "dtype": label, "median_ms": round(ms, 5),
             "calls_per_step": e.count // steps}
        )  # fmt: skip


def decode_attention(args, dtype, pool, ids, ctx, tables, rows: list[dict], sweeps) -> None:
    """One layer's decode attention alone: padded vs triton (and, with --sweep, its configs).

    Times are ``kernel_time`` (device time, launch hidden); a sweep records each
    config's time in ``sweeps`` for ``best_config``.
    """
    import radixkv.model.triton_attention as tk

    dev, bs, n = args.device, pool.block_size, len(ids)
    q = torch.randn(n, HEADS, HEAD_DIM, device=dev, dtype=dtype)
    k_cache, v_cache = pool.k[0], pool.v[0]
    padded = AttentionMetadata.build(
        [1] * n, ctx, tables, block_size=bs, group_size=HEADS // KV_HEADS, backend="padded",
        device=dev,
    )  # fmt: skip
    want = paged_attention(q, k_cache, v_cache, padded).float()
    t_pad = kernel_time(partial(paged_attention, q, k_cache, v_cache, padded), args.repeats)
    kind = 4 if dtype == torch.float32 else 2
    default = (dict(tk.DECODE_CONFIGS[kind]), tk.SPLIT_LEN)
    variants = [default]
    if args.sweep:
        variants += [v for v in DECODE_SWEEP if v != default]
    width = max(len(t) for t in tables)
    bt = np.zeros((n, width), dtype=np.int64)
    for i, t in enumerate(tables):
        bt[i, : len(t)] = t
    timings = sweeps.setdefault(("decode", kind), {}).setdefault(f"{n}x{args.ctx}", {})
    for config, split_len in variants:
        tk.DECODE_CONFIGS[kind], tk.SPLIT_LEN = config, split_len
        meta = tk.TritonAttention(
            query_starts=torch.arange(n, device=dev), query_lens=torch.ones(n, dtype=torch.long,
            device=dev), context_lens=torch.tensor(ctx, device=dev),
            block_tables=torch.from_numpy(bt).to(dev), block_size=bs, max_query_len=1,
            max_splits=decode_splits(max(ctx)),
        )  # fmt: skip
        label = f"{config} split {split_len}" + (
            " (default)" if (config, split_len) == default else ""
        )
        try:
            got = meta.attend(q, k_cache, v_cache).float()
            t = kernel_time(partial(meta.attend, q, k_cache, v_cache), args.repeats)
        except Exception as exc:  # noqa: BLE001 - a config may not fit the chip
            print(f"  decode config {label}: failed ({type(exc).__name__})")
            continue
        err = float((got - want).norm() / want.norm())
        timings[repr((config, split_len))] = t
        print(
            f"decode attention, one layer, {n} seqs, {str(dtype)[6:]}: padded {t_pad:.4f} ms, "
            f"triton {label} {t:.4f} ms ({t_pad / t:.1f}x); rel err vs padded {err:.1e}"
        )
        rows.append(
            {"table": "decode_attention", "what": f"triton {label}", "dtype": str(dtype)[6:],
             "kernel_ms": round(t, 5), "padded_kernel_ms": round(t_pad, 5),
             "rel_err_vs_padded": err}
        )  # fmt: skip
    tk.DECODE_CONFIGS[kind], tk.SPLIT_LEN = default


def prefill_attention(args, dtype: torch.dtype, rows: list[dict], sweeps) -> None:
    """One layer's prefill attention: triton (paged) vs dense SDPA (unpaged) vs padded (paged).

    Each is timed twice: ``event_time`` (Python launches it, as the engine's eager
    prefill does) and ``kernel_time`` (device time alone): the kernels' own ratio.
    """
    dev = args.device
    gen = torch.Generator(device=dev).manual_seed(args.seed)
    bs = 16
    shapes = [tuple(int(x) for x in shape.split("x")) for shape in args.prefill_shapes.split(",")]
    for batch, length in shapes:
        nb = batch * (length // bs)
        perm = torch.randperm(nb + 8, device=dev, generator=gen)[:nb].view(batch, -1)
        k_cache = torch.randn((nb + 8) * bs, KV_HEADS, HEAD_DIM, device=dev, dtype=dtype)
        v_cache = torch.randn_like(k_cache)
        q = torch.randn(batch * length, HEADS, HEAD_DIM, device=dev, dtype=dtype)
        lens = torch.full((batch,), length, device=dev)
        meta = TritonAttention(
            query_starts=torch.arange(batch, device=dev) * length,
            query_lens=lens,
            context_lens=lens,
            block_tables=perm,
            block_size=bs,
            max_query_len=length,
            max_splits=decode_splits(length),
        )
        # the same kernel over pages in order (block i of sequence s is s * n + i): what the
        # scattered tables cost over contiguous memory (the values read differ; the time not)
        contiguous = TritonAttention(
            query_starts=meta.query_starts, query_lens=lens, context_lens=lens,
            block_tables=torch.arange(nb, device=dev).view(batch, -1), block_size=bs,
            max_query_len=length, max_splits=meta.max_splits,
        )  # fmt: skip
        # the dense call reads the same K/V, laid out contiguously per sequence
        pos = torch.arange(length, device=dev)
        slots = (perm[:, pos // bs] * bs + pos % bs).reshape(-1)
        kd = k_cache[slots].view(batch, length, KV_HEADS, HEAD_DIM).transpose(1, 2).contiguous()
        vd = v_cache[slots].view(batch, length, KV_HEADS, HEAD_DIM).transpose(1, 2).contiguous()
        qd = q.view(batch, length, HEADS, HEAD_DIM).transpose(1, 2).contiguous()
        padded = AttentionMetadata.build(
            [length] * batch, [length] * batch, [t.cpu().numpy() for t in perm],
            block_size=bs, group_size=HEADS // KV_HEADS, backend="padded", device=dev,
        )  # fmt: skip
        import radixkv.model.triton_attention as tk

        kind = 4 if dtype == torch.float32 else 2
        default = dict(tk.PREFILL_CONFIGS[kind])
        timings = sweeps.setdefault(("prefill", kind), {}).setdefault(f"{batch}x{length}", {})
        for config in [default] + (
            [c for c in PREFILL_SWEEP if c != default] if args.sweep else []
        ):
            tk.PREFILL_CONFIGS[kind] = config
            try:
                t = kernel_time(partial(meta.attend, q, k_cache, v_cache), args.repeats)
            except Exception as exc:  # noqa: BLE001 - a config may not fit the chip
                print(f"  sweep {config}: failed ({type(exc).__name__})")
                continue
            timings[repr(config)] = t
            if args.sweep:
                print(f"  sweep prefill {batch}x{length} {str(dtype)[6:]} {config}: {t:.4f} ms")
                rows.append(
                    {"table": "prefill_sweep", "what": str(config), "dtype": str(dtype)[6:],
                     "shape": f"{batch}x{length}", "kernel_ms": round(t, 4)}
                )  # fmt: skip
        tk.PREFILL_CONFIGS[kind] = default
        fns = {
            "sdpa_dense": partial(
                F.scaled_dot_product_attention, qd, kd, vd, is_causal=True, enable_gqa=True
            ),
            "triton": partial(meta.attend, q, k_cache, v_cache),
            "triton_contiguous": partial(contiguous.attend, q, k_cache, v_cache),
            "padded": partial(paged_attention, q, k_cache, v_cache, padded),
        }
        ref = fns["sdpa_dense"]().transpose(1, 2).reshape(batch * length, -1).float()
        got = fns["triton"]().float()
        err = float((got - ref).norm() / ref.norm())
        times = {name: event_time(fn, args.repeats) for name, fn in fns.items()}
        kernel = {name: kernel_time(fn, args.repeats) for name, fn in fns.items()}
        tokens = batch * length
        for label, t in (("launched", times), ("kernels", kernel)):
            line = ", ".join(
                f"{n} {ms:.3f} ms ({tokens / ms / 1e3:.2f} Mtok/s)" for n, ms in t.items()
            )
            print(
                f"prefill attention {batch}x{length} {str(dtype)[6:]}, {label}: {line}; "
                f"triton / dense {t['sdpa_dense'] / t['triton']:.2f}"
            )
        print(f"  rel err vs dense {err:.1e}")
        for name in fns:
            rows.append(
                {"table": "prefill", "what": name, "dtype": str(dtype)[6:],
                 "shape": f"{batch}x{length}", "median_ms": round(times[name], 4),
                 "mtok_s": round(tokens / times[name] / 1e3, 3),
                 "vs_dense": round(times["sdpa_dense"] / times[name], 3),
                 "kernel_ms": round(kernel[name], 4),
                 "kernel_vs_dense": round(kernel["sdpa_dense"] / kernel[name], 3),
                 "rel_err_vs_dense": err}
            )  # fmt: skip


def choose_configs(sweeps, rows: list[dict]) -> dict:
    """Per kernel and dtype size, the swept config that ``best_config`` picks; printed and
    recorded as ``chosen`` rows. Returns ``{"prefill": {size: config}, "decode": {size: [config,
    split_len]}}`` (JSON-ready), for ``--configs`` of a later run."""
    chosen: dict = {"prefill": {}, "decode": {}}
    for (kernel, size), timings in sorted(sweeps.items()):
        if not timings or min(len(t) for t in timings.values()) < 2:
            continue  # nothing was swept
        pick = best_config(timings)
        chosen[kernel][str(size)] = ast.literal_eval(pick)
        for shape, t in timings.items():
            print(
                f"chosen {kernel} config for {size}-byte pools: {pick}; on {shape} "
                f"{t[pick]:.4f} ms, {t[pick] / min(t.values()):.2f}x the best there"
            )
            rows.append(
                {"table": "chosen", "what": f"{kernel} {pick}", "dtype": f"{size}-byte",
                 "shape": shape, "kernel_ms": round(t[pick], 5),
                 "vs_best": round(t[pick] / min(t.values()), 3)}
            )  # fmt: skip
    return chosen


def apply_configs(path: Path) -> None:
    """Set the triton kernels' launch configs to those a ``--save-configs`` run chose."""
    import radixkv.model.triton_attention as tk

    chosen = json.loads(path.read_text())
    for size, config in chosen.get("prefill", {}).items():
        tk.PREFILL_CONFIGS[int(size)] = config
    for size, (config, split_len) in chosen.get("decode", {}).items():
        tk.DECODE_CONFIGS[int(size)] = config
        tk.SPLIT_LEN = split_len
    print(
        f"configs from {path}: prefill {tk.PREFILL_CONFIGS}, decode {tk.DECODE_CONFIGS}, "
        f"split {tk.SPLIT_LEN}"
    )


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--seqs", type=int, default=32)
    ap.add_argument("--ctx", default="1024-2048", help="decode contexts drawn from LO-HI")
    ap.add_argument("--dtypes", default="float32,bfloat16")
    ap.add_argument("--repeats", type=int, default=20)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--layers", type=int, default=30)
    ap.add_argument("--skip-prefill", action="store_true")
    ap.add_argument("--sweep", action="store_true", help="also time other kernel configs")
    ap.add_argument(
        "--profile", action="store_true", help="also rank the graphed step's kernels by time"
    )
    ap.add_argument(
        "--prefill-shapes", default="4x1024,1x4096,16x512", help="SEQSxLEN,... (dry run: 2x48)"
    )
    ap.add_argument(
        "--save-configs",
        type=Path,
        default=None,
        help="with --sweep: write the configs chosen on these shapes as JSON",
    )
    ap.add_argument(
        "--configs",
        type=Path,
        default=None,
        help="run with the configs a --save-configs run chose (held-out check)",
    )
    ap.add_argument("--out", type=Path, default=None)
    args = ap.parse_args()
    if args.device == "cuda" and not torch.cuda.is_available():
        raise SystemExit("bench_decode.py needs a CUDA device (or --device cpu, a dry run)")
    where = torch.cuda.get_device_name() if args.device == "cuda" else "CPU (dry run)"
    print(f"{where}, torch {torch.__version__}")
    if args.configs is not None:
        apply_configs(args.configs)
    rows: list[dict] = []
    sweeps: dict = {}
    for name in args.dtypes.split(","):
        dtype = DTYPES[name]
        decode_step(args, dtype, rows, sweeps)
        if not args.skip_prefill:
            prefill_attention(args, dtype, rows, sweeps)
        torch.cuda.empty_cache()
    chosen = choose_configs(sweeps, rows)
    if args.save_configs is not None:
        args.save_configs.write_text(json.dumps(chosen, indent=1))
        print(f"chosen configs written to {args.save_configs}")
    save_rows(rows, args.out, "decode_cuda.csv")


if __name__ == "__main__":
    main()
