"""Pure logic: the node's GPUs as one ResourceSlice (resource.k8s.io/v1) of shareable devices.

Each GPU is one device that several claims may be allocated at once (``allowMultipleAllocations``),
each consuming part of two capacities: ``memory`` (bytes) and ``cores`` (percent of the GPU's time).
kube-scheduler adds up what the claims on a device consume and never lets the sum pass the device's
value. The request policies say what a claim consumes when it names no amount (the device plugin
path's defaults: all the memory, no compute quota) and what it may ask for.

A GPU that is unhealthy (:mod:`nodeagent.health`) stays in the slice with a device taint
(``<domain>/unhealthy=<why>``): ``NoExecute`` when the fault is fatal, ``NoSchedule`` otherwise
(docs/dra.md, "GPU health").
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Iterable
from dataclasses import dataclass
from datetime import UTC, datetime

from nodeagent.health import GpuHealth, HealthState
from tessera.contract import (
    DRA_CORES_CAPACITY,
    DRA_MEMORY_CAPACITY,
    MAX_CORES,
    MIB,
    ContractKeys,
    GpuInfo,
    JsonObject,
    format_time,
)
from tessera.placement.speed import SpeedProfiles

RESOURCE_API = "resource.k8s.io/v1"
# Memory is granted in MiB, as in the device plugin path's resources and the extender's placement.
MEMORY_STEP_BYTES = MIB
# A claim that names no compute share gets no compute quota (its kernels are never throttled).
DEFAULT_CORES = 0
# Device taint effects (resource.k8s.io/v1 DeviceTaint): NoSchedule keeps new claims off a device;
# NoExecute also evicts the pods whose allocated claims use it (kube-controller-manager's
# device-taint-eviction-controller), unless their claims tolerate it.
NO_SCHEDULE = "NoSchedule"
NO_EXECUTE = "NoExecute"


@dataclass(frozen=True, slots=True)
class ShareDefaults:
    """What a claim consumes of a GPU when it names no amount."""

    memory_quota_bytes: int
    cores: int


@dataclass(frozen=True, slots=True)
class DeviceCapacity:
    """What the claims on one GPU may consume in all: the device's capacities in the slice."""

    memory_bytes: int
    cores: int


def capacity_of(gpu: GpuInfo) -> DeviceCapacity:
    return DeviceCapacity(memory_bytes=gpu.total_memory_mib * MIB, cores=MAX_CORES)


def defaults_for(gpu: GpuInfo) -> ShareDefaults:
    return ShareDefaults(memory_quota_bytes=capacity_of(gpu).memory_bytes, cores=DEFAULT_CORES)


def device_name(gpu: GpuInfo) -> str:
    """The device's name in the slice: a DNS label, stable for as long as the GPU keeps its index."""
    return f"gpu-{gpu.index}"


def slice_name(node: str, keys: ContractKeys) -> str:
    return f"{node}-{keys.dra_driver}"


def nvlink_islands(gpus: Iterable[GpuInfo]) -> dict[str, str]:
    """Each GPU's NVLink island: the GPUs connected to it through NVLink, directly or not, named
    by the smallest UUID among them (a GPU without NVLink is an island of its own)."""
    listed = list(gpus)
    links: dict[str, set[str]] = {g.uuid: set() for g in listed}
    for gpu in listed:
        for peer in gpu.nvlink_peers:
            if peer in links:
                links[gpu.uuid].add(peer)
                links[peer].add(gpu.uuid)
    island: dict[str, str] = {}
    for start in links:
        if start in island:
            continue
        seen, pending = {start}, [start]
        while pending:
            for peer in links[pending.pop()]:
                if peer not in seen:
                    seen.add(peer)
                    pending.append(peer)
        name = min(seen)
        island.update(dict.fromkeys(seen, name))
    return island


def device(gpu: GpuInfo, profiles: SpeedProfiles, island: str) -> JsonObject:
    """One GPU as a shareable device; attributes are in the driver's domain (unqualified)."""
    capacity = capacity_of(gpu)
    defaults = defaults_for(gpu)
    attributes: dict[str, JsonObject] = {
        "model": {"string": profiles.model_key(gpu.model) or gpu.model},
        "productName": {"string": gpu.model},
        "uuid": {"string": gpu.uuid},
        "speedMilli": {"int": round(profiles.speed(gpu.model) * 1000)},
        "nvlinkIsland": {"string": island},
        "computeCapability": {"version": f"{gpu.compute_capability}.0"},
    }
    if gpu.numa_node is not None:
        attributes["numaNode"] = {"int": gpu.numa_node}
    return {
        "name": device_name(gpu),
        "allowMultipleAllocations": True,
        "attributes": attributes,
        "capacity": {
            DRA_MEMORY_CAPACITY: {
                "value": str(capacity.memory_bytes),
                "requestPolicy": {
                    "default": str(defaults.memory_quota_bytes),
                    "validRange": {
                        "min": str(MEMORY_STEP_BYTES),
                        "max": str(capacity.memory_bytes),
                        "step": str(MEMORY_STEP_BYTES),
                    },
                },
            },
            DRA_CORES_CAPACITY: {
                "value": str(capacity.cores),
                "requestPolicy": {
                    "default": str(defaults.cores),
                    "validRange": {"min": "0", "max": str(capacity.cores), "step": "1"},
                },
            },
        },
    }


def device_taint(health: GpuHealth, since: float, keys: ContractKeys) -> JsonObject | None:
    """The taint of a GPU in this ``health`` since ``since`` (Unix time); None when it is healthy."""
    if health.healthy:
        return None
    return {
        "key": keys.dra_unhealthy_taint,
        "value": health.reason,
        "effect": NO_EXECUTE if health.fatal else NO_SCHEDULE,
        # When the GPU turned so: a NoExecute taint evicts from this time on (plus a toleration's
        # seconds), and it stays the same across rewrites of the slice.
        "timeAdded": format_time(datetime.fromtimestamp(since, UTC)),
    }


def resource_slice(
    node: str,
    gpus: Iterable[GpuInfo],
    profiles: SpeedProfiles,
    generation: int,
    keys: ContractKeys,
    *,
    health: HealthState | None = None,
) -> JsonObject:
    """The node's one slice: its GPUs, as pool ``<node>`` of the driver, each unhealthy one in
    ``health`` (None: all healthy) with its taint."""
    listed = list(gpus)
    islands = nvlink_islands(listed)
    devices = [device(g, profiles, islands[g.uuid]) for g in listed]
    if health is not None:
        for gpu, entry in zip(listed, devices, strict=True):
            taint = device_taint(
                health.gpus.get(gpu.uuid, GpuHealth()), health.since.get(gpu.uuid, 0.0), keys
            )
            if taint is not None:
                entry["taints"] = [taint]
    return {
        "apiVersion": RESOURCE_API,
        "kind": "ResourceSlice",
        "metadata": {
            "name": slice_name(node, keys),
            "annotations": {keys.dra_slice_digest: devices_digest(devices)},
        },
        "spec": {
            "driver": keys.dra_driver,
            "nodeName": node,
            "pool": {"name": node, "generation": generation, "resourceSliceCount": 1},
            "devices": devices,
        },
    }


def devices_digest(devices: object) -> str:
    """A digest of what a slice says about its devices: the publisher compares this annotation of
    what it wrote, not the stored devices, which the API server may default or reformat."""
    return hashlib.sha256(json.dumps(devices, sort_keys=True).encode()).hexdigest()[:32]
