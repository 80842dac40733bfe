"""Plain data the placement core decides over: GPUs and nodes with their usage, pod shapes, placements.

Everything here is immutable. A change to a node (a pod placed or released, an inventory update)
makes a *new* :class:`NodeState`; callers keep the newest one per node name. Because states are
never mutated, ``old is new`` tells a cache whether a node changed (see :mod:`.engine`).

Vocabulary:
* a GPU has ``memory_mib`` of memory, ``MAX_CORES`` (100) percent of compute and ``slices`` virtual
  devices (the device plugin's ``split``); a container placed on it uses memory, cores and one slice;
* a :class:`ContainerShape` is what one container asks for, without its name; a :class:`PodShape` is
  the tuple of them plus the pod's placement preferences (hashable, so caches key on it);
* a :class:`Placement` says, per container, which GPUs (by position in ``NodeState.gpus``) with how
  much memory and compute;
* an *oversubscribed* grant (best-effort pods only, :mod:`.usage`) was placed against the GPU's
  measured use, not its requests: it takes a slice but none of the memory or compute that placement
  by requests counts (``used_memory_mib``, ``used_cores``); its memory is ``borrowed_mib``.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field, replace
from enum import StrEnum

from tessera.contract import (
    MAX_CORES,
    Allocation,
    ContainerAllocation,
    GpuGrant,
    GpuInfo,
    PodPreferences,
    PodRequest,
    QosClass,
)

# kube-scheduler's extender scores run 0..MAX_SCORE.
MAX_SCORE = 10


@dataclass(frozen=True, slots=True)
class GpuState:
    """One physical GPU and what placed containers use of it."""

    uuid: str
    index: int
    model: str
    total_memory_mib: int
    slices: int
    numa: int | None = None
    nvlink_peers: frozenset[str] = frozenset()
    healthy: bool = True
    used_memory_mib: int = 0
    used_cores: int = 0
    used_slices: int = 0
    # The memory of the oversubscribed grants on it: in no fit by requests (see the module's notes).
    borrowed_mib: int = 0
    # What usage-aware placement counts as taken (:mod:`.usage`): the memory measured in use, plus
    # the safety margin, plus every grant placed since the measurement in full; None: no fresh
    # measurement, so nothing may be placed against use here.
    measured_mib: int | None = None
    # Derived once here, not in properties: the fit search reads them for every GPU of every node it
    # tries. Left out of equality and repr: they follow from the fields above.
    free_memory_mib: int = field(init=False, repr=False, compare=False)
    free_cores: int = field(init=False, repr=False, compare=False)
    free_slices: int = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        object.__setattr__(self, "free_memory_mib", self.total_memory_mib - self.used_memory_mib)
        object.__setattr__(self, "free_cores", MAX_CORES - self.used_cores)
        object.__setattr__(self, "free_slices", self.slices - self.used_slices)

    def with_use(self, memory_mib: int, cores: int, slices: int, oversubscribed: bool = False) -> GpuState:
        """This GPU with ``memory_mib``, ``cores`` and ``slices`` added to its use (negative: given
        back); ``oversubscribed``: of grants placed against measured use, whose memory is borrowed
        and whose cores reserve nothing. What ``dataclasses.replace`` would make, without its
        per-field introspection.

        A grant added counts in full on top of the measured use (it has not started using); one
        given back leaves the measured use as it is until the next measurement (what it really used
        is in it, and unknown)."""
        measured = self.measured_mib
        if measured is not None and memory_mib > 0:
            measured += memory_mib
        # Borrowed memory and oversubscribed cores count for nothing by requests.
        requested_mib, requested_cores = (0, 0) if oversubscribed else (memory_mib, cores)
        return GpuState(
            uuid=self.uuid,
            index=self.index,
            model=self.model,
            total_memory_mib=self.total_memory_mib,
            slices=self.slices,
            numa=self.numa,
            nvlink_peers=self.nvlink_peers,
            healthy=self.healthy,
            used_memory_mib=self.used_memory_mib + requested_mib,
            used_cores=self.used_cores + requested_cores,
            used_slices=self.used_slices + slices,
            borrowed_mib=self.borrowed_mib + (memory_mib - requested_mib),
            measured_mib=measured,
        )

    @property
    def in_use(self) -> bool:
        return self.used_slices > 0

    @property
    def utilization(self) -> float:
        """The larger of the memory and compute fractions in use, 0..1 (over-commit reads as 1)."""
        return min(1.0, max(self.used_memory_mib / self.total_memory_mib, self.used_cores / MAX_CORES))


@dataclass(frozen=True, slots=True)
class NodeState:
    """A node as the placement core sees it.

    ``schedulable`` False (stale device-plugin heartbeat, node cordoned, inventory unreadable) makes
    every pod fail on this node with ``unschedulable_reason``. ``cpu_milli``/``memory_mib`` and
    their ``used_`` counterparts are optional host capacities for the simulator; the extender leaves
    them None (kube-scheduler's own plugins check CPU and memory).
    """

    name: str
    gpus: tuple[GpuState, ...]
    schedulable: bool = True
    unschedulable_reason: str = ""
    cpu_milli: int | None = None
    host_memory_mib: int | None = None
    used_cpu_milli: int = 0
    used_host_memory_mib: int = 0
    # Derived once per node state (every pod tried on the node reads them): the positions of the
    # healthy GPUs, ascending, and each one's utilization (GpuState.utilization), aligned with them.
    healthy_positions: tuple[int, ...] = field(init=False, repr=False, compare=False)
    healthy_utilizations: tuple[float, ...] = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        healthy = tuple(i for i, gpu in enumerate(self.gpus) if gpu.healthy)
        object.__setattr__(self, "healthy_positions", healthy)
        object.__setattr__(self, "healthy_utilizations", tuple(self.gpus[i].utilization for i in healthy))

    def gpu_position(self, uuid: str) -> int | None:
        return next((i for i, g in enumerate(self.gpus) if g.uuid == uuid), None)


@dataclass(frozen=True, slots=True)
class ContainerShape:
    """What one container asks for: ``vgpu`` distinct GPUs, each with this memory and compute.

    ``memory_mib`` None = the whole memory of each GPU it gets; ``cores`` None = no compute reserved.
    """

    gpu_count: int
    memory_quota_mib: int | None
    cores: int | None
    # ``cores`` or 0; a field, not a property, as the fit search reads it per GPU tried. Left out of
    # equality, hash and repr: shapes are cache keys, and it follows from ``cores``.
    cores_needed: int = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        object.__setattr__(self, "cores_needed", self.cores or 0)

    def memory_quota_on(self, gpu: GpuState) -> int:
        return gpu.total_memory_mib if self.memory_quota_mib is None else self.memory_quota_mib

    def describe(self) -> str:
        memory = "whole GPU memory" if self.memory_quota_mib is None else f"{self.memory_quota_mib} MiB"
        cores = f", {self.cores}% compute" if self.cores else ""
        return f"{self.gpu_count} x ({memory}{cores})"


@dataclass(frozen=True, slots=True)
class PodShape:
    """A pod's GPU request without names: the key placement caches use.

    ``cpu_milli``/``memory_mib`` are the pod's host requests, checked only against nodes that set
    their own host capacities (the simulator).
    """

    containers: tuple[ContainerShape, ...]
    preferences: PodPreferences = field(default_factory=PodPreferences)
    cpu_milli: int = 0
    host_memory_mib: int = 0
    # The pod's class as decided (tessera.placement.qos): a best-effort pod that does not fit by
    # requests may be placed against measured use (:mod:`.usage`).
    qos: QosClass = QosClass.STANDARD

    @property
    def gpu_count(self) -> int:
        return sum(c.gpu_count for c in self.containers)


def shape_of(request: PodRequest, qos: QosClass = QosClass.STANDARD) -> PodShape:
    """The shape of a pod's request, with the class decided for it (its annotation, else its priority)."""
    return PodShape(
        containers=tuple(
            ContainerShape(c.gpu_count, c.memory_quota_mib, c.cores) for c in request.containers
        ),
        preferences=request.preferences,
        qos=qos,
    )


@dataclass(frozen=True, slots=True)
class Grant:
    """One GPU given to one container: position in ``NodeState.gpus`` and the quotas on it."""

    gpu: int
    memory_quota_mib: int
    cores: int
    oversubscribed: bool = False  # placed against measured use (:mod:`.usage`)


@dataclass(frozen=True, slots=True)
class Placement:
    """Where each container of a pod goes on one node; ``containers[i]`` matches the shape's i-th.
    A pod is placed by requests or against measured use as a whole: its grants are all oversubscribed
    or none is."""

    node: str
    containers: tuple[tuple[Grant, ...], ...]

    @property
    def oversubscribed(self) -> bool:
        return any(g.oversubscribed for grants in self.containers for g in grants)

    def grants(self) -> Iterable[Grant]:
        for grants in self.containers:
            yield from grants


@dataclass(frozen=True, slots=True)
class NodeFit:
    """The pod fits on ``node`` as ``placement``.

    ``policy_score`` (0..1, higher is better) comes from the placement policy; ``gain`` is the pod's
    comparative advantage on the GPUs chosen (see :mod:`.speed`), used to rank nodes across a request.
    """

    node: NodeState
    placement: Placement
    policy_score: float
    gain: float
    # Derived once here, not in properties: scoring reads them for thousands of fits per request.
    name: str = field(init=False)
    oversubscribed: bool = field(init=False)  # the placement is against measured use
    policy_share: float = field(init=False)  # policy_score clamped to 0..1
    policy_points: int = field(init=False)  # round(MAX_SCORE * policy_share)

    def __post_init__(self) -> None:
        share = min(max(self.policy_score, 0.0), 1.0)
        object.__setattr__(self, "name", self.node.name)
        object.__setattr__(self, "oversubscribed", self.placement.oversubscribed)
        object.__setattr__(self, "policy_share", share)
        object.__setattr__(self, "policy_points", round(MAX_SCORE * share))


class Shortfall(StrEnum):
    """What a rejected pod lacks on a node (a metrics label; the reason text has the numbers)."""

    NODE = "node"  # node unusable: no inventory, stale heartbeat
    HEALTH = "health"
    MODEL = "model"
    SPEED = "speed"
    CAPACITY = "capacity"  # too little even on an empty node
    HOST = "host"  # host CPU or memory (simulator)
    MEMORY = "memory"
    COMPUTE = "compute"
    SLICES = "slices"
    TOGETHER = "together"  # containers fit one by one only
    INFLIGHT = "inflight"  # the in-flight rule (extender)


# Shortfalls that evicting pods cannot cure: kube-scheduler skips such nodes for preemption.
UNRESOLVABLE = frozenset(
    {Shortfall.NODE, Shortfall.HEALTH, Shortfall.MODEL, Shortfall.SPEED, Shortfall.CAPACITY}
)


@dataclass(frozen=True, slots=True)
class NodeRejection:
    """The pod does not fit on ``node``, for ``reason`` (text naming the numbers)."""

    node: str
    reason: str
    shortfall: Shortfall
    # Derived once (a field, not a property): filters read it for thousands of rejections.
    unresolvable: bool = field(init=False)

    def __post_init__(self) -> None:
        object.__setattr__(self, "unresolvable", self.shortfall in UNRESOLVABLE)


NodeOutcome = NodeFit | NodeRejection


# --------------------------------------------------------------------------------------------------
# Building states from the contract, and applying placements to them.


def gpu_from_info(info: GpuInfo) -> GpuState:
    return GpuState(
        uuid=info.uuid,
        index=info.index,
        model=info.model,
        total_memory_mib=info.total_memory_mib,
        slices=info.split,
        numa=info.numa_node,
        nvlink_peers=frozenset(info.nvlink_peers),
        healthy=info.healthy,
    )


@dataclass(slots=True)
class _Usage:
    memory_mib: int = 0
    cores: int = 0
    slices: int = 0
    borrowed_mib: int = 0
    pending_mib: int = 0


def build_node(
    name: str,
    inventory: Iterable[GpuInfo],
    allocations: Iterable[Allocation] = (),
    *,
    schedulable: bool = True,
    unschedulable_reason: str = "",
    measured: Mapping[str, int] | None = None,
    placed_since: Iterable[Allocation] = (),
) -> NodeState:
    """A node's state from its inventory annotation and the allocations of the pods placed on it.

    ``measured`` (by GPU UUID) is what usage-aware placement counts as taken on each GPU with a
    fresh measurement (:func:`tessera.placement.usage.measured_bounds`); ``placed_since`` are those
    of ``allocations`` placed since that measurement, counted in full on top of it.

    Grants naming a GPU the inventory lacks are ignored (that GPU is gone; nothing to protect).
    """
    gpus = [gpu_from_info(info) for info in inventory]
    usage = {g.uuid: _Usage() for g in gpus}
    for allocation in allocations:
        for container in allocation.containers:
            for grant in container.gpus:
                used = usage.get(grant.uuid)
                if used is None:
                    continue
                used.slices += 1
                if grant.oversubscribed:
                    used.borrowed_mib += grant.memory_quota_mib
                else:
                    used.memory_mib += grant.memory_quota_mib
                    used.cores += grant.cores
    for allocation in placed_since:
        for container in allocation.containers:
            for grant in container.gpus:
                if (used := usage.get(grant.uuid)) is not None:
                    used.pending_mib += grant.memory_quota_mib
    measured = measured or {}

    def gpu_state(gpu: GpuState) -> GpuState:
        used = usage[gpu.uuid]
        bound = measured.get(gpu.uuid)
        return GpuState(
            uuid=gpu.uuid,
            index=gpu.index,
            model=gpu.model,
            total_memory_mib=gpu.total_memory_mib,
            slices=gpu.slices,
            numa=gpu.numa,
            nvlink_peers=gpu.nvlink_peers,
            healthy=gpu.healthy,
            used_memory_mib=used.memory_mib,
            used_cores=used.cores,
            used_slices=used.slices,
            borrowed_mib=used.borrowed_mib,
            measured_mib=None if bound is None else bound + used.pending_mib,
        )

    return NodeState(
        name=name,
        gpus=tuple(gpu_state(g) for g in gpus),
        schedulable=schedulable,
        unschedulable_reason=unschedulable_reason,
    )


def _with_usage(node: NodeState, placements: Iterable[Placement], sign: int) -> NodeState:
    gpus = list(node.gpus)
    for placement in placements:
        if placement.node != node.name:
            raise ValueError(f"placement for node {placement.node!r} applied to node {node.name!r}")
        for grant in placement.grants():
            gpus[grant.gpu] = gpus[grant.gpu].with_use(
                sign * grant.memory_quota_mib, sign * grant.cores, sign, grant.oversubscribed
            )
    return replace(node, gpus=tuple(gpus))


def apply(node: NodeState, placement: Placement, shape: PodShape | None = None) -> NodeState:
    """The node after ``placement`` is made (and, if given, the shape's host CPU/memory taken)."""
    placed = _with_usage(node, (placement,), +1)
    if shape is None:
        return placed
    return replace(
        placed,
        used_cpu_milli=placed.used_cpu_milli + shape.cpu_milli,
        used_host_memory_mib=placed.used_host_memory_mib + shape.host_memory_mib,
    )


def release(node: NodeState, placement: Placement, shape: PodShape | None = None) -> NodeState:
    """The node after ``placement`` (made earlier by :func:`apply`) is given back."""
    released = _with_usage(node, (placement,), -1)
    if shape is None:
        return released
    return replace(
        released,
        used_cpu_milli=released.used_cpu_milli - shape.cpu_milli,
        used_host_memory_mib=released.used_host_memory_mib - shape.host_memory_mib,
    )


def release_all(node: NodeState, placements: Iterable[Placement]) -> NodeState:
    """The node after all of ``placements`` are given back (one new state, not one per placement)."""
    return _with_usage(node, placements, -1)


def to_allocation(
    node: NodeState,
    placement: Placement,
    container_names: Iterable[str],
    qos: QosClass = QosClass.STANDARD,
) -> Allocation:
    """The contract's allocation annotation for a placement (container names in shape order), with
    the pod's QoS class."""
    names = tuple(container_names)
    if len(names) != len(placement.containers):
        raise ValueError(f"{len(names)} container names for {len(placement.containers)} placed containers")
    return Allocation(
        node=node.name,
        containers=tuple(
            ContainerAllocation(
                name=name,
                gpus=tuple(
                    GpuGrant(
                        uuid=node.gpus[g.gpu].uuid,
                        memory_quota_mib=g.memory_quota_mib,
                        cores=g.cores,
                        oversubscribed=g.oversubscribed,
                    )
                    for g in grants
                ),
            )
            for name, grants in zip(names, placement.containers, strict=True)
        ),
        qos=qos,
    )


def placement_of(node: NodeState, allocation: Allocation) -> Placement:
    """The placement an allocation annotation describes; raises ValueError naming an unknown GPU."""
    positions: Mapping[str, int] = {g.uuid: i for i, g in enumerate(node.gpus)}
    containers = []
    for container in allocation.containers:
        grants = []
        for grant in container.gpus:
            if grant.uuid not in positions:
                raise ValueError(f"allocation names GPU {grant.uuid!r}, not on node {node.name!r}")
            grants.append(
                Grant(positions[grant.uuid], grant.memory_quota_mib, grant.cores, grant.oversubscribed)
            )
        containers.append(tuple(grants))
    return Placement(node=node.name, containers=tuple(containers))


@dataclass(slots=True)
class ShapeMix:
    """The recent mix of pod shapes (a sliding window), for policies that plan for future pods.

    ``version`` increases on every change, so caches of context-dependent scores know when to drop.
    """

    window: int = 1000
    counts: dict[PodShape, int] = field(default_factory=dict)
    recent: list[PodShape] = field(default_factory=list)
    version: int = 0

    def record(self, shape: PodShape) -> None:
        self.recent.append(shape)
        self.counts[shape] = self.counts.get(shape, 0) + 1
        if len(self.recent) > self.window:
            oldest = self.recent.pop(0)
            self.counts[oldest] -= 1
            if not self.counts[oldest]:
                del self.counts[oldest]
        self.version += 1
