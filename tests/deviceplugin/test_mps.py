"""MPS mode on the device plugin's side: the node's mode from its label, the client policy by
class, and what Allocate answers and writes on an MPS node against a time-sliced one."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from deviceplugin.config import parse_config
from deviceplugin.main import NodeAgent
from deviceplugin.mps_control import mps_clients, warn_mps_clients
from deviceplugin.sharing import MpsPolicy, NodeModeError, node_sharing_mode
from hook.limits import MpsClient
from nodeagent.records import ServedRecord, load_record
from nodeagent.statedir import StateDir
from tessera.contract import (
    CONTAINER_MPS_PIPE_DIR,
    CONTAINER_MPS_SHM_DIR,
    KEYS,
    ContractError,
    QosClass,
    SharingMode,
)
from tests.deviceplugin.fakes import MemoryKube, in_flight_pod, make_agent


def test_the_policy_by_class() -> None:
    policy = MpsPolicy(best_effort_threads=40)
    assert policy.client(QosClass.LATENCY_CRITICAL) == MpsClient(CONTAINER_MPS_PIPE_DIR, 100, 0)
    assert policy.client(QosClass.STANDARD) == MpsClient(CONTAINER_MPS_PIPE_DIR, 100, 0)
    assert policy.client(QosClass.BEST_EFFORT) == MpsClient(CONTAINER_MPS_PIPE_DIR, 40, 1)
    assert MpsPolicy().client(QosClass.BEST_EFFORT).threads == 50
    for bad in (0, 101):
        with pytest.raises(ContractError, match=f"MPS best-effort threads {bad} is outside 1..100"):
            MpsPolicy(best_effort_threads=bad)


def test_the_node_label_decides_the_mode_else_the_flag() -> None:
    label = KEYS.node_sharing
    assert label == "tessera.io/sharing"
    assert node_sharing_mode({}, KEYS, "n1", SharingMode.TIMESLICE) == SharingMode.TIMESLICE
    assert node_sharing_mode({}, KEYS, "n1", SharingMode.MPS) == SharingMode.MPS
    assert node_sharing_mode({label: "mps"}, KEYS, "n1", SharingMode.TIMESLICE) == SharingMode.MPS
    assert node_sharing_mode({label: "timeslice"}, KEYS, "n1", SharingMode.MPS) == SharingMode.TIMESLICE
    with pytest.raises(NodeModeError) as raised:
        node_sharing_mode({label: "MPS "}, KEYS, "n1", SharingMode.TIMESLICE)
    assert str(raised.value) == "node n1: label tessera.io/sharing: 'MPS ' is not timeslice or mps"


def test_flags() -> None:
    config = parse_config(["--node-name=n"], environ={})
    assert (config.sharing, config.mps_best_effort_threads, config.mps_control) == (
        SharingMode.TIMESLICE,
        50,
        "nvidia-cuda-mps-control",
    )
    env = {"TESSERA_SHARING": "mps", "TESSERA_MPS_BEST_EFFORT_THREADS": "30", "TESSERA_MPS_CONTROL": "/x/ctl"}
    config = parse_config(["--node-name=n"], environ=env)
    assert (config.sharing, config.mps_best_effort_threads, config.mps_control) == (
        SharingMode.MPS,
        30,
        "/x/ctl",
    )
    config = parse_config(
        ["--node-name=n", "--sharing=timeslice", "--mps-best-effort-threads=100"], environ=env
    )
    assert (config.sharing, config.mps_best_effort_threads) == (SharingMode.TIMESLICE, 100)


@pytest.mark.parametrize(
    ("flag", "message"),
    [
        ("--sharing=spatial", "argument --sharing: sharing mode: 'spatial' is not timeslice or mps"),
        ("--mps-best-effort-threads=0", "argument --mps-best-effort-threads: '0' must be at least 1"),
        ("--mps-best-effort-threads=101", "argument --mps-best-effort-threads: '101' is outside 1..100"),
    ],
)
def test_bad_flags_name_the_flag(flag: str, message: str, capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit):
        parse_config(["--node-name=n", flag], environ={})
    assert message in capsys.readouterr().err


def agent_on(tmp_path: Path, sharing: SharingMode, pods: list[Any]) -> tuple[NodeAgent, MemoryKube]:
    return make_agent(tmp_path, pods, flags=["--mps-best-effort-threads=40"], sharing=sharing)


PODS = [
    in_flight_pod("lc", {"main": [("GPU-1", 1024, 30)]}, qos=QosClass.LATENCY_CRITICAL),
    in_flight_pod("std", {"main": [("GPU-1", 1024, 30)]}, bind=1),
    in_flight_pod("be", {"main": [("GPU-1", 1024, 0), ("GPU-2", 1024, 0)]}, bind=2, qos=QosClass.BEST_EFFORT),
]


def limits_of(tmp_path: Path, pod: str) -> str:
    return (tmp_path / "containers" / f"uid-{pod}" / "main" / "limits.d" / "limits").read_text()


def test_allocate_on_an_mps_node_mounts_the_daemon_and_writes_each_class_its_mps_line(tmp_path: Path) -> None:
    agent, _ = agent_on(tmp_path, SharingMode.MPS, PODS)
    answers = [
        agent.allocator.allocate([["GPU-1::0"]]),
        agent.allocator.allocate([["GPU-1::1"]]),
        agent.allocator.allocate([["GPU-1::2", "GPU-2::0"]]),
    ]
    mps = tmp_path / "mps"
    for (answer,) in answers:
        mounts = {(m.container_path, m.host_path, m.read_only) for m in answer.mounts}
        assert (CONTAINER_MPS_PIPE_DIR, str(mps / "pipe"), False) in mounts
        assert (CONTAINER_MPS_SHM_DIR, str(mps / "shm"), False) in mounts
        assert answer.record.mps
    assert limits_of(tmp_path, "lc").startswith("# Tessera limits")
    assert "version 4\n" in limits_of(tmp_path, "lc")
    assert limits_of(tmp_path, "lc").endswith(f"mps {CONTAINER_MPS_PIPE_DIR} threads 100 priority 0\n")
    assert limits_of(tmp_path, "std").endswith(f"mps {CONTAINER_MPS_PIPE_DIR} threads 100 priority 0\n")
    assert limits_of(tmp_path, "be").endswith(f"mps {CONTAINER_MPS_PIPE_DIR} threads 40 priority 1\n")
    record = json.loads((tmp_path / "containers" / "uid-be" / "main" / "allocation.json").read_text())
    assert record["mps"] is True


def test_allocate_on_a_time_sliced_node_is_as_before(tmp_path: Path) -> None:
    agent, _ = agent_on(tmp_path, SharingMode.TIMESLICE, PODS)
    (answer,) = agent.allocator.allocate([["GPU-1::0"]])
    paths = {m.container_path for m in answer.mounts}
    assert CONTAINER_MPS_PIPE_DIR not in paths and CONTAINER_MPS_SHM_DIR not in paths
    text = limits_of(tmp_path, "lc")
    assert "version 2\n" in text and "mps " not in text
    assert not load_record(tmp_path / "containers" / "uid-lc" / "main" / "allocation.json", ServedRecord).mps


def test_the_mps_line_stays_on_every_rewrite_and_after_a_restart(tmp_path: Path) -> None:
    agent, _ = agent_on(tmp_path, SharingMode.MPS, PODS)
    agent.allocator.allocate([["GPU-1::2", "GPU-2::0"]])
    limits = tmp_path / "containers" / "uid-be" / "main" / "limits.d" / "limits"
    line = f"mps {CONTAINER_MPS_PIPE_DIR} threads 40 priority 1\n"
    # A live resize rewrites the file: the mps line stays.
    resized = in_flight_pod(
        "be", {"main": [("GPU-1", 2048, 0), ("GPU-2", 2048, 0)]}, bind=2, qos=QosClass.BEST_EFFORT
    )
    assert agent.resizes.resize([resized]) == 1
    text = limits.read_text()
    assert f"device GPU-1 memory {2048 * 2**20} cores 0\n" in text and text.endswith(line)
    # A restarted agent rewrites every container's limits at its first check: the record keeps the
    # container an MPS client, even when the node's label has since been removed.
    before = limits.stat().st_ino
    restarted, _ = agent_on(tmp_path, SharingMode.TIMESLICE, [resized])
    restarted.usage.check()
    assert limits.stat().st_ino != before
    assert limits.read_text().endswith(line)


def test_a_restarted_daemon_is_said_on_each_pod_served_under_mps(tmp_path: Path) -> None:
    """tessera-mps-control finds the pods to tell in the served records the agent wrote."""
    agent, kube = agent_on(tmp_path, SharingMode.MPS, PODS)
    agent.allocator.allocate([["GPU-1::0"]])
    agent.allocator.allocate([["GPU-1::2", "GPU-2::0"]])
    state = StateDir(tmp_path)
    assert [p.name for p in mps_clients(state)] == ["be", "lc"]
    assert warn_mps_clients(kube.warn, state, "the daemon was started again") == 2
    assert sorted(kube.events) == [
        ("be", "the daemon was started again"),
        ("lc", "the daemon was started again"),
    ]
    # A time-sliced container's pod is not told.
    sliced, sliced_kube = agent_on(tmp_path / "sliced", SharingMode.TIMESLICE, PODS)
    sliced.allocator.allocate([["GPU-1::0"]])
    assert warn_mps_clients(sliced_kube.warn, StateDir(tmp_path / "sliced"), "restarted") == 0
