"""The DRA driver's side of GPU health (the rules and the book: :mod:`nodeagent.health`): the node's
ResourceSlice republished as soon as a GPU's health changes, each unhealthy GPU's device with its
taint (:func:`draplugin.slices.device_taint`), and a Warning event on the pods whose prepared claims
use a GPU that turned unhealthy, or fatally so."""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Iterable, Mapping

from draplugin.kube import SlicePublisher
from draplugin.slices import NO_EXECUTE, NO_SCHEDULE, device_name
from nodeagent.health import GpuHealth, HealthBook
from tessera.contract import ContractKeys, GpuInfo

log = logging.getLogger(__name__)

GPU_UNHEALTHY_REASON = "TesseraGpuUnhealthy"
# The longest the loop waits before it looks at its stop event again.
WAKE_SECONDS = 1.0


def _severity(health: GpuHealth) -> int:
    return 0 if health.healthy else 2 if health.fatal else 1


def worsened(before: Mapping[str, GpuHealth], after: Mapping[str, GpuHealth]) -> list[str]:
    """The GPUs whose health got worse from ``before`` to ``after``: unhealthy now and healthy
    before, or fatally unhealthy now and not before (a missing GPU is healthy)."""
    return [
        uuid for uuid, health in after.items() if _severity(health) > _severity(before.get(uuid, GpuHealth()))
    ]


def unhealthy_message(gpu: GpuInfo, health: GpuHealth, keys: ContractKeys) -> str:
    """What the event on an affected pod says: what happened to the GPU and what follows for the pod."""
    what = (
        "gone (NVML no longer answers for it)" if not health.present else f"critical XID {health.fault_xid}"
    )
    effect = NO_EXECUTE if health.fatal else NO_SCHEDULE
    follows = (
        "its pods are evicted unless their claims tolerate the taint"
        if health.fatal
        else "running containers keep it, new claims avoid it"
    )
    return (
        f"GPU {gpu.uuid} (device {device_name(gpu)}) is unhealthy: {what}; device taint "
        f"{keys.dra_unhealthy_taint}={health.reason}:{effect}: {follows}"
    )


class HealthPublisher:
    """Keeps the slice current: a pass when the book changes and every ``every`` seconds anyway (the
    slice repaired if someone else changed or deleted it); a pass writes only when the devices
    changed (:meth:`SlicePublisher.sync`)."""

    def __init__(
        self,
        book: HealthBook,
        gpus: Iterable[GpuInfo],
        keys: ContractKeys,
        publisher: SlicePublisher,
        tell: Callable[[str, str, str], None],
    ) -> None:
        """``tell(device, reason, message)``: a Warning event on the pods whose prepared claims use
        ``device`` (:meth:`draplugin.driver.Driver.tell_pods_on`)."""
        self._book = book
        self._gpus = {g.uuid: g for g in gpus}
        self._keys = keys
        self._publisher = publisher
        self._tell = tell

    def run(self, stop: threading.Event, every: float) -> None:
        seen: Mapping[str, GpuHealth] = {}  # as published at start: all healthy
        version: int | None = None
        next_pass = 0.0
        while not stop.is_set():
            state = self._book.state()
            if state.version != version or time.monotonic() >= next_pass:
                self._publisher.try_sync()
                next_pass = time.monotonic() + every
                for uuid in worsened(seen, state.gpus):
                    gpu = self._gpus[uuid]
                    message = unhealthy_message(gpu, state.gpus[uuid], self._keys)
                    log.warning("%s", message)
                    self._tell(device_name(gpu), GPU_UNHEALTHY_REASON, message)
                seen, version = state.gpus, state.version
            self._book.wait_for_change(
                state.version, timeout=min(WAKE_SECONDS, max(0.0, next_pass - time.monotonic()))
            )
