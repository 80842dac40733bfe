"""Pure logic: which container an Allocate (or GetPreferredAllocation) call is for.

The kubelet's requests carry no pod identity, only slice IDs. The rule (docs/deviceplugin.md,
"Concurrency"): the extender lets several pods be in flight on a node only while, for every GPU count
k, all in-flight containers asking for k GPUs have the same key (GPU set and quotas). So the GPU set
and size of an Allocate name one key, and every in-flight container with that key gets the same
answer; among them the oldest bind time is served first, then spec order within a pod. Pods bound
longer ago than the extender's in-flight timeout no longer hold others back, so they come last.
"""

from __future__ import annotations

from collections.abc import Collection, Iterable, Mapping, Sequence
from dataclasses import dataclass
from datetime import datetime, timedelta

from tessera.contract import (
    ContainerAllocation,
    ContractError,
    ContractKeys,
    GpuGrant,
    Phase,
    parse_allocation,
    parse_time,
    slice_gpu,
)


@dataclass(frozen=True, slots=True)
class GpuContainer:
    """A container of a pod that limits the vGPU resource, with the slice count it asks for."""

    name: str
    slices: int


@dataclass(frozen=True, slots=True)
class PodView:
    """What the matching needs of a pending pod on this node, read from the API."""

    namespace: str
    name: str
    uid: str
    created: datetime
    annotations: Mapping[str, str]
    # Containers asking for vGPU slices, in spec order (the order the kubelet allocates them in).
    gpu_containers: tuple[GpuContainer, ...]

    @property
    def ref(self) -> str:
        return f"{self.namespace}/{self.name}"


ServedKey = tuple[str, str]  # (pod UID, container name)


@dataclass(frozen=True, slots=True)
class InFlight:
    """A container whose allocation is decided and which the plugin has not served yet."""

    pod: PodView
    container: str
    grants: tuple[GpuGrant, ...]
    bind_time: datetime
    position: int  # index among the pod's GPU containers
    # Bound longer ago than the in-flight timeout: the extender no longer holds other pods back for
    # it, so a fresh container of the same size may have another key. Fresh ones are preferred.
    stale: bool = False

    @property
    def uuids(self) -> frozenset[str]:
        return frozenset(g.uuid for g in self.grants)

    @property
    def key(self) -> ServedKey:
        return (self.pod.uid, self.container)

    @property
    def order(self) -> tuple[bool, datetime, str, int]:
        return (self.stale, self.bind_time, self.pod.uid, self.position)


@dataclass(frozen=True, slots=True)
class BrokenPod:
    """A pending GPU pod whose allocation can never be served on this node, and why."""

    pod: PodView
    reason: str


@dataclass(frozen=True, slots=True)
class NodeSnapshot:
    """The pending GPU pods on this node, sorted into in-flight containers and broken pods."""

    in_flight: tuple[InFlight, ...]
    broken: tuple[BrokenPod, ...]


def _check_allocation(
    pod: PodView, keys: ContractKeys, node: str, node_gpus: Collection[str]
) -> list[tuple[GpuContainer, ContainerAllocation]] | str:
    """Each GPU container with its allocation entry, or the reason the pod's allocation is unusable."""
    text = pod.annotations.get(keys.allocation)
    if text is None:
        return f"annotation {keys.allocation} is missing"
    try:
        allocation = parse_allocation(text, pod=pod.ref)
    except ContractError as e:
        return str(e)
    if allocation.node != node:
        return f"annotation {keys.allocation} is for node {allocation.node!r}, not this node {node!r}"
    pairs = []
    for container in pod.gpu_containers:
        entry = allocation.for_container(container.name)
        if entry is None:
            return f"annotation {keys.allocation} has no entry for container {container.name!r}"
        if len(entry.gpus) != container.slices:
            return (
                f"container {container.name!r} asks for {container.slices} {keys.vgpu} but its "
                f"allocation names {len(entry.gpus)} GPU(s)"
            )
        missing = [g.uuid for g in entry.gpus if g.uuid not in node_gpus]
        if missing:
            return f"container {container.name!r}: GPU {missing[0]} is not on this node {node!r}"
        pairs.append((container, entry))
    return pairs


def snapshot(
    pods: Iterable[PodView],
    *,
    keys: ContractKeys,
    node: str,
    node_gpus: Collection[str],
    served: Collection[ServedKey],
    now: datetime,
    inflight_timeout: timedelta,
) -> NodeSnapshot:
    """Sort pending GPU pods into in-flight containers and broken pods.

    Pods whose phase is already ``allocated`` or ``failed`` are done and left out. In-flight
    containers come fresh before stale, then oldest bind time first, then in spec order.
    """
    in_flight: list[InFlight] = []
    broken: list[BrokenPod] = []
    for pod in pods:
        if not pod.gpu_containers:
            continue
        phase = pod.annotations.get(keys.allocation_phase)
        if phase in (Phase.ALLOCATED, Phase.FAILED):
            continue
        if phase != Phase.ALLOCATING:
            reason = f"annotation {keys.allocation_phase} is {phase!r}, not 'allocating'"
            broken.append(BrokenPod(pod, reason))
            continue
        checked = _check_allocation(pod, keys, node, node_gpus)
        if isinstance(checked, str):
            broken.append(BrokenPod(pod, checked))
            continue
        bind_time = _bind_time(pod, keys)
        stale = now - bind_time > inflight_timeout
        for position, (container, entry) in enumerate(checked):
            if (pod.uid, container.name) not in served:
                in_flight.append(InFlight(pod, container.name, entry.gpus, bind_time, position, stale))
    in_flight.sort(key=lambda c: c.order)
    return NodeSnapshot(tuple(in_flight), tuple(broken))


def _bind_time(pod: PodView, keys: ContractKeys) -> datetime:
    text = pod.annotations.get(keys.bind_time)
    if text is None:
        return pod.created
    try:
        return parse_time(text, field=f"pod {pod.ref}: annotation {keys.bind_time}")
    except ContractError:
        return pod.created


# --------------------------------------------------------------------------------------------------
# Allocate


class AllocationError(Exception):
    """An Allocate that cannot be served. ``concerned`` are the pods it must be reported on."""

    def __init__(self, message: str, concerned: Sequence[BrokenPod]) -> None:
        super().__init__(message)
        self.message = message
        self.concerned = tuple(concerned)


def requested_gpus(device_ids: Sequence[str], node_gpus: Collection[str]) -> frozenset[str]:
    """The physical GPUs behind the slice IDs of one container request; one slice per GPU."""
    if not device_ids:
        raise ContractError("devices_ids: the request names no device")
    uuids = [slice_gpu(d) for d in device_ids]
    for device, uuid in zip(device_ids, uuids, strict=True):
        if uuid not in node_gpus:
            raise ContractError(f"devices_ids: {device!r} is a slice of GPU {uuid}, not on this node")
    for uuid in uuids:
        if uuids.count(uuid) > 1:
            raise ContractError(
                f"devices_ids: {sorted(device_ids)} holds {uuids.count(uuid)} slices of GPU {uuid}; "
                "a container gets at most one slice of each GPU"
            )
    return frozenset(uuids)


def _concerned(state: NodeSnapshot, size: int, taken: Collection[ServedKey]) -> list[BrokenPod]:
    """The pods a failed Allocate of ``size`` slices can be for.

    Broken pods asking for that many slices if there are any (they can never be served); otherwise the
    in-flight pods of that size, whose GPUs the kubelet did not pick.
    """
    broken = [b for b in state.broken if any(c.slices == size for c in b.pod.gpu_containers)]
    if broken:
        return broken
    seen: dict[str, BrokenPod] = {}
    for c in state.in_flight:
        if len(c.grants) == size and c.key not in taken and c.pod.uid not in seen:
            names = sorted(c.uuids)
            seen[c.pod.uid] = BrokenPod(
                c.pod, f"container {c.container!r} was allocated GPU(s) {names}, the kubelet chose others"
            )
    return list(seen.values())


def match_container(
    device_ids: Sequence[str],
    state: NodeSnapshot,
    *,
    node: str,
    node_gpus: Collection[str],
    taken: Collection[ServedKey] = (),
) -> InFlight:
    """The in-flight container one ``ContainerAllocateRequest`` is for.

    ``taken`` are containers already matched earlier in the same call. Raises
    :class:`AllocationError` with a message naming the devices and what did not fit.
    """
    size = len(device_ids)
    try:
        uuids = requested_gpus(device_ids, node_gpus)
    except ContractError as e:
        raise AllocationError(f"node {node}: {e}", _concerned(state, size, taken)) from None
    for candidate in state.in_flight:
        if candidate.key not in taken and len(candidate.grants) == size and candidate.uuids == uuids:
            return candidate
    concerned = _concerned(state, size, taken)
    reasons = "".join(f"; pod {b.pod.ref}: {b.reason}" for b in concerned)
    raise AllocationError(
        f"node {node}: no in-flight container asks for {size} GPU(s) {sorted(uuids)} "
        f"(devices {list(device_ids)}){reasons}",
        concerned,
    )


def pod_complete(pod: PodView, served: Collection[ServedKey]) -> bool:
    """Every GPU container of the pod has been served."""
    return all((pod.uid, c.name) in served for c in pod.gpu_containers)


# --------------------------------------------------------------------------------------------------
# GetPreferredAllocation


def preferred_devices(
    available: Sequence[str], must_include: Sequence[str], size: int, state: NodeSnapshot
) -> list[str]:
    """Slices the kubelet should pick: those of the GPUs of the first in-flight container of this size.

    With no such container (or its GPUs not available), one slice from each of ``size`` distinct
    GPUs, so that at least the shape is right; ``must_include`` always comes first.
    """
    by_gpu: dict[str, str] = {}
    for device in available:
        try:
            by_gpu.setdefault(slice_gpu(device), device)
        except ContractError:
            continue  # not one of ours; Allocate would refuse it
    for candidate in state.in_flight:
        if len(candidate.grants) == size:
            wanted = [g.uuid for g in candidate.grants]
            picks = _add_slices(must_include, wanted, by_gpu, size)
            if len(picks) == size and {_gpu_or_none(d) for d in picks} == set(wanted):
                return picks
    return _add_slices(must_include, list(by_gpu), by_gpu, size)


def _gpu_or_none(device: str) -> str | None:
    try:
        return slice_gpu(device)
    except ContractError:
        return None


def _add_slices(
    must_include: Sequence[str], uuids: Sequence[str], by_gpu: Mapping[str, str], size: int
) -> list[str]:
    """``must_include`` plus one available slice of each GPU in ``uuids`` not yet covered, up to ``size``."""
    picks = list(must_include)[:size]
    covered = {_gpu_or_none(d) for d in picks}
    for uuid in uuids:
        if len(picks) >= size:
            break
        if uuid not in covered and uuid in by_gpu:
            picks.append(by_gpu[uuid])
            covered.add(uuid)
    return picks
