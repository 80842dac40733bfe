"""Usage-aware placement of best-effort pods with the real kube-apiserver and kube-scheduler: a node
whose one GPU is full by requests but measured mostly idle takes a best-effort pod against measured
use (an oversubscribed allocation), and a standard pod is then placed there by requests as if the
best-effort pod were not there."""

from __future__ import annotations

import json
import urllib.request
from collections.abc import Callable
from datetime import timedelta
from typing import Any

import pytest
from kubernetes import client

from tessera.contract import (
    KEYS,
    GpuGrant,
    GpuUsage,
    NodeGpuUsage,
    QosClass,
    dump_gpu_usage,
    dump_inventory,
    format_time,
    now,
    parse_allocation,
    parse_time,
)
from tests.extender.conftest import SPLIT, ExtenderServer, FakeDevicePlugin, scheduler_config
from tests.extender.helpers import gpu_pod, inventory
from tests.waiting import wait_for

pytestmark = pytest.mark.k8s

NODE = "measured"
GPU = f"GPU-{NODE}-0"


def grant_of(core: client.CoreV1Api, namespace: str, name: str) -> tuple[GpuGrant, QosClass]:
    annotations = core.read_namespaced_pod(name, namespace).metadata.annotations or {}
    allocation = parse_allocation(annotations[KEYS.allocation])
    (container,) = allocation.containers
    (grant,) = container.gpus
    return grant, allocation.qos


def create(core: client.CoreV1Api, namespace: str, pod: dict[str, Any]) -> None:
    pod["metadata"].pop("namespace", None)
    core.create_namespaced_pod(namespace, pod)


def bound(core: client.CoreV1Api, namespace: str, name: str) -> str:
    node: str = wait_for(
        lambda: core.read_namespaced_pod(name, namespace).spec.node_name, what=f"pod {name} bound"
    )
    return node


def filter_passes(extender: ExtenderServer, pod: dict[str, Any]) -> bool:
    body = json.dumps({"Pod": pod, "NodeNames": [NODE]}).encode()
    request = urllib.request.Request(
        f"{extender.url}/filter", data=body, headers={"Content-Type": "application/json"}
    )
    with urllib.request.urlopen(request, timeout=10) as response:
        return bool(json.loads(response.read())["NodeNames"])


def test_a_best_effort_pod_runs_on_measured_use_and_a_standard_pod_still_gets_its_request(
    kube: client.ApiClient,
    namespace: str,
    create_fake_node: Callable[..., str],
    start_extender: Callable[..., ExtenderServer],
    start_scheduler: Callable[[str], Any],
) -> None:
    core = client.CoreV1Api(kube)
    annotations = {
        KEYS.node_gpus: dump_inventory(inventory(NODE, "NVIDIA A100-SXM4-40GB", 40960, count=1, split=SPLIT)),
        KEYS.node_heartbeat: format_time(now()),
    }
    capacity = {KEYS.vgpu: str(SPLIT), "cpu": "32", "memory": "128Gi", "pods": "110"}
    create_fake_node(NODE, capacity, annotations)
    extender = start_extender(
        "--heartbeat-timeout=600", "--best-effort-oversubscription", "--best-effort-usage-max-age=3600"
    )
    start_scheduler(scheduler_config(extender.url))
    with FakeDevicePlugin(kube, namespace):
        # 36864 of the GPU's 40960 MiB promised to a standard pod.
        create(core, namespace, gpu_pod("guaranteed", memory=36864, cores=50))
        assert bound(core, namespace, "guaranteed") == NODE
        bind_time = parse_time(
            core.read_namespaced_pod("guaranteed", namespace).metadata.annotations[KEYS.bind_time],
            field="bind",
        )
        # The node agent measures after it started: 2048 MiB in use (margin 10% = 4096 MiB).
        wait_for(lambda: now() >= bind_time + timedelta(seconds=1), what="a second after the bind")
        usage = NodeGpuUsage(
            time=format_time(now()),
            gpus=(
                GpuUsage(uuid=GPU, memory_used_mib=2048, guaranteed_used_mib=2048, utilization_percent=30),
            ),
        )
        core.patch_node(NODE, {"metadata": {"annotations": {KEYS.node_gpu_usage: dump_gpu_usage(usage)}}})
        # kube-scheduler does not retry an unschedulable pod on a node's annotation change: ask the
        # extender (a pod without a UID holds no reservation) until its watch has the measurement.
        probe = gpu_pod("probe", memory=8192, cores=20, annotations={KEYS.qos: QosClass.BEST_EFFORT.value})
        wait_for(lambda: filter_passes(extender, probe), what="the extender placing against the measurement")

        # 8192 MiB fit only against measured use: 2048 + 4096 + 8192 <= 40960.
        create(
            core,
            namespace,
            gpu_pod("borrower", memory=8192, cores=20, annotations={KEYS.qos: QosClass.BEST_EFFORT.value}),
        )
        assert bound(core, namespace, "borrower") == NODE
        grant, qos = grant_of(core, namespace, "borrower")
        assert (grant.uuid, grant.memory_quota_mib, grant.oversubscribed, qos) == (
            GPU,
            8192,
            True,
            QosClass.BEST_EFFORT,
        )

        # A standard pod gets the 4096 MiB left by requests, as if the borrower were not there.
        create(core, namespace, gpu_pod("late", memory=4096, cores=30))
        assert bound(core, namespace, "late") == NODE
        grant, qos = grant_of(core, namespace, "late")
        assert (grant.uuid, grant.memory_quota_mib, grant.oversubscribed, qos) == (
            GPU,
            4096,
            False,
            QosClass.STANDARD,
        )

    metrics = extender.metrics()
    assert "tessera_extender_oversubscribed_binds_total 1.0" in metrics
    assert "tessera_extender_oversubscribed_gpus 1.0" in metrics
