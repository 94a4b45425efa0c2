"""Three-tier replay (``replay(..., host_capacity=H, store_capacity=S)``): a KV store below
the host tier, ``radixkv replay --store-capacity`` and ``radixkv sweep --store-capacities``.

What must hold, whatever the eviction order and the store's write policy:

- ``store_capacity=0`` is the two-tier replay;
- device, host and store hits partition the served prefix (tokens and blocks), accesses are
  conserved (device + host + store hits + misses = ids), the served prefix never exceeds
  the longest previously seen one, and the store never holds more than its blocks;
- with a store that holds every block and no backup skipped, nothing is ever lost: every
  request is served exactly its longest previously seen prefix, so never less than the
  two-tier replay gives it (a host of twice the longest request never skips a backup);
- every block served from any tier holds its position's id (``IdPools``);
- hand traces with hand-derived figures, the CLI, and errors naming the argument.

(An infinite store does *not* always serve at least the two-tier total: a run read from
the store occupies the host while it loads, so a device node evicted meanwhile can find no
host room, is not backed up, and is lost where the two-tier replay would have kept it on
the host. ``test_an_infinite_store_can_lose_a_node_the_host_would_have_kept`` pins one.)
"""

from __future__ import annotations

import csv
import json

import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st
from replay_reference import random_requests, reqs
from test_replay_host import seen_prefixes
from trace_paths import TRACES

from radixkv.cli import main
from radixkv.errors import InvariantError
from radixkv.replay import RADIX_POLICIES, ReplayConfig, TierCostModel, load_trace, replay
from radixkv.replay.id_pools import STORE_ENTRY_BYTES
from radixkv.replay.radix_policy import RadixReplayer
from radixkv.replay.sweep import read_csv

WRITE_POLICIES = ("write_back", "write_through")
CONVERSATION = TRACES / "conversation_trace.jsonl"


def served(r) -> np.ndarray:
    return r.hit_blocks + r.host_hit_blocks + r.store_hit_blocks


# ----------------------------------------------------------------------------- hand traces
A, B, C = [1, 2], [3, 4], [5, 6]
HAND = [A, B, C, A, C, B]
HAND_LENGTHS = [len(s) * 512 - 100 for s in HAND]


def hand(store: int, write_policy: str = "write_back"):
    requests = reqs(HAND, 512, HAND_LENGTHS)
    return replay(
        requests,
        "radix-lru",
        2,
        host_capacity=2,
        store_capacity=store,
        store_write_policy=write_policy,
    )


@pytest.mark.parametrize("write_policy", WRITE_POLICIES)
def test_hand_trace_device_2_host_2_store_4(write_policy):
    # radix-lru, device 2 blocks, host 2, store 4 (room for all of A and B):
    # A miss. B evicts A to the host (write_through: and puts A). C evicts B to the host,
    # which evicts A (write_back: puts A; write_through: B was put at its backup).
    # A: neither the device nor the host has it, the store does: its run is read into
    # the host (evicting B from it: write_back puts B) and loaded to the device, whose
    # eviction of C finds no host room (the host's two blocks hold the loading run):
    # C is lost. C: a miss, recomputed; A leaves the device for its host copy.
    # B: in the store: read into the host (evicting A: write_back puts it again, a
    # touch), loaded to the device (C lost again).
    r = hand(4, write_policy)
    assert r.hit_blocks.tolist() == [0] * 6
    assert r.host_hit_blocks.tolist() == [0] * 6
    assert r.store_hit_blocks.tolist() == [0, 0, 0, 2, 0, 2]
    assert r.store_hit_tokens.tolist() == [0, 0, 0, 924, 0, 924]  # capped at input_length
    assert r.recompute_tokens.tolist() == [924, 924, 924, 0, 924, 0]
    assert (r.block_hits, r.host_block_hits, r.store_block_hits, r.block_misses) == (0, 0, 4, 8)
    s, t, c = r.cache_stats, r.store_stats, r.store_counts
    assert (s.backed_up_blocks, s.skipped_backup_blocks, s.loaded_blocks) == (4, 4, 4)
    assert (t.found_blocks, t.loaded_blocks, t.load_misses, t.stored_blocks) == (4, 4, 0, 4)
    # write_back offers A, B, then A again (already stored); write_through A and B once
    assert t.put_blocks == (6 if write_policy == "write_back" else 4)
    assert (c.num_entries, c.evicted, c.used_bytes) == (4, 0, 4 * STORE_ENTRY_BYTES)
    assert r.combined_hit_rate == 2 * 924 / sum(HAND_LENGTHS)
    d = r.to_dict()
    assert (d["store_capacity_blocks"], d["store_capacity_bytes"]) == (4, 4 * STORE_ENTRY_BYTES)
    assert (d["store_block_hits"], d["store_loaded_blocks"], d["final_store_blocks"]) == (4, 4, 4)
    # the two-tier replay keeps C on the host (it drops A and B instead)
    two = replay(reqs(HAND, 512, HAND_LENGTHS), "radix-lru", 2, host_capacity=2)
    assert two.host_hit_blocks.tolist() == [0, 0, 0, 0, 2, 0]


def test_hand_trace_store_of_one_node_write_back():
    # store 2 (room for one node's two blocks), write_back: B evicts A to the host; C evicts
    # B to the host, which evicts A from it: A is put in the store. A: the store has it; its
    # run is read first (bytes in hand), then the host makes room by evicting B, whose
    # write-back evicts A from the full store (store: B), which no longer matters: A fills
    # the host and loads to the device (a store hit of 2), whose eviction of C finds no host
    # room (A holds it while loading): C is lost. C: a miss; A leaves the device for its
    # host copy. B: the store has it: read, the host evicts A (put again, evicting B from
    # the store: store A), B fills the host and loads (a store hit of 2; C lost again).
    r = hand(2)
    assert r.host_hit_blocks.tolist() == [0] * 6
    assert r.store_hit_blocks.tolist() == [0, 0, 0, 2, 0, 2]
    s, t, c = r.cache_stats, r.store_stats, r.store_counts
    assert (t.found_blocks, t.loaded_blocks, t.load_misses, t.unfilled_blocks) == (4, 4, 0, 0)
    assert (t.put_blocks, t.stored_blocks) == (6, 6)  # A, B, A: each evicted in between
    assert (c.num_entries, c.evicted) == (2, 4)  # A's blocks; B's went at B's load
    assert (s.backed_up_blocks, s.skipped_backup_blocks) == (4, 4)  # C, twice


def test_hand_trace_store_of_one_node_write_through():
    # write_through puts each backup at once: A (at B), B (at C, evicting A from the store),
    # then C at A's recompute (evicting B). The store never has what is asked of it.
    r = hand(2, "write_through")
    assert r.host_hit_blocks.tolist() == [0, 0, 0, 0, 2, 0]
    assert not r.store_hit_blocks.any()
    assert r.store_stats.found_blocks == 0 and r.store_counts.evicted == 4


def test_an_infinite_store_can_lose_a_node_the_host_would_have_kept():
    seqs = [[1], [3, 4], [5, 6], [1], [5, 6]]
    two = replay(reqs(seqs), "radix-lru", 2, host_capacity=2)
    assert served(two).tolist() == [0, 0, 0, 0, 2]
    for policy in WRITE_POLICIES:
        three = replay(
            reqs(seqs),
            "radix-lru",
            2,
            host_capacity=2,
            store_capacity=100,
            store_write_policy=policy,
        )
        # [1] comes from the store into the host (which drops [3 4] to the store for it);
        # the device evicts [5 6] to load it, but the host's one free block cannot take
        # [5 6]: it is not backed up, and lost. The two-tier replay recomputes [1] and
        # keeps [5 6] on the host.
        assert served(three).tolist() == [0, 0, 0, 1, 0]
        assert three.cache_stats.skipped_backup_blocks == 2


# ----------------------------------------------------------------------------- properties
@given(
    seqs=random_requests(),
    capacity=st.integers(1, 12),
    host=st.integers(1, 16),
    policy=st.sampled_from(RADIX_POLICIES),
)
def test_store_capacity_zero_is_the_two_tier_replay(seqs, capacity, host, policy):
    two = replay(reqs(seqs), policy, capacity, host_capacity=host)
    zero = replay(reqs(seqs), policy, capacity, host_capacity=host, store_capacity=0)
    assert zero.to_dict(per_request=True) == two.to_dict(per_request=True)
    assert "store_capacity_blocks" not in zero.to_dict() and zero.store_stats is None


@given(
    seqs=random_requests(),
    extra=st.integers(0, 4),
    host=st.integers(1, 24),
    policy=st.sampled_from(RADIX_POLICIES),
    write_policy=st.sampled_from(WRITE_POLICIES),
)
def test_an_infinite_store_never_serves_less_than_none(seqs, extra, host, policy, write_policy):
    # Device >= the longest request, a store that holds every id: a block leaves the tree
    # only for the store (write_back: as the host drops it; write_through: it is there
    # since its backup), unless a device eviction skips its backup. Without a skipped
    # backup nothing is ever lost: each request is served its longest previously seen
    # prefix, so at least what the two-tier replay serves it, request by request.
    longest = max([1, *map(len, seqs)])
    capacity = longest + extra
    host = max(host, longest)
    two = replay(reqs(seqs), policy, capacity, host_capacity=host)
    requests = reqs(seqs)
    three = replay(
        requests,
        policy,
        capacity,
        host_capacity=host,
        store_capacity=max(1, sum(map(len, seqs))),
        store_write_policy=write_policy,
    )
    if host >= 2 * longest:  # room for a backup beside any loading run
        assert three.cache_stats.skipped_backup_blocks == 0
    if three.cache_stats.skipped_backup_blocks == 0:
        assert served(three).tolist() == seen_prefixes(seqs)
        assert (served(three) >= served(two)).all()
        assert three.combined_hit_rate >= two.combined_hit_rate


@given(
    seqs=random_requests(),
    capacity=st.integers(1, 12),
    host=st.integers(1, 16),
    store=st.integers(1, 24),
    policy=st.sampled_from(RADIX_POLICIES),
    write_policy=st.sampled_from(WRITE_POLICIES),
)
def test_three_tier_figures_partition_the_served_prefix(
    seqs, capacity, host, store, policy, write_policy
):
    requests = reqs(seqs, 4, [max(0, 4 * len(s) - 1) for s in seqs])
    r = replay(
        requests,
        policy,
        capacity,
        block_size=4,
        host_capacity=host,
        store_capacity=store,
        store_write_policy=write_policy,
    )
    num_ids = sum(map(len, seqs))
    assert r.block_hits + r.host_block_hits + r.store_block_hits + r.block_misses == num_ids
    assert r.store_block_hits == int(r.store_hit_blocks.sum())
    assert r.cache_stats.loaded_blocks == r.host_block_hits + r.store_block_hits
    assert (served(r) <= seen_prefixes(seqs)).all()
    lengths = r.prompt_tokens
    whole = np.minimum(served(r) * 4, lengths)
    assert (r.hit_tokens + r.host_hit_tokens + r.store_hit_tokens == whole).all()
    assert (r.store_hit_tokens >= 0).all() and (r.recompute_tokens >= 0).all()
    t, c = r.store_stats, r.store_counts
    assert t.loaded_blocks >= r.store_block_hits and t.errors == 0 and t.corrupt_blocks == 0
    assert c.num_entries <= store and c.used_bytes == c.num_entries * STORE_ENTRY_BYTES
    distinct = {tuple(q[: j + 1]) for q in seqs for j in range(len(q))}
    assert c.num_entries <= len(distinct)  # one entry per distinct prefix, at most
    d = r.to_dict(per_request=True)
    assert json.loads(json.dumps(d)) == d
    assert d["total_store_hit_tokens"] == sum(p["store_hit_tokens"] for p in d["per_request"])
    total = d["overall_hit_rate"] + d["host_hit_rate"] + d["store_hit_rate"]
    assert d["combined_hit_rate"] == pytest.approx(total)


@given(
    seqs=random_requests(),
    capacity=st.integers(1, 12),
    host=st.integers(1, 16),
    store=st.integers(1, 24),
    policy=st.sampled_from(RADIX_POLICIES),
)
def test_step_by_step_pools_and_tree_stay_whole(seqs, capacity, host, store, policy):
    replayer = RadixReplayer(policy, capacity, host, store)
    cache = replayer.cache
    for seq, seen in zip(seqs, seen_prefixes(seqs), strict=True):
        arr = np.asarray(seq, dtype=np.int32)
        resident = cache.peek(arr)
        device, host_hit, store_hit = replayer.step_store(arr)  # checks every served id
        assert device == resident and device + host_hit + store_hit <= seen
        cache.check()
        replayer.store.check()
    assert replayer.step_tiers(np.asarray([7, 8], dtype=np.int32))[0] >= 0


def test_a_load_that_brings_back_the_wrong_block_is_an_invariant_error():
    replayer = RadixReplayer("radix-lru", 2, 2, 8)
    for seq in ([1, 2], [3, 4]):  # [1 2] is now on the host alone
        replayer.step_store(np.asarray(seq, dtype=np.int32))
    assert sorted(replayer._pools.host.tolist()) == [1, 2]
    replayer._pools.host[:] = 9  # the host's copy is not [1 2] any more
    with pytest.raises(InvariantError, match="holds another position's id"):
        replayer.step_store(np.asarray([1, 2], dtype=np.int32))


@pytest.mark.skipif(not CONVERSATION.exists(), reason="Mooncake traces not found")
def test_real_trace_an_infinite_store_serves_every_seen_prefix():
    trace = load_trace(CONVERSATION)[:300]
    seqs = [trace.request_ids(i).tolist() for i in range(trace.num_requests)]
    longest = max(map(len, seqs))  # 235 blocks: device 256, host 512 >= twice that
    two = replay(trace, "radix-lru", 256, host_capacity=512)
    three = replay(trace, "radix-lru", 256, host_capacity=512, store_capacity=trace.num_accesses)
    assert 256 >= longest and 512 >= 2 * longest
    assert served(three).tolist() == seen_prefixes(seqs)
    assert three.store_block_hits > 0 and three.combined_hit_rate > two.combined_hit_rate
    num = three.block_hits + three.host_block_hits + three.store_block_hits + three.block_misses
    assert num == trace.num_accesses


# ----------------------------------------------------------------------------- errors
def test_bad_store_arguments_name_the_argument():
    requests = reqs([[1, 2]])
    with pytest.raises(
        ValueError,
        match="store_capacity needs a host tier \\(the store sits below it\\), got "
        "store_capacity=4 with host_capacity=0",
    ):
        replay(requests, "radix-lru", 8, store_capacity=4)
    with pytest.raises(ValueError, match="store_capacity must be an int in \\[0, .*\\], got -1"):
        replay(requests, "radix-lru", 8, host_capacity=2, store_capacity=-1)
    with pytest.raises(ValueError, match="store_capacity must be an int in .*, got 2147483648"):
        ReplayConfig("radix-lru", 8, host_capacity=2, store_capacity=2**31)
    with pytest.raises(
        ValueError,
        match="store_write_policy must be one of write_back, write_through, got 'lazy'",
    ):
        replay(
            requests, "radix-lru", 8, host_capacity=2, store_capacity=2, store_write_policy="lazy"
        )
    with pytest.raises(ValueError, match="store_capacity needs a host tier"):
        RadixReplayer("radix-lru", 8, 0, 4)
    with pytest.raises(ValueError, match="host_capacity is for the radix-\\* policies only"):
        replay(requests, "lru", 8, host_capacity=2, store_capacity=2)


def test_the_cost_model_refuses_a_store_it_cannot_price():
    model = TierCostModel()
    with pytest.raises(
        ValueError, match="device and a host tier only, got a result with store_capacity=4"
    ):
        model.tokens_saved(hand(4))
    assert model.seconds(replay(reqs(HAND, 512, HAND_LENGTHS), "radix-lru", 2, host_capacity=2))


def test_the_largest_store_capacity_reserves_nothing():
    # 2**31 - 1 blocks is ~146 GB of entries: the store's capacity is a count, not memory.
    r = hand(2**31 - 1)
    assert r.store_hit_blocks.tolist() == [0, 0, 0, 2, 0, 2]
    assert r.to_dict()["store_capacity_bytes"] == (2**31 - 1) * STORE_ENTRY_BYTES


# ----------------------------------------------------------------------------- CLI
@pytest.fixture
def hand_trace(tmp_path):
    path = tmp_path / "hand.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in reqs(HAND, 512, HAND_LENGTHS)))
    return path


def run_cli(capsys, *argv):
    try:
        code = main([str(a) for a in argv])
    except SystemExit as exc:  # argparse's own usage errors
        code = exc.code
    out, err = capsys.readouterr()
    return code, out, err


@pytest.mark.parametrize("write_policy", WRITE_POLICIES)
def test_cli_store_capacity(capsys, hand_trace, write_policy):
    argv = ["replay", hand_trace, "--policy", "radix-lru", "--capacity", 2, "--host-capacity", 2]
    store = ["--store-capacity", 4, "--store-write-policy", write_policy]
    code, out, err = run_cli(capsys, *argv, *store, "--per-request")
    assert code == 0 and err == ""
    d = json.loads(out)
    expected = replay(
        load_trace(hand_trace),
        "radix-lru",
        2,
        host_capacity=2,
        store_capacity=4,
        store_write_policy=write_policy,
    )
    assert d == expected.to_dict(per_request=True)
    store_keys = [k for k in d if k.startswith(("store_", "total_store", "final_store"))]
    assert store_keys == [
        "store_capacity_blocks",
        "store_capacity_bytes",
        "store_write_policy",
        "total_store_hit_tokens",
        "store_hit_rate",
        "store_block_hits",
        "store_lookups",
        "store_found_blocks",
        "store_loaded_blocks",
        "store_put_blocks",
        "store_stored_blocks",
        "store_evicted_blocks",
        "final_store_blocks",
    ]
    assert d["store_write_policy"] == write_policy and d["store_block_hits"] == 4
    assert [p["store_hit_tokens"] for p in d["per_request"]] == [0, 0, 0, 924, 0, 924]
    # --store-capacity 0 prints exactly the two-tier object
    _, plain, _ = run_cli(capsys, *argv)
    _, zero, _ = run_cli(capsys, *argv, "--store-capacity", 0)
    assert json.loads(zero) == json.loads(plain) and "store_capacity_blocks" not in plain


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--store-capacity", "-1"], "argument --store-capacity: must be >= 0, got -1"),
        (["--store-capacity", "2147483648"], "argument --store-capacity: must be <= 2147483647"),
        (["--store-capacity", "x"], "--store-capacity: expected an integer, got 'x'"),
        (
            ["--store-capacity", "8"],
            "--store-capacity needs a host tier (the store sits below it), got "
            "--store-capacity=8 with --host-capacity=0",
        ),
        (
            ["--host-capacity", "2", "--store-capacity", "8", "--store-write-policy", "lazy"],
            "argument --store-write-policy: invalid choice: 'lazy'",
        ),
    ],
)
def test_cli_bad_store_arguments_exit_2_with_one_line(capsys, hand_trace, args, message):
    code, out, err = run_cli(
        capsys, "replay", hand_trace, "--policy", "radix-lru", "--capacity", 2, *args
    )
    assert code == 2 and out == ""
    assert err.count("\n") == 1 and err.startswith("radixkv replay: error: ")
    assert message in err


def test_cli_sweep_store_axis(capsys, hand_trace, tmp_path):
    csv_path = tmp_path / "out.csv"
    code, out, err = run_cli(
        capsys,
        "sweep",
        hand_trace,
        "--policies",
        "radix-lru,lru",
        "--capacities",
        "2",
        "--host-capacities",
        "0,2",
        "--store-capacities",
        "0",
        "4",
        "--csv",
        csv_path,
        "--no-progress",
    )
    assert code == 0 and err == ""
    with open(csv_path) as f:
        rows = list(csv.DictReader(f))
    # radix-lru at every (host, store) but a store without a host; lru has no lower tiers
    assert [(r["policy"], int(r["host_capacity"]), int(r["store_capacity"])) for r in rows] == [
        ("radix-lru", 0, 0),
        ("radix-lru", 2, 0),
        ("radix-lru", 2, 4),
        ("lru", 0, 0),
        ("infinite", 0, 0),
    ]
    trace = load_trace(hand_trace)
    for r in rows[:3]:
        h, s = int(r["host_capacity"]), int(r["store_capacity"])
        expected = replay(trace, "radix-lru", 2, host_capacity=h, store_capacity=s)
        assert float(r["combined_hit_rate"]) == expected.combined_hit_rate
        assert int(r["total_store_hit_tokens"]) == expected.total_store_hit_tokens
        assert int(r["total_host_hit_tokens"]) == expected.total_host_hit_tokens
    assert int(rows[2]["total_store_hit_tokens"]) == 2 * 924
    back = read_csv(csv_path)
    assert [(b.host_capacity, b.store_capacity) for b in back][:3] == [(0, 0), (2, 0), (2, 4)]
    assert csv_path.with_suffix(".png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert "radix-lru" in out


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--store-capacities", "4"], "--store-capacities needs a host capacity above 0"),
        (
            ["--host-capacities", "2", "--store-capacities", "4,-1"],
            "--store-capacities: must be >= 0",
        ),
        (["--host-capacities", "x"], "--host-capacities: expected an integer, got 'x'"),
        (["--policies", "lru", "--host-capacities", "2"], None),  # flat: no lower tiers, runs
    ],
)
def test_cli_sweep_bad_store_axis_runs_nothing(capsys, hand_trace, tmp_path, args, message):
    csv_path = tmp_path / "out.csv"
    code, out, err = run_cli(
        capsys, "sweep", hand_trace, "--capacities", "2", *args, "--csv", csv_path, "--no-progress"
    )
    if message is None:
        assert code == 0 and csv_path.exists()
        return
    assert code == 2 and out == "" and err.count("\n") == 1 and message in err
    assert not csv_path.exists()
