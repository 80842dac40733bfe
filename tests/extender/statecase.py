"""One node "n" (four T4s) and pods on it, for the cluster state's parts' tests."""

from __future__ import annotations

from datetime import UTC, datetime, timedelta
from typing import Any

from extender.podrecords import PodAllocation
from extender.state import ClusterState
from tessera.contract import (
    KEYS,
    Allocation,
    ContainerAllocation,
    GpuGrant,
    Phase,
    dump_allocation,
    format_time,
)
from tessera.placement import PlacementEngine, SpeedProfiles
from tests.extender.helpers import inventory, node_object

NOW = datetime(2026, 1, 1, 12, 0, 0, tzinfo=UTC)


def one_node_state() -> ClusterState:
    s = ClusterState(PlacementEngine(SpeedProfiles()), KEYS, heartbeat_timeout=timedelta(seconds=60))
    s.replace_nodes([node_object("n", inventory("n", "Tesla T4", 15360), NOW)], NOW)
    s.replace_pods([])
    return s


def allocation(memory: int = 4096, gpu: int = 0) -> Allocation:
    return Allocation(
        node="n",
        containers=(
            ContainerAllocation(
                name="main", gpus=(GpuGrant(uuid=f"GPU-n-{gpu}", memory_quota_mib=memory, cores=30),)
            ),
        ),
    )


def pod(
    uid: str,
    *,
    bound: bool,
    phase: str = "allocating",
    status: str = "Pending",
    memory: int = 4096,
    version: int = 1,
) -> dict[str, Any]:
    return {
        "metadata": {
            "name": uid,
            "namespace": "ns",
            "uid": uid,
            "resourceVersion": str(version),
            "annotations": {
                KEYS.allocation: dump_allocation(allocation(memory)),
                KEYS.allocation_phase: phase,
                KEYS.bind_time: format_time(NOW),
            },
        },
        "spec": {"nodeName": "n"} if bound else {},
        "status": {"phase": status},
    }


def used(state: ClusterState) -> int:
    return state.engine.nodes["n"].gpus[0].used_memory_mib


def record(uid: str, memory: int = 4096) -> PodAllocation:
    return PodAllocation(uid, "ns", uid, allocation(memory), Phase.ALLOCATING.value, NOW)
