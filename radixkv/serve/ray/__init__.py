"""The fleet on Ray Serve: Serve's deployments and callbacks around radixkv's plain parts.

- :mod:`~radixkv.serve.ray.fleet`: ``EngineReplica`` (an ``AsyncEngine`` that publishes
  its cache's KV events), ``build_fleet_app`` and ``serve_fleet`` (``radixkv serve
  --replicas N --router NAME``); the one module here that loads torch and a model.
- :mod:`~radixkv.serve.ray.ingress`: ``FleetIngress``, the OpenAI API on Serve
  (:mod:`radixkv.serve.openai.handlers` over a routed client); torch-free, it only parses,
  tokenizes and routes.
- :mod:`~radixkv.serve.ray.request_router`: ``PrefixRouter``, Serve's request router
  running a radixkv policy; its bookkeeping is :class:`~radixkv.fleet.routing_state.RoutingState`
  and its event streams an :class:`~radixkv.fleet.event_feed.EventFeed` (plain, in the
  fleet tier) behind ``ReplicaEvents`` (``NoReplicaEvents`` when it reads none).
- :mod:`~radixkv.serve.ray.router_registry`: the live routers of a process.

Needs the ``serve`` and ``fleet`` extras (Ray Serve). This package's ``__init__``
imports nothing, so a process that unpickles the ingress does not load the engine.
"""
