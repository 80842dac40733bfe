"""``sandbox.json``: what `up` started, read by `down`, `status`, `restart`, the node commands and
the tests."""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Literal

from kubernetes import client, config
from pydantic import BaseModel, ConfigDict

from sandbox.layout import Layout
from sandbox.nodes import NodeAddresses
from sandbox.processes import Started, StartError

# mixed: the last node runs the DRA driver, the others the device plugin (docs/dra.md, "One mode per
# node").
Mode = Literal["deviceplugin", "dra", "mixed"]
MODES: tuple[Mode, ...] = ("deviceplugin", "dra", "mixed")


def node_mode(mode: Mode, node: str, further: Sequence[str]) -> Mode:
    """The node's own agent in a sandbox of ``mode`` whose further nodes are ``further``: a mixed
    cluster's last node runs the DRA driver, its others the device plugin."""
    if mode != "mixed":
        return mode
    return "dra" if further and node == further[-1] else "deviceplugin"


class FurtherNode(BaseModel):
    """A node after the first (sandbox.nodes): its name, its place on the node network and its fake
    GPUs (sandbox.fakenode.PRESETS names)."""

    model_config = ConfigDict(extra="forbid")

    name: str
    index: int
    gpus: tuple[str, ...]

    @property
    def addresses(self) -> NodeAddresses:
        return NodeAddresses(self.index)

    def process_name(self, component: str) -> str:
        return f"{self.name}/{component}"


class SandboxState(BaseModel):
    """``sandbox.json``: what `up` started, for `down`, `status`, `restart` and the tests."""

    model_config = ConfigDict(extra="forbid")

    node: str
    kubeconfig: str
    api_url: str
    kubernetes_bin: str
    """The Kubernetes binaries, helm and kubectl included, the sandbox runs."""
    kubelet_port: int
    kubelet_healthz_port: int
    processes: list[Started]
    mode: Mode = "deviceplugin"
    ready_seconds: float = 0.0
    prometheus_url: str = ""
    """The sandbox's Prometheus (`up --monitoring`); empty without."""
    health: dict[str, str] = {}
    """A health URL for each component `restart` waits on besides the kubelet and the plugin."""
    nodes: list[FurtherNode] = []
    """The nodes after the first (`up --nodes N`), each in namespaces of its own."""
    stopped: list[str] = []
    """Nodes `node stop` stopped (and no `node start` started since)."""
    partitioned: list[str] = []
    """Nodes `node partition` cut off from the control plane (and no `node heal` joined since)."""

    def process(self, name: str) -> Started:
        for p in self.processes:
            if p.name == name:
                return p
        raise KeyError(f"no process named {name!r} in the sandbox state")

    def replace(self, new: Started) -> None:
        self.processes = [new if p.name == new.name else p for p in self.processes]

    def node_mode(self, node: str) -> Mode:
        return node_mode(self.mode, node, [n.name for n in self.nodes])

    def further_node(self, name: str) -> FurtherNode:
        for n in self.nodes:
            if n.name == name:
                return n
        raise KeyError(name)


def load_state(layout: Layout) -> SandboxState | None:
    if not layout.state_file.exists():
        return None
    return SandboxState.model_validate_json(layout.state_file.read_text())


def save_state(layout: Layout, state: SandboxState) -> None:
    layout.state_file.write_text(state.model_dump_json(indent=2))


def running_state(root: Path) -> tuple[Layout, SandboxState]:
    """The layout and state of the sandbox up in ``root``; StartError when none is."""
    layout = Layout(root)
    state = load_state(layout)
    if state is None:
        raise StartError(f"no sandbox is up in {root}")
    return layout, state


def api_client(state: SandboxState) -> client.ApiClient:
    return config.new_client_from_config(config_file=state.kubeconfig)


def node_ready(api: client.ApiClient, node: str) -> bool:
    try:
        status = client.CoreV1Api(api).read_node_status(node).status
    except client.ApiException:
        return False
    return any(c.type == "Ready" and c.status == "True" for c in status.conditions or [])
