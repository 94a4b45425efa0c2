"""Hypothesis state machine: RadixCache against a brute-force oracle.

The oracle is a plain dict from every cached block-aligned prefix
``(namespace, tokens[:k * bs])`` to the block that holds its last block of
tokens, plus the references each simulated request holds. After every step it
checks the invariants of docs/design.md:

1-3 structure: ``cache.check()``;
4   refcount(b) == (1 if the oracle says the tree holds b) + request references;
5   every match equals the oracle's longest cached prefix, block for block (and
    ``peek`` just before it equals its length);
6   after reset and every request letting go, all blocks are free;
plus a content check: each matched block was written with exactly the tokens
of the position it is matched for.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field

import numpy as np
from hypothesis import assume, note
from hypothesis import strategies as st
from hypothesis.stateful import (
    Bundle,
    RuleBasedStateMachine,
    consumes,
    initialize,
    invariant,
    rule,
)

from radixkv import BlockAllocator, RadixCache

NUM_BLOCKS = 48
NAMESPACES = [None, "lora-a", ("tenant", 2)]
try:  # torch is the engine extra's; without it the machine feeds numpy and lists only
    import torch
except ImportError:
    torch = None
INPUT_TYPES = ["list", "tuple", "np64", "np32", *(["torch"] if torch is not None else [])]


def as_input(tokens: list[int], kind: str):
    if kind == "list":
        return list(tokens)
    if kind == "tuple":
        return tuple(tokens)
    if kind == "np64":
        return np.array(tokens, dtype=np.int64)
    if kind == "np32":
        return np.array(tokens, dtype=np.int32)
    return torch.tensor(tokens, dtype=torch.long)


@dataclass
class Request:
    tokens: list[int]
    namespace: object
    blocks: list[int] = field(default_factory=list)


class RadixMachine(RuleBasedStateMachine):
    requests = Bundle("requests")

    @initialize(
        block_size=st.sampled_from([1, 2, 4, 16]), eviction=st.sampled_from(["level", "lru"])
    )
    def setup(self, block_size: int, eviction: str) -> None:
        self.bs = block_size
        self.alloc = BlockAllocator(num_blocks=NUM_BLOCKS, block_size=block_size)
        self.cache = RadixCache(self.alloc, eviction=eviction)
        self.cached: dict[tuple, int] = {}  # (namespace, prefix tokens) -> block
        self.request_refs: Counter[int] = Counter()
        self.written: dict[int, tuple[int, ...]] = {}  # block -> the tokens written into it
        self.seen: list[list[int]] = []
        note(f"block_size={block_size} eviction={eviction}")

    # ------------------------------------------------------------ helpers
    def tokens_strategy(self, draw_base: int, extra: list[int], cut_blocks: int) -> list[int]:
        if self.seen and draw_base >= 0:
            base = self.seen[draw_base % len(self.seen)]
            base = base[: cut_blocks * self.bs] if cut_blocks >= 0 else base
            return base + extra
        return extra

    def expected(self, tokens: list[int], ns: object) -> list[int]:
        out = []
        for k in range(1, len(tokens) // self.bs + 1):
            b = self.cached.get((ns, tuple(tokens[: k * self.bs])))
            if b is None:
                break
            out.append(b)
        return out

    def do_match(self, tokens: list[int], ns: object, kind: str) -> list[int]:
        want = self.expected(tokens, ns)
        assert self.cache.peek(as_input(tokens, kind), namespace=ns) == len(want) * self.bs
        m = self.cache.match(as_input(tokens, kind), namespace=ns)
        assert m.blocks == want, (m.blocks, want)
        assert m.num_tokens == len(want) * self.bs
        for i, b in enumerate(m.blocks):
            assert self.written[b] == tuple(tokens[i * self.bs : (i + 1) * self.bs])
        self.request_refs.update(m.blocks)
        return m.blocks

    def tree_blocks(self) -> set[int]:
        return set(self.cached.values())

    def oracle_evictable(self) -> set[tuple]:
        # A prefix is evictable iff no request holds its block or the block of any extension.
        in_use = {k for k, b in self.cached.items() if self.request_refs[b]}
        return {
            k
            for k in self.cached
            if not any(u[0] == k[0] and u[1][: len(k[1])] == k[1] for u in in_use)
        }

    # -------------------------------------------------------------- rules
    @rule(
        target=requests,
        base=st.integers(-1, 20),
        cut=st.integers(-1, 4),
        extra=st.lists(st.integers(0, 2), max_size=40),
        ns=st.sampled_from(NAMESPACES),
        kind=st.sampled_from(INPUT_TYPES),
    )
    def start_request(self, base: int, cut: int, extra: list[int], ns: object, kind: str):
        tokens = self.tokens_strategy(base, extra, cut)
        assume(len(tokens) >= 1)
        self.seen.append(tokens)
        blocks = self.do_match(tokens, ns, kind)
        need = -(-len(tokens) // self.bs) - len(blocks)
        if need > self.alloc.num_free:
            self.do_evict(need - self.alloc.num_free)
        if need > self.alloc.num_free:  # the pool is full of running requests: give up
            self.alloc.decref(blocks)
            self.request_refs.subtract(blocks)
            return Request(tokens, ns, [])
        new = self.alloc.alloc(need)
        for i, b in enumerate(new, start=len(blocks)):
            self.written[b] = tuple(tokens[i * self.bs : (i + 1) * self.bs])
        self.request_refs.update(new)
        return Request(tokens, ns, blocks + new)

    def do_insert(self, req: Request, kind: str) -> None:
        n_full = len(req.tokens) // self.bs
        want_cached = len(self.expected(req.tokens, req.namespace)) * self.bs
        got = self.cache.insert(as_input(req.tokens, kind), req.blocks, namespace=req.namespace)
        assert got == want_cached
        for k in range(1, n_full + 1):
            prefix = (req.namespace, tuple(req.tokens[: k * self.bs]))
            self.cached.setdefault(prefix, req.blocks[k - 1])

    @rule(req=consumes(requests), kind=st.sampled_from(INPUT_TYPES))
    def finish_request(self, req: Request, kind: str) -> None:
        if req.blocks:
            self.do_insert(req, kind)
            self.alloc.decref(req.blocks)
            self.request_refs.subtract(req.blocks)

    @rule(req=requests, kind=st.sampled_from(INPUT_TYPES))
    def insert_while_running(self, req: Request, kind: str) -> None:
        if req.blocks:
            self.do_insert(req, kind)

    @rule(
        base=st.integers(0, 20),
        extra=st.lists(st.integers(0, 2), max_size=8),
        ns=st.sampled_from(NAMESPACES),
        kind=st.sampled_from(INPUT_TYPES),
    )
    def probe(self, base: int, extra: list[int], ns: object, kind: str) -> None:
        tokens = self.tokens_strategy(base, extra, -1)
        blocks = self.do_match(tokens, ns, kind)
        self.alloc.decref(blocks)
        self.request_refs.subtract(blocks)

    def do_evict(self, n: int) -> None:
        evictable = self.oracle_evictable()
        assert self.cache.evictable_blocks == len(evictable)
        before = dict(self.cached)
        freed = self.cache.evict(n)
        rc = self.alloc.refcount
        gone = {k for k, b in before.items() if rc(b) == self.request_refs[b]}
        assert len(gone) == freed
        assert gone <= evictable, "evicted a block a request holds, or an ancestor of one"
        for k in gone:  # prefix-closed: what goes takes its extensions with it
            kept = before.keys() - gone
            assert all(not (u[0] == k[0] and u[1][: len(k[1])] == k[1]) for u in kept)
        if len(evictable) >= n:
            assert freed >= n
        else:
            assert freed == len(evictable)
        for k in gone:
            del self.cached[k]

    @rule(n=st.integers(0, NUM_BLOCKS))
    def evict(self, n: int) -> None:
        self.do_evict(n)

    @rule()
    def reset(self) -> None:
        self.cache.reset()
        self.cached.clear()

    # ---------------------------------------------------------- invariants
    @invariant()
    def structure_and_refcounts(self) -> None:
        self.cache.check()
        held = self.tree_blocks()
        assert len(held) == len(self.cached), "a block cached at two prefixes"
        assert self.cache.cached_blocks == len(held)
        assert self.cache.held_blocks().tolist() == sorted(held)
        for b in range(NUM_BLOCKS):
            want = (b in held) + self.request_refs[b]
            assert self.alloc.refcount(b) == want, (b, self.alloc.refcount(b), want)
        free = [b for b in range(NUM_BLOCKS) if b not in held and not self.request_refs[b]]
        assert self.alloc.num_free == len(free)

    def teardown(self) -> None:
        if not hasattr(self, "alloc"):
            return
        self.cache.reset()
        for b, n in self.request_refs.items():
            if n:
                self.alloc.decref([b] * n)
        assert self.alloc.num_free == NUM_BLOCKS


TestRadixMachine = RadixMachine.TestCase
