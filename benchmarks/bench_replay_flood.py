"""How late live KV event batches arrive while a client floods the publisher's replay socket.

Setup: an ``EventPublisher`` whose replay ring is full (``--buffer`` batches, each one
``BlockStored`` of 4 blocks of 16 tokens), publishing live batches at ``--rate`` per
second for ``--seconds``. Two other processes: a subscriber on the PUB socket that
records, for every live batch, its arrival time minus the ``ts`` it was published with;
and, in the ``flood`` condition, ``--flooders`` clients that each ask the replay socket
for everything from seq 0 as fast as they can (reading the answers), from before the
first live batch to half a second after the last. The baseline, measured in the same
run, is the ``quiet`` condition: the same live stream with no flood.

Rows, per condition: live batches published and received, how many arrived while the
flood was still on, the delay's median, p99 and max (ms), and
the replays the flood clients got to the end of.

    python benchmarks/bench_replay_flood.py            # ~20 s
    python benchmarks/bench_replay_flood.py --quick
    python benchmarks/bench_replay_flood.py --out benchmarks/results/bench_replay_flood.csv
"""

from __future__ import annotations

import argparse
import multiprocessing as mp
import queue
import time
from pathlib import Path

import msgspec
import numpy as np
import zmq
from bench_common import save_rows

from radixkv.cache.events import BlockStored
from radixkv.fleet.transport import END_SEQ, EventPublisher

_BLOCK = 16
_GRACE_S = 0.5  # the flood outlasts the live window by this much


def events_of(seq: int) -> list[BlockStored]:
    """One batch's events: a BlockStored of 4 blocks whose hashes come from ``seq``."""
    hashes = [seq * 4 + i for i in range(4)]
    tokens = list(range(4 * _BLOCK))
    return [BlockStored(hashes, None, tokens, _BLOCK, None, None, None)]


def flood(endpoint: str, started, stop, counts) -> None:  # noqa: ANN001 - mp objects
    """Ask ``endpoint`` for a replay from seq 0 again and again until ``stop`` is set,
    reading every answer; count the replays answered to their end marker."""
    ctx = zmq.Context()
    dealer = ctx.socket(zmq.DEALER)
    dealer.setsockopt(zmq.LINGER, 0)
    dealer.connect(endpoint)
    done = sent = 0
    started.set()
    while not stop.is_set():
        try:
            dealer.send_multipart((b"", (0).to_bytes(8, "big")), zmq.NOBLOCK)
            sent += 1
        except zmq.Again:
            pass
        while dealer.poll(0):
            frames = dealer.recv_multipart()
            if frames[-2] == END_SEQ:
                done += 1
    with counts.get_lock():
        counts[0] += done
        counts[1] += sent
    dealer.close()
    ctx.term()


def subscribe(endpoint: str, expected: int, ready, give_up, out) -> None:  # noqa: ANN001
    """Receive live batches until ``expected`` arrived or ``give_up`` is set; put (seq,
    ts, arrival) for each on ``out``."""
    ctx = zmq.Context()
    sub = ctx.socket(zmq.SUB)
    sub.setsockopt(zmq.SUBSCRIBE, b"")
    sub.connect(endpoint)
    ready.set()
    got = []
    while len(got) < expected and not give_up.is_set():
        if not sub.poll(100):
            continue
        _, seq, payload = sub.recv_multipart()
        now = time.time()
        ts = msgspec.msgpack.decode(payload)[0]
        got.append((int.from_bytes(seq, "big"), ts, now))
    out.put(got)
    sub.close(linger=0)
    ctx.term()


def run(condition: str, args: argparse.Namespace) -> dict:
    spawn = mp.get_context("spawn")
    pub = EventPublisher(buffer_size=args.buffer)
    try:
        for seq in range(args.buffer):  # the replay ring full before the live window
            pub.publish(events_of(seq))
        pub.flush(60)
        num_live = round(args.rate * args.seconds)
        ready, give_up, out = spawn.Event(), spawn.Event(), spawn.Queue()
        sub = spawn.Process(target=subscribe, args=(pub.endpoint, num_live, ready, give_up, out))
        sub.start()
        ready.wait(30)
        time.sleep(1.0)  # the subscription reaches the publisher (PUB drops before it)
        counts, stop = spawn.Array("q", 2), spawn.Event()
        flooders = []
        for _ in range(args.flooders if condition == "flood" else 0):
            started = spawn.Event()
            flooders.append(
                spawn.Process(target=flood, args=(pub.replay_endpoint, started, stop, counts))
            )
            flooders[-1].start()
            started.wait(60)
        time.sleep(0.5 if flooders else 0.0)  # the flood under way
        start = time.time()
        for i in range(num_live):
            time.sleep(max(0.0, start + i / args.rate - time.time()))
            pub.publish(events_of(args.buffer + i), ts=time.time())
        time.sleep(max(0.0, start + args.seconds + _GRACE_S - time.time()))
        stop.set()
        flood_end = time.time()
        try:
            got = out.get(timeout=args.wait)
        except queue.Empty:  # what arrived by then
            give_up.set()
            got = out.get(timeout=60)
        sub.join()
        for p in flooders:
            p.join()
    finally:
        try:
            pub.close(timeout=args.wait)
        except RuntimeError as exc:  # the thread still busy with queued replays
            print(f"{condition}: {exc}")
    delays = np.array([(now - ts) * 1000 for _, ts, now in got]) if got else np.array([np.nan])
    during = sum(1 for *_, now in got if now < flood_end) if flooders else len(got)
    return {
        "condition": condition,
        "flooders": len(flooders),
        "live_published": num_live,
        "live_received": len(got),
        "received_during_flood": during,
        "delay_p50_ms": round(float(np.median(delays)), 2),
        "delay_p99_ms": round(float(np.percentile(delays, 99)), 2),
        "delay_max_ms": round(float(np.max(delays)), 2),
        "replays_answered": int(counts[0]),
        "replay_requests_sent": int(counts[1]),
    }


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--seconds", type=float, default=5.0, help="the live window (the flood's)")
    p.add_argument("--rate", type=float, default=87.0, help="live batches per second")
    p.add_argument("--buffer", type=int, default=10_000, help="the replay ring's batches")
    p.add_argument("--flooders", type=int, default=1, help="flooding replay clients")
    p.add_argument("--wait", type=float, default=60.0, help="how long to wait for late batches")
    p.add_argument("--quick", action="store_true", help="2 s, a 2,000-batch ring")
    p.add_argument("--out", type=Path, default=None, help="write the rows as CSV here")
    args = p.parse_args()
    if args.quick:
        args.seconds, args.buffer = 2.0, 2_000
    rows = [run(condition, args) for condition in ("quiet", "flood")]
    for row in rows:
        print(row)
    save_rows(rows, args.out, "bench_replay_flood.csv")


if __name__ == "__main__":
    main()
