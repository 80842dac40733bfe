"""Live resize in the hook: a process holding memory under a limits file follows the file when the
device plugin replaces it (by a rename), without a restart and without losing an allocation."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from hook.limits import DeviceLimit, write_limits
from hook.region import read_region
from tests.hook.conftest import MIB, NVML_CLIENT, Clients, FakeGpus, Processes
from tests.hook.test_compute import KERNEL, share_between, ticks
from tests.waiting import wait_for

OOM = "error CUDA_ERROR_OUT_OF_MEMORY"
BLOCK = "256m"


def limits_file(tmp_path: Path) -> Path:
    """Alone in its directory, as the device plugin mounts it."""
    return tmp_path / "limits.d" / "limits"


def resize(limits: Path, gpu: FakeGpus, memory_mib: int, cores: int = 0) -> None:
    write_limits(limits, [DeviceLimit(gpu.uuids[0], memory_mib * MIB, cores)], region=str(gpu.region))


def region_quota(gpu: FakeGpus) -> int | None:
    usage = read_region(gpu.region).device(gpu.uuids[0])
    return None if usage is None else usage.memory_quota_bytes


def lines(process: subprocess.Popen[str], count: int) -> list[str]:
    assert process.stdout is not None
    return [process.stdout.readline().strip() for _ in range(count)]


def answer(process: subprocess.Popen[str]) -> None:
    assert process.stdin is not None
    process.stdin.write("go\n")
    process.stdin.flush()


def test_growing_the_quota_lets_a_holding_process_allocate_more(
    gpu: FakeGpus, clients: Clients, processes: Processes, tmp_path: Path
) -> None:
    limits = limits_file(tmp_path)
    resize(limits, gpu, 1024)
    env = gpu.env(TESSERA_LIMITS_FILE=str(limits))
    script = ["alloc", BLOCK] * 5 + ["wait-stdin"] + ["await", "alloc", BLOCK, "60"] * 4
    holder = processes.start([clients.dynamic, "dlsym", *script, "alloc", BLOCK, "info", "hold"], env)
    assert lines(holder, 6) == ["ok 0", "ok 1", "ok 2", "ok 3", OOM, "waiting"]
    resize(limits, gpu, 2048)
    answer(holder)
    got = lines(holder, 7)
    assert [g.split()[:2] for g in got[:4]] == [["ok", str(i)] for i in range(4, 8)], got
    assert got[4:] == [OOM, f"info 0 {2048 * MIB}", "holding"]
    assert region_quota(gpu) == 2048 * MIB
    # NVML in another process of the container shows the new total too.
    nvml = processes.run([sys.executable, NVML_CLIENT], env)
    assert nvml.lines[0] == f"{2048 * MIB} {2048 * MIB} 0", nvml.stderr


def test_shrinking_below_use_frees_nothing_and_refuses_until_use_falls(
    gpu: FakeGpus, clients: Clients, processes: Processes, tmp_path: Path
) -> None:
    limits = limits_file(tmp_path)
    resize(limits, gpu, 1024)
    env = gpu.env(TESSERA_LIMITS_FILE=str(limits))
    script = ["alloc", BLOCK] * 4 + ["wait-stdin", "info", "alloc", BLOCK, "free", "0", "free", "1"]
    script += ["alloc", BLOCK, "free", "2", "alloc", BLOCK, "info", "hold"]
    holder = processes.start([clients.dynamic, "dlsym", *script], env)
    assert lines(holder, 5) == ["ok 0", "ok 1", "ok 2", "ok 3", "waiting"]
    resize(limits, gpu, 512)
    wait_for(lambda: region_quota(gpu) == 512 * MIB, timeout=30, what="the hook to follow the limits file")
    answer(holder)
    assert lines(holder, 9) == [
        f"info 0 {512 * MIB}",  # the new total at once; all 1024 MiB still held
        OOM,
        "ok",
        "ok",
        OOM,  # 512 MiB held: at the quota
        "ok",
        "ok 4",  # 768 MiB freed: 256 MiB held, one more block fits
        f"info 0 {512 * MIB}",
        "holding",
    ]
    assert read_region(gpu.region).device(gpu.uuids[0]).memory_used_bytes == 512 * MIB  # type: ignore[union-attr]


def test_a_broken_limits_file_refuses_new_memory_until_a_good_one_replaces_it(
    gpu: FakeGpus, clients: Clients, processes: Processes, tmp_path: Path
) -> None:
    limits = limits_file(tmp_path)
    resize(limits, gpu, 1024)
    env = gpu.env(TESSERA_LIMITS_FILE=str(limits))
    script = ["alloc", BLOCK, "wait-stdin", "alloc", BLOCK, "wait-stdin", "alloc", BLOCK, "hold"]
    holder = processes.start([clients.dynamic, "dlsym", *script], env)
    assert lines(holder, 2) == ["ok 0", "waiting"]
    broken = limits.with_name("broken")
    broken.write_text("version 2\ndevice nonsense\n")
    broken.replace(limits)
    wait_for(lambda: region_quota(gpu) == 0, timeout=30, what="the hook to fail closed")
    answer(holder)
    assert lines(holder, 2) == [OOM, "waiting"]
    resize(limits, gpu, 1024)
    wait_for(lambda: region_quota(gpu) == 1024 * MIB, timeout=30, what="the hook to follow the good file")
    answer(holder)
    assert lines(holder, 2) == ["ok 1", "holding"]
    holder.kill()
    _, err = holder.communicate(timeout=30)
    assert (
        "line 2: expected `device <uuid> memory <bytes> cores <0-100>`; refusing new device memory" in err
    ), err


@pytest.mark.wallclock
def test_raising_the_compute_share_changes_the_achieved_share(
    gpu: FakeGpus, clients: Clients, processes: Processes, tmp_path: Path
) -> None:
    limits = limits_file(tmp_path)
    resize(limits, gpu, 1024, cores=30)
    env = gpu.env(TESSERA_LIMITS_FILE=str(limits))
    client = processes.start([clients.dynamic, "dlsym", "launch", KERNEL, "100000000", "14"], env)
    assert client.stdout is not None
    seen: list[str] = []
    while not seen or not seen[-1].startswith("tick") or float(seen[-1].split()[1]) < 5.0:
        seen.append(client.stdout.readline().strip())
        assert seen[-1], "the client ended early"
    resized_at = float(seen[-1].split()[1])
    resize(limits, gpu, 1024, cores=60)
    out, err = client.communicate(timeout=120)
    assert client.returncode == 0, err
    points = ticks("\n".join(seen) + "\n" + out)
    before = share_between(points, 1.0, resized_at)
    after = share_between(points, resized_at + 2.0, 14.0)
    assert 22 <= before <= 38, (before, after)
    assert 50 <= after <= 70, (before, after)
