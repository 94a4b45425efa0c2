"""The OpenAI-compatible HTTP API over one :class:`~radixkv.serve.async_engine.AsyncEngine`.

``build_app(engine, model_name=...)`` returns a FastAPI app with:

- ``POST /v1/completions`` and ``POST /v1/chat/completions``, both also as
  server-sent events (``"stream": true``, ending in ``data: [DONE]``);
- ``GET /v1/models`` and ``GET /v1/models/{id}`` (``max_model_len``: the most tokens a
  request gets, the engine's limit or the model's context length if shorter), ``GET
  /version``, vLLM's ``POST /tokenize``, ``POST /detokenize`` and ``GET /tokenizer_info``;
- ``GET /health`` (200, or 503 once the engine thread failed), ``GET /metrics``
  (Prometheus text, :mod:`radixkv.serve.openai.metrics`, names under ``metrics_prefix``);
- only with ``enable_cache_reset``: vLLM's ``POST /reset_prefix_cache`` and SGLang's
  ``POST /flush_cache``, which empty the prefix cache while no request runs (200) and
  refuse while one does (409); without it both are the 404 of an unknown path.

The body is read as JSON whatever its ``Content-Type``
(:func:`~radixkv.serve.openai.errors.parse_body`).
A bad request (bytes that are not UTF-8 JSON, a wrong type, text that is not valid
Unicode, an unsupported option, a token id outside the vocabulary, a prompt or
``max_tokens`` the KV pool cannot hold) gets HTTP 400 with OpenAI's error body and
never reaches the engine; so do an unknown path (404) and a wrong method (405). A
client that goes away (mid-stream or while waiting for a whole reply) has its request
aborted, which frees its blocks. The app starts the engine thread on startup and, if
it started it, stops it on shutdown; after ``engine.drain()`` (what ``radixkv serve``
does on SIGINT/SIGTERM) open requests end with ``"abort"``, new ones get a 503 and
``/health`` turns 503.
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Hashable
from contextlib import asynccontextmanager
from typing import Any

from fastapi import FastAPI, Request
from fastapi.responses import Response

from radixkv.checks import check_int
from radixkv.engine.request import EngineLimits, SamplingParams
from radixkv.serve.async_engine import AsyncEngine
from radixkv.serve.openai.bodies import default_max_body_bytes, read_body, server_version
from radixkv.serve.openai.client import RequestOutput
from radixkv.serve.openai.errors import ApiError, error_response, install_error_handlers, parse_body
from radixkv.serve.openai.handlers import (
    DEFAULT_CHAT_MAX_TOKENS,
    DEFAULT_COMPLETION_MAX_TOKENS,
    OpenAIHandlers,
)
from radixkv.serve.openai.metrics import CONTENT_TYPE, DEFAULT_PREFIX, ServerMetrics
from radixkv.serve.openai.openapi import document_bodies
from radixkv.serve.openai.protocol import (
    ChatCompletionRequest,
    CompletionRequest,
    DetokenizeRequest,
    TokenizeRequest,
    utf8_problem,
)
from radixkv.serve.stream import RequestStream

__all__ = [
    "DEFAULT_CHAT_MAX_TOKENS",
    "DEFAULT_COMPLETION_MAX_TOKENS",
    "ApiError",
    "build_app",
    "default_max_body_bytes",
]

_CACHE_BUSY = (
    "the prefix cache was not reset: requests are running or waiting, and the blocks they "
    "hold cannot be freed; retry when the server is idle"
)


def build_app(
    engine: AsyncEngine,
    *,
    model_name: str,
    max_body_bytes: int | None = None,
    max_model_len: int | None = None,
    metrics_prefix: str = DEFAULT_PREFIX,
    enable_cache_reset: bool = False,
) -> FastAPI:
    """The FastAPI app serving ``engine`` under the model name ``model_name``.

    Text needs ``engine.engine.tokenizer`` (a :class:`~radixkv.text.tokenizer.Tokenizer`);
    without one only token-id completions work and replies carry no text. A request
    body over ``max_body_bytes`` (default: :func:`default_max_body_bytes` of the pool) is a 413,
    refused before it is read whole: parsing a huge body would stall every client.
    ``max_model_len`` is the model's context length
    (:func:`~radixkv.text.tokenizer.context_length`; None: unknown, and the engine's
    ``max_model_len`` alone bounds a request): ``/v1/models`` reports the smaller of the
    two and longer requests are refused.
    ``metrics_prefix`` names the metrics (``"vllm"`` for vLLM's own names).
    ``enable_cache_reset`` adds the operator's cache reset routes (off: any client could
    empty the cache every tenant shares). ``TypeError`` / ``ValueError`` naming the
    argument for a bad one.
    """
    if not isinstance(engine, AsyncEngine):
        raise TypeError(f"engine must be an AsyncEngine, got {type(engine).__name__}")
    if not isinstance(model_name, str) or not model_name:
        raise ValueError(f"model_name must be a non-empty str, got {model_name!r}")
    if (problem := utf8_problem(model_name)) is not None:  # every response carries it
        raise ValueError(f"model_name: {problem}")
    max_body_bytes = check_int("max_body_bytes", max_body_bytes, low=1, optional=True)
    max_model_len = check_int("max_model_len", max_model_len, low=1, optional=True)
    if not isinstance(enable_cache_reset, bool):
        raise TypeError(f"enable_cache_reset must be a bool, got {enable_cache_reset!r}")
    client = _EngineClient(engine)
    if max_body_bytes is None:
        max_body_bytes = default_max_body_bytes(client.limits.max_model_len)
    body_limit = max_body_bytes
    limit = max_model_len or client.limits.max_model_len
    metrics = ServerMetrics(model_name, metrics_prefix, limit)
    api = OpenAIHandlers(client, model_name, context_len=max_model_len, metrics=metrics.requests)
    has_host_tier = engine.engine.host_kv_pool is not None  # asked for, or under a kv_store

    @asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        started_here = not engine.is_running
        await engine.start()
        try:
            yield
        finally:
            if started_here:
                await engine.shutdown()

    app = FastAPI(title="radixkv", lifespan=lifespan)
    app.state.engine = engine
    install_error_handlers(app)
    document_bodies(app)

    @app.post("/v1/completions", response_model=None)
    async def completions(request: Request) -> Response:
        body = parse_body(CompletionRequest, await read_body(request, body_limit))
        return await api.completions(body, request)

    @app.post("/v1/chat/completions", response_model=None)
    async def chat_completions(request: Request) -> Response:
        body = parse_body(ChatCompletionRequest, await read_body(request, body_limit))
        return await api.chat(body, request)

    @app.get("/v1/models")
    async def models() -> dict[str, Any]:
        return api.models()

    @app.get("/v1/models/{model_id:path}")
    async def model(model_id: str) -> dict[str, Any]:
        return api.model(model_id)

    @app.get("/version")
    async def version() -> dict[str, str]:
        return {"version": server_version()}

    @app.post("/tokenize")
    async def tokenize(request: Request) -> dict[str, Any]:
        body = parse_body(TokenizeRequest, await read_body(request, body_limit))
        return await api.tokenize(body)

    @app.get("/tokenizer_info")
    async def get_tokenizer_info() -> dict[str, Any]:
        return await api.tokenizer_info()

    @app.post("/detokenize")
    async def detokenize(request: Request) -> dict[str, Any]:
        body = parse_body(DetokenizeRequest, await read_body(request, body_limit))
        return await api.detokenize(body)

    @app.get("/health")
    async def health() -> Response:
        if engine.is_serving:
            return Response(status_code=200)
        message = (
            "the engine is shutting down" if engine.is_running else "the engine is not running"
        )
        return error_response(ApiError(503, message, type_="service_unavailable"))

    @app.get("/metrics")
    async def metrics_text() -> Response:
        tiers = None
        if has_host_tier and engine.is_running:
            tiers = await engine.call(lambda e: e.tier_stats())  # read on the engine thread
        text = metrics.render(engine.metrics(), tiers)
        return Response(text, media_type=CONTENT_TYPE)

    if enable_cache_reset:

        @app.post("/reset_prefix_cache")
        @app.post("/flush_cache")
        async def reset_prefix_cache() -> Response:
            try:
                done = await engine.reset_prefix_cache()
            except RuntimeError as exc:  # shutting down, or the engine thread failed
                raise ApiError(503, str(exc), type_="service_unavailable") from None
            if not done:
                raise ApiError(409, _CACHE_BUSY, type_="conflict")
            return Response(status_code=200)

    return app


class _EngineClient:
    """:class:`~radixkv.serve.openai.client.EngineClient` over one engine: the handlers check a
    request against its limits before queueing it."""

    def __init__(self, engine: AsyncEngine) -> None:
        self.engine = engine
        self.tokenizer = engine.engine.tokenizer

    @property
    def limits(self) -> EngineLimits:
        return self.engine.limits

    async def generate(
        self, prompt_ids: list[int], params: SamplingParams, namespace: Hashable
    ) -> _EngineCall:
        try:
            stream = self.engine.generate(prompt_ids, params, namespace)
        except (TypeError, ValueError) as exc:
            raise ApiError(400, str(exc)) from None
        except RuntimeError as exc:  # shutting down, or the engine thread failed
            raise ApiError(503, str(exc), type_="service_unavailable") from None
        return _EngineCall(self.engine, stream)


class _EngineCall:
    """One queued request: its stream, and the engine to abort it on."""

    def __init__(self, engine: AsyncEngine, stream: RequestStream) -> None:
        self.engine = engine
        self.stream = stream

    def __aiter__(self) -> AsyncIterator[RequestOutput]:
        return self.stream

    async def aclose(self) -> None:
        await self.stream.aclose()

    async def abort(self) -> None:
        await self.engine.abort(self.stream.request_id)
