"""Long-running processes the sandbox starts and stops: each in its own session (so one signal reaches
its children too), its output in a log file, and recorded with its start time so that a later `down`
never signals a different process that reused the PID.
"""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import time
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path

from pydantic import BaseModel, ConfigDict


class StartError(RuntimeError):
    """A component could not be started; the message says which and points at its log."""


class Started(BaseModel):
    """A process as recorded in the sandbox state file."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    name: str
    pid: int
    start_ticks: int
    log: str
    argv: tuple[str, ...]


def _stat_after_name(stat: Path) -> list[str] | None:
    """The fields of a ``/proc/.../stat`` file from field 3 (the state) on; None when it is gone.
    The command name (field 2) may hold spaces and parentheses; the fields after its last ")" don't."""
    try:
        return stat.read_text().rsplit(")", 1)[1].split()
    except OSError:
        return None


def _start_ticks(pid: int) -> int | None:
    """The process's start time in clock ticks since boot (field 22 of /proc/PID/stat)."""
    fields = _stat_after_name(Path(f"/proc/{pid}/stat"))
    return None if fields is None else int(fields[19])


def _exited(pid: int) -> bool:
    """Whether every thread of the process has exited (dead or a zombie).

    The main thread's own state is not enough: a SIGKILLed multi-threaded process (etcd,
    kube-apiserver) shows its main thread as a zombie while its other threads are still exiting, and
    the files they share (its listening sockets) stay open until the last one has. A restart that
    went on at that moment found its port still in use."""
    try:
        tasks = list(Path(f"/proc/{pid}/task").iterdir())
    except OSError:
        return True
    for task in tasks:
        fields = _stat_after_name(task / "stat")
        if fields is not None and fields[0] not in ("Z", "X"):  # None: that thread is gone
            return False
    return True


def alive(process: Started) -> bool:
    return _start_ticks(process.pid) == process.start_ticks and not _exited(process.pid)


def adopt(name: str, pid: int, log: Path, argv: Sequence[str]) -> Started:
    """Record a process started elsewhere (the control plane, by sandbox.controlplane)."""
    ticks = _start_ticks(pid)
    if ticks is None:
        raise StartError(f"{name} (pid {pid}) is not running; see {log}")
    return Started(name=name, pid=pid, start_ticks=ticks, log=str(log), argv=tuple(argv))


def start(
    name: str, argv: Sequence[str], log: Path, env: Mapping[str, str] | None = None, cwd: Path | None = None
) -> Started:
    log.parent.mkdir(parents=True, exist_ok=True)
    with log.open("ab") as out:
        child = subprocess.Popen(
            list(argv),
            stdin=subprocess.DEVNULL,
            stdout=out,
            stderr=subprocess.STDOUT,
            env=dict(env) if env is not None else None,
            cwd=cwd,
            start_new_session=True,
        )
    return adopt(name, child.pid, log, argv)


def _reap(pid: int) -> None:
    # Our own children must be reaped or they stay zombies; others are reaped by their parent.
    with contextlib.suppress(ChildProcessError):
        os.waitpid(pid, os.WNOHANG)


def stop(process: Started, timeout: float = 20.0) -> None:
    """SIGTERM the process's session, then SIGKILL whatever is left after ``timeout`` seconds."""
    if not alive(process):
        return
    for sig in (signal.SIGTERM, signal.SIGKILL):
        try:
            os.killpg(process.pid, sig)
        except ProcessLookupError:
            return
        deadline = time.monotonic() + (timeout if sig == signal.SIGTERM else 5.0)
        while time.monotonic() < deadline:
            _reap(process.pid)
            if not alive(process):
                return
            time.sleep(0.1)
    raise StartError(f"{process.name} (pid {process.pid}) survived SIGKILL")


def kill(process: Started, timeout: float = 5.0) -> None:
    """SIGKILL the process alone (not its session: a crash takes nothing else with it) and wait
    until it is gone."""
    if not alive(process):
        return
    with contextlib.suppress(ProcessLookupError):
        os.kill(process.pid, signal.SIGKILL)
    deadline = time.monotonic() + timeout
    while alive(process):
        _reap(process.pid)
        if time.monotonic() > deadline:
            raise StartError(f"{process.name} (pid {process.pid}) survived SIGKILL")
        time.sleep(0.05)


def wait_for(
    what: str, ready: Callable[[], bool], process: Started | None, timeout: float, interval: float = 0.25
) -> float:
    """Poll ``ready`` until true; fails early, naming the log, if ``process`` dies meanwhile."""
    began = time.monotonic()
    while True:
        if ready():
            return time.monotonic() - began
        if process is not None and not alive(process):
            raise StartError(f"{process.name} exited while waiting for {what}; see {process.log}")
        if time.monotonic() - began > timeout:
            where = f"; see {process.log}" if process is not None else ""
            raise StartError(f"timed out after {timeout:.0f}s waiting for {what}{where}")
        time.sleep(interval)
