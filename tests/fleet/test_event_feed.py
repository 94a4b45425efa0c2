"""EventFeed: every replica's KV event stream, read on one thread and handed over in order,
over real ZMQ publishers on 127.0.0.1. No Ray, no torch."""

from __future__ import annotations

import logging
import time

import pytest

pytest.importorskip("zmq")

from routing_helpers import LOCAL, stored, wait_for  # noqa: E402

from radixkv.fleet.event_feed import EventFeed  # noqa: E402
from radixkv.fleet.transport import EventPublisher  # noqa: E402


def test_event_feed_hands_over_each_replica_s_batches_in_order(caplog) -> None:
    caplog.set_level(logging.ERROR, logger="radixkv.fleet.event_feed")
    feed = EventFeed(poll_interval_s=0.002)
    with EventPublisher(LOCAL, LOCAL) as pa, EventPublisher(LOCAL, LOCAL) as pb:
        feed.add("a", pa.endpoint, pa.replay_endpoint)
        feed.add("b", pb.endpoint, pb.replay_endpoint)
        feed.add("bad", "not an endpoint", None)  # logged; the others keep flowing
        batches = [stored(list(range(i, i + 8))) for i in range(3)]
        got: list = []

        def arrived() -> bool:
            for events in batches:
                pa.publish(events)
            pb.publish(batches[0])
            time.sleep(0.05)
            got.extend(feed.drain())
            return any(r == "b" for r, _ in got) and sum(r == "a" for r, _ in got) >= 3

        wait_for(arrived, "batches from both replicas")
        from_a = [events for r, events in got if r == "a"]
        assert all(from_a[i] == batches[i % 3] for i in range(len(from_a)))  # in order
        assert {r for r, _ in got} == {"a", "b"}
        feed.remove("a")
        time.sleep(0.1)
        feed.drain()
        pa.publish(batches[0])
        pb.publish(batches[1])
        got.clear()
        wait_for(lambda: got.extend(feed.drain()) or ("b", batches[1]) in got, "b after a")
        time.sleep(0.05)
        assert all(r == "b" for r, _ in feed.drain())
    assert "cannot subscribe to replica 'bad'" in caplog.text
    feed.close()
    assert not feed.running
    with pytest.raises(RuntimeError, match="after close"):
        feed.add("c", "tcp://127.0.0.1:1", None)
