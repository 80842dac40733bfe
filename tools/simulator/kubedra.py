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
* **Ties** between the highest totals go to a uniformly random node (``framework/sorted_nodes.go``:
  a random key per node breaks them); the caller draws it from its seeded generator.
"""

from __future__ import annotations

from tessera.placement import Grant, NodeState, Placement, PodShape

MAX_NODE_SCORE = 100
# numFeasibleNodesToFind (pkg/scheduler/schedule_one.go).
MIN_FEASIBLE_NODES = 100
MIN_FEASIBLE_PERCENT = 5
BASE_PERCENT = 50
# What LeastAllocated counts for a pod that requests no CPU or no memory (pkg/scheduler/util).
DEFAULT_MILLI_CPU = 100
DEFAULT_MEMORY_MIB = 200


def nodes_to_find(total: int, percentage: int = 0) -> int:
    """How many feasible nodes filtering looks for among ``total`` (percentageOfNodesToScore;
    0: adaptive, 50% minus a point per 125 nodes, at least 5%, at least 100 nodes)."""
    if total < MIN_FEASIBLE_NODES:
        return total
    if percentage == 0:
        percentage = max(MIN_FEASIBLE_PERCENT, BASE_PERCENT - total // 125)
    return max(MIN_FEASIBLE_NODES, min(total, total * percentage // 100))


def allocate(node: NodeState, shape: PodShape) -> Placement | None:
    """The structured allocator's answer for the pod's claim on ``node``: per container, its GPUs
    taken first-fit in slice order; None when a request finds no device.

    The allocator searches a request's next device after the one it took (so a request's devices
    are distinct) and each request from the slice's start (so two containers may share a device).
    Its backtracking is left out: within one request a device that fits a later GPU also fits an
    earlier one, so it finds nothing first fit misses; across the containers of one pod (the
    simulator's pods have one) it could."""
    models = shape.preferences.models
    memory_taken = [0] * len(node.gpus)
    cores_taken = [0] * len(node.gpus)
    containers: list[tuple[Grant, ...]] = []
    for container in shape.containers:
        grants: list[Grant] = []
        chosen: set[int] = set()
        for _ in range(container.gpu_count):
            for position, gpu in enumerate(node.gpus):
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


def least_allocated(node: NodeState, nonzero_used: tuple[int, int], shape: PodShape) -> int:
    """NodeResourcesFit's LeastAllocated score (0..100) of ``node`` with the pod on it;
    ``nonzero_used`` is the node's pods' requests as LeastAllocated counts them."""
    cpu, memory = nonzero_request(shape)
    cpu_score = _least_requested(nonzero_used[0] + cpu, node.cpu_milli or 0)
    memory_score = _least_requested(nonzero_used[1] + memory, node.host_memory_mib or 0)
    return (cpu_score + memory_score) // 2


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


def node_score(node: NodeState, nonzero_used: tuple[int, int], shape: PodShape) -> int:
    """The default profile's total for ``node`` (0..200): the plugins that differ between nodes."""
    return least_allocated(node, nonzero_used, shape) + balanced_allocation(node, shape)
