"""The phase writer: each pod's write is independent, so a pod whose write fails or is refused holds
up no other pod (issue: a pod with annotations near the API's limit kept the node's other pods
``allocating`` while its write was retried ahead of theirs)."""

from __future__ import annotations

import threading
from collections.abc import Iterator
from datetime import UTC, datetime
from typing import Any

import pytest
from kubernetes import client

from deviceplugin.matching import PodView
from deviceplugin.phases import REFUSED_REASON, PhaseWriter
from tessera.contract import Phase


def pod(name: str) -> PodView:
    return PodView(
        namespace="team-a",
        name=name,
        uid=f"uid-{name}",
        created=datetime(2026, 1, 1, tzinfo=UTC),
        annotations={},
        gpu_containers=(),
    )


class Api:
    """The writer's calls: phases refused for some pods (a status, for good or not), kept for others."""

    def __init__(self, refuse: dict[str, int]) -> None:
        self.refuse = refuse
        self.phases: dict[str, Phase] = {}
        self.attempts: dict[str, int] = {}
        self.events: list[tuple[str, str, str]] = []
        self.lock = threading.Lock()

    def set_phase(self, target: PodView, phase: Phase) -> None:
        with self.lock:
            self.attempts[target.name] = self.attempts.get(target.name, 0) + 1
            if target.name in self.refuse:
                raise client.ApiException(status=self.refuse[target.name], reason="Refused")
            self.phases[target.name] = phase

    def read_pod(self, namespace: str, name: str) -> Any:
        return type("NodePod", (), {"view": pod(name)})()  # still there, same UID

    def warn(self, target: PodView, reason: str, message: str) -> None:
        self.events.append((target.name, reason, message))


@pytest.fixture
def running() -> Iterator[Any]:
    stops: list[tuple[threading.Event, threading.Thread]] = []

    def start(writer: PhaseWriter) -> None:
        stop = threading.Event()
        thread = threading.Thread(target=writer.run, args=(stop,), daemon=True)
        thread.start()
        stops.append((stop, thread))

    yield start
    for stop, thread in stops:
        stop.set()
        thread.join(timeout=10)


def test_a_failing_write_holds_up_no_other_pod(running: Any) -> None:
    api = Api({"stuck": 500})  # the API server keeps failing this one
    writer = PhaseWriter(api)  # type: ignore[arg-type]
    running(writer)
    assert writer.submit(pod("stuck"))
    others = [pod(f"p{i}") for i in range(5)]
    for other in others:
        assert writer.submit(other)
    deadline = threading.Event()
    for _ in range(100):
        if all(o.name in api.phases for o in others):
            break
        deadline.wait(0.05)
    assert {o.name: api.phases.get(o.name) for o in others} == {o.name: Phase.ALLOCATED for o in others}
    assert "stuck" not in api.phases and writer.pending() == 1  # still retried, behind the others


def test_a_write_refused_for_good_is_told_on_the_pod_and_not_tried_again(running: Any) -> None:
    api = Api({"huge": 422})  # its annotations leave no room under the API's 256 KiB
    writer = PhaseWriter(api)  # type: ignore[arg-type]
    running(writer)
    assert writer.submit(pod("huge"))
    assert writer.submit(pod("small"))
    assert writer.wait_idle(10)
    assert api.phases == {"small": Phase.ALLOCATED}
    assert api.attempts["huge"] == 1 and writer.refused == 1
    [(name, reason, message)] = api.events
    assert (name, reason) == ("huge", REFUSED_REASON)
    assert message.startswith("Tessera cannot record allocation phase allocated on this pod (422 Refused")
    # The agent's tidying asks again every 5 s: the same pod is not queued again.
    assert not writer.submit(pod("huge"))
    assert writer.pending() == 0
