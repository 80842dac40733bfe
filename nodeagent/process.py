"""The process around a node agent (the device plugin's and the DRA driver's): logging, the signals
that stop it, and the exit status of a configuration it cannot run with."""

from __future__ import annotations

import logging
import os
import signal
import sys
import threading
from collections.abc import Callable
from types import FrameType

log = logging.getLogger(__name__)


class SetupError(RuntimeError):
    """Something the agent cannot run with (its API server credentials, the node's sharing label, its
    MPS control daemon): the message says what, and the process exits 2 rather than retrying."""


def serve_until_signalled(run: Callable[[threading.Event], None]) -> int:
    """Run ``run(stop)`` until SIGTERM or SIGINT sets ``stop``; 2 when a path it needs is unusable or
    it raised a :class:`SetupError` (the message logged), else 0."""
    logging.basicConfig(
        level=os.environ.get("TESSERA_LOG_LEVEL", "INFO").upper(),
        format="%(asctime)s %(levelname)s %(name)s: %(message)s",
        stream=sys.stderr,
    )
    # The Kubernetes client's connection pool logs every retry; the agent reports failures itself.
    logging.getLogger("urllib3.connectionpool").setLevel(logging.ERROR)
    stop = threading.Event()

    def on_signal(signum: int, frame: FrameType | None) -> None:
        log.info("signal %d: stopping", signum)
        stop.set()

    signal.signal(signal.SIGTERM, on_signal)
    signal.signal(signal.SIGINT, on_signal)
    try:
        run(stop)
    except (SetupError, OSError) as e:
        log.error("%s", e)
        return 2
    return 0
