"""Sweeps: every (policy, capacity, lower tiers) over one trace, with the infinite-cache ceiling.

``run_sweep`` returns one ``SweepRow`` per configuration: each policy at each
device capacity, and for the radix policies at each (host, store) pair of
lower tiers (``host_capacities`` x ``store_capacities``, a store only under a
host). ``write_csv`` and ``plot_sweep`` turn rows into a CSV and a PNG (token
hit rate, every tier's hits counted, vs device capacity: one line per policy
and tiers, the ceiling dashed). matplotlib (the ``plot`` extra) is imported
only to plot; ``can_plot`` says whether it is installed.
"""

from __future__ import annotations

import csv
import importlib.util
import os
import time
from collections.abc import Sequence
from dataclasses import asdict, dataclass, fields

from radixkv.replay.config import RADIX_POLICIES, ReplayConfig
from radixkv.replay.replay import ReplayResult, replay
from radixkv.replay.trace import Trace

__all__ = [
    "CEILING_POLICY",
    "SweepRow",
    "can_plot",
    "ceiling_row",
    "plot_sweep",
    "read_csv",
    "run_sweep",
    "sweep_configs",
    "write_csv",
]

CEILING_POLICY = "infinite"


@dataclass(frozen=True)
class SweepRow:
    """One replay's totals, flat enough for a CSV line.

    ``overall_hit_rate`` is the device's; ``combined_hit_rate`` counts the host's
    and the store's hits too (equal without lower tiers).
    """

    trace: str
    policy: str
    capacity: int
    block_size: int
    small_ratio: float
    max_freq: int
    num_requests: int
    total_prompt_tokens: int
    total_hit_tokens: int
    overall_hit_rate: float
    final_cache_blocks: int
    block_hits: int
    block_misses: int
    unreachable_blocks: int
    seconds: float
    host_capacity: int = 0
    store_capacity: int = 0
    store_write_policy: str = "write_back"
    total_host_hit_tokens: int = 0
    total_store_hit_tokens: int = 0
    combined_hit_rate: float = 0.0

    @classmethod
    def from_result(cls, trace: str, result: ReplayResult, seconds: float) -> SweepRow:
        c = result.config
        return cls(
            trace=trace,
            policy=c.policy,
            capacity=c.capacity,
            block_size=c.block_size,
            small_ratio=c.small_ratio,
            max_freq=c.max_freq,
            num_requests=result.num_requests,
            total_prompt_tokens=result.total_prompt_tokens,
            total_hit_tokens=result.total_hit_tokens,
            overall_hit_rate=result.overall_hit_rate,
            final_cache_blocks=result.final_cache_blocks,
            block_hits=result.block_hits,
            block_misses=result.block_misses,
            unreachable_blocks=result.unreachable_blocks,
            seconds=seconds,
            host_capacity=c.host_capacity,
            store_capacity=c.store_capacity,
            store_write_policy=c.store_write_policy,
            total_host_hit_tokens=result.total_host_hit_tokens,
            total_store_hit_tokens=result.total_store_hit_tokens,
            combined_hit_rate=result.combined_hit_rate,
        )


def _trace_name(trace: Trace) -> str:
    return os.path.basename(trace.source)


def ceiling_row(trace: Trace, block_size: int = 512) -> SweepRow:
    """The infinite-cache ceiling: LRU with room for every distinct id, so nothing is evicted.

    Its ``policy`` is ``"infinite"`` and ``capacity`` the number of distinct ids.
    """
    start = time.perf_counter()
    result = replay(trace, "lru", max(trace.num_ids, 1), block_size)
    row = SweepRow.from_result(_trace_name(trace), result, time.perf_counter() - start)
    return SweepRow(**{**asdict(row), "policy": CEILING_POLICY})


def sweep_configs(
    policies: Sequence[str],
    capacities: Sequence[int],
    *,
    block_size: int = 512,
    small_ratio: float = 0.1,
    max_freq: int = 3,
    host_capacities: Sequence[int] = (0,),
    store_capacities: Sequence[int] = (0,),
    store_write_policy: str = "write_back",
) -> list[ReplayConfig]:
    """The configurations a sweep replays, in order: policy, then capacity, then host, then store.

    A radix policy runs at every (host, store) pair except a store with no host
    (a store sits below a host tier); a flat policy has no lower tiers and runs
    once per capacity. ``ValueError`` naming ``store_capacities`` when a store is
    asked for but no host capacity is above 0; otherwise ``ValueError`` /
    ``TypeError`` as ``ReplayConfig``, for the first bad configuration.
    Complexity: O(configurations).
    """
    if any(store_capacities) and not any(host_capacities):
        raise ValueError(
            "store_capacities needs a host capacity above 0 (a store sits below a host tier), "
            f"got host_capacities {list(host_capacities)}"
        )
    tiers = [(h, s) for h in host_capacities for s in store_capacities if h or not s]
    configs = []
    for p in policies:
        for c in capacities:
            for h, s in tiers if p in RADIX_POLICIES else [(0, 0)]:
                configs.append(
                    ReplayConfig(p, c, block_size, small_ratio, max_freq, h, s, store_write_policy)
                )
    return configs


def run_sweep(
    trace: Trace,
    policies: Sequence[str],
    capacities: Sequence[int],
    *,
    block_size: int = 512,
    small_ratio: float = 0.1,
    max_freq: int = 3,
    host_capacities: Sequence[int] = (0,),
    store_capacities: Sequence[int] = (0,),
    store_write_policy: str = "write_back",
    progress: bool = True,
) -> list[SweepRow]:
    """Replay ``trace`` for every configuration of ``sweep_configs``, in that order; one row each.

    Every configuration is validated before the first replay (``ValueError`` /
    ``TypeError`` then, nothing run). With ``progress``, a tqdm bar on stderr.
    The defaults (no host, no store) are the one-tier sweep. Complexity: the sum
    of the replays'.
    """
    configs = sweep_configs(
        policies,
        capacities,
        block_size=block_size,
        small_ratio=small_ratio,
        max_freq=max_freq,
        host_capacities=host_capacities,
        store_capacities=store_capacities,
        store_write_policy=store_write_policy,
    )
    name = _trace_name(trace)
    rows = []
    bar = None
    if progress:
        from tqdm import tqdm

        bar = tqdm(total=len(configs), desc=f"sweep {name}", unit="replay")
    try:
        for c in configs:
            if bar is not None:
                bar.set_postfix_str(
                    f"{_label(c.policy, c.host_capacity, c.store_capacity)} @ {c.capacity}"
                )
            start = time.perf_counter()
            result = replay(
                trace,
                c.policy,
                c.capacity,
                c.block_size,
                c.small_ratio,
                c.max_freq,
                c.host_capacity,
                c.store_capacity,
                c.store_write_policy,
            )
            rows.append(SweepRow.from_result(name, result, time.perf_counter() - start))
            if bar is not None:
                bar.update(1)
    finally:
        if bar is not None:
            bar.close()
    return rows


def _label(policy: str, host_capacity: int, store_capacity: int) -> str:
    """``policy``, then ``+ host N`` and ``+ store N`` for the lower tiers it has."""
    label = policy
    if host_capacity:
        label += f" + host {host_capacity}"
    if store_capacity:
        label += f" + store {store_capacity}"
    return label


def write_csv(rows: Sequence[SweepRow], path: str | os.PathLike[str]) -> None:
    """Write rows with a header line (the ``SweepRow`` field names)."""
    names = [f.name for f in fields(SweepRow)]
    with open(path, "w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=names)
        writer.writeheader()
        for row in rows:
            writer.writerow(asdict(row))


def read_csv(path: str | os.PathLike[str]) -> list[SweepRow]:
    """Rows written by ``write_csv`` (the ceiling row included, policy ``"infinite"``)."""
    types = {f.name: f.type for f in fields(SweepRow)}
    convert = {"int": int, "float": float, "str": str}
    with open(path, newline="") as f:
        return [
            SweepRow(**{k: convert[types[k]](v) for k, v in row.items()})
            for row in csv.DictReader(f)
        ]


def can_plot() -> bool:
    """Whether matplotlib can be imported (``pip install 'radixkv[plot]'``); imports nothing."""
    try:
        return importlib.util.find_spec("matplotlib") is not None
    except (ImportError, ValueError):
        return False


def plot_sweep(
    rows: Sequence[SweepRow],
    ceiling: SweepRow | None,
    path: str | os.PathLike[str],
    title: str | None = None,
) -> None:
    """Token hit rate (``combined_hit_rate``: every tier's hits) vs device capacity (log2 x
    axis), one line per policy and lower tiers, the ceiling dashed black.

    One tier is a solid line with circles, two (a host tier) dashed with squares,
    three (and a store) dash-dotted with diamonds, so three-tier rates read against
    the two- and one-tier ones. Writes a PNG to ``path``. ``ModuleNotFoundError``
    without matplotlib (see ``can_plot``).
    """
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7.5, 4.5), dpi=120)
    lines = list(dict.fromkeys((r.policy, r.host_capacity, r.store_capacity) for r in rows))
    styles = {1: ("-", "o"), 2: ("--", "s"), 3: ("-.", "D")}
    for policy, host, store in lines:
        pts = sorted(
            (r.capacity, r.combined_hit_rate)
            for r in rows
            if (r.policy, r.host_capacity, r.store_capacity) == (policy, host, store)
        )
        xs, ys = zip(*pts, strict=True)
        style, marker = styles[1 + (host > 0) + (store > 0)]
        label = _label(policy, host, store)
        ax.plot(xs, ys, linestyle=style, marker=marker, label=label, linewidth=1.5)
    if ceiling is not None:
        ax.axhline(
            ceiling.overall_hit_rate,
            color="black",
            linestyle="--",
            linewidth=1,
            label=f"infinite cache ({ceiling.overall_hit_rate:.4f})",
        )
    ax.set_xscale("log", base=2)
    ax.set_xlabel("device cache capacity (blocks)")
    ax.set_ylabel("token hit rate (every tier)")
    ax.set_ylim(bottom=0)
    ax.grid(True, which="major", alpha=0.3)
    ax.set_title(title or (rows[0].trace if rows else "sweep"))
    ax.legend(loc="lower right", fontsize=8)
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)
