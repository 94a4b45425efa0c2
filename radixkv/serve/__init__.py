"""The serving tier: engines behind OpenAI's HTTP API, one on this process or a fleet on Ray Serve.

Three rooms:

- :mod:`radixkv.serve.openai`: the OpenAI layer, torch-free (fastapi, pydantic,
  prometheus_client): request and response shapes, errors, the request handling over an
  engine client and the records it reads from an engine (``RequestOutput``,
  ``EngineMetrics``), Prometheus text.
- The one-engine server (torch): :mod:`~radixkv.serve.async_engine` runs an
  :class:`~radixkv.engine.Engine` on a thread of its own for asyncio code
  (:mod:`~radixkv.serve.worker` is that thread, :mod:`~radixkv.serve.stream` what a caller
  iterates); :mod:`~radixkv.serve.app` is the FastAPI app over it;
  :mod:`~radixkv.serve.models` builds the engine over what ``--model`` names
  (``load_model`` is :func:`radixkv.model.loading.load_model`); :mod:`~radixkv.serve.cli`
  is ``radixkv serve``.
- :mod:`radixkv.serve.ray`: the fleet on Ray Serve (deployments, the ingress, Serve's request
  router); its routing state and event feed are plain fleet-tier objects
  (:mod:`radixkv.fleet.routing_state`, :mod:`radixkv.fleet.event_feed`).

Needs the ``serve`` extra (and ``engine`` for the one-engine server, ``fleet`` for Ray).
Names load on first use, so importing this package (as the ``radixkv`` command does) costs
nothing.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from radixkv.model.loading import load_model
    from radixkv.serve.app import build_app
    from radixkv.serve.async_engine import AsyncEngine
    from radixkv.serve.models import build_engine
    from radixkv.serve.openai.client import EngineMetrics, RequestOutput

_NAMES = {
    "AsyncEngine": "radixkv.serve.async_engine",
    "EngineMetrics": "radixkv.serve.openai.client",
    "RequestOutput": "radixkv.serve.openai.client",
    "build_app": "radixkv.serve.app",
    "build_engine": "radixkv.serve.models",
    "load_model": "radixkv.model.loading",
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
