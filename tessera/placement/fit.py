"""Does a pod fit on a node, on which GPUs, and if not, why not.

Rules (docs/placement.md has them with examples):

* A GPU is *eligible* for a pod when it is healthy, its model matches ``<domain>/gpu-models`` (any
  entry, case-insensitive substring; no entries = any model) and no ``<domain>/gpu-models-exclude``
  entry, and its speed for the pod's workload is at least ``<domain>/min-speed``.
* A container asking ``gpu_count: n`` gets n *distinct* eligible GPUs, each with a free slice, free
  memory >= its ``vgpu-memory`` (absent: the GPU's whole memory, i.e. none of it in use) and free
  compute >= its ``vgpu-cores`` (absent: none reserved). Containers of one pod may share a GPU
  when the quotas allow; each takes its own slice.
* GPUs are tried in the policy's order; a multi-GPU container first tries sets inside one NVLink
  island, then inside one NUMA node, then any set. Containers are placed biggest first, with
  backtracking (bounded by ``SEARCH_LIMIT`` tries per node), so a fit is found whenever one exists
  for the pods real clusters run.
* A best-effort pod that fits nowhere on the node by requests may be placed against the GPUs'
  measured use (:mod:`.usage`): ``by_use`` here, on GPUs with a free slice and ``measured_mib`` +
  its memory within the GPU's memory (compute reserves nothing then), the GPUs with the most
  measured headroom left first; all its grants are then oversubscribed.
* A rejection names the shortfall: ``no GPU with 8192 MiB free; largest free 6144 MiB``. It is
  *unresolvable* when even an empty node could not take the pod (wrong models, too little memory,
  too few GPUs, node unusable), so kube-scheduler does not try preemption there.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator, Mapping, Sequence
from itertools import combinations, repeat

from tessera.contract import MAX_CORES, PodPreferences, QosClass
from tessera.placement.model import (
    ContainerShape,
    GpuState,
    Grant,
    NodeFit,
    NodeOutcome,
    NodeRejection,
    NodeState,
    Placement,
    PodShape,
    Shortfall,
)
from tessera.placement.policies import ClusterContext, PlacementPolicy
from tessera.placement.speed import SpeedProfiles

# GPU sets tried per node before giving up (only multi-container or multi-GPU pods come near it).
SEARCH_LIMIT = 2000


def model_allowed(model: str, allowed: Sequence[str], excluded: Sequence[str]) -> bool:
    lowered = model.lower()
    if allowed and not any(a.lower() in lowered for a in allowed):
        return False
    return not any(x.lower() in lowered for x in excluded)


def _allowed_by_model(node: NodeState, positions: Iterable[int], prefs: PodPreferences) -> dict[str, bool]:
    """:func:`model_allowed` for each model among the GPUs at ``positions``, decided once per model:
    a node has one or two models, and eight or so GPUs."""
    models = {node.gpus[i].model for i in positions}
    return {model: model_allowed(model, prefs.models, prefs.models_exclude) for model in models}


def eligible_gpus(node: NodeState, shape: PodShape, profiles: SpeedProfiles) -> list[int]:
    """Positions of the node's GPUs the pod may use at all (health, model, speed)."""
    prefs = shape.preferences
    healthy = node.healthy_positions
    if not prefs.models and not prefs.models_exclude and prefs.min_speed is None:
        return list(healthy)
    allowed = _allowed_by_model(node, healthy, prefs)
    if prefs.min_speed is not None:
        allowed = {
            model: ok and profiles.speed(model, prefs.workload) >= prefs.min_speed
            for model, ok in allowed.items()
        }
    return [i for i in healthy if allowed[node.gpus[i].model]]


def _fitting(
    gpus: Sequence[GpuState], positions: Iterable[int], container: ContainerShape, by_use: bool = False
) -> list[int]:
    """The ``positions`` (in their order) whose GPU can take one GPU of ``container`` now: a free
    slice, the compute and the memory (``container.memory_quota_on``, inlined: this runs per GPU tried);
    ``by_use``: a free slice and the memory against the GPU's measured use (:mod:`.usage`)."""
    cores = container.cores_needed
    memory = container.memory_quota_mib
    if by_use:
        return [
            i
            for i in positions
            if (gpu := gpus[i]).free_slices >= 1
            and gpu.measured_mib is not None
            and gpu.measured_mib + (gpu.total_memory_mib if memory is None else memory)
            <= gpu.total_memory_mib
        ]
    return [
        i
        for i in positions
        if (gpu := gpus[i]).free_slices >= 1
        and gpu.free_cores >= cores
        and gpu.free_memory_mib >= (gpu.total_memory_mib if memory is None else memory)
    ]


def gpu_takes(gpu: GpuState, container: ContainerShape) -> bool:
    """Whether ``gpu`` can take one GPU of ``container`` now (the rule of :func:`_fitting`)."""
    return bool(_fitting((gpu,), (0,), container))


def headroom_mib(gpu: GpuState) -> int:
    """What the GPU's measured use (with the margin and the grants placed since) leaves; 0 when
    it has no fresh measurement."""
    return 0 if gpu.measured_mib is None else max(0, gpu.total_memory_mib - gpu.measured_mib)


def _use_key(gpu: GpuState, container: ContainerShape) -> tuple[float, ...]:
    """The order of GPUs for a placement against measured use: the most headroom left after it first
    (the least likely to need its memory back), then the lowest index."""
    return (-(headroom_mib(gpu) - container.memory_quota_on(gpu)) / gpu.total_memory_mib, gpu.index)


def _islands(node: NodeState, positions: Sequence[int]) -> list[list[int]]:
    """Groups of ``positions`` (kept in their order) that share an NVLink island, then a NUMA node."""
    by_uuid = {node.gpus[i].uuid: i for i in positions}
    seen: set[int] = set()
    groups: list[list[int]] = []
    for start in positions:
        if start in seen or not node.gpus[start].nvlink_peers:
            continue
        island = {start}
        frontier = [start]
        while frontier:
            for peer in node.gpus[frontier.pop()].nvlink_peers:
                j = by_uuid.get(peer)
                if j is not None and j not in island:
                    island.add(j)
                    frontier.append(j)
        seen |= island
        groups.append([i for i in positions if i in island])
    numa: dict[int, list[int]] = {}
    for i in positions:
        domain = node.gpus[i].numa
        if domain is not None:
            numa.setdefault(domain, []).append(i)
    groups.extend(numa.values())
    return groups


def _gpu_sets(node: NodeState, ranked: list[int], count: int) -> Iterator[tuple[int, ...]]:
    """Sets of ``count`` GPUs from ``ranked`` (best first), topology-local sets first, no repeats."""
    if count == 1:
        for i in ranked:
            yield (i,)
        return
    tried: set[tuple[int, ...]] = set()
    for group in _islands(node, ranked):
        if len(group) >= count:
            chosen = tuple(group[:count])
            if chosen not in tried:
                tried.add(chosen)
                yield chosen
    for chosen in combinations(ranked, count):
        if chosen not in tried:
            yield chosen


def find_placement(
    node: NodeState,
    shape: PodShape,
    eligible: Sequence[int],
    policy: PlacementPolicy,
    context: ClusterContext,
    *,
    pinned: Mapping[int, Sequence[int]] | None = None,
    by_use: bool = False,
) -> Placement | None:
    """The placement the policy prefers among those that fit, or None. ``pinned`` limits containers
    (by index in the shape) to some GPU positions (see :mod:`.inflight`); ``by_use``: against the
    GPUs' measured use, every grant oversubscribed (:mod:`.usage`)."""
    if pinned is None and len(shape.containers) == 1:
        return _place_one_container(node, shape.containers[0], eligible, policy, context, by_use=by_use)
    gpus = list(node.gpus)
    order = sorted(
        range(len(shape.containers)),
        key=lambda i: (
            -shape.containers[i].gpu_count,
            -(shape.containers[i].memory_quota_mib or 1 << 40),
            -shape.containers[i].cores_needed,
        ),
    )
    chosen: list[tuple[Grant, ...]] = [() for _ in shape.containers]
    budget = SEARCH_LIMIT

    def place(step: int) -> bool:
        nonlocal budget
        if step == len(order):
            return True
        container = shape.containers[order[step]]
        if pinned is not None and order[step] in pinned:
            candidates = _fitting(gpus, [i for i in pinned[order[step]] if i in eligible], container, by_use)
        else:
            candidates = _fitting(gpus, eligible, container, by_use)
        if len(candidates) < container.gpu_count:
            return False
        if by_use:
            candidates.sort(key=lambda i: _use_key(gpus[i], container))
        else:
            candidates.sort(key=lambda i: policy.gpu_key(gpus[i], container, context))
        for gpu_set in _gpu_sets(node, candidates, container.gpu_count):
            if budget <= 0:
                return False
            budget -= 1
            grants = tuple(
                Grant(i, container.memory_quota_on(gpus[i]), container.cores_needed, by_use) for i in gpu_set
            )
            before = [gpus[g.gpu] for g in grants]
            for g in grants:
                gpus[g.gpu] = gpus[g.gpu].with_use(g.memory_quota_mib, g.cores, 1, by_use)
            chosen[order[step]] = grants
            if place(step + 1):
                return True
            for g, gpu in zip(grants, before, strict=True):
                gpus[g.gpu] = gpu
        return False

    if not place(0):
        return None
    return Placement(node=node.name, containers=tuple(chosen))


def _place_one_container(
    node: NodeState,
    container: ContainerShape,
    eligible: Sequence[int],
    policy: PlacementPolicy,
    context: ClusterContext,
    *,
    by_use: bool,
) -> Placement | None:
    """:func:`find_placement` for the common pod of one container, without the search: with no
    container placed after it, the search keeps the first GPU set it tries, and this is that set."""
    gpus = node.gpus
    candidates = _fitting(gpus, eligible, container, by_use)
    if len(candidates) < container.gpu_count:
        return None
    # The policy's keys in one C-level pass (map), not a lambda call per GPU.
    keys: list[tuple[float, ...]] = (
        [_use_key(gpus[i], container) for i in candidates]
        if by_use
        else list(map(policy.gpu_key, map(gpus.__getitem__, candidates), repeat(container), repeat(context)))
    )
    if container.gpu_count == 1:
        # The first of the smallest keys: what the stable sort would put first, without sorting.
        gpu_set: tuple[int, ...] = (candidates[keys.index(min(keys))],)
    else:
        ranked = [candidates[k] for k in sorted(range(len(keys)), key=keys.__getitem__)]
        gpu_set = next(_gpu_sets(node, ranked, container.gpu_count))
    grants = tuple(
        Grant(i, container.memory_quota_on(gpus[i]), container.cores_needed, by_use) for i in gpu_set
    )
    return Placement(node=node.name, containers=(grants,))


def filter_node(
    node: NodeState,
    shape: PodShape,
    profiles: SpeedProfiles,
    policy: PlacementPolicy,
    context: ClusterContext,
) -> NodeOutcome:
    """Whether and how the pod fits on ``node``: a :class:`NodeFit` with the policy's placement and
    score, or a :class:`NodeRejection` naming the shortfall."""
    if not node.schedulable:
        return NodeRejection(
            node.name, node.unschedulable_reason or "node is not schedulable", Shortfall.NODE
        )
    host = _host_shortfall(node, shape)
    if host is not None:
        return NodeRejection(node.name, host, Shortfall.HOST)
    eligible = eligible_gpus(node, shape, profiles)
    placement = find_placement(node, shape, eligible, policy, context) if eligible else None
    if placement is None and eligible and shape.qos == QosClass.BEST_EFFORT:
        placement = find_placement(node, shape, eligible, policy, context, by_use=True)
    if placement is None:
        return explain_rejection(node, shape, eligible, profiles)
    return make_fit(node, shape, placement, profiles=profiles, policy=policy, context=context)


def make_fit(
    node: NodeState,
    shape: PodShape,
    placement: Placement,
    *,
    profiles: SpeedProfiles,
    policy: PlacementPolicy,
    context: ClusterContext,
) -> NodeFit:
    """The fit of ``placement`` with its policy score and speed gain. A placement against measured
    use scores by the headroom it leaves (:func:`use_score`), not by the policy: requests say
    nothing of a GPU full by requests."""
    workload = shape.preferences.workload
    # Without a workload profile every gain is 1.0, and so is their minimum. A pod asking no GPU
    # (the simulator places CPU-only trace pods on GPU nodes) has no speed gain either.
    gain = (
        min((profiles.gain(node.gpus[g.gpu].model, workload) for g in placement.grants()), default=1.0)
        if profiles.has_workload(workload)
        else 1.0
    )
    score = (
        use_score(node, placement)
        if placement.oversubscribed
        else policy.score(node, placement, shape, context)
    )
    return NodeFit(node, placement, score, gain)


def use_score(node: NodeState, placement: Placement) -> float:
    """0..1: the smallest share of a chosen GPU's memory that its measured use leaves after the
    placement (the node least likely to need the memory back scores highest)."""
    taken: dict[int, int] = {}
    for grant in placement.grants():
        taken[grant.gpu] = taken.get(grant.gpu, 0) + grant.memory_quota_mib
    return min(
        (
            max(0, headroom_mib(node.gpus[i]) - memory) / node.gpus[i].total_memory_mib
            for i, memory in taken.items()
        ),
        default=0.0,
    )


def _host_shortfall(node: NodeState, shape: PodShape) -> str | None:
    if node.cpu_milli is not None and node.cpu_milli - node.used_cpu_milli < shape.cpu_milli:
        return f"not enough CPU: {node.cpu_milli - node.used_cpu_milli}m free, {shape.cpu_milli}m asked"
    if (
        node.host_memory_mib is not None
        and node.host_memory_mib - node.used_host_memory_mib < shape.host_memory_mib
    ):
        free = node.host_memory_mib - node.used_host_memory_mib
        return f"not enough host memory: {free} MiB free, {shape.host_memory_mib} MiB asked"
    return None


# --------------------------------------------------------------------------------------------------
# Why not: the first shortfall, in the order eligibility, capacity, current use.


def explain_rejection(
    node: NodeState, shape: PodShape, eligible: Sequence[int], profiles: SpeedProfiles
) -> NodeRejection:
    """The rejection of a pod that found no placement on ``node`` (for a best-effort pod, neither
    by requests nor against measured use: the reason says what measured use leaves)."""
    ineligible = _ineligibility(node, shape, eligible, profiles)
    if ineligible is not None:
        return NodeRejection(node.name, *ineligible)
    several = len(shape.containers) > 1
    by_use = _by_use_shortfall(node, eligible) if shape.qos == QosClass.BEST_EFFORT else ""
    for container in shape.containers:
        found = _container_shortfall(node, container, eligible)
        if found is not None:
            reason, shortfall = found
            return NodeRejection(
                node.name,
                f"{container.describe()}: {reason}{by_use}" if several else f"{reason}{by_use}",
                shortfall,
            )
    wanted = " + ".join(c.describe() for c in shape.containers)
    return NodeRejection(
        node.name, f"the containers fit one by one but not together ({wanted}){by_use}", Shortfall.TOGETHER
    )


def _by_use_shortfall(node: NodeState, eligible: Sequence[int]) -> str:
    """What measured use leaves on the eligible GPUs, for a best-effort pod's rejection."""
    measured = [node.gpus[i] for i in eligible if node.gpus[i].measured_mib is not None]
    if not measured:
        return "; no fresh measured use to place a best-effort pod against"
    most = max(headroom_mib(g) for g in measured)
    return f"; against measured use (with the safety margin) largest headroom {most} MiB"


def _models(node: NodeState, positions: Sequence[int]) -> str:
    counts: dict[str, int] = {}
    for i in positions:
        counts[node.gpus[i].model] = counts.get(node.gpus[i].model, 0) + 1
    return ", ".join(f"{model} x{n}" for model, n in sorted(counts.items()))


def _ineligibility(
    node: NodeState, shape: PodShape, eligible: Sequence[int], profiles: SpeedProfiles
) -> tuple[str, Shortfall] | None:
    needed = max(c.gpu_count for c in shape.containers)
    if len(eligible) >= needed:
        return None
    if not node.gpus:
        return "no GPUs in the node's inventory", Shortfall.NODE
    healthy = node.healthy_positions
    if not healthy:
        return f"all {len(node.gpus)} GPUs are unhealthy", Shortfall.HEALTH
    prefs = shape.preferences
    allowed_model = _allowed_by_model(node, healthy, prefs)
    allowed = [i for i in healthy if allowed_model[node.gpus[i].model]]
    if len(allowed) < needed and (prefs.models or prefs.models_exclude):
        wanted = []
        if prefs.models:
            wanted.append(f"models {', '.join(prefs.models)}")
        if prefs.models_exclude:
            wanted.append(f"excluding {', '.join(prefs.models_exclude)}")
        have = f"{len(allowed)} such healthy GPUs" if allowed else "no such healthy GPU"
        return f"{have} ({' '.join(wanted)}); node has {_models(node, healthy)}", Shortfall.MODEL
    if prefs.min_speed is not None and len(eligible) < needed:
        workload = f" for workload {prefs.workload!r}" if prefs.workload else ""
        models = {node.gpus[i].model for i in allowed}
        speeds = ", ".join(sorted(f"{model} {profiles.speed(model, prefs.workload):g}" for model in models))
        have = f"only {len(eligible)} GPUs" if eligible else "no GPU"
        return f"{have} with speed >= {prefs.min_speed:g}{workload}; node has {speeds}", Shortfall.SPEED
    if len(healthy) < len(node.gpus):
        return (
            f"only {len(healthy)} healthy GPUs (of {len(node.gpus)}); a container needs {needed}",
            Shortfall.HEALTH,
        )
    return f"only {len(healthy)} GPUs; a container needs {needed}", Shortfall.CAPACITY


def _count(n: int) -> str:
    return "no GPU" if n == 0 else f"only {n} GPU{'s' if n > 1 else ''}"


def _container_shortfall(
    node: NodeState, container: ContainerShape, eligible: Sequence[int]
) -> tuple[str, Shortfall] | None:
    k = container.gpu_count
    need = "" if k == 1 else f"; {k} needed"
    gpus = [node.gpus[i] for i in eligible]
    whole = container.memory_quota_mib is None
    if not whole:
        big = [g for g in gpus if g.total_memory_mib >= container.memory_quota_on(g)]
        if len(big) < k:
            largest = max(g.total_memory_mib for g in gpus)
            return (
                f"{_count(len(big))} with {container.memory_quota_mib} MiB of memory{need}; "
                f"largest has {largest} MiB",
                Shortfall.CAPACITY,
            )
    with_memory = [g for g in gpus if g.free_memory_mib >= container.memory_quota_on(g)]
    if len(with_memory) < k:
        largest_free = max(g.free_memory_mib for g in gpus)
        what = "all memory free" if whole else f"{container.memory_quota_mib} MiB free"
        return (
            f"{_count(len(with_memory))} with {what}{need}; largest free {largest_free} MiB",
            Shortfall.MEMORY,
        )
    with_cores = [g for g in with_memory if g.free_cores >= container.cores_needed]
    if len(with_cores) < k:
        most = max(g.free_cores for g in with_memory)
        return (
            f"{_count(len(with_cores))} with {container.cores}% compute free (of {MAX_CORES}) among those "
            f"with the memory{need}; most free {most}%",
            Shortfall.COMPUTE,
        )
    with_slice = [g for g in with_cores if g.free_slices >= 1]
    if len(with_slice) < k:
        return (
            f"{_count(len(with_slice))} with a free slice among those with the memory and compute{need} "
            f"(all {sum(g.slices for g in with_cores)} slices in use)",
            Shortfall.SLICES,
        )
    return None
