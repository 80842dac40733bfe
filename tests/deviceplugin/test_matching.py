"""The pure core of Allocate and GetPreferredAllocation: which container a request is for."""

from __future__ import annotations

from datetime import UTC, datetime, timedelta

import pytest

from deviceplugin.kube import pod_view
from deviceplugin.matching import (
    AllocationError,
    NodeSnapshot,
    PodView,
    match_container,
    pod_complete,
    preferred_devices,
    snapshot,
)
from tessera.contract import (
    KEYS,
    Allocation,
    ContainerAllocation,
    ContainerRequest,
    GpuGrant,
    Phase,
    dump_allocation,
    format_time,
    slice_id,
)

NODE = "node-a"
GPUS = ("GPU-a", "GPU-b", "GPU-c", "GPU-d")
T0 = datetime(2026, 1, 1, tzinfo=UTC)


def pod(
    name: str,
    containers: dict[str, list[tuple[str, int, int]]],
    *,
    bind_offset: int = 0,
    phase: str | None = Phase.ALLOCATING,
    allocation: str | None = "",
    gpu_counts: dict[str, int] | None = None,
) -> PodView:
    """A pending pod whose allocation gives each container its (uuid, MiB, cores) list."""
    annotations = {KEYS.bind_time: format_time(T0 + timedelta(seconds=bind_offset))}
    if phase is not None:
        annotations[KEYS.allocation_phase] = phase
    if allocation == "":
        allocation = dump_allocation(
            Allocation(
                node=NODE,
                containers=tuple(
                    ContainerAllocation(
                        name=c,
                        gpus=tuple(GpuGrant(uuid=u, memory_quota_mib=m, cores=k) for u, m, k in grants),
                    )
                    for c, grants in containers.items()
                ),
            )
        )
    if allocation is not None:
        annotations[KEYS.allocation] = allocation
    counts = gpu_counts or {c: len(g) for c, g in containers.items()}
    return PodView(
        namespace="ns",
        name=name,
        uid=f"uid-{name}",
        created=T0,
        annotations=annotations,
        gpu_containers=tuple(ContainerRequest(c, n, None, None) for c, n in counts.items()),
    )


def state(*pods: PodView, served: set[tuple[str, str]] | None = None) -> NodeSnapshot:
    return snapshot(
        pods,
        keys=KEYS,
        node=NODE,
        node_gpus=GPUS,
        served=served or set(),
        now=T0 + timedelta(seconds=60),
        inflight_timeout=timedelta(seconds=300),
    )


def test_allocate_finds_the_container_by_gpu_set_and_size() -> None:
    one = pod("one", {"main": [("GPU-a", 4096, 30)]})
    two = pod("two", {"main": [("GPU-b", 1024, 10), ("GPU-c", 1024, 10)]})
    s = state(one, two)
    got = match_container([slice_id("GPU-c", 3), slice_id("GPU-b", 0)], s, node=NODE, node_gpus=GPUS)
    assert (got.pod.name, got.container) == ("two", "main")
    got = match_container([slice_id("GPU-a", 7)], s, node=NODE, node_gpus=GPUS)
    assert got.pod.name == "one"
    assert got.grants == (GpuGrant(uuid="GPU-a", memory_quota_mib=4096, cores=30),)


def test_equal_keys_are_served_oldest_bind_first_then_spec_order() -> None:
    late = pod("late", {"a": [("GPU-a", 1024, 10)]}, bind_offset=5)
    early = pod("early", {"x": [("GPU-a", 1024, 10)], "y": [("GPU-a", 1024, 10)]}, bind_offset=1)
    s = state(late, early)
    order = []
    taken: set[tuple[str, str]] = set()
    for _ in range(3):
        got = match_container([slice_id("GPU-a", 0)], s, node=NODE, node_gpus=GPUS, taken=taken)
        taken.add(got.ref)
        order.append((got.pod.name, got.container))
    assert order == [("early", "x"), ("early", "y"), ("late", "a")]
    with pytest.raises(AllocationError):
        match_container([slice_id("GPU-a", 0)], s, node=NODE, node_gpus=GPUS, taken=taken)


def test_served_containers_and_finished_pods_are_not_in_flight() -> None:
    p = pod("p", {"x": [("GPU-a", 1024, 10)], "y": [("GPU-b", 1024, 10)]})
    done = pod("done", {"x": [("GPU-c", 1024, 10)]}, phase=Phase.ALLOCATED)
    failed = pod("failed", {"x": [("GPU-d", 1024, 10)]}, phase=Phase.FAILED)
    s = state(p, done, failed, served={("uid-p", "x")})
    assert [(c.pod.name, c.container) for c in s.in_flight] == [("p", "y")]
    assert s.broken == ()
    assert not pod_complete(p, {("uid-p", "x")})
    assert pod_complete(p, {("uid-p", "x"), ("uid-p", "y")})


@pytest.mark.parametrize(
    ("bad", "reason"),
    [
        (pod("p", {"main": [("GPU-a", 1, 1)]}, allocation=None), f"annotation {KEYS.allocation} is missing"),
        (pod("p", {"main": [("GPU-a", 1, 1)]}, allocation="{not json"), "Invalid JSON"),
        (pod("p", {"main": [("GPU-x", 1, 1)]}), "GPU GPU-x is not on this node 'node-a'"),
        (
            pod("p", {"main": [("GPU-a", 1, 1)]}, gpu_counts={"main": 2}),
            f"container 'main' asks for 2 {KEYS.vgpu} but its allocation names 1 GPU(s)",
        ),
        (
            pod("p", {"main": [("GPU-a", 1, 1)]}, gpu_counts={"other": 1}),
            "has no entry for container 'other'",
        ),
        (pod("p", {"main": [("GPU-a", 1, 1)]}, phase=None), "is None, not 'allocating'"),
    ],
)
def test_broken_pods_fail_allocate_with_the_reason(bad: PodView, reason: str) -> None:
    s = state(bad)
    assert s.in_flight == ()
    gpu_count = bad.gpu_containers[0].gpu_count
    devices = [slice_id(g, 0) for g in GPUS[:gpu_count]]
    with pytest.raises(AllocationError) as e:
        match_container(devices, s, node=NODE, node_gpus=GPUS)
    assert reason in e.value.message
    assert "pod ns/p" in e.value.message
    assert [b.pod.name for b in e.value.concerned] == ["p"]


def test_allocation_for_another_node_is_broken() -> None:
    other = Allocation(
        node="node-b",
        containers=(
            ContainerAllocation(name="m", gpus=(GpuGrant(uuid="GPU-a", memory_quota_mib=1, cores=0),)),
        ),
    )
    s = state(pod("p", {"m": [("GPU-a", 1, 1)]}, allocation=dump_allocation(other)))
    assert "is for node 'node-b', not this node 'node-a'" in s.broken[0].reason


def test_bad_device_ids_name_the_device() -> None:
    s = state(pod("p", {"main": [("GPU-a", 1, 1), ("GPU-b", 1, 1)]}))
    with pytest.raises(AllocationError, match=r"'GPU-z::0' is a slice of GPU GPU-z, not on this node"):
        match_container(["GPU-z::0"], s, node=NODE, node_gpus=GPUS)
    with pytest.raises(AllocationError, match=r"holds 2 slices of GPU GPU-a"):
        match_container(["GPU-a::0", "GPU-a::1"], s, node=NODE, node_gpus=GPUS)
    with pytest.raises(AllocationError, match=r"'garbage' is not of the form <GPU-UUID>::<n>"):
        match_container(["garbage"], s, node=NODE, node_gpus=GPUS)
    with pytest.raises(AllocationError, match=r"the request names no device"):
        match_container([], s, node=NODE, node_gpus=GPUS)


def test_kubelet_picking_other_gpus_names_the_in_flight_pods_of_that_size_but_fails_none() -> None:
    """Which of them the kubelet admits is a guess: a pod failed on a wrong guess would leave the
    in-flight rule, and the extender could bind another key beside it (deviceplugin/matching.py)."""
    s = state(pod("p", {"main": [("GPU-a", 1, 1)]}), pod("q", {"main": [("GPU-b", 1, 1), ("GPU-c", 1, 1)]}))
    with pytest.raises(AllocationError) as e:
        match_container(["GPU-d::0"], s, node=NODE, node_gpus=GPUS)
    assert e.value.concerned == ()
    assert (
        "pod ns/p: container 'main' was allocated GPU(s) ['GPU-a'], the kubelet chose others"
        in e.value.message
    )
    assert "ns/q" not in e.value.message


def test_two_pods_in_flight_on_the_same_gpus_with_different_quotas_are_served_to_neither() -> None:
    """The in-flight rule broken (the extender missed one of them, as when the API server died
    after committing a binding and before answering it): the call cannot say which pod the kubelet
    admits, and a guess could give one pod's quotas to the other."""
    s = state(
        pod("old", {"main": [("GPU-a", 1024, 10)]}, bind_offset=1),
        pod("new", {"main": [("GPU-a", 2048, 30)]}, bind_offset=2),
    )
    with pytest.raises(AllocationError) as e:
        match_container(["GPU-a::0"], s, node=NODE, node_gpus=GPUS)
    assert e.value.concerned == ()
    assert "pod ns/old container 'main' (GPU-a: 1024 MiB, 10% cores)" in e.value.message
    assert "pod ns/new container 'main' (GPU-a: 2048 MiB, 30% cores)" in e.value.message
    # Equal quotas, as the rule keeps them, are no ambiguity: the oldest is served.
    same = state(
        pod("old", {"main": [("GPU-a", 1024, 10)]}, bind_offset=1),
        pod("new", {"main": [("GPU-a", 1024, 10)]}, bind_offset=2),
    )
    assert match_container(["GPU-a::0"], same, node=NODE, node_gpus=GPUS).pod.name == "old"
    # One pod's own containers may differ (the kubelet allocates them in spec order).
    own = state(pod("p", {"a": [("GPU-a", 1024, 10)], "b": [("GPU-a", 2048, 30)]}))
    assert match_container(["GPU-a::0"], own, node=NODE, node_gpus=GPUS).container == "a"


def test_preferred_allocation_steers_to_the_in_flight_gpus() -> None:
    s = state(
        pod("new", {"main": [("GPU-c", 1, 1), ("GPU-a", 1, 1)]}, bind_offset=9),
        pod("old", {"main": [("GPU-d", 1, 1), ("GPU-b", 1, 1)]}, bind_offset=1),
        pod("single", {"main": [("GPU-a", 1, 1)]}),
    )
    available = [slice_id(g, n) for g in GPUS for n in range(3)]
    assert preferred_devices(available, [], 2, s) == ["GPU-d::0", "GPU-b::0"]
    # The oldest one's GPU has no free slice left: the next in-flight container of that size.
    no_d = [d for d in available if not d.startswith("GPU-d")]
    assert preferred_devices(no_d, [], 2, s) == ["GPU-c::0", "GPU-a::0"]
    assert preferred_devices(available, ["GPU-b::2"], 2, s) == ["GPU-b::2", "GPU-d::0"]
    assert preferred_devices(available, [], 1, s) == ["GPU-a::0"]


def test_preferred_allocation_without_a_candidate_spreads_over_distinct_gpus() -> None:
    available = ["GPU-a::0", "GPU-a::1", "GPU-b::0", "other-device", "GPU-c::4"]
    assert preferred_devices(available, [], 3, state()) == ["GPU-a::0", "GPU-b::0", "GPU-c::4"]


def test_stale_in_flight_pods_come_after_fresh_ones() -> None:
    """A pod bound longer ago than the timeout no longer holds others back: a fresh pod of the same
    size may have another key, and steering must go to the fresh one."""
    stale = pod("stale", {"main": [("GPU-a", 1, 1)]}, bind_offset=-600)
    fresh = pod("fresh", {"main": [("GPU-b", 2, 2)]}, bind_offset=30)
    s = state(stale, fresh)
    assert [(c.pod.name, c.stale) for c in s.in_flight] == [("fresh", False), ("stale", True)]
    assert preferred_devices(["GPU-a::0", "GPU-b::0"], [], 1, s) == ["GPU-b::0"]
    # Matching is still by GPU set: the stale pod is served if the kubelet admits it after all.
    assert match_container(["GPU-a::3"], s, node=NODE, node_gpus=GPUS).pod.name == "stale"


def pod_object(limits: dict[str, str], *, init: bool = False) -> dict[str, object]:
    """A pending pod on this node as the API server lists it, allocated by the extender."""
    spec_key = "initContainers" if init else "containers"
    return {
        "metadata": {
            "namespace": "ns",
            "name": "p",
            "uid": "uid-p",
            "creationTimestamp": "2026-01-01T00:00:00Z",
            "annotations": {KEYS.allocation_phase: Phase.ALLOCATING, KEYS.bind_time: format_time(T0)},
        },
        "spec": {spec_key: [{"name": "main", "resources": {"limits": limits}}]},
    }


def test_the_pod_view_reads_the_request_as_the_contract_does() -> None:
    view = pod_view(pod_object({KEYS.vgpu: "2", KEYS.vgpu_memory: "4Ki", "cpu": "1"}), KEYS)
    assert view.gpu_containers == (ContainerRequest("main", 2, 4096, None),)
    assert view.request_error is None
    assert view.created == T0
    assert view.ref == "ns/p"


@pytest.mark.parametrize(
    ("limits", "init", "reason"),
    [
        (
            {KEYS.vgpu: "1", KEYS.vgpu_cores: "0"},
            False,
            f"container 'main': {KEYS.vgpu_cores}: 0 is outside 1..100",
        ),
        ({KEYS.vgpu: "one"}, False, f"container 'main': {KEYS.vgpu}: 'one' is not a quantity"),
        ({KEYS.vgpu: "1"}, True, f"init container 'main': {KEYS.vgpu} is supported on containers only"),
    ],
)
def test_a_pod_with_an_invalid_request_fails_allocate_with_the_contracts_reason(
    limits: dict[str, str], init: bool, reason: str
) -> None:
    """The extender never binds such a pod; if it is on the node anyway, an Allocate that finds no
    in-flight container reports it, whatever its GPU count (it cannot be read)."""
    view = pod_view(pod_object(limits, init=init), KEYS)
    assert view.gpu_containers == ()
    s = state(view)
    assert s.in_flight == ()
    assert [b.reason for b in s.broken] == [f"its request is invalid: {reason}"]
    with pytest.raises(AllocationError) as e:
        match_container([slice_id("GPU-a", 0)], s, node=NODE, node_gpus=GPUS)
    assert f"pod ns/p: its request is invalid: {reason}" in e.value.message
    assert [b.pod.name for b in e.value.concerned] == ["p"]
