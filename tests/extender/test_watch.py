"""The watch loop against a stand-in API: list, watch, list again on 410 Gone (at once) or after a
failure (after a backoff that starts again after each successful list), stop."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from datetime import UTC, datetime, timedelta

import pytest

from extender.kube import ApiError
from extender.state import ClusterState
from extender.watch import Watcher
from tessera import watching
from tessera.contract import KEYS, JsonObject
from tessera.placement import PlacementEngine, SpeedProfiles
from tests.extender.helpers import inventory, node_object

NOW = datetime(2026, 1, 1, 12, 0, 0, tzinfo=UTC)


class FakeKube:
    """Nodes: the first watch says 410 Gone; the second list has a new node, whose watch then adds
    a third before the server ends it; later watches fail. Pods: nothing."""

    def __init__(self) -> None:
        self.node_lists = 0
        self.watches: list[tuple[str, str]] = []
        self.selectors: dict[str, str] = {}
        self.third_added = asyncio.Event()

    async def list(self, path: str, field_selector: str) -> tuple[list[JsonObject], str]:
        self.selectors[path] = field_selector
        if path == "/api/v1/pods":
            return [], "1"
        self.node_lists += 1
        names = ["a"] if self.node_lists == 1 else ["a", "b"]
        return [node_object(n, inventory(n, "Tesla T4", 15360), NOW) for n in names], str(
            self.node_lists * 10
        )

    async def watch(
        self, path: str, resource_version: str, timeout_seconds: int, field_selector: str
    ) -> AsyncIterator[JsonObject]:
        assert field_selector == self.selectors[path]
        self.watches.append((path, resource_version))
        if path == "/api/v1/pods":
            await asyncio.sleep(0.05)
            return
        if resource_version == "10":
            yield {
                "type": "ERROR",
                "object": {"kind": "Status", "code": 410, "message": "too old resource version"},
            }
            return
        if resource_version == "20" and not self.third_added.is_set():
            yield {"type": "ADDED", "object": node_object("c", inventory("c", "Tesla T4", 15360), NOW)}
            yield {"type": "DELETED", "object": {"metadata": {"name": "a"}}}
            self.third_added.set()
            return
        await asyncio.sleep(0.05)
        raise ApiError(500, "unexpected")


def test_relists_after_410_and_applies_events(monkeypatch: pytest.MonkeyPatch) -> None:
    settled: list[list[str]] = []
    monkeypatch.setattr("extender.watch.settle_heap", lambda: settled.append(state.unsynced()))
    state = ClusterState(PlacementEngine(SpeedProfiles()), KEYS, heartbeat_timeout=timedelta(minutes=5))
    kube = FakeKube()
    watcher = Watcher(kube, state, clock=lambda: NOW, sweep_every=0.05)  # type: ignore[arg-type]

    async def run() -> None:
        watcher.start()
        try:
            await asyncio.wait_for(kube.third_added.wait(), 10)
            # Nodes and pods are listed by tasks of their own: wait for both.
            async with asyncio.timeout(10):
                while set(state.engine.nodes) != {"b", "c"} or state.unsynced():
                    await asyncio.sleep(0.01)
        finally:
            await watcher.stop()

    asyncio.run(run())
    assert set(state.engine.nodes) == {"b", "c"}
    assert kube.node_lists >= 2
    assert ("/api/v1/nodes", "10") in kube.watches
    assert ("/api/v1/nodes", "20") in kube.watches
    assert state.unsynced() == []
    assert kube.selectors == {"/api/v1/nodes": "", "/api/v1/pods": "spec.nodeName!="}  # bound pods only
    assert settled == [[]]  # the heap is settled once, when both caches first are


class FailingKube:
    """Nodes: eight lists fail (the API server down, answering errors, a bug), the ninth succeeds; its
    watch fails; the tenth list succeeds and its watch says 410 Gone; the eleventh succeeds and its
    watch stays open. Pods: listed at once, their watch stays open."""

    def __init__(self) -> None:
        self.node_lists = 0
        self.failures: list[Exception] = [
            ApiError(0, "connection refused"),
            ApiError(0, "connection refused"),
            ApiError(503, "unavailable"),
            ApiError(500, "internal error"),
            RuntimeError("a bug"),
            ApiError(0, "timed out"),
            ApiError(0, "timed out"),
            ApiError(0, "timed out"),
        ]
        self.open = asyncio.Event()  # the last node watch is open

    async def list(self, path: str, field_selector: str) -> tuple[list[JsonObject], str]:
        if path == "/api/v1/pods":
            return [], "1"
        self.node_lists += 1
        if self.failures:
            raise self.failures.pop(0)
        return [node_object("a", inventory("a", "Tesla T4", 15360), NOW)], str(self.node_lists)

    async def watch(
        self, path: str, resource_version: str, timeout_seconds: int, field_selector: str
    ) -> AsyncIterator[JsonObject]:
        if path == "/api/v1/nodes" and resource_version == "9":
            raise ApiError(500, "watch failed")
        if path == "/api/v1/nodes" and resource_version == "10":
            yield {"type": "ERROR", "object": {"kind": "Status", "code": 410, "message": "too old"}}
            return
        if path == "/api/v1/nodes":
            self.open.set()
        await asyncio.Event().wait()  # open until the watcher stops


def test_failures_back_off_exponentially_with_jitter_and_410_relists_at_once(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr("extender.watch.settle_heap", lambda: None)
    state = ClusterState(PlacementEngine(SpeedProfiles()), KEYS, heartbeat_timeout=timedelta(minutes=5))
    kube = FailingKube()
    pauses: list[tuple[float, int]] = []  # (the pause asked for, node lists made before it)

    async def sleep(seconds: float) -> None:  # no real waiting: the test counts and bounds pauses
        pauses.append((seconds, kube.node_lists))
        await asyncio.sleep(0)

    watcher = Watcher(kube, state, clock=lambda: NOW, sweep_every=0.05, sleep=sleep)  # type: ignore[arg-type]

    async def run() -> None:
        watcher.start()
        try:
            await asyncio.wait_for(kube.open.wait(), 10)
        finally:
            await watcher.stop()

    asyncio.run(run())
    assert kube.node_lists == 11  # 8 failed, then one per watch: failed, 410 Gone, open
    first, jitter, cap = watching.RETRY_FIRST, watching.RETRY_JITTER, watching.RETRY_MAX
    # One pause after each failed list, doubling from the first step up to the cap, each with up
    # to RETRY_JITTER added: 0.5, 1, 2, 4, 4, ... (+ 0-1) seconds.
    assert [made for _, made in pauses[:8]] == list(range(1, 9))
    for n, (pause, _) in enumerate(pauses[:8]):
        low = min(first * 2**n, cap)
        assert low <= pause <= low + jitter
        assert pause <= 5.0
    # The ninth list succeeded: after its watch failed, the pause is the first step again.
    assert len(pauses) == 9
    assert pauses[8][1] == 9
    assert first <= pauses[8][0] <= first + jitter
    # 410 Gone after the tenth list: the eleventh came at once, with no pause.
    assert set(state.engine.nodes) == {"a"}
