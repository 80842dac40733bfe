"""A further node's life (sandbox.nodes says what one is): started by `up --nodes N`, stopped and
started again as power would be (`tessera sandbox node stop|start NAME`), cut off from the control
plane and joined again (`node partition|heal NAME`).

Its kubelet, containerd and kube-proxy are recorded in the sandbox state as ``NAME/kubelet`` and so
on, beside the first node's; `down` stops them with the rest and deletes the node's namespaces.
"""

from __future__ import annotations

import contextlib
import datetime
import os
import shutil
import time
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path

from kubernetes import client

from sandbox import addons, containerd, gpu, host, install, kubelet, nodes, seeds
from sandbox.layout import BRIDGE_ADDRESS, CGROUP_ROOT, HOST_CONTAINERD_RUN, Layout
from sandbox.processes import Started, StartError, alive, kill, start, stop, wait_for
from sandbox.record import FurtherNode, SandboxState, api_client, node_ready, running_state, save_state
from tessera.contract import KEYS

# In the node's own network namespace, so every node has the same.
KUBELET_PORT = 10250
KUBELET_HEALTHZ_PORT = 10248
PROXY_HEALTHZ_PORT = 10256
PROXY_METRICS_PORT = 10249
# The further nodes' fake GPUs by default, in turn: the fleet mixes models across nodes (the first
# node has sandbox.gpu.SANDBOX_GPUS, an A100 and a T4).
DEFAULT_GPUS: tuple[tuple[str, ...], ...] = (("t4", "t4"), ("a100",))
COMPONENTS = ("holder", "containerd", "kubelet", "kube-proxy")
# The first node's, as `up` records them (it shares the host's namespaces: no holder).
FIRST_NODE_COMPONENTS = ("containerd", "kubelet", "kube-proxy")


def plan(first: str, count: int, gpus: Sequence[Sequence[str]] = ()) -> list[FurtherNode]:
    """The nodes after the first of a sandbox of ``count`` nodes: ``FIRST-2``, ``FIRST-3``, ...,
    with ``gpus[i]`` (or the defaults, in turn) as their GPU models."""
    if count < 1:
        raise nodes.NodeError(f"nodes: {count} is not a number of nodes (1 or more)")
    if len(gpus) > count - 1:
        raise nodes.NodeError(f"node-gpus: {len(gpus)} lists for {count - 1} further node(s)")
    further = []
    for index in range(1, count):
        name = nodes.check_name(f"{first}-{index + 1}")
        given = index - 1 < len(gpus)
        models = tuple(gpus[index - 1]) if given else DEFAULT_GPUS[(index - 1) % len(DEFAULT_GPUS)]
        gpu.node_gpus(name, models)  # refuses an unknown model before anything starts
        nodes.NodeAddresses(index)  # refuses too many nodes
        further.append(FurtherNode(name=name, index=index, gpus=models))
    return further


@dataclass(frozen=True, slots=True)
class Cluster:
    """What a further node's processes need from the sandbox around them."""

    layout: Layout
    kubeconfig: Path
    kubernetes_bin: Path
    containerd_bin: Path | None
    # The containerd root, the images imported, that the node's starts as when it is first made
    # (sandbox.seeds); None where no node is made.
    seed: Path | None


def _write_files(cluster: Cluster, node: FurtherNode) -> None:
    """Everything the node's processes read, in the node's own directory."""
    layout = cluster.layout.of_node(node.name)
    a = node.addresses
    files = gpu.prepare(layout, gpu.node_gpus(node.name, node.gpus))
    containerd.write_files(
        layout, files.container_mounts(), files.container_env(), cluster.containerd_bin, subnet=a.pod_subnet
    )
    cgroup_root = nodes.cgroup_root(node.name)
    config = kubelet.render_config(
        layout,
        KUBELET_PORT,
        KUBELET_HEALTHZ_PORT,
        address=a.address,
        healthz_address=a.address,
        cgroup_root=cgroup_root,
    )
    kubelet.write_files(layout, config)
    addons.write_kube_proxy_config(
        layout, cluster.kubeconfig, node.name, PROXY_HEALTHZ_PORT, PROXY_METRICS_PORT, address=a.address
    )
    install.make_host_dirs(layout)


def _start_runtime(
    cluster: Cluster, node: FurtherNode, add: Callable[[Started], Started], *, first: bool, timeout: float
) -> Started:
    """The holder and containerd (its root seeded with the images ``first``); returns the holder."""
    layout = cluster.layout.of_node(node.name)
    host.create_cgroup_root(nodes.cgroup_root(node.name))
    holder = add(nodes.start_holder(cluster.layout, node.name, node.addresses))
    enter = nodes.enter(holder)
    if first:
        if cluster.seed is None:
            raise StartError(f"node {node.name}: no seed to make its containerd root from")
        seeds.plant(cluster.seed, layout.place(layout.containerd_root))
    add(containerd.start_containerd(layout, timeout, name=node.process_name("containerd"), enter=enter))
    return holder


def join(
    cluster: Cluster, node: FurtherNode, holder: Started, add: Callable[[Started], Started], timeout: float
) -> None:
    """The kubelet, started again until healthy, and kube-proxy: the node joins the cluster (at
    `up`, once the control plane answers; at `node start`)."""
    layout = cluster.layout.of_node(node.name)
    enter = nodes.enter(holder)

    def start_kubelet() -> Started:
        return kubelet.start_kubelet(
            layout,
            cluster.kubernetes_bin / "kubelet",
            cluster.kubeconfig,
            node.name,
            name=node.process_name("kubelet"),
            enter=enter,
            node_ip=node.addresses.address,
        )

    healthy = lambda: kubelet.healthy(KUBELET_HEALTHZ_PORT, node.addresses.address)  # noqa: E731
    add(until_healthy(start_kubelet, healthy, timeout))
    add(
        addons.start_kube_proxy(
            layout, cluster.kubernetes_bin / "kube-proxy", name=node.process_name("kube-proxy"), enter=enter
        )
    )


def _ready_since(api: client.ApiClient, node: str, since: datetime.datetime) -> bool:
    """The node's Ready condition says True in a heartbeat from ``since`` on."""
    try:
        status = client.CoreV1Api(api).read_node_status(node).status
    except client.ApiException:
        return False
    return any(
        c.type == "Ready" and c.status == "True" and c.last_heartbeat_time and c.last_heartbeat_time >= since
        for c in status.conditions or []
    )


def until_healthy(start_once: Callable[[], Started], healthy: Callable[[], bool], timeout: float) -> Started:
    """Started, and started again whenever it exits before it is healthy, as a node's supervisor
    would (systemd's Restart=always): a kubelet started while containerd's CRI service is still
    initialising exits at once ("server is not initialized yet")."""
    deadline = time.monotonic() + timeout
    while True:
        process = start_once()
        while alive(process) and not healthy() and time.monotonic() < deadline:
            time.sleep(0.5)
        if alive(process) and healthy():
            return process
        if time.monotonic() >= deadline:
            stop(process)
            raise StartError(f"{process.name} not healthy after {timeout:.0f}s; see {process.log}")
        time.sleep(1.0)


def create(cluster: Cluster, node: FurtherNode, add: Callable[[Started], Started], timeout: float) -> Started:
    """Make the node (`up`): its network, its files, its containerd with the images; needs no
    control plane yet. Returns its holder, for :func:`join`."""
    nodes.create_network(node.addresses)
    _write_files(cluster, node)
    return _start_runtime(cluster, node, add, first=True, timeout=timeout)


def wait_ready(api: client.ApiClient, node: FurtherNode, kubelet_process: Started, timeout: float) -> None:
    wait_for(f"node {node.name}: Ready", lambda: node_ready(api, node.name), kubelet_process, timeout)


# --------------------------------------------------------------------------------------------------
# The node commands, on a running sandbox.


def _further(state: SandboxState, name: str) -> FurtherNode:
    try:
        return state.further_node(name)
    except KeyError:
        names = ", ".join(n.name for n in state.nodes) or "none"
        raise StartError(f"node {name!r}: not a further node of this sandbox (those: {names})") from None


def _processes(state: SandboxState, names: Iterable[str]) -> list[Started]:
    wanted = set(names)
    return [p for p in state.processes if p.name in wanted]


def _first_node_shims(layout: Layout) -> set[int]:
    """The first node's containers' shims: in the host's mount namespace, serving its containerd
    (a further node's shims name the same socket path, in their node's namespace)."""
    ours = nodes.mount_namespace(os.getpid())
    socket = str(layout.containerd_socket)
    return {
        pid
        for pid in host.component_processes(layout)
        if socket in host.cmdline(pid) and nodes.mount_namespace(pid) == ours
    }


def node_processes(layout: Layout, state: SandboxState, name: str) -> Callable[[], set[int]]:
    """What lists a node's processes at each call: its components, its containers' shims and its
    pods' processes. A further node's are every process in its mount namespace (taken now, while
    its holder runs) and in its cgroup subtree, its holder listed alone once the rest is gone; the
    first node's, its recorded components, the shims serving its containerd from the host's mount
    namespace and what runs in its pods' cgroups."""
    namespace: str | None = None
    holder: Started | None = None
    if name == state.node:
        components = _processes(state, FIRST_NODE_COMPONENTS)
        pods = f"/{CGROUP_ROOT}/kubepods"
    else:
        node = _further(state, name)
        components = _processes(state, (node.process_name(c) for c in COMPONENTS))
        holder = next(p for p in components if p.name == node.process_name("holder"))
        namespace = nodes.mount_namespace(holder.pid) if alive(holder) else None
        pods = nodes.cgroup_root(name)

    def listed() -> set[int]:
        found = nodes.cgroup_pids(pods) | {p.pid for p in components if alive(p) and p is not holder}
        if name == state.node:
            return found | _first_node_shims(layout)
        if holder is None or not alive(holder):
            return found
        # Read by the namespace only while the holder pins it: a namespace's number is free again
        # once its last process is gone, and the next container any node starts may take it (a
        # further node's stop once killed a pause process starting on another node).
        in_namespace = set(nodes.processes_in(namespace)) - {holder.pid} if namespace else set()
        # The holder goes last, once nothing else of the node is left.
        return found | in_namespace or {holder.pid}

    return listed


def stop_node(root: Path, name: str) -> None:
    """`node stop NAME`: a power loss (:func:`kill_node`); the sandbox's record says stopped."""
    layout, state = running_state(root)
    if name in state.stopped:
        raise StartError(f"node {name!r} is already stopped")
    kill_node(node_processes(layout, state, name))
    state.stopped.append(name)
    save_state(layout, state)


def kill_node(listed: Callable[[], set[int]], timeout: float = 30.0) -> None:
    """Every process of the node killed at once, with no chance to clean up (a further node's mount
    namespace ends with the last of them)."""
    deadline = time.monotonic() + timeout
    while True:
        host.thaw_cgroups()  # a frozen process never acts on SIGKILL
        left = listed()
        if not left:
            return
        if time.monotonic() > deadline:
            raise StartError(f"processes {sorted(left)[:10]} outlived SIGKILL for {timeout:.0f}s")
        host.kill_all(left)
        time.sleep(0.2)


def start_node(root: Path, name: str, timeout: float = 120.0) -> None:
    """`node start NAME`: power back. What a reboot loses is gone (containerd's state, with its pods'
    network namespaces, and a further node's /run/containerd); the images, the kubelet's directory
    and Tessera's state directory stay, as on a disk. The kubelet finds its pods' containers dead
    and asks the API what should run."""
    layout, state = running_state(root)
    if name not in state.stopped:
        raise StartError(f"node {name!r} is running; stop it first")
    began = datetime.datetime.now(datetime.UTC).replace(microsecond=0)
    started: dict[str, Started] = {}

    def add(process: Started) -> Started:
        started[process.name] = process
        state.replace(process)
        return process

    if name == state.node:
        host.unmount(host.mount_points([layout.containerd_state]))
        shutil.rmtree(layout.containerd_state, ignore_errors=True)
        recorded = {p.name: p for p in _processes(state, FIRST_NODE_COMPONENTS)}

        def again(name: str) -> Callable[[], Started]:
            return lambda: start(name, recorded[name].argv, Path(recorded[name].log))

        socket = layout.containerd_socket
        add(until_healthy(again("containerd"), lambda: containerd.socket_answers(socket), timeout))
        healthz = state.kubelet_healthz_port
        add(until_healthy(again("kubelet"), lambda: kubelet.healthy(healthz), timeout))
        add(again("kube-proxy")())
        kubelet_process = started["kubelet"]
    else:
        node = _further(state, name)
        home = layout.of_node(name)
        shutil.rmtree(home.place(home.containerd_state), ignore_errors=True)
        shutil.rmtree(nodes.host_dir(layout, name, HOST_CONTAINERD_RUN), ignore_errors=True)
        cluster = Cluster(layout, Path(state.kubeconfig), Path(state.kubernetes_bin), None, None)
        holder = _start_runtime(cluster, node, add, first=False, timeout=timeout)
        join(cluster, node, holder, add, timeout)
        kubelet_process = started[node.process_name("kubelet")]
    with contextlib.closing(api_client(state)) as api:
        # Ready as the restarted kubelet reports it: a Ready written before the stop may still stand.
        wait_for(f"node {name}: Ready", lambda: _ready_since(api, name, began), kubelet_process, timeout)
    state.stopped.remove(name)
    save_state(layout, state)


# What `restart_component` restarts on a further node, and how it knows each is back.
RESTARTABLE = ("containerd", "kubelet", "kube-proxy")


def _healthy(layout: Layout, node: FurtherNode, component: str) -> Callable[[], bool]:
    address = node.addresses.address
    if component == "containerd":
        home = layout.of_node(node.name)
        return lambda: containerd.socket_answers(home.place(home.containerd_socket))
    if component == "kubelet":
        return lambda: kubelet.healthy(KUBELET_HEALTHZ_PORT, address)
    return lambda: addons.http_ok(f"http://{address}:{PROXY_HEALTHZ_PORT}/healthz")


def restart_component(
    root: Path, name: str, component: str, timeout: float = 120.0, *, crash: bool = False
) -> Started:
    """Stop one of a further node's components and start it again as `up` did (in the node's
    namespaces, which outlive it); ``crash``: SIGKILL it alone first, as a crash would. For the
    kubelet, returns once it offers the node agent's GPU slices again (the agent registers with the
    new kubelet), or on a DRA node has registered the DRA driver; for the others, once they answer."""
    if component not in RESTARTABLE:
        raise ValueError(f"component: {component!r} is not one of {', '.join(RESTARTABLE)}")
    layout, state = running_state(root)
    node = _further(state, name)
    if name in state.stopped:
        raise StartError(f"node {name!r} is stopped; start it first")
    old = state.process(node.process_name(component))
    if crash:
        kill(old)
    stop(old)
    process = until_healthy(
        lambda: start(old.name, old.argv, Path(old.log)), _healthy(layout, node, component), timeout
    )
    if component == "kubelet" and state.node_mode(name) == "dra":
        wait_for(
            f"node {name}: the DRA driver registered with the new kubelet",
            lambda: kubelet.dra_driver_registered(layout, KUBELET_PORT, node.addresses.address),
            process,
            timeout,
        )
    elif component == "kubelet":
        home = layout.of_node(name)
        wait_for(
            f"node {name}: the node agent registered with the new kubelet",
            lambda: bool(kubelet.allocatable_devices(home, KEYS.vgpu)),
            process,
            timeout,
        )
    state.replace(process)
    save_state(layout, state)
    return process


def partition_node(root: Path, name: str) -> None:
    """`node partition NAME`: nothing passes between a further node and the control plane's address;
    its pods keep running (the hook needs no API)."""
    layout, state = running_state(root)
    nodes.partition(_further(state, name).addresses, BRIDGE_ADDRESS)
    if name not in state.partitioned:
        state.partitioned.append(name)
    save_state(layout, state)


def heal_node(root: Path, name: str) -> None:
    """`node heal NAME`: undoes :func:`partition_node`."""
    layout, state = running_state(root)
    nodes.heal(_further(state, name).addresses)
    if name in state.partitioned:
        state.partitioned.remove(name)
    save_state(layout, state)
