"""GPU health, shared by both agents (nodeagent/health.py): the rules of a GPU's health and the book
that XID events and presence checks write into and the publishing loops wait on."""

from __future__ import annotations

import threading
import time
from collections.abc import Callable

from nodeagent.health import GpuHealth, HealthBook, health_threads, is_critical_xid
from tests.waiting import wait_for

UUIDS = ("GPU-0", "GPU-1", "GPU-2", "GPU-3")


def test_critical_xid_makes_a_gpu_unhealthy_until_it_comes_back() -> None:
    health = GpuHealth()
    assert health.with_xid(13) == health  # the application's own fault: the GPU is fine
    assert not is_critical_xid(43)
    faulted = health.with_xid(79)
    assert not faulted.healthy and faulted.fault_xid == 79
    assert faulted.with_xid(48).fault_xid == 79  # the first fault is the one reported
    assert faulted.with_presence(True) == faulted  # still there: still faulted
    lost = faulted.with_presence(False)
    assert not lost.healthy
    assert lost.with_presence(True) == GpuHealth()  # reset / re-attached: healthy again


def test_a_fault_is_fatal_when_the_gpu_is_gone_or_needs_a_reset() -> None:
    assert not GpuHealth().fatal and GpuHealth().reason == ""
    fallen = GpuHealth().with_xid(79)  # fallen off the bus
    assert fallen.fatal and fallen.reason == "xid-79"
    assert GpuHealth().with_xid(95).fatal  # uncontained ECC error
    # High single-bit ECC rate (no reset needed) and an XID the list does not know: unhealthy, not fatal.
    for xid in (92, 1000):
        faulted = GpuHealth().with_xid(xid)
        assert not faulted.healthy and not faulted.fatal and faulted.reason == f"xid-{xid}"
    gone = GpuHealth().with_xid(92).with_presence(False)
    assert gone.fatal and gone.reason == "gone"


def test_a_health_change_bumps_the_version_and_the_time_it_changed() -> None:
    before = time.time()
    book = HealthBook(UUIDS, poll_seconds=60)
    state = book.state()
    assert state.version == 0 and all(h.healthy for h in state.gpus.values())
    made = state.since["GPU-1"]
    assert made >= before
    book.record_xid("GPU-1", 13)  # the application's own fault: no change
    book.record_xid("GPU-9", 79)  # not this node's GPU
    assert book.wait_for_change(0, timeout=0.01) == 0
    book.record_xid("GPU-1", 79)
    changed = book.state()
    assert changed.version == 1
    assert changed.gpus["GPU-1"] == GpuHealth(fault_xid=79)
    assert changed.since["GPU-1"] >= made and changed.since["GPU-0"] == made
    assert state.gpus["GPU-1"].healthy  # a state is a copy, not a view
    # Gone and back: healthy again, two more versions.
    book.record_presence("GPU-1", False)
    book.record_presence("GPU-1", True)
    assert book.state().version == 3
    assert all(h.healthy for h in book.state().gpus.values())


def test_a_waiter_wakes_on_a_change_and_presence_checks_run_until_stopped() -> None:
    book = HealthBook(UUIDS, poll_seconds=0.01)
    woken: list[int] = []
    waiter = threading.Thread(target=lambda: woken.append(book.wait_for_change(0, timeout=30)))
    waiter.start()
    stop = threading.Event()
    checks = threading.Thread(target=book.run_presence_checks, args=(lambda uuid: uuid != "GPU-2", stop))
    checks.start()
    waiter.join(30)
    assert woken == [1]
    wait_for(lambda: not book.state().gpus["GPU-2"].present, what="GPU-2 marked gone")
    stop.set()
    checks.join(30)
    assert not checks.is_alive()


class FakeNvml:
    """XID events on cue and a set of GPUs that are gone."""

    def __init__(self) -> None:
        self.gone: set[str] = set()
        self.xids: list[tuple[str, int]] = []

    def watch_xids(
        self, uuids: tuple[str, ...], on_xid: Callable[[str, int], None], stop: threading.Event
    ) -> None:
        while not stop.wait(0.01):
            while self.xids:
                uuid, xid = self.xids.pop(0)
                if uuid in uuids:
                    on_xid(uuid, xid)

    def present(self, uuid: str) -> bool:
        return uuid not in self.gone


def test_the_health_threads_keep_the_book_current_until_stopped() -> None:
    book = HealthBook(UUIDS, poll_seconds=0.01)
    nvml = FakeNvml()
    stop = threading.Event()
    threads = health_threads(nvml, book, stop)
    assert [t.name for t in threads] == ["xid", "presence"]
    for thread in threads:
        thread.start()
    try:
        nvml.xids.append(("GPU-0", 79))
        nvml.gone.add("GPU-3")
        wait_for(
            lambda: book.state().gpus["GPU-0"].fault_xid == 79 and not book.state().gpus["GPU-3"].present,
            what="the XID and the lost GPU recorded",
        )
    finally:
        stop.set()
        for thread in threads:
            thread.join(30)
    assert not any(t.is_alive() for t in threads)
    # Nothing to watch without NVML or without GPUs.
    assert health_threads(None, book, stop) == []
    assert health_threads(nvml, HealthBook((), poll_seconds=1), stop) == []
