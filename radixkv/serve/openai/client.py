"""What the OpenAI layer needs of whatever runs its requests, and the records that cross that line.

The handlers (:mod:`~radixkv.serve.openai.handlers`) serve one engine on this process
(:mod:`~radixkv.serve.app`) and a fleet of engines on Ray Serve
(:mod:`~radixkv.serve.ray.ingress`) alike, through an :class:`EngineClient`: it starts
requests, each an :class:`EngineCall` whose outputs are :class:`RequestOutput` records;
an engine's load is an :class:`EngineMetrics` snapshot. Plain records and protocols:
this module, like the whole OpenAI layer, imports no torch, so an ingress that only
parses, tokenizes and routes never loads a model.
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Hashable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Protocol

from radixkv.engine.request import EngineLimits, PromptLogprobs, SamplingParams

if TYPE_CHECKING:
    from radixkv.text.tokenizer import Tokenizer

__all__ = ["EngineCall", "EngineClient", "EngineMetrics", "RequestOutput", "TopLogprobs"]

TopLogprobs = list[tuple[int, float]]


@dataclass(frozen=True)
class RequestOutput:
    """A request's progress since the previous output its stream yielded.

    ``new_token_ids`` are the tokens sampled since then (possibly several, when
    the consumer was slower than the engine; empty only in a final output that
    brings no token, e.g. an abort); ``output_ids`` all of them so far. Once
    ``finished``, ``finish_reason`` is ``"length"``, ``"stop"`` (a stop token, kept
    in the ids), ``"abort"`` or ``"error"`` (then ``error`` says why).
    ``cached_tokens`` is the prompt prefix found in the cache at admission (0
    before it).

    What the engine knew of the new tokens: ``logprobs`` (the model's logprob of each),
    ``top_logprobs`` (the likeliest alternatives at each position, where the request
    asked; else empty lists) and ``token_times`` (when each was sampled, the engine's
    ``time.perf_counter``); these three align with ``new_token_ids``. Once known and
    from then on: ``prompt_logprobs`` (where asked), ``arrival_time`` (queued in the
    engine) and ``scheduled_time`` (first scheduled), on the same clock.
    """

    request_id: int
    new_token_ids: list[int]
    output_ids: list[int]
    finished: bool
    finish_reason: str | None
    prompt_tokens: int
    cached_tokens: int
    error: str | None
    logprobs: list[float] = field(default_factory=list)
    top_logprobs: list[TopLogprobs] = field(default_factory=list)
    token_times: list[float] = field(default_factory=list)
    prompt_logprobs: PromptLogprobs | None = None
    arrival_time: float | None = None
    scheduled_time: float | None = None


@dataclass(frozen=True)
class EngineMetrics:
    """A snapshot of one engine, taken on its thread after each step.

    Gauges: ``running`` / ``waiting`` requests; ``kv_usage``, the fraction of the
    KV pool requests hold (blocks only the cache holds are free to evict and do not
    count, as in vLLM's ``kv_cache_usage_perc``). Counters since the engine was
    built: ``prefix_cache_queries`` / ``prefix_cache_hits`` (prompt tokens looked up
    in the cache / found there, vLLM's names; a preempted request looks up again),
    ``preemptions``, ``failed_steps``. Counters since the engine's
    :class:`~radixkv.serve.async_engine.AsyncEngine` was built: ``requests_finished``
    (any finish reason), ``prompt_tokens`` (of requests that got their first token),
    ``generation_tokens``.
    """

    running: int
    waiting: int
    kv_usage: float
    prefix_cache_queries: int
    prefix_cache_hits: int
    preemptions: int
    requests_finished: int
    prompt_tokens: int
    generation_tokens: int
    failed_steps: int


class EngineCall(Protocol):
    """One request in flight: its outputs, the last one final."""

    def __aiter__(self) -> AsyncIterator[RequestOutput]: ...

    async def aclose(self) -> None:
        """Stop listening; end the request if it has not finished. Idempotent."""

    async def abort(self) -> None:
        """End the request from another task (its client went away)."""


class EngineClient(Protocol):
    """What the handlers need of whatever serves a request: one engine or a fleet.

    ``tokenizer`` is None where only token ids are served. ``limits`` are the engine's
    (a fleet's replicas'), fixed: the handlers check every request against them with the
    engine's own check (:func:`~radixkv.engine.request.check_request`), so a request the
    engine would refuse is a 400 naming the field before any choice starts.
    """

    tokenizer: Tokenizer | None

    @property
    def limits(self) -> EngineLimits: ...

    async def generate(
        self, prompt_ids: list[int], params: SamplingParams, namespace: Hashable
    ) -> EngineCall:
        """Start one request (checked against :attr:`limits`). ``ApiError`` if the engine
        refuses it anyway, before anything is answered."""
