"""``as_token_array`` / ``as_block_array``: every input form users pass, converted once and
exactly, or refused with the entry named (issue 14's fast paths: lists through
``array.array``, int64 arrays through one compiled pass)."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

from radixkv.cache.arrays import as_block_array, as_token_array

I32 = np.iinfo(np.int32)
ints = st.integers(I32.min, I32.max)
wide = st.integers(-(2**63), 2**63 - 1)


@given(st.lists(ints, min_size=1, max_size=300))
def test_lists_int64_and_tensors_convert_exactly(values: list[int]) -> None:
    want = np.array(values, dtype=np.int64).astype(np.int32)
    for form in (values, tuple(values), np.array(values, dtype=np.int64)):
        got = as_token_array(form)
        assert got.dtype == np.int32 and got.flags.c_contiguous
        np.testing.assert_array_equal(got, want)
        np.testing.assert_array_equal(as_block_array(form), want)


@given(st.lists(wide, min_size=1, max_size=200))
def test_out_of_int32_is_refused_naming_the_first_bad_entry(values: list[int]) -> None:
    bad = [i for i, v in enumerate(values) if not I32.min <= v <= I32.max]
    for form in (values, np.array(values, dtype=np.int64)):
        if not bad:
            np.testing.assert_array_equal(as_token_array(form), np.array(values, dtype=np.int32))
            continue
        with pytest.raises(ValueError, match=rf"tokens\[{bad[0]}\] is {values[bad[0]]}"):
            as_token_array(form)


def test_int32_bounds_are_accepted_and_one_past_is_not() -> None:
    for form in ([I32.min, I32.max], np.array([I32.min, I32.max], dtype=np.int64)):
        np.testing.assert_array_equal(as_token_array(form), [I32.min, I32.max])
    for v in (I32.max + 1, I32.min - 1):
        with pytest.raises(ValueError, match=r"tokens\[1\]"):
            as_token_array(np.array([0, v], dtype=np.int64))
        with pytest.raises(ValueError, match=r"tokens\[1\]"):
            as_token_array([0, v])


def test_list_fast_path_refuses_what_numpy_would_coerce() -> None:
    """array.array takes __index__ only: floats, strings and None never become ids."""
    with pytest.raises(TypeError, match=r"tokens\[1\] must be an int, got 1.5"):
        as_token_array([1, 1.5])
    with pytest.raises(TypeError, match=r"tokens\[0\] must be an int, got '3'"):
        as_token_array(["3"])
    with pytest.raises(TypeError, match=r"blocks\[2\] must be an int, got None"):
        as_block_array([0, 1, None])
    with pytest.raises(TypeError, match="tokens must be integers, got dtype bool"):
        as_token_array([True, False])  # all bools: numpy's bool array, refused as before
    np.testing.assert_array_equal(as_token_array([np.int64(7), np.int16(2)]), [7, 2])


def test_strided_int64_view_converts() -> None:
    a = np.arange(20, dtype=np.int64)[::3]
    np.testing.assert_array_equal(as_token_array(a), [0, 3, 6, 9, 12, 15, 18])


def test_torch_int64_tensor_converts_and_checks_range() -> None:
    torch = pytest.importorskip("torch")
    np.testing.assert_array_equal(as_token_array(torch.arange(5)), [0, 1, 2, 3, 4])
    with pytest.raises(ValueError, match=r"tokens\[2\] is 4294967296"):
        as_token_array(torch.tensor([1, 2, 2**32]))
