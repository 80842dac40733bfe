"""The driver's word on who holds what (deviceplugin/driveruse.py), its pure rules: over quota with a
context per process, unmanaged use, the grace period's timer (acted on: test_driverchecks.py)."""

from __future__ import annotations

from deviceplugin.driveruse import (
    CONTEXT_ALLOWANCE_BYTES,
    GpuHolders,
    OverQuotaTimer,
    PodMemory,
    over_quota,
    unmanaged_bytes,
)
from tessera.contract import MIB

GIB = 1024 * MIB


def test_over_quota_counts_a_context_per_process() -> None:
    holders = GpuHolders(
        {
            "a": PodMemory(GIB + 2 * CONTEXT_ALLOWANCE_BYTES, (1, 2)),  # at its allowance: fine
            "b": PodMemory(GIB + CONTEXT_ALLOWANCE_BYTES + 1, (3,)),  # one byte over
            "c": PodMemory(8 * GIB, (4,)),  # no quota here: not over, unmanaged
        },
        outside_pods_bytes=0,
    )
    assert set(over_quota({"a": GIB, "b": GIB}, holders)) == {"b"}
    assert unmanaged_bytes({"a", "b"}, holders) == {"c": 8 * GIB}
    assert unmanaged_bytes({"a", "b", "c"}, GpuHolders({}, outside_pods_bytes=MIB)) == {"": MIB}


def test_the_timer_acts_once_per_episode_after_the_grace() -> None:
    timer = OverQuotaTimer(5.0)
    key = ("uid-p", "GPU-0")
    assert timer.due([key], 100.0) == []
    assert timer.due([key], 104.9) == []
    assert timer.due([key], 105.0) == [key]
    assert timer.due([key], 120.0) == []  # acted on already
    assert timer.due([], 121.0) == []  # back within its quota
    assert timer.due([key], 122.0) == []  # a new episode waits its grace again
    assert timer.due([key], 127.0) == [key]
