"""The DRA driver's side of GPU health (draplugin/health.py): the slice republished with a taint as a
GPU's health changes, written only when its devices change, and the pods told once per worsening."""

from __future__ import annotations

import copy
import threading
import time
from collections.abc import Iterator

import pytest
from kubernetes import client

from draplugin.health import GPU_UNHEALTHY_REASON, HealthPublisher, unhealthy_message, worsened
from draplugin.kube import SlicePublisher
from draplugin.slices import resource_slice
from nodeagent.health import GpuHealth, HealthBook
from tessera.contract import KEYS, JsonObject
from tessera.placement.speed import SpeedProfiles
from tests.draplugin.test_slices import A100, T4
from tests.waiting import wait_for


def test_a_gpu_worsens_when_it_turns_unhealthy_or_fatally_so() -> None:
    faulted, fatal, gone = GpuHealth(fault_xid=92), GpuHealth(fault_xid=79), GpuHealth(present=False)
    healthy = {"a": GpuHealth(), "b": GpuHealth()}
    assert worsened(healthy, healthy) == []
    assert worsened(healthy, {"a": faulted, "b": GpuHealth()}) == ["a"]
    assert worsened({"a": faulted}, {"a": fatal, "b": gone}) == ["a", "b"]  # missing before: healthy
    assert worsened({"a": fatal}, {"a": gone}) == []  # as fatal as before
    assert worsened({"a": gone}, {"a": GpuHealth()}) == []  # recovered


def test_the_message_says_what_happened_and_what_follows() -> None:
    assert unhealthy_message(T4, GpuHealth(fault_xid=92), KEYS) == (
        "GPU GPU-t4 (device gpu-1) is unhealthy: critical XID 92; device taint tessera.io/unhealthy=xid-92"
        ":NoSchedule: running containers keep it, new claims avoid it"
    )
    assert unhealthy_message(A100, GpuHealth(present=False), KEYS) == (
        "GPU GPU-a100 (device gpu-0) is unhealthy: gone (NVML no longer answers for it); device taint "
        "tessera.io/unhealthy=gone:NoExecute: its pods are evicted unless their claims tolerate the taint"
    )


class Store:
    """The API server's one slice, and how often it was written; fails while ``failing``."""

    def __init__(self) -> None:
        self.slice: JsonObject | None = None
        self.writes = 0
        self.failing = False
        self._lock = threading.Lock()

    def read_slice(self, name: str) -> JsonObject | None:
        if self.failing:
            raise client.ApiException(status=503, reason="Service Unavailable")
        with self._lock:
            return copy.deepcopy(self.slice)

    def create_slice(self, body: JsonObject) -> None:
        self.replace_slice(body)

    def replace_slice(self, body: JsonObject) -> None:
        with self._lock:
            self.slice = copy.deepcopy(body)
            self.slice["metadata"]["resourceVersion"] = str(self.writes)
            self.writes += 1

    def taints(self) -> list[list[JsonObject]]:
        with self._lock:
            assert self.slice is not None
            return [d.get("taints", []) for d in self.slice["spec"]["devices"]]


class Running:
    def __init__(self, book: HealthBook, store: Store) -> None:
        self.book, self.store = book, store
        self.told: list[tuple[str, str, str]] = []


@pytest.fixture
def running() -> Iterator[Running]:
    """A HealthPublisher running on a book of the A100 and the T4, resyncing every 0.05 s."""
    book = HealthBook((A100.uuid, T4.uuid), poll_seconds=60)
    store = Store()
    view = Running(book, store)
    publisher = SlicePublisher(
        store,
        KEYS,
        lambda generation: resource_slice(
            "node-a", [A100, T4], SpeedProfiles(), generation, KEYS, health=book.state()
        ),
    )
    loop = HealthPublisher(
        book,
        [A100, T4],
        KEYS,
        publisher,
        lambda device, reason, message: view.told.append((device, reason, message)),
    )
    stop = threading.Event()
    thread = threading.Thread(target=loop.run, args=(stop, 0.05))
    thread.start()
    try:
        yield view
    finally:
        stop.set()
        book.wake()
        thread.join(5)
        assert not thread.is_alive()


def test_each_health_change_is_published_at_once_and_only_changes_are_written(running: Running) -> None:
    book, store, told = running.book, running.store, running.told
    wait_for(lambda: store.writes == 1, what="the slice created")
    assert store.taints() == [[], []]
    time.sleep(0.3)  # resyncs every 0.05 s: nothing changed, nothing written
    assert store.writes == 1 and told == []

    book.record_xid(T4.uuid, 92)
    wait_for(lambda: store.taints()[1], timeout=2.0, what="the T4 tainted")
    [taint] = store.taints()[1]
    assert (taint["key"], taint["value"], taint["effect"]) == (
        KEYS.dra_unhealthy_taint,
        "xid-92",
        "NoSchedule",
    )
    # The pods are told after the slice is written: wait for the telling too.
    wait_for(lambda: len(told) >= 1, timeout=2.0, what="the T4's pods told")
    assert told == [("gpu-1", GPU_UNHEALTHY_REASON, unhealthy_message(T4, GpuHealth(fault_xid=92), KEYS))]
    assert store.writes == 2
    assert store.slice is not None and store.slice["spec"]["pool"]["generation"] == 2

    book.record_presence(T4.uuid, False)  # now fatal: NoExecute, and the pods told again
    wait_for(lambda: store.taints()[1][0]["effect"] == "NoExecute", timeout=2.0, what="the T4 gone")
    wait_for(lambda: len(told) >= 2, timeout=2.0, what="the T4's pods told again")
    assert [t[0] for t in told] == ["gpu-1", "gpu-1"] and "gone" in told[1][2]
    book.record_presence(T4.uuid, True)  # back: healthy again, the taint goes, nobody is told
    wait_for(lambda: store.taints() == [[], []], timeout=2.0, what="the taint gone")
    time.sleep(0.3)
    assert store.writes == 4 and len(told) == 2


def test_a_failed_write_is_retried_at_the_next_pass(running: Running) -> None:
    book, store = running.book, running.store
    wait_for(lambda: store.writes == 1, what="the slice created")
    store.failing = True
    book.record_xid(A100.uuid, 79)
    time.sleep(0.2)
    assert store.taints() == [[], []]
    store.failing = False
    wait_for(lambda: store.taints()[0], timeout=2.0, what="the A100 tainted once the API answers")
    assert store.taints()[0][0]["effect"] == "NoExecute"
