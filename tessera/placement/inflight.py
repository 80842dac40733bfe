"""The in-flight rule (shared by the extender's bind and the device plugin's Allocate).

An *in-flight* container belongs to a pod bound to a node with allocation phase ``allocating``
that the device plugin has not served yet. Its key is (GPU count, sorted GPU UUIDs, per-GPU memory
and cores). The kubelet's Allocate carries only slice IDs, so the device plugin tells in-flight
containers apart by key: for every GPU count k, the in-flight containers of *different pods* asking
for k GPUs must all share one key. (One pod's own containers may differ: the kubelet allocates a
pod's containers one after the other, in spec order, before the next pod.)

A pod that would break the rule is refused at bind with a retriable error; in-flight pods that are
gone or whose bind time is older than a timeout are left out by the caller, so a lost pod never
blocks a node for long. Before refusing, :func:`fit_keeping_inflight_rule` tries the placement that
joins the in-flight key (the same GPUs with the same quotas), so replicas of one workload still
bind back to back on one node.

In-flight pods are given as ``{pod name: [container keys]}`` (:func:`allocation_keys`).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

from tessera.contract import Allocation, ContainerAllocation
from tessera.placement.fit import eligible_gpus, find_placement, make_fit
from tessera.placement.model import NodeFit, NodeState, Placement, PodShape
from tessera.placement.policies import ClusterContext, PlacementPolicy
from tessera.placement.speed import SpeedProfiles

InflightKey = tuple[int, tuple[str, ...], tuple[tuple[int, int], ...]]


def container_key(container: ContainerAllocation) -> InflightKey:
    """(GPU count, sorted GPU UUIDs, (memory, cores) per GPU in UUID order)."""
    grants = sorted(container.gpus, key=lambda g: g.uuid)
    return (len(grants), tuple(g.uuid for g in grants), tuple((g.memory_mib, g.cores) for g in grants))


def allocation_keys(allocation: Allocation) -> list[InflightKey]:
    return [container_key(c) for c in allocation.containers]


def placement_keys(node: NodeState, placement: Placement) -> list[InflightKey]:
    """The container keys ``placement`` would have once written as an allocation."""
    keys = []
    for grants in placement.containers:
        ordered = sorted(grants, key=lambda g: node.gpus[g.gpu].uuid)
        keys.append(
            (
                len(ordered),
                tuple(node.gpus[g.gpu].uuid for g in ordered),
                tuple((g.memory_mib, g.cores) for g in ordered),
            )
        )
    return keys


def keys_conflict(
    node: str, mine: Sequence[InflightKey], inflight: Mapping[str, Sequence[InflightKey]]
) -> str | None:
    """Why a pod with container keys ``mine`` may not be in flight on ``node`` together with the
    other in-flight pods there, or None when it may."""
    own: dict[int, set[InflightKey]] = {}
    for key in mine:
        own.setdefault(key[0], set()).add(key)
    for pod, keys in inflight.items():
        for key in keys:
            same_count = own.get(key[0])
            if same_count and same_count != {key}:
                return (
                    f"pod {pod} is still being admitted on node {node} with a {key[0]}-GPU "
                    f"container on {', '.join(key[1])}; a different {key[0]}-GPU container cannot be in "
                    "flight with it (retry after the device plugin serves it)"
                )
    return None


def inflight_conflict(allocation: Allocation, inflight: Mapping[str, Allocation]) -> str | None:
    """:func:`keys_conflict` for allocations (pod name -> allocation of the other in-flight pods)."""
    return keys_conflict(
        allocation.node, allocation_keys(allocation), {pod: allocation_keys(a) for pod, a in inflight.items()}
    )


def _pins(
    node: NodeState, shape: PodShape, inflight: Mapping[str, Sequence[InflightKey]]
) -> dict[int, list[int]] | None:
    """For each container of the pod whose GPU count other in-flight pods use: the GPU positions of
    their (single) key, if the container's quotas on those GPUs equal the key's; None if impossible."""
    keys: dict[int, set[InflightKey]] = {}
    for pod_keys in inflight.values():
        for key in pod_keys:
            keys.setdefault(key[0], set()).add(key)
    pins: dict[int, list[int]] = {}
    for index, container in enumerate(shape.containers):
        found = keys.get(container.gpu_count)
        if not found:
            continue
        if len(found) > 1:
            return None
        [(_, uuids, quotas)] = found
        positions = [node.gpu_position(uuid) for uuid in uuids]
        known = [p for p in positions if p is not None]
        if len(known) != len(positions):
            return None
        if tuple((container.memory_on(node.gpus[p]), container.cores_needed) for p in known) != quotas:
            return None
        pins[index] = known
    return pins


def fit_keeping_inflight_rule(
    fit: NodeFit,
    shape: PodShape,
    *,
    profiles: SpeedProfiles,
    policy: PlacementPolicy,
    context: ClusterContext,
    inflight: Mapping[str, Sequence[InflightKey]],
) -> NodeFit | str:
    """``fit`` if its placement may be in flight with ``inflight`` (the other in-flight pods on its
    node); else the placement on the same node that joins their key (same GPUs, same quotas: what
    replicas of one workload ask), when the pod fits there; else the reason it may not bind now."""
    if not inflight:
        return fit
    node = fit.node
    conflict = keys_conflict(node.name, placement_keys(node, fit.placement), inflight)
    if conflict is None:
        return fit
    pins = _pins(node, shape, inflight)
    if not pins:
        return conflict
    placement = find_placement(
        node, shape, eligible_gpus(node, shape, profiles), policy, context, pinned=pins
    )
    if placement is None or keys_conflict(node.name, placement_keys(node, placement), inflight):
        return conflict
    return make_fit(node, shape, placement, profiles=profiles, policy=policy, context=context)
