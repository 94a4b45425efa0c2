"""Hypothesis state machine: RadixCache with a host tier, against an oracle and a KV model.

Every block of both pools has simulated contents: a request that computes a
block writes ``(namespace, the tokens up to the block's end)`` into it; a
copier moves contents between the pools and poisons device blocks the tree
frees. After every step:

- ``cache.check()`` (both tiers' invariants) and device refcount conservation
  (tree + requests' references);
- each ``match``/``load`` equals the oracle: device tokens are the longest
  prefix on the device, device + host tokens the longest prefix in some tier
  (the oracle enumerates the nodes' prefixes, not the walk);
- every block a match or load hands out holds exactly the contents of its
  position (a reload copies what was backed up; a copy never reads a freed,
  poisoned block);
- after reset and every request letting go, both pools are fully free.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field

import numpy as np
from hypothesis import note, settings
from hypothesis import strategies as st
from hypothesis.stateful import (
    Bundle,
    RuleBasedStateMachine,
    consumes,
    initialize,
    invariant,
    rule,
)

from radixkv import BlockAllocator
from radixkv.cache import TieredRadixCache
from radixkv.cache.host import HostTier
from radixkv.cache.prefix_cache import namespace_key

NAMESPACES = [None, "lora-a"]
POISON = "poison"


class ContentCopier:
    """A copier over simulated pools: lists of per-block contents."""

    def __init__(self, num_device: int, num_host: int) -> None:
        self.device: list[object] = [None] * num_device
        self.host: list[object] = [None] * num_host

    def backup(self, device: np.ndarray, host: np.ndarray) -> None:
        for d, h in zip(device.tolist(), host.tolist(), strict=True):
            assert self.device[d] not in (None, POISON), f"backup of device block {d}: unwritten"
            self.host[h] = self.device[d]

    def load(self, host: np.ndarray, device: np.ndarray) -> None:
        for h, d in zip(host.tolist(), device.tolist(), strict=True):
            self.device[d] = self.host[h]

    def discard(self, device: np.ndarray) -> None:
        for d in device.tolist():
            self.device[d] = POISON


@dataclass
class Request:
    tokens: list[int]
    namespace: object
    blocks: list[int] = field(default_factory=list)


def tier_prefixes(cache: TieredRadixCache) -> tuple[set, set]:
    """(device, any tier): every cached block-aligned prefix as (namespace key, tokens)."""
    device: set = set()
    anywhere: set = set()
    bs = cache.block_size
    for ns_key, root in cache._roots.items():
        stack = [(child, ()) for child in root.children.values()]
        while stack:
            node, before = stack.pop()
            toks = tuple(node.tokens().tolist())
            for i in range(1, len(toks) // bs + 1):
                prefix = (ns_key, before + toks[: i * bs])
                anywhere.add(prefix)
                if node.blocks:
                    device.add(prefix)
            stack.extend((c, before + toks) for c in node.children.values())
    return device, anywhere


def longest(prefixes: set, ns_key: object, tokens: list[int], bs: int) -> int:
    for k in range(len(tokens) // bs, 0, -1):
        if (ns_key, tuple(tokens[: k * bs])) in prefixes:
            return k * bs
    return 0


class HostTierMachine(RuleBasedStateMachine):
    requests = Bundle("requests")

    @initialize(
        block_size=st.sampled_from([1, 2, 4]),
        num_device=st.integers(4, 24),
        num_host=st.integers(1, 48),
        policy=st.sampled_from(["write_back", "write_through"]),
        hits=st.integers(0, 2),
        eviction=st.sampled_from(["lru", "level", "lfu"]),
        host_eviction=st.sampled_from(["lru", "fifo"]),
    )
    def setup(self, block_size, num_device, num_host, policy, hits, eviction, host_eviction):
        self.bs = block_size
        self.alloc = BlockAllocator(num_device, block_size)
        self.host = BlockAllocator(num_host, block_size)
        self.kv = ContentCopier(num_device, num_host)
        tier = HostTier(self.host, self.kv, policy, hits, host_eviction)
        self.cache = TieredRadixCache(self.alloc, eviction, host=tier)
        self.refs: Counter[int] = Counter()
        note(f"bs={block_size} device={num_device} host={num_host} {policy}/{hits} {eviction}")

    def expect_contents(self, blocks: list[int], tokens: list[int], namespace) -> None:
        for i, b in enumerate(blocks):
            want = (namespace, tuple(tokens[: (i + 1) * self.bs]))
            assert self.kv.device[b] == want, f"block {b} at position {i} holds {self.kv.device[b]}"

    @rule(
        target=requests,
        tokens=st.lists(st.integers(0, 3), min_size=0, max_size=14),
        namespace=st.sampled_from(NAMESPACES),
        load=st.booleans(),
        keep=st.booleans(),
    )
    def serve(self, tokens, namespace, load, keep):
        cache, bs = self.cache, self.bs
        device, anywhere = tier_prefixes(cache)
        key = namespace_key(namespace)
        on_device = longest(device, key, tokens, bs)
        in_some_tier = longest(anywhere, key, tokens, bs)
        m = cache.load(tokens, namespace) if load else cache.match(tokens, namespace)
        assert m.num_tokens + m.host_num_tokens == in_some_tier
        if load:
            assert on_device <= m.num_tokens
        else:
            assert m.num_tokens == on_device
        self.expect_contents(m.blocks, tokens, namespace)
        return self.place(list(m.blocks), tokens, namespace, keep)

    def place(self, blocks: list, tokens: list, namespace: object, keep: bool) -> Request:
        """After a match that handed out ``blocks``: evict for the rest (holding them),
        allocate what fits, compute the new blocks, insert, then hold or release."""
        cache, alloc, bs = self.cache, self.alloc, self.bs
        need = len(tokens) // bs - len(blocks)
        if need > alloc.num_free:
            self.refs.update(blocks)  # held while evicting, as the engine's would be
            cache.evict(need - alloc.num_free)
            self.refs.subtract(blocks)
        start = len(blocks)
        blocks += alloc.alloc(min(need, alloc.num_free))
        self.compute(blocks, start, tokens, namespace)
        n = len(blocks) * bs
        cache.insert(tokens[:n], blocks, namespace)
        req = Request(tokens[:n], namespace, blocks)
        if keep:
            self.refs.update(blocks)
        else:
            alloc.decref(blocks)
            req.blocks = []
        return req

    def compute(self, blocks: list, start: int, tokens: list, namespace: object) -> None:
        """Write what ``blocks[start:]`` (just allocated) hold: their position's tokens."""
        for i in range(start, len(blocks)):
            self.kv.device[blocks[i]] = (namespace, tuple(tokens[: (i + 1) * self.bs]))

    @rule(req=consumes(requests))
    def release(self, req):
        if req.blocks:
            self.alloc.decref(req.blocks)
            self.refs.subtract(req.blocks)

    @rule(n=st.integers(0, 30))
    def evict(self, n):
        before = self.alloc.num_free
        freed = self.cache.evict(n)
        assert self.alloc.num_free == before + freed

    @rule(n=st.integers(0, 30))
    def evict_host(self, n):
        before = self.host.num_free
        freed = self.cache.evict_host(n)
        assert self.host.num_free == before + freed

    @rule()
    def reset(self):
        self.cache.reset()
        assert self.host.num_free == self.host.num_blocks

    @invariant()
    def consistent(self):
        if not hasattr(self, "cache"):
            return
        self.cache.check()
        expected = np.zeros(self.alloc.num_blocks, dtype=np.int64)
        expected[self.cache.held_blocks()] += 1
        for b, n in self.refs.items():
            expected[b] += n
        assert (self.alloc.refcount_array == expected).all()

    def teardown(self):
        if not hasattr(self, "cache"):
            return
        self.cache.reset()
        for b, n in self.refs.items():
            for _ in range(n):
                self.alloc.decref([b])
        assert self.alloc.num_free == self.alloc.num_blocks
        assert self.host.num_free == self.host.num_blocks


HostTierMachine.TestCase.settings = settings(
    max_examples=150, stateful_step_count=30, deadline=None
)
TestHostTier = HostTierMachine.TestCase
