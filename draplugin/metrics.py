"""The DRA driver's /metrics, read at scrape time from the prepared records and the claims'
accounting regions, as the device plugin serves its containers': the per-GPU series
(nodeagent/gpumetrics.py), each GPU's allocation the sum of the quotas of the claims prepared on it,
and the per-container series (nodeagent/containermetrics.py) of each claim."""

from __future__ import annotations

from collections.abc import Callable, Iterator, Sequence

from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from prometheus_client.registry import Collector

from nodeagent.containermetrics import container_families, prepared_series
from nodeagent.gpumetrics import gpu_families
from nodeagent.health import HealthState
from nodeagent.nvml import GpuReading
from nodeagent.statedir import StateDir
from tessera.contract import GpuInfo


class ClaimCollector(Collector):
    def __init__(
        self,
        node: str,
        gpus: Sequence[GpuInfo],
        state: StateDir,
        *,
        health: Callable[[], HealthState],
        reading: Callable[[str], GpuReading | None],
    ) -> None:
        self._node = node
        self._gpus = tuple(gpus)
        self._state = state
        self._health = health
        self._reading = reading

    def collect(self) -> Iterator[GaugeMetricFamily | CounterMetricFamily]:
        series = [prepared_series(where, record) for where, record in self._state.prepared_records()]
        unhealthy = {uuid for uuid, health in self._health().gpus.items() if not health.healthy}
        quotas = (quota for one in series for quota in one.quotas)
        yield from gpu_families(self._node, self._gpus, unhealthy, quotas, self._reading)
        yield from container_families(self._node, {gpu.uuid: gpu.model for gpu in self._gpus}, series)
