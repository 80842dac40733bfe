"""The simulated scheduler: the placement core's engine over a simulated cluster, one policy per run.

Every decision is the core's: :class:`tessera.placement.PlacementEngine` evaluates a pod's shape on
every node (``filter_node``: fit, GPU choice, the policy's score) and :func:`tessera.placement.choose`
picks the node, exactly as the extender does. The simulator only turns trace pods into pod shapes,
applies and releases placements, and keeps the clock.

The compared systems differ in the request they make of the core and in the policy:

* ``exclusive``: the stock NVIDIA device plugin; every GPU pod gets whole GPUs; kube-scheduler's
  default least-allocated scoring (the core's ``spread``).
* ``gpushare``: memory-only sharing (Alibaba's gpushare-scheduler-extender): pods ask GPU memory and
  no compute share, binpacked.
* ``hami``: HAMi's defaults: memory and compute shares, nodes binpacked, GPUs spread.
* ``binpack``, ``spread``, ``fragmentation``: Tessera's policies, memory and compute shares, no speed
  profiles (speed-blind); ``fgd-paper``: FGD as published (ties to a random node), on request only.
* ``speed-aware``: Tessera's ``binpack`` with the speed profiles.
* ``dra``: the DRA path: the same shares as claims, placed by kube-scheduler's default profile and
  its DRA allocator (:class:`KubeDraScheduler`, the model in :mod:`simulator.kubedra`), not by the
  placement core; on request only. ``dra-mostallocated``, ``dra-ratio``, ``dra-bestfit`` and
  ``dra-mostallocated-bestfit``: the same under another scheduler profile or device order
  (:class:`simulator.kubedra.Profile`); on request only.

The research baselines ``hami-like`` and ``fgd-paper`` are policies of the simulator's own
(:data:`SIM_POLICIES`: the product's ``POLICIES`` and these); the product never offers them.

Node names get a seeded ``%04d-`` prefix, so the core's tie-break (alphabetically first name) is a
per-seed random node order, as in the FGD simulator.
"""

from __future__ import annotations

import random
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from enum import StrEnum
from typing import Protocol

from simulator import kubedra
from simulator.model import MILLI_PER_GPU, Cluster, SimPod, derived_memory_mib
from tessera.contract import MAX_CORES, PodPreferences
from tessera.placement import (
    POLICIES,
    ClusterContext,
    ContainerShape,
    GpuState,
    NodeFit,
    NodeState,
    Placement,
    PlacementEngine,
    PlacementPolicy,
    PodShape,
    ShapeMix,
    SpeedProfiles,
    apply,
    choose,
    release,
    score_nodes,
)
from tessera.placement.fragmentation import Fragmentation
from tessera.placement.policies import Binpack, Spread

# Slices per GPU: the device plugin's default --split.
SLICES_PER_GPU = 10
MILLI_PER_CORE = MILLI_PER_GPU // MAX_CORES


class Request(StrEnum):
    """How a system turns a trace pod into a GPU request."""

    WHOLE = "whole GPUs"
    MEMORY_ONLY = "memory share only"
    SHARES = "memory and compute shares"


class HamiLike(Binpack):
    """HAMi's default policies: node-scheduler-policy binpack, gpu-scheduler-policy spread.

    Nodes are scored by the core's binpack score; inside a node the GPU with the most left is used.
    """

    name = "hami-like"
    gpu_key = Spread.gpu_key


class PaperFgd(Fragmentation):
    """FGD as published: the same score, ties left to the node order (kube-scheduler's choice)."""

    name = "fgd-paper"
    breaks_ties = False


# The DRA path's placement: kube-scheduler's, modelled in simulator.kubedra (no core policy).
KUBE_SCHEDULER_DRA = "kube-scheduler-dra"

# Every policy a system may use, by name: the product's and the research baselines.
SIM_POLICIES: Mapping[str, PlacementPolicy] = {
    **{policy.value: placement for policy, placement in POLICIES.items()},
    HamiLike.name: HamiLike(),
    PaperFgd.name: PaperFgd(),
}


@dataclass(frozen=True, slots=True)
class System:
    """One column of the comparison."""

    name: str
    description: str
    policy: str
    request: Request
    speed_aware: bool = False
    # The DRA path's systems: kube-scheduler's placement under this profile, not the core's.
    kube_profile: kubedra.Profile | None = None


SYSTEMS: tuple[System, ...] = (
    System("exclusive", "whole GPUs (stock NVIDIA device plugin)", "spread", Request.WHOLE),
    System("gpushare", "memory-only sharing, binpack (gpushare-like)", "binpack", Request.MEMORY_ONLY),
    System("hami", "HAMi-like: node binpack, GPU spread", "hami-like", Request.SHARES),
    System("binpack", "Tessera binpack", "binpack", Request.SHARES),
    System("spread", "Tessera spread", "spread", Request.SHARES),
    System("fragmentation", "Tessera fragmentation (FGD)", "fragmentation", Request.SHARES),
    # Not compared by default: FGD with the paper's ties to a random node, to measure the tie-break.
    System("fgd-paper", "FGD as published (ties to a random node)", "fgd-paper", Request.SHARES),
    System("speed-aware", "Tessera binpack + speed profiles", "binpack", Request.SHARES, speed_aware=True),
    # Not compared by default: the DRA path, to measure what Tessera's placement adds over it.
    System(
        "dra",
        "DRA claims, kube-scheduler's default profile and allocator",
        KUBE_SCHEDULER_DRA,
        Request.SHARES,
        kube_profile=kubedra.Profile(),
    ),
    # Not compared by default: issue 26's levers on the DRA path, to measure what each closes.
    System(
        "dra-mostallocated",
        "DRA claims, a profile with NodeResourcesFit MostAllocated",
        KUBE_SCHEDULER_DRA,
        Request.SHARES,
        kube_profile=kubedra.Profile(kubedra.Scoring.MOST_ALLOCATED),
    ),
    System(
        "dra-ratio",
        "DRA claims, a profile with NodeResourcesFit RequestedToCapacityRatio (binpacking)",
        KUBE_SCHEDULER_DRA,
        Request.SHARES,
        kube_profile=kubedra.Profile(kubedra.Scoring.REQUESTED_TO_CAPACITY_RATIO),
    ),
    System(
        "dra-packwhole",
        "DRA claims, whole GPUs by the extended resource under a profile scoring it MostAllocated",
        KUBE_SCHEDULER_DRA,
        Request.SHARES,
        kube_profile=kubedra.Profile(pack_whole_gpus=True),
    ),
    System(
        "dra-packwhole-bestfit",
        "DRA claims, whole GPUs packed by the extended resource, devices listed best fit first",
        KUBE_SCHEDULER_DRA,
        Request.SHARES,
        kube_profile=kubedra.Profile(best_fit_devices=True, pack_whole_gpus=True),
    ),
    System(
        "dra-extender",
        "DRA claims, Tessera's extender filtering nodes for them (fragmentation), default allocator",
        KUBE_SCHEDULER_DRA,
        Request.SHARES,
        kube_profile=kubedra.Profile(extender=True),
    ),
    System(
        "dra-extender-bestfit",
        "DRA claims, Tessera's extender filtering nodes for them, devices listed best fit first",
        KUBE_SCHEDULER_DRA,
        Request.SHARES,
        kube_profile=kubedra.Profile(best_fit_devices=True, extender=True),
    ),
    System(
        "dra-bestfit",
        "DRA claims, default profile, devices listed best fit first",
        KUBE_SCHEDULER_DRA,
        Request.SHARES,
        kube_profile=kubedra.Profile(best_fit_devices=True),
    ),
    System(
        "dra-mostallocated-bestfit",
        "DRA claims, MostAllocated profile, devices listed best fit first",
        KUBE_SCHEDULER_DRA,
        Request.SHARES,
        kube_profile=kubedra.Profile(kubedra.Scoring.MOST_ALLOCATED, best_fit_devices=True),
    ),
)


def system_named(name: str) -> System:
    for system in SYSTEMS:
        if system.name == name:
            return system
    raise ValueError(f"policy: {name!r} is not one of {', '.join(s.name for s in SYSTEMS)}")


def pod_shape(pod: SimPod, cluster: Cluster, request: Request) -> PodShape:
    """The core's view of a trace pod under a system's way of requesting GPUs."""
    preferences = PodPreferences(models=pod.gpu_models, workload=pod.workload)
    containers: tuple[ContainerShape, ...] = ()
    if pod.num_gpu:
        if request is Request.WHOLE or not pod.fractional:
            memory, cores = None, (None if request is Request.MEMORY_ONLY else MAX_CORES)
        else:
            memory = derived_memory_mib(pod, cluster)
            cores = None if request is Request.MEMORY_ONLY else max(1, pod.gpu_milli // MILLI_PER_CORE)
        containers = (ContainerShape(pod.num_gpu, memory, cores),)
    return PodShape(containers, preferences, pod.cpu_milli, pod.host_memory_mib)


def node_states(cluster: Cluster, seed: int, *, dra: bool = False) -> list[NodeState]:
    """The cluster's nodes, empty, named ``%04d-<name>`` by a seeded permutation.

    ``dra``: the DRA driver's devices, which have no slices (the device plugin's ``--split``): a
    claim takes at least 1 MiB, so a GPU's memory in MiB bounds how many it holds."""
    order = list(range(len(cluster.nodes)))
    random.Random(seed).shuffle(order)
    states = []
    for rank, node in zip(order, cluster.nodes, strict=True):
        name = f"{rank:04d}-{node.name}"
        gpus = tuple(
            GpuState(uuid=f"{name}/gpu{i}", index=i, model=node.model, total_memory_mib=node.gpu_memory_mib,
                     slices=node.gpu_memory_mib if dra else SLICES_PER_GPU)
            for i in range(node.gpus)
        )  # fmt: skip
        states.append(NodeState(name, gpus, cpu_milli=node.cpu_milli, host_memory_mib=node.host_memory_mib))
    return states


def shape_mix(shapes: Iterable[PodShape]) -> ShapeMix:
    """A fixed mix of the workload's shapes (the FGD simulator's target workload, known up front)."""
    listed = list(shapes)
    mix = ShapeMix(window=max(1, len(listed)))
    for shape in listed:
        mix.record(shape)
    return mix


class SimScheduler:
    """One system's scheduler over one simulated cluster."""

    def __init__(
        self,
        cluster: Cluster,
        system: System,
        profiles: SpeedProfiles,
        target: Iterable[SimPod],
        seed: int,
    ) -> None:
        self.cluster = cluster
        self.system = system
        self._shapes: dict[SimPod, PodShape] = {}
        # The target workload is known up front and stays as it is (placed pods do not join it).
        context = ClusterContext(shape_mix(self.shape(p) for p in target), learns=False)
        self.engine = PlacementEngine(
            profiles if system.speed_aware else SpeedProfiles(), SIM_POLICIES[system.policy], context
        )
        for state in node_states(cluster, seed):
            self.engine.set_node(state)

    def shape(self, pod: SimPod) -> PodShape:
        shape = self._shapes.get(pod)
        if shape is None:
            shape = self._shapes[pod] = pod_shape(pod, self.cluster, self.system.request)
        return shape

    def place(self, pod: SimPod) -> NodeFit | None:
        """Schedule ``pod`` now; the fit made, or None when no node takes it."""
        shape = self.shape(pod)
        best = choose(self.engine.evaluate(shape).fits)
        if best is not None:
            self.engine.commit(shape, best)
        return best

    def remove(self, pod: SimPod, fit: NodeFit) -> None:
        """``pod``, placed as ``fit``, ends and gives its resources back."""
        node = self.engine.nodes[fit.name]
        self.engine.set_node(release(node, fit.placement, self.shape(pod)))

    def fits(self, shape: PodShape, name: str) -> bool:
        """Whether a pod of ``shape`` fits on node ``name`` now."""
        return bool(self.engine.evaluate(shape, [name]).fits)

    def node(self, name: str) -> NodeState:
        return self.engine.nodes[name]

    @property
    def nodes(self) -> list[NodeState]:
        return list(self.engine.nodes.values())


class KubeDraScheduler:
    """The DRA path's scheduler over one simulated cluster: kube-scheduler's default profile and
    DRA allocator (:mod:`simulator.kubedra`) placing the pods' shares as claims.

    Nodes are searched in the order of their seeded names, from where the previous search stopped;
    ties go to a node drawn from a generator seeded by ``seed``."""

    def __init__(
        self,
        cluster: Cluster,
        system: System,
        seed: int,
        percentage_of_nodes: int = 0,
        target: Iterable[SimPod] = (),
    ) -> None:
        if system.kube_profile is None:
            raise ValueError(f"system: {system.name!r} is not placed by kube-scheduler (no kube_profile)")
        self.cluster = cluster
        self.system = system
        self._profile = system.kube_profile
        self._shapes: dict[SimPod, PodShape] = {}
        self._nodes = {n.name: n for n in sorted(node_states(cluster, seed, dra=True), key=lambda n: n.name)}
        self._order = list(self._nodes)
        self._to_find = kubedra.nodes_to_find(len(self._order), percentage_of_nodes)
        self._start = 0
        # Its own stream: one seeded as the node names' permutation would repeat its draws.
        self._rng = random.Random(f"{seed}/ties")
        # Per node: the pods' CPU and memory requests as LeastAllocated counts them (0 -> default).
        self._nonzero_used = dict.fromkeys(self._order, (0, 0))
        # Per node: its state when the outcomes were made, and per shape (by number: hashing a
        # shape per node costs more than the search) the allocator's placement and the node's
        # score, or None when the pod does not fit.
        self._outcomes: dict[str, tuple[NodeState, dict[int, tuple[Placement, int] | None]]] = {}
        self._shape_numbers: dict[PodShape, int] = {}
        # The extender's view (kube_profile.extender): the core's fragmentation policy over the same
        # nodes, kept in step with the allocator's placements; ``target`` is its shape mix.
        self._extender: PlacementEngine | None = None
        if self._profile.extender:
            context = ClusterContext(shape_mix(self.shape(p) for p in target), learns=False)
            self._extender = PlacementEngine(SpeedProfiles(), SIM_POLICIES["fragmentation"], context)
            for state in self._nodes.values():
                self._extender.set_node(state)

    def shape(self, pod: SimPod) -> PodShape:
        shape = self._shapes.get(pod)
        if shape is None:
            shape = self._shapes[pod] = pod_shape(pod, self.cluster, self.system.request)
        return shape

    def _outcome(self, name: str, shape: PodShape, number: int) -> tuple[Placement, int] | None:
        node = self._nodes[name]
        kept = self._outcomes.get(name)
        if kept is None or kept[0] is not node:
            kept = self._outcomes[name] = (node, {})
        outcomes = kept[1]
        if number not in outcomes:
            fits = kubedra.host_fits(node, shape)
            placement = kubedra.allocate(node, shape, self._profile.best_fit_devices) if fits else None
            outcomes[number] = None if placement is None else (placement, self._score(name, shape))
        return outcomes[number]

    def _score(self, name: str, shape: PodShape) -> int:
        """The node's total for the pod under the profile the pod names (its schedulerName): the
        profile's for GPU pods (whole-GPU pods' own with ``pack_whole_gpus``), the default for the
        others."""
        node, profile = self._nodes[name], self._profile
        if (
            profile.pack_whole_gpus
            and shape.containers
            and all(c.memory_quota_mib is None for c in shape.containers)
        ):
            return kubedra.whole_gpu_score(node, shape) + kubedra.balanced_allocation(node, shape)
        scoring = profile.scoring if shape.containers else kubedra.Scoring.LEAST_ALLOCATED
        return kubedra.node_score(node, self._nonzero_used[name], shape, scoring)

    def _number(self, shape: PodShape) -> int:
        return self._shape_numbers.setdefault(shape, len(self._shape_numbers))

    def place(self, pod: SimPod) -> NodeFit | None:
        """Schedule ``pod`` now as kube-scheduler would; the fit made, or None when no node takes it."""
        shape = self.shape(pod)
        number = self._number(shape)
        total = len(self._order)
        feasible: list[tuple[str, Placement, int]] = []
        checked = 0
        while checked < total and len(feasible) < self._to_find:
            name = self._order[(self._start + checked) % total]
            checked += 1
            outcome = self._outcome(name, shape, number)
            if outcome is not None:
                feasible.append((name, *outcome))
        self._start = (self._start + checked) % total
        if self._extender is not None:
            feasible = self._extender_filter(shape, feasible)
        if not feasible:
            return None
        best = max(score for _, _, score in feasible)
        tied = [f for f in feasible if f[2] == best]
        name, placement, _ = tied[self._rng.randrange(len(tied))] if len(tied) > 1 else tied[0]
        fit = NodeFit(self._nodes[name], placement, best / (2 * kubedra.MAX_NODE_SCORE), 1.0)
        self._set_node(apply(self._nodes[name], placement, shape))
        cpu, memory = kubedra.nonzero_request(shape)
        used_cpu, used_memory = self._nonzero_used[name]
        self._nonzero_used[name] = (used_cpu + cpu, used_memory + memory)
        return fit

    def _extender_filter(
        self, shape: PodShape, feasible: list[tuple[str, Placement, int]]
    ) -> list[tuple[str, Placement, int]]:
        """The feasible nodes the extender's filter answers: those with its top score."""
        assert self._extender is not None
        fits = self._extender.evaluate(shape, [name for name, _, _ in feasible]).fits
        if not fits:
            return []
        scores = score_nodes(fits)
        top = max(scores.values())
        return [f for f in feasible if scores.get(f[0]) == top]

    def _set_node(self, state: NodeState) -> None:
        self._nodes[state.name] = state
        if self._extender is not None:
            self._extender.set_node(state)

    def remove(self, pod: SimPod, fit: NodeFit) -> None:
        """``pod``, placed as ``fit``, ends and gives its resources back."""
        shape = self.shape(pod)
        self._set_node(release(self._nodes[fit.name], fit.placement, shape))
        cpu, memory = kubedra.nonzero_request(shape)
        used_cpu, used_memory = self._nonzero_used[fit.name]
        self._nonzero_used[fit.name] = (used_cpu - cpu, used_memory - memory)

    def fits(self, shape: PodShape, name: str) -> bool:
        """Whether a pod of ``shape`` fits on node ``name`` now."""
        return self._outcome(name, shape, self._number(shape)) is not None

    def node(self, name: str) -> NodeState:
        return self._nodes[name]

    @property
    def nodes(self) -> list[NodeState]:
        return list(self._nodes.values())


class Scheduler(Protocol):
    """What the experiments ask of a system's scheduler."""

    @property
    def system(self) -> System: ...

    def shape(self, pod: SimPod) -> PodShape: ...

    def place(self, pod: SimPod) -> NodeFit | None: ...

    def remove(self, pod: SimPod, fit: NodeFit) -> None: ...

    def fits(self, shape: PodShape, name: str) -> bool: ...

    def node(self, name: str) -> NodeState: ...

    @property
    def nodes(self) -> list[NodeState]: ...


def make_scheduler(
    cluster: Cluster, system: System, profiles: SpeedProfiles, target: Iterable[SimPod], seed: int
) -> Scheduler:
    """The scheduler of ``system``: the placement core's, or kube-scheduler's for the DRA path."""
    if system.kube_profile is not None:
        return KubeDraScheduler(cluster, system, seed, target=target)
    return SimScheduler(cluster, system, profiles, target, seed)
