"""MPS mode (docs/hook.md, "MPS mode"): the hook sets the MPS client settings that its limits give
just before the driver's cuInit reads them, over the container's own environment, and a best-effort
container under MPS is held back by MPS (thread share, priority), not by the hook's time cap or its
yield rule."""

from __future__ import annotations

import subprocess
import sys

import pytest

from hook.limits import DeviceLimit, MpsClient, write_limits
from tessera.contract import QosClass
from tests.hook.conftest import GIB, Clients, FakeGpus, Processes
from tests.hook.test_compute import finish, launch, share_of

# What the driver sees at cuInit: the environment read from C (Python's os.environ is a copy made
# at start), right after the first cuInit, which the hook wraps.
SEEN_AT_CUINIT = """
import ctypes
from cuda.bindings import driver
driver.cuInit(0)
libc = ctypes.CDLL(None)
libc.getenv.restype = ctypes.c_char_p
for name in ("CUDA_MPS_PIPE_DIRECTORY", "CUDA_MPS_ACTIVE_THREAD_PERCENTAGE", "CUDA_MPS_CLIENT_PRIORITY"):
    value = libc.getenv(name.encode())
    print(name, value.decode() if value else "-")
"""

# A tenant's own try at leaving the daemon, taking the whole GPU and normal priority.
TENANT = {
    "CUDA_MPS_PIPE_DIRECTORY": "/tmp/elsewhere",
    "CUDA_MPS_ACTIVE_THREAD_PERCENTAGE": "100",
    "CUDA_MPS_CLIENT_PRIORITY": "0",
}


def seen(gpu: FakeGpus, processes: Processes, **variables: str) -> dict[str, str]:
    result = processes.run([sys.executable, "-c", SEEN_AT_CUINIT], gpu.env(**{**TENANT, **variables}))
    assert result.returncode == 0, result.stderr
    return dict(line.split(" ", 1) for line in result.lines)


def test_the_limits_file_sets_the_mps_client_over_the_containers_environment(
    gpu: FakeGpus, processes: Processes
) -> None:
    limits = gpu.config.parent / "limits"
    write_limits(
        limits,
        [DeviceLimit(uuid=gpu.uuids[0], memory_quota_bytes=GIB, cores=10)],
        qos=QosClass.BEST_EFFORT,
        mps=MpsClient("/var/run/tessera/mps", threads=50, priority=1),
    )
    assert seen(gpu, processes, TESSERA_LIMITS_FILE=str(limits)) == {
        "CUDA_MPS_PIPE_DIRECTORY": "/var/run/tessera/mps",
        "CUDA_MPS_ACTIVE_THREAD_PERCENTAGE": "50",
        "CUDA_MPS_CLIENT_PRIORITY": "1",
    }


def test_standalone_settings_and_none_without_them(gpu: FakeGpus, processes: Processes) -> None:
    assert seen(gpu, processes, TESSERA_MPS="/tmp/mps threads 100 priority 0") == {
        "CUDA_MPS_PIPE_DIRECTORY": "/tmp/mps",
        "CUDA_MPS_ACTIVE_THREAD_PERCENTAGE": "100",
        "CUDA_MPS_CLIENT_PRIORITY": "0",
    }
    # Without settings the hook leaves MPS to the environment (time-sliced nodes have no daemon).
    assert seen(gpu, processes) == TENANT


def test_a_broken_mps_setting_is_refused_naming_it(gpu: FakeGpus, processes: Processes) -> None:
    limits = gpu.config.parent / "limits"
    limits.write_text(
        f"version 4\nmps relative threads 50 priority 1\ndevice {gpu.uuids[0]} memory {GIB} cores 0\n"
    )
    result = processes.run([sys.executable, "-c", SEEN_AT_CUINIT], gpu.env(TESSERA_LIMITS_FILE=str(limits)))
    assert "line 2: expected `mps <absolute pipe directory> threads <1-100> priority <0|1>`" in result.stderr
    assert "CUDA_MPS_PIPE_DIRECTORY -" in result.lines  # nothing applied from a refused file
    result = processes.run(
        [sys.executable, "-c", SEEN_AT_CUINIT], gpu.env(TESSERA_MPS="/tmp/mps threads 0 priority 1")
    )
    assert "TESSERA_MPS: expected `mps" in result.stderr


@pytest.mark.wallclock
def test_best_effort_under_mps_is_not_capped_in_time(
    gpu: FakeGpus, clients: Clients, processes: Processes
) -> None:
    """Without MPS and without a coordination area a best-effort container runs as standard, held
    to its cores; under MPS its thread share and priority hold it back, so the hook does not."""
    mps = {
        "TESSERA_QOS": "best-effort",
        "TESSERA_CORES": "10",
        "TESSERA_MPS": "/tmp/mps threads 50 priority 1",
    }
    under_mps = processes.start(launch(clients, "dlsym", "launch", 2), gpu.env(**mps))
    assert share_of(finish(under_mps)) >= 80
    capped = subprocess.Popen(
        launch(clients, "dlsym", "launch", 2),
        env=gpu.env(TESSERA_QOS="best-effort", TESSERA_CORES="10"),
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    assert share_of(finish(capped)) <= 15
