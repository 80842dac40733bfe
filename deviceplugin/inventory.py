"""The node's GPUs and their health: the slices the kubelet is offered and the inventory the Node
carries. XID events and presence checks change a GPU's health; every change bumps a version that
ListAndWatch and the publisher wait on."""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable

from deviceplugin.devices import GpuHealth, VirtualDevice, virtual_devices, with_health
from tessera.contract import GpuInfo

log = logging.getLogger(__name__)


class Inventory:
    def __init__(self, gpus: tuple[GpuInfo, ...], health_poll_seconds: float) -> None:
        """``gpus``: as discovered; ``health_poll_seconds``: the pause between presence checks."""
        self.gpus = gpus
        self.uuids = frozenset(g.uuid for g in gpus)
        self._poll_seconds = health_poll_seconds
        # Guards the health and its version; notified on every change (and to wake waiters).
        self._changed = threading.Condition()
        self._health = {g.uuid: GpuHealth() for g in gpus}
        self._version = 0

    @property
    def gpu_uuids(self) -> tuple[str, ...]:
        return tuple(g.uuid for g in self.gpus)

    def inventory(self) -> tuple[GpuInfo, ...]:
        with self._changed:
            return with_health(self.gpus, self._health)

    def devices(self) -> tuple[tuple[VirtualDevice, ...], int]:
        """The full slice list and its version (bumped on every health change)."""
        with self._changed:
            return virtual_devices(with_health(self.gpus, self._health)), self._version

    def wait_for_change(self, version: int, timeout: float) -> int:
        with self._changed:
            self._changed.wait_for(lambda: self._version != version, timeout=timeout)
            return self._version

    def wake(self) -> None:
        """Wake the loops that wait for a change (to see that they are stopped)."""
        with self._changed:
            self._changed.notify_all()

    def record_xid(self, uuid: str, xid: int) -> None:
        self._set_health(uuid, lambda h: h.with_xid(xid), f"XID {xid}")

    def record_presence(self, uuid: str, present: bool) -> None:
        self._set_health(uuid, lambda h: h.with_presence(present), "present" if present else "gone")

    def _set_health(self, uuid: str, change: Callable[[GpuHealth], GpuHealth], why: str) -> None:
        with self._changed:
            if uuid not in self._health:
                return
            before = self._health[uuid]
            after = change(before)
            if after == before:
                return
            self._health[uuid] = after
            self._version += 1
            self._changed.notify_all()
        log.warning("GPU %s: %s, now %s", uuid, why, "Healthy" if after.healthy else "Unhealthy")

    def run_presence_checks(self, present: Callable[[str], bool], stop: threading.Event) -> None:
        while not stop.wait(self._poll_seconds):
            for uuid in self.gpu_uuids:
                self.record_presence(uuid, present(uuid))
