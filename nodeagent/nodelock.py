"""One node agent per node: the device plugin or the DRA driver, never both on the same GPUs.

Both would keep the books of the GPUs' memory (the device plugin with the extender's allocations, the
DRA driver with kube-scheduler's claims), and neither sees the other's shares: together they would
overcommit every GPU. So each holds an exclusive ``flock`` on ``agent.lock`` in the host state dir
(the chart gives both agents the same one) for as long as it runs. The kernel lets go of the lock
when the process ends, however it ends, so a crash leaves nothing stale to clean up.

The holder writes who it is into the file. An agent of the other kind that finds the lock taken
stops with a clear error. An agent of the same kind waits: that is a DaemonSet rolling update that
starts the new pod before the old one has gone.
"""

from __future__ import annotations

import contextlib
import fcntl
import json
import logging
import os
import socket
import threading
from collections.abc import Callable, Iterator
from pathlib import Path

from nodeagent.process import SetupError, serve_until_signalled

log = logging.getLogger(__name__)

AGENT_LOCK = "agent.lock"
# How often an agent waiting for another of its kind tries the lock again, in seconds.
WAIT_POLL_SECONDS = 1.0


class AgentConflictError(SetupError):
    """The node's GPUs are held by the other kind of node agent."""


def serve_holding_node(state_dir: Path, agent: str, run: Callable[[threading.Event], None]) -> int:
    """:func:`~nodeagent.process.serve_until_signalled` for a node agent: ``run(stop)`` once this
    node is ``agent``'s alone, held until it returns."""

    def holding(stop: threading.Event) -> None:
        with holding_node(state_dir, agent, stop) as held:
            if held:
                run(stop)

    return serve_until_signalled(holding)


@contextlib.contextmanager
def holding_node(
    state_dir: Path, agent: str, stop: threading.Event, poll: float = WAIT_POLL_SECONDS
) -> Iterator[bool]:
    """Hold the node for ``agent`` (``device plugin`` or ``DRA driver``) while the block runs.

    Yields True once held, or False when ``stop`` was set while waiting for an earlier agent of the
    same kind. Raises :class:`AgentConflictError` when the other kind holds it."""
    state_dir.mkdir(parents=True, exist_ok=True)
    path = state_dir / AGENT_LOCK
    fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o644)
    try:
        held = _take(fd, path, agent, stop, poll)
        if held:
            # Who holds it, for the error an agent of the other kind reports. The pod's name is the
            # hostname in Kubernetes; a PID means little across PID namespaces.
            me = json.dumps({"agent": agent, "pod": socket.gethostname(), "pid": os.getpid()})
            os.ftruncate(fd, 0)
            os.pwrite(fd, me.encode(), 0)
        yield held
    finally:
        os.close(fd)  # lets go of the lock


def _take(fd: int, path: Path, agent: str, stop: threading.Event, poll: float) -> bool:
    told = False
    while True:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            return True
        except BlockingIOError:
            pass
        holder = _holder(path)
        # An empty file is a holder between taking the lock and saying who it is: wait for it.
        if holder and holder.get("agent") != agent:
            raise AgentConflictError(
                f"{path}: the node's GPUs are held by the {holder.get('agent')} (pod {holder.get('pod')}); "
                f"a node runs either the device plugin or the DRA driver, never both, so this {agent} "
                "does not start (docs/dra.md, 'One mode per node')"
            )
        if not told:
            log.info("%s: waiting for the %s still running (pod %s) to stop", path, agent, holder.get("pod"))
            told = True
        if stop.wait(poll):
            return False


def _holder(path: Path) -> dict[str, object]:
    try:
        found = json.loads(path.read_text())
    except (OSError, ValueError):
        return {}
    return found if isinstance(found, dict) else {}
