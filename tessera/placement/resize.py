"""Live resize: new quotas for a placed pod, on the GPUs it already has.

:func:`resize` decides whether a pod's new quotas fit where it is: every other grant on its GPUs
(pods placed and pods in flight alike, as the node's state counts them) plus the new quotas must stay
within each GPU's memory and compute. A pod never moves: what does not fit is refused, naming the
GPU and the shortfall. Shrinking always fits.
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
                memory_mib=g.memory_mib if change.memory_mib is None else change.memory_mib,
                cores=g.cores if change.cores is None else change.cores,
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
    delta: dict[str, list[int]] = {}
    for before, after in zip(allocation.containers, resized.containers, strict=True):
        for old, new in zip(before.gpus, after.gpus, strict=True):
            memory_cores = delta.setdefault(old.uuid, [0, 0])
            memory_cores[0] += new.memory_mib - old.memory_mib
            memory_cores[1] += new.cores - old.cores
    for uuid, (memory, cores) in delta.items():
        position = node.gpu_position(uuid)
        if position is None:
            return ResizeRefusal(f"GPU {uuid} is no longer in node {node.name!r}'s inventory", Shortfall.NODE)
        gpu = node.gpus[position]
        if memory > 0 and memory > gpu.free_memory_mib:
            return ResizeRefusal(
                f"GPU {uuid} on node {node.name}: {memory} MiB more memory asked, "
                f"{max(gpu.free_memory_mib, 0)} MiB of {gpu.memory_mib} MiB free",
                Shortfall.MEMORY,
            )
        if cores > 0 and cores > gpu.free_cores:
            return ResizeRefusal(
                f"GPU {uuid} on node {node.name}: {cores}% more compute asked, "
                f"{max(gpu.free_cores, 0)}% of {MAX_CORES}% free",
                Shortfall.COMPUTE,
            )
    return resized
