"""The ``radixkv`` command line: one subcommand per job, each registered by its own module.

Each module named in ``_COMMAND_MODULES`` has ``register(subparsers)``, which adds its
subcommands with ``set_defaults(func=...)``; ``func(args)`` returns the exit code.
Modules are imported only when present, so the CLI stays light.
"""

from __future__ import annotations

import argparse
import importlib
import sys

_COMMAND_MODULES = ("radixkv.demo", "radixkv.replay.cli")


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="radixkv", description=__doc__.splitlines()[0])
    subparsers = parser.add_subparsers(dest="command", required=True)
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
    args = build_parser().parse_args(argv)
    return int(args.func(args) or 0)


if __name__ == "__main__":
    sys.exit(main())
