"""``tessera-mps-control``: the one manager of the node's MPS control daemon (docs/deviceplugin.md,
"MPS mode"), run in a container of its own beside the node agent's, so that a restart of the agent's
container (a crash, an OOM kill) leaves the daemon, and every MPS client on the node, running.

It reads the node's mode as the agent does (the ``<domain>/sharing`` label, else ``--sharing``). On
a node in MPS mode with GPUs it starts or adopts the daemon and watches it, starting it again when it
dies and putting a Warning event on each pod served under MPS (from the served records in the state
dir), until SIGTERM; elsewhere it waits for SIGTERM and holds nothing, so that its container neither
crash-loops nor costs anything. On SIGTERM it leaves the daemon running, unless ``--stop-daemon``.
"""

from __future__ import annotations

import argparse
import logging
import os
import subprocess
import sys
import threading
from collections.abc import Callable, Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

from deviceplugin.config import add_sharing_flags
from deviceplugin.kube import Kube
from deviceplugin.mps_daemon import (
    WATCH_SECONDS,
    MpsDaemon,
    MpsDaemonError,
    MpsPaths,
    mps_paths,
)
from deviceplugin.served import PodTarget
from deviceplugin.sharing import node_sharing_mode
from nodeagent.flags import add_node_flags, node_keys
from nodeagent.kubeapi import EventTarget, load_api
from nodeagent.nvml import Nvml, NvmlUnavailableError
from nodeagent.process import serve_until_signalled
from nodeagent.statedir import StateDir
from tessera.cliargs import seconds
from tessera.contract import (
    CONTAINER_MPS_SHM_DIR,
    ContractKeys,
    SharingMode,
)

log = logging.getLogger("tessera-mps-control")

# The Warning event on each pod served under MPS when the node's MPS control daemon was started again.
MPS_RESTARTED_REASON = "TesseraMpsDaemonRestarted"


@dataclass(frozen=True, slots=True)
class ControlConfig:
    node_name: str
    keys: ContractKeys
    state_dir: Path
    kubeconfig: Path | None
    sharing: SharingMode
    mps_control: str
    # Stop the daemon on SIGTERM (standalone use); by default it is left running for its clients.
    stop_daemon: bool = False
    watch_seconds: float = WATCH_SECONDS


def parser(environ: Mapping[str, str]) -> argparse.ArgumentParser:
    env = environ.get
    p = argparse.ArgumentParser(
        prog="tessera-mps-control",
        description="Tessera's MPS control daemon manager: on a node in MPS mode, starts or adopts the "
        "node's MPS control daemon and starts it again when it dies; elsewhere waits, holding nothing.",
    )
    add_node_flags(p, environ)
    add_sharing_flags(p, environ)
    p.add_argument(
        "--stop-daemon",
        action="store_true",
        default=env("TESSERA_MPS_STOP_DAEMON", "") == "true",
        help="on SIGTERM, stop the daemon (its clients lose their server); by default it is left running "
        "(env TESSERA_MPS_STOP_DAEMON=true)",
    )
    p.add_argument(
        "--watch-seconds",
        type=seconds,
        default=env("TESSERA_MPS_WATCH_SECONDS", f"{WATCH_SECONDS:g}"),
        help="how often the daemon is checked (env TESSERA_MPS_WATCH_SECONDS, default %(default)s)",
    )
    return p


def parse_control_config(
    argv: Sequence[str] | None = None, environ: Mapping[str, str] | None = None
) -> ControlConfig:
    """Settings from ``argv`` and ``environ``; exits with a message naming the flag on bad input."""
    environ = os.environ if environ is None else environ
    p = parser(environ)
    args = p.parse_args(argv)
    keys = node_keys(p, args)
    return ControlConfig(
        node_name=args.node_name,
        keys=keys,
        state_dir=args.state_dir,
        kubeconfig=args.kubeconfig,
        sharing=args.sharing,
        mps_control=args.mps_control,
        stop_daemon=args.stop_daemon,
        watch_seconds=args.watch_seconds,
    )


def mps_clients(state: StateDir) -> list[PodTarget]:
    """The pods with a container served under MPS, from the served records in the state dir."""
    pods = {r.pod_uid: PodTarget(r.namespace, r.pod, r.pod_uid) for _, r in state.records() if r.mps}
    return [pods[uid] for uid in sorted(pods)]


def warn_mps_clients(warn: Callable[[EventTarget, str, str], object], state: StateDir, message: str) -> int:
    """A Warning event on each pod served under MPS (the daemon was started again: ``message`` says
    so) through ``warn`` (:meth:`Kube.warn`); returns how many pods were told."""
    pods = mps_clients(state)
    for pod in pods:
        try:
            warn(pod, MPS_RESTARTED_REASON, message)
        except Exception as e:
            log.warning("pod %s/%s: cannot record event: %s", pod.namespace, pod.name, e)
    return len(pods)


def node_gpu_uuids() -> list[str]:
    """The UUIDs of the node's GPUs, as NVML sees them; none (logged) without NVML."""
    try:
        nvml = Nvml()
    except NvmlUnavailableError as e:
        log.warning("no GPUs: %s", e)
        return []
    try:
        return [gpu.uuid for gpu in nvml.discover(1)]
    except NvmlUnavailableError as e:
        log.warning("no GPUs: %s", e)
        return []
    finally:
        nvml.close()


def serve(
    config: ControlConfig,
    stop: threading.Event,
    *,
    labels: Callable[[], Mapping[str, str]],
    gpu_uuids: Callable[[], Sequence[str]],
    on_restart: Callable[[str], object] | None = None,
) -> MpsDaemon | None:
    """Manage the node's daemon until ``stop`` on a node in MPS mode with GPUs, else wait for ``stop``;
    returns the daemon managed (None when idle). Raises :class:`~deviceplugin.sharing.NodeModeError`
    for a bad label, :class:`MpsDaemonError` or OSError when the daemon cannot be started at all."""
    mode = node_sharing_mode(labels(), config.keys, config.node_name, config.sharing)
    uuids = list(gpu_uuids()) if mode == SharingMode.MPS else []
    if mode != SharingMode.MPS or not uuids:
        why = "no GPUs" if mode == SharingMode.MPS else f"GPUs shared by {mode.value}"
        log.info("node %s: %s: no MPS control daemon to run; idle until stopped", config.node_name, why)
        stop.wait()
        return None
    daemon = MpsDaemon(config.mps_control, mps_paths(config.state_dir), uuids)
    daemon.on_restart = on_restart
    daemon.ensure()
    check_shm(daemon.paths)
    try:
        daemon.watch(stop, config.watch_seconds)
    finally:
        if config.stop_daemon:
            stop_daemon(daemon)
        else:
            log.info("MPS control daemon left running for its clients (--stop-daemon stops it)")
    return daemon


def stop_daemon(daemon: MpsDaemon) -> None:
    """Ask the daemon to quit (``quit``), as ``--stop-daemon`` does on SIGTERM."""
    pid = daemon.pid()
    if pid is None:
        return
    try:
        daemon.command("quit")
    except (MpsDaemonError, OSError, subprocess.TimeoutExpired) as e:
        log.warning("cannot stop the MPS control daemon %d: %s", pid, e)
        return
    log.info("MPS control daemon %d told to quit (--stop-daemon)", pid)


def check_shm(paths: MpsPaths) -> None:
    """Say so when this process's /dev/shm, which the daemon inherits, is not the directory containers
    get as theirs (the chart mounts it so): the server and its clients would not share memory, and
    clients could not connect."""
    try:
        same = os.path.samefile(CONTAINER_MPS_SHM_DIR, paths.shm)
    except OSError:
        same = False
    if not same:
        log.warning(
            "MPS: %s is not %s, which containers get as their %s: mount %s at %s in this container "
            "(the chart does), or MPS clients may not reach the server",
            CONTAINER_MPS_SHM_DIR,
            paths.shm,
            CONTAINER_MPS_SHM_DIR,
            paths.shm,
            CONTAINER_MPS_SHM_DIR,
        )


def run(config: ControlConfig, stop: threading.Event) -> None:
    kube = Kube(load_api(config.kubeconfig), config.node_name, config.keys)
    state = StateDir(config.state_dir)
    # Events go out on their own thread: the watch never waits for the API server.
    events = ThreadPoolExecutor(max_workers=1, thread_name_prefix="events")
    try:
        serve(
            config,
            stop,
            labels=kube.node_labels,
            gpu_uuids=node_gpu_uuids,
            on_restart=lambda message: events.submit(warn_mps_clients, kube.warn, state, message),
        )
    finally:
        events.shutdown(wait=False, cancel_futures=True)
        kube.close()
        log.info("stopped")


def main(argv: Sequence[str] | None = None) -> int:
    config = parse_control_config(argv)
    return serve_until_signalled(lambda stop: run(config, stop))


if __name__ == "__main__":
    sys.exit(main())
