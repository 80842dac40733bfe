"""The ``fragmentation`` policy: Fragmentation Gradient Descent (FGD; Weng et al., "Beware of
Fragmentation", USENIX ATC '23).

FGD places a pod where it raises the cluster's *expected fragmentation* least. Fragmentation is
measured against a target workload: the mix of pod shapes the cluster expects (here the context's
shape mix, cut to the most frequent shapes covering ``COVERAGE`` of pods, as the paper's simulator
does). For a node and a target shape, the fragment is the free GPU capacity that shape could not use:

* the whole free capacity, when the shape cannot run on the node at all (no GPU of an allowed model
  takes it, too few such GPUs, too little host CPU) or asks no GPU;
* otherwise the free capacity of the GPUs that cannot take one of its GPUs.

A node's fragmentation is the shape-weighted sum; the policy scores a placement by how much it
lowers it: ``int(100 * sigmoid((F_before - F_after) / 1000)) / 100`` with F in thousandths of a GPU,
the paper's formula including its truncation to whole percents. The truncation matters: nodes within
about 4% of a GPU of the best tie. On the Alibaba trace, ranking by the exact value instead leaves
5.8% of GPUs unallocated at full load where the truncated score leaves 5.0% (seed 42). Inside a node,
GPUs are ordered by how much their own fragment grows.

Ties. The paper sends them to a random node (kube-scheduler's choice; the simulator's seeded node
order): that is the simulator's ``fgd-paper`` baseline (``breaks_ties = False``, in
``tools/simulator``). ``fragmentation`` breaks them instead, by a bonus smaller
than one score step (so it never overrides the paper's score), mostly by *CPU stranding*: the idle
GPU capacity a node's free CPU could no longer feed at the target workload's CPU per GPU (its CPU
requests over its GPU requests, CPU-only shapes included). FGD sees CPU only as a cliff (a shape's
CPU request fits or not), so among its ties it spends the CPU of GPU-heavy nodes on CPU-only pods and
CPU-hungry fractional pods, and GPUs end up idle beside an exhausted CPU (96 of the 297 GPUs left
at full load on the Alibaba trace, seed 42). A small share of the bonus prefers a node already in
use, which keeps empty nodes whole for multi-GPU pods when stranding does not decide. (The binpack
score in that role did as well on the plain trace but steered pods to small nodes, which on the
trace's model-bound variants are the rare models those pods need: it nearly doubled the GPUs left
unallocated there.) On the plain trace the tie-break cuts the GPUs left unallocated at full load
from 4.76% to about 4.24%; where a third of GPU demand is bound to GPU models (the gpuspec33
variant) it leaves about 1 point more than ``fgd-paper`` on two seeds of three (docs/benchmarks.md).

A GPU's free capacity is the smaller of its free compute and free memory, in percent of the GPU: a
GPU with 30% compute but 10% memory left can host only what fits in 10%. Memory, when it is the only
thing requested (memory-only sharing), then counts as it should.
"""

from __future__ import annotations

import functools
import math
from dataclasses import dataclass, replace

from tessera.contract import MAX_CORES
from tessera.placement.fit import model_allowed
from tessera.placement.model import ContainerShape, GpuState, NodeState, Placement, PodShape, ShapeMix, apply
from tessera.placement.policies import ClusterContext, PlacementPolicy

# Share of pods the target workload's most frequent shapes must cover (the paper's run config).
COVERAGE = 0.95
# Thousandths of a GPU per percent, to put F in the paper's unit for its sigmoid.
MILLI_PER_PERCENT = 10
SIGMOID_SCALE_MILLI = 1000
# The paper's score is int64(100 * sigmoid): whole percents.
SCORE_STEPS = 100
# Target weights are rounded to this many digits, so a slowly moving mix keeps its memoized values.
WEIGHT_DIGITS = 3
# Memoized fragmentation values kept before the memo is cleared.
MEMO_LIMIT = 200_000
# The tie-break bonus stays below one step of the paper's score (0.01), so it only orders ties.
TIE_BREAK_WEIGHT = 0.0099
# Share of the tie-break that prefers a node already in use; the rest rates the change in CPU stranding.
TIE_BREAK_IN_USE = 0.1
# Steepness of the stranding term: sigmoid(-slope x change in stranded GPUs).
STRANDING_SLOPE = 2.0


@dataclass(frozen=True, slots=True)
class TargetShape:
    """A pod shape of the target workload as FGD sees it (host memory plays no part) and its weight."""

    containers: tuple[ContainerShape, ...]
    models: tuple[str, ...]
    models_exclude: tuple[str, ...]
    cpu_milli: int
    weight: float


def target_workload(mix: ShapeMix) -> tuple[TargetShape, ...]:
    """The most frequent shapes of ``mix`` covering ``COVERAGE`` of its pods, weights summing to 1."""
    counts: dict[tuple[tuple[ContainerShape, ...], tuple[str, ...], tuple[str, ...], int], int] = {}
    for shape, n in mix.counts.items():
        prefs = shape.preferences
        key = (shape.containers, prefs.models, prefs.models_exclude, shape.cpu_milli)
        counts[key] = counts.get(key, 0) + n
    total = sum(counts.values())
    if not total:
        return ()
    kept: list[tuple[tuple[tuple[ContainerShape, ...], tuple[str, ...], tuple[str, ...], int], int]] = []
    covered = 0
    # Most frequent first; ties in first-seen order (dicts keep it), so the cut is deterministic.
    for key, n in sorted(counts.items(), key=lambda item: -item[1]):
        if covered >= COVERAGE * total:
            break
        kept.append((key, n))
        covered += n
    return tuple(
        TargetShape(containers, models, exclude, cpu, round(n / covered, WEIGHT_DIGITS))
        for (containers, models, exclude, cpu), n in kept
    )


def free_share(gpu: GpuState) -> int:
    """Percent of ``gpu`` still free: the smaller of free compute and free memory; 0 when unusable."""
    if not gpu.healthy or gpu.free_slices < 1:
        return 0
    return min(gpu.free_cores, gpu.free_memory_mib * MAX_CORES // gpu.total_memory_mib)


def _takes(gpu: GpuState, container: ContainerShape) -> bool:
    return (
        gpu.healthy
        and gpu.free_slices >= 1
        and gpu.free_cores >= container.cores_needed
        and gpu.free_memory_mib >= container.memory_quota_on(gpu)
    )


@functools.cache
def _allowed(model: str, models: tuple[str, ...], excluded: tuple[str, ...]) -> bool:
    # Memoized: the measure asks it for every GPU and target shape, over a handful of models.
    return model_allowed(model, models, excluded)


def _gpu_unusable(gpu: GpuState, target: TargetShape) -> bool:
    """Whether none of the target's containers could use this GPU (its free share is then a fragment)."""
    return not (
        target.containers
        and _allowed(gpu.model, target.models, target.models_exclude)
        and any(_takes(gpu, c) for c in target.containers)
    )


def node_fragmentation(node: NodeState, targets: tuple[TargetShape, ...]) -> float:
    """Expected fragment of ``node`` against the target workload, in percent of one GPU."""
    shares = [free_share(g) for g in node.gpus]
    idle = sum(shares)
    if not idle:
        return 0.0
    free_cpu = None if node.cpu_milli is None else node.cpu_milli - node.used_cpu_milli
    total = 0.0
    for target in targets:
        if not target.containers or (free_cpu is not None and free_cpu < target.cpu_milli):
            total += target.weight * idle
            continue
        allowed = [
            i for i, g in enumerate(node.gpus) if _allowed(g.model, target.models, target.models_exclude)
        ]
        useful: set[int] = set()
        runs = True
        for container in target.containers:
            takers = [i for i in allowed if _takes(node.gpus[i], container)]
            if len(takers) < container.gpu_count:
                runs = False
                break
            useful.update(takers)
        fragment = idle if not runs else sum(s for i, s in enumerate(shares) if i not in useful)
        total += target.weight * fragment
    return total


def cpu_per_gpu(targets: tuple[TargetShape, ...]) -> float | None:
    """The target workload's CPU requests over its GPU requests, in milli-CPU per percent of a GPU
    (a container without a compute share counts whole GPUs); None when the target asks no GPU."""
    gpu_percent = sum(
        t.weight * sum(c.gpu_count * (c.cores_needed or MAX_CORES) for c in t.containers) for t in targets
    )
    if not gpu_percent:
        return None
    return sum(t.weight * t.cpu_milli for t in targets) / gpu_percent


def stranded_share(node: NodeState, cpu_per_percent: float) -> float:
    """Idle GPU capacity of ``node`` (percent of a GPU) that its free CPU cannot feed at
    ``cpu_per_percent`` milli-CPU per percent; 0 on a node without host capacities."""
    if node.cpu_milli is None:
        return 0.0
    idle = sum(free_share(g) for g in node.gpus)
    return max(0.0, idle - (node.cpu_milli - node.used_cpu_milli) / cpu_per_percent)


def _gpu_signature(gpu: GpuState) -> tuple[str, int, int, bool, int, int, int]:
    return (
        gpu.model,
        gpu.total_memory_mib,
        gpu.slices,
        gpu.healthy,
        gpu.used_memory_mib,
        gpu.used_cores,
        gpu.used_slices,
    )


def _node_signature(node: NodeState) -> tuple[object, ...]:
    # GPU order inside a node does not change its fragmentation; nodes in equal states share a value.
    free_cpu = None if node.cpu_milli is None else node.cpu_milli - node.used_cpu_milli
    return (free_cpu, tuple(sorted(_gpu_signature(g) for g in node.gpus)))


class Fragmentation(PlacementPolicy):
    """FGD with its score ties broken by CPU stranding, then packing (see the module docstring)."""

    name = "fragmentation"
    uses_context = True
    # False: the paper's score alone, ties left to the node order (the simulator's fgd-paper).
    breaks_ties = True

    def __init__(self) -> None:
        # The mix (and its version) the targets were derived from: one policy object serves every
        # engine in a process (the extender's one, the simulator's several), and two mixes can be at
        # the same version with different shapes.
        self._mix: ShapeMix | None = None
        self._version = -1
        self._targets: tuple[TargetShape, ...] = ()
        self._cpu_per_gpu: float | None = None
        self._node_memo: dict[tuple[object, ...], float] = {}
        self._gpu_memo: dict[tuple[object, ...], float] = {}

    def _targets_for(self, context: ClusterContext) -> tuple[TargetShape, ...]:
        if context.shape_mix is not self._mix or context.version != self._version:
            self._mix = context.shape_mix
            self._version = context.version
            targets = target_workload(context.shape_mix)
            # A mix that moved by a pod or two usually keeps the same rounded target: memos stay.
            if targets != self._targets:
                self._targets = targets
                self._cpu_per_gpu = cpu_per_gpu(targets)
                self._clear_memos()
        if len(self._node_memo) + len(self._gpu_memo) > MEMO_LIMIT:
            self._clear_memos()
        return self._targets

    def _clear_memos(self) -> None:
        self._node_memo.clear()
        self._gpu_memo.clear()

    def fragmentation(self, node: NodeState, context: ClusterContext) -> float:
        """``node_fragmentation`` against the context's target workload, memoized per node state."""
        targets = self._targets_for(context)
        key = _node_signature(node)
        value = self._node_memo.get(key)
        if value is None:
            value = self._node_memo[key] = node_fragmentation(node, targets)
        return value

    def gpu_key(self, gpu: GpuState, container: ContainerShape, context: ClusterContext) -> tuple[float, ...]:
        """The growth of this GPU's own fragment if the container's share goes on it (least first)."""
        targets = self._targets_for(context)
        key = (_gpu_signature(gpu), container)
        growth = self._gpu_memo.get(key)
        if growth is None:
            after = replace(
                gpu,
                used_memory_mib=gpu.used_memory_mib + container.memory_quota_on(gpu),
                used_cores=gpu.used_cores + container.cores_needed,
                used_slices=gpu.used_slices + 1,
            )
            before_share, after_share = free_share(gpu), free_share(after)
            growth = self._gpu_memo[key] = sum(
                t.weight
                * (
                    (after_share if _gpu_unusable(after, t) else 0)
                    - (before_share if _gpu_unusable(gpu, t) else 0)
                )
                for t in targets
            )
        return (growth, gpu.index)

    def score(self, node: NodeState, placement: Placement, shape: PodShape, context: ClusterContext) -> float:
        after = apply(node, placement, shape)
        drop_milli = (
            self.fragmentation(node, context) - self.fragmentation(after, context)
        ) * MILLI_PER_PERCENT
        fgd = math.floor(SCORE_STEPS / (1 + math.exp(-drop_milli / SIGMOID_SCALE_MILLI))) / SCORE_STEPS
        if not self.breaks_ties:
            return fgd
        return fgd + TIE_BREAK_WEIGHT * self._tie_break(node, after)

    def _tie_break(self, node: NodeState, after: NodeState) -> float:
        """0..1, higher for less CPU stranding added (mostly) and for a node already in use (the rest)."""
        in_use = 1.0 if node.used_cpu_milli or any(g.used_slices for g in node.gpus) else 0.0
        per_percent = self._cpu_per_gpu
        if per_percent is None:
            return in_use
        # Stranded capacity in whole GPUs, so that the slope reads per GPU.
        added = (stranded_share(after, per_percent) - stranded_share(node, per_percent)) / MAX_CORES
        stranding = 1 / (1 + math.exp(STRANDING_SLOPE * added))
        return (1 - TIE_BREAK_IN_USE) * stranding + TIE_BREAK_IN_USE * in_use
