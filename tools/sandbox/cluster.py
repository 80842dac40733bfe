"""`tessera sandbox up/down/status`: the whole path on one machine, every part real but the GPUs.

``up`` starts, with all state under one directory: containerd (with the project's images imported),
etcd + kube-apiserver + kube-controller-manager + kube-scheduler (:mod:`sandbox.controlplane`), a
kubelet registered as a real node, kube-proxy and CoreDNS (:mod:`sandbox.addons`), then installs
Tessera with its Helm chart (:mod:`sandbox.install`): the node agent as a DaemonSet pod over the fake
GPU driver, kube-scheduler (profile tessera-scheduler) with the extender as a Deployment; with
``--monitoring`` a Prometheus that discovers Tessera's pods (:mod:`sandbox.monitoring`). With
``--mode dra`` it runs the DRA path instead (docs/dra.md): Kubernetes ``DRA_K8S_VERSION``, the
containerd 2 that hack/k8s-binaries.sh builds (CDI), the chart's node agent as ``tessera-dra`` and
placement by the cluster's own kube-scheduler (no tessera-scheduler, no extender); ``--mode mixed``
runs both agents on that Kubernetes, the DRA driver on the last node and the device plugin on the
others, with tessera-scheduler and the extender for the device plugin nodes. It records
what it started in ``sandbox.json`` and returns; the processes run on. ``down`` stops them newest
first and removes what they left on the host (:mod:`sandbox.host`).
"""

from __future__ import annotations

import contextlib
import dataclasses
import shutil
import socket
import sys
import time
from collections.abc import Callable, Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml
from kubernetes import client, config

from sandbox import (
    addons,
    containerd,
    fakenode,
    gpu,
    host,
    images,
    install,
    kubeapi,
    kubelet,
    monitoring,
    nodelife,
    nodes,
    seeds,
)
from sandbox.controlplane import (
    DRA_K8S_VERSION,
    K8S_VERSION,
    LOOPBACK,
    ControlPlane,
    ManagedProcess,
    bin_dir_for,
    default_bin_dir,
    free_port,
)
from sandbox.layout import BRIDGE_ADDRESS, Layout
from sandbox.processes import Started, StartError, adopt, alive, kill, start, stop, wait_for
from sandbox.record import (
    FurtherNode,
    Mode,
    SandboxState,
    api_client,
    load_state,
    node_mode,
    node_ready,
    running_state,
    save_state,
)
from tessera.contract import KEYS, ContractError, parse_allocation, parse_inventory

CONTAINERD_PROGRAMS = ("containerd", containerd.SHIM, "ctr")
KUBERNETES_BINARIES = (
    "etcd",
    "kube-apiserver",
    "kube-scheduler",
    "kube-controller-manager",
    "kubelet",
    "kube-proxy",
    "coredns",
    "helm",
)
# The cluster's own scheduler: the default profile only. Tessera's profile is served by the chart's
# tessera-scheduler pods, as on a real cluster.
DEFAULT_SCHEDULER_CONFIG = yaml.safe_dump(
    {
        "apiVersion": "kubescheduler.config.k8s.io/v1",
        "kind": "KubeSchedulerConfiguration",
        "clientConnection": {"kubeconfig": "{kubeconfig}"},
        "leaderElection": {"leaderElect": False},
    }
)


# The chart's values of each mode. DRA: tessera-dra as the node agent, placement by the cluster's
# kube-scheduler, so neither the chart's scheduler (whose image is built for the pinned Kubernetes
# only) nor the extender. Mixed: both agents, and the scheduler with the extender for the device
# plugin nodes, its image the pinned one (the chart's default tag is the cluster's version, for
# which no image is built), which runs against the DRA path's newer API server (docs/sandbox.md).
CHART_VALUES: dict[Mode, tuple[str, ...]] = {
    "deviceplugin": (),
    "dra": ("mode=dra", "scheduler.enabled=false", "extender.enabled=false"),
    "mixed": ("mode=mixed", f"scheduler.image.tag={K8S_VERSION}"),
}
# How long the token the sandbox's Prometheus scrapes with lasts: longer than any sandbox runs.
SCRAPER_TOKEN_SECONDS = 7 * 24 * 3600


def default_node_name() -> str:
    """This host's name, as the kubelet would use: it resolves to 127.0.0.1 on these machines."""
    return socket.gethostname().lower()


@dataclass(frozen=True, slots=True)
class Options:
    root: Path
    node: str = field(default_factory=default_node_name)
    kubelet_port: int = 10250
    kubelet_healthz_port: int = 10248
    kubernetes_bin: Path = field(default_factory=default_bin_dir)
    timeout: float = 180.0
    # Chart values on top of deploy/sandbox-values.yaml (`helm --set KEY=VALUE`), to try a setting.
    values: tuple[str, ...] = ()
    # Before `monitoring`, whose name in the class body hides the module's.
    prometheus_bin: Path = field(default_factory=monitoring.default_bin_dir)
    monitoring: bool = False
    mode: Mode = "deviceplugin"
    # The directory of a containerd (with its shim and ctr) to run instead of the host's.
    containerd_bin: Path | None = None
    # How many nodes (sandbox.nodes), and the GPU models of the nodes after the first, in order
    # (sandbox.fakenode.PRESETS names; nodelife.DEFAULT_GPUS for those not given).
    nodes: int = 1
    node_gpus: tuple[tuple[str, ...], ...] = ()


def dra(options: Options) -> Options:
    """These options for the DRA path: Kubernetes DRA_K8S_VERSION, whose bin directory
    hack/k8s-binaries.sh also links containerd 2 into, and the chart in DRA mode."""
    binaries = bin_dir_for(DRA_K8S_VERSION)
    return dataclasses.replace(options, kubernetes_bin=binaries, containerd_bin=binaries, mode="dra")


def in_mode(options: Options, mode: Mode) -> Options:
    """These options for ``mode``: the device plugin path's as they are; a mixed cluster (its last
    node DRA's, the others the device plugin's) on the DRA path's Kubernetes and containerd, which
    both agents run on."""
    return options if mode == "deviceplugin" else dataclasses.replace(dra(options), mode=mode)


def _recorded(process: ManagedProcess) -> Started:
    """A control-plane process (started by sandbox.controlplane) in the sandbox's own record."""
    assert process.popen is not None, f"{process.name} was not started"
    return adopt(process.name, process.popen.pid, process.log_path, process.args)


def node_slice_devices(api: client.ApiClient, node: str) -> int:
    """Devices in the ResourceSlices Tessera's DRA driver published for the node."""
    try:
        found = client.CustomObjectsApi(api).list_cluster_custom_object(
            "resource.k8s.io", "v1", "resourceslices", field_selector=f"spec.nodeName={node}"
        )
    except client.ApiException:
        return 0
    return sum(
        len(s["spec"].get("devices", [])) for s in found["items"] if s["spec"]["driver"] == KEYS.dra_driver
    )


def node_has_gpus(api: client.ApiClient, node: str) -> bool:
    """The device plugin registered (slices allocatable) and published the node's inventory."""
    try:
        found = client.CoreV1Api(api).read_node(node)
    except client.ApiException:
        return False
    slices = (found.status.allocatable or {}).get(KEYS.vgpu, "0")
    return int(slices) > 0 and KEYS.node_gpus in (found.metadata.annotations or {})


def preflight(options: Options, layout: Layout) -> list[str]:
    facts = host.gather_facts(
        layout,
        options.kubernetes_bin,
        KUBERNETES_BINARIES,
        (options.kubelet_port, options.kubelet_healthz_port),
        options.node,
    )
    found = host.problems(facts)
    found += [f"not built: {m}" for m in gpu.missing_builds()]
    found += [f"no image: {m}" for m in install.missing_images()]
    if options.containerd_bin is not None:
        found += [
            f"not built: {options.containerd_bin / b} (run hack/k8s-binaries.sh)"
            for b in CONTAINERD_PROGRAMS
            if not (options.containerd_bin / b).exists()
        ]
    if options.monitoring:
        found += [f"not built: {m}" for m in monitoring.missing_binaries(options.prometheus_bin)]
    return found


def _controller_manager_health(argv: Sequence[str]) -> str:
    [port] = [a.split("=", 1)[1] for a in argv if a.startswith("--secure-port=")]
    return f"https://{LOOPBACK}:{port}/healthz"


@dataclass(frozen=True, slots=True)
class _Node:
    """A node of the sandbox: its name and where its kubelet serves."""

    node: str
    kubelet_port: int
    address: str = BRIDGE_ADDRESS


@dataclass
class _Starting:
    """Processes started so far by one `up`, stopped newest first if a later step fails."""

    started: list[Started] = field(default_factory=list)
    health: dict[str, str] = field(default_factory=dict)
    prometheus_url: str = ""

    def add(self, process: Started) -> Started:
        self.started.append(process)
        return process

    def undo(self) -> None:
        for process in reversed(self.started):
            stop(process)


def _wait_node(
    api: client.ApiClient,
    what: str,
    ready: Callable[[client.ApiClient, str], bool],
    *,
    node: str,
    process: Started,
    timeout: float,
) -> None:
    wait_for(f"node {node}: {what}", lambda: ready(api, node), process, timeout)


def _start_kubelet(options: Options, layout: Layout, kubeconfig: Path) -> Started:
    return kubelet.start_kubelet(layout, options.kubernetes_bin / "kubelet", kubeconfig, options.node)


def _make_further(
    setup: nodelife.Cluster, further: Sequence[FurtherNode], starting: _Starting, timeout: float
) -> dict[str, Started]:
    """The nodes after the first, made one after another (their holders, by node)."""
    return {node.name: nodelife.create(setup, node, starting.add, timeout) for node in further}


def _join_further(
    setup: nodelife.Cluster,
    holders: Mapping[str, Started],
    starting: _Starting,
    api: client.ApiClient,
    *,
    further: Sequence[FurtherNode],
    timeout: float,
) -> None:
    """Their kubelets and kube-proxies started, then the nodes waited for together."""
    for node in further:
        nodelife.join(setup, node, holders[node.name], starting.add, timeout)
    for node in further:
        kubelet_process = next(p for p in starting.started if p.name == node.process_name("kubelet"))
        nodelife.wait_ready(api, node, kubelet_process, timeout)


def _start_all(
    options: Options,
    layout: Layout,
    starting: _Starting,
    report: Callable[[str], None],
    further: Sequence[FurtherNode] = (),
) -> ControlPlane:
    """Every component in order, each waited for, then Tessera installed by its chart."""
    report("images, fake GPUs and containerd")
    tarballs = {**images.write_images(layout.images), **install.image_archives()}
    files = gpu.prepare(layout)
    containerd.write_files(layout, files.container_mounts(), files.container_env(), options.containerd_bin)
    seed = seeds.seed(tarballs, options.containerd_bin)
    seeds.plant(seed, layout.place(layout.containerd_root))
    starting.add(containerd.start_containerd(layout))

    plane = ControlPlane(
        work_dir=layout.cluster, bin_dir=options.kubernetes_bin, service_accounts=True, address=BRIDGE_ADDRESS
    )
    setup = nodelife.Cluster(layout, plane.kubeconfig, options.kubernetes_bin, options.containerd_bin, seed)
    # The further nodes are made meanwhile (network, files, containerd and its images): they need no
    # control plane until their kubelets start. Leaving the block waits for them, also on failure,
    # so that `up`'s undo stops what they started too.
    with ThreadPoolExecutor(max_workers=1, thread_name_prefix="further-nodes") as pool:
        making = pool.submit(_make_further, setup, further, starting, options.timeout)
        _start_control_plane(options, plane, starting, report)
        with contextlib.closing(config.new_client_from_config(config_file=str(plane.kubeconfig))) as api:
            _start_first_node(options, layout, plane, starting, api, report=report)
            if further:
                report(f"further nodes: {', '.join(n.name for n in further)}")
                _join_further(setup, making.result(), starting, api, further=further, timeout=options.timeout)
            _install(options, layout, plane, api, further, report=report)
    if options.monitoring:
        _start_monitoring(options, layout, plane, starting, report)
    return plane


def _start_control_plane(
    options: Options, plane: ControlPlane, starting: _Starting, report: Callable[[str], None]
) -> None:
    """etcd, kube-apiserver, kube-controller-manager and the cluster's own kube-scheduler."""
    report("control plane (etcd, kube-apiserver, kube-controller-manager, kube-scheduler)")
    # The pod bridge first: kube-apiserver listens on its address, so pods reach it through the
    # `kubernetes` Service with their service account's token (in-cluster config).
    addons.create_bridge()
    plane.start(timeout=options.timeout)
    for process in plane.processes:
        starting.add(_recorded(process))
    starting.health["etcd"] = f"{plane.etcd_url}/health"
    starting.health["kube-apiserver"] = f"{plane.api_url}/readyz"
    manager = plane.start_controller_manager(timeout=options.timeout)
    starting.add(_recorded(manager))
    starting.health["kube-controller-manager"] = _controller_manager_health(manager.args)
    scheduler = plane.start_scheduler(DEFAULT_SCHEDULER_CONFIG, timeout=options.timeout)
    starting.add(_recorded(scheduler))


def _start_first_node(
    options: Options,
    layout: Layout,
    plane: ControlPlane,
    starting: _Starting,
    api: client.ApiClient,
    *,
    report: Callable[[str], None],
) -> None:
    """The first node's kubelet (the host's), kube-proxy and CoreDNS."""
    report(f"kubelet (node {options.node})")
    kubelet.write_files(
        layout, kubelet.render_config(layout, options.kubelet_port, options.kubelet_healthz_port)
    )
    host.create_cgroup_root()
    node_agent = starting.add(_start_kubelet(options, layout, plane.kubeconfig))
    _wait_node(api, "Ready", node_ready, node=options.node, process=node_agent, timeout=options.timeout)

    report("kube-proxy (iptables) and CoreDNS")
    proxy_health, proxy_metrics = free_port(), free_port()
    addons.write_kube_proxy_config(layout, plane.kubeconfig, options.node, proxy_health, proxy_metrics)
    proxy = starting.add(addons.start_kube_proxy(layout, options.kubernetes_bin / "kube-proxy"))
    starting.health["kube-proxy"] = f"http://{LOOPBACK}:{proxy_health}/healthz"
    dns_health, dns_ready = free_port(), free_port()
    dns = starting.add(
        addons.start_coredns(
            layout, options.kubernetes_bin / "coredns", plane.kubeconfig, dns_health, dns_ready
        )
    )
    starting.health["coredns"] = f"http://{LOOPBACK}:{dns_ready}/ready"
    addons.create_dns_service(api)
    wait_for("kube-proxy", lambda: addons.http_ok(starting.health["kube-proxy"]), proxy, options.timeout)
    wait_for("CoreDNS", lambda: addons.http_ok(starting.health["coredns"]), dns, options.timeout)
    wait_for(
        "the default service account and kube-root-ca.crt",
        lambda: addons.service_accounts_ready(api),
        None,
        options.timeout,
    )


def _install(
    options: Options,
    layout: Layout,
    plane: ControlPlane,
    api: client.ApiClient,
    further: Sequence[FurtherNode],
    *,
    report: Callable[[str], None],
) -> None:
    """Tessera by its chart, waited for on every node (for its own agent's, in a mixed cluster)."""
    every = [
        _Node(options.node, options.kubelet_port),
        *(_Node(n.name, nodelife.KUBELET_PORT, n.addresses.address) for n in further),
    ]
    if options.mode == "mixed":
        # Before the chart: each node's agent is its mode's from the start (one mode per node).
        dra_node = further[-1].name
        report(f"node {dra_node}: {KEYS.node_mode}=dra")
        client.CoreV1Api(api).patch_node(dra_node, {"metadata": {"labels": {KEYS.node_mode: "dra"}}})
    report(f"Tessera: helm install {install.RELEASE} charts/tessera -n {install.NAMESPACE}")
    values = (*CHART_VALUES[options.mode], *options.values)
    install.install(options.kubernetes_bin / "helm", plane.kubeconfig, layout, values)
    for node in every:
        _wait_installed(
            api, layout, node, node_mode(options.mode, node.node, [n.name for n in further]), options.timeout
        )


def _start_monitoring(
    options: Options, layout: Layout, plane: ControlPlane, starting: _Starting, report: Callable[[str], None]
) -> None:
    """Prometheus on the host, discovering Tessera's pods through the API server."""
    report("Prometheus (Kubernetes discovery of Tessera's pods)")
    port = free_port()
    with contextlib.closing(config.new_client_from_config(config_file=str(plane.kubeconfig))) as api:
        token = install.scraper_token(api, seconds=SCRAPER_TOKEN_SECONDS)
    prometheus = starting.add(
        monitoring.start_prometheus(layout, options.prometheus_bin, plane.kubeconfig, token, port)
    )
    starting.prometheus_url = monitoring.url(port)
    ready = monitoring.ready_url(starting.prometheus_url)
    wait_for("Prometheus ready", lambda: addons.http_ok(ready), prometheus, options.timeout)


def _wait_installed(api: client.ApiClient, layout: Layout, node: _Node, mode: Mode, timeout: float) -> None:
    """The chart's pods are up on a node whose agent is ``mode``'s: the device plugin registered
    the GPU slices and published the inventory, and every tessera-scheduler replica's extender has
    synced its caches; the DRA driver published the node's ResourceSlice and the kubelet registered
    it."""
    install.wait(
        f"node {node.node}: the node agent's pod ready",
        lambda: install.agent_ready(api, node.node),
        timeout,
        lambda: install.describe_pods(api),
    )
    if mode == "dra":
        _wait_dra_driver(api, layout, node, timeout)
        return
    install.wait(
        f"node {node.node}: GPU slices and inventory",
        lambda: node_has_gpus(api, node.node),
        timeout,
        lambda: install.describe_pods(api),
    )
    install.wait(
        "the tessera-scheduler replicas ready (extender caches synced)",
        lambda: install.extenders_ready(api),
        timeout,
        lambda: install.describe_pods(api),
    )


def up(options: Options, report: Callable[[str], None] = print) -> SandboxState:
    """Start the sandbox; raises :class:`StartError` (after stopping what it started and cleaning the
    host) on failure."""
    layout = Layout(options.root)
    try:
        further = nodelife.plan(options.node, options.nodes, options.node_gpus)
    except (nodes.NodeError, ValueError) as e:
        raise StartError(f"cannot start the sandbox: {e}") from None
    if options.mode == "mixed" and not further:
        raise StartError("cannot start the sandbox: mode mixed needs a node of each kind (--nodes 2 or more)")
    found = preflight(options, layout)
    if found:
        raise StartError("cannot start the sandbox:\n  - " + "\n  - ".join(found))
    began = time.monotonic()
    layout.root.mkdir(parents=True, exist_ok=True)
    host.take_snapshot(layout)
    starting = _Starting()
    try:
        plane = _start_all(options, layout, starting, report, further)
    except BaseException:
        starting.undo()
        host.restore_host(layout)
        raise
    state = SandboxState(
        node=options.node,
        kubeconfig=str(plane.kubeconfig),
        api_url=plane.api_url,
        kubernetes_bin=str(options.kubernetes_bin),
        kubelet_port=options.kubelet_port,
        kubelet_healthz_port=options.kubelet_healthz_port,
        processes=starting.started,
        mode=options.mode,
        prometheus_url=starting.prometheus_url,
        health=starting.health,
        ready_seconds=round(time.monotonic() - began, 1),
        nodes=list(further),
    )
    save_state(layout, state)
    return state


# Started again from the command line `up` recorded, ready when their health URL answers (containerd:
# when its socket does). Running containers outlive containerd (their shims are in sessions of their
# own) and etcd keeps its data directory, as under a node's or a control plane's supervisor.
RESTARTABLE_AS_RECORDED = (
    "containerd", "etcd", "kube-apiserver", "kube-controller-manager", "kube-proxy", "coredns",
)  # fmt: skip
RESTARTABLE = ("kubelet", *RESTARTABLE_AS_RECORDED)
# Tessera's node agent is a pod of the chart's DaemonSet: `restart` deletes it and the DaemonSet
# makes a new one, as an operator would.
AGENT = "tessera-device-plugin"


def restart(root: Path, name: str, timeout: float = 120.0, *, crash: bool = False) -> Started:
    """Stop one component and start it again as `up` did. For the kubelet, returns once the
    kubelet itself (its pod-resources API) offers the GPU slices from the device plugin again; for
    the others, once their health endpoint answers. ``crash``: SIGKILL the process alone first, with
    no chance to clean up, as a crash leaves it for the supervisor that restarts it."""
    if "/" in name:  # a further node's: NODE/kubelet, NODE/containerd, NODE/kube-proxy
        node, component = name.split("/", 1)
        return nodelife.restart_component(root, node, component, timeout, crash=crash)
    if name not in RESTARTABLE:
        raise ValueError(
            f"component: {name!r} is not one of {', '.join(RESTARTABLE)}, nor a further node's NODE/COMPONENT"
        )
    layout, state = running_state(root)
    old = state.process(name)
    if crash:
        kill(old)
    stop(old)
    if name in RESTARTABLE_AS_RECORDED:
        process = start(name, old.argv, Path(old.log), cwd=layout.root)
        ready = _health(layout, state, name)
        wait_for(f"{name}'s health", ready, process, timeout)
        state.replace(process)
        save_state(layout, state)
        return process
    options = Options(root=root, node=state.node, kubernetes_bin=Path(state.kubernetes_bin))
    process = _start_kubelet(options, layout, Path(state.kubeconfig))
    wait_for("the kubelet's health", lambda: kubelet.healthy(state.kubelet_healthz_port), process, timeout)
    if state.mode == "dra":
        with contextlib.closing(api_client(state)) as api:
            _wait_dra_driver(api, layout, _Node(state.node, state.kubelet_port), timeout)
        state.replace(process)
        save_state(layout, state)
        return process
    # A restarted kubelet offers no slices until the agent has noticed the new kubelet socket and
    # registered again (its checkpoint keeps only what running pods were given).
    _wait_slices(layout, state, "the node agent registered with the new kubelet", process, timeout)
    state.replace(process)
    save_state(layout, state)
    return process


def _health(layout: Layout, state: SandboxState, name: str) -> Callable[[], bool]:
    if name == "containerd":
        return lambda: containerd.socket_answers(layout.containerd_socket)
    url = state.health[name]
    return lambda: addons.http_ok(url)


def replace_agent(root: Path, timeout: float = 120.0) -> str:
    """Delete the node agent's pod; returns the name of the pod the DaemonSet made instead, once it
    has registered with the kubelet again and the node offers its GPU slices."""
    layout, state = running_state(root)
    with contextlib.closing(api_client(state)) as api:
        began = time.time()
        new = install.restart_agent(api, state.node, timeout)
        if state.mode == "dra":
            _wait_dra_driver(api, layout, _Node(state.node, state.kubelet_port), timeout)
            return new
        # The kubelet keeps a dead plugin's devices for a grace period: first the new agent's own
        # socket, then the slices it offers.
        install.wait(
            "the new node agent's device plugin socket",
            lambda: kubelet.plugin_socket_since(began),
            timeout,
            lambda: install.describe_pods(api),
        )
        _wait_slices(layout, state, "the new node agent registered with the kubelet", None, timeout)
    return new


def _wait_dra_driver(api: client.ApiClient, layout: Layout, node: _Node, timeout: float) -> None:
    """The DRA driver published the node's ResourceSlice and the kubelet registered it (a pod
    whose claims the kubelet prepares before that fails, and is retried only after a back-off)."""
    install.wait(
        f"node {node.node}: the DRA driver's ResourceSlice",
        lambda: node_slice_devices(api, node.node) > 0,
        timeout,
        lambda: install.describe_pods(api),
    )
    install.wait(
        f"node {node.node}: the kubelet registered the DRA driver",
        lambda: kubelet.dra_driver_registered(layout, node.kubelet_port, node.address),
        timeout,
        lambda: install.describe_pods(api),
    )


def _wait_slices(
    layout: Layout, state: SandboxState, what: str, process: Started | None, timeout: float
) -> None:
    wait_for(what, lambda: bool(kubelet.allocatable_devices(layout, KEYS.vgpu)), process, timeout)
    with contextlib.closing(api_client(state)) as api:
        install.wait(
            f"node {state.node}: GPU slices", lambda: node_has_gpus(api, state.node), timeout, lambda: ""
        )


def add_node(root: Path, name: str, models: Sequence[str], timeout: float = 60.0) -> Started:
    """A node with these GPU models (fakenode.PRESETS) and no kubelet, kept alive by its own process."""
    fakenode.inventory(name, models)  # refuses unknown models before anything starts
    layout, state = running_state(root)
    process_name = f"fake-node-{name}"
    if name == state.node or any(p.name == process_name for p in state.processes):
        raise StartError(f"node {name!r} already exists in the sandbox")
    argv = [
        sys.executable,
        "-m",
        "sandbox.fakenode",
        f"--kubeconfig={state.kubeconfig}",
        f"--node={name}",
    ]
    argv += [f"--gpu={m}" for m in models]
    process = start(process_name, argv, layout.log(process_name), cwd=gpu.REPO)
    api = api_client(state)
    try:
        _wait_node(api, "GPU inventory", node_has_gpus, node=name, process=process, timeout=timeout)
        # Until the extenders' watches have the node, kube-scheduler may try a new pod there, be
        # told "unknown node" and park the pod for minutes: return only once every extender knows it.
        with_inventory = install.nodes_with_inventory(api)
        wait_for(
            f"the extenders to know node {name}",
            lambda: install.extenders_know(api, with_inventory),
            process,
            timeout,
        )
    except BaseException:
        stop(process)
        raise
    finally:
        api.close()
    state.processes.append(process)
    save_state(layout, state)
    return process


def remove_node(root: Path, name: str) -> None:
    """Undoes :func:`add_node`: its process stopped, the node deleted (with it the pods bound there,
    which no kubelet runs), so that the sandbox is as it was for whatever runs next on it."""
    layout, state = running_state(root)
    process = next((p for p in state.processes if p.name == f"fake-node-{name}"), None)
    if process is None:
        raise StartError(f"no node {name!r} was added to the sandbox")
    stop(process)
    state.processes.remove(process)
    save_state(layout, state)
    with contextlib.closing(api_client(state)) as api:
        kubeapi.delete(lambda: client.CoreV1Api(api).delete_node(name))


# Graceful first: deleting the pods lets the kubelet stop their containers and tear down their
# networks through CRI, which also releases CNI state. What is left after this is killed.
POD_DRAIN_SECONDS = 60.0


def _drain_pods(state: SandboxState) -> None:
    api = api_client(state)
    try:
        core = client.CoreV1Api(api)
        for pod in core.list_pod_for_all_namespaces().items:
            core.delete_namespaced_pod(pod.metadata.name, pod.metadata.namespace, grace_period_seconds=0)
        kubelet_process = state.process("kubelet")
        deadline = time.monotonic() + POD_DRAIN_SECONDS
        while alive(kubelet_process) and host.cgroup_pids() and time.monotonic() < deadline:
            time.sleep(0.5)
    finally:
        api.close()


def down(root: Path, report: Callable[[str], None] = print) -> list[str]:
    """Stop everything and clean the host; returns what could not be removed (empty when clean).
    A directory where no `up` ever began (no state, no host snapshot: `up` refused, or nothing was
    started there) has nothing of its own on the host: the host is left alone, since what is there
    may be another sandbox's."""
    layout = Layout(root)
    state = load_state(layout)
    if state is None and not layout.host_snapshot.exists():
        return []
    if state is not None:
        names = {p.name for p in state.processes}
        if "kube-controller-manager" in names:
            # First, or its ReplicaSets and DaemonSets would replace the pods being deleted.
            report("stopping kube-controller-manager")
            stop(state.process("kube-controller-manager"))
        if "kubelet" in names and alive(state.process("kubelet")):
            report("deleting pods")
            try:
                _drain_pods(state)
            except Exception as e:  # the apiserver may already be gone; the forced path follows
                report(f"could not delete pods through the API ({e}); killing them instead")
        for process in reversed(state.processes):
            report(f"stopping {process.name}")
            stop(process)
        if "kube-proxy" in names:
            report("removing kube-proxy's iptables rules (kube-proxy --cleanup)")
            addons.cleanup_kube_proxy(Path(state.process("kube-proxy").argv[0]))
    report("removing mounts, cgroups, network devices and host directories")
    host.restore_host(layout)
    left = host.leftovers(layout)
    if not left:
        for entry in layout.root.iterdir() if layout.root.exists() else []:
            if entry != layout.logs:
                shutil.rmtree(entry) if entry.is_dir() and not entry.is_symlink() else entry.unlink()
    return left


def _node_summary(node: Any, state: SandboxState) -> dict[str, Any]:
    name = node.metadata.name
    annotations = node.metadata.annotations or {}
    allocatable = node.status.allocatable or {}
    summary: dict[str, Any] = {
        "name": node.metadata.name,
        "ready": any(c.type == "Ready" and c.status == "True" for c in node.status.conditions or []),
        "slices": int(allocatable.get(KEYS.vgpu, "0")),
        "gpus": [],
    }
    record = state.further_node(name) if name in {n.name for n in state.nodes} else None
    summary["address"] = record.addresses.address if record else "host"
    summary["stopped"] = name in state.stopped
    summary["partitioned"] = name in state.partitioned
    text = annotations.get(KEYS.node_gpus)
    if text:
        try:
            gpus = parse_inventory(text, node=node.metadata.name)
            summary["gpus"] = [
                {"uuid": g.uuid, "model": g.model, "memory_mib": g.total_memory_mib} for g in gpus
            ]
        except ContractError as e:
            summary["error"] = str(e)
    return summary


def _pod_summary(pod: Any) -> dict[str, Any]:
    annotations = pod.metadata.annotations or {}
    summary: dict[str, Any] = {
        "namespace": pod.metadata.namespace,
        "name": pod.metadata.name,
        "node": pod.spec.node_name,
        "phase": pod.status.phase,
        "allocation_phase": annotations.get(KEYS.allocation_phase),
        "gpus": [],
    }
    text = annotations.get(KEYS.allocation)
    if text:
        try:
            allocation = parse_allocation(text, pod=pod.metadata.name)
            summary["gpus"] = [
                {"container": c.name, "uuid": g.uuid, "memory_mib": g.memory_quota_mib, "cores": g.cores}
                for c in allocation.containers
                for g in c.gpus
            ]
        except ContractError as e:
            summary["error"] = str(e)
    return summary


def status(root: Path) -> dict[str, Any]:
    """Processes, nodes with their GPUs and slices, pods with their GPU shares, as plain data."""
    layout = Layout(root)
    state = load_state(layout)
    if state is None:
        return {"up": False}
    api = api_client(state)
    try:
        core = client.CoreV1Api(api)
        return {
            "up": True,
            "processes": {p.name: ("running" if alive(p) else "exited") for p in state.processes},
            "nodes": [_node_summary(n, state) for n in core.list_node().items],
            "pods": [_pod_summary(p) for p in core.list_pod_for_all_namespaces().items],
        }
    finally:
        api.close()
