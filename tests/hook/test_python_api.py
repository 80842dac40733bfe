"""The Python side: the limits-file writer the device plugin imports, and the region reader. What
it shares with the C side is checked in test_constants.py."""

from __future__ import annotations

import os
import stat
import time
from collections.abc import Callable
from pathlib import Path

import pytest

from deviceplugin.metrics import AgentCollector
from hook.limits import CONTAINER_REGION_FILE, DeviceLimit, render_limits, write_limits
from hook.region import RegionError, RegionUsage, read_region
from nodeagent.records import ServedRecord
from nodeagent.statedir import REGION_NAME, StateDir
from tessera.contract import CONTAINER_COORDINATION_DIR, ContractError, GpuGrant, QosClass
from tests.hook.conftest import GIB, MIB, Clients, FakeGpus, Processes

UUID = "GPU-00000001-0000-4000-8000-000000000001"


def test_render_limits_is_the_documented_format() -> None:
    text = render_limits(
        [DeviceLimit(UUID, GIB, 30), DeviceLimit("GPU-b", 2 * GIB, 0)],
        elastic=True,
        qos=QosClass.BEST_EFFORT,
        coordination=CONTAINER_COORDINATION_DIR,
    )
    assert text == (
        "# Tessera limits, written by the device plugin; format in docs/hook.md\n"
        "version 2\n"
        f"region {CONTAINER_REGION_FILE}\n"
        "elastic 1\n"
        "qos best-effort\n"
        f"coordination {CONTAINER_COORDINATION_DIR}\n"
        f"device {UUID} memory 1073741824 cores 30\n"
        "device GPU-b memory 2147483648 cores 0\n"
    )


def test_device_limit_from_a_grant() -> None:
    grant = GpuGrant(uuid=UUID, memory_quota_mib=4096, cores=25)
    assert DeviceLimit.from_grant(grant) == DeviceLimit(UUID, 4096 * MIB, 25)


@pytest.mark.parametrize(
    ("devices", "kwargs", "message"),
    [
        ([], {}, "limits: 0 devices, expected 1..16"),
        ([DeviceLimit(f"GPU-{i}", GIB, 0) for i in range(17)], {}, "limits: 17 devices, expected 1..16"),
        ([DeviceLimit(UUID, GIB, 0), DeviceLimit(UUID, GIB, 0)], {}, "device uuids must be distinct"),
        ([DeviceLimit("", GIB, 0)], {}, "limits: uuid '' must be 1..79 characters without spaces"),
        ([DeviceLimit("GPU a", GIB, 0)], {}, "limits: uuid 'GPU a' must be 1..79 characters without spaces"),
        ([DeviceLimit(UUID, 0, 0)], {}, f"limits: device {UUID}: memory_quota_bytes 0 must be > 0"),
        ([DeviceLimit(UUID, GIB, 101)], {}, f"limits: device {UUID}: cores 101 is outside 0..100"),
        ([DeviceLimit(UUID, GIB, -1)], {}, f"limits: device {UUID}: cores -1 is outside 0..100"),
        (
            [DeviceLimit(UUID, GIB, 0)],
            {"region": "rel/region"},
            "limits: region 'rel/region' must be an absolute",
        ),
        (
            [DeviceLimit(UUID, GIB, 0)],
            {"coordination": "run/coordination"},
            "limits: coordination 'run/coordination' must be an absolute",
        ),
    ],
)
def test_bad_limits_are_refused_naming_the_field(
    devices: list[DeviceLimit], kwargs: dict[str, str], message: str
) -> None:
    with pytest.raises(ContractError) as error:
        render_limits(devices, **kwargs)  # type: ignore[arg-type]
    assert message in str(error.value)


def test_write_limits_is_atomic_and_read_only(tmp_path: Path) -> None:
    path = tmp_path / "sub" / "limits"
    write_limits(path, [DeviceLimit(UUID, GIB, 30)])
    write_limits(path, [DeviceLimit(UUID, 2 * GIB, 30)])
    assert f"device {UUID} memory {2 * GIB} cores 30" in path.read_text()
    assert stat.S_IMODE(path.stat().st_mode) == 0o444
    assert [p.name for p in path.parent.iterdir()] == ["limits"]


def test_read_region_reports_typed_usage_of_live_processes(
    gpu: FakeGpus, clients: Clients, processes: Processes, tmp_path: Path
) -> None:
    limits, region = tmp_path / "limits", tmp_path / "container-region"
    write_limits(limits, [DeviceLimit(gpu.uuids[0], GIB, 30)], region=str(region))
    env = gpu.env(TESSERA_LIMITS_FILE=str(limits))
    holder = processes.start(
        [clients.dynamic, "dlsym", "alloc", "300m", "launch", "sleep_us_1000", "50", "100", "hold"], env
    )
    assert holder.stdout is not None
    assert holder.stdout.readline().strip() == "ok 0"
    while not holder.stdout.readline().startswith("holding"):
        pass
    usage = read_region(region)
    assert usage.live_processes == 1
    (device,) = usage.devices
    assert (device.uuid, device.memory_used_bytes, device.memory_quota_bytes) == (
        gpu.uuids[0],
        300 * MIB,
        GIB,
    )
    assert (device.cores, device.elastic, device.processes, device.launches) == (30, False, 1, 50)
    assert device.busy_seconds == pytest.approx(0.05, rel=0.2)
    assert device.throttled_seconds > 0
    Processes.stop(holder)
    after = read_region(region)
    assert (after.live_processes, after.devices[0].memory_used_bytes, after.devices[0].processes) == (0, 0, 0)


def test_read_region_keeps_the_peak_and_counts_refusals_after_the_process_exits(
    gpu: FakeGpus, clients: Clients, processes: Processes, tmp_path: Path
) -> None:
    limits, region = tmp_path / "limits", tmp_path / "container-region"
    write_limits(limits, [DeviceLimit(gpu.uuids[0], GIB, 0)], region=str(region))
    steps = ["alloc", "600m", "free", "0", "alloc", "300m", "alloc", "800m", "alloc", "800m"]
    result = processes.run([clients.dynamic, "dlsym", *steps], gpu.env(TESSERA_LIMITS_FILE=str(limits)))
    assert result.lines == ["ok 0", "ok", "ok 1", *["error CUDA_ERROR_OUT_OF_MEMORY"] * 2], result.stderr
    (d,) = read_region(region).devices
    # The process is gone: nothing is used, the most it held and its refusals stay.
    assert (d.memory_used_bytes, d.memory_peak_bytes, d.allocations_refused) == (0, 600 * MIB, 2)


def test_a_region_being_created_reads_as_empty(tmp_path: Path, clients: Clients) -> None:
    fresh = tmp_path / "fresh"
    fresh.touch()
    assert read_region(fresh) == RegionUsage(devices=(), live_processes=0)


def test_read_region_errors_name_the_path(tmp_path: Path, clients: Clients) -> None:
    missing, garbage = tmp_path / "missing", tmp_path / "garbage"
    garbage.write_bytes(b"x" * 1024)
    with pytest.raises(RegionError, match=f"region {missing}: No such file or directory"):
        read_region(missing)
    with pytest.raises(RegionError, match=f"region {garbage}: not a Tessera region of this version"):
        read_region(garbage)


@pytest.mark.parametrize(
    ("make", "reason"),
    [
        (os.mkfifo, "not a regular file"),
        (lambda path: path.mkdir(), "not a regular file"),
        (lambda path: path.symlink_to("/etc/passwd"), "a symbolic link, not followed"),
        (lambda path: path.write_bytes(b"\0" * 64), "not a Tessera region of this version"),
    ],
)
def test_a_region_path_the_container_tampered_with_fails_at_once(
    make: Callable[[Path], object], reason: str, tmp_path: Path, clients: Clients
) -> None:
    """The node agent reads regions on the host, as root, where the container can write."""
    region = tmp_path / "region"
    make(region)
    started = time.monotonic()
    with pytest.raises(RegionError, match=f"region {region}: {reason}"):
        read_region(region)
    assert time.monotonic() - started < 5


def test_a_region_with_forged_counts_is_refused(
    gpu: FakeGpus, clients: Clients, processes: Processes, tmp_path: Path
) -> None:
    """Counts in the file index nothing before they are checked against the layout."""
    region = tmp_path / "region"
    done = processes.run([clients.dynamic, "dlsym", "alloc", "1m"], gpu.env(TESSERA_REGION=str(region)))
    assert done.lines == ["ok 0"], done.stderr
    data = bytearray(region.read_bytes())
    forged = tmp_path / "forged"
    for offset in (12, 16):  # devices, then procs_hw (struct vgpu_region in hook/src/region.h)
        copy = bytearray(data)
        copy[offset : offset + 4] = (0xFFFFFFFF).to_bytes(4, "little")
        forged.write_bytes(bytes(copy))
        with pytest.raises(RegionError, match="not a Tessera region of this version"):
            read_region(forged)
    # Cut short, it is no region either (and never mapped, so never a SIGBUS).
    forged.write_bytes(bytes(data[: len(data) // 2]))
    with pytest.raises(RegionError, match="not a Tessera region of this version"):
        read_region(forged)


def test_metrics_keep_serving_when_a_container_plants_a_fifo_at_its_region(
    tmp_path: Path, clients: Clients, caplog: pytest.LogCaptureFixture
) -> None:
    """The node agent's scrape reads every container's region: a FIFO there is logged, not waited on."""
    state = StateDir(tmp_path / "state-dir")
    grant = GpuGrant(uuid=UUID, memory_quota_mib=1024, cores=30)
    for name in ("tampered", "honest"):
        where = state.container(f"uid-{name}", "main")
        state.write_record(
            where,
            ServedRecord(namespace="ns", pod=name, pod_uid=f"uid-{name}", container="main", gpus=(grant,)),
        )
        where.state.mkdir()
        if name == "tampered":
            os.mkfifo(where.state / REGION_NAME)
    collector = AgentCollector("node", lambda: (), lambda uuid: None, state)
    started = time.monotonic()
    families = {family.name: family for family in collector.collect()}
    assert time.monotonic() - started < 5
    quotas = {
        sample.labels["pod"]: sample.value
        for sample in families["tessera_container_memory_quota_bytes"].samples
    }
    assert quotas == {"tampered": GIB, "honest": GIB}
    assert "not a regular file" in caplog.text
