"""The served containers (deviceplugin/served.py): what is taken while Allocate decides, how a
fallback waits for the reservations to end, and records read again by a restarted agent."""

from __future__ import annotations

import threading
import time
from pathlib import Path

from tests.deviceplugin.fakes import in_flight_pod, make_agent


def test_a_reserved_container_is_taken_and_a_fallback_waits_for_its_release(tmp_path: Path) -> None:
    agent, _ = make_agent(tmp_path, [])
    served = agent.served
    served.reserve({("uid-p", "main")})
    assert served.taken() == {("uid-p", "main")} and served.served() == set()
    waited: list[bool] = []

    def fallback() -> None:
        with served.lock:
            served.wait_for_reservations()
            waited.append(served.fallback_waiting())

    thread = threading.Thread(target=fallback)
    thread.start()
    deadline = time.monotonic() + 30
    while not served.fallback_waiting() and time.monotonic() < deadline:
        time.sleep(0.01)
    assert served.fallback_waiting() and not waited  # no new reservations meanwhile
    served.release({("uid-p", "main")})
    thread.join(30)
    assert waited == [False] and served.taken() == set()


def test_a_restarted_agent_reads_the_records_but_not_what_awaited_confirmation(tmp_path: Path) -> None:
    pod = in_flight_pod("p", {"main": [("GPU-1", 1024, 30)]})
    agent, _ = make_agent(tmp_path, [pod])
    agent.allocator.allocate([["GPU-1::0"]])
    assert [p.uid for _, p, _ in agent.served.unconfirmed()] == ["uid-p"]
    restarted, _ = make_agent(tmp_path, [pod])
    assert restarted.served.served() == {("uid-p", "main")}
    assert [r.pod for r in restarted.served.records().values()] == ["p"]
    assert restarted.served.unconfirmed() == []  # the clean-up asks for the phase instead
