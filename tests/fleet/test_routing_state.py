"""RoutingState: the bookkeeping between a serving front's callbacks and a radixkv policy.

Serve's callback sequences (confirmed, rejected, fallen back, shared request ids,
cancelled, replicas lost) against the plain object, ``check()`` after every step; what
ends a request's speculative claims in the ``exact`` policy's index (issue 22); what a
snapshot shows of a policy's index. No Ray, no torch: the Ray Serve adapter around it is
tested in test_serve_fleet.py.
"""

from __future__ import annotations

import random
import subprocess
import sys
import textwrap
from collections.abc import Hashable
from typing import Any

import pytest
from routing_helpers import BS, XX, Clock, Failing, req, stored

from radixkv.errors import InvariantError
from radixkv.fleet.index import chain_hashes
from radixkv.fleet.router import make_router
from radixkv.fleet.routing_state import NO_INDEX_VIEW, RoutingState, index_view
from radixkv.fleet.wire import Reset


def state(policy: str = "least_loaded", **kwargs: Any) -> RoutingState:
    return RoutingState(make_router(policy, block_size=BS, hasher=XX), **kwargs)


def test_a_decision_counts_from_choice_to_completion() -> None:
    s = state()
    assert s.decide("k1", req([1] * 8, "r1"), ["a", "b"]) == "a"
    assert (s.in_flight("a"), s.in_flight("b"), s.num_pending) == (1, 0, 1)
    s.check()
    # the second call sees the first: least loaded goes to b
    assert s.decide("k2", req([2] * 8, "r2"), ["a", "b"]) == "b"
    assert s.routed("k1", "a") and s.routed("k2", "b")
    assert s.num_pending == 0
    s.check()
    assert s.completed("r1", "a")
    assert (s.in_flight("a"), s.in_flight("b")) == (0, 1)
    assert not s.completed("r1", "a")  # settled once
    assert s.completed("r2", "b")
    assert (s.in_flight("a"), s.in_flight("b")) == (0, 0)
    s.check()


def test_a_rejected_attempt_is_replaced_never_counted_twice() -> None:
    s = state()
    s.decide("k1", req([1] * 8, "r1"), ["a", "b"])
    # Serve reports the rejected attempt as completed before it asks again: not confirmed,
    # so it is not this call's end
    assert not s.completed("r1", "a")
    assert s.in_flight("a") == 1
    assert s.decide("k1", req([1] * 8, "r1"), ["a", "b"]) == "a"  # the old one undone first
    assert s.in_flight("a") + s.in_flight("b") == 1
    s.check()
    s.routed("k1", "a")
    assert s.completed("r1", "a") and s.in_flight("a") == 0
    s.check()


def test_serve_falling_back_to_another_rank_moves_the_count() -> None:
    s = state()
    assert s.decide("k1", req([1] * 8, "r1"), ["a", "b"]) == "a"
    assert s.routed("k1", "b")  # a was full: Serve took the next rank
    assert (s.in_flight("a"), s.in_flight("b")) == (0, 1)
    s.check()
    assert not s.completed("r1", "a")
    assert s.completed("r1", "b") and s.in_flight("b") == 0
    s.check()


def test_calls_sharing_a_request_id_end_on_their_own_replica() -> None:
    # Serve gives every handle call made while serving one request that request's id
    s = state()
    s.decide("k1", req([1] * 8, "r"), ["a", "b"])
    s.decide("k2", req([2] * 8, "r"), ["a", "b"])
    s.routed("k1", "a")
    s.routed("k2", "b")
    assert s.completed("r", "b")
    assert (s.in_flight("a"), s.in_flight("b")) == (1, 0)
    s.check()
    assert s.completed("r", "a") and s.in_flight("a") == 0


def test_an_unconfirmed_decision_expires() -> None:
    clock = Clock()
    s = state(pending_ttl_s=5.0, clock=clock)
    s.decide("k1", req([1] * 8, "r1"), ["a", "b"])  # cancelled before a replica took it
    clock.now = 10.0
    s.decide("k2", req([2] * 8, "r2"), ["a", "b"])
    assert s.num_pending == 1
    assert s.in_flight("a") + s.in_flight("b") == 1
    assert not s.routed("k1", "a")
    s.check()


def test_without_confirmations_a_decision_is_confirmed_when_made() -> None:
    s = state(confirmations=False)
    assert s.decide("k1", req([1] * 8, "r1"), ["a", "b"]) == "a"
    assert s.decide("k1", req([1] * 8, "r1"), ["a", "b"]) == "a"  # backoff: asked again
    assert s.in_flight("a") == 1
    s.check()
    assert s.completed("r1", "a") and s.in_flight("a") == 0
    s.check()


def test_without_confirmations_a_running_request_outlives_the_pending_ttl() -> None:
    clock = Clock()
    s = state(confirmations=False, pending_ttl_s=5.0, clock=clock)
    assert s.decide("k1", req([1] * 8, "r1"), ["a", "b"]) == "a"  # confirmed when made
    clock.now = 100.0  # a long generation: far past the TTL for unconfirmed decisions
    assert s.decide("k2", req([2] * 8, "r2"), ["a", "b"]) == "b"  # sweeps; a is still busy
    assert (s.in_flight("a"), s.in_flight("b"), s.num_pending) == (1, 1, 0)
    s.check()
    assert s.completed("r1", "a") and s.in_flight("a") == 0
    s.check()


def test_the_pending_sweep_runs_at_most_once_a_second_and_ends_only_the_expired() -> None:
    clock = Clock()
    s = state(pending_ttl_s=5.0, clock=clock)
    s.decide("k1", req([1] * 8, "r1"), ["a", "b"])  # t=0, swept at 0
    clock.now = 4.5
    s.decide("k2", req([2] * 8, "r2"), ["a", "b"])  # t=4.5, swept at 4.5
    clock.now = 5.2  # k1 is 5.2 s old, but the last sweep was 0.7 s ago
    s.decide("k3", req([3] * 8, "r3"), ["a", "b"])
    assert s.num_pending == 3
    clock.now = 9.5  # k1 (9.5 s) expires; k2 is exactly 5 s old: not older than the TTL
    s.decide("k4", req([4] * 8, "r4"), ["a", "b"])
    assert s.num_pending == 3 and not s.routed("k1", "a")
    assert s.routed("k2", "a")  # still standing (a fallback to a, if it was on b)
    s.check()


def test_without_confirmations_a_confirmed_call_asked_again_is_undone_first() -> None:
    s = state(confirmations=False)
    s.decide("k1", req([1] * 8, "r1"), ["a", "b"])
    assert s.routed("k1", "a")  # a confirmation that never had to come
    s.decide("k1", req([1] * 8, "r1"), ["a", "b"])  # Serve asks again for the same call
    assert s.in_flight("a") + s.in_flight("b") == 1
    s.check()


def test_each_ended_decision_gets_one_on_finish() -> None:
    s = state()
    finished: list[tuple[Hashable, str]] = []
    on_finish = s.router.on_finish

    def spy(replica_id: Hashable, request: Any) -> None:
        finished.append((replica_id, request.request_id))
        on_finish(replica_id, request)

    s.router.on_finish = spy  # type: ignore[method-assign]
    assert s.decide("k1", req([1] * 8, "r1"), ["a", "b"]) == "a"
    s.routed("k1", "b")  # Serve fell back: the policy's count on a ends here
    assert s.completed("r1", "b")  # the policy never counted it on b: nothing more
    assert finished == [("a", "r1")]
    s.check()


def test_add_replica_updates_a_known_replica_s_capacity() -> None:
    s = state()
    assert s.add_replica("a", 64).capacity_blocks == 64
    s.add_replica("a", 128)
    assert s.replicas["a"].capacity_blocks == 128 and len(s.replicas) == 1


def test_events_steer_the_exact_policy_and_a_reset_or_drop_forgets_them() -> None:
    s = state("exact")
    prefix = list(range(100, 124))  # 6 blocks
    s.add_replica("a", 64)
    s.add_replica("b", 64)
    s.apply("b", stored(prefix))
    assert s.decide("k1", req(prefix + [7, 8], "r1"), ["a", "b"]) == "b"
    s.routed("k1", "b")
    s.apply("z", stored(prefix))  # a replica it does not know: ignored
    assert "z" not in s.snapshot()
    blocks = chain_hashes(XX, prefix, BS, None)
    assert s.snapshot()["b"]["blocks"] == sorted(blocks)
    s.apply("b", Reset("lost", 3, 2))
    assert s.snapshot()["b"]["blocks"] == []
    s.apply("a", stored(prefix))
    assert s.drop_replica("a") and not s.drop_replica("a")
    assert "a" not in s.snapshot()
    assert s.router.index.match(blocks) == {}  # the reset took b's speculative entry too
    assert s.completed("r1", "b") and s.in_flight("b") == 0
    s.check()


def test_an_ended_request_s_speculative_blocks_leave_the_exact_index() -> None:
    """Issue 22: the ``exact`` policy claims a request's blocks on its replica from the decision
    until the request ends. Every way Serve ends a call (completed: finished or aborted by a
    client that went away; rejected and asked again; moved by a fallback; cancelled before
    any replica took it) ends its claims, through the policy's ``on_finish``."""
    clock = Clock()
    s = state("exact", pending_ttl_s=5.0, clock=clock)
    index = s.router.index
    s.add_replica("a", 64)
    s.add_replica("b", 64)

    def prompt(i: int) -> list[int]:
        return list(range(1000 * i, 1000 * i + 24))  # 6 blocks, unlike any other prompt

    def claimed(replica: str) -> set[int]:
        return index.speculative(replica)

    # decided, confirmed, then aborted: Serve reports the cancelled call as completed
    where = s.decide("k1", req(prompt(1), "r1"), ["a", "b"])
    s.routed("k1", where)
    assert claimed(where) == set(chain_hashes(XX, prompt(1), BS, None))
    assert s.completed("r1", where)
    assert claimed(where) == set() and index.num_speculating() == 0
    # rejected, then decided again: the old attempt's claims go, the new one's stand
    first = s.decide("k2", req(prompt(2), "r2"), ["a", "b"])
    assert not s.completed("r2", first)  # the rejection report: not confirmed, not the end
    second = s.decide("k2", req(prompt(2), "r2"), ["a", "b"])
    assert index.num_speculating() == 1 and claimed(second)
    # Serve fell back to the other replica: the chosen one's claims go
    other = "b" if second == "a" else "a"
    s.routed("k2", other)
    assert index.num_speculating() == 0 and claimed(second) == set() == claimed(other)
    assert s.completed("r2", other) and s.in_flight(other) == 0
    # cancelled before any replica took it: its claims go when the decision expires
    s.decide("k3", req(prompt(3), "r3"), ["a", "b"])
    assert index.num_speculating() == 1
    clock.now = 10.0
    s.decide("k4", req(prompt(4), "r4"), ["a", "b"])  # sweeps k3
    assert index.num_speculating() == 1 and s.num_pending == 1
    s.check()
    index.check()


def test_a_dropped_replica_s_decisions_settle_without_counting() -> None:
    s = state()
    s.decide("k1", req([1] * 8, "r1"), ["a", "b"])
    s.routed("k1", "a")
    s.decide("k2", req([2] * 8, "r2"), ["a", "b"])  # b, unconfirmed
    s.drop_replica("a")
    s.drop_replica("b")
    assert s.completed("r1", "a")
    s.decide("k2", req([2] * 8, "r2"), ["c"])
    assert s.in_flight("c") == 1
    s.check()


def test_reported_stats_become_the_replica_state() -> None:
    s = state()
    s.add_replica("a", 128)
    s.set_stats("a", {"running": 2, "waiting": 3, "kv_usage": 0.5})
    s.set_stats("a", {"waiting": "many", "running": True})  # malformed: kept as they were
    s.set_stats("nobody", {"running": 9})
    snap = s.snapshot()
    assert snap["a"] == {
        "replica_id": "a",
        "in_flight": 0,
        "waiting": 3,
        "running": 2,
        "kv_usage": 0.5,
        "capacity_blocks": 128,
    }
    assert "nobody" not in snap


def test_check_names_a_broken_count() -> None:
    s = state()
    s.decide("k1", req([1] * 8, "r1"), ["a"])
    s.replicas["a"].in_flight = 5
    with pytest.raises(InvariantError, match="replica 'a' counts 5 in flight, 1 decisions"):
        s.check()


def test_random_callback_sequences_keep_the_counts_exact() -> None:
    """Serve's sequences, shuffled: a call is decided; then rejected (reported completed,
    decided again), confirmed (maybe on a fallback replica), or cancelled unconfirmed
    (no callback: it expires); a confirmed call completes. check() after every step."""
    rng = random.Random(7)
    clock = Clock()
    s = state("exact", pending_ttl_s=30.0, clock=clock)
    replicas = ["a", "b", "c"]
    pending: dict[str, str] = {}  # call (also its request id) -> replica chosen
    confirmed: list[tuple[str, str]] = []  # (request id, replica)
    for step in range(800):
        clock.now += 0.01  # 8 s in all: only the cancelled outlive pending_ttl_s, at the end
        op = rng.random()
        if op < 0.3 or not (pending or confirmed):
            key = f"k{step}"
            pending[key] = s.decide(key, req([rng.randrange(4)] * 8 + [step], key), replicas)
        elif op < 0.45 and pending:  # rejected: reported, then asked again
            key = rng.choice(sorted(pending))
            assert not s.completed(key, pending[key])
            pending[key] = s.decide(key, req([1] * 8, key), replicas)
        elif op < 0.7 and pending:
            key = rng.choice(sorted(pending))
            chosen = pending.pop(key)
            where = chosen if rng.random() < 0.8 else rng.choice(replicas)
            assert s.routed(key, where)
            confirmed.append((key, where))
        elif op < 0.75 and pending:  # cancelled before a replica took it
            pending.pop(rng.choice(sorted(pending)))
        elif confirmed:
            assert s.completed(*confirmed.pop(rng.randrange(len(confirmed))))
        s.check()
        assert sum(s.in_flight(r) for r in replicas) >= len(confirmed)
    for rid, where in confirmed:
        assert s.completed(rid, where)
    clock.now += 100.0
    s.decide("last", req([1] * 8, "last"), replicas)  # sweeps every expired decision
    assert sum(s.in_flight(r) for r in replicas) == 1
    s.check()


def test_routing_state_rejects_a_bad_ttl_and_no_candidates() -> None:
    with pytest.raises(ValueError, match="pending_ttl_s must be a positive number, got 0"):
        state(pending_ttl_s=0)
    with pytest.raises(ValueError, match="candidates must not be empty"):
        state().decide("k", req([1, 2]), [])


def test_a_policy_that_raises_leaves_the_counts_consistent() -> None:
    s = state()
    s.decide("k1", req([1] * 8, "r1"), ["a", "b"])
    s.routed("k1", "a")
    failing = Failing(s.router, "choose")
    with pytest.raises(UnicodeEncodeError):
        s.decide("k2", req([2] * 8, "r2"), ["a", "b"])
    assert failing.calls == 1 and s.num_pending == 0
    assert (s.in_flight("a"), s.in_flight("b")) == (1, 0)
    s.check()
    # a policy that picks a replica it was not offered is refused before anything counts
    s.router.choose = lambda request, replicas: "z"
    with pytest.raises(ValueError, match="the policy chose 'z', not one of"):
        s.decide("k3", req([3] * 8, "r3"), ["a", "b"])
    s.check()
    # the policy hears of a request's end after the bookkeeping: the counts stay right
    Failing(s.router, "on_finish")
    with pytest.raises(UnicodeEncodeError):
        s.completed("r1", "a")
    assert s.in_flight("a") == 0 and not s.completed("r1", "a")
    s.check()


# ------------------------------------------------------------------ what a snapshot shows
def test_the_index_view_is_chosen_once_from_the_policy() -> None:
    prefix = list(range(100, 116))  # 4 blocks
    hashes = sorted(chain_hashes(XX, prefix, BS, None))
    exact, approx, plain = state("exact"), state("approx"), state("least_loaded")
    assert plain.index is NO_INDEX_VIEW and NO_INDEX_VIEW.describe("a") == {}
    assert index_view(plain.router) is NO_INDEX_VIEW
    for s in (exact, approx, plain):
        s.add_replica("a", 64)
    exact.apply("a", stored(prefix))  # exact: what the replica reported
    approx.decide("k", req(prefix, "r"), ["a"])  # approx: what it recorded routing there
    assert exact.snapshot()["a"]["blocks"] == hashes
    assert approx.snapshot()["a"]["blocks"] == hashes
    assert "blocks" not in plain.snapshot()["a"]
    # a speculative claim is not a reported block
    exact.decide("k", req(list(range(200, 216)), "r2"), ["a"])
    assert exact.snapshot()["a"]["blocks"] == hashes


def test_a_given_index_view_is_what_the_snapshot_shows() -> None:
    class Shown:
        def describe(self, replica_id: Hashable) -> dict[str, Any]:
            return {"shown": replica_id}

    s = RoutingState(make_router("exact", block_size=BS, hasher=XX), index=Shown())
    s.add_replica("a", 8)
    assert s.snapshot()["a"]["shown"] == "a" and "blocks" not in s.snapshot()["a"]


def test_routing_state_needs_no_pyzmq() -> None:
    """A Reset is a wire record (``radixkv.fleet.wire``), so the routing state imports and
    routes where pyzmq is missing (a front that gets its events another way)."""
    code = textwrap.dedent(
        """
        import importlib.abc, sys

        class Blocked(importlib.abc.MetaPathFinder):
            def find_spec(self, name, path=None, target=None):
                if name.split(".")[0] == "zmq":
                    raise ModuleNotFoundError(f"No module named {name!r} (blocked)", name=name)
                return None

        sys.meta_path.insert(0, Blocked())
        import numpy as np
        from radixkv.fleet.router import make_router
        from radixkv.fleet.routing import RouteRequest
        from radixkv.fleet.routing_state import RoutingState
        from radixkv.fleet.wire import Reset

        s = RoutingState(make_router("exact", block_size=4))
        s.add_replica("a")
        s.apply("a", Reset("lost", 3, 1))
        assert s.decide("k", RouteRequest("r", np.arange(8, dtype=np.int32)), ["a"]) == "a"
        assert not any(m.split(".")[0] == "zmq" for m in sys.modules)
        print("OK")
        """
    )
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0 and proc.stdout.endswith("OK\n"), proc.stdout + proc.stderr
