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

from deviceplugin.kube import KubeConfigError
from deviceplugin.mps_daemon import MpsDaemonError
from deviceplugin.sharing import NodeModeError

log = logging.getLogger(__name__)


def serve_until_signalled(run: Callable[[threading.Event], None]) -> int:
    """Run ``run(stop)`` until SIGTERM or SIGINT sets ``stop``; 2 when the API server's credentials,
    a path it needs, the node's sharing label or its MPS control daemon are unusable (the message
    logged), else 0."""
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
    except (KubeConfigError, OSError, NodeModeError, MpsDaemonError) as e:
        log.error("%s", e)
        return 2
    return 0
