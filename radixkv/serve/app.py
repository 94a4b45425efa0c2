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

import asyncio
import json
import time
from collections.abc import AsyncIterator, Callable, Sequence
from contextlib import asynccontextmanager
from dataclasses import dataclass
from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response, StreamingResponse

from radixkv.engine.request import SamplingParams
from radixkv.serve.async_engine import AsyncEngine, RequestOutput, RequestStream
from radixkv.serve.metrics import CONTENT_TYPE, render_metrics
from radixkv.serve.protocol import (
    ChatCompletionRequest,
    CompletionRequest,
    chat_chunk,
    chat_response,
    completion_chunk,
    completion_response,
    error_body,
    namespace_of,
    new_id,
    usage,
    usage_chunk,
)
from radixkv.serve.text import TextStream

__all__ = ["DEFAULT_CHAT_MAX_TOKENS", "DEFAULT_COMPLETION_MAX_TOKENS", "ApiError", "build_app"]

DEFAULT_COMPLETION_MAX_TOKENS = 16  # OpenAI's default for /v1/completions
DEFAULT_CHAT_MAX_TOKENS = 1024  # capped further by what the KV pool can hold


class ApiError(Exception):
    """An error the API answers with OpenAI's error body and ``status``."""

    def __init__(
        self,
        status: int,
        message: str,
        *,
        param: str | None = None,
        type_: str = "invalid_request_error",
        code: str | None = None,
    ) -> None:
        super().__init__(message)
        self.status = status
        self.body = error_body(message, type_=type_, param=param, code=code)


@dataclass
class _Job:
    """One request in flight: its output stream, its text, and how to answer."""

    rid: str
    stream: RequestStream
    text: TextStream
    prompt_len: int
    token_ids: bool
    include_usage: bool


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
    api = _Api(engine, model_name)

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

    @app.exception_handler(RequestValidationError)
    async def invalid_request(request: Request, exc: RequestValidationError) -> JSONResponse:
        return _error_response(_validation_error(exc))

    @app.exception_handler(ApiError)
    async def api_error(request: Request, exc: ApiError) -> JSONResponse:
        return _error_response(exc)

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
        return _error_response(ApiError(503, message, type_="service_unavailable"))

    @app.get("/metrics")
    async def metrics() -> Response:
        text = render_metrics(engine.metrics(), model_name)
        return Response(text, media_type=CONTENT_TYPE)

    return app


class _Api:
    """The endpoints' logic, apart from routing."""

    def __init__(self, engine: AsyncEngine, model_name: str) -> None:
        self.engine = engine
        self.model_name = model_name
        self.tokenizer = engine.engine.tokenizer
        self.created = int(time.time())

    @property
    def max_model_len(self) -> int:
        """Tokens the whole KV pool holds: the longest prompt plus reply there can be."""
        alloc = self.engine.engine.allocator
        return alloc.num_blocks * alloc.block_size

    def models(self) -> dict[str, Any]:
        card = {
            "id": self.model_name,
            "object": "model",
            "created": self.created,
            "owned_by": "radixkv",
            "max_model_len": self.max_model_len,
        }
        return {"object": "list", "data": [card]}

    # ------------------------------------------------------------ endpoints
    async def completions(self, body: CompletionRequest, request: Request) -> Response:
        self._check_model(body.model)
        if isinstance(body.prompt, str):
            prompt_ids = self._tokenizer("a text prompt").encode(body.prompt)
            if not prompt_ids:
                raise ApiError(400, "prompt encodes to no tokens", param="prompt")
        else:
            prompt_ids = body.prompt
        job = self._start(
            body,
            prompt_ids,
            prompt_param="prompt",
            max_tokens=body.max_tokens,
            default_max_tokens=DEFAULT_COMPLETION_MAX_TOKENS,
        )
        if body.stream:
            return _sse_response(self._completion_events(job, request))
        out, finish = await self._collect(job, request)
        return JSONResponse(
            completion_response(
                job.rid,
                self.model_name,
                job.text.text,
                finish,
                _usage(job, out),
                out.output_ids if job.token_ids else None,
            )
        )

    async def chat(self, body: ChatCompletionRequest, request: Request) -> Response:
        self._check_model(body.model)
        tokenizer = self._tokenizer("chat")
        messages = [m.as_template_input() for m in body.messages]
        try:
            prompt_ids = list(tokenizer.apply_chat_template(messages, add_generation_prompt=True))
        except Exception as exc:  # noqa: BLE001 - jinja raises its own errors
            raise ApiError(
                400, f"cannot render the chat template: {exc}", param="messages"
            ) from None
        job = self._start(
            body,
            prompt_ids,
            prompt_param="messages",
            max_tokens=body.requested_max_tokens,
            default_max_tokens=DEFAULT_CHAT_MAX_TOKENS,
        )
        if body.stream:
            return _sse_response(self._chat_events(job, request))
        out, finish = await self._collect(job, request)
        return JSONResponse(
            chat_response(
                job.rid,
                self.model_name,
                job.text.text,
                finish,
                _usage(job, out),
                out.output_ids if job.token_ids else None,
            )
        )

    # ---------------------------------------------------------- the request
    def _check_model(self, model: str | None) -> None:
        if model is not None and model != self.model_name:
            raise ApiError(
                404,
                f"the model {model!r} does not exist; this server serves {self.model_name!r}",
                param="model",
                code="model_not_found",
            )

    def _tokenizer(self, what: str) -> Any:
        if self.tokenizer is None:
            raise ApiError(400, f"this server has no tokenizer, so {what} cannot be served")
        return self.tokenizer

    def _start(
        self,
        body: CompletionRequest | ChatCompletionRequest,
        prompt_ids: Sequence[int],
        *,
        prompt_param: str,
        max_tokens: int | None,
        default_max_tokens: int,
    ) -> _Job:
        """Check the request against the model and the pool, then queue it (400s first)."""
        engine = self.engine
        vocab = engine.vocab_size
        top = max(prompt_ids)
        if top >= vocab:
            raise ApiError(
                400,
                f"{prompt_param} holds token id {top}, outside the vocabulary (size {vocab})",
                param=prompt_param,
            )
        room = engine.max_new_tokens(len(prompt_ids))
        if room == 0:
            raise ApiError(
                400,
                f"the prompt is {len(prompt_ids)} tokens; the KV pool holds at most "
                f"{self.max_model_len} tokens",
                param=prompt_param,
                code="context_length_exceeded",
            )
        if max_tokens is None:
            max_tokens = min(default_max_tokens, room)
        elif max_tokens > room:
            raise ApiError(
                400,
                f"max_tokens is {max_tokens} but a prompt of {len(prompt_ids)} tokens leaves "
                f"room for {room} in the KV pool",
                param="max_tokens",
                code="context_length_exceeded",
            )
        stop_ids = body.stop_ids()
        for param, ids in (("stop", body.stop_ids(only="stop")), ("stop_token_ids", stop_ids)):
            bad = [t for t in ids if t >= vocab]
            if bad:
                raise ApiError(
                    400,
                    f"{param} holds token ids {bad}, outside the vocabulary (size {vocab})",
                    param=param,
                )
        if not body.ignore_eos and self.tokenizer is not None:
            stop_ids += [t for t in self.tokenizer.stop_token_ids if t not in stop_ids]
        try:
            params = SamplingParams(
                max_new_tokens=max_tokens,
                temperature=body.temperature,
                top_p=body.top_p,
                seed=body.seed,
                stop_token_ids=tuple(stop_ids),
            )
            stream = engine.generate(prompt_ids, params, namespace_of(body.cache_salt, body.user))
        except (TypeError, ValueError) as exc:
            raise ApiError(400, str(exc)) from None
        decode: Callable[[Sequence[int]], str] = (
            self.tokenizer.decode if self.tokenizer is not None else lambda ids: ""
        )
        prefix = "chatcmpl" if isinstance(body, ChatCompletionRequest) else "cmpl"
        return _Job(
            rid=new_id(prefix),
            stream=stream,
            text=TextStream(decode, body.stop_strings(), stop_ids),
            prompt_len=len(prompt_ids),
            token_ids=body.return_token_ids,
            include_usage=body.include_usage,
        )

    async def _collect(self, job: _Job, request: Request) -> tuple[RequestOutput, str | None]:
        """Run ``job`` to its end; the last output and the finish reason (500 on an error)."""
        watcher = asyncio.create_task(self._abort_on_disconnect(job, request))
        try:
            last: RequestOutput | None = None
            async for out in job.stream:
                last = out
                job.text.push(out.output_ids, out.finished)
                if job.text.stopped:
                    return out, "stop"
            assert last is not None
            if last.finish_reason == "error":
                raise ApiError(500, last.error or "the engine failed", type_="internal_error")
            return last, last.finish_reason
        finally:
            watcher.cancel()
            await job.stream.aclose()

    async def _abort_on_disconnect(self, job: _Job, request: Request) -> None:
        """Abort ``job``'s request when its client disconnects."""
        while True:
            message = await request.receive()
            if message["type"] == "http.disconnect":
                await self.engine.abort(job.stream.request_id)
                return

    async def _events(
        self, job: _Job, request: Request
    ) -> AsyncIterator[tuple[RequestOutput, str, str | None]]:
        """``(output, new text, finish reason or None)`` until the request ends."""
        watcher = asyncio.create_task(self._abort_on_disconnect(job, request))
        try:
            async for out in job.stream:
                delta = job.text.push(out.output_ids, out.finished)
                if job.text.stopped:
                    yield out, delta, "stop"
                    return
                if out.finish_reason == "error":
                    raise ApiError(500, out.error or "the engine failed", type_="internal_error")
                yield out, delta, out.finish_reason
        finally:
            watcher.cancel()
            await job.stream.aclose()

    async def _completion_events(self, job: _Job, request: Request) -> AsyncIterator[str]:
        out = None
        try:
            async for out, delta, finish in self._events(job, request):
                ids = out.new_token_ids if job.token_ids else None
                if delta or finish is not None or ids:
                    yield _sse(completion_chunk(job.rid, self.model_name, delta, finish, ids))
            if job.include_usage and out is not None:
                usage_ = _usage(job, out)
                yield _sse(usage_chunk(job.rid, "text_completion", self.model_name, usage_))
        except Exception as exc:  # noqa: BLE001 - headers are sent: report it in the stream
            yield _sse(_as_api_error(exc).body)
        yield "data: [DONE]\n\n"

    async def _chat_events(self, job: _Job, request: Request) -> AsyncIterator[str]:
        out = None
        yield _sse(chat_chunk(job.rid, self.model_name, {"role": "assistant", "content": ""}))
        try:
            async for out, delta, finish in self._events(job, request):
                ids = out.new_token_ids if job.token_ids else None
                if delta or ids:
                    chunk = chat_chunk(job.rid, self.model_name, {"content": delta}, None, ids)
                    yield _sse(chunk)
                if finish is not None:
                    yield _sse(chat_chunk(job.rid, self.model_name, {}, finish))
            if job.include_usage and out is not None:
                usage_ = _usage(job, out)
                yield _sse(usage_chunk(job.rid, "chat.completion.chunk", self.model_name, usage_))
        except Exception as exc:  # noqa: BLE001 - headers are sent: report it in the stream
            yield _sse(_as_api_error(exc).body)
        yield "data: [DONE]\n\n"


def _usage(job: _Job, out: RequestOutput) -> dict[str, Any]:
    return usage(job.prompt_len, len(out.output_ids), out.cached_tokens)


def _sse(obj: dict[str, Any]) -> str:
    return f"data: {json.dumps(obj, separators=(',', ':'))}\n\n"


def _sse_response(events: AsyncIterator[str]) -> StreamingResponse:
    headers = {"Cache-Control": "no-cache", "X-Accel-Buffering": "no"}
    return StreamingResponse(events, media_type="text/event-stream", headers=headers)


def _as_api_error(exc: Exception) -> ApiError:
    if isinstance(exc, ApiError):
        return exc
    return ApiError(500, f"{type(exc).__name__}: {exc}", type_="internal_error")


def _error_response(exc: ApiError) -> JSONResponse:
    return JSONResponse(exc.body, status_code=exc.status)


def _validation_error(exc: RequestValidationError) -> ApiError:
    """The first of pydantic's complaints as a 400 naming the field (``param``)."""
    errors = exc.errors()
    if not errors:
        return ApiError(400, "invalid request")
    first = max(errors, key=lambda e: len(e.get("loc", ())))  # the most specific complaint
    if first.get("type") == "json_invalid":
        detail = first.get("ctx", {}).get("error", "")
        return ApiError(400, f"the body is not valid JSON: {detail}".rstrip(": "))
    loc = [str(p) for p in first.get("loc", ()) if p != "body"]
    # a union's member type ("str", "list[int]") is not a field name
    path = [p for p in loc if not any(c in p for c in "[]") and p not in ("str", "int")]
    message = str(first.get("msg", "invalid value"))
    where = ".".join(path)
    if "input" in first and path:
        message = f"{message}, got {json.dumps(first['input'], default=repr)[:200]}"
    if not where:
        if first.get("type") == "missing":
            return ApiError(400, "the request body is missing: send a JSON object")
        got = json.dumps(first.get("input"), default=repr)[:100]
        return ApiError(400, f"the request body must be a JSON object, got {got}")
    return ApiError(400, f"{where}: {message}", param=path[0])
