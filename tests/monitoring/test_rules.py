"""The alerts (deploy/prometheus/tessera-alerts.yaml): promtool checks the rule file, and each alert has
a unit test of its own under tests/monitoring/rules/ (``promtool test rules``), run here; promtool
also checks the plain-Prometheus scrape config and the sandbox's. promtool is the project's build
(hack/prometheus-binaries.sh), the same version as the Prometheus the sandbox runs."""

from __future__ import annotations

import re
import shutil
import subprocess
from pathlib import Path

import pytest
import yaml

from sandbox import monitoring
from tests.monitoring.dashboard_queries import exporter_sources

HERE = Path(__file__).parent
SERVICE_ACCOUNT_TOKEN = "/var/run/secrets/kubernetes.io/serviceaccount/token"
RULE_TESTS = sorted((HERE / "rules").glob("*.yaml"))


def promtool() -> str:
    return str(monitoring.binary("promtool"))


def rule_file(repo_root: Path) -> Path:
    return repo_root / "deploy" / "prometheus" / "tessera-alerts.yaml"


def alerts(repo_root: Path) -> list[dict[str, object]]:
    groups = yaml.safe_load(rule_file(repo_root).read_text())["groups"]
    return [rule for group in groups for rule in group["rules"]]


@pytest.mark.prometheus
def test_promtool_accepts_the_rule_file(repo_root: Path) -> None:
    result = subprocess.run(
        [promtool(), "check", "rules", str(rule_file(repo_root))], capture_output=True, text=True, check=False
    )
    assert result.returncode == 0, result.stdout + result.stderr


def test_the_chart_reads_the_same_rule_file(repo_root: Path) -> None:
    linked = repo_root / "charts" / "tessera" / "files" / "tessera-alerts.yaml"
    assert linked.resolve() == rule_file(repo_root).resolve()


def test_every_alert_has_a_unit_test_and_every_test_an_alert(repo_root: Path) -> None:
    names = {str(rule["alert"]) for rule in alerts(repo_root)}
    assert names == {path.stem for path in RULE_TESTS}
    for path in RULE_TESTS:
        tested = {
            t["alertname"]
            for case in yaml.safe_load(path.read_text())["tests"]
            for t in case["alert_rule_test"]
        }
        assert tested == {path.stem}, path.name


@pytest.mark.prometheus
@pytest.mark.parametrize("test_file", RULE_TESTS, ids=[p.stem for p in RULE_TESTS])
def test_alert_unit_test(test_file: Path) -> None:
    result = subprocess.run(
        [promtool(), "test", "rules", test_file.name],
        cwd=test_file.parent,
        capture_output=True,
        text=True,
        check=False,
    )
    assert result.returncode == 0, result.stdout + result.stderr


def test_alerts_query_only_metrics_the_components_export(repo_root: Path) -> None:
    exported = exporter_sources(repo_root)
    names = {
        re.sub(r"_(total|bucket|count|sum)$", "", m)
        for rule in alerts(repo_root)
        for m in re.findall(r"tessera_[a-z_]+", str(rule["expr"]))
    }
    assert names
    missing = sorted(n for n in names if f'"{n}"' not in exported)
    assert not missing, f"alerts query metrics nobody exports: {missing}"


def check_config(path: Path) -> None:
    result = subprocess.run(
        [promtool(), "check", "config", str(path)], capture_output=True, text=True, check=False
    )
    assert result.returncode == 0, result.stdout + result.stderr


@pytest.mark.prometheus
def test_promtool_accepts_the_plain_scrape_config_and_the_sandboxs(tmp_path: Path) -> None:
    # promtool wants the token file to exist: a pod's service account token, here a file of ours.
    token = tmp_path / "token"
    token.write_text("a-token")
    shipped = monitoring.SCRAPE_CONFIG.read_text()
    (tmp_path / "scrape-config.yaml").write_text(shipped.replace(SERVICE_ACCOUNT_TOKEN, str(token)))
    shutil.copy(monitoring.RULE_FILE, tmp_path / monitoring.RULE_FILE.name)  # its rule file beside it
    check_config(tmp_path / "scrape-config.yaml")
    kubeconfig = tmp_path / "kubeconfig"
    kubeconfig.write_text("apiVersion: v1\nkind: Config\n")
    sandbox_config = tmp_path / "prometheus.yml"
    sandbox_config.write_text(yaml.safe_dump(monitoring.config(kubeconfig, token)))
    check_config(sandbox_config)


def test_plain_prometheus_config_honors_the_workload_labels(repo_root: Path) -> None:
    """What promtool cannot judge: honor_labels on every job and the job names the alerts use."""
    config = yaml.safe_load((repo_root / "deploy" / "prometheus" / "scrape-config.yaml").read_text())
    assert config["rule_files"] == ["tessera-alerts.yaml"]
    jobs = {job["job_name"]: job for job in config["scrape_configs"]}
    assert set(jobs) == {"tessera-device-plugin", "tessera-dra", "tessera-extender"}
    assert all(job["honor_labels"] is True for job in jobs.values())
    # Tessera's ports serve /metrics only to a token allowed get on /metrics (metricsAccess).
    assert all(job["authorization"] == {"credentials_file": SERVICE_ACCOUNT_TOKEN} for job in jobs.values())
    expressions = " ".join(str(rule["expr"]) for rule in alerts(repo_root))
    assert 'job="tessera-device-plugin"' in expressions


@pytest.mark.prometheus
def test_promtool_is_the_pinned_build_with_kubernetes_discovery(repo_root: Path) -> None:
    script = (repo_root / "hack" / "prometheus-binaries.sh").read_text()
    pinned = monitoring.PROMETHEUS_VERSION
    assert f'PROMETHEUS_VERSION="${{PROMETHEUS_VERSION:-{pinned}}}"' in script
    for name in monitoring.BINARIES:
        result = subprocess.run(
            [str(monitoring.binary(name)), "--version"], capture_output=True, text=True, check=True
        )
        assert f"{name}, version {pinned.removeprefix('v')} " in result.stdout, result.stdout
        assert "tags:             remove_all_sd,enable_kubernetes_sd" in result.stdout, result.stdout
