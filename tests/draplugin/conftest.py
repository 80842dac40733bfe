"""Fixtures for the DRA driver's cluster tests: a real Kubernetes 1.37 control plane (etcd,
kube-apiserver, kube-scheduler with its DRA allocator, kube-controller-manager's ResourceClaim
controller), a node without a kubelet, fake GPUs and the real ``tessera-dra`` as a child process; and
the admin's view of a namespace (:class:`Cluster`), which test_node.py uses on the sandbox's real node
too."""

from __future__ import annotations

import contextlib
import copy
import re
import shutil
import sys
import tempfile
import uuid
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest
import yaml
from kubernetes import client, config

import fakegpu
from sandbox.controlplane import (
    DRA_K8S_VERSION,
    ControlPlane,
    ManagedProcess,
    bin_dir_for,
    fake_node_body,
)
from tessera.contract import KEYS
from tests.deviceplugin.conftest import HOOK_LIBRARY, FakeGpus
from tests.waiting import wait_for

ROOT = Path(__file__).resolve().parents[2]
DRIVER_SCRIPT = Path(sys.executable).parent / "tessera-dra"
NODE = "dra-node"
GROUP, VERSION = "resource.k8s.io", "v1"
# Listed, not kube-controller-manager's default `*` (the sandbox's): node-lifecycle would mark NODE,
# which has no kubelet and no heartbeat, not ready after its grace, taint it and evict its pods.
# Workloads, service accounts and their tokens, garbage collection, endpoints, namespaces and quotas;
# and the DRA path's: the ResourceClaim controller makes the claims of ResourceClaimTemplates, takes
# deleted pods off their claims' reservedFor and deallocates claims nobody uses any more; the device
# taint eviction controller deletes the pods whose claims use a device with a NoExecute taint (the
# DRA driver's taint on a GPU that failed fatally).
CONTROLLERS = (
    "deployment-controller",
    "replicaset-controller",
    "daemonset-controller",
    "statefulset-controller",
    "job-controller",
    "serviceaccount-controller",
    "serviceaccount-token-controller",
    "root-ca-certificate-publisher-controller",
    "garbage-collector-controller",
    "pod-garbage-collector-controller",
    "endpoints-controller",
    "endpointslice-controller",
    "endpointslice-mirroring-controller",
    "namespace-controller",
    "clusterrole-aggregation-controller",
    "disruption-controller",
    "resourcequota-controller",
    "resourceclaim-controller",
    "device-taint-eviction-controller",
)
SCHEDULER_CONFIG = """apiVersion: kubescheduler.config.k8s.io/v1
kind: KubeSchedulerConfiguration
clientConnection:
  kubeconfig: {kubeconfig}
"""


def gpus() -> list[fakegpu.FakeGpuSpec]:
    """The sandbox's two GPUs: an A100 with 40 GiB and a T4 with 16 GiB, on two NUMA nodes."""
    return [
        fakegpu.example_gpu(0, model="NVIDIA A100-SXM4-40GB", memory_mib=40960, numa_node=0),
        fakegpu.example_gpu(
            1, model="Tesla T4", memory_mib=15360, sm_count=40, compute_capability="7.5", numa_node=1
        ),
    ]


@pytest.fixture(scope="module")
def dra_cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ControlPlane]:
    plane = ControlPlane(work_dir=tmp_path_factory.mktemp("dra-plane"), bin_dir=bin_dir_for(DRA_K8S_VERSION))
    plane.start()
    try:
        plane.start_scheduler(SCHEDULER_CONFIG)
        # The ResourceClaim controller takes a deleted pod off its claims' reservedFor and frees
        # the claims nobody uses any more; the garbage collector deletes claims made from templates.
        plane.start_controller_manager(controllers=CONTROLLERS)
        api = config.new_client_from_config(config_file=str(plane.kubeconfig))
        try:
            core = client.CoreV1Api(api)
            body = fake_node_body(NODE, {"cpu": "8", "memory": "32Gi", "pods": "110"})
            status = body.pop("status")
            core.create_node(body)
            core.patch_node_status(NODE, {"status": status})
            [device_class] = [
                d
                for d in yaml.safe_load_all((ROOT / "deploy" / "dra-driver.yaml").read_text())
                if d["kind"] == "DeviceClass"
            ]
            client.CustomObjectsApi(api).create_cluster_custom_object(
                GROUP, VERSION, "deviceclasses", device_class
            )
        finally:
            api.close()
        yield plane
    finally:
        plane.stop()


def claim_spec(
    capacity: dict[str, str] | None = None, selector: str | None = None, parameters: object = None
) -> dict[str, Any]:
    """A claim's spec: one share (request ``gpu``) of the class, with its capacity, selector and
    opaque config for the driver."""
    request: dict[str, Any] = {"deviceClassName": KEYS.dra_device_class}
    if capacity is not None:
        request["capacity"] = {"requests": capacity}
    if selector is not None:
        request["selectors"] = [{"cel": {"expression": selector}}]
    spec: dict[str, Any] = {"devices": {"requests": [{"name": "gpu", "exactly": request}]}}
    if parameters is not None:
        opaque = {"driver": KEYS.dra_driver, "parameters": parameters}
        spec["devices"]["config"] = [{"requests": ["gpu"], "opaque": opaque}]
    return spec


# A container for a node without a kubelet: nothing ever runs it.
NO_CONTAINER: dict[str, Any] = {"name": "main", "image": "example.invalid/none"}


@dataclass
class Cluster:
    """The admin's view of the DRA cluster, in a fresh namespace; its pods run ``container``."""

    api: client.ApiClient
    namespace: str
    container: dict[str, Any] = field(default_factory=lambda: dict(NO_CONTAINER))
    core: client.CoreV1Api = field(init=False)
    objects: client.CustomObjectsApi = field(init=False)

    def __post_init__(self) -> None:
        self.core = client.CoreV1Api(self.api)
        self.objects = client.CustomObjectsApi(self.api)

    def create_claim(
        self,
        name: str,
        capacity: dict[str, str] | None = None,
        selector: str | None = None,
        parameters: object = None,
    ) -> dict[str, Any]:
        """A claim of one share (request ``gpu``); ``parameters``: its opaque config for the driver."""
        body = {
            "apiVersion": f"{GROUP}/{VERSION}",
            "kind": "ResourceClaim",
            "metadata": {"name": name},
            "spec": claim_spec(capacity, selector, parameters),
        }
        created: dict[str, Any] = self.objects.create_namespaced_custom_object(
            GROUP, VERSION, self.namespace, "resourceclaims", body
        )
        return created

    def create_claim_template(
        self, name: str, capacity: dict[str, str] | None = None, selector: str | None = None
    ) -> None:
        """A ResourceClaimTemplate of such a claim: each pod naming it gets a claim of its own."""
        body = {
            "apiVersion": f"{GROUP}/{VERSION}",
            "kind": "ResourceClaimTemplate",
            "metadata": {"name": name},
            "spec": {"spec": claim_spec(capacity, selector)},
        }
        self.objects.create_namespaced_custom_object(
            GROUP, VERSION, self.namespace, "resourceclaimtemplates", body
        )

    def claim_of(self, pod: str, timeout: float = 60.0) -> str:
        """The name of the claim the ResourceClaim controller made for the pod from its template."""

        def made() -> str | None:
            statuses = self.core.read_namespaced_pod(pod, self.namespace).status.resource_claim_statuses
            return statuses[0].resource_claim_name if statuses else None

        name: str = wait_for(made, timeout, f"the claim made for pod {pod}")
        return name

    def claim(self, name: str) -> dict[str, Any]:
        found: dict[str, Any] = self.objects.get_namespaced_custom_object(
            GROUP, VERSION, self.namespace, "resourceclaims", name
        )
        return found

    def create_pod(
        self,
        name: str,
        claim: str,
        scheduler: str = "default-scheduler",
        priority_class: str | None = None,
        *,
        template: bool = False,
    ) -> None:
        """A pod whose one container uses ``claim`` (with ``template``: a claim of its own made from
        the template of that name)."""
        source = "resourceClaimTemplateName" if template else "resourceClaimName"
        spec: dict[str, Any] = {"resourceClaims": [{"name": "gpu", source: claim}]}
        if priority_class is not None:
            spec["priorityClassName"] = priority_class
        self._create_pod(name, spec, {"claims": [{"name": "gpu"}]}, scheduler)

    def create_plain_pod(self, name: str, limits: dict[str, str], scheduler: str) -> None:
        """A pod without claims, with these resource limits."""
        self._create_pod(name, {}, {"limits": limits}, scheduler)

    def _create_pod(self, name: str, spec: dict[str, Any], resources: dict[str, Any], scheduler: str) -> None:
        container = {**self.container, "resources": resources}
        self.core.create_namespaced_pod(
            self.namespace,
            {
                "metadata": {"name": name},
                "spec": {**spec, "schedulerName": scheduler, "containers": [container]},
            },
        )

    def allocate_as_lost_bind(
        self, name: str, beside: str, node: str, memory_bytes: int | None = None
    ) -> None:
        """Claim ``name`` allocated on the device of claim ``beside``, and reserved for a new pod of
        that name bound to ``node``, as kube-scheduler leaves them after a lost bind (docs/dra.md,
        "Allocated past a device's capacity"): written by hand, past the device's capacity.
        ``memory_bytes``: what the claim consumes of the device's memory (as ``beside`` by default)."""
        self._create_pod(
            name,
            {"nodeName": node, "resourceClaims": [{"name": "gpu", "resourceClaimName": name}]},
            {"claims": [{"name": "gpu"}]},
            "default-scheduler",
        )
        pod = self.core.read_namespaced_pod(name, self.namespace)
        allocation = copy.deepcopy(self.claim(beside)["status"]["allocation"])
        [result] = allocation["devices"]["results"]
        result["shareID"] = str(uuid.uuid4())
        if memory_bytes is not None:
            result["consumedCapacity"]["memory"] = str(memory_bytes)
        lost = self.claim(name)
        lost["status"] = {
            "allocation": allocation,
            "reservedFor": [{"resource": "pods", "name": name, "uid": pod.metadata.uid}],
        }
        self.objects.replace_namespaced_custom_object_status(
            GROUP, VERSION, self.namespace, "resourceclaims", name, lost
        )

    def delete_pod(self, name: str, grace_seconds: int | None = 0) -> None:
        """Deleted at once by default (without a kubelet nothing would confirm a graceful deletion);
        ``None``: gracefully, as the pod's spec says, for a kubelet to stop it and confirm."""
        self.core.delete_namespaced_pod(name, self.namespace, grace_period_seconds=grace_seconds)

    def allocated(self, name: str, timeout: float = 90.0) -> dict[str, Any]:
        """The claim's one result, once kube-scheduler has allocated it."""

        def result() -> dict[str, Any] | None:
            allocation = (self.claim(name).get("status") or {}).get("allocation")
            return allocation["devices"]["results"][0] if allocation else None

        found: dict[str, Any] = wait_for(result, timeout, f"claim {name} allocated")
        return found

    def not_scheduled(self, pod: str, timeout: float = 90.0) -> tuple[str, str]:
        """The reason and message of the pod's PodScheduled=False condition, once kube-scheduler
        has given up on it (``Unschedulable``) or failed on it (``SchedulerError``)."""

        def condition() -> tuple[str, str] | None:
            status = self.core.read_namespaced_pod(pod, self.namespace).status
            for found in status.conditions or []:
                if found.type == "PodScheduled" and found.status == "False" and found.reason:
                    return str(found.reason), str(found.message)
            return None

        found: tuple[str, str] = wait_for(condition, timeout, f"pod {pod} not scheduled")
        return found

    def events(self, pod: str, reason: str) -> list[Any]:
        """The pod's events of ``reason``, as the API server keeps them."""
        found = self.core.list_namespaced_event(self.namespace, field_selector=f"involvedObject.name={pod}")
        return [e for e in found.items if e.reason == reason]

    def unschedulable(self, pod: str, timeout: float = 90.0) -> str:
        """The message of the pod's PodScheduled=False condition with reason Unschedulable."""
        reason, message = self.not_scheduled(pod, timeout)
        assert reason == "Unschedulable", (reason, message)
        return message


@contextlib.contextmanager
def namespace_view(api: client.ApiClient, container: dict[str, Any] = NO_CONTAINER) -> Iterator[Cluster]:
    """A fresh namespace, its pods and claims deleted afterwards and their capacity freed."""
    namespace = f"dra-{uuid.uuid4().hex[:8]}"
    client.CoreV1Api(api).create_namespace({"metadata": {"name": namespace}})
    view = Cluster(api, namespace, dict(container))
    try:
        yield view
    finally:
        # Pods first: their claims are then no longer reserved, and the capacity is free for the next
        # test once the ResourceClaim controller has taken the claims' allocations back.
        for pod in view.core.list_namespaced_pod(namespace).items:
            with contextlib.suppress(client.ApiException):
                view.delete_pod(pod.metadata.name)
        for claim in view.objects.list_namespaced_custom_object(GROUP, VERSION, namespace, "resourceclaims")[
            "items"
        ]:
            with contextlib.suppress(client.ApiException):
                view.objects.delete_namespaced_custom_object(
                    GROUP, VERSION, namespace, "resourceclaims", claim["metadata"]["name"]
                )

        def gone() -> bool:
            left = view.objects.list_namespaced_custom_object(GROUP, VERSION, namespace, "resourceclaims")
            return not left["items"]

        wait_for(gone, 60.0, f"the claims of {namespace} deleted")


@pytest.fixture
def cluster(dra_cluster: ControlPlane) -> Iterator[Cluster]:
    with (
        contextlib.closing(config.new_client_from_config(config_file=str(dra_cluster.kubeconfig))) as api,
        namespace_view(api) as view,
    ):
        yield view


@dataclass
class DriverProcess:
    """``tessera-dra`` for the node."""

    process: ManagedProcess
    kubelet_dir: Path  # where it serves its sockets

    @property
    def registration_socket(self) -> Path:
        return self.kubelet_dir / "plugins_registry" / f"{KEYS.dra_driver}-reg.sock"

    def slice(self, api: client.ApiClient) -> dict[str, Any] | None:
        with contextlib.suppress(client.ApiException):
            found: dict[str, Any] = client.CustomObjectsApi(api).get_cluster_custom_object(
                GROUP, VERSION, "resourceslices", f"{NODE}-{KEYS.dra_driver}"
            )
            return found
        return None

    def metrics_port(self, timeout: float = 30.0) -> int:
        """The port it serves /metrics on (it picks a free one), as it logs it."""

        def logged() -> int | None:
            assert self.process.running, f"tessera-dra exited:\n{self.process.log_tail()}"
            found = re.search(r"metrics on http://[\d.]+:(\d+)/metrics", self.process.log_path.read_text())
            return int(found.group(1)) if found else None

        port: int = wait_for(logged, timeout, "tessera-dra's metrics port")
        return port

    def stop(self) -> None:
        self.process.stop()


@pytest.fixture
def fake_gpus(tmp_path: Path) -> FakeGpus:
    fakegpu.build()
    fakegpu.build_hook()
    specs = gpus()
    config_file = fakegpu.write_config(tmp_path / "gpus.conf", specs)
    state = tmp_path / "fakegpu-state"
    state.mkdir()
    return FakeGpus(config=config_file, state=state, specs=specs)


@pytest.fixture
def start_driver(
    dra_cluster: ControlPlane, fake_gpus: FakeGpus, tmp_path: Path
) -> Iterator[Callable[..., DriverProcess]]:
    """Starts ``tessera-dra`` for the node, with extra flags if given; a second call (after stopping
    the first) restarts it on the same dirs."""
    # Unix socket paths are limited to 108 bytes: a short dir, not pytest's long tmp_path.
    kubelet_dir = Path(tempfile.mkdtemp(prefix="dra-", dir="/tmp"))
    started: list[DriverProcess] = []

    def start(*flags: str) -> DriverProcess:
        n = len(started)
        process = ManagedProcess(
            f"tessera-dra-{n}",
            [
                str(DRIVER_SCRIPT),
                f"--node-name={NODE}",
                f"--kubeconfig={dra_cluster.kubeconfig}",
                f"--kubelet-dir={kubelet_dir}",
                f"--cdi-dir={tmp_path / 'cdi'}",
                f"--state-dir={tmp_path / 'state'}",
                f"--hook-library={HOOK_LIBRARY}",
                f"--speed-profiles={ROOT / 'deploy' / 'speed-profiles.yaml'}",
                "--resync-seconds=1",
                "--health-poll-seconds=1",
                "--metrics-address=127.0.0.1",
                "--metrics-port=0",
                *flags,
            ],
            tmp_path / f"tessera-dra-{n}.log",
            env=fake_gpus.env(),
        )
        driver = DriverProcess(process, kubelet_dir)
        started.append(driver)
        process.start()
        return driver

    try:
        yield start
    finally:
        for driver in started:
            driver.stop()
        shutil.rmtree(kubelet_dir, ignore_errors=True)


def wait_published(driver: DriverProcess, api: client.ApiClient, devices: int = 2) -> dict[str, Any]:
    def published() -> dict[str, Any] | None:
        assert driver.process.running, f"tessera-dra exited:\n{driver.process.log_tail()}"
        found = driver.slice(api)
        return found if found and len(found["spec"]["devices"]) == devices else None

    found: dict[str, Any] = wait_for(published, 60.0, "the node's ResourceSlice")
    return found
