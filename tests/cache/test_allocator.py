"""BlockAllocator: refcounts, free list, errors that change nothing; the array converters."""

import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

from radixkv import BlockAllocator, OutOfBlocks
from radixkv.cache.arrays import as_block_array, as_token_array, common_prefix_len


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


@pytest.mark.parametrize(
    "kwargs",
    [
        {"num_blocks": 0, "block_size": 1},
        {"num_blocks": 4, "block_size": 0},
        {"num_blocks": 4.0, "block_size": 1},
    ],
)
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


@given(
    st.lists(
        st.tuples(
            st.sampled_from(["alloc", "incref", "decref"]), st.integers(0, 5), st.integers(0, 50)
        ),
        max_size=60,
    )
)
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


# ------------------------------------------------- arrays: the converters
CONVERTERS = [as_token_array, as_block_array]


@pytest.mark.parametrize("convert", CONVERTERS)
def test_converters_fast_path_returns_the_array_itself(convert) -> None:
    arr = np.array([3, 1, 2], dtype=np.int32)
    assert convert(arr) is arr
    view = np.arange(10, dtype=np.int32)[::2]  # not contiguous: copied into one that is
    out = convert(view)
    assert out.flags.c_contiguous and out.tolist() == [0, 2, 4, 6, 8]
    assert convert([]).dtype == np.int32 and convert([]).size == 0


@pytest.mark.parametrize("convert", CONVERTERS)
@pytest.mark.parametrize(
    "bad, exc",
    [
        ("abc", TypeError),
        (b"ab", TypeError),
        ([1.5, 2.0], TypeError),
        (np.zeros((2, 2), dtype=np.int64), ValueError),
        (np.array([2**31]), ValueError),
        (np.array([-(2**31) - 1]), ValueError),
        (None, TypeError),
    ],
)
def test_converters_reject_the_same_bad_input(convert, bad: object, exc: type) -> None:
    with pytest.raises(exc):
        convert(bad)


def test_converters_detect_torch_tensors_the_same_way() -> None:
    torch = pytest.importorskip("torch")
    for dtype in (torch.int64, torch.int32, torch.int16, torch.uint8):
        t = torch.tensor([5, 6, 7], dtype=dtype)
        for convert in CONVERTERS:
            out = convert(t)
            assert out.dtype == np.int32 and out.tolist() == [5, 6, 7]
    for bad, exc in (
        (torch.tensor([1.0, 2.0]), TypeError),
        (torch.tensor([True, False]), TypeError),
        (torch.tensor([1, 2], dtype=torch.complex64), TypeError),
        (torch.zeros(2, 2, dtype=torch.long), ValueError),
        (torch.tensor([2**40]), ValueError),
    ):
        for convert in CONVERTERS:
            with pytest.raises(exc):
                convert(bad)


def test_a_tensor_lookalike_is_not_a_tensor() -> None:
    # Detection is isinstance(x, torch.Tensor), not duck typing or a module name.
    class Fake:
        __module__ = "torch"

        def detach(self):
            return self

        def cpu(self):
            return self

        def numpy(self):
            return np.array([1, 2], dtype=np.int32)

    with pytest.raises(TypeError):
        as_token_array(Fake())
    with pytest.raises(TypeError):
        as_block_array(Fake())


def test_block_arrays_take_ordered_sequences_of_ints() -> None:
    assert as_block_array(range(3)).tolist() == [0, 1, 2]
    assert as_block_array(np.array([1, 2], dtype=np.uint64)).tolist() == [1, 2]
    for unordered in ((b for b in (4, 5)), {4, 5}, {4: 0, 5: 0}, iter([4, 5])):
        with pytest.raises(TypeError, match="blocks must be an ordered sequence"):
            as_block_array(unordered)  # a block table's order is its positions' order
    with pytest.raises(TypeError):
        as_token_array(range(3))  # tokens: a list, tuple, array or tensor only


@given(
    a=st.lists(st.integers(-3, 3), max_size=20),
    b=st.lists(st.integers(-3, 3), max_size=20),
    shared=st.lists(st.integers(-(2**31), 2**31 - 1), max_size=20),
)
def test_common_prefix_len_matches_a_python_oracle(a: list, b: list, shared: list) -> None:
    a, b = shared + a, shared + b
    want = next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))
    assert common_prefix_len(as_token_array(a), as_token_array(b)) == want
    assert common_prefix_len(as_token_array(b), as_token_array(a)) == want


def test_common_prefix_len_takes_int32_arrays_only() -> None:
    ok = np.array([1, 2], dtype=np.int32)
    for bad in ([1, 2], np.array([1, 2], dtype=np.int64), np.zeros((1, 2), dtype=np.int32)):
        with pytest.raises(TypeError):
            common_prefix_len(bad, ok)  # type: ignore[arg-type]
        with pytest.raises(TypeError):
            common_prefix_len(ok, bad)  # type: ignore[arg-type]
