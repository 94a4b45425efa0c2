"""The engine tier: requests, their blocks, continuous batching and generation.

Bookkeeping (:mod:`~radixkv.engine.request`, :mod:`~radixkv.engine.scheduler`,
:mod:`~radixkv.engine.stats`, over the cache tier's
:class:`~radixkv.cache.manager.KVCacheManager`) works on plain ints and numpy and
imports without torch; :mod:`~radixkv.engine.engine` runs the model (with
:mod:`~radixkv.engine.model_runner` and :mod:`~radixkv.engine.sampler`). Its names
(``Engine``, ``EngineConfig``, ...) load on first use, so ``from radixkv.engine import
Scheduler`` works where torch is not installed.

``KVCacheManager``, ``make_cache`` and ``CACHE_KINDS`` are imported from ``radixkv``
(the first two) or ``radixkv.cache``; importing them from here still works, with a
``DeprecationWarning``, until the next release.
"""

from __future__ import annotations

import importlib
import warnings
from typing import TYPE_CHECKING, Any

from radixkv.engine.request import Request, RequestStats, SamplingParams
from radixkv.engine.scheduler import SCHEDULE_POLICIES, Scheduler, SchedulerConfig
from radixkv.engine.stats import EngineStats

if TYPE_CHECKING:
    from radixkv.engine.engine import Completion, Engine, EngineConfig, build_forward_batch

_TORCH_NAMES = ("Completion", "Engine", "EngineConfig", "build_forward_batch")
# The cache tier's names this package re-exported before radixkv did (until the next release).
_MOVED_NAMES = {
    "CACHE_KINDS": "radixkv.cache",
    "KVCacheManager": "radixkv",
    "make_cache": "radixkv",
}

__all__ = [
    "SCHEDULE_POLICIES",
    "Completion",
    "Engine",
    "EngineConfig",
    "EngineStats",
    "Request",
    "RequestStats",
    "SamplingParams",
    "Scheduler",
    "SchedulerConfig",
    "build_forward_batch",
]


def __getattr__(name: str) -> Any:
    if name in _TORCH_NAMES:
        return getattr(importlib.import_module("radixkv.engine.engine"), name)
    if name in _MOVED_NAMES:
        home = _MOVED_NAMES[name]
        warnings.warn(
            f"radixkv.engine.{name} is deprecated and goes in the next release: "
            f"import it from {home}",
            DeprecationWarning,
            stacklevel=2,
        )
        return getattr(importlib.import_module("radixkv.cache"), name)
    raise AttributeError(f"module 'radixkv.engine' has no attribute {name!r}")
