"""The per-GPU series (``tessera_gpu_*``) either node agent serves, read at scrape time: each GPU's
health, its memory capacity and what the quotas on it add up to (from the agent's own records, which
no container can write), and what NVML reads of it. One label set and one reader for both paths, so
that the overcommit alerts and the dashboard's GPU panels work on a device plugin node and on a DRA
node alike.
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Callable, Collection, Iterable, Iterator

from prometheus_client.core import GaugeMetricFamily

from hook.limits import DeviceLimit
from nodeagent.nvml import GpuReading
from tessera.contract import MIB, GpuInfo

# dcgm-exporter's label names, as the per-container series' (nodeagent/containermetrics.py).
GPU_LABELS = ("Hostname", "UUID", "modelName")


def gpu_families(
    node: str,
    gpus: Iterable[GpuInfo],
    unhealthy: Collection[str],
    quotas: Iterable[DeviceLimit],
    reading: Callable[[str], GpuReading | None],
) -> Iterator[GaugeMetricFamily]:
    """The ``tessera_gpu_*`` families of ``gpus`` on node ``node``: ``unhealthy`` names the GPUs out
    of service by UUID; ``quotas``, every quota the agent has given (a container's on the device
    plugin path, a claim's on the DRA path), each GPU's allocation their sum; ``reading``, NVML's
    reading of a GPU (None: no series of it)."""
    healthy = GaugeMetricFamily("tessera_gpu_healthy", "1 if the GPU is healthy", labels=GPU_LABELS)
    capacity = GaugeMetricFamily(
        "tessera_gpu_memory_capacity_bytes",
        "GPU memory in the node's inventory: what quotas are allocated against",
        labels=GPU_LABELS,
    )
    memory_allocated = GaugeMetricFamily(
        "tessera_gpu_memory_allocated_bytes",
        "Sum of the memory quotas given on the GPU (containers served, claims prepared)",
        labels=GPU_LABELS,
    )
    cores_allocated = GaugeMetricFamily(
        "tessera_gpu_cores_allocated_ratio",
        "Sum of the compute quotas given on the GPU, 0..1 (beyond 1: overcommitted)",
        labels=GPU_LABELS,
    )
    total = GaugeMetricFamily("tessera_gpu_memory_total_bytes", "GPU memory (NVML)", labels=GPU_LABELS)
    used = GaugeMetricFamily("tessera_gpu_memory_used_bytes", "GPU memory in use", labels=GPU_LABELS)
    utilization = GaugeMetricFamily(
        "tessera_gpu_utilization_ratio", "Share of time a kernel ran, 0..1", labels=GPU_LABELS
    )
    on_gpu: dict[str, list[DeviceLimit]] = defaultdict(list)
    for quota in quotas:
        on_gpu[quota.uuid].append(quota)
    for gpu in gpus:
        labels = (node, gpu.uuid, gpu.model)
        healthy.add_metric(labels, 0.0 if gpu.uuid in unhealthy else 1.0)
        capacity.add_metric(labels, gpu.total_memory_mib * MIB)
        given = on_gpu.get(gpu.uuid, [])
        memory_allocated.add_metric(labels, sum(q.memory_quota_bytes for q in given))
        cores_allocated.add_metric(labels, sum(q.cores for q in given) / 100)
        read = reading(gpu.uuid)
        if read is None:
            continue
        total.add_metric(labels, read.memory_total_bytes)
        used.add_metric(labels, read.memory_used_bytes)
        utilization.add_metric(labels, read.utilization_ratio)
    yield from (healthy, capacity, memory_allocated, cores_allocated, total, used, utilization)
