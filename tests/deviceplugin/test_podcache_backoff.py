"""The pod cache's pauses when the watch keeps failing (no API server needed: the failures are the
point, and the pauses are recorded instead of slept)."""

from __future__ import annotations

import threading
from typing import Any

import urllib3

from deviceplugin.podcache import PodCache
from tessera.contract import KEYS


class FailingWatchKube:
    """Lists work (nothing on the node); every watch fails to connect, or ends at once."""

    node = "n1"
    keys = KEYS

    def __init__(self, quick_end: bool = False) -> None:
        self.quick_end = quick_end
        self.watches = 0

    def list_pods(self) -> tuple[list[dict[str, Any]], str]:
        return [], "7"

    def watch_pods(self, resource_version: str, timeout_seconds: int) -> Any:
        self.watches += 1
        if self.quick_end:
            return EmptyResponse()
        raise urllib3.exceptions.NewConnectionError(None, "connection refused")  # type: ignore[arg-type]


class EmptyResponse:
    def stream(self, amt: int | None = None, decode_content: bool = False) -> list[bytes]:
        return []

    def close(self) -> None:
        pass


def pauses_until(kube: Any, count: int) -> list[float]:
    stop = threading.Event()
    pauses: list[float] = []

    def sleep(seconds: float) -> None:
        pauses.append(seconds)
        if len(pauses) >= count:
            stop.set()

    cache = PodCache(kube, sleep=sleep)
    cache.run(stop)
    assert cache.synced
    return pauses


def test_consecutive_failed_watches_lengthen_the_pause_up_to_its_cap() -> None:
    kube = FailingWatchKube()
    pauses = pauses_until(kube, 6)
    floors = [0.5, 1.0, 2.0, 4.0, 4.0, 4.0]
    assert all(floor <= p <= floor + 1.0 for floor, p in zip(floors, pauses, strict=True)), pauses
    assert kube.watches == 6


def test_a_watch_ended_at_once_without_an_event_counts_as_failed() -> None:
    kube = FailingWatchKube(quick_end=True)
    pauses = pauses_until(kube, 3)
    assert all(floor <= p <= floor + 1.0 for floor, p in zip([0.5, 1.0, 2.0], pauses, strict=True)), pauses
    assert kube.watches == 3
