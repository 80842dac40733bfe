"""The placement core's shortcuts decide exactly as the plain computations they stand for.

* values derived once at construction (free memory/cores/slices, a container's cores_needed, a node's
  healthy GPUs and their utilizations) follow the fields, and stay out of equality, hashes and reprs;
* ``GpuState.with_use`` makes what ``dataclasses.replace`` makes;
* a one-container pod skips the backtracking search: it gets the placement the search finds;
* ``utilization_after`` recomputes only the chosen GPUs: the same floats, to the bit, as GPU by GPU.
"""

from __future__ import annotations

import random
from dataclasses import fields, replace

import pytest

from tessera.contract import MAX_CORES, Policy
from tessera.placement import (
    POLICIES,
    ClusterContext,
    ContainerShape,
    GpuState,
    Grant,
    NodeState,
    Placement,
    PodShape,
    SpeedProfiles,
    build_node,
    find_placement,
)
from tessera.placement.fit import eligible_gpus
from tessera.placement.policies import utilization_after
from tests.placement.helpers import gpus, shape

PROFILES = SpeedProfiles.from_mapping({"models": {"T4": 0.4, "V100": 1.0, "A100": 2.0}})


def used_gpu(rng: random.Random, position: int, *, healthy: bool = True) -> GpuState:
    memory = rng.choice([15360, 16384, 40960])
    return GpuState(
        uuid=f"GPU-{position}",
        index=position,
        model=rng.choice(["Tesla T4", "Tesla V100-SXM2-16GB", "NVIDIA A100-SXM4-40GB"]),
        total_memory_mib=memory,
        slices=rng.choice([1, 4, 8]),
        numa=position // 4,
        healthy=healthy,
        used_memory_mib=rng.choice([0, 1024, 4096, memory // 2, memory]),
        used_cores=rng.choice([0, 10, 30, 100]),
        used_slices=rng.choice([0, 1, 2]),
    )


def random_node(rng: random.Random, name: str) -> NodeState:
    return NodeState(name, tuple(used_gpu(rng, i, healthy=rng.random() > 0.1) for i in range(8)))


def test_derived_values_follow_the_fields() -> None:
    gpu = GpuState("GPU-0", 0, "Tesla T4", 15360, 4, used_memory_mib=4096, used_cores=30, used_slices=1)
    assert (gpu.free_memory_mib, gpu.free_cores, gpu.free_slices) == (11264, MAX_CORES - 30, 3)
    assert ContainerShape(1, 4096, None).cores_needed == 0
    assert ContainerShape(1, 4096, 25).cores_needed == 25
    sick = replace(gpu, uuid="GPU-1", index=1, healthy=False)
    node = NodeState("n", (gpu, sick, replace(gpu, uuid="GPU-2", index=2, used_cores=80)))
    assert node.healthy_positions == (0, 2)
    assert node.healthy_utilizations == (node.gpus[0].utilization, node.gpus[2].utilization)


def test_derived_values_stay_out_of_equality_hashes_and_reprs() -> None:
    assert ContainerShape(1, 4096, 25) == ContainerShape(1, 4096, 25)
    assert hash(ContainerShape(1, 4096, 25)) == hash((1, 4096, 25))
    assert (
        repr(ContainerShape(1, 4096, None))
        == "ContainerShape(gpu_count=1, memory_quota_mib=4096, cores=None)"
    )
    gpu = GpuState("GPU-0", 0, "Tesla T4", 15360, 4)
    assert "free_" not in repr(gpu)
    assert "healthy_positions" not in repr(NodeState("n", (gpu,)))


def test_with_use_is_replace() -> None:
    gpu = used_gpu(random.Random(1), 3)
    made = gpu.with_use(2048, 20, 1)
    assert made == replace(
        gpu,
        used_memory_mib=gpu.used_memory_mib + 2048,
        used_cores=gpu.used_cores + 20,
        used_slices=gpu.used_slices + 1,
    )
    # Every field the constructor takes is carried over (a field added later must be too).
    for f in fields(GpuState):
        if f.init and not f.name.startswith("used_"):
            assert getattr(made, f.name) == getattr(gpu, f.name), f.name
    assert made.free_memory_mib == gpu.free_memory_mib - 2048


@pytest.mark.parametrize("policy", ["binpack", "spread", "fragmentation"])
def test_one_container_shortcut_is_the_search(policy: str) -> None:
    """Pinning the container to every GPU takes the general search; it must find the same set."""
    rng = random.Random(policy)
    context = ClusterContext()
    topologies: list[dict[str, object]] = [{}, {"nvlink": [[0, 1], [2, 3]]}, {"numa": [0, 0, 1, 1]}]
    checked = 0
    for n in range(300):
        node = build_node(f"n{n}", gpus(f"n{n}", split=8, **rng.choice(topologies)))  # type: ignore[arg-type]
        node = replace(node, gpus=tuple(g.with_use(rng.choice([0, 4096, 12000]), 10, 1) for g in node.gpus))
        container = (rng.choice([1, 1, 2, 3]), rng.choice([None, 2048, 4096, 8192]), rng.choice([None, 20]))
        pod: PodShape = shape(container)
        eligible = eligible_gpus(node, pod, PROFILES)
        fast = find_placement(node, pod, eligible, POLICIES[Policy(policy)], context)
        searched = find_placement(
            node, pod, eligible, POLICIES[Policy(policy)], context, pinned={0: list(range(len(node.gpus)))}
        )
        assert fast == searched, (node, pod)
        checked += fast is not None
    assert checked > 100  # most of them fit: the comparison is not only of Nones


def reference_utilization_after(node: NodeState, placement: Placement) -> tuple[float, float]:
    """utilization_after computed GPU by GPU, as the core did before the shortcut."""
    added_memory: dict[int, int] = {}
    added_cores: dict[int, int] = {}
    for grant in placement.grants():
        added_memory[grant.gpu] = added_memory.get(grant.gpu, 0) + grant.memory_quota_mib
        added_cores[grant.gpu] = added_cores.get(grant.gpu, 0) + grant.cores
    total = 0.0
    healthy = 0
    chosen = 0.0
    for position, gpu in enumerate(node.gpus):
        if not gpu.healthy:
            continue
        healthy += 1
        memory = (gpu.used_memory_mib + added_memory.get(position, 0)) / gpu.total_memory_mib
        cores = (gpu.used_cores + added_cores.get(position, 0)) / 100
        used = min(1.0, max(memory, cores))
        total += used
        if position in added_memory:
            chosen += used
    return (chosen / len(added_memory) if added_memory else 0.0, total / healthy if healthy else 0.0)


def test_utilization_after_matches_gpu_by_gpu_to_the_bit() -> None:
    rng = random.Random(5)
    for n in range(500):
        node = random_node(rng, f"n{n}")
        containers = tuple(
            tuple(
                Grant(position, rng.choice([512, 1000, 3333, 8192]), rng.choice([0, 7, 25]))
                for position in rng.sample(range(8), rng.choice([1, 1, 2, 3]))
            )
            for _ in range(rng.choice([0, 1, 1, 2]))
        )
        placement = Placement(node.name, containers)
        assert utilization_after(node, placement) == reference_utilization_after(node, placement)
