"""The node agent's parts on stand-ins (unit level): the Kubernetes API and the pod cache held in
memory, in-flight pods as the extender binds them, and a kubelet admitting pods."""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any

from deviceplugin.config import parse_config
from deviceplugin.driverchecks import Driver
from deviceplugin.identity import ContainerRef as IdentityRef
from deviceplugin.kube import NodePod
from deviceplugin.main import NodeAgent, compose
from deviceplugin.matching import PodView
from deviceplugin.podresources import Owners
from nodeagent.statedir import StateDir
from tessera.contract import (
    KEYS,
    Allocation,
    ContainerAllocation,
    ContainerRequest,
    GpuGrant,
    GpuInfo,
    Phase,
    QosClass,
    SharingMode,
    dump_allocation,
    format_time,
    parse_allocation,
)
from tessera.inflight import inflight_conflict

NODE = "n1"
GPUS = tuple(
    GpuInfo(
        uuid=f"GPU-{i}",
        index=i,
        model="Fake",
        total_memory_mib=16384,
        sm_count=80,
        compute_capability="8.0",
        split=10,
    )
    for i in range(4)
)


class MemoryKube:
    """Pods and a node held in memory; records what the agent patched."""

    def __init__(self, pods: list[PodView]) -> None:
        self.pods = pods
        self.phases: dict[str, Phase] = {}
        self.events: list[tuple[str, str]] = []
        self.node: dict[str, str] = {}
        self.reads = 0

    def pending_pods(self) -> list[PodView]:
        return [p for p in self.pods if p.uid not in self.phases]

    def node_pods(self) -> list[NodePod]:
        return [NodePod(p, pending=True) for p in self.pods]

    def read_pod(self, namespace: str, name: str) -> NodePod | None:
        self.reads += 1
        found = [p for p in self.pods if (p.namespace, p.name) == (namespace, name)]
        return NodePod(found[0], pending=True) if found else None

    def set_phase(self, pod: PodView, phase: Phase) -> None:
        self.phases[pod.uid] = phase

    def warn(self, pod: PodView, reason: str, message: str) -> None:
        self.events.append((pod.name, message))

    def node_annotations(self) -> dict[str, str]:
        return dict(self.node)

    def annotate_node(self, annotations: Mapping[str, str]) -> None:
        self.node.update(annotations)


class LaggingCache:
    """A pod cache that never sees a phase change or a deletion: every pod as first bound."""

    def __init__(self, pods: list[PodView]) -> None:
        self.pods = list(pods)

    def pending_pods(self) -> list[PodView]:
        return list(self.pods)

    def node_pods(self) -> list[PodView]:
        return list(self.pods)


def in_flight_pod(
    name: str,
    grants: dict[str, list[tuple[str, int, int]]],
    bind: int = 0,
    qos: QosClass = QosClass.STANDARD,
) -> PodView:
    allocation = Allocation(
        node=NODE,
        containers=tuple(
            ContainerAllocation(
                name=c, gpus=tuple(GpuGrant(uuid=u, memory_quota_mib=m, cores=k) for u, m, k in g)
            )
            for c, g in grants.items()
        ),
        qos=qos,
    )
    t0 = datetime(2026, 1, 1, tzinfo=UTC)
    return PodView(
        namespace="ns",
        name=name,
        uid=f"uid-{name}",
        created=t0,
        annotations={
            KEYS.allocation: dump_allocation(allocation),
            KEYS.allocation_phase: Phase.ALLOCATING.value,
            KEYS.bind_time: format_time(t0 + timedelta(seconds=bind)),
        },
        gpu_containers=tuple(ContainerRequest(c, len(g), None, None) for c, g in grants.items()),
    )


def make_agent(
    tmp_path: Path,
    pods: list[PodView],
    cache: object | None = None,
    pod_resources: Callable[[], Owners | None] = lambda: None,
    flags: Sequence[str] = (),
    *,
    sharing: SharingMode | None = None,
    driver: Driver | None = None,
) -> tuple[NodeAgent, MemoryKube]:
    """The agent's parts on ``pods``; ``cache`` stands in for the pod cache (None: the API only);
    ``pod_resources`` for the kubelet's pod-resources API (by default a kubelet without it: the
    pods matched are taken as admitted); ``flags``: more of its command line."""
    config = parse_config(
        [f"--node-name={NODE}", f"--state-dir={tmp_path}", "--hook-library=/opt/libvgpu.so", *flags],
        environ={},
    )
    state = StateDir(config.state_dir)
    state.prepare()
    kube = MemoryKube(pods)
    kube_any: Any = kube
    cache_any: Any = cache
    agent = compose(
        config,
        GPUS,
        kube_any,
        state,
        pod_cache=None if cache is None else lambda _: cache_any,
        pod_resources=pod_resources,
        sharing=sharing,
        driver=driver,
    )
    return agent, kube


def served_on_disk(agent: NodeAgent) -> set[tuple[str, str]]:
    """(pod UID, container) of every container whose record is in the state dir."""
    return {(r.pod_uid, r.container) for _, r in agent.served.state.records()}


def write_phases(agent: NodeAgent) -> None:
    """What the agent's loops do after Allocate: ask which pods were admitted, write their phases."""
    agent.admissions.confirm()
    agent.admissions.phases.drain()


class Kubelet:
    """The kubelet's side of admitting pods, as the agent sees it: GetPreferredAllocation among the
    free slices, Allocate of the slices it steered to, and its pod-resources API naming the
    container each device set went to (recorded as Allocate returns)."""

    def __init__(self) -> None:
        self.agent: NodeAgent | None = None
        self.owners: Owners = {}

    def pod_resources(self) -> Owners:
        return dict(self.owners)

    def admit(self, pod: PodView) -> None:
        assert self.agent is not None
        used = {d for devices in self.owners for d in devices}
        free = [f"{g.uuid}::{i}" for g in GPUS for i in range(10) if f"{g.uuid}::{i}" not in used]
        for container in pod.gpu_containers:
            picks = self.agent.allocator.preferred(free, [], container.gpu_count)
            self.agent.allocator.allocate([picks])
            self.owners[frozenset(picks)] = IdentityRef(pod.namespace, pod.name, container.name)


def bind(kube: MemoryKube, pod: PodView) -> bool:
    """The extender's bind as far as the in-flight rule goes (tessera/inflight.py): refused while a
    pod with another key of the same GPU count is in flight (phase allocating, as the API says)."""
    inflight = {
        p.ref: parse_allocation(p.annotations[KEYS.allocation]) for p in kube.pods if p.uid not in kube.phases
    }
    if inflight_conflict(parse_allocation(pod.annotations[KEYS.allocation]), inflight) is not None:
        return False
    kube.pods.append(pod)
    return True
