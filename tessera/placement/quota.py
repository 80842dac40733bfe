"""A namespace's ResourceQuota on Tessera's resources, held against a live resize.

Kubernetes' quota controller counts a pod's spec (``requests.<domain>/vgpu-memory`` and
``requests.<domain>/vgpu-cores``: what each container asks per GPU, summed over the namespace's
pods), and a live resize changes a pod's allocation, not its spec: counted by the controller alone, a
resize would let a namespace hold more than its quota. So a resize is held against the quota here:
what the namespace's pods hold beyond their specs (earlier resizes, :func:`beyond_spec`), plus what
this resize adds, on top of the quota's ``used``, must stay within its ``hard``
(:func:`quota_refusal`). Shrinking always passes. Counted per container per GPU, as the spec is.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass

from tessera.contract import Allocation, ContainerRequest, ContractKeys


@dataclass(frozen=True, slots=True)
class QuotaLimit:
    """One ResourceQuota's hard limit and use on one of Tessera's resources."""

    quota: str  # the ResourceQuota's name
    resource: str  # e.g. requests.tessera.io/vgpu-memory
    hard: int
    used: int


def quota_resources(keys: ContractKeys) -> tuple[str, str]:
    """The quota names of the memory and the compute share, as a ResourceQuota spells them."""
    return f"requests.{keys.vgpu_memory}", f"requests.{keys.vgpu_cores}"


def beyond_spec(
    containers: Sequence[ContainerRequest], allocation: Allocation, keys: ContractKeys
) -> dict[str, int]:
    """What the pod holds beyond what its spec asks, per quota resource (nothing below zero): for
    each container whose spec asks for the resource, its grant per GPU less its request."""
    memory, cores = quota_resources(keys)
    extra = {memory: 0, cores: 0}
    for request in containers:
        granted = allocation.for_container(request.name)
        if granted is None:
            continue
        if request.memory_quota_mib is not None:
            extra[memory] += max(0, max(g.memory_quota_mib for g in granted.gpus) - request.memory_quota_mib)
        if request.cores is not None:
            extra[cores] += max(0, max(g.cores for g in granted.gpus) - request.cores)
    return extra


def added(before: Mapping[str, int], after: Mapping[str, int]) -> dict[str, int]:
    return {resource: after.get(resource, 0) - before.get(resource, 0) for resource in after}


def quota_refusal(
    namespace: str,
    limits: Iterable[QuotaLimit],
    others_beyond: Mapping[str, int],
    this_before: Mapping[str, int],
    this_after: Mapping[str, int],
) -> str:
    """Why the resize breaks a quota ("" when it does not): ``others_beyond``, what the namespace's
    other pods hold beyond their specs; ``this_before``/``this_after``, the resized pod's, before and
    after the resize. Only growth is held against a quota: a resize that grows nothing passes, even
    in a namespace already over (it was, before the resize)."""
    growth = added(this_before, this_after)
    for limit in limits:
        grows = growth.get(limit.resource, 0)
        if grows <= 0:
            continue
        total = limit.used + others_beyond.get(limit.resource, 0) + this_after.get(limit.resource, 0)
        if total > limit.hard:
            return (
                f"namespace {namespace}'s ResourceQuota {limit.quota} allows {limit.resource} {limit.hard}; "
                f"with this resize its pods would hold {total} (the quota counts {limit.used} by their "
                f"specs, resized pods hold {total - limit.used} beyond them, {grows} of it this resize's)"
            )
    return ""
