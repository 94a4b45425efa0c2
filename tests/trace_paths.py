"""Where the replay tests find the Mooncake traces: the full ones when present, else excerpts.

The full traces are looked for in the folder ``$RADIXKV_TRACES`` names, else in
``../shared/data/traces`` beside the checkout (CI's layout). When both files are
there, :data:`TRACES` is that folder and :data:`FULL_TRACES` is true; otherwise
:data:`TRACES` is ``tests/data/mooncake``, the excerpts shipped with the repository
(the first 500 conversation requests, the last 500 synthetic ones; their source,
licence and figures are in its README). Tests whose figures hold only on the full
traces carry :data:`needs_full_traces`; the rest pick their expected figures by
:data:`FULL_TRACES`.
"""

import os
from pathlib import Path

import pytest

TRACE_NAMES = ("conversation", "synthetic")
EXCERPTS = Path(__file__).resolve().parent / "data" / "mooncake"
FULL_TRACES_DIR = Path(
    os.environ.get("RADIXKV_TRACES")
    or Path(__file__).resolve().parents[2] / "shared" / "data" / "traces"
)
FULL_TRACES = all((FULL_TRACES_DIR / f"{n}_trace.jsonl").is_file() for n in TRACE_NAMES)
TRACES = FULL_TRACES_DIR if FULL_TRACES else EXCERPTS

needs_full_traces = pytest.mark.skipif(
    not FULL_TRACES,
    reason=f"figures of the full Mooncake traces, not in {FULL_TRACES_DIR} (set RADIXKV_TRACES)",
)
