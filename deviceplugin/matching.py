"""Pure logic: which container an Allocate (or GetPreferredAllocation) call is for.

The kubelet's requests carry no pod identity, only slice IDs. The in-flight rule
(:mod:`tessera.inflight`, docs/deviceplugin.md "Concurrency") that the extender keeps at bind makes
the GPU set of an Allocate name one in-flight key among the containers of different pods, so every
in-flight container the request can be for gets the same answer. Among them the device plugin serves
fresh before stale (bound longer ago than the in-flight timeout: the extender no longer holds other
pods back for them), then the oldest bind time, then spec order within a pod (the order the kubelet
allocates a pod's containers in).
"""

from __future__ import annotations

import functools
from collections.abc import Collection, Iterable, Mapping, Sequence
from dataclasses import dataclass
from datetime import datetime, timedelta

from tessera.contract import (
    Allocation,
    ContainerAllocation,
    ContainerRequest,
    ContractError,
    ContractKeys,
    GpuGrant,
    Phase,
    QosClass,
    parse_allocation,
    pod_ref,
    slice_gpu,
)
from tessera.inflight import InflightKey, container_key, is_allocating, read_bind_time, serves, stale


@dataclass(frozen=True, slots=True)
class PodView:
    """What the matching needs of a pending pod on this node, read from the API."""

    namespace: str
    name: str
    uid: str
    created: datetime
    annotations: Mapping[str, str]
    # The containers asking for GPUs, in spec order (the order the kubelet allocates them in), as the
    # contract parses them; empty when the request is invalid (``request_error``).
    gpu_containers: tuple[ContainerRequest, ...]
    # Why the pod's GPU request breaks the contract (the extender would never have bound it).
    request_error: str | None = None

    @property
    def ref(self) -> str:
        return pod_ref(self.namespace, self.name)

    @property
    def asks_for_gpus(self) -> bool:
        return bool(self.gpu_containers) or self.request_error is not None


# A container of a pod: (pod UID, container name). What the served records and an Allocate's
# matches are kept by.
ContainerRef = tuple[str, str]


@dataclass(frozen=True, slots=True)
class InFlight:
    """A container whose allocation is decided and which the plugin has not served yet."""

    pod: PodView
    container: str
    grants: tuple[GpuGrant, ...]  # in the allocation's order
    key: InflightKey
    bind_time: datetime
    position: int  # index among the pod's GPU containers
    # Bound longer ago than the in-flight timeout: the extender no longer holds other pods back for
    # it, so a fresh container of the same GPU count may have another key. Fresh ones are preferred.
    stale: bool = False
    qos: QosClass = QosClass.STANDARD  # the pod's class, as the extender wrote it in the allocation

    @property
    def ref(self) -> ContainerRef:
        return (self.pod.uid, self.container)

    @property
    def order(self) -> tuple[bool, datetime, str, int]:
        """Fresh before stale, then the oldest bind time, then spec order."""
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


@functools.lru_cache(maxsize=4096)
def _parsed_allocation(text: str, pod: str) -> Allocation | str:
    """The allocation annotation's text parsed, or why it cannot be. Every kubelet call reads the
    allocations of all the pods in flight, which stay as they are from bind to admission: each text
    is parsed once (the model is frozen, so sharing it is safe)."""
    try:
        return parse_allocation(text, pod=pod)
    except ContractError as e:
        return str(e)


def _check_allocation(
    pod: PodView, keys: ContractKeys, node: str, node_gpus: Collection[str]
) -> tuple[QosClass, list[tuple[ContainerRequest, ContainerAllocation]]] | str:
    """The pod's class and each GPU container with its allocation entry, or the reason the pod's
    allocation is unusable."""
    text = pod.annotations.get(keys.allocation)
    if text is None:
        return f"annotation {keys.allocation} is missing"
    allocation = _parsed_allocation(text, pod.ref)
    if isinstance(allocation, str):
        return allocation
    if allocation.node != node:
        return f"annotation {keys.allocation} is for node {allocation.node!r}, not this node {node!r}"
    pairs = []
    for container in pod.gpu_containers:
        entry = allocation.for_container(container.name)
        if entry is None:
            return f"annotation {keys.allocation} has no entry for container {container.name!r}"
        if len(entry.gpus) != container.gpu_count:
            return (
                f"container {container.name!r} asks for {container.gpu_count} {keys.vgpu} but its "
                f"allocation names {len(entry.gpus)} GPU(s)"
            )
        missing = [g.uuid for g in entry.gpus if g.uuid not in node_gpus]
        if missing:
            return f"container {container.name!r}: GPU {missing[0]} is not on this node {node!r}"
        pairs.append((container, entry))
    return allocation.qos, pairs


def snapshot(
    pods: Iterable[PodView],
    *,
    keys: ContractKeys,
    node: str,
    node_gpus: Collection[str],
    served: Collection[ContainerRef],
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
        if not pod.asks_for_gpus:
            continue
        phase = pod.annotations.get(keys.allocation_phase)
        if phase in (Phase.ALLOCATED, Phase.FAILED):
            continue
        if pod.request_error is not None:
            broken.append(BrokenPod(pod, pod.request_error))
            continue
        if not is_allocating(phase):
            reason = f"annotation {keys.allocation_phase} is {phase!r}, not 'allocating'"
            broken.append(BrokenPod(pod, reason))
            continue
        checked = _check_allocation(pod, keys, node, node_gpus)
        if isinstance(checked, str):
            broken.append(BrokenPod(pod, checked))
            continue
        qos, pairs = checked
        bind_time = _bind_time(pod, keys)
        is_stale = stale(bind_time, now, inflight_timeout)
        for position, (container, entry) in enumerate(pairs):
            if (pod.uid, container.name) not in served:
                key = container_key(entry)
                in_flight.append(
                    InFlight(pod, entry.name, entry.gpus, key, bind_time, position, is_stale, qos)
                )
    in_flight.sort(key=lambda c: c.order)
    return NodeSnapshot(tuple(in_flight), tuple(broken))


def _bind_time(pod: PodView, keys: ContractKeys) -> datetime:
    """The pod's bind time; its creation time (never later) when the annotation is missing or bad."""
    try:
        bind_time = read_bind_time(pod.annotations, keys, pod=pod.ref)
    except ContractError:
        return pod.created
    return pod.created if bind_time is None else bind_time


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


def _concerned(state: NodeSnapshot, gpu_count: int) -> list[BrokenPod]:
    """The pods a failed Allocate of ``gpu_count`` slices (one per GPU) fails for good: broken pods
    with a container of that GPU count, or whose request is invalid (its GPU counts are unknown).
    They can never be served, whichever pod the kubelet is admitting.

    In-flight pods are never among them, though the call may be for one of them (the kubelet picked
    other GPUs than its allocation's): which one the kubelet admits is only a guess, and a pod marked
    ``failed`` on a wrong guess leaves the in-flight rule, so that the extender may bind a container
    of another key beside it, which its own admission later gets. The kubelet fails the pod it
    admits itself (``UnexpectedAdmissionError``, with this call's message).
    """
    return [
        b
        for b in state.broken
        if b.pod.request_error is not None or any(c.gpu_count == gpu_count for c in b.pod.gpu_containers)
    ]


def _in_flight_of(state: NodeSnapshot, gpu_count: int, taken: Collection[ContainerRef]) -> list[str]:
    """Why no in-flight container of ``gpu_count`` GPUs matched: each one's allocated GPUs."""
    return [
        f"; pod {c.pod.ref}: container {c.container!r} was allocated GPU(s) {list(c.key.uuids)}, "
        "the kubelet chose others"
        for c in state.in_flight
        if c.key.gpu_count == gpu_count and c.ref not in taken
    ]


def match_container(
    device_ids: Sequence[str],
    state: NodeSnapshot,
    *,
    node: str,
    node_gpus: Collection[str],
    taken: Collection[ContainerRef] = (),
) -> InFlight:
    """The in-flight container one ``ContainerAllocateRequest`` is for: the first, in serving order,
    whose in-flight key the request's GPUs name (:func:`tessera.inflight.serves`).

    ``taken`` are containers already matched earlier in the same call. Raises
    :class:`AllocationError` with a message naming the devices and what did not fit, or, when
    another pod's container as fresh (or as stale) as the first asks for the same GPUs with other
    quotas, naming both: the in-flight rule is broken there (the extender cannot have seen one of
    them), the kubelet's call does not say which one it admits, and a wrong guess serves one pod's
    quotas to the other. Neither is failed for it; the kubelet fails the pod it admits.
    """
    gpu_count = len(device_ids)
    try:
        uuids = requested_gpus(device_ids, node_gpus)
    except ContractError as e:
        raise AllocationError(f"node {node}: {e}", _concerned(state, gpu_count)) from None
    candidates = [c for c in state.in_flight if c.ref not in taken and serves(c.key, uuids)]
    if candidates:
        first = candidates[0]
        rival = next(
            (
                c
                for c in candidates
                if c.pod.uid != first.pod.uid and c.stale == first.stale and c.key != first.key
            ),
            None,
        )
        if rival is None:
            return first
        raise AllocationError(
            f"node {node}: {gpu_count} GPU(s) {sorted(uuids)} are asked for with different quotas by "
            f"pod {first.pod.ref} container {first.container!r} ({grants_text(first.grants)}) and "
            f"pod {rival.pod.ref} container {rival.container!r} ({grants_text(rival.grants)}), both in "
            "flight; the call does not say which one the kubelet admits, so neither is served",
            (),
        )
    concerned = _concerned(state, gpu_count)
    reasons = "".join(f"; pod {b.pod.ref}: {b.reason}" for b in concerned)
    reasons = reasons or "".join(_in_flight_of(state, gpu_count, taken))
    raise AllocationError(
        f"node {node}: no in-flight container asks for {gpu_count} GPU(s) {sorted(uuids)} "
        f"(devices {list(device_ids)}){reasons}",
        concerned,
    )


def grants_text(grants: Iterable[GpuGrant]) -> str:
    """A container's GPUs and quotas as the agent's logs and refusals name them."""
    return ", ".join(f"{g.uuid}: {g.memory_quota_mib} MiB, {g.cores}% cores" for g in grants)


def pod_complete(pod: PodView, served: Collection[ContainerRef]) -> bool:
    """Every GPU container of the pod has been served."""
    return all((pod.uid, c.name) in served for c in pod.gpu_containers)


# --------------------------------------------------------------------------------------------------
# GetPreferredAllocation


def preferred_devices(
    available: Sequence[str], must_include: Sequence[str], gpu_count: int, state: NodeSnapshot
) -> list[str]:
    """Slices the kubelet should pick for a container of ``gpu_count`` GPUs (the kubelet's allocation
    size): those of the GPUs of the first in-flight container of that GPU count.

    With no such container (or its GPUs not available), one slice from each of ``gpu_count``
    distinct GPUs, so that at least the shape is right; ``must_include`` always comes first.
    """
    by_gpu: dict[str, str] = {}
    for device in available:
        try:
            by_gpu.setdefault(slice_gpu(device), device)
        except ContractError:
            continue  # not one of ours; Allocate would refuse it
    for candidate in state.in_flight:
        if candidate.key.gpu_count == gpu_count:
            wanted = [g.uuid for g in candidate.grants]
            picks = _add_slices(must_include, wanted, by_gpu, gpu_count)
            if len(picks) == gpu_count and {_gpu_or_none(d) for d in picks} == set(wanted):
                return picks
    return _add_slices(must_include, list(by_gpu), by_gpu, gpu_count)


def _gpu_or_none(device: str) -> str | None:
    try:
        return slice_gpu(device)
    except ContractError:
        return None


def _add_slices(
    must_include: Sequence[str], uuids: Sequence[str], by_gpu: Mapping[str, str], gpu_count: int
) -> list[str]:
    """``must_include`` plus one available slice of each GPU in ``uuids`` not yet covered, up to
    ``gpu_count``."""
    picks = list(must_include)[:gpu_count]
    covered = {_gpu_or_none(d) for d in picks}
    for uuid in uuids:
        if len(picks) >= gpu_count:
            break
        if uuid not in covered and uuid in by_gpu:
            picks.append(by_gpu[uuid])
            covered.add(uuid)
    return picks
