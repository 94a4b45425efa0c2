"""The prefix routers alive in this process, so the process that hosts one can report its state.

Serve unpickles a deployment's request router class *by value*: the
:class:`~radixkv.serve.ray.request_router.PrefixRouter` running in a process is a
copy whose module globals are its own, and ``isinstance`` against the class
imported normally is False. This module is imported normally by both sides,
so its registry is the one place where the ingress that holds a handle can
find the router Serve built for that handle.
"""

from __future__ import annotations

import threading
import weakref
from typing import Any

__all__ = ["live_routers", "register"]

_routers: weakref.WeakSet[Any] = weakref.WeakSet()
_lock = threading.Lock()


def register(router: Any) -> None:
    """Record ``router`` (held weakly: it leaves the registry when it is garbage collected)."""
    with _lock:
        _routers.add(router)


def live_routers(deployment_name: str | None = None, app_name: str | None = None) -> list[Any]:
    """The live registered routers of ``deployment_name`` in ``app_name`` (None: any), in no
    particular order. Each has ``deployment_id`` (Serve's) and ``snapshot_threadsafe()``."""
    with _lock:
        routers = list(_routers)
    return [
        r
        for r in routers
        if (deployment_name is None or r.deployment_id.name == deployment_name)
        and (app_name is None or r.deployment_id.app_name == app_name)
    ]
