"""Two-tier replay (``replay(..., host_capacity=N)``, ``radixkv replay --host-capacity``).

What must hold, whatever the eviction order:

- ``host_capacity=0`` is the one-tier replay, and a host tier that is never needed (the
  device never evicts) changes nothing;
- with a device that fits every request and a host that fits every block, nothing is ever
  lost, so every request is served (device + host) exactly its longest previously seen
  prefix: the infinite cache's hit;
- at any capacities: the device hit is the device-resident prefix at arrival (``peek``),
  device + host hits never exceed the longest previously seen prefix, accesses are
  conserved (device hits + host hits + misses = ids), pools never overflow, the tree's
  invariants hold after every request, and a request that fits is cached whole;
- a hand trace with hand-derived figures, the cost model's arithmetic, the CLI, and the
  errors naming the argument.

(Device + host is *not* always at least the one-tier hit at the same device capacity,
request by request: host-only nodes keep their split points and hit counts, which changes
which leaves the device evicts.)
"""

from __future__ import annotations

import json

import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st
from replay_reference import check_sanity, random_requests, reqs
from trace_paths import TRACES

from radixkv.cli import main
from radixkv.replay import RADIX_POLICIES, TierCostModel, Trace, load_trace, replay
from radixkv.replay.cost import DEFAULT_RELOAD_S_PER_TOKEN, KV_BYTES_PER_TOKEN
from radixkv.replay.radix_policy import RadixReplayer, radix_replay, radix_replay_tiers

CONVERSATION = TRACES / "conversation_trace.jsonl"
needs_traces = pytest.mark.skipif(not CONVERSATION.exists(), reason="Mooncake traces not found")


def seen_prefixes(seqs: list[list[int]]) -> list[int]:
    """Per request, its longest prefix that is a prefix of some earlier request (brute force)."""
    prefixes: set[tuple[int, ...]] = set()
    out = []
    for seq in seqs:
        k = 0
        while k < len(seq) and tuple(seq[: k + 1]) in prefixes:
            k += 1
        out.append(k)
        prefixes.update(tuple(seq[:j]) for j in range(1, len(seq) + 1))
    return out


def first_requests(n: int) -> Trace:
    return load_trace(CONVERSATION)[:n]


# ----------------------------------------------------------------------------- hand trace
HAND = [[1, 2], [3, 4], [1, 2], [3, 4, 5], [1, 2]]


def hand_requests():
    return reqs(HAND, 512, [len(s) * 512 - 100 for s in HAND])


def test_hand_trace_device_2_host_4():
    # lru, device 2 blocks, host 4:
    # [1 2] miss; [3 4] evicts [1 2] to the host; [1 2] loads it back (evicting [3 4] to the
    # host; the copy of [1 2] stays, a mirror); [3 4 5] loads [3 4], but 5 does not fit
    # (the request holds both device blocks); [1 2] loads again. Backups: [1 2], [3 4] once each.
    r = replay(hand_requests(), "radix-lru", 2, host_capacity=4)
    assert r.hit_blocks.tolist() == [0, 0, 0, 0, 0]
    assert r.host_hit_blocks.tolist() == [0, 0, 2, 2, 2]
    assert r.host_hit_tokens.tolist() == [0, 0, 924, 1024, 924]  # capped at input_length
    assert r.recompute_tokens.tolist() == [924, 924, 0, 412, 0]
    assert (r.block_hits, r.host_block_hits, r.block_misses) == (0, 6, 5)
    assert (r.final_cache_blocks, r.final_host_blocks) == (2, 4)
    s = r.cache_stats
    assert (s.loaded_blocks, s.backed_up_blocks, s.host_evicted_blocks) == (6, 4, 0)
    assert r.combined_hit_rate == (924 + 1024 + 924) / sum(len(x) * 512 - 100 for x in HAND)
    one = replay(hand_requests(), "radix-lru", 2)
    assert one.hit_blocks.tolist() == [0, 0, 0, 0, 0]


def test_hand_trace_cost_model():
    r = replay(hand_requests(), "radix-lru", 2, host_capacity=4)
    model = TierCostModel(prefill_s_per_token=1.0, reload_s_per_token=0.25)
    # recompute [924, 924, 0, 412, 0]; reloads are whole blocks: 2 * 512 tokens for 3 requests
    expected = [924.0, 924.0, 256.0, 412.0 + 256.0, 256.0]
    assert model.request_seconds(r).tolist() == expected
    assert model.seconds(r) == sum(expected)
    prompts = sum(len(x) * 512 - 100 for x in HAND)
    assert model.no_cache_seconds(r) == prompts
    assert model.tokens_saved(r) == prompts - sum(expected)
    assert model.tokens_saved(r) == r.total_hit_tokens + r.total_host_hit_tokens - 0.25 * 6 * 512


def test_cost_model_defaults_and_errors():
    assert KV_BYTES_PER_TOKEN == 2 * 30 * 3 * 64 * 4 == 46080
    model = TierCostModel()
    assert model.reload_s_per_token == DEFAULT_RELOAD_S_PER_TOKEN == 46080 / 6.4e9
    assert TierCostModel.from_bandwidth() == model
    assert 0 < model.ratio < 0.01
    with pytest.raises(ValueError, match="prefill_s_per_token must be a positive number, got 0"):
        TierCostModel(prefill_s_per_token=0)
    with pytest.raises(
        ValueError, match="reload_s_per_token must be a non-negative number, got -1"
    ):
        TierCostModel(reload_s_per_token=-1)
    with pytest.raises(
        ValueError, match="reload_s_per_token must be a non-negative number, got nan"
    ):
        TierCostModel(reload_s_per_token=float("nan"))
    with pytest.raises(ValueError, match="gbps must be a positive number, got 0"):
        TierCostModel.from_bandwidth(gbps=0)
    with pytest.raises(ValueError, match="kv_bytes_per_token must be a positive int, got 0"):
        TierCostModel.from_bandwidth(kv_bytes_per_token=0)


# ----------------------------------------------------------------------------- equivalences
@given(seqs=random_requests(), capacity=st.integers(1, 40), policy=st.sampled_from(RADIX_POLICIES))
def test_host_capacity_zero_is_the_one_tier_replay(seqs, capacity, policy):
    one = replay(reqs(seqs), policy, capacity)
    zero = replay(reqs(seqs), policy, capacity, host_capacity=0)
    assert zero.hit_blocks.tolist() == one.hit_blocks.tolist()
    assert zero.to_dict(per_request=True) == one.to_dict(per_request=True)
    assert not zero.host_hit_blocks.any() and zero.final_host_blocks == 0
    hit_blocks, block_hits, final, unreachable = radix_replay(
        Trace.from_requests(reqs(seqs)), policy, capacity
    )
    assert hit_blocks.tolist() == one.hit_blocks.tolist()
    assert (block_hits, final, unreachable) == (one.block_hits, one.final_cache_blocks, 0)


@given(seqs=random_requests(), host=st.integers(1, 50), policy=st.sampled_from(RADIX_POLICIES))
def test_a_host_tier_the_device_never_needs_changes_nothing(seqs, host, policy):
    # The device holds every id of the trace: nothing is evicted, so nothing reaches the
    # host, and the tiered match and insert must give the one-tier figures.
    capacity = max(1, sum(map(len, seqs)))
    one = replay(reqs(seqs), policy, capacity)
    two = replay(reqs(seqs), policy, capacity, host_capacity=host)
    assert two.hit_blocks.tolist() == one.hit_blocks.tolist()
    assert not two.host_hit_blocks.any()
    assert two.final_cache_blocks == one.final_cache_blocks and two.final_host_blocks == 0
    assert two.cache_stats.backed_up_blocks == 0


@given(
    seqs=random_requests(),
    extra=st.integers(0, 5),
    policy=st.sampled_from(RADIX_POLICIES),
)
def test_a_big_host_serves_every_previously_seen_prefix(seqs, extra, policy):
    # Device >= the longest request (every request is cached whole), host >= every id (no
    # copy is ever dropped): the two tiers together never lose a prefix, so device + host
    # hit is exactly the infinite cache's, request by request, whatever the order.
    capacity = max([1, *map(len, seqs)]) + extra
    host = max(1, sum(map(len, seqs)))
    r = replay(reqs(seqs), policy, capacity, host_capacity=host)
    assert (r.hit_blocks + r.host_hit_blocks).tolist() == seen_prefixes(seqs)
    assert r.cache_stats.skipped_backup_blocks == 0
    assert r.cache_stats.host_evicted_blocks == 0


@given(
    seqs=random_requests(),
    capacity=st.integers(1, 12),
    host=st.integers(1, 16),
    policy=st.sampled_from(RADIX_POLICIES),
)
def test_step_by_step_invariants(seqs, capacity, host, policy):
    replayer = RadixReplayer(policy, capacity, host)
    cache, alloc, halloc = replayer.cache, replayer.alloc, replayer.host_alloc
    for seq, seen in zip(seqs, seen_prefixes(seqs), strict=True):
        arr = np.asarray(seq, dtype=np.int32)
        resident = cache.peek(arr)
        device, loaded = replayer.step_tiers(arr)
        assert device == resident, "the device hit is not the device-resident prefix"
        assert device + loaded <= seen, "a hit on a prefix no earlier request had"
        if len(seq) <= capacity:
            assert cache.peek(arr) == len(seq), "the request fits but was not cached whole"
        assert alloc.num_free + cache.cached_blocks == capacity, "a device block leaked"
        assert halloc.num_free + cache.host_cached_blocks == host, "a host block leaked"
        cache.check()
    assert cache.stats.loaded_blocks == replayer.copier.loaded


@given(
    seqs=random_requests(),
    capacity=st.integers(1, 12),
    host=st.integers(1, 16),
    policy=st.sampled_from(RADIX_POLICIES),
)
def test_result_figures_add_up(seqs, capacity, host, policy):
    requests = reqs(seqs, 4, [max(0, 4 * len(s) - 1) for s in seqs])
    r = replay(requests, policy, capacity, block_size=4, host_capacity=host)
    num_ids = sum(map(len, seqs))
    assert r.block_hits + r.host_block_hits + r.block_misses == num_ids
    assert r.host_block_hits == int(r.host_hit_blocks.sum()) == r.cache_stats.loaded_blocks
    assert (r.hit_blocks + r.host_hit_blocks <= [len(s) for s in seqs]).all()
    assert r.final_cache_blocks <= capacity and r.final_host_blocks <= host
    assert r.unreachable_blocks == 0 and r.orphan_blocks == 0
    lengths = r.prompt_tokens
    both = np.minimum((r.hit_blocks + r.host_hit_blocks) * 4, lengths)
    assert (r.host_hit_tokens == both - r.hit_tokens).all() and (r.host_hit_tokens >= 0).all()
    assert (r.recompute_tokens >= 0).all()
    d = r.to_dict(per_request=True)
    assert json.loads(json.dumps(d)) == d
    assert d["total_host_hit_tokens"] == sum(p["host_hit_tokens"] for p in d["per_request"])
    assert d["combined_hit_rate"] == pytest.approx(d["overall_hit_rate"] + d["host_hit_rate"])


def test_flat_results_carry_zero_host_figures():
    requests = reqs([[1, 2], [1, 2, 3]])
    r = replay(requests, "lru", 4)
    check_sanity(requests, r)
    assert r.host_hit_blocks.tolist() == r.host_hit_tokens.tolist() == [0, 0]
    assert r.cache_stats is None and r.combined_hit_rate == r.overall_hit_rate
    assert "host_capacity_blocks" not in r.to_dict()


# ----------------------------------------------------------------------------- real trace
@needs_traces
@pytest.mark.parametrize("policy", ["radix-lru", "radix-deep"])
def test_real_trace_prefix_with_a_big_host(policy):
    trace = first_requests(300)
    seqs = [trace.request_ids(i).tolist() for i in range(trace.num_requests)]
    longest = max(map(len, seqs))
    t = radix_replay_tiers(trace, policy, longest, trace.num_accesses)
    assert (t.hit_blocks + t.host_hit_blocks).tolist() == seen_prefixes(seqs)
    assert t.host_hit_blocks.sum() > 0  # the device alone is too small: the host served some


@needs_traces
def test_real_trace_prefix_small_tiers():
    trace = first_requests(300)
    seqs = [trace.request_ids(i).tolist() for i in range(trace.num_requests)]
    r = replay(trace, "radix-lru", 512, host_capacity=4096)
    assert r.block_hits + r.host_block_hits + r.block_misses == trace.num_accesses
    assert ((r.hit_blocks + r.host_hit_blocks) <= seen_prefixes(seqs)).all()
    assert r.host_block_hits > 0 and r.final_host_blocks <= 4096
    assert r.combined_hit_rate > replay(trace, "radix-lru", 512).overall_hit_rate


# ----------------------------------------------------------------------------- errors
def test_bad_host_capacity_names_the_argument():
    requests = reqs([[1, 2]])
    with pytest.raises(
        ValueError,
        match="host_capacity is for the radix-\\* policies only, "
        "got host_capacity=4 with policy 'lru'",
    ):
        replay(requests, "lru", 8, host_capacity=4)
    with pytest.raises(ValueError, match="host_capacity must be an int in \\[0, .*\\], got -1"):
        replay(requests, "radix-lru", 8, host_capacity=-1)
    with pytest.raises(TypeError, match="host_capacity must be an int in \\[0, .*\\], got 1.5"):
        replay(requests, "radix-lru", 8, host_capacity=1.5)
    with pytest.raises(ValueError, match="host_capacity must be a non-negative int, got -2"):
        RadixReplayer("radix-lru", 8, -2)
    with pytest.raises(TypeError, match="host_capacity must be a non-negative int, got '4'"):
        RadixReplayer("radix-lru", 8, "4")
    assert replay(requests, "s3fifo", 20, host_capacity=0).host_block_hits == 0


# ----------------------------------------------------------------------------- CLI
@pytest.fixture
def hand_trace(tmp_path):
    path = tmp_path / "hand.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in hand_requests()))
    return path


def run_cli(capsys, *argv):
    try:
        code = main([str(a) for a in argv])
    except SystemExit as exc:  # argparse's own usage errors
        code = exc.code
    out, err = capsys.readouterr()
    return code, out, err


def test_cli_host_capacity(capsys, hand_trace):
    argv = ["replay", hand_trace, "--policy", "radix-lru", "--capacity", 2]
    code, out, err = run_cli(capsys, *argv, "--host-capacity", 4, "--per-request")
    assert code == 0 and err == ""
    d = json.loads(out)
    assert d == replay(load_trace(hand_trace), "radix-lru", 2, host_capacity=4).to_dict(True)
    assert d["host_capacity_blocks"] == 4 and d["host_block_hits"] == 6
    assert d["total_host_hit_tokens"] == 924 + 1024 + 924
    assert [p["host_hit_tokens"] for p in d["per_request"]] == [0, 0, 924, 1024, 924]
    assert (d["backed_up_blocks"], d["host_evicted_blocks"], d["skipped_backup_blocks"]) == (
        4,
        0,
        0,
    )
    # --host-capacity 0 prints exactly the one-tier object
    _, plain, _ = run_cli(capsys, *argv)
    _, zero, _ = run_cli(capsys, *argv, "--host-capacity", 0)
    assert json.loads(zero) == json.loads(plain) and "host_capacity_blocks" not in plain


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--policy", "radix-lru", "--host-capacity", "-1"], "--host-capacity: must be >= 0"),
        (["--policy", "radix-lru", "--host-capacity", "x"], "--host-capacity: expected an integer"),
        (
            ["--policy", "lru", "--host-capacity", "4"],
            "--host-capacity is for the radix-* policies only, got --host-capacity=4 with "
            "policy 'lru'",
        ),
    ],
)
def test_cli_bad_host_capacity_exits_2_with_one_line(capsys, hand_trace, args, message):
    code, out, err = run_cli(capsys, "replay", hand_trace, "--capacity", 2, *args)
    assert code == 2 and out == ""
    assert err.count("\n") == 1 and err.startswith("radixkv replay: error: ")
    assert message in err
