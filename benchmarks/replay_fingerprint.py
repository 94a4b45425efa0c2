"""A fingerprint of trace replay: every policy, both Mooncake traces, two capacities, with and
without a host tier, one JSON line per configuration (counts, and a SHA-1 of each per-request
array). Deterministic: run it at two revisions and diff the outputs to prove a change kept
replay bit-identical (issue 23's guard for its re-cut).

    python benchmarks/replay_fingerprint.py > after.jsonl          # ~25 s
    python benchmarks/replay_fingerprint.py --traces synthetic --policies lru radix-lru  # a subset
    git stash; python benchmarks/replay_fingerprint.py > before.jsonl; git stash pop
    diff before.jsonl after.jsonl && echo identical

The traces are ``../shared/data/traces/{conversation,synthetic}_trace.jsonl`` beside the
checkout, or in the folder ``$RADIXKV_TRACES`` names. Every configuration is store-off: the
store tier's fields (``store_*`` of the result and of its config, all zeros or None there)
are left out, so the lines compare equal with revisions from before the store tier.
"""

from __future__ import annotations

import argparse
import dataclasses
import hashlib
import json
import os
import sys
from pathlib import Path

import numpy as np

from radixkv.replay import load_trace, replay
from radixkv.replay.config import REPLAY_POLICIES

TRACES = Path(
    os.environ.get("RADIXKV_TRACES")
    or Path(__file__).resolve().parents[2] / "shared" / "data" / "traces"
)
TRACE_NAMES = ("conversation", "synthetic")
CAPACITIES = (300, 3000)
HOST_CAPACITY = 1500


def _encode(value: object) -> object:
    if isinstance(value, np.ndarray):
        digest = hashlib.sha1(np.ascontiguousarray(value).tobytes()).hexdigest()
        return [digest, int(value.sum())]
    return str(value)


def _store_off(fields: dict[str, object]) -> dict[str, object]:
    """``fields`` (a store-off result's) without the store tier's, in the result and its config."""
    out = {k: v for k, v in fields.items() if not k.startswith("store_")}
    config = out["config"]
    if not isinstance(config, dict) or config.get("store_capacity", 0):
        raise ValueError(f"the fingerprint replays store-off configurations only, got {config}")
    out["config"] = {k: v for k, v in config.items() if not k.startswith("store_")}
    return out


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--traces", nargs="+", choices=TRACE_NAMES, default=list(TRACE_NAMES))
    p.add_argument("--policies", nargs="+", choices=REPLAY_POLICIES, default=list(REPLAY_POLICIES))
    return p.parse_args()


def main() -> int:
    args = parse_args()
    for name in args.traces:
        path = TRACES / f"{name}_trace.jsonl"
        if not path.exists():
            print(f"missing trace {path}", file=sys.stderr)
            return 1
        trace = load_trace(path)
        for policy in args.policies:
            for capacity in CAPACITIES:
                hosts = (0, HOST_CAPACITY) if policy.startswith("radix") else (0,)
                for host in hosts:
                    result = replay(trace, policy, capacity, host_capacity=host)
                    row = {"trace": name, "policy": policy, "cap": capacity, "host": host}
                    row.update(_store_off(dataclasses.asdict(result)))
                    print(json.dumps(row, sort_keys=True, default=_encode), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
