"""Fixtures for the device plugin's integration tests: a kubelet stand-in on real unix sockets, the
real API server (tests/conftest.py), the real ``tessera-device-plugin`` as a child process, and a
stand-in MPS control program (``control``)."""

from __future__ import annotations

import contextlib
import os
import re
import shutil
import signal
import sys
import tempfile
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest
from kubernetes import client

import fakegpu
from sandbox.controlplane import ControlPlane, ManagedProcess
from sandbox.kubelet_standin import KubeletStandIn
from tessera.contract import KEYS
from tests.scraping import service_account_token

ROOT = Path(__file__).resolve().parents[2]
PLUGIN_SCRIPT = Path(sys.executable).parent / "tessera-device-plugin"
HOOK_LIBRARY = fakegpu.HOOK_LIBRARY
CUCLIENT = fakegpu.cuclient()
_METRICS_LINE = re.compile(r"metrics on http://[\d.]+:(\d+)/metrics")


@dataclass
class PluginProcess:
    process: ManagedProcess
    node: str
    state_dir: Path
    # A token that may read its /metrics (a service account bound to get /metrics, as Prometheus's).
    reader_token: str

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


@dataclass
class FakeGpus:
    """Fake GPUs (tests/fakegpu) described by a config file, with their control files."""

    config: Path
    state: Path
    specs: list[fakegpu.FakeGpuSpec]

    @property
    def uuids(self) -> list[str]:
        return [spec.uuid for spec in self.specs]

    def env(self) -> dict[str, str]:
        """The environment of a process that sees these GPUs through the fake NVML and CUDA."""
        base = {
            k: v for k, v in os.environ.items() if not k.startswith(("TESSERA_", "CUDA_", "NVIDIA_", "LD_"))
        }
        return fakegpu.client_env(self.config, self.state, base)

    def inject_xid(self, index: int, xid: int) -> None:
        fakegpu.inject_xid(self.state, self.uuids[index], xid)

    def set_lost(self, index: int, lost: bool) -> None:
        fakegpu.set_lost(self.state, self.uuids[index], lost)


@pytest.fixture(scope="session")
def native() -> None:
    """The hook and the fake GPU, built as CI builds them."""
    fakegpu.build()
    fakegpu.build_hook()


def four_gpus() -> list[fakegpu.FakeGpuSpec]:
    """Four fake A100s on two NUMA nodes, NVLinked in pairs (0-1, 2-3)."""
    return [
        fakegpu.example_gpu(
            i,
            model="NVIDIA A100-SXM4-40GB",
            memory_mib=40960,
            numa_node=i // 2,
            nvlink_peers=(fakegpu.gpu_uuid(i ^ 1),),
        )
        for i in range(4)
    ]


@pytest.fixture
def fake_gpus(tmp_path: Path, native: None) -> FakeGpus:
    specs = four_gpus()
    config = fakegpu.write_config(tmp_path / "gpus.conf", specs)
    state = tmp_path / "fakegpu-state"
    state.mkdir()
    return FakeGpus(config=config, state=state, specs=specs)


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
    control_plane: ControlPlane, kube: client.ApiClient, kubelet: KubeletStandIn, tmp_path: Path
) -> Iterator[Callable[..., PluginProcess]]:
    """Starts ``tessera-device-plugin`` for a node with the given environment and extra flags."""
    started: list[ManagedProcess] = []
    token = service_account_token(kube, "prometheus", reader=True)

    def start(
        node: str,
        env: dict[str, str],
        *flags: str,
        kubeconfig: Path | None = None,
        state_dir: Path | None = None,
    ) -> PluginProcess:
        state_dir = state_dir or tmp_path / f"state-{len(started)}"
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
        return PluginProcess(process, node, state_dir, token)

    try:
        yield start
    finally:
        for process in started:
            process.stop()


STAND_IN = """\
import contextlib
import os
import sys

pipe = os.environ["CUDA_MPS_PIPE_DIRECTORY"]
pid_file = os.path.join(pipe, "nvidia-cuda-mps-control.pid")
fifo = os.path.join(pipe, "control")
if sys.argv[1:] == ["-d"]:
    if os.fork():
        os._exit(0)
    os.setsid()
    if os.fork():
        os._exit(0)
    null = os.open(os.devnull, os.O_RDWR)
    for fd in (0, 1, 2):
        os.dup2(null, fd)
    if not os.path.exists(fifo):
        os.mkfifo(fifo)
    with open(os.path.join(os.environ["CUDA_MPS_LOG_DIRECTORY"], "control.log"), "a") as log:
        log.write(f"started {os.getpid()} devices {os.environ.get('CUDA_VISIBLE_DEVICES', '')}\\n")
    with open(pid_file + ".tmp", "w") as out:
        out.write(f"{os.getpid()}\\n")
    os.replace(pid_file + ".tmp", pid_file)
    while True:
        with open(fifo) as commands:
            for line in commands:
                if line.strip() == "quit":
                    os.unlink(pid_file)
                    os._exit(0)
elif not sys.argv[1:]:
    with open(fifo, "w") as daemon:
        daemon.write(sys.stdin.read())
else:
    sys.exit(f"unknown arguments {sys.argv[1:]}")
"""


@pytest.fixture
def control(tmp_path: Path) -> Iterator[Path]:
    """A stand-in MPS control program, named as NVIDIA's (``STAND_IN``: ``-d`` daemonises, writes its
    pid file and a ``control`` FIFO into CUDA_MPS_PIPE_DIRECTORY and logs its start to
    ``control.log``; without arguments it passes its stdin to the daemon, which exits on ``quit``).
    Every daemon it left under ``<tmp_path>/state`` is killed after the test."""
    program = tmp_path / "bin" / "nvidia-cuda-mps-control"
    program.parent.mkdir()
    program.write_text(f"#!{sys.executable}\n{STAND_IN}")
    program.chmod(0o755)
    yield program
    log = tmp_path / "state" / "mps" / "log" / "control.log"
    for line in log.read_text().splitlines() if log.exists() else []:
        pid = int(line.split()[1])
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGKILL)
