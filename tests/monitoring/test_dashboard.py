"""The Grafana dashboard is built by hack/dashboard.py with Grafana's SDK (grafana-foundation-sdk): the
committed JSON is its output, and its panels query the metrics and labels the components export."""

from __future__ import annotations

import json
import re
import subprocess
import sys
from pathlib import Path

import pytest

VARIABLES = {"datasource", "node", "gpu", "namespace", "pod"}


@pytest.fixture
def board(repo_root: Path) -> dict[str, object]:
    loaded: dict[str, object] = json.loads(
        (repo_root / "deploy" / "grafana" / "tessera-dashboard.json").read_text()
    )
    return loaded


def queries(board: dict[str, object]) -> list[str]:
    panels = board["panels"]
    templating = board["templating"]
    assert isinstance(panels, list) and isinstance(templating, dict)
    found = [str(t["expr"]) for p in panels for t in p.get("targets", [])]
    return found + [str(v["query"]) for v in templating["list"] if v["type"] == "query"]


def test_the_committed_dashboard_is_the_builders_output(repo_root: Path) -> None:
    result = subprocess.run(
        [sys.executable, str(repo_root / "hack" / "dashboard.py"), "--check"],
        capture_output=True,
        text=True,
        check=False,
    )
    assert result.returncode == 0, result.stderr


def test_the_chart_ships_the_same_dashboard(repo_root: Path) -> None:
    linked = repo_root / "charts" / "tessera" / "files" / "tessera-dashboard.json"
    assert linked.resolve() == (repo_root / "deploy" / "grafana" / "tessera-dashboard.json").resolve()


def test_panels_filter_by_the_template_variables(board: dict[str, object]) -> None:
    templating = board["templating"]
    assert isinstance(templating, dict)
    assert {v["name"] for v in templating["list"]} == VARIABLES
    for expr in queries(board):
        if "tessera_gpu_" in expr or "tessera_container_" in expr or "tessera_pod_" in expr:
            # Per-GPU and per-container series are filtered by node (and GPU) at least.
            assert 'Hostname=~"$node"' in expr or "label_values(tessera_gpu_healthy, Hostname)" in expr, expr
        if "tessera_container_" in expr and "label_values" not in expr:
            assert 'namespace=~"$namespace"' in expr and 'pod=~"$pod"' in expr, expr


def test_panels_use_only_the_exported_label_names(board: dict[str, object]) -> None:
    labels = {
        "Hostname",
        "UUID",
        "modelName",
        "namespace",
        "pod",
        "container",
        "verb",
        "result",
        "reason",
        "code",
        "le",
    }
    for expr in queries(board):
        used = set(re.findall(r"([A-Za-z_]+)=~", expr)) | set(re.findall(r"by \(([^)]*)\)", expr))
        names = {n.strip() for u in used for n in u.split(",")}
        assert names <= labels, (expr, names - labels)
    for old in ("gpu_uuid", "node=~", "model=~"):
        assert not any(old in expr for expr in queries(board)), old
