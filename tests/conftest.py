"""Shared fixtures: a real Kubernetes control plane (etcd + kube-apiserver, kube-scheduler on demand).

- ``control_plane``: session-wide etcd + kube-apiserver on loopback (binaries from
  ``hack/k8s-binaries.sh``); every process is stopped at the end, also when tests fail.
- ``kube``: a ``kubernetes.client.ApiClient`` for the admin; after each test, every Node and every Pod
  the tests made is deleted (namespaces stay: no namespace controller runs to finalise them).
- ``namespace``: a fresh namespace name for one test.
- ``start_scheduler(config_yaml)``: starts kube-scheduler with that KubeSchedulerConfiguration
  (``{kubeconfig}`` in it is replaced by the admin kubeconfig); stopped after the test.
- ``create_fake_node(name, capacity, annotations)``: a Node with patched status, no kubelet.
"""

from __future__ import annotations

import contextlib
import signal
import uuid
from collections.abc import Callable, Iterator
from pathlib import Path
from types import FrameType

import pytest
from kubernetes import client, config

from sandbox.controlplane import ControlPlane, ManagedProcess, fake_node_body
from tests import fuzzing
from tests.sandbox.conftest import keep_logs_of_failed


def pytest_configure(config: pytest.Config) -> None:
    # A run stopped with SIGTERM (a CI timeout, `timeout`, `kill`) ends as Ctrl-C ends it, running
    # every fixture's teardown, so the processes the tests started are stopped: by default SIGTERM
    # ends pytest at once and leaves them running.
    signal.signal(signal.SIGTERM, _interrupt)


def pytest_report_header() -> str:
    return fuzzing.header()


# The fixtures that bring up what a marker names (pyproject.toml): a test using one carries the marker,
# so that `make check` (which deselects the markers) never starts a control plane or a sandbox.
NEEDS = {"control_plane": "k8s", "sandbox_root": "sandbox", "shared_sandbox": "sandbox"}


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    unmarked = [
        f"{item.nodeid} (uses {fixture}, not marked {marker})"
        for item in items
        for fixture, marker in NEEDS.items()
        if fixture in getattr(item, "fixturenames", ()) and item.get_closest_marker(marker) is None
    ]
    if unmarked:
        raise pytest.UsageError("tests without the marker of what they need:\n" + "\n".join(unmarked))


@pytest.hookimpl(wrapper=True)
def pytest_runtest_makereport(item: pytest.Item, call: pytest.CallInfo[None]) -> Iterator[pytest.TestReport]:
    report: pytest.TestReport = yield
    if report.failed and report.when == "call" and (errors := keep_logs_of_failed(item)):
        report.sections.append(("the sandboxes' last errors", errors))
    return report


def _interrupt(signum: int, _frame: FrameType | None) -> None:
    raise KeyboardInterrupt(f"stopped by {signal.Signals(signum).name}")


@pytest.fixture(scope="session")
def control_plane(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ControlPlane]:
    plane = ControlPlane(work_dir=tmp_path_factory.mktemp("control-plane"))
    plane.start()
    try:
        yield plane
    finally:
        plane.stop()


def _cleanup(api: client.ApiClient) -> None:
    core = client.CoreV1Api(api)
    for pod in core.list_pod_for_all_namespaces().items:
        if pod.metadata.namespace != "kube-system":
            with contextlib.suppress(client.ApiException):
                core.delete_namespaced_pod(pod.metadata.name, pod.metadata.namespace, grace_period_seconds=0)
    for node in core.list_node().items:
        with contextlib.suppress(client.ApiException):
            core.delete_node(node.metadata.name)


@pytest.fixture
def kube(control_plane: ControlPlane) -> Iterator[client.ApiClient]:
    api = config.new_client_from_config(config_file=str(control_plane.kubeconfig))
    try:
        yield api
    finally:
        _cleanup(api)
        api.close()


@pytest.fixture
def namespace(kube: client.ApiClient) -> str:
    name = f"t-{uuid.uuid4().hex[:10]}"
    client.CoreV1Api(kube).create_namespace({"metadata": {"name": name}})
    return name


@pytest.fixture
def start_scheduler(control_plane: ControlPlane) -> Iterator[Callable[[str], ManagedProcess]]:
    started: list[ManagedProcess] = []

    def start(config_yaml: str) -> ManagedProcess:
        process = control_plane.start_scheduler(config_yaml, name=f"kube-scheduler-{len(started)}")
        started.append(process)
        return process

    try:
        yield start
    finally:
        for process in started:
            control_plane.stop_process(process)


@pytest.fixture
def create_fake_node(kube: client.ApiClient) -> Callable[..., str]:
    core = client.CoreV1Api(kube)

    def create(name: str, capacity: dict[str, str], annotations: dict[str, str] | None = None) -> str:
        body = fake_node_body(name, capacity, annotations)
        status = body.pop("status")
        core.create_node(body)
        core.patch_node_status(name, {"status": status})
        return name

    return create


@pytest.fixture(scope="session")
def repo_root() -> Path:
    return Path(__file__).resolve().parent.parent
