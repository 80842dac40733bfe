#!/usr/bin/env python3
"""Build Tessera's Grafana dashboard with Grafana's own SDK (grafana-foundation-sdk, the test extra).

    .venv/bin/python hack/dashboard.py          write deploy/grafana/tessera-dashboard.json
    .venv/bin/python hack/dashboard.py --check  exit 1 if the committed file differs from the build

The chart ships the same file (charts/tessera/files/tessera-dashboard.json links to it). Why this SDK:
its builders are generated from Grafana's own schema (panel, variable and query types), so a field
Grafana does not know cannot be written, and the dashboard is reviewed as Python, not as 1,000 lines
of JSON. It is a tool dependency only: the product never imports it (tests/foundation/test_packaging.py).
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from grafana_foundation_sdk.builders import common, dashboard, prometheus, stat, timeseries
from grafana_foundation_sdk.cog.encoder import JSONEncoder
from grafana_foundation_sdk.models.common import LegendDisplayMode, LegendPlacement, TooltipDisplayMode
from grafana_foundation_sdk.models.dashboard import (
    DashboardCursorSync,
    DataSourceRef,
    VariableOption,
    VariableRefresh,
    VariableSort,
)

OUTPUT = Path(__file__).resolve().parent.parent / "deploy" / "grafana" / "tessera-dashboard.json"
DATASOURCE = DataSourceRef(type_val="prometheus", uid="${datasource}")
# Filters every per-GPU query takes (label names are dcgm-exporter's: docs/observability.md).
GPU = 'Hostname=~"$node", UUID=~"$gpu"'
CONTAINER = f'{GPU}, namespace=~"$namespace", pod=~"$pod"'


def query(expr: str, legend: str) -> prometheus.Dataquery:
    return prometheus.Dataquery().expr(expr).legend_format(legend).datasource(DATASOURCE)


class _Ids:
    """Panel ids in the order panels are made, so the JSON is the same on every build."""

    def __init__(self) -> None:
        self.last = 0

    def next(self) -> int:
        self.last += 1
        return self.last


_ids = _Ids()


def series(title: str, unit: str, description: str, *queries: prometheus.Dataquery) -> timeseries.Panel:
    panel = (
        timeseries.Panel()
        .id(_ids.next())
        .title(title)
        .unit(unit)
        .description(description)
        .datasource(DATASOURCE)
        .height(8)
        .span(12)
        .min(0)
        .legend(
            common.VizLegendOptions()
            .show_legend(True)
            .display_mode(LegendDisplayMode.LIST)
            .placement(LegendPlacement.BOTTOM)
        )
        .tooltip(common.VizTooltipOptions().mode(TooltipDisplayMode.MULTI))
    )
    for ref, q in zip("ABCD", queries, strict=False):
        panel = panel.with_target(q.ref_id(ref))
    return panel


def single(title: str, description: str, *queries: prometheus.Dataquery) -> stat.Panel:
    panel = (
        stat.Panel()
        .id(_ids.next())
        .title(title)
        .description(description)
        .datasource(DATASOURCE)
        .height(4)
        .span(6)
        .reduce_options(common.ReduceDataOptions().calcs(["lastNotNull"]).values(False))
    )
    for ref, q in zip("ABCD", queries, strict=False):
        panel = panel.with_target(q.ref_id(ref))
    return panel


def variable(name: str, label: str, expr: str) -> dashboard.QueryVariable:
    return (
        dashboard.QueryVariable(name)
        .label(label)
        .query(expr)
        .datasource(DATASOURCE)
        .multi(True)
        .include_all(True)
        .all_value(".*")
        .current(VariableOption(selected=True, text="All", value="$__all"))
        .refresh(VariableRefresh.ON_TIME_RANGE_CHANGED)
        .sort(VariableSort.ALPHABETICAL_ASC)
    )


def build() -> dashboard.Dashboard:
    board = (
        dashboard.Dashboard("Tessera: shared GPUs")
        .uid("tessera-gpus")
        .tags(["tessera", "gpu"])
        .time("now-1h", "now")
        .refresh("30s")
        .tooltip(DashboardCursorSync.CROSSHAIR)
        .with_variable(dashboard.DatasourceVariable("datasource").label("Data source").type("prometheus"))
        .with_variable(variable("node", "Node", "label_values(tessera_gpu_healthy, Hostname)"))
        .with_variable(variable("gpu", "GPU", 'label_values(tessera_gpu_healthy{Hostname=~"$node"}, UUID)'))
        .with_variable(
            variable(
                "namespace",
                "Namespace",
                f"label_values(tessera_container_memory_quota_bytes{{{GPU}}}, namespace)",
            )
        )
        .with_variable(
            variable(
                "pod",
                "Pod",
                f'label_values(tessera_container_memory_quota_bytes{{{GPU}, namespace=~"$namespace"}}, pod)',
            )
        )
    )
    board = (
        board.with_row(dashboard.Row("GPUs").id(_ids.next()))
        .with_panel(
            single(
                "Unhealthy GPUs",
                "GPUs the node agent marks unhealthy (fatal XID or lost): their slices are withdrawn.",
                query(f"count(tessera_gpu_healthy{{{GPU}}} == 0) or vector(0)", "unhealthy"),
            )
        )
        .with_panel(
            single(
                "Slices in use / advertised",
                "Containers served (one slice each) against the slices advertised to the kubelets.",
                query(f"sum(tessera_gpu_slices_used{{{GPU}}})", "in use"),
                query(f"sum(tessera_gpu_slices{{{GPU}}})", "advertised"),
            )
        )
        .with_panel(
            single(
                "GPU memory allocated",
                "Memory quotas of the served containers over the GPUs' capacity.",
                query(
                    f"sum(tessera_gpu_memory_allocated_bytes{{{GPU}}})"
                    f" / sum(tessera_gpu_memory_capacity_bytes{{{GPU}}})",
                    "allocated",
                ),
            ).unit("percentunit")
        )
        .with_panel(
            single(
                "GPU cores allocated",
                "Compute quotas of the served containers over the GPUs' time.",
                query(
                    f"sum(tessera_gpu_cores_allocated_ratio{{{GPU}}})"
                    f" / count(tessera_gpu_cores_allocated_ratio{{{GPU}}})",
                    "allocated",
                ),
            ).unit("percentunit")
        )
        .with_panel(
            series(
                "GPU memory allocated against capacity",
                "bytes",
                "Per GPU: the sum of the memory quotas of its containers, and the memory it has. "
                "Allocated above capacity must never happen (alert TesseraGpuMemoryOvercommitted).",
                query(f"tessera_gpu_memory_allocated_bytes{{{GPU}}}", "{{Hostname}} {{UUID}} allocated"),
                query(f"tessera_gpu_memory_capacity_bytes{{{GPU}}}", "{{Hostname}} {{UUID}} capacity"),
            )
        )
        .with_panel(
            series(
                "GPU cores allocated",
                "percentunit",
                "Per GPU: the sum of the compute quotas of its containers (1 = all of its time).",
                query(f"tessera_gpu_cores_allocated_ratio{{{GPU}}}", "{{Hostname}} {{UUID}}"),
            )
        )
        .with_panel(
            series(
                "GPU memory in use (driver)",
                "bytes",
                "Per GPU, as NVML reports it: memory in use and total.",
                query(f"tessera_gpu_memory_used_bytes{{{GPU}}}", "{{Hostname}} {{UUID}} used"),
                query(f"tessera_gpu_memory_total_bytes{{{GPU}}}", "{{Hostname}} {{UUID}} total"),
            )
        )
        .with_panel(
            series(
                "GPU utilization",
                "percentunit",
                "Per GPU, as NVML reports it: the share of time a kernel ran.",
                query(f"tessera_gpu_utilization_ratio{{{GPU}}}", "{{Hostname}} {{UUID}}"),
            )
        )
    )
    board = (
        board.with_row(dashboard.Row("Containers").id(_ids.next()))
        .with_panel(
            series(
                "Container GPU memory: used against quota",
                "bytes",
                "Per container and GPU: device memory its processes hold (the hook's region), the most "
                "they have held, and its quota.",
                query(
                    f"tessera_container_memory_used_bytes{{{CONTAINER}}}",
                    "{{namespace}}/{{pod}} {{container}} used",
                ),
                query(
                    f"tessera_container_memory_peak_bytes{{{CONTAINER}}}",
                    "{{namespace}}/{{pod}} {{container}} peak",
                ),
                query(
                    f"tessera_container_memory_quota_bytes{{{CONTAINER}}}",
                    "{{namespace}}/{{pod}} {{container}} quota",
                ),
            )
        )
        .with_panel(
            series(
                "Container GPU time: achieved against quota",
                "percentunit",
                "Per container and GPU: device time of its kernels per second, and its compute quota.",
                query(
                    f"rate(tessera_container_gpu_busy_seconds_total{{{CONTAINER}}}[$__rate_interval])",
                    "{{namespace}}/{{pod}} {{container}} achieved",
                ),
                query(
                    f"tessera_container_compute_quota_ratio{{{CONTAINER}}}",
                    "{{namespace}}/{{pod}} {{container}} quota",
                ),
            )
        )
        .with_panel(
            series(
                "Time throttled by the compute quota",
                "percentunit",
                "Per container and GPU: the share of time its kernel launches were held back.",
                query(
                    f"rate(tessera_container_throttled_seconds_total{{{CONTAINER}}}[$__rate_interval])",
                    "{{namespace}}/{{pod}} {{container}}",
                ),
            )
        )
        .with_panel(
            series(
                "Allocations refused by the memory quota",
                "short",
                "Per container and GPU: allocations the hook refused with CUDA out of memory "
                "(alert TesseraContainerAllocationsRefused).",
                query(
                    f"increase(tessera_container_allocations_refused_total{{{CONTAINER}}}[$__rate_interval])",
                    "{{namespace}}/{{pod}} {{container}}",
                ),
            )
        )
        .with_panel(
            series(
                "Pods over their quotas by the driver",
                "short",
                "1 while the driver reports more memory for a pod's processes than its quotas allow "
                "(its accounting region bypassed; alert TesseraPodOverQuotaByDriver).",
                query(
                    f'tessera_pod_gpu_memory_over_quota{{{GPU}, namespace=~"$namespace", pod=~"$pod"}}',
                    "{{namespace}}/{{pod}} {{UUID}}",
                ),
            )
        )
    )
    board = (
        board.with_row(dashboard.Row("Node agents").id(_ids.next()))
        .with_panel(
            series(
                "Allocate latency p99",
                "s",
                "The node agents' answer time to the kubelet's Allocate (a container waits on it to start).",
                query(
                    "histogram_quantile(0.99, sum by (le) "
                    "(rate(tessera_device_plugin_allocate_seconds_bucket[$__rate_interval])))",
                    "p99",
                ),
            )
        )
        .with_panel(
            series(
                "Allocate refusals by status",
                "ops",
                "Allocate calls refused: FAILED_PRECONDITION (the pod's allocation is wrong, the pod "
                "fails), UNAVAILABLE (the API server could not be read).",
                query(
                    "sum by (code) (rate(tessera_device_plugin_allocate_errors_total[$__rate_interval]))",
                    "{{code}}",
                ),
            )
        )
        .with_panel(
            single(
                "Agents registered with their kubelet",
                "Node agents registered as device plugins, of those scraped.",
                query("sum(tessera_device_plugin_registered)", "registered"),
                query("count(tessera_device_plugin_registered)", "agents"),
            )
        )
    )
    board = (
        board.with_row(dashboard.Row("Extender").id(_ids.next()))
        .with_panel(
            series(
                "Extender latency p99 by verb",
                "s",
                "The extender's answer time to kube-scheduler "
                "(budget: filter and prioritize 100 ms, bind 1 s).",
                query(
                    "histogram_quantile(0.99, sum by (le, verb) "
                    "(rate(tessera_extender_request_seconds_bucket[$__rate_interval])))",
                    "{{verb}}",
                ),
            )
        )
        .with_panel(
            series(
                "Extender binds, failures and resizes",
                "ops",
                "Binds by result, refused or failed binds by reason, and live resizes by result (applied, "
                "refused: docs/placement.md, Live resize).",
                query("sum by (result) (rate(tessera_extender_binds_total[$__rate_interval]))", "{{result}}"),
                query(
                    "sum by (reason) (rate(tessera_extender_bind_failures_total[$__rate_interval]))",
                    "failed: {{reason}}",
                ),
                query(
                    "sum by (result) (rate(tessera_extender_resizes_total[$__rate_interval]))",
                    "resize: {{result}}",
                ),
            )
        )
        .with_panel(
            series(
                "Filter decisions and Pending reasons",
                "ops",
                "Pods with a feasible node or none, and nodes rejected for pods that fit nowhere, by "
                "shortfall (the reasons Pending pods show).",
                query(
                    "sum by (result) (rate(tessera_extender_pods_filtered_total[$__rate_interval]))",
                    "{{result}}",
                ),
                query(
                    "sum by (reason) (rate(tessera_extender_node_rejections_total[$__rate_interval]))",
                    "rejected: {{reason}}",
                ),
            )
        )
        .with_panel(
            single(
                "Nodes with a Tessera inventory",
                "Nodes the extender holds a GPU inventory for.",
                query("max(tessera_extender_nodes)", "nodes"),
            )
        )
    )
    return board


def render() -> str:
    _ids.last = 0
    return json.dumps(build().build(), cls=JSONEncoder, indent=2, sort_keys=True) + "\n"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--check", action="store_true", help="fail if the committed dashboard is stale")
    parser.add_argument("--output", type=Path, default=OUTPUT)
    args = parser.parse_args(argv)
    text = render()
    if args.check:
        if args.output.read_text() != text:
            print(f"{args.output} is stale: run hack/dashboard.py", file=sys.stderr)
            return 1
        return 0
    args.output.write_text(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
