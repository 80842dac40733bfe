"""Builders of Node and Pod objects (API JSON, as kube-scheduler and the API server send them)."""

from __future__ import annotations

from datetime import datetime
from typing import Any

from tessera.contract import (
    KEYS,
    Allocation,
    ContainerAllocation,
    GpuGrant,
    GpuInfo,
    Phase,
    dump_allocation,
    dump_inventory,
    format_time,
)


def inventory(node: str, model: str, memory_mib: int, count: int = 4, split: int = 4) -> list[GpuInfo]:
    return [
        GpuInfo(
            uuid=f"GPU-{node}-{i}",
            index=i,
            model=model,
            total_memory_mib=memory_mib,
            sm_count=80,
            compute_capability="8.0",
            numa_node=0,
            split=split,
        )
        for i in range(count)
    ]


def node_object(name: str, gpus: list[GpuInfo] | None, heartbeat: datetime | None) -> dict[str, Any]:
    annotations: dict[str, str] = {}
    if gpus is not None:
        annotations[KEYS.node_gpus] = dump_inventory(gpus)
    if heartbeat is not None:
        annotations[KEYS.node_heartbeat] = format_time(heartbeat)
    return {"metadata": {"name": name, "annotations": annotations}, "status": {}}


def gpu_pod(
    name: str,
    *,
    vgpu: int = 1,
    memory: int | None = 4096,
    cores: int | None = 30,
    annotations: dict[str, str] | None = None,
    namespace: str = "default",
    uid: str | None = None,
    scheduler: str = "tessera-scheduler",
) -> dict[str, Any]:
    limits = {KEYS.vgpu: str(vgpu)}
    if memory is not None:
        limits[KEYS.vgpu_memory] = str(memory)
    if cores is not None:
        limits[KEYS.vgpu_cores] = str(cores)
    metadata: dict[str, Any] = {"name": name, "namespace": namespace, "annotations": annotations or {}}
    if uid is not None:
        metadata["uid"] = uid
    return {
        "metadata": metadata,
        "spec": {
            "schedulerName": scheduler,
            "containers": [{"name": "main", "image": "local/cuda:latest", "resources": {"limits": limits}}],
        },
    }


def bound_to(
    pod: dict[str, Any], node: str, gpu: int, bind_time: str = "2026-01-01T11:00:00Z"
) -> dict[str, Any]:
    """``pod`` (of one container, one GPU) bound to ``node`` as the extender would have bound it, on
    its GPU at position ``gpu`` with the memory it asks, phase allocated (served)."""
    limits = pod["spec"]["containers"][0]["resources"]["limits"]
    allocation = Allocation(
        node=node,
        containers=(
            ContainerAllocation(
                name="main",
                gpus=(
                    GpuGrant(
                        uuid=f"GPU-{node}-{gpu}",
                        memory_quota_mib=int(limits[KEYS.vgpu_memory]),
                        cores=int(limits.get(KEYS.vgpu_cores, 0)),
                    ),
                ),
            ),
        ),
    )
    pod["metadata"]["annotations"].update(
        {
            KEYS.allocation: dump_allocation(allocation),
            KEYS.allocation_phase: Phase.ALLOCATED.value,
            KEYS.bind_time: bind_time,
        }
    )
    pod["spec"]["nodeName"] = node
    return pod
