"""The serving tier: one engine behind an OpenAI-compatible HTTP server.

:mod:`~radixkv.serve.async_engine` runs an :class:`~radixkv.engine.Engine` on a
thread of its own for asyncio code (:mod:`~radixkv.serve.worker` is that thread,
:mod:`~radixkv.serve.stream` what a caller iterates); :mod:`~radixkv.serve.app` is the FastAPI app
(:mod:`~radixkv.serve.handlers` the OpenAI request handling it shares with the fleet's
ingress, :mod:`~radixkv.serve.choices` a request's choices, :mod:`~radixkv.serve.protocol`
the request shapes, :mod:`~radixkv.serve.responses` the response shapes,
:mod:`~radixkv.serve.text` incremental text and stop strings,
:mod:`~radixkv.serve.metrics` Prometheus text); :mod:`~radixkv.serve.models` loads
what ``--model`` names; :mod:`~radixkv.serve.cli` is ``radixkv serve``. Needs the
``engine`` and ``serve`` extras (torch, fastapi, uvicorn, prometheus_client). Names load
on first use, so importing this package (as the ``radixkv`` command does) costs nothing.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from radixkv.serve.app import build_app
    from radixkv.serve.async_engine import AsyncEngine, EngineMetrics, RequestOutput
    from radixkv.serve.models import build_engine, load_model

_NAMES = {
    "AsyncEngine": "radixkv.serve.async_engine",
    "EngineMetrics": "radixkv.serve.async_engine",
    "RequestOutput": "radixkv.serve.async_engine",
    "build_app": "radixkv.serve.app",
    "build_engine": "radixkv.serve.models",
    "load_model": "radixkv.serve.models",
}

__all__ = [
    "AsyncEngine",
    "EngineMetrics",
    "RequestOutput",
    "build_app",
    "build_engine",
    "load_model",
]


def __getattr__(name: str) -> Any:
    module = _NAMES.get(name)
    if module is None:
        raise AttributeError(f"module 'radixkv.serve' has no attribute {name!r}")
    return getattr(importlib.import_module(module), name)
