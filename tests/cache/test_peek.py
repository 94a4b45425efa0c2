"""``peek`` has no side effects: a run that peeks is indistinguishable from one that does not.

Two identical setups (allocator + cache) run the same random serving-loop
operations in lock step; one of them also peeks before every operation and at
random extra probes (other namespaces, one never used). After every operation
both must agree on everything observable: the refcount array, the free count,
``stats``, ``held_blocks()``, ``cached_blocks``, ``evictable_blocks``, the
tree's node count (a split would change it), and the
result of the operation itself (matched blocks, insert results, the blocks
``alloc`` hands out, which blocks ``evict`` frees). At the end both are
drained one ``evict(1)`` at a time, so the eviction order itself is compared.
And every peek equals the ``num_tokens`` of a ``match`` of the same query.
"""

from __future__ import annotations

from collections.abc import Callable

import pytest
from hypothesis import given
from hypothesis import strategies as st

from radixkv import BlockAllocator, HashBlockCache, NullCache, RadixCache
from radixkv.cache.prefix_cache import PrefixCache

CACHES: dict[str, Callable[[BlockAllocator], PrefixCache]] = {
    "radix-level": lambda a: RadixCache(a, eviction="level"),
    "radix-lru": lambda a: RadixCache(a, eviction="lru"),
    "hash-sha256": lambda a: HashBlockCache(a, hash_fn="sha256", hash_seed=0),
    "hash-builtin": lambda a: HashBlockCache(a, hash_fn="builtin", hash_seed=0),
    "null": NullCache,
}
NAMESPACES = [None, "a", ("tenant", 2)]
NUM_BLOCKS = 20

tokens = st.lists(st.integers(0, 3), max_size=16)
namespace = st.sampled_from(NAMESPACES)
# An extra peek: the tokens of an earlier serve (all of them, or a prefix), so it often hits
# a cached path the next op does not touch, under that serve's namespace, another one, or one
# never used.
probe = st.tuples(
    st.integers(0, 24),
    st.none() | st.integers(0, 16),
    st.sampled_from(["same", "same", *NAMESPACES, "never-used"]),
)
ops = st.lists(
    st.tuples(
        # serve twice as likely, reset half as likely: the trees grow before they are dropped
        st.sampled_from(["serve"] * 4 + ["hold", "match", "release", "evict"] * 2 + ["reset"]),
        tokens,
        namespace,
        st.integers(0, 8),
        st.lists(probe, max_size=3),  # extra peeks before this op, in the peeking run only
    ),
    max_size=25,
)


class Run:
    """One allocator + cache and the references its simulated requests hold."""

    def __init__(self, kind: str, block_size: int) -> None:
        self.alloc = BlockAllocator(num_blocks=NUM_BLOCKS, block_size=block_size)
        self.cache = CACHES[kind](self.alloc)
        self.held: list[list[int]] = []

    def state(self) -> tuple:
        alloc, cache = self.alloc, self.cache
        return (
            alloc.refcount_array.tolist(),
            alloc.num_free,
            cache.stats,
            cache.held_blocks().tolist(),
            cache.cached_blocks,
            cache.evictable_blocks,
            getattr(cache, "num_nodes", None),  # the tree's: a split would show here
        )

    def apply(self, op: str, seq: list[int], ns: object, k: int) -> object:
        """Do one operation; return everything it produced, for comparison."""
        alloc, cache = self.alloc, self.cache
        if op == "evict":
            before = set(cache.held_blocks().tolist())
            freed = cache.evict(k)
            return freed, sorted(before - set(cache.held_blocks().tolist()))
        if op == "reset":
            cache.reset()
            return None
        if op == "release":
            if not self.held:
                return None
            blocks = self.held.pop(k % len(self.held))
            return alloc.decref(blocks), blocks
        m = cache.match(seq, namespace=ns)
        if op == "match":
            self.held.append(m.blocks)
            return m.blocks, m.num_tokens
        # serve / hold: one request's life (hold keeps its references, as a running request)
        need = len(seq) // alloc.block_size - len(m.blocks)
        evicted = cache.evict(need - alloc.num_free) if need > alloc.num_free else 0
        if need > alloc.num_free:
            alloc.decref(m.blocks)  # no room: preempted
            return m.blocks, evicted, None
        new = alloc.alloc(need)
        cached = cache.insert(seq, m.blocks + new, namespace=ns)
        if op == "hold":
            self.held.append(m.blocks + new)
        else:
            alloc.decref(m.blocks + new)
        return m.blocks, evicted, new, cached


def peek_checked(run: Run, seq: list[int], ns: object) -> int:
    """``peek``, asserting it changed nothing observable."""
    before = run.state()
    got = run.cache.peek(seq, namespace=ns)
    assert run.state() == before, ("peek changed state", seq, ns)
    assert got % run.alloc.block_size == 0 and 0 <= got <= len(seq)
    return got


@pytest.mark.parametrize("kind", sorted(CACHES))
@given(block_size=st.sampled_from([1, 2, 4]), ops=ops, last_probes=st.lists(probe, max_size=4))
def test_peek_changes_nothing_and_agrees_with_match(
    kind: str, block_size: int, ops: list, last_probes: list
) -> None:
    plain, peeking = Run(kind, block_size), Run(kind, block_size)
    served: list[tuple[list[int], object]] = []

    def extra_peek(i: int, cut: int | None, p_ns: object) -> None:
        if served:
            p_seq, ns = served[i % len(served)]
            peek_checked(peeking, p_seq[:cut], ns if p_ns == "same" else p_ns)

    for op, seq, ns, k, probes in ops:
        for p in probes:
            extra_peek(*p)
        expect = peek_checked(peeking, seq, ns)
        out = plain.apply(op, seq, ns, k)
        assert peeking.apply(op, seq, ns, k) == out, (op, seq, ns, k)
        if op in ("match", "serve", "hold"):
            assert expect == len(out[0]) * block_size  # peek == match(t).num_tokens
            served.append((seq, ns))
        assert peeking.state() == plain.state(), (op, seq, ns, k)
        peeking.cache.check()
    for p in last_probes:  # right before the drain, where no later op masks what they touch
        extra_peek(*p)
    # Drain: both must evict the same blocks in the same order.
    for run in (plain, peeking):
        for blocks in run.held:
            run.alloc.decref(blocks)
        run.held.clear()
    while plain.cache.cached_blocks:
        out = plain.apply("evict", [], None, 1)
        assert peeking.apply("evict", [], None, 1) == out
        assert out[0] >= 1  # nothing is held, so every step frees something
        assert peeking.state() == plain.state()
    assert peeking.cache.cached_blocks == 0
    assert peeking.alloc.num_free == peeking.alloc.num_blocks
