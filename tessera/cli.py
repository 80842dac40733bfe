"""`tessera`: the user's command line.

Each subcommand lives in its own module exposing ``register(subparsers)``; the module sets
``func`` on its parser, which receives the parsed arguments and returns the exit status.
"""

from __future__ import annotations

import argparse
import importlib
import sys
from collections.abc import Sequence

# Subcommand name -> module. Imported only when the subcommand list is built, so a command's heavy
# dependencies (matplotlib for simulate) load only for that command.
SUBCOMMANDS: dict[str, str] = {
    "simulate": "tessera.simulate.command",
    "sandbox": "tessera.sandbox.command",
}


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="tessera", description="Fractional GPU sharing for Kubernetes.")
    subparsers = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    for module_name in SUBCOMMANDS.values():
        importlib.import_module(module_name).register(subparsers)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    status: int = args.func(args)
    return status


if __name__ == "__main__":
    sys.exit(main())
