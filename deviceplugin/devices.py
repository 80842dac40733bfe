"""Pure logic over the node's GPUs: the slices advertised to the kubelet and their health.

A GPU is healthy while it is present (NVML still answers for it) and has had no critical XID since it
last came back. Losing a GPU and getting it back (a reset, a re-attach) clears a past XID fault.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass

from tessera.contract import HEALTHY, UNHEALTHY, GpuInfo, slice_id

# XIDs caused by the application (its own bad kernel, out-of-range access, a reset it asked for), not
# by the GPU: the GPU is still fine for the next container. NVIDIA's own device plugin skips the same.
APPLICATION_XIDS = frozenset({13, 31, 43, 45, 68, 109})


def is_critical_xid(xid: int) -> bool:
    return xid not in APPLICATION_XIDS


@dataclass(frozen=True, slots=True)
class GpuHealth:
    present: bool = True
    # The critical XID that took the GPU out of service, if any.
    fault_xid: int | None = None

    @property
    def healthy(self) -> bool:
        return self.present and self.fault_xid is None

    def with_xid(self, xid: int) -> GpuHealth:
        if not is_critical_xid(xid) or self.fault_xid is not None:
            return self
        return GpuHealth(present=self.present, fault_xid=xid)

    def with_presence(self, present: bool) -> GpuHealth:
        if present == self.present:
            return self
        if present:
            return GpuHealth(present=True, fault_xid=None)
        return GpuHealth(present=False, fault_xid=self.fault_xid)


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
