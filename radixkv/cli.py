"""The ``radixkv`` command line: one subcommand per job, each registered by its own module.

Each module named in ``_COMMAND_MODULES`` has ``register(subparsers)``, which adds its
subcommands with ``set_defaults(func=...)``; ``func(args)`` returns the exit code.
Modules are imported only when present, so the CLI stays light. Shared argument
types and the one-line usage errors live in ``radixkv.cli_args``.

Exit codes: 0 success, 2 bad usage or input (one line on stderr, as argparse),
141 (128 + SIGPIPE, what a shell reports for a tool killed by a closed pipe) when
stdout's reader goes away early, e.g. ``radixkv replay ... --per-request | head -c 100``:
the command stops quietly, without a traceback.
"""

from __future__ import annotations

import argparse
import importlib
import importlib.metadata
import os
import sys

from radixkv.cli_args import one_line_errors

__all__ = ["EXIT_BROKEN_PIPE", "build_parser", "main", "version"]

_COMMAND_MODULES = (
    "radixkv.demo",
    "radixkv.replay.cli",
    "radixkv.fleet.cli",
    "radixkv.serve.cli",
)

EXIT_BROKEN_PIPE = 141

# Plain text: argparse prints descriptions verbatim, so no RST markup here.
_DESCRIPTION = (
    "radixkv: radix-tree KV prefix caching for LLM serving. "
    "demo serves multi-turn chats with the cache off and on; "
    "replay and sweep replay Mooncake hash_ids traces through cache policies; "
    "serve runs an OpenAI-compatible HTTP server."
)


def version() -> str:
    """The installed distribution's version, else ``radixkv.__version__``, else ``"unknown"``."""
    try:
        return importlib.metadata.version("radixkv")
    except importlib.metadata.PackageNotFoundError:
        import radixkv

        return getattr(radixkv, "__version__", "unknown")


def build_parser() -> argparse.ArgumentParser:
    """The ``radixkv`` parser with every available subcommand registered."""
    parser = argparse.ArgumentParser(
        prog="radixkv",
        description=_DESCRIPTION,
        epilog="Run 'radixkv COMMAND --help' for a command's options.",
    )
    one_line_errors(parser)
    parser.add_argument("--version", action="version", version=f"radixkv {version()}")
    subparsers = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    for name in _COMMAND_MODULES:
        try:
            module = importlib.import_module(name)
        except ModuleNotFoundError as exc:
            if exc.name is None or not name.startswith(exc.name):
                raise
            continue
        module.register(subparsers)
    return parser


def main(argv: list[str] | None = None) -> int:
    """Parse ``argv`` (default ``sys.argv[1:]``), run the subcommand, return its exit code.

    Usage errors raise ``SystemExit(2)`` (argparse); ``--help`` and ``--version``
    ``SystemExit(0)``. A closed stdout returns ``EXIT_BROKEN_PIPE`` with nothing on stderr.
    """
    try:
        try:
            args = build_parser().parse_args(argv)
            return int(args.func(args) or 0)
        finally:
            # Surface a closed pipe here, not in the interpreter's final flush.
            sys.stdout.flush()
    except BrokenPipeError:
        # Python's documented recipe: point stdout at devnull so the exit flush
        # cannot fail again and print "Exception ignored ... BrokenPipeError".
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())
        return EXIT_BROKEN_PIPE


if __name__ == "__main__":
    sys.exit(main())
