"""The packing experiment of the FGD paper (Weng et al., USENIX ATC '23, section 6).

Pods arrive one at a time and never leave. The order is the workload sorted by name and shuffled
with the seed; while the arrived GPU demand is below ``inflation`` x the cluster's GPUs, pods drawn
uniformly with replacement are appended (the paper's "workload inflation"). A pod no node takes
fails and is never retried.

Metrics, as the paper's scripts compute them:

* arrived load: GPU demand of every pod submitted so far, failed ones included, in % of capacity;
* allocation rate: GPU demand placed, in % of capacity (on a GPU whose pods ask more than it has,
  which memory-only sharing allows, only the GPU's own capacity counts), binned by integer arrived %;
* unallocated GPUs: 100 - allocation rate, and that share of the cluster's GPUs;
* fragmentation: the FGD measure of the cluster (node fragments against the workload's shape mix),
  as % of capacity (amount) and % of idle capacity (ratio).
"""

from __future__ import annotations

import random
import time
from collections.abc import Sequence
from dataclasses import dataclass, field

from simulator.model import MILLI_PER_GPU, Cluster, Progress, SimPod, Workload
from simulator.scheduler import Request, Scheduler, System, pod_shape, shape_mix
from tessera.placement import ClusterContext, NodeState
from tessera.placement.fragmentation import Fragmentation, free_share

REPORTED_LOADS = (90, 95, 100)
FRAGMENTATION_LOADS = (50, 75, 90, 95, 100)


def arrival_order(workload: Workload, cluster: Cluster, seed: int, inflation: float) -> list[SimPod]:
    """The seeded arrival sequence: shuffled pods, then resampled ones up to ``inflation`` x capacity."""
    rng = random.Random(seed)
    pods = sorted(workload.pods, key=lambda p: p.name)
    rng.shuffle(pods)
    target = inflation * cluster.total_gpus * MILLI_PER_GPU
    order: list[SimPod] = []
    arrived = 0
    for pod in pods:
        if arrived + pod.total_gpu_milli > target:
            return order
        order.append(pod)
        arrived += pod.total_gpu_milli
    if not any(p.total_gpu_milli for p in pods):
        return order
    while True:
        pod = rng.choice(pods)
        if arrived + pod.total_gpu_milli > target:
            return order
        order.append(pod)
        arrived += pod.total_gpu_milli


@dataclass(slots=True)
class PackingResult:
    system: str
    total_gpus: int
    pods: int = 0
    placed: int = 0
    # Mean allocation rate (%) by integer arrived load (%), 0..inflation.
    allocation: dict[int, float] = field(default_factory=dict)
    # Arrived load (%) -> (fragment amount % of capacity, fragment ratio % of idle).
    fragmentation: dict[int, tuple[float, float]] = field(default_factory=dict)
    decision_seconds: float = 0.0

    def allocation_at(self, load: int) -> float:
        """The allocation rate at ``load`` % arrived (the nearest measured load if none fell there)."""
        if load in self.allocation:
            return self.allocation[load]
        nearest = min(self.allocation, key=lambda x: (abs(x - load), x))
        return self.allocation[nearest]

    def unallocated_at(self, load: int) -> tuple[float, float]:
        """(% of capacity, GPUs) unallocated at ``load`` % arrived."""
        percent = 100.0 - self.allocation_at(load)
        return percent, percent * self.total_gpus / 100

    @property
    def mean_decision_ms(self) -> float:
        return 1000 * self.decision_seconds / self.pods if self.pods else 0.0


def cluster_fragmentation(
    nodes: Sequence[NodeState], measure: Fragmentation, context: ClusterContext
) -> tuple[float, float]:
    """(fragment amount in % of GPU capacity, fragment ratio in % of idle GPU capacity)."""
    fragment = sum(measure.fragmentation(n, context) for n in nodes)
    idle = sum(free_share(g) for n in nodes for g in n.gpus)
    capacity = 100 * sum(len(n.gpus) for n in nodes)
    return 100 * fragment / capacity, (100 * fragment / idle if idle else 0.0)


def run_packing(
    cluster: Cluster,
    *,
    workload: Workload,
    system: System,
    scheduler: Scheduler,
    order: Sequence[SimPod],
    progress: Progress | None = None,
) -> PackingResult:
    capacity = cluster.total_gpus * MILLI_PER_GPU
    result = PackingResult(system.name, cluster.total_gpus, pods=len(order))
    # Fragmentation is measured the same way for every system: against the workload's shapes as
    # memory-and-compute requests.
    measure = Fragmentation()
    measure_context = ClusterContext(shape_mix(pod_shape(p, cluster, Request.SHARES) for p in workload.pods))
    demand: dict[tuple[str, int], int] = {}
    sums: dict[int, tuple[float, int]] = {}
    arrived = allocated = 0
    checkpoints = list(FRAGMENTATION_LOADS)
    for n, pod in enumerate(order):
        started = time.perf_counter()
        fit = scheduler.place(pod)
        result.decision_seconds += time.perf_counter() - started
        arrived += pod.total_gpu_milli
        if fit is not None:
            result.placed += 1
            for grant in fit.placement.grants():
                key = (fit.name, grant.gpu)
                before = demand.get(key, 0)
                demand[key] = before + pod.gpu_milli
                allocated += min(MILLI_PER_GPU, before + pod.gpu_milli) - min(MILLI_PER_GPU, before)
        load = round(100 * arrived / capacity)
        total, count = sums.get(load, (0.0, 0))
        sums[load] = (total + 100 * allocated / capacity, count + 1)
        while checkpoints and 100 * arrived / capacity >= checkpoints[0]:
            result.fragmentation[checkpoints.pop(0)] = cluster_fragmentation(
                scheduler.nodes, measure, measure_context
            )
        if progress is not None and n % 64 == 63:
            progress(64)
    if progress is not None:
        progress(len(order) % 64)
    result.allocation = {load: total / count for load, (total, count) in sorted(sums.items())}
    return result
