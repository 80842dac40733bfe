"""Live resize with the real kube-apiserver and kube-scheduler: a request on a running pod is
applied or refused by the extender, on the pod's own GPU, against everything else placed there; and
Kubernetes' own in-place resize cannot change Tessera's resources (the pinned API server refuses it)."""

from __future__ import annotations

import json
import random
import re
from collections.abc import Callable
from typing import Any

import pytest
from kubernetes import client

from tessera.contract import (
    KEYS,
    ResizeOutcome,
    ResizeStatus,
    dump_inventory,
    format_time,
    now,
    parse_allocation,
    parse_resize_status,
)
from tests.extender.conftest import SPLIT, ExtenderServer, FakeDevicePlugin
from tests.extender.helpers import gpu_pod, inventory
from tests.waiting import wait_for

pytestmark = pytest.mark.k8s

NODE = "solo"
GPU = f"GPU-{NODE}-0"


def quotas(core: client.CoreV1Api, namespace: str, name: str) -> tuple[int, int]:
    annotations = core.read_namespaced_pod(name, namespace).metadata.annotations or {}
    (container,) = parse_allocation(annotations[KEYS.allocation]).containers
    (grant,) = container.gpus
    return grant.memory_quota_mib, grant.cores


def ask(core: client.CoreV1Api, namespace: str, name: str, text: str) -> ResizeStatus:
    """Annotate the pod with the request, as `kubectl annotate` does; the answer once written."""
    core.patch_namespaced_pod(name, namespace, {"metadata": {"annotations": {KEYS.resize: text}}})

    def answered() -> ResizeStatus | None:
        annotations = core.read_namespaced_pod(name, namespace).metadata.annotations or {}
        status = annotations.get(KEYS.resize_status)
        if KEYS.resize in annotations or status is None:
            return None
        parsed = parse_resize_status(status)
        return parsed if parsed.request == text else None

    return wait_for(answered, what=f"the answer to the resize {text!r} of {name}")


def create_pod(core: client.CoreV1Api, namespace: str, name: str, memory: int, cores: int) -> None:
    pod = gpu_pod(name, memory=memory, cores=cores)
    pod["metadata"].pop("namespace")
    core.create_namespaced_pod(namespace, pod)


def wait_allocated(core: client.CoreV1Api, namespace: str, name: str) -> None:
    """Until the pod is bound and its containers were given their GPUs (phase allocated)."""

    def allocated() -> bool:
        annotations = core.read_namespaced_pod(name, namespace).metadata.annotations or {}
        return annotations.get(KEYS.allocation_phase) == "allocated"

    wait_for(allocated, what=f"{name} bound and allocated")


def one_gpu_node(create_fake_node: Callable[..., str]) -> None:
    annotations = {
        KEYS.node_gpus: dump_inventory(inventory(NODE, "Tesla T4", 15360, count=1, split=SPLIT)),
        KEYS.node_heartbeat: format_time(now()),
    }
    capacity = {KEYS.vgpu: str(SPLIT), "cpu": "32", "memory": "128Gi", "pods": "110"}
    create_fake_node(NODE, capacity, annotations)


def test_a_resize_is_applied_on_the_pods_gpu_or_refused_naming_the_shortfall(
    kube: client.ApiClient,
    namespace: str,
    create_fake_node: Callable[..., str],
    extender_with_scheduler: Callable[[int], ExtenderServer],
) -> None:
    core = client.CoreV1Api(kube)
    one_gpu_node(create_fake_node)
    extender = extender_with_scheduler(600)
    with FakeDevicePlugin(kube, namespace):
        for name, memory, cores in (("small", 1024, 30), ("large", 12288, 40)):
            create_pod(core, namespace, name, memory, cores)
        for name in ("small", "large"):
            wait_allocated(core, namespace, name)

        applied = ask(core, namespace, "small", "memory=2048,cores=60")
        assert applied.outcome is ResizeOutcome.APPLIED, applied
        assert quotas(core, namespace, "small") == (2048, 60)

        # 2048 + 12288 of 15360 MiB are taken: 8192 is 6144 more, with 1024 free.
        refused = ask(core, namespace, "small", "memory=8192")
        assert refused.outcome is ResizeOutcome.REFUSED
        assert (
            refused.message
            == f"GPU {GPU} on node {NODE}: 6144 MiB more memory asked, 1024 MiB of 15360 MiB free"
        )
        assert quotas(core, namespace, "small") == (2048, 60)  # nothing changed
        refused = ask(core, namespace, "large", "cores=61")
        assert refused.message == f"GPU {GPU} on node {NODE}: 21% more compute asked, 0% of 100% free"

        bad = ask(core, namespace, "small", "memory=lots")
        assert bad.outcome is ResizeOutcome.REFUSED
        assert bad.message == f"annotation {KEYS.resize}: value: memory: 'lots' is not a whole number"

        # Shrinking always fits, and what it gives back is free for the next pod at once.
        assert ask(core, namespace, "large", "memory=4096,cores=10").outcome is ResizeOutcome.APPLIED
        assert quotas(core, namespace, "large") == (4096, 10)
        create_pod(core, namespace, "third", 9216, 30)
        wait_for(
            lambda: core.read_namespaced_pod("third", namespace).spec.node_name == NODE, what="third bound"
        )

    events = core.list_namespaced_event(namespace, field_selector="involvedObject.name=small").items
    reasons = sorted(e.reason for e in events if e.reason.startswith("TesseraResize"))
    assert reasons == ["TesseraResizeRefused", "TesseraResizeRefused", "TesseraResized"], reasons
    metrics = extender.metrics()
    assert 'tessera_extender_resizes_total{result="applied"} 2.0' in metrics
    assert 'tessera_extender_resizes_total{result="refused"} 3.0' in metrics


def test_kubernetes_in_place_resize_cannot_change_tessera_resources(
    kube: client.ApiClient, namespace: str
) -> None:
    """The pinned API server refuses a resize (the pods/resize subresource, and a plain update) of an
    extended resource: Tessera's live resize is the only way, and this test says when that changes."""
    core = client.CoreV1Api(kube)
    pod = gpu_pod("fixed", memory=1024, cores=30)
    pod["metadata"].pop("namespace")
    pod["spec"]["nodeName"] = "anywhere"
    core.create_namespaced_pod(namespace, pod)
    changed: dict[str, Any] = {
        "spec": {
            "containers": [
                {
                    "name": "main",
                    "resources": {
                        "limits": {KEYS.vgpu_memory: "2048"},
                        "requests": {KEYS.vgpu_memory: "2048"},
                    },
                }
            ]
        }
    }
    for patch, why in (
        (core.patch_namespaced_pod_resize, "spec: Forbidden: only cpu and memory resources are mutable"),
        (core.patch_namespaced_pod, "spec: Forbidden: pod updates may not change fields other than"),
    ):
        with pytest.raises(client.ApiException) as refused:
            patch("fixed", namespace, changed)
        assert refused.value.status == 422, (patch.__name__, refused.value.body)
        assert why in json.loads(refused.value.body)["message"]
    (container,) = core.read_namespaced_pod("fixed", namespace).spec.containers
    assert container.resources.limits[KEYS.vgpu_memory] == "1024"


def test_concurrent_resizes_and_new_pods_never_overcommit_a_gpu(
    kube: client.ApiClient,
    namespace: str,
    create_fake_node: Callable[..., str],
    extender_with_scheduler: Callable[[int], ExtenderServer],
) -> None:
    """The smaller real-API version of tests/extender/test_resizing.py: 60 operations, new pods and
    resize requests sent without waiting for each other's answers."""
    core = client.CoreV1Api(kube)
    one_gpu_node(create_fake_node)
    extender = extender_with_scheduler(600)
    rng = random.Random(16)
    created: list[str] = []
    asked: dict[str, str] = {}
    with FakeDevicePlugin(kube, namespace, delay=0.2):
        for step in range(60):
            allocated = [n for n in created if KEYS.allocation in (annotations_of(core, namespace, n))]
            if allocated and rng.random() < 0.6:
                name = rng.choice(allocated)
                text = f"memory={rng.choice([512, 2048, 4096, 8192, 12288])},cores={rng.randint(1, 60)}"
                core.patch_namespaced_pod(name, namespace, {"metadata": {"annotations": {KEYS.resize: text}}})
                asked[name] = text
            else:
                pod = gpu_pod(f"p{step}", memory=rng.choice([512, 1024, 2048]), cores=rng.randint(1, 20))
                pod["metadata"].pop("namespace")
                core.create_namespaced_pod(namespace, pod)
                created.append(f"p{step}")
        wait_for(
            lambda: all(KEYS.resize not in annotations_of(core, namespace, n) for n in asked),
            timeout=120,
            what="every resize request answered",
        )
    memory = cores = 0
    for pod in core.list_namespaced_pod(namespace).items:
        text = (pod.metadata.annotations or {}).get(KEYS.allocation)
        if pod.spec.node_name and text:
            for container in parse_allocation(text).containers:
                for grant in container.gpus:
                    memory += grant.memory_quota_mib
                    cores += grant.cores
    assert memory <= 15360 and cores <= 100, (memory, cores)
    metrics = extender.metrics()
    for result in ("applied", "refused"):
        counted = re.search(rf'^tessera_extender_resizes_total{{result="{result}"}} (\S+)$', metrics, re.M)
        assert counted and float(counted.group(1)) > 0, (result, metrics)


def annotations_of(core: client.CoreV1Api, namespace: str, name: str) -> dict[str, str]:
    return dict(core.read_namespaced_pod(name, namespace).metadata.annotations or {})


def test_a_resize_is_held_against_the_namespaces_resource_quota(
    kube: client.ApiClient,
    namespace: str,
    create_fake_node: Callable[..., str],
    extender_with_scheduler: Callable[[int], ExtenderServer],
) -> None:
    """The quota controller counts pods' specs, not their resizes: a tenant with a quota of 4096 MiB
    of GPU memory resizing its 1024 MiB pod to 8192 MiB is refused, naming the quota, though the GPU
    has room; up to the quota is applied; and what resized pods hold beyond their specs counts for
    the next resize in the namespace."""
    core = client.CoreV1Api(kube)
    one_gpu_node(create_fake_node)
    extender_with_scheduler(600)
    memory = f"requests.{KEYS.vgpu_memory}"

    def quota_counts(used_mib: int) -> None:
        # What the quota controller writes (the test's control plane does not run it): the specs' sum.
        core.patch_namespaced_resource_quota_status(
            "gpu", namespace, {"status": {"hard": {memory: "4096"}, "used": {memory: str(used_mib)}}}
        )

    with FakeDevicePlugin(kube, namespace):
        for name in ("own", "second"):
            create_pod(core, namespace, name, 1024, 10)
            wait_allocated(core, namespace, name)
        core.create_namespaced_resource_quota(
            namespace, {"metadata": {"name": "gpu"}, "spec": {"hard": {memory: "4096"}}}
        )
        quota_counts(2048)

        refused = ask(core, namespace, "own", "memory=8192")
        assert refused.outcome is ResizeOutcome.REFUSED, refused
        assert refused.message.startswith(
            f"namespace {namespace}'s ResourceQuota gpu allows {memory} 4096; with this resize its pods "
            "would hold 9216"
        ), refused.message
        assert quotas(core, namespace, "own") == (1024, 10)

        applied = ask(core, namespace, "own", "memory=3072")  # 2048 by specs + 2048 beyond: 4096
        assert applied.outcome is ResizeOutcome.APPLIED, applied
        assert quotas(core, namespace, "own") == (3072, 10)
        # The quota still counts 2048 (specs); the other pod's growth meets the first's.
        again = ask(core, namespace, "second", "memory=2048")
        assert again.outcome is ResizeOutcome.REFUSED, again
        assert "resized pods hold 3072 beyond them, 1024 of it this resize's" in again.message, again.message
        # Shrinking passes, and gives back what it held beyond its spec.
        assert ask(core, namespace, "own", "memory=1024").outcome is ResizeOutcome.APPLIED
        assert ask(core, namespace, "second", "memory=2048").outcome is ResizeOutcome.APPLIED
