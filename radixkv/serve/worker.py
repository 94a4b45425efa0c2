"""EngineWorker: the engine thread's side of :class:`~radixkv.serve.async_engine.AsyncEngine`.

The only code that touches the :class:`~radixkv.engine.Engine` while serving. Its
loop: take every pending command (add, abort, call, stop) from the command queue,
run one ``engine.step()`` if any request is unfinished, then hand the cache's KV
events to the sink, take a metrics snapshot, and post each request's new tokens
(a :class:`~radixkv.serve.stream.Delta`) through ``post``. With nothing to run it
blocks on the queue. It keeps one :class:`_Tracked` per request (stream id, engine
id, tokens sent) from its add to its end, and nothing after.
"""

from __future__ import annotations

import logging
import queue
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Protocol, runtime_checkable

import numpy as np

from radixkv.cache.events import KVCacheEvent
from radixkv.engine.engine import Engine
from radixkv.engine.request import Request
from radixkv.errors import InvariantError
from radixkv.serve.openai.client import EngineMetrics
from radixkv.serve.stream import Delta

__all__ = [
    "ABORT",
    "ADD",
    "CALL",
    "NO_EVENT_RELAY",
    "STOP",
    "EngineWorker",
    "EventRelay",
    "EventSink",
    "EventSource",
]

log = logging.getLogger(__name__)

# Commands, as tuples: (ADD, stream_id, request from Engine.make_request), (ABORT, stream_id),
# (CALL, fn, concurrent.futures.Future), (STOP,).
ADD, ABORT, CALL, STOP = "add", "abort", "call", "stop"

Outputs = list[tuple[int, Delta | BaseException]]
EventSink = Callable[[list[KVCacheEvent]], None]


@runtime_checkable
class EventSource(Protocol):
    """A cache that hands out its KV events: every built-in cache (``[]`` with events off)."""

    def take_events(self) -> list[KVCacheEvent]: ...


class EventRelay:
    """Hands ``source``'s KV events to ``sink`` after each round, on the engine thread.

    ``sink`` gets each non-empty batch, oldest event first; a sink that raises loses
    that batch (logged) and serving goes on. Complexity: O(events) per :meth:`relay`.
    """

    def __init__(self, source: EventSource, sink: EventSink) -> None:
        self._take = source.take_events
        self._sink = sink

    def relay(self) -> None:
        """Take the source's pending events and hand them to the sink (if there are any)."""
        events = self._take()
        if events:
            try:
                self._sink(events)
            except Exception:  # noqa: BLE001 - a broken sink must not stop serving
                log.exception("the event sink failed; %d events dropped", len(events))


class _NoEventRelay:
    """The relay without a sink: takes nothing (the cache keeps its events, if any)."""

    def relay(self) -> None:
        pass


NO_EVENT_RELAY = _NoEventRelay()


@dataclass
class _Tracked:
    """A request on the engine thread: its stream id, engine id and tokens delivered."""

    stream_id: int
    engine_id: int
    sent: int = 0


class EngineWorker:
    """Serves ``engine`` from ``commands`` on the thread that calls :meth:`run`.

    ``post(outputs)`` receives, after each round, ``(stream_id, Delta or exception)``
    pairs (it must be thread-safe: it is called on the engine thread).
    ``event_sink`` gets the cache's events after each round that produced some
    (:class:`EventRelay`; every ``PrefixCache`` hands out events, ``[]`` with them off).
    ``metrics`` is the latest snapshot; ``dead`` says why :meth:`run` failed.
    """

    def __init__(
        self,
        engine: Engine,
        commands: queue.SimpleQueue,
        post: Callable[[Outputs], None],
        event_sink: EventSink | None = None,
    ) -> None:
        self.engine = engine
        self._commands = commands
        self._post = post
        self._events = _relay(engine, event_sink)
        self.by_stream: dict[int, _Tracked] = {}
        self.by_engine: dict[int, _Tracked] = {}
        self._num_finished = 0
        self._prompt_tokens = 0
        self._generation_tokens = 0
        self._num_loop_failures = 0
        self.dead: str | None = None
        self.metrics = self.snapshot()

    def run(self) -> None:
        """The engine thread's body: serve commands and steps until a stop command.

        If serving itself fails (a bug, not a model error: the engine handles those),
        every stream gets the exception, ``dead`` says why, and it returns.
        """
        try:
            self._serve()
        except BaseException as exc:  # noqa: BLE001 - a bug here must not hang every client
            log.exception("the engine thread failed; failing every request")
            self.dead = f"{type(exc).__name__}: {exc}"
            failure = RuntimeError(f"the engine thread failed: {self.dead}")
            self._post([(t.stream_id, failure) for t in self.by_stream.values()])
            self.by_stream.clear()
            self.by_engine.clear()

    def _serve(self) -> None:
        engine = self.engine
        commands = self._commands
        while True:
            outputs: list[tuple[int, Delta | BaseException]] = []
            busy = engine.scheduler.has_unfinished()
            command = _next(commands) if busy else commands.get()
            while command is not None:
                if command[0] == STOP:
                    for t in list(self.by_stream.values()):
                        self._abort(t, outputs)
                    self._after(outputs)
                    return
                self._apply(command, outputs)
                command = _next(commands)
            if engine.scheduler.has_unfinished():
                self._step(outputs)
            self._after(outputs)

    def _apply(self, command: tuple, outputs: list) -> None:
        kind = command[0]
        if kind == ADD:
            _, stream_id, request = command
            try:
                self.engine.enqueue([request])
            except Exception as exc:  # noqa: BLE001 - the stream raises it
                outputs.append((stream_id, exc))
                return
            engine_id = request.request_id
            t = _Tracked(stream_id, engine_id)
            self.by_stream[stream_id] = t
            self.by_engine[engine_id] = t
        elif kind == ABORT:
            t = self.by_stream.get(command[1])
            if t is not None:
                self._abort(t, outputs)
        elif kind == CALL:
            _, fn, future = command
            if future.set_running_or_notify_cancel():
                try:
                    future.set_result(fn(self.engine))
                except BaseException as exc:  # noqa: BLE001 - the caller gets it
                    future.set_exception(exc)

    def _abort(self, t: _Tracked, outputs: list) -> None:
        req = self.engine.abort_request(t.engine_id)
        if req is None:  # cannot happen while tracked; drop the entry all the same
            self._forget(t)
            return
        outputs.append((t.stream_id, self._final(t, req)))

    def _step(self, outputs: list) -> None:
        engine = self.engine
        try:
            finished = engine.step()
        except Exception as exc:  # noqa: BLE001 - the engine handles model failures itself
            self._num_loop_failures += 1
            log.exception("an engine step failed outside the model; aborting its requests")
            message = f"{type(exc).__name__}: {exc}"
            for t in list(self.by_stream.values()):
                req = engine.abort_request(t.engine_id)
                self._forget(t)
                self._num_finished += 1
                prompt_len = req.prompt_len if req is not None else 0
                outputs.append((t.stream_id, Delta([], "error", prompt_len, 0, message)))
            return
        by_engine = self.by_engine
        for req in engine.scheduler.running:
            t = by_engine.get(req.request_id)
            if t is not None and req.num_output_tokens > t.sent:
                outputs.append((t.stream_id, self._delta(t, req, None)))
        for req in finished:
            t = by_engine.get(req.request_id)
            if t is not None:
                outputs.append((t.stream_id, self._final(t, req)))

    def _delta(self, t: _Tracked, req: Request, finish_reason: str | None) -> Delta:
        """The tokens ``req`` sampled since the last delta for ``t``; updates the counters."""
        n = req.num_output_tokens
        new = req.tokens[req.prompt_len + t.sent : req.prompt_len + n].tolist()
        if t.sent == 0 and n > 0:
            self._prompt_tokens += req.prompt_len
        self._generation_tokens += n - t.sent
        t.sent = n
        return Delta(new, finish_reason, req.prompt_len, max(req.cached_tokens, 0), req.error)

    def _final(self, t: _Tracked, req: Request) -> Delta:
        reason = req.finish_reason.value if req.finish_reason is not None else "abort"
        delta = self._delta(t, req, reason)
        self._forget(t)
        self._num_finished += 1
        return delta

    def _forget(self, t: _Tracked) -> None:
        self.by_stream.pop(t.stream_id, None)
        self.by_engine.pop(t.engine_id, None)

    def _after(self, outputs: list) -> None:
        """After each round: hand events to the sink, refresh the metrics, post the outputs
        (in that order, so a consumer never sees metrics older than its output)."""
        self._events.relay()
        self.metrics = self.snapshot()
        self._post(outputs)

    def snapshot(self) -> EngineMetrics:
        """Metrics read from the engine; on the engine thread (or before it runs).

        Complexity: O(num_blocks), vectorised (the blocks only the cache holds).
        """
        engine = self.engine
        alloc = engine.allocator
        cache = engine.cache
        held = cache.held_blocks()
        cache_only = int(np.count_nonzero(alloc.refcounts(held) == 1)) if len(held) else 0
        used = alloc.num_blocks - alloc.num_free - cache_only
        stats = cache.stats
        return EngineMetrics(
            running=len(engine.scheduler.running),
            waiting=len(engine.scheduler.waiting),
            kv_usage=used / alloc.num_blocks,
            prefix_cache_queries=stats.query_tokens,
            prefix_cache_hits=stats.hit_tokens,
            preemptions=engine.scheduler.num_preemptions,
            requests_finished=self._num_finished,
            prompt_tokens=self._prompt_tokens,
            generation_tokens=self._generation_tokens,
            failed_steps=engine.num_failed_steps + self._num_loop_failures,
        )

    def verify(self, engine: Engine) -> None:
        """On the engine thread: ``engine.check()``, and the id maps are inverse and hold only
        unfinished requests. ``InvariantError`` naming the first broken rule."""
        engine.check()
        if len(self.by_stream) != len(self.by_engine):
            raise InvariantError("the stream and engine id maps differ in size")
        for t in self.by_stream.values():
            if self.by_engine.get(t.engine_id) is not t:
                raise InvariantError(f"stream {t.stream_id} is missing from the engine map")
            req = engine.get(t.engine_id)
            if req is None:
                raise InvariantError(f"stream {t.stream_id} tracks a finished request")
            if t.sent > req.num_output_tokens:
                raise InvariantError(f"stream {t.stream_id} was sent tokens it lacks")


def _relay(engine: Engine, event_sink: EventSink | None) -> EventRelay | _NoEventRelay:
    """The relay of ``engine``'s cache events to ``event_sink`` (none without a sink)."""
    if event_sink is None:
        return NO_EVENT_RELAY
    return EventRelay(engine.cache, event_sink)  # every PrefixCache hands out events


def _next(commands: queue.SimpleQueue) -> Any:
    """The next pending command, or None without waiting."""
    try:
        return commands.get_nowait()
    except queue.Empty:
        return None
