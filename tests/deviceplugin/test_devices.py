"""Slices advertised per GPU, and their health (its rules: tests/nodeagent/test_health.py)."""

from __future__ import annotations

from deviceplugin.devices import virtual_devices, with_health
from nodeagent.health import GpuHealth
from tessera.contract import HEALTHY, UNHEALTHY, GpuInfo


def gpu(uuid: str, numa: int | None = 0, split: int = 10) -> GpuInfo:
    return GpuInfo(
        uuid=uuid,
        index=0,
        model="Fake A100",
        total_memory_mib=40960,
        sm_count=108,
        compute_capability="8.0",
        numa_node=numa,
        split=split,
    )


def test_each_gpu_is_split_into_slices_with_its_numa_node() -> None:
    devices = virtual_devices([gpu("GPU-a", numa=1), gpu("GPU-b", numa=None, split=3)])
    assert [d.id for d in devices] == [f"GPU-a::{n}" for n in range(10)] + [
        "GPU-b::0",
        "GPU-b::1",
        "GPU-b::2",
    ]
    assert {d.numa_node for d in devices[:10]} == {1}
    assert devices[-1].numa_node is None
    assert all(d.healthy for d in devices)


def test_inventory_health_follows_the_state() -> None:
    gpus = [gpu("GPU-a"), gpu("GPU-b")]
    marked = with_health(gpus, {"GPU-b": GpuHealth(present=False)})
    assert [g.health for g in marked] == [HEALTHY, UNHEALTHY]
    devices = virtual_devices(marked)
    assert sum(d.healthy for d in devices) == 10
    assert not any(d.healthy for d in devices if d.id.startswith("GPU-b"))
