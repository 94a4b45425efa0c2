"""load_trace / Trace: parsing, dense remapping, and every kind of malformed input."""

from __future__ import annotations

import io
import json
from pathlib import Path

import numpy as np
import pytest
from trace_paths import FULL_TRACES, TRACES

from radixkv.replay import Trace, TraceError, TraceLengthError, TraceRequest, load_trace, replay

GOOD = {"timestamp": 0, "input_length": 700, "output_length": 5, "hash_ids": [7, 9]}


def write_lines(tmp_path: Path, lines: list[str]) -> Path:
    path = tmp_path / "t.jsonl"
    path.write_text("".join(line + "\n" for line in lines))
    return path


def test_dense_ids_in_order_of_first_appearance(tmp_path):
    lines = [
        json.dumps({**GOOD, "hash_ids": [100, 5, 100]}),
        "",  # blank lines are skipped
        json.dumps({**GOOD, "timestamp": 3, "hash_ids": [5, -2, 2**70]}),
        json.dumps({**GOOD, "hash_ids": []}),
    ]
    trace = load_trace(write_lines(tmp_path, lines), block_size=None)  # lengths unchecked
    assert trace.ids.tolist() == [0, 1, 0, 1, 2, 3]
    assert trace.offsets.tolist() == [0, 3, 6, 6]
    assert trace.hash_values == [100, 5, -2, 2**70]
    assert trace.num_requests == len(trace) == 3
    assert trace.num_ids == 4 and trace.num_accesses == 6
    assert trace[1] == TraceRequest(3, 700, 5, (5, -2, 2**70))
    assert trace[-1].hash_ids == ()
    assert [r.hash_ids for r in trace] == [(100, 5, 100), (5, -2, 2**70), ()]
    assert trace.ids.dtype == np.int32 and trace.timestamps.dtype == np.int64


def test_from_requests_round_trips_and_slices():
    reqs = [TraceRequest(0.5, 10, 1, (4, 5)), {**GOOD, "hash_ids": [5, 6]}]
    trace = Trace.from_requests(reqs)
    assert list(trace) == [TraceRequest(0.5, 10, 1, (4, 5)), TraceRequest(0.0, 700, 5, (5, 6))]
    assert trace.timestamps.dtype == np.float64
    sub = trace[1:]
    assert list(sub) == [TraceRequest(0.0, 700, 5, (5, 6))] and sub.ids.tolist() == [0, 1]
    with pytest.raises(IndexError):
        trace[2]


# (requests, block accesses, unique ids) as the READMEs of ../shared/data/traces and
# tests/data/mooncake give them
README_COUNTS = (
    {"conversation": (12031, 288500, 182790), "synthetic": (3993, 121877, 43924)}
    if FULL_TRACES
    else {"conversation": (500, 14162, 11879), "synthetic": (500, 20755, 6666)}
)


def test_real_traces_match_their_readme():
    # Loading checks Mooncake's length rule at 512 on every line (issue 11, item 18).
    conv = load_trace(TRACES / "conversation_trace.jsonl")
    assert (conv.num_requests, conv.num_accesses, conv.num_ids) == README_COUNTS["conversation"]
    syn = load_trace(TRACES / "synthetic_trace.jsonl")
    assert (syn.num_requests, syn.num_accesses, syn.num_ids) == README_COUNTS["synthetic"]
    for trace in (conv, syn):
        assert (np.diff(trace.offsets) == -(-trace.input_lengths // 512)).all()
    first = json.loads((TRACES / "conversation_trace.jsonl").open().readline())
    assert conv[0] == TraceRequest(
        first["timestamp"], first["input_length"], first["output_length"], tuple(first["hash_ids"])
    )


BAD_LINES = [
    ("{not json", "invalid JSON"),
    ("[1, 2]", "expected a JSON object"),
    (json.dumps({k: v for k, v in GOOD.items() if k != "hash_ids"}), "missing field hash_ids"),
    (json.dumps({k: v for k, v in GOOD.items() if k != "timestamp"}), "missing field timestamp"),
    (json.dumps({**GOOD, "input_length": -1}), "input_length must be >= 0"),
    (json.dumps({**GOOD, "input_length": 7.5}), "input_length must be an int"),
    (json.dumps({**GOOD, "input_length": "7"}), "input_length must be an int"),
    (json.dumps({**GOOD, "output_length": True}), "output_length must be an int"),
    (json.dumps({**GOOD, "hash_ids": "1,2"}), "hash_ids must be a list"),
    (json.dumps({**GOOD, "hash_ids": [1, 2.0]}), "hash_ids[1] must be an int"),
    (json.dumps({**GOOD, "hash_ids": [1, None]}), "hash_ids[1] must be an int"),
    (json.dumps({**GOOD, "hash_ids": [False]}), "hash_ids[0] must be an int"),
    (json.dumps({**GOOD, "timestamp": "now"}), "timestamp must be a number"),
    ('{"timestamp": NaN, "input_length": 1, "output_length": 1, "hash_ids": []}', "NaN"),
    (json.dumps({**GOOD, "input_length": 2**64}), "does not fit in int64"),
]


@pytest.mark.parametrize(("line", "problem"), BAD_LINES)
def test_malformed_line_names_file_line_and_problem(tmp_path, line, problem):
    path = write_lines(tmp_path, [json.dumps(GOOD), "", line, json.dumps(GOOD)])
    with pytest.raises(TraceError) as info:
        load_trace(path)
    message = str(info.value)
    assert message.startswith(f"{path}:3: "), message
    assert problem in message


def test_bad_request_objects_name_the_request_index():
    with pytest.raises(TraceError, match=r"^request 1: missing field input_length"):
        Trace.from_requests([GOOD, {"timestamp": 0, "output_length": 0, "hash_ids": []}])
    with pytest.raises(TraceError, match=r"^request 0: expected a JSON object"):
        replay([[1, 2]], "lru", 4)


def test_invalid_utf8_is_a_trace_error(tmp_path):
    path = tmp_path / "t.jsonl"
    path.write_bytes(json.dumps(GOOD).encode() + b"\n\xff\xfe{}\n")
    with pytest.raises(TraceError, match=":2: invalid JSON"):
        load_trace(path)


def test_missing_file_is_an_oserror(tmp_path):
    with pytest.raises(FileNotFoundError):
        load_trace(tmp_path / "absent.jsonl")


def test_empty_trace(tmp_path):
    trace = load_trace(write_lines(tmp_path, ["", "  "]))
    assert trace.num_requests == 0 and trace.num_ids == 0
    result = replay(trace, "s3fifo", 10)
    assert result.to_dict(per_request=True) == {
        "policy": "s3fifo",
        "cache_capacity_blocks": 10,
        "block_size": 512,
        "num_requests": 0,
        "total_prompt_tokens": 0,
        "total_hit_tokens": 0,
        "overall_hit_rate": 0.0,
        "final_cache_blocks": 0,
        "block_hits": 0,
        "block_misses": 0,
        "unreachable_blocks": 0,
        "orphan_blocks": 0,
        "per_request": [],
    }


# ---------------------------------------------------------------- issue 11, item 18
@pytest.mark.parametrize(
    ("input_length", "num_ids", "block_size"),
    [(10, 8, 512), (700, 1, 512), (1024, 3, 512), (0, 1, 512), (1, 0, 512), (900, 2, 400)],
)
def test_hash_ids_must_cover_input_length(tmp_path, input_length, num_ids, block_size):
    """Mooncake's rule: len(hash_ids) == ceil(input_length / block_size), else file:line."""
    bad = {**GOOD, "input_length": input_length, "hash_ids": list(range(num_ids))}
    path = write_lines(tmp_path, [json.dumps(GOOD), json.dumps(bad)])
    need = -(-input_length // block_size)
    with pytest.raises(TraceLengthError) as info:
        load_trace(path, block_size)
    assert isinstance(info.value, (TraceError, ValueError))
    assert str(info.value) == (
        f"{path}:2: {num_ids} hash_ids, but input_length {input_length} at block size "
        f"{block_size} needs ceil({input_length} / {block_size}) = {need}"
    )
    assert load_trace(path, block_size=None)[1].hash_ids == tuple(range(num_ids))


def test_lengths_that_follow_the_rule_load(tmp_path):
    lines = [
        json.dumps({**GOOD, "input_length": n, "hash_ids": list(range(k))})
        for n, k in [(0, 0), (1, 1), (512, 1), (513, 2), (1024, 2), (1025, 3)]
    ]
    assert len(load_trace(write_lines(tmp_path, lines))) == 6


@pytest.mark.parametrize("block_size", [0, -1, 1.5, True, "512"])
def test_bad_block_size_is_a_value_error_before_reading(block_size):
    with pytest.raises(ValueError, match="block_size must be a positive int or None"):
        load_trace("/nonexistent/trace.jsonl", block_size)


def test_load_trace_reads_a_binary_stream():
    data = (json.dumps(GOOD) + "\n" + json.dumps({**GOOD, "hash_ids": [9, 8]}) + "\n").encode()
    trace = load_trace(io.BytesIO(data))
    assert [r.hash_ids for r in trace] == [(7, 9), (9, 8)] and trace.source == "<stream>"
    with pytest.raises(TraceError, match=r"^<stream>:2: invalid JSON"):
        load_trace(io.BytesIO(b"\n{"))
