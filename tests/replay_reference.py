"""Helpers the replay tests share: the brute-force radix oracle, request builders, a
hypothesis strategy, the seed's sanity checks, and LFU by linear scan (a check of
``lfu_reference``). The plain flat-policy oracles live in ``radixkv.replay.reference``
(the replay benchmark times against them too).
"""

from __future__ import annotations

import json
import math
from collections import OrderedDict
from collections.abc import Mapping, Sequence
from typing import Any

from hypothesis import strategies as st

from radixkv.replay import replay
from radixkv.replay.reference import Requests, prefix_len


def lfu_bruteforce(requests: Requests, capacity: int):
    """LFU by a linear scan for the victim: slow, for small traces, checks ``lfu_reference``."""
    count: dict[int, int] = {}
    last: dict[int, int] = {}
    clock = 0
    hit_blocks, block_hits = [], 0
    for hash_ids in requests:
        hit_blocks.append(prefix_len(hash_ids, count.__contains__))
        for h in hash_ids:
            clock += 1
            if h in count:
                block_hits += 1
                count[h] += 1
            else:
                if len(count) == capacity:
                    victim = min(count, key=lambda b: (count[b], last[b]))
                    del count[victim], last[victim]
                count[h] = 1
            last[h] = clock
    return hit_blocks, block_hits, set(count)


class _TrieNode:
    """A run of tokens (one block each) in the brute-force radix oracle."""

    def __init__(self, tokens, parent, depth_end, last_access):
        self.tokens = list(tokens)
        self.parent = parent
        self.children = {}  # first token -> node
        self.depth_end = depth_end  # tokens from the root to the end of this node
        self.last_access = last_access
        self.hits = 0  # matches through it
        self.created = last_access
        self.readmitted = False  # ghost: inserted where a deleted leaf was


def radix_reference(requests: Requests, capacity: int, eviction: str):
    """The radix replay written as plainly as possible: ``(hit_blocks, final_cache_blocks)``.

    A compressed trie over token lists (one token = one block), with the tree's rules
    restated from its contract rather than its code: ``match`` walks full nodes and splits
    the node where the sequence ends or diverges (the head takes the clock); ``evict``
    repeatedly removes the whole leaf with the smallest key among leaves off the request's
    matched path, scanning every node (``level``: deepest end first, then least recently
    used; ``lru``: least recently used; ``lfu``: fewest hits, then LRU; ``fifo``: oldest
    creation; ``priority``: all 0 in a replay, so LRU; ``lrfu``: last access plus 200 per
    hit for up to 3 hits, then last access; ``deep``: last access plus int(100 log2 depth)
    plus, once hit, twice (last access - creation), then last access; ``ghost``: lrfu with
    600 per hit plus 1500 while readmitted, then last access); ``insert`` touches
    the path and hangs the new tokens under it as one leaf. Every match and insert ticks the
    clock; every node a match walks through (a split's head included) counts a hit.

    ``ghost`` also keeps S3-FIFO's ghost: a deleted leaf is remembered by (its parent's
    depth, its first token) with its length, oldest forgotten first beyond 4 x capacity
    tokens; a new leaf whose (parent depth, first token) is remembered is readmitted
    (forgetting the entry); readmitted tokens are capped at 0.75 x capacity, the oldest
    readmission lapsing first (a split's head is readmitted after its tail); a leaf
    deleted loses its readmission.
    """
    root = _TrieNode([], None, 0, 0)
    clock = 0
    cached = 0
    ghost: OrderedDict = OrderedDict()  # (parent depth, first token) -> tokens
    protected: OrderedDict = OrderedDict()  # id -> readmitted node, oldest first

    def key(node):
        last = node.last_access
        return {
            "level": (-node.depth_end, last),
            "lru": (last,),
            "lfu": (node.hits, last),
            "fifo": (node.created,),
            "priority": (0, last),
            "lrfu": (last + 200 * min(node.hits, 3), last),
            "ghost": (last + 600 * min(node.hits, 3) + (1500 if node.readmitted else 0), last),
            "deep": (
                last
                + int(100 * math.log2(max(node.depth_end, 1)))
                + (2 * (last - node.created) if node.hits else 0),
                last,
            ),
        }[eviction]

    def nodes():
        stack = list(root.children.values())
        while stack:
            node = stack.pop()
            yield node
            stack.extend(node.children.values())

    def split(node, k):
        head = _TrieNode(node.tokens[:k], node.parent, node.depth_end - (len(node.tokens) - k), 0)
        head.last_access = node.last_access
        head.hits = node.hits
        head.created = node.created
        if node.readmitted:
            head.readmitted = True
            protected[id(head)] = head
        node.parent.children[head.tokens[0]] = head
        node.tokens = node.tokens[k:]
        node.parent = head
        head.children[node.tokens[0]] = node
        return head

    def walk(seq):
        """Nodes along the longest cached prefix, splitting where it ends inside a node."""
        node, pos, path = root, 0, []
        while pos < len(seq) and seq[pos] in node.children:
            child = node.children[seq[pos]]
            common = 0
            while (
                common < len(child.tokens)
                and pos + common < len(seq)
                and child.tokens[common] == seq[pos + common]
            ):
                common += 1
            if common < len(child.tokens):  # ends or diverges inside: split, stop
                path.append(split(child, common))
                pos += common
                break
            path.append(child)
            pos += common
            node = child
        return path, pos

    hit_blocks = []
    for ids in requests:
        seq = list(ids)
        clock += 1
        path, matched = walk(seq)
        for node in path:
            node.last_access = clock
            node.hits += 1
        hit_blocks.append(matched)
        need = len(seq) - matched
        if not need:
            continue
        held = set(map(id, path))
        while capacity - cached < need:
            leaves = [n for n in nodes() if not n.children and id(n) not in held]
            if not leaves:
                break
            victim = min(leaves, key=key)
            del victim.parent.children[victim.tokens[0]]
            cached -= len(victim.tokens)
            if eviction == "ghost":
                protected.pop(id(victim), None)
                ghost_key = (victim.parent.depth_end, victim.tokens[0])
                ghost.pop(ghost_key, None)
                ghost[ghost_key] = len(victim.tokens)
                while sum(ghost.values()) > int(4.0 * capacity):
                    ghost.popitem(last=False)
        got = min(need, capacity - cached)
        if got:
            clock += 1
            for node in path:
                node.last_access = clock
            parent = path[-1] if path else root
            leaf = _TrieNode(seq[matched : matched + got], parent, matched + got, clock)
            parent.children[seq[matched]] = leaf
            cached += got
            if eviction == "ghost" and ghost.pop((parent.depth_end, seq[matched]), None):
                leaf.readmitted = True
                protected[id(leaf)] = leaf
                while sum(len(n.tokens) for n in protected.values()) > int(0.75 * capacity):
                    protected.popitem(last=False)[1].readmitted = False
    return hit_blocks, cached


def check_sanity(requests: Sequence[Mapping[str, Any]], result: Any) -> None:
    """Assert the seed's sanity checks (and a few more) on a replay of ``requests``.

    ``requests``: mappings with ``input_length`` and ``hash_ids``, in trace order.
    """
    d = result.to_dict(per_request=True)
    assert json.loads(json.dumps(d)) == d
    per = d["per_request"]
    assert len(per) == d["num_requests"] == len(requests)
    total_prompt, total_hit = d["total_prompt_tokens"], d["total_hit_tokens"]
    assert d["overall_hit_rate"] == (total_hit / total_prompt if total_prompt else 0.0)
    assert sum(r["hit_tokens"] for r in per) == total_hit
    assert sum(r["prompt_tokens"] for r in per) == total_prompt
    assert 0 <= d["final_cache_blocks"] <= d["cache_capacity_blocks"]
    assert 0 <= d["unreachable_blocks"] <= d["final_cache_blocks"]
    num_accesses = sum(len(r["hash_ids"]) for r in requests)
    assert d["block_hits"] + d["block_misses"] == num_accesses and d["block_hits"] >= 0
    seen: set[int] = set()
    bs = d["block_size"]
    for req, row, k in zip(requests, per, result.hit_blocks.tolist(), strict=True):
        ids = list(req["hash_ids"])
        assert row["prompt_tokens"] == req["input_length"]
        assert 0 <= k <= len(ids)
        assert row["hit_tokens"] == min(k * bs, req["input_length"])
        if ids and ids[0] not in seen:  # never seen, so not resident and not in a ghost
            assert row["hit_tokens"] == 0
        # a prefix hit needs every one of its ids to have been seen before
        assert all(h in seen for h in ids[:k])
        seen.update(ids)


# ------------------------------------------------------------ test helpers
def reqs(seqs, block_size=1, input_lengths=None):
    """Trace requests from id lists; input_length defaults to whole blocks."""
    lengths = input_lengths or [len(s) * block_size for s in seqs]
    return [
        {"timestamp": i, "input_length": n, "output_length": 1, "hash_ids": list(s)}
        for i, (s, n) in enumerate(zip(seqs, lengths, strict=True))
    ]


def run(seqs, policy, capacity, block_size=1, input_lengths=None, **kw):
    """``replay`` (block_size 1 by default) with the sanity checks asserted on the result."""
    requests = reqs(seqs, block_size, input_lengths)
    result = replay(requests, policy, capacity, block_size=block_size, **kw)
    check_sanity(requests, result)
    return result


def hits(seqs, policy, capacity, **kw):
    """Per-request hit tokens of ``run``."""
    return run(seqs, policy, capacity, **kw).hit_tokens.tolist()


@st.composite
def random_requests(draw):
    """Either free-form ids (any order, repeats) or chained ids that share prefixes."""
    num = draw(st.integers(0, 25))
    if draw(st.booleans()):
        alphabet = draw(st.integers(1, 30))
        return [draw(st.lists(st.integers(0, alphabet - 1), max_size=10)) for _ in range(num)]
    seqs: list[list[int]] = []
    fresh = 0
    for _ in range(num):
        base = draw(st.sampled_from(seqs)) if seqs and draw(st.booleans()) else []
        keep = draw(st.integers(0, len(base)))
        extra = draw(st.integers(0, 6))
        seqs.append(base[:keep] + list(range(fresh, fresh + extra)))
        fresh += extra
    return seqs
