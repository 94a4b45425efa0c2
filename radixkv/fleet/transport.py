"""KV event batches over ZMQ, as vLLM publishes them: PUB for the stream, ROUTER for replay.

**Stream.** Each batch is one 3-frame message on a PUB socket: the topic
(utf-8, ``""`` by default), the sequence number (8 bytes, big-endian unsigned:
0 for a publisher's first batch, +1 per batch) and the payload
(:func:`radixkv.fleet.wire.encode_batch`). PUB drops messages a subscriber is
too slow for, and a subscriber that connects late misses what came before (the
slow joiner), so the sequence numbers are what tell a subscriber it missed
something.

**Replay.** The publisher keeps its last ``buffer_size`` batches in a ring and
serves them on a ROUTER socket. A client (DEALER) sends ``[b"", start_seq]``
(8 bytes big-endian; a REQ socket's framing, so REQ clients work too, and a
bare ``[start_seq]`` is accepted); the publisher answers, after the client's
routing frames, ``[b"", seq, payload]`` for every buffered batch with
``seq >= start_seq``, oldest first, then the end marker
``[b"", 0xff * 8, b""]`` (seq -1 as 8 signed bytes, empty payload). These are
vLLM's frames (``ZmqEventPublisher._service_replay``). :class:`EventSubscriber`
also accepts replies that carry the topic before the seq
(``[b"", topic, seq, payload]``).

:class:`EventPublisher` runs one background thread that owns both sockets
(ZMQ sockets are not thread-safe): :meth:`EventPublisher.publish` encodes the
batch in the caller's thread, numbers it and queues it. The live stream goes
first: between two looks at that queue the thread reads at most
``_REPLAY_REQUESTS_PER_TURN`` replay requests and resends at most
``_REPLAY_SENDS_PER_TURN`` buffered batches, so no replay client, however fast it
asks, delays a live batch by more than that much work. A client has one replay
under way at a time (what it asks meanwhile is dropped); at most ``_MAX_REPLAYS``
run at once, round-robin, and later requests wait in the socket. :class:`EventSubscriber`
lives in its caller's thread: :meth:`EventSubscriber.poll` returns the batches
in sequence order, each exactly once, filling gaps from the replay socket, and
a :class:`Reset` marker where the replica's view has to start over.
"""

from __future__ import annotations

import logging
import math
import queue
import threading
import time
from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Literal

import zmq

from radixkv.cache.events import EventBatch, KVCacheEvent
from radixkv.checks import check_int, check_str
from radixkv.fleet.wire import Reset, decode_batch, encode_batch  # Reset: re-exported

__all__ = [
    "END_SEQ",
    "LOCAL_ENDPOINT",
    "EventPublisher",
    "EventSubscriber",
    "Received",
    "Reset",
    "offset_endpoint",
]

logger = logging.getLogger(__name__)

END_SEQ = (-1).to_bytes(8, "big", signed=True)  # the seq frame of replay's end marker
LOCAL_ENDPOINT = "tcp://127.0.0.1:*"  # loopback, a port the OS picks

Received = tuple[int, EventBatch]  # (seq, batch)

# How long the idle publisher thread waits on its queue before looking at the replay
# socket again: the worst-case extra latency of a replay answer.
_REPLAY_POLL_S = 0.005
_START_TIMEOUT_S = 5.0
# The replay work between two looks at the live queue: what bounds a live batch's wait.
_REPLAY_REQUESTS_PER_TURN = 16  # requests read
_REPLAY_SENDS_PER_TURN = 64  # buffered batches resent, in slices of _REPLAY_SLICE per replay
_REPLAY_SLICE = 32
_MAX_REPLAYS = 64  # replays under way at once; later requests wait in the socket
_REPLAY_MAX_FRAME = 64  # bytes; a request's frames are at most 8 (ZMQ drops a peer past it)


def offset_endpoint(endpoint: str, offset: int) -> str:
    """``endpoint`` for the publisher of rank ``offset`` among several sharing one setting, as
    vLLM offsets a data-parallel rank's KV-event endpoints: a TCP port goes up by ``offset``
    (``tcp://*:5557`` -> ``tcp://*:5559`` for rank 2); a port the OS picks (``*`` or 0)
    stays so; any other transport (``ipc://``, ``inproc://``) gets ``-{offset}`` appended
    past rank 0. ``ValueError`` naming ``endpoint`` if its TCP port is not a number, or
    the result is past 65535. Complexity: O(len(endpoint)).

    >>> offset_endpoint("tcp://127.0.0.1:5557", 1), offset_endpoint("tcp://*:*", 3)
    ('tcp://127.0.0.1:5558', 'tcp://*:*')
    """
    check_str("endpoint", endpoint)
    offset = check_int("offset", offset, low=0)
    if not endpoint.startswith("tcp://"):
        return endpoint if offset == 0 else f"{endpoint}-{offset}"
    host, sep, port = endpoint.rpartition(":")
    if not sep or host == "tcp":
        raise ValueError(f"endpoint must be tcp://HOST:PORT, got {endpoint!r}")
    if port in ("*", "0"):
        return endpoint
    if not port.isdigit():
        raise ValueError(f"endpoint must end in a port number or *, got {endpoint!r}")
    moved = int(port) + offset
    if moved > 65535:
        raise ValueError(f"endpoint {endpoint!r} offset by {offset} is past port 65535")
    return f"{host}:{moved}"


def _seq_bytes(seq: int) -> bytes:
    return seq.to_bytes(8, "big")


class _Ring:
    """The publisher's last ``size`` batches by seq (seqs arrive 0, 1, 2, ...): O(1) each."""

    __slots__ = ("_payloads", "end", "start")

    def __init__(self, size: int) -> None:
        self._payloads: list[bytes] = [b""] * size
        self.start = 0  # the oldest seq held
        self.end = 0  # one past the newest

    def append(self, seq: int, payload: bytes) -> None:
        size = len(self._payloads)
        self._payloads[seq % size] = payload
        self.end = seq + 1
        self.start = max(self.start, self.end - size)

    def get(self, seq: int) -> bytes:
        """The payload of ``seq``, which must be in ``[start, end)``."""
        return self._payloads[seq % len(self._payloads)]


@dataclass(slots=True)
class _Replay:
    """One client's replay under way: ``route`` its routing frames, ``next`` the next seq to
    send, ``stop`` one past the last (the newest batch when it asked)."""

    route: tuple[bytes, ...]
    next: int
    stop: int


class EventPublisher:
    """Publishes KV event batches on a PUB socket and serves replay on a ROUTER socket.

    ``endpoint`` / ``replay_endpoint`` are ZMQ addresses to bind; the default
    binds the loopback interface on a port the OS picks (``tcp://127.0.0.1:*``;
    a port of 0 means the same), and :attr:`endpoint` / :attr:`replay_endpoint`
    give the addresses actually bound. ``replay_endpoint=None`` serves no
    replay. ``buffer_size`` is how many of the latest batches replay can
    resend. ``data_parallel_rank`` goes into every payload.

    Both sockets live in one background thread, started here and stopped by
    :meth:`close` (or leaving the ``with`` block); :meth:`publish` may be called
    from any thread. Raises ``TypeError``/``ValueError`` for bad arguments,
    ``OSError`` naming the endpoint when a bind fails (nothing is left running).
    """

    def __init__(
        self,
        endpoint: str = LOCAL_ENDPOINT,
        replay_endpoint: str | None = LOCAL_ENDPOINT,
        *,
        topic: str = "",
        buffer_size: int = 10_000,
        data_parallel_rank: int | None = None,
        hwm: int = 100_000,
    ) -> None:
        check_str("endpoint", endpoint)
        check_str("replay_endpoint", replay_endpoint, optional=True)
        self.topic = check_str("topic", topic)
        self.buffer_size = check_int("buffer_size", buffer_size, low=1)
        self.data_parallel_rank = check_int(
            "data_parallel_rank", data_parallel_rank, low=0, optional=True
        )
        self._hwm = check_int("hwm", hwm, low=0)
        self._topic_bytes = topic.encode("utf-8")
        self._next_seq = 0
        self._lock = threading.Lock()  # orders seq assignment with the queue
        # (seq, payload) to send; an Event to set once everything before it is sent; None to stop.
        self._queue: queue.SimpleQueue[tuple[int, bytes] | threading.Event | None] = (
            queue.SimpleQueue()
        )
        self._closed = False
        # Test hook: seqs kept in the replay buffer but never sent on PUB (a simulated drop).
        self._skip_live: set[int] = set()
        self._num_ignored = 0  # malformed replay requests (the thread's)
        self.endpoint = ""
        self.replay_endpoint: str | None = None
        self._ctx = zmq.Context()
        self._ready = threading.Event()
        self._start_error: BaseException | None = None
        self._thread = threading.Thread(
            target=self._run,
            args=(self._bind_address(endpoint), replay_endpoint),
            name="radixkv-event-publisher",
            daemon=True,
        )
        self._thread.start()
        if not self._ready.wait(_START_TIMEOUT_S):  # pragma: no cover - binding is immediate
            self._closed = True
            self._queue.put(None)
            raise OSError(f"EventPublisher did not start within {_START_TIMEOUT_S} s")
        if self._start_error is not None:
            self._thread.join()
            self._ctx.term()
            self._closed = True
            raise self._start_error

    @staticmethod
    def _bind_address(endpoint: str) -> str:
        return endpoint[:-2] + ":*" if endpoint.endswith(":0") else endpoint

    @property
    def next_seq(self) -> int:
        """The seq the next published batch will carry (the number published so far)."""
        return self._next_seq

    @property
    def closed(self) -> bool:
        """True once :meth:`close` ran."""
        return self._closed

    def publish(self, events: Sequence[KVCacheEvent], ts: float | None = None) -> int:
        """Queue one batch of ``events`` (oldest first) for the stream; returns its seq.

        ``ts`` defaults to ``time.time()``. The batch is encoded here, so a bad
        event raises ``TypeError``/``ValueError`` in the caller (see
        :func:`~radixkv.fleet.wire.encode_batch`) and takes no seq. ``events`` is
        read, not kept. ``RuntimeError`` after :meth:`close`. Thread-safe;
        O(size of the batch).
        """
        payload = encode_batch(events, time.time() if ts is None else ts, self.data_parallel_rank)
        with self._lock:
            if self._closed:
                raise RuntimeError("EventPublisher.publish called after close()")
            seq = self._next_seq
            self._next_seq += 1
            self._queue.put((seq, payload))
        return seq

    def flush(self, timeout: float = 5.0) -> bool:
        """Wait until every batch published so far has been handed to the PUB socket.

        True when it has, False if ``timeout`` seconds passed first (or the
        publisher is closed: :meth:`close` itself sends what is queued). After
        True the batches are in the replay ring too. It says nothing about
        delivery: PUB may still drop them for a slow subscriber.
        """
        done = threading.Event()
        with self._lock:
            if self._closed:
                return False
            self._queue.put(done)
        return done.wait(timeout)

    def close(self, timeout: float = 5.0) -> None:
        """Stop the thread, close the sockets and release the ports.

        Batches already published are handed to the PUB socket first, but the
        sockets close with linger 0 (as vLLM's): what has not reached the wire
        by then is dropped, and replay ends with the publisher. Idempotent.
        Waits up to ``timeout`` seconds for the thread; ``RuntimeError`` if it
        is still running then (the sockets stay open).
        """
        with self._lock:
            if self._closed:
                return
            self._closed = True
            self._queue.put(None)
        self._thread.join(timeout)
        if self._thread.is_alive():  # pragma: no cover - the loop never blocks for long
            raise RuntimeError(f"EventPublisher thread did not stop within {timeout} s")
        self._ctx.term()

    def __enter__(self) -> EventPublisher:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __repr__(self) -> str:
        return (
            f"EventPublisher(endpoint={self.endpoint!r}, replay_endpoint={self.replay_endpoint!r}, "
            f"topic={self.topic!r}, next_seq={self._next_seq}, closed={self._closed})"
        )

    # ------------------------------------------------------------ the thread
    def _run(self, endpoint: str, replay_endpoint: str | None) -> None:
        pub = self._ctx.socket(zmq.PUB)
        replay = None if replay_endpoint is None else self._ctx.socket(zmq.ROUTER)
        try:
            pub.set_hwm(self._hwm)
            if replay is not None:
                # ROUTER drops what exceeds its per-client HWM: leave room for a whole replay.
                replay.setsockopt(zmq.SNDHWM, self.buffer_size + 1)
                replay.setsockopt(zmq.MAXMSGSIZE, _REPLAY_MAX_FRAME)
            for sock, name, address in (
                (pub, "endpoint", endpoint),
                (replay, "replay_endpoint", replay_endpoint),
            ):
                if sock is None:
                    continue
                try:
                    sock.bind(address)
                except zmq.ZMQError as exc:
                    raise OSError(f"EventPublisher cannot bind {name}={address!r}: {exc}") from exc
            self.endpoint = pub.get(zmq.LAST_ENDPOINT).decode()
            if replay is not None:
                self.replay_endpoint = replay.get(zmq.LAST_ENDPOINT).decode()
        except BaseException as exc:
            self._start_error = exc
            for sock in (pub, replay):
                if sock is not None:
                    sock.close(linger=0)
            self._ready.set()
            return
        self._ready.set()
        try:
            self._loop(pub, replay)
        finally:
            pub.close(linger=0)
            if replay is not None:
                replay.close(linger=0)

    def _loop(self, pub: zmq.Socket, replay: zmq.Socket | None) -> None:
        ring = _Ring(self.buffer_size)
        replays: deque[_Replay] = deque()
        busy: set[bytes] = set()  # the identities of the clients in replays
        topic = self._topic_bytes
        while True:
            # The live stream first: everything queued, before any replay work.
            try:  # idle, wait for a batch; with replays under way, only look
                if replays:
                    item = self._queue.get_nowait()
                else:
                    item = self._queue.get(timeout=_REPLAY_POLL_S)
            except queue.Empty:
                item = False  # nothing queued (None is the stop sentinel)
            while item is not False:
                if item is None:
                    return
                if isinstance(item, threading.Event):
                    item.set()
                else:
                    seq, payload = item
                    if seq not in self._skip_live:
                        pub.send_multipart((topic, _seq_bytes(seq), payload))
                    ring.append(seq, payload)
                try:
                    item = self._queue.get_nowait()
                except queue.Empty:
                    item = False
            if replay is not None:
                self._take_replay_requests(replay, ring, replays, busy)
                self._send_replays(replay, ring, replays, busy)
                if replays:  # let a thread waiting for the GIL (a publish()) in at once
                    time.sleep(0)

    def _take_replay_requests(
        self, replay: zmq.Socket, ring: _Ring, replays: deque[_Replay], busy: set[bytes]
    ) -> None:
        """Read up to ``_REPLAY_REQUESTS_PER_TURN`` requests, queueing a replay for each
        well-formed one from a client without one under way."""
        for _ in range(_REPLAY_REQUESTS_PER_TURN):
            if len(replays) >= _MAX_REPLAYS:
                return
            try:
                frames = replay.recv_multipart(zmq.NOBLOCK)
            except zmq.Again:
                return
            # [identity, b"", start] from a DEALER that adds the delimiter or a REQ;
            # [identity, start] from a bare DEALER. Answer with the same routing frames.
            if len(frames) == 3 and frames[1] == b"":
                route = tuple(frames[:2])
            elif len(frames) == 2:
                route = tuple(frames[:1])
            else:
                self._ignore("a malformed replay request of %d frames", len(frames))
                continue
            start = frames[-1]
            if len(start) != 8:
                self._ignore("a replay request with a %d-byte start_seq", len(start))
                continue
            if route[0] in busy:  # one replay a client at a time: a flood costs one
                continue
            busy.add(route[0])
            replays.append(_Replay(route, max(int.from_bytes(start, "big"), ring.start), ring.end))

    @staticmethod
    def _send_replays(
        replay: zmq.Socket, ring: _Ring, replays: deque[_Replay], busy: set[bytes]
    ) -> None:
        """Send up to ``_REPLAY_SENDS_PER_TURN`` buffered batches, ``_REPLAY_SLICE`` per
        replay in turn, and the end marker of each replay that reaches its stop."""
        budget = _REPLAY_SENDS_PER_TURN
        while budget > 0 and replays:
            job = replays.popleft()
            first = max(job.next, ring.start)  # what the ring dropped meanwhile is gone
            last = min(job.stop, first + _REPLAY_SLICE, first + budget)
            for seq in range(first, last):
                replay.send_multipart((*job.route, _seq_bytes(seq), ring.get(seq)))
            budget -= max(0, last - first)
            job.next = last
            if job.next >= job.stop:
                replay.send_multipart((*job.route, END_SEQ, b""))
                busy.discard(job.route[0])
            else:
                replays.append(job)

    def _ignore(self, what: str, size: int) -> None:
        """Log an ignored replay request: the 1st, 2nd, 4th, 8th... (a flood stays cheap)."""
        self._num_ignored += 1
        if self._num_ignored & (self._num_ignored - 1) == 0:
            logger.warning("ignoring %s (%d ignored so far)", what % size, self._num_ignored)


class EventSubscriber:
    """Reads one publisher's KV event stream in order, filling gaps from its replay socket.

    Connects a SUB socket to ``endpoint`` (subscribed to ``topic``; messages
    with another topic are skipped) and, when ``replay_endpoint`` is given, a
    DEALER socket to it. :meth:`poll` returns ``(seq, batch)`` pairs in seq
    order, each seq at most once, with :class:`Reset` markers in between
    where the view must start over:

    - a gap (``seq > last + 1``) is filled by replaying ``last + 1 ..
      seq - 1`` before ``seq``; batches the replay cannot give are counted in
      :attr:`num_lost` and announced by ``Reset("lost")``, after which only
      batches newer than the last missing one are delivered;
    - a seq at or below the last one means the publisher restarted:
      ``Reset("restart")``, then the new stream as if joining it;
    - joining a stream whose first seq is above 0: with ``replay_from_start``
      (and a replay endpoint) the batches before it are replayed first, with a
      ``Reset("lost")`` if the ring no longer has them all; otherwise the
      stream starts where it was joined.

    A publisher that restarts and passes the old seq before the subscriber
    sees it cannot be told apart from a gap (vLLM's seq carries no epoch).
    Owned by one thread: not thread-safe. ``TypeError``/``ValueError`` for
    bad arguments.
    """

    def __init__(
        self,
        endpoint: str,
        replay_endpoint: str | None = None,
        *,
        topic: str = "",
        replay_from_start: bool = True,
        replay_timeout_ms: int = 1000,
        hwm: int = 100_000,
    ) -> None:
        self.endpoint = check_str("endpoint", endpoint)
        self.replay_endpoint = check_str("replay_endpoint", replay_endpoint, optional=True)
        self.topic = check_str("topic", topic)
        self.replay_from_start = bool(replay_from_start)
        self.replay_timeout_ms = check_int("replay_timeout_ms", replay_timeout_ms, low=1)
        hwm = check_int("hwm", hwm, low=0)
        self._topic_bytes = topic.encode("utf-8")
        self.last_seq: int | None = None
        """The last seq accounted for, delivered or reported lost (None before the first)."""
        self.num_received = 0  # batches delivered, live or replayed
        self.num_replayed = 0  # of those, the ones that came from the replay socket
        self.num_lost = 0  # batches never delivered: gaps replay could not fill
        self.num_resets = 0  # Reset markers returned
        self._ctx = zmq.Context()
        self._sub = self._ctx.socket(zmq.SUB)
        self._monitor: zmq.Socket | None = self._sub.get_monitor_socket(
            zmq.EVENT_HANDSHAKE_SUCCEEDED
        )
        self._connected = False
        self._sub.set_hwm(hwm)
        self._sub.setsockopt(zmq.SUBSCRIBE, self._topic_bytes)
        self._dealer: zmq.Socket | None = None
        self._closed = False
        try:
            self._sub.connect(endpoint)
        except zmq.ZMQError as exc:
            self.close()
            raise ValueError(
                f"EventSubscriber cannot connect endpoint={endpoint!r}: {exc}"
            ) from exc
        if replay_endpoint is not None:
            try:
                self._dealer = self._new_dealer()
            except zmq.ZMQError as exc:
                self.close()
                raise ValueError(
                    f"EventSubscriber cannot connect replay_endpoint={replay_endpoint!r}: {exc}"
                ) from exc

    def _new_dealer(self) -> zmq.Socket:
        dealer = self._ctx.socket(zmq.DEALER)
        dealer.setsockopt(zmq.LINGER, 0)
        dealer.connect(self.replay_endpoint)
        return dealer

    def wait_connected(self, timeout_ms: int) -> bool:
        """True once the SUB socket has completed its first handshake with the publisher.

        Waits up to ``timeout_ms``; False if it has not by then. After True
        the subscription reaches the publisher within a round trip, so batches
        published from then on arrive live (earlier ones only by replay).
        """
        timeout_ms = check_int("timeout_ms", timeout_ms, low=0)
        if self._connected:
            return True
        if self._monitor is None:
            raise RuntimeError("EventSubscriber.wait_connected called after close()")
        if self._monitor.poll(timeout_ms, zmq.POLLIN):
            self._monitor.recv_multipart()
            self._connected = True
            self._sub.disable_monitor()
            self._monitor.close(linger=0)
            self._monitor = None
        return self._connected

    def poll(self, timeout_ms: int | None = 0, max_messages: int = 1000) -> list[Received | Reset]:
        """What arrived: ``(seq, batch)`` pairs in seq order and :class:`Reset` markers.

        Waits up to ``timeout_ms`` for the first message (None: forever; 0:
        not at all), then takes what is already queued, up to ``max_messages``
        live messages. Filling a gap waits up to ``replay_timeout_ms`` on the
        replay socket. The batches are new objects the caller owns. Malformed
        messages (not 3 frames, a seq not 8 bytes) are logged and skipped.
        ``RuntimeError`` after :meth:`close`. O(messages + batches replayed).
        """
        if self._closed:
            raise RuntimeError("EventSubscriber.poll called after close()")
        timeout_ms = check_int("timeout_ms", timeout_ms, low=0, optional=True)
        max_messages = check_int("max_messages", max_messages, low=1)
        out: list[Received | Reset] = []
        if not self._sub.poll(-1 if timeout_ms is None else timeout_ms, zmq.POLLIN):
            return out
        for _ in range(max_messages):
            try:
                frames = self._sub.recv_multipart(zmq.NOBLOCK)
            except zmq.Again:
                break
            self._on_message(frames, out)
        return out

    def close(self) -> None:
        """Close both sockets and release the context. Idempotent."""
        if self._closed:
            return
        self._closed = True
        if self._monitor is not None:
            self._sub.disable_monitor()
            self._monitor.close(linger=0)
            self._monitor = None
        self._sub.close(linger=0)
        if self._dealer is not None:
            self._dealer.close(linger=0)
            self._dealer = None
        self._ctx.term()

    def __enter__(self) -> EventSubscriber:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __repr__(self) -> str:
        return (
            f"EventSubscriber(endpoint={self.endpoint!r}, last_seq={self.last_seq}, "
            f"received={self.num_received}, lost={self.num_lost}, resets={self.num_resets})"
        )

    # -------------------------------------------------------------- internals
    def _on_message(self, frames: list[bytes], out: list[Received | Reset]) -> None:
        if len(frames) != 3 or len(frames[1]) != 8:
            logger.warning("skipping a malformed KV event message: %d frames", len(frames))
            return
        topic, seq_frame, payload = frames
        if topic != self._topic_bytes:  # SUBSCRIBE matches prefixes; the topic is exact
            return
        seq = int.from_bytes(seq_frame, "big")
        last = self.last_seq
        if last is not None and seq <= last:
            self._reset(out, "restart", seq, 0)
            last = None
        if last is None:
            if seq > 0 and self.replay_from_start and self._dealer is not None:
                self._fill(0, seq, out)
        elif seq > last + 1:
            self._fill(last + 1, seq, out)
        try:
            batch = decode_batch(payload)
        except ValueError:
            logger.warning("KV event batch seq=%d does not decode", seq, exc_info=True)
            self.last_seq = seq
            self.num_lost += 1
            self._reset(out, "lost", seq + 1, 1)
            return
        self._deliver(seq, batch, out)

    def _deliver(self, seq: int, batch: EventBatch, out: list[Received | Reset]) -> None:
        out.append((seq, batch))
        self.last_seq = seq
        self.num_received += 1

    def _reset(
        self, out: list[Received | Reset], reason: Literal["restart", "lost"], seq: int, lost: int
    ) -> None:
        out.append(Reset(reason, seq, lost))
        self.num_resets += 1

    def _fill(self, start: int, stop: int, out: list[Received | Reset]) -> None:
        """Deliver ``start .. stop - 1`` from replay, with a Reset for what it lacks."""
        got = self._replay(start, stop)
        first_kept = stop  # the start of the run of replayed seqs that ends at stop - 1
        while first_kept > start and first_kept - 1 in got:
            first_kept -= 1
        if first_kept > start:
            num_lost = first_kept - start
            self.num_lost += num_lost
            self._reset(out, "lost", first_kept, num_lost)
            logger.warning(
                "KV event batches %d..%d lost (replay had %d of %d)",
                start,
                first_kept - 1,
                len(got),
                stop - start,
            )
            start = first_kept
        for seq in range(start, stop):
            self._deliver(seq, got[seq], out)
            self.num_replayed += 1

    def _replay(self, start: int, stop: int) -> dict[int, EventBatch]:
        """The batches with ``start <= seq < stop`` the replay socket gives, by seq."""
        got: dict[int, EventBatch] = {}
        dealer = self._dealer
        if dealer is None:
            return got
        try:
            dealer.send_multipart((b"", _seq_bytes(start)), zmq.NOBLOCK)
        except zmq.Again:
            logger.warning("replay socket not connected: cannot replay from seq %d", start)
            return got
        deadline = time.monotonic() + self.replay_timeout_ms / 1000
        while True:
            left_ms = math.ceil((deadline - time.monotonic()) * 1000)
            if left_ms <= 0 or not dealer.poll(left_ms, zmq.POLLIN):
                # A late answer would be taken for the next request's: start afresh.
                logger.warning("replay request from seq %d timed out", start)
                dealer.close(linger=0)
                self._dealer = self._new_dealer()
                return got
            frames = dealer.recv_multipart()
            if frames and frames[0] == b"":
                frames = frames[1:]
            if len(frames) not in (2, 3) or len(frames[-2]) != 8:
                logger.warning("skipping a malformed replay reply: %d frames", len(frames))
                continue
            seq_frame, payload = frames[-2], frames[-1]
            if seq_frame == END_SEQ:
                return got
            seq = int.from_bytes(seq_frame, "big")
            if start <= seq < stop:
                try:
                    got[seq] = decode_batch(payload)
                except ValueError:
                    logger.warning("replayed batch seq=%d does not decode", seq, exc_info=True)
