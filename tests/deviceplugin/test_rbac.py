"""deploy/device-plugin.yaml's RBAC and admission policy, applied to the real API server: the agent
runs with its service account's token and nothing more, and may change only its own node's objects."""

from __future__ import annotations

import os
import time
import uuid
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
import yaml
from kubernetes import client, config

from sandbox.controlplane import ControlPlane
from sandbox.kubelet_standin import KubeletStandIn
from tessera.contract import (
    KEYS,
    Allocation,
    ContainerAllocation,
    GpuGrant,
    Phase,
    QosClass,
    dump_allocation,
)
from tests.deviceplugin.conftest import PluginProcess
from tests.waiting import wait_for

pytestmark = pytest.mark.k8s

DEPLOY = Path(__file__).resolve().parents[2] / "deploy" / "device-plugin.yaml"
SA_NAMESPACE = "kube-system"
SA_NAME = "tessera-device-plugin"


def _apply(api: client.ApiClient, doc: dict[str, Any]) -> None:
    kind = doc["kind"]
    if kind == "ServiceAccount":
        client.CoreV1Api(api).create_namespaced_service_account(SA_NAMESPACE, doc)
    elif kind == "ClusterRole":
        client.RbacAuthorizationV1Api(api).create_cluster_role(doc)
    elif kind == "ClusterRoleBinding":
        client.RbacAuthorizationV1Api(api).create_cluster_role_binding(doc)
    elif kind == "ValidatingAdmissionPolicy":
        client.AdmissionregistrationV1Api(api).create_validating_admission_policy(doc)
    elif kind == "ValidatingAdmissionPolicyBinding":
        client.AdmissionregistrationV1Api(api).create_validating_admission_policy_binding(doc)


def _delete(api: client.ApiClient, doc: dict[str, Any]) -> None:
    name = doc["metadata"]["name"]
    calls = {
        "ServiceAccount": lambda: client.CoreV1Api(api).delete_namespaced_service_account(name, SA_NAMESPACE),
        "ClusterRole": lambda: client.RbacAuthorizationV1Api(api).delete_cluster_role(name),
        "ClusterRoleBinding": lambda: client.RbacAuthorizationV1Api(api).delete_cluster_role_binding(name),
        "ValidatingAdmissionPolicy": lambda: client.AdmissionregistrationV1Api(
            api
        ).delete_validating_admission_policy(name),
        "ValidatingAdmissionPolicyBinding": lambda: client.AdmissionregistrationV1Api(
            api
        ).delete_validating_admission_policy_binding(name),
    }
    if doc["kind"] in calls:
        try:
            calls[doc["kind"]]()
        except client.ApiException as e:
            if e.status != 404:
                raise


@pytest.fixture
def deployed_rbac(kube: client.ApiClient) -> Iterator[None]:
    docs = list(yaml.safe_load_all(DEPLOY.read_text()))
    try:
        for doc in docs:
            _apply(kube, doc)
        yield
    finally:
        for doc in reversed(docs):
            _delete(kube, doc)


@pytest.fixture
def agent_kubeconfig(kube: client.ApiClient, control_plane: ControlPlane) -> Iterator[Callable[[str], Path]]:
    """A kubeconfig with the token the agent's pod on a node would get (bound to that pod)."""
    core = client.CoreV1Api(kube)
    pods: list[str] = []

    def make(node: str) -> Path:
        return _agent_kubeconfig(core, control_plane, node, pods)

    try:
        yield make
    finally:
        for name in pods:
            core.delete_namespaced_pod(name, SA_NAMESPACE, grace_period_seconds=0)


def _agent_kubeconfig(
    core: client.CoreV1Api, control_plane: ControlPlane, node: str, pods: list[str]
) -> Path:
    pod = core.create_namespaced_pod(
        SA_NAMESPACE,
        {
            "metadata": {"name": f"agent-{node}-{uuid.uuid4().hex[:6]}"},
            "spec": {
                "nodeName": node,
                "serviceAccountName": SA_NAME,
                "containers": [{"name": "agent", "image": "tessera:0.1.0"}],
            },
        },
    )
    pods.append(pod.metadata.name)
    token = core.create_namespaced_service_account_token(
        SA_NAME,
        SA_NAMESPACE,
        {
            "spec": {
                "audiences": [],
                "expirationSeconds": 3600,
                "boundObjectRef": {
                    "kind": "Pod",
                    "apiVersion": "v1",
                    "name": pod.metadata.name,
                    "uid": pod.metadata.uid,
                },
            }
        },
    ).status.token
    return control_plane.kubeconfig_for(token, f"agent-{node}")


@pytest.mark.usefixtures("deployed_rbac")
def test_agent_works_with_exactly_the_deployed_rbac(
    kube: client.ApiClient,
    agent_kubeconfig: Callable[[str], Path],
    kubelet: KubeletStandIn,
    create_fake_node: Callable[..., str],
    start_plugin: Callable[..., PluginProcess],
) -> None:
    namespace = "default"
    victim = f"victim-{uuid.uuid4().hex[:6]}"
    node = create_fake_node("rbac-node", {"cpu": "8", "memory": "32Gi", "pods": "110"})
    other = create_fake_node("rbac-other", {"cpu": "8", "memory": "32Gi", "pods": "110"})
    kubeconfig = agent_kubeconfig(node)
    core = client.CoreV1Api(kube)
    # A pod bound here whose allocation names a GPU this node lacks: Allocate must refuse it, mark
    # it failed and record an event: list pods, patch pods, create events, all as the agent.
    annotation = (
        '{"node":"rbac-node","containers":[{"name":"main","gpus":[{"uuid":"GPU-elsewhere",'
        '"memory_mib":1024,"cores":10}]}]}'
    )
    core.create_namespaced_pod(
        namespace,
        {
            "metadata": {
                "name": victim,
                "annotations": {KEYS.allocation: annotation, KEYS.allocation_phase: Phase.ALLOCATING.value},
            },
            "spec": {
                "nodeName": node,
                "containers": [{"name": "main", "image": "x", "resources": {"limits": {KEYS.vgpu: "1"}}}],
            },
        },
    )
    env = {k: v for k, v in os.environ.items() if k not in ("LD_LIBRARY_PATH", "LD_PRELOAD")}
    plugin = start_plugin(node, env, kubeconfig=kubeconfig)
    kubelet.wait_for(lambda k: bool(k.registrations and k.registrations[-1].device_lists))
    deadline = time.monotonic() + 30
    while KEYS.node_gpus not in (core.read_node(node).metadata.annotations or {}):
        assert time.monotonic() < deadline, plugin.log()
        time.sleep(0.2)
    with pytest.raises(Exception, match=r"GPU-elsewhere"):
        kubelet.allocate(["GPU-elsewhere::0"])
    pod = core.read_namespaced_pod(victim, namespace)
    assert pod.metadata.annotations[KEYS.allocation_phase] == Phase.FAILED.value
    events = core.list_namespaced_event(namespace, field_selector=f"involvedObject.name={victim}").items
    assert events and "GPU GPU-elsewhere is not on this node" in events[0].message
    assert "Forbidden" not in plugin.log() and "forbidden" not in plugin.log(), plugin.log()

    agent = client.CoreV1Api(config.new_client_from_config(config_file=str(kubeconfig)))
    agent.patch_node(node, {"metadata": {"annotations": {"example.com/own": "yes"}}})

    def patch_other_node() -> client.ApiException | None:
        try:
            agent.patch_node(other, {"metadata": {"annotations": {"example.com/own": "no"}}})
        except client.ApiException as e:
            return e
        return None

    # The API server loads a new admission policy from its own watch, a second or so after the
    # fixture created it: poll until the policy is in force.
    denied = wait_for(patch_other_node, timeout=30, what="the admission policy to refuse another node")
    assert denied.status == 403 and "may change only its own Node" in str(denied.body)
    # On its own node's pods, only the allocation phase; events only on pods, from its own node.
    with pytest.raises(client.ApiException) as denied_pod:
        agent.patch_namespaced_pod(victim, namespace, {"metadata": {"labels": {"example.com/x": "y"}}})
    assert "may change only the annotation" in str(denied_pod.value.body)
    with pytest.raises(client.ApiException) as denied_pod:
        agent.patch_namespaced_pod(victim, namespace, {"metadata": {"annotations": {"example.com/x": "y"}}})
    assert "may change only the annotation" in str(denied_pod.value.body)
    agent.patch_namespaced_pod(
        victim, namespace, {"metadata": {"annotations": {KEYS.allocation_phase: "failed"}}}
    )
    forged = {
        "metadata": {"generateName": "forged.", "namespace": namespace},
        "involvedObject": {"kind": "Pod", "apiVersion": "v1", "namespace": namespace, "name": victim},
        "type": "Warning",
        "reason": "Forged",
        "message": "from another node",
        "source": {"component": "tessera-device-plugin", "host": other},
        "reportingComponent": "tessera-device-plugin",
        "reportingInstance": other,
    }
    with pytest.raises(client.ApiException) as denied_event:
        agent.create_namespaced_event(namespace, forged)
    assert "may record events only on pods, from its own node" in str(denied_event.value.body) or (
        "may change only its own Node" in str(denied_event.value.body)
    )
    with pytest.raises(client.ApiException) as forbidden:
        agent.list_namespaced_secret(namespace)
    assert forbidden.value.status == 403
    # Deletes: only of best-effort pods on its own node that borrow GPU memory (evictions).
    with pytest.raises(client.ApiException) as denied_pod:
        agent.delete_namespaced_pod(victim, namespace)
    assert "may delete only best-effort pods that borrow GPU memory" in str(denied_pod.value.body)
    borrowing = dump_allocation(
        Allocation(
            node=node,
            containers=(
                ContainerAllocation(
                    name="main",
                    gpus=(GpuGrant(uuid="GPU-0", memory_quota_mib=1024, cores=0, oversubscribed=True),),
                ),
            ),
            qos=QosClass.BEST_EFFORT,
        )
    )
    here, there = f"borrower-{uuid.uuid4().hex[:6]}", f"borrower-{uuid.uuid4().hex[:6]}"
    for name, on in ((here, node), (there, other)):
        core.create_namespaced_pod(
            namespace,
            {
                "metadata": {"name": name, "annotations": {KEYS.allocation: borrowing}},
                "spec": {"nodeName": on, "containers": [{"name": "main", "image": "x"}]},
            },
        )
    with pytest.raises(client.ApiException) as denied_pod:
        agent.delete_namespaced_pod(there, namespace)
    assert "may change only its own Node and the pods" in str(denied_pod.value.body)
    agent.delete_namespaced_pod(here, namespace, grace_period_seconds=0)
    core.delete_namespaced_pod(there, namespace, grace_period_seconds=0)
