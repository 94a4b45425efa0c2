"""The exceptions every tier shares: broken invariants and arguments of the wrong type.

A leaf module: it imports nothing from radixkv, so every tier may import it.
"""

from __future__ import annotations

__all__ = ["ArgumentTypeError", "InvariantError", "invariant"]


class InvariantError(AssertionError):
    """Raised by ``check()`` when a structure breaks an invariant; the message names which.

    A subclass of ``AssertionError`` so that code catching what ``check()``
    used to raise keeps working, but raised explicitly: ``python -O`` does not
    turn it off.
    """


def invariant(ok: object, message: str) -> None:
    """Raise ``InvariantError(message)`` unless ``ok`` is true (``check()``'s ``assert``)."""
    if not ok:
        raise InvariantError(message)


class ArgumentTypeError(TypeError, ValueError):
    """An argument of the wrong type (a float or a bool where an int belongs, ...).

    Both a ``TypeError`` (what it is) and a ``ValueError`` (what a caller
    validating "a bad argument" catches): an argument of the wrong type is one
    bad value among others, so callers need not catch two classes.
    """
