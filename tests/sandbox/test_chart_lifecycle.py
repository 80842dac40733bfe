"""The chart's lifecycle on the sandbox, as a platform team lives it, in order on one sandbox: an
upgrade that changes the placement policy, the leading scheduler pod deleted while 50 GPU pods wait,
and `helm uninstall`. (The node agent's pod deleted and recreated is in test_gpu_path.py.)"""

from __future__ import annotations

import copy
import time
from collections import defaultdict
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import yaml
from kubernetes import client

from sandbox import cluster, install
from tessera.contract import KEYS, parse_allocation, parse_inventory
from tests.sandbox.conftest import HostView, Sandbox, running_sandbox
from tests.waiting import wait_for

pytestmark = pytest.mark.sandbox

EXAMPLES = Path(__file__).resolve().parents[2] / "deploy" / "examples"
SCHEDULER = "tessera-scheduler"


# 30 slices per GPU: room for the 50 pods of the failover test on the node's two GPUs.
SPLIT = 30


@pytest.fixture(scope="module")
def chart_sandbox(request: pytest.FixtureRequest) -> Iterator[tuple[Sandbox, HostView]]:
    with running_sandbox("chart", request.session, values=(f"devicePlugin.split={SPLIT}",)) as running:
        yield running


@pytest.fixture
def sbx(chart_sandbox: tuple[Sandbox, HostView]) -> Sandbox:
    return chart_sandbox[0]


def probe_pod(name: str, memory_mib: int, cores: int, *, idle: bool = False) -> dict[str, Any]:
    """A vgpu-probe pod of deploy/examples/shared-gpu.yaml with this share and no model wish;
    ``idle``: its container only waits (no probe run), to keep 50 of them light."""
    [template] = [d for d in yaml.safe_load_all((EXAMPLES / "shared-gpu.yaml").read_text()) if d][:1]
    pod = copy.deepcopy(template)
    pod["metadata"] = {"name": name}
    container = pod["spec"]["containers"][0]
    container["resources"]["limits"].update({KEYS.vgpu_memory: str(memory_mib), KEYS.vgpu_cores: str(cores)})
    if idle:
        container["command"] = ["/bin/sh", "-c", "trap 'exit 0' TERM; while :; do sleep 3600 & wait $!; done"]
    return dict(pod)


def helm(sbx: Sandbox, *args: str) -> str:
    return install.helm(Path(sbx.state.kubernetes_bin) / "helm", Path(sbx.state.kubeconfig), *args)


def grant(sbx: Sandbox, name: str) -> tuple[str, int, int]:
    pod = sbx.core.read_namespaced_pod(name, "default")
    (g,) = parse_allocation(pod.metadata.annotations[KEYS.allocation]).containers[0].gpus
    return g.uuid, g.memory_quota_mib, g.cores


def gpu_uuids(sbx: Sandbox) -> dict[str, str]:
    node = sbx.core.read_node(sbx.state.node)
    return {g.model: g.uuid for g in parse_inventory(node.metadata.annotations[KEYS.node_gpus])}


def scheduler_template_hash(sbx: Sandbox) -> set[str]:
    pods = client.CoreV1Api(sbx.api).list_namespaced_pod(
        install.NAMESPACE, label_selector=install.EXTENDER_SELECTOR
    )
    return {
        p.metadata.labels.get("pod-template-hash", "")
        for p in pods.items
        if not p.metadata.deletion_timestamp
    }


def rolled_out(sbx: Sandbox) -> bool:
    deployment = client.AppsV1Api(sbx.api).read_namespaced_deployment(SCHEDULER, install.NAMESPACE)
    status = deployment.status
    return bool(
        status.observed_generation == deployment.metadata.generation
        and status.updated_replicas == deployment.spec.replicas
        and status.ready_replicas == deployment.spec.replicas
        and (status.replicas or 0) == deployment.spec.replicas
    )


def test_upgrade_changing_the_policy_rolls_the_scheduler_and_keeps_running_pods(sbx: Sandbox) -> None:
    """binpack takes the GPU that fits tightest (the T4 for 1 GiB), spread the emptiest (the A100)."""
    uuids = gpu_uuids(sbx)
    a100, t4 = uuids["NVIDIA A100-SXM4-40GB"], uuids["Tesla T4"]
    sbx.core.create_namespaced_pod("default", probe_pod("under-binpack", 1024, 10))
    sbx.wait_pod("under-binpack", "Running")
    assert grant(sbx, "under-binpack") == (t4, 1024, 10)
    hashes_before = scheduler_template_hash(sbx)

    helm(sbx, "upgrade", install.RELEASE, str(install.CHART), "--namespace", install.NAMESPACE,
         "--reuse-values", "--set", "extender.policy=spread")  # fmt: skip
    wait_for(lambda: rolled_out(sbx) and scheduler_template_hash(sbx).isdisjoint(hashes_before), timeout=180,
             what="the tessera-scheduler Deployment rolled out with the new policy")  # fmt: skip
    wait_for(lambda: install.extenders_ready(sbx.api), timeout=120, what="the new extenders ready")

    # The running pod keeps its GPU and its quota.
    assert sbx.core.read_namespaced_pod("under-binpack", "default").status.phase == "Running"
    assert grant(sbx, "under-binpack") == (t4, 1024, 10)
    sbx.core.create_namespaced_pod("default", probe_pod("under-spread", 1024, 10))
    sbx.wait_pod("under-spread", "Running")
    assert grant(sbx, "under-spread") == (a100, 1024, 10)


def leader_pod(sbx: Sandbox) -> str:
    lease = client.CoordinationV1Api(sbx.api).read_namespaced_lease(SCHEDULER, install.NAMESPACE)
    holder = lease.spec.holder_identity or ""
    return holder.split("_", 1)[0]


def overcommitted(sbx: Sandbox) -> list[str]:
    """GPUs whose pods' allocations add up to more memory or cores than the GPU has."""
    capacity = {}
    for node in sbx.core.list_node().items:
        text = (node.metadata.annotations or {}).get(KEYS.node_gpus)
        for g in parse_inventory(text) if text else ():
            capacity[g.uuid] = g.total_memory_mib
    memory: dict[str, int] = defaultdict(int)
    cores: dict[str, int] = defaultdict(int)
    for pod in sbx.core.list_pod_for_all_namespaces().items:
        text = (pod.metadata.annotations or {}).get(KEYS.allocation)
        if text and pod.status.phase not in ("Succeeded", "Failed"):
            for container in parse_allocation(text).containers:
                for g in container.gpus:
                    memory[g.uuid] += g.memory_quota_mib
                    cores[g.uuid] += g.cores
    return [
        f"{uuid}: {memory[uuid]}/{capacity.get(uuid)} MiB, {cores[uuid]}% cores"
        for uuid in memory
        if memory[uuid] > capacity.get(uuid, 0) or cores[uuid] > 100
    ]


def test_losing_the_leading_scheduler_pod_loses_no_scheduling(sbx: Sandbox) -> None:
    """50 GPU pods pending; the leading tessera-scheduler pod is deleted once a few are bound: the
    other replica takes over, every pod is bound and runs, no GPU holds more than it has.

    One shape for all: pods in flight on one node must share their in-flight key (tessera/inflight.py),
    so identical pods bind without waiting for each other's Allocate. 512 MiB each fills the T4
    (binpack) and spills onto the A100: the new leader must count what the old one placed."""
    names = [f"wave-{i:02d}" for i in range(50)]
    for name in names:
        sbx.core.create_namespaced_pod("default", probe_pod(name, 512, 2, idle=True))

    def pods() -> list[Any]:
        return [p for p in sbx.core.list_namespaced_pod("default").items if p.metadata.name in names]

    def bound() -> int:
        return sum(1 for p in pods() if p.spec.node_name)

    wait_for(lambda: bound() >= 5, timeout=120, what="the first pods bound")
    leader = leader_pod(sbx)
    assert leader, "no tessera-scheduler holds the lease"
    sbx.core.delete_namespaced_pod(leader, install.NAMESPACE)
    began = time.monotonic()
    wait_for(lambda: bound() == len(names), timeout=240, what="all 50 pods bound after the leader was lost")
    print(
        f"all bound {time.monotonic() - began:.1f}s after deleting the leader {leader}; new leader {leader_pod(sbx)}"
    )
    # The old leader released its Lease on its way out; the other replica takes it within the
    # election's retry period (all pods may be bound before then: kube-scheduler binds asynchronously).
    wait_for(lambda: leader_pod(sbx) not in ("", leader), timeout=60, what="the other replica to lead")
    assert overcommitted(sbx) == []

    def not_running() -> list[str]:
        return [f"{p.metadata.name}: {p.status.phase} {p.status.reason or ''} {p.status.message or ''}"
                for p in pods() if p.status.phase != "Running"]  # fmt: skip

    try:
        wait_for(lambda: not not_running(), timeout=300, what="all 50 pods Running")
    except AssertionError as e:
        raise AssertionError(f"{e}: {not_running()[:10]}") from None
    assert overcommitted(sbx) == []
    wait_for(lambda: rolled_out(sbx), timeout=180, what="the Deployment back to its replicas")
    for name in names:
        sbx.core.delete_namespaced_pod(name, "default", grace_period_seconds=0)


def test_uninstall_removes_every_object_and_the_slices(sbx: Sandbox) -> None:
    helm(sbx, "uninstall", install.RELEASE, "--namespace", install.NAMESPACE, "--wait")
    apps = client.AppsV1Api(sbx.api)
    assert apps.list_namespaced_daemon_set(install.NAMESPACE).items == []
    assert apps.list_namespaced_deployment(install.NAMESPACE).items == []
    assert [c.metadata.name for c in sbx.core.list_namespaced_config_map(install.NAMESPACE).items] == [
        "kube-root-ca.crt"
    ]
    assert [s.metadata.name for s in sbx.core.list_namespaced_service_account(install.NAMESPACE).items] == [
        "default"
    ]
    rbac = client.RbacAuthorizationV1Api(sbx.api)
    prefix = f"{install.RELEASE}-"
    assert [
        r.metadata.name for r in rbac.list_cluster_role().items if r.metadata.name.startswith(prefix)
    ] == []
    assert [
        b.metadata.name for b in rbac.list_cluster_role_binding().items if b.metadata.name.startswith(prefix)
    ] == []
    admission = client.AdmissionregistrationV1Api(sbx.api)
    assert [p.metadata.name for p in admission.list_validating_admission_policy().items] == []
    wait_for(lambda: sbx.core.list_namespaced_pod(install.NAMESPACE).items == [], timeout=120,
             what="the chart's pods gone")  # fmt: skip

    def slices() -> str:
        return str((sbx.core.read_node(sbx.state.node).status.allocatable or {}).get(KEYS.vgpu, "0"))

    wait_for(lambda: slices() == "0", timeout=90, what="the node's slices gone from its allocatable")
    status = cluster.status(sbx.root)
    assert status["up"]
