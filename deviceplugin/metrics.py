"""Prometheus metrics: per GPU from NVML, per container from the hook's accounting regions.

Read at scrape time, so a scrape always shows the current state and nothing is cached between them.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterator
from pathlib import Path

from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from prometheus_client.registry import Collector

from deviceplugin.nvml import GpuReading
from deviceplugin.statedir import StateDir
from hook.limits import CONTAINER_REGION_FILE
from hook.region import RegionError, RegionUsage, read_region
from tessera.contract import CONTAINER_STATE_DIR, MIB, GpuInfo

log = logging.getLogger(__name__)

GPU_LABELS = ("node", "gpu_uuid", "model")
CONTAINER_LABELS = ("namespace", "pod", "container", "gpu_uuid")
# The region's path inside the container's state dir (the hook reads it from the limits file).
REGION_NAME = CONTAINER_REGION_FILE.removeprefix(CONTAINER_STATE_DIR + "/")


class AgentCollector(Collector):
    def __init__(
        self,
        node: str,
        inventory: Callable[[], tuple[GpuInfo, ...]],
        reading: Callable[[str], GpuReading | None],
        state: StateDir,
    ) -> None:
        self._node = node
        self._inventory = inventory
        self._reading = reading
        self._state = state

    def collect(self) -> Iterator[GaugeMetricFamily | CounterMetricFamily]:
        yield from self._gpu_metrics()
        yield from self._container_metrics()

    def _gpu_metrics(self) -> Iterator[GaugeMetricFamily]:
        healthy = GaugeMetricFamily("tessera_gpu_healthy", "1 if the GPU is healthy", labels=GPU_LABELS)
        total = GaugeMetricFamily("tessera_gpu_memory_total_bytes", "GPU memory", labels=GPU_LABELS)
        used = GaugeMetricFamily("tessera_gpu_memory_used_bytes", "GPU memory in use", labels=GPU_LABELS)
        utilization = GaugeMetricFamily(
            "tessera_gpu_utilization_ratio", "Share of time a kernel ran, 0..1", labels=GPU_LABELS
        )
        slices = GaugeMetricFamily(
            "tessera_gpu_slices", "Slices advertised to the kubelet", labels=GPU_LABELS
        )
        for gpu in self._inventory():
            labels = (self._node, gpu.uuid, gpu.model)
            healthy.add_metric(labels, 1.0 if gpu.healthy else 0.0)
            slices.add_metric(labels, gpu.split)
            reading = self._reading(gpu.uuid)
            if reading is None:
                continue
            total.add_metric(labels, reading.memory_total_bytes)
            used.add_metric(labels, reading.memory_used_bytes)
            utilization.add_metric(labels, reading.utilization_ratio)
        yield from (healthy, slices, total, used, utilization)

    def _container_metrics(self) -> Iterator[GaugeMetricFamily | CounterMetricFamily]:
        quota = GaugeMetricFamily(
            "tessera_container_memory_quota_bytes", "GPU memory quota", labels=CONTAINER_LABELS
        )
        used = GaugeMetricFamily(
            "tessera_container_memory_used_bytes", "GPU memory the container holds", labels=CONTAINER_LABELS
        )
        cores = GaugeMetricFamily(
            "tessera_container_compute_quota_ratio", "Share of the GPU's time, 0..1", labels=CONTAINER_LABELS
        )
        busy = CounterMetricFamily(
            "tessera_container_gpu_busy_seconds",
            "Device time of the container's kernels",
            labels=CONTAINER_LABELS,
        )
        throttled = CounterMetricFamily(
            "tessera_container_throttled_seconds",
            "Time the container's kernel launches were held back by its compute quota",
            labels=CONTAINER_LABELS,
        )
        for where, record in self._state.records():
            usage = self._region(where.state / REGION_NAME)
            for grant in record.gpus:
                labels = (record.namespace, record.pod, record.container, grant.uuid)
                quota.add_metric(labels, grant.memory_mib * MIB)
                cores.add_metric(labels, grant.cores / 100)
                device = usage.device(grant.uuid) if usage is not None else None
                used.add_metric(labels, device.memory_used_bytes if device else 0)
                busy.add_metric(labels, device.busy_seconds if device else 0.0)
                throttled.add_metric(labels, device.throttled_seconds if device else 0.0)
        yield from (quota, used, cores, busy, throttled)

    def _region(self, path: Path) -> RegionUsage | None:
        if not path.exists():
            return None  # no process of the container has used the GPU yet
        try:
            return read_region(path)
        except RegionError as e:
            log.warning("%s", e)
            return None
