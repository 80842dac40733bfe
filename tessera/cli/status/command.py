"""`tessera status` and `kubectl tessera status`: the arguments, and the run from them."""

from __future__ import annotations

import argparse
import os
import sys
from collections.abc import Sequence
from typing import Any

from tessera.cli.status.gather import StatusError, collect
from tessera.cli.status.table import render_json, render_table
from tessera.cliargs import add_domain, add_kubeconfig, seconds
from tessera.contract import ContractError, keys_for


def add_arguments(parser: argparse.ArgumentParser) -> None:
    add_kubeconfig(parser, None, "default: $KUBECONFIG or ~/.kube/config")
    parser.add_argument("--context", help="kubeconfig context (default: its current context)")
    parser.add_argument("-o", "--output", choices=("table", "json"), default="table", help="default: table")
    add_domain(parser, os.environ)
    parser.add_argument(
        "--metrics-timeout",
        type=seconds,
        default=3.0,
        help="seconds to wait for each node agent's metrics (through the API server; default 3)",
    )
    parser.add_argument("--no-metrics", action="store_true", help="do not ask the node agents for use")
    parser.add_argument(
        "--color", choices=("auto", "always", "never"), default="auto", help="default: auto (on a TTY)"
    )
    parser.set_defaults(func=run)


def register(subparsers: Any) -> None:
    parser = subparsers.add_parser(
        "status", help="nodes, GPUs, pods on each GPU, and Pending pods with the extender's reason"
    )
    add_arguments(parser)


def run(args: argparse.Namespace) -> int:
    try:
        keys = keys_for(args.domain)
        report = collect(
            args.kubeconfig, args.context, keys, None if args.no_metrics else args.metrics_timeout
        )
    except (StatusError, ContractError) as e:
        print(f"tessera status: {e}", file=sys.stderr)
        return 1
    if args.output == "json":
        render_json(report, sys.stdout)
    else:
        colour = args.color == "always" or (
            args.color == "auto" and sys.stdout.isatty() and "NO_COLOR" not in os.environ
        )
        render_table(report, sys.stdout, colour)
    return 0


def kubectl_main(argv: Sequence[str] | None = None) -> int:
    """`kubectl-tessera`: kubectl runs it as `kubectl tessera status ...`."""
    parser = argparse.ArgumentParser(prog="kubectl tessera", description="Tessera's view of the cluster.")
    subparsers = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    register(subparsers)
    args = parser.parse_args(argv)
    result: int = args.func(args)
    return result
