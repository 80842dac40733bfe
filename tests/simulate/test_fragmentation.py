"""The FGD policy: its fragmentation measure, its choices through the placement core, its score."""

from __future__ import annotations

import math
from dataclasses import replace

import pytest

from simulator.scheduler import SIM_POLICIES, PaperFgd
from tessera.contract import PodPreferences, Policy
from tessera.placement import (
    POLICIES,
    ClusterContext,
    ContainerShape,
    GpuState,
    NodeState,
    PlacementEngine,
    PodShape,
    ShapeMix,
    SpeedProfiles,
    choose,
)
from tessera.placement.fragmentation import (
    Fragmentation,
    TargetShape,
    cpu_per_gpu,
    free_share,
    node_fragmentation,
    stranded_share,
    target_workload,
)

HALF = ContainerShape(1, 8192, 50)
WHOLE = ContainerShape(1, None, 100)


def gpu(index: int, used_cores: int = 0, model: str = "V100", memory: int = 16384) -> GpuState:
    return GpuState(
        uuid=f"gpu-{index}",
        index=index,
        model=model,
        total_memory_mib=memory,
        slices=10,
        used_cores=used_cores,
        used_memory_mib=memory * used_cores // 100,
        used_slices=1 if used_cores else 0,
    )


def node(name: str, *gpus: GpuState, cpu: int | None = 64000, used_cpu: int = 0) -> NodeState:
    return NodeState(
        name, gpus, cpu_milli=cpu, host_memory_mib=None if cpu is None else 1 << 20, used_cpu_milli=used_cpu
    )


def pod(container: ContainerShape | None, cpu: int = 1000, models: tuple[str, ...] = ()) -> PodShape:
    return PodShape((container,) if container else (), PodPreferences(models=models), cpu, 1024)


def mix(counts: dict[PodShape, int]) -> ShapeMix:
    shapes = ShapeMix(window=sum(counts.values()))
    for shape, n in counts.items():
        for _ in range(n):
            shapes.record(shape)
    return shapes


def test_in_the_product_table_and_the_paper_baseline_in_the_simulator_only() -> None:
    assert isinstance(POLICIES[Policy.FRAGMENTATION], Fragmentation)
    assert SIM_POLICIES["fragmentation"] is POLICIES[Policy.FRAGMENTATION]
    assert isinstance(SIM_POLICIES["fgd-paper"], PaperFgd)
    assert "fgd-paper" not in {policy.value for policy in POLICIES}


def test_target_workload_keeps_the_shapes_covering_95_percent() -> None:
    a, b, c, d = pod(HALF), pod(WHOLE), pod(None, cpu=4000), pod(ContainerShape(1, 4096, 25))
    targets = target_workload(mix({a: 50, b: 30, c: 15, d: 5}))
    assert [t.containers for t in targets] == [(HALF,), (WHOLE,), ()]
    assert [t.weight for t in targets] == [round(50 / 95, 3), round(30 / 95, 3), round(15 / 95, 3)]
    # Host memory is no part of a shape: pods differing only in it count together.
    merged = target_workload(mix({a: 1, replace(a, host_memory_mib=2048): 1}))
    assert len(merged) == 1 and merged[0].weight == 1.0


def test_node_fragmentation_counts_what_each_shape_cannot_use() -> None:
    half = TargetShape((HALF,), (), (), 1000, 0.5)
    whole = TargetShape((WHOLE,), (), (), 1000, 0.5)
    partly_used = node("n", gpu(0, used_cores=60), gpu(1))
    # The half shape cannot use GPU 0's 40%; the whole shape cannot either; both can use GPU 1.
    assert node_fragmentation(partly_used, (half, whole)) == pytest.approx(40)
    # A shape asking no GPU leaves all idle GPU capacity a fragment.
    assert node_fragmentation(partly_used, (TargetShape((), (), (), 1000, 1.0),)) == pytest.approx(140)
    # Without the host CPU a shape needs, nothing on the node is usable by it.
    starved = node("n", gpu(0, used_cores=60), gpu(1), cpu=64000, used_cpu=63500)
    assert node_fragmentation(starved, (half,)) == pytest.approx(140 * 0.5)
    # A shape bound to another GPU model cannot use any of these GPUs.
    t4_only = TargetShape((HALF,), ("T4",), (), 1000, 1.0)
    assert node_fragmentation(partly_used, (t4_only,)) == pytest.approx(140)
    # A 2-GPU shape needs two GPUs that each take one of its GPUs.
    pair = TargetShape((ContainerShape(2, None, 100),), (), (), 1000, 1.0)
    assert node_fragmentation(partly_used, (pair,)) == pytest.approx(140)
    assert node_fragmentation(node("n", gpu(0), gpu(1)), (pair,)) == 0


def test_each_context_is_judged_against_its_own_mix() -> None:
    """One policy object serves every engine of a process: two mixes at the same version but with
    other shapes must not share the targets derived from the first."""
    policy = Fragmentation()
    partly_used = node("n", gpu(0, used_cores=60), gpu(1))
    halves = ClusterContext(mix({pod(HALF): 1}), learns=False)
    no_gpu = ClusterContext(mix({pod(None, cpu=4000): 1}), learns=False)
    assert halves.version == no_gpu.version
    assert policy.fragmentation(partly_used, halves) == pytest.approx(40)
    assert policy.fragmentation(partly_used, no_gpu) == pytest.approx(140)
    assert policy.fragmentation(partly_used, halves) == pytest.approx(40)


def test_free_share_is_the_smaller_of_compute_and_memory() -> None:
    memory_bound = replace(gpu(0), used_memory_mib=16384 * 90 // 100, used_slices=1)
    assert free_share(memory_bound) == 10
    assert free_share(gpu(0, used_cores=30)) == 70
    assert free_share(replace(gpu(0), healthy=False)) == 0


def engine_with(*nodes: NodeState, counts: dict[PodShape, int]) -> PlacementEngine:
    engine = PlacementEngine(SpeedProfiles(), "fragmentation", ClusterContext(mix(counts)))
    for n in nodes:
        engine.set_node(n)
    return engine


def test_fills_the_gpu_a_pod_completes_and_keeps_whole_gpus_free() -> None:
    forty = pod(ContainerShape(1, 6553, 40))
    counts = {forty: 5, pod(WHOLE): 5}
    engine = engine_with(node("a", gpu(0), gpu(1, used_cores=60), gpu(2)), counts=counts)
    best = choose(engine.evaluate(forty).fits)
    assert best is not None
    assert [g.gpu for g in best.placement.grants()] == [1]
    spread = PlacementEngine(SpeedProfiles(), "spread")
    spread.set_node(engine.nodes["a"])
    other = choose(spread.evaluate(forty).fits)
    assert other is not None and [g.gpu for g in other.placement.grants()] != [1]


def test_prefers_the_node_where_the_pod_fragments_least() -> None:
    half = pod(HALF)
    counts = {half: 5, pod(WHOLE): 5}
    shared = node("b-shared", gpu(0, used_cores=50), gpu(1))
    empty = node("a-empty", gpu(0), gpu(1))
    engine = engine_with(empty, shared, counts=counts)
    best = choose(engine.evaluate(half).fits)
    assert best is not None and best.name == "b-shared"


def test_score_is_the_papers_truncated_sigmoid() -> None:
    policy = PaperFgd()
    half, forty = pod(HALF), pod(ContainerShape(1, 6553, 40))
    context = ClusterContext(mix({half: 1}))
    before = node("n", gpu(0, used_cores=60))
    engine = engine_with(before, counts={half: 1})
    fit = engine.evaluate(forty).fits[0]
    # The 40% left cannot take the half shape (a fragment of 40% = 400 milli); filling it removes it.
    assert (
        policy.score(before, fit.placement, forty, context) == int(100 / (1 + math.exp(-0.4))) / 100 == 0.59
    )
    # Nothing changes for the target workload: sigmoid(0) = 0.5.
    other = engine_with(node("m", gpu(0, used_cores=50)), counts={half: 1})
    fit = other.evaluate(half).fits[0]
    assert policy.score(other.nodes["m"], fit.placement, half, context) == 0.5


def test_the_tie_break_stays_below_one_step_of_the_papers_score() -> None:
    half, forty = pod(HALF), pod(ContainerShape(1, 6553, 40))
    context = ClusterContext(mix({half: 1}))
    engine = engine_with(node("n", gpu(0, used_cores=60)), counts={half: 1})
    fit = engine.evaluate(forty).fits[0]
    paper = PaperFgd().score(engine.nodes["n"], fit.placement, forty, context)
    broken = Fragmentation().score(engine.nodes["n"], fit.placement, forty, context)
    assert paper == 0.59 and paper < broken < paper + 0.01


def test_cpu_per_gpu_is_the_targets_cpu_over_their_gpu_requests() -> None:
    whole = TargetShape((WHOLE,), (), (), 10000, 0.5)
    cpu_only = TargetShape((), (), (), 10000, 0.5)
    # 10 vCPU per pod, half the pods ask a whole GPU: 20 vCPU per GPU = 200 milli-CPU per percent.
    assert cpu_per_gpu((whole, cpu_only)) == pytest.approx(200)
    # A whole GPU asked without a compute share counts as one GPU too.
    assert cpu_per_gpu((TargetShape((ContainerShape(2, None, None),), (), (), 8000, 1.0),)) == 40
    assert cpu_per_gpu((cpu_only,)) is None


def test_stranded_share_is_idle_capacity_the_free_cpu_cannot_feed() -> None:
    # 140% idle; 10 vCPU free feed 100% at 100 milli-CPU per percent.
    assert stranded_share(node("n", gpu(0, used_cores=60), gpu(1), cpu=64000, used_cpu=54000), 100) == 40
    assert stranded_share(node("n", gpu(0), cpu=64000), 100) == 0
    assert stranded_share(node("n", gpu(0), cpu=None), 100) == 0


def test_ties_go_where_the_cpu_still_feeds_the_idle_gpus() -> None:
    # 20 vCPU per GPU in the target. A CPU-only pod changes no shape's fit on either node (a tie for
    # the paper's score); on the GPU-heavy node it leaves half a GPU without the CPU to use it.
    whole, cpu_only = pod(WHOLE, cpu=10000), pod(None, cpu=10000)
    gpu_heavy = node("a-gpu-heavy", gpu(0), gpu(1), cpu=40000)
    cpu_rich = node("b-cpu-rich", gpu(0), gpu(1), cpu=100000)
    counts = {whole: 1, cpu_only: 1}
    paper = PlacementEngine(SpeedProfiles(), SIM_POLICIES["fgd-paper"], ClusterContext(mix(counts)))
    for n in (gpu_heavy, cpu_rich):
        paper.set_node(n)
    fits = paper.evaluate(cpu_only).fits
    assert {f.policy_score for f in fits} == {0.5}
    assert (best := choose(fits)) is not None and best.name == "a-gpu-heavy"
    best = choose(engine_with(gpu_heavy, cpu_rich, counts=counts).evaluate(cpu_only).fits)
    assert best is not None and best.name == "b-cpu-rich"


def test_ties_without_stranding_go_to_a_node_in_use() -> None:
    # A whole-GPU pod fragments neither node; the empty node stays whole for bigger pods.
    whole = pod(WHOLE)
    empty, used = node("a-empty", gpu(0), gpu(1)), node("b-used", gpu(0, used_cores=100), gpu(1))
    best = choose(engine_with(empty, used, counts={whole: 1}).evaluate(whole).fits)
    assert best is not None and best.name == "b-used"
