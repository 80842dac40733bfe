"""GPU health for both node agents: the rules (pure) and the book that XID events and presence checks
write into and the agents' publishing loops wait on.

A GPU is healthy while it is present (NVML still answers for it) and has had no critical XID since it
last came back. Losing a GPU and getting it back (a reset, a re-attach) clears a past XID fault.
A fault is fatal when the containers on the GPU cannot go on: the GPU is gone, or its XID is one
after which NVIDIA's XID catalogue says the GPU must be reset (:data:`FATAL_XIDS`); any other
critical XID (one the catalogue says needs no reset, or one this list does not know) keeps new work
off the GPU and leaves running work alone.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass
from typing import Protocol

log = logging.getLogger(__name__)

# XIDs caused by the application (its own bad kernel, out-of-range access, a reset it asked for), not
# by the GPU: the GPU is still fine for the next container. NVIDIA's own device plugin skips the same.
APPLICATION_XIDS = frozenset({13, 31, 43, 45, 68, 109})
# XIDs after which the GPU needs a reset (NVIDIA's XID catalogue): 48 double-bit ECC, 62 internal
# micro-controller halt, 64 ECC page retirement / row remapping failure, 74 NVLink, 79 fallen off the
# bus, 95 uncontained ECC, 119 and 120 GSP errors.
FATAL_XIDS = frozenset({48, 62, 64, 74, 79, 95, 119, 120})


def is_critical_xid(xid: int) -> bool:
    return xid not in APPLICATION_XIDS


@dataclass(frozen=True, slots=True)
class GpuHealth:
    present: bool = True
    # The critical XID that took the GPU out of service, if any.
    fault_xid: int | None = None

    @property
    def healthy(self) -> bool:
        return self.present and self.fault_xid is None

    @property
    def fatal(self) -> bool:
        """Whether the containers on the GPU cannot go on (it is gone, or its fault needs a reset)."""
        return not self.present or self.fault_xid in FATAL_XIDS

    @property
    def reason(self) -> str:
        """Why it is unhealthy, as a label value: ``gone`` or ``xid-<n>``; "" when healthy."""
        if not self.present:
            return "gone"
        return "" if self.fault_xid is None else f"xid-{self.fault_xid}"

    def with_xid(self, xid: int) -> GpuHealth:
        if not is_critical_xid(xid) or self.fault_xid is not None:
            return self
        return GpuHealth(present=self.present, fault_xid=xid)

    def with_presence(self, present: bool) -> GpuHealth:
        if present == self.present:
            return self
        if present:
            return GpuHealth(present=True, fault_xid=None)
        return GpuHealth(present=False, fault_xid=self.fault_xid)


@dataclass(frozen=True, slots=True)
class HealthState:
    """The book at one moment: each GPU's health, when it last changed (Unix time; the time the book
    was made for a GPU that never changed) and the version, bumped on every change."""

    gpus: Mapping[str, GpuHealth]
    since: Mapping[str, float]
    version: int


class HealthBook:
    """Each GPU's health, changed by XID events and presence checks; every change bumps a version
    that the publishing loops wait on."""

    def __init__(self, uuids: Iterable[str], poll_seconds: float) -> None:
        """``uuids``: the node's GPUs as discovered; ``poll_seconds``: the pause between presence
        checks."""
        self.gpu_uuids = tuple(uuids)
        self._poll_seconds = poll_seconds
        # Guards the health and its version; notified on every change (and to wake waiters).
        self._changed = threading.Condition()
        self._health = {uuid: GpuHealth() for uuid in self.gpu_uuids}
        made = time.time()
        self._since = dict.fromkeys(self.gpu_uuids, made)
        self._version = 0

    def state(self) -> HealthState:
        with self._changed:
            return HealthState(dict(self._health), dict(self._since), self._version)

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
            self._since[uuid] = time.time()
            self._version += 1
            self._changed.notify_all()
        log.warning("GPU %s: %s, now %s", uuid, why, "Healthy" if after.healthy else "Unhealthy")

    def run_presence_checks(self, present: Callable[[str], bool], stop: threading.Event) -> None:
        while not stop.wait(self._poll_seconds):
            for uuid in self.gpu_uuids:
                self.record_presence(uuid, present(uuid))


class GpuWatch(Protocol):
    """What the health threads ask NVML (:class:`nodeagent.nvml.Nvml`)."""

    def watch_xids(
        self, uuids: tuple[str, ...], on_xid: Callable[[str, int], None], stop: threading.Event
    ) -> None: ...

    def present(self, uuid: str) -> bool: ...


def health_threads(nvml: GpuWatch | None, book: HealthBook, stop: threading.Event) -> list[threading.Thread]:
    """The threads (not started) that keep ``book`` current until ``stop``: XID events and presence
    checks; none without NVML or GPUs."""
    if nvml is None or not book.gpu_uuids:
        return []
    return [
        threading.Thread(target=nvml.watch_xids, args=(book.gpu_uuids, book.record_xid, stop), name="xid"),
        threading.Thread(target=book.run_presence_checks, args=(nvml.present, stop), name="presence"),
    ]
