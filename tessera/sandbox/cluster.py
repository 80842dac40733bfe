"""`tessera sandbox up/down/status`: the whole path on one machine, every part a real process.

``up`` starts, with all state under one directory: containerd (with the project's images imported),
etcd + kube-apiserver + kube-scheduler (:mod:`tessera.localcluster`), the extender, a kubelet
registered as a real node, and the device plugin on that node over the fake GPU driver. It records
what it started in ``sandbox.json`` and returns; the processes run on. ``down`` stops them newest
first and removes what they left on the host (:mod:`tessera.sandbox.host`).
"""

from __future__ import annotations

import shutil
import socket
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

from kubernetes import client, config
from pydantic import BaseModel, ConfigDict

from tessera.localcluster import ControlPlane, ManagedProcess, default_bin_dir
from tessera.sandbox import containerd, host, images, kubelet
from tessera.sandbox.layout import Layout
from tessera.sandbox.processes import Started, StartError, alive, stop, wait_for

KUBERNETES_BINARIES = ("etcd", "kube-apiserver", "kube-scheduler", "kubelet")


def default_node_name() -> str:
    """This host's name, as the kubelet would use: it resolves to 127.0.0.1 on these machines."""
    return socket.gethostname().lower()


class SandboxState(BaseModel):
    """``sandbox.json``: what `up` started, for `down`, `status` and the tests."""

    model_config = ConfigDict(extra="forbid")

    node: str
    kubeconfig: str
    api_url: str
    kubelet_port: int
    kubelet_healthz_port: int
    processes: list[Started]
    ready_seconds: float = 0.0

    def process(self, name: str) -> Started:
        for p in self.processes:
            if p.name == name:
                return p
        raise KeyError(f"no process named {name!r} in the sandbox state")

    def replace(self, new: Started) -> None:
        self.processes = [new if p.name == new.name else p for p in self.processes]


@dataclass(frozen=True, slots=True)
class Options:
    root: Path
    node: str = field(default_factory=default_node_name)
    kubelet_port: int = 10250
    kubelet_healthz_port: int = 10248
    kubernetes_bin: Path = field(default_factory=default_bin_dir)
    timeout: float = 180.0


def load_state(layout: Layout) -> SandboxState | None:
    if not layout.state_file.exists():
        return None
    return SandboxState.model_validate_json(layout.state_file.read_text())


def save_state(layout: Layout, state: SandboxState) -> None:
    layout.state_file.write_text(state.model_dump_json(indent=2))


def _recorded(process: ManagedProcess) -> Started:
    """A control-plane process (started by localcluster) in the sandbox's own record."""
    assert process.popen is not None, f"{process.name} was not started"
    ticks = Path(f"/proc/{process.popen.pid}/stat").read_text().rsplit(")", 1)[1].split()[19]
    return Started(
        name=process.name,
        pid=process.popen.pid,
        start_ticks=int(ticks),
        log=str(process.log_path),
        argv=tuple(process.args),
    )


def api_client(state: SandboxState) -> client.ApiClient:
    return config.new_client_from_config(config_file=state.kubeconfig)


def node_ready(api: client.ApiClient, node: str) -> bool:
    try:
        status = client.CoreV1Api(api).read_node_status(node).status
    except client.ApiException:
        return False
    return any(c.type == "Ready" and c.status == "True" for c in status.conditions or [])


def preflight(options: Options, layout: Layout) -> list[str]:
    facts = host.gather_facts(
        layout,
        options.kubernetes_bin,
        KUBERNETES_BINARIES,
        (options.kubelet_port, options.kubelet_healthz_port),
        options.node,
    )
    return host.problems(facts)


@dataclass
class _Starting:
    """Processes started so far by one `up`, stopped newest first if a later step fails."""

    layout: Layout
    started: list[Started] = field(default_factory=list)

    def add(self, process: Started) -> Started:
        self.started.append(process)
        return process

    def undo(self) -> None:
        for process in reversed(self.started):
            stop(process)


def start_runtime(
    layout: Layout, starting: _Starting, driver: dict[str, Path], driver_env: dict[str, str]
) -> None:
    tarballs = images.write_images(layout.images)
    containerd.write_files(layout, driver, driver_env)
    starting.add(containerd.start_containerd(layout))
    containerd.import_images(layout, tarballs)


def start_control_plane(options: Options, layout: Layout, starting: _Starting) -> ControlPlane:
    plane = ControlPlane(work_dir=layout.cluster, bin_dir=options.kubernetes_bin)
    plane.start(timeout=options.timeout)
    for process in plane.processes:
        starting.add(_recorded(process))
    return plane


def start_node(options: Options, layout: Layout, starting: _Starting, plane: ControlPlane) -> Started:
    kubelet.write_files(layout, options.kubelet_port, options.kubelet_healthz_port)
    host.create_cgroup_root()
    process = starting.add(
        kubelet.start_kubelet(layout, options.kubernetes_bin / "kubelet", plane.kubeconfig, options.node)
    )
    api = config.new_client_from_config(config_file=str(plane.kubeconfig))
    try:
        wait_for(
            f"node {options.node} to be Ready",
            lambda: node_ready(api, options.node),
            process,
            options.timeout,
        )
    finally:
        api.close()
    return process


def up(options: Options, report: Callable[[str], None] = print) -> SandboxState:
    """Start the sandbox; raises :class:`StartError` (after stopping what it started) on failure."""
    layout = Layout(options.root)
    found = preflight(options, layout)
    if found:
        raise StartError("cannot start the sandbox:\n  - " + "\n  - ".join(found))
    began = time.monotonic()
    layout.root.mkdir(parents=True, exist_ok=True)
    host.take_snapshot(layout)
    starting = _Starting(layout)
    try:
        report("images and containerd")
        start_runtime(layout, starting, {}, {})
        report("control plane (etcd, kube-apiserver)")
        plane = start_control_plane(options, layout, starting)
        report(f"kubelet (node {options.node})")
        start_node(options, layout, starting, plane)
    except BaseException:
        starting.undo()
        host.restore_host(layout)
        raise
    state = SandboxState(
        node=options.node,
        kubeconfig=str(plane.kubeconfig),
        api_url=plane.api_url,
        kubelet_port=options.kubelet_port,
        kubelet_healthz_port=options.kubelet_healthz_port,
        processes=starting.started,
        ready_seconds=round(time.monotonic() - began, 1),
    )
    save_state(layout, state)
    return state


# Graceful first: deleting the pods lets the kubelet stop their containers and tear down their
# networks through CRI, which also releases CNI state. What is left after this is killed.
POD_DRAIN_SECONDS = 60.0


def _drain_pods(state: SandboxState, layout: Layout) -> None:
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
    """Stop everything and clean the host; returns what could not be removed (empty when clean)."""
    layout = Layout(root)
    state = load_state(layout)
    if state is not None:
        names = {p.name for p in state.processes}
        if "kubelet" in names and alive(state.process("kubelet")):
            report("deleting pods")
            try:
                _drain_pods(state, layout)
            except Exception as e:  # the apiserver may already be gone; the forced path follows
                report(f"could not delete pods through the API ({e}); killing them instead")
        for process in reversed(state.processes):
            report(f"stopping {process.name}")
            stop(process)
    report("removing mounts, cgroups, network devices and host directories")
    host.restore_host(layout)
    left = host.leftovers(layout)
    if not left:
        for entry in layout.root.iterdir() if layout.root.exists() else []:
            if entry != layout.logs:
                shutil.rmtree(entry) if entry.is_dir() and not entry.is_symlink() else entry.unlink()
    return left


def status(root: Path) -> dict[str, object]:
    """Processes, nodes, GPUs, slices and pods, as plain data for printing."""
    layout = Layout(root)
    state = load_state(layout)
    if state is None:
        return {"up": False}
    result: dict[str, object] = {
        "up": True,
        "processes": {p.name: ("running" if alive(p) else "exited") for p in state.processes},
    }
    api = api_client(state)
    try:
        core = client.CoreV1Api(api)
        result["nodes"] = [
            {
                "name": n.metadata.name,
                "ready": any(c.type == "Ready" and c.status == "True" for c in n.status.conditions or []),
                "allocatable": dict(n.status.allocatable or {}),
            }
            for n in core.list_node().items
        ]
        result["pods"] = [
            {
                "namespace": p.metadata.namespace,
                "name": p.metadata.name,
                "node": p.spec.node_name,
                "phase": p.status.phase,
            }
            for p in core.list_pod_for_all_namespaces().items
        ]
    finally:
        api.close()
    return result
