"""The fake GPU's time model: kernel launches (every launch API and graphs) take simulated time on a
device timeline shared by processes, synchronisation waits for it, events measure it, NVML reports
it as utilization. Bounds are one-sided where the machine's load could only make things slower."""

from __future__ import annotations

import json
import sys
import time

import pytest

from fakegpu import BUILD_DIR
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


def test_two_processes_on_one_gpu_serialise(gpus: Gpus, procs: ClientProcesses) -> None:
    first = procs.start([CUCLIENT, "launch", "sleep_us_1000", "1", "1000", "hold"], gpus.env())  # 1 s queued
    queued = fields(procs.expect(first, "launch"))
    second = procs.run([CUCLIENT, "events", "sleep_us_1000", "1", "100"], gpus.env())
    measured = fields(second.stdout.splitlines()[0])
    # The second process's 100 ms of kernels run after the first's second of them: its sync cannot
    # return before both are done, however late it started.
    assert float(measured["wall_end_us"]) >= float(queued["wall_start_us"]) + 1_100_000
    assert float(measured["elapsed_ms"]) >= 100.0


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
