"""A Prometheus HTTP API client for tests, and the dashboard's queries as Prometheus runs them: every
panel's every target and every template variable, with the variables filled in. Shared by the
real-Prometheus test against static targets (tests/monitoring/test_prometheus.py) and the sandbox's
end-to-end test (tests/sandbox/test_monitoring.py)."""

from __future__ import annotations

import json
import re
import urllib.parse
import urllib.request
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

DASHBOARD = Path(__file__).resolve().parents[2] / "deploy" / "grafana" / "tessera-dashboard.json"
# The modules that declare every metric Tessera exports.
EXPORTERS = (
    "deviceplugin/metrics.py",
    "nodeagent/gpumetrics.py",
    "nodeagent/containermetrics.py",
    "extender/metrics.py",
)


def exporter_sources(repo_root: Path) -> str:
    """The text of :data:`EXPORTERS`, where an exported metric's name stands in quotes."""
    return "".join((repo_root / source).read_text() for source in EXPORTERS)


class Prometheus:
    def __init__(self, url: str) -> None:
        self.url = url

    def get(self, path: str, **params: str) -> Any:
        query = urllib.parse.urlencode(params)
        with urllib.request.urlopen(f"{self.url}{path}?{query}", timeout=10) as response:
            body = json.load(response)
        assert body["status"] == "success", body
        return body["data"]

    def query(self, expr: str) -> list[dict[str, Any]]:
        result: list[dict[str, Any]] = self.get("/api/v1/query", query=expr)["result"]
        return result


@dataclass(frozen=True, slots=True)
class PanelQuery:
    panel: str
    legend: str
    expr: str  # with the variables filled in


def substitute(expr: str, variables: Mapping[str, str]) -> str:
    """``variables`` maps ``$name`` to its value; longer names first, so ``$pod`` never eats ``$pods``."""
    for name in sorted(variables, key=len, reverse=True):
        expr = expr.replace(name, variables[name])
    return expr


def panel_queries(variables: Mapping[str, str]) -> Iterator[PanelQuery]:
    board = json.loads(DASHBOARD.read_text())
    for panel in board["panels"]:
        for target in panel.get("targets", []):
            yield PanelQuery(panel["title"], target["legendFormat"], substitute(target["expr"], variables))


def variable_values(prometheus: Prometheus, variables: Mapping[str, str]) -> dict[str, set[str]]:
    """Each query variable's values, its Grafana ``label_values(metric{...}, label)`` run as PromQL."""
    board = json.loads(DASHBOARD.read_text())
    values = {}
    for variable in board["templating"]["list"]:
        if variable["type"] != "query":
            continue
        found = re.fullmatch(r"label_values\((.*), *([A-Za-z_]+)\)", substitute(variable["query"], variables))
        assert found, variable["query"]
        selector, label = found.groups()
        result = prometheus.query(f"group by ({label}) ({selector})")
        values[variable["name"]] = {s["metric"][label] for s in result}
    return values
