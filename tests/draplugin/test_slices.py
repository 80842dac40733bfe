"""The node's GPUs as a ResourceSlice: capacities, request policies, attributes, islands."""

from __future__ import annotations

from draplugin.slices import devices_digest, nvlink_islands, resource_slice
from nodeagent.health import GpuHealth, HealthState
from tessera.contract import KEYS, MIB, GpuInfo
from tessera.placement.speed import SpeedProfiles

A100 = GpuInfo(
    uuid="GPU-a100",
    index=0,
    model="NVIDIA A100-SXM4-40GB",
    total_memory_mib=40960,
    sm_count=108,
    compute_capability="8.0",
    numa_node=1,
    split=1,
)
T4 = GpuInfo(
    uuid="GPU-t4",
    index=1,
    model="Tesla T4",
    total_memory_mib=15360,
    sm_count=40,
    compute_capability="7.5",
    split=1,
)
PROFILES = SpeedProfiles.from_mapping({"models": {"A100": 2.0, "T4": 0.4}})


def test_each_gpu_is_a_shareable_device_with_memory_and_cores() -> None:
    body = resource_slice("node-a", [A100, T4], PROFILES, 3, KEYS)
    assert body["apiVersion"] == "resource.k8s.io/v1"
    spec = body["spec"]
    assert spec["driver"] == KEYS.dra_driver
    assert spec["nodeName"] == "node-a"
    assert spec["pool"] == {"name": "node-a", "generation": 3, "resourceSliceCount": 1}
    a100, t4 = spec["devices"]
    assert a100["name"] == "gpu-0"
    assert t4["name"] == "gpu-1"
    assert a100["allowMultipleAllocations"] is True
    memory = a100["capacity"]["memory"]
    assert memory["value"] == str(40960 * MIB)
    # A claim naming no memory takes all of it (as the device plugin path's vgpu alone does); it may
    # ask for whole MiB up to the GPU's memory.
    assert memory["requestPolicy"] == {
        "default": str(40960 * MIB),
        "validRange": {"min": str(MIB), "max": str(40960 * MIB), "step": str(MIB)},
    }
    cores = a100["capacity"]["cores"]
    assert cores == {
        "value": "100",
        "requestPolicy": {"default": "0", "validRange": {"min": "0", "max": "100", "step": "1"}},
    }


def test_attributes_name_model_speed_numa_and_uuid() -> None:
    a100, t4 = resource_slice("node-a", [A100, T4], PROFILES, 1, KEYS)["spec"]["devices"]
    assert a100["attributes"] == {
        "model": {"string": "A100"},
        "productName": {"string": "NVIDIA A100-SXM4-40GB"},
        "uuid": {"string": "GPU-a100"},
        "speedMilli": {"int": 2000},
        "nvlinkIsland": {"string": "GPU-a100"},
        "computeCapability": {"version": "8.0.0"},
        "numaNode": {"int": 1},
    }
    assert "numaNode" not in t4["attributes"]  # unknown: absent, so a CEL test on it is false
    assert t4["attributes"]["speedMilli"] == {"int": 400}
    unprofiled = resource_slice("node-a", [T4], SpeedProfiles(), 1, KEYS)["spec"]["devices"][0]
    assert unprofiled["attributes"]["model"] == {"string": "Tesla T4"}


def test_an_unhealthy_gpu_stays_in_the_slice_with_a_taint_that_says_why() -> None:
    """NoSchedule for a fault the containers survive, NoExecute for a fatal one; the taint's time is
    when the GPU turned so; a healthy GPU has no taint, and the digest follows the taints."""
    healthy = resource_slice("node-a", [A100, T4], PROFILES, 1, KEYS, health=state({}))
    assert all("taints" not in d for d in healthy["spec"]["devices"])
    assert (
        healthy["spec"]["devices"]
        == resource_slice("node-a", [A100, T4], PROFILES, 1, KEYS)["spec"]["devices"]
    )
    # 1798761600 = 2027-01-01T00:00:00Z
    faulted = state({"GPU-t4": GpuHealth().with_xid(92)}, since=1798761600.0)
    a100, t4 = resource_slice("node-a", [A100, T4], PROFILES, 1, KEYS, health=faulted)["spec"]["devices"]
    assert "taints" not in a100
    assert t4["taints"] == [
        {
            "key": "tessera.io/unhealthy",
            "value": "xid-92",
            "effect": "NoSchedule",
            "timeAdded": "2027-01-01T00:00:00Z",
        }
    ]
    for fatal, why in ((GpuHealth().with_xid(79), "xid-79"), (GpuHealth(present=False), "gone")):
        t4 = resource_slice("node-a", [A100, T4], PROFILES, 1, KEYS, health=state({"GPU-t4": fatal}))
        [taint] = t4["spec"]["devices"][1]["taints"]
        assert (taint["value"], taint["effect"]) == (why, "NoExecute")
    digests = {
        resource_slice("node-a", [A100, T4], PROFILES, 1, KEYS, health=h)["metadata"]["annotations"][
            KEYS.dra_slice_digest
        ]
        for h in (state({}), faulted, state({"GPU-t4": GpuHealth(present=False)}))
    }
    assert len(digests) == 3


def state(unhealthy: dict[str, GpuHealth], since: float = 0.0) -> HealthState:
    return HealthState(unhealthy, dict.fromkeys(unhealthy, since), version=1)


def test_nvlink_islands_are_connected_components() -> None:
    gpus = [
        A100.model_copy(update={"uuid": "GPU-c", "nvlink_peers": ("GPU-b",)}),
        A100.model_copy(update={"uuid": "GPU-b", "nvlink_peers": ("GPU-c", "GPU-a")}),
        A100.model_copy(update={"uuid": "GPU-a"}),  # links listed by its peer only
        A100.model_copy(update={"uuid": "GPU-d", "nvlink_peers": ("GPU-elsewhere",)}),
    ]
    assert nvlink_islands(gpus) == {"GPU-a": "GPU-a", "GPU-b": "GPU-a", "GPU-c": "GPU-a", "GPU-d": "GPU-d"}


def test_digest_follows_the_devices_only() -> None:
    one = resource_slice("node-a", [A100], PROFILES, 1, KEYS)
    two = resource_slice("node-a", [A100], PROFILES, 2, KEYS)
    digest = one["metadata"]["annotations"][KEYS.dra_slice_digest]
    assert digest == two["metadata"]["annotations"][KEYS.dra_slice_digest]
    assert digest == devices_digest(one["spec"]["devices"])
    changed = resource_slice("node-a", [A100, T4], PROFILES, 1, KEYS)
    assert changed["metadata"]["annotations"][KEYS.dra_slice_digest] != digest
