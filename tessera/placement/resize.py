"""Live resize: new quotas for a placed pod, on the GPUs it already has.

:func:`resize` decides whether a pod's new quotas fit where it is: every other grant on its GPUs
(pods placed and pods in flight alike, as the node's state counts them) plus the new quotas must stay
within each GPU's memory and compute. A pod never moves: what does not fit is refused, naming the
GPU and the shortfall. Shrinking always fits.

An oversubscribed grant (a best-effort pod placed against measured use, :mod:`.usage`) stays
oversubscribed: it grows only as far as the GPU's measured use (with the margin and the grants placed
since) leaves room, as it was placed, and never by requests (that would promise it memory that
guaranteed pods were promised); its cores change freely, as they reserve nothing.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

from tessera.contract import (
    MAX_CORES,
    Allocation,
    ContainerAllocation,
    GpuGrant,
    QuotaChange,
    ResizeRequest,
)
from tessera.placement.fit import headroom_mib
from tessera.placement.model import NodeState, Shortfall


@dataclass(frozen=True, slots=True)
class ResizeRefusal:
    """The resize does not fit, or names what the pod does not have; ``reason`` names the numbers."""

    reason: str
    shortfall: Shortfall | None  # None: the request itself is wrong for this pod (no such container)


def _changes(allocation: Allocation, request: ResizeRequest) -> Mapping[str, QuotaChange] | ResizeRefusal:
    """The request's changes by the allocation's container names."""
    names = [c.name for c in allocation.containers]
    changes: dict[str, QuotaChange] = {}
    for asked, change in request.containers.items():
        name = asked or names[0]
        if not asked and len(names) != 1:
            return ResizeRefusal(
                f"the pod has {len(names)} GPU containers ({', '.join(names)}): name the one to resize "
                "(<container>:memory=...)",
                None,
            )
        if name not in names:
            return ResizeRefusal(
                f"container {name!r} has no GPU allocation (GPU containers: {', '.join(names)})", None
            )
        changes[name] = change
    return changes


def _resized(container: ContainerAllocation, change: QuotaChange | None) -> ContainerAllocation:
    if change is None:
        return container
    return ContainerAllocation(
        name=container.name,
        gpus=tuple(
            GpuGrant(
                uuid=g.uuid,
                memory_quota_mib=g.memory_quota_mib
                if change.memory_quota_mib is None
                else change.memory_quota_mib,
                cores=g.cores if change.cores is None else change.cores,
                oversubscribed=g.oversubscribed,
            )
            for g in container.gpus
        ),
    )


def resize(node: NodeState, allocation: Allocation, request: ResizeRequest) -> Allocation | ResizeRefusal:
    """``allocation`` with the new quotas of ``request``, or why not.

    ``node`` counts every pod on it, this one with its current ``allocation`` included: its grants
    are given back before the new ones are checked.
    """
    changes = _changes(allocation, request)
    if isinstance(changes, ResizeRefusal):
        return changes
    resized = Allocation(
        node=allocation.node,
        containers=tuple(_resized(c, changes.get(c.name)) for c in allocation.containers),
        qos=allocation.qos,
    )
    # By GPU: the memory and cores asked more by requests, and the memory asked more against use.
    delta: dict[str, list[int]] = {}
    for before, after in zip(allocation.containers, resized.containers, strict=True):
        for old, new in zip(before.gpus, after.gpus, strict=True):
            asked = delta.setdefault(old.uuid, [0, 0, 0])
            if old.oversubscribed:
                asked[2] += new.memory_quota_mib - old.memory_quota_mib
            else:
                asked[0] += new.memory_quota_mib - old.memory_quota_mib
                asked[1] += new.cores - old.cores
    for uuid, (memory, cores, against_use) in delta.items():
        position = node.gpu_position(uuid)
        if position is None:
            return ResizeRefusal(f"GPU {uuid} is no longer in node {node.name!r}'s inventory", Shortfall.NODE)
        gpu = node.gpus[position]
        if against_use > 0 and (
            gpu.measured_mib is None or gpu.measured_mib + against_use > gpu.total_memory_mib
        ):
            left = "no fresh measured use" if gpu.measured_mib is None else f"{headroom_mib(gpu)} MiB left"
            return ResizeRefusal(
                f"GPU {uuid} on node {node.name}: {against_use} MiB more memory asked for a best-effort "
                f"grant placed against measured use; {left} by measured use (with the safety margin)",
                Shortfall.MEMORY,
            )
        if memory > 0 and memory > gpu.free_memory_mib:
            return ResizeRefusal(
                f"GPU {uuid} on node {node.name}: {memory} MiB more memory asked, "
                f"{max(gpu.free_memory_mib, 0)} MiB of {gpu.total_memory_mib} MiB free",
                Shortfall.MEMORY,
            )
        if cores > 0 and cores > gpu.free_cores:
            return ResizeRefusal(
                f"GPU {uuid} on node {node.name}: {cores}% more compute asked, "
                f"{max(gpu.free_cores, 0)}% of {MAX_CORES}% free",
                Shortfall.COMPUTE,
            )
    return resized
