"""BlockAllocator: refcounts, free list, errors that change nothing."""

import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

from radixkv import BlockAllocator, OutOfBlocks


def snapshot(a: BlockAllocator) -> tuple:
    return a.num_free, [a.refcount(b) for b in range(a.num_blocks)]


def test_fresh_allocator_hands_out_ascending_ids() -> None:
    a = BlockAllocator(num_blocks=8, block_size=4)
    assert (a.block_size, a.num_blocks, a.num_free) == (4, 8, 8)
    assert a.alloc(3) == [0, 1, 2]
    assert [a.refcount(b) for b in range(4)] == [1, 1, 1, 0]
    assert a.num_free == 5
    a.check()


def test_alloc_zero_and_all() -> None:
    a = BlockAllocator(num_blocks=4, block_size=1)
    assert a.alloc(0) == []
    assert sorted(a.alloc(4)) == [0, 1, 2, 3]
    assert a.num_free == 0


def test_out_of_blocks_allocates_nothing() -> None:
    a = BlockAllocator(num_blocks=4, block_size=2)
    a.alloc(3)
    before = snapshot(a)
    with pytest.raises(OutOfBlocks, match="cannot allocate 2 blocks: only 1 free"):
        a.alloc(2)
    assert snapshot(a) == before


def test_incref_decref_roundtrip_frees_at_zero() -> None:
    a = BlockAllocator(num_blocks=4, block_size=2)
    blocks = a.alloc(2)
    a.incref(blocks)
    assert a.decref(blocks) == 0
    assert a.decref(blocks) == 2
    assert a.num_free == 4
    a.check()


def test_repeated_blocks_count_once_per_occurrence() -> None:
    a = BlockAllocator(num_blocks=4, block_size=2)
    (b,) = a.alloc(1)
    a.incref([b, b])
    assert a.refcount(b) == 3
    assert a.decref([b, b]) == 0
    assert a.decref([b]) == 1


@pytest.mark.parametrize("op", ["incref", "decref"])
def test_free_block_is_value_error_and_nothing_changes(op: str) -> None:
    a = BlockAllocator(num_blocks=4, block_size=2)
    live = a.alloc(2)
    before = snapshot(a)
    with pytest.raises(ValueError, match="not allocated"):
        getattr(a, op)([live[0], 3])
    assert snapshot(a) == before


def test_decref_more_than_held_changes_nothing() -> None:
    a = BlockAllocator(num_blocks=4, block_size=2)
    x, y = a.alloc(2)
    before = snapshot(a)
    with pytest.raises(ValueError, match="more times than its refcount"):
        a.decref([y, x, x])
    assert snapshot(a) == before


@pytest.mark.parametrize("bad", [[-1], [4], [0.5], "ab", [[0]]])
def test_bad_block_ids_rejected(bad: object) -> None:
    a = BlockAllocator(num_blocks=4, block_size=2)
    a.alloc(4)
    with pytest.raises((ValueError, TypeError)):
        a.incref(bad)  # type: ignore[arg-type]


@pytest.mark.parametrize("kwargs", [{"num_blocks": 0, "block_size": 1},
                                    {"num_blocks": 4, "block_size": 0},
                                    {"num_blocks": 4.0, "block_size": 1}])
def test_bad_construction(kwargs: dict) -> None:
    with pytest.raises((ValueError, TypeError)):
        BlockAllocator(**kwargs)


def test_accepts_numpy_and_torch_block_lists() -> None:
    torch = pytest.importorskip("torch")
    a = BlockAllocator(num_blocks=4, block_size=2)
    blocks = a.alloc(2)
    a.incref(np.array(blocks, dtype=np.int64))
    a.incref(torch.tensor(blocks))
    assert [a.refcount(b) for b in blocks] == [3, 3]


@given(st.lists(st.tuples(st.sampled_from(["alloc", "incref", "decref"]),
                          st.integers(0, 5), st.integers(0, 50)), max_size=60))
def test_refcounts_match_a_counter_oracle(ops: list) -> None:
    a = BlockAllocator(num_blocks=8, block_size=1)
    held: list[int] = []  # one entry per reference held
    for op, n, pick in ops:
        if op == "alloc":
            if n > a.num_free:
                with pytest.raises(OutOfBlocks):
                    a.alloc(n)
            else:
                got = a.alloc(n)
                assert not set(got) & set(held)
                held.extend(got)
        elif held:
            chosen = [held[(pick + i) % len(held)] for i in range(min(n, len(held)))]
            if op == "incref":
                a.incref(chosen)
                held.extend(chosen)
            else:
                # remove one reference per occurrence; may legitimately fail if chosen repeats
                counts = {b: held.count(b) for b in set(chosen)}
                if all(chosen.count(b) <= counts[b] for b in counts):
                    freed = a.decref(chosen)
                    for b in chosen:
                        held.remove(b)
                    assert freed == sum(1 for b in set(chosen) if b not in held)
        a.check()
        for b in range(8):
            assert a.refcount(b) == held.count(b)
        assert a.num_free == 8 - len(set(held))
