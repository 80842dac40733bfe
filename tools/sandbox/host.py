"""The host side of the sandbox: can it start here (preflight), what it changes on the host (a
snapshot taken before `up`), and putting everything back (`down`), with a check that nothing is left.

The decisions (:func:`problems`, :func:`sysctls_to_restore`, :func:`host_paths_to_remove`) are plain
functions over plain data; the rest reads and changes the host.
"""

from __future__ import annotations

import contextlib
import json
import os
import shlex
import shutil
import signal
import socket
import subprocess
import time
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path

from sandbox import nodes
from sandbox.layout import (
    BRIDGE,
    CGROUP_ROOT,
    HOST_CNI_STATE,
    HOST_CONTAINERD_RUN,
    HOST_DEVICE_PLUGIN_DIR,
    HOST_KUBELET_DIR,
    HOST_NODE_PATHS,
    NETWORK_NAME,
    Layout,
)

CGROUP_MOUNT = Path("/sys/fs/cgroup")
# cgroup v1 controllers runc and the kubelet need (cpuacct, blkio and hugetlb are optional).
REQUIRED_CONTROLLERS = ("cpu", "cpuset", "memory", "pids", "devices", "freezer")
REQUIRED_PROGRAMS = (
    "containerd", "containerd-shim-runc-v2", "runc", "ctr", "ip", "cc", "busybox",
    "iptables", "iptables-save", "ip6tables", "ip6tables-save",
)  # fmt: skip
CNI_PLUGINS = (Path("/usr/lib/cni/bridge"), Path("/usr/lib/cni/host-local"), Path("/usr/lib/cni/loopback"))
# What the kubelet writes when it starts, protectKernelDefaults being false (pkg/kubelet/cm,
# setupKernelTunables). They are the machine's, not a network namespace's: sandboxes at once on one
# machine (sandbox.ownhost) share them.
KUBELET_SYSCTLS = {
    "vm/overcommit_memory": "1",
    "vm/panic_on_oom": "0",
    "kernel/panic": "10",
    "kernel/panic_on_oops": "1",
    "kernel/keys/root_maxkeys": "1000000",
    "kernel/keys/root_maxbytes": "25000000",
}
# The kubelet's, and the CNI bridge (isGateway) turns on forwarding. kube-proxy is configured to
# leave the last five alone (conntrack: 0, localhostNodePorts: false); they are watched in case it
# does not.
TRACKED_SYSCTLS = (
    *KUBELET_SYSCTLS,
    "net/ipv4/ip_forward",
    "net/ipv4/conf/all/route_localnet",
    "net/netfilter/nf_conntrack_max",
    "net/netfilter/nf_conntrack_tcp_timeout_established",
    "net/netfilter/nf_conntrack_tcp_timeout_close_wait",
    "net/netfilter/nf_conntrack_tcp_be_liberal",
)
# iptables tables kube-proxy (and a kubelet) add KUBE-* chains to, for IPv4 and IPv6.
IPTABLES = (("iptables", "iptables-save"), ("ip6tables", "ip6tables-save"))
IPTABLES_TABLES = ("filter", "nat", "mangle", "raw")
CHAIN_PREFIX = "KUBE-"
MAX_SOCKET_PATH = 107


@dataclass(frozen=True, slots=True)
class HostFacts:
    """What preflight needs to know about the host, gathered by :func:`gather_facts`."""

    uid: int
    cgroup_controllers: frozenset[str]
    missing_programs: tuple[str, ...]
    missing_kubernetes: tuple[str, ...]
    kubernetes_bin: str
    taken_ports: tuple[int, ...]
    running_runtimes: tuple[str, ...]  # "containerd (pid 12)"
    socket_path: str
    already_up: bool
    node_name: str
    node_name_is_loopback: bool
    kube_chains: tuple[str, ...] = ()  # "iptables nat KUBE-SERVICES", before `up`


def problems(facts: HostFacts) -> list[str]:
    """Why the sandbox cannot start here; empty when it can. Each message says what to do."""
    found: list[str] = []
    if facts.uid != 0:
        found.append(
            f"tessera sandbox must run as root (uid 0, not {facts.uid}): it starts containerd and a "
            "kubelet, which create cgroups, mounts and network devices; run it with sudo"
        )
    missing = [c for c in REQUIRED_CONTROLLERS if c not in facts.cgroup_controllers]
    if missing:
        found.append(
            f"cgroups: no {', '.join(missing)} controller under {CGROUP_MOUNT}; "
            "the kubelet and runc need them"
        )
    if facts.missing_programs:
        found.append(
            f"missing programs: {', '.join(facts.missing_programs)}; run hack/install-sandbox-deps.sh as root"
        )
    if facts.missing_kubernetes:
        found.append(
            f"missing Kubernetes binaries in {facts.kubernetes_bin}: {', '.join(facts.missing_kubernetes)}; "
            "run hack/k8s-binaries.sh"
        )
    found.extend(
        f"port {port} on 127.0.0.1 is taken; stop what listens there or pick another port with the flags"
        for port in facts.taken_ports
    )
    found.extend(
        f"{runtime} is already running; the sandbox's containerd and kubelet would share "
        f"{HOST_CONTAINERD_RUN} and {HOST_DEVICE_PLUGIN_DIR} with it. Stop it first"
        for runtime in facts.running_runtimes
    )
    if len(facts.socket_path) > MAX_SOCKET_PATH:
        found.append(
            f"sandbox directory too deep: socket path {facts.socket_path!r} is longer than "
            f"{MAX_SOCKET_PATH} bytes; choose a shorter --dir"
        )
    if not facts.node_name_is_loopback:
        found.append(
            f"node name {facts.node_name!r} does not resolve to 127.0.0.1: the apiserver reaches the "
            "kubelet by its node name (kubectl logs, exec) and the kubelet listens on loopback only; "
            "choose --node with a name that does (this host's name usually does)"
        )
    if facts.kube_chains:
        found.append(
            f"iptables chains of another Kubernetes node exist ({', '.join(facts.kube_chains[:3])}"
            f"{', ...' if len(facts.kube_chains) > 3 else ''}); the sandbox's kube-proxy would share them "
            "and `down` would remove them. Remove them first (kube-proxy --cleanup)"
        )
    if facts.already_up:
        found.append("a sandbox is already up in this directory; run `tessera sandbox down` first")
    return found


def sysctls_to_restore(before: Mapping[str, str], now: Mapping[str, str]) -> dict[str, str]:
    """The sysctls whose value changed since the snapshot, with the value to write back."""
    return {key: value for key, value in before.items() if key in now and now[key] != value}


def host_paths_to_remove(existed_before: Mapping[str, bool]) -> list[Path]:
    """Host directories the sandbox created (they did not exist before `up`)."""
    return [Path(path) for path, existed in existed_before.items() if not existed]


# --------------------------------------------------------------------------------------------------
# Adapters: reading the host.


def cgroup_controllers() -> frozenset[str]:
    """Controllers available in v1 hierarchies (one dir per controller) or the v2 root."""
    found: set[str] = set()
    if CGROUP_MOUNT.is_dir():
        for entry in CGROUP_MOUNT.iterdir():
            if entry.is_dir() and (entry / "cgroup.procs").exists():
                found.update(entry.name.split(","))
    v2 = CGROUP_MOUNT / "cgroup.controllers"
    if v2.exists():
        found.update(v2.read_text().split())
    return frozenset(found)


def resolves_to_loopback(name: str) -> bool:
    try:
        return "127.0.0.1" in {info[4][0] for info in socket.getaddrinfo(name, None, socket.AF_INET)}
    except OSError:
        return False


def port_taken(port: int) -> bool:
    """Whether something listens there. SO_REUSEADDR as Go's listeners set it: connections of a
    stopped kubelet lingering in TIME_WAIT do not keep a new one from binding."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            s.bind(("127.0.0.1", port))
        except OSError:
            return True
        return False


def processes_named(names: Iterable[str]) -> list[tuple[int, str]]:
    """Running processes of these names that share this process's mounts. Not a zombie, which runs
    nothing and shares nothing (a parent that has not reaped its exited containerd yet); not one in
    another mount namespace, which sees other directories at the host paths (another sandbox's in a
    host of its own, sandbox.ownhost; a container's)."""
    wanted = set(names)
    mounts = nodes.mount_namespace(os.getpid())
    found = []
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            with contextlib.suppress(OSError, IndexError):
                comm = (entry / "comm").read_text().strip()
                state = (entry / "stat").read_text().rsplit(")", 1)[1].split()[0]
                if comm in wanted and state != "Z" and nodes.mount_namespace(int(entry.name)) == mounts:
                    found.append((int(entry.name), comm))
    return found


def gather_facts(
    layout: Layout,
    kubernetes_bin: Path,
    kubernetes_binaries: Sequence[str],
    ports: Sequence[int],
    node_name: str,
) -> HostFacts:
    return HostFacts(
        uid=os.geteuid(),
        cgroup_controllers=cgroup_controllers(),
        missing_programs=tuple(
            [p for p in REQUIRED_PROGRAMS if shutil.which(p) is None]
            + [str(p) for p in CNI_PLUGINS if not os.access(p, os.X_OK)]
        ),
        missing_kubernetes=tuple(
            b for b in kubernetes_binaries if not os.access(kubernetes_bin / b, os.X_OK)
        ),
        kubernetes_bin=str(kubernetes_bin),
        taken_ports=tuple(p for p in ports if port_taken(p)),
        running_runtimes=tuple(
            f"{name} (pid {pid})" for pid, name in processes_named(("containerd", "kubelet"))
        ),
        socket_path=str(layout.containerd_socket),
        already_up=layout.state_file.exists(),
        node_name=node_name,
        node_name_is_loopback=resolves_to_loopback(node_name),
        kube_chains=tuple(kube_chains()),
    )


def read_sysctls() -> dict[str, str]:
    values = {}
    for key in TRACKED_SYSCTLS:
        with contextlib.suppress(OSError):
            values[key] = (Path("/proc/sys") / key).read_text().strip()
    return values


def take_snapshot(layout: Layout) -> None:
    """Record the host settings `down` restores. Kept from the first `up` if one is on disk."""
    if layout.host_snapshot.exists():
        return
    layout.host_snapshot.write_text(
        json.dumps(
            {"sysctls": read_sysctls(), "existed": {str(p): p.exists() for p in HOST_NODE_PATHS}}, indent=2
        )
    )


# --------------------------------------------------------------------------------------------------
# Adapters: finding and removing what the sandbox left.


def cgroup_dirs() -> list[Path]:
    """The sandbox's cgroup subtree in every hierarchy, deepest first."""
    found: list[Path] = []
    if not CGROUP_MOUNT.is_dir():
        return found
    for hierarchy in [CGROUP_MOUNT, *CGROUP_MOUNT.iterdir()]:
        top = hierarchy / CGROUP_ROOT
        if top.is_dir():
            found.extend(Path(d) for d, _, _ in os.walk(top, topdown=False))
    return found


def create_cgroup_root(path: str = f"/{CGROUP_ROOT}") -> None:
    """A kubelet's cgroupRoot (the sandbox's, or a further node's inside it) must exist in every
    hierarchy before it starts."""
    for hierarchy in CGROUP_MOUNT.iterdir():
        if not (hierarchy / "cgroup.procs").exists():
            continue
        parent = hierarchy
        for part in path.strip("/").split("/"):
            directory = parent / part
            directory.mkdir(exist_ok=True)
            # A new v1 cpuset starts with no CPUs and no memory nodes, so nothing could join it or
            # its children: give it the parent's.
            for name in ("cpuset.cpus", "cpuset.mems"):
                if (parent / name).exists() and not (directory / name).read_text().strip():
                    (directory / name).write_text((parent / name).read_text())
            parent = directory


def cgroup_pids() -> set[int]:
    """Processes anywhere in the sandbox's cgroup subtree (every node's pods)."""
    return nodes.cgroup_pids(f"/{CGROUP_ROOT}")


def cmdline(pid: int) -> list[str]:
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes().decode(errors="replace").split("\0")
    except OSError:
        return []


# What the sandbox runs: these programs, and Python running these modules.
COMPONENT_PROGRAMS = frozenset(
    {
        "containerd",
        "containerd-shim-runc-v2",
        "kubelet",
        "etcd",
        "kube-apiserver",
        "kube-scheduler",
        "kube-controller-manager",
        "kube-proxy",
        "coredns",
        nodes.HOLDER,
    }
)
COMPONENT_MODULES = frozenset({"extender.main", "deviceplugin.main", "sandbox.fakenode"})


def is_component(args: Sequence[str], root: str) -> bool:
    """A sandbox component of the sandbox in ``root``: one of its programs with an argument inside
    that directory. (Not any process naming the directory: the `tessera sandbox` command itself, its
    sudo, or a pager on a log are not the sandbox's to kill.)"""
    if not args or not any(a.startswith(root + "/") or f"={root}/" in a for a in args):
        return False
    program = os.path.basename(args[0])
    if program in COMPONENT_PROGRAMS:
        return True
    return program.startswith("python") and any(m in args for m in COMPONENT_MODULES)


def component_processes(layout: Layout) -> set[int]:
    """The sandbox's component processes still running (containerd, kubelet, shims, ...)."""
    root = str(layout.root)
    found = set()
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit() and is_component(cmdline(int(entry.name)), root):
            found.add(int(entry.name))
    return found


def thaw_cgroups() -> None:
    """Thaw the sandbox's frozen cgroups, whose processes would never act on SIGKILL. runc freezes a
    container's cgroup while it changes its device rules (cgroup v1) and thaws it after; killed in
    between (the chaos test kills containerd and the kubelet at random), it leaves the container
    frozen: a `down` after it found a pod's `sleep` in state D with SIGKILL pending, its cgroup
    FROZEN, for as long as it tried."""
    for directory in cgroup_dirs():
        for name, thawed in (("freezer.state", "THAWED"), ("cgroup.freeze", "0")):
            with contextlib.suppress(OSError):  # not a freezer hierarchy's, or gone meanwhile
                (directory / name).write_text(thawed)


def kill_all(pids: Iterable[int]) -> None:
    for pid in pids:
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.kill(pid, signal.SIGKILL)


def mount_points(under: Iterable[Path]) -> list[str]:
    """Mount points at or below any of ``under``, deepest first (mountinfo field 5, octal-escaped)."""
    prefixes = [str(p).rstrip("/") for p in under]
    points = []
    for line in Path("/proc/self/mountinfo").read_text().splitlines():
        point = line.split()[4].encode().decode("unicode_escape")
        if any(point == p or point.startswith(p + "/") for p in prefixes):
            points.append(point)
    return sorted(set(points), key=lambda p: (-p.count("/"), p))


def unmount(points: Iterable[str]) -> None:
    for point in points:
        result = subprocess.run(["umount", point], capture_output=True, check=False)
        if result.returncode != 0:
            # Busy (a process still dying holds it): detach now, the kernel frees it when released.
            subprocess.run(["umount", "-l", point], capture_output=True, check=False)


def network_devices() -> list[str]:
    """The sandbox's bridge and every device attached to it (pod veth ends)."""
    out = subprocess.run(["ip", "-o", "link", "show"], capture_output=True, text=True, check=False).stdout
    devices = []
    for line in out.splitlines():
        name = line.split(":", 2)[1].strip().split("@")[0]
        if name == BRIDGE or f" master {BRIDGE} " in line:
            devices.append(name)
    return devices


def _iptables_save(save: str, table: str) -> list[str]:
    result = subprocess.run([save, "-t", table], capture_output=True, text=True, check=False)
    return result.stdout.splitlines() if result.returncode == 0 else []


def kube_chain_names(saved: Sequence[str]) -> list[str]:
    """KUBE-* chains declared in one table's iptables-save output (``:NAME POLICY [counters]``)."""
    return [line[1:].split()[0] for line in saved if line.startswith(":" + CHAIN_PREFIX)]


def kube_jump_rules(saved: Sequence[str]) -> list[list[str]]:
    """Rules in chains other than KUBE-* that jump to or mention one (``-A CHAIN ...`` split), as
    iptables -D takes them after the chain name."""
    rules = []
    for line in saved:
        if line.startswith("-A ") and CHAIN_PREFIX in line:
            words = shlex.split(line)
            if not words[1].startswith(CHAIN_PREFIX):
                rules.append(words[1:])
    return rules


def kube_chains() -> list[str]:
    """Every KUBE-* iptables chain on the host, as "iptables nat KUBE-SERVICES"."""
    found = []
    for command, save in IPTABLES:
        if shutil.which(save) is None:
            continue
        for table in IPTABLES_TABLES:
            found += [f"{command} {table} {name}" for name in kube_chain_names(_iptables_save(save, table))]
    return found


def remove_kube_chains() -> None:
    """The rules that jump into KUBE-* chains, then the chains (flushed first: they reference each
    other). After `kube-proxy --cleanup` this normally finds nothing; the kubelet's own chains
    (KUBE-IPTABLES-HINT, KUBE-KUBELET-CANARY) and a killed kube-proxy's are swept here."""
    for command, save in IPTABLES:
        if shutil.which(save) is None:
            continue
        for table in IPTABLES_TABLES:
            saved = _iptables_save(save, table)
            chains = kube_chain_names(saved)
            if not chains:
                continue
            for rule in kube_jump_rules(saved):
                subprocess.run([command, "-w", "-t", table, "-D", *rule], capture_output=True, check=False)
            for flag in ("-F", "-X"):
                for chain in chains:
                    subprocess.run(
                        [command, "-w", "-t", table, flag, chain], capture_output=True, check=False
                    )


def remove_cgroups(timeout: float = 15.0) -> None:
    """rmdir the subtree, deepest first; retried while killed processes finish leaving it."""
    deadline = time.monotonic() + timeout
    while cgroup_dirs() and time.monotonic() < deadline:
        kill_all(cgroup_pids())
        for directory in cgroup_dirs():
            with contextlib.suppress(OSError):
                directory.rmdir()
        if cgroup_dirs():
            time.sleep(0.2)


def _remove_own_entries(layout: Layout) -> None:
    """Inside host directories that existed before: only what the sandbox put there."""
    for path in [
        HOST_CNI_STATE / "networks" / NETWORK_NAME,
        *(HOST_CNI_STATE / "results").glob(f"{NETWORK_NAME}-*"),
    ]:
        shutil.rmtree(path, ignore_errors=True) if path.is_dir() else path.unlink(missing_ok=True)
    for name in ("kubelet.sock", "kubelet_internal_checkpoint"):
        (HOST_DEVICE_PLUGIN_DIR / name).unlink(missing_ok=True)
    for link in Path("/var/log/containers").glob("*.log"):
        with contextlib.suppress(OSError):
            if link.is_symlink() and str(os.readlink(link)).startswith(str(layout.pod_logs)):
                link.unlink()


def restore_host(layout: Layout) -> None:
    """Everything after the processes are gone: mounts, devices, cgroups, host dirs, sysctls."""
    thaw_cgroups()
    kill_all(cgroup_pids())
    kill_all(component_processes(layout))
    unmount(mount_points([layout.root, HOST_CONTAINERD_RUN, HOST_KUBELET_DIR]))
    nodes.delete_networks()
    for device in network_devices():
        subprocess.run(["ip", "link", "delete", device], capture_output=True, check=False)
    remove_cgroups()
    remove_kube_chains()
    snapshot = json.loads(layout.host_snapshot.read_text()) if layout.host_snapshot.exists() else None
    existed: dict[str, bool] = snapshot["existed"] if snapshot else {}
    _remove_own_entries(layout)
    for path in host_paths_to_remove(existed):
        shutil.rmtree(path, ignore_errors=True)
    if snapshot:
        for key, value in sysctls_to_restore(snapshot["sysctls"], read_sysctls()).items():
            (Path("/proc/sys") / key).write_text(value + "\n")


def leftovers(layout: Layout) -> list[str]:
    """What the sandbox left on the host; empty after a clean `down`."""
    found = [
        f"process {pid}: {' '.join(cmdline(pid))[:120]}"
        for pid in sorted(component_processes(layout) | cgroup_pids())
    ]
    found += [f"mount {p}" for p in mount_points([layout.root, HOST_CONTAINERD_RUN, HOST_KUBELET_DIR])]
    found += [f"cgroup {d}" for d in cgroup_dirs()]
    found += [f"network device {d}" for d in network_devices()]
    found += [f"network namespace {n}" for n in nodes.network_namespaces()]
    found += [f"iptables chain {c}" for c in kube_chains()]
    if layout.host_snapshot.exists():
        snapshot = json.loads(layout.host_snapshot.read_text())
        found += [f"directory {p}" for p in host_paths_to_remove(snapshot["existed"]) if p.exists()]
        found += [
            f"sysctl {key} = {now} (was {snapshot['sysctls'][key]})"
            for key, now in read_sysctls().items()
            if key in snapshot["sysctls"] and snapshot["sysctls"][key] != now
        ]
    return found
