"""What `tessera status` reports, built from API objects (plain JSON, as the API server sends them):
nodes with their GPUs from the inventories, the pods on each GPU from their allocations, and Pending
pods with the extender's reason. DRA nodes and their claims: tessera/cli/status/dra.py."""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from datetime import datetime
from typing import Any

from tessera.contract import (
    MIB,
    ContractError,
    ContractKeys,
    parse_allocation,
    parse_gpu_usage,
    parse_inventory,
    parse_time,
    pod_ref,
)

TERMINAL_PHASES = ("Succeeded", "Failed")


@dataclass
class PodOnGpu:
    namespace: str
    pod: str
    container: str
    memory_bytes: int
    cores_percent: int
    phase: str
    # From the node agent's metrics, when reachable.
    memory_used_bytes: int | None = None


@dataclass
class ClaimOnGpu:
    """A DRA claim allocated a share of the GPU: its quotas there (its requests on it added up), and
    the pods it is reserved for."""

    namespace: str
    claim: str
    pods: list[str]
    memory_bytes: int
    cores_percent: int
    # From the DRA driver's metrics, when reachable.
    memory_used_bytes: int | None = None


@dataclass
class GpuStatus:
    uuid: str
    index: int
    model: str
    health: str
    memory_bytes: int
    slices_total: int
    memory_allocated_bytes: int = 0
    cores_allocated_percent: int = 0
    slices_used: int = 0
    pods: list[PodOnGpu] = field(default_factory=list)
    claims: list[ClaimOnGpu] = field(default_factory=list)
    # From the node agent's metrics (NVML), when reachable.
    memory_used_bytes: int | None = None
    utilization_ratio: float | None = None


@dataclass
class NodeStatus:
    name: str
    heartbeat_age_seconds: float | None
    # Why the node's annotations could not be read, if they could not.
    error: str | None = None
    gpus: list[GpuStatus] = field(default_factory=list)
    # "ok", "not reachable: ...", or "no node agent pod".
    metrics: str = "not asked"
    # Its GPUs are the DRA driver's devices (its ResourceSlice), shared by claims; it has no heartbeat.
    dra: bool = False


@dataclass
class PendingPod:
    namespace: str
    pod: str
    reason: str


@dataclass
class Status:
    nodes: list[NodeStatus]
    pending: list[PendingPod]
    # Allocations that could not be read or name a GPU no inventory has.
    problems: list[str] = field(default_factory=list)


Json = Mapping[str, Any]


def _annotations(obj: Json) -> Mapping[str, str]:
    return (obj.get("metadata") or {}).get("annotations") or {}


def _requests_gpus(pod: Json, keys: ContractKeys) -> bool:
    for container in (pod.get("spec") or {}).get("containers") or []:
        resources = container.get("resources") or {}
        if keys.vgpu in (resources.get("limits") or {}) or keys.vgpu in (resources.get("requests") or {}):
            return True
    return False


def _event_time(event: Json) -> str:
    series = event.get("series") or {}
    return str(
        series.get("lastObservedTime")
        or event.get("lastTimestamp")
        or event.get("eventTime")
        or (event.get("metadata") or {}).get("creationTimestamp")
        or ""
    )


def _add_measured_use(gpus: dict[str, GpuStatus], text: str | None, node: str) -> None:
    """The node agent's published use (the Node's gpu-usage annotation), until its metrics, when
    readable, say more; an unreadable one adds nothing."""
    if text is None:
        return
    try:
        usage = parse_gpu_usage(text, node=node)
    except ContractError:
        return
    for measured in usage.gpus:
        gpu = gpus.get(measured.uuid)
        if gpu is not None:
            gpu.memory_used_bytes = measured.memory_used_mib * MIB
            gpu.utilization_ratio = measured.utilization_percent / 100


def build_status(
    nodes: Iterable[Json],
    pods: Iterable[Json],
    events: Iterable[Json],
    keys: ContractKeys,
    moment: datetime,
) -> Status:
    report = Status(nodes=[], pending=[])
    gpus: dict[str, GpuStatus] = {}
    for node in sorted(nodes, key=lambda n: str(n["metadata"]["name"])):
        name = str(node["metadata"]["name"])
        annotations = _annotations(node)
        text = annotations.get(keys.node_gpus)
        if text is None:
            continue  # not a Tessera node
        entry = NodeStatus(name=name, heartbeat_age_seconds=None)
        report.nodes.append(entry)
        beat = annotations.get(keys.node_heartbeat)
        try:
            if beat is not None:
                entry.heartbeat_age_seconds = (
                    moment - parse_time(beat, field=keys.node_heartbeat)
                ).total_seconds()
            inventory = parse_inventory(text, node=name)
        except ContractError as e:
            entry.error = str(e)
            continue
        for info in sorted(inventory, key=lambda g: g.index):
            gpus[info.uuid] = GpuStatus(
                uuid=info.uuid,
                index=info.index,
                model=info.model,
                health=info.health,
                memory_bytes=info.total_memory_mib * MIB,
                slices_total=info.split,
            )
            entry.gpus.append(gpus[info.uuid])
        _add_measured_use(gpus, annotations.get(keys.node_gpu_usage), name)

    reasons: dict[tuple[str, str], tuple[str, str]] = {}
    for event in events:
        involved = event.get("involvedObject") or {}
        where = (str(involved.get("namespace")), str(involved.get("name")))
        when = _event_time(event)
        if where not in reasons or when >= reasons[where][0]:
            reasons[where] = (when, str(event.get("message") or "").strip())

    for pod in sorted(pods, key=lambda p: (p["metadata"].get("namespace", ""), p["metadata"]["name"])):
        metadata = pod["metadata"]
        namespace, name = str(metadata.get("namespace", "")), str(metadata["name"])
        ref = pod_ref(namespace, name)
        pod_status = pod.get("status") or {}
        if pod_status.get("phase") in TERMINAL_PHASES:
            continue
        annotations = _annotations(pod)
        text = annotations.get(keys.allocation)
        node_name = (pod.get("spec") or {}).get("nodeName")
        if text is not None and node_name:
            try:
                allocation = parse_allocation(text, pod=ref)
            except ContractError as e:
                report.problems.append(str(e))
                continue
            phase = annotations.get(keys.allocation_phase, "")
            for container in allocation.containers:
                for grant in container.gpus:
                    gpu = gpus.get(grant.uuid)
                    if gpu is None:
                        report.problems.append(
                            f"pod {ref}: container {container.name} holds GPU {grant.uuid}, "
                            f"which no node's inventory lists"
                        )
                        continue
                    gpu.pods.append(
                        PodOnGpu(
                            namespace, name, container.name, grant.memory_quota_mib * MIB, grant.cores, phase
                        )
                    )
                    gpu.memory_allocated_bytes += grant.memory_quota_mib * MIB
                    gpu.cores_allocated_percent += grant.cores
                    gpu.slices_used += 1
        elif not node_name and pod_status.get("phase", "Pending") == "Pending" and _requests_gpus(pod, keys):
            reason = reasons.get((namespace, name), ("", ""))[1]
            if not reason:
                condition: Json = next(
                    (c for c in pod_status.get("conditions") or [] if c.get("type") == "PodScheduled"), {}
                )
                reason = str(condition.get("message") or "not scheduled yet (no FailedScheduling event)")
            report.pending.append(PendingPod(namespace, name, reason))
    return report
