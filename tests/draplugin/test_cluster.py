"""The DRA path on a real Kubernetes 1.37 control plane: kube-scheduler allocates shares of the fake
GPUs as consumable capacity from the driver's ResourceSlice; the driver prepares the claims for a
kubelet stand-in over its real sockets; the hook, run as a container with the claim's CDI edits,
holds each claim to its share."""

from __future__ import annotations

import json
import re
import subprocess
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

import pytest
import yaml
from kubernetes import client

from deviceplugin.response import MountSpec
from sandbox.controlplane import ControlPlane
from tessera.contract import KEYS
from tests.deviceplugin.conftest import CUCLIENT
from tests.deviceplugin.test_plugin import run_in_container
from tests.draplugin.conftest import NODE, ROOT, Cluster, DriverProcess, wait_published
from tests.waiting import wait_for

pytestmark = pytest.mark.k8s

GIB = 2**30
A100 = 'device.attributes["tessera.io"].model == "A100"'
T4 = 'device.attributes["tessera.io"].model == "T4"'


class Container:
    """What a container runtime makes of a claim's CDI device: its mounts and environment."""

    def __init__(self, spec: dict[str, Any]) -> None:
        [device] = spec["devices"]
        edits = device["containerEdits"]
        self.mounts = [
            MountSpec(m["containerPath"], m["hostPath"], read_only=m["options"][0] == "ro")
            for m in edits["mounts"]
        ]
        self.envs = dict(e.split("=", 1) for e in edits["env"])


def hook_view(
    driver: DriverProcess, claim_uid: str, env: dict[str, str], block: str, blocks: int
) -> tuple[int, list[str]]:
    """The GPU memory the hook reports inside the claim's container, and the results of ``blocks``
    allocations of ``block`` followed by one more of 1 MiB."""
    out = run_in_container(
        Container(driver.cdi_spec(claim_uid)),
        [str(CUCLIENT), "info", "alloc", "mem", block, str(blocks), "alloc", "mem", "1m", "1"],
        env,
    )
    total = re.search(r"total=(\d+)", out)
    assert total, out
    return int(total.group(1)), re.findall(r"^alloc kind=mem size=\d+ index=\d+ result=(\S+)$", out, re.M)


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


def test_two_claims_share_the_a100_each_held_to_its_own_share(
    cluster: Cluster, start_driver: Any, fake_gpus: Any
) -> None:
    driver = start_driver()
    wait_published(driver, cluster.api)
    cluster.create_claim("small", {"memory": "1Gi", "cores": "30"}, A100)
    cluster.create_claim("large", {"memory": "3Gi", "cores": "50"}, A100)
    cluster.create_pod("small", "small")
    cluster.create_pod("large", "large")
    small, large = cluster.allocated("small"), cluster.allocated("large")
    assert (small["device"], large["device"]) == ("gpu-0", "gpu-0")
    assert small["consumedCapacity"] == {"memory": str(GIB), "cores": "30"}
    assert large["consumedCapacity"] == {"memory": str(3 * GIB), "cores": "50"}
    assert small["shareID"] != large["shareID"]

    kubelet = driver.register()
    refs = [cluster.claim_ref("small"), cluster.claim_ref("large")]
    answer = kubelet.prepare(*refs)
    for ref, result in zip(refs, (small, large), strict=True):
        entry = answer.claims[ref.uid]
        assert entry.error == ""
        [device] = entry.devices
        assert (device.pool_name, device.device_name) == (NODE, "gpu-0")
        assert device.share_id == result["shareID"]
        assert list(device.cdi_device_ids) == [f"{KEYS.cdi_kind}={ref.uid}"]
    # The compute shares go to the hook as its own tests exercise them (tests/hook/test_compute.py).
    gpu = fake_gpus.uuids[0]
    for ref, line in zip(
        refs, (f"device {gpu} memory {GIB} cores 30", f"device {gpu} memory {3 * GIB} cores 50"), strict=True
    ):
        assert (
            line in (driver.state_dir / "claims" / ref.uid / "limits.d" / "limits").read_text().splitlines()
        )
    env = fake_gpus.env()
    assert hook_view(driver, refs[0].uid, env, "256m", 4) == (
        GIB,
        ["CUDA_SUCCESS"] * 4 + ["CUDA_ERROR_OUT_OF_MEMORY"],
    )
    assert hook_view(driver, refs[1].uid, env, "1g", 3) == (
        3 * GIB,
        ["CUDA_SUCCESS"] * 3 + ["CUDA_ERROR_OUT_OF_MEMORY"],
    )


def test_a_claim_no_gpu_fits_stays_pending_with_the_schedulers_reason(
    cluster: Cluster, start_driver: Any
) -> None:
    wait_published(start_driver(), cluster.api)
    cluster.create_claim("huge", {"memory": "48Gi"})
    cluster.create_pod("huge", "huge")
    assert "cannot allocate all claims" in cluster.unschedulable("huge")
    assert not (cluster.claim("huge").get("status") or {}).get("allocation")


def test_a_cel_model_selector_lands_on_that_model(cluster: Cluster, start_driver: Any) -> None:
    wait_published(start_driver(), cluster.api)
    cluster.create_claim("t4", {"memory": "2Gi"}, T4)
    cluster.create_pod("t4", "t4")
    assert cluster.allocated("t4")["device"] == "gpu-1"
    cluster.create_claim("numa0", {"memory": "2Gi"}, 'device.attributes["tessera.io"].numaNode == 0')
    cluster.create_pod("numa0", "numa0")
    assert cluster.allocated("numa0")["device"] == "gpu-0"


def test_three_15g_claims_on_the_40g_gpu_two_fit_and_deleting_a_pod_frees_its_share(
    cluster: Cluster, start_driver: Any
) -> None:
    driver = start_driver()
    wait_published(driver, cluster.api)
    for n in (1, 2):
        cluster.create_claim(f"c{n}", {"memory": "15Gi"}, A100)
        cluster.create_pod(f"p{n}", f"c{n}")
        assert cluster.allocated(f"c{n}")["device"] == "gpu-0"
    cluster.create_claim("c3", {"memory": "15Gi"}, A100)
    cluster.create_pod("p3", "c3")
    assert "cannot allocate all claims" in cluster.unschedulable("p3")

    kubelet = driver.register()
    first = cluster.claim_ref("c1")
    assert kubelet.prepare(first).claims[first.uid].error == ""
    assert any(first.uid in f for f in driver.files())
    # The pod goes: the kubelet unprepares its claim, and the claim's share is free again.
    cluster.delete_pod("p1")
    assert kubelet.unprepare(first).claims[first.uid].error == ""
    assert not any(first.uid in f for f in driver.files())
    cluster.objects.delete_namespaced_custom_object(
        "resource.k8s.io", "v1", cluster.namespace, "resourceclaims", "c1"
    )
    assert cluster.allocated("c3", timeout=120)["device"] == "gpu-0"


def test_driver_restarts_before_and_after_prepare_lose_nothing(
    cluster: Cluster, start_driver: Any, fake_gpus: Any
) -> None:
    driver = start_driver()
    wait_published(driver, cluster.api)
    cluster.create_claim("share", {"memory": "1Gi", "cores": "30"}, A100)
    cluster.create_pod("share", "share")
    cluster.allocated("share")
    ref = cluster.claim_ref("share")

    # Between allocation and prepare.
    driver.stop()
    driver = start_driver()
    first = driver.register().prepare(ref).claims[ref.uid]
    assert first.error == ""
    files = {f: (driver.state_dir.parent / f).read_bytes() for f in driver.files()}

    # After prepare: the kubelet asks again (it retries until it has an answer) and gets the same.
    driver.stop()
    driver = start_driver()
    again = driver.register().prepare(ref).claims[ref.uid]
    assert again == first
    assert {f: (driver.state_dir.parent / f).read_bytes() for f in driver.files()} == files
    assert hook_view(driver, ref.uid, fake_gpus.env(), "256m", 4)[0] == GIB


def test_bad_claims_are_refused_clearly_with_nothing_written(cluster: Cluster, start_driver: Any) -> None:
    driver = start_driver()
    wait_published(driver, cluster.api)
    kubelet = driver.register()

    # More than the request policy allows: no device can take it.
    cluster.create_claim("greedy", {"cores": "150"}, A100)
    cluster.create_pod("greedy", "greedy")
    assert "cannot allocate all claims" in cluster.unschedulable("greedy")

    # A capacity the devices do not have: no device can take it either.
    cluster.create_claim("bandwidth", {"bandwidth": "1"}, A100)
    cluster.create_pod("bandwidth", "bandwidth")
    assert "cannot allocate all claims" in cluster.unschedulable("bandwidth")

    # Opaque parameters that are no JSON object: refused at creation, naming the field.
    with pytest.raises(client.ApiException, match=r"opaque\.parameters"):
        cluster.create_claim("unparsable", {"memory": "1Gi"}, A100, "not an object")

    # An attribute no device has: the selector cannot be evaluated (kube-scheduler retries it).
    cluster.create_claim("colour", {"memory": "1Gi"}, 'device.attributes["tessera.io"].colour == "red"')
    cluster.create_pod("colour", "colour")
    reason, message = cluster.not_scheduled("colour")
    assert reason == "SchedulerError"
    assert "CEL runtime error: no such key: colour" in message

    # A malformed opaque config: allocated (the API server checks only that it is JSON), refused at
    # prepare with the field named, nothing written on the node.
    cluster.create_claim(
        "configured",
        {"memory": "1Gi"},
        A100,
        {"apiVersion": KEYS.dra_config_api_version, "kind": "GpuShareConfig", "elastic": "yes"},
    )
    cluster.create_pod("configured", "configured")
    cluster.allocated("configured")
    ref = cluster.claim_ref("configured")
    refused = kubelet.prepare(ref).claims[ref.uid]
    assert list(refused.devices) == []
    assert refused.error == (
        f"claim {cluster.namespace}/configured ({ref.uid}): status.allocation.devices.config[0].opaque.parameters: "
        'elastic: Input should be a valid boolean (got "yes")'
    )
    assert driver.files() == []


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


def test_the_example_claim_template_gets_its_share(cluster: Cluster, start_driver: Any) -> None:
    """deploy/examples/dra-shared-gpu.yaml as a user applies it: the ResourceClaim controller makes
    the pod's claim from the template, kube-scheduler gives it 4 GiB and 30% of the A100."""
    wait_published(start_driver(), cluster.api)
    template, pod = yaml.safe_load_all((ROOT / "deploy" / "examples" / "dra-shared-gpu.yaml").read_text())
    cluster.objects.create_namespaced_custom_object(
        "resource.k8s.io", "v1", cluster.namespace, "resourceclaimtemplates", template
    )
    cluster.core.create_namespaced_pod(cluster.namespace, pod)

    def claim_name() -> str | None:
        statuses = cluster.core.read_namespaced_pod(pod["metadata"]["name"], cluster.namespace).status
        names = [s.resource_claim_name for s in statuses.resource_claim_statuses or []]
        return names[0] if names and names[0] else None

    name = wait_for(claim_name, 60.0, "the claim made from the template")
    result = cluster.allocated(name)
    assert result["device"] == "gpu-0"
    assert result["consumedCapacity"] == {"memory": str(4 * GIB), "cores": "30"}
