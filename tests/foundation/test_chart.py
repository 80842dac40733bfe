"""The Helm chart: it lints, the plain manifests under deploy/ are rendered from it, and its output
is accepted by the real kube-apiserver."""

from __future__ import annotations

import json
import re
import subprocess
from pathlib import Path

import pytest
import yaml
from kubernetes import client

from sandbox.controlplane import ControlPlane, find_binaries
from tessera.contract import KEYS

pytestmark = pytest.mark.k8s


def helm(*args: str) -> str:
    binary = find_binaries(names=("helm",)) / "helm"
    result = subprocess.run([str(binary), *args], capture_output=True, text=True, check=False)
    assert result.returncode == 0, result.stderr
    return result.stdout


def test_chart_lints(repo_root: Path) -> None:
    helm("lint", "--strict", str(repo_root / "charts" / "tessera"))


def test_deploy_manifests_are_rendered_from_the_chart(repo_root: Path) -> None:
    result = subprocess.run(
        [str(repo_root / "hack" / "render-manifests.sh"), "--check"],
        capture_output=True,
        text=True,
        check=False,
    )
    assert result.returncode == 0, result.stdout + result.stderr


def test_chart_uses_the_configured_domain(repo_root: Path) -> None:
    rendered = helm("template", "t", str(repo_root / "charts" / "tessera"), "--set", "domain=gpu.example.com")
    docs = [d for d in yaml.safe_load_all(rendered) if d]
    config = next(d for d in docs if d["kind"] == "ConfigMap" and d["metadata"]["name"].endswith("-config"))
    scheduler = yaml.safe_load(config["data"]["config.yaml"])
    names = [r["name"] for r in scheduler["extenders"][0]["managedResources"]]
    assert names == ["gpu.example.com/vgpu", "gpu.example.com/vgpu-memory", "gpu.example.com/vgpu-cores"]
    default = helm("template", "t", str(repo_root / "charts" / "tessera"))
    assert all(name in default for name in KEYS.resources)


def _scheduler_and_extender(rendered: str) -> tuple[dict[str, object], list[str]]:
    """The chart's scheduler extender configuration and the extender container's arguments."""
    docs = [d for d in yaml.safe_load_all(rendered) if d]
    config = next(d for d in docs if d["kind"] == "ConfigMap" and d["metadata"]["name"].endswith("-config"))
    deployment = next(d for d in docs if d["kind"] == "Deployment" and "extender" in d["metadata"]["name"])
    [container] = deployment["spec"]["template"]["spec"]["containers"]
    return yaml.safe_load(config["data"]["config.yaml"])["extenders"][0], container["args"]


def test_chart_pairs_the_filter_mode_with_the_scheduler_verbs(repo_root: Path) -> None:
    chart = str(repo_root / "charts" / "tessera")
    extender, args = _scheduler_and_extender(helm("template", "t", chart))
    assert "prioritizeVerb" not in extender
    assert "--filter-keeps=best" in args
    extender, args = _scheduler_and_extender(
        helm("template", "t", chart, "--set", "extender.filterKeeps=all")
    )
    assert (extender["prioritizeVerb"], extender["weight"]) == ("prioritize", 10)
    assert "--filter-keeps=all" in args


def test_one_chart_value_sets_the_in_flight_timeout_of_both_sides(repo_root: Path) -> None:
    rendered = helm("template", "t", str(repo_root / "charts" / "tessera"), "--set", "inflightTimeout=42")
    docs = [d for d in yaml.safe_load_all(rendered) if d]
    args = {
        d["kind"]: d["spec"]["template"]["spec"]["containers"][0]["args"]
        for d in docs
        if d["kind"] in ("DaemonSet", "Deployment") and "scheduler" not in d["metadata"]["name"]
    }
    assert set(args) == {"DaemonSet", "Deployment"}
    for kind, given in args.items():
        assert [a for a in given if a.startswith("--inflight-timeout")] == ["--inflight-timeout=42"], kind


def test_chart_output_is_accepted_by_the_api_server(
    repo_root: Path, control_plane: ControlPlane, kube: client.ApiClient
) -> None:
    namespace = "tessera-system"
    client.CoreV1Api(kube).create_namespace({"metadata": {"name": namespace}})
    rendered = helm("template", "tessera", str(repo_root / "charts" / "tessera"), "--namespace", namespace)
    kubectl = [str(find_binaries(names=("kubectl",)) / "kubectl"), f"--kubeconfig={control_plane.kubeconfig}"]
    applied = subprocess.run(
        [*kubectl, "apply", "--server-side", "-f", "-"],
        input=rendered,
        capture_output=True,
        text=True,
        check=False,
    )
    try:
        assert applied.returncode == 0, applied.stderr
        apps = client.AppsV1Api(kube)
        assert apps.read_namespaced_daemon_set(
            "tessera-device-plugin", namespace
        ).spec.template.spec.containers
        assert apps.read_namespaced_deployment("tessera-extender", namespace).spec.replicas == 1
        assert apps.read_namespaced_deployment("tessera-scheduler", namespace)
        speed = client.CoreV1Api(kube).read_namespaced_config_map("tessera-speed-profiles", namespace)
        assert yaml.safe_load(speed.data["speed-profiles.yaml"]) == yaml.safe_load(
            (repo_root / "deploy" / "speed-profiles.yaml").read_text()
        )
        dashboard = client.CoreV1Api(kube).read_namespaced_config_map("tessera-dashboard", namespace)
        assert dashboard.metadata.labels["grafana_dashboard"] == "1"
    finally:
        subprocess.run(
            [*kubectl, "delete", "--ignore-not-found", "--wait=false", "-f", "-"],
            input=rendered,
            capture_output=True,
            text=True,
            check=False,
        )


def test_dashboard_queries_only_metrics_the_components_export(repo_root: Path) -> None:
    dashboard = json.loads((repo_root / "deploy" / "grafana" / "tessera-dashboard.json").read_text())
    queries = [t["expr"] for p in dashboard["panels"] for t in p.get("targets", [])]
    queries += [v["query"] for v in dashboard["templating"]["list"] if v["type"] == "query"]
    exported = (repo_root / "deviceplugin" / "metrics.py").read_text() + (
        repo_root / "extender" / "metrics.py"
    ).read_text()
    names = {re.sub(r"_(total|bucket)$", "", m) for q in queries for m in re.findall(r"tessera_[a-z_]+", q)}
    assert names, "the dashboard queries no Tessera metric"
    missing = sorted(n for n in names if f'"{n}"' not in exported)
    assert not missing, f"dashboard queries metrics nobody exports: {missing}"
