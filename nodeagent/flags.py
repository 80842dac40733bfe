"""The flags every binary on a node takes (tessera-device-plugin, tessera-mps-control, tessera-dra),
each declared here once, and the host paths they default to."""

from __future__ import annotations

import argparse
from collections.abc import Mapping
from pathlib import Path

from tessera.cliargs import add_domain, add_kubeconfig, seconds
from tessera.contract import ContractError, ContractKeys, keys_for

DEFAULT_HOOK_LIBRARY = Path("/usr/local/tessera/libvgpu.so")
DEFAULT_STATE_DIR = Path("/var/lib/tessera")


def add_node_flags(p: argparse.ArgumentParser, environ: Mapping[str, str]) -> None:
    """The node's name, the domain, the agent's state dir and the kubeconfig."""
    env = environ.get
    p.add_argument("--node-name", default=env("NODE_NAME"), help="this node's name (env NODE_NAME)")
    add_domain(p, environ)
    p.add_argument(
        "--state-dir",
        type=Path,
        default=Path(env("TESSERA_STATE_DIR", str(DEFAULT_STATE_DIR))),
        help="the node agent's host dir for per-container (or per-claim) limits, accounting state and "
        "records, and the MPS daemon's files under its mps/ (env TESSERA_STATE_DIR)",
    )
    add_kubeconfig(p, env("KUBECONFIG") or None, "env KUBECONFIG; in-cluster config when unset")


def node_keys(p: argparse.ArgumentParser, args: argparse.Namespace) -> ContractKeys:
    """The node flags checked (:func:`add_node_flags`): the domain's keys; exits naming the flag."""
    if not args.node_name:
        p.error("--node-name (or env NODE_NAME) is required")
    try:
        return keys_for(args.domain)
    except ContractError as e:
        p.error(f"--domain: {e}")


def add_hook_library_flag(p: argparse.ArgumentParser, environ: Mapping[str, str]) -> None:
    """Where the hook is on the host, for the agents that mount it into containers."""
    p.add_argument(
        "--hook-library",
        type=Path,
        default=Path(environ.get("TESSERA_HOOK_LIBRARY", str(DEFAULT_HOOK_LIBRARY))),
        help="host path of libvgpu.so (env TESSERA_HOOK_LIBRARY)",
    )


def add_health_poll_flag(p: argparse.ArgumentParser, environ: Mapping[str, str]) -> None:
    """How often the agents check that each GPU is still there (:mod:`nodeagent.health`)."""
    p.add_argument(
        "--health-poll-seconds",
        type=seconds,
        default=environ.get("TESSERA_HEALTH_POLL_SECONDS", "5"),
        help="how often every GPU is checked for presence (default 5)",
    )
