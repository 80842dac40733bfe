"""Live resize in the placement core: new quotas fit on the pod's own GPUs, against everyone else."""

from __future__ import annotations

import random

import pytest

from tessera.contract import Allocation, ContainerAllocation, GpuGrant, QosClass, parse_resize
from tessera.placement import ResizeRefusal, Shortfall, build_node, resize
from tests.placement.helpers import gpus

GPU0, GPU1 = "GPU-n-0", "GPU-n-1"


def alloc(*containers: tuple[str, tuple[tuple[str, int, int], ...]]) -> Allocation:
    return Allocation(
        node="n",
        containers=tuple(
            ContainerAllocation(
                name=name, gpus=tuple(GpuGrant(uuid=u, memory_quota_mib=m, cores=c) for u, m, c in g)
            )
            for name, g in containers
        ),
        qos=QosClass.STANDARD,
    )


def test_grow_fits_against_the_other_pods_on_the_gpu() -> None:
    mine = alloc(("main", ((GPU0, 1024, 30),)))
    other = alloc(("main", ((GPU0, 12288, 40),)))
    node = build_node("n", gpus("n", count=2), [mine, other])
    resized = resize(node, mine, parse_resize("memory=4096,cores=60"))
    assert resized == alloc(("main", ((GPU0, 4096, 60),)))


def test_grow_past_what_is_free_is_refused_naming_the_shortfall() -> None:
    mine = alloc(("main", ((GPU0, 1024, 30),)))
    other = alloc(("main", ((GPU0, 12288, 40),)))
    node = build_node("n", gpus("n", count=2), [mine, other])
    refused = resize(node, mine, parse_resize("memory=6144"))
    assert refused == ResizeRefusal(
        f"GPU {GPU0} on node n: 5120 MiB more memory asked, 3072 MiB of 16384 MiB free", Shortfall.MEMORY
    )
    refused = resize(node, mine, parse_resize("cores=61"))
    assert refused == ResizeRefusal(
        f"GPU {GPU0} on node n: 31% more compute asked, 30% of 100% free", Shortfall.COMPUTE
    )


def test_shrink_always_fits_even_on_an_overcommitted_gpu() -> None:
    mine = alloc(("main", ((GPU0, 8192, 60),)))
    other = alloc(("main", ((GPU0, 12288, 60),)))
    node = build_node("n", gpus("n", count=2), [mine, other])
    assert resize(node, mine, parse_resize("memory=512,cores=10")) == alloc(("main", ((GPU0, 512, 10),)))


def test_a_container_on_two_gpus_is_resized_on_each_and_each_must_fit() -> None:
    mine = alloc(("main", ((GPU0, 1024, 0), (GPU1, 1024, 0))))
    other = alloc(("main", ((GPU1, 15000, 0),)))
    node = build_node("n", gpus("n", count=2), [mine, other])
    refused = resize(node, mine, parse_resize("memory=2048"))
    assert isinstance(refused, ResizeRefusal)
    assert refused.shortfall == Shortfall.MEMORY
    assert GPU1 in refused.reason
    assert resize(node, mine, parse_resize("memory=1384")) == alloc(
        ("main", ((GPU0, 1384, 0), (GPU1, 1384, 0)))
    )


def test_two_containers_of_one_pod_on_one_gpu_count_together() -> None:
    mine = alloc(("a", ((GPU0, 4096, 0),)), ("b", ((GPU0, 4096, 0),)))
    node = build_node("n", gpus("n", count=1), [mine])
    assert isinstance(resize(node, mine, parse_resize("a:memory=8192;b:memory=8193")), ResizeRefusal)
    assert resize(node, mine, parse_resize("a:memory=8192;b:memory=8192")) == alloc(
        ("a", ((GPU0, 8192, 0),)), ("b", ((GPU0, 8192, 0),))
    )


@pytest.mark.parametrize(
    ("text", "reason"),
    [
        ("memory=10", "the pod has 2 GPU containers (a, b): name the one to resize (<container>:memory=...)"),
        ("c:memory=10", "container 'c' has no GPU allocation (GPU containers: a, b)"),
    ],
)
def test_a_request_naming_no_container_of_the_pod_is_refused(text: str, reason: str) -> None:
    mine = alloc(("a", ((GPU0, 4096, 0),)), ("b", ((GPU0, 4096, 0),)))
    node = build_node("n", gpus("n", count=1), [mine])
    assert resize(node, mine, parse_resize(text)) == ResizeRefusal(reason, None)


def test_a_gpu_gone_from_the_inventory_refuses_growth_there() -> None:
    mine = alloc(("main", ((GPU1, 1024, 0),)))
    node = build_node("n", gpus("n", count=1), [mine])
    refused = resize(node, mine, parse_resize("memory=2048"))
    assert isinstance(refused, ResizeRefusal)
    assert refused.shortfall == Shortfall.NODE


def test_random_resizes_and_new_pods_never_overcommit_a_gpu() -> None:
    """200 operations: pods placed by the core's fit rule and resized at random; after each, every
    GPU's grants stay within its memory and compute."""
    rng = random.Random(16)
    inventory = gpus("n", count=2, memory_mib=8192, split=8)
    pods: dict[str, Allocation] = {}
    applied = refused = 0
    for step in range(200):
        node = build_node("n", inventory, pods.values())
        if pods and rng.random() < 0.6:
            name = rng.choice(sorted(pods))
            text = f"memory={rng.choice([256, 512, 1024, 2048, 4096])},cores={rng.randint(1, 60)}"
            outcome = resize(node, pods[name], parse_resize(text))
            if isinstance(outcome, Allocation):
                pods[name] = outcome
                applied += 1
            else:
                refused += 1
        elif pods and rng.random() < 0.2:
            del pods[rng.choice(sorted(pods))]
        else:
            memory, cores = rng.choice([512, 1024, 2048]), rng.randint(1, 40)
            free = [
                g
                for g in node.gpus
                if g.free_memory_mib >= memory and g.free_cores >= cores and g.free_slices
            ]
            if free:
                pods[f"p{step}"] = alloc(("main", ((free[0].uuid, memory, cores),)))
        for gpu in build_node("n", inventory, pods.values()).gpus:
            assert gpu.used_memory_mib <= gpu.total_memory_mib and gpu.used_cores <= 100, (step, gpu)
    assert applied > 20 and refused > 20  # both paths were taken
