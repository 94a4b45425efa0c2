"""What the benchmark scripts share: writing result rows as CSV, and a host-side step."""

from __future__ import annotations

import csv
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np

if TYPE_CHECKING:  # the torch-free benchmarks import this module too
    from radixkv.model import ForwardBatch, KVPool


def save_rows(rows: list[dict], out: Path | None, tracked_name: str) -> None:
    """Write ``rows`` to ``out`` when the run was given ``--out``; else only say how.

    Benchmarks never write by default: the CSVs under ``benchmarks/results/`` are
    tracked, so a run records its numbers only when asked (``tracked_name`` is the
    file there that this kind of run reproduces).
    """
    if out is None:
        print(f"(no CSV written: --out benchmarks/results/{tracked_name} records this run)")
    else:
        write_csv(rows, out)


def write_csv(rows: list[dict], path: Path) -> None:
    """Write ``rows`` to ``path`` (folders made as needed); columns in order of first appearance."""
    names = list(dict.fromkeys(k for row in rows for k in row))
    path.parent.mkdir(parents=True, exist_ok=True)
    with path.open("w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=names)
        writer.writeheader()
        writer.writerows(rows)
    print(f"wrote {path}")


@dataclass(frozen=True)
class Step:
    """One scheduler step on the host: what ``ForwardBatch.build`` takes."""

    input_ids: np.ndarray
    query_lens: list[int]
    context_lens: list[int]
    block_tables: list[np.ndarray]
    num_blocks: int

    def batch(self, pool: KVPool, backend: str, group_size: int) -> ForwardBatch:
        """The step as ``pool``'s batch for ``backend`` (``ForwardBatch.build``)."""
        from radixkv.model import ForwardBatch

        return ForwardBatch.build(
            self.input_ids,
            self.query_lens,
            self.context_lens,
            self.block_tables,
            block_size=pool.block_size,
            num_blocks=pool.num_blocks,
            backend=backend,
            group_size=group_size,
            device=pool.device,
        )
