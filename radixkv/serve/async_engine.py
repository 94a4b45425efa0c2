"""AsyncEngine: one :class:`~radixkv.engine.Engine` behind an asyncio server.

The engine is not thread-safe and a model step takes milliseconds to seconds, so
the engine lives on a thread of its own (the *engine thread*) and nothing else
touches it. The event loop talks to that thread through two one-way channels:

- loop -> engine: a ``queue.SimpleQueue`` of commands (add, abort, call, stop);
- engine -> loop: ``loop.call_soon_threadsafe`` with each step's outputs, which land
  in one ``asyncio.Queue`` per request.

The engine thread drains every pending command, runs one step, posts the outputs,
and repeats; with nothing to run it blocks on the command queue. Requests from any
number of clients therefore join the running batch at the next step (continuous
batching), and the event loop never waits on a step.

:meth:`AsyncEngine.drain` is a server's first step on SIGINT/SIGTERM: every open
request ends with ``"abort"`` at once, and new ones are refused until shutdown.

Per-request state lives exactly as long as the request: the loop side keeps a
request's queue until its final output is delivered (or its consumer goes away),
the engine thread keeps its id mapping until it finishes or is aborted.

Each step's new tokens reach the loop with what the engine knew of them (logprobs, top
alternatives, times: a :class:`~radixkv.serve.stream.TokenInfo`): the engine tells this
module's recorder (its ``observer``) during the step, and each request's delta picks it
up on its way out, on the engine thread.

This module is the loop side (lifecycle, delivery; a request is checked by
``Engine.make_request``);
:mod:`~radixkv.serve.worker` is the engine thread's; :mod:`~radixkv.serve.stream`
is what a consumer iterates.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import dataclasses
import itertools
import queue
import threading
from collections.abc import Callable, Hashable, Sequence
from typing import TypeVar

from radixkv.engine.engine import Engine
from radixkv.engine.request import EngineLimits, Request, SamplingParams
from radixkv.serve.openai.client import EngineMetrics
from radixkv.serve.stream import Delta, RequestStream, TokenInfo
from radixkv.serve.worker import ABORT, ADD, CALL, STOP, EngineWorker, EventSink

__all__ = ["AsyncEngine"]

T = TypeVar("T")


class AsyncEngine:
    """Serves an :class:`~radixkv.engine.Engine` to asyncio code; the engine runs on its own
    thread (see the module docstring) and must not be touched by anyone else.

    ``event_sink``, if given, receives ``engine.cache.take_events()`` after every
    step that produced events, on the engine thread (keep it short; hand off to
    another thread or loop for I/O); ``TypeError`` naming it for a cache without
    ``take_events`` (every built-in cache has it). Use as ``async with AsyncEngine(engine) as e:``
    or call :meth:`start` / :meth:`shutdown`; :meth:`generate` and :meth:`call`
    start the engine thread themselves when it is not running. The engine thread
    serves the event loop it was started from.
    """

    def __init__(self, engine: Engine, *, event_sink: EventSink | None = None) -> None:
        if not isinstance(engine, Engine):
            raise TypeError(f"engine must be an Engine, got {type(engine).__name__}")
        if event_sink is not None and not callable(event_sink):
            raise TypeError(f"event_sink must be callable or None, got {event_sink!r}")
        self.engine = engine
        self._commands: queue.SimpleQueue[tuple] = queue.SimpleQueue()
        self._ids = itertools.count()
        self._channels: dict[int, asyncio.Queue] = {}  # stream id -> its outputs, until final
        self._loop: asyncio.AbstractEventLoop | None = None
        self._thread: threading.Thread | None = None
        self._stopped: asyncio.Future | None = None
        self._closing = False
        self._draining = False  # drain() called: refuse new requests until shutdown() ends
        self._worker = EngineWorker(engine, self._commands, self._post, event_sink)
        self._recorder = _TokenRecorder(self._worker)
        engine.observer = self._recorder

    # ------------------------------------------------------------- lifecycle
    async def start(self) -> None:
        """Start the engine thread for the running event loop; no-op if it already runs
        for this loop. ``RuntimeError`` if it runs for another loop or is shutting down."""
        self._ensure_started()

    async def shutdown(self) -> None:
        """Abort every request (its stream ends with ``finish_reason`` ``"abort"``), stop
        the engine thread and wait for it. No-op when not running."""
        if self._thread is None or self._closing:
            return
        self._closing = True
        try:
            self._commands.put((STOP,))
            assert self._stopped is not None
            await asyncio.shield(self._stopped)
            self._thread.join()
        finally:
            self._thread = self._loop = self._stopped = None
            self._closing = self._draining = False

    def drain(self) -> None:
        """Stop taking requests: abort every open one (its stream ends with ``finish_reason``
        ``"abort"``) and refuse new ones (:meth:`generate` raises ``RuntimeError``) until
        :meth:`shutdown` ends. What a server does on SIGINT/SIGTERM, before it waits for its
        connections to close. Call on the loop the engine serves (from a signal handler,
        through ``loop.call_soon_threadsafe``). No-op when not running.
        Complexity: O(open requests)."""
        if self._thread is None:
            return
        self._draining = True
        for stream_id in list(self._channels):
            self._commands.put((ABORT, stream_id))

    async def __aenter__(self) -> AsyncEngine:
        await self.start()
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.shutdown()

    @property
    def loop(self) -> asyncio.AbstractEventLoop | None:
        """The event loop the engine thread serves (None when stopped): other threads run
        :meth:`call` or :meth:`check` there with ``asyncio.run_coroutine_threadsafe``."""
        return self._loop

    @property
    def is_running(self) -> bool:
        """True while the engine thread runs and has not failed."""
        return self._thread is not None and self._thread.is_alive() and self._worker.dead is None

    @property
    def is_serving(self) -> bool:
        """True while it takes requests: running, and neither draining nor shutting down."""
        return self.is_running and not (self._draining or self._closing)

    def _ensure_started(self) -> None:
        loop = asyncio.get_running_loop()
        if self._closing:
            raise RuntimeError("the AsyncEngine is shutting down")
        if self._worker.dead is not None:
            raise RuntimeError(f"the engine thread failed: {self._worker.dead}")
        if self._thread is not None:
            if self._loop is not loop:
                raise RuntimeError("the AsyncEngine serves another event loop")
            return
        self._loop = loop
        self._stopped = loop.create_future()
        self._thread = threading.Thread(target=self._run, name="radixkv-engine", daemon=True)
        self._thread.start()

    # -------------------------------------------------------------- requests
    def generate(
        self,
        prompt_ids: Sequence[int],
        params: SamplingParams,
        namespace: Hashable = None,
    ) -> RequestStream:
        """Queue one request and return the stream of its outputs.

        Call from a coroutine on the loop the engine serves. ``TypeError`` /
        ``ValueError`` (naming the field and the value) before anything is queued, from
        ``Engine.make_request`` (here, on the loop): a malformed prompt, ``params`` or
        ``namespace``, a token or stop id outside the model's vocabulary, or the prompt
        plus ``max_new_tokens`` over the engine's ``max_model_len`` (see
        :meth:`max_new_tokens`). ``RuntimeError`` after :meth:`drain` or while shutting
        down. ``prompt_ids`` is copied. Complexity:
        O(len(prompt_ids)) here; the request runs on the engine thread.
        """
        request = self.engine.make_request(prompt_ids, params, namespace)
        if self._draining:
            raise RuntimeError("the AsyncEngine is shutting down")
        self._ensure_started()
        stream_id = next(self._ids)
        channel: asyncio.Queue = asyncio.Queue()
        self._channels[stream_id] = channel
        self._commands.put((ADD, stream_id, request))
        return RequestStream(stream_id, channel, self._abandon)

    async def abort(self, request_id: int) -> None:
        """Abort the request with this id (a stream's ``request_id``); its stream ends with
        an output whose ``finish_reason`` is ``"abort"``. No-op for an unknown or finished
        request."""
        if request_id in self._channels:
            self._commands.put((ABORT, request_id))

    def _abandon(self, request_id: int) -> None:
        """Its consumer is gone: forget the stream, abort the request (any thread)."""
        if self._channels.pop(request_id, None) is not None:
            self._commands.put((ABORT, request_id))

    async def call(self, fn: Callable[[Engine], T]) -> T:
        """Run ``fn(engine)`` on the engine thread between two steps; return its result or
        raise its exception. The one safe way to read or change the engine while serving."""
        self._ensure_started()
        future: concurrent.futures.Future = concurrent.futures.Future()
        self._commands.put((CALL, fn, future))
        return await asyncio.wrap_future(future)

    async def reset_prefix_cache(self) -> bool:
        """``Engine.reset_prefix_cache`` on the engine thread, between two steps: True once
        the cache is empty (its ``AllBlocksCleared`` goes to the event sink after that
        round), False while a request is running or waiting."""
        return await self.call(lambda engine: engine.reset_prefix_cache())

    def max_new_tokens(self, prompt_len: int) -> int:
        """The largest ``max_new_tokens`` a prompt of ``prompt_len`` tokens may ask for: the
        two together within the engine's ``max_model_len`` (at most what the pool holds).
        0 if even one token does not fit. Complexity: O(1)."""
        return self.limits.max_new_tokens(prompt_len)

    @property
    def limits(self) -> EngineLimits:
        """What the engine accepts (``Engine.limits``: its vocabulary and ``max_model_len``),
        fixed once it is built: what :meth:`generate` checks a request against."""
        return self.engine.limits

    @property
    def num_requests(self) -> int:
        """Streams that have not received their final output (0 when idle)."""
        return len(self._channels)

    def metrics(self) -> EngineMetrics:
        """The latest snapshot (taken after the engine thread's last step). Any thread."""
        return self._worker.metrics

    async def check(self) -> None:
        """Verify, on the engine thread, the engine's invariants (``Engine.check``) and the
        engine thread's: its id maps are inverse and hold only unfinished requests.
        ``InvariantError`` naming the first broken one."""
        await self.call(self._worker.verify)

    # ----------------------------------------------------------- loop side
    def _deliver(self, outputs: list[tuple[int, Delta | BaseException]]) -> None:
        """On the loop: hand each output to its stream; a final one closes the channel."""
        for stream_id, item in outputs:
            channel = self._channels.get(stream_id)
            if channel is None:
                continue  # its consumer left; the abort is on its way
            channel.put_nowait(item)
            if isinstance(item, BaseException) or item.finish_reason is not None:
                del self._channels[stream_id]

    def _post(self, outputs: list[tuple[int, Delta | BaseException]]) -> None:
        """From the engine thread: attach what the recorder learned of each delta's tokens,
        then schedule delivery on the loop (dropped if it closed)."""
        take = self._recorder.take
        outputs = [
            (sid, dataclasses.replace(item, info=info))
            if isinstance(item, Delta) and (info := take(sid)) is not None
            else (sid, item)
            for sid, item in outputs
        ]
        if outputs and self._loop is not None:
            try:
                self._loop.call_soon_threadsafe(self._deliver, outputs)
            except RuntimeError:  # the loop closed under us: nobody is listening
                pass

    def _run(self) -> None:
        """The engine thread: the worker's loop, then wake :meth:`shutdown`."""
        try:
            self._worker.run()
        finally:
            loop, stopped = self._loop, self._stopped
            if loop is not None and stopped is not None:
                try:
                    loop.call_soon_threadsafe(_resolve, stopped)
                except RuntimeError:  # the loop closed: nobody waits
                    pass


class _TokenRecorder:
    """The engine's observer (engine thread): what it knew of each stream's new tokens,
    until that stream's next delta takes it (:meth:`take`)."""

    def __init__(self, worker: EngineWorker) -> None:
        self._by_engine = worker.by_engine  # engine id -> the tracked stream, while it runs
        self._pending: dict[int, TokenInfo] = {}

    def on_tokens(self, reqs: Sequence[Request], now: float) -> None:
        pending = self._pending
        for req in reqs:
            tracked = self._by_engine.get(req.request_id)
            if tracked is None:  # not one of ours (a request added past the AsyncEngine)
                continue
            info = pending.get(tracked.stream_id)
            if info is None:
                info = pending[tracked.stream_id] = TokenInfo(
                    [], [], [], req.prompt_logprobs, req.arrival_time, req.scheduled_time
                )
            info.logprobs.append(req.logprobs[-1])
            info.top_logprobs.append(req.top_logprobs[-1] if req.params.top_logprobs else [])
            info.times.append(now)

    def take(self, stream_id: int) -> TokenInfo | None:
        """The stream's info since the last take (None if nothing new); forgets it."""
        return self._pending.pop(stream_id, None)


def _resolve(future: asyncio.Future) -> None:
    if not future.done():
        future.set_result(None)
