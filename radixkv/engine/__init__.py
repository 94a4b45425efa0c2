"""The engine tier: requests, their blocks, continuous batching and generation.

Bookkeeping (:mod:`~radixkv.engine.request`, :mod:`~radixkv.engine.scheduler`,
:mod:`~radixkv.engine.stats`, and the cache tier's
:class:`~radixkv.cache.manager.KVCacheManager`, re-exported here) works on plain ints
and numpy and imports without torch; :mod:`~radixkv.engine.engine` runs the model
(with :mod:`~radixkv.engine.model_runner` and :mod:`~radixkv.engine.sampler`). Its
names (``Engine``, ``EngineConfig``, ...) load on first use, so ``from radixkv.engine
import KVCacheManager`` works where torch is not installed.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

from radixkv.cache.manager import CACHE_KINDS, KVCacheManager, make_cache
from radixkv.engine.request import Request, RequestStats, SamplingParams
from radixkv.engine.scheduler import ADMISSION_POLICIES, Scheduler, SchedulerConfig
from radixkv.engine.stats import EngineStats

if TYPE_CHECKING:
    from radixkv.engine.engine import Completion, Engine, EngineConfig, build_forward_batch

_TORCH_NAMES = ("Completion", "Engine", "EngineConfig", "build_forward_batch")

__all__ = [
    "ADMISSION_POLICIES",
    "CACHE_KINDS",
    "Completion",
    "Engine",
    "EngineConfig",
    "EngineStats",
    "KVCacheManager",
    "Request",
    "RequestStats",
    "SamplingParams",
    "Scheduler",
    "SchedulerConfig",
    "build_forward_batch",
    "make_cache",
]


def __getattr__(name: str) -> Any:
    if name in _TORCH_NAMES:
        return getattr(importlib.import_module("radixkv.engine.engine"), name)
    raise AttributeError(f"module 'radixkv.engine' has no attribute {name!r}")
