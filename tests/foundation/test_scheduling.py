"""The real kube-scheduler places a pod on fake nodes advertising tessera.io/vgpu (no extender yet)."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest
from kubernetes import client

from sandbox.controlplane import ManagedProcess
from tessera.contract import KEYS
from tests.waiting import wait_for

pytestmark = pytest.mark.k8s

DEFAULT_PROFILE = """\
apiVersion: kubescheduler.config.k8s.io/v1
kind: KubeSchedulerConfiguration
clientConnection:
  kubeconfig: {kubeconfig}
leaderElection:
  leaderElect: false
profiles:
- schedulerName: default-scheduler
"""


def gpu_pod(name: str, vgpu: int) -> dict[str, Any]:
    return {
        "metadata": {"name": name},
        "spec": {
            "containers": [
                {
                    "name": "main",
                    "image": "docker.io/local/cuclient:latest",
                    "resources": {"limits": {KEYS.vgpu: str(vgpu)}},
                }
            ]
        },
    }


def test_scheduler_binds_gpu_pod_and_reports_impossible_one(
    kube: client.ApiClient,
    namespace: str,
    start_scheduler: Callable[[str], ManagedProcess],
    create_fake_node: Callable[..., str],
) -> None:
    core = client.CoreV1Api(kube)
    capacity = {KEYS.vgpu: "40", "cpu": "8", "memory": "32Gi", "pods": "110"}
    nodes = {create_fake_node("gpu-node-a", capacity), create_fake_node("gpu-node-b", capacity)}
    start_scheduler(DEFAULT_PROFILE)

    core.create_namespaced_pod(namespace, gpu_pod("fits", 1))
    core.create_namespaced_pod(namespace, gpu_pod("too-big", 41))

    def node_of_fits() -> str | None:
        return core.read_namespaced_pod("fits", namespace).spec.node_name  # type: ignore[no-any-return]

    assert wait_for(node_of_fits, what="pod 'fits' bound") in nodes

    def failed_scheduling() -> list[Any]:
        events = core.list_namespaced_event(namespace, field_selector="involvedObject.name=too-big").items
        return [e for e in events if e.reason == "FailedScheduling"]

    events = wait_for(failed_scheduling, what="FailedScheduling event for 'too-big'")
    assert f"Insufficient {KEYS.vgpu}" in events[0].message
    assert core.read_namespaced_pod("too-big", namespace).spec.node_name is None
