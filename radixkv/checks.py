"""Argument checks with one wording: ``{name} must be {what}, got {value!r}``.

Every public entry point checks its arguments before it changes any state;
these helpers are the one implementation of the common checks. Wrong type:
``ArgumentTypeError`` (a ``TypeError`` and a ``ValueError``); right type, out of
range: ``ValueError``. ``bool`` is never accepted as an int or a number (it is
one in Python, and ``True`` where a block count belongs is always a bug);
numpy integers and floats are. Each check returns the value (as a plain
``int`` / ``float``) so that a constructor can check and store in one line.

A leaf module: it imports only numpy, so every tier may import it.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import numpy as np

from radixkv.errors import ArgumentTypeError

__all__ = [
    "FLOAT32_MAX",
    "FLOAT32_TINY",
    "check_bool",
    "check_int",
    "check_ints",
    "check_number",
    "check_str",
    "describe_int",
    "describe_number",
    "is_int",
    "is_number",
]

_INT_TYPES = (int, np.integer)
_NUMBER_TYPES = (int, float, np.integer, np.floating)
FLOAT32_TINY = float(np.finfo(np.float32).tiny)
"""float32's smallest normal magnitude (about 1.18e-38): below it a value is subnormal,
which a GPU may flush to 0."""
FLOAT32_MAX = float(np.finfo(np.float32).max)
"""float32's largest magnitude (about 3.40e38): above it a value becomes infinity."""


def is_int(value: object) -> bool:
    """True for ``int`` and numpy integers, False for ``bool`` and everything else."""
    return isinstance(value, _INT_TYPES) and not isinstance(value, (bool, np.bool_))


def is_number(value: object) -> bool:
    """True for ints, floats and their numpy kinds, False for ``bool`` and everything else."""
    return isinstance(value, _NUMBER_TYPES) and not isinstance(value, (bool, np.bool_))


def describe_int(low: int | None = None, high: int | None = None) -> str:
    """The wording for an int in ``[low, high]``: "a positive int", "an int in [0, 7]", ..."""
    if low is None and high is None:
        return "an int"
    if high is None:
        return {0: "a non-negative int", 1: "a positive int"}.get(low, f"an int >= {low}")
    if low is None:
        return f"an int <= {high}"
    return f"an int in [{low}, {high}]"


def describe_number(
    low: float | None = None, *, strict: bool = False, finite: bool = True, float32: bool = False
) -> str:
    """The wording for a number above ``low``: "a positive number", "a number >= 1", ...;
    with ``float32``, the float32 range it must lie in too."""
    if low is None:
        what = "a finite number" if finite else "a number"
    elif low == 0:
        what = "a positive number" if strict else "a non-negative number"
    else:
        what = f"a number {'>' if strict else '>='} {low}"
    if float32:
        zero = "" if low == 0 and strict else "0 or "
        span = f"[{FLOAT32_TINY:.3g}, {FLOAT32_MAX:.3g}]"
        what += f" that float32 holds ({zero}a magnitude in {span})"
    return what


def check_int(
    name: str,
    value: object,
    *,
    low: int | None = None,
    high: int | None = None,
    optional: bool = False,
) -> int | None:
    """``value`` as an ``int`` if it is an int in ``[low, high]`` (``None`` too if ``optional``).

    Raises ``ArgumentTypeError`` for a non-int (bool included), ``ValueError``
    out of range; the message names ``name`` and the value. O(1).
    """
    if type(value) is int and (low is None or value >= low) and (high is None or value <= high):
        return value  # the common case first: one type test, no isinstance chain
    if value is None and optional:
        return None
    if not is_int(value):
        raise ArgumentTypeError(_message(name, describe_int(low, high), optional, value))
    if (low is not None and value < low) or (high is not None and value > high):
        raise ValueError(_message(name, describe_int(low, high), optional, value))
    return int(value)


def check_ints(
    name: str, values: Sequence[object], *, low: int | None = None, high: int | None = None
) -> list[int]:
    """Each element of ``values`` checked as by ``check_int``, named ``name[i]``. O(len)."""
    return [check_int(f"{name}[{i}]", v, low=low, high=high) for i, v in enumerate(values)]


def check_number(
    name: str,
    value: object,
    *,
    low: float | None = None,
    strict: bool = False,
    finite: bool = True,
    float32: bool = False,
    optional: bool = False,
) -> float | None:
    """``value`` as a ``float`` if it is a number above ``low`` (``> low`` if ``strict``).

    NaN never passes; infinity passes only with ``finite=False``. With ``float32``, a
    value a float32 tensor cannot hold as it is does not pass either: a magnitude above
    :data:`FLOAT32_MAX` (it would be infinity) or a nonzero one below
    :data:`FLOAT32_TINY` (subnormal or 0). Raises ``ArgumentTypeError`` for a non-number
    (bool included), ``ValueError`` out of range; the message names ``name`` and the
    value. O(1).
    """
    if value is None and optional:
        return None
    what = describe_number(low, strict=strict, finite=finite, float32=float32)
    if not is_number(value):
        raise ArgumentTypeError(_message(name, what, optional, value))
    x = float(value)
    bad = math.isnan(x) or (finite and math.isinf(x))
    if low is not None:
        bad = bad or (x <= low if strict else x < low)
    if float32 and x != 0.0:
        bad = bad or not FLOAT32_TINY <= abs(x) <= FLOAT32_MAX
    if bad:
        raise ValueError(_message(name, what, optional, value))
    return x


def check_bool(name: str, value: object) -> bool:
    """``value`` if it is a ``bool`` (numpy's too), else ``ArgumentTypeError``. O(1)."""
    if not isinstance(value, (bool, np.bool_)):
        raise ArgumentTypeError(_message(name, "a bool", False, value))
    return bool(value)


def check_str(name: str, value: object, *, optional: bool = False) -> str | None:
    """``value`` if it is a ``str`` (``None`` too if ``optional``), else ``ArgumentTypeError``.

    O(1).
    """
    if value is None and optional:
        return None
    if not isinstance(value, str):
        raise ArgumentTypeError(_message(name, "a str", optional, value))
    return value


def _message(name: str, what: str, optional: bool, value: object) -> str:
    return f"{name} must be {what}{' or None' if optional else ''}, got {value!r}"
