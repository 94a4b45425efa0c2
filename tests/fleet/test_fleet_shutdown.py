"""A fleet stops like one server (issue 24, item 6): SIGTERM and SIGINT end ``radixkv serve
--replicas 2`` with no traceback, no C++ stack dump and no Ray process left, and a stream
open at SIGTERM ends with ``"abort"`` and ``[DONE]``.

The real CLI runs as a subprocess in a session of its own (``start_new_session``), with
Ray's files in a temp dir of its own: every process of its Ray cluster (GCS, raylet, the
agents, the Serve actors) is in that session whatever its command line says (Ray renames
workers ``ray::...``), so ``/proc`` finds them by session id before and after the
signal. Then :func:`stop_on_signals` alone, in this process and in a child: what a
second signal does. Every wait is bounded by a deadline.
"""

from __future__ import annotations

import contextlib
import dataclasses
import http.client
import json
import os
import secrets
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import textwrap
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from pathlib import Path

import pytest

pytest.importorskip("ray")
pytest.importorskip("ray.serve")

ROOT = Path(__file__).resolve().parents[2]
START_S = 150.0  # Ray, Serve and two replicas on 2 busy cores
STOP_S = 60.0
# Serve waits up to 20 s (graceful_shutdown_timeout_s) for a replica's open requests: a
# drained fleet has none left, so it exits before that (about 9 s here, Ray's stop included).
EXIT_S = 15.0
GONE_S = 10.0  # for processes already killed to be reaped
# What Ray's C++ failure handler and Python's faulthandler print.
DUMP_MARKERS = ("Traceback", "*** SIGTERM received", "*** SIGINT received", "Stack trace")
DUMP_MARKERS += ("Fatal Python error", "PC: @", "SystemError")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def session_processes(sid: int) -> dict[int, str]:
    """Live (not zombie) processes of session ``sid``: pid -> name (``/proc/<pid>/stat``)."""
    found = {}
    for entry in Path("/proc").glob("[0-9]*"):
        try:
            stat = (entry / "stat").read_text()
        except OSError:  # gone meanwhile
            continue
        name, rest = stat[stat.index("(") + 1 : stat.rindex(")")], stat.rindex(")")
        fields = stat[rest + 1 :].split()  # state, ppid, pgrp, session, ...
        if int(fields[3]) == sid and fields[0] != "Z":
            found[int(entry.name)] = name
    return found


def answers(url: str) -> bool:
    try:
        with urllib.request.urlopen(url, timeout=10) as r:
            return r.status == 200
    except OSError:  # refused, reset, timed out (URLError is one)
        return False


@dataclasses.dataclass
class Fleet:
    """A fleet's process, its port, and (once the ``with`` block is left) its stderr."""

    proc: subprocess.Popen
    port: int
    err: str = ""


@contextlib.contextmanager
def running_fleet(*flags: str) -> Iterator[Fleet]:
    """``radixkv serve --replicas 2 --router exact FLAGS`` in a session of its own, once it
    has printed its URL and answers ``/health``. On leaving, every process of its session
    is killed and its stderr read into ``err``."""
    temp = tempfile.mkdtemp(prefix="rk", dir="/tmp")  # Ray's socket paths must stay short
    port = free_port()
    env = dict(
        os.environ,
        RAY_TMPDIR=temp,
        RAY_USAGE_STATS_ENABLED="0",
        RAY_AUTH_TOKEN=secrets.token_hex(16),  # none written to $HOME
    )
    env.pop("RAY_ADDRESS", None)  # a cluster of its own
    cmd = [sys.executable, "-m", "radixkv.cli", "serve", "--model", "random"]
    cmd += ["--replicas", "2", "--router", "exact", *flags]
    cmd += ["--host", "127.0.0.1", "--port", str(port)]
    out_path, err_path = Path(temp) / "stdout.txt", Path(temp) / "stderr.txt"
    # Files, not pipes: Ray's logs would fill a pipe no one reads.
    with open(out_path, "wb") as stdout, open(err_path, "wb") as stderr:
        proc = subprocess.Popen(
            cmd, cwd=ROOT, env=env, stdout=stdout, stderr=stderr, start_new_session=True
        )
    fleet = Fleet(proc, port)
    try:
        end = time.monotonic() + START_S
        # The URL line comes once serve.run has every replica running.
        while "radixkv fleet:" not in out_path.read_text():
            assert proc.poll() is None, err_path.read_text()[-3000:]
            assert time.monotonic() < end, "the fleet did not start in time"
            time.sleep(0.5)
        assert answers(f"http://127.0.0.1:{port}/health")
        yield fleet
    finally:
        for pid in session_processes(proc.pid):  # never leave one behind, even on failure
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
        proc.wait(timeout=STOP_S)
        fleet.err = err_path.read_text(errors="replace")
        shutil.rmtree(temp, ignore_errors=True)


def processes_left_after(proc: subprocess.Popen[bytes]) -> dict[int, str]:
    """The processes of ``proc``'s session still alive ``GONE_S`` after it exited."""
    end = time.monotonic() + GONE_S
    while (left := session_processes(proc.pid)) and time.monotonic() < end:
        time.sleep(0.2)
    return left


def assert_a_ray_fleet_runs(proc: subprocess.Popen[bytes]) -> None:
    before = session_processes(proc.pid)
    assert {"raylet", "gcs_server"} <= set(before.values()), before
    assert any(name.startswith("ray::ServeRepl") for name in before.values()), before


@pytest.mark.skipif(not Path("/proc/self/stat").exists(), reason="finds processes in /proc")
@pytest.mark.slow  # a Ray fleet (~30 s)
def test_sigint_stops_the_fleet_and_every_process_of_its_ray() -> None:
    """SIGTERM's case is the stream test below (one fleet start fewer: ~30 s each)."""
    with running_fleet("--num-blocks", "64") as fleet:
        proc = fleet.proc
        assert_a_ray_fleet_runs(proc)
        proc.send_signal(signal.SIGINT)
        proc.wait(timeout=STOP_S)
        left = processes_left_after(proc)
    err = fleet.err
    assert left == {}, left
    assert proc.returncode == 0, err[-3000:]  # as the one-engine server does after SIGINT
    assert "radixkv fleet: SIGINT, shutting down" in err
    assert not [m for m in DUMP_MARKERS if m in err], err[-3000:]


@pytest.mark.skipif(not Path("/proc/self/stat").exists(), reason="finds processes in /proc")
@pytest.mark.slow  # a Ray fleet (~30 s)
def test_sigterm_ends_an_open_stream_with_abort_and_done_as_one_server_does() -> None:
    """SIGTERM broke a fleet's open streams off (no final chunk, no ``[DONE]``, a
    traceback in the log): Serve's stop kills its HTTP proxies at once. Now the fleet
    drains first: the stream ends with ``finish_reason`` ``"abort"`` and ``data:
    [DONE]``, and the fleet exits inside Serve's 20 s graceful timeout."""
    body = {"prompt": "x", "max_tokens": 60_000, "ignore_eos": True, "stream": True}
    with running_fleet("--num-blocks", "4000") as fleet:
        proc = fleet.proc
        assert_a_ray_fleet_runs(proc)
        lines: list[bytes] = []
        conn = http.client.HTTPConnection("127.0.0.1", fleet.port, timeout=STOP_S)
        conn.request("POST", "/v1/completions", json.dumps(body), {"Content-Type": "x"})
        resp = conn.getresponse()
        assert resp.status == 200, resp.read()
        while sum(line.startswith(b"data: {") for line in lines) < 3:  # it is running
            lines.append(resp.readline())
            assert lines[-1], lines
        proc.send_signal(signal.SIGTERM)
        with contextlib.suppress(http.client.IncompleteRead, ConnectionError):
            while line := resp.readline():  # until the server closes the stream
                lines.append(line)
        conn.close()
        proc.wait(timeout=EXIT_S)
        left = processes_left_after(proc)
    err = fleet.err
    assert left == {}, left
    assert "radixkv fleet: SIGTERM, shutting down" in err
    events = [x[len(b"data: ") :].strip() for x in lines if x.startswith(b"data: ")]
    assert events[-1] == b"[DONE]", lines[-5:]
    last = json.loads(events[-2])
    assert last["choices"][0]["finish_reason"] == "abort", last
    assert proc.returncode == -signal.SIGTERM, err[-3000:]
    assert not [m for m in DUMP_MARKERS if m in err], err[-3000:]


def test_stop_on_signals_interrupts_records_the_first_signal_and_restores_handlers() -> None:
    from radixkv.serve.ray.fleet import stop_on_signals

    before = {sig: signal.getsignal(sig) for sig in (signal.SIGINT, signal.SIGTERM)}
    with stop_on_signals() as stop:
        assert stop.received is None
        with pytest.raises(KeyboardInterrupt):
            signal.raise_signal(signal.SIGTERM)
        with pytest.raises(KeyboardInterrupt):  # a second one cuts a slow step short
            signal.raise_signal(signal.SIGINT)
        assert stop.received == signal.SIGTERM
    assert {sig: signal.getsignal(sig) for sig in before} == before


def test_a_signal_after_exit_now_ends_the_process_at_once() -> None:
    code = textwrap.dedent(
        """
        import signal
        from radixkv.serve.ray.fleet import stop_on_signals
        with stop_on_signals() as stop:
            stop.exit_now = True
            signal.raise_signal(signal.SIGTERM)
            print("still running")
        """
    )
    run = subprocess.run(
        [sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=STOP_S
    )
    assert run.returncode == 128 + signal.SIGTERM, run.stderr
    assert run.stdout == ""
    assert run.stderr == "radixkv fleet: SIGTERM, exiting now\n"
