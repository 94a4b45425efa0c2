"""The OpenAI API's request handling, written once over any :class:`EngineClient`.

:class:`OpenAIHandlers` turns a parsed request (:mod:`radixkv.serve.protocol`)
into prompt token ids and :class:`~radixkv.engine.request.SamplingParams`, calls
the client's ``generate`` and shapes what comes back: one JSON response, or
server-sent events ending in ``data: [DONE]``; text and stop strings through
:class:`~radixkv.serve.text.TextStream`; ``usage`` with the prompt tokens the
cache held. A bad request is an :class:`~radixkv.serve.errors.ApiError` (OpenAI's error body) before
the engine sees it; any other failure is logged and answered as a 500 with that body
(an exception escaping the app would drop the client's keep-alive connection).
Prompts are tokenized (and chat templates rendered) on a worker thread, so a long
prompt does not stall the event loop; a ``temperature`` below :data:`SAMPLING_EPS`
is greedy, as in vLLM. The single-engine app (:mod:`radixkv.serve.app`) and the
fleet's ingress (:mod:`radixkv.serve.fleet_ingress`) differ only in their client
and their routes.
"""

from __future__ import annotations

import asyncio
import functools
import json
import logging
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Hashable, Sequence
from dataclasses import dataclass
from typing import Any, ParamSpec, Protocol, TypeVar

from fastapi import Request
from fastapi.responses import JSONResponse, Response, StreamingResponse

from radixkv.engine.request import SamplingParams
from radixkv.serve.async_engine import RequestOutput
from radixkv.serve.errors import ApiError, as_api_error
from radixkv.serve.models import Tokenizer
from radixkv.serve.protocol import (
    ChatCompletionRequest,
    CompletionRequest,
    chat_chunk,
    chat_response,
    completion_chunk,
    completion_response,
    namespace_of,
    new_id,
    usage,
    usage_chunk,
)
from radixkv.serve.text import TextStream

__all__ = [
    "DEFAULT_CHAT_MAX_TOKENS",
    "DEFAULT_COMPLETION_MAX_TOKENS",
    "EngineCall",
    "EngineClient",
    "OpenAIHandlers",
]

DEFAULT_COMPLETION_MAX_TOKENS = 16  # OpenAI's default for /v1/completions
DEFAULT_CHAT_MAX_TOKENS = 1024  # capped further by what the KV pool can hold
SAMPLING_EPS = 1e-5  # vLLM's: a lower temperature is greedy (1/temperature would overflow)

Body = CompletionRequest | ChatCompletionRequest
P = ParamSpec("P")
R = TypeVar("R")
log = logging.getLogger(__name__)


def _api_errors(handler: Callable[P, Awaitable[R]]) -> Callable[P, Awaitable[R]]:
    """``handler`` raising only ``ApiError``s: any other failure is logged and answered as a
    500 with OpenAI's body (an exception that escaped the app would drop the connection)."""

    @functools.wraps(handler)
    async def wrapper(*args: P.args, **kwargs: P.kwargs) -> R:
        try:
            return await handler(*args, **kwargs)
        except ApiError:
            raise
        except Exception as exc:  # noqa: BLE001 - OpenAI's error body, whatever failed
            log.exception("a request failed")
            raise as_api_error(exc) from None

    return wrapper


class EngineCall(Protocol):
    """One request in flight: its outputs, the last one final."""

    def __aiter__(self) -> AsyncIterator[RequestOutput]: ...

    async def aclose(self) -> None:
        """Stop listening; end the request if it has not finished. Idempotent."""

    async def abort(self) -> None:
        """End the request from another task (its client went away)."""


class EngineClient(Protocol):
    """What the handlers need of whatever serves a request: one engine or a fleet.

    ``vocab_size``, ``max_model_len`` and :meth:`max_new_tokens` are ``None``
    where only the engine behind the client knows them; it then checks them itself.
    """

    tokenizer: Tokenizer | None

    @property
    def vocab_size(self) -> int | None: ...

    @property
    def max_model_len(self) -> int | None: ...

    def max_new_tokens(self, prompt_len: int) -> int | None:
        """The most new tokens a prompt of ``prompt_len`` tokens leaves room for (0: none)."""

    async def generate(
        self,
        prompt_ids: list[int],
        params: SamplingParams,
        namespace: Hashable,
        *,
        cap_to_pool: bool = False,
    ) -> EngineCall:
        """Start one request; ``cap_to_pool`` lowers ``params.max_new_tokens`` to what the
        pool holds (a default, not a client's ask). ``ApiError`` (400) if the engine refuses
        it, before anything is answered."""


@dataclass
class _Job:
    """One request being answered: its call, its text, and how to shape the response."""

    rid: str
    chat: bool
    call: EngineCall
    text: TextStream
    prompt_len: int
    token_ids: bool
    include_usage: bool

    def usage(self, out: RequestOutput) -> dict[str, Any]:
        return usage(self.prompt_len, len(out.output_ids), out.cached_tokens)


class OpenAIHandlers:
    """The endpoints' logic over ``client``, apart from routing, for the model ``model_name``.

    ``request``, where a route passes it, is watched: a client that disconnects has
    its request aborted.
    """

    def __init__(self, client: EngineClient, model_name: str) -> None:
        self.client = client
        self.model_name = model_name
        self.created = int(time.time())

    def models(self) -> dict[str, Any]:
        card: dict[str, Any] = {
            "id": self.model_name,
            "object": "model",
            "created": self.created,
            "owned_by": "radixkv",
        }
        if self.client.max_model_len is not None:
            card["max_model_len"] = self.client.max_model_len
        return {"object": "list", "data": [card]}

    @_api_errors
    async def completions(
        self, body: CompletionRequest, request: Request | None = None
    ) -> Response:
        self._check_model(body.model)
        if isinstance(body.prompt, str):
            # on a worker thread: a long prompt must not stall every client (tokenizers in
            # Rust let go of the GIL)
            encode = self._tokenizer("a text prompt").encode
            prompt_ids = await asyncio.to_thread(encode, body.prompt)
            if not prompt_ids:
                raise ApiError(400, "prompt encodes to no tokens", param="prompt")
        else:
            prompt_ids = list(body.prompt)
        job = await self._start(
            body, prompt_ids, "prompt", body.max_tokens, DEFAULT_COMPLETION_MAX_TOKENS
        )
        return await self._answer(job, body.stream, request)

    @_api_errors
    async def chat(self, body: ChatCompletionRequest, request: Request | None = None) -> Response:
        self._check_model(body.model)
        tokenizer = self._tokenizer("chat")
        messages = [m.as_template_input() for m in body.messages]
        render = functools.partial(tokenizer.apply_chat_template, add_generation_prompt=True)
        try:
            prompt_ids = list(await asyncio.to_thread(render, messages))  # as a text prompt
        except Exception as exc:  # noqa: BLE001 - jinja raises its own errors
            message = f"cannot render the chat template: {exc}"
            raise ApiError(400, message, param="messages") from None
        job = await self._start(
            body, prompt_ids, "messages", body.requested_max_tokens, DEFAULT_CHAT_MAX_TOKENS
        )
        return await self._answer(job, body.stream, request)

    # ---------------------------------------------------------- the request
    def _check_model(self, model: str | None) -> None:
        if model is not None and model != self.model_name:
            raise ApiError(
                404,
                f"the model {model!r} does not exist; this server serves {self.model_name!r}",
                param="model",
                code="model_not_found",
            )

    def _tokenizer(self, what: str) -> Tokenizer:
        if self.client.tokenizer is None:
            raise ApiError(400, f"this server has no tokenizer, so {what} cannot be served")
        return self.client.tokenizer

    def _params(
        self,
        body: Body,
        prompt_ids: Sequence[int],
        prompt_param: str,
        max_tokens: int | None,
        default_max_tokens: int,
    ) -> tuple[SamplingParams, bool]:
        """The request's sampling parameters and whether to cap them to the pool (400s for
        what the client can check: the vocabulary, the pool, the parameters themselves)."""
        client = self.client
        vocab = client.vocab_size
        if vocab is not None and (top := max(prompt_ids)) >= vocab:
            raise ApiError(
                400,
                f"{prompt_param} holds token id {top}, outside the vocabulary (size {vocab})",
                param=prompt_param,
            )
        room = client.max_new_tokens(len(prompt_ids))
        if room == 0:
            raise ApiError(
                400,
                f"the prompt is {len(prompt_ids)} tokens; the KV pool holds at most "
                f"{client.max_model_len} tokens",
                param=prompt_param,
                code="context_length_exceeded",
            )
        cap = max_tokens is None and room is None  # the engine knows its room
        if max_tokens is None:
            max_tokens = default_max_tokens if room is None else min(default_max_tokens, room)
        elif room is not None and max_tokens > room:
            raise ApiError(
                400,
                f"max_tokens is {max_tokens} but a prompt of {len(prompt_ids)} tokens leaves "
                f"room for {room} in the KV pool",
                param="max_tokens",
                code="context_length_exceeded",
            )
        stop_ids = body.stop_ids()
        for param, ids in (("stop", body.stop_ids(only="stop")), ("stop_token_ids", stop_ids)):
            bad = [t for t in ids if vocab is not None and t >= vocab]
            if bad:
                raise ApiError(
                    400,
                    f"{param} holds token ids {bad}, outside the vocabulary (size {vocab})",
                    param=param,
                )
        if not body.ignore_eos and client.tokenizer is not None:
            stop_ids += [t for t in client.tokenizer.stop_token_ids if t not in stop_ids]
        try:
            params = SamplingParams(
                max_new_tokens=max_tokens,
                temperature=body.temperature if body.temperature >= SAMPLING_EPS else 0.0,
                top_p=body.top_p,
                seed=body.seed,
                stop_token_ids=tuple(stop_ids),
            )
        except (TypeError, ValueError) as exc:
            raise ApiError(400, str(exc)) from None
        return params, cap

    async def _start(
        self,
        body: Body,
        prompt_ids: list[int],
        prompt_param: str,
        max_tokens: int | None,
        default_max_tokens: int,
    ) -> _Job:
        """Check the request, then start it (400s first)."""
        params, cap = self._params(body, prompt_ids, prompt_param, max_tokens, default_max_tokens)
        namespace = namespace_of(body.cache_salt, body.user)
        call = await self.client.generate(prompt_ids, params, namespace, cap_to_pool=cap)
        tokenizer = self.client.tokenizer
        decode = tokenizer.decode if tokenizer is not None else lambda ids: ""
        chat = isinstance(body, ChatCompletionRequest)
        return _Job(
            rid=new_id("chatcmpl" if chat else "cmpl"),
            chat=chat,
            call=call,
            text=TextStream(decode, body.stop_strings(), params.stop_token_ids),
            prompt_len=len(prompt_ids),
            token_ids=body.return_token_ids,
            include_usage=body.include_usage,
        )

    # ---------------------------------------------------------- the answer
    async def _answer(self, job: _Job, stream: bool, request: Request | None) -> Response:
        if stream:
            headers = {"Cache-Control": "no-cache", "X-Accel-Buffering": "no"}
            events = self._events(job, request)
            return StreamingResponse(events, media_type="text/event-stream", headers=headers)
        try:
            last, finish = None, None
            async for out, _, reason in self._steps(job, request):
                last, finish = out, reason
        except Exception as exc:  # noqa: BLE001 - OpenAI's error body, whatever failed
            raise as_api_error(exc) from None
        assert last is not None  # a call yields at least its final output
        build = chat_response if job.chat else completion_response
        ids = last.output_ids if job.token_ids else None
        return JSONResponse(
            build(job.rid, self.model_name, job.text.text, finish, job.usage(last), ids)
        )

    async def _steps(
        self, job: _Job, request: Request | None
    ) -> AsyncIterator[tuple[RequestOutput, str, str | None]]:
        """``(output, new text, finish reason or None)`` until the request ends (500 on an
        engine error); a stop string ends it early."""
        watcher = None
        if request is not None:
            watcher = asyncio.create_task(_abort_on_disconnect(job.call, request))
        try:
            async for out in job.call:
                delta = job.text.push(out.output_ids, out.finished)
                if job.text.stopped:
                    yield out, delta, "stop"
                    return
                if out.finish_reason == "error":
                    raise ApiError(500, out.error or "the engine failed", type_="internal_error")
                yield out, delta, out.finish_reason
        finally:
            if watcher is not None:
                watcher.cancel()
            await job.call.aclose()

    async def _events(self, job: _Job, request: Request | None) -> AsyncIterator[str]:
        """The server-sent events of a streamed response, ending in ``[DONE]``."""
        rid, model = job.rid, self.model_name
        last = None
        if job.chat:
            yield _sse(chat_chunk(rid, model, {"role": "assistant", "content": ""}))
        try:
            async for last, delta, finish in self._steps(job, request):
                ids = last.new_token_ids if job.token_ids else None
                if job.chat:
                    if delta or ids:
                        yield _sse(chat_chunk(rid, model, {"content": delta}, None, ids))
                    if finish is not None:
                        yield _sse(chat_chunk(rid, model, {}, finish))
                elif delta or finish is not None or ids:
                    yield _sse(completion_chunk(rid, model, delta, finish, ids))
            if job.include_usage and last is not None:
                obj = "chat.completion.chunk" if job.chat else "text_completion"
                yield _sse(usage_chunk(rid, obj, model, job.usage(last)))
        except Exception as exc:  # noqa: BLE001 - headers are sent: report it in the stream
            yield _sse(as_api_error(exc).body)
        yield "data: [DONE]\n\n"


async def _abort_on_disconnect(call: EngineCall, request: Request) -> None:
    """Abort ``call`` when the client of ``request`` disconnects."""
    while True:
        message = await request.receive()
        if message["type"] == "http.disconnect":
            await call.abort()
            return


def _sse(obj: dict[str, Any]) -> str:
    return f"data: {json.dumps(obj, separators=(',', ':'))}\n\n"
