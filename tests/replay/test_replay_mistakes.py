"""One test per "common mistake" of the replay seed (plus LFU's rules): each shows the mistake
would be caught.

``s3fifo_variant`` is the plain S3FIFO with a switch that commits exactly one mistake. For
each mistake, on a trace derived by hand (the derivations are in test_replay.py), the
correct variant and ``replay`` give the hand answer and the mistaken variant does not; on a
real trace (see ``REAL_CASE``) the mistaken variant's totals differ from ``replay``'s.
"""

from __future__ import annotations

from collections import OrderedDict, deque

import pytest
from trace_paths import FULL_TRACES, TRACES

from radixkv.replay import load_trace, replay
from radixkv.replay.reference import lru_reference, prefix_len

S3FIFO_MISTAKES = (
    "lru_instead_of_s3fifo",
    "no_min_cap",
    "ghost_counts_as_resident",
    "no_freq_saturation",
    "main_plain_fifo",
    "requeue_at_head",
    "set_intersection",
    "freq_only_on_prefix",
    "final_includes_ghost",
    "reset_freq_on_promotion",
    "int_small_cap",
    "ghost_cap_small",
)


def s3fifo_variant(
    seqs, input_lengths, capacity, small_ratio=0.1, max_freq=3, block_size=1, mistake=None
):
    """``(hit_tokens per request, final_cache_blocks)``, committing ``mistake`` if given."""
    assert mistake is None or mistake in S3FIFO_MISTAKES
    if mistake == "lru_instead_of_s3fifo":
        ks, _, resident = lru_reference(seqs, capacity)
        return [min(k * block_size, n) for k, n in zip(ks, input_lengths, strict=True)], len(
            resident
        )
    if mistake == "int_small_cap":
        small_cap = int(capacity * small_ratio)
    else:
        small_cap = round(capacity * small_ratio)
    main_cap = capacity - small_cap
    ghost_cap = small_cap if mistake == "ghost_cap_small" else main_cap
    small: deque[int] = deque()
    main: deque[int] = deque()
    ghost: OrderedDict[int, None] = OrderedDict()
    freq: dict[int, int] = {}

    def to_ghost(h):
        if h in ghost:
            del ghost[h]
        elif len(ghost) >= ghost_cap:
            ghost.popitem(last=False)
        ghost[h] = None

    def admit_to_main(h, f):
        while len(main) >= main_cap:
            v = main.popleft()
            if freq[v] >= 1 and mistake != "main_plain_fifo":
                freq[v] -= 1
                if mistake == "requeue_at_head":
                    main.appendleft(v)
                else:
                    main.append(v)
            else:
                del freq[v]
                to_ghost(v)
                break
        main.append(h)
        freq[h] = f

    def admit_to_small(h):
        while len(small) >= small_cap:
            v = small.popleft()
            vf = freq[v]
            if vf >= 1:
                admit_to_main(v, 0 if mistake == "reset_freq_on_promotion" else vf)
            else:
                del freq[v]
                to_ghost(v)
        small.append(h)
        freq[h] = 0

    out = []
    for ids, length in zip(seqs, input_lengths, strict=True):
        if mistake == "ghost_counts_as_resident":
            k = prefix_len(ids, lambda h: h in freq or h in ghost)
        elif mistake == "set_intersection":
            k = len(set(ids) & set(freq))
        else:
            k = prefix_len(ids, freq.__contains__)
        out.append(k * block_size if mistake == "no_min_cap" else min(k * block_size, length))
        for j, h in enumerate(ids):
            if h in freq:
                if mistake == "freq_only_on_prefix" and j >= k:
                    continue
                if mistake == "no_freq_saturation":
                    freq[h] += 1
                else:
                    freq[h] = min(freq[h] + 1, max_freq)
            elif h in ghost:
                del ghost[h]
                admit_to_main(h, 0)
            else:
                admit_to_small(h)
    final = len(freq) + (len(ghost) if mistake == "final_includes_ghost" else 0)
    return out, final


A, B, C, D, X, Y = 1, 2, 3, 4, 6, 7
SECOND_CHANCE = dict(
    seqs=[[A], [A], [B], [C], [B], [D], [C], [A]],
    capacity=3,
    small_ratio=0.3,
    hits=[0, 1, 0, 0, 0, 0, 0, 1],
)
# mistake -> hand-derived case: seqs, capacity, parameters, expected hit tokens (and final)
CASES = {
    "lru_instead_of_s3fifo": dict(
        seqs=[[A], [B], [A]], capacity=2, small_ratio=0.5, hits=[0, 0, 0]
    ),
    "no_min_cap": dict(
        seqs=[[1, 2], [1, 2]],
        capacity=4,
        small_ratio=0.5,
        block_size=512,
        input_lengths=[700, 700],
        hits=[0, 700],
    ),
    "ghost_counts_as_resident": dict(
        seqs=[[A], [B], [A], [A], [B]], capacity=2, small_ratio=0.5, hits=[0, 0, 0, 1, 1]
    ),
    "no_freq_saturation": dict(
        seqs=[[A, A, A], [B], [B], [C], [C], [D], [A]],
        capacity=3,
        small_ratio=0.3,
        max_freq=1,
        hits=[0, 0, 1, 0, 1, 0, 0],
    ),
    "main_plain_fifo": SECOND_CHANCE,
    "requeue_at_head": SECOND_CHANCE,
    "reset_freq_on_promotion": SECOND_CHANCE,
    "set_intersection": dict(
        seqs=[[1, 2], [9, 1, 2], [1, 7, 2]], capacity=4, small_ratio=0.5, hits=[0, 0, 1]
    ),
    "freq_only_on_prefix": dict(
        seqs=[[A], [X, A], [Y], [A]], capacity=4, small_ratio=0.5, hits=[0, 0, 0, 1]
    ),
    "final_includes_ghost": dict(
        seqs=[[1], [2], [3]], capacity=2, small_ratio=0.5, hits=[0, 0, 0], final=1
    ),
    "int_small_cap": dict(seqs=[[A], [B], [A]], capacity=3, small_ratio=0.5, hits=[0, 0, 1]),
    "ghost_cap_small": dict(
        seqs=[[A], [B], [C], [A], [D], [A]], capacity=4, small_ratio=0.25, hits=[0, 0, 0, 0, 0, 1]
    ),
}


def run_case(case, mistake=None):
    bs = case.get("block_size", 1)
    lengths = case.get("input_lengths") or [len(s) * bs for s in case["seqs"]]
    return s3fifo_variant(
        case["seqs"],
        lengths,
        case["capacity"],
        case["small_ratio"],
        case.get("max_freq", 3),
        bs,
        mistake,
    )


@pytest.mark.parametrize("mistake", S3FIFO_MISTAKES)
def test_mistake_is_caught_on_a_hand_trace(mistake):
    case = CASES[mistake]
    bs = case.get("block_size", 1)
    lengths = case.get("input_lengths") or [len(s) * bs for s in case["seqs"]]
    requests = [
        {"timestamp": 0, "input_length": n, "output_length": 0, "hash_ids": s}
        for s, n in zip(case["seqs"], lengths, strict=True)
    ]
    result = replay(
        requests, "s3fifo", case["capacity"], bs, case["small_ratio"], case.get("max_freq", 3)
    )
    expected = (case["hits"], case.get("final", result.final_cache_blocks))
    assert (result.hit_tokens.tolist(), result.final_cache_blocks) == expected
    assert run_case(case) == expected
    assert run_case(case, mistake) != expected


# Where each mistake shows on real data: the whole synthetic trace at capacity 4096 (some
# mistakes change nothing on shorter or colder slices, where main never fills), except
# int() vs round(), which shows on the first 2000 conversation requests at 4096. On the
# excerpts (tests/data/mooncake), every mistake shows on the synthetic tail at capacity
# 1006 (int(100.6) != round(100.6)); at 1024 int() vs round() would not.
if FULL_TRACES:
    REAL_CASE = {"int_small_cap": ("conversation", 2000, 4096)}
    DEFAULT_REAL_CASE = ("synthetic", None, 4096)
else:
    REAL_CASE = {}
    DEFAULT_REAL_CASE = ("synthetic", None, 1006)


@pytest.fixture(scope="module")
def real_runs():
    """(trace name, requests, capacity) -> (seqs, lengths, replay result), each built once."""
    cache = {}

    def get(name, num_requests, capacity):
        key = (name, num_requests, capacity)
        if key not in cache:
            trace = load_trace(TRACES / f"{name}_trace.jsonl")
            if num_requests is not None:
                trace = trace[:num_requests]
            seqs = [r.hash_ids for r in trace]
            lengths = trace.input_lengths.tolist()
            result = replay(trace, "s3fifo", capacity)
            correct = s3fifo_variant(seqs, lengths, capacity, block_size=512)
            assert correct == (result.hit_tokens.tolist(), result.final_cache_blocks)
            cache[key] = (seqs, lengths, result)
        return cache[key]

    return get


@pytest.mark.parametrize("mistake", S3FIFO_MISTAKES)
def test_mistake_is_caught_on_the_real_trace(real_runs, mistake):
    name, num_requests, capacity = REAL_CASE.get(mistake, DEFAULT_REAL_CASE)
    seqs, lengths, result = real_runs(name, num_requests, capacity)
    wrong_hits, wrong_final = s3fifo_variant(
        seqs, lengths, capacity, block_size=512, mistake=mistake
    )
    assert (sum(wrong_hits), wrong_final) != (result.total_hit_tokens, result.final_cache_blocks)


# ------------------------------------------------------------------- LFU rules
def lfu_variant(seqs, capacity, mistake=None):
    """Brute-force LFU hit lengths; mistakes: tie_fifo, remember_count, insert_then_evict."""
    count: dict[int, int] = {}
    last: dict[int, int] = {}
    first: dict[int, int] = {}
    history: dict[int, int] = {}
    clock = 0
    out = []
    for ids in seqs:
        out.append(prefix_len(ids, count.__contains__))
        for h in ids:
            clock += 1
            if h in count:
                count[h] += 1
                last[h] = clock
                continue
            start = history.get(h, 0) + 1 if mistake == "remember_count" else 1
            if mistake == "insert_then_evict":
                count[h], last[h], first[h] = start, clock, clock
            if len(count) > capacity or (mistake != "insert_then_evict" and len(count) == capacity):
                tie = first if mistake == "tie_fifo" else last
                victim = min(count, key=lambda b: (count[b], tie[b]))
                history[victim] = count[victim]
                del count[victim]
            if mistake != "insert_then_evict":
                count[h], last[h], first[h] = start, clock, clock
    return out


LFU_CASES = {
    "tie_fifo": ([[A], [B], [B], [A], [C], [A], [B]], [0, 0, 1, 1, 0, 1, 0]),
    "remember_count": (
        [[A], [A], [B], [B], [B], [C], [A], [D], [A]],
        [0, 1, 0, 1, 1, 0, 0, 0, 0],
    ),
    "insert_then_evict": (
        [[A], [A], [B], [B], [B], [C], [A], [D], [A]],
        [0, 1, 0, 1, 1, 0, 0, 0, 0],
    ),
}


@pytest.mark.parametrize("mistake", LFU_CASES)
def test_lfu_rule_is_caught(mistake):
    seqs, expected = LFU_CASES[mistake]
    requests = [
        {"timestamp": 0, "input_length": len(s), "output_length": 0, "hash_ids": s} for s in seqs
    ]
    assert replay(requests, "lfu", 2, block_size=1).hit_tokens.tolist() == expected
    assert lfu_variant(seqs, 2) == expected
    assert lfu_variant(seqs, 2, mistake) != expected
