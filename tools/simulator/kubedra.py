"""kube-scheduler placing pods whose ResourceClaims ask Tessera's DRA driver for GPU shares: a model.

The DRA path has no Tessera placement: kube-scheduler's default profile decides, and this module is
the simulator's model of it on the pinned 1.37 (what was read, with its source paths in
kubernetes/kubernetes, is in docs/benchmarks.md, "DRA placement vs the extender"). Pure: node
states and pod shapes in, placements and scores out.

* **Filter**, per node: NodeResourcesFit's CPU and memory check, then DynamicResources' structured
  allocator over the node's ResourceSlice (``staging/src/k8s.io/dynamic-resource-allocation/
  structured``, its incubating implementation, the one used with consumable capacity): for each
  device a request asks, the devices in slice order, the first one whose model the request's
  selector accepts and whose capacity left covers the request takes it.
  Tessera's driver publishes one slice per node, ``gpu-<index>`` in index order, each device with
  ``allowMultipleAllocations`` and the consumable capacities ``memory`` (default: all of it) and
  ``cores`` (default 0); kube-scheduler keeps the sums of what the claims on a device consumed.
  A request for N devices gets N distinct ones.
* **Which nodes**: filtering stops once ``nodes_to_find`` feasible nodes are found
  (``percentageOfNodesToScore``, default adaptive), starting where the previous pod's search
  stopped (``pkg/scheduler/schedule_one.go``).
* **Score**: the default profile's plugins that tell these nodes apart are NodeResourcesFit
  (LeastAllocated over CPU and memory, weights 1 and 1, pods without a request counted at 100m CPU
  and 200 MiB) and NodeResourcesBalancedAllocation (how much the pod evens out the node's CPU and
  memory fractions requested), weight 1 each. Devices are not scored: DynamicResources' Score only
  ranks the subrequests of ``firstAvailable`` lists, so it gives every node 0 for ``exactly``
  requests; the rest (taints, affinities, topology spread, image locality) are equal for the
  simulator's pods.
* **Other profiles** (:class:`Profile`, issue 26's levers for the DRA path's placement):
  NodeResourcesFit's other scoring strategies, ``MostAllocated`` and ``RequestedToCapacityRatio``
  (``framework/plugins/noderesources/most_allocated.go``, ``requested_to_capacity_ratio.go``), still
  over CPU and memory, which a scheduler profile may set; a profile for the pods that ask whole
  GPUs by the DRA-backed extended resource (docs/dra.md, "Whole GPUs through the extended
  resource"), whose NodeResourcesFit scores that resource MostAllocated: the one way a default
  plugin sees devices (``resource_allocation.go``, ``calculateDRAResourceTotals``: the class's
  devices on the node, and those with any allocation, shares included; only for a pod that asks
  the resource, so never for a share's claim); and a driver that lists a node's devices best fit
  first (least capacity left first), so that the allocator's first fit is a best fit.
* **Ties** between the highest totals go to a uniformly random node (``framework/sorted_nodes.go``:
  a random key per node breaks them); the caller draws it from its seeded generator.
"""

from __future__ import annotations

from dataclasses import dataclass
from enum import StrEnum

from tessera.placement import Grant, NodeState, Placement, PodShape

MAX_NODE_SCORE = 100
# numFeasibleNodesToFind (pkg/scheduler/schedule_one.go).
MIN_FEASIBLE_NODES = 100
MIN_FEASIBLE_PERCENT = 5
BASE_PERCENT = 50
# What LeastAllocated counts for a pod that requests no CPU or no memory (pkg/scheduler/util).
DEFAULT_MILLI_CPU = 100
DEFAULT_MEMORY_MIB = 200


# RequestedToCapacityRatio's shape for binpacking, as kube-scheduler's documentation gives it
# (utilization %, score 0..10; scaled to 0..100 by MaxNodeScore / MaxCustomPriorityScore).
BINPACKING_SHAPE = ((0, 0), (100, 10))
MAX_CUSTOM_PRIORITY_SCORE = 10


class Scoring(StrEnum):
    """NodeResourcesFit's scoring strategy (``scoringStrategy.type``), over CPU and memory."""

    LEAST_ALLOCATED = "LeastAllocated"
    MOST_ALLOCATED = "MostAllocated"
    REQUESTED_TO_CAPACITY_RATIO = "RequestedToCapacityRatio"


@dataclass(frozen=True, slots=True)
class Profile:
    """What decides the DRA path's placement: the scheduler profile's NodeResourcesFit strategy
    (RequestedToCapacityRatio with :data:`BINPACKING_SHAPE`) and whether the driver lists a node's
    devices best fit first. The default is kube-scheduler's default profile over Tessera's driver
    as it is (devices in index order)."""

    scoring: Scoring = Scoring.LEAST_ALLOCATED
    best_fit_devices: bool = False
    # Whole-GPU pods ask the extended resource under a profile of their own: NodeResourcesFit
    # MostAllocated over that resource alone (:func:`whole_gpu_score`).
    pack_whole_gpus: bool = False
    # Tessera's extender called for the claim pods too: with empty managedResources, as it must be
    # for them, kube-scheduler calls it for every pod. Its filter keeps the feasible nodes with the
    # fragmentation policy's top score (the product's --filter-keeps=best); the allocator still
    # picks the devices. Modelled in simulator.scheduler, where the placement core is at hand.
    extender: bool = False


def nodes_to_find(total: int, percentage: int = 0) -> int:
    """How many feasible nodes filtering looks for among ``total`` (percentageOfNodesToScore;
    0: adaptive, 50% minus a point per 125 nodes, at least 5%, at least 100 nodes)."""
    if total < MIN_FEASIBLE_NODES:
        return total
    if percentage == 0:
        percentage = max(MIN_FEASIBLE_PERCENT, BASE_PERCENT - total // 125)
    return max(MIN_FEASIBLE_NODES, min(total, total * percentage // 100))


def slice_order(node: NodeState, best_fit: bool = False) -> list[int]:
    """The positions of ``node``'s devices in its ResourceSlice: by index, or with ``best_fit``
    the least compute left first, then the least memory left, then by index (a driver that
    republishes the slice as the devices' use changes; the model assumes it always up to date)."""
    positions = list(range(len(node.gpus)))
    if not best_fit:
        return positions
    gpus = node.gpus
    return sorted(positions, key=lambda p: (gpus[p].free_cores, gpus[p].free_memory_mib, p))


def allocate(node: NodeState, shape: PodShape, best_fit: bool = False) -> Placement | None:
    """The structured allocator's answer for the pod's claim on ``node``: per container, its GPUs
    taken first-fit in slice order (:func:`slice_order`); None when a request finds no device.

    The allocator searches a request's next device after the one it took (so a request's devices
    are distinct) and each request from the slice's start (so two containers may share a device).
    Its backtracking is left out: within one request a device that fits a later GPU also fits an
    earlier one, so it finds nothing first fit misses; across the containers of one pod (the
    simulator's pods have one) it could."""
    models = shape.preferences.models
    memory_taken = [0] * len(node.gpus)
    cores_taken = [0] * len(node.gpus)
    containers: list[tuple[Grant, ...]] = []
    order = slice_order(node, best_fit)
    for container in shape.containers:
        grants: list[Grant] = []
        chosen: set[int] = set()
        for _ in range(container.gpu_count):
            for position in order:
                gpu = node.gpus[position]
                if not gpu.healthy or position in chosen or (models and gpu.model not in models):
                    continue
                memory = container.memory_quota_on(gpu)
                cores = container.cores_needed
                if (
                    gpu.free_memory_mib - memory_taken[position] >= memory
                    and gpu.free_cores - cores_taken[position] >= cores
                ):
                    chosen.add(position)
                    memory_taken[position] += memory
                    cores_taken[position] += cores
                    grants.append(Grant(position, memory, cores))
                    break
            else:
                return None
        containers.append(tuple(grants))
    return Placement(node.name, tuple(containers))


def host_fits(node: NodeState, shape: PodShape) -> bool:
    """NodeResourcesFit's filter: the pod's CPU and memory requests fit in what is left."""
    cpu_ok = node.cpu_milli is None or node.used_cpu_milli + shape.cpu_milli <= node.cpu_milli
    memory = node.host_memory_mib
    return cpu_ok and (memory is None or node.used_host_memory_mib + shape.host_memory_mib <= memory)


def nonzero_request(shape: PodShape) -> tuple[int, int]:
    """(milli-CPU, MiB) that LeastAllocated counts for a pod: a request of 0 counts as the default."""
    return shape.cpu_milli or DEFAULT_MILLI_CPU, shape.host_memory_mib or DEFAULT_MEMORY_MIB


def _least_requested(requested: int, capacity: int) -> int:
    if capacity == 0 or requested > capacity:
        return 0
    return (capacity - requested) * MAX_NODE_SCORE // capacity


def _most_requested(requested: int, capacity: int) -> int:
    # More requested than the capacity (pods without requests count at the defaults) is full.
    return min(requested, capacity) * MAX_NODE_SCORE // capacity


def _ratio_scored(requested: int, capacity: int) -> int:
    """RequestedToCapacityRatio's score of one resource: :data:`BINPACKING_SHAPE`, a broken linear
    function of the utilization in whole percent (over the capacity: 100%)."""
    utilization = 100 if requested > capacity else requested * 100 // capacity
    # The shape's scores are scaled before the interpolation (helper.BuildBrokenLinearFunction).
    scale = MAX_NODE_SCORE // MAX_CUSTOM_PRIORITY_SCORE
    (low, low_score), (high, high_score) = ((u, score * scale) for u, score in BINPACKING_SHAPE)
    return low_score + (high_score - low_score) * (utilization - low) // (high - low)


def fit_score(
    node: NodeState,
    nonzero_used: tuple[int, int],
    shape: PodShape,
    scoring: Scoring = Scoring.LEAST_ALLOCATED,
) -> int:
    """NodeResourcesFit's score (0..100) of ``node`` with the pod on it under ``scoring``, CPU and
    memory weighted 1 each; ``nonzero_used`` is the node's pods' requests as the plugin counts them
    (a request of 0 as the default). A resource the node has none of is left out; so is, under
    RequestedToCapacityRatio, one that scores 0, and its mean is rounded, not truncated."""
    cpu, memory = nonzero_request(shape)
    pairs = [
        (used + wanted, capacity)
        for used, wanted, capacity in (
            (nonzero_used[0], cpu, node.cpu_milli or 0),
            (nonzero_used[1], memory, node.host_memory_mib or 0),
        )
        if capacity
    ]
    if scoring is Scoring.REQUESTED_TO_CAPACITY_RATIO:
        scores = [s for s in (_ratio_scored(r, c) for r, c in pairs) if s > 0]
        # math.Round: halves away from zero (the scores are not negative).
        return (2 * sum(scores) + len(scores)) // (2 * len(scores)) if scores else 0
    scorer = _most_requested if scoring is Scoring.MOST_ALLOCATED else _least_requested
    return sum(scorer(r, c) for r, c in pairs) // len(pairs) if pairs else 0


def whole_gpu_score(node: NodeState, shape: PodShape) -> int:
    """NodeResourcesFit's MostAllocated score (0..100) over the DRA-backed extended resource alone,
    for a pod asking its GPUs as whole ones: the node's devices with any allocation (a share counts
    the device as allocated) plus the pod's count, over the node's devices."""
    allocated = sum(1 for gpu in node.gpus if gpu.used_cores or gpu.used_memory_mib)
    asked = sum(container.gpu_count for container in shape.containers)
    return _most_requested(allocated + asked, len(node.gpus)) if node.gpus else 0


def least_allocated(node: NodeState, nonzero_used: tuple[int, int], shape: PodShape) -> int:
    """NodeResourcesFit's LeastAllocated score (0..100) of ``node`` with the pod on it;
    ``nonzero_used`` is the node's pods' requests as LeastAllocated counts them."""
    return fit_score(node, nonzero_used, shape)


def _balance(cpu_milli: int, memory_mib: int, node: NodeState) -> int:
    """1 minus the standard deviation of the CPU and memory fractions requested (each at most 1),
    x 100; a resource the node has none of is left out."""
    fractions = [
        min(1.0, used / capacity)
        for used, capacity in ((cpu_milli, node.cpu_milli or 0), (memory_mib, node.host_memory_mib or 0))
        if capacity
    ]
    deviation = abs(fractions[0] - fractions[1]) / 2 if len(fractions) == 2 else 0.0
    return int((1 - deviation) * MAX_NODE_SCORE)


def balanced_allocation(node: NodeState, shape: PodShape) -> int:
    """NodeResourcesBalancedAllocation's score (50..100) of ``node`` for the pod: how much placing it
    improves the node's balance of CPU and memory requested (1.37 scores the change: 75 when the
    pod changes nothing, towards 100 as it evens the node out, towards 50 as it skews it). A pod
    that requests neither is not scored by the plugin (0 everywhere)."""
    if not shape.cpu_milli and not shape.host_memory_mib:
        return 0
    cpu, memory = node.used_cpu_milli, node.used_host_memory_mib
    with_pod = _balance(cpu + shape.cpu_milli, memory + shape.host_memory_mib, node)
    without_pod = _balance(cpu, memory, node)
    return MAX_NODE_SCORE // 2 + (MAX_NODE_SCORE // 2 + with_pod - without_pod) // 2


def node_score(
    node: NodeState,
    nonzero_used: tuple[int, int],
    shape: PodShape,
    scoring: Scoring = Scoring.LEAST_ALLOCATED,
) -> int:
    """The profile's total for ``node`` (0..200): the plugins that differ between nodes."""
    return fit_score(node, nonzero_used, shape, scoring) + balanced_allocation(node, shape)
