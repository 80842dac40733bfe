"""Prometheus metrics: per GPU from NVML and the served records, and per container from the hook's
accounting regions (the series both agents serve: nodeagent/gpumetrics.py, containermetrics.py),
each GPU's slices, and per pod the cross-check of the two (:class:`AgentCollector`); the device
plugin's own service to the kubelet, Allocate and registration, and the live resizes it followed
(:class:`PluginMetrics`).

The collector reads at scrape time, so a scrape always shows the current state and nothing is cached
between them.

The regions are written by the containers themselves (the hook in each process keeps its
container's accounting there), so a container could zero or delete its own and take a second quota.
What the driver reports per process (NVML's ``nvmlDeviceGetComputeRunningProcesses``) it cannot
forge: each scrape sums that per pod (a process's pod from its cgroup, ``/proc/<pid>/cgroup``; the
agent needs the host's PID namespace for that) and reports a pod holding more than its quotas on a
GPU allow, by metric and by a warning in the log (docs/security.md).
"""

from __future__ import annotations

import logging
from collections import defaultdict
from collections.abc import Callable, Iterator

import grpc
from prometheus_client import Counter, Gauge, Histogram
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from prometheus_client.registry import Collector, CollectorRegistry

from deviceplugin.driveruse import (
    GpuProcess,
    PodMemory,
    allowed_bytes,
    gpu_holders,
    nvml_processes,
    pod_uid_of,
    unmanaged_bytes,
)
from nodeagent.containermetrics import container_families, served_series
from nodeagent.gpumetrics import GPU_LABELS, gpu_families
from nodeagent.nvml import GpuReading
from nodeagent.records import ServedRecord
from nodeagent.statedir import ContainerDir, StateDir
from tessera.contract import MIB, GpuInfo, NodeGpuUsage, QosClass

log = logging.getLogger(__name__)

POD_LABELS = ("namespace", "pod", "Hostname", "UUID", "modelName")


# Allocate reads the pod from the agent's cache (milliseconds) or, on a miss, from the API server
# (tens of milliseconds); the kubelet gives up on it after its own timeout. 15 and 20 ms resolve the
# objective docs/benchmarks.md measures against (p99 at most 20 ms).
ALLOCATE_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.015, 0.02, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0)
# The statuses Allocate refuses with (deviceplugin/kubelet.py), each series there at 0 from the start.
ALLOCATE_ERROR_CODES = (grpc.StatusCode.FAILED_PRECONDITION, grpc.StatusCode.UNAVAILABLE)


def mps_daemon_gauge(registry: CollectorRegistry) -> Gauge:
    """On a node in MPS mode only: whether the node's MPS control daemon runs."""
    return Gauge(
        "tessera_device_plugin_mps_daemon_running",
        "On a node in MPS mode: 1 while the node's MPS control daemon runs (its pid file names a live "
        "process of the control program, which the tessera-mps-control container starts), else 0",
        registry=registry,
    )


class PluginMetrics:
    """What the kubelet sees of the device plugin: Allocate's latency and refusals, registration; and
    the live resizes it followed."""

    def __init__(self, registry: CollectorRegistry) -> None:
        self.allocate_latency = Histogram(
            "tessera_device_plugin_allocate_seconds",
            "Time to answer the kubelet's Allocate, refusals included",
            buckets=ALLOCATE_BUCKETS,
            registry=registry,
        )
        self.allocate_errors = Counter(
            "tessera_device_plugin_allocate_errors",
            "Allocate calls refused, by gRPC status (FAILED_PRECONDITION: the pod's allocation is "
            "wrong; UNAVAILABLE: the API server could not be read)",
            ["code"],
            registry=registry,
        )
        for code in ALLOCATE_ERROR_CODES:
            self.allocate_errors.labels(code.name)
        self.registered = Gauge(
            "tessera_device_plugin_registered",
            "1 while the device plugin is registered with the kubelet it serves, 0 before and between",
            registry=registry,
        )
        self.resizes_followed = Counter(
            "tessera_device_plugin_resizes_followed",
            "Containers whose limits file was rewritten for a live resize (docs/placement.md)",
            registry=registry,
        )
        self.best_effort_evictions = Counter(
            "tessera_device_plugin_best_effort_evictions",
            "Best-effort pods evicted because guaranteed containers waited for the memory they borrowed "
            "(docs/deviceplugin.md)",
            registry=registry,
        )


Inventory = tuple[GpuInfo, ...]
Records = list[tuple[ContainerDir, ServedRecord]]


class AgentCollector(Collector):
    def __init__(
        self,
        node: str,
        inventory: Callable[[], tuple[GpuInfo, ...]],
        reading: Callable[[str], GpuReading | None],
        state: StateDir,
        *,
        processes: Callable[[str], tuple[GpuProcess, ...] | None] = nvml_processes,
        pod_of_pid: Callable[[int], str | None] = pod_uid_of,
        measured: Callable[[], NodeGpuUsage | None] = lambda: None,
    ) -> None:
        self._node = node
        self._inventory = inventory
        self._reading = reading
        self._state = state
        self._processes = processes
        self._pod_of_pid = pod_of_pid
        self._measured = measured  # each GPU's use as the node agent publishes it
        # (pod UID, GPU) found over quota at the last scrape: each is logged when it starts and ends.

    def collect(self) -> Iterator[GaugeMetricFamily | CounterMetricFamily]:
        # One read of the inventory and of the served records per scrape, shared by every family.
        inventory = self._inventory()
        records = [(where, record) for where, record in self._state.records()]
        series = [served_series(where, record) for where, record in records]
        unhealthy = {gpu.uuid for gpu in inventory if not gpu.healthy}
        quotas = (quota for one in series for quota in one.quotas)
        yield from gpu_families(self._node, inventory, unhealthy, quotas, self._reading)
        yield from self._slice_metrics(inventory, records)
        yield from container_families(self._node, {gpu.uuid: gpu.model for gpu in inventory}, series)
        yield from self._driver_crosscheck(inventory, records)
        yield from self._oversubscription_metrics(inventory, records)

    def _oversubscription_metrics(
        self, inventory: Inventory, records: Records
    ) -> Iterator[GaugeMetricFamily | CounterMetricFamily]:
        """Best-effort containers that borrow memory (docs/deviceplugin.md), and the measured use
        the node annotation publishes."""
        oversubscribed = GaugeMetricFamily(
            "tessera_gpu_oversubscribed",
            "1 while best-effort containers borrow memory of the GPU that guaranteed ones were promised",
            labels=GPU_LABELS,
        )
        refused = CounterMetricFamily(
            "tessera_gpu_best_effort_allocations_refused",
            "Allocations of best-effort containers that borrow the GPU's memory refused by their quota "
            "(what the others leave unused; counted while they run)",
            labels=GPU_LABELS,
        )
        measured_used = GaugeMetricFamily(
            "tessera_gpu_measured_memory_used_bytes",
            "GPU memory its containers hold, as published in the node's gpu-usage annotation",
            labels=GPU_LABELS,
        )
        measured_guaranteed = GaugeMetricFamily(
            "tessera_gpu_measured_guaranteed_memory_used_bytes",
            "Of that, what guaranteed (standard, latency-critical) containers hold",
            labels=GPU_LABELS,
        )
        measured_utilization = GaugeMetricFamily(
            "tessera_gpu_measured_utilization_ratio",
            "GPU utilisation as published in the node's gpu-usage annotation, 0..1",
            labels=GPU_LABELS,
        )
        borrowing: dict[str, list[ContainerDir]] = defaultdict(list)
        for where, record in records:
            for grant in record.gpus:
                if grant.oversubscribed and record.qos == QosClass.BEST_EFFORT:
                    borrowing[grant.uuid].append(where)
        measured = self._measured()
        by_uuid = {g.uuid: g for g in measured.gpus} if measured is not None else {}
        for gpu in inventory:
            labels = (self._node, gpu.uuid, gpu.model)
            oversubscribed.add_metric(labels, 1.0 if borrowing.get(gpu.uuid) else 0.0)
            usages = [where.usage() for where in borrowing.get(gpu.uuid, [])]
            devices = [u.device(gpu.uuid) for u in usages if u is not None]
            refused.add_metric(labels, sum(d.allocations_refused for d in devices if d is not None))
            use = by_uuid.get(gpu.uuid)
            if use is not None:
                measured_used.add_metric(labels, use.memory_used_mib * MIB)
                measured_guaranteed.add_metric(labels, use.guaranteed_used_mib * MIB)
                measured_utilization.add_metric(labels, use.utilization_percent / 100)
        yield from (oversubscribed, refused, measured_used, measured_guaranteed, measured_utilization)

    def _slice_metrics(self, inventory: Inventory, records: Records) -> Iterator[GaugeMetricFamily]:
        """The slices each GPU advertises to the kubelet, and those its served containers use."""
        slices = GaugeMetricFamily(
            "tessera_gpu_slices", "Slices advertised to the kubelet", labels=GPU_LABELS
        )
        slices_used = GaugeMetricFamily(
            "tessera_gpu_slices_used", "Containers served on the GPU (one slice each)", labels=GPU_LABELS
        )
        served: dict[str, int] = defaultdict(int)
        for _, record in records:
            for grant in record.gpus:
                served[grant.uuid] += 1
        for gpu in inventory:
            labels = (self._node, gpu.uuid, gpu.model)
            slices.add_metric(labels, gpu.split)
            slices_used.add_metric(labels, served[gpu.uuid])
        yield from (slices, slices_used)

    def _driver_crosscheck(self, inventory: Inventory, records: Records) -> Iterator[GaugeMetricFamily]:
        """Per pod and GPU: device memory its processes hold by NVML, and whether that exceeds what
        its containers' quotas allow there (whatever their regions say); per GPU, what processes of
        pods Tessera did not give it, or of no pod, hold (the node agent acts on both and records
        the events: :mod:`deviceplugin.driveruse`)."""
        held = GaugeMetricFamily(
            "tessera_pod_gpu_memory_driver_bytes",
            "GPU memory the pod's processes hold, as the driver (NVML) reports it",
            labels=POD_LABELS,
        )
        over = GaugeMetricFamily(
            "tessera_pod_gpu_memory_over_quota",
            "1 if the pod's processes hold more GPU memory than its quotas allow (by NVML)",
            labels=POD_LABELS,
        )
        unmanaged = GaugeMetricFamily(
            "tessera_gpu_memory_unmanaged_bytes",
            "GPU memory held by processes of pods Tessera did not give this GPU, or of no pod (by NVML)",
            labels=GPU_LABELS,
        )
        quota: dict[tuple[str, str], int] = defaultdict(int)
        names: dict[str, tuple[str, str]] = {}
        for _, record in records:
            names[record.pod_uid] = (record.namespace, record.pod)
            for grant in record.gpus:
                quota[record.pod_uid, grant.uuid] += grant.memory_quota_mib * MIB
        for gpu in inventory:
            holders = gpu_holders(gpu.uuid, self._processes, self._pod_of_pid)
            if holders is None:
                continue
            served = {uid for uid, uuid in quota if uuid == gpu.uuid}
            unmanaged.add_metric(
                (self._node, gpu.uuid, gpu.model), sum(unmanaged_bytes(served, holders).values())
            )
            for pod_uid, (namespace, pod) in names.items():
                if (pod_uid, gpu.uuid) not in quota and pod_uid not in holders.pods:
                    continue
                labels = (namespace, pod, self._node, gpu.uuid, gpu.model)
                driver = holders.pods.get(pod_uid, PodMemory(0, ()))
                held.add_metric(labels, driver.used_bytes)
                over.add_metric(
                    labels,
                    1.0 if driver.used_bytes > allowed_bytes(quota[pod_uid, gpu.uuid], driver) else 0.0,
                )
        yield from (held, over, unmanaged)
