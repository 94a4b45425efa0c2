"""The OpenAI API's request handling, written once over any engine client.

:class:`OpenAIHandlers` (over an :class:`~radixkv.serve.openai.client.EngineClient`) turns a
parsed request (:mod:`radixkv.serve.openai.protocol`) into prompts (token ids) and
:class:`~radixkv.engine.request.SamplingParams`, starts
one engine call per choice (``n`` per prompt: forks of one prompt share its blocks,
since the first fork's prefill is cached before the others are admitted) and shapes
what comes back (:mod:`radixkv.serve.openai.choices`): one JSON response, or server-sent
events ending in ``data: [DONE]``, every choice's chunks as they come, each with its
``index``; text and stop strings through :class:`~radixkv.text.stream.TextStream`;
``usage`` with the prompt tokens the cache held. A bad request is an
:class:`~radixkv.serve.openai.errors.ApiError` (OpenAI's error body) before the engine sees
any of it: what the engine would refuse is found by the engine's own check
(:func:`~radixkv.engine.request.check_prompt` and ``check_params`` over the client's
limits), whose errors are mapped to 400s here; any other failure is logged and answered
as a 500 with that body (an exception escaping the app would drop the client's
keep-alive connection). Prompts are
tokenized (and chat templates rendered) on a worker thread, so a long prompt does not
stall the event loop; a ``temperature`` below :data:`SAMPLING_EPS` is greedy, as in
vLLM. The single-engine app (:mod:`radixkv.serve.app`) and the fleet's ingress
(:mod:`radixkv.serve.ray.ingress`) differ only in their client and their routes. Part of
the torch-free OpenAI layer: nothing here loads a model.
"""

from __future__ import annotations

import asyncio
import dataclasses
import functools
import json
import logging
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Mapping, Sequence
from typing import Any, ParamSpec, TypeVar

from fastapi import Request
from fastapi.responses import JSONResponse, Response, StreamingResponse

from radixkv.engine.request import (
    ContextLengthError,
    EngineLimits,
    RequestError,
    SamplingParams,
    check_params,
    check_prompt,
    check_token_ids,
)
from radixkv.serve.openai.choices import Choice, Prompt, ReplySpec, fork_seed, merged, usage_of
from radixkv.serve.openai.client import EngineCall, EngineClient, RequestOutput
from radixkv.serve.openai.errors import ApiError, as_api_error
from radixkv.serve.openai.metrics import NO_REQUEST_METRICS, RequestMetrics
from radixkv.serve.openai.protocol import (
    ChatCompletionRequest,
    CompletionRequest,
    DetokenizeRequest,
    FieldError,
    TokenizeRequest,
    namespace_of,
    new_id,
)
from radixkv.serve.openai.responses import envelope
from radixkv.text.stream import TextStream
from radixkv.text.tokenizer import Tokenizer, encode_plain, render_chat, tokenizer_info

__all__ = ["DEFAULT_CHAT_MAX_TOKENS", "DEFAULT_COMPLETION_MAX_TOKENS", "OpenAIHandlers"]

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
        except FieldError as exc:
            raise ApiError(400, str(exc), param=exc.param) from None
        except Exception as exc:  # noqa: BLE001 - OpenAI's error body, whatever failed
            log.exception("a request failed")
            raise as_api_error(exc) from None

    return wrapper


@dataclasses.dataclass
class _Reply:
    """One request being answered: its choices and how to shape the response."""

    rid: str
    spec: ReplySpec
    prompts: list[Prompt]
    choices: list[Choice]
    include_usage: bool
    continuous_usage: bool  # usage on every chunk (vLLM's continuous_usage_stats)
    received: float  # loop clock (time.perf_counter) when the request arrived
    ended: dict[int, int] = dataclasses.field(default_factory=dict)  # prompt -> choices ended


class OpenAIHandlers:
    """The endpoints' logic over ``client``, apart from routing, for the model ``model_name``.

    ``context_len`` is the model's context length (the longest prompt plus reply it takes;
    None: only the client's limit, the pool's, bounds it); :attr:`limits` are the
    client's with the smaller of the two as ``max_model_len``, which ``/v1/models``
    reports; ``metrics`` records each choice's latencies and lengths.
    ``request``, where a route passes it, is watched: a client that disconnects has
    its request aborted.
    """

    def __init__(
        self,
        client: EngineClient,
        model_name: str,
        *,
        context_len: int | None = None,
        metrics: RequestMetrics = NO_REQUEST_METRICS,
    ) -> None:
        self.client = client
        self.model_name = model_name
        self.limits: EngineLimits = client.limits.within(context_len)
        """What a request is checked against: the engine's limits, within the context."""
        self.metrics = metrics
        self.created = int(time.time())

    # ------------------------------------------------------------ models, tokens
    def model_card(self) -> dict[str, Any]:
        """The served model as ``/v1/models`` lists it."""
        card: dict[str, Any] = {
            "id": self.model_name,
            "object": "model",
            "created": self.created,
            "owned_by": "radixkv",
            "root": self.model_name,
            "parent": None,
            "max_model_len": self.max_model_len,
        }
        return card

    @property
    def max_model_len(self) -> int:
        """The most tokens a request may have, prompt plus ``max_tokens``: the client's limit
        (the pool's), or the model's context length where that is shorter."""
        return self.limits.max_model_len

    def models(self) -> dict[str, Any]:
        return {"object": "list", "data": [self.model_card()]}

    def model(self, model_id: str) -> dict[str, Any]:
        """``GET /v1/models/{model_id}``: the card, or a 404 naming the model."""
        self._check_model(model_id)
        return self.model_card()

    @_api_errors
    async def tokenize(self, body: TokenizeRequest) -> dict[str, Any]:
        """vLLM's ``POST /tokenize``: ``{"count", "max_model_len", "tokens", "token_strs"}``."""
        self._check_model(body.model)
        body.check()
        if body.prompt is not None:
            tokenizer = self._tokenizer("a text prompt")
            if body.add_special_tokens is False:
                try:
                    ids = await asyncio.to_thread(encode_plain, tokenizer, body.prompt)
                except ValueError as exc:
                    raise ApiError(400, str(exc), param="add_special_tokens") from None
            else:
                ids = await asyncio.to_thread(tokenizer.encode, body.prompt)
        else:
            assert body.messages is not None
            ids = await self._render(
                body.messages,
                body.add_generation_prompt,
                body.continue_final_message,
                body.chat_template_kwargs,
            )
        strs = [self._token_text(False)(t) for t in ids] if body.return_token_strs else None
        return {
            "count": len(ids),
            "max_model_len": self.max_model_len,
            "tokens": ids,
            "token_strs": strs,
        }

    @_api_errors
    async def tokenizer_info(self) -> dict[str, Any]:
        """vLLM's ``GET /tokenizer_info`` (:func:`~radixkv.text.tokenizer.tokenizer_info`),
        with ``model_max_length``; a 400 when the server has no tokenizer."""
        info = tokenizer_info(self._tokenizer("the tokenizer's description"))
        return {**info, "model_max_length": self.max_model_len}

    @_api_errors
    async def detokenize(self, body: DetokenizeRequest) -> dict[str, Any]:
        """vLLM's ``POST /detokenize``: ``{"prompt"}``, the text of ``tokens``."""
        self._check_model(body.model)
        try:
            check_token_ids("tokens", body.tokens, self.limits.vocab_size)
        except RequestError as exc:
            raise _refused(exc, body) from None
        decode = self._tokenizer("detokenizing").decode
        return {"prompt": await asyncio.to_thread(decode, body.tokens)}

    # ------------------------------------------------------------ generation
    @_api_errors
    async def completions(
        self, body: CompletionRequest, request: Request | None = None
    ) -> Response:
        received = time.perf_counter()
        self._check_model(body.model)
        body.check()
        texts = [p for p in body.prompts() if isinstance(p, str)]
        if texts:
            # on a worker thread: a long prompt must not stall every client (tokenizers in
            # Rust let go of the GIL)
            encode = self._tokenizer("a text prompt").encode
            encoded = iter(await asyncio.to_thread(lambda: [encode(t) for t in texts]))
        prompts = []
        for p in body.prompts():
            if isinstance(p, str):
                prompts.append(Prompt(next(encoded), p))
                if not prompts[-1].ids:
                    raise ApiError(400, "prompt encodes to no tokens", param="prompt")
            else:
                prompts.append(Prompt(list(p)))
        reply = await self._start(body, prompts, "prompt", DEFAULT_COMPLETION_MAX_TOKENS, received)
        return await self._answer(reply, body.stream, request)

    @_api_errors
    async def chat(self, body: ChatCompletionRequest, request: Request | None = None) -> Response:
        received = time.perf_counter()
        self._check_model(body.model)
        body.check()
        ids = await self._render(
            body.messages,
            body.add_generation_prompt,
            body.continue_final_message,
            body.template_variables(),
        )
        reply = await self._start(
            body, [Prompt(ids)], "messages", DEFAULT_CHAT_MAX_TOKENS, received
        )
        return await self._answer(reply, body.stream, request)

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

    async def _render(
        self,
        messages: Sequence[Any],
        add_generation_prompt: bool,
        continue_final: bool,
        variables: Mapping[str, Any] | None,
    ) -> list[int]:
        """The chat prompt's ids (on a worker thread), ``variables`` (``chat_template_kwargs``,
        checked by the request's ``check()``) passed to the template; 400 naming
        ``messages`` if the template fails."""
        tokenizer = self._tokenizer("chat")
        inputs = [m.as_template_input() for m in messages]
        render = functools.partial(
            render_chat,
            tokenizer,
            inputs,
            add_generation_prompt=add_generation_prompt,
            continue_final_message=continue_final,
            variables=variables,
        )
        try:
            return list(await asyncio.to_thread(render))
        except Exception as exc:  # noqa: BLE001 - jinja raises its own errors
            message = f"cannot render the chat template: {exc}"
            raise ApiError(400, message, param="messages") from None

    def _token_text(self, as_ids: bool) -> Callable[[int], str]:
        """A token's text as logprobs show it: its id decoded alone, or ``token_id:N``."""
        if as_ids:
            return lambda t: f"token_id:{t}"
        tokenizer = self.client.tokenizer
        if tokenizer is None:
            return lambda t: ""
        return lambda t: tokenizer.decode([t])

    def _truncate(self, body: Body, prompt: Prompt) -> Prompt:
        """vLLM's ``truncate_prompt_tokens``: keep the prompt's last k tokens (-1: as many as
        the model takes)."""
        k = body.truncate_prompt_tokens
        if k is None:
            return prompt
        if k == -1:
            k = self.max_model_len
        return prompt if len(prompt.ids) <= k else Prompt(prompt.ids[-k:])

    def _params(
        self, body: Body, prompt: Prompt, prompt_param: str, default_max_tokens: int
    ) -> tuple[SamplingParams, bool]:
        """The prompt's sampling parameters, and whether to keep the output (an echo with
        ``max_tokens`` 0 keeps none). Checked as the engine checks a request
        (:func:`~radixkv.engine.request.check_prompt`, then ``check_params``, over
        :attr:`limits`): a 400 naming the field the engine's error names (:func:`_refused`).
        Without ``max_tokens``, ``default_max_tokens`` within the room the prompt leaves."""
        limits = self.limits
        try:
            check_prompt(prompt.ids, limits)
            # stop's ids join stop_token_ids below: blame stop for its own
            check_token_ids("stop", body.stop_ids(only="stop"), limits.vocab_size)
        except RequestError as exc:
            raise _refused(exc, body, prompt_param) from None
        max_tokens = body.requested_max_tokens
        keep = max_tokens != 0
        if not keep:
            max_tokens = 1  # an echo: one token, dropped, to score the prompt
        if max_tokens is None:
            max_tokens = min(default_max_tokens, limits.max_new_tokens(len(prompt.ids)))
        stop_ids = body.stop_ids()
        bias = body.logit_bias_pairs()  # once: up to MAX_TOKEN_IDS entries
        if not body.ignore_eos and self.client.tokenizer is not None:
            stop_ids += [t for t in self.client.tokenizer.stop_token_ids if t not in stop_ids]
        top = body.num_top_logprobs
        echoed = top if body.echoes_prompt else None
        asks = [k for k in (body.prompt_logprobs, echoed) if k is not None]
        try:
            params = SamplingParams(
                max_new_tokens=max_tokens,
                temperature=body.temperature if body.temperature >= SAMPLING_EPS else 0.0,
                top_p=body.top_p,
                top_k=max(body.top_k, 0),
                min_p=body.min_p,
                repetition_penalty=body.repetition_penalty,
                presence_penalty=body.presence_penalty,
                frequency_penalty=body.frequency_penalty,
                logit_bias=bias,
                min_tokens=body.min_tokens if keep else 0,
                seed=body.seed,
                stop_token_ids=tuple(stop_ids),
                top_logprobs=top or 0,
                prompt_logprobs=max(asks) if asks else None,
            )
        except (TypeError, ValueError) as exc:  # its messages start with the field's name
            field = str(exc).split(" ", 1)[0].split("[", 1)[0]  # "stop_token_ids[2] must ..."
            raise ApiError(
                400, str(exc), param=field if field in type(body).model_fields else None
            ) from None
        try:
            check_params(params, len(prompt.ids), limits)
        except RequestError as exc:
            raise _refused(exc, body, prompt_param) from None
        return params, keep

    async def _start(
        self,
        body: Body,
        prompts: list[Prompt],
        prompt_param: str,
        default_max_tokens: int,
        received: float,
    ) -> _Reply:
        """Check every prompt, then start every choice (400s before any starts)."""
        prompts = [self._truncate(body, p) for p in prompts]
        plans = [self._params(body, p, prompt_param, default_max_tokens) for p in prompts]
        namespace = namespace_of(body.cache_salt, body.user)
        tokenizer = self.client.tokenizer
        decode = tokenizer.decode if tokenizer is not None else lambda ids: ""
        chat = isinstance(body, ChatCompletionRequest)
        spec = ReplySpec(
            chat=chat,
            echo=body.echoes_prompt,
            top_logprobs=body.num_top_logprobs,
            prompt_logprobs=body.prompt_logprobs,
            token_ids=body.return_token_ids,
            token_text=self._token_text(body.return_tokens_as_token_ids),
            decode=decode,
        )
        starts: list[tuple[Prompt, int, SamplingParams, bool]] = []
        for pi, (prompt, (params, keep)) in enumerate(zip(prompts, plans, strict=True)):
            for fork in range(body.n):
                seed = fork_seed(params.seed, fork)
                forked = params if seed == params.seed else dataclasses.replace(params, seed=seed)
                starts.append((prompt, pi, forked, keep))
        asked = body.requested_max_tokens
        self.metrics.started(body.n, plans[0][0].max_new_tokens if asked is None else asked)
        echo_only = spec.echo and spec.top_logprobs is None and body.prompt_logprobs is None

        async def start(prompt: Prompt, params: SamplingParams, keep: bool) -> Any:
            if echo_only and not keep:
                return None  # the prompt is the whole reply: nothing to run
            return await self.client.generate(prompt.ids, params, namespace)

        results = await asyncio.gather(
            *(start(p, sp, keep) for p, _, sp, keep in starts), return_exceptions=True
        )
        failed = [r for r in results if isinstance(r, BaseException)]
        if failed:
            for r in results:
                if r is not None and not isinstance(r, BaseException):
                    await r.aclose()
            raise failed[0]
        choices = [
            Choice(
                index=k,
                prompt_index=pi,
                prompt=prompt,
                spec=spec,
                call=call,
                text=TextStream(
                    decode, body.stop_strings(), params.stop_token_ids, body.min_tokens
                ),
                keep_output=keep,
            )
            for k, ((prompt, pi, params, keep), call) in enumerate(
                zip(starts, results, strict=True)
            )
        ]
        rid = new_id("chatcmpl" if chat else "cmpl")
        return _Reply(
            rid, spec, prompts, choices, body.include_usage, body.continuous_usage, received
        )

    # ---------------------------------------------------------- the answer
    async def _answer(self, reply: _Reply, stream: bool, request: Request | None) -> Response:
        if stream:
            headers = {"Cache-Control": "no-cache", "X-Accel-Buffering": "no"}
            events = self._events(reply, request)
            return StreamingResponse(events, media_type="text/event-stream", headers=headers)
        try:
            async for _ in self._outputs(reply, request):
                pass
        except Exception as exc:  # noqa: BLE001 - OpenAI's error body, whatever failed
            raise as_api_error(exc) from None
        obj = "chat.completion" if reply.spec.chat else "text_completion"
        choices = [c.response() for c in reply.choices]
        extra: dict[str, Any] = {"usage": usage_of(reply.choices, reply.prompts)}
        if reply.spec.chat and reply.spec.prompt_logprobs is not None:
            # vLLM's place for a chat's: the response's, since every choice has one prompt
            extra["prompt_logprobs"] = reply.choices[0].prompt_logprobs()
        return JSONResponse(envelope(reply.rid, obj, self.model_name, choices, **extra))

    async def _outputs(
        self, reply: _Reply, request: Request | None
    ) -> AsyncIterator[tuple[Choice, RequestOutput | None, str, str | None]]:
        """``(choice, output, new text, finish reason or None)`` for every choice's outputs
        as they come, until all end (500 on an engine error). A client that disconnects
        has every call aborted."""
        watcher = None
        calls = [c.call for c in reply.choices if c.call is not None]
        if request is not None and calls:
            watcher = asyncio.create_task(_abort_on_disconnect(calls, request))
        try:
            steps = [self._steps(c, reply) for c in reply.choices]
            async for k, (out, delta, finish) in merged(steps):
                yield reply.choices[k], out, delta, finish
        finally:
            if watcher is not None:
                watcher.cancel()

    async def _steps(
        self, choice: Choice, reply: _Reply
    ) -> AsyncIterator[tuple[RequestOutput | None, str, str | None]]:
        """One choice's ``(output, new text, finish reason)`` until it ends (500 on an engine
        error); a stop string ends it early. Its call is closed at the end."""
        call = choice.call
        if call is None:
            delta, finish = choice.step(None, time.perf_counter())
            yield None, delta, finish
            self._record(choice, reply)
            return
        try:
            async for out in call:
                delta, finish = choice.step(out, time.perf_counter())
                if out.finish_reason == "error" and not choice.text.stopped:
                    raise ApiError(500, out.error or "the engine failed", type_="internal_error")
                yield out, delta, finish
                if finish is not None:
                    self._record(choice, reply)
                    return
        finally:
            await call.aclose()

    def _record(self, choice: Choice, reply: _Reply) -> None:
        """Record that ``choice`` ended; once all of its prompt's ``n`` choices have, the
        longest output among them. O(n) for the last of them, O(1) before."""
        self.metrics.finished(choice, reply.received, time.perf_counter())
        pi, n = choice.prompt_index, len(reply.choices) // len(reply.prompts)
        reply.ended[pi] = ended = reply.ended.get(pi, 0) + 1
        if ended == n:  # a prompt's choices are consecutive, n of them
            siblings = reply.choices[pi * n : (pi + 1) * n]
            self.metrics.prompt_finished(max(len(c.token_ids) for c in siblings))

    async def _events(self, reply: _Reply, request: Request | None) -> AsyncIterator[str]:
        """The server-sent events of a streamed response, ending in ``[DONE]``."""
        rid, model, spec = reply.rid, self.model_name, reply.spec
        obj = "chat.completion.chunk" if spec.chat else "text_completion"

        def chunk(piece: dict[str, Any]) -> str:
            if reply.continuous_usage:  # the request's usage so far, as vLLM sends it
                usage = usage_of(reply.choices, reply.prompts)
                return _sse(envelope(rid, obj, model, [piece], usage=usage))
            return _sse(envelope(rid, obj, model, [piece]))

        if spec.chat:
            for c in reply.choices:
                yield chunk(_role_choice(c.index, {"role": "assistant", "content": ""}))
        try:
            async for choice, out, delta, finish in self._outputs(reply, request):
                for piece in choice.chunks(out, delta, finish):
                    yield chunk(piece)
            if reply.include_usage:
                usage = usage_of(reply.choices, reply.prompts)
                yield _sse(envelope(rid, obj, model, [], usage=usage))
        except Exception as exc:  # noqa: BLE001 - headers are sent: report it in the stream
            yield _sse(as_api_error(exc).body)
        yield "data: [DONE]\n\n"


def _refused(exc: RequestError, body: Any, prompt_param: str = "prompt") -> ApiError:
    """The engine's refusal ``exc`` as OpenAI's 400: ``param`` is ``body``'s name for the field
    the engine names (``prompt_param`` for the prompt; ``max_tokens``, or chat's
    ``max_completion_tokens`` where given, for ``max_new_tokens``; None for a field the API
    does not have), and the message says it; ``code`` ``context_length_exceeded`` when the
    request does not fit."""
    names = {"prompt": prompt_param, "max_new_tokens": "max_tokens"}
    if isinstance(body, ChatCompletionRequest) and body.max_completion_tokens is not None:
        names["max_new_tokens"] = "max_completion_tokens"
    param: str | None = names.get(exc.param, exc.param)
    if param not in type(body).model_fields:
        param = None
    message = str(exc) if param is None else exc.message_for(param)
    code = "context_length_exceeded" if isinstance(exc, ContextLengthError) else None
    return ApiError(400, message, param=param, code=code)


def _role_choice(index: int, delta: dict[str, str]) -> dict[str, Any]:
    return {"index": index, "delta": delta, "logprobs": None, "finish_reason": None}


async def _abort_on_disconnect(calls: Sequence[EngineCall], request: Request) -> None:
    """Abort every call of ``request`` when its client disconnects."""
    while True:
        message = await request.receive()
        if message["type"] == "http.disconnect":
            for call in calls:
                await call.abort()
            return


def _sse(obj: dict[str, Any]) -> str:
    return f"data: {json.dumps(obj, separators=(',', ':'))}\n\n"
