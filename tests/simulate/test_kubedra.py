"""The DRA path's model of kube-scheduler (simulator.kubedra) on small hand-made cases."""

from __future__ import annotations

import pytest

from simulator import kubedra
from simulator.experiment import Experiment, Options, run_system
from simulator.inputs import Inputs
from simulator.model import Cluster, SimNode, SimPod, Workload
from simulator.scheduler import SYSTEMS, KubeDraScheduler, make_scheduler, system_named
from tessera.contract import PodPreferences
from tessera.placement import ContainerShape, GpuState, NodeState, Placement, PodShape, SpeedProfiles

DRA = system_named("dra")


def gpu(index: int, used_cores: int = 0, model: str = "V100", memory: int = 16384) -> GpuState:
    return GpuState(
        uuid=f"gpu-{index}",
        index=index,
        model=model,
        total_memory_mib=memory,
        slices=memory,
        used_cores=used_cores,
        used_memory_mib=memory * used_cores // 100,
    )


def node(
    *gpus: GpuState, cpu: int = 64000, used_cpu: int = 0, memory: int = 262144, used_memory: int = 0
) -> NodeState:
    return NodeState(
        "n",
        gpus,
        cpu_milli=cpu,
        host_memory_mib=memory,
        used_cpu_milli=used_cpu,
        used_host_memory_mib=used_memory,
    )


def share(percent: int, gpus: int = 1, cpu: int = 1000, models: tuple[str, ...] = ()) -> PodShape:
    """A claim of ``gpus`` devices, each ``percent`` of a 16 GiB GPU's memory and compute."""
    return PodShape(
        (ContainerShape(gpus, 16384 * percent // 100, percent),), PodPreferences(models=models), cpu, 1024
    )


def devices(placement: Placement | None) -> list[int]:
    assert placement is not None
    return [g.gpu for g in placement.grants()]


def test_the_first_device_in_slice_order_that_fits() -> None:
    partly_used = node(gpu(0, used_cores=60), gpu(1), gpu(2))
    # 30% fits in GPU 0's 40% left: taken there, not on an empty GPU (no best fit, no spreading).
    assert devices(kubedra.allocate(partly_used, share(30))) == [0]
    # 50% does not: the next device in order.
    assert devices(kubedra.allocate(partly_used, share(50))) == [1]
    # A selector on the model skips the devices it refuses.
    mixed = node(gpu(0), gpu(1, model="T4", memory=15360))
    assert devices(kubedra.allocate(mixed, share(30, models=("T4",)))) == [1]
    assert kubedra.allocate(mixed, share(30, models=("A100",))) is None
    assert kubedra.allocate(node(gpu(0, used_cores=60), gpu(1, used_cores=80)), share(50)) is None


def test_a_fractional_claim_consumes_its_capacity_and_claims_add_up() -> None:
    scheduler = KubeDraScheduler(Cluster((SimNode("a", "V100", 2, 16384, 64000, 1 << 20),)), DRA, seed=1)
    pods = [SimPod(f"p{i}", 1000, 1024, 1, 300) for i in range(7)]
    fits = [scheduler.place(p) for p in pods]
    # Three 30% claims fill GPU 0 to 90%, the fourth goes to GPU 1, ...: six fit, the seventh does not.
    assert [devices(f.placement) if f else None for f in fits] == [[0], [0], [0], [1], [1], [1], None]
    first = scheduler.nodes[0].gpus[0]
    assert (first.used_cores, first.used_memory_mib) == (90, 3 * (300 * 16384 // 1000))
    assert fits[0] is not None
    scheduler.remove(pods[0], fits[0])
    assert scheduler.nodes[0].gpus[0].used_cores == 60
    assert scheduler.fits(scheduler.shape(pods[6]), scheduler.nodes[0].name)


def test_a_multi_device_claim_takes_distinct_devices_in_order() -> None:
    partly_used = node(gpu(0, used_cores=60), gpu(1), gpu(2), gpu(3))
    whole = PodShape((ContainerShape(2, None, 100),), PodPreferences(), 1000, 1024)
    assert devices(kubedra.allocate(partly_used, whole)) == [1, 2]
    # Two 30% devices of one claim do not both land on GPU 0, though its 40% left would take them.
    assert devices(kubedra.allocate(partly_used, share(30, gpus=2))) == [0, 1]
    placement = kubedra.allocate(partly_used, whole)
    assert placement is not None and [g.memory_quota_mib for g in placement.grants()] == [16384, 16384]
    assert kubedra.allocate(node(gpu(0), gpu(1, used_cores=10)), whole) is None


def test_host_cpu_and_memory_filter_the_node() -> None:
    assert kubedra.host_fits(node(gpu(0), cpu=4000, used_cpu=3000), share(30, cpu=1000))
    assert not kubedra.host_fits(node(gpu(0), cpu=4000, used_cpu=3500), share(30, cpu=1000))
    assert not kubedra.host_fits(node(gpu(0), memory=2048, used_memory=1500), share(30))


def test_least_allocated_and_balanced_allocation_scores() -> None:
    shape = share(30, cpu=8000)  # 8 vCPU, 1 GiB
    empty = node(gpu(0), cpu=64000, memory=65536)
    # LeastAllocated: CPU (64 - 8) / 64 -> 87, memory (64 - 1) / 64 GiB -> 98; mean 92 (integers).
    assert kubedra.least_allocated(empty, (0, 0), shape) == (87 + 98) // 2 == 92
    # BalancedAllocation scores the change in balance: with the pod the fractions are 0.125 and
    # 1/64 (1 - their half difference: 94), without it 0 and 0 (100); 50 + (50 + 94 - 100) / 2.
    assert int((1 - (0.125 - 1 / 64) / 2) * 100) == 94
    assert kubedra.balanced_allocation(empty, shape) == 50 + (50 + 94 - 100) // 2 == 72
    assert kubedra.node_score(empty, (0, 0), shape) == 92 + 72
    # A pod that evens a CPU-heavy node out scores above 75: fractions 0.5 / 0 (75) become
    # 33/64 / 0.25 (86).
    cpu_heavy = node(gpu(0), cpu=64000, used_cpu=32000, memory=65536)
    memory_heavy = PodShape((ContainerShape(1, 1024, 10),), PodPreferences(), 1000, 16384)
    assert kubedra.balanced_allocation(cpu_heavy, memory_heavy) == 50 + (50 + 86 - 75) // 2 == 80
    # A pod without requests counts at 100m CPU and 200 MiB for LeastAllocated and is not balanced.
    nothing = PodShape((ContainerShape(1, 1024, 10),))
    assert kubedra.nonzero_request(nothing) == (100, 200)
    assert kubedra.balanced_allocation(empty, nothing) == 0


def test_how_many_feasible_nodes_the_search_looks_for() -> None:
    assert kubedra.nodes_to_find(50) == 50
    assert kubedra.nodes_to_find(123) == 100  # 50% is 61, below the floor of 100
    assert kubedra.nodes_to_find(1213) == 1213 * 41 // 100 == 497  # the Alibaba trace's GPU nodes
    assert kubedra.nodes_to_find(10000) == 500  # 5% at the least
    assert kubedra.nodes_to_find(1213, percentage=100) == 1213


def small_cluster(*cpus: int) -> Cluster:
    return Cluster(tuple(SimNode(f"n{i}", "V100", 2, 16384, cpu, 1 << 20) for i, cpu in enumerate(cpus)))


def test_least_allocated_picks_the_node_with_most_left() -> None:
    # Both nodes hold one pod of 4 vCPU; the node with 64 vCPU has more left than the one with 16.
    scheduler = KubeDraScheduler(small_cluster(16000, 64000), DRA, seed=3)
    big = next(n.name for n in scheduler.nodes if n.name.endswith("-n1"))
    fit = scheduler.place(SimPod("p", 4000, 1024, 1, 300))
    assert fit is not None and fit.name == big
    # Device use does not count: the next pod goes to the same node although its GPU is shared.
    again = scheduler.place(SimPod("q", 4000, 1024, 1, 300))
    assert again is not None and again.name == big and devices(again.placement) == [0]


def test_ties_go_to_a_seeded_random_node() -> None:
    pod = SimPod("p", 1000, 1024, 1, 300)
    chosen = set()
    for seed in range(12):
        first = KubeDraScheduler(small_cluster(64000, 64000, 64000), DRA, seed=seed).place(pod)
        second = KubeDraScheduler(small_cluster(64000, 64000, 64000), DRA, seed=seed).place(pod)
        assert first is not None and second is not None and first.name == second.name
        chosen.add(first.name.split("-", 1)[1])
    assert chosen == {"n0", "n1", "n2"}


def test_the_search_stops_at_enough_feasible_nodes_and_resumes_there() -> None:
    # 120 nodes: kube-scheduler looks for 100 feasible ones, so the first pod never sees the last 20
    # nodes of the order, and the second pod's search starts with them.
    nodes = small_cluster(*[64000] * 120)
    for seed in range(5):
        scheduler = KubeDraScheduler(nodes, DRA, seed=seed)
        order = [n.name for n in scheduler.nodes]
        first = scheduler.place(SimPod("p", 1000, 1024, 1, 300))
        assert first is not None and order.index(first.name) < 100
        # The second pod's search sees the 20 untouched nodes first; they score above the used one.
        second = scheduler.place(SimPod("q", 1000, 1024, 1, 300))
        assert second is not None and second.name != first.name


def test_the_dra_system_runs_in_both_experiments() -> None:
    cluster = small_cluster(64000, 64000)
    pods = Workload(tuple(SimPod(f"p{i}", 1000, 1024, 1, 500, arrival=i, duration=100.0) for i in range(8)))
    assert isinstance(make_scheduler(cluster, DRA, SpeedProfiles(), pods.pods, 1), KubeDraScheduler)
    options = Options(("dra",), (Experiment.PACKING, Experiment.TIME), seed=1, inflation=1.0)
    result = run_system(Inputs(cluster, pods, "test"), DRA, options, SpeedProfiles())
    assert result.packing is not None and result.packing.placed == 8
    assert result.time is not None and result.time.finished == 8


MOST = kubedra.Scoring.MOST_ALLOCATED
RATIO = kubedra.Scoring.REQUESTED_TO_CAPACITY_RATIO


def test_most_allocated_and_requested_to_capacity_ratio_scores() -> None:
    shape = share(30, cpu=8000)  # 8 vCPU, 1 GiB
    empty = node(gpu(0), cpu=64000, memory=65536)
    # MostAllocated: CPU 8 / 64 -> 12, memory 1 / 64 GiB -> 1; mean 6 (integers).
    assert kubedra.fit_score(empty, (0, 0), shape, MOST) == (12 + 1) // 2 == 6
    # RequestedToCapacityRatio, binpacking shape: the same utilizations, the mean rounded (6.5 -> 7).
    assert kubedra.fit_score(empty, (0, 0), shape, RATIO) == 7
    # Half the CPU taken: MostAllocated 50 and 1 -> 25 (LeastAllocated 50 and 98 -> 74).
    assert kubedra.fit_score(empty, (24000, 0), shape, MOST) == (50 + 1) // 2 == 25
    assert kubedra.fit_score(empty, (24000, 0), shape) == (50 + 98) // 2 == 74
    # RequestedToCapacityRatio leaves out a resource that scores 0: 200 MiB of 256 GiB is 0%.
    roomy = node(gpu(0), cpu=64000, memory=262144)
    nothing = PodShape((ContainerShape(1, 1024, 10),))
    assert kubedra.fit_score(roomy, (31900, 0), nothing, RATIO) == 50
    assert kubedra.fit_score(roomy, (31900, 0), nothing, MOST) == (50 + 0) // 2 == 25
    # More requested than the node has (the defaults of pods without requests) counts as full.
    assert kubedra.fit_score(node(gpu(0), cpu=4000, memory=65536), (3950, 65500), nothing, MOST) == 100
    assert kubedra.fit_score(node(gpu(0), cpu=4000, memory=65536), (3950, 65500), nothing, RATIO) == 100
    # The profile's total adds BalancedAllocation as before.
    assert kubedra.node_score(empty, (0, 0), shape, MOST) == 6 + kubedra.balanced_allocation(empty, shape)


def test_a_best_fit_slice_order_makes_the_first_fit_the_best_fit() -> None:
    partly_used = node(gpu(0, used_cores=20), gpu(1, used_cores=60), gpu(2))
    assert kubedra.slice_order(partly_used) == [0, 1, 2]
    assert kubedra.slice_order(partly_used, best_fit=True) == [1, 0, 2]
    # 30% fits in GPU 1's 40% left, the least that takes it; index order would take GPU 0.
    assert devices(kubedra.allocate(partly_used, share(30), best_fit=True)) == [1]
    assert devices(kubedra.allocate(partly_used, share(30))) == [0]
    # 50% does not fit GPU 1: the next in the order, GPU 0; two devices: distinct, in that order.
    assert devices(kubedra.allocate(partly_used, share(50), best_fit=True)) == [0]
    assert devices(kubedra.allocate(partly_used, share(30, gpus=2), best_fit=True)) == [1, 0]
    # Equal compute left: the least memory left first.
    by_memory = node(gpu(0, model="V100", memory=32768), gpu(1))
    assert kubedra.slice_order(by_memory, best_fit=True) == [1, 0]


def test_a_most_allocated_profile_packs_gpu_pods_and_leaves_the_others_to_the_default() -> None:
    system = system_named("dra-mostallocated")
    assert system.kube_profile == kubedra.Profile(MOST)
    scheduler = KubeDraScheduler(small_cluster(16000, 64000), system, seed=3)
    small = next(n.name for n in scheduler.nodes if n.name.endswith("-n0"))
    # 4 vCPU is a larger share of the 16-vCPU node: MostAllocated sends the GPU pod there.
    fit = scheduler.place(SimPod("p", 4000, 1024, 1, 300))
    assert fit is not None and fit.name == small
    # A pod without GPUs has no claim and no schedulerName: the default profile spreads it.
    cpu_only = scheduler.place(SimPod("c", 4000, 1024, 0, 0))
    assert cpu_only is not None and cpu_only.name != small


def test_only_the_dra_systems_have_a_kube_scheduler() -> None:
    dra_systems = [s.name for s in SYSTEMS if s.kube_profile is not None]
    assert dra_systems == [
        "dra",
        "dra-mostallocated",
        "dra-ratio",
        "dra-packwhole",
        "dra-packwhole-bestfit",
        "dra-extender",
        "dra-extender-bestfit",
        "dra-bestfit",
        "dra-mostallocated-bestfit",
    ]
    assert system_named("dra-bestfit").kube_profile == kubedra.Profile(best_fit_devices=True)
    with pytest.raises(ValueError, match="system: 'fragmentation' is not placed by kube-scheduler"):
        KubeDraScheduler(small_cluster(64000), system_named("fragmentation"), seed=1)


def test_whole_gpu_pods_scored_by_the_extended_resource_pack_devices() -> None:
    # A share on a device counts it as allocated: 2 of 4 devices used, a pod asking 1 -> 75.
    shared = node(gpu(0, used_cores=10), gpu(1), gpu(2, used_cores=100), gpu(3))
    whole = PodShape((ContainerShape(1, None, 100),), PodPreferences(), 1000, 1024)
    assert kubedra.whole_gpu_score(shared, whole) == 75
    assert kubedra.whole_gpu_score(node(gpu(0), gpu(1)), whole) == 50
    # More asked than the node has counts as full.
    assert kubedra.whole_gpu_score(node(gpu(0, used_cores=5)), whole) == 100
    # In the scheduler: the second whole GPU joins the first (100 against 50); the default profile
    # spreads it to the node with more CPU left.
    pods = [SimPod("a", 1000, 1024, 1, 1000), SimPod("b", 1000, 1024, 1, 1000)]
    for name, together in (("dra-packwhole", True), ("dra", False)):
        scheduler = KubeDraScheduler(small_cluster(64000, 64000), system_named(name), seed=2)
        first, second = (scheduler.place(p) for p in pods)
        assert first is not None and second is not None and (first.name == second.name) is together
    # Shares keep the default profile's scoring.
    scheduler = KubeDraScheduler(small_cluster(64000, 64000), system_named("dra-packwhole"), seed=2)
    first, second = (scheduler.place(SimPod(n, 1000, 1024, 1, 300)) for n in "ab")
    assert first is not None and second is not None and first.name != second.name


def test_tessera_s_extender_filter_chooses_the_node_and_the_allocator_the_device() -> None:
    pods = [SimPod(n, 1000, 1024, 1, 300) for n in "ab"]
    target = [*pods, SimPod("w", 1000, 1024, 2, 1000)]
    for name, together in (("dra-extender", True), ("dra", False)):
        scheduler = make_scheduler(
            small_cluster(64000, 64000), system_named(name), SpeedProfiles(), target, 2
        )
        first, second = (scheduler.place(p) for p in pods)
        # Fragmentation keeps the other node's two GPUs whole for the 2-GPU pods of the workload;
        # LeastAllocated spreads.
        assert first is not None and second is not None and (first.name == second.name) is together
        if together:
            # The allocator's first fit: GPU 0, which has room left for the second share too.
            assert devices(first.placement) == devices(second.placement) == [0]
            # A release gives the first share back.
            scheduler.remove(pods[0], first)
            assert scheduler.node(first.name).gpus[0].used_cores == 30
