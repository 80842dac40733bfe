"""The in-flight rule: what the extender's bind and the device plugin's Allocate must agree on.

Pure: no I/O. The words are the glossary's (docs/glossary.md); both sides import them from here.

* **In flight**: a pod bound with its allocation written, phase ``allocating``, not yet admitted by
  the kubelet (the device plugin writes ``allocated`` once the kubelet's pod-resources API names the
  pod, not when it matched one: among pods of one key the match is a guess), whose bind time
  (annotation ``<domain>/bind-time``, :func:`read_bind_time`) is within
  the in-flight timeout (:func:`stale`; :data:`DEFAULT_INFLIGHT_TIMEOUT`, flag ``--inflight-timeout``
  on both binaries). A pod bound longer ago is *stale*: the extender no longer holds other pods back
  for it, so a lost pod never blocks a node for long.
* **In-flight key** of a container's allocation (:func:`container_key`): (GPU count, sorted GPU
  UUIDs, memory, cores and whether oversubscribed per GPU in UUID order).
* **The rule** (:func:`keys_conflict`): for every GPU count, the in-flight containers of *different
  pods* on a node share one in-flight key. One pod's own containers may differ: the kubelet allocates
  a pod's containers one after the other, in spec order, before the next pod. The extender refuses a
  bind that would break it (with a retriable error); the device plugin relies on it.
* **The match** (:func:`serves`): the kubelet's ``Allocate`` names only slices, one of each of the
  GPUs it picked; it is for an in-flight container whose key has that GPU count and exactly those
  GPUs. By the rule every such container of another pod has the same key, so whichever the device
  plugin picks (fresh before stale, then oldest bind time, then spec order: deviceplugin.matching),
  the container gets the GPUs and quotas its pod asked for.

The part of the rule that needs the placement core (joining an in-flight key when placing a pod) is
:mod:`tessera.placement.inflight`.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from collections.abc import Set as AbstractSet
from datetime import datetime, timedelta
from typing import NamedTuple

from tessera.contract import Allocation, ContainerAllocation, ContractKeys, Phase, parse_time

# How long after its bind time a pod counts as in flight: the default of --inflight-timeout on the
# extender and the device plugin alike (the chart's inflightTimeout sets both).
DEFAULT_INFLIGHT_TIMEOUT = timedelta(minutes=5)


class InflightKey(NamedTuple):
    """What tells in-flight containers apart when ``Allocate`` names only slices."""

    gpu_count: int
    uuids: tuple[str, ...]  # sorted
    # (memory MiB, cores, oversubscribed) per GPU, in the order of ``uuids``: two containers whose
    # grants differ only in being oversubscribed are enforced differently by the hook.
    quotas: tuple[tuple[int, int, bool], ...]


def container_key(container: ContainerAllocation) -> InflightKey:
    """The in-flight key of one container's allocation."""
    grants = sorted(container.gpus, key=lambda g: g.uuid)
    return InflightKey(
        len(grants),
        tuple(g.uuid for g in grants),
        tuple((g.memory_quota_mib, g.cores, g.oversubscribed) for g in grants),
    )


def allocation_keys(allocation: Allocation) -> list[InflightKey]:
    """The in-flight keys of a pod's containers, in the allocation's order."""
    return [container_key(c) for c in allocation.containers]


def is_allocating(phase: str | None) -> bool:
    """The phase of a pod bound with its allocation and not yet served by the device plugin."""
    return phase == Phase.ALLOCATING


def read_bind_time(annotations: Mapping[str, str], keys: ContractKeys, *, pod: str) -> datetime | None:
    """The pod's bind time, None when the annotation is missing.

    Raises :class:`tessera.contract.ContractError` naming the pod and the annotation when it is not
    an RFC 3339 time. What stands in for a missing or bad one is each side's: the extender counts
    such a pod as not in flight, the device plugin orders it by its creation time.
    """
    text = annotations.get(keys.bind_time)
    if text is None:
        return None
    return parse_time(text, field=f"pod {pod}: annotation {keys.bind_time}")


def stale(bind_time: datetime, now: datetime, timeout: timedelta) -> bool:
    """Bound longer ago than the in-flight timeout: no longer in flight for the rule."""
    return now - bind_time > timeout


def keys_conflict(
    node: str, mine: Sequence[InflightKey], inflight: Mapping[str, Sequence[InflightKey]]
) -> str | None:
    """Why a pod whose containers have in-flight keys ``mine`` may not be in flight on ``node``
    together with the other in-flight pods there (pod ref -> their keys), or None when it may."""
    own: dict[int, set[InflightKey]] = {}
    for key in mine:
        own.setdefault(key.gpu_count, set()).add(key)
    for pod, keys in inflight.items():
        for key in keys:
            same_count = own.get(key.gpu_count)
            if same_count and same_count != {key}:
                return (
                    f"pod {pod} is still being admitted on node {node} with a {key.gpu_count}-GPU "
                    f"container on {', '.join(key.uuids)}; a different {key.gpu_count}-GPU container "
                    "cannot be in flight with it (retry after the device plugin serves it)"
                )
    return None


def inflight_conflict(allocation: Allocation, inflight: Mapping[str, Allocation]) -> str | None:
    """:func:`keys_conflict` for allocations (pod ref -> allocation of the other in-flight pods)."""
    return keys_conflict(
        allocation.node, allocation_keys(allocation), {pod: allocation_keys(a) for pod, a in inflight.items()}
    )


def serves(key: InflightKey, gpus: AbstractSet[str]) -> bool:
    """Whether an ``Allocate`` of one slice of each of ``gpus`` can be for an in-flight container with
    ``key``: the same GPU count and the same GPUs (quotas are not in the request; the rule makes them
    equal among the candidates of different pods)."""
    return key.gpu_count == len(gpus) and all(uuid in gpus for uuid in key.uuids)
