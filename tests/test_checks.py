"""radixkv.checks / radixkv.errors: one wording, one rule for bools, types and ranges."""

from __future__ import annotations

import math

import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

from radixkv.checks import (
    check_bool,
    check_int,
    check_ints,
    check_number,
    check_str,
    describe_int,
    describe_number,
    is_int,
    is_number,
)
from radixkv.errors import ArgumentTypeError, InvariantError, invariant


def test_is_int_and_is_number_refuse_bools() -> None:
    assert is_int(3) and is_int(np.int64(3)) and is_int(np.int32(-1))
    assert not is_int(True) and not is_int(np.bool_(True)) and not is_int(3.0) and not is_int("3")
    assert is_number(3) and is_number(2.5) and is_number(np.float32(1.5))
    assert not is_number(False) and not is_number("1") and not is_number(None)


@pytest.mark.parametrize(
    ("low", "high", "text"),
    [
        (None, None, "an int"),
        (1, None, "a positive int"),
        (0, None, "a non-negative int"),
        (4, None, "an int >= 4"),
        (None, 7, "an int <= 7"),
        (0, 7, "an int in [0, 7]"),
    ],
)
def test_describe_int(low: int | None, high: int | None, text: str) -> None:
    assert describe_int(low, high) == text


def test_describe_number() -> None:
    assert describe_number(0, strict=True) == "a positive number"
    assert describe_number(0) == "a non-negative number"
    assert describe_number(1) == "a number >= 1"
    assert describe_number(0.5, strict=True) == "a number > 0.5"
    assert describe_number() == "a finite number"


def test_check_int_returns_a_plain_int() -> None:
    v = check_int("n", np.int64(5), low=1)
    assert v == 5 and type(v) is int
    assert check_int("n", None, low=1, optional=True) is None


def test_check_int_messages_name_argument_and_value() -> None:
    with pytest.raises(ValueError, match=r"^block_size must be a positive int, got 0$"):
        check_int("block_size", 0, low=1)
    with pytest.raises(ArgumentTypeError, match=r"^block_size must be a positive int, got True$"):
        check_int("block_size", True, low=1)
    with pytest.raises(TypeError, match=r"got 2\.5$"):  # a type error is a TypeError ...
        check_int("n", 2.5)
    with pytest.raises(ValueError, match=r"got '3'$"):  # ... and a ValueError
        check_int("n", "3")
    with pytest.raises(ValueError, match=r"^k must be an int in \[0, 3\] or None, got 4$"):
        check_int("k", 4, low=0, high=3, optional=True)


def test_check_ints_names_the_element() -> None:
    assert check_ints("ids", [1, np.int32(2)], low=0) == [1, 2]
    with pytest.raises(ValueError, match=r"^ids\[1\] must be a non-negative int, got -1$"):
        check_ints("ids", [0, -1], low=0)


def test_check_number_bounds_nan_and_infinity() -> None:
    assert check_number("rate", 2, low=0, strict=True) == 2.0
    assert check_number("ttl", math.inf, low=0, strict=True, finite=False) == math.inf
    with pytest.raises(ValueError, match=r"^rate must be a positive number, got 0$"):
        check_number("rate", 0, low=0, strict=True)
    with pytest.raises(ValueError, match="got nan"):
        check_number("rate", math.nan, low=0, finite=False)
    with pytest.raises(ValueError, match="got inf"):
        check_number("x", math.inf)
    with pytest.raises(ArgumentTypeError, match=r"^x must be a number >= 1 or None, got False$"):
        check_number("x", False, low=1, optional=True)


def test_check_bool() -> None:
    assert check_bool("flag", np.bool_(True)) is True
    with pytest.raises(ArgumentTypeError, match=r"^flag must be a bool, got 1$"):
        check_bool("flag", 1)


def test_check_str() -> None:
    assert check_str("topic", "") == "" and check_str("endpoint", None, optional=True) is None
    with pytest.raises(ArgumentTypeError, match=r"^topic must be a str, got b'x'$"):
        check_str("topic", b"x")
    with pytest.raises(TypeError, match=r"^endpoint must be a str or None, got 5$"):
        check_str("endpoint", 5, optional=True)


@given(st.one_of(st.integers(-50, 50), st.floats(allow_nan=True), st.booleans(), st.none()))
def test_check_int_accepts_exactly_the_ints_in_range(value: object) -> None:
    ok = is_int(value) and 0 <= value <= 10  # type: ignore[operator]
    if ok:
        assert check_int("v", value, low=0, high=10) == value
    else:
        with pytest.raises(ValueError):
            check_int("v", value, low=0, high=10)


def test_invariant_raises_even_under_python_o() -> None:
    invariant(True, "fine")
    with pytest.raises(InvariantError, match="broken") as info:
        invariant(0, "broken")
    assert isinstance(info.value, AssertionError)


def test_invariant_error_is_one_class_on_every_public_path() -> None:
    import radixkv
    import radixkv.cache
    import radixkv.cache.allocator
    import radixkv.errors

    assert radixkv.cache.allocator.InvariantError is radixkv.errors.InvariantError
    assert radixkv.cache.InvariantError is radixkv.InvariantError is radixkv.errors.InvariantError
    assert radixkv.cache.allocator.invariant is radixkv.errors.invariant
