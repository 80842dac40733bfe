"""Builders of Node and Pod objects (API JSON, as kube-scheduler and the API server send them)."""

from __future__ import annotations

from datetime import datetime
from typing import Any

from tessera.contract import KEYS, GpuInfo, dump_inventory, format_time


def inventory(node: str, model: str, memory_mib: int, count: int = 4, split: int = 4) -> list[GpuInfo]:
    return [
        GpuInfo(
            uuid=f"GPU-{node}-{i}",
            index=i,
            model=model,
            memory_mib=memory_mib,
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
