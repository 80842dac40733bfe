"""The chart's ServiceMonitors and PrometheusRule are accepted by the real kube-apiserver.

The CRDs applied (tests/monitoring/operator-crds.yaml) are minimal structural schemas written for
this test, not prometheus-operator's own files: they type the fields the chart uses, and the API
server's strict field validation (kubectl apply --server-side) refuses unknown or mistyped ones."""

from __future__ import annotations

import subprocess
import time
from pathlib import Path

import pytest
import yaml
from kubernetes import client

from sandbox.controlplane import ControlPlane, find_binaries

pytestmark = pytest.mark.k8s

HERE = Path(__file__).parent


def kubectl(
    control_plane: ControlPlane, *args: str, stdin: str | None = None
) -> subprocess.CompletedProcess[str]:
    binary = find_binaries(names=("kubectl",)) / "kubectl"
    return subprocess.run(
        [str(binary), f"--kubeconfig={control_plane.kubeconfig}", *args],
        input=stdin,
        capture_output=True,
        text=True,
        check=False,
    )


def render(repo_root: Path, namespace: str, *values: str) -> str:
    helm = find_binaries(names=("helm",)) / "helm"
    args = [str(helm), "template", "tessera", str(repo_root / "charts" / "tessera"), "--namespace", namespace]
    for value in values:
        args += ["--set", value]
    result = subprocess.run(args, capture_output=True, text=True, check=False)
    assert result.returncode == 0, result.stderr
    return result.stdout


def apply_until_accepted(control_plane: ControlPlane, manifest: str, timeout: float = 30) -> None:
    """Apply server-side; retried while the API server has not yet served a just-created CRD's kind."""
    deadline = time.monotonic() + timeout
    while True:
        applied = kubectl(control_plane, "apply", "--server-side", "-f", "-", stdin=manifest)
        if applied.returncode == 0:
            return
        if "no matches for kind" not in applied.stderr or time.monotonic() > deadline:
            raise AssertionError(applied.stderr)
        time.sleep(0.5)


SCRAPER = "tessera-metrics-scraper"


def test_the_charts_operator_objects_are_accepted(
    repo_root: Path, control_plane: ControlPlane, kube: client.ApiClient, namespace: str
) -> None:
    crds = (HERE / "operator-crds.yaml").read_text()
    # Both node agents' (mixed: the device plugin and the DRA driver, each on its own nodes).
    rendered = render(
        repo_root, namespace, "serviceMonitor.enabled=true", "prometheusRule.enabled=true", "mode=mixed"
    )
    # The monitoring template's objects only: the rest of the chart is test_chart.py's.
    ours = [
        d
        for d in yaml.safe_load_all(rendered)
        if d
        and (
            d["apiVersion"] == "monitoring.coreos.com/v1"
            or d["metadata"]["name"].endswith("-metrics")
            or d["metadata"]["name"].startswith(SCRAPER)
        )
    ]
    monitoring = "---\n".join(yaml.safe_dump(d) for d in ours)
    created = kubectl(control_plane, "apply", "--server-side", "-f", "-", stdin=crds)
    try:
        assert created.returncode == 0, created.stderr
        waited = kubectl(
            control_plane, "wait", "--for=condition=Established", "--timeout=30s", "-f", "-", stdin=crds
        )
        assert waited.returncode == 0, waited.stderr
        apply_until_accepted(control_plane, monitoring)
        objects = client.CustomObjectsApi(kube)
        monitors = objects.list_namespaced_custom_object(
            "monitoring.coreos.com", "v1", namespace, "servicemonitors"
        )
        by_name = {m["metadata"]["name"]: m["spec"] for m in monitors["items"]}
        assert set(by_name) == {"tessera-device-plugin", "tessera-dra", "tessera-extender"}
        for spec in by_name.values():
            assert spec["jobLabel"] == "app.kubernetes.io/name"
            assert [e["honorLabels"] for e in spec["endpoints"]] == [True]
            # The agents and extenders serve /metrics to a token allowed get /metrics only: the
            # chart's scraper's, from its token Secret, bound to the reader role.
            assert [e["authorization"] for e in spec["endpoints"]] == [
                {"type": "Bearer", "credentials": {"name": f"{SCRAPER}-token", "key": "token"}}
            ]
        secret = client.CoreV1Api(kube).read_namespaced_secret(f"{SCRAPER}-token", namespace)
        assert secret.type == "kubernetes.io/service-account-token"
        assert secret.metadata.annotations["kubernetes.io/service-account.name"] == SCRAPER
        (reader,) = [
            d
            for d in yaml.safe_load_all(rendered)
            if d and d["metadata"]["name"] == "tessera-metrics-reader" and d["kind"] == "ClusterRoleBinding"
        ]
        assert {"kind": "ServiceAccount", "name": SCRAPER, "namespace": namespace} in reader["subjects"]
        # The Services they select exist with the label that names the job.
        core = client.CoreV1Api(kube)
        for name, job in (
            ("tessera-device-plugin-metrics", "tessera-device-plugin"),
            ("tessera-dra-metrics", "tessera-dra"),
            ("tessera-extender-metrics", "tessera-extender"),
        ):
            service = core.read_namespaced_service(name, namespace)
            assert service.metadata.labels["app.kubernetes.io/name"] == job
            assert by_name[job]["selector"]["matchLabels"] == {"app.kubernetes.io/name": job}
        rule = objects.get_namespaced_custom_object(
            "monitoring.coreos.com", "v1", namespace, "prometheusrules", "tessera-alerts"
        )
        expected = yaml.safe_load((repo_root / "deploy" / "prometheus" / "tessera-alerts.yaml").read_text())
        assert rule["spec"]["groups"] == expected["groups"]
        # The schema is strict: a mistyped field is refused, so acceptance above means something.
        bad = monitoring.replace("honorLabels: true", "honorLabels: 'yes'", 1)
        refused = kubectl(control_plane, "apply", "--server-side", "--dry-run=server", "-f", "-", stdin=bad)
        assert refused.returncode != 0 and "honorLabels" in refused.stderr, refused.stderr
    finally:
        kubectl(control_plane, "delete", "--ignore-not-found", "--wait=false", "-f", "-", stdin=monitoring)
        kubectl(control_plane, "delete", "--ignore-not-found", "--wait=false", "-f", "-", stdin=crds)


def test_operator_objects_are_off_by_default(repo_root: Path) -> None:
    kinds = {d["kind"] for d in yaml.safe_load_all(render(repo_root, "tessera")) if d}
    assert not kinds & {"ServiceMonitor", "PrometheusRule"}
