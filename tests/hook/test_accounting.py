"""The shared accounting region: exact under concurrency, and the memory of dead processes comes
back within a second, whenever and however they die."""

from __future__ import annotations

import random
import signal
import sys
import threading
import time

from hook.region import read_region
from tests.hook.conftest import GIB, MIB, NVML_WATCH, Clients, FakeGpus, Processes

OOM = "error CUDA_ERROR_OUT_OF_MEMORY"


def test_concurrent_allocations_never_exceed_the_quota(
    gpu: FakeGpus, clients: Clients, processes: Processes
) -> None:
    env = gpu.env(TESSERA_MEMORY_LIMIT="1g")
    # Attach the region first, so the observer can read it from the start.
    assert processes.run([clients.dynamic, "dlsym", "info"], env).lines == [f"info {GIB} {GIB}"]
    seen: list[int] = []
    stop = threading.Event()

    def observe() -> None:
        while not stop.is_set():
            seen.append(read_region(gpu.region).devices[0].memory_used_bytes)
            time.sleep(0.001)

    observer = threading.Thread(target=observe)
    observer.start()
    # The driver's own view, from a process without the hook.
    driver = processes.start([sys.executable, NVML_WATCH], gpu.env(hooked=False))
    assert driver.stdout is not None and driver.stdout.readline().strip() == "watching"
    try:
        workers = [
            processes.start([clients.dynamic, "dlsym", "stress", "8", "10000", "64m", str(seed)], env)
            for seed in (1, 2)
        ]
        outputs = [w.communicate(timeout=300) for w in workers]
    finally:
        stop.set()
        observer.join()
    for worker, (out, err) in zip(workers, outputs, strict=True):
        assert worker.returncode == 0, err
        ooms = int(out.split()[1])
        assert ooms > 0, "the quota was never reached, so the test proved nothing"
    assert len(seen) > 10
    assert max(seen) <= GIB
    assert max(seen) > GIB // 2
    driver_used, samples = map(int, driver.communicate(input="stop\n", timeout=60)[0].split())
    assert samples > 10
    assert GIB // 2 < driver_used <= GIB
    usage = read_region(gpu.region)
    assert usage.devices[0].memory_used_bytes == 0
    assert usage.live_processes == 0


def test_sigkilled_process_memory_can_be_allocated_at_once(
    gpu: FakeGpus, clients: Clients, processes: Processes
) -> None:
    env = gpu.env(TESSERA_MEMORY_LIMIT="1g")
    victim = processes.start([clients.dynamic, "dlsym", "alloc", "512m", "hold"], env)
    assert victim.stdout is not None
    assert [victim.stdout.readline().strip() for _ in range(2)] == ["ok 0", "holding"]
    survivor = processes.start(
        [
            clients.dynamic,
            "dlsym",
            "alloc",
            "512m",
            "alloc",
            "512m",
            "wait-stdin",
            "await",
            "alloc",
            "512m",
            "5",
        ],
        env,
    )
    assert survivor.stdout is not None
    assert [survivor.stdout.readline().strip() for _ in range(3)] == ["ok 0", OOM, "waiting"]
    victim.send_signal(signal.SIGKILL)
    victim.wait(timeout=30)
    out, err = survivor.communicate(input="go\n", timeout=60)
    status, index, taken = out.split()
    assert (status, index) == ("ok", "1"), err
    assert float(taken) < 1.0


def test_dead_process_memory_returns_within_a_second_without_anyone_asking(
    gpu: FakeGpus, clients: Clients, processes: Processes
) -> None:
    env = gpu.env(TESSERA_MEMORY_LIMIT="1g")
    victim = processes.start([clients.dynamic, "dlsym", "alloc", "512m", "hold"], env)
    assert victim.stdout is not None
    assert [victim.stdout.readline().strip() for _ in range(2)] == ["ok 0", "holding"]
    # Started only once the victim holds its memory, so that the watcher's first look sees it.
    watcher = processes.start([clients.dynamic, "dlsym", "info", "wait-stdin", "await-free", "1g", "5"], env)
    assert watcher.stdout is not None
    assert [watcher.stdout.readline().strip() for _ in range(2)] == [f"info {512 * MIB} {GIB}", "waiting"]
    victim.send_signal(signal.SIGKILL)
    victim.wait(timeout=30)
    out, err = watcher.communicate(input="go\n", timeout=60)
    status, taken = out.split()
    assert status == "free", err
    assert float(taken) < 1.0


def test_processes_killed_at_any_instant_never_deadlock_or_leak(
    gpu: FakeGpus, clients: Clients, processes: Processes
) -> None:
    env = gpu.env(TESSERA_MEMORY_LIMIT="1g")
    rng = random.Random(7)
    for round_ in range(12):
        victims = [
            processes.start(
                [clients.dynamic, "dlsym", "stress", "4", "1000000", "32m", str(round_ * 4 + i)], env
            )
            for i in range(3)
        ]
        time.sleep(rng.uniform(0.05, 0.3))
        for victim in victims:
            victim.send_signal(signal.SIGKILL)
        for victim in victims:
            victim.wait(timeout=30)
    # Nobody is left holding the lock or the memory: the whole quota is allocatable at once.
    result = processes.run([clients.dynamic, "dlsym", "await", "alloc", "1g", "2", "info"], env, timeout=60)
    assert result.lines[0].startswith("ok 0"), result.stderr
    assert float(result.lines[0].split()[2]) < 1.0
    assert result.lines[1] == f"info 0 {GIB}"
