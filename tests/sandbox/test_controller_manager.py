"""The sandbox's kube-controller-manager (every default controller, ``*``) on a real control plane
without kubelets: node-lifecycle marks a node that stops reporting not ready, taints it and its pods
are evicted per their tolerations, while a fake node (``sandbox add-node``) stays Ready and
untainted past the controller's grace."""

from __future__ import annotations

import contextlib
import re
import threading
import time
from collections.abc import Iterator

import pytest
from kubernetes import client, config

from sandbox import fakenode
from sandbox.controlplane import ControlPlane, fake_node_body
from tests.waiting import wait_for

pytestmark = pytest.mark.k8s

# What a chart's workloads need (Deployments, DaemonSets, Jobs, tokens and the kube-root-ca.crt
# ConfigMap, garbage collection, endpoints, namespaces, quotas), and what a node's loss needs.
NEEDED = {
    "deployment-controller",
    "replicaset-controller",
    "daemonset-controller",
    "job-controller",
    "serviceaccount-token-controller",
    "root-ca-certificate-publisher-controller",
    "garbage-collector-controller",
    "endpointslice-controller",
    "namespace-controller",
    "resourcequota-controller",
    "node-lifecycle-controller",
    "taint-eviction-controller",
}
# Past node-lifecycle's --node-monitor-grace-period (50 s) and its --node-startup-grace-period (60 s).
ALIVE_FOR_S = 65.0


@pytest.fixture(scope="module")
def plane(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ControlPlane]:
    with ControlPlane(work_dir=tmp_path_factory.mktemp("kcm-plane")) as started:
        started.start_controller_manager()
        yield started


@pytest.fixture
def core(plane: ControlPlane) -> Iterator[client.CoreV1Api]:
    api = config.new_client_from_config(config_file=str(plane.kubeconfig))
    try:
        yield client.CoreV1Api(api)
    finally:
        api.close()


def test_it_runs_the_default_controllers_a_chart_and_a_nodes_loss_need(plane: ControlPlane) -> None:
    log = plane.work_dir / "logs" / "kube-controller-manager.log"

    def missing() -> set[str]:
        return NEEDED - set(re.findall(r'"Started controller" controller="([a-z-]+)"', log.read_text()))

    wait_for(lambda: not missing(), timeout=30, what="the controllers started")
    # The root CA file holds kube-apiserver's CA only, not its serving certificate.
    assert (plane.work_dir / "pki" / "ca.crt").read_text().count("BEGIN CERTIFICATE") == 1


def _taints(core: client.CoreV1Api, node: str) -> list[str]:
    return [f"{t.key}:{t.effect}" for t in core.read_node(node).spec.taints or []]


def _ready(core: client.CoreV1Api, node: str) -> str:
    conditions = core.read_node(node).status.conditions or []
    return next((c.status for c in conditions if c.type == "Ready"), "absent")


def _evicted(core: client.CoreV1Api, pod: str) -> bool:
    try:
        return core.read_namespaced_pod(pod, "default").metadata.deletion_timestamp is not None
    except client.ApiException as e:
        if e.status == 404:
            return True
        raise


def test_a_fake_node_stays_ready_while_a_silent_one_is_tainted_and_its_pod_evicted(
    core: client.CoreV1Api, plane: ControlPlane
) -> None:
    alive, silent = "fake-alive", "fake-silent"
    stop = threading.Event()
    keeper_api = config.new_client_from_config(config_file=str(plane.kubeconfig))
    keeper = threading.Thread(
        target=fakenode.keep_alive,
        args=(client.CoreV1Api(keeper_api), alive, fakenode.inventory(alive, ["t4"]), stop),
        daemon=True,
    )
    keeper.start()
    # A node that reported Ready once and then nothing more: a kubelet that died.
    body = fake_node_body(silent, {"cpu": "8", "memory": "32Gi", "pods": "110"})
    status = body.pop("status")
    core.create_node(body)
    core.patch_node_status(silent, {"status": status})
    pod = {
        "metadata": {"name": "on-silent"},
        "spec": {
            "nodeName": silent,
            "containers": [{"name": "c", "image": "never-pulled"}],
            "tolerations": [
                {
                    "key": "node.kubernetes.io/unreachable",
                    "operator": "Exists",
                    "effect": "NoExecute",
                    "tolerationSeconds": 5,
                }
            ],
        },
    }
    core.create_namespaced_pod("default", pod)
    start = time.monotonic()
    try:
        wait_for(lambda: _ready(core, alive) == "True", timeout=30, what=f"{alive} Ready")
        evicted = False
        while not evicted or time.monotonic() - start < ALIVE_FOR_S:
            assert (_ready(core, alive), _taints(core, alive)) == ("True", []), time.monotonic() - start
            evicted = evicted or _evicted(core, "on-silent")
            assert time.monotonic() - start < 120, "the silent node's pod not evicted"
            time.sleep(2)
        assert _ready(core, silent) == "Unknown"
        assert "node.kubernetes.io/unreachable:NoExecute" in _taints(core, silent)
    finally:
        stop.set()
        keeper.join(timeout=30)
        keeper_api.close()
        with contextlib.suppress(client.ApiException):
            core.delete_namespaced_pod("on-silent", "default", grace_period_seconds=0)
        for node in (alive, silent):
            with contextlib.suppress(client.ApiException):
                core.delete_node(node)
