"""The DRA path's API side on a real Kubernetes 1.37 control plane and a node without a kubelet: the
driver's ResourceSlice as the API server keeps it, the DRA manifests as it validates them, which
pods kube-scheduler asks an extender about, and the driver's /metrics as scrapers' tokens allow. Claims allocated, prepared and run on a real kubelet:
test_node.py."""

from __future__ import annotations

import contextlib
import json
import re
import subprocess
import threading
import time
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

import pytest
import yaml
from kubernetes import client
from kubernetes.utils import parse_quantity
from prometheus_client.parser import text_string_to_metric_families

from draplugin.claims import OVERCOMMITTED
from draplugin.health import GPU_UNHEALTHY_REASON
from hook.limits import DeviceLimit, write_limits
from sandbox.controlplane import ControlPlane, fake_node_body
from tessera import cli
from tessera.contract import KEYS
from tessera.placement.qos import QOS_LOWERED_REASON
from tests.deviceplugin.conftest import CUCLIENT, HOOK_LIBRARY, FakeGpus
from tests.draplugin.conftest import GROUP, NODE, ROOT, VERSION, Cluster, DriverProcess, wait_published
from tests.draplugin.kubelet_standin import claim as claim_message
from tests.draplugin.kubelet_standin import register
from tests.scraping import get, host_address, service_account_token
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
        self.offered: dict[str, list[str]] = {}  # per pod, the nodes kube-scheduler last asked about
        recorder = self

        class Handler(BaseHTTPRequestHandler):
            def do_POST(self) -> None:
                args = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
                recorder.asked.append(args["Pod"]["metadata"]["name"])
                recorder.offered[args["Pod"]["metadata"]["name"]] = list(args["NodeNames"])
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


def extended_resource_claim(cluster: Cluster, pod: str) -> tuple[str, list[dict[str, str]]]:
    """The claim kube-scheduler made for the pod's extended resources, and the pod's mappings of its
    containers' resources to the claim's requests (``status.extendedResourceClaimStatus``)."""

    def written() -> Any:
        return cluster.core.read_namespaced_pod(pod, cluster.namespace).status.extended_resource_claim_status

    status = wait_for(written, 90.0, f"pod {pod}'s extendedResourceClaimStatus")
    mappings = [
        {"container": m.container_name, "resource": m.resource_name, "request": m.request_name}
        for m in status.request_mappings
    ]
    return str(status.resource_claim_name), mappings


def test_a_pod_asking_whole_gpus_gets_them_whole_from_kube_scheduler(
    cluster: Cluster, start_driver: Any, tmp_path: Path
) -> None:
    """KEP-5004: a pod with tessera.io/whole-gpu: 1 in its limits and no claim. kube-scheduler makes
    it a claim of Tessera's class (one device, no capacity asked), allocates it with the request
    policy's defaults (all the memory, no compute quota), and the driver prepares exactly that: the GPU
    is the pod's alone (a second such pod takes the other GPU, a 1 GiB share then fits nowhere)."""
    driver = start_driver()
    wait_published(driver, cluster.api)
    cluster.create_plain_pod("whole", {KEYS.whole_gpu: "1"}, scheduler="default-scheduler")
    name, mappings = extended_resource_claim(cluster, "whole")
    assert mappings == [{"container": "main", "resource": KEYS.whole_gpu, "request": "container-0-request-0"}]
    pod = cluster.core.read_namespaced_pod("whole", cluster.namespace)
    claim = cluster.claim(name)
    assert claim["metadata"]["annotations"] == {"resource.kubernetes.io/extended-resource-claim": "true"}
    [owner] = claim["metadata"]["ownerReferences"]
    assert (owner["kind"], owner["uid"]) == ("Pod", pod.metadata.uid)
    [request] = claim["spec"]["devices"]["requests"]
    assert request == {
        "name": "container-0-request-0",
        "exactly": {"deviceClassName": KEYS.dra_device_class, "allocationMode": "ExactCount", "count": 1},
    }
    result = cluster.allocated(name)
    assert (result["pool"], result["device"]) == (NODE, "gpu-0")
    assert {k: int(parse_quantity(v)) for k, v in result["consumedCapacity"].items()} == {
        "memory": 40 * GIB,
        "cores": 0,
    }
    wait_for(
        lambda: cluster.core.read_namespaced_pod("whole", cluster.namespace).spec.node_name == NODE,
        60.0,
        "whole bound",
    )
    reserved = wait_for(
        lambda: (cluster.claim(name).get("status") or {}).get("reservedFor"), 60.0, "reserved"
    )
    assert reserved == [{"resource": "pods", "name": "whole", "uid": pod.metadata.uid}]

    # The driver prepares what kube-scheduler counted: the whole memory, cores 0 (no compute quota).
    uid = claim["metadata"]["uid"]
    kubelet = register(driver.registration_socket, KEYS.dra_driver)
    try:
        answer = kubelet.prepare(claim_message(cluster.namespace, name, uid))
        assert answer.claims[uid].error == ""
        [device] = answer.claims[uid].devices
        assert list(device.request_names) == ["container-0-request-0"]
    finally:
        kubelet.close()
    limits = (tmp_path / "state" / "claims" / uid / "limits.d" / "limits").read_text().splitlines()
    [gpu] = [line for line in limits if line.startswith("device ")]
    assert gpu.endswith(f" memory {40 * GIB} cores 0")

    # Whole: nothing else fits on the A100. The next such pod gets the T4, then a share fits nowhere.
    cluster.create_plain_pod("whole-2", {KEYS.whole_gpu: "1"}, scheduler="default-scheduler")
    assert cluster.allocated(extended_resource_claim(cluster, "whole-2")[0])["device"] == "gpu-1"
    cluster.create_claim("share", {"memory": "1Gi"})
    cluster.create_pod("share", "share")
    assert "cannot allocate all claims" in cluster.unschedulable("share")


def test_in_a_mixed_cluster_whole_gpus_come_from_dra_nodes_and_vgpu_from_the_extenders(
    cluster: Cluster, start_driver: Any, dra_cluster: ControlPlane
) -> None:
    """A DRA node (the driver's slice) beside a device plugin node (tessera.io/vgpu allocatable),
    kube-scheduler with the extender's managedResources of deploy/scheduler-config.yaml: a whole-GPU pod
    lands on the DRA node and the extender never hears of it (nor of one that adds a memory quota,
    which fits nowhere); a vgpu pod with a memory quota is offered to the extender on the device
    plugin node only and lands there. And why the DeviceClass does not
    name tessera.io/vgpu: then kube-scheduler refuses that vgpu pod on every node, as its
    vgpu-memory is neither a node's resource nor a DeviceClass's."""
    wait_published(start_driver(), cluster.api)
    deploy_config = yaml.safe_load((ROOT / "deploy" / "scheduler-config.yaml").read_text())
    [tessera_extender] = deploy_config["extenders"]
    extender = RecordingExtender()
    config = (
        "apiVersion: kubescheduler.config.k8s.io/v1\nkind: KubeSchedulerConfiguration\n"
        "clientConnection:\n  kubeconfig: {kubeconfig}\n"
        "profiles:\n  - schedulerName: tessera-scheduler\n"
        + yaml.safe_dump(
            {
                "extenders": [
                    {
                        "urlPrefix": extender.url,
                        "filterVerb": "filter",
                        "nodeCacheCapable": True,
                        "managedResources": tessera_extender["managedResources"],
                    }
                ]
            }
        )
    )
    plugin_node = "device-plugin-node"
    body = fake_node_body(plugin_node, {"cpu": "8", "memory": "32Gi", "pods": "110", KEYS.vgpu: "20"})
    status = body.pop("status")
    cluster.core.create_node(body)
    cluster.core.patch_node_status(plugin_node, {"status": status})
    mapped = f"vgpu-mapped-{cluster.namespace}"
    scheduler = dra_cluster.start_scheduler(config, name="kube-scheduler-mixed")
    try:
        cluster.create_plain_pod("whole", {KEYS.whole_gpu: "1"}, scheduler="tessera-scheduler")
        vgpu = {KEYS.vgpu: "1", KEYS.vgpu_memory: "1024"}
        cluster.create_plain_pod("vgpu", vgpu, scheduler="tessera-scheduler")

        def node_of(pod: str) -> str | None:
            return cluster.core.read_namespaced_pod(pod, cluster.namespace).spec.node_name  # type: ignore[no-any-return]

        assert wait_for(lambda: node_of("whole"), 90.0, "whole bound") == NODE
        assert wait_for(lambda: node_of("vgpu"), 90.0, "vgpu bound") == plugin_node
        assert extender.offered["vgpu"] == [plugin_node]
        assert "whole" not in extender.asked
        # A memory quota cannot be added to whole GPUs: vgpu-memory is the extender's, on no DRA node.
        cluster.create_plain_pod(
            "whole-quota", {KEYS.whole_gpu: "1", KEYS.vgpu_memory: "1024"}, scheduler="tessera-scheduler"
        )
        assert "cannot fit resource" in cluster.unschedulable("whole-quota")
        assert "whole-quota" not in extender.asked

        device_class = {
            "apiVersion": f"{GROUP}/{VERSION}",
            "kind": "DeviceClass",
            "metadata": {"name": mapped},
            "spec": {
                "selectors": [{"cel": {"expression": f'device.driver == "{KEYS.dra_driver}"'}}],
                "extendedResourceName": KEYS.vgpu,
            },
        }
        cluster.objects.create_cluster_custom_object(GROUP, VERSION, "deviceclasses", device_class)
        cluster.create_plain_pod("vgpu-mapped", vgpu, scheduler="tessera-scheduler")
        assert "cannot fit resource" in cluster.unschedulable("vgpu-mapped")
        assert "vgpu-mapped" not in extender.asked
    finally:
        dra_cluster.stop_process(scheduler)
        extender.stop()
        with contextlib.suppress(client.ApiException):
            cluster.objects.delete_cluster_custom_object(GROUP, VERSION, "deviceclasses", mapped)
        cluster.core.delete_node(plugin_node)


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
            lambda: cluster.events("scavenger", QOS_LOWERED_REASON),
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


def test_a_claim_allocated_past_its_gpus_capacity_waits_until_the_node_has_room(
    cluster: Cluster, start_driver: Any
) -> None:
    """kube-scheduler's lost bind (docs/dra.md, "Allocated past a device's capacity"), as it leaves
    the API server: a second claim allocated on the A100 beside a first, 120 of its 100 cores in all,
    and reserved for a pod bound to the node. The driver prepares the first, refuses the second
    naming the first, and prepares it once the first is unprepared."""
    driver = start_driver()
    wait_published(driver, cluster.api)
    share = {"memory": "1Gi", "cores": "60"}
    cluster.create_claim("first", share, A100)
    cluster.create_pod("first", "first")
    cluster.allocated("first")
    cluster.create_claim("second", share, A100)
    cluster.allocate_as_lost_bind("second", "first", NODE)
    wait_for(
        lambda: (cluster.claim("first").get("status") or {}).get("reservedFor"),
        60.0,
        "the first claim reserved",
    )
    first, second = (
        claim_message(cluster.namespace, name, cluster.claim(name)["metadata"]["uid"])
        for name in ("first", "second")
    )
    kubelet = register(driver.registration_socket, KEYS.dra_driver)
    try:
        assert kubelet.prepare(first).claims[first.uid].error == ""
        refused = kubelet.prepare(second).claims[second.uid].error
        assert OVERCOMMITTED in refused, refused
        assert "gpu-0 (" in refused and "120 of its 100 cores" in refused, refused
        assert f"beside those prepared on it ({cluster.namespace}/first)" in refused, refused
        assert kubelet.prepare(second).claims[second.uid].error == refused  # the kubelet's retry
        kubelet.unprepare(first)
        assert kubelet.prepare(second).claims[second.uid].error == ""
    finally:
        kubelet.close()


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
        lambda: cluster.events("victim", GPU_UNHEALTHY_REASON),
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


@contextlib.contextmanager
def a_claim_in_use(
    cluster: Cluster, driver: DriverProcess, fake_gpus: FakeGpus, tmp_path: Path
) -> Iterator[str]:
    """Pod ``trainer``'s own claim (2 GiB and 30% of the A100, from template ``train``) for its
    container ``main``, prepared by a kubelet stand-in, and a process of its containers holding 1 GiB
    of it through the hook, which keeps that in the claim's accounting region; yields the claim's
    name, then unprepares it."""
    cluster.create_claim_template("train", {"memory": "2Gi", "cores": "30"}, A100)
    cluster.create_pod("trainer", "train", template=True)
    name = cluster.claim_of("trainer")
    cluster.allocated(name)
    wait_for(lambda: (cluster.claim(name).get("status") or {}).get("reservedFor"), 60.0, "the claim reserved")
    uid = cluster.claim(name)["metadata"]["uid"]
    kubelet = register(driver.registration_socket, KEYS.dra_driver)
    holder = None
    try:
        assert kubelet.prepare(claim_message(cluster.namespace, name, uid)).claims[uid].error == ""
        limits = tmp_path / "container-limits"
        region = tmp_path / "state" / "claims" / uid / "state" / "region"
        write_limits(limits, [DeviceLimit(fake_gpus.specs[0].uuid, 2 * GIB, 30)], region=str(region))
        env = {**fake_gpus.env(), "LD_PRELOAD": str(HOOK_LIBRARY), "TESSERA_LIMITS_FILE": str(limits)}
        holder = subprocess.Popen(
            [str(CUCLIENT), "alloc", "mem", "1g", "1", "hold"],
            env=env,
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            text=True,
        )
        assert holder.stdout is not None
        while (line := holder.stdout.readline()) and line.strip() != "hold ready":
            assert "CUDA_SUCCESS" in line, line
        yield name
        kubelet.unprepare(claim_message(cluster.namespace, name, uid))
    finally:
        if holder is not None:
            holder.kill()
            holder.wait(timeout=30)
        kubelet.close()


def test_a_prepared_claims_series_are_served_to_an_allowed_scraper_only(
    cluster: Cluster, start_driver: Any, fake_gpus: FakeGpus, tmp_path: Path
) -> None:
    """The real driver prepares a pod's own claim (a kubelet stand-in calls it) for its one container:
    its /metrics has the claim's tessera_container_* series, labelled as the device plugin's with the
    claim's name, its use read from the claim's accounting region (a process on the fake GPU writes
    it through the hook); no token is 401, a tenant's token 403; unprepared, the series go."""
    driver = start_driver()
    wait_published(driver, cluster.api)
    reader = service_account_token(cluster.api, "prometheus", reader=True)
    tenant = service_account_token(cluster.api, "tenant", reader=False, namespace=cluster.namespace)
    url = f"http://127.0.0.1:{driver.metrics_port()}/metrics"
    with a_claim_in_use(cluster, driver, fake_gpus, tmp_path) as claim_name:
        status, text = get(url, reader)
        assert status == 200, text
        assert get(url, None)[0] == 401
        assert get(url, tenant)[0] == 403
    series = {
        (s.name, frozenset(s.labels.items())): s.value
        for family in text_string_to_metric_families(text)
        for s in family.samples
    }
    labels = frozenset(
        {
            "namespace": cluster.namespace,
            "pod": "trainer",
            "container": "main",
            "claim": claim_name,
            "Hostname": NODE,
            "UUID": fake_gpus.specs[0].uuid,
            "modelName": "NVIDIA A100-SXM4-40GB",
        }.items()
    )
    assert series["tessera_container_memory_quota_bytes", labels] == 2 * GIB
    assert series["tessera_container_compute_quota_ratio", labels] == 0.3
    assert series["tessera_container_memory_used_bytes", labels] == GIB
    assert series["tessera_container_memory_peak_bytes", labels] == GIB
    # The GPU's series, as the device plugin's: its allocation is the claim's quotas; NVML's reading
    # sees the process's gigabyte.
    gpu = frozenset((k, v) for k, v in labels if k in {"Hostname", "UUID", "modelName"})
    assert series["tessera_gpu_memory_allocated_bytes", gpu] == 2 * GIB
    assert series["tessera_gpu_cores_allocated_ratio", gpu] == 0.3
    assert series["tessera_gpu_healthy", gpu] == 1
    assert series["tessera_gpu_memory_used_bytes", gpu] >= GIB
    # Unprepared: its series go with its record, and its GPU's allocation with them.
    after = get(url, reader)[1]
    assert "tessera_container_memory_quota_bytes{" not in after
    assert {
        s.value
        for family in text_string_to_metric_families(after)
        for s in family.samples
        if s.name == "tessera_gpu_memory_allocated_bytes"
    } == {0}


def test_status_lists_a_dra_claim_with_its_device_memory_cores_and_use(  # noqa: PLR0917 (fixtures are injected by name)
    cluster: Cluster,
    start_driver: Any,
    fake_gpus: FakeGpus,
    tmp_path: Path,
    dra_cluster: ControlPlane,
    capsys: pytest.CaptureFixture[str],
) -> None:
    """`tessera status` shows the DRA node's GPUs from its ResourceSlice, the claim on the A100 with
    its pod, memory and cores from its allocation, and its use from the driver's metrics, read through
    the API server's pod proxy (a driver serving them open: the proxy forwards no token)."""
    driver = start_driver("--metrics-address=0.0.0.0", "--metrics-authorization=none")
    wait_published(driver, cluster.api)
    with a_claim_in_use(cluster, driver, fake_gpus, tmp_path) as claim_name:
        # The driver's pod, as the chart runs it: the proxy reaches its metrics port on this machine.
        cluster.core.create_namespaced_pod(
            cluster.namespace,
            {
                "metadata": {
                    "name": "tessera-dra-x7k2p",
                    "labels": {"app.kubernetes.io/name": "tessera-dra"},
                },
                "spec": {
                    "nodeName": NODE,
                    "containers": [
                        {
                            "name": "driver",
                            "image": "example.invalid/none",
                            "ports": [{"name": "metrics", "containerPort": driver.metrics_port()}],
                        }
                    ],
                },
            },
        )
        address = host_address()
        cluster.core.patch_namespaced_pod_status(
            "tessera-dra-x7k2p",
            cluster.namespace,
            {"status": {"phase": "Running", "podIP": address, "podIPs": [{"ip": address}]}},
        )
        kubeconfig = f"--kubeconfig={dra_cluster.kubeconfig}"
        assert cli.main(["status", kubeconfig, "-o", "json"]) == 0
        report = json.loads(capsys.readouterr().out)
        assert cli.main(["status", kubeconfig, "--color=never"]) == 0
        table = capsys.readouterr().out.splitlines()
    [node] = [n for n in report["nodes"] if n["name"] == NODE]
    assert (node["dra"], node["metrics"]) == (True, "ok")
    a100, t4 = node["gpus"]
    assert (a100["uuid"], a100["model"], a100["health"]) == (
        fake_gpus.specs[0].uuid,
        "NVIDIA A100-SXM4-40GB",
        "Healthy",
    )
    assert (a100["memory_bytes"], a100["memory_allocated_bytes"], a100["cores_allocated_percent"]) == (
        40 * GIB,
        2 * GIB,
        30,
    )
    assert a100["claims"] == [
        {
            "namespace": cluster.namespace,
            "claim": claim_name,
            "pods": ["trainer"],
            "memory_bytes": 2 * GIB,
            "cores_percent": 30,
            "memory_used_bytes": GIB,
        }
    ]
    assert t4["claims"] == [] and t4["model"] == "Tesla T4"
    [row] = [re.split(r"\s{2,}", line.strip()) for line in table if "(trainer)" in line]
    assert row == [
        f"claim {cluster.namespace}/{claim_name} (trainer)",
        "2.0",
        "30",
        "reserved",
        "1.0 GiB used",
    ], row
    assert any(line.startswith(NODE) and "DRA driver" in line for line in table), table
