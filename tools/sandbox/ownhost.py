"""A host of its own: a command run in network and mount namespaces of its own, so that a second
sandbox can run beside the first on one machine (the DRA path's sandbox tests beside the device plugin
path's, docs/sandbox.md).

What `up` takes of its host is then the namespaces' own: the loopback ports (the kubelet's 10250),
the pod bridge and its subnet, kube-proxy's iptables chains, the further nodes' network namespaces
(/run/netns), and the host paths the kubelet and containerd use whatever they are told
(layout.HOST_NODE_PATHS). The command sees the host's /run, /var and /opt through overlays whose
upper layers are its own, with a whiteout at each of those paths: they start absent whatever the
host has there, nothing the command writes under the three reaches the host, and nothing the host's
own sandbox writes there reaches the command.

Three things stay the machine's and are told apart otherwise: cgroups, by a subtree of its own
(layout.CGROUP_ROOT, from the environment this sets); processes, which preflight counts only in its
own mount namespace (host.processes_named); and the kernel's global sysctls that every kubelet
writes (host.KUBELET_SYSCTLS), which whoever runs sandboxes side by side writes once before them.

Usage, as root: ``python -m sandbox.ownhost NAME DIR COMMAND [ARG...]``. DIR holds the overlays'
layers (emptied first); the namespaces end with the command and everything started in them.
"""

from __future__ import annotations

import os
import shutil
import stat
import subprocess
import sys
from pathlib import Path

from sandbox.layout import CGROUP_ROOT_ENV, DEFAULT_CGROUP_ROOT, HOST_NODE_PATHS

# Where `ip netns add` names network namespaces: the further nodes' must be this host's only.
NETNS_DIR = Path("/run/netns")
# Absent in the host of its own, whatever the machine has there.
PRIVATE_PATHS = (*HOST_NODE_PATHS, NETNS_DIR)
# Set in the namespaces to the host's name: the second stage of main() runs there.
ENTERED_ENV = "TESSERA_OWN_HOST"
_NAME_CHARS = frozenset("abcdefghijklmnopqrstuvwxyz0123456789-")


class OwnHostError(RuntimeError):
    """The host of its own could not be made; the message says what failed."""


def overlaid(paths: tuple[Path, ...] = PRIVATE_PATHS) -> list[Path]:
    """The top-level directories to overlay: each one that holds a private path."""
    return sorted({Path("/", p.relative_to("/").parts[0]) for p in paths})


def cgroup_root(name: str) -> str:
    """The cgroup subtree of the sandbox in host ``name``."""
    return f"{DEFAULT_CGROUP_ROOT}-{name}"


def prepare(directory: Path, paths: tuple[Path, ...] = PRIVATE_PATHS) -> None:
    """Empty upper and work directories for each overlay, a whiteout (a 0/0 character device, as
    overlayfs writes one) at each private path in its upper layer."""
    shutil.rmtree(directory, ignore_errors=True)
    for top in overlaid(paths):
        (directory / "upper" / top.name).mkdir(parents=True)
        (directory / "work" / top.name).mkdir(parents=True)
    for path in paths:
        whiteout = directory / "upper" / path.relative_to("/")
        whiteout.parent.mkdir(parents=True, exist_ok=True)
        os.mknod(whiteout, stat.S_IFCHR, os.makedev(0, 0))


def _run(*argv: str) -> None:
    done = subprocess.run(argv, capture_output=True, text=True, check=False)
    if done.returncode != 0:
        raise OwnHostError(f"{' '.join(argv)}: {done.stderr.strip() or f'exit {done.returncode}'}")


def enter(directory: Path) -> None:
    """Inside the new namespaces: loopback up, the overlays mounted over the machine's."""
    _run("ip", "link", "set", "lo", "up")
    for top in overlaid():
        upper, work = directory / "upper" / top.name, directory / "work" / top.name
        layers = f"lowerdir={top},upperdir={upper},workdir={work}"
        _run("mount", "-t", "overlay", "overlay", "-o", layers, str(top))


def main(argv: list[str] | None = None) -> int:
    args = sys.argv[1:] if argv is None else argv
    if len(args) < 3:
        print("usage: python -m sandbox.ownhost NAME DIR COMMAND [ARG...]", file=sys.stderr)
        return 2
    name, directory, command = args[0], Path(args[1]).absolute(), args[2:]
    if not name or not set(name) <= _NAME_CHARS:
        print(f"sandbox.ownhost: NAME {name!r}: lower-case letters, digits and '-' only", file=sys.stderr)
        return 2
    try:
        if os.environ.get(ENTERED_ENV) != name:
            if os.geteuid() != 0:
                raise OwnHostError(
                    f"must run as root (uid 0, not {os.geteuid()}): it makes namespaces and mounts"
                )
            prepare(directory)
            env = {**os.environ, ENTERED_ENV: name, CGROUP_ROOT_ENV: cgroup_root(name)}
            unshare = ["unshare", "--mount", "--net", "--propagation", "private"]
            os.execvpe("unshare", [*unshare, sys.executable, "-m", "sandbox.ownhost", *args], env)
        enter(directory)
    except (OSError, OwnHostError) as e:
        print(f"sandbox.ownhost: host {name}: {e}", file=sys.stderr)
        return 1
    try:
        os.execvp(command[0], command)
    except OSError as e:
        print(f"sandbox.ownhost: host {name}: {command[0]}: {e}", file=sys.stderr)
        return 127


if __name__ == "__main__":
    sys.exit(main())
