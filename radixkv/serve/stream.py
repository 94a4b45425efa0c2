"""What a consumer of :class:`~radixkv.serve.async_engine.AsyncEngine` sees: one stream per request.

The engine thread posts a :class:`Delta` per request and step into the request's
``asyncio.Queue``, with a :class:`TokenInfo` (the new tokens' logprobs and times) where
the engine produced tokens; :class:`RequestStream` turns them into
:class:`~radixkv.serve.openai.client.RequestOutput` (the new tokens and what is known of them,
all tokens so far, how it ended) and aborts the request when its consumer leaves.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass

from radixkv.engine.request import PromptLogprobs
from radixkv.serve.openai.client import RequestOutput, TopLogprobs

__all__ = ["Delta", "RequestStream", "TokenInfo"]


@dataclass(frozen=True)
class TokenInfo:
    """What the engine knew of a request's tokens sampled since its last :class:`Delta`:
    their logprobs, their top alternatives (empty lists where not asked), when each was
    sampled; and the request's prompt logprobs (where asked), arrival and first
    scheduling times (``time.perf_counter``)."""

    logprobs: list[float]
    top_logprobs: list[TopLogprobs]
    times: list[float]
    prompt_logprobs: PromptLogprobs | None
    arrival_time: float
    scheduled_time: float | None


@dataclass(frozen=True)
class Delta:
    """What the engine thread posts for one request after a step (or an abort); ``info``
    describes ``new_token_ids`` where the engine sampled them."""

    new_token_ids: list[int]
    finish_reason: str | None
    prompt_tokens: int
    cached_tokens: int
    error: str | None
    info: TokenInfo | None = None


class RequestStream(AsyncIterator[RequestOutput]):
    """The outputs of one request, as :meth:`~radixkv.serve.async_engine.AsyncEngine.generate`
    returns them: ``channel`` receives its :class:`Delta` (or an exception) from the engine
    thread; ``abandon(request_id)`` is called once if the consumer leaves before the end.

    Iterate it (``async for out in stream``) until an output is ``finished``.
    Leaving early aborts the request and frees its blocks: :meth:`aclose` (or
    ``contextlib.aclosing``) does it at once; cancelling the task that awaits the
    next output does it too, and so does dropping the stream (when it is garbage
    collected). An output merges everything that arrived since the previous one.
    """

    def __init__(
        self, request_id: int, channel: asyncio.Queue, abandon: Callable[[int], None]
    ) -> None:
        self.request_id = request_id
        self._channel = channel
        self._abandon_request = abandon  # forgets the channel and aborts the request
        self._output_ids: list[int] = []
        self._done = False
        self._prompt_logprobs: PromptLogprobs | None = None
        self._times: tuple[float | None, float | None] = (None, None)  # arrival, scheduled

    def __aiter__(self) -> RequestStream:
        return self

    async def __anext__(self) -> RequestOutput:
        """The next output; ``StopAsyncIteration`` after the final one. Raises the
        engine's exception if it refused the request."""
        if self._done:
            raise StopAsyncIteration
        try:
            items = [await self._channel.get()]
        except asyncio.CancelledError:
            self._abandon()
            raise
        while not self._channel.empty():
            items.append(self._channel.get_nowait())
        new: list[int] = []
        logprobs: list[float] = []
        tops: list[TopLogprobs] = []
        times: list[float] = []
        last: Delta | None = None
        for item in items:
            if isinstance(item, BaseException):
                self._done = True
                raise item
            new += item.new_token_ids
            if (info := item.info) is not None:
                logprobs += info.logprobs
                tops += info.top_logprobs
                times += info.times
                self._prompt_logprobs = info.prompt_logprobs or self._prompt_logprobs
                self._times = (info.arrival_time, info.scheduled_time)
            last = item
        assert last is not None
        self._output_ids += new
        self._done = last.finish_reason is not None
        return RequestOutput(
            request_id=self.request_id,
            new_token_ids=new,
            output_ids=list(self._output_ids),
            finished=self._done,
            finish_reason=last.finish_reason,
            prompt_tokens=last.prompt_tokens,
            cached_tokens=last.cached_tokens,
            error=last.error,
            logprobs=logprobs,
            top_logprobs=tops,
            token_times=times,
            prompt_logprobs=self._prompt_logprobs,
            arrival_time=self._times[0],
            scheduled_time=self._times[1],
        )

    async def aclose(self) -> None:
        """Stop listening; abort the request if it has not finished. Idempotent."""
        self._abandon()

    def _abandon(self) -> None:
        if not self._done:
            self._done = True
            self._abandon_request(self.request_id)

    def __del__(self) -> None:
        try:
            self._abandon()
        except Exception:  # noqa: BLE001 - interpreter shutdown: nothing left to abort
            pass
