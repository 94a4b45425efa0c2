"""Every replica's KV event stream, read on one background thread and handed over in a queue.

A router reads the streams of all the replicas it routes to. ZMQ sockets
belong to one thread and filling a gap waits on a replay socket, so neither
may run on a router's event loop (Ray Serve's, for
:class:`~radixkv.serve.ray.request_router.PrefixRouter`): :class:`EventFeed` owns one
:class:`~radixkv.fleet.transport.EventSubscriber` per replica on a daemon
thread, and the router takes what arrived with :meth:`EventFeed.drain`, on its
own loop, before each decision. The router's index is only ever touched by
the router's thread. Plain Python over pyzmq: no Ray, no torch.
"""

from __future__ import annotations

import logging
import queue
import threading
from collections import deque
from collections.abc import Callable, Hashable, Sequence

from radixkv.cache.events import KVCacheEvent
from radixkv.checks import check_number
from radixkv.fleet.transport import EventSubscriber
from radixkv.fleet.wire import Reset

__all__ = ["EventFeed", "FeedItem"]

log = logging.getLogger(__name__)

# (replica, its events oldest first) or (replica, a Reset: forget what it reported so far)
FeedItem = tuple[Hashable, "Sequence[KVCacheEvent] | Reset"]
SubscriberFactory = Callable[[str, str | None], EventSubscriber]


class EventFeed:
    """Subscribes to replicas' event publishers and queues what they publish, in order.

    :meth:`add` and :meth:`remove` may be called from any thread; the
    subscriber is created, polled and closed on the feed's thread (started by
    the first :meth:`add`). Per replica, items come out of :meth:`drain` in
    the order the subscriber delivered them: batches in seq order, a
    ``Reset`` where the view must start over (a gap replay could not fill, a
    publisher restart). After :meth:`remove` nothing more is queued for that
    replica (items already queued still come out: the consumer ignores
    replicas it dropped). An idle thread sleeps ``poll_interval_s`` between
    rounds, the most an event waits before it is queued.
    """

    def __init__(
        self,
        *,
        poll_interval_s: float = 0.005,
        subscriber_factory: SubscriberFactory = EventSubscriber,
    ) -> None:
        self.poll_interval_s = check_number(
            "poll_interval_s", poll_interval_s, low=0, strict=True, finite=False
        )
        self._factory = subscriber_factory
        self._commands: queue.SimpleQueue[tuple[str, Hashable, str, str | None]] = (
            queue.SimpleQueue()
        )
        self._out: deque[FeedItem] = deque()  # appends and pops are atomic
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._lock = threading.Lock()  # starts the thread once

    def add(self, replica_id: Hashable, endpoint: str, replay_endpoint: str | None) -> None:
        """Subscribe to ``replica_id``'s publisher at ``endpoint`` (replaying from its first batch
        through ``replay_endpoint``). A replica already subscribed is re-subscribed."""
        self._start()
        self._commands.put(("add", replica_id, endpoint, replay_endpoint))

    def remove(self, replica_id: Hashable) -> None:
        """Stop reading ``replica_id``'s stream (no-op for a replica not subscribed)."""
        self._commands.put(("remove", replica_id, "", None))

    def drain(self, max_items: int = 10_000) -> list[FeedItem]:
        """What arrived since the last drain, oldest first, at most ``max_items``. Never blocks."""
        out: list[FeedItem] = []
        pop = self._out.popleft
        for _ in range(max_items):
            try:
                out.append(pop())
            except IndexError:
                break
        return out

    def close(self, timeout: float = 5.0) -> None:
        """Stop the thread and close every subscriber. Idempotent."""
        self._stop.set()
        thread = self._thread
        if thread is not None:
            thread.join(timeout)

    @property
    def running(self) -> bool:
        """Whether the feed's thread is alive."""
        return self._thread is not None and self._thread.is_alive()

    # -------------------------------------------------------------- internals
    def _start(self) -> None:
        with self._lock:
            if self._stop.is_set():
                raise RuntimeError("EventFeed.add called after close()")
            if self._thread is None:
                self._thread = threading.Thread(
                    target=self._run, name="radixkv-event-feed", daemon=True
                )
                self._thread.start()

    def _run(self) -> None:
        subs: dict[Hashable, EventSubscriber] = {}
        try:
            while not self._stop.is_set():
                self._apply_commands(subs)
                got = False
                for replica_id, sub in list(subs.items()):
                    got |= self._poll(replica_id, sub, subs)
                if not got:
                    self._stop.wait(self.poll_interval_s)
        finally:
            for sub in subs.values():
                sub.close()

    def _apply_commands(self, subs: dict[Hashable, EventSubscriber]) -> None:
        while True:
            try:
                op, replica_id, endpoint, replay_endpoint = self._commands.get_nowait()
            except queue.Empty:
                return
            old = subs.pop(replica_id, None)
            if old is not None:
                old.close()
            if op == "add":
                try:
                    subs[replica_id] = self._factory(endpoint, replay_endpoint)
                except (TypeError, ValueError):
                    log.exception("cannot subscribe to replica %r at %r", replica_id, endpoint)

    def _poll(
        self, replica_id: Hashable, sub: EventSubscriber, subs: dict[Hashable, EventSubscriber]
    ) -> bool:
        """Queue what ``sub`` has; True if anything came. A subscriber that fails is replaced
        (its replica's view reset), so one bad stream never stops the others."""
        try:
            items = sub.poll(0)
        except Exception:
            log.exception("KV event stream of replica %r failed; resubscribing", replica_id)
            sub.close()
            subs[replica_id] = self._factory(sub.endpoint, sub.replay_endpoint)
            self._out.append((replica_id, Reset("lost", 0)))
            return True
        for item in items:
            self._out.append((replica_id, item if isinstance(item, Reset) else item[1].events))
        return bool(items)
