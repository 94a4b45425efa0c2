"""KV events over real ZMQ sockets on 127.0.0.1 (radixkv.fleet.transport).

Every receive is bounded (a poll timeout under a deadline), so a broken
transport fails a test instead of hanging it. Subscribers are brought live with
:func:`sync` (probe batches until one arrives) rather than sleeps, except where
a bare SUB socket has no other way to know its subscription reached the PUB.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator

import msgspec
import pytest
import zmq

from radixkv.cache.events import AllBlocksCleared, BlockRemoved, EventBatch
from radixkv.fleet.transport import END_SEQ, EventPublisher, EventSubscriber, Received, Reset
from radixkv.fleet.wire import decode_batch, encode_batch

DEADLINE_S = 3.0
THREAD_NAME = "radixkv-event-publisher"


def test_reset_is_the_wire_modules_record() -> None:
    from radixkv.fleet import wire

    assert Reset is wire.Reset  # re-exported here: transport emits it, consumers need no zmq


def events(i: int) -> list[BlockRemoved]:
    """Batch ``i``'s events: distinct per batch, so a swapped or repeated batch shows."""
    return [BlockRemoved(block_hashes=[i], medium="GPU", group_idx=0)]


def seq_bytes(seq: int) -> bytes:
    return seq.to_bytes(8, "big")


def batches(items: list[Received | Reset]) -> list[Received]:
    return [x for x in items if not isinstance(x, Reset)]


def seqs(items: list[Received | Reset]) -> list[int]:
    return [s for s, _ in batches(items)]


def poll_until(sub: EventSubscriber, done, what: str) -> list[Received | Reset]:
    """Poll in 20 ms steps until ``done(items so far)``; fail (never hang) after DEADLINE_S."""
    out: list[Received | Reset] = []
    deadline = time.monotonic() + DEADLINE_S
    while not done(out):
        if time.monotonic() > deadline:
            pytest.fail(f"timed out waiting for {what}; got {out}")
        out += sub.poll(20)
    return out


def collect(sub: EventSubscriber, last_seq: int) -> list[Received | Reset]:
    """Everything up to and including batch ``last_seq``."""
    return poll_until(sub, lambda _: sub.last_seq == last_seq, f"seq {last_seq}")


def sync(pub: EventPublisher, sub: EventSubscriber) -> list[Received | Reset]:
    """Publish probe batches until ``sub`` receives live, then drain to the last one.

    Returns what arrived (replay fills whatever the slow joiner missed).
    """
    assert sub.wait_connected(int(DEADLINE_S * 1000))
    out: list[Received | Reset] = []
    deadline = time.monotonic() + DEADLINE_S
    while sub.last_seq is None:
        if time.monotonic() > deadline:
            pytest.fail("subscriber never received a probe")
        pub.publish([AllBlocksCleared()], ts=-1.0)
        out += sub.poll(20)
    return out + collect(sub, pub.next_seq - 1)


@pytest.fixture
def pub() -> Iterator[EventPublisher]:
    with EventPublisher() as p:
        yield p


@pytest.fixture
def sub(pub: EventPublisher) -> Iterator[EventSubscriber]:
    with EventSubscriber(pub.endpoint, pub.replay_endpoint) as s:
        yield s


@pytest.fixture(autouse=True)
def no_leaked_threads() -> Iterator[None]:
    yield
    alive = [t for t in threading.enumerate() if t.name == THREAD_NAME]
    assert not alive, f"publisher threads left running: {alive}"


def recv(sock: zmq.Socket) -> list[bytes]:
    assert sock.poll(int(DEADLINE_S * 1000), zmq.POLLIN), "no message within the deadline"
    return sock.recv_multipart()


# ------------------------------------------------------------ the stream
@pytest.mark.parametrize(("topic", "rank"), [("", None), ("kv@replica-1", 2)])
def test_raw_frames_are_vllms(topic: str, rank: int | None) -> None:
    """A bare SUB sees [topic, seq as 8 big-endian bytes, msgpack payload], seq from 0."""
    ctx = zmq.Context()
    try:
        with EventPublisher(topic=topic, data_parallel_rank=rank) as pub:
            sock = ctx.socket(zmq.SUB)
            monitor = sock.get_monitor_socket(zmq.EVENT_HANDSHAKE_SUCCEEDED)
            sock.setsockopt(zmq.SUBSCRIBE, b"")
            sock.connect(pub.endpoint)
            assert monitor.poll(int(DEADLINE_S * 1000), zmq.POLLIN)
            # After the handshake the subscription is one message behind: give it time to land.
            time.sleep(0.1)
            pub.publish(events(7), ts=1.5)
            pub.publish([AllBlocksCleared()], ts=2.5)
            first, second = recv(sock), recv(sock)
            monitor.close(linger=0)
            sock.close(linger=0)
        assert len(first) == 3
        assert first[0] == topic.encode()
        assert first[1] == (0).to_bytes(8, "big")
        assert decode_batch(first[2]) == EventBatch(1.5, events(7), rank)
        assert first[2] == encode_batch(events(7), 1.5, rank)
        assert second[1] == (1).to_bytes(8, "big")
        assert decode_batch(second[2]).events == [AllBlocksCleared()]
    finally:
        ctx.term()


def test_in_order_delivery(pub: EventPublisher, sub: EventSubscriber) -> None:
    sync(pub, sub)
    base = pub.next_seq
    for i in range(50):
        assert pub.publish(events(i), ts=float(i)) == base + i
    got = collect(sub, base + 49)
    assert got == [(base + i, EventBatch(float(i), events(i))) for i in range(50)]
    assert sub.num_lost == sub.num_resets == 0


def test_publish_is_thread_safe(pub: EventPublisher, sub: EventSubscriber) -> None:
    """Seqs are handed out in queue order: concurrent publishers still give 0, 1, 2, ..."""
    sync(pub, sub)
    base = pub.next_seq

    def worker(w: int) -> None:
        for i in range(50):
            pub.publish(events(1000 * w + i))

    threads = [threading.Thread(target=worker, args=(w,)) for w in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(DEADLINE_S)
    got = collect(sub, base + 199)
    assert seqs(got) == list(range(base, base + 200))
    hashes = sorted(b.events[0].block_hashes[0] for _, b in batches(got))
    assert hashes == sorted(1000 * w + i for w in range(4) for i in range(50))


def test_topic_is_matched_exactly() -> None:
    """SUBSCRIBE matches prefixes; the subscriber skips a topic that only starts with its own."""
    with EventPublisher(topic="kv@1") as pub:
        with (
            EventSubscriber(pub.endpoint, pub.replay_endpoint, topic="kv@1") as exact,
            EventSubscriber(pub.endpoint, topic="kv@") as prefix,
        ):
            assert prefix.wait_connected(int(DEADLINE_S * 1000))
            got = sync(pub, exact)
            assert seqs(got) == list(range(pub.next_seq))
            assert prefix.poll(50) == [] and prefix.last_seq is None


# ------------------------------------------------------------ gaps and replay
def test_gap_is_filled_from_replay(pub: EventPublisher, sub: EventSubscriber) -> None:
    sync(pub, sub)
    base = pub.next_seq
    pub._skip_live.update({base + 2, base + 3, base + 7})  # kept for replay, never sent live
    for i in range(10):
        pub.publish(events(i), ts=float(i))
    got = collect(sub, base + 9)
    assert got == [(base + i, EventBatch(float(i), events(i))) for i in range(10)]
    assert sub.num_replayed == 3 and sub.num_lost == 0 and sub.num_resets == 0


@pytest.mark.parametrize("num_before", [1, 5])
def test_late_joiner_replays_from_start(pub: EventPublisher, num_before: int) -> None:
    for i in range(num_before):
        pub.publish(events(i), ts=float(i))
    assert pub.flush()
    with EventSubscriber(pub.endpoint, pub.replay_endpoint) as sub:
        got = sync(pub, sub)
        assert not any(isinstance(x, Reset) for x in got)
        assert seqs(got) == list(range(pub.next_seq))
        want = [EventBatch(float(i), events(i)) for i in range(num_before)]
        assert [b for _, b in got[:num_before]] == want
        assert sub.num_replayed >= num_before


@pytest.mark.parametrize("buffer_size", [2, 1])
def test_first_live_batch_seq_1_recovers_seq_0_or_resets(buffer_size: int) -> None:
    """Joining at seq 1 exactly (a hand-driven XPUB for the stream, a real publisher's ring for
    replay): seq 0 comes from replay, or, when the ring has dropped it, a Reset says so."""
    ctx = zmq.Context()
    try:
        xpub = ctx.socket(zmq.XPUB)
        endpoint = f"tcp://127.0.0.1:{xpub.bind_to_random_port('tcp://127.0.0.1')}"
        with EventPublisher(buffer_size=buffer_size) as ring:
            for i in range(2):
                ring.publish(events(i), ts=float(i))
            assert ring.flush()  # the ring holds seqs 0 and 1, or only 1
            with EventSubscriber(endpoint, ring.replay_endpoint) as sub:
                assert recv(xpub) == [b"\x01"]  # the subscription arrived: the sub is live
                xpub.send_multipart([b"", seq_bytes(1), pub_payload(1)])
                got = collect(sub, 1)
        xpub.close(linger=0)
    finally:
        ctx.term()
    batch = [(1, EventBatch(1.0, events(1)))]
    if buffer_size == 2:
        assert got == [(0, EventBatch(0.0, events(0))), *batch]
        assert (sub.num_replayed, sub.num_lost, sub.num_resets) == (1, 0, 0)
    else:
        assert got == [Reset("lost", seq=1, num_lost=1), *batch]
        assert (sub.num_replayed, sub.num_lost, sub.num_resets) == (0, 1, 1)


def test_late_joiner_without_replay_from_start(pub: EventPublisher) -> None:
    for i in range(5):
        pub.publish(events(i), ts=float(i))
    assert pub.flush()
    with EventSubscriber(pub.endpoint, pub.replay_endpoint, replay_from_start=False) as sub:
        got = sync(pub, sub)
        assert not any(isinstance(x, Reset) for x in got)
        first = seqs(got)[0]
        assert first >= 5 and seqs(got) == list(range(first, pub.next_seq))
        assert sub.num_replayed == 0


def test_ring_buffer_evicts_and_the_loss_is_reported() -> None:
    with EventPublisher(buffer_size=3) as pub:
        with EventSubscriber(pub.endpoint, pub.replay_endpoint) as sub:
            sync(pub, sub)
            base = pub.next_seq
            pub._skip_live.update(range(base + 1, base + 5))
            for i in range(8):
                pub.publish(events(i), ts=float(i))
            assert pub.flush()  # the ring now holds base+5 .. base+7 only
            got = collect(sub, base + 7)
    assert got == [
        (base, EventBatch(0.0, events(0))),
        Reset("lost", seq=base + 5, num_lost=4),
        *[(base + i, EventBatch(float(i), events(i))) for i in (5, 6, 7)],
    ]
    assert sub.num_lost == 4 and sub.num_resets == 1


def test_replay_socket_frames_and_end_marker() -> None:
    """vLLM's replay: [b"", start] in; [b"", seq, payload] per batch >= start, then the marker."""
    ctx = zmq.Context()
    try:
        with EventPublisher(buffer_size=3) as pub:
            for i in range(5):
                pub.publish(events(i), ts=float(i))
            assert pub.flush()
            dealer = ctx.socket(zmq.DEALER)
            dealer.connect(pub.replay_endpoint)

            def ask(*request: bytes) -> list[list[bytes]]:
                dealer.send_multipart(request)
                replies = [recv(dealer)]
                while replies[-1][-2] != END_SEQ:
                    replies.append(recv(dealer))
                return replies

            # Asking from seq 1 gives what the ring still holds (2, 3, 4), oldest first.
            replies = ask(b"", seq_bytes(1))
            assert [r[:2] for r in replies[:-1]] == [[b"", seq_bytes(s)] for s in (2, 3, 4)]
            assert [decode_batch(r[2]).ts for r in replies[:-1]] == [2.0, 3.0, 4.0]
            assert replies[-1] == [b"", b"\xff" * 8, b""]
            assert END_SEQ == (-1).to_bytes(8, "big", signed=True)
            assert [r[1] for r in ask(b"", seq_bytes(4))] == [seq_bytes(4), END_SEQ]
            assert ask(b"", seq_bytes(99)) == [[b"", END_SEQ, b""]]  # nothing that new
            # A bare DEALER (no delimiter) gets answers without one.
            assert ask(seq_bytes(4))[0] == [seq_bytes(4), pub_payload(4)]
            # A malformed request is ignored; the socket keeps serving.
            dealer.send_multipart([b"", b"\x01\x02"])
            assert ask(b"", seq_bytes(4))[-1] == [b"", END_SEQ, b""]
            dealer.close(linger=0)
    finally:
        ctx.term()


def pub_payload(i: int) -> bytes:
    return encode_batch(events(i), float(i))


def test_a_replay_flood_does_not_hold_back_the_live_stream() -> None:
    """A client asking the replay socket for the whole ring as fast as it can, reading every
    answer: each live batch still arrives while the flood goes on (it used to wait until
    the flood and its backlog were over), and the flood's replays are still answered."""
    ring, num_live = 2000, 20
    ctx = zmq.Context()
    stop, answered = threading.Event(), [0]  # replays answered to their end marker

    def flood(endpoint: str) -> None:
        dealer = ctx.socket(zmq.DEALER)
        dealer.connect(endpoint)
        while not stop.is_set():
            try:
                dealer.send_multipart((b"", seq_bytes(0)), zmq.NOBLOCK)
            except zmq.Again:
                pass
            while dealer.poll(0):
                answered[0] += dealer.recv_multipart()[-2] == END_SEQ
        dealer.close(linger=0)

    try:
        with (
            EventPublisher(buffer_size=ring) as pub,
            EventSubscriber(pub.endpoint, replay_from_start=False) as sub,
        ):
            for i in range(ring):
                pub.publish(events(i))
            assert pub.flush()
            sync(pub, sub)
            flooder = threading.Thread(target=flood, args=(pub.replay_endpoint,))
            flooder.start()
            try:
                poll_until(sub, lambda _: answered[0] > 0, "the flood's first replay")
                before = answered[0]
                for i in range(num_live):
                    seq = pub.publish(events(ring + i))
                    assert seqs(collect(sub, seq)) == [seq]  # while the flood goes on
                poll_until(sub, lambda _: answered[0] > before, "a replay during the flood")
                assert flooder.is_alive()
            finally:
                stop.set()
                flooder.join()
    finally:
        ctx.term()


# ------------------------------------------------------------ resets
def test_seq_going_backwards_is_a_restart() -> None:
    a = EventPublisher()
    endpoints = (a.endpoint, a.replay_endpoint)
    with EventSubscriber(*endpoints) as sub:
        try:
            sync(a, sub)
            for i in range(100):  # far ahead of what the restarted publisher reaches below
                a.publish(events(i))
            collect(sub, a.next_seq - 1)
            old_last = sub.last_seq
        finally:
            a.close()
        with EventPublisher(*endpoints) as b:  # same ports: the replica restarted
            got: list[Received | Reset] = []
            deadline = time.monotonic() + DEADLINE_S
            while not got:
                assert time.monotonic() < deadline, "restarted publisher never reached the sub"
                b.publish(events(b.next_seq), ts=float(b.next_seq))
                got += sub.poll(20)
            got += collect(sub, b.next_seq - 1)
    reset, rest = got[0], got[1:]
    assert isinstance(reset, Reset) and reset.reason == "restart"
    assert reset.seq <= old_last and reset.num_lost == 0
    # Then the new stream from its start: replay gives what the sub joined too late for.
    assert rest == [(i, EventBatch(float(i), events(i))) for i in range(b.next_seq)]
    assert sub.num_resets == 1 and sub.num_lost == 0


def test_raw_publisher_gaps_garbage_and_restart() -> None:
    """Against a hand-driven XPUB (no replay): each kind of trouble and its marker."""
    ctx = zmq.Context()
    try:
        xpub = ctx.socket(zmq.XPUB)
        endpoint = f"tcp://127.0.0.1:{xpub.bind_to_random_port('tcp://127.0.0.1')}"
        with EventSubscriber(endpoint, topic="t") as sub:
            assert recv(xpub) == [b"\x01t"]  # the subscription arrived: the sub is live

            def send(seq: int, payload: bytes | None = None, topic: bytes = b"t") -> None:
                xpub.send_multipart([topic, seq_bytes(seq), payload or pub_payload(seq)])

            send(0)
            xpub.send_multipart([b"t", seq_bytes(1)])  # two frames: skipped
            send(1, topic=b"tx")  # another topic: skipped
            send(1, b"\xc1not msgpack")  # undecodable: lost
            send(2)
            send(5)  # 3 and 4 missed and no replay socket: lost
            send(1)  # backwards: the publisher restarted
            got = poll_until(sub, lambda out: len(out) >= 7, "7 items")
            xpub.close(linger=0)
    finally:
        ctx.term()
    b = pub_payload
    assert got == [
        (0, decode_batch(b(0))),
        Reset("lost", seq=2, num_lost=1),
        (2, decode_batch(b(2))),
        Reset("lost", seq=5, num_lost=2),
        (5, decode_batch(b(5))),
        Reset("restart", seq=1),
        (1, decode_batch(b(1))),
    ]
    assert (sub.num_lost, sub.num_resets, sub.num_received) == (3, 3, 4)


def epochs(items: list[Received | Reset]) -> list[list[int]]:
    """The seqs delivered between Reset markers, one list per stretch."""
    out: list[list[int]] = [[]]
    for x in items:
        if isinstance(x, Reset):
            out.append([])
        else:
            out[-1].append(x[0])
    return out


@pytest.mark.parametrize("with_replay", [False, True])
def test_a_seq_equal_to_the_last_is_a_restart(with_replay: bool) -> None:
    """The old publisher's seqs 0, 1, 2, then the restarted one's 2 (it passed 0 and 1 before
    the sub saw it): a Reset("restart"), never the new 2 as if it were the old one again.
    With replay, the new publisher's 0 and 1 come from its ring before its 2."""
    ctx = zmq.Context()
    try:
        xpub = ctx.socket(zmq.XPUB)
        endpoint = f"tcp://127.0.0.1:{xpub.bind_to_random_port('tcp://127.0.0.1')}"
        with EventPublisher() as new:  # the restarted publisher's ring: its seqs 0, 1, 2
            for s in range(3):
                new.publish(events(10 + s), ts=float(10 + s))
            assert new.flush()
            replay = new.replay_endpoint if with_replay else None
            with EventSubscriber(endpoint, replay) as sub:
                assert recv(xpub) == [b"\x01"]
                for s in range(3):
                    xpub.send_multipart([b"", seq_bytes(s), pub_payload(s)])
                xpub.send_multipart([b"", seq_bytes(2), pub_payload(12)])  # the new stream
                xpub.send_multipart([b"", seq_bytes(3), pub_payload(13)])
                got = poll_until(
                    sub, lambda out: any(x[0] == 3 for x in batches(out)), "the new seq 3"
                )
        xpub.close(linger=0)
    finally:
        ctx.term()
    old = [(s, decode_batch(pub_payload(s))) for s in range(3)]
    renewed = [(s, decode_batch(pub_payload(10 + s))) for s in range(4)]
    assert got == [*old, Reset("restart", seq=2), *(renewed if with_replay else renewed[2:])]
    assert all(a < b for run in epochs(got) for a, b in zip(run, run[1:]))  # none twice
    assert sub.num_resets == 1 and sub.num_lost == 0


# ------------------------------------------------------------ lifecycle and errors
def test_close_stops_the_thread_and_releases_the_ports() -> None:
    pub = EventPublisher()
    endpoints = (pub.endpoint, pub.replay_endpoint)
    assert endpoints[0].startswith("tcp://127.0.0.1:") and endpoints[0] != endpoints[1]
    thread = pub._thread
    assert thread.is_alive()
    pub.close()
    assert not thread.is_alive() and pub.closed
    pub.close()  # idempotent
    with pytest.raises(RuntimeError, match="after close"):
        pub.publish(events(0))
    assert pub.flush() is False
    with EventPublisher(*endpoints) as again:  # the ports are free again
        assert (again.endpoint, again.replay_endpoint) == endpoints
    sub = EventSubscriber(endpoints[0], endpoints[1])
    sub.close()
    sub.close()
    with pytest.raises(RuntimeError, match="after close"):
        sub.poll(0)


def test_port_zero_and_no_replay() -> None:
    with EventPublisher("tcp://127.0.0.1:0", replay_endpoint=None) as pub:
        assert not pub.endpoint.endswith(":0") and pub.replay_endpoint is None


def test_bad_arguments_are_named() -> None:
    with pytest.raises(ValueError, match="buffer_size must be a positive int, got 0"):
        EventPublisher(buffer_size=0)
    with pytest.raises(TypeError, match="topic must be a str, got b'x'"):
        EventPublisher(topic=b"x")  # type: ignore[arg-type]
    with pytest.raises(OSError, match="cannot bind endpoint='bogus://x'"):
        EventPublisher("bogus://x")
    with EventPublisher() as pub:
        with pytest.raises(OSError, match=f"cannot bind replay_endpoint='{pub.replay_endpoint}'"):
            EventPublisher(replay_endpoint=pub.replay_endpoint)
        with pytest.raises(TypeError, match=r"events\[0\] must be a BlockStored"):
            pub.publish([object()])  # type: ignore[list-item]
        assert pub.next_seq == 0  # a rejected batch takes no seq
    with pytest.raises(ValueError, match="cannot connect endpoint='bogus://x'"):
        EventSubscriber("bogus://x")
    with pytest.raises(ValueError, match="replay_timeout_ms must be a positive int, got 0"):
        EventSubscriber("tcp://127.0.0.1:1", replay_timeout_ms=0)


def test_replay_that_never_answers_counts_as_lost() -> None:
    """A replay endpoint nobody serves: the gap is reported lost after replay_timeout_ms."""
    ctx = zmq.Context()
    try:
        xpub = ctx.socket(zmq.XPUB)
        silent = ctx.socket(zmq.ROUTER)  # accepts the request, never answers
        port = xpub.bind_to_random_port("tcp://127.0.0.1")
        replay_port = silent.bind_to_random_port("tcp://127.0.0.1")
        with EventSubscriber(
            f"tcp://127.0.0.1:{port}", f"tcp://127.0.0.1:{replay_port}", replay_timeout_ms=100
        ) as sub:
            assert recv(xpub) == [b"\x01"]
            xpub.send_multipart([b"", seq_bytes(0), pub_payload(0)])
            xpub.send_multipart([b"", seq_bytes(3), pub_payload(3)])
            started = time.monotonic()
            got = collect(sub, 3)
            assert time.monotonic() - started < 1.0
            assert len(recv(silent)) == 3  # [identity, b"", start_seq 1]
        xpub.close(linger=0)
        silent.close(linger=0)
    finally:
        ctx.term()
    assert got == [
        (0, decode_batch(pub_payload(0))),
        Reset("lost", seq=3, num_lost=2),
        (3, decode_batch(pub_payload(3))),
    ]


def test_payload_bytes_are_msgpack_arrays_of_three() -> None:
    """The payload a subscriber sees is exactly wire.encode_batch's (no extra framing)."""
    raw = msgspec.msgpack.decode(pub_payload(3))
    assert raw == [
        3.0,
        [{"type": "BlockRemoved", "block_hashes": [3], "medium": "GPU", "group_idx": 0}],
        None,
    ]


def test_offset_endpoint_moves_a_tcp_port_by_the_rank_as_vllm_does() -> None:
    from radixkv.fleet.transport import offset_endpoint

    assert offset_endpoint("tcp://*:5557", 2) == "tcp://*:5559"
    assert offset_endpoint("tcp://127.0.0.1:5557", 0) == "tcp://127.0.0.1:5557"
    assert offset_endpoint("tcp://[::1]:5557", 1) == "tcp://[::1]:5558"
    assert offset_endpoint("tcp://127.0.0.1:*", 3) == "tcp://127.0.0.1:*"  # the OS picks
    assert offset_endpoint("tcp://127.0.0.1:0", 3) == "tcp://127.0.0.1:0"
    assert offset_endpoint("ipc:///tmp/kv", 0) == "ipc:///tmp/kv"
    assert offset_endpoint("ipc:///tmp/kv", 2) == "ipc:///tmp/kv-2"
    with pytest.raises(ValueError, match="endpoint must end in a port number or \\*, got"):
        offset_endpoint("tcp://host:abc", 1)
    with pytest.raises(ValueError, match="endpoint must be tcp://HOST:PORT, got 'tcp://5557'"):
        offset_endpoint("tcp://5557", 1)
    with pytest.raises(ValueError, match="past port 65535"):
        offset_endpoint("tcp://*:65535", 1)
