"""The sandbox's further nodes (`up --nodes N`): each a real kubelet with its own containerd and
kube-proxy, joined to the one control plane, the way kind runs nodes but with no container engine.

A further node lives in two namespaces of its own. Its network namespace (``ip netns``) is linked to
the host by a veth pair and has its own address on the node network, its own pod bridge and subnet
(routed through the host, so pods on different nodes reach each other and the control plane) and
its own iptables, where its kube-proxy writes. Its mount namespace, held by one process
(:func:`start_holder`), shows the node's own directory at the sandbox layout's ``node_root`` and
its own directories at the host paths the kubelet and containerd use whatever they are told: every
node names the same paths (configuration, the chart's hostPaths), as every kind node names
/var/lib/kubelet. Its pods' cgroups are under a subtree of its own.

The first node is the host's (its network and mounts), as a single-node sandbox always was. A
further node's processes run through :func:`enter`; stopping the node (:func:`kill_node`) kills
them, the containers' shims and every process of its pods, as a power loss would, and ends the
mount namespace (what a reboot loses); its network namespace, the cable, stays until `down`.

Addresses: the first node's pods have ``POD_SUBNET``; node ``i`` (1, 2, ...) has ``10.245.i.2`` on
the node network (the host's end ``10.245.i.1``) and pods in ``10.244.(77+i).0/24``.
"""

from __future__ import annotations

import contextlib
import os
import re
import subprocess
from dataclasses import dataclass
from pathlib import Path

from sandbox.layout import CGROUP_ROOT, HOST_NODE_PATHS, POD_SUBNET, Layout
from sandbox.processes import Started, start, wait_for

# The first further node's pod subnet is the one after the first node's.
_FIRST_POD_OCTET = int(POD_SUBNET.split(".")[2])
MAX_NODES = 255 - _FIRST_POD_OCTET
# The iptables chain `partition` fills in a node's network namespace; `heal` flushes it.
PARTITION_CHAIN = "TESSERA-PARTITION"
HOLDER = "tessera-node-holder"
NODE_NAME = re.compile(r"^[a-z0-9]([-a-z0-9]*[a-z0-9])?$")


class NodeError(RuntimeError):
    """A node could not be made, found or changed; the message says which and why."""


@dataclass(frozen=True, slots=True)
class NodeAddresses:
    """Where further node ``index`` (1 for the second node) is on the node and pod networks."""

    index: int

    def __post_init__(self) -> None:
        if not 1 <= self.index <= MAX_NODES:
            raise NodeError(f"nodes: a sandbox has at most {MAX_NODES + 1} nodes, not {self.index + 1}")

    @property
    def netns(self) -> str:
        return f"tessera-node{self.index}"

    @property
    def host_link(self) -> str:
        """The host's end of the veth pair (interface names have at most 15 characters)."""
        return f"tsnode{self.index}"

    @property
    def host_address(self) -> str:
        return f"10.245.{self.index}.1"

    @property
    def address(self) -> str:
        """The node's InternalIP: its kubelet, kube-proxy and hostNetwork pods listen here."""
        return f"10.245.{self.index}.2"

    @property
    def pod_subnet(self) -> str:
        return f"10.244.{_FIRST_POD_OCTET + self.index}.0/24"


def cgroup_root(node: str) -> str:
    """A further node's kubelet cgroupRoot: inside the sandbox's subtree, which `down` removes."""
    return f"/{CGROUP_ROOT}/nodes/{node}"


def check_name(node: str) -> str:
    if not NODE_NAME.match(node) or len(node) > 63:
        raise NodeError(f"node name {node!r} is not a DNS label (lower-case letters, digits and '-')")
    return node


# --------------------------------------------------------------------------------------------------
# Adapters: ip, the holder process, nsenter, signals.


def _ip(*args: str) -> None:
    done = subprocess.run(["ip", *args], capture_output=True, text=True, check=False)
    if done.returncode != 0:
        raise NodeError(f"ip {' '.join(args)}: {done.stderr.strip()}")


def in_netns(addresses: NodeAddresses, *argv: str) -> list[str]:
    return ["ip", "netns", "exec", addresses.netns, *argv]


def create_network(addresses: NodeAddresses) -> None:
    """The node's network namespace, its link to the host and the routes both ways. The host
    forwards between nodes (``net.ipv4.ip_forward``, put back by `down` from the host snapshot)."""
    a = addresses
    _ip("netns", "add", a.netns)
    _ip("link", "add", a.host_link, "type", "veth", "peer", "name", "eth0", "netns", a.netns)
    _ip("addr", "add", f"{a.host_address}/24", "dev", a.host_link)
    _ip("link", "set", a.host_link, "up")
    _ip("-n", a.netns, "link", "set", "lo", "up")
    _ip("-n", a.netns, "addr", "add", f"{a.address}/24", "dev", "eth0")
    _ip("-n", a.netns, "link", "set", "eth0", "up")
    _ip("-n", a.netns, "route", "add", "default", "via", a.host_address)
    _ip("route", "add", a.pod_subnet, "via", a.address, "dev", a.host_link)
    Path("/proc/sys/net/ipv4/ip_forward").write_text("1")
    subprocess.run(in_netns(a, "sysctl", "-qw", "net.ipv4.ip_forward=1"), check=True)


def network_namespaces() -> list[str]:
    """The sandbox's node network namespaces on this host."""
    out = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True, check=False).stdout
    return [line.split()[0] for line in out.splitlines() if line.startswith("tessera-node")]


def delete_networks() -> None:
    """Every node network namespace (with it its veth pair, the host's routes through it, its pod
    bridge and its iptables)."""
    for name in network_namespaces():
        subprocess.run(["ip", "netns", "del", name], capture_output=True, check=False)


def holder_argv(layout: Layout, node: str, addresses: NodeAddresses) -> list[str]:
    """The process that holds the node's mount namespace: it binds the node's directories, makes
    every mount shared inside the namespace (the kubelet and the chart's Bidirectional mounts need
    that; nothing propagates to the host: the namespace starts private), then idles (``tail -f``, as
    :data:`HOLDER`: its argv names the node's directory, so that `down` finds it like every other
    component)."""
    home = layout.node_home(node)
    binds = [(home / "root", layout.node_root), *((host_dir(layout, node, p), p) for p in HOST_NODE_PATHS)]
    lines = ["set -e"]
    for source, target in binds:
        lines.append(f"mkdir -p '{source}' '{target}'")
        lines.append(f"mount --bind '{source}' '{target}'")
    lines += ["mount --make-rshared /", f"touch '{home}/holder'", f"exec -a {HOLDER} tail -f '{home}/holder'"]
    script = "\n".join(lines)
    # nsenter, not `ip netns exec`: that mounts a sysfs of the network namespace over /sys, which
    # hides the cgroup hierarchies the kubelet and runc need.
    netns = f"--net=/run/netns/{addresses.netns}"
    return ["nsenter", netns, "unshare", "--mount", "--propagation", "private", "--", "bash", "-c", script]


def host_dir(layout: Layout, node: str, path: Path) -> Path:
    """Where the host keeps the node's own directory for a host path (HOST_NODE_PATHS)."""
    return layout.node_home(node) / "host" / path.relative_to("/").as_posix().replace("/", "-")


def start_holder(layout: Layout, node: str, addresses: NodeAddresses, timeout: float = 30.0) -> Started:
    process = start(f"{node}/holder", holder_argv(layout, node, addresses), layout.log(f"{node}-holder"))

    def bound() -> bool:
        """Its binds are made once it runs as HOLDER (its script names HOLDER from the start)."""
        with contextlib.suppress(OSError):
            return Path(f"/proc/{process.pid}/cmdline").read_text().split("\0")[0] == HOLDER
        return False

    wait_for(f"node {node}'s mount namespace", bound, process, timeout)
    return process


def enter(holder: Started) -> list[str]:
    """The argv prefix that runs a command in the node's network and mount namespaces."""
    return ["nsenter", f"--target={holder.pid}", "--mount", "--net", "--"]


def mount_namespace(pid: int) -> str | None:
    with contextlib.suppress(OSError):
        return os.readlink(f"/proc/{pid}/ns/mnt")
    return None


def processes_in(namespace: str) -> list[int]:
    """Every process in this mount namespace (the node's components and its containers' shims)."""
    found = []
    for entry in Path("/proc").iterdir():
        if (
            entry.name.isdigit()
            and int(entry.name) != os.getpid()
            and mount_namespace(int(entry.name)) == namespace
        ):
            found.append(int(entry.name))
    return found


def cgroup_pids(root: str) -> set[int]:
    """Processes in a cgroup subtree (any hierarchy): a node's pods."""
    pids: set[int] = set()
    for hierarchy in Path("/sys/fs/cgroup").iterdir():
        # os.walk, not Path.rglob: a pod's cgroup removed mid-walk is skipped, not raised.
        for directory, _, files in os.walk(hierarchy / root.lstrip("/")):
            if "cgroup.procs" in files:
                with contextlib.suppress(OSError, ValueError):
                    pids.update(int(line) for line in Path(directory, "cgroup.procs").read_text().split())
    return pids


def _partition_rules(api_address: str) -> list[list[str]]:
    """The node's side of a cut: nothing from its kubelet, kube-proxy or pods reaches the control
    plane's address, nothing from it reaches them (the apiserver's calls to the kubelet)."""
    return [
        ["-A", PARTITION_CHAIN, "-d", api_address, "-j", "DROP"],
        ["-A", PARTITION_CHAIN, "-s", api_address, "-j", "DROP"],
    ]


def partition(addresses: NodeAddresses, api_address: str) -> None:
    iptables = in_netns(addresses, "iptables", "-w")
    subprocess.run([*iptables, "-N", PARTITION_CHAIN], capture_output=True, check=False)
    subprocess.run([*iptables, "-F", PARTITION_CHAIN], check=True)
    for rule in _partition_rules(api_address):
        subprocess.run([*iptables, *rule], check=True)
    for chain in ("INPUT", "OUTPUT", "FORWARD"):
        jump = ["-j", PARTITION_CHAIN]
        if subprocess.run([*iptables, "-C", chain, *jump], capture_output=True, check=False).returncode:
            subprocess.run([*iptables, "-I", chain, "1", *jump], check=True)


def heal(addresses: NodeAddresses) -> None:
    subprocess.run(
        [*in_netns(addresses, "iptables", "-w"), "-F", PARTITION_CHAIN], capture_output=True, check=False
    )
