"""The agent's Allocate with the Kubernetes API replaced by an in-memory stand-in (unit level):
concurrent calls never serve one container twice, files are written, phases follow."""

from __future__ import annotations

import dataclasses
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any

import pytest

from deviceplugin.agent import Agent
from deviceplugin.config import parse_config
from deviceplugin.identity import ContainerRef as IdentityRef
from deviceplugin.kube import FreshReads, KubeUnavailableError, NodePod
from deviceplugin.matching import AllocationError, PodView
from deviceplugin.podresources import Owners, PodResourcesError
from nodeagent.records import ServedRecord, load_record
from nodeagent.statedir import StateDir
from tessera.contract import (
    CONTAINER_COORDINATION_DIR,
    CONTAINER_DEVICE_LIST_DIR,
    CONTAINER_HOOK_LIBRARY,
    CONTAINER_LD_SO_PRELOAD,
    CONTAINER_LIMITS_DIR,
    CONTAINER_STATE_DIR,
    COORDINATION_SLOT_BYTES,
    KEYS,
    MIB,
    Allocation,
    ContainerAllocation,
    ContainerRequest,
    GpuGrant,
    GpuInfo,
    Phase,
    QosClass,
    dump_allocation,
    format_time,
    parse_allocation,
    parse_gpu_usage,
)
from tessera.inflight import inflight_conflict

NODE = "n1"
GPUS = tuple(
    GpuInfo(
        uuid=f"GPU-{i}",
        index=i,
        model="Fake",
        memory_mib=16384,
        sm_count=80,
        compute_capability="8.0",
        split=10,
    )
    for i in range(4)
)


class MemoryKube:
    """Pods and a node held in memory; records what the agent patched."""

    def __init__(self, pods: list[PodView]) -> None:
        self.pods = pods
        self.phases: dict[str, Phase] = {}
        self.events: list[tuple[str, str]] = []
        self.node: dict[str, str] = {}
        self.reads = 0

    def pending_pods(self) -> list[PodView]:
        return [p for p in self.pods if p.uid not in self.phases]

    def node_pods(self) -> list[NodePod]:
        return [NodePod(p, pending=True) for p in self.pods]

    def read_pod(self, namespace: str, name: str) -> NodePod | None:
        self.reads += 1
        found = [p for p in self.pods if (p.namespace, p.name) == (namespace, name)]
        return NodePod(found[0], pending=True) if found else None

    def set_phase(self, pod: PodView, phase: Phase) -> None:
        self.phases[pod.uid] = phase

    def warn(self, pod: PodView, reason: str, message: str) -> None:
        self.events.append((pod.name, message))

    def node_annotations(self) -> dict[str, str]:
        return dict(self.node)

    def annotate_node(self, annotations: Mapping[str, str]) -> None:
        self.node.update(annotations)


class LaggingCache:
    """A pod cache that never sees a phase change or a deletion: every pod as first bound."""

    def __init__(self, pods: list[PodView]) -> None:
        self.pods = list(pods)

    def pending_pods(self) -> list[PodView]:
        return list(self.pods)

    def node_pods(self) -> list[PodView]:
        return list(self.pods)


def in_flight_pod(
    name: str,
    grants: dict[str, list[tuple[str, int, int]]],
    bind: int = 0,
    qos: QosClass = QosClass.STANDARD,
) -> PodView:
    allocation = Allocation(
        node=NODE,
        containers=tuple(
            ContainerAllocation(name=c, gpus=tuple(GpuGrant(uuid=u, memory_mib=m, cores=k) for u, m, k in g))
            for c, g in grants.items()
        ),
        qos=qos,
    )
    t0 = datetime(2026, 1, 1, tzinfo=UTC)
    return PodView(
        namespace="ns",
        name=name,
        uid=f"uid-{name}",
        created=t0,
        annotations={
            KEYS.allocation: dump_allocation(allocation),
            KEYS.allocation_phase: Phase.ALLOCATING.value,
            KEYS.bind_time: format_time(t0 + timedelta(seconds=bind)),
        },
        gpu_containers=tuple(ContainerRequest(c, len(g), None, None) for c, g in grants.items()),
    )


def make_agent(
    tmp_path: Path,
    pods: list[PodView],
    cache: bool = False,
    pod_resources: Callable[[], Owners | None] = lambda: None,
    flags: Sequence[str] = (),
) -> tuple[Agent, MemoryKube]:
    """The agent on ``pods``; ``pod_resources`` stands in for the kubelet's pod-resources API (by
    default a kubelet without it: the pods matched are taken as admitted); ``flags``: more of its
    command line."""
    config = parse_config(
        [f"--node-name={NODE}", f"--state-dir={tmp_path}", "--hook-library=/opt/libvgpu.so", *flags],
        environ={},
    )
    state = StateDir(config.state_dir)
    state.prepare()
    kube = MemoryKube(pods)
    kube_any: Any = kube
    cache_any: Any = LaggingCache(pods) if cache else None
    return Agent(config, GPUS, kube_any, state, cache=cache_any, pod_resources=pod_resources), kube


def served_on_disk(agent: Agent) -> set[tuple[str, str]]:
    """(pod UID, container) of every container whose record is in the state dir."""
    return {(r.pod_uid, r.container) for _, r in agent.state.records()}


def write_phases(agent: Agent) -> None:
    """What the agent's loops do after Allocate: ask which pods were admitted, write their phases."""
    agent.confirm_admissions()
    agent.phases.drain()


def test_allocate_answers_and_writes_the_containers_files(tmp_path: Path) -> None:
    agent, kube = make_agent(tmp_path, [in_flight_pod("p", {"main": [("GPU-2", 4096, 30)]})])
    (answer,) = agent.allocate([["GPU-2::5"]])
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
        agent.allocate([["GPU-2::5"]])


def test_volume_mounts_name_the_gpus_where_the_toolkit_ignores_the_variable(tmp_path: Path) -> None:
    """--device-list-strategy volume-mounts: the toolkit, set to ignore NVIDIA_VISIBLE_DEVICES from
    unprivileged containers (docs/install.md), takes the GPUs from mounts only Allocate can make."""
    pod = in_flight_pod("p", {"main": [("GPU-1", 1024, 10), ("GPU-3", 1024, 10)]})
    agent, _ = make_agent(tmp_path, [pod], flags=["--device-list-strategy=volume-mounts"])
    (answer,) = agent.allocate([["GPU-1::0", "GPU-3::0"]])
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
    (answer,) = agent.allocate([["GPU-1::0", "GPU-3::0"]])
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
    agent.tidy_state()
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
            (answer,) = agent.allocate([ids])
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
    agent, kube = make_agent(tmp_path, pods, cache=True)
    served: list[str] = []
    errors: list[BaseException] = []
    lock = threading.Lock()

    def call(i: int) -> None:
        try:
            (answer,) = agent.allocate([[f"GPU-1::{i}"]])
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
    assert agent.cache_answers == 20 and agent.api_answers == 0 and kube.reads == 20
    write_phases(agent)
    assert len(kube.phases) == 20
    # All served: the cache still offers them, the records do not.
    with pytest.raises(AllocationError):
        agent.allocate([["GPU-1::0"]])
    assert agent.api_reasons["no match in the cache"] == 1


def test_multi_container_pod_is_allocated_after_its_last_container(tmp_path: Path) -> None:
    agent, kube = make_agent(
        tmp_path, [in_flight_pod("p", {"x": [("GPU-0", 1024, 10)], "y": [("GPU-1", 2048, 50)]})]
    )
    agent.allocate([["GPU-0::0"]])
    write_phases(agent)
    assert kube.phases == {}
    (answer,) = agent.allocate([["GPU-1::3"]])
    assert answer.record.container == "y" and answer.record.gpus[0].memory_mib == 2048
    write_phases(agent)
    assert kube.phases == {"uid-p": Phase.ALLOCATED}


def test_refusal_fails_the_pod_with_an_event(tmp_path: Path) -> None:
    broken = in_flight_pod("bad", {"main": [("GPU-9", 1024, 10)]})
    agent, kube = make_agent(tmp_path, [broken])
    with pytest.raises(AllocationError, match=r"GPU GPU-9 is not on this node"):
        agent.allocate([["GPU-0::0"]])
    assert kube.phases == {"uid-bad": Phase.FAILED}
    assert kube.events and "GPU GPU-9 is not on this node 'n1'" in kube.events[0][1]


def test_inventory_is_patched_only_when_it_changes(tmp_path: Path) -> None:
    agent, kube = make_agent(tmp_path, [])
    assert agent.publish(heartbeat=False)
    first = dict(kube.node)
    assert KEYS.node_gpus in first and KEYS.node_heartbeat in first
    assert not agent.publish(heartbeat=False)
    agent.record_xid("GPU-1", 79)
    assert agent.publish(heartbeat=False)
    assert '"health":"Unhealthy"' in kube.node[KEYS.node_gpus]
    assert agent.publish(heartbeat=True)


def test_measured_use_is_published_with_the_inventory_and_limits_follow_borrowing(tmp_path: Path) -> None:
    # A best-effort pod whose grant borrows GPU-0's memory beside a standard one.
    borrowing = Allocation(
        node=NODE,
        containers=(
            ContainerAllocation(
                name="main", gpus=(GpuGrant(uuid="GPU-0", memory_mib=16384, cores=0, oversubscribed=True),)
            ),
        ),
        qos=QosClass.BEST_EFFORT,
    )
    be = in_flight_pod("be", {"main": [("GPU-0", 16384, 0)]}, bind=1, qos=QosClass.BEST_EFFORT)
    be = dataclasses.replace(be, annotations={**be.annotations, KEYS.allocation: dump_allocation(borrowing)})
    pods = [in_flight_pod("std", {"main": [("GPU-0", 4096, 10)]}, bind=0), be]
    agent, kube = make_agent(tmp_path, pods)
    agent.allocate([["GPU-0::0"]])
    agent.allocate([["GPU-0::1"]])
    agent.check_usage()
    assert agent.oversubscribed_gpus() == {"GPU-0"}
    limits = {
        p.parent.parent.parent.name: p.read_text()
        for p in (tmp_path / "containers").glob("*/*/limits.d/limits")
    }
    # Nothing used yet: the borrower may take the GPU less the margin; the standard one waits if short.
    assert f"device GPU-0 memory {(16384 - 512) * MIB} cores 0" in limits["uid-be"]
    assert "oversubscribed GPU-0 wait 30000" in limits["uid-std"] and "version 3" in limits["uid-std"]
    assert "oversubscribed" not in limits["uid-be"]
    assert agent.publish(heartbeat=False)
    usage = parse_gpu_usage(kube.node[KEYS.node_gpu_usage])
    assert [(g.uuid, g.memory_used_mib) for g in usage.gpus] == [(g.uuid, 0) for g in GPUS]
    assert not agent.publish(heartbeat=False)  # nothing changed


def test_state_of_containers_whose_pods_are_gone_is_removed(tmp_path: Path) -> None:
    pods = [in_flight_pod(name, {"main": [("GPU-0", 1024, 10)]}, bind=i) for i, name in enumerate("abc")]
    agent, kube = make_agent(tmp_path, pods)
    for i, _ in enumerate(pods):
        agent.allocate([[f"GPU-0::{i}"]])
    containers = tmp_path / "containers"
    assert sorted(p.name for p in containers.iterdir()) == ["uid-a", "uid-b", "uid-c"]
    kube.pods = [p for p in pods if p.name != "b"]
    agent.tidy_state()  # no kubelet pod-resources socket here: records stay as they are
    assert sorted(p.name for p in containers.iterdir()) == ["uid-a", "uid-c"]
    assert served_on_disk(agent) == {("uid-a", "main"), ("uid-c", "main")}


def test_without_the_api_preferred_spreads_and_allocate_says_why(tmp_path: Path) -> None:
    agent, kube = make_agent(tmp_path, [in_flight_pod("p", {"main": [("GPU-2", 1024, 10)]})])

    def down() -> list[PodView]:
        raise KubeUnavailableError("cannot list the pods on node n1: connection refused")

    kube.pending_pods = down  # type: ignore[method-assign]
    assert agent.preferred(["GPU-0::0", "GPU-0::1", "GPU-3::0"], [], 2) == ["GPU-0::0", "GPU-3::0"]
    with pytest.raises(KubeUnavailableError, match="connection refused"):
        agent.allocate([["GPU-2::0"]])


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


class Kubelet:
    """The kubelet's side of admitting pods, as the agent sees it: GetPreferredAllocation among the
    free slices, Allocate of the slices it steered to, and its pod-resources API naming the
    container each device set went to (recorded as Allocate returns)."""

    def __init__(self) -> None:
        self.agent: Agent | None = None
        self.owners: Owners = {}

    def pod_resources(self) -> Owners:
        return dict(self.owners)

    def admit(self, pod: PodView) -> None:
        assert self.agent is not None
        used = {d for devices in self.owners for d in devices}
        free = [f"{g.uuid}::{i}" for g in GPUS for i in range(10) if f"{g.uuid}::{i}" not in used]
        for container in pod.gpu_containers:
            picks = self.agent.preferred(free, [], container.gpu_count)
            self.agent.allocate([picks])
            self.owners[frozenset(picks)] = IdentityRef(pod.namespace, pod.name, container.name)


def bind(kube: MemoryKube, pod: PodView) -> bool:
    """The extender's bind as far as the in-flight rule goes (tessera/inflight.py): refused while a
    pod with another key of the same GPU count is in flight (phase allocating, as the API says)."""
    inflight = {
        p.ref: parse_allocation(p.annotations[KEYS.allocation]) for p in kube.pods if p.uid not in kube.phases
    }
    if inflight_conflict(parse_allocation(pod.annotations[KEYS.allocation]), inflight) is not None:
        return False
    kube.pods.append(pod)
    return True


def test_the_allocated_phase_is_for_the_pod_the_kubelet_admitted(tmp_path: Path) -> None:
    """A burst of equal pods spilling from one GPU onto the next (the chart's failover test): the
    kubelet admits b before a, the agent's match is a (the older bind; the same answer). Only b may
    read as allocated: were it a, the extender would let the next GPU's key into flight while a
    still waits for admission, and a would be steered onto the next GPU and served a pod's
    container it does not belong to, leaving that pod with "no in-flight container asks for"."""
    a = in_flight_pod("a", {"main": [("GPU-0", 512, 2)]}, bind=0)
    b = in_flight_pod("b", {"main": [("GPU-0", 512, 2)]}, bind=1)
    c = in_flight_pod("c", {"main": [("GPU-1", 512, 2)]}, bind=2)
    kubelet = Kubelet()
    agent, kube = make_agent(tmp_path, [a, b], pod_resources=kubelet.pod_resources)
    kubelet.agent = agent

    kubelet.admit(b)
    assert served_on_disk(agent) == {("uid-a", "main")}  # the guess
    write_phases(agent)
    assert kube.phases == {"uid-b": Phase.ALLOCATED}
    assert served_on_disk(agent) == {("uid-b", "main")}  # corrected by what the kubelet says
    assert not bind(kube, c), "the extender must keep the A100's key out while a is in flight"

    kubelet.admit(a)
    write_phases(agent)
    assert kube.phases == {"uid-a": Phase.ALLOCATED, "uid-b": Phase.ALLOCATED}
    assert bind(kube, c)
    kubelet.admit(c)
    write_phases(agent)
    assert set(kube.phases) == {"uid-a", "uid-b", "uid-c"}
    held = {(r.pod, frozenset(r.device_ids), r.gpus[0].uuid) for _, r in agent.state.records()}
    assert held == {
        (o.pod, devices, next(iter(devices)).split("::")[0]) for devices, o in kubelet.owners.items()
    }


def test_slices_given_again_leave_one_record_for_their_new_container(tmp_path: Path) -> None:
    """The chaos test's case: a served container goes (its pod failed, still listed) and the kubelet
    gives the same slices to a new pod's container. The old record must not be rewritten to name the
    new container (two records for one container: its metrics and the NVML cross-check's allowance
    would count it twice), and the new one keeps its own quotas."""
    old = in_flight_pod("old", {"main": [("GPU-0", 512, 2)]}, bind=0)
    kubelet = Kubelet()
    agent, kube = make_agent(tmp_path, [old], pod_resources=kubelet.pod_resources)
    kubelet.agent = agent
    kubelet.admit(old)
    write_phases(agent)
    ((devices, _),) = kubelet.owners.items()
    del kubelet.owners[devices]  # the old container is gone; its pod is still on the node
    new = in_flight_pod("new", {"main": [("GPU-0", 1024, 4)]}, bind=1)
    kube.pods.append(new)
    agent.allocate([sorted(devices)])
    kubelet.owners[devices] = IdentityRef("ns", "new", "main")
    write_phases(agent)
    agent.tidy_state()
    records = [r for _, r in agent.state.records()]
    assert [(r.pod, r.gpus[0].memory_mib, frozenset(r.device_ids)) for r in records] == [
        ("new", 1024, devices)
    ]
    assert kube.phases["uid-new"] == Phase.ALLOCATED


def test_a_pod_is_allocated_only_once_the_kubelet_names_it(tmp_path: Path) -> None:
    """Served but not yet named by the pod-resources API: no phase, asked again; a failing API is
    asked again too, and never taken as an answer."""
    p = in_flight_pod("p", {"x": [("GPU-0", 1024, 10)], "y": [("GPU-1", 2048, 50)]})
    owners: Owners = {}
    failing = [False]

    def pod_resources() -> Owners:
        if failing[0]:
            raise PodResourcesError("pod-resources List on /k.sock failed: connection refused")
        return dict(owners)

    agent, kube = make_agent(tmp_path, [p], pod_resources=pod_resources)
    agent.allocate([["GPU-0::0"]])
    assert agent.confirm_admissions()  # the kubelet has not named it yet: ask again
    owners[frozenset({"GPU-0::0"})] = IdentityRef("ns", "p", "x")
    assert not agent.confirm_admissions()
    agent.phases.drain()
    assert kube.phases == {}  # y is not admitted yet
    agent.allocate([["GPU-1::0"]])
    owners[frozenset({"GPU-1::0"})] = IdentityRef("ns", "p", "y")
    failing[0] = True
    assert agent.confirm_admissions()
    agent.tidy_state()
    agent.phases.drain()
    assert kube.phases == {}
    failing[0] = False
    assert not agent.confirm_admissions()
    agent.phases.drain()
    assert kube.phases == {"uid-p": Phase.ALLOCATED}


def test_a_resized_allocation_rewrites_the_served_containers_limits_by_a_rename(tmp_path: Path) -> None:
    pod = in_flight_pod(
        "p", {"main": [("GPU-1", 1024, 30), ("GPU-2", 1024, 30)], "side": [("GPU-3", 512, 0)]}
    )
    agent, kube = make_agent(tmp_path, [pod])
    agent.allocate([["GPU-1::0", "GPU-2::0"]])
    agent.allocate([["GPU-3::0"]])
    where = tmp_path / "containers" / "uid-p" / "main"
    limits = where / "limits.d" / "limits"
    before = limits.stat().st_ino
    assert agent.follow_resizes([pod]) == 0  # the allocation as served
    resized = in_flight_pod(
        "p", {"main": [("GPU-1", 2048, 60), ("GPU-2", 2048, 60)], "side": [("GPU-3", 512, 0)]}
    )
    assert agent.follow_resizes([resized]) == 1
    text = limits.read_text()
    assert f"device GPU-1 memory {2048 * 2**20} cores 60\n" in text
    assert f"device GPU-2 memory {2048 * 2**20} cores 60\n" in text
    assert limits.stat().st_ino != before  # a new file renamed over the old one
    assert limits.stat().st_mode & 0o777 == 0o444
    record = load_record(where / "allocation.json", ServedRecord)
    assert [(g.memory_mib, g.cores) for g in record.gpus] == [(2048, 60), (2048, 60)]
    assert (
        f"memory {512 * 2**20} cores 0"
        in (tmp_path / "containers" / "uid-p" / "side" / "limits.d" / "limits").read_text()
    )
    assert agent.follow_resizes([resized]) == 0  # followed once
    # An allocation naming other GPUs is no resize: the container keeps what it was served.
    moved = in_flight_pod(
        "p", {"main": [("GPU-0", 4096, 60), ("GPU-2", 4096, 60)], "side": [("GPU-3", 512, 0)]}
    )
    assert agent.follow_resizes([moved]) == 0
    assert limits.read_text() == text
    assert kube.events == []


def test_a_restarted_agent_follows_a_resize_made_while_it_was_down(tmp_path: Path) -> None:
    pod = in_flight_pod("p", {"main": [("GPU-1", 1024, 30)]})
    agent, _ = make_agent(tmp_path, [pod])
    agent.allocate([["GPU-1::0"]])
    resized = in_flight_pod("p", {"main": [("GPU-1", 512, 30)]})
    restarted, _ = make_agent(tmp_path, [resized])
    restarted.tidy_state()
    limits = tmp_path / "containers" / "uid-p" / "main" / "limits.d" / "limits"
    assert f"device GPU-1 memory {512 * 2**20} cores 30\n" in limits.read_text()
