"""The per-container series (``tessera_container_*``) either node agent serves, read at scrape time:
one set per GPU of each container the device plugin served, and of each claim the DRA driver
prepared (whose containers share one limits file and one accounting region, so its quotas and its
use are the claim's, not any one container's).

Quotas come from the agent's own record (a container cannot write it); use comes from the hook's
accounting region, which the container writes, read as one reader for both paths
(:meth:`nodeagent.statedir.ContainerDir.usage`): a broken region reads as none, and the driver's
cross-check (the device plugin's ``tessera_pod_gpu_memory_*``) does not rest on it.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator, Mapping
from dataclasses import dataclass

from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

from hook.limits import DeviceLimit
from nodeagent.records import PreparedRecord, ServedRecord
from nodeagent.statedir import ContainerDir

# Label names are NVIDIA dcgm-exporter's (``Hostname``: the node's name, as dcgm-exporter sets it from
# NODE_NAME in Kubernetes; ``UUID``; ``modelName``), so Tessera's series and DCGM's join on ``UUID``
# (or on all three) without relabelling. The workload's ``namespace``, ``pod`` and ``container`` are
# the labels the Prometheus target also carries: scrape with honor_labels (docs/observability.md).
# ``claim``: the DRA claim's name (its namespace is its pods', ``namespace``); "" on the device
# plugin path. One label set for both paths, so a query or panel works on either.
CONTAINER_LABELS = ("namespace", "pod", "container", "claim", "Hostname", "UUID", "modelName")


@dataclass(frozen=True, slots=True)
class ContainerSeries:
    """What one set of per-container series describes: its labels, its quotas per GPU and its state
    directory, whose region holds its use."""

    namespace: str
    pod: str
    container: str
    claim: str
    quotas: tuple[DeviceLimit, ...]
    where: ContainerDir


def served_series(where: ContainerDir, record: ServedRecord) -> ContainerSeries:
    """A container the device plugin served."""
    return ContainerSeries(
        namespace=record.namespace,
        pod=record.pod,
        container=record.container,
        claim="",
        quotas=tuple(DeviceLimit.from_grant(grant) for grant in record.gpus),
        where=where,
    )


def prepared_series(where: ContainerDir, record: PreparedRecord) -> ContainerSeries:
    """A claim the DRA driver prepared: ``pod`` names the pod it was made for from its template,
    and ``container`` that pod's one container using it. Both are "" where the claim is not one
    pod's alone, or not one container's, so that no label names a part of a use that is the
    claim's."""
    return ContainerSeries(
        namespace=record.namespace,
        pod=record.pod,
        container=record.containers[0] if record.pod and len(record.containers) == 1 else "",
        claim=record.name,
        quotas=tuple(DeviceLimit(q.uuid, q.memory_quota_bytes, q.cores) for q in record.quotas),
        where=where,
    )


def container_families(
    node: str, models: Mapping[str, str], series: Iterable[ContainerSeries]
) -> Iterator[GaugeMetricFamily | CounterMetricFamily]:
    """The ``tessera_container_*`` families of ``series`` on node ``node``; ``models``: each GPU's
    model by UUID (a GPU gone from the inventory keeps its containers' series, with no model)."""
    quota = GaugeMetricFamily(
        "tessera_container_memory_quota_bytes", "GPU memory quota", labels=CONTAINER_LABELS
    )
    used = GaugeMetricFamily(
        "tessera_container_memory_used_bytes", "GPU memory the container holds", labels=CONTAINER_LABELS
    )
    peak = GaugeMetricFamily(
        "tessera_container_memory_peak_bytes",
        "The most GPU memory the container has held",
        labels=CONTAINER_LABELS,
    )
    refused = CounterMetricFamily(
        "tessera_container_allocations_refused",
        "GPU memory allocations the container's memory quota refused",
        labels=CONTAINER_LABELS,
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
    for one in series:
        usage = one.where.usage()
        for limit in one.quotas:
            labels = (
                one.namespace,
                one.pod,
                one.container,
                one.claim,
                node,
                limit.uuid,
                models.get(limit.uuid, ""),
            )
            quota.add_metric(labels, limit.memory_quota_bytes)
            cores.add_metric(labels, limit.cores / 100)
            device = usage.device(limit.uuid) if usage is not None else None
            used.add_metric(labels, device.memory_used_bytes if device else 0)
            peak.add_metric(labels, device.memory_peak_bytes if device else 0)
            refused.add_metric(labels, device.allocations_refused if device else 0)
            busy.add_metric(labels, device.busy_seconds if device else 0.0)
            throttled.add_metric(labels, device.throttled_seconds if device else 0.0)
    yield from (quota, used, peak, refused, cores, busy, throttled)
