"""The fake GPU's time model: kernel launches (every launch API and graphs) take simulated time, the
scheduler model shares the GPU between processes (time slices; MPS), synchronisation waits for it,
events measure it, NVML reports it as utilization. Bounds are one-sided where the machine's load
could only make things slower."""

from __future__ import annotations

import dataclasses
import json
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from fakegpu import BUILD_DIR, mps_control, write_config
from tests.fakegpu.conftest import ClientProcesses, Gpus, fields

CUCLIENT = BUILD_DIR / "cuclient"


def elapsed_ms(lines: list[str]) -> float:
    [line] = [line for line in lines if line.startswith("events")]
    assert fields(line)["result"] == "CUDA_SUCCESS", line
    return float(fields(line)["elapsed_ms"])


# A 100 ms kernel first: the start event then completes 100 ms ahead and every measured launch
# queues behind it, so a client stalled by the machine's load leaves no gap in what events measure.
BLOCKER = ("launch", "sleep_us_100000", "1", "1")


def test_events_measure_the_simulated_duration(gpus: Gpus, procs: ClientProcesses) -> None:
    lines = procs.cuclient(gpus.env(), *BLOCKER, "events", "sleep_us_1000", "1", "50")
    assert abs(elapsed_ms(lines) - 50.0) < 0.01


def test_duration_grows_with_waves_over_the_sm_count(gpus: Gpus, procs: ClientProcesses) -> None:
    # GPU 0 has 108 SMs: 108 blocks are one wave, 216 two; a launch costs 10 us plus 1 ms per wave.
    one = elapsed_ms(procs.cuclient(gpus.env(), *BLOCKER, "events", "wave_us_1000", "108", "10"))
    two = elapsed_ms(procs.cuclient(gpus.env(), *BLOCKER, "events", "wave_us_1000", "216", "10"))
    other = elapsed_ms(procs.cuclient(gpus.env(), "--device", "1", *BLOCKER, "events", "kernel", "264", "10"))
    assert abs(one - 10.1) < 0.01
    assert abs(two - 20.1) < 0.01
    assert abs(other - 2.1) < 0.01  # 132 SMs: 264 blocks are two waves of the default 100 us


@pytest.mark.parametrize("path", ["linked", "dlopen", "procaddr", "procaddr-ptds"])
def test_every_launch_api_and_graphs_take_device_time(gpus: Gpus, procs: ClientProcesses, path: str) -> None:
    lines = procs.cuclient(
        gpus.env(),
        *("--path", path),
        *("launch", "sleep_us_2000", "1", "10", "sync"),
        *("launch-ex", "sleep_us_2000", "1", "10", "sync"),
        *("launch-coop", "sleep_us_2000", "1", "10", "sync"),
        *("graph", "sleep_us_2000", "1", "10"),
        *("capture", "sleep_us_2000", "1", "10"),
    )
    starts = [float(fields(line)["wall_start_us"]) for line in lines if line.startswith("launch")]
    ends = [float(fields(line)["wall_end_us"]) for line in lines if line.startswith("sync")]
    graphs = [int(fields(line)["elapsed_us"]) for line in lines if line.startswith(("graph", "capture"))]
    assert len(starts) == len(ends) == 3 and len(graphs) == 2
    # From the first launch to the end of the sync, 10 x 2 ms of kernels must have elapsed.
    assert all(end - start >= 19_900 for start, end in zip(starts, ends, strict=True)), lines
    assert all(us >= 19_900 for us in graphs), lines
    assert all(fields(line)["result"] == "CUDA_SUCCESS" for line in lines)


def test_two_processes_on_one_gpu_share_it_by_time_slices(gpus: Gpus, procs: ClientProcesses) -> None:
    """Not first come, first served: a process that queued a second of work does not make another
    wait for all of it (a real GPU time-slices contexts; docs/fakegpu.md, "Time model")."""
    first = procs.start([CUCLIENT, "launch", "sleep_us_1000", "1", "1000", "hold"], gpus.env())  # 1 s queued
    queued = fields(procs.expect(first, "launch"))
    second = procs.run([CUCLIENT, "events", "sleep_us_1000", "1", "100"], gpus.env())
    measured = fields(second.stdout.splitlines()[0])
    # The second waits one slice (1.2 ms) and a switch (0.1 ms), then the two alternate: 100 ms of
    # its work in 1.2 ms slices, each followed by a switch, the first's slice and a switch back.
    assert 217.4 <= float(measured["elapsed_ms"]) < 260.0, measured
    assert float(measured["wall_end_us"]) < float(queued["wall_start_us"]) + 1_000_000, (queued, measured)


@pytest.mark.parametrize("kernel_us", [500, 8000])
def test_a_context_waits_one_time_slice_whatever_the_running_kernel(
    gpus: Gpus, procs: ClientProcesses, kernel_us: int
) -> None:
    """The running context keeps the GPU one slice from the moment another asks, then its kernel is
    preempted: the waiting one's 250 us kernel completes 1.2 + 0.1 + 0.25 ms after it was queued."""
    count = str(1_000_000 // kernel_us)  # a second of work
    batch = procs.start([CUCLIENT, "launch", f"sleep_us_{kernel_us}", "1", count, "hold"], gpus.env())
    procs.expect(batch, "launch")
    lines = procs.cuclient(gpus.env(), "events", "sleep_us_250", "1", "1")
    assert 1.549 <= elapsed_ms(lines) < 10.0, lines


def test_the_time_slice_and_the_switch_come_from_the_config(gpus: Gpus, procs: ClientProcesses) -> None:
    specs = [gpus.specs[0], dataclasses.replace(gpus.specs[1], timeslice_us=5000)]
    write_config(gpus.config, specs, timeslice_us=200, switch_us=0)
    for device, expected in (("0", 0.45), ("1", 5.25)):
        batch = procs.start(
            [CUCLIENT, "--device", device, "launch", "sleep_us_8000", "1", "100", "hold"], gpus.env()
        )
        procs.expect(batch, "launch")
        lines = procs.cuclient(gpus.env(), "--device", device, "events", "sleep_us_250", "1", "1")
        assert expected - 0.001 <= elapsed_ms(lines) < expected + 8.0, (device, lines)
        procs.stop(batch)


@pytest.fixture
def mps(gpus: Gpus, procs: ClientProcesses, tmp_path: Path) -> Iterator[dict[str, str]]:
    """MPS started on the fake GPU by the stand-in control daemon; the variables of its clients."""
    variables = {
        "CUDA_MPS_PIPE_DIRECTORY": str(tmp_path / "mps-pipe"),
        "CUDA_MPS_LOG_DIRECTORY": str(tmp_path / "mps-log"),
    }
    (tmp_path / "mps-log").mkdir()
    started = procs.run([mps_control(), "-d"], gpus.env(**variables))
    assert started.returncode == 0, started.stderr
    try:
        yield variables
    finally:
        stopped = subprocess.run(
            [mps_control()],
            check=False,
            input="quit\n",
            env=gpus.env(**variables),
            capture_output=True,
            text=True,
            timeout=30,
        )
        assert stopped.returncode == 0, stopped.stderr
        assert "quit" in (tmp_path / "mps-log" / "control.log").read_text()


def test_mps_clients_share_the_sms_and_a_capped_batch_leaves_room(
    gpus: Gpus, procs: ClientProcesses, mps: dict[str, str]
) -> None:
    """Under MPS kernels of clients run side by side: beside a batch at half the SMs and below-normal
    priority, a service's kernel starts at once; beside a batch holding every SM it waits for that
    kernel's end (no preemption between MPS clients), not for a time slice."""
    capped = gpus.env(**mps, CUDA_MPS_ACTIVE_THREAD_PERCENTAGE="50", CUDA_MPS_CLIENT_PRIORITY="1")
    batch = procs.start([CUCLIENT, "launch", "sleep_us_2000", "1", "500", "hold"], capped)
    procs.expect(batch, "launch")
    beside_capped = elapsed_ms(procs.cuclient(gpus.env(**mps), "events", "sleep_us_250", "1", "1"))
    assert 0.249 <= beside_capped < 5.0
    procs.stop(batch)

    batch = procs.start([CUCLIENT, "launch", "sleep_us_2000", "1", "500", "hold"], gpus.env(**mps))
    procs.expect(batch, "launch")
    beside_full = [
        elapsed_ms(procs.cuclient(gpus.env(**mps), "events", "sleep_us_250", "1", "1")) for _ in range(3)
    ]
    # The rest of the batch's 2 ms kernel, then its own 250 us: never the 1.2 ms slice plus a switch
    # on top of a whole kernel.
    assert all(0.249 <= ms < 2.25 + 5.0 for ms in beside_full), beside_full
    # A process that is no MPS client is time-sliced against the MPS server as against one context.
    outside = elapsed_ms(procs.cuclient(gpus.env(), "events", "sleep_us_250", "1", "1"))
    assert 1.549 <= outside < 10.0, outside
    procs.stop(batch)


def test_nvml_utilization_under_mps_counts_concurrent_kernels_once(
    gpus: Gpus, procs: ClientProcesses, mps: dict[str, str]
) -> None:
    half = gpus.env(**mps, CUDA_MPS_ACTIVE_THREAD_PERCENTAGE="50")
    clients = [
        procs.start([CUCLIENT, "launch", "sleep_us_5000", "1", "1000", "hold"], half) for _ in range(2)
    ]
    for client in clients:
        procs.expect(client, "launch")
    time.sleep(0.3)  # a full 200 ms sample window of work
    rates, samples = (
        json.loads(line) for line in procs.probe(gpus.env(), "utilization", "0", "process-utilization", "0")
    )
    assert rates["gpu"] >= 95
    assert sorted(s["pid"] for s in samples) == sorted(c.pid for c in clients)
    assert all(s["sm"] >= 95 for s in samples), samples


def test_processes_on_different_gpus_do_not_wait_for_each_other(gpus: Gpus, procs: ClientProcesses) -> None:
    clients = [
        procs.start(
            [CUCLIENT, "--device", str(d), "wait", *BLOCKER, "events", "sleep_us_1000", "1", "100"],
            gpus.env(),
        )
        for d in (0, 1)
    ]
    for client in clients:
        procs.expect(client, "wait ready")
    for client in clients:
        assert client.stdin is not None
        client.stdin.write("go\n")
        client.stdin.flush()
    for client in clients:
        procs.expect(client, "launch")
    results = [fields(procs.expect(client, "events")) for client in clients]
    assert all(abs(float(r["elapsed_ms"]) - 100.0) < 0.01 for r in results)


def test_nvml_reports_utilization_from_the_timeline(gpus: Gpus, procs: ClientProcesses) -> None:
    idle = json.loads(procs.probe(gpus.env(), "utilization", "0")[0])
    assert idle == {"gpu": 0, "memory": 0}
    busy = procs.start([CUCLIENT, "launch", "sleep_us_5000", "1", "1000", "hold"], gpus.env())  # 5 s queued
    procs.expect(busy, "launch")
    time.sleep(0.3)  # a full 200 ms sample window of work
    rates, samples = (
        json.loads(line) for line in procs.probe(gpus.env(), "utilization", "0", "process-utilization", "0")
    )
    assert rates["gpu"] >= 95
    assert [s["pid"] for s in samples] == [busy.pid]
    assert samples[0]["sm"] >= 95
    other = json.loads(procs.probe(gpus.env(), "utilization", "1")[0])
    assert other["gpu"] == 0


def test_work_queued_by_a_killed_process_is_dropped(gpus: Gpus, procs: ClientProcesses) -> None:
    doomed = procs.start([CUCLIENT, "launch", "sleep_us_1000000", "1", "5", "hold"], gpus.env())  # 5 s queued
    procs.expect(doomed, "launch")
    procs.expect(doomed, "hold ready")
    doomed.kill()
    doomed.wait(timeout=30)
    lines = procs.cuclient(gpus.env(), "launch", "sleep_us_1000", "1", "10", "sync")
    start, end = float(fields(lines[0])["wall_start_us"]), float(fields(lines[1])["wall_end_us"])
    assert 10_000 <= end - start < 1_000_000  # not behind the dead process's remaining seconds


BINDINGS_LAUNCH = """
import time
from cuda.bindings import driver as d
def ok(r):
    assert r[0] == d.CUresult.CUDA_SUCCESS, r
    return r[1] if len(r) == 2 else r[1:]
ok(d.cuInit(0)); ctx = ok(d.cuDevicePrimaryCtxRetain(ok(d.cuDeviceGet(0)))); ok(d.cuCtxSetCurrent(ctx))
module = ok(d.cuModuleLoadData(b"any image"))
from_module = ok(d.cuModuleGetFunction(module, b"sleep_us_10000"))
library = ok(d.cuLibraryLoadData(b"any image", None, None, 0, None, None, 0))
from_library = ok(d.cuKernelGetFunction(ok(d.cuLibraryGetKernel(library, b"sleep_us_10000"))))
stream = ok(d.cuStreamCreate(0))
start, end = ok(d.cuEventCreate(0)), ok(d.cuEventCreate(0))
ok(d.cuLaunchKernel(ok(d.cuModuleGetFunction(module, b"sleep_us_100000")), 1, 1, 1, 1, 1, 1, 0, stream, 0, 0))
ok(d.cuEventRecord(start, stream))
for f in (from_module, from_library):
    ok(d.cuLaunchKernel(f, 1, 1, 1, 32, 1, 1, 0, stream, 0, 0))
ok(d.cuEventRecord(end, stream))
print(d.cuEventQuery(end)[0].name, d.cuStreamQuery(stream)[0].name)
ok(d.cuStreamSynchronize(stream))
print(d.cuEventQuery(end)[0].name, ok(d.cuEventElapsedTime(start, end)))
"""


def test_cuda_bindings_launches_from_modules_and_libraries(gpus: Gpus, procs: ClientProcesses) -> None:
    done = procs.run([sys.executable, "-c", BINDINGS_LAUNCH], gpus.env())
    assert done.returncode == 0, done.stderr
    pending, finished = (line.split() for line in done.stdout.splitlines())
    assert pending == ["CUDA_ERROR_NOT_READY", "CUDA_ERROR_NOT_READY"]
    assert finished[0] == "CUDA_SUCCESS"
    assert abs(float(finished[1]) - 20.0) < 0.01
