"""The memory quota holds on every path a client can reach the driver by, for every kind of
allocation, and cuMemGetInfo / cuDeviceTotalMem report the quota as the GPU's size."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

from hook.limits import DeviceLimit, write_limits
from hook.region import read_region
from tests.hook.conftest import BINDINGS_CLIENT, GIB, MIB, Clients, FakeGpus, Processes

PATHS = ["link", "dlsym", "proc", "proc-self", "ptsz"]
KINDS = ["alloc", "managed", "create", "async"]
OOM = "error CUDA_ERROR_OUT_OF_MEMORY"
# 256 MiB four times fills a 1 GiB quota; the fifth fails; after one free, one more fits.
QUOTA_SCRIPT_EXPECTED = ["ok 0", "ok 1", "ok 2", "ok 3", OOM, "ok", "ok 4", f"info 0 {GIB}", f"total {GIB}"]


def quota_script(kind: str, size: str) -> list[str]:
    return [*[kind, size] * 5, "free", "0", kind, size, "info", "total"]


@pytest.mark.parametrize("kind", [*KINDS, "pool", "pitch", "array"])
@pytest.mark.parametrize("mode", PATHS)
def test_quota_holds_through_c_client(
    mode: str, kind: str, gpu: FakeGpus, clients: Clients, processes: Processes
) -> None:
    result = processes.run(
        [clients.for_mode(mode), mode, *quota_script(kind, "256m")], gpu.env(TESSERA_MEMORY_LIMIT="1g")
    )
    assert result.lines == QUOTA_SCRIPT_EXPECTED, result.stderr


@pytest.mark.parametrize("kind", KINDS)
def test_quota_holds_through_cuda_bindings(kind: str, gpu: FakeGpus, processes: Processes) -> None:
    result = processes.run(
        [sys.executable, BINDINGS_CLIENT, *quota_script(kind, "256")], gpu.env(TESSERA_MEMORY_LIMIT="1g")
    )
    assert result.lines == QUOTA_SCRIPT_EXPECTED, result.stderr


def test_without_the_hook_the_same_script_is_not_limited(
    gpu: FakeGpus, clients: Clients, processes: Processes
) -> None:
    """The control: the quota above is the hook's doing, not the fake GPU's."""
    result = processes.run(
        [clients.dynamic, "dlsym", *quota_script("alloc", "256m")],
        gpu.env(hooked=False, TESSERA_MEMORY_LIMIT="1g"),
    )
    assert result.lines[:7] == ["ok 0", "ok 1", "ok 2", "ok 3", "ok 4", "ok", "ok 5"]
    assert result.lines[8] == f"total {8 * GIB}"


def test_a_refused_allocation_leaves_nothing_in_the_driver(
    gpu: FakeGpus, clients: Clients, processes: Processes
) -> None:
    holder = processes.start(
        [clients.dynamic, "dlsym", "alloc", "768m", "alloc", "512m", "hold"],
        gpu.env(TESSERA_MEMORY_LIMIT="1g"),
    )
    assert holder.stdout is not None
    assert [holder.stdout.readline().strip() for _ in range(3)] == ["ok 0", OOM, "holding"]
    # The fake driver itself, asked without the hook, holds exactly the one allocation.
    unhooked = processes.run([clients.dynamic, "dlsym", "info"], gpu.env(hooked=False))
    free, total = map(int, unhooked.lines[0].split()[1:])
    assert total - free == 768 * MIB


@pytest.mark.parametrize(
    ("variables", "total"),
    [
        ({"TESSERA_MEMORY_LIMIT": "1073741824"}, GIB),
        ({"TESSERA_MEMORY_LIMIT": "1048576k"}, GIB),
        ({"TESSERA_MEMORY_LIMIT": "1024M"}, GIB),
        ({"TESSERA_MEMORY_LIMIT": "3g", "TESSERA_MEMORY_LIMIT_0": "512m"}, 512 * MIB),
        ({"TESSERA_MEMORY_LIMIT_1": "512m"}, 8 * GIB),
        ({}, 8 * GIB),
    ],
)
def test_standalone_environment(
    variables: dict[str, str], total: int, gpu: FakeGpus, clients: Clients, processes: Processes
) -> None:
    result = processes.run([clients.dynamic, "dlsym", "info", "total"], gpu.env(variables))
    assert result.lines[1] == f"total {total}", result.stderr
    assert result.lines[0].split()[2] == str(total)


@pytest.mark.parametrize(
    ("variables", "message"),
    [
        ({"TESSERA_MEMORY_LIMIT": "4q"}, "TESSERA_MEMORY_LIMIT=4q is not a positive number of bytes"),
        ({"TESSERA_MEMORY_LIMIT": "0"}, "TESSERA_MEMORY_LIMIT=0 is not a positive number of bytes"),
        ({"TESSERA_MEMORY_LIMIT": "-1g"}, "TESSERA_MEMORY_LIMIT=-1g is not a positive number of bytes"),
        ({"TESSERA_MEMORY_LIMIT_0": "lots"}, "TESSERA_MEMORY_LIMIT_0=lots is not a positive number of bytes"),
        ({"TESSERA_CORES": "0"}, "TESSERA_CORES=0 is not in 1..100"),
        ({"TESSERA_CORES_0": "101"}, "TESSERA_CORES_0=101 is not in 1..100"),
        ({"TESSERA_ELASTIC": "yes"}, "TESSERA_ELASTIC=yes is not 0 or 1"),
        ({"TESSERA_QOS": "urgent"}, "TESSERA_QOS=urgent is not latency-critical, standard or best-effort"),
        (
            {"TESSERA_COORDINATION": "coordination"},
            "TESSERA_COORDINATION=coordination is not an absolute path",
        ),
    ],
)
def test_bad_environment_refuses_device_memory(
    variables: dict[str, str], message: str, gpu: FakeGpus, clients: Clients, processes: Processes
) -> None:
    result = processes.run([clients.dynamic, "dlsym", "alloc", "1m"], gpu.env(variables))
    assert result.lines == [OOM]
    assert message in result.stderr and "refusing device memory" in result.stderr, result.stderr


def test_limits_file_wins_over_environment(
    gpu: FakeGpus, clients: Clients, processes: Processes, tmp_path: Path
) -> None:
    limits, region = tmp_path / "limits", tmp_path / "container-region"
    write_limits(limits, [DeviceLimit(gpu.uuids[0], GIB, 0)], region=str(region))
    env = gpu.env(
        TESSERA_LIMITS_FILE=str(limits), TESSERA_MEMORY_LIMIT="8g", TESSERA_MEMORY_LIMIT_0="8g"
    )  # TESSERA_REGION (set by env()) is ignored too
    result = processes.run([clients.dynamic, "dlsym", "alloc", "768m", "info", "total"], env)
    assert result.lines == ["ok 0", f"info {256 * MIB} {GIB}", f"total {GIB}"], result.stderr
    assert not gpu.region.exists()


@pytest.mark.parametrize(
    ("text", "message"),
    [
        ("version 5\n", "line 1: version 5 is not 1..4"),
        ("version 1\n", "no device lines"),
        ("device GPU-x memory 1 cores 0\n", "no `version 4` line"),
        (
            "version 2\ndevice GPU-x memory 1 cores 0\noversubscribed GPU-x wait 10\n",
            "line 3: `oversubscribed` needs `version 3` (or later) before it",
        ),
        (
            "version 3\noversubscribed GPU-x wait 10\ndevice GPU-x memory 1 cores 0\n",
            "line 2: GPU GPU-x has no device line before it",
        ),
        (
            "version 3\ndevice GPU-x memory 1 cores 0\noversubscribed GPU-x wait 600001\n",
            "line 3: wait 600001 is not in 0..600000 milliseconds",
        ),
        (
            "version 3\ndevice GPU-x memory 1 cores 0\noversubscribed GPU-x 10\n",
            "line 3: expected `oversubscribed <uuid> wait <0-600000 milliseconds>`",
        ),
        ("version 2\nqos urgent\n", "line 2: qos urgent is not latency-critical, standard or best-effort"),
        ("version 1\nqos best-effort\n", "line 2: `qos` needs `version 2` (or later) before it"),
        ("version 2\ncoordination run\n", "line 2: coordination run is not an absolute path"),
        (
            "version 1\ndevice GPU-x memory 1g cores 0\n",
            "line 2: memory 1g is not a positive number of bytes",
        ),
        ("version 1\ndevice GPU-x memory 1 cores 300\n", "line 2: cores 300 is not in 0..100"),
        (
            "version 1\ndevice GPU-x memory 1\n",
            "line 2: expected `device <uuid> memory <bytes> cores <0-100>`",
        ),
        ("version 1\nregion relative/path\n", "line 2: region relative/path is not an absolute path"),
        ("version 1\nquota 5\n", "line 2: unknown line starting with quota"),
    ],
)
def test_bad_limits_file_refuses_device_memory(
    text: str, message: str, gpu: FakeGpus, clients: Clients, processes: Processes
) -> None:
    limits = gpu.config.parent / "limits"
    limits.write_text(text)
    result = processes.run(
        [clients.dynamic, "dlsym", "alloc", "1m"], gpu.env(TESSERA_LIMITS_FILE=str(limits))
    )
    assert result.lines == [OOM]
    assert f"limits file {limits}" in result.stderr and message in result.stderr, result.stderr


def test_missing_limits_file_refuses_device_memory(
    gpu: FakeGpus, clients: Clients, processes: Processes, tmp_path: Path
) -> None:
    missing = tmp_path / "absent"
    result = processes.run(
        [clients.dynamic, "dlsym", "alloc", "1m"], gpu.env(TESSERA_LIMITS_FILE=str(missing))
    )
    assert result.lines == [OOM]
    assert f"limits file {missing}: No such file or directory; refusing device memory" in result.stderr


def test_gpu_missing_from_limits_file_gets_no_memory(
    two_gpus: FakeGpus, clients: Clients, processes: Processes, tmp_path: Path
) -> None:
    limits = tmp_path / "limits"
    write_limits(limits, [DeviceLimit(two_gpus.uuids[1], GIB, 0)], region=str(tmp_path / "r"))
    result = processes.run(
        [clients.dynamic, "dlsym", "alloc", "1m"], two_gpus.env(TESSERA_LIMITS_FILE=str(limits))
    )
    assert result.lines == [OOM]


@pytest.mark.parametrize("visible", ["1,0", "1"])
def test_accounting_follows_the_physical_gpu_under_cuda_visible_devices(
    visible: str, two_gpus: FakeGpus, clients: Clients, processes: Processes, tmp_path: Path
) -> None:
    limits, region = tmp_path / "limits", tmp_path / "container-region"
    write_limits(
        limits,
        [DeviceLimit(two_gpus.uuids[0], GIB, 0), DeviceLimit(two_gpus.uuids[1], 2 * GIB, 0)],
        region=str(region),
    )
    # CUDA ordinal 0 is physical GPU 1 here: its 2 GiB quota applies, and its usage is counted.
    env = two_gpus.env(TESSERA_LIMITS_FILE=str(limits), CUDA_VISIBLE_DEVICES=visible)
    holder = processes.start([clients.dynamic, "dlsym", "alloc", "1536m", "info", "hold"], env)
    assert holder.stdout is not None
    assert [holder.stdout.readline().strip() for _ in range(3)] == [
        "ok 0",
        f"info {512 * MIB} {2 * GIB}",
        "holding",
    ]
    usage = read_region(region)
    assert usage.device(two_gpus.uuids[1]) is not None
    assert usage.device(two_gpus.uuids[1]).memory_used_bytes == 1536 * MIB  # type: ignore[union-attr]
    gpu0 = usage.device(two_gpus.uuids[0])
    assert gpu0 is None or gpu0.memory_used_bytes == 0
    # A process that sees all GPUs in order shares that usage on the same physical GPU.
    other = processes.run([clients.dynamic, "dlsym", "info"], two_gpus.env(TESSERA_LIMITS_FILE=str(limits)))
    assert other.lines == [f"info {GIB} {GIB}"]  # its ordinal 0 is physical GPU 0: untouched


@pytest.mark.parametrize("mode", ["link", "dlsym", "proc"])
def test_destroying_a_context_returns_its_allocations(
    mode: str, gpu: FakeGpus, clients: Clients, processes: Processes
) -> None:
    script = ["alloc", "512m", "release-primary", "info", "alloc", "512m", "reset-primary", "info"]
    result = processes.run([clients.for_mode(mode), mode, *script], gpu.env(TESSERA_MEMORY_LIMIT="1g"))
    assert result.lines == ["ok 0", "ok", f"info {GIB} {GIB}", "ok 0", "ok", f"info {GIB} {GIB}"], (
        result.stderr
    )
