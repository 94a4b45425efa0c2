"""The fleet's front door: the OpenAI API on Serve, turning each request into a routed engine call.

Serve's HTTP proxy hands a deployment opaque ASGI payloads, so no request
router can see a prompt there. :class:`FleetIngress` parses and validates the
OpenAI request (:mod:`radixkv.serve.openai.protocol`), tokenizes it, and calls the
engine deployment's ``generate`` through a streaming handle with the token ids
as the keyword ``prompt_ids``: the handle's request router
(:class:`~radixkv.serve.ray.request_router.PrefixRouter`) places it by prefix and load.
Everything else is the single-engine server's request handling
(:class:`~radixkv.serve.openai.handlers.OpenAIHandlers` over this module's routed client),
with the replicas' :class:`~radixkv.engine.request.EngineLimits` (asked of one replica
when the ingress starts: every replica is built alike), so a request the single server
refuses gets the same 400 here, by the engine's own check, before any replica sees it;
``usage.prompt_tokens_details.cached_tokens`` is what the chosen replica's
cache held.

Routes: ``POST /v1/completions``, ``POST /v1/chat/completions`` (both also as
server-sent events), ``GET /v1/models``, ``GET /health``, ``GET /metrics`` (every
replica's engine metrics, its host tier's and KV store's where it has them, and the
requests' histograms this ingress records through the handlers, as the single server's;
:mod:`radixkv.serve.openai.metrics`) and
``GET /replicas`` (the replicas that answer; one that does not is reported
as unreachable). Two operator routes are the 404 of an unknown path unless enabled:
``GET /router`` (``enable_router_view``: this ingress's router's view of the fleet, load
and the block hashes its index holds per replica, which tell what prompts other clients
sent) and ``POST /reset_prefix_cache`` = ``POST /flush_cache`` (``enable_cache_reset``:
every replica empties its cache, when idle).

:meth:`FleetIngress.drain` is the fleet's first step on SIGINT/SIGTERM, as
``AsyncEngine.drain`` is one server's: new requests get a 503, every open one ends with
``"abort"``, and it returns once this ingress has sent those ends.

Torch-free: the ingress parses, tokenizes (the model's tokenizer alone, no weights) and
routes; only the engine replicas (:mod:`radixkv.serve.ray.fleet`) load a model.
"""

# No ``from __future__ import annotations``: Serve rebuilds the routes from a by-value pickle
# of this class, whose functions keep only the globals their code names, so FastAPI could
# not resolve string annotations (the request models) there.
import asyncio
from collections.abc import AsyncIterator, Awaitable, Callable, Hashable
from dataclasses import dataclass, fields
from typing import Any

from fastapi import FastAPI, Request
from fastapi.responses import Response, StreamingResponse
from pydantic import BaseModel
from ray import serve
from ray.serve.handle import DeploymentHandle, DeploymentResponseGenerator
from starlette.exceptions import HTTPException

from radixkv.engine.request import EngineLimits, SamplingParams
from radixkv.engine.stats import TierStats
from radixkv.serve.openai.bodies import default_max_body_bytes, read_body, server_version
from radixkv.serve.openai.client import EngineMetrics, RequestOutput
from radixkv.serve.openai.errors import ApiError, as_api_error, install_error_handlers, parse_body
from radixkv.serve.openai.handlers import OpenAIHandlers
from radixkv.serve.openai.metrics import CONTENT_TYPE, DEFAULT_PREFIX, ServerMetrics
from radixkv.serve.openai.openapi import document_bodies
from radixkv.serve.openai.protocol import (
    ChatCompletionRequest,
    CompletionRequest,
    DetokenizeRequest,
    TokenizeRequest,
)
from radixkv.serve.ray import router_registry
from radixkv.text.tokenizer import Tokenizer, context_length, load_tokenizer

__all__ = ["DRAIN_TIMEOUT_S", "FleetIngress", "PromptText", "collect_stats"]

STATS_TIMEOUT_S = 30.0  # for every replica's stats together (GET /replicas, /metrics)
# For a drain: the engines' aborts, then the last chunks of every open response. Serve's
# graceful stop would wait 20 s (graceful_shutdown_timeout_s) for what is still open.
DRAIN_TIMEOUT_S = 10.0

api = FastAPI(title="radixkv fleet")
install_error_handlers(api)
document_bodies(api)


@dataclass(frozen=True)
class PromptText:
    """A call's prompt as text, for routers that match on text (Ray's prefix router)."""

    prompt: str


async def collect_stats(
    engine: DeploymentHandle, names: dict[str, str], timeout_s: float = STATS_TIMEOUT_S
) -> dict[str, dict[str, Any]]:
    """Every engine replica's :meth:`EngineReplica.stats`, by replica id, each with ``"state":
    "running"``; a replica that does not answer (dead, and Serve has not dropped it yet) is
    ``{"replica_id", "actor_id", "state": "unreachable", "error"}`` under its replica id if
    ``names`` (actor id -> replica id, learned from earlier answers and updated here) knows
    it, else under its actor id. ``ApiError`` 503 when no replica answers in ``timeout_s``.
    """
    try:
        results = await engine.broadcast("stats").results_async(
            timeout_s=timeout_s, return_exceptions=True
        )
    except Exception as exc:  # noqa: BLE001 - no replica at all, or the timeout
        results = [exc]
    rows: dict[str, dict[str, Any]] = {}
    seen: dict[str, str] = {}
    for r in results:
        if isinstance(r, dict):
            rows[r["replica_id"]] = {**r, "state": "running"}
            seen[r["actor_id"]] = r["replica_id"]
    errors = [r for r in results if isinstance(r, BaseException)]
    if not rows:
        why = "; ".join(_error_line(e) for e in errors) or "none is running"
        raise ApiError(503, f"no engine replica answered: {why}", type_="service_unavailable")
    for exc in errors:
        actor = getattr(exc, "actor_id", None)  # a RayActorError's; None for another failure
        replica = names.get(actor) if actor is not None else None
        rows[replica or actor or f"unknown-{len(rows)}"] = {
            "replica_id": replica,
            "actor_id": actor,
            "state": "unreachable",
            "error": _error_line(exc),
        }
        if replica is not None:
            seen[actor] = replica
    names.clear()
    names.update(seen)
    return rows


def _error_line(exc: BaseException) -> str:
    """The exception's type and the first line of its message (Ray's run to many lines)."""
    return f"{type(exc).__name__}: {(str(exc).splitlines() or [''])[0]}"


class _RoutedCall:
    """A routed ``generate`` call whose first output has arrived."""

    def __init__(self, call: DeploymentResponseGenerator, first: RequestOutput) -> None:
        self._call = call
        self._first = first
        self._finished = first.finished

    async def __aiter__(self) -> AsyncIterator[RequestOutput]:
        yield self._first
        async for out in self._call:
            self._finished = out.finished
            yield out

    async def aclose(self) -> None:
        """Cancel the call if it has not finished (the replica aborts the request)."""
        if not self._finished:
            self._finished = True
            self._call.cancel()

    async def abort(self) -> None:
        await self.aclose()


class _RoutedClient:
    """:class:`~radixkv.serve.openai.client.EngineClient` over the engine deployment's handle:
    the handlers check each request against the replicas' ``limits``, then it goes where
    the handle's router places it."""

    def __init__(
        self,
        engine: DeploymentHandle,
        tokenizer: Tokenizer,
        limits: EngineLimits,
        send_prompt_text: bool,
    ) -> None:
        self.engine = engine
        self.tokenizer = tokenizer
        self.limits = limits
        self.send_prompt_text = send_prompt_text

    async def generate(
        self, prompt_ids: list[int], params: SamplingParams, namespace: Hashable
    ) -> _RoutedCall:
        """The routed call; its first output is awaited here, so a request the replica
        refuses is a 400 before any response starts."""
        # Ray's PrefixCacheAffinityRouter reads text from a positional argument with a
        # ``prompt`` attribute; radixkv's routers read the ``prompt_ids`` keyword.
        hint = PromptText(self.tokenizer.decode(prompt_ids)) if self.send_prompt_text else None
        call = self.engine.options(stream=True).generate.remote(
            hint, prompt_ids=prompt_ids, params=params, namespace=namespace
        )
        try:
            first = await call.__anext__()
        except (TypeError, ValueError) as exc:  # Ray's wrapper is also the cause's type
            raise ApiError(400, str(getattr(exc, "cause", exc))) from None
        except Exception as exc:  # noqa: BLE001 - a replica lost after accepting the call
            raise as_api_error(exc) from None
        return _RoutedCall(call, first)


# serve.ingress pickles the app's routes when the class is defined: everything they use
# must be defined above this line.
@serve.deployment(name="FleetIngress")
@serve.ingress(api)
class FleetIngress:
    """The OpenAI API over a deployment of :class:`~radixkv.serve.ray.fleet.EngineReplica`
    (``engine``, a handle), for the model ``model`` served as ``model_name``, its
    ``/metrics`` named under ``metrics_prefix`` (``"vllm"`` for vLLM's own names;
    ``ValueError`` naming a bad one). Starting, it asks one replica for the
    :class:`~radixkv.engine.request.EngineLimits` (so it waits for one to run)."""

    async def __init__(
        self,
        engine: DeploymentHandle,
        *,
        model: str,
        model_name: str,
        send_prompt_text: bool = False,
        metrics_prefix: str = DEFAULT_PREFIX,
        enable_cache_reset: bool = False,
        enable_router_view: bool = False,
    ) -> None:
        self.engine = engine
        self.tokenizer = load_tokenizer(model)
        self.model_name = model_name
        limits = EngineLimits(**await engine.limits.remote())
        client = _RoutedClient(engine, self.tokenizer, limits, send_prompt_text)
        self.metrics = ServerMetrics(model_name, metrics_prefix, limits.max_model_len)
        self.openai = OpenAIHandlers(
            client, model_name, context_len=context_length(model), metrics=self.metrics.requests
        )
        self.body_limit = default_max_body_bytes(limits.max_model_len)  # as the one-engine app
        self._replica_names: dict[str, str] = {}  # actor id -> replica id, for collect_stats
        self.enable_cache_reset = enable_cache_reset
        self.enable_router_view = enable_router_view
        self._draining = False  # drain() called: completions and chat are a 503
        self._open = 0  # completions and chat whose response is not sent whole yet

    # ------------------------------------------------------------ shutdown
    async def drain(self, timeout_s: float = DRAIN_TIMEOUT_S) -> int:
        """Stop admitting (completions and chat get a 503, ``/health`` turns 503), drain
        every engine replica (``EngineReplica.drain``: each open request ends with
        ``"abort"``, so its response gets its final chunk and ``[DONE]``), then wait, at
        most ``timeout_s`` in all, until this ingress has sent every open response whole.
        Returns how many are still open (0 unless the wait ran out)."""
        self._draining = True
        loop = asyncio.get_running_loop()
        deadline = loop.time() + timeout_s
        try:  # a replica that fails to drain still leaves the others' ends to wait for
            await self.engine.broadcast("drain").results_async(
                timeout_s=timeout_s, return_exceptions=True
            )
        except Exception:  # noqa: BLE001 - no replica at all, or the timeout
            pass
        while self._open and loop.time() < deadline:
            await asyncio.sleep(0.01)
        return self._open

    async def _answer(
        self,
        request: Request,
        model: type[BaseModel],
        handler: Callable[[Any], Awaitable[Response]],
    ) -> Response:
        """``handler``'s response to the body of ``request`` read as ``model``, counted
        open until it is sent whole (a stream: until its last event); a 503 once
        draining."""
        if self._draining:
            raise ApiError(503, "the fleet is shutting down", type_="service_unavailable")
        self._open += 1
        try:
            response = await handler(parse_body(model, await read_body(request, self.body_limit)))
        except BaseException:
            self._open -= 1
            raise
        if isinstance(response, StreamingResponse):
            response.body_iterator = self._counted(response.body_iterator)
        else:
            self._open -= 1
        return response

    async def _counted(self, events: AsyncIterator[Any]) -> AsyncIterator[Any]:
        """``events``, then one open response fewer."""
        try:
            async for event in events:
                yield event
        finally:
            self._open -= 1

    # ------------------------------------------------------------ routes
    # Bodies are read as the one-engine app reads them (radixkv.serve.openai.bodies): up to a byte
    # limit, then JSON whatever the Content-Type, so a client that sends none is served.
    @api.post("/v1/completions", response_model=None)
    async def completions(self, request: Request) -> Response:
        return await self._answer(request, CompletionRequest, self.openai.completions)

    @api.post("/v1/chat/completions", response_model=None)
    async def chat_completions(self, request: Request) -> Response:
        return await self._answer(request, ChatCompletionRequest, self.openai.chat)

    @api.get("/v1/models")
    async def models(self) -> dict[str, Any]:
        return self.openai.models()

    @api.get("/v1/models/{model_id:path}")
    async def model(self, model_id: str) -> dict[str, Any]:
        return self.openai.model(model_id)

    @api.get("/version")
    async def version(self) -> dict[str, str]:
        return {"version": server_version()}

    @api.post("/tokenize")
    async def tokenize(self, request: Request) -> dict[str, Any]:
        body = parse_body(TokenizeRequest, await read_body(request, self.body_limit))
        return await self.openai.tokenize(body)

    @api.get("/tokenizer_info")
    async def get_tokenizer_info(self) -> dict[str, Any]:
        return await self.openai.tokenizer_info()

    @api.post("/detokenize")
    async def detokenize(self, request: Request) -> dict[str, Any]:
        body = parse_body(DetokenizeRequest, await read_body(request, self.body_limit))
        return await self.openai.detokenize(body)

    @api.get("/health")
    async def health(self) -> Response:
        if self._draining:
            raise ApiError(503, "the fleet is shutting down", type_="service_unavailable")
        return Response(status_code=200)

    @api.get("/replicas")
    async def replica_stats(self) -> dict[str, Any]:
        """Every engine replica's counters (:meth:`EngineReplica.stats`), by replica id: what
        a benchmark reads before and after a run for requests served per replica. A replica
        that does not answer is a row with ``"state": "unreachable"`` (:func:`collect_stats`);
        503 when none answers."""
        return await collect_stats(self.engine, self._replica_names)

    @api.get("/metrics")
    async def metrics_text(self) -> Response:
        """Prometheus text: every answering replica's engine metrics and, for a replica with
        a host tier, its host tier's and KV store's (``host_cache_*``, ``kv_store_*``), all
        labelled ``replica`` (one that does not answer is left out, as Prometheus leaves
        out a dead target), and the requests' histograms and ``request_success`` this
        ingress recorded."""
        names = [f.name for f in fields(EngineMetrics)]
        rows = {
            rid: row
            for rid, row in (await collect_stats(self.engine, self._replica_names)).items()
            if row["state"] == "running"
        }
        per = {rid: EngineMetrics(**{n: row[n] for n in names}) for rid, row in rows.items()}
        tiers = {rid: TierStats(**row["tiers"]) for rid, row in rows.items() if row.get("tiers")}
        return Response(self.metrics.render_fleet(per, tiers), media_type=CONTENT_TYPE)

    @api.get("/router")
    async def routing_snapshot(self) -> dict[str, Any]:
        """Per replica, as this ingress's router sees it: in flight, the reported load and
        the block hashes its index holds; {} before the first routed request (Serve builds
        a handle's router lazily) or under Serve's own router. The 404 of an unknown path
        unless ``enable_router_view``: the hashes are public recipes over the prompts, so
        a client could test guesses at what another sent."""
        if not self.enable_router_view:
            raise HTTPException(404)
        out: dict[str, Any] = {}
        for r in router_registry.live_routers(self.engine.deployment_name, self.engine.app_name):
            out.update(await r.snapshot_threadsafe())
        return out

    @api.post("/reset_prefix_cache")
    @api.post("/flush_cache")
    async def reset_prefix_cache(self) -> Response:
        """Every engine replica empties its prefix cache (``EngineReplica.reset_prefix_cache``,
        each emitting ``AllBlocksCleared``, which empties the router's index for it): 200
        when all did; 409 naming those that had requests running or waiting (the others
        did reset); 503 when a replica did not answer (those that did may have reset).
        The 404 of an unknown path unless ``enable_cache_reset``."""
        if not self.enable_cache_reset:
            raise HTTPException(404)
        try:
            results = await self.engine.broadcast("reset_prefix_cache").results_async(
                timeout_s=STATS_TIMEOUT_S, return_exceptions=True
            )
        except Exception as exc:  # noqa: BLE001 - no replica at all, or the timeout
            results = [exc]
        failed = [_error_line(r) for r in results if isinstance(r, BaseException)]
        if failed:
            why = "; ".join(failed)
            raise ApiError(
                503, f"an engine replica did not answer: {why}", type_="service_unavailable"
            )
        busy = sorted(r["replica_id"] for r in results if not r["reset"])
        if busy:
            raise ApiError(
                409,
                f"replicas {', '.join(busy)} did not reset their prefix cache: requests are "
                f"running or waiting there, and the blocks they hold cannot be freed (the "
                f"other {len(results) - len(busy)} did); retry when the fleet is idle",
                type_="conflict",
            )
        return Response(status_code=200)
