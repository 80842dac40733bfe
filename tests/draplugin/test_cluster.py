"""The DRA path's API side on a real Kubernetes 1.37 control plane and a node without a kubelet: the
driver's ResourceSlice as the API server keeps it, the DRA manifests as it validates them, and which
pods kube-scheduler asks an extender about. Claims allocated, prepared and run on a real kubelet:
test_node.py."""

from __future__ import annotations

import json
import subprocess
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

import pytest
from kubernetes import client

from draplugin.health import GPU_UNHEALTHY_REASON
from sandbox.controlplane import ControlPlane
from tessera.contract import KEYS
from tessera.placement.qos import QOS_LOWERED_REASON
from tests.deviceplugin.conftest import FakeGpus
from tests.draplugin.conftest import NODE, ROOT, Cluster, DriverProcess, wait_published
from tests.draplugin.kubelet_standin import claim as claim_message
from tests.draplugin.kubelet_standin import register
from tests.waiting import wait_for

pytestmark = pytest.mark.k8s

GIB = 2**30
A100 = 'device.attributes["tessera.io"].model == "A100"'


def test_the_slice_as_the_api_server_keeps_it(cluster: Cluster, start_driver: Any) -> None:
    driver = start_driver()
    published = wait_published(driver, cluster.api)
    assert published["spec"]["pool"]["name"] == NODE
    a100, t4 = published["spec"]["devices"]
    assert a100["allowMultipleAllocations"] is True
    assert a100["attributes"]["model"] == {"string": "A100"}
    assert t4["attributes"]["model"] == {"string": "T4"}
    assert a100["attributes"]["numaNode"] == {"int": 0}
    assert a100["capacity"]["memory"]["value"] == str(40 * GIB)
    assert t4["capacity"]["cores"]["requestPolicy"]["validRange"]["max"] == "100"


class RecordingExtender:
    """A scheduler extender that passes every node and records which pods it was asked about."""

    def __init__(self) -> None:
        self.asked: list[str] = []
        recorder = self

        class Handler(BaseHTTPRequestHandler):
            def do_POST(self) -> None:
                args = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
                recorder.asked.append(args["Pod"]["metadata"]["name"])
                body = json.dumps({"NodeNames": args["NodeNames"], "FailedNodes": {}, "Error": ""}).encode()
                self.send_response(200)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)

            def log_message(self, *args: object) -> None:
                pass

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.thread = threading.Thread(target=self.server.serve_forever, daemon=True)
        self.thread.start()

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.server.server_address[1]}"

    def stop(self) -> None:
        self.server.shutdown()
        self.server.server_close()


def test_the_extender_is_not_asked_about_dra_pods(
    cluster: Cluster, start_driver: Any, dra_cluster: ControlPlane
) -> None:
    """kube-scheduler calls an extender with managedResources only for pods that request one of
    them: Tessera's extender never sees a DRA pod, so its placement does not apply to claims."""
    wait_published(start_driver(), cluster.api)
    extender = RecordingExtender()
    config = (
        "apiVersion: kubescheduler.config.k8s.io/v1\nkind: KubeSchedulerConfiguration\n"
        "clientConnection:\n  kubeconfig: {kubeconfig}\n"
        "profiles:\n  - schedulerName: tessera-scheduler\n"
        f"extenders:\n  - urlPrefix: {extender.url}\n    filterVerb: filter\n    nodeCacheCapable: true\n"
        f"    managedResources:\n      - name: {KEYS.vgpu}\n        ignoredByScheduler: true\n"
    )
    scheduler = dra_cluster.start_scheduler(config, name="kube-scheduler-extender")
    try:
        cluster.create_claim("share", {"memory": "1Gi"}, A100)
        cluster.create_pod("dra", "share", scheduler="tessera-scheduler")
        cluster.create_plain_pod("vgpu", {KEYS.vgpu: "1"}, scheduler="tessera-scheduler")
        wait_for(lambda: "vgpu" in extender.asked, 90.0, "the extender asked about the vgpu pod")
        assert cluster.allocated("share")["device"] == "gpu-0"
        wait_for(
            lambda: cluster.core.read_namespaced_pod("dra", cluster.namespace).spec.node_name,
            60.0,
            "dra bound",
        )
        assert "dra" not in extender.asked
    finally:
        dra_cluster.stop_process(scheduler)
        extender.stop()


def test_an_allocated_claims_capacity_cannot_change(cluster: Cluster, start_driver: Any) -> None:
    """Why a DRA pod has no live resize (docs/dra.md, "Live resize"): the API server refuses any
    change to a claim's allocation once written, so the capacity kube-scheduler counts for it stays
    what it was allocated with (and its spec, the request, is immutable from the start)."""
    wait_published(start_driver(), cluster.api)
    cluster.create_claim("fixed", {"memory": "1Gi"}, A100)
    cluster.create_pod("holder", "fixed")
    assert cluster.allocated("fixed")["consumedCapacity"]["memory"] == str(GIB)
    claim = cluster.claim("fixed")
    claim["status"]["allocation"]["devices"]["results"][0]["consumedCapacity"]["memory"] = str(2 * GIB)
    with pytest.raises(client.ApiException) as refused:
        cluster.objects.replace_namespaced_custom_object_status(
            "resource.k8s.io", "v1", cluster.namespace, "resourceclaims", "fixed", claim
        )
    assert refused.value.status == 422
    assert "cannot be modified once set" in str(refused.value.body)
    assert "status.allocation" in str(refused.value.body)
    grown = cluster.claim("fixed")
    grown["spec"]["devices"]["requests"][0]["exactly"]["capacity"]["requests"]["memory"] = "2Gi"
    with pytest.raises(client.ApiException) as refused:
        cluster.objects.replace_namespaced_custom_object(
            "resource.k8s.io", "v1", cluster.namespace, "resourceclaims", "fixed", grown
        )
    assert refused.value.status == 422
    assert cluster.allocated("fixed")["consumedCapacity"]["memory"] == str(GIB)


def test_the_dra_manifests_are_accepted_by_the_api_server(dra_cluster: ControlPlane) -> None:
    """deploy/dra-driver.yaml (the chart in DRA mode) as the API server validates it (dry run)."""
    kubectl = dra_cluster.bin_dir / "kubectl"
    applied = subprocess.run(
        [
            str(kubectl),
            f"--kubeconfig={dra_cluster.kubeconfig}",
            "apply",
            "--server-side",
            "--dry-run=server",
            "--force-conflicts",
            "-f",
            str(ROOT / "deploy" / "dra-driver.yaml"),
        ],
        capture_output=True,
        text=True,
        check=False,
    )
    assert applied.returncode == 0, applied.stderr
    assert "daemonset.apps/tessera-dra serverside-applied (server dry run)" in applied.stdout


def test_a_claim_asking_more_than_its_pods_priority_grants_is_lowered_with_an_event(
    cluster: Cluster, start_driver: Any, tmp_path: Path
) -> None:
    """Prepare on the real API server (a kubelet stand-in calls it): the driver reads the pod in the
    claim's status.reservedFor, its priority (from a -10 PriorityClass) grants best-effort only, so the
    claim asking for latency-critical is prepared best-effort and the pod gets QosClassLowered."""
    driver = start_driver()
    wait_published(driver, cluster.api)
    scheduling = client.SchedulingV1Api(cluster.api)
    priority_class = f"scavenger-{cluster.namespace}"
    scheduling.create_priority_class({"metadata": {"name": priority_class}, "value": -10})
    kubelet = None
    try:
        parameters = {
            "apiVersion": KEYS.dra_config_api_version,
            "kind": "GpuShareConfig",
            "qos": "latency-critical",
        }
        cluster.create_claim("asks", {"memory": "1Gi"}, A100, parameters)
        cluster.create_pod("scavenger", "asks", priority_class=priority_class)
        cluster.allocated("asks")
        reserved = wait_for(
            lambda: (cluster.claim("asks").get("status") or {}).get("reservedFor"), 60.0, "the claim reserved"
        )
        pod = cluster.core.read_namespaced_pod("scavenger", cluster.namespace)
        assert reserved == [{"resource": "pods", "name": "scavenger", "uid": pod.metadata.uid}]
        uid = cluster.claim("asks")["metadata"]["uid"]
        kubelet = register(driver.registration_socket, KEYS.dra_driver)
        answer = kubelet.prepare(claim_message(cluster.namespace, "asks", uid))
        assert answer.claims[uid].error == ""
        limits = (tmp_path / "state" / "claims" / uid / "limits.d" / "limits").read_text().splitlines()
        assert "qos best-effort" in limits
        assert len(list((tmp_path / "state" / "coordination").glob(f"*/best-effort/{uid}"))) == 1
        events = wait_for(
            lambda: [
                e
                for e in cluster.core.list_namespaced_event(
                    cluster.namespace, field_selector="involvedObject.name=scavenger"
                ).items
                if e.reason == QOS_LOWERED_REASON
            ],
            30.0,
            "the QosClassLowered event",
        )
        [event] = events
        assert event.type == "Warning"
        assert event.involved_object.uid == pod.metadata.uid
        assert (event.source.component, event.source.host) == ("tessera-dra", NODE)
        assert event.message.startswith(
            f"claim {cluster.namespace}/asks ({uid}): asked for QoS class latency-critical"
        )
        assert "runs as best-effort: priority -10" in event.message
    finally:
        if kubelet is not None:
            kubelet.close()
        scheduling.delete_priority_class(priority_class)


def device_taints(driver: DriverProcess, api: client.ApiClient) -> list[list[dict[str, Any]]]:
    """Each device's taints in the slice as the API server keeps it, in slice order."""
    found = driver.slice(api)
    assert found is not None
    return [d.get("taints", []) for d in found["spec"]["devices"]]


def test_a_failed_gpu_is_tainted_within_5s_new_claims_avoid_it_its_pods_are_told_and_it_recovers(
    cluster: Cluster, start_driver: Any, fake_gpus: FakeGpus
) -> None:
    """A fatal XID on the A100: within 5 s its device carries a NoExecute taint, the pod whose
    prepared claim uses it gets a TesseraGpuUnhealthy event and is evicted by kube-controller-manager's
    device taint eviction controller, and kube-scheduler allocates a new claim to the T4 (first fit
    would take the A100). Lost and back (a reset): the taint goes."""
    driver = start_driver()
    wait_published(driver, cluster.api)
    wait_for(lambda: "watching XID events of 2 GPU(s)" in driver.process.log_tail(100), 30.0, "the XID watch")
    cluster.create_claim("running", {"memory": "1Gi"}, A100)
    cluster.create_pod("victim", "running")
    assert cluster.allocated("running")["device"] == "gpu-0"
    wait_for(lambda: (cluster.claim("running").get("status") or {}).get("reservedFor"), 60.0, "reserved")
    uid = cluster.claim("running")["metadata"]["uid"]
    kubelet = register(driver.registration_socket, KEYS.dra_driver)
    try:
        assert kubelet.prepare(claim_message(cluster.namespace, "running", uid)).claims[uid].error == ""
    finally:
        kubelet.close()
    victim = cluster.core.read_namespaced_pod("victim", cluster.namespace)

    fake_gpus.inject_xid(0, 79)  # fallen off the bus: fatal
    injected = time.monotonic()
    wait_for(lambda: device_taints(driver, cluster.api)[0], 5.0, "the A100's device tainted")
    assert time.monotonic() - injected < 5.0
    [taint] = device_taints(driver, cluster.api)[0]
    assert (taint["key"], taint["value"], taint["effect"]) == (
        KEYS.dra_unhealthy_taint,
        "xid-79",
        "NoExecute",
    )
    assert taint["timeAdded"]
    assert device_taints(driver, cluster.api)[1] == []

    [event] = wait_for(
        lambda: [
            e
            for e in cluster.core.list_namespaced_event(
                cluster.namespace, field_selector="involvedObject.name=victim"
            ).items
            if e.reason == GPU_UNHEALTHY_REASON
        ],
        30.0,
        "the TesseraGpuUnhealthy event",
    )
    assert event.type == "Warning" and event.involved_object.uid == victim.metadata.uid
    assert (event.source.component, event.source.host) == ("tessera-dra", NODE)
    assert event.message.startswith(f"claim {cluster.namespace}/running ({uid}): GPU {fake_gpus.uuids[0]}")
    assert "critical XID 79" in event.message and "tessera.io/unhealthy=xid-79:NoExecute" in event.message

    def evicted() -> bool:
        pod = cluster.core.read_namespaced_pod("victim", cluster.namespace)
        conditions = {(c.type, c.reason) for c in pod.status.conditions or []}
        return (
            pod.metadata.deletion_timestamp is not None
            and ("DisruptionTarget", "DeletionByDeviceTaintManager") in conditions
        )

    wait_for(evicted, 30.0, "the victim evicted by the device taint eviction controller")

    cluster.create_claim("fresh", {"memory": "1Gi"})
    cluster.create_pod("newcomer", "fresh")
    assert cluster.allocated("fresh")["device"] == "gpu-1"

    fake_gpus.set_lost(0, True)
    wait_for(lambda: device_taints(driver, cluster.api)[0][0]["value"] == "gone", 5.0, "the A100 gone")
    fake_gpus.set_lost(0, False)
    wait_for(lambda: device_taints(driver, cluster.api) == [[], []], 5.0, "the A100's taint gone")
    cluster.create_claim("again", {"memory": "1Gi"}, A100)
    cluster.create_pod("returning", "again")
    assert cluster.allocated("again")["device"] == "gpu-0"
