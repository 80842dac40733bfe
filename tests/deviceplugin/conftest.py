"""Fixtures for the device plugin's integration tests: a kubelet stand-in on real unix sockets, the
real API server (tests/conftest.py), and the real ``tessera-device-plugin`` as a child process."""

from __future__ import annotations

import re
import shutil
import sys
import tempfile
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest
from kubernetes import client

from tessera.contract import KEYS
from tessera.localcluster import ControlPlane, ManagedProcess
from tests.deviceplugin.kubelet_standin import KubeletStandIn

PLUGIN_SCRIPT = Path(sys.executable).parent / "tessera-device-plugin"
_METRICS_LINE = re.compile(r"metrics on http://[\d.]+:(\d+)/metrics")


@dataclass
class PluginProcess:
    process: ManagedProcess
    node: str
    state_dir: Path

    def log(self) -> str:
        return self.process.log_path.read_text(errors="replace")

    def metrics_port(self, timeout: float = 30.0) -> int:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            match = _METRICS_LINE.search(self.log())
            if match:
                return int(match.group(1))
            assert self.process.running, f"plugin exited:\n{self.process.log_tail()}"
            time.sleep(0.1)
        raise AssertionError(f"plugin never logged its metrics port:\n{self.process.log_tail()}")


@pytest.fixture
def kubelet() -> Iterator[KubeletStandIn]:
    # Unix socket paths are limited to 108 bytes: a short dir, not pytest's long tmp_path.
    plugin_dir = Path(tempfile.mkdtemp(prefix="dp-", dir="/tmp"))
    standin = KubeletStandIn(plugin_dir)
    standin.start()
    try:
        yield standin
    finally:
        standin.stop()
        shutil.rmtree(plugin_dir, ignore_errors=True)


@pytest.fixture
def gpu_node(kube: client.ApiClient, create_fake_node: Callable[..., str]) -> str:
    return create_fake_node("gpu-node-1", {"cpu": "8", "memory": "32Gi", "pods": "110"})


@pytest.fixture
def start_plugin(
    control_plane: ControlPlane, kubelet: KubeletStandIn, tmp_path: Path
) -> Iterator[Callable[..., PluginProcess]]:
    """Starts ``tessera-device-plugin`` for a node with the given environment and extra flags."""
    started: list[ManagedProcess] = []

    def start(node: str, env: dict[str, str], *flags: str, kubeconfig: Path | None = None) -> PluginProcess:
        state_dir = tmp_path / f"state-{len(started)}"
        process = ManagedProcess(
            f"device-plugin-{len(started)}",
            [
                str(PLUGIN_SCRIPT),
                f"--node-name={node}",
                f"--plugin-dir={kubelet.plugin_dir}",
                f"--state-dir={state_dir}",
                f"--kubeconfig={kubeconfig or control_plane.kubeconfig}",
                f"--domain={KEYS.domain}",
                "--metrics-address=127.0.0.1",
                "--metrics-port=0",
                "--health-poll-seconds=0.5",
                *flags,
            ],
            tmp_path / f"device-plugin-{len(started)}.log",
            env=env,
        )
        started.append(process)
        process.start()
        return PluginProcess(process, node, state_dir)

    try:
        yield start
    finally:
        for process in started:
            process.stop()
