"""A load generator for OpenAI-compatible servers: multi-turn chats sharing system prompts.

A benchmark tool (``bench_serve.py`` plays it), not library code.
``run_chat_workload(url, workload)`` plays ``workload.conversations`` chats of
``workload.turns`` turns each against ``url``'s ``/v1/chat/completions``,
``concurrency`` chats at a time (each chat's turns in order: turn ``t + 1``
sends turn ``t``'s prompt, the reply and a new question, so every turn's prompt
extends the last). Chats fall into ``workload.groups`` groups, each with its own
long system prompt, so requests share prefixes within a chat (earlier turns) and
across chats (the system prompt): what a prefix cache, and a prefix-aware
router, can use. The chats are the library's :class:`radixkv.workloads.ChatWorkload`,
written as words (:class:`radixkv.workloads.WordText`).

Every request streams (``stream_options.include_usage``) and is timed on the
client: time to the first content chunk (TTFT) and to the end. The server's
``usage`` gives prompt, cached and completion tokens; the ``x-radixkv-replica``
response header, when a fleet sets it, says which replica served it.
Plain ``http.client`` in threads: no client library to install.
"""

from __future__ import annotations

import http.client
import json
import time
from collections import Counter
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from functools import cached_property
from urllib.parse import urlsplit

import numpy as np

from radixkv.checks import check_int
from radixkv.workloads import ChatWorkload, WordText

__all__ = [
    "WORDS",
    "ChatTraffic",
    "LoadResult",
    "RequestRecord",
    "run_chat_workload",
    "served_model",
]

WORDS = tuple(
    "cache prefix token block radix tree replica router request batch prompt model layer "
    "attention key value memory page evict insert match share split node leaf depth hit "
    "miss latency queue decode prefill stream event hash chain fleet load serve".split()
)  # one word per token id of the chats


@dataclass(frozen=True)
class ChatTraffic:
    """The shape of the traffic: ``conversations`` chats of ``turns`` turns in ``groups``
    groups (one system prompt of ``system_words`` words each), ``question_words`` words
    per question, ``max_tokens`` per reply, greedy; deterministic given ``seed``. The
    words are :attr:`chats`' token ids, one word each."""

    conversations: int = 16
    turns: int = 3
    groups: int = 4
    system_words: int = 120
    question_words: int = 12
    max_tokens: int = 16
    seed: int = 0

    def __post_init__(self) -> None:
        names = ("conversations", "turns", "groups", "system_words", "question_words")
        for name in (*names, "max_tokens"):
            check_int(name, getattr(self, name), low=1)

    @cached_property
    def chats(self) -> ChatWorkload:
        """The chats in token ids, one id per word of ``WORDS``."""
        return ChatWorkload(
            system_len=self.system_words,
            num_users=self.conversations,
            num_turns=self.turns,
            user_len=(self.question_words, self.question_words),
            vocab_size=len(WORDS),
            seed=self.seed,
            num_groups=self.groups,
        )

    def system_prompt(self, group: int) -> str:
        """Group ``group``'s system prompt (the same whatever ``groups`` is)."""
        return f"You are assistant {group}. " + WordText(self.chats, WORDS).system_text(group)

    def question(self, conversation: int, turn: int) -> str:
        """Conversation ``conversation``'s question at ``turn``."""
        return WordText(self.chats, WORDS).user_text(conversation, turn) + "?"


@dataclass(frozen=True)
class RequestRecord:
    """One request as the client saw it (times in seconds; ``error`` set if it failed)."""

    conversation: int
    turn: int
    ttft: float
    latency: float
    prompt_tokens: int
    cached_tokens: int
    completion_tokens: int
    replica: str | None
    error: str | None = None


@dataclass
class LoadResult:
    """Every request's record and the run's wall time; the summary figures as properties."""

    records: list[RequestRecord]
    wall_time: float
    _ok: list[RequestRecord] = field(init=False, repr=False)

    def __post_init__(self) -> None:
        self._ok = [r for r in self.records if r.error is None]

    @property
    def num_errors(self) -> int:
        return len(self.records) - len(self._ok)

    def _pct(self, values: list[float], q: float) -> float:
        return float(np.percentile(values, q)) if values else float("nan")

    @property
    def ttft_p50(self) -> float:
        return self._pct([r.ttft for r in self._ok], 50)

    @property
    def ttft_p90(self) -> float:
        return self._pct([r.ttft for r in self._ok], 90)

    @property
    def throughput(self) -> float:
        """Completion tokens per second of wall time."""
        tokens = sum(r.completion_tokens for r in self._ok)
        return tokens / self.wall_time if self.wall_time > 0 else float("nan")

    @property
    def hit_rate(self) -> float:
        """Cached prompt tokens over prompt tokens, as the server reported them."""
        prompt = sum(r.prompt_tokens for r in self._ok)
        return sum(r.cached_tokens for r in self._ok) / prompt if prompt else 0.0

    @property
    def per_replica(self) -> dict[str, int]:
        """Requests served per replica (from ``x-radixkv-replica``; empty if never set)."""
        return dict(Counter(r.replica for r in self._ok if r.replica is not None))

    @property
    def max_mean_load(self) -> float:
        counts = list(self.per_replica.values())
        return max(counts) / (sum(counts) / len(counts)) if counts else float("nan")


def served_model(url: str, timeout: float = 30.0) -> str:
    """The id of the first model ``url``'s ``GET /v1/models`` lists."""
    parts = urlsplit(url)
    conn = http.client.HTTPConnection(parts.hostname, parts.port or 80, timeout=timeout)
    try:
        conn.request("GET", parts.path.rstrip("/") + "/v1/models")
        resp = conn.getresponse()
        if resp.status != 200:
            raise RuntimeError(f"GET /v1/models: HTTP {resp.status}")
        return json.loads(resp.read())["data"][0]["id"]
    finally:
        conn.close()


def _chat_once(
    url: str, model: str, messages: list[dict], max_tokens: int, timeout: float
) -> tuple[float, float, dict, str, str | None]:
    """Stream one chat completion: (ttft, latency, usage, text, replica header)."""
    parts = urlsplit(url)
    conn = http.client.HTTPConnection(parts.hostname, parts.port or 80, timeout=timeout)
    body = json.dumps(
        {
            "model": model,
            "messages": messages,
            "max_tokens": max_tokens,
            "temperature": 0,
            "stream": True,
            "stream_options": {"include_usage": True},
        }
    )
    t0 = time.perf_counter()
    try:
        conn.request(
            "POST",
            parts.path.rstrip("/") + "/v1/chat/completions",
            body=body,
            headers={"Content-Type": "application/json"},
        )
        resp = conn.getresponse()
        if resp.status != 200:
            raise RuntimeError(f"HTTP {resp.status}: {resp.read(500).decode(errors='replace')}")
        replica = resp.getheader("x-radixkv-replica")
        ttft = None
        usage: dict = {}
        text: list[str] = []
        for raw in resp:
            line = raw.decode().strip()
            if not line.startswith("data:"):
                continue
            data = line[5:].strip()
            if data == "[DONE]":
                break
            chunk = json.loads(data)
            if chunk.get("usage"):
                usage = chunk["usage"]
            for choice in chunk.get("choices") or ():
                piece = (choice.get("delta") or {}).get("content")
                if piece:
                    if ttft is None:
                        ttft = time.perf_counter() - t0
                    text.append(piece)
        latency = time.perf_counter() - t0
        return (latency if ttft is None else ttft), latency, usage, "".join(text), replica
    finally:
        conn.close()


def _conversation(
    url: str, model: str, workload: ChatTraffic, index: int, timeout: float
) -> list[RequestRecord]:
    group = workload.chats.group(index)
    messages = [{"role": "system", "content": workload.system_prompt(group)}]
    out = []
    for turn in range(workload.turns):
        messages.append({"role": "user", "content": workload.question(index, turn)})
        try:
            ttft, latency, usage, text, replica = _chat_once(
                url, model, messages, workload.max_tokens, timeout
            )
        except Exception as exc:  # noqa: BLE001 - a failed request is a measured outcome
            out.append(RequestRecord(index, turn, 0.0, 0.0, 0, 0, 0, None, f"{exc}"))
            return out
        details = usage.get("prompt_tokens_details") or {}
        out.append(
            RequestRecord(
                index,
                turn,
                ttft,
                latency,
                int(usage.get("prompt_tokens", 0)),
                int(details.get("cached_tokens", 0) or 0),
                int(usage.get("completion_tokens", 0)),
                replica,
            )
        )
        messages.append({"role": "assistant", "content": text})
    return out


def run_chat_workload(
    url: str,
    workload: ChatTraffic,
    *,
    concurrency: int = 8,
    model: str | None = None,
    timeout: float = 120.0,
) -> LoadResult:
    """Play ``workload`` against the OpenAI-compatible server at ``url`` (``http://host:port``).

    ``model`` defaults to the first one the server lists at ``/v1/models``.
    ``concurrency`` chats run at once, each in its own thread; a request that
    fails is recorded with its error and ends its chat. ``ValueError`` naming
    the argument for a bad ``url`` or ``concurrency``. Blocks until every chat
    has ended (each request bounded by ``timeout`` seconds per socket read).
    """
    parts = urlsplit(url)
    if parts.scheme != "http" or not parts.hostname:
        raise ValueError(f"url must be http://host[:port], got {url!r}")
    check_int("concurrency", concurrency, low=1)
    name = model if model is not None else served_model(url, timeout)
    t0 = time.perf_counter()
    with ThreadPoolExecutor(max_workers=concurrency) as pool:
        chats = pool.map(
            lambda i: _conversation(url, name, workload, i, timeout),
            range(workload.conversations),
        )
        records = [r for chat in chats for r in chat]
    return LoadResult(records, time.perf_counter() - t0)
