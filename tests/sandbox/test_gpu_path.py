"""The whole path on a real node, the issue's checks in order: pods from deploy/examples/ are placed
by kube-scheduler through the extender, admitted by the real kubelet after the device plugin's
Allocate, and the hook holds their quotas over the fake driver inside the containers; every Tessera
component is a pod installed by the chart. Then the kubelet is restarted and the node agent's pod
replaced under running pods, and a node added for a pod only it fits, then removed. On the shared
sandbox (tests/sandbox/conftest.py); a clean `down` after a sandbox like this one:
test_cluster_services.py."""

from __future__ import annotations

import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import grpc
import pytest
import yaml
from kubernetes.stream import stream

from proto.podresources.v1 import api_pb2, api_pb2_grpc
from sandbox import cluster, gpu, install
from sandbox.layout import Layout
from tessera.contract import KEYS, Phase, parse_allocation, parse_inventory, slice_gpu
from tests.sandbox.conftest import Sandbox
from tests.waiting import wait_for

pytestmark = pytest.mark.sandbox

EXAMPLES = Path(__file__).resolve().parents[2] / "deploy" / "examples"
A100, T4 = gpu.SANDBOX_GPUS
CUDA_ERROR_OUT_OF_MEMORY = 2


def _example(file: str, name: str) -> dict[str, Any]:
    for doc in yaml.safe_load_all((EXAMPLES / file).read_text()):
        if doc["metadata"]["name"] == name:
            return dict(doc)
    raise KeyError(f"{name} not in {file}")


def _another(name: str) -> dict[str, Any]:
    """quota-1g under a new name and without its model wish: the A100 has 20 % of its time left
    after the two example pods, so the extender places it on the T4."""
    pod = _example("shared-gpu.yaml", "quota-1g")
    return {**pod, "metadata": {"name": name}}


def _probe_output(text: str) -> dict[str, str]:
    """The probe's last report ("key=value" lines; a later run overwrites an earlier one)."""
    return dict(line.split("=", 1) for line in text.splitlines() if "=" in line)


@pytest.fixture(scope="module")
def sbx(shared_sandbox: Sandbox) -> Sandbox:
    return shared_sandbox


def _exec_probe(sandbox: Sandbox, pod: str, timeout: float = 30) -> str:
    """`kubectl exec POD -- vgpu-probe 256` through the apiserver and the kubelet. Retried: a kubelet
    just restarted answers exec with nothing until it has synced its pods again."""
    deadline = time.monotonic() + timeout
    while True:
        out: str = stream(
            sandbox.core.connect_get_namespaced_pod_exec,
            pod,
            "default",
            command=["vgpu-probe", "256"],
            stderr=True,
            stdin=False,
            stdout=True,
            tty=False,
        )
        if "refused_with=" in out or time.monotonic() > deadline:
            return out
        time.sleep(1)


def _run_probe_pod(sandbox: Sandbox, pod: dict[str, Any]) -> tuple[Any, dict[str, str]]:
    name = pod["metadata"]["name"]
    sandbox.core.create_namespaced_pod("default", pod)
    running = sandbox.wait_pod(name, "Running")
    return running, _probe_output(sandbox.logs(name, until="refused_with="))


def test_node_advertises_both_fake_gpus(sbx: Sandbox) -> None:
    node = sbx.core.read_node(sbx.state.node)
    inventory = parse_inventory(node.metadata.annotations[KEYS.node_gpus])
    assert [(g.model, g.total_memory_mib) for g in inventory] == [(A100.model, 40960), (T4.model, 15360)]
    assert int(node.status.allocatable[KEYS.vgpu]) == sum(g.split for g in inventory)


def test_pod_is_placed_by_the_extender_admitted_after_allocate_and_held_to_its_quota(sbx: Sandbox) -> None:
    pod, report = _run_probe_pod(sbx, _example("shared-gpu.yaml", "quota-1g"))
    annotations = pod.metadata.annotations
    assert annotations[KEYS.allocation_phase] == Phase.ALLOCATED  # the device plugin's Allocate ran
    assert KEYS.bind_time in annotations  # the extender bound it
    allocation = parse_allocation(annotations[KEYS.allocation])
    assert allocation.node == sbx.state.node == pod.spec.node_name
    (grant,) = allocation.for_container("probe").gpus  # type: ignore[union-attr]
    assert (grant.uuid, grant.memory_quota_mib, grant.cores) == (A100.uuid, 1024, 30)
    # Inside the container, through the hook over the fake driver:
    assert report["device"] == A100.model
    assert report["total_mib"] == "1024"
    assert report["allocations_ok"] == "4"
    assert report["refused_with"] == str(CUDA_ERROR_OUT_OF_MEMORY)


def test_second_pod_shares_the_gpu_with_its_own_quota(sbx: Sandbox) -> None:
    pod, report = _run_probe_pod(sbx, _example("shared-gpu.yaml", "quota-3g"))
    (grant,) = parse_allocation(pod.metadata.annotations[KEYS.allocation]).containers[0].gpus
    first = sbx.core.read_namespaced_pod("quota-1g", "default")
    (first_grant,) = parse_allocation(first.metadata.annotations[KEYS.allocation]).containers[0].gpus
    assert grant.uuid == first_grant.uuid == A100.uuid
    assert (grant.memory_quota_mib, grant.cores) == (3072, 50)
    assert report["total_mib"] == "3072"
    assert report["chunk_mib"] == "512"
    assert report["allocations_ok"] == "6"


def test_pod_that_fits_nowhere_stays_pending_with_the_extenders_reason(sbx: Sandbox) -> None:
    sbx.core.create_namespaced_pod("default", _example("too-big.yaml", "too-big"))
    deadline = time.monotonic() + 60
    messages: list[str] = []
    while time.monotonic() < deadline and not any("81920 MiB" in m for m in messages):
        events = sbx.core.list_namespaced_event("default", field_selector="involvedObject.name=too-big").items
        messages = [e.message for e in events if e.reason == "FailedScheduling"]
        time.sleep(1)
    assert any("81920 MiB" in m and "largest has 40960 MiB" in m for m in messages), messages
    pod = sbx.core.read_namespaced_pod("too-big", "default")
    assert pod.status.phase == "Pending" and not pod.spec.node_name


def _container_ids(sbx: Sandbox, names: list[str]) -> dict[str, str]:
    return {
        n: sbx.core.read_namespaced_pod(n, "default").status.container_statuses[0].container_id for n in names
    }


def test_kubelet_restart_keeps_running_pods_and_their_quotas_and_admits_a_new_pod(sbx: Sandbox) -> None:
    before = _container_ids(sbx, ["quota-1g", "quota-3g"])
    cluster.restart(sbx.root, "kubelet")
    assert _container_ids(sbx, ["quota-1g", "quota-3g"]) == before  # the same containers, not restarted
    # A new process in the old container is still held to the pod's quota.
    again = _probe_output(_exec_probe(sbx, "quota-1g"))
    assert (again["total_mib"], again["allocations_ok"]) == ("1024", "4")
    _, report = _run_probe_pod(sbx, _another("after-kubelet-restart"))
    assert (report["total_mib"], report["allocations_ok"]) == ("1024", "4")


def _kubelet_allocations(root: Path) -> dict[tuple[str, str], set[str]]:
    """(pod, container) -> physical GPUs of its tessera slices, from the kubelet's pod-resources API."""
    socket = Layout(root).kubelet_root / "pod-resources" / "kubelet.sock"
    with grpc.insecure_channel(f"unix://{socket}") as channel:
        response = api_pb2_grpc.PodResourcesListerStub(channel).List(
            api_pb2.ListPodResourcesRequest(), timeout=10
        )
    found: dict[tuple[str, str], set[str]] = {}
    for pod in response.pod_resources:
        for container in pod.containers:
            ids = [i for d in container.devices if d.resource_name == KEYS.vgpu for i in d.device_ids]
            if ids:
                found[(pod.name, container.name)] = {slice_gpu(i) for i in ids}
    return found


def _annotated_allocations(sbx: Sandbox) -> dict[tuple[str, str], set[str]]:
    found: dict[tuple[str, str], set[str]] = {}
    for pod in sbx.core.list_namespaced_pod("default").items:
        text = (pod.metadata.annotations or {}).get(KEYS.allocation)
        if text and pod.status.phase == "Running":
            for container in parse_allocation(text).containers:
                found[(pod.metadata.name, container.name)] = {g.uuid for g in container.gpus}
    return found


def test_deleted_agent_pod_is_recreated_reregisters_and_quotas_and_allocations_hold(sbx: Sandbox) -> None:
    """The node agent's pod deleted: the DaemonSet makes a new one, which registers with the kubelet
    again; running containers keep their quotas (their limits files are on the host) and new pods
    are admitted."""
    old = {p.metadata.name for p in install.agent_pods(sbx.api, sbx.state.node)}
    new = cluster.replace_agent(sbx.root)
    assert new not in old
    again = _probe_output(_exec_probe(sbx, "quota-1g"))
    assert (again["total_mib"], again["allocations_ok"]) == ("1024", "4")
    kubelet_view = _kubelet_allocations(sbx.root)
    assert kubelet_view == _annotated_allocations(sbx)
    assert set(kubelet_view) >= {
        ("quota-1g", "probe"),
        ("quota-3g", "probe"),
        ("after-kubelet-restart", "probe"),
    }
    _, report = _run_probe_pod(sbx, _another("after-plugin-restart"))
    assert (report["device"], report["total_mib"], report["allocations_ok"]) == (T4.model, "1024", "4")


def test_added_node_without_kubelet_takes_what_fits_only_there(sbx: Sandbox) -> None:
    """A pod no GPU can take waits with the extender's reason; adding a node that fits places it.

    The pod is Pending before the node comes, as when a cluster grows for a waiting pod: the node's
    arrival (its capacity appearing) is the event on which kube-scheduler tries the pod again.
    """
    big = _another("needs-80g")
    big["spec"]["containers"][0]["resources"]["limits"][KEYS.vgpu_memory] = "61440"
    sbx.core.create_namespaced_pod("default", big)
    wait_for(
        lambda: (
            sbx.core.list_namespaced_event(
                "default", field_selector="involvedObject.name=needs-80g,reason=FailedScheduling"
            ).items
        ),
        timeout=60,
        what="needs-80g Pending with a FailedScheduling event",
    )
    result = subprocess.run(
        [
            sys.executable,
            "-m",
            "tessera.cli",
            "sandbox",
            "add-node",
            "edge-1",
            "--gpu",
            "a100-80",
            "--dir",
            str(sbx.root),
        ],
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    assert result.returncode == 0, result.stderr
    try:
        deadline = time.monotonic() + 60
        while (
            not sbx.core.read_namespaced_pod("needs-80g", "default").spec.node_name
            and time.monotonic() < deadline
        ):
            time.sleep(0.5)
        pod = sbx.core.read_namespaced_pod("needs-80g", "default")
        events = sbx.core.list_namespaced_event(
            "default", field_selector="involvedObject.name=needs-80g"
        ).items
        assert pod.spec.node_name == "edge-1", [f"{e.reason}: {e.message}" for e in events]
        assert parse_allocation(pod.metadata.annotations[KEYS.allocation]).node == "edge-1"
        nodes = {n["name"]: n for n in cluster.status(sbx.root)["nodes"]}
        assert nodes["edge-1"]["slices"] == 10
        assert [g["model"] for g in nodes["edge-1"]["gpus"]] == ["NVIDIA A100-SXM4-80GB"]
        sbx.core.delete_namespaced_pod("needs-80g", "default", grace_period_seconds=0)

    finally:
        cluster.remove_node(sbx.root, "edge-1")
