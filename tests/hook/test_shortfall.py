"""The wait of a guaranteed allocation on a GPU whose memory best-effort neighbours borrow
(hook/src/shortfall.c): within its quota, an allocation the driver refuses for lack of memory waits,
published in the region, for the node agent to free memory, and is retried; without the limits
file's `oversubscribed` line it fails at once, as it always did."""

from __future__ import annotations

import subprocess
from pathlib import Path

import pytest

from hook.limits import DeviceLimit, write_limits
from hook.region import read_region
from tests.hook.conftest import MIB, Clients, FakeGpus, Processes, write_fake_gpus
from tests.waiting import wait_for

OOM = "error CUDA_ERROR_OUT_OF_MEMORY"
BLOCK = "256m"


@pytest.fixture
def small_gpu(tmp_path: Path, clients: Clients) -> FakeGpus:
    """One fake 1 GiB GPU: four blocks."""
    return write_fake_gpus(tmp_path, 1, memory_gib=1)


def guaranteed(gpu: FakeGpus, tmp_path: Path, wait_ms: int) -> dict[str, str]:
    """A standard container's environment: 768 MiB on the GPU, `oversubscribed` when wait_ms > 0."""
    limits = tmp_path / "limits.d" / "limits"
    write_limits(limits, [DeviceLimit(gpu.uuids[0], 768 * MIB, 0, wait_ms)], region=str(gpu.region))
    return gpu.env(TESSERA_LIMITS_FILE=str(limits))


def fill_the_gpu(
    gpu: FakeGpus, clients: Clients, processes: Processes, tmp_path: Path
) -> subprocess.Popen[str]:
    """A best-effort neighbour (its own region) holding the three blocks the guaranteed one leaves."""
    env = gpu.env(TESSERA_REGION=str(tmp_path / "neighbour-region"), TESSERA_QOS="best-effort")
    neighbour = processes.start([clients.dynamic, "dlsym", *["alloc", BLOCK] * 3, "hold"], env)
    assert lines(neighbour, 4) == ["ok 0", "ok 1", "ok 2", "holding"]
    return neighbour


def lines(process: subprocess.Popen[str], count: int) -> list[str]:
    assert process.stdout is not None
    return [process.stdout.readline().strip() for _ in range(count)]


def go(process: subprocess.Popen[str]) -> None:
    assert process.stdin is not None
    process.stdin.write("go\n")
    process.stdin.flush()


def waiting_bytes(gpu: FakeGpus) -> int:
    usage = read_region(gpu.region).device(gpu.uuids[0])
    return 0 if usage is None else usage.memory_waiting_bytes


def test_an_allocation_the_driver_refuses_waits_for_the_neighbour_to_go(
    small_gpu: FakeGpus, clients: Clients, processes: Processes, tmp_path: Path
) -> None:
    script = ["alloc", BLOCK, "wait-stdin", "alloc", BLOCK, "info", "hold"]
    holder = processes.start([clients.dynamic, "dlsym", *script], guaranteed(small_gpu, tmp_path, 120_000))
    assert lines(holder, 2) == ["ok 0", "waiting"]
    neighbour = fill_the_gpu(small_gpu, clients, processes, tmp_path)
    go(holder)
    # Within its quota and refused by the driver: it waits, and says for how much in its region,
    # the reservation held meanwhile (so the best-effort quotas computed from it shrink at once).
    wait_for(lambda: waiting_bytes(small_gpu) == 256 * MIB, timeout=30, what="the wait to be published")
    usage = read_region(small_gpu.region).device(small_gpu.uuids[0])
    assert usage is not None and usage.memory_used_bytes == 512 * MIB
    processes.stop(neighbour)  # the node agent's eviction
    assert lines(holder, 3) == ["ok 1", f"info {256 * MIB} {768 * MIB}", "holding"]
    assert waiting_bytes(small_gpu) == 0


def test_the_wait_is_bounded_and_then_the_allocation_fails(
    small_gpu: FakeGpus, clients: Clients, processes: Processes, tmp_path: Path
) -> None:
    fill_the_gpu(small_gpu, clients, processes, tmp_path)
    result = processes.run(
        [clients.dynamic, "dlsym", "alloc", BLOCK, "alloc", BLOCK, "info"],
        guaranteed(small_gpu, tmp_path, 300),
    )
    # Nothing reserved is left behind: 256 MiB held, and the GPU itself has nothing free.
    assert result.lines == ["ok 0", OOM, f"info 0 {768 * MIB}"], result.stderr
    assert "waiting up to 300 ms" in result.stderr
    assert "no memory freed" in result.stderr
    assert waiting_bytes(small_gpu) == 0


def test_without_an_oversubscribed_line_the_driver_refusal_is_returned_at_once(
    small_gpu: FakeGpus, clients: Clients, processes: Processes, tmp_path: Path
) -> None:
    fill_the_gpu(small_gpu, clients, processes, tmp_path)
    result = processes.run(
        [clients.dynamic, "dlsym", "alloc", BLOCK, "alloc", BLOCK], guaranteed(small_gpu, tmp_path, 0)
    )
    assert result.lines == ["ok 0", OOM], result.stderr
    assert "waiting" not in result.stderr
