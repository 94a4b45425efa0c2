"""The engine tier: requests, their blocks, continuous batching and generation.

Bookkeeping (:mod:`~radixkv.engine.request`, :mod:`~radixkv.engine.scheduler`) works
on plain ints and numpy; only :mod:`~radixkv.engine.engine` touches tensors.
"""

from radixkv.engine.engine import (
    CACHE_KINDS,
    Completion,
    Engine,
    EngineConfig,
    EngineStats,
    build_forward_batch,
    make_cache,
)
from radixkv.engine.request import Request, RequestStats, SamplingParams

__all__ = [
    "CACHE_KINDS",
    "Completion",
    "Engine",
    "EngineConfig",
    "EngineStats",
    "Request",
    "RequestStats",
    "SamplingParams",
    "build_forward_batch",
    "make_cache",
]
