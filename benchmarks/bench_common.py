"""What every benchmark script shares: writing its result rows as CSV."""

from __future__ import annotations

import csv
from pathlib import Path


def write_csv(rows: list[dict], path: Path) -> None:
    """Write ``rows`` to ``path`` (folders made as needed); columns in order of first appearance."""
    names = list(dict.fromkeys(k for row in rows for k in row))
    path.parent.mkdir(parents=True, exist_ok=True)
    with path.open("w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=names)
        writer.writeheader()
        writer.writerows(rows)
    print(f"wrote {path}")
