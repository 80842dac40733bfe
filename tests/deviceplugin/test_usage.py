"""Measured use (deviceplugin/usage.py): published with the inventory, and the limits of the
containers on a GPU whose memory is borrowed follow the plan."""

from __future__ import annotations

import dataclasses
from pathlib import Path

from tessera.contract import (
    KEYS,
    MIB,
    Allocation,
    ContainerAllocation,
    GpuGrant,
    QosClass,
    dump_allocation,
    parse_gpu_usage,
)
from tests.deviceplugin.fakes import (
    GPUS,
    NODE,
    in_flight_pod,
    make_agent,
)


def test_measured_use_is_published_with_the_inventory_and_limits_follow_borrowing(tmp_path: Path) -> None:
    # A best-effort pod whose grant borrows GPU-0's memory beside a standard one.
    borrowing = Allocation(
        node=NODE,
        containers=(
            ContainerAllocation(
                name="main",
                gpus=(GpuGrant(uuid="GPU-0", memory_quota_mib=16384, cores=0, oversubscribed=True),),
            ),
        ),
        qos=QosClass.BEST_EFFORT,
    )
    be = in_flight_pod("be", {"main": [("GPU-0", 16384, 0)]}, bind=1, qos=QosClass.BEST_EFFORT)
    be = dataclasses.replace(be, annotations={**be.annotations, KEYS.allocation: dump_allocation(borrowing)})
    # One after the other, as the in-flight rule has them bound: their keys differ.
    agent, kube = make_agent(tmp_path, [in_flight_pod("std", {"main": [("GPU-0", 4096, 10)]}, bind=0)])
    agent.allocator.allocate([["GPU-0::0"]])
    kube.pods.append(be)
    agent.allocator.allocate([["GPU-0::1"]])
    agent.usage.check()
    assert agent.served.oversubscribed_gpus() == {"GPU-0"}
    limits = {
        p.parent.parent.parent.name: p.read_text()
        for p in (tmp_path / "containers").glob("*/*/limits.d/limits")
    }
    # Nothing used yet: the borrower may take the GPU less the margin; the standard one waits if short.
    assert f"device GPU-0 memory {(16384 - 512) * MIB} cores 0" in limits["uid-be"]
    assert "oversubscribed GPU-0 wait 30000" in limits["uid-std"] and "version 3" in limits["uid-std"]
    assert "oversubscribed" not in limits["uid-be"]
    assert agent.publisher.publish(heartbeat=False)
    usage = parse_gpu_usage(kube.node[KEYS.node_gpu_usage])
    assert [(g.uuid, g.memory_used_mib) for g in usage.gpus] == [(g.uuid, 0) for g in GPUS]
    assert not agent.publisher.publish(heartbeat=False)  # nothing changed
