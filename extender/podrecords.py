"""What the extender keeps of one pod: its allocation as annotated (or decided here), and the record
that holds the API server's word beside the extender's own decision (docs/placement.md, "State").

Read from Pod objects (dicts) only: allocation annotations (``KEYS.allocation``) of pods bound and
not finished, with their phase and bind time, and what preemption weighs.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from datetime import datetime
from typing import TypedDict

from tessera.contract import (
    Allocation,
    ContainerAllocation,
    ContractError,
    ContractKeys,
    JsonObject,
    Phase,
    PodShapeError,
    parse_allocation,
    pod_priority,
    pod_ref,
)
from tessera.inflight import InflightKey, allocation_keys, read_bind_time
from tessera.placement import PodShape

log = logging.getLogger(__name__)

TERMINAL_POD_PHASES = ("Succeeded", "Failed")


@dataclass(frozen=True, slots=True)
class PodAllocation:
    """A pod's allocation as annotated (or assumed at bind)."""

    uid: str
    namespace: str
    name: str
    allocation: Allocation
    phase: str | None
    bind_time: datetime | None
    # What preemption weighs (tessera.placement.preemption): its priority, its labels (for the
    # disruption budgets covering it), and whether it is being deleted already.
    priority: int = 0
    labels: tuple[tuple[str, str], ...] = ()
    terminating: bool = False
    # A reservation's: the shape it was made for (bind keeps it only for a pod asking the same).
    shape: PodShape | None = field(default=None, compare=False, repr=False)
    # The in-flight rule's container keys, computed once.
    keys: tuple[InflightKey, ...] = field(init=False)

    def __post_init__(self) -> None:
        object.__setattr__(self, "keys", tuple(allocation_keys(self.allocation)))

    @property
    def ref(self) -> str:
        return pod_ref(self.namespace, self.name)


class PreemptionFacts(TypedDict):
    priority: int
    labels: tuple[tuple[str, str], ...]
    terminating: bool


def preemption_facts(pod: JsonObject) -> PreemptionFacts:
    """What preemption needs of a pod the API server stores: its priority, labels and deletion."""
    metadata = pod.get("metadata") or {}
    labels = metadata.get("labels") or {}
    try:
        priority = pod_priority(pod)
    except PodShapeError:
        priority = 0  # never from the API server, which admits integers only
    return PreemptionFacts(
        priority=priority,
        labels=tuple(sorted((str(k), str(v)) for k, v in labels.items())),
        terminating=metadata.get("deletionTimestamp") is not None,
    )


def parse_pod(pod: JsonObject, keys: ContractKeys) -> PodAllocation | None:
    """The allocation the pod holds: None when it holds none (no allocation, finished, not bound,
    or an allocation that does not parse, logged)."""
    metadata = pod.get("metadata") or {}
    annotations = metadata.get("annotations") or {}
    text = annotations.get(keys.allocation)
    if text is None or (pod.get("status") or {}).get("phase") in TERMINAL_POD_PHASES:
        return None
    if not (pod.get("spec") or {}).get("nodeName"):
        # Not bound: it holds nothing (the extender writes allocations with the binding; one
        # on an unbound pod was written by someone else, or is left from an older scheme).
        return None
    ref = pod_ref(str(metadata.get("namespace")), str(metadata.get("name")))
    try:
        allocation = parse_allocation(text, pod=ref)
    except ContractError as e:
        log.warning("ignoring %s", e)
        return None
    try:
        bind_time = read_bind_time(annotations, keys, pod=ref)
    except ContractError as e:
        log.warning("%s", e)  # not in flight: the rule has no time to count from
        bind_time = None
    return PodAllocation(
        uid=str(metadata.get("uid")),
        namespace=str(metadata.get("namespace")),
        name=str(metadata.get("name")),
        allocation=allocation,
        phase=annotations.get(keys.allocation_phase),
        bind_time=bind_time,
        **preemption_facts(pod),
    )


def resource_version(metadata: JsonObject) -> int | None:
    """The object's resourceVersion as an integer, None when it is not one.

    Kubernetes calls it opaque; kube-apiserver serves etcd's revision, and the comparison only ever
    keeps an older read from replacing what the watch showed (an unreadable one is applied as is).
    """
    try:
        return int(str(metadata.get("resourceVersion")))
    except ValueError:
        return None


@dataclass(slots=True)
class PodRecord:
    """What the state knows of one pod: the API server's word, and the extender's own decision
    until the API server shows it."""

    observed: PodAllocation | None = None  # as last listed or watched (bound, not finished)
    assumed: PodAllocation | None = None  # decided here (a bind or a reservation), not yet seen
    reserved_at: datetime | None = None  # when ``assumed`` is a reservation: when it was made
    # The resourceVersion of ``observed`` (None when it is not an integer): a read (list or get)
    # older than what the watch has shown is not applied.
    version: int | None = None
    # For a bind decision (``assumed`` and not reserved): the mark (PodBook.mark) taken when the
    # bind's answer came, None while the bind is on its way. A relist begun before it may not show
    # the pod bound yet.
    answered: int | None = None

    @property
    def counted(self) -> PodAllocation | None:
        """What counts on the node: the decision, else the API server's word."""
        return self.assumed if self.assumed is not None else self.observed

    @property
    def binding(self) -> bool:
        """A bind decision (not a reservation) waiting for the watch to show it."""
        return self.assumed is not None and self.reserved_at is None

    def nodes(self) -> set[str]:
        """The nodes named by either allocation."""
        return {p.allocation.node for p in (self.assumed, self.observed) if p is not None}


def with_resize(allocation: Allocation, resized: Allocation | None) -> Allocation:
    """``allocation`` with each grant at the larger of its quotas and those of ``resized`` (the same
    containers on the same GPUs: a live resize being written)."""
    if resized is None or resized.node != allocation.node:
        return allocation
    containers = []
    for container in allocation.containers:
        after = resized.for_container(container.name)
        new = {} if after is None else {g.uuid: g for g in after.gpus}
        containers.append(
            ContainerAllocation(
                name=container.name,
                gpus=tuple(
                    g
                    if g.uuid not in new
                    else g.model_copy(
                        update={
                            "memory_quota_mib": max(g.memory_quota_mib, new[g.uuid].memory_quota_mib),
                            "cores": max(g.cores, new[g.uuid].cores),
                        }
                    )
                    for g in container.gpus
                ),
            )
        )
    return allocation.model_copy(update={"containers": tuple(containers)})


def bound_record(pod: JsonObject, allocation: Allocation, bind_time: datetime) -> PodAllocation:
    """The record of ``pod`` bound here with ``allocation`` at ``bind_time`` (phase allocating)."""
    metadata = pod.get("metadata") or {}
    return PodAllocation(
        uid=str(metadata.get("uid")),
        namespace=str(metadata.get("namespace")),
        name=str(metadata.get("name")),
        allocation=allocation,
        phase=Phase.ALLOCATING.value,
        bind_time=bind_time,
        **preemption_facts(pod),
    )
