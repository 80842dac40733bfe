"""The container resizer (deviceplugin/resize.py): a live resize on the pod rewrites the served
containers' limits files, once, also after a restart of the agent."""

from __future__ import annotations

from pathlib import Path

from nodeagent.records import ServedRecord, load_record
from tests.deviceplugin.fakes import (
    in_flight_pod,
    make_agent,
)


def test_a_resized_allocation_rewrites_the_served_containers_limits_by_a_rename(tmp_path: Path) -> None:
    pod = in_flight_pod(
        "p", {"main": [("GPU-1", 1024, 30), ("GPU-2", 1024, 30)], "side": [("GPU-3", 512, 0)]}
    )
    agent, kube = make_agent(tmp_path, [pod])
    agent.allocator.allocate([["GPU-1::0", "GPU-2::0"]])
    agent.allocator.allocate([["GPU-3::0"]])
    where = tmp_path / "containers" / "uid-p" / "main"
    limits = where / "limits.d" / "limits"
    before = limits.stat().st_ino
    assert agent.resizes.resize([pod]) == 0  # the allocation as served
    resized = in_flight_pod(
        "p", {"main": [("GPU-1", 2048, 60), ("GPU-2", 2048, 60)], "side": [("GPU-3", 512, 0)]}
    )
    assert agent.resizes.resize([resized]) == 1
    text = limits.read_text()
    assert f"device GPU-1 memory {2048 * 2**20} cores 60\n" in text
    assert f"device GPU-2 memory {2048 * 2**20} cores 60\n" in text
    assert limits.stat().st_ino != before  # a new file renamed over the old one
    assert limits.stat().st_mode & 0o777 == 0o444
    record = load_record(where / "allocation.json", ServedRecord)
    assert [(g.memory_quota_mib, g.cores) for g in record.gpus] == [(2048, 60), (2048, 60)]
    assert (
        f"memory {512 * 2**20} cores 0"
        in (tmp_path / "containers" / "uid-p" / "side" / "limits.d" / "limits").read_text()
    )
    assert agent.resizes.resize([resized]) == 0  # followed once
    # An allocation naming other GPUs is no resize: the container keeps what it was served.
    moved = in_flight_pod(
        "p", {"main": [("GPU-0", 4096, 60), ("GPU-2", 4096, 60)], "side": [("GPU-3", 512, 0)]}
    )
    assert agent.resizes.resize([moved]) == 0
    assert limits.read_text() == text
    assert kube.events == []


def test_a_restarted_agent_follows_a_resize_made_while_it_was_down(tmp_path: Path) -> None:
    pod = in_flight_pod("p", {"main": [("GPU-1", 1024, 30)]})
    agent, _ = make_agent(tmp_path, [pod])
    agent.allocator.allocate([["GPU-1::0"]])
    resized = in_flight_pod("p", {"main": [("GPU-1", 512, 30)]})
    restarted, _ = make_agent(tmp_path, [resized])
    restarted.admissions.tidy()
    limits = tmp_path / "containers" / "uid-p" / "main" / "limits.d" / "limits"
    assert f"device GPU-1 memory {512 * 2**20} cores 30\n" in limits.read_text()
