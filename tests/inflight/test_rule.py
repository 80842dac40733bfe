"""The in-flight rule is one rule on both sides: what the extender lets be in flight together, the
device plugin tells apart at Allocate.

Both sides read the same pod objects: the extender through its cluster state (phase, bind time,
allocation) and the shared conflict check, as its bind does; the device plugin through its pod view,
its snapshot and its match, as its Allocate does. Random binds and kubelet admissions interleave; every
Allocate must give the container exactly the GPUs and quotas its pod was bound with.
"""

from __future__ import annotations

import random
from dataclasses import dataclass, field
from datetime import UTC, datetime, timedelta
from typing import Any

import pytest

from deviceplugin.config import parse_config
from deviceplugin.kube import pod_view
from deviceplugin.matching import (
    AllocationError,
    ContainerRef,
    match_container,
    pod_complete,
    preferred_devices,
    snapshot,
)
from extender.main import build_parser
from extender.state import ClusterState
from tessera.contract import (
    KEYS,
    Allocation,
    ContainerAllocation,
    GpuGrant,
    Phase,
    dump_allocation,
    format_time,
    slice_gpu,
    slice_id,
)
from tessera.inflight import DEFAULT_INFLIGHT_TIMEOUT, allocation_keys, container_key, keys_conflict
from tessera.placement import PlacementEngine, SpeedProfiles
from tests.extender.helpers import inventory, node_object

NODE = "n"
GPUS = tuple(g.uuid for g in inventory(NODE, "Tesla T4", 15360))
SPLIT = 4
SLICES = [slice_id(u, n) for u in GPUS for n in range(SPLIT)]
QUOTAS = ((1024, 10), (2048, 20))
T0 = datetime(2026, 1, 1, tzinfo=UTC)


def random_allocation(rng: random.Random) -> Allocation:
    """1-2 containers of 1-3 GPUs, each with one of a few quotas (so that keys often collide)."""
    containers = []
    for i in range(rng.randint(1, 2)):
        memory, cores = rng.choice(QUOTAS)
        gpus = rng.sample(GPUS, rng.randint(1, 3))
        containers.append(
            ContainerAllocation(
                name=f"c{i}", gpus=tuple(GpuGrant(uuid=u, memory_quota_mib=memory, cores=cores) for u in gpus)
            )
        )
    return Allocation(node=NODE, containers=tuple(containers))


def bound_pod(name: str, allocation: Allocation, bind_time: datetime) -> dict[str, Any]:
    """A pod as the extender's bind leaves it (API JSON): requests, allocation, phase, bind time."""
    return {
        "metadata": {
            "name": name,
            "namespace": "ns",
            "uid": f"uid-{name}",
            "creationTimestamp": format_time(bind_time - timedelta(seconds=1)),
            "annotations": {
                KEYS.allocation: dump_allocation(allocation),
                KEYS.allocation_phase: Phase.ALLOCATING.value,
                KEYS.bind_time: format_time(bind_time),
            },
        },
        "spec": {
            "nodeName": NODE,
            "containers": [
                {
                    "name": c.name,
                    "image": "app",
                    "resources": {
                        "limits": {
                            KEYS.vgpu: str(len(c.gpus)),
                            KEYS.vgpu_memory: str(c.gpus[0].memory_quota_mib),
                            KEYS.vgpu_cores: str(c.gpus[0].cores),
                        }
                    },
                }
                for c in allocation.containers
            ],
        },
        "status": {"phase": "Pending"},
    }


@dataclass
class Node:
    """One GPU node: the extender's view of it and the device plugin's."""

    extender_timeout: timedelta = DEFAULT_INFLIGHT_TIMEOUT
    plugin_timeout: timedelta = DEFAULT_INFLIGHT_TIMEOUT
    state: ClusterState = field(init=False)
    pods: dict[str, dict[str, Any]] = field(default_factory=dict)  # by name, as the API server has them
    bound: dict[str, Allocation] = field(default_factory=dict)  # by name: what each pod was bound with
    served: set[ContainerRef] = field(default_factory=set)

    def __post_init__(self) -> None:
        self.state = ClusterState(PlacementEngine(SpeedProfiles()), KEYS, heartbeat_timeout=timedelta(days=1))
        self.state.replace_nodes([node_object(NODE, inventory(NODE, "Tesla T4", 15360), T0)], T0)
        self.state.replace_pods([])

    def bind(self, name: str, allocation: Allocation, now: datetime, *, check: bool = True) -> bool:
        """The extender's bind: refused while the pod may not be in flight with the others."""
        pod = bound_pod(name, allocation, now)
        others = self.state.inflight_pods(NODE, now, self.extender_timeout).without(f"uid-{name}")
        if check and keys_conflict(NODE, allocation_keys(allocation), others) is not None:
            return False
        self.pods[name] = pod
        self.bound[name] = allocation
        self.state.upsert_pod(pod)
        return True

    def admit(self, name: str, now: datetime, rng: random.Random) -> list[tuple[str, str, str]]:
        """The kubelet admits pod ``name``: GetPreferredAllocation and Allocate for each of its
        containers in spec order, picking the slices of the pod's own GPUs, as the device plugin's
        agent serves them. Returns what went wrong, by container: ``quotas`` (served another key
        than its pod's), ``steered`` (preferred other GPUs than its pod's), ``refused`` (Allocate
        refused: the kubelet fails the pod, and admits none of its further containers)."""
        allocation = self.bound[name]
        wrong = []
        for container in allocation.containers:
            views = [pod_view(p, KEYS) for p in self.pods.values()]
            node = snapshot(
                views,
                keys=KEYS,
                node=NODE,
                node_gpus=GPUS,
                served=self.served,
                now=now,
                inflight_timeout=self.plugin_timeout,
            )
            gpu_count = len(container.gpus)
            preferred = preferred_devices(SLICES, [], gpu_count, node)
            uuids = [g.uuid for g in container.gpus]
            devices = [slice_id(u, rng.randrange(SPLIT)) for u in rng.sample(uuids, gpu_count)]
            if {slice_gpu(d) for d in preferred} != set(uuids):
                wrong.append((name, container.name, "steered"))
            try:
                got = match_container(devices, node, node=NODE, node_gpus=GPUS)
            except AllocationError:
                wrong.append((name, container.name, "refused"))
                break
            self.served.add(got.ref)
            if got.key != container_key(container):
                wrong.append((name, container.name, "quotas"))
            if pod_complete(got.pod, self.served):  # the agent's phase patch, seen by the extender
                served = self.pods[got.pod.name]
                served["metadata"]["annotations"][KEYS.allocation_phase] = Phase.ALLOCATED.value
                self.state.upsert_pod(served)
        return wrong


def run(seed: int, *, check: bool = True) -> list[tuple[str, str, str]]:
    """Binds and kubelet admissions interleaved at random (within the in-flight timeout)."""
    rng = random.Random(seed)
    node = Node()
    unadmitted: list[str] = []
    now = T0
    wrong = []
    for step in range(30):
        now += timedelta(seconds=1)
        if unadmitted and rng.random() < 0.4:
            wrong += node.admit(unadmitted.pop(rng.randrange(len(unadmitted))), now, rng)
        elif node.bind(f"p{step}", random_allocation(rng), now, check=check):
            unadmitted.append(f"p{step}")
    for name in rng.sample(unadmitted, len(unadmitted)):
        wrong += node.admit(name, now, rng)
    return wrong


@pytest.mark.parametrize("seeds", [range(0, 100), range(100, 200)])
def test_what_the_extender_lets_fly_together_the_device_plugin_tells_apart(seeds: range) -> None:
    for seed in seeds:
        assert run(seed) == [], f"seed {seed}"


def test_without_the_rule_allocates_are_refused_never_served_another_pods_quotas() -> None:
    """The check above has teeth: binding every pod regardless of the rule leaves the device plugin
    unable to tell pods apart. It steers them wrong and refuses them; it never serves a container
    another pod's quotas (a guess would, as the chaos test saw when the rule broke)."""
    outcomes = {kind for seed in range(50) for _, _, kind in run(seed, check=False)}
    assert outcomes == {"steered", "refused"}


def test_both_sides_count_the_same_in_flight_timeout() -> None:
    """A pod bound longer ago than the timeout no longer holds others back at bind, and comes after
    them at Allocate. With one timeout on both sides, the fresh pod gets its own quotas; a device
    plugin counting a longer timeout would count both as fresh, could not tell them apart, and would
    refuse the fresh pod."""
    old = Allocation(
        node=NODE,
        containers=(
            ContainerAllocation(name="c0", gpus=(GpuGrant(uuid=GPUS[0], memory_quota_mib=1024, cores=10),)),
        ),
    )
    new = Allocation(
        node=NODE,
        containers=(
            ContainerAllocation(name="c0", gpus=(GpuGrant(uuid=GPUS[0], memory_quota_mib=2048, cores=20),)),
        ),
    )
    later = T0 + DEFAULT_INFLIGHT_TIMEOUT + timedelta(seconds=1)
    for plugin_timeout, served_right in (
        (DEFAULT_INFLIGHT_TIMEOUT, True),
        (2 * DEFAULT_INFLIGHT_TIMEOUT, False),
    ):
        node = Node(plugin_timeout=plugin_timeout)
        assert node.bind("old", old, T0)
        assert not node.bind("refused", new, T0 + timedelta(seconds=1))  # "old" still in flight
        assert node.bind("new", new, later)
        expected = [] if served_right else [("new", "c0", "refused")]
        assert node.admit("new", later, random.Random(0)) == expected


def test_both_binaries_take_one_in_flight_timeout_flag_with_one_default() -> None:
    extender = build_parser()
    plugin = parse_config(["--node-name=n"], environ={})
    assert timedelta(seconds=extender.parse_args([]).inflight_timeout) == DEFAULT_INFLIGHT_TIMEOUT
    assert plugin.inflight_timeout == DEFAULT_INFLIGHT_TIMEOUT
    assert extender.parse_args(["--inflight-timeout=42"]).inflight_timeout == 42
    assert parse_config(["--node-name=n", "--inflight-timeout=42"], environ={}).inflight_timeout == timedelta(
        seconds=42
    )
