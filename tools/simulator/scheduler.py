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

from simulator.model import MILLI_PER_GPU, Cluster, SimPod, derived_memory_mib
from tessera.contract import MAX_CORES, PodPreferences
from tessera.placement import (
    POLICIES,
    ClusterContext,
    ContainerShape,
    GpuState,
    NodeFit,
    NodeState,
    PlacementEngine,
    PlacementPolicy,
    PodShape,
    ShapeMix,
    SpeedProfiles,
    choose,
    release,
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


def node_states(cluster: Cluster, seed: int) -> list[NodeState]:
    """The cluster's nodes, empty, named ``%04d-<name>`` by a seeded permutation."""
    order = list(range(len(cluster.nodes)))
    random.Random(seed).shuffle(order)
    states = []
    for rank, node in zip(order, cluster.nodes, strict=True):
        name = f"{rank:04d}-{node.name}"
        gpus = tuple(
            GpuState(uuid=f"{name}/gpu{i}", index=i, model=node.model, total_memory_mib=node.gpu_memory_mib,
                     slices=SLICES_PER_GPU)
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

    @property
    def nodes(self) -> list[NodeState]:
        return list(self.engine.nodes.values())
