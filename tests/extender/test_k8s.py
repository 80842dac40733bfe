"""The extender with the real kube-apiserver and kube-scheduler (deploy/scheduler-config.yaml) on
10 fake nodes x 4 GPUs of three models."""

from __future__ import annotations

import random
import time
from collections import defaultdict
from collections.abc import Callable
from datetime import timedelta
from typing import Any

import pytest
from kubernetes import client

from sandbox.controlplane import ControlPlane
from tessera.contract import KEYS, Phase, now, parse_allocation, parse_inventory, parse_pod_request
from tessera.placement import PlacementEngine, SpeedProfiles, build_node, choose, shape_of
from tests.extender.conftest import (
    CLUSTER,
    REPO,
    SPLIT,
    ExtenderServer,
    FakeDevicePlugin,
    node_annotations,
)
from tests.extender.helpers import gpu_pod, inventory
from tests.waiting import wait_for

pytestmark = pytest.mark.k8s


def create(core: client.CoreV1Api, namespace: str, pod: dict[str, Any]) -> None:
    pod["metadata"].pop("namespace", None)
    core.create_namespaced_pod(namespace, pod)


def node_of(core: client.CoreV1Api, namespace: str, name: str) -> str | None:
    return core.read_namespaced_pod(name, namespace).spec.node_name  # type: ignore[no-any-return]


def failed_scheduling(core: client.CoreV1Api, namespace: str, name: str) -> list[str]:
    events = core.list_namespaced_event(namespace, field_selector=f"involvedObject.name={name}").items
    return [e.message for e in events if e.reason == "FailedScheduling"]


def test_pods_land_where_the_rules_say(
    kube: client.ApiClient,
    namespace: str,
    gpu_cluster: dict[str, str],
    extender_with_scheduler: Callable[[int], ExtenderServer],
) -> None:
    core = client.CoreV1Api(kube)
    extender_with_scheduler(600)
    cases: dict[str, tuple[dict[str, Any], str]] = {
        "big-memory": (gpu_pod("big-memory", memory=30000), "A100"),
        "only-t4": (gpu_pod("only-t4", annotations={KEYS.gpu_models: "t4"}), "T4"),
        "no-t4-v100": (gpu_pod("no-t4-v100", annotations={KEYS.gpu_models_exclude: "T4,v100"}), "A100"),
        "fast": (gpu_pod("fast", annotations={KEYS.min_speed: "1.5"}), "A100"),
        "v100-speed": (
            gpu_pod("v100-speed", annotations={KEYS.min_speed: "0.9", KEYS.gpu_models: "V100"}),
            "V100",
        ),
        # Speed awareness (deploy/speed-profiles.yaml): training gains most on A100, inference on T4.
        "training": (gpu_pod("training", annotations={KEYS.workload: "llm-training"}), "A100"),
        "inference": (gpu_pod("inference", annotations={KEYS.workload: "inference"}), "T4"),
    }
    # One at a time, each served (phase allocated, as the device plugin does once the kubelet admits
    # it) before the next: the in-flight rule would otherwise keep later pods off nodes where earlier
    # ones are still being admitted, for as long as no device plugin serves them.
    for name, (pod_body, model) in cases.items():
        create(core, namespace, pod_body)
        node = wait_for(lambda n=name: node_of(core, namespace, n), what=f"pod {name} bound")
        assert model in gpu_cluster[node], f"{name} on {node} ({gpu_cluster[node]}), expected {model}"
        pod = core.read_namespaced_pod(name, namespace)
        annotations = pod.metadata.annotations
        allocation = parse_allocation(annotations[KEYS.allocation])
        assert allocation.node == node
        assert annotations[KEYS.allocation_phase] == Phase.ALLOCATING
        assert KEYS.bind_time in annotations
        [container] = allocation.containers
        assert container.name == "main"
        [grant] = container.gpus
        assert grant.uuid.startswith(f"GPU-{node}-")
        served = {"metadata": {"annotations": {KEYS.allocation_phase: Phase.ALLOCATED.value}}}
        core.patch_namespaced_pod(name, namespace, served)

    # binpack: a second pod of the same shape joins the first one's GPU, even while the first is
    # still in flight (same GPU, same quotas: the same in-flight key).
    create(core, namespace, gpu_pod("pack-1", memory=2048, cores=10, annotations={KEYS.gpu_models: "v100"}))
    first = wait_for(lambda: node_of(core, namespace, "pack-1"), what="pack-1 bound")
    create(core, namespace, gpu_pod("pack-2", memory=2048, cores=10, annotations={KEYS.gpu_models: "v100"}))
    assert wait_for(lambda: node_of(core, namespace, "pack-2"), what="pack-2 bound") == first
    grants = [
        parse_allocation(core.read_namespaced_pod(n, namespace).metadata.annotations[KEYS.allocation])
        .containers[0]
        .gpus[0]
        .uuid
        for n in ("pack-1", "pack-2")
    ]
    assert grants[0] == grants[1]


def test_an_api_server_restart_loses_nothing(
    kube: client.ApiClient,
    namespace: str,
    gpu_cluster: dict[str, str],
    extender_with_scheduler: Callable[[int], ExtenderServer],
    control_plane: ControlPlane,
) -> None:
    core = client.CoreV1Api(kube)
    extender = extender_with_scheduler(600)
    on_a100 = {"kubernetes.io/hostname": "a100-0"}

    def pinned(name: str, memory: int) -> dict[str, Any]:
        pod = gpu_pod(name, memory=memory)
        pod["spec"]["nodeSelector"] = on_a100
        return pod

    # Each of a100-0's four 40960 MiB GPUs holds a 30000 MiB pod (served one after the other, as
    # the device plugin would: the in-flight rule keeps different GPUs from being in flight at once).
    for i in range(4):
        create(core, namespace, pinned(f"fill-{i}", 30000))
        wait_for(lambda n=f"fill-{i}": node_of(core, namespace, n), what=f"fill-{i} bound")
        served = {"metadata": {"annotations": {KEYS.allocation_phase: Phase.ALLOCATED.value}}}
        core.patch_namespaced_pod(f"fill-{i}", namespace, served)
    control_plane.restart_apiserver()
    # The extender's watches and connections broke; it listed again and still counts every GPU used.
    create(core, namespace, pinned("one-more", 30000))
    create(core, namespace, pinned("small", 8000))
    assert wait_for(lambda: node_of(core, namespace, "small"), what="small bound") == "a100-0"
    wait_for(
        lambda: [
            m for m in failed_scheduling(core, namespace, "one-more") if "no GPU with 30000 MiB free" in m
        ],
        what="one-more's FailedScheduling with the extender's reason",
    )
    assert node_of(core, namespace, "one-more") is None
    assert extender.process is not None and extender.process.running


def test_impossible_pod_stays_pending_with_the_extenders_reason(
    kube: client.ApiClient,
    namespace: str,
    gpu_cluster: dict[str, str],
    extender_with_scheduler: Callable[[int], ExtenderServer],
) -> None:
    core = client.CoreV1Api(kube)
    extender_with_scheduler(600)
    create(core, namespace, gpu_pod("huge", memory=80000))
    create(core, namespace, gpu_pod("slow-only", annotations={KEYS.min_speed: "3"}))
    huge = wait_for(lambda: failed_scheduling(core, namespace, "huge"), what="FailedScheduling for huge")
    assert "0/10 nodes are available" in huge[0]
    assert "no GPU with 80000 MiB of memory; largest has 40960 MiB" in huge[0]
    slow = wait_for(lambda: failed_scheduling(core, namespace, "slow-only"), what="FailedScheduling")
    assert "no GPU with speed >= 3; node has NVIDIA A100-SXM4-40GB 2" in slow[0]
    assert node_of(core, namespace, "huge") is None
    assert node_of(core, namespace, "slow-only") is None


def test_stale_heartbeat_gets_no_new_pods(
    kube: client.ApiClient,
    namespace: str,
    gpu_cluster: dict[str, str],
    extender_with_scheduler: Callable[[int], ExtenderServer],
) -> None:
    core = client.CoreV1Api(kube)
    extender_with_scheduler(60)
    old = now() - timedelta(minutes=10)
    for name, model in gpu_cluster.items():
        if name != "a100-2":
            memory = 40960 if "A100" in model else 16384
            core.patch_node(name, {"metadata": {"annotations": node_annotations(name, model, memory, old)}})
    create(core, namespace, gpu_pod("fresh-only"))
    assert wait_for(lambda: node_of(core, namespace, "fresh-only"), what="pod bound") == "a100-2"


def _check_no_overcommit(core: client.CoreV1Api, namespace: str) -> tuple[int, int]:
    """Every GPU within memory, compute and slices by the final annotations; every pod bound with
    an allocation on its node, or Pending with a FailedScheduling reason. Returns (bound, pending)."""
    capacity = {}
    for node in core.list_node().items:
        for gpu in parse_inventory(node.metadata.annotations[KEYS.node_gpus]):
            capacity[gpu.uuid] = gpu
    memory: dict[str, int] = defaultdict(int)
    cores: dict[str, int] = defaultdict(int)
    slices: dict[str, int] = defaultdict(int)
    bound = pending = 0
    for pod in core.list_namespaced_pod(namespace).items:
        annotations = pod.metadata.annotations or {}
        if pod.spec.node_name:
            bound += 1
            allocation = parse_allocation(annotations[KEYS.allocation])
            assert allocation.node == pod.spec.node_name, pod.metadata.name
            for container in allocation.containers:
                for grant in container.gpus:
                    assert grant.uuid.startswith(f"GPU-{pod.spec.node_name}-")
                    memory[grant.uuid] += grant.memory_quota_mib
                    cores[grant.uuid] += grant.cores
                    slices[grant.uuid] += 1
        else:
            pending += 1
            assert _unschedulable_reason(pod), f"pod {pod.metadata.name} is Pending without a reason"
    for uuid, used in memory.items():
        assert used <= capacity[uuid].total_memory_mib, (
            f"{uuid}: {used} MiB > {capacity[uuid].total_memory_mib}"
        )
        assert cores[uuid] <= 100, f"{uuid}: {cores[uuid]}% compute"
        assert slices[uuid] <= SPLIT, f"{uuid}: {slices[uuid]} slices"
    return bound, pending


def _random_pods(count: int, seed: int) -> list[dict[str, Any]]:
    rng = random.Random(seed)
    pods = []
    for i in range(count):
        annotations = {}
        roll = rng.random()
        if roll < 0.1:
            annotations[KEYS.gpu_models] = rng.choice(["T4", "V100", "A100"])
        elif roll < 0.2:
            annotations[KEYS.min_speed] = "1.0"
        pods.append(
            gpu_pod(
                f"load-{i:03d}",
                vgpu=rng.choice([1, 1, 1, 2]),
                memory=rng.choice([1024, 2048, 4096, 8192, 12288, None]),
                cores=rng.choice([None, 10, 20, 30, 50]),
                annotations=annotations,
            )
        )
    return pods


def _offline_fits() -> int:
    """How many of the load pods the placement core fits when placing them one by one, in order:
    the cluster saturates well before 300."""
    engine = PlacementEngine(SpeedProfiles.from_yaml((REPO / "deploy" / "speed-profiles.yaml").read_text()))
    for name, model, memory in CLUSTER:
        engine.set_node(build_node(name, inventory(name, model, memory, count=4, split=SPLIT)))
    placed = 0
    for pod in _random_pods(300, seed=7):
        shape = shape_of(parse_pod_request(pod))
        best = choose(engine.evaluate(shape).fits)
        if best is not None:
            engine.commit(shape, best)
            placed += 1
    return placed


def _settled(core: client.CoreV1Api, namespace: str, total: int) -> bool:
    pods = core.list_namespaced_pod(namespace).items
    bound = sum(1 for p in pods if p.spec.node_name)
    waiting = [p for p in pods if not p.spec.node_name]
    if bound + len(waiting) < total:
        return False
    return all(_unschedulable_reason(p) for p in waiting)


def _unschedulable_reason(pod: Any) -> str | None:
    """The message of the pod's PodScheduled=False condition when the reason is Unschedulable (not
    a scheduler error, such as the extender being down)."""
    for condition in pod.status.conditions or []:
        if (
            condition.type == "PodScheduled"
            and condition.status == "False"
            and condition.reason == "Unschedulable"
        ):
            return condition.message  # type: ignore[no-any-return]
    return None


def _load_run(
    kube: client.ApiClient,
    namespace: str,
    extender_with_scheduler: Callable[[int], ExtenderServer],
    restart_after: int | None,
) -> tuple[int, int]:
    core = client.CoreV1Api(kube)
    extender = extender_with_scheduler(3600)
    pods = _random_pods(300, seed=7)
    with FakeDevicePlugin(kube, namespace):
        for pod in pods:
            create(core, namespace, pod)
        if restart_after is not None:
            wait_for(
                lambda: (
                    sum(1 for p in core.list_namespaced_pod(namespace).items if p.spec.node_name)
                    >= restart_after
                ),
                timeout=180,
                what=f"{restart_after} pods bound",
            )
            extender.kill()
            extender.start()
        wait_for(lambda: _settled(core, namespace, len(pods)), timeout=300, what="all pods bound or told why")
        # Settled: the count of bound pods holds still across a few seconds.
        counts = [_check_no_overcommit(core, namespace)]
        while True:
            time.sleep(5)
            counts.append(_check_no_overcommit(core, namespace))
            if counts[-1] == counts[-2]:
                return counts[-1]


def test_300_pods_at_once_never_overcommit(
    kube: client.ApiClient,
    namespace: str,
    gpu_cluster: dict[str, str],
    extender_with_scheduler: Callable[[int], ExtenderServer],
) -> None:
    bound, pending = _load_run(kube, namespace, extender_with_scheduler, restart_after=None)
    assert bound + pending == 300
    assert bound >= 0.8 * _offline_fits(), "far fewer pods bound than the cluster holds"


def test_300_pods_with_the_extender_killed_and_restarted_midway(
    kube: client.ApiClient,
    namespace: str,
    gpu_cluster: dict[str, str],
    extender_with_scheduler: Callable[[int], ExtenderServer],
) -> None:
    bound, pending = _load_run(kube, namespace, extender_with_scheduler, restart_after=40)
    assert bound + pending == 300
    assert bound >= 0.8 * _offline_fits(), "far fewer pods bound than the cluster holds"
