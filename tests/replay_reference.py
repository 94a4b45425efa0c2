"""Plain reference replays (OrderedDict / deque), the oracles the fast kernels are tested
against, and the helpers the replay tests share (request builders, a hypothesis strategy,
the seed's sanity checks).

Written to be obviously correct, straight from the replay seed's rules, over the
ORIGINAL hash ids (no remapping), one Python step per access. Each returns
``(hit_blocks, block_hits, resident)``: the per-request prefix hit lengths, the
number of accesses that found their block resident, and the final resident set.
"""

from __future__ import annotations

import json
from collections import OrderedDict, deque
from collections.abc import Mapping, Sequence
from typing import Any

from hypothesis import strategies as st

from radixkv.replay import replay

Requests = Sequence[Sequence[int]]  # each request's hash_ids


def prefix_len(hash_ids: Sequence[int], is_resident) -> int:
    """Largest k with hash_ids[0..k-1] all resident (stops at the first miss)."""
    k = 0
    while k < len(hash_ids) and is_resident(hash_ids[k]):
        k += 1
    return k


def lru_reference(requests: Requests, capacity: int):
    cache: OrderedDict[int, None] = OrderedDict()  # first = least recently used
    hit_blocks, block_hits = [], 0
    for hash_ids in requests:
        hit_blocks.append(prefix_len(hash_ids, cache.__contains__))
        for h in hash_ids:
            if h in cache:
                block_hits += 1
                cache.move_to_end(h)
            else:
                if len(cache) == capacity:
                    cache.popitem(last=False)
                cache[h] = None
    return hit_blocks, block_hits, set(cache)


def lfu_reference(requests: Requests, capacity: int):
    """LFU with O(1) buckets: count -> OrderedDict of its blocks, least recently used first."""
    count: dict[int, int] = {}
    buckets: dict[int, OrderedDict[int, None]] = {}
    min_count = 0
    hit_blocks, block_hits = [], 0
    for hash_ids in requests:
        hit_blocks.append(prefix_len(hash_ids, count.__contains__))
        for h in hash_ids:
            if h in count:
                block_hits += 1
                c = count[h]
                del buckets[c][h]
                if not buckets[c]:
                    del buckets[c]
                    if min_count == c:
                        min_count = c + 1
                count[h] = c + 1
                buckets.setdefault(c + 1, OrderedDict())[h] = None
                continue
            if len(count) == capacity:
                victim, _ = buckets[min_count].popitem(last=False)
                if not buckets[min_count]:
                    del buckets[min_count]
                del count[victim]
            count[h] = 1
            min_count = 1
            buckets.setdefault(1, OrderedDict())[h] = None
    return hit_blocks, block_hits, set(count)


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


def s3fifo_reference(
    requests: Requests, capacity: int, small_ratio: float = 0.1, max_freq: int = 3
):
    """S3FIFO exactly as the seed's pseudocode: small/main deques, an ordered ghost, freq dict."""
    small_cap = round(capacity * small_ratio)
    main_cap = capacity - small_cap
    ghost_cap = main_cap
    assert small_cap >= 1 and main_cap >= 1
    small: deque[int] = deque()
    main: deque[int] = deque()
    ghost: OrderedDict[int, None] = OrderedDict()
    freq: dict[int, int] = {}  # resident blocks only

    def insert_to_ghost(h: int) -> None:
        if h in ghost:
            del ghost[h]
        elif len(ghost) >= ghost_cap:
            ghost.popitem(last=False)
        ghost[h] = None

    def admit_to_main(h: int, f: int) -> None:
        while len(main) >= main_cap:
            victim = main.popleft()
            if freq[victim] >= 1:
                freq[victim] -= 1
                main.append(victim)
            else:
                del freq[victim]
                insert_to_ghost(victim)
                break
        main.append(h)
        freq[h] = f

    def admit_to_small(h: int) -> None:
        while len(small) >= small_cap:
            victim = small.popleft()
            vf = freq[victim]
            if vf >= 1:
                admit_to_main(victim, vf)
            else:
                del freq[victim]
                insert_to_ghost(victim)
        small.append(h)
        freq[h] = 0

    hit_blocks, block_hits = [], 0
    for hash_ids in requests:
        hit_blocks.append(prefix_len(hash_ids, freq.__contains__))
        for h in hash_ids:
            if h in freq:  # resident: in small or main
                block_hits += 1
                freq[h] = min(freq[h] + 1, max_freq)
            elif h in ghost:
                del ghost[h]
                admit_to_main(h, 0)
            else:
                admit_to_small(h)
    assert set(small) | set(main) == set(freq) and len(small) + len(main) == len(freq)
    return hit_blocks, block_hits, set(freq)


REFERENCES = {"lru": lru_reference, "lfu": lfu_reference, "s3fifo": s3fifo_reference}


def reference_replay(
    requests: Requests,
    policy: str,
    capacity: int,
    small_ratio: float = 0.1,
    max_freq: int = 3,
):
    """``(hit_blocks, block_hits, resident)`` of a flat policy, the plain way."""
    if policy == "s3fifo":
        return s3fifo_reference(requests, capacity, small_ratio, max_freq)
    return REFERENCES[policy](requests, capacity)


def unreachable_reference(requests: Requests, resident: set[int]) -> int:
    """Resident blocks that no request would get as part of its prefix hit now."""
    reachable: set[int] = set()
    for hash_ids in requests:
        for h in hash_ids:
            if h not in resident:
                break
            reachable.add(h)
    return len(resident - reachable)


def orphan_reference(requests: Requests, resident: set[int]) -> int:
    """Resident blocks whose parent (the id before it at its first appearance) is not resident."""
    parent: dict[int, int | None] = {}
    for hash_ids in requests:
        for i, h in enumerate(hash_ids):
            parent.setdefault(h, hash_ids[i - 1] if i else None)
    return sum(1 for h in resident if parent[h] is not None and parent[h] not in resident)


class _TrieNode:
    """A run of tokens (one block each) in the brute-force radix oracle."""

    def __init__(self, tokens, parent, depth_end, last_access):
        self.tokens = list(tokens)
        self.parent = parent
        self.children = {}  # first token -> node
        self.depth_end = depth_end  # tokens from the root to the end of this node
        self.last_access = last_access


def radix_reference(requests: Requests, capacity: int, eviction: str):
    """The radix replay written as plainly as possible: ``(hit_blocks, final_cache_blocks)``.

    A compressed trie over token lists (one token = one block), with the tree's rules
    restated from its contract rather than its code: ``match`` walks full nodes and splits
    the node where the sequence ends or diverges (the head takes the clock); ``evict``
    repeatedly removes the whole leaf with the smallest key among leaves off the request's
    matched path, scanning every node (``level``: deepest end first, then least recently
    used; ``lru``: least recently used); ``insert`` touches the path and hangs the new
    tokens under it as one leaf. Every match and insert ticks the clock.
    """
    root = _TrieNode([], None, 0, 0)
    clock = 0
    cached = 0

    def key(node):
        return (-node.depth_end, node.last_access) if eviction == "level" else (node.last_access,)

    def nodes():
        stack = list(root.children.values())
        while stack:
            node = stack.pop()
            yield node
            stack.extend(node.children.values())

    def split(node, k):
        head = _TrieNode(node.tokens[:k], node.parent, node.depth_end - (len(node.tokens) - k), 0)
        head.last_access = node.last_access
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
        got = min(need, capacity - cached)
        if got:
            clock += 1
            for node in path:
                node.last_access = clock
            parent = path[-1] if path else root
            leaf = _TrieNode(seq[matched : matched + got], parent, matched + got, clock)
            parent.children[seq[matched]] = leaf
            cached += got
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
