"""The OpenAI-compatible HTTP API over one :class:`~radixkv.serve.async_engine.AsyncEngine`.

``build_app(engine, model_name=...)`` returns a FastAPI app with:

- ``POST /v1/completions`` and ``POST /v1/chat/completions``, both also as
  server-sent events (``"stream": true``, ending in ``data: [DONE]``);
- ``GET /v1/models``, ``GET /health`` (200, or 503 once the engine thread failed),
  ``GET /metrics`` (Prometheus text, :mod:`radixkv.serve.metrics`).

A bad request (malformed JSON, a wrong type, an unsupported option, a token id
outside the vocabulary, a prompt or ``max_tokens`` the KV pool cannot hold) gets
HTTP 400 with OpenAI's error body and never reaches the engine. A client that
goes away (mid-stream or while waiting for a whole reply) has its request
aborted, which frees its blocks. The app starts the engine thread on startup and,
if it started it, stops it on shutdown.
"""

from __future__ import annotations

import dataclasses
from collections.abc import AsyncIterator, Hashable
from contextlib import asynccontextmanager
from typing import Any

from fastapi import FastAPI, Request
from fastapi.responses import Response

from radixkv.engine.request import SamplingParams
from radixkv.serve.async_engine import AsyncEngine, RequestOutput, RequestStream
from radixkv.serve.errors import ApiError, error_response, install_error_handlers
from radixkv.serve.handlers import (
    DEFAULT_CHAT_MAX_TOKENS,
    DEFAULT_COMPLETION_MAX_TOKENS,
    OpenAIHandlers,
)
from radixkv.serve.metrics import CONTENT_TYPE, render_metrics
from radixkv.serve.protocol import ChatCompletionRequest, CompletionRequest

__all__ = ["DEFAULT_CHAT_MAX_TOKENS", "DEFAULT_COMPLETION_MAX_TOKENS", "ApiError", "build_app"]


def build_app(engine: AsyncEngine, *, model_name: str) -> FastAPI:
    """The FastAPI app serving ``engine`` under the model name ``model_name``.

    Text needs ``engine.engine.tokenizer`` (a :class:`~radixkv.serve.models.Tokenizer`);
    without one only token-id completions work and replies carry no text.
    ``TypeError`` / ``ValueError`` naming the argument for a bad one.
    """
    if not isinstance(engine, AsyncEngine):
        raise TypeError(f"engine must be an AsyncEngine, got {type(engine).__name__}")
    if not isinstance(model_name, str) or not model_name:
        raise ValueError(f"model_name must be a non-empty str, got {model_name!r}")
    api = OpenAIHandlers(_EngineClient(engine), model_name)

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

    @app.post("/v1/completions", response_model=None)
    async def completions(body: CompletionRequest, request: Request) -> Response:
        return await api.completions(body, request)

    @app.post("/v1/chat/completions", response_model=None)
    async def chat_completions(body: ChatCompletionRequest, request: Request) -> Response:
        return await api.chat(body, request)

    @app.get("/v1/models")
    async def models() -> dict[str, Any]:
        return api.models()

    @app.get("/health")
    async def health() -> Response:
        if engine.is_running:
            return Response(status_code=200)
        message = "the engine is not running"
        return error_response(ApiError(503, message, type_="service_unavailable"))

    @app.get("/metrics")
    async def metrics() -> Response:
        text = render_metrics(engine.metrics(), model_name)
        return Response(text, media_type=CONTENT_TYPE)

    return app


class _EngineClient:
    """:class:`~radixkv.serve.handlers.EngineClient` over one engine: the handlers check a
    request against its vocabulary and pool before queueing it."""

    def __init__(self, engine: AsyncEngine) -> None:
        self.engine = engine
        self.tokenizer = engine.engine.tokenizer

    @property
    def vocab_size(self) -> int:
        return self.engine.vocab_size

    @property
    def max_model_len(self) -> int:
        """Tokens the whole KV pool holds: the longest prompt plus reply there can be."""
        alloc = self.engine.engine.allocator
        return alloc.num_blocks * alloc.block_size

    def max_new_tokens(self, prompt_len: int) -> int:
        return self.engine.max_new_tokens(prompt_len)

    async def generate(
        self,
        prompt_ids: list[int],
        params: SamplingParams,
        namespace: Hashable,
        *,
        cap_to_pool: bool = False,
    ) -> _EngineCall:
        if cap_to_pool:
            room = self.engine.max_new_tokens(len(prompt_ids))
            if 0 < room < params.max_new_tokens:
                params = dataclasses.replace(params, max_new_tokens=room)
        try:
            stream = self.engine.generate(prompt_ids, params, namespace)
        except (TypeError, ValueError) as exc:
            raise ApiError(400, str(exc)) from None
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
