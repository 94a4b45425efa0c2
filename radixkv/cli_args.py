"""What every ``radixkv`` subcommand's parser shares: numeric argument types and one-line errors.

The types are argparse ``type=`` functions: a bad value becomes argparse's own usage
error, ``argument --flag: must be >= 1, got 0``, before the command does any work.
``one_line_errors`` makes those errors a single line on stderr with exit code 2
(``EXIT_USAGE``, argparse's code); ``fail`` prints one such line for a problem found
after parsing, and ``output_problem`` finds one for an output file. A leaf module: it
imports nothing from radixkv, so every tier's command line (``radixkv replay``,
``route-sim``, ``serve``, the demo) may import it.
"""

from __future__ import annotations

import argparse
import math
import os
import sys
from collections.abc import Callable
from typing import NoReturn

__all__ = [
    "EXIT_USAGE",
    "fail",
    "int_in",
    "nonneg_int",
    "one_line_errors",
    "open_unit_float",
    "output_problem",
    "positive_int",
]

EXIT_USAGE = 2


def fail(prog: str, message: object) -> int:
    """Print ``PROG: error: MESSAGE`` as one line on stderr; return ``EXIT_USAGE``."""
    print(f"{prog}: error: {' '.join(str(message).split())}", file=sys.stderr)
    return EXIT_USAGE


def int_in(low: int, high: int | None = None) -> Callable[[str], int]:
    """An argparse type: a base-10 int in ``[low, high]`` (no upper bound when ``high`` is None).

    Raises ``argparse.ArgumentTypeError`` with the value and the bound that failed.
    """

    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected an integer, got {text!r}") from None
        if value < low:
            raise argparse.ArgumentTypeError(f"must be >= {low}, got {value}")
        if high is not None and value > high:
            raise argparse.ArgumentTypeError(f"must be <= {high}, got {value}")
        return value

    parse.__name__ = f"int_in({low}, {high})"
    return parse


positive_int = int_in(1)
nonneg_int = int_in(0)


def open_unit_float(text: str) -> float:
    """An argparse type: a float strictly between 0 and 1 (so never NaN or infinite)."""
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a number, got {text!r}") from None
    if not (math.isfinite(value) and 0.0 < value < 1.0):
        raise argparse.ArgumentTypeError(f"must be in (0, 1), got {text!r}")
    return value


def one_line_errors(parser: argparse.ArgumentParser) -> None:
    """Make ``parser``'s usage errors one line on stderr, exit code 2 (argparse's own code)."""

    def error(message: str) -> NoReturn:
        fail(parser.prog, message)
        sys.exit(EXIT_USAGE)

    parser.error = error  # type: ignore[method-assign]

    # A subcommand's unknown options would otherwise travel up to the top-level parser,
    # whose error names the wrong program; reject them here.
    parse_known_args = parser.parse_known_args

    def parse_strict(
        args: list[str] | None = None, namespace: argparse.Namespace | None = None
    ) -> tuple[argparse.Namespace, list[str]]:
        namespace, extras = parse_known_args(args, namespace)
        if extras:
            error(f"unrecognized arguments: {' '.join(extras)}")
        return namespace, extras

    parser.parse_known_args = parse_strict  # type: ignore[method-assign]


def output_problem(flag: str, path: str, suffix: str) -> str | None:
    """Why ``path`` cannot take ``flag``'s output (a ``suffix`` file), or None if it can."""
    if not path.lower().endswith(suffix):
        return f"{flag}: the file name must end in {suffix}, got {path!r}"
    if os.path.isdir(path):
        return f"{flag}: {path!r} is a directory"
    parent = os.path.dirname(path) or "."
    if not os.path.isdir(parent):
        return f"{flag}: directory {parent!r} does not exist (for {path!r})"
    if not os.access(parent, os.W_OK | os.X_OK):
        return f"{flag}: directory {parent!r} is not writable (for {path!r})"
    if os.path.exists(path) and not os.access(path, os.W_OK):
        return f"{flag}: {path!r} is not writable"
    return None
