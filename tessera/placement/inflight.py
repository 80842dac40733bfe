"""The in-flight rule (shared by the extender's bind and the device plugin's Allocate).

An *in-flight* container belongs to a pod bound to a node with allocation phase ``allocating``
that the device plugin has not served yet. Its key is (GPU count, sorted GPU UUIDs, per-GPU memory
and cores). The kubelet's Allocate carries only slice IDs, so the device plugin tells in-flight
containers apart by key: for every GPU count k, the in-flight containers of *different pods* asking
for k GPUs must all share one key. (One pod's own containers may differ: the kubelet allocates a
pod's containers one after the other, in spec order, before the next pod.)

A pod that would break the rule is refused at bind with a retriable error; in-flight pods that are
gone or whose bind time is older than a timeout are ignored by the caller, so a lost pod never
blocks a node for long.
"""

from __future__ import annotations

from collections.abc import Mapping

from tessera.contract import Allocation, ContainerAllocation

InflightKey = tuple[int, tuple[str, ...], tuple[tuple[int, int], ...]]


def container_key(container: ContainerAllocation) -> InflightKey:
    """(GPU count, sorted GPU UUIDs, (memory, cores) per GPU in UUID order)."""
    grants = sorted(container.gpus, key=lambda g: g.uuid)
    return (len(grants), tuple(g.uuid for g in grants), tuple((g.memory_mib, g.cores) for g in grants))


def inflight_conflict(allocation: Allocation, inflight: Mapping[str, Allocation]) -> str | None:
    """Why ``allocation`` may not be in flight together with ``inflight`` (pod name -> allocation of
    the other in-flight pods on the same node), or None when it may."""
    mine: dict[int, set[InflightKey]] = {}
    for container in allocation.containers:
        key = container_key(container)
        mine.setdefault(key[0], set()).add(key)
    for pod, other in inflight.items():
        for container in other.containers:
            key = container_key(container)
            own = mine.get(key[0])
            if own and own != {key}:
                return (
                    f"pod {pod} is still being admitted on node {allocation.node} with a {key[0]}-GPU "
                    f"container on {', '.join(key[1])}; a different {key[0]}-GPU container cannot be in "
                    "flight with it (retry after the device plugin serves it)"
                )
    return None
