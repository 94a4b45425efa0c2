"""The serving load generator's workload and its summary figures (no server needed).

The load generator is a benchmark tool (``benchmarks/loadgen.py``), imported from there.
"""

from __future__ import annotations

import math
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))
from loadgen import WORDS, ChatTraffic, LoadResult, RequestRecord, run_chat_workload  # noqa: E402

from radixkv.workloads import ChatWorkload  # noqa: E402


def test_workload_is_deterministic_and_groups_share_system_prompts() -> None:
    w = ChatTraffic(conversations=6, groups=3, seed=5)
    assert w.system_prompt(1) == ChatTraffic(seed=5).system_prompt(1)
    assert w.system_prompt(0) != w.system_prompt(1)
    assert w.question(2, 0) != w.question(2, 1)
    assert ChatTraffic(seed=6).system_prompt(1) != w.system_prompt(1)


def test_traffic_is_the_library_chat_workload_as_words() -> None:
    """One chat generator: the traffic's words are ChatWorkload's ids, one word each."""
    w = ChatTraffic(conversations=5, turns=2, groups=2, system_words=7, question_words=3)
    chats = w.chats
    assert isinstance(chats, ChatWorkload)
    assert (chats.num_users, chats.num_turns, chats.num_groups) == (5, 2, 2)
    head, system = w.system_prompt(1).split(". ", 1)
    assert head == "You are assistant 1"
    assert [WORDS.index(x) for x in system.split()] == chats.system_prompt(1).tolist()
    question = w.question(3, 1)
    assert question.endswith("?")
    assert [WORDS.index(x) for x in question[:-1].split()] == chats.user_message(3, 1).tolist()
    assert len(set(WORDS)) == len(WORDS)  # a word names one id


@pytest.mark.parametrize("field", ["conversations", "turns", "groups", "max_tokens"])
@pytest.mark.parametrize("value", [0, -1, True, 1.5])
def test_workload_rejects_bad_fields_by_name(field: str, value: object) -> None:
    with pytest.raises(ValueError, match=field):
        ChatTraffic(**{field: value})


def rec(replica: str | None, prompt: int, cached: int, ttft: float, error: str | None = None):
    return RequestRecord(0, 0, ttft, ttft * 2, prompt, cached, 10, replica, error)


def test_summary_figures_count_only_successful_requests() -> None:
    res = LoadResult(
        [
            rec("a", 100, 0, 0.1),
            rec("a", 100, 50, 0.2),
            rec("b", 200, 150, 0.3),
            rec(None, 0, 0, 0.0, error="HTTP 500"),
        ],
        wall_time=2.0,
    )
    assert res.num_errors == 1
    assert res.hit_rate == pytest.approx(200 / 400)
    assert res.ttft_p50 == pytest.approx(0.2)
    assert res.throughput == pytest.approx(30 / 2.0)
    assert res.per_replica == {"a": 2, "b": 1}
    assert res.max_mean_load == pytest.approx(2 / 1.5)


def test_empty_result_is_nan_not_an_error() -> None:
    res = LoadResult([], wall_time=1.0)
    assert math.isnan(res.ttft_p50) and res.hit_rate == 0.0 and res.per_replica == {}


@pytest.mark.parametrize(
    "url, kwargs, needle",
    [
        ("ftp://x", {}, "url"),
        ("http://127.0.0.1:1", {"concurrency": 0}, "concurrency"),
    ],
)
def test_bad_arguments_are_named(url: str, kwargs: dict, needle: str) -> None:
    with pytest.raises(ValueError, match=needle):
        run_chat_workload(url, ChatTraffic(), **kwargs)
