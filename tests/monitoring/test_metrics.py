"""The exposition itself: metric names in base units with ``_total`` on counters, and the labels that
join with NVIDIA dcgm-exporter's series (docs/observability.md)."""

from __future__ import annotations

from pathlib import Path

from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.parser import text_string_to_metric_families

from deviceplugin.metrics import AgentCollector
from extender.metrics import Metrics
from nodeagent.nvml import GpuReading
from nodeagent.records import ServedRecord
from nodeagent.statedir import StateDir
from tessera.contract import MIB, GpuGrant, GpuInfo, GpuUsage, NodeGpuUsage, QosClass

MODEL = "NVIDIA A100-SXM4-40GB"
GPU_A = "GPU-aaaaaaaa-0000-0000-0000-000000000000"
GPU_B = "GPU-bbbbbbbb-0000-0000-0000-000000000000"


def gpu(uuid: str, index: int) -> GpuInfo:
    return GpuInfo(
        uuid=uuid,
        index=index,
        model=MODEL,
        total_memory_mib=40960,
        sm_count=108,
        compute_capability="8.0",
        split=10,
    )


def agent_exposition(tmp_path: Path) -> str:
    state = StateDir(tmp_path / "state")
    for pod, grants in (
        ("train", (GpuGrant(uuid=GPU_A, memory_quota_mib=4096, cores=30),)),
        (
            "infer",
            (
                GpuGrant(uuid=GPU_A, memory_quota_mib=2048, cores=20),
                GpuGrant(uuid=GPU_B, memory_quota_mib=1024, cores=0),
            ),
        ),
    ):
        where = state.container(f"uid-{pod}", "main")
        state.write_record(
            where, ServedRecord(namespace="ml", pod=pod, pod_uid=f"uid-{pod}", container="main", gpus=grants)
        )
    registry = CollectorRegistry()
    registry.register(
        AgentCollector(
            "node-1",
            lambda: (gpu(GPU_A, 0), gpu(GPU_B, 1)),
            lambda uuid: GpuReading(uuid, 40 * 2**30, 2**30, 0.5),
            state,
            processes=lambda uuid: (),
            pod_of_pid=lambda pid: None,
        )
    )
    return generate_latest(registry).decode()


def samples(text: str) -> dict[str, list[tuple[dict[str, str], float]]]:
    found: dict[str, list[tuple[dict[str, str], float]]] = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            found.setdefault(sample.name, []).append((sample.labels, sample.value))
    return found


def test_agent_series_carry_dcgm_exporter_labels_and_base_units(tmp_path: Path) -> None:
    text = agent_exposition(tmp_path)
    found = samples(text)
    gpu_a = {"Hostname": "node-1", "UUID": GPU_A, "modelName": MODEL}
    assert (gpu_a, 40 * 2**30) in found["tessera_gpu_memory_capacity_bytes"]
    # Allocated against capacity, per GPU: both containers' quotas on A, one on B.
    assert (gpu_a, 6144 * MIB) in found["tessera_gpu_memory_allocated_bytes"]
    assert (gpu_a, 0.5) in found["tessera_gpu_cores_allocated_ratio"]
    assert (gpu_a, 2) in found["tessera_gpu_slices_used"]
    assert ({**gpu_a, "UUID": GPU_B}, 1) in found["tessera_gpu_slices_used"]
    # One label set for both paths: a container the device plugin served names no DRA claim.
    train = {"namespace": "ml", "pod": "train", "container": "main", "claim": "", **gpu_a}
    assert (train, 4096 * MIB) in found["tessera_container_memory_quota_bytes"]
    assert (train, 0.3) in found["tessera_container_compute_quota_ratio"]
    # No process of the container has used the GPU (no region yet): nothing held, nothing refused.
    assert (train, 0) in found["tessera_container_memory_peak_bytes"]
    assert (train, 0.0) in found["tessera_container_allocations_refused_total"]
    # Counters are exposed with _total (prometheus_client appends it to the family's name).
    assert (train, 0.0) in found["tessera_container_gpu_busy_seconds_total"]
    assert (train, 0.0) in found["tessera_container_throttled_seconds_total"]
    assert "tessera_container_gpu_busy_seconds_total{" in text
    names = set(found)
    assert all(n.startswith("tessera_") for n in names)
    # No label of the old scheme is left (gpu_uuid, model, node).
    labels = {label for series in found.values() for lbls, _ in series for label in lbls}
    assert labels <= {"Hostname", "UUID", "modelName", "namespace", "pod", "container", "claim"}, labels


def test_every_counter_ends_in_total_and_every_unit_is_a_base_unit(tmp_path: Path) -> None:
    metrics = Metrics()
    metrics.latency.labels("filter").observe(0.001)
    metrics.requests.labels("filter", "200").inc()
    metrics.pods_filtered.labels("feasible").inc()
    metrics.node_rejections.labels("memory").inc()
    metrics.binds.labels("bound").inc()
    metrics.bind_failures.labels("conflict").inc()
    text = agent_exposition(tmp_path) + generate_latest(metrics.registry).decode()
    for family in text_string_to_metric_families(text):
        if family.type == "counter":
            assert all(s.name.endswith(("_total", "_created")) for s in family.samples), family.name
        for unit in ("_ms", "_milliseconds", "_mib", "_mb", "_percent"):
            assert unit not in family.name, family.name
    assert "tessera_extender_binds_total" in text
    assert 'tessera_extender_request_seconds_bucket{le="0.001",verb="filter"} 1.0' in text


def test_oversubscribed_gpus_and_the_measured_use_are_exported(tmp_path: Path) -> None:
    state = StateDir(tmp_path / "state")
    borrowing = GpuGrant(uuid=GPU_A, memory_quota_mib=8192, cores=0, oversubscribed=True)
    where = state.container("uid-batch", "main")
    state.write_record(
        where,
        ServedRecord(
            namespace="ml",
            pod="batch",
            pod_uid="uid-batch",
            container="main",
            gpus=(borrowing,),
            qos=QosClass.BEST_EFFORT,
        ),
    )
    measured = NodeGpuUsage(
        time="2026-11-26T05:00:00Z",
        gpus=(
            GpuUsage(uuid=GPU_A, memory_used_mib=3000, guaranteed_used_mib=1000, utilization_percent=40),
            GpuUsage(uuid=GPU_B, memory_used_mib=0, guaranteed_used_mib=0, utilization_percent=0),
        ),
    )
    registry = CollectorRegistry()
    registry.register(
        AgentCollector(
            "node-1",
            lambda: (gpu(GPU_A, 0), gpu(GPU_B, 1)),
            lambda uuid: None,
            state,
            processes=lambda uuid: (),
            pod_of_pid=lambda pid: None,
            measured=lambda: measured,
        )
    )
    found = samples(generate_latest(registry).decode())
    gpu_a = {"Hostname": "node-1", "UUID": GPU_A, "modelName": MODEL}
    gpu_b = {**gpu_a, "UUID": GPU_B}
    assert (gpu_a, 1) in found["tessera_gpu_oversubscribed"] and (gpu_b, 0) in found[
        "tessera_gpu_oversubscribed"
    ]
    # No process has run yet: nothing refused.
    assert (gpu_a, 0) in found["tessera_gpu_best_effort_allocations_refused_total"]
    assert (gpu_a, 3000 * MIB) in found["tessera_gpu_measured_memory_used_bytes"]
    assert (gpu_a, 1000 * MIB) in found["tessera_gpu_measured_guaranteed_memory_used_bytes"]
    assert (gpu_a, 0.4) in found["tessera_gpu_measured_utilization_ratio"]
