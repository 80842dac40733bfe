"""The DRA driver's /metrics: the per-container series (nodeagent/containermetrics.py) of each claim
it prepared, read at scrape time from the prepared records and the claims' accounting regions, as the
device plugin serves its containers'."""

from __future__ import annotations

from collections.abc import Iterator, Sequence

from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from prometheus_client.registry import Collector

from nodeagent.containermetrics import container_families, prepared_series
from nodeagent.statedir import StateDir
from tessera.contract import GpuInfo


class ClaimCollector(Collector):
    def __init__(self, node: str, gpus: Sequence[GpuInfo], state: StateDir) -> None:
        self._node = node
        self._models = {gpu.uuid: gpu.model for gpu in gpus}
        self._state = state

    def collect(self) -> Iterator[GaugeMetricFamily | CounterMetricFamily]:
        claims = (prepared_series(where, record) for where, record in self._state.prepared_records())
        yield from container_families(self._node, self._models, claims)
