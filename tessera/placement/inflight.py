"""The in-flight rule where it needs the placement core: placing a pod so that it may be in flight.

The rule itself (in-flight keys, the conflict check, the match the device plugin relies on) is
:mod:`tessera.inflight`, shared with the device plugin. Here: the in-flight keys a placement would
have (:func:`placement_keys`), and :func:`fit_keeping_inflight_rule`, which, before refusing a pod at
bind, tries the placement that joins the in-flight key (the same GPUs with the same quotas), so
replicas of one workload still bind back to back on one node.

In-flight pods are given as ``{pod ref: [in-flight keys]}`` (:func:`tessera.inflight.allocation_keys`);
the caller leaves out those that are gone or stale.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

from tessera.inflight import InflightKey, keys_conflict
from tessera.placement.fit import eligible_gpus, find_placement, make_fit
from tessera.placement.model import NodeFit, NodeState, Placement, PodShape
from tessera.placement.policies import ClusterContext, PlacementPolicy
from tessera.placement.speed import SpeedProfiles


def placement_keys(node: NodeState, placement: Placement) -> list[InflightKey]:
    """The in-flight keys ``placement`` would have once written as an allocation."""
    keys = []
    for grants in placement.containers:
        ordered = sorted(grants, key=lambda g: node.gpus[g.gpu].uuid)
        keys.append(
            InflightKey(
                len(ordered),
                tuple(node.gpus[g.gpu].uuid for g in ordered),
                tuple((g.memory_quota_mib, g.cores, g.oversubscribed) for g in ordered),
            )
        )
    return keys


def _pins(
    node: NodeState, shape: PodShape, inflight: Mapping[str, Sequence[InflightKey]], by_use: bool
) -> dict[int, list[int]] | None:
    """For each container of the pod whose GPU count other in-flight pods use: the GPU positions of
    their (single) key, if the container's quotas on those GPUs (placed by requests, or against
    measured use when ``by_use``) equal the key's; None if impossible."""
    keys: dict[int, set[InflightKey]] = {}
    for pod_keys in inflight.values():
        for key in pod_keys:
            keys.setdefault(key.gpu_count, set()).add(key)
    pins: dict[int, list[int]] = {}
    for index, container in enumerate(shape.containers):
        found = keys.get(container.gpu_count)
        if not found:
            continue
        if len(found) > 1:
            return None
        [key] = found
        positions = [node.gpu_position(uuid) for uuid in key.uuids]
        known = [p for p in positions if p is not None]
        if len(known) != len(positions):
            return None
        quotas = tuple(
            (container.memory_quota_on(node.gpus[p]), container.cores_needed, by_use) for p in known
        )
        if quotas != key.quotas:
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
    # The same way the fit was placed: by requests, or against measured use (only where a
    # best-effort pod fits by requests nowhere on the node).
    by_use = fit.placement.oversubscribed
    pins = _pins(node, shape, inflight, by_use)
    if not pins:
        return conflict
    placement = find_placement(
        node, shape, eligible_gpus(node, shape, profiles), policy, context, pinned=pins, by_use=by_use
    )
    if placement is None or keys_conflict(node.name, placement_keys(node, placement), inflight):
        return conflict
    return make_fit(node, shape, placement, profiles=profiles, policy=policy, context=context)
