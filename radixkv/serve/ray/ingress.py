"""The fleet's front door: the OpenAI API on Serve, turning each request into a routed engine call.

Serve's HTTP proxy hands a deployment opaque ASGI payloads, so no request
router can see a prompt there. :class:`FleetIngress` parses and validates the
OpenAI request (:mod:`radixkv.serve.protocol`), tokenizes it, and calls the
engine deployment's ``generate`` through a streaming handle with the token ids
as the keyword ``prompt_ids``: the handle's request router
(:class:`~radixkv.serve.ray.request_router.PrefixRouter`) places it by prefix and load.
Everything else is the single-engine server's request handling
(:class:`~radixkv.serve.handlers.OpenAIHandlers` over this module's routed client),
with the replicas' :class:`EngineLimits` (asked of one replica when the
ingress starts: every replica is built alike), so a request the single server
refuses gets the same 400 here before any replica sees it;
``usage.prompt_tokens_details.cached_tokens`` is what the chosen replica's
cache held.

Routes: ``POST /v1/completions``, ``POST /v1/chat/completions`` (both also as
server-sent events), ``GET /v1/models``, ``GET /health``, ``GET /metrics`` (every
replica's engine metrics, and the requests' histograms this ingress records through the
handlers, as the single server's; :mod:`radixkv.serve.metrics`) and
``GET /replicas`` (the replicas that answer; one that does not is reported
as unreachable), and ``GET /router``: this ingress's router's view of the
fleet (load, and the blocks its index holds per replica).

Torch-free: the ingress parses, tokenizes (the model's tokenizer alone, no weights) and
routes; only the engine replicas (:mod:`radixkv.serve.ray.fleet`) load a model.
"""

# No ``from __future__ import annotations``: Serve rebuilds the routes from a by-value pickle
# of this class, whose functions keep only the globals their code names, so FastAPI could
# not resolve string annotations (the request models) there.
from collections.abc import AsyncIterator, Hashable
from dataclasses import dataclass, fields
from typing import Any

from fastapi import FastAPI, Request
from fastapi.responses import Response
from ray import serve
from ray.serve.handle import DeploymentHandle, DeploymentResponseGenerator

from radixkv.engine.request import SamplingParams
from radixkv.serve.bodies import default_max_body_bytes, read_body, server_version
from radixkv.serve.client import EngineMetrics, RequestOutput
from radixkv.serve.errors import ApiError, as_api_error, install_error_handlers, parse_body
from radixkv.serve.handlers import OpenAIHandlers
from radixkv.serve.metrics import CONTENT_TYPE, DEFAULT_PREFIX, ServerMetrics
from radixkv.serve.protocol import (
    ChatCompletionRequest,
    CompletionRequest,
    DetokenizeRequest,
    TokenizeRequest,
)
from radixkv.serve.ray import router_registry
from radixkv.text.tokenizer import Tokenizer, context_length, load_tokenizer

__all__ = ["EngineLimits", "FleetIngress", "PromptText", "collect_stats"]

STATS_TIMEOUT_S = 30.0  # for every replica's stats together (GET /replicas, /metrics)

api = FastAPI(title="radixkv fleet")
install_error_handlers(api)


@dataclass(frozen=True)
class PromptText:
    """A call's prompt as text, for routers that match on text (Ray's prefix router)."""

    prompt: str


@dataclass(frozen=True)
class EngineLimits:
    """What a fleet's engine replicas accept (all are built from one engine config): token
    ids below ``vocab_size``; a prompt and its reply within ``max_model_len`` tokens, the
    engine's (``EngineReplica.limits`` reports them)."""

    vocab_size: int
    max_model_len: int

    def max_new_tokens(self, prompt_len: int) -> int:
        """The most new tokens a prompt of ``prompt_len`` tokens may ask for, as
        ``AsyncEngine.max_new_tokens`` decides on the replica; 0 if none fits. O(1)."""
        return max(0, self.max_model_len - prompt_len)


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
    """:class:`~radixkv.serve.client.EngineClient` over the engine deployment's handle:
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

    @property
    def vocab_size(self) -> int:
        return self.limits.vocab_size

    @property
    def max_model_len(self) -> int:
        return self.limits.max_model_len

    def max_new_tokens(self, prompt_len: int) -> int:
        return self.limits.max_new_tokens(prompt_len)

    async def generate(
        self,
        prompt_ids: list[int],
        params: SamplingParams,
        namespace: Hashable,
        *,
        cap_to_pool: bool = False,
    ) -> _RoutedCall:
        """The routed call; its first output is awaited here, so a request the replica
        refuses is a 400 before any response starts."""
        # Ray's PrefixCacheAffinityRouter reads text from a positional argument with a
        # ``prompt`` attribute; radixkv's routers read the ``prompt_ids`` keyword.
        hint = PromptText(self.tokenizer.decode(prompt_ids)) if self.send_prompt_text else None
        call = self.engine.options(stream=True).generate.remote(
            hint, prompt_ids=prompt_ids, params=params, namespace=namespace, cap_to_pool=cap_to_pool
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
    :class:`EngineLimits` (so it waits for one to run)."""

    async def __init__(
        self,
        engine: DeploymentHandle,
        *,
        model: str,
        model_name: str,
        send_prompt_text: bool = False,
        metrics_prefix: str = DEFAULT_PREFIX,
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

    # ------------------------------------------------------------ routes
    # Bodies are read as the one-engine app reads them (radixkv.serve.bodies): up to a byte
    # limit, then JSON whatever the Content-Type, so a client that sends none is served.
    @api.post("/v1/completions", response_model=None)
    async def completions(self, request: Request) -> Response:
        body = parse_body(CompletionRequest, await read_body(request, self.body_limit))
        return await self.openai.completions(body)

    @api.post("/v1/chat/completions", response_model=None)
    async def chat_completions(self, request: Request) -> Response:
        body = parse_body(ChatCompletionRequest, await read_body(request, self.body_limit))
        return await self.openai.chat(body)

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
        """Prometheus text: every answering replica's engine metrics, labelled ``replica``
        (one that does not answer is left out, as Prometheus leaves out a dead target),
        and the requests' histograms and ``request_success`` this ingress recorded."""
        names = [f.name for f in fields(EngineMetrics)]
        per = {
            rid: EngineMetrics(**{n: row[n] for n in names})
            for rid, row in (await collect_stats(self.engine, self._replica_names)).items()
            if row["state"] == "running"
        }
        return Response(self.metrics.render_fleet(per), media_type=CONTENT_TYPE)

    @api.get("/router")
    async def routing_snapshot(self) -> dict[str, Any]:
        """Per replica, as this ingress's router sees it: in flight, the reported load and
        the block hashes its index holds; {} before the first routed request (Serve builds
        a handle's router lazily) or under Serve's own router."""
        out: dict[str, Any] = {}
        for r in router_registry.live_routers(self.engine.deployment_name, self.engine.app_name):
            out.update(await r.snapshot_threadsafe())
        return out
