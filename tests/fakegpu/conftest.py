"""Fixtures for the fake GPU's own tests: the libraries built once, a two-GPU config per test, and
client processes that are always stopped (process groups killed) when the test ends."""

from __future__ import annotations

import os
import subprocess
import sys
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest

from fakegpu import FakeGpuSpec, build, client_env, cuclient, example_gpu, gpu_uuid, write_config
from tests.processes import Processes

NVML_PROBE = Path(__file__).resolve().parent / "clients" / "nvml_probe.py"
BINDINGS_PROBE = Path(__file__).resolve().parent / "clients" / "bindings_probe.py"
TIMEOUT = 60


@pytest.fixture(scope="session")
def built() -> Path:
    return build()


@dataclass
class Gpus:
    config: Path
    state: Path
    specs: list[FakeGpuSpec]

    def env(self, **extra: str) -> dict[str, str]:
        base = {k: v for k, v in os.environ.items() if not k.startswith(("CUDA_", "NVIDIA_", "LD_PRELOAD"))}
        env = client_env(self.config, self.state, base)
        env.update(extra)
        return env


@pytest.fixture
def gpus(tmp_path: Path, built: Path) -> Gpus:
    """GPU 0: an 8 GiB A100 (108 SMs, NUMA 0) NVLinked to GPU 1: a 1 GiB H100 (132 SMs, no NUMA)."""
    specs = [
        example_gpu(0, memory_mib=8192, numa_node=0, nvlink_peers=(gpu_uuid(1),)),
        example_gpu(
            1, model="NVIDIA H100 80GB HBM3", memory_mib=1024, sm_count=132, compute_capability="9.0"
        ),
    ]
    config = write_config(tmp_path / "gpus.conf", specs, util_window_ms=200)
    return Gpus(config=config, state=tmp_path / "state", specs=specs)


def fields(line: str) -> dict[str, str]:
    """The key=value fields of a cuclient line."""
    return dict(part.split("=", 1) for part in line.split()[1:] if "=" in part)


class ClientProcesses(Processes):
    """Processes of one test, with the fake GPU's own clients at hand."""

    def cuclient(self, env: dict[str, str], *steps: str) -> list[str]:
        done = self.run([cuclient(), *steps], env, timeout=TIMEOUT)
        assert done.returncode == 0, f"cuclient {steps} failed: {done.stdout}{done.stderr}"
        return done.lines

    def probe(self, env: dict[str, str], *commands: str) -> list[str]:
        done = self.run([sys.executable, NVML_PROBE, *commands], env, timeout=TIMEOUT)
        assert done.returncode == 0, f"nvml_probe {commands} failed: {done.stdout}{done.stderr}"
        return done.lines

    @staticmethod
    def expect(process: subprocess.Popen[str], prefix: str) -> str:
        """The next stdout line of a running process, which must start with `prefix`."""
        assert process.stdout is not None
        line = process.stdout.readline()
        assert line.startswith(prefix), f"expected {prefix!r} from {process.args!r}, got {line!r}"
        return line


@pytest.fixture
def procs() -> Iterator[ClientProcesses]:
    running = ClientProcesses()
    try:
        yield running
    finally:
        running.stop_all()
