"""The SM time-slice quota, measured on the fake GPU's device timeline: kernels named
``sleep_us_<N>`` run exactly N microseconds, so a client's share of device time is the number of
kernels it completed times N over the wall time it took."""

from __future__ import annotations

import subprocess
from pathlib import Path

import pytest

from hook.limits import DeviceLimit, write_limits
from tests.hook.conftest import GIB, Clients, FakeGpus, Processes

pytestmark = pytest.mark.wallclock

KERNEL = "sleep_us_1000"
KERNEL_SECONDS = 1e-3


def share_of(output: str, seconds_per_kernel: float = KERNEL_SECONDS) -> float:
    """Percent of device time from the client's final "launched <count> <seconds>" line."""
    count, seconds = (
        line.split()[1:] for line in output.splitlines() if line.startswith("launched")
    ).__next__()
    return 100.0 * int(count) * seconds_per_kernel / float(seconds)


def ticks(output: str) -> list[tuple[float, int]]:
    return [
        (float(t), int(n))
        for _, t, n in (line.split() for line in output.splitlines() if line.startswith("tick"))
    ]


def share_between(
    points: list[tuple[float, int]], start: float, end: float, seconds_per_kernel: float = KERNEL_SECONDS
) -> float:
    inside = [(t, n) for t, n in points if start <= t <= end]
    (t0, n0), (t1, n1) = inside[0], inside[-1]
    return 100.0 * (n1 - n0) * seconds_per_kernel / (t1 - t0)


def launch(clients: Clients, mode: str, command: str, seconds: float) -> list[str]:
    return [str(clients.for_mode(mode)), mode, command, KERNEL, "100000000", str(seconds)]


def finish(process: subprocess.Popen[str], timeout: float = 120) -> str:
    out, err = process.communicate(timeout=timeout)
    assert process.returncode == 0, err + out
    return out


def test_one_container_at_30_percent_holds_its_share_over_10_s(
    gpu: FakeGpus, clients: Clients, processes: Processes
) -> None:
    out = finish(processes.start(launch(clients, "dlsym", "launch", 10), gpu.env(TESSERA_CORES="30")))
    assert 25 <= share_of(out) <= 35


@pytest.mark.parametrize(
    ("mode", "command"),
    [
        ("link", "launch"),
        ("proc", "launch-ex"),
        ("ptsz", "launch-coop"),
        ("ptsz", "launch"),
        ("dlsym", "launch-ex"),
    ],
)
def test_every_launch_api_is_throttled(
    mode: str, command: str, gpu: FakeGpus, clients: Clients, processes: Processes
) -> None:
    out = finish(processes.start(launch(clients, mode, command, 4), gpu.env(TESSERA_CORES="30")))
    assert 25 <= share_of(out) <= 35


@pytest.mark.parametrize("mode", ["dlsym", "ptsz"])
def test_graph_launches_are_throttled(
    mode: str, gpu: FakeGpus, clients: Clients, processes: Processes
) -> None:
    out = finish(
        processes.start(
            [clients.for_mode(mode), mode, "graph", "sleep_us_400", "4000"], gpu.env(TESSERA_CORES="30")
        )
    )
    assert 25 <= share_of(out, 400e-6) <= 35


@pytest.mark.parametrize("mode", ["dlsym", "ptsz"])
def test_graphs_recorded_by_stream_capture_are_whole_and_throttled(
    mode: str, gpu: FakeGpus, clients: Clients, processes: Processes
) -> None:
    """PyTorch's CUDA graphs and torch.compile's reduce-overhead mode record launches by stream
    capture. A launch on a capturing stream runs nothing, so the hook neither charges nor measures
    it: an event recorded in a capture is a graph node, and querying it invalidates the capture (on
    a real H200, `torch.cuda.graph` failed under a 30% quota before this). The graph's launches are
    what the quota governs."""
    out = finish(
        processes.start(
            [clients.for_mode(mode), mode, "captured", "sleep_us_400", "1000"], gpu.env(TESSERA_CORES="30")
        )
    )
    assert 25 <= share_of(out, 4 * 400e-6) <= 35


def test_without_a_quota_a_client_uses_the_whole_gpu(
    gpu: FakeGpus, clients: Clients, processes: Processes
) -> None:
    """The control: the shares above are the hook's doing."""
    out = finish(processes.start(launch(clients, "dlsym", "launch", 3), gpu.env()))
    assert share_of(out) >= 90


def test_two_containers_at_30_and_60_percent_on_one_gpu(
    gpu: FakeGpus, clients: Clients, processes: Processes, tmp_path: Path
) -> None:
    small = processes.start(
        launch(clients, "dlsym", "launch", 10),
        gpu.env(TESSERA_CORES="30", TESSERA_REGION=f"{tmp_path}/small"),
    )
    large = processes.start(
        launch(clients, "dlsym", "launch", 10),
        gpu.env(TESSERA_CORES="60", TESSERA_REGION=f"{tmp_path}/large"),
    )
    assert 25 <= share_of(finish(small)) <= 35
    assert 55 <= share_of(finish(large)) <= 65


def test_elastic_container_uses_an_idle_gpu_and_gives_it_back_within_a_second(
    gpu: FakeGpus, clients: Clients, processes: Processes, tmp_path: Path
) -> None:
    elastic = processes.start(
        launch(clients, "dlsym", "launch", 8),
        gpu.env(TESSERA_CORES="30", TESSERA_ELASTIC="1", TESSERA_REGION=f"{tmp_path}/elastic"),
    )
    assert elastic.stdout is not None
    lines: list[str] = []
    while not lines or not lines[-1].startswith("tick") or float(lines[-1].split()[1]) < 3.5:
        line = elastic.stdout.readline()
        assert line, "the elastic client ended early"
        lines.append(line)
    neighbour_started = float(lines[-1].split()[1])
    hard = processes.start(
        launch(clients, "dlsym", "launch", 4), gpu.env(TESSERA_CORES="60", TESSERA_REGION=f"{tmp_path}/hard")
    )
    alone = ticks("".join(lines) + finish(elastic))
    hard_ticks = ticks(finish(hard))
    # Alone it takes the idle GPU, far beyond its 30% (measured 88-100% over these 2 s: the client's
    # own launching shares the loaded 2 cores, so the bound leaves room for that, not for the hook).
    assert share_between(alone, 1.5, neighbour_started) >= 80
    # Back to its 30%: never above it (the hook's doing); below it by a few points when the loaded
    # cores delay the client's own launches in this short window (measured 24.9 beside a sandbox).
    assert 20 <= share_between(alone, neighbour_started + 1.0, neighbour_started + 3.5) <= 35
    assert 55 <= share_between(hard_ticks, 1.0, 3.9) <= 65


def test_processes_of_one_container_share_its_share(
    gpu: FakeGpus, clients: Clients, processes: Processes
) -> None:
    env = gpu.env(TESSERA_CORES="30")
    both = [processes.start(launch(clients, "dlsym", "launch", 5), env) for _ in range(2)]
    assert 25 <= sum(share_of(finish(p)) for p in both) <= 35


@pytest.mark.parametrize("source", ["limits file", "per-device variable"])
def test_compute_share_from_each_configuration_source(
    source: str, gpu: FakeGpus, clients: Clients, processes: Processes, tmp_path: Path
) -> None:
    if source == "limits file":
        limits = tmp_path / "limits"
        write_limits(limits, [DeviceLimit(gpu.uuids[0], GIB, 30)], region=str(tmp_path / "container-region"))
        env = gpu.env(TESSERA_LIMITS_FILE=str(limits), TESSERA_CORES="100")
    else:
        env = gpu.env(TESSERA_CORES="90", TESSERA_CORES_0="30")
    out = finish(processes.start(launch(clients, "dlsym", "launch", 4), env))
    assert 25 <= share_of(out) <= 35
