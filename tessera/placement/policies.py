"""Placement policies: which GPUs of a node to prefer, and how good a node's placement is.

A policy answers two questions, both over plain data:

* :meth:`PlacementPolicy.gpu_key` orders the GPUs that could take one container on one node
  (smaller key = tried first). The fit search (:mod:`.fit`) takes GPUs in this order.
* :meth:`PlacementPolicy.score` rates the placement found on a node, 0..1, higher = better. The
  core turns it into kube-scheduler's 0..10 (see :func:`tessera.placement.score.score_nodes`).

Both get a :class:`ClusterContext` with what a policy may need beyond the node itself (the recent
mix of pod shapes). A policy whose answers depend on the context sets ``uses_context = True``;
caches then also key on ``context.version``.

``binpack`` and ``spread`` are here, ``fragmentation`` in :mod:`tessera.placement.fragmentation`;
the table by the contract's ``Policy`` (what a pod's ``<domain>/policy`` annotation and the
extender's ``--policy`` name) is :data:`tessera.placement.engine.POLICIES`. Research baselines are
the simulator's own (``tools/simulator``).
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from bisect import bisect_left
from dataclasses import dataclass, field
from functools import reduce
from operator import add

from tessera.placement.model import ContainerShape, GpuState, NodeState, Placement, PodShape, ShapeMix


@dataclass(slots=True)
class ClusterContext:
    """Cluster-wide facts a policy may use. ``shape_mix`` is the recent mix of placed pod shapes;
    with ``learns`` False it is a target workload known up front (the simulator's, as in the FGD
    simulator), which placed pods leave as it is."""

    shape_mix: ShapeMix = field(default_factory=ShapeMix)
    learns: bool = True

    @property
    def version(self) -> int:
        return self.shape_mix.version

    def placed(self, shape: PodShape) -> None:
        """A pod of ``shape`` was placed: it joins the recent mix (unless the mix is fixed)."""
        if self.learns:
            self.shape_mix.record(shape)


class PlacementPolicy(ABC):
    name: str
    uses_context: bool = False

    @abstractmethod
    def gpu_key(self, gpu: GpuState, container: ContainerShape, context: ClusterContext) -> tuple[float, ...]:
        """Sort key of ``gpu`` (with its current usage) as a home for one GPU of ``container``."""

    @abstractmethod
    def score(self, node: NodeState, placement: Placement, shape: PodShape, context: ClusterContext) -> float:
        """How good ``placement`` on ``node`` (state before the placement) is, 0..1."""


def utilization_after(node: NodeState, placement: Placement) -> tuple[float, float]:
    """(mean utilization of the GPUs the placement uses, mean utilization of the node's healthy GPUs),
    both after the placement; a GPU's utilization is the larger of its memory and compute fractions."""
    added: dict[int, tuple[int, int]] = {}  # position -> (memory, cores) the placement adds there
    for grants in placement.containers:
        for grant in grants:
            memory, cores = added.get(grant.gpu, (0, 0))
            added[grant.gpu] = (memory + grant.memory_quota_mib, cores + grant.cores)
    # The node's utilizations before, with the chosen GPUs' replaced (only these change), summed in
    # position order by plain float additions: the same sums, to the bit, as adding GPU by GPU.
    healthy = node.healthy_positions
    used = list(node.healthy_utilizations)
    chosen = 0.0
    for position in sorted(added):
        rank = bisect_left(healthy, position)
        if rank == len(healthy) or healthy[rank] != position:
            continue  # an unhealthy GPU counts in neither mean's numerator
        gpu = node.gpus[position]
        memory, cores = added[position]
        used[rank] = after = min(
            1.0, max((gpu.used_memory_mib + memory) / gpu.total_memory_mib, (gpu.used_cores + cores) / 100)
        )
        chosen += after
    total = reduce(add, used, 0.0)
    return (chosen / len(added) if added else 0.0, total / len(healthy) if healthy else 0.0)


# How much the chosen GPUs weigh against the whole node in binpack/spread scores.
GPU_WEIGHT = 0.6


class Binpack(PlacementPolicy):
    """Fill GPUs and nodes already in use, to keep whole GPUs (and nodes) free for big pods.

    GPUs: best fit first (least memory left after, then least compute left after).
    Score: utilization after the placement, of the chosen GPUs (weight 0.6) and of the node (0.4).
    """

    name = "binpack"

    def gpu_key(self, gpu: GpuState, container: ContainerShape, context: ClusterContext) -> tuple[float, ...]:
        return (
            gpu.free_memory_mib - container.memory_quota_on(gpu),
            gpu.free_cores - container.cores_needed,
            gpu.index,
        )

    def score(self, node: NodeState, placement: Placement, shape: PodShape, context: ClusterContext) -> float:
        chosen, whole = utilization_after(node, placement)
        return GPU_WEIGHT * chosen + (1 - GPU_WEIGHT) * whole


class Spread(PlacementPolicy):
    """Least loaded first: GPUs with the most left after the placement, nodes with the least in use.

    Score: 1 - the binpack score.
    """

    name = "spread"

    def gpu_key(self, gpu: GpuState, container: ContainerShape, context: ClusterContext) -> tuple[float, ...]:
        return (
            -(gpu.free_memory_mib - container.memory_quota_on(gpu)) / gpu.total_memory_mib,
            -(gpu.free_cores - container.cores_needed),
            gpu.index,
        )

    def score(self, node: NodeState, placement: Placement, shape: PodShape, context: ClusterContext) -> float:
        chosen, whole = utilization_after(node, placement)
        return 1 - (GPU_WEIGHT * chosen + (1 - GPU_WEIGHT) * whole)
