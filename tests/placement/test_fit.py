"""filter_node: which GPUs a pod gets on one node, and the reason when it gets none."""

from __future__ import annotations

import pytest

from tessera.contract import Policy
from tessera.placement import (
    POLICIES,
    ClusterContext,
    NodeFit,
    NodeRejection,
    NodeState,
    PodShape,
    Shortfall,
    SpeedProfiles,
    apply,
    filter_node,
)
from tests.placement.helpers import node, shape

PROFILES = SpeedProfiles.from_mapping(
    {"models": {"T4": 0.4, "V100": 1.0, "A100": 2.0}, "workloads": {"bert": {"T4": 0.2, "A100": 3.0}}}
)


def fit(n: NodeState, s: PodShape, policy: str = "binpack") -> NodeFit:
    outcome = filter_node(n, s, PROFILES, POLICIES[Policy(policy)], ClusterContext())
    assert isinstance(outcome, NodeFit), outcome
    return outcome


def reject(n: NodeState, s: PodShape) -> NodeRejection:
    outcome = filter_node(n, s, PROFILES, POLICIES[Policy.BINPACK], ClusterContext())
    assert isinstance(outcome, NodeRejection), outcome
    return outcome


def test_one_gpu_with_quotas() -> None:
    f = fit(node("n"), shape((1, 4096, 30)))
    [[grant]] = f.placement.containers
    assert (grant.gpu, grant.memory_quota_mib, grant.cores) == (0, 4096, 30)


def test_absent_memory_means_the_whole_gpu_and_absent_cores_none() -> None:
    n = node("n")
    f = fit(n, shape((1, None, None)))
    [[grant]] = f.placement.containers
    assert (grant.memory_quota_mib, grant.cores) == (16384, 0)
    taken = apply(n, f.placement)
    # Whole-memory requests need a GPU with nothing in use.
    f2 = fit(taken, shape((1, None, None)))
    assert f2.placement.containers[0][0].gpu != grant.gpu


def test_binpack_fills_the_used_gpu_spread_takes_an_empty_one() -> None:
    n = node("n")
    first = fit(n, shape((1, 4096, 20)))
    used = apply(n, first.placement)
    used_gpu = first.placement.containers[0][0].gpu
    assert fit(used, shape((1, 4096, 20)), "binpack").placement.containers[0][0].gpu == used_gpu
    assert fit(used, shape((1, 4096, 20)), "spread").placement.containers[0][0].gpu != used_gpu


def test_binpack_scores_used_nodes_higher_spread_lower() -> None:
    empty = node("empty")
    busy = apply(node("busy"), fit(node("busy"), shape((1, 8192, 50))).placement)
    s = shape((1, 4096, 20))
    assert fit(busy, s, "binpack").policy_score > fit(empty, s, "binpack").policy_score
    assert fit(busy, s, "spread").policy_score < fit(empty, s, "spread").policy_score


def test_multi_gpu_container_gets_distinct_gpus() -> None:
    f = fit(node("n"), shape((3, 1024, 10)))
    assert len({g.gpu for g in f.placement.containers[0]}) == 3


def test_containers_of_one_pod_may_share_a_gpu() -> None:
    f = fit(node("n", count=1), shape((1, 4096, 30), (1, 4096, 30)))
    assert [c[0].gpu for c in f.placement.containers] == [0, 0]


def test_containers_do_not_share_past_the_quota() -> None:
    # Each container alone fits on the single GPU, both together do not.
    r = reject(node("n", count=1), shape((1, 10000, 10), (1, 10000, 10)))
    assert r.shortfall is Shortfall.TOGETHER
    assert "fit one by one but not together" in r.reason


def test_backtracking_finds_the_fit_greedy_would_miss() -> None:
    # GPU 0 has 8 GiB free, GPU 1 has 16 GiB. Best-fit puts the 8 GiB container first on GPU 0 only
    # if the 12 GiB container went first; containers are placed biggest first, so both fit.
    n = node("n", count=2)
    n = apply(n, fit(n, shape((1, 8192, None))).placement)
    f = fit(n, shape((1, 8192, None), (1, 12288, None)))
    assert sorted(g.gpu for c in f.placement.containers for g in c) == [0, 1]


def test_multi_gpu_prefers_one_nvlink_island() -> None:
    n = node("n", count=4, nvlink=[[0, 3], [1, 2]])
    taken = apply(n, fit(n, shape((1, 1024, None))).placement)  # GPU 0 now in use
    f = fit(taken, shape((2, 1024, None)))
    assert sorted(g.gpu for g in f.placement.containers[0]) in ([0, 3], [1, 2])


def test_multi_gpu_prefers_one_numa_node() -> None:
    n = node("n", count=4, numa=[0, 1, 0, 1])
    f = fit(n, shape((2, 1024, None)))
    gpus = [g.gpu for g in f.placement.containers[0]]
    assert len({n.gpus[i].numa for i in gpus}) == 1


@pytest.mark.parametrize(
    ("s", "expected", "shortfall"),
    [
        (
            shape((1, 40960, None)),
            "no GPU with 40960 MiB of memory; largest has 16384 MiB",
            Shortfall.CAPACITY,
        ),
        (shape((5, 1024, None)), "only 4 GPUs; a container needs 5", Shortfall.CAPACITY),
        (
            shape((1, 1024, None), models=("a100",)),
            "no such healthy GPU (models a100); node has Tesla V100-SXM2-16GB x4",
            Shortfall.MODEL,
        ),
        (
            shape((1, 1024, None), exclude=("v100",)),
            "no such healthy GPU (excluding v100); node has Tesla V100-SXM2-16GB x4",
            Shortfall.MODEL,
        ),
        (
            shape((1, 1024, None), min_speed=1.5),
            "no GPU with speed >= 1.5; node has Tesla V100-SXM2-16GB 1",
            Shortfall.SPEED,
        ),
    ],
)
def test_unresolvable_reasons(s: PodShape, expected: str, shortfall: Shortfall) -> None:
    r = reject(node("n"), s)
    assert (r.reason, r.shortfall, r.unresolvable) == (expected, shortfall, True)


def test_memory_shortfall_names_the_largest_free() -> None:
    n = node("n", count=2)
    for _ in range(2):
        n = apply(n, fit(n, shape((1, 10240, None))).placement)
    r = reject(n, shape((1, 8192, None)))
    assert r.reason == "no GPU with 8192 MiB free; largest free 6144 MiB"
    assert (r.shortfall, r.unresolvable) == (Shortfall.MEMORY, False)


def test_compute_shortfall() -> None:
    n = node("n", count=1)
    n = apply(n, fit(n, shape((1, 1024, 80))).placement)
    r = reject(n, shape((1, 1024, 30)))
    assert r.reason == "no GPU with 30% compute free (of 100) among those with the memory; most free 20%"
    assert r.shortfall is Shortfall.COMPUTE


def test_slice_shortfall() -> None:
    n = node("n", count=1, split=2)
    for _ in range(2):
        n = apply(n, fit(n, shape((1, 1024, 10))).placement)
    r = reject(n, shape((1, 1024, 10)))
    assert (
        r.reason == "no GPU with a free slice among those with the memory and compute (all 2 slices in use)"
    )
    assert r.shortfall is Shortfall.SLICES


def test_multi_gpu_shortfall_counts() -> None:
    n = node("n", count=4)
    for _ in range(3):
        n = apply(n, fit(n, shape((1, 12000, None))).placement)
    r = reject(n, shape((2, 8192, None)))
    assert r.reason == "only 1 GPU with 8192 MiB free; 2 needed; largest free 16384 MiB"


def test_several_containers_name_the_one_short() -> None:
    r = reject(node("n"), shape((1, 1024, None), (1, 40960, 10)))
    assert r.reason.startswith("1 x (40960 MiB, 10% compute): no GPU with 40960 MiB of memory")


def test_unhealthy_gpus_are_skipped_and_all_unhealthy_is_named() -> None:
    f = fit(node("n", unhealthy=(0, 1)), shape((1, 1024, None)))
    assert f.placement.containers[0][0].gpu == 2
    r = reject(node("n", count=2, unhealthy=(0, 1)), shape((1, 1024, None)))
    assert (r.reason, r.shortfall) == ("all 2 GPUs are unhealthy", Shortfall.HEALTH)


def test_unschedulable_node_gives_its_reason() -> None:
    n = NodeState("n", node("n").gpus, schedulable=False, unschedulable_reason="heartbeat is 90 s old")
    r = reject(n, shape((1, 1024, None)))
    assert (r.reason, r.shortfall, r.unresolvable) == ("heartbeat is 90 s old", Shortfall.NODE, True)


def test_model_filters_are_case_insensitive_substrings() -> None:
    t4 = node("t4", model="Tesla T4", memory_mib=15360)
    assert fit(t4, shape((1, 1024, None), models=("t4", "a100"))).placement
    assert reject(t4, shape((1, 1024, None), exclude=("TESLA",))).shortfall is Shortfall.MODEL


def test_min_speed_uses_the_workload_profile() -> None:
    a100 = node("a", model="NVIDIA A100-SXM4-40GB", memory_mib=40960)
    assert fit(a100, shape((1, 1024, None), min_speed=2.5, workload="bert"))
    assert reject(a100, shape((1, 1024, None), min_speed=2.5)).reason == (
        "no GPU with speed >= 2.5; node has NVIDIA A100-SXM4-40GB 2"
    )


def test_gain_is_the_comparative_advantage_of_the_slowest_gpu_chosen() -> None:
    a100 = node("a", model="NVIDIA A100-SXM4-40GB", memory_mib=40960)
    assert fit(a100, shape((1, 1024, None), workload="bert")).gain == pytest.approx(1.5)
    assert fit(a100, shape((1, 1024, None))).gain == 1.0


def test_host_capacity_is_checked_when_the_node_has_one() -> None:
    n = NodeState("n", node("n").gpus, cpu_milli=1000, host_memory_mib=2048)
    s = PodShape(shape((1, 1024, None)).containers, cpu_milli=2000)
    r = reject(n, s)
    assert (r.reason, r.shortfall) == ("not enough CPU: 1000m free, 2000m asked", Shortfall.HOST)
