"""The node's MPS control daemon's lifecycle (deviceplugin/mps_daemon.py) with a stand-in control
program (the ``control`` fixture, tests/deviceplugin/conftest.py) that behaves as
``nvidia-cuda-mps-control`` does for its manager: ``-d`` daemonises, writes its pid file and a
``control`` FIFO into CUDA_MPS_PIPE_DIRECTORY; without arguments it passes its stdin to the daemon,
which exits on ``quit``."""

from __future__ import annotations

import os
import signal
import threading
import time
from pathlib import Path

import pytest

from deviceplugin.mps_daemon import PID_FILE, MpsDaemon, MpsDaemonError, daemon_environment, mps_paths


def daemon_for(tmp_path: Path, control: Path) -> MpsDaemon:
    return MpsDaemon(
        str(control), mps_paths(tmp_path / "state"), ["GPU-a", "GPU-b"], environ={"PATH": "/usr/bin"}
    )


def started(tmp_path: Path) -> list[str]:
    return (tmp_path / "state" / "mps" / "log" / "control.log").read_text().splitlines()


def wait_gone(pid: int) -> None:
    deadline = time.monotonic() + 10
    while Path(f"/proc/{pid}").exists() and "Z" not in Path(f"/proc/{pid}/stat").read_text().split()[2:3]:
        assert time.monotonic() < deadline, f"process {pid} did not end"
        time.sleep(0.01)


def test_started_with_its_directories_and_the_node_gpus_and_quits_on_command(
    tmp_path: Path, control: Path
) -> None:
    daemon = daemon_for(tmp_path, control)
    assert daemon.pid() is None
    assert daemon.ensure() == "started"
    pid = daemon.pid()
    assert pid is not None and pid != os.getpid()
    pipe = tmp_path / "state" / "mps" / "pipe"
    assert (pipe / PID_FILE).read_text().strip() == str(pid)
    assert (pipe / "control").exists()
    assert (tmp_path / "state" / "mps" / "shm").is_dir()
    assert started(tmp_path) == [f"started {pid} devices GPU-a,GPU-b"]
    daemon.command("quit")
    wait_gone(pid)
    assert daemon.pid() is None


def test_a_restarted_agent_adopts_the_running_daemon(tmp_path: Path, control: Path) -> None:
    first = daemon_for(tmp_path, control)
    assert first.ensure() == "started"
    pid = first.pid()
    # The agent restarts: a new MpsDaemon finds the daemon by its pid file and starts no second one.
    again = daemon_for(tmp_path, control)
    assert again.ensure() == "adopted"
    assert again.pid() == pid
    assert not again.check()
    assert len(started(tmp_path)) == 1 and again.starts == 0


def test_a_daemon_that_died_is_started_again_and_said_so(tmp_path: Path, control: Path) -> None:
    daemon = daemon_for(tmp_path, control)
    told: list[str] = []
    daemon.on_restart = told.append
    daemon.ensure()
    pid = daemon.pid()
    assert pid is not None
    os.kill(pid, signal.SIGKILL)
    wait_gone(pid)
    assert daemon.pid() is None  # its pid file stays, naming a dead process
    stop = threading.Event()
    watch = threading.Thread(target=daemon.watch, args=(stop, 0.02))
    watch.start()
    try:
        deadline = time.monotonic() + 10
        while daemon.restarts == 0:
            assert time.monotonic() < deadline, "the daemon was not started again"
            time.sleep(0.01)
    finally:
        stop.set()
        watch.join()
    new = daemon.pid()
    assert new is not None and new != pid
    assert len(started(tmp_path)) == 2
    assert len(told) == 1 and "had died and was started again" in told[0]


def test_a_pid_file_naming_another_program_is_no_daemon(tmp_path: Path, control: Path) -> None:
    daemon = daemon_for(tmp_path, control)
    pipe = tmp_path / "state" / "mps" / "pipe"
    pipe.mkdir(parents=True)
    (pipe / PID_FILE).write_text(f"{os.getpid()}\n")  # a pid reused by pytest
    assert daemon.pid() is None
    assert daemon.ensure() == "started"
    assert daemon.pid() != os.getpid()


def test_a_control_program_that_fails_or_is_missing_is_a_clear_error(tmp_path: Path) -> None:
    failing = tmp_path / "nvidia-cuda-mps-control"
    failing.write_text("#!/bin/sh\necho 'no GPU in compute mode' >&2\nexit 3\n")
    failing.chmod(0o755)
    daemon = MpsDaemon(str(failing), mps_paths(tmp_path / "state"), ["GPU-a"])
    with pytest.raises(MpsDaemonError, match="-d exited with status 3: no GPU in compute mode"):
        daemon.ensure()
    missing = MpsDaemon(str(tmp_path / "absent"), mps_paths(tmp_path / "state"), ["GPU-a"])
    with pytest.raises(OSError):
        missing.ensure()


def test_the_daemon_gets_its_directories_and_devices_not_the_agents_settings(tmp_path: Path) -> None:
    paths = mps_paths(tmp_path)
    env = daemon_environment(
        {"PATH": "/bin", "CUDA_MPS_ACTIVE_THREAD_PERCENTAGE": "10", "CUDA_VISIBLE_DEVICES": "0"},
        paths,
        ["GPU-a", "GPU-b"],
    )
    assert env == {
        "PATH": "/bin",
        "CUDA_MPS_PIPE_DIRECTORY": str(tmp_path / "mps" / "pipe"),
        "CUDA_MPS_LOG_DIRECTORY": str(tmp_path / "mps" / "log"),
        "CUDA_VISIBLE_DEVICES": "GPU-a,GPU-b",
    }
