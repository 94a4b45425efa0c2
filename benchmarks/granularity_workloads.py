"""Seeded request workloads for the radix vs hash granularity study (bench_granularity.py).

Each generator returns a list of prompts (1-D int32 token arrays) in arrival
order. Token ids are drawn uniformly from a 32,000-token vocabulary, so two
independently drawn spans share a first token with probability 1/32,000 and
essentially never share more: all reuse comes from the structure of the
workload. Lengths are deliberately not multiples of any block size.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path

import numpy as np

VOCAB = 32_000
MOONCAKE_BLOCK = 512  # tokens per Mooncake hash id
TRACES = Path(__file__).resolve().parents[2] / "shared" / "data" / "traces"


def _span(rng: np.random.Generator, low: int, high: int) -> np.ndarray:
    return rng.integers(0, VOCAB, int(rng.integers(low, high + 1)), dtype=np.int32)


def system_prompt(seed: int, scale: float = 1.0) -> list[np.ndarray]:
    """One 1,003-token system prompt, then many users each asking one 20-300-token question."""
    rng = np.random.default_rng([seed, 1])
    system = _span(rng, 1003, 1003)
    return [np.concatenate([system, _span(rng, 20, 300)]) for _ in range(int(300 * scale))]


def multi_turn(seed: int, scale: float = 1.0) -> list[np.ndarray]:
    """Chats growing by turns: each turn resends the history plus a reply and a new message.

    40 conversations x 6 turns; each starts from one of 3 system prompts (250-400
    tokens) and a first message; a turn adds an assistant reply (50-400 tokens)
    and a user message (10-150). Conversations interleave at random, turns in order.
    """
    rng = np.random.default_rng([seed, 2])
    systems = [_span(rng, 250, 400) for _ in range(3)]
    convs = []
    for _ in range(int(40 * scale)):
        turns = [np.concatenate([systems[int(rng.integers(3))], _span(rng, 10, 150)])]
        for _ in range(5):
            turns.append(np.concatenate([turns[-1], _span(rng, 50, 400), _span(rng, 10, 150)]))
        convs.append(turns)
    order = np.repeat(np.arange(len(convs)), 6)
    rng.shuffle(order)
    nxt = [0] * len(convs)
    out = []
    for c in order.tolist():
        out.append(convs[c][nxt[c]])
        nxt[c] += 1
    return out


def few_shot(seed: int, scale: float = 1.0) -> list[np.ndarray]:
    """Few-shot prompts sharing a header and examples, diverging at arbitrary token offsets.

    A 200-token instruction header and 12 worked examples (40-160 tokens each) in
    a fixed order; each prompt keeps the header plus a uniformly random number of
    tokens of the examples (cut anywhere, mid-example included), then a unique
    20-100-token query.
    """
    rng = np.random.default_rng([seed, 3])
    base = np.concatenate([_span(rng, 200, 200)] + [_span(rng, 40, 160) for _ in range(12)])
    out = []
    for _ in range(int(300 * scale)):
        cut = int(rng.integers(200, len(base) + 1))
        out.append(np.concatenate([base[:cut], _span(rng, 20, 100)]))
    return out


def agent_tree(seed: int, scale: float = 1.0) -> list[np.ndarray]:
    """Agent-style trees: a task prompt forking into many continuations, breadth first.

    3 tasks share a 400-token system prompt; each adds a 300-600-token task
    description, then a tree of depth 4 and branching 3, each step a tool call
    plus observation of 30-300 tokens. Every node of the tree is one request
    (its whole path): 3 x 121 requests.
    """
    rng = np.random.default_rng([seed, 4])
    system = _span(rng, 400, 400)
    out = []
    for _ in range(max(1, int(3 * scale))):
        level = [np.concatenate([system, _span(rng, 300, 600)])]
        out.extend(level)
        for _ in range(4):
            level = [np.concatenate([p, _span(rng, 30, 300)]) for p in level for _ in range(3)]
            out.extend(level)
    return out


def _expand_id(hash_id: int) -> np.ndarray:
    return np.random.default_rng([0x5EED, hash_id]).integers(0, VOCAB, MOONCAKE_BLOCK, np.int32)


def mooncake(seed: int, scale: float = 1.0, name: str = "conversation_trace") -> list[np.ndarray]:
    """A family-sampled slice (~``3M * scale`` tokens) of a Mooncake FAST'25 trace, as tokens.

    Hash ids are chained, so two requests can share a prefix only if they share
    their first id (the first two where every request shares the first, as in
    the conversation trace): that id prefix is a request's *family*. Whole
    families are drawn at random (seeded) until the token budget is met, and
    their requests kept in trace order, so every kept request finds the same
    earlier prefixes as in the full trace. Each hash id becomes 512
    deterministic pseudo-tokens (seeded by the id); the prompt is cut at
    ``input_length``, so the last block stays partial.
    """
    with open(TRACES / f"{name}.jsonl") as f:
        records = [json.loads(line) for line in f]
    depth = 1 if len({r["hash_ids"][0] for r in records}) > 1 else 2
    fam_tokens: dict[tuple, int] = {}
    for r in records:
        key = tuple(r["hash_ids"][:depth])
        fam_tokens[key] = fam_tokens.get(key, 0) + r["input_length"]
    families = list(fam_tokens)
    chosen, total = set(), 0
    for i in np.random.default_rng([seed, 5]).permutation(len(families)).tolist():
        if total >= 3_000_000 * scale:
            break
        chosen.add(families[i])
        total += fam_tokens[families[i]]
    out = []
    ids: dict[int, np.ndarray] = {}
    for r in records:
        if tuple(r["hash_ids"][:depth]) in chosen:
            parts = [ids.setdefault(h, _expand_id(h)) for h in r["hash_ids"]]
            out.append(np.concatenate(parts)[: r["input_length"]])
    return out


def mooncake_synthetic(seed: int, scale: float = 1.0) -> list[np.ndarray]:
    """As ``mooncake`` on the synthetic trace."""
    return mooncake(seed, scale, name="synthetic_trace")


WORKLOADS: dict[str, Callable[[int, float], list[np.ndarray]]] = {
    "system_prompt": system_prompt,
    "multi_turn": multi_turn,
    "few_shot": few_shot,
    "agent_tree": agent_tree,
    "mooncake_conv": mooncake,
    "mooncake_synth": mooncake_synthetic,
}


def ideal_hit_tokens(prompts: list[np.ndarray]) -> np.ndarray:
    """Token-level reuse with an infinite cache: each prompt's longest common prefix with
    any earlier prompt. Brute force over a sorted list of earlier prompts' byte strings
    (the longest common prefix with any string is attained at a sorted neighbour)."""
    import bisect

    seen: list[bytes] = []
    out = np.zeros(len(prompts), dtype=np.int64)
    for i, p in enumerate(prompts):
        key = p.astype(">i4").tobytes()  # big-endian: byte order = token order
        j = bisect.bisect_left(seen, key)
        best = 0
        for k in (j - 1, j):
            if 0 <= k < len(seen):
                best = max(best, _lcp_bytes(seen[k], key) // 4)
        out[i] = best
        seen.insert(j, key)
    return out


def _lcp_bytes(a: bytes, b: bytes) -> int:
    n = min(len(a), len(b))
    x = np.frombuffer(a[:n], dtype=np.uint8)
    y = np.frombuffer(b[:n], dtype=np.uint8)
    diff = np.flatnonzero(x != y)
    return int(diff[0]) if diff.size else n
