"""Preemption by GPU shares with the real kube-apiserver and kube-scheduler (deploy/scheduler-config.yaml,
with its preemptVerb) and PriorityClasses, on fake nodes.

kube-scheduler preempts by its own view of a node: it considers a node for preemption only where its
own filters find the node short (here: the slices, ``tessera.io/vgpu``, all in use), proposes the
victims that frees by that view, and asks the extender, which answers the pods whose eviction frees
the GPU memory the pod needs.

There is no kubelet on a fake node: a victim kube-scheduler deletes keeps its deletionTimestamp and
stays, as a real pod does while its containers stop. :class:`FinishDeletions` finishes the deletion
(grace period 0) of every pod that has one, which is what the kubelet does once the containers are
gone, and records which pods it finished: exactly the pods kube-scheduler evicted.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Any

import pytest
from kubernetes import client

from tessera.contract import KEYS, QosClass, dump_inventory, format_time, now, parse_allocation
from tests.extender.conftest import ExtenderServer, PodPoller
from tests.extender.helpers import bound_to, gpu_pod, inventory
from tests.extender.test_k8s import create, failed_scheduling, node_of
from tests.waiting import wait_for

pytestmark = pytest.mark.k8s

V100 = ("Tesla V100-SXM2-16GB", 16384)
LOW = "tessera-test-low"  # a notebook's class: best-effort by the default thresholds (negative)
HIGH = "tessera-test-high"  # an inference service's: latency-critical by the default thresholds
PRIORITIES = {LOW: -10, HIGH: 1_000_000}


@pytest.fixture
def priority_classes(kube: client.ApiClient) -> Iterator[None]:
    scheduling = client.SchedulingV1Api(kube)
    for name, value in PRIORITIES.items():
        try:
            scheduling.create_priority_class({"metadata": {"name": name}, "value": value})
        except client.ApiException as e:
            if e.status != 409:
                raise
    try:
        yield
    finally:
        for name in PRIORITIES:
            scheduling.delete_priority_class(name)


class FinishDeletions(PodPoller):
    """Stands in for the kubelet on the fake nodes: finishes the deletion of pods being deleted, and
    records their names."""

    def __init__(self, api: client.ApiClient, namespace: str) -> None:
        super().__init__(api, namespace, delay=0.3)
        self.finished: set[str] = set()

    def visit(self, pod: client.V1Pod) -> None:
        if pod.metadata.deletion_timestamp is None:
            return
        try:
            self.core.delete_namespaced_pod(pod.metadata.name, self.namespace, grace_period_seconds=0)
        except client.ApiException as e:
            if e.status != 404:
                return
        self.finished.add(pod.metadata.name)


def gpu_node(create_fake_node: Callable[..., str], name: str, gpus: int, split: int = 4) -> None:
    model, memory = V100
    annotations = {
        KEYS.node_gpus: dump_inventory(inventory(name, model, memory, count=gpus, split=split)),
        KEYS.node_heartbeat: format_time(now()),
    }
    capacity = {KEYS.vgpu: str(gpus * split), "cpu": "32", "memory": "128Gi", "pods": "110"}
    create_fake_node(name, capacity, annotations)


def place_running(
    core: client.CoreV1Api,
    namespace: str,
    placed: dict[str, tuple[int, str, str, int]],
    labels: dict[str, dict[str, str]] | None = None,
) -> None:
    """Pods already running: name -> (MiB, PriorityClass, node, GPU position), bound as the extender
    binds them, served; with their ``labels`` by name."""
    for name, (memory, priority_class, node, gpu) in placed.items():
        pod = bound_to(gpu_pod(name, memory=memory, cores=None), node, gpu)
        pod["spec"]["priorityClassName"] = priority_class
        pod["metadata"]["labels"] = (labels or {}).get(name, {})
        create(core, namespace, pod)


GPU_A = {
    "a": (6144, LOW, "gpu-a", 0),
    "b": (6144, LOW, "gpu-a", 0),
    "c": (2048, LOW, "gpu-a", 0),
    "d": (1024, LOW, "gpu-a", 0),
    **{f"e{i}": (4096, LOW, "gpu-a", 1) for i in range(4)},
}


def pending(name: str, memory: int, priority_class: str, **annotations: str) -> dict[str, Any]:
    pod = gpu_pod(name, memory=memory, cores=None, annotations=annotations)
    pod["spec"]["priorityClassName"] = priority_class
    return pod


def untouched(core: client.CoreV1Api, namespace: str, names: list[str]) -> None:
    for name in names:
        pod = core.read_namespaced_pod(name, namespace)
        assert pod.metadata.deletion_timestamp is None, f"{name} is being deleted"
        assert not [c for c in pod.status.conditions or [] if c.type == "DisruptionTarget"], name


def test_the_two_pods_on_the_gpu_that_frees_enough_make_room(
    kube: client.ApiClient,
    namespace: str,
    priority_classes: None,
    create_fake_node: Callable[..., str],
    extender_with_scheduler: Callable[[int], ExtenderServer],
) -> None:
    """gpu-a: GPU 0 holds 6 + 6 + 2 + 1 GiB, GPU 1 four 4 GiB pods, all low priority, every slice in
    use. gpu-b: one GPU with three high-priority 4 GiB pods and one low one. A high-priority pod of
    12 GiB fits only where a and b (GPU 0 of gpu-a) go: no single pod frees enough anywhere, three
    of GPU 1's would, and on gpu-b the only low-priority pod frees 4 GiB."""
    core = client.CoreV1Api(kube)
    gpu_node(create_fake_node, "gpu-a", gpus=2)
    gpu_node(create_fake_node, "gpu-b", gpus=1)
    extender = extender_with_scheduler(600)
    placed = {
        **GPU_A,
        **{f"keep{i}": (4096, HIGH, "gpu-b", 0) for i in range(3)},
        "low-b": (4096, LOW, "gpu-b", 0),
    }
    place_running(core, namespace, placed)
    with FinishDeletions(kube, namespace) as kubelet:
        create(core, namespace, pending("urgent", 12288, HIGH))
        node = wait_for(lambda: node_of(core, namespace, "urgent"), timeout=120, what="urgent bound")
        assert node == "gpu-a"
        assert kubelet.finished == {"a", "b"}
    pod = core.read_namespaced_pod("urgent", namespace)
    allocation = parse_allocation(pod.metadata.annotations[KEYS.allocation])
    [grant] = allocation.containers[0].gpus
    assert (grant.uuid, grant.memory_quota_mib) == ("GPU-gpu-a-0", 12288)
    assert allocation.qos == QosClass.LATENCY_CRITICAL  # from its PriorityClass
    remaining = {p.metadata.name for p in core.list_namespaced_pod(namespace).items}
    assert remaining == set(placed) - {"a", "b"} | {"urgent"}
    untouched(core, namespace, sorted(set(placed) - {"a", "b"}))
    metrics = extender.metrics()
    assert 'tessera_extender_preemption_nodes_total{result="victims"}' in metrics
    assert 'tessera_extender_preemption_nodes_total{result="removed"}' in metrics  # gpu-b


def test_a_pod_no_preemption_helps_stays_pending_with_the_reason(
    kube: client.ApiClient,
    namespace: str,
    priority_classes: None,
    create_fake_node: Callable[..., str],
    extender_with_scheduler: Callable[[int], ExtenderServer],
) -> None:
    """gpu-b: every slice in use, mostly by high-priority pods; kube-scheduler proposes its one
    low-priority pod, which frees too little: the extender leaves the node out. gpu-c: slices free,
    memory short (its filter says so). Nothing is evicted, the pod stays Pending with the reasons."""
    core = client.CoreV1Api(kube)
    gpu_node(create_fake_node, "gpu-b", gpus=1)
    gpu_node(create_fake_node, "gpu-c", gpus=1)
    extender = extender_with_scheduler(600)
    placed = {
        **{f"keep{i}": (4096, HIGH, "gpu-b", 0) for i in range(3)},
        "low-b": (4096, LOW, "gpu-b", 0),
        "keep-c": (12288, HIGH, "gpu-c", 0),
        "low-c": (2048, LOW, "gpu-c", 0),
    }
    place_running(core, namespace, placed)
    with FinishDeletions(kube, namespace) as kubelet:
        create(core, namespace, pending("urgent", 12288, HIGH))
        create(core, namespace, pending("bad-class", 1024, HIGH, **{KEYS.qos: "urgent"}))
        events = wait_for(
            lambda: [m for m in failed_scheduling(core, namespace, "urgent") if "preemption:" in m],
            timeout=120,
            what="urgent's FailedScheduling after preemption",
        )
        assert "no GPU with 12288 MiB free; largest free 2048 MiB" in events[0]  # gpu-c, the extender's
        assert "preemption: no candidate node for preemption" in events[0]  # gpu-b, left out
        bad = wait_for(lambda: failed_scheduling(core, namespace, "bad-class"), what="bad-class refused")
        assert (
            "annotation tessera.io/qos: 'urgent' is not one of latency-critical, standard, best-effort"
            in bad[0]
        )
        wait_for(
            lambda: 'tessera_extender_preemption_nodes_total{result="removed"}' in extender.metrics(),
            what="the extender leaving gpu-b out",
        )
        assert kubelet.finished == set()
    assert node_of(core, namespace, "urgent") is None
    assert not core.read_namespaced_pod("urgent", namespace).status.nominated_node_name
    untouched(core, namespace, sorted(placed))


def test_a_disruption_budget_moves_the_eviction_to_the_other_gpu(
    kube: client.ApiClient,
    namespace: str,
    priority_classes: None,
    create_fake_node: Callable[..., str],
    extender_with_scheduler: Callable[[int], ExtenderServer],
) -> None:
    """gpu-a as above, with a and b in a PodDisruptionBudget that allows no disruption (no disruption
    controller runs here: its status says 0): the extender, reading the budget from the API server,
    answers three of GPU 1's pods, which break none, rather than a and b; the pod binds to GPU 1."""
    core = client.CoreV1Api(kube)
    gpu_node(create_fake_node, "gpu-a", gpus=2)
    extender_with_scheduler(600)
    place_running(core, namespace, GPU_A, labels={"a": {"app": "cache"}, "b": {"app": "cache"}})
    budget = {
        "metadata": {"name": "cache"},
        "spec": {"maxUnavailable": 0, "selector": {"matchLabels": {"app": "cache"}}},
    }
    client.PolicyV1Api(kube).create_namespaced_pod_disruption_budget(namespace, budget)
    with FinishDeletions(kube, namespace) as kubelet:
        create(core, namespace, pending("urgent", 12288, HIGH))
        assert (
            wait_for(lambda: node_of(core, namespace, "urgent"), timeout=120, what="urgent bound") == "gpu-a"
        )
        evicted = set(kubelet.finished)
    assert len(evicted) == 3 and evicted <= {"e0", "e1", "e2", "e3"}, evicted
    allocation = parse_allocation(
        core.read_namespaced_pod("urgent", namespace).metadata.annotations[KEYS.allocation]
    )
    assert allocation.containers[0].gpus[0].uuid == "GPU-gpu-a-1"
    untouched(core, namespace, sorted(set(GPU_A) - evicted))
