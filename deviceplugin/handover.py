"""Going away without failing a pod: the node agent's last act when it is told to stop (a DaemonSet
rolling update, `kubectl delete pod`), before it stops serving the kubelet.

Once the agent's socket is gone, the kubelet rejects every pod it admits with this node's slices
(``UnexpectedAdmissionError``: the pod fails for good) until the next agent registers; the extender
would go on binding pods here in the meantime, since the node still offers its slices. So the agent
first withdraws its heartbeat, which makes the node unschedulable to the extender (a node without
one gets no new pods: pods created meanwhile wait, Pending with that reason, for the next agent's
heartbeat), and keeps serving until every pod already bound here has had its Allocate, for at most
:data:`LIMIT_SECONDS`. A crash (SIGKILL) skips all this; the heartbeat timeout covers it.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable

log = logging.getLogger(__name__)

# How long the extender may go on binding here after the heartbeat is withdrawn: its watch of the
# Node, and a bind it decided just before, on a loaded host.
SETTLE_SECONDS = 3.0
# The most the agent waits, after the settle, for the pods bound here to have their Allocate (well
# within the pod's default 30 s termination grace period).
LIMIT_SECONDS = 10.0
POLL_SECONDS = 0.2


def hand_over(
    withdraw: Callable[[], None],
    allocating: Callable[[], int],
    *,
    settle: float = SETTLE_SECONDS,
    limit: float = LIMIT_SECONDS,
    sleep: Callable[[float], None] = time.sleep,
    clock: Callable[[], float] = time.monotonic,
) -> int:
    """Withdraw the heartbeat, then wait for ``allocating()`` (the pods bound here and not yet
    served) to reach 0; returns how many were left when it gave up (0 when none)."""
    try:
        withdraw()
    except Exception as e:  # the API may be down: stop anyway, as a crash would
        log.warning("could not withdraw the node's heartbeat (stopping anyway): %s", e)
        return allocating()
    sleep(settle)
    deadline = clock() + limit
    while (left := allocating()) and clock() < deadline:
        sleep(POLL_SECONDS)
    if left:
        log.warning("stopping with %d pod(s) bound here still waiting for Allocate", left)
    return left
