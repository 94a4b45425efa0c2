"""One request's choices: what each has received from its engine call, and how it reads as JSON.

A request has ``len(prompts) x n`` choices; choice ``index`` is prompt position x ``n``
+ fork. Each :class:`Choice` has its own engine call (or none, for an echo of the
prompt with ``max_tokens`` 0 and no logprobs) and its own
:class:`~radixkv.text.stream.TextStream`; :meth:`Choice.step` takes each output of the
call, :meth:`Choice.response` is the whole choice and :meth:`Choice.chunk` a streamed
piece. :func:`merged` runs every choice's outputs into one stream, and
:func:`usage_of` sums their usage: each prompt's tokens once (not once per fork), every
choice's tokens, and per prompt the cached prefix its least lucky fork found.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator, Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

from radixkv.serve.openai.client import EngineCall, RequestOutput
from radixkv.serve.openai.responses import (
    TokenText,
    chat_choice,
    chat_logprobs,
    completion_choice,
    completion_logprobs,
    prompt_logprobs_entries,
    usage,
)
from radixkv.text.stream import TextStream

__all__ = ["Choice", "Prompt", "ReplySpec", "fork_seed", "merged", "usage_of"]

SEED_SPAN = 2**64


@dataclass(frozen=True)
class Prompt:
    """One prompt: its token ids and the text it was sent as (None for token ids)."""

    ids: list[int]
    text: str | None = None


@dataclass(frozen=True)
class ReplySpec:
    """How a request's choices read: chat or completion, ``echo``, the alternatives per
    token (None: no logprobs), vLLM's ``prompt_logprobs``, ``token_ids``, and each token's
    text for logprobs."""

    chat: bool
    echo: bool
    top_logprobs: int | None
    prompt_logprobs: int | None
    token_ids: bool
    token_text: TokenText
    decode: Callable[[Sequence[int]], str]


def fork_seed(seed: int | None, fork: int) -> int | None:
    """Fork ``fork``'s seed: ``seed + fork`` (vLLM's rule for ``n`` > 1), kept in the range
    ``torch.Generator`` takes by wrapping past ``2**64 - 1``."""
    if seed is None:
        return None
    s = seed + fork
    return s - SEED_SPAN if s >= SEED_SPAN else s


@dataclass
class Choice:
    """One choice: its call's outputs so far and its text (see the module docstring).

    ``keep_output`` False drops the generated tokens (an echo with ``max_tokens`` 0 runs
    one token only for the prompt's logprobs)."""

    index: int
    prompt_index: int
    prompt: Prompt
    spec: ReplySpec
    call: EngineCall | None
    text: TextStream
    keep_output: bool = True
    token_ids: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    tops: list[list[tuple[int, float]]] = field(default_factory=list)
    token_times: list[float] = field(default_factory=list)  # engine clock, per token
    last: RequestOutput | None = None
    finish: str | None = None
    first_token_at: float | None = None  # loop clock: when its first token arrived
    _echoed: bool = False
    _offset: int = 0  # text_offset of the next streamed token

    @property
    def cached_tokens(self) -> int:
        return self.last.cached_tokens if self.last is not None else 0

    def step(self, out: RequestOutput | None, now: float) -> tuple[str, str | None]:
        """Take the call's next output (None: there is no call): the new text to send and
        the finish reason once it ends (``"stop"`` when a stop string cut the text)."""
        if out is None:
            self.finish = "length"
            return "", self.finish
        self.last = out
        if not self.keep_output:
            self.finish = "length" if out.finished else None
            return "", self.finish
        if out.new_token_ids and self.first_token_at is None:
            self.first_token_at = now
        self.token_ids += out.new_token_ids
        self.logprobs += out.logprobs
        self.tops += out.top_logprobs
        self.token_times += out.token_times
        delta = self.text.push(out.output_ids, out.finished)
        self.finish = "stop" if self.text.stopped else out.finish_reason
        return delta, self.finish

    # ----------------------------------------------------------- whole
    def response(self) -> dict[str, Any]:
        """The choice as a response's ``choices`` entry."""
        spec = self.spec
        ids = self.token_ids if spec.token_ids else None
        if spec.chat:
            message = {"role": "assistant", "content": self.text.text}
            logprobs = self._chat_logprobs(0) if spec.top_logprobs is not None else None
            return chat_choice(
                self.index, self.finish, message=message, logprobs=logprobs, token_ids=ids
            )
        text = (self._echo_text() if spec.echo else "") + self.text.text
        logprobs = None
        if spec.top_logprobs is not None:
            logprobs = self._completion_logprobs(spec.echo, 0, 0)
        return completion_choice(
            self.index,
            text,
            self.finish,
            logprobs,
            token_ids=ids,
            prompt_logprobs=self.prompt_logprobs(),
        )

    # ----------------------------------------------------------- streamed
    def chunks(self, out: RequestOutput | None, delta: str, finish: str | None) -> list[dict]:
        """The streamed choices for one output (none: nothing to send yet): the new text,
        the new tokens' logprobs and ids, then the finish reason (a chat's in a chunk of
        its own, as OpenAI sends it); a completion's first chunk starts with the echo."""
        spec = self.spec
        new = len(out.new_token_ids) if out is not None and self.keep_output else 0
        first = not self._echoed
        self._echoed = True
        ids = out.new_token_ids if spec.token_ids and new else None
        wants_logprobs = spec.top_logprobs is not None
        start = len(self.token_ids) - new
        if spec.chat:
            pieces = []
            if delta or ids or (wants_logprobs and new):
                logprobs = self._chat_logprobs(start) if wants_logprobs else None
                pieces.append(
                    chat_choice(
                        self.index, None, delta={"content": delta}, logprobs=logprobs,
                        token_ids=ids,
                    )
                )  # fmt: skip
            if finish is not None:
                pieces.append(chat_choice(self.index, finish, delta={}))
            return pieces
        echo = spec.echo and first
        if not (echo or delta or finish or ids or (wants_logprobs and new)):
            return []
        logprobs = None
        if wants_logprobs:
            logprobs = self._completion_logprobs(echo, start, self._offset)
            if logprobs["tokens"]:
                self._offset = logprobs["text_offset"][-1] + len(logprobs["tokens"][-1])
        text = (self._echo_text() if echo else "") + delta
        prompt_lp = self.prompt_logprobs() if first else None
        choice = completion_choice(
            self.index, text, finish, logprobs, token_ids=ids, prompt_logprobs=prompt_lp
        )
        return [choice]

    # ----------------------------------------------------------- pieces
    def _echo_text(self) -> str:
        p = self.prompt
        return p.text if p.text is not None else self.spec.decode(p.ids)

    def _completion_logprobs(self, echo: bool, start: int, offset: int) -> dict[str, Any]:
        """Completions' logprobs for the output tokens from ``start`` (after the prompt's,
        when ``echo``), text offsets from ``offset``."""
        ids: list[int] = []
        lps: list[float | None] = []
        tops: list[Any] = []
        if echo:
            pl = self.last.prompt_logprobs if self.last is not None else None
            ids += self.prompt.ids
            if pl is None:  # nothing scored (logprobs were not asked of the engine)
                lps += [None] * len(self.prompt.ids)
                tops += [None] * len(self.prompt.ids)
            else:
                k = self.spec.top_logprobs or 0  # the engine scored max(k, prompt_logprobs)
                lps += [None, *pl.logprobs]
                tops += [None, *(top[:k] for top in pl.top)]
        ids += self.token_ids[start:]
        lps += self.logprobs[start:]
        tops += self.tops[start:]
        return completion_logprobs(ids, lps, tops, self.spec.token_text, offset)

    def _chat_logprobs(self, start: int) -> dict[str, Any]:
        return chat_logprobs(
            self.token_ids[start:], self.logprobs[start:], self.tops[start:], self.spec.token_text
        )

    def prompt_logprobs(self) -> list | None:
        """vLLM's ``prompt_logprobs`` of the choice, where asked (and computed)."""
        pl = self.last.prompt_logprobs if self.last is not None else None
        if self.spec.prompt_logprobs is None or pl is None:
            return None
        top = [t[: self.spec.prompt_logprobs] for t in pl.top]
        return prompt_logprobs_entries(
            self.prompt.ids, pl.logprobs, pl.ranks, top, self.spec.token_text
        )


def usage_of(choices: Sequence[Choice], prompts: Sequence[Prompt]) -> dict[str, Any]:
    """The request's ``usage``: each prompt's tokens once, every choice's tokens, and per
    prompt the fewest cached tokens any of its forks found."""
    cached: dict[int, int] = {}
    for c in choices:
        cached[c.prompt_index] = min(cached.get(c.prompt_index, c.cached_tokens), c.cached_tokens)
    return usage(
        sum(len(p.ids) for p in prompts),
        sum(len(c.token_ids) for c in choices),
        sum(cached.values()),
    )


async def merged(
    steps: Sequence[AsyncIterator[Any]],
) -> AsyncIterator[tuple[int, Any]]:
    """``(k, item)`` for every item of every iterator ``steps[k]``, as they come. An
    exception in one ends the merge with it; leaving early (or failing) cancels every
    iterator's task, so each closes."""
    if len(steps) == 1:  # the common case: no task, no queue
        async with contextlib.aclosing(steps[0]) as only:  # type: ignore[type-var]
            async for item in only:
                yield 0, item
        return
    queue: asyncio.Queue = asyncio.Queue()
    done = object()

    async def pump(k: int, it: AsyncIterator[Any]) -> None:
        try:
            async for item in it:
                await queue.put((k, item))
        except Exception as exc:  # noqa: BLE001 - handed to the consumer
            await queue.put((k, exc))
            return
        await queue.put((k, done))

    tasks = [asyncio.create_task(pump(k, it)) for k, it in enumerate(steps)]
    try:
        left = len(tasks)
        while left:
            k, item = await queue.get()
            if item is done:
                left -= 1
            elif isinstance(item, Exception):
                raise item
            else:
                yield k, item
    finally:
        for t in tasks:
            t.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
