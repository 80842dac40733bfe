"""The node's MPS control daemon (docs/deviceplugin.md, "MPS mode"): one per node in MPS mode,
covering the node's shared GPUs, with one lifecycle: start, adopt, watch, restart, and one manager,
``tessera-mps-control`` (deviceplugin/mps_control.py), in a container of its own beside the node
agent's, so that the agent's container can restart without touching the daemon. The agent only
reports whether the daemon runs (:class:`DaemonReport`).

One daemon per node, not per GPU: a client's ``CUDA_MPS_PIPE_DIRECTORY`` is process-wide, and a
container may have several GPUs. Its files live under the agent's state dir::

    mps/pipe/   CUDA_MPS_PIPE_DIRECTORY: the daemon's control FIFO and pid file
                (nvidia-cuda-mps-control.pid); mounted read-write in every container
    mps/log/    CUDA_MPS_LOG_DIRECTORY: control.log, server.log
    mps/shm/    what the daemon and its clients must share as /dev/shm (the chart mounts a tmpfs
                there and at /dev/shm in the daemon's container; every container gets it at /dev/shm)

The daemon is started with ``-d`` (it daemonises: it is never its manager's child). A manager that
starts while a daemon runs (a restart) adopts it, found by its pid file, instead of starting another
or killing it: killing it would end every client on the node. A daemon found dead is started again,
and said so (a log line and :attr:`MpsDaemon.on_restart`). The manager stops the daemon only when
told to (``tessera-mps-control --stop-daemon``).
"""

from __future__ import annotations

import contextlib
import logging
import os
import subprocess
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path

from nodeagent.process import SetupError

log = logging.getLogger(__name__)

PID_FILE = "nvidia-cuda-mps-control.pid"
# How long `<control> -d` may take to leave its pid file, and a command sent to it to answer.
START_SECONDS = 10.0
COMMAND_SECONDS = 10.0
# How often the watch checks that the daemon lives.
WATCH_SECONDS = 1.0
# A daemon that dies again and again is started again after pauses doubling up to this.
MAX_RESTART_PAUSE = 60.0
# The settings a client reads at cuInit: none of the agent's own must reach the daemon.
_CLIENT_ENV = (
    "CUDA_MPS_PIPE_DIRECTORY",
    "CUDA_MPS_LOG_DIRECTORY",
    "CUDA_MPS_ACTIVE_THREAD_PERCENTAGE",
    "CUDA_MPS_CLIENT_PRIORITY",
    "CUDA_MPS_PINNED_DEVICE_MEM_LIMIT",
    "CUDA_VISIBLE_DEVICES",
)


class MpsDaemonError(SetupError):
    """The daemon could not be started; the message names the program and what it said."""


@dataclass(frozen=True, slots=True)
class MpsPaths:
    """The daemon's directories under ``<state dir>/mps``."""

    root: Path

    @property
    def pipe(self) -> Path:
        return self.root / "pipe"

    @property
    def log(self) -> Path:
        return self.root / "log"

    @property
    def shm(self) -> Path:
        return self.root / "shm"

    @property
    def pid_file(self) -> Path:
        return self.pipe / PID_FILE


def mps_paths(state_dir: Path) -> MpsPaths:
    return MpsPaths(state_dir / "mps")


def daemon_environment(
    environ: Mapping[str, str], paths: MpsPaths, gpu_uuids: Sequence[str]
) -> dict[str, str]:
    """The daemon's environment: the agent's, with its pipe and log directories and the node's
    shared GPUs (by UUID) in place of any MPS or CUDA device settings the agent had."""
    env = {k: v for k, v in environ.items() if k not in _CLIENT_ENV}
    env["CUDA_MPS_PIPE_DIRECTORY"] = str(paths.pipe)
    env["CUDA_MPS_LOG_DIRECTORY"] = str(paths.log)
    env["CUDA_VISIBLE_DEVICES"] = ",".join(gpu_uuids)
    return env


def _read_pid(pid_file: Path) -> int | None:
    try:
        text = pid_file.read_text().strip()
    except OSError:
        return None
    return int(text) if text.isdigit() and int(text) > 0 else None


def _is_program(pid: int, program: str) -> bool:
    """Whether process ``pid`` lives (not a zombie) and runs ``program`` (its name among the first
    arguments of its command line: a script's interpreter comes first), so that a pid reused by
    another process since the daemon died is not taken for it."""
    with contextlib.suppress(ChildProcessError):  # reaps a dead child of ours (never the daemon)
        os.waitpid(pid, os.WNOHANG)
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
        cmdline = Path(f"/proc/{pid}/cmdline").read_bytes()
    except OSError:
        return False
    if stat.rpartition(")")[2].split()[:1] == ["Z"]:
        return False
    name = os.path.basename(program)
    return any(os.path.basename(arg.decode(errors="replace")) == name for arg in cmdline.split(b"\0")[:3])


def running_daemon(control: str, paths: MpsPaths) -> int | None:
    """The pid of the daemon that runs for ``paths`` (its pid file names a live process of the program
    ``control``); None when none runs."""
    pid = _read_pid(paths.pid_file)
    return pid if pid is not None and _is_program(pid, control) else None


class MpsDaemon:
    """The node's MPS control daemon, as its one manager (``tessera-mps-control``) sees it."""

    def __init__(
        self,
        control: str,
        paths: MpsPaths,
        gpu_uuids: Sequence[str],
        *,
        environ: Mapping[str, str] | None = None,
    ) -> None:
        """``control``: the MPS control program (``--mps-control``), a path or a name on PATH."""
        self.control = control
        self.paths = paths
        self.gpu_uuids = tuple(gpu_uuids)
        self._environ = os.environ if environ is None else environ
        # Told (with the message logged) each time a dead daemon is started again.
        self.on_restart: Callable[[str], object] | None = None
        self.starts = 0
        self.restarts = 0

    @property
    def environment(self) -> dict[str, str]:
        return daemon_environment(self._environ, self.paths, self.gpu_uuids)

    def pid(self) -> int | None:
        """The running daemon's pid, from its pid file; None when none runs."""
        return running_daemon(self.control, self.paths)

    def ensure(self) -> str:
        """Adopt the running daemon, or start one: ``"adopted"`` or ``"started"``. Raises
        :class:`MpsDaemonError` (or OSError: the program cannot be run)."""
        pid = self.pid()
        if pid is not None:
            log.info("MPS control daemon %d (pipe directory %s) runs: adopted", pid, self.paths.pipe)
            return "adopted"
        self.start()
        return "started"

    def start(self) -> int:
        """Start the daemon (``<control> -d``) and wait for its pid file; returns its pid."""
        for directory in (self.paths.pipe, self.paths.log):
            directory.mkdir(mode=0o755, parents=True, exist_ok=True)
        self.paths.shm.mkdir(mode=0o1777, parents=True, exist_ok=True)
        # A pid file left by a daemon that died would be taken for the new one's.
        self.paths.pid_file.unlink(missing_ok=True)
        # Its output to a file, not a pipe: the daemon it forks may keep the descriptors open, and a
        # pipe would then never end. Its own session: the agent's signals are not the daemon's.
        output = self.paths.log / "start.out"
        with output.open("w") as out:
            done = subprocess.run(
                [self.control, "-d"],
                env=self.environment,
                stdin=subprocess.DEVNULL,
                stdout=out,
                stderr=subprocess.STDOUT,
                timeout=START_SECONDS,
                check=False,
                start_new_session=True,
            )
        if done.returncode != 0:
            said = output.read_text(errors="replace").strip()[-500:]
            raise MpsDaemonError(
                f"{self.control} -d exited with status {done.returncode}" + (f": {said}" if said else "")
            )
        deadline = time.monotonic() + START_SECONDS
        while (pid := self.pid()) is None:
            if time.monotonic() > deadline:
                raise MpsDaemonError(
                    f"{self.control} -d left no running daemon in {self.paths.pid_file} within "
                    f"{START_SECONDS:g} s (its log: {self.paths.log})"
                )
            time.sleep(0.02)
        self.starts += 1
        gpus = ", ".join(self.gpu_uuids) or "no GPUs"
        log.info("MPS control daemon %d started for %s (pipe directory %s)", pid, gpus, self.paths.pipe)
        return pid

    def command(self, text: str) -> str:
        """Send one command to the daemon (as ``echo <text> | <control>``); returns what it answered."""
        done = subprocess.run(
            [self.control],
            env=self.environment,
            input=text + "\n",
            capture_output=True,
            text=True,
            timeout=COMMAND_SECONDS,
            check=False,
        )
        if done.returncode != 0:
            raise MpsDaemonError(f"{self.control} {text!r}: status {done.returncode}: {done.stderr.strip()}")
        return done.stdout

    def check(self) -> bool:
        """Start the daemon again when it died; True when it had to (and did). Raises as :meth:`start`."""
        if self.pid() is not None:
            return False
        self.start()
        self.restarts += 1
        message = (
            f"the node's MPS control daemon had died and was started again (restart {self.restarts}); "
            "the CUDA processes of the containers on the node's GPUs lost their server and must start again"
        )
        log.warning("%s", message)
        if self.on_restart is not None:
            self.on_restart(message)
        return True

    def watch(self, stop: threading.Event, interval: float = WATCH_SECONDS) -> None:
        """:meth:`check` every ``interval`` until ``stop``; a failed start is tried again after pauses
        doubling up to a minute, each failure logged."""
        pause = interval
        while not stop.wait(pause):
            try:
                self.check()
                pause = interval
            except (MpsDaemonError, OSError, subprocess.TimeoutExpired) as e:
                log.warning("cannot start the MPS control daemon (trying again in %g s): %s", pause * 2, e)
                pause = min(MAX_RESTART_PAUSE, pause * 2)


class DaemonReport:
    """What the node agent, which does not manage the daemon, says of it: whether it runs, logged
    each time that changes and told to :attr:`on_change` (the agent's metric)."""

    def __init__(self, control: str, paths: MpsPaths) -> None:
        self.control = control
        self.paths = paths
        self.on_change: Callable[[int | None], object] | None = None
        self._pid: int | None = None
        self._checked = False

    def check(self) -> int | None:
        """The running daemon's pid (None when none runs); a change since the last check is logged."""
        pid = running_daemon(self.control, self.paths)
        if self._checked and pid == self._pid:
            return pid
        if pid is not None:
            log.info("MPS control daemon %d runs (pipe directory %s)", pid, self.paths.pipe)
        else:
            log.warning(
                "no MPS control daemon runs (pipe directory %s): the tessera-mps-control container "
                "starts it; until it runs, CUDA processes of the containers on this node find no MPS server",
                self.paths.pipe,
            )
        self._pid, self._checked = pid, True
        if self.on_change is not None:
            self.on_change(pid)
        return pid

    def wait(self, stop: threading.Event, seconds: float, interval: float = 0.1) -> int | None:
        """:meth:`check` until the daemon runs, ``seconds`` pass or ``stop``; its pid, or None."""
        deadline = time.monotonic() + seconds
        while (
            running_daemon(self.control, self.paths) is None
            and (left := deadline - time.monotonic()) > 0
            and not stop.wait(min(interval, left))
        ):
            pass
        return self.check()

    def watch(self, stop: threading.Event, interval: float = WATCH_SECONDS) -> None:
        """:meth:`check` every ``interval`` until ``stop``."""
        while not stop.wait(interval):
            self.check()
