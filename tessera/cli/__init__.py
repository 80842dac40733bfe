"""`tessera`: the user's command line (``python -m tessera.cli``, or the installed `tessera`).

The product's own subcommand is `status` (``tessera.cli.status``, a package of its own; also installed
as ``kubectl-tessera``).
`simulate` and `sandbox` come from the tools distribution (tools/pyproject.toml), which registers each
under the ``tessera.commands`` entry point group as a ``register(subparsers)`` function. Each module
sets ``func`` on its parser, which receives the parsed arguments and returns the exit status. The
product never imports the tools.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence
from importlib.metadata import entry_points

from tessera.cli.status import command as status_command

COMMAND_GROUP = "tessera.commands"
# Subcommands the tools provide, named in the error when they are not installed.
TOOL_EXTRAS = {"simulate": "simulate", "sandbox": "sandbox"}


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="tessera", description="Fractional GPU sharing for Kubernetes.")
    subparsers = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    status_command.register(subparsers)
    installed = set()
    for entry in sorted(entry_points(group=COMMAND_GROUP), key=lambda e: e.name):
        entry.load()(subparsers)
        installed.add(entry.name)
    for name, extra in TOOL_EXTRAS.items():
        if name not in installed:
            missing = subparsers.add_parser(name, help=f"(not installed: pip install 'tessera[{extra}]')")
            missing.set_defaults(func=lambda _args, name=name, extra=extra: _not_installed(name, extra))
    return parser


def _not_installed(name: str, extra: str) -> int:
    print(f"tessera {name}: not installed; install it with: pip install 'tessera[{extra}]'", file=sys.stderr)
    return 2


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    status: int = args.func(args)
    return status
