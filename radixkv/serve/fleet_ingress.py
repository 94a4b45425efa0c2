"""The fleet's front door: the OpenAI API on Serve, turning each request into a routed engine call.

Serve's HTTP proxy hands a deployment opaque ASGI payloads, so no request
router can see a prompt there. :class:`FleetIngress` parses and validates the
OpenAI request (:mod:`radixkv.serve.protocol`), tokenizes it, and calls the
engine deployment's ``generate`` through a streaming handle with the token ids
as the keyword ``prompt_ids``: the handle's request router
(:class:`~radixkv.serve.ray_router.PrefixRouter`) places it by prefix and load.
Text, stop strings and the response shapes are the single-engine server's
(:class:`~radixkv.serve.text.TextStream`, the ``protocol`` builders);
``usage.prompt_tokens_details.cached_tokens`` is what the chosen replica's
cache held.

Routes: ``POST /v1/completions``, ``POST /v1/chat/completions`` (both also as
server-sent events), ``GET /v1/models``, ``GET /health``, and ``GET /router``:
this ingress's router's view of the fleet (load, and the blocks its index
holds per replica).
"""

# No ``from __future__ import annotations``: Serve rebuilds the routes from a by-value pickle
# of this class, whose functions keep only the globals their code names, so FastAPI could
# not resolve string annotations (the request models) there.
import json
import time
from collections.abc import AsyncGenerator, AsyncIterator, Hashable, Sequence
from contextlib import aclosing
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from fastapi import FastAPI
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response, StreamingResponse
from ray import serve
from ray.serve.handle import DeploymentHandle
from starlette.requests import Request

from radixkv.engine.request import SamplingParams
from radixkv.serve import router_registry
from radixkv.serve.app import ApiError
from radixkv.serve.async_engine import RequestOutput
from radixkv.serve.models import ByteTokenizer, ChatTokenizer, Tokenizer, load_hf_tokenizer
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

__all__ = ["FleetIngress", "load_tokenizer"]

COMPLETION_MAX_TOKENS = 16  # OpenAI's default for /v1/completions
CHAT_MAX_TOKENS = 1024  # lowered by the replica to what its pool holds

api = FastAPI(title="radixkv fleet")


@api.exception_handler(ApiError)
async def _api_error(request: Request, exc: ApiError) -> JSONResponse:
    return JSONResponse(exc.body, status_code=exc.status)


@api.exception_handler(RequestValidationError)
async def _invalid(request: Request, exc: RequestValidationError) -> JSONResponse:
    errors = exc.errors()
    first = errors[0] if errors else {}
    path = [str(p) for p in first.get("loc", ()) if p != "body"]
    message = f"{'.'.join(path) or 'the request body'}: {first.get('msg', 'invalid value')}"
    body = error_body(message, param=path[0] if path else None)
    return JSONResponse(body, status_code=400)


def load_tokenizer(spec: str) -> Tokenizer:
    """The tokenizer of the model ``spec`` names, without loading its weights: ``"random"``'s
    byte tokenizer, a Hugging Face directory's ``tokenizer.json``, or a GGUF file's (or
    ``"smollm2"``'s) vocabulary. ``ValueError`` naming ``spec`` when it names none."""
    if spec == "random":
        return ByteTokenizer()
    from radixkv.model.loading import open_gguf
    from radixkv.model.tokenizer import load_gguf_tokenizer, smollm2_gguf_path

    path = smollm2_gguf_path() if spec == "smollm2" else Path(spec)
    if path is None or not Path(path).exists():
        raise ValueError(f"spec {spec!r} is neither 'smollm2', 'random' nor an existing path")
    if Path(path).is_dir():
        return load_hf_tokenizer(path)
    try:
        return ChatTokenizer(load_gguf_tokenizer(open_gguf(path)))
    except (OSError, ValueError, KeyError) as exc:
        raise ValueError(f"spec {spec!r}: {exc}") from exc


def _api_error_of(exc: Exception) -> ApiError:
    """``exc`` as the API reports it: an ``ApiError`` as is, anything else a 500."""
    if isinstance(exc, ApiError):
        return exc
    return ApiError(500, f"{type(exc).__name__}: {exc}", type_="internal_error")


def _sse(obj: dict[str, Any]) -> str:
    return f"data: {json.dumps(obj, separators=(',', ':'))}\n\n"


class _Job:
    """One request's answer: its text so far and how to shape the response."""

    def __init__(
        self,
        *,
        rid: str,
        model: str,
        chat: bool,
        text: TextStream,
        prompt_len: int,
        token_ids: bool,
        include_usage: bool,
    ) -> None:
        self.rid, self.model, self.chat, self.text = rid, model, chat, text
        self.prompt_len, self.token_ids, self.include_usage = prompt_len, token_ids, include_usage

    def _usage(self, out: RequestOutput) -> dict[str, Any]:
        return usage(self.prompt_len, len(out.output_ids), out.cached_tokens)

    async def _steps(
        self, outputs: AsyncGenerator[RequestOutput, None]
    ) -> AsyncIterator[tuple[RequestOutput, str, str | None]]:
        """``(output, new text, finish reason or None)`` until the request ends (500 on an
        engine error); a stop string ends it early."""
        async with aclosing(outputs):  # leaving early cancels the routed call
            async for out in outputs:
                delta = self.text.push(out.output_ids, out.finished)
                if self.text.stopped:
                    yield out, delta, "stop"
                    return
                if out.finish_reason == "error":
                    raise ApiError(500, out.error or "the engine failed", type_="internal_error")
                yield out, delta, out.finish_reason

    async def collect(self, outputs: AsyncGenerator[RequestOutput, None]) -> dict[str, Any]:
        """The whole response object."""
        steps = [step async for step in self._steps(outputs)]
        last, _, finish = steps[-1]  # _outputs yields at least one output
        ids = last.output_ids if self.token_ids else None
        if self.chat:
            return chat_response(
                self.rid, self.model, self.text.text, finish, self._usage(last), ids
            )
        return completion_response(
            self.rid, self.model, self.text.text, finish, self._usage(last), ids
        )

    async def events(self, outputs: AsyncGenerator[RequestOutput, None]) -> AsyncIterator[str]:
        """The server-sent events of a streamed response, ending in ``[DONE]``."""
        obj = "chat.completion.chunk" if self.chat else "text_completion"
        last = None
        if self.chat:
            yield _sse(chat_chunk(self.rid, self.model, {"role": "assistant", "content": ""}))
        try:
            async for last, delta, finish in self._steps(outputs):
                ids = last.new_token_ids if self.token_ids else None
                if self.chat:
                    if delta or ids:
                        yield _sse(chat_chunk(self.rid, self.model, {"content": delta}, None, ids))
                    if finish is not None:
                        yield _sse(chat_chunk(self.rid, self.model, {}, finish))
                elif delta or finish is not None or ids:
                    yield _sse(completion_chunk(self.rid, self.model, delta, finish, ids))
            if self.include_usage and last is not None:
                yield _sse(usage_chunk(self.rid, obj, self.model, self._usage(last)))
        except Exception as exc:  # noqa: BLE001 - headers are sent: report it in the stream
            yield _sse(_api_error_of(exc).body)
        yield "data: [DONE]\n\n"


@dataclass(frozen=True)
class PromptText:
    """A call's prompt as text, for routers that match on text (Ray's prefix router)."""

    prompt: str


# serve.ingress pickles the app's routes when the class is defined: everything they use
# must be defined above this line.
@serve.deployment(name="FleetIngress")
@serve.ingress(api)
class FleetIngress:
    """The OpenAI API over a deployment of :class:`~radixkv.serve.fleet.EngineReplica`
    (``engine``, a handle), for the model ``model`` served as ``model_name``."""

    def __init__(
        self,
        engine: DeploymentHandle,
        *,
        model: str,
        model_name: str,
        send_prompt_text: bool = False,
    ) -> None:
        self.engine = engine
        self.tokenizer = load_tokenizer(model)
        self.model_name = model_name
        self.created = int(time.time())
        self.send_prompt_text = send_prompt_text

    # ------------------------------------------------------------ routes
    @api.post("/v1/completions", response_model=None)
    async def completions(self, body: CompletionRequest) -> Response:
        self._check_model(body.model)
        if isinstance(body.prompt, str):
            prompt_ids = self.tokenizer.encode(body.prompt)
            if not prompt_ids:
                raise ApiError(400, "prompt encodes to no tokens", param="prompt")
        else:
            prompt_ids = list(body.prompt)
        return await self._answer(body, prompt_ids, body.max_tokens, COMPLETION_MAX_TOKENS)

    @api.post("/v1/chat/completions", response_model=None)
    async def chat_completions(self, body: ChatCompletionRequest) -> Response:
        self._check_model(body.model)
        messages = [m.as_template_input() for m in body.messages]
        try:
            prompt_ids = list(self.tokenizer.apply_chat_template(messages))
        except Exception as exc:  # noqa: BLE001 - jinja raises its own errors
            message = f"cannot render the chat template: {exc}"
            raise ApiError(400, message, param="messages") from None
        return await self._answer(body, prompt_ids, body.requested_max_tokens, CHAT_MAX_TOKENS)

    @api.get("/v1/models")
    async def models(self) -> dict[str, Any]:
        card = {"id": self.model_name, "object": "model", "created": self.created}
        return {"object": "list", "data": [{**card, "owned_by": "radixkv"}]}

    @api.get("/health")
    async def health(self) -> Response:
        return Response(status_code=200)

    @api.get("/replicas")
    async def replica_stats(self) -> dict[str, Any]:
        """Every engine replica's counters (:meth:`EngineReplica.stats`), by replica id: what
        a benchmark reads before and after a run for requests served per replica."""
        response = self.engine.broadcast("stats")
        return {s["replica_id"]: s for s in await response.results_async(timeout_s=30)}

    @api.get("/router")
    async def routing_snapshot(self) -> dict[str, Any]:
        """Per replica, as this ingress's router sees it: in flight, the reported load and
        the block hashes its index holds; {} before the first routed request (Serve builds
        a handle's router lazily) or under Serve's own router."""
        out: dict[str, Any] = {}
        for r in router_registry.live_routers(self.engine.deployment_name, self.engine.app_name):
            out.update(await r.snapshot_threadsafe())
        return out

    # ------------------------------------------------------------ requests
    def _check_model(self, model: str | None) -> None:
        if model is not None and model != self.model_name:
            raise ApiError(
                404,
                f"the model {model!r} does not exist; this server serves {self.model_name!r}",
                param="model",
                code="model_not_found",
            )

    def _params(
        self, body: CompletionRequest | ChatCompletionRequest, max_tokens: int | None, default: int
    ) -> SamplingParams:
        stop_ids = body.stop_ids()
        if not body.ignore_eos:
            stop_ids += [t for t in self.tokenizer.stop_token_ids if t not in stop_ids]
        try:
            return SamplingParams(
                max_new_tokens=default if max_tokens is None else max_tokens,
                temperature=body.temperature,
                top_p=body.top_p,
                seed=body.seed,
                stop_token_ids=tuple(stop_ids),
            )
        except (TypeError, ValueError) as exc:
            raise ApiError(400, str(exc)) from None

    async def _outputs(
        self, prompt_ids: Sequence[int], params: SamplingParams, namespace: Hashable, cap: bool
    ) -> AsyncGenerator[RequestOutput, None]:
        """The routed call's outputs; its first one is awaited here, so a request the replica
        refuses is a 400 before any response starts. Leaving early cancels the call (the
        replica aborts the request)."""
        # Ray's PrefixCacheAffinityRouter reads text from a positional argument with a
        # ``prompt`` attribute; radixkv's routers read the ``prompt_ids`` keyword.
        hint = None
        if self.send_prompt_text:
            hint = PromptText(self.tokenizer.decode(list(prompt_ids)))
        call = self.engine.options(stream=True).generate.remote(
            hint, prompt_ids=list(prompt_ids), params=params, namespace=namespace, cap_to_pool=cap
        )
        try:
            first = await call.__anext__()
        except (TypeError, ValueError) as exc:  # Ray's wrapper is also the cause's type
            raise ApiError(400, str(getattr(exc, "cause", exc))) from None
        except Exception as exc:  # noqa: BLE001 - a replica lost after accepting the call
            raise _api_error_of(exc) from None

        async def rest() -> AsyncGenerator[RequestOutput, None]:
            finished = first.finished
            try:
                yield first
                async for out in call:
                    finished = out.finished
                    yield out
            finally:
                if not finished:
                    call.cancel()

        return rest()

    async def _answer(
        self,
        body: CompletionRequest | ChatCompletionRequest,
        prompt_ids: list[int],
        max_tokens: int | None,
        default: int,
    ) -> Response:
        params = self._params(body, max_tokens, default)
        namespace = namespace_of(body.cache_salt, body.user)
        outputs = await self._outputs(prompt_ids, params, namespace, cap=max_tokens is None)
        chat = isinstance(body, ChatCompletionRequest)
        job = _Job(
            rid=new_id("chatcmpl" if chat else "cmpl"),
            model=self.model_name,
            chat=chat,
            text=TextStream(self.tokenizer.decode, body.stop_strings(), params.stop_token_ids),
            prompt_len=len(prompt_ids),
            token_ids=body.return_token_ids,
            include_usage=body.include_usage,
        )
        if body.stream:
            headers = {"Cache-Control": "no-cache", "X-Accel-Buffering": "no"}
            return StreamingResponse(
                job.events(outputs), media_type="text/event-stream", headers=headers
            )
        try:
            return JSONResponse(await job.collect(outputs))
        except Exception as exc:  # noqa: BLE001 - OpenAI's error body, whatever failed
            raise _api_error_of(exc) from None
