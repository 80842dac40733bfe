"""Fixtures for the extender's tests against the real kube-apiserver and kube-scheduler
(``tests/conftest.py``): the real ``tessera-extender`` as a child process, kube-scheduler configured
from ``deploy/scheduler-config.yaml``, and GPU nodes with inventory annotations."""

from __future__ import annotations

import contextlib
import sys
import threading
import time
import urllib.error
import urllib.request
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from datetime import datetime
from pathlib import Path
from typing import Self

import pytest
import yaml
from kubernetes import client, config

from sandbox.controlplane import ControlPlane, ManagedProcess, free_port
from tessera.contract import KEYS, Phase, dump_inventory, format_time, now
from tests.extender.helpers import inventory
from tests.scraping import get, service_account_token

REPO = Path(__file__).resolve().parents[2]

# The cluster of the integration tests: 10 nodes x 4 GPUs, three models.
CLUSTER: list[tuple[str, str, int]] = (
    [(f"t4-{i}", "Tesla T4", 15360) for i in range(4)]
    + [(f"v100-{i}", "Tesla V100-SXM2-16GB", 16384) for i in range(3)]
    + [(f"a100-{i}", "NVIDIA A100-SXM4-40GB", 40960) for i in range(3)]
)
SPLIT = 4


@dataclass
class ExtenderServer:
    control_plane: ControlPlane
    extra_args: list[str] = field(default_factory=list)
    port: int = field(default_factory=free_port)
    process: ManagedProcess | None = None
    starts: int = 0
    # Where /readyz and /metrics are served when the verbs' port needs a client certificate
    # (--health-listen); None: on the verbs' port.
    health_port: int | None = None

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    @property
    def health_url(self) -> str:
        return self.url if self.health_port is None else f"http://127.0.0.1:{self.health_port}"

    def start(self, timeout: float = 60.0) -> None:
        self.starts += 1
        self.process = ManagedProcess(
            f"tessera-extender-{self.starts}",
            [
                sys.executable,
                "-m",
                "extender.main",
                f"--listen=127.0.0.1:{self.port}",
                f"--kubeconfig={self.control_plane.kubeconfig}",
                f"--speed-profiles={REPO / 'deploy' / 'speed-profiles.yaml'}",
                *self.extra_args,
            ],
            self.control_plane.work_dir / "logs" / f"tessera-extender-{self.port}-{self.starts}.log",
        )
        self.process.start()
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            assert self.process.running, f"extender exited:\n{self.process.log_tail()}"
            try:
                with urllib.request.urlopen(f"{self.health_url}/readyz", timeout=2) as response:
                    if response.status == 200:
                        return
            except (urllib.error.URLError, ConnectionError, TimeoutError):
                pass
            time.sleep(0.2)
        raise AssertionError(f"extender not ready after {timeout:.0f}s:\n{self.process.log_tail()}")

    def kill(self) -> None:
        """Stop at once (SIGKILL), as a crash would."""
        if self.process is not None and self.process.popen is not None:
            self.process.popen.kill()
            self.process.popen.wait()
            self.process.stop()

    def stop(self) -> None:
        if self.process is not None:
            self.process.stop()

    def metrics(self) -> str:
        """Its /metrics, read as a scraper allowed get on /metrics (the extender asks the API server)."""
        with contextlib.closing(config.new_client_from_config(str(self.control_plane.kubeconfig))) as api:
            token = service_account_token(api, "prometheus", reader=True)
        status, text = get(f"{self.health_url}/metrics", token, timeout=5)
        assert status == 200, (status, text)
        return text


@pytest.fixture
def start_extender(control_plane: ControlPlane) -> Iterator[Callable[..., ExtenderServer]]:
    servers: list[ExtenderServer] = []

    def start(*extra_args: str) -> ExtenderServer:
        server = ExtenderServer(control_plane, list(extra_args))
        servers.append(server)
        server.start()
        return server

    try:
        yield start
    finally:
        for server in servers:
            server.stop()


@pytest.fixture
def extender_with_scheduler(
    start_extender: Callable[..., ExtenderServer], start_scheduler: Callable[[str], ManagedProcess]
) -> Callable[[int], ExtenderServer]:
    """Start the extender (with this heartbeat timeout in seconds), then a kube-scheduler calling
    it with deploy/scheduler-config.yaml; both stop at the end of the test."""

    def start(heartbeat_timeout: int) -> ExtenderServer:
        extender = start_extender(f"--heartbeat-timeout={heartbeat_timeout}")
        start_scheduler(scheduler_config(extender.url))
        return extender

    return start


def scheduler_config(extender_url: str) -> str:
    """deploy/scheduler-config.yaml, pointed at a local extender and the test API server."""
    config = yaml.safe_load((REPO / "deploy" / "scheduler-config.yaml").read_text())
    config["clientConnection"]["kubeconfig"] = "{kubeconfig}"
    config["leaderElection"] = {"leaderElect": False}
    config["extenders"][0]["urlPrefix"] = extender_url
    # Unschedulable pods are retried within seconds, so the tests see retries after capacity frees.
    config["podMaxBackoffSeconds"] = 2
    return str(yaml.safe_dump(config))


def node_annotations(name: str, model: str, memory_mib: int, heartbeat: datetime) -> dict[str, str]:
    return {
        KEYS.node_gpus: dump_inventory(inventory(name, model, memory_mib, count=4, split=SPLIT)),
        KEYS.node_heartbeat: format_time(heartbeat),
    }


@pytest.fixture
def gpu_cluster(create_fake_node: Callable[..., str]) -> dict[str, str]:
    """The 10 GPU nodes; returns node name -> GPU model."""
    capacity = {KEYS.vgpu: str(4 * SPLIT), "cpu": "32", "memory": "128Gi", "pods": "110"}
    for name, model, memory in CLUSTER:
        create_fake_node(name, capacity, node_annotations(name, model, memory, now()))
    return {name: model for name, model, _ in CLUSTER}


class PodPoller:
    """A thread that, every ``delay`` seconds until the ``with`` block ends, hands each pod of the
    namespace to :meth:`visit`: the parts of a node that fake nodes lack, acting on the API."""

    def __init__(self, api: client.ApiClient, namespace: str, delay: float = 0.5) -> None:
        self.core = client.CoreV1Api(api)
        self.namespace = namespace
        self.delay = delay
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def __enter__(self) -> Self:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join(10)

    def _run(self) -> None:
        while not self._stop.wait(self.delay):
            for pod in self.core.list_namespaced_pod(self.namespace).items:
                self.visit(pod)

    def visit(self, pod: client.V1Pod) -> None:
        raise NotImplementedError


class FakeDevicePlugin(PodPoller):
    """Marks bound pods ``allocated``, as the device plugin does once the kubelet admits them, so the
    in-flight rule sees the flow it sees in a real cluster (no kubelet runs here)."""

    def visit(self, pod: client.V1Pod) -> None:
        annotations = pod.metadata.annotations or {}
        if pod.spec.node_name and annotations.get(KEYS.allocation_phase) == Phase.ALLOCATING:
            patch = {"metadata": {"annotations": {KEYS.allocation_phase: Phase.ALLOCATED.value}}}
            with contextlib.suppress(client.ApiException):
                self.core.patch_namespaced_pod(pod.metadata.name, self.namespace, patch)
