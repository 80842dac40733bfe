"""Pure logic over the node's GPUs: the slices advertised to the kubelet and their health (its
rules: :mod:`nodeagent.health`)."""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass

from nodeagent.health import GpuHealth
from tessera.contract import HEALTHY, UNHEALTHY, GpuInfo, slice_id


@dataclass(frozen=True, slots=True)
class VirtualDevice:
    """One slice as the kubelet sees it."""

    id: str
    healthy: bool
    numa_node: int | None


def with_health(gpus: Iterable[GpuInfo], health: Mapping[str, GpuHealth]) -> tuple[GpuInfo, ...]:
    """The inventory with each GPU's health field set from ``health`` (missing = healthy)."""
    return tuple(
        gpu.model_copy(update={"health": HEALTHY if health.get(gpu.uuid, GpuHealth()).healthy else UNHEALTHY})
        for gpu in gpus
    )


def virtual_devices(gpus: Iterable[GpuInfo]) -> tuple[VirtualDevice, ...]:
    """Every GPU as ``gpu.split`` slices ``<uuid>::0 .. <uuid>::<split-1>``, in inventory order."""
    return tuple(
        VirtualDevice(id=slice_id(gpu.uuid, n), healthy=gpu.healthy, numa_node=gpu.numa_node)
        for gpu in gpus
        for n in range(gpu.split)
    )
