"""The allocator (deviceplugin/allocation.py) with the Kubernetes API replaced by an in-memory
stand-in: concurrent calls never serve one container twice, files are written, refusals are told."""

from __future__ import annotations

import dataclasses
import threading
import time
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any

import pytest

from deviceplugin.kube import FreshReads, KubeUnavailableError, NodePod
from deviceplugin.matching import AllocationError, PodView
from tessera.contract import (
    CONTAINER_COORDINATION_DIR,
    CONTAINER_DEVICE_LIST_DIR,
    CONTAINER_HOOK_LIBRARY,
    CONTAINER_LD_SO_PRELOAD,
    CONTAINER_LIMITS_DIR,
    CONTAINER_STATE_DIR,
    COORDINATION_SLOT_BYTES,
    KEYS,
    Phase,
    QosClass,
    format_time,
)
from tests.deviceplugin.fakes import (
    LaggingCache,
    in_flight_pod,
    make_agent,
    write_phases,
)


def test_allocate_answers_and_writes_the_containers_files(tmp_path: Path) -> None:
    agent, kube = make_agent(tmp_path, [in_flight_pod("p", {"main": [("GPU-2", 4096, 30)]})])
    (answer,) = agent.allocator.allocate([["GPU-2::5"]])
    assert answer.envs == {"NVIDIA_VISIBLE_DEVICES": "GPU-2"}
    where = tmp_path / "containers" / "uid-p" / "main"
    area = tmp_path / "coordination" / "GPU-2"
    assert {(m.container_path, m.host_path, m.read_only) for m in answer.mounts} == {
        (CONTAINER_LIMITS_DIR, str(where / "limits.d"), True),
        (CONTAINER_STATE_DIR, str(where / "state"), False),
        (CONTAINER_HOOK_LIBRARY, "/opt/libvgpu.so", True),
        (CONTAINER_LD_SO_PRELOAD, str(tmp_path / "ld.so.preload"), True),
        (f"{CONTAINER_COORDINATION_DIR}/GPU-2", str(area), True),
        (f"{CONTAINER_COORDINATION_DIR}/GPU-2.slot", str(area / "standard" / "uid-p_main"), False),
    }
    limits = (where / "limits.d" / "limits").read_text()
    assert f"device GPU-2 memory {4096 * 2**20} cores 30" in limits
    assert f"qos standard\ncoordination {CONTAINER_COORDINATION_DIR}\n" in limits
    assert (where / "limits.d" / "limits").stat().st_mode & 0o777 == 0o444
    assert (tmp_path / "ld.so.preload").read_text() == f"{CONTAINER_HOOK_LIBRARY}\n"
    assert kube.phases == {}  # written after the answer
    write_phases(agent)
    assert kube.phases == {"uid-p": Phase.ALLOCATED}
    # Served: the same call again finds no container (a restart of the agent reads the same records).
    with pytest.raises(AllocationError):
        agent.allocator.allocate([["GPU-2::5"]])


def test_volume_mounts_name_the_gpus_where_the_toolkit_ignores_the_variable(tmp_path: Path) -> None:
    """--device-list-strategy volume-mounts: the toolkit, set to ignore NVIDIA_VISIBLE_DEVICES from
    unprivileged containers (docs/install.md), takes the GPUs from mounts only Allocate can make."""
    pod = in_flight_pod("p", {"main": [("GPU-1", 1024, 10), ("GPU-3", 1024, 10)]})
    agent, _ = make_agent(tmp_path, [pod], flags=["--device-list-strategy=volume-mounts"])
    (answer,) = agent.allocator.allocate([["GPU-1::0", "GPU-3::0"]])
    assert answer.envs == {"NVIDIA_VISIBLE_DEVICES": CONTAINER_DEVICE_LIST_DIR}
    devices = {
        (m.container_path, m.host_path, m.read_only) for m in answer.mounts if m.host_path == "/dev/null"
    }
    assert devices == {
        (f"{CONTAINER_DEVICE_LIST_DIR}/GPU-1", "/dev/null", True),
        (f"{CONTAINER_DEVICE_LIST_DIR}/GPU-3", "/dev/null", True),
    }


def test_each_container_gets_a_slot_of_its_class_in_each_gpus_coordination_area(tmp_path: Path) -> None:
    pod = in_flight_pod(
        "p", {"main": [("GPU-1", 1024, 10), ("GPU-3", 1024, 10)]}, qos=QosClass.LATENCY_CRITICAL
    )
    agent, kube = make_agent(tmp_path, [pod])
    (answer,) = agent.allocator.allocate([["GPU-1::0", "GPU-3::0"]])
    slots = [
        tmp_path / "coordination" / gpu / "latency-critical" / "uid-p_main" for gpu in ("GPU-1", "GPU-3")
    ]
    writable = {m.container_path: m.host_path for m in answer.mounts if not m.read_only}
    assert [writable[f"{CONTAINER_COORDINATION_DIR}/{gpu}.slot"] for gpu in ("GPU-1", "GPU-3")] == [
        str(slot) for slot in slots
    ]
    for (
        slot
    ) in slots:  # idle until the container's hook writes it; writable by its user only through its mount
        assert slot.read_bytes() == bytes(COORDINATION_SLOT_BYTES)
        assert slot.stat().st_mode & 0o777 == 0o666
        assert slot.parent.parent.stat().st_mode & 0o777 == 0o755
    assert (
        "qos latency-critical\n"
        in (tmp_path / "containers" / "uid-p" / "main" / "limits.d" / "limits").read_text()
    )
    # The pod gone, its slots go with its state.
    kube.pods = []
    agent.admissions.tidy()
    assert not any(slot.exists() for slot in slots)


def test_concurrent_allocates_of_equal_keys_serve_each_container_once(tmp_path: Path) -> None:
    pods = [in_flight_pod(f"r{i}", {"main": [("GPU-1", 2048, 20)]}, bind=i) for i in range(12)]
    pods += [
        in_flight_pod(f"d{i}", {"a": [("GPU-0", 1024, 10), ("GPU-3", 1024, 10)]}, bind=i) for i in range(8)
    ]
    agent, kube = make_agent(tmp_path, pods)
    served: list[tuple[str, str]] = []
    errors: list[BaseException] = []
    lock = threading.Lock()

    def call(ids: list[str]) -> None:
        try:
            (answer,) = agent.allocator.allocate([ids])
        except BaseException as e:
            errors.append(e)
            return
        with lock:
            served.append((answer.record.pod, answer.record.container))

    threads = [threading.Thread(target=call, args=([f"GPU-1::{i}"],)) for i in range(12)]
    threads += [threading.Thread(target=call, args=([f"GPU-3::{i}", f"GPU-0::{i}"],)) for i in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors
    assert sorted(served) == sorted(
        [(f"r{i}", "main") for i in range(12)] + [(f"d{i}", "a") for i in range(8)]
    )
    write_phases(agent)
    assert set(kube.phases.values()) == {Phase.ALLOCATED} and len(kube.phases) == 20


def test_concurrent_allocates_from_a_lagging_cache_serve_each_container_once(tmp_path: Path) -> None:
    """From the pod cache, each match reserved while its pod is confirmed: 20 concurrent calls of
    one key serve 20 containers, each once, although the cache never sees a phase written."""
    bound = datetime.now(UTC) - timedelta(seconds=30)
    pods = [
        dataclasses.replace(
            pod, annotations={**pod.annotations, KEYS.bind_time: format_time(bound + timedelta(seconds=i))}
        )
        for i, pod in enumerate(in_flight_pod(f"r{i}", {"main": [("GPU-1", 2048, 20)]}) for i in range(20))
    ]  # fresh: bound within the in-flight timeout
    agent, kube = make_agent(tmp_path, pods, cache=LaggingCache(pods))
    served: list[str] = []
    errors: list[BaseException] = []
    lock = threading.Lock()

    def call(i: int) -> None:
        try:
            (answer,) = agent.allocator.allocate([[f"GPU-1::{i}"]])
        except BaseException as e:
            errors.append(e)
            return
        with lock:
            served.append(answer.record.pod)

    threads = [threading.Thread(target=call, args=(i,)) for i in range(20)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors
    assert sorted(served) == sorted(f"r{i}" for i in range(20))
    assert agent.allocator.cache_answers == 20 and agent.allocator.api_answers == 0 and kube.reads == 20
    write_phases(agent)
    assert len(kube.phases) == 20
    # All served: the cache still offers them, the records do not.
    with pytest.raises(AllocationError):
        agent.allocator.allocate([["GPU-1::0"]])
    assert agent.allocator.api_reasons["no match in the cache"] == 1


def test_multi_container_pod_is_allocated_after_its_last_container(tmp_path: Path) -> None:
    agent, kube = make_agent(
        tmp_path, [in_flight_pod("p", {"x": [("GPU-0", 1024, 10)], "y": [("GPU-1", 2048, 50)]})]
    )
    agent.allocator.allocate([["GPU-0::0"]])
    write_phases(agent)
    assert kube.phases == {}
    (answer,) = agent.allocator.allocate([["GPU-1::3"]])
    assert answer.record.container == "y" and answer.record.gpus[0].memory_quota_mib == 2048
    write_phases(agent)
    assert kube.phases == {"uid-p": Phase.ALLOCATED}


def test_refusal_fails_the_pod_with_an_event(tmp_path: Path) -> None:
    broken = in_flight_pod("bad", {"main": [("GPU-9", 1024, 10)]})
    agent, kube = make_agent(tmp_path, [broken])
    with pytest.raises(AllocationError, match=r"GPU GPU-9 is not on this node"):
        agent.allocator.allocate([["GPU-0::0"]])
    assert kube.phases == {"uid-bad": Phase.FAILED}
    assert kube.events and "GPU GPU-9 is not on this node 'n1'" in kube.events[0][1]


def test_an_unmatched_call_fails_no_in_flight_pod_and_each_is_served_its_own_quotas(tmp_path: Path) -> None:
    """A call no in-flight container matches (here the kubelet asking again for a container it was
    answered for, as after its restart) is refused, and the pods in flight keep their phase: marked
    failed, one would leave the in-flight rule, the extender could bind another key on its GPU, and
    its own admission would later get that pod's quotas (seen in the chaos test)."""
    agent, kube = make_agent(
        tmp_path,
        [
            in_flight_pod("p", {"main": [("GPU-0", 1024, 10)]}),
            in_flight_pod("q", {"main": [("GPU-1", 2048, 20)]}),
        ],
    )
    agent.allocator.allocate([["GPU-0::0"]])
    with pytest.raises(
        AllocationError, match=r"pod ns/q: container 'main' was allocated GPU\(s\) \['GPU-1'\]"
    ):
        agent.allocator.allocate([["GPU-0::1"]])
    assert kube.phases == {} and kube.events == []
    (answer,) = agent.allocator.allocate([["GPU-1::0"]])
    assert (answer.record.pod, answer.record.gpus[0].memory_quota_mib, answer.record.gpus[0].cores) == (
        "q",
        2048,
        20,
    )


def test_without_the_api_preferred_spreads_and_allocate_says_why(tmp_path: Path) -> None:
    agent, kube = make_agent(tmp_path, [in_flight_pod("p", {"main": [("GPU-2", 1024, 10)]})])

    def down() -> list[PodView]:
        raise KubeUnavailableError("cannot list the pods on node n1: connection refused")

    kube.pending_pods = down  # type: ignore[method-assign]
    assert agent.allocator.preferred(["GPU-0::0", "GPU-0::1", "GPU-3::0"], [], 2) == ["GPU-0::0", "GPU-3::0"]
    with pytest.raises(KubeUnavailableError, match="connection refused"):
        agent.allocator.allocate([["GPU-2::0"]])


def test_fresh_reads_start_after_the_call_and_are_shared() -> None:
    """Callers that ask while a read is under way get the next read (which started after they
    asked), one read for all of them: a get for one pod, one list of the node's pods for several."""
    started: list[str] = []
    release = [threading.Event(), threading.Event()]
    pods = {name: in_flight_pod(name, {"main": [("GPU-0", 1024, 10)]}) for name in ("p", "q", "r")}

    class SlowKube:
        def _wait(self, what: str) -> int:
            number = len(started)
            started.append(what)
            release[number].wait(30)
            return number

        def read_pod(self, namespace: str, name: str) -> NodePod:
            number = self._wait(f"get {name}")
            return NodePod(dataclasses.replace(pods[name], uid=f"read-{number}"), pending=True)

        def node_pods(self) -> list[NodePod]:
            number = self._wait("list")
            return [
                NodePod(dataclasses.replace(p, uid=f"read-{number}"), pending=True) for p in pods.values()
            ]

    kube_any: Any = SlowKube()
    reads = FreshReads(kube_any)
    got: dict[str, str] = {}

    def call(who: str, name: str) -> None:
        result = reads.read_pod("ns", name)
        got[who] = result.view.uid if result else ""

    first = threading.Thread(target=call, args=("first", "p"))
    first.start()
    while not started:
        time.sleep(0.01)
    later = [threading.Thread(target=call, args=(f"later-{i}-{n}", n)) for i, n in enumerate("pqrp")]
    for t in later:
        t.start()
    while reads.waiting() < 5:  # all four wait while the first read is under way
        time.sleep(0.01)
    release[0].set()
    first.join(30)
    while len(started) < 2:
        time.sleep(0.01)
    release[1].set()
    for t in later:
        t.join(30)
    assert got == {"first": "read-0", **{f"later-{i}-{n}": "read-1" for i, n in enumerate("pqrp")}}
    assert started == ["get p", "list"]
    assert (reads.reads, reads.lists, reads.waiting()) == (1, 1, 0)
