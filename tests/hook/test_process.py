"""NVML inside a hooked process, forked children, and exec: the quota follows every process."""

from __future__ import annotations

import os
import signal
import sys
from pathlib import Path

from tests.hook.conftest import GIB, MIB, NVML_CLIENT, Clients, FakeGpus, Processes

OOM = "error CUDA_ERROR_OUT_OF_MEMORY"


def test_nvidia_ml_py_reports_the_quota_and_the_container_usage(
    gpu: FakeGpus, clients: Clients, processes: Processes
) -> None:
    env = gpu.env(TESSERA_MEMORY_LIMIT="1g")
    holder = processes.start([clients.dynamic, "dlsym", "alloc", "256m", "hold"], env)
    assert holder.stdout is not None
    assert [holder.stdout.readline().strip() for _ in range(2)] == ["ok 0", "holding"]
    result = processes.run([sys.executable, NVML_CLIENT], env)
    expected = f"{GIB} {256 * MIB} {768 * MIB}"
    assert result.lines == [expected, expected], result.stderr


def test_nvidia_ml_py_without_the_hook_sees_the_whole_gpu(gpu: FakeGpus, processes: Processes) -> None:
    result = processes.run([sys.executable, NVML_CLIENT], gpu.env(hooked=False, TESSERA_MEMORY_LIMIT="1g"))
    assert [line.split()[0] for line in result.lines] == [str(8 * GIB)] * 2, result.stderr


def test_forked_child_shares_the_quota_and_its_memory_returns_when_it_exits(
    gpu: FakeGpus, clients: Clients, processes: Processes
) -> None:
    script = [
        "alloc",
        "512m",
        "fork",
        "info",
        "alloc",
        "256m",
        "alloc",
        "512m",
        "end",
        "await-free",
        "512m",
        "2",
    ]
    result = processes.run([clients.dynamic, "dlsym", *script], gpu.env(TESSERA_MEMORY_LIMIT="1g"))
    assert result.lines[:5] == ["ok 0", f"info {512 * MIB} {GIB}", "ok 1", OOM, "child 0"], result.stderr
    status, taken = result.lines[5].split()
    assert status == "free" and float(taken) < 1.0


def test_a_forked_child_killed_while_holding_memory_never_blocks_the_parent(
    gpu: FakeGpus, clients: Clients, processes: Processes
) -> None:
    env = gpu.env(TESSERA_MEMORY_LIMIT="1g")
    script = ["alloc", "256m", "fork", "alloc", "512m", "hold", "end", "await-free", "768m", "2"]
    parent = processes.start([clients.dynamic, "dlsym", *script], env)
    assert parent.stdout is not None
    assert [parent.stdout.readline().strip() for _ in range(3)] == ["ok 0", "ok 1", "holding"]
    children = Path(f"/proc/{parent.pid}/task/{parent.pid}/children").read_text().split()
    assert len(children) == 1
    os.kill(int(children[0]), signal.SIGKILL)
    out, err = parent.communicate(timeout=60)
    lines = out.splitlines()
    assert lines[0] == "child 137", err
    status, taken = lines[1].split()
    assert status == "free" and float(taken) < 1.0


def test_exec_returns_the_memory_of_the_replaced_program(
    gpu: FakeGpus, clients: Clients, processes: Processes
) -> None:
    script = ["alloc", "768m", "exec", "await-free", "1g", "2", "alloc", "1g"]
    result = processes.run([clients.dynamic, "dlsym", *script], gpu.env(TESSERA_MEMORY_LIMIT="1g"))
    assert result.lines[0] == "ok 0", result.stderr
    status, taken = result.lines[1].split()
    assert status == "free" and float(taken) < 1.0
    assert result.lines[2] == "ok 0"
