"""The acceptance tasks' datasets, read from the JSONL files beside this module (not the
hub, which is unreachable here): lm-eval calls these through ``custom_dataset``."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import datasets

HERE = Path(__file__).resolve().parent


def _test_split(name: str) -> dict[str, datasets.Dataset]:
    """``{"test": <the docs of HERE/name>}``; lm-eval reads the split named in the YAML."""
    path = HERE / name
    return {"test": datasets.Dataset.from_json(str(path), split=datasets.Split.TEST)}


def load_mc(**_metadata: Any) -> dict[str, datasets.Dataset]:
    """The multiple-choice docs (``radixkv_mc.jsonl``); lm-eval's metadata is ignored."""
    return _test_split("radixkv_mc.jsonl")


def load_gen(**_metadata: Any) -> dict[str, datasets.Dataset]:
    """The generate_until docs (``radixkv_gen.jsonl``); lm-eval's metadata is ignored."""
    return _test_split("radixkv_gen.jsonl")
