"""``tessera-mps-control`` (deviceplugin/mps_control.py), the one manager of the node's MPS control
daemon: idle on a time-sliced node, the daemon's lifecycle on an MPS node (start, restart with the
events said, left running on SIGTERM, adopted by its next run, stopped only with --stop-daemon), with
the stand-in control program of the ``control`` fixture (tests/deviceplugin/conftest.py); and the
node agent's report of a daemon it does not run (deviceplugin/mps_daemon.py, ``DaemonReport``)."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from pathlib import Path

import pytest

from deviceplugin import mps_control
from deviceplugin.mps_control import ControlConfig, parse_control_config, serve
from deviceplugin.mps_daemon import DaemonReport, MpsDaemon, MpsPaths, mps_paths
from deviceplugin.sharing import NodeModeError
from tessera.contract import KEYS, SharingMode
from tests.deviceplugin.test_mps_daemon import started, wait_gone

UUIDS = ["GPU-a", "GPU-b"]


def config_for(tmp_path: Path, control: Path, **changes: object) -> ControlConfig:
    settings: dict[str, object] = {
        "node_name": "n1",
        "keys": KEYS,
        "state_dir": tmp_path / "state",
        "kubeconfig": None,
        "sharing": SharingMode.TIMESLICE,
        "mps_control": str(control),
        "watch_seconds": 0.02,
    }
    settings.update(changes)
    return ControlConfig(**settings)  # type: ignore[arg-type]


class Run:
    """``serve`` on a thread, as the binary runs it until SIGTERM (``stop``)."""

    def __init__(
        self, runs: list[Run], config: ControlConfig, labels: Mapping[str, str], uuids: Sequence[str] = UUIDS
    ) -> None:
        self.stop = threading.Event()
        # Set once the daemon is started or adopted (serve's next step, check_shm, was reached).
        self.ready = threading.Event()
        self.asked_gpus = 0
        self.told: list[str] = []
        self.result: list[MpsDaemon | None] = []
        self.error: list[BaseException] = []

        def gpus() -> Sequence[str]:
            self.asked_gpus += 1
            return uuids

        def target() -> None:
            try:
                self.result.append(
                    serve(
                        config, self.stop, labels=lambda: labels, gpu_uuids=gpus, on_restart=self.told.append
                    )
                )
            except BaseException as e:
                self.error.append(e)

        self.thread = threading.Thread(target=target)
        runs.append(self)  # before it starts: the runs fixture tells the last one it is ready
        self.thread.start()

    def end(self) -> MpsDaemon | None:
        self.stop.set()
        self.thread.join(10)
        assert not self.thread.is_alive(), "serve did not return on stop"
        if self.error:
            raise self.error[0]
        return self.result[0]


@pytest.fixture
def runs(monkeypatch: pytest.MonkeyPatch) -> Iterator[list[Run]]:
    made: list[Run] = []
    check_shm = mps_control.check_shm

    def checked(paths: MpsPaths) -> None:
        check_shm(paths)
        made[-1].ready.set()

    monkeypatch.setattr(mps_control, "check_shm", checked)
    yield made
    for run in made:
        run.stop.set()
        run.thread.join(10)


def wait_until(condition: Callable[[], object], what: str) -> None:
    deadline = time.monotonic() + 10
    while not condition():
        assert time.monotonic() < deadline, what
        time.sleep(0.01)


@pytest.mark.parametrize(
    ("labels", "default"),
    [
        ({}, SharingMode.TIMESLICE),
        ({KEYS.node_sharing: "timeslice"}, SharingMode.MPS),  # the label decides over --sharing
    ],
)
def test_idle_on_a_time_sliced_node_until_stopped(
    tmp_path: Path, control: Path, runs: list[Run], labels: dict[str, str], default: SharingMode
) -> None:
    run = Run(runs, config_for(tmp_path, control, sharing=default), labels)
    time.sleep(0.3)
    assert run.thread.is_alive()  # it waits: its container neither exits nor crash-loops
    assert run.asked_gpus == 0  # nor opens NVML
    assert not (tmp_path / "state" / "mps").exists()  # nor starts or holds anything
    assert run.end() is None


def test_idle_on_an_mps_node_without_gpus(tmp_path: Path, control: Path, runs: list[Run]) -> None:
    run = Run(runs, config_for(tmp_path, control), {KEYS.node_sharing: "mps"}, uuids=[])
    time.sleep(0.2)
    assert run.thread.is_alive() and run.asked_gpus == 1
    assert not (tmp_path / "state" / "mps").exists()
    assert run.end() is None


def test_a_bad_label_stops_it_naming_the_label(tmp_path: Path, control: Path) -> None:
    with pytest.raises(NodeModeError, match=r"label tessera\.io/sharing: 'MPS' is not timeslice or mps"):
        serve(
            config_for(tmp_path, control),
            threading.Event(),
            labels=lambda: {KEYS.node_sharing: "MPS"},
            gpu_uuids=lambda: UUIDS,
        )


def test_on_an_mps_node_it_runs_the_daemon_restarts_it_and_leaves_it_running_on_stop(
    tmp_path: Path, control: Path, runs: list[Run]
) -> None:
    config = config_for(tmp_path, control)
    probe = MpsDaemon(str(control), mps_paths(tmp_path / "state"), UUIDS)
    run = Run(runs, config, {KEYS.node_sharing: "mps"})
    assert run.ready.wait(10), "the daemon was not started"
    first = probe.pid()
    assert first is not None
    assert started(tmp_path) == [f"started {first} devices GPU-a,GPU-b"]

    # The daemon dies: it is started again, and the pods served under MPS are told.
    os.kill(first, signal.SIGKILL)
    wait_gone(first)
    wait_until(lambda: run.told and probe.pid() not in (None, first), "the daemon was not started again")
    second = probe.pid()
    assert len(run.told) == 1 and "had died and was started again" in run.told[0]

    # SIGTERM (stop): the daemon, and with it its clients, keeps running.
    daemon = run.end()
    assert daemon is not None and (daemon.starts, daemon.restarts) == (2, 1)
    assert probe.pid() == second

    # The container restarts: the next run adopts the daemon, starts none, tells no pod.
    again = Run(runs, config, {KEYS.node_sharing: "mps"})
    assert again.ready.wait(10), "the daemon was not adopted"
    time.sleep(0.2)  # a few of its checks
    adopted = again.end()
    assert adopted is not None and adopted.starts == 0
    assert probe.pid() == second and len(started(tmp_path)) == 2 and again.told == []


def test_stop_daemon_stops_it_on_stop(tmp_path: Path, control: Path, runs: list[Run]) -> None:
    probe = MpsDaemon(str(control), mps_paths(tmp_path / "state"), UUIDS)
    run = Run(runs, config_for(tmp_path, control, stop_daemon=True), {KEYS.node_sharing: "mps"})
    assert run.ready.wait(10), "the daemon was not started"
    pid = probe.pid()
    assert pid is not None
    run.end()
    wait_gone(pid)
    assert probe.pid() is None


def test_flags() -> None:
    config = parse_control_config(["--node-name=n"], environ={})
    assert (config.sharing, config.mps_control, config.stop_daemon, config.watch_seconds) == (
        SharingMode.TIMESLICE,
        "nvidia-cuda-mps-control",
        False,
        1.0,
    )
    assert config.state_dir == Path("/var/lib/tessera")
    env = {
        "NODE_NAME": "m",
        "TESSERA_SHARING": "mps",
        "TESSERA_MPS_CONTROL": "/x/ctl",
        "TESSERA_STATE_DIR": "/s",
    }
    config = parse_control_config(["--stop-daemon", "--domain=gpu.example.com"], environ=env)
    assert (config.node_name, config.sharing, config.mps_control, config.state_dir, config.stop_daemon) == (
        "m",
        SharingMode.MPS,
        "/x/ctl",
        Path("/s"),
        True,
    )
    assert config.keys.node_sharing == "gpu.example.com/sharing"


def test_the_binary_is_installed_and_stops_naming_unusable_credentials(tmp_path: Path) -> None:
    """The installed ``tessera-mps-control`` (one entry point per binary): without usable credentials
    it stops at once, status 2, naming them (as the agent does)."""
    binary = Path(sys.executable).parent / "tessera-mps-control"
    done = subprocess.run(
        [str(binary), "--node-name=n", f"--kubeconfig={tmp_path / 'absent'}"],
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    assert done.returncode == 2, done.stderr
    assert f"--kubeconfig {tmp_path / 'absent'}" in done.stderr


def test_the_agents_report_says_whether_the_daemon_runs_and_starts_none(
    tmp_path: Path, control: Path
) -> None:
    paths = mps_paths(tmp_path / "state")
    report = DaemonReport(str(control), paths)
    seen: list[int | None] = []
    report.on_change = seen.append
    stop = threading.Event()
    # No daemon: the wait ends after its time, and nothing was started.
    began = time.monotonic()
    assert report.wait(stop, 0.2) is None
    assert time.monotonic() - began >= 0.2
    assert not paths.root.exists() and seen == [None]
    assert report.check() is None and seen == [None]  # said once, not at every check
    # tessera-mps-control starts it: the report sees it.
    daemon = MpsDaemon(str(control), paths, UUIDS)
    daemon.ensure()
    pid = daemon.pid()
    assert report.wait(stop, 5) == pid and seen == [None, pid]
    # It dies: said, and not started again by the report.
    assert pid is not None
    os.kill(pid, signal.SIGKILL)
    wait_gone(pid)
    watch = threading.Thread(target=report.watch, args=(stop, 0.02))
    watch.start()
    try:
        wait_until(lambda: seen[-1] is None, "the report did not see the daemon die")
        time.sleep(0.1)
    finally:
        stop.set()
        watch.join()
    assert seen == [None, pid, None]
    assert len(started(tmp_path)) == 1 and daemon.pid() is None
