"""The Helm chart: it lints, the plain manifests under deploy/ are rendered from it, and its output
is accepted by the real kube-apiserver."""

from __future__ import annotations

import json
import re
import subprocess
from pathlib import Path
from typing import Any

import pytest
import yaml
from kubernetes import client

from sandbox.controlplane import ControlPlane, find_binaries
from tessera.contract import KEYS, ContractError, Policy, SharingMode, keys_for
from tests.monitoring.dashboard_queries import exporter_sources

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


def _container(docs: list[dict[str, Any]], workload: str, container: str) -> dict[str, Any]:
    [found] = [
        c
        for d in docs
        if d["kind"] in ("DaemonSet", "Deployment") and d["metadata"]["name"] == workload
        for c in d["spec"]["template"]["spec"]["containers"]
        if c["name"] == container
    ]
    return dict(found)


def _scheduler_and_extender(rendered: str) -> tuple[dict[str, object], list[str]]:
    """The chart's scheduler extender configuration and the extender container's arguments."""
    docs = [d for d in yaml.safe_load_all(rendered) if d]
    config = next(d for d in docs if d["kind"] == "ConfigMap" and d["metadata"]["name"].endswith("-config"))
    args = _container(docs, "tessera-scheduler", "extender")["args"]
    return yaml.safe_load(config["data"]["config.yaml"])["extenders"][0], args


def test_the_extender_runs_beside_its_scheduler_reached_on_the_pods_loopback_only(repo_root: Path) -> None:
    """Two replicas, one Lease; each kube-scheduler calls the extender in its own pod, whose verbs
    listen on the pod's loopback: no other pod can reach them. Standalone (for the cluster's own
    scheduler) the extender has its own Deployment and Service instead."""
    chart = str(repo_root / "charts" / "tessera")
    docs = [d for d in yaml.safe_load_all(helm("template", "t", chart)) if d]
    workloads = {d["metadata"]["name"]: d for d in docs if d["kind"] in ("DaemonSet", "Deployment")}
    assert set(workloads) == {"tessera-device-plugin", "tessera-scheduler"}
    scheduler = workloads["tessera-scheduler"]
    assert scheduler["spec"]["replicas"] == 2
    pod = scheduler["spec"]["template"]["spec"]
    assert [c["name"] for c in pod["containers"]] == ["kube-scheduler", "extender"]
    extender, args = _scheduler_and_extender(helm("template", "t", chart))
    assert extender["urlPrefix"] == "http://127.0.0.1:8888"
    assert "--listen=127.0.0.1:8888" in args and "--health-listen=0.0.0.0:8889" in args
    assert [p["containerPort"] for p in _container(docs, "tessera-scheduler", "extender")["ports"]] == [8889]
    config = next(
        d for d in docs if d["kind"] == "ConfigMap" and d["metadata"]["name"] == "tessera-scheduler-config"
    )
    assert yaml.safe_load(config["data"]["config.yaml"])["leaderElection"]["leaderElect"] is True
    assert not [d for d in docs if d["kind"] == "Service" and d["metadata"]["name"] == "tessera-extender"]

    alone = [
        d for d in yaml.safe_load_all(helm("template", "t", chart, "--set", "scheduler.enabled=false")) if d
    ]
    assert {d["metadata"]["name"] for d in alone if d["kind"] in ("DaemonSet", "Deployment")} == {
        "tessera-device-plugin",
        "tessera-extender",
    }
    assert "--listen=0.0.0.0:8888" in _container(alone, "tessera-extender", "extender")["args"]
    assert [d for d in alone if d["kind"] == "Service" and d["metadata"]["name"] == "tessera-extender"]


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


def test_chart_calls_the_preempt_verb_and_sets_the_qos_priorities(repo_root: Path) -> None:
    chart = str(repo_root / "charts" / "tessera")
    extender, args = _scheduler_and_extender(helm("template", "t", chart))
    assert extender["preemptVerb"] == "preempt"
    assert {"--qos-latency-critical-priority=1000000", "--qos-best-effort-priority=0"} <= set(args)
    _, args = _scheduler_and_extender(
        helm(
            "template", "t", chart,
            "--set", "extender.qos.latencyCriticalPriority=2000000000",
            "--set", "extender.qos.bestEffortPriority=-100",
        )
    )  # fmt: skip
    assert {"--qos-latency-critical-priority=2000000000", "--qos-best-effort-priority=-100"} <= set(args)


def test_chart_turns_best_effort_oversubscription_on_with_its_margin_and_max_age(repo_root: Path) -> None:
    chart = str(repo_root / "charts" / "tessera")
    _, args = _scheduler_and_extender(helm("template", "t", chart))
    assert not [a for a in args if a.startswith("--best-effort")]  # off by default
    _, args = _scheduler_and_extender(
        helm(
            "template", "t", chart,
            "--set", "extender.bestEffortOversubscription.enabled=true",
            "--set", "extender.bestEffortOversubscription.marginMiB=2048",
            "--set", "extender.bestEffortOversubscription.marginPercent=5",
            "--set", "extender.bestEffortOversubscription.usageMaxAgeSeconds=30",
        )
    )  # fmt: skip
    assert {
        "--best-effort-oversubscription",
        "--best-effort-margin-mib=2048",
        "--best-effort-margin-percent=5",
        "--best-effort-usage-max-age=30",
    } <= set(args)


def test_one_chart_value_sets_the_in_flight_timeout_of_both_sides(repo_root: Path) -> None:
    rendered = helm("template", "t", str(repo_root / "charts" / "tessera"), "--set", "inflightTimeout=42")
    docs = [d for d in yaml.safe_load_all(rendered) if d]
    args = {
        "agent": _container(docs, "tessera-device-plugin", "agent")["args"],
        "extender": _container(docs, "tessera-scheduler", "extender")["args"],
    }
    for kind, given in args.items():
        assert [a for a in given if a.startswith("--inflight-timeout")] == ["--inflight-timeout=42"], kind


CLUSTER_SCOPED = (
    "ClusterRole",
    "ClusterRoleBinding",
    "ValidatingAdmissionPolicy",
    "ValidatingAdmissionPolicyBinding",
)


def test_chart_output_is_accepted_by_the_api_server(
    repo_root: Path, control_plane: ControlPlane, kube: client.ApiClient
) -> None:
    """Two releases into one API server, each in its namespace: their cluster-scoped objects are
    named after the release and both are accepted, side by side."""
    chart = str(repo_root / "charts" / "tessera")
    releases = {"tessera": "tessera-system", "gpu-b": "tessera-b"}
    kubectl = [str(find_binaries(names=("kubectl",)) / "kubectl"), f"--kubeconfig={control_plane.kubeconfig}"]
    rendered = {}
    for release, namespace in releases.items():
        client.CoreV1Api(kube).create_namespace({"metadata": {"name": namespace}})
        rendered[release] = helm("template", release, chart, "--namespace", namespace)
    try:
        for release in releases:
            applied = subprocess.run(
                [*kubectl, "apply", "--server-side", "-f", "-"],
                input=rendered[release],
                capture_output=True,
                text=True,
                check=False,
            )
            assert applied.returncode == 0, applied.stderr
        apps = client.AppsV1Api(kube)
        core = client.CoreV1Api(kube)
        for release, namespace in releases.items():
            assert apps.read_namespaced_daemon_set(
                "tessera-device-plugin", namespace
            ).spec.template.spec.containers
            assert apps.read_namespaced_deployment("tessera-scheduler", namespace).spec.replicas == 2
            speed = core.read_namespaced_config_map("tessera-speed-profiles", namespace)
            assert yaml.safe_load(speed.data["speed-profiles.yaml"]) == yaml.safe_load(
                (repo_root / "deploy" / "speed-profiles.yaml").read_text()
            )
            dashboard = core.read_namespaced_config_map("tessera-dashboard", namespace)
            assert dashboard.metadata.labels["grafana_dashboard"] == "1"
            docs = [d for d in yaml.safe_load_all(rendered[release]) if d and d["kind"] in CLUSTER_SCOPED]
            assert len(docs) == 13
            assert all(d["metadata"]["name"].startswith(f"{release}-") for d in docs)
            binding = client.RbacAuthorizationV1Api(kube).read_cluster_role_binding(
                f"{release}-device-plugin"
            )
            assert [(s.name, s.namespace) for s in binding.subjects] == [("tessera-device-plugin", namespace)]
            policy = client.AdmissionregistrationV1Api(kube).read_validating_admission_policy(
                f"{release}-device-plugin-own-node"
            )
            assert f"system:serviceaccount:{namespace}:tessera-device-plugin" in (
                policy.spec.match_conditions[0].expression
            )
    finally:
        for release in releases:
            subprocess.run(
                [*kubectl, "delete", "--ignore-not-found", "--wait=false", "-f", "-"],
                input=rendered[release],
                capture_output=True,
                text=True,
                check=False,
            )


def _agent_pod(docs: list[dict[str, Any]]) -> dict[str, Any]:
    [daemonset] = [
        d for d in docs if d["kind"] == "DaemonSet" and d["metadata"]["name"] == "tessera-device-plugin"
    ]
    return dict(daemonset)


def test_the_mps_control_daemon_runs_in_a_container_of_its_own(repo_root: Path) -> None:
    """The node's MPS control daemon is the mps-control container's (tessera-mps-control), beside the
    agent's in the same pod: a restart of the agent's container leaves it and its clients running.
    Same image, state dir and /dev/shm; root and privileged for the GPUs, and nothing else of the
    agent's: no port, no kubelet socket, no hook, no probe, no memory limit."""
    chart = str(repo_root / "charts" / "tessera")
    # Off by default: no MPS pieces, no Bidirectional mount (which needs a shared mount on the node).
    docs = [d for d in yaml.safe_load_all(helm("template", "t", chart)) if d]
    pod = _agent_pod(docs)["spec"]["template"]["spec"]
    assert [c["name"] for c in pod["containers"]] == ["agent"]
    assert [c["name"] for c in pod["initContainers"]] == ["install-hook"]
    assert "mps-shm" not in {v["name"] for v in pod["volumes"]}
    docs = [
        d
        for d in yaml.safe_load_all(helm("template", "t", chart, "--set", "devicePlugin.mps.enabled=true"))
        if d
    ]
    daemonset = _agent_pod(docs)
    pod = daemonset["spec"]["template"]["spec"]
    assert [c["name"] for c in pod["containers"]] == ["agent", "mps-control"]
    agent = _container(docs, "tessera-device-plugin", "agent")
    control = _container(docs, "tessera-device-plugin", "mps-control")
    assert control["image"] == agent["image"]
    assert control["command"] == ["tessera-mps-control"]
    assert control["args"] == [
        "--state-dir=/var/lib/tessera",
        f"--domain={KEYS.domain}",
        "--sharing=timeslice",
        "--mps-control=nvidia-cuda-mps-control",
    ]
    # The agent's flags that tessera-mps-control shares have the same values.
    assert {
        "--state-dir=/var/lib/tessera",
        "--sharing=timeslice",
        "--mps-control=nvidia-cuda-mps-control",
    } <= set(agent["args"])
    env = {e["name"]: e.get("value", e.get("valueFrom")) for e in control["env"]}
    assert env == {
        "NODE_NAME": {"fieldRef": {"fieldPath": "spec.nodeName"}},
        "NVIDIA_VISIBLE_DEVICES": "all",
        "NVIDIA_DRIVER_CAPABILITIES": "compute,utility",
    }
    mounts = {m["mountPath"]: m for m in control["volumeMounts"]}
    assert set(mounts) == {"/var/lib/tessera", "/dev/shm"}
    assert (
        mounts["/var/lib/tessera"] in agent["volumeMounts"]
    )  # the agent's state dir, as the agent mounts it
    volumes = {v["name"]: v for v in pod["volumes"]}
    assert volumes[mounts["/dev/shm"]["name"]]["hostPath"]["path"] == "/var/lib/tessera/mps/shm"
    # The agent no longer runs the daemon: it needs no shared /dev/shm.
    assert "/dev/shm" not in {m["mountPath"] for m in agent["volumeMounts"]}
    assert control["securityContext"] == {"runAsUser": 0, "privileged": True}
    assert not {"ports", "livenessProbe", "readinessProbe", "startupProbe"} & set(control)
    assert control["resources"] == {"requests": {"cpu": "10m", "memory": "64Mi"}}
    # The mps-shm init container mounts the tmpfs both see.
    assert [c["name"] for c in pod["initContainers"]] == ["install-hook", "mps-shm"]
    assert daemonset["spec"]["updateStrategy"] == {"type": "RollingUpdate"}
    assert pod["hostPID"] is True and "shareProcessNamespace" not in pod

    rendered = helm(
        "template", "t", chart,
        "--set", "devicePlugin.updateStrategy.type=OnDelete", "--set", "devicePlugin.sharing=mps",
        "--set", "devicePlugin.hostPID=false", "--set", "domain=gpu.example.com",
        "--set", "devicePlugin.mps.control=/usr/bin/nvidia-cuda-mps-control",
        "--set", "devicePlugin.mps.enabled=true",
    )  # fmt: skip
    docs = [d for d in yaml.safe_load_all(rendered) if d]
    daemonset = _agent_pod(docs)
    pod = daemonset["spec"]["template"]["spec"]
    assert daemonset["spec"]["updateStrategy"] == {"type": "OnDelete"}
    # Without the node's PID namespace, one for the pod: the agent sees the daemon mps-control runs.
    assert pod["hostPID"] is False and pod["shareProcessNamespace"] is True
    control = _container(docs, "tessera-device-plugin", "mps-control")
    assert control["args"] == [
        "--state-dir=/var/lib/tessera",
        "--domain=gpu.example.com",
        "--sharing=mps",
        "--mps-control=/usr/bin/nvidia-cuda-mps-control",
    ]


def test_the_agents_pod_with_its_own_pid_namespace_is_accepted_by_the_api_server(
    repo_root: Path, control_plane: ControlPlane, kube: client.ApiClient
) -> None:
    """hostPID and shareProcessNamespace may not both be set: the chart sets the second only without
    the first, which the API server accepts."""
    chart = str(repo_root / "charts" / "tessera")
    kubectl = [str(find_binaries(names=("kubectl",)) / "kubectl"), f"--kubeconfig={control_plane.kubeconfig}"]
    client.CoreV1Api(kube).create_namespace({"metadata": {"name": "tessera-pid"}})
    for hostpid in ("true", "false"):
        rendered = helm(
            "template", "t", chart, "--namespace", "tessera-pid", "--show-only", "templates/device-plugin.yaml",
            "--set", f"devicePlugin.hostPID={hostpid}", "--set", "devicePlugin.updateStrategy.type=OnDelete",
        )  # fmt: skip
        daemonset = json.dumps(_agent_pod([d for d in yaml.safe_load_all(rendered) if d]))
        applied = subprocess.run(
            [*kubectl, "apply", "--server-side", "--dry-run=server", "-f", "-"],
            input=daemonset,
            capture_output=True,
            text=True,
            check=False,
        )
        assert applied.returncode == 0, (hostpid, applied.stderr)


def _scheduler_image(*args: str) -> str:
    chart = str(Path(__file__).resolve().parents[2] / "charts" / "tessera")
    docs = [d for d in yaml.safe_load_all(helm("template", "t", chart, *args)) if d]
    return str(_container(docs, "tessera-scheduler", "kube-scheduler")["image"])


def test_scheduler_image_follows_the_cluster_version_unless_overridden() -> None:
    assert _scheduler_image("--kube-version", "1.33.2") == "registry.k8s.io/kube-scheduler:v1.33.2"
    # A distribution's build suffix is not part of kube-scheduler's tag.
    assert _scheduler_image("--kube-version", "v1.31.4+k3s1") == "registry.k8s.io/kube-scheduler:v1.31.4"
    assert (
        _scheduler_image("--kube-version", "1.33.2", "--set", "scheduler.image.tag=v1.32.9")
        == "registry.k8s.io/kube-scheduler:v1.32.9"
    )
    assert (
        _scheduler_image(
            "--kube-version", "1.33.2", "--set", "scheduler.image.registry=mirror.example.com/k8s"
        )
        == "mirror.example.com/k8s/kube-scheduler:v1.33.2"
    )


def test_chart_refuses_clusters_older_than_its_apis(repo_root: Path) -> None:
    binary = find_binaries(names=("helm",)) / "helm"
    result = subprocess.run(
        [str(binary), "template", "t", str(repo_root / "charts" / "tessera"), "--kube-version", "1.29.9"],
        capture_output=True,
        text=True,
        check=False,
    )
    assert result.returncode != 0
    assert "kubeVersion" in result.stderr or "incompatible" in result.stderr, result.stderr


def test_image_values_reach_every_pod(repo_root: Path) -> None:
    rendered = helm(
        "template", "t", str(repo_root / "charts" / "tessera"),
        "--set", "image.registry=registry.example.com/gpu", "--set", "image.tag=9.9.9",
        "--set", "imagePullSecrets[0].name=pull",
        "--set", "extender.podAnnotations.team=ml", "--set", "devicePlugin.priorityClassName=",
    )  # fmt: skip
    docs = [d for d in yaml.safe_load_all(rendered) if d]
    pods = {
        d["metadata"]["name"]: d["spec"]["template"] for d in docs if d["kind"] in ("DaemonSet", "Deployment")
    }
    assert set(pods) == {"tessera-device-plugin", "tessera-scheduler"}
    for name, pod in pods.items():
        assert pod["spec"]["imagePullSecrets"] == [{"name": "pull"}], name
    agent = pods["tessera-device-plugin"]["spec"]
    assert {c["image"] for c in agent["containers"] + agent["initContainers"]} == {
        "registry.example.com/gpu/tessera:9.9.9"
    }
    assert "priorityClassName" not in agent
    assert agent["hostPID"] is True  # NVML's host pids, mapped to pods (docs/install.md)
    assert {"key": "nvidia.com/gpu", "operator": "Exists", "effect": "NoSchedule"} in agent["tolerations"]
    assert pods["tessera-scheduler"]["metadata"]["annotations"]["team"] == "ml"
    assert (
        _container(docs, "tessera-scheduler", "extender")["image"] == "registry.example.com/gpu/tessera:9.9.9"
    )
    default = [
        d for d in yaml.safe_load_all(helm("template", "t", str(repo_root / "charts" / "tessera"))) if d
    ]
    images = {
        c["image"]
        for d in default
        if d["kind"] == "DaemonSet"
        for c in d["spec"]["template"]["spec"]["containers"]
    }
    chart = yaml.safe_load((repo_root / "charts" / "tessera" / "Chart.yaml").read_text())
    assert images == {f"tessera:{chart['appVersion']}"}


@pytest.mark.parametrize(
    ("value", "named"),
    [
        ("devicePlugin.split=0", "/devicePlugin/split"),
        ("extender.policy=fgd-paper", "/extender/policy"),
        ("domain=Bad_Domain", "/domain"),
        ("extender.polcy=spread", "polcy"),
        ("inflightTimeout=0", "/inflightTimeout"),
        ("extender.port=70000", "/extender/port"),
        ("mode=both", "/mode"),
        ("dra.resyncSeconds=0", "/dra/resyncSeconds"),
        ("devicePlugin.updateStrategy.type=Recreate", "/devicePlugin/updateStrategy/type"),
    ],
)
def test_bad_values_fail_at_install_naming_the_value(
    repo_root: Path, control_plane: ControlPlane, value: str, named: str
) -> None:
    binary = find_binaries(names=("helm",)) / "helm"
    chart = str(repo_root / "charts" / "tessera")
    install = ["install", "t", chart, "--dry-run=client", f"--kubeconfig={control_plane.kubeconfig}"]
    for command in (["template", "t", chart], install):
        result = subprocess.run(
            [str(binary), *command, "--set", value], capture_output=True, text=True, check=False
        )
        assert result.returncode != 0, (command, value)
        assert named in result.stderr, result.stderr


def test_schema_policy_enum_is_the_contracts() -> None:
    schema = json.loads(
        (Path(__file__).resolve().parents[2] / "charts" / "tessera" / "values.schema.json").read_text()
    )
    assert schema["properties"]["extender"]["properties"]["policy"]["enum"] == [p.value for p in Policy]
    sharing = schema["properties"]["devicePlugin"]["properties"]["sharing"]["enum"]
    assert sharing == [m.value for m in SharingMode]
    pattern = schema["properties"]["domain"]["pattern"]
    for domain in ("tessera.io", "gpu.example.com", "Bad_Domain", "-x.io", "a..b"):
        try:
            keys_for(domain)
            valid = True
        except ContractError:
            valid = False
        assert bool(re.match(pattern, domain)) == valid, domain


# Values that are Kubernetes objects passed to a pod whole: their fields are Kubernetes's, not the chart's.
KUBERNETES_OBJECTS = ("resources", "affinity")


def _value_keys(values: dict[str, object], prefix: str = "") -> list[str]:
    keys = []
    for key, value in values.items():
        keys.append(prefix + key)
        if isinstance(value, dict) and value and key not in KUBERNETES_OBJECTS:
            keys += _value_keys(value, prefix + key + ".")
    return keys


def test_readme_and_schema_list_every_value(repo_root: Path) -> None:
    chart = repo_root / "charts" / "tessera"
    values = yaml.safe_load((chart / "values.yaml").read_text())
    readme = (chart / "README.md").read_text()
    missing = [k for k in _value_keys(values) if f"`{k}`" not in readme]
    assert not missing, f"charts/tessera/README.md does not list: {missing}"
    schema = json.loads((chart / "values.schema.json").read_text())

    def in_schema(key: str) -> bool:
        node = schema
        for part in key.split("."):
            node = node.get("properties", {}).get(part)
            if node is None:
                return False
        return True

    assert [k for k in _value_keys(values) if not in_schema(k)] == []


def test_notes_say_how_to_check_the_install(repo_root: Path, control_plane: ControlPlane) -> None:
    chart = str(repo_root / "charts" / "tessera")
    kubeconfig = f"--kubeconfig={control_plane.kubeconfig}"
    out = helm("install", "gpu", chart, "--dry-run=client", "--namespace", "ts", kubeconfig)
    notes = out[out.index("NOTES:") :]
    assert "kubectl get pods -n ts" in notes
    assert "tessera status" in notes
    assert "deploy/examples/" in notes


def test_scheduler_config_calls_the_extender_service_by_its_cluster_ip(repo_root: Path) -> None:
    """A host-network kube-scheduler cannot resolve cluster DNS names: deploy/scheduler-config.yaml
    calls the extender's Service of deploy/extender.yaml by its fixed ClusterIP and port."""
    config = yaml.safe_load((repo_root / "deploy" / "scheduler-config.yaml").read_text())
    [extender] = config["extenders"]
    docs = [d for d in yaml.safe_load_all((repo_root / "deploy" / "extender.yaml").read_text()) if d]
    [service] = [d for d in docs if d["kind"] == "Service"]
    [port] = service["spec"]["ports"]
    assert extender["urlPrefix"] == f"http://{service['spec']['clusterIP']}:{port['port']}"


def test_dashboard_queries_only_metrics_the_components_export(repo_root: Path) -> None:
    dashboard = json.loads((repo_root / "deploy" / "grafana" / "tessera-dashboard.json").read_text())
    queries = [t["expr"] for p in dashboard["panels"] for t in p.get("targets", [])]
    queries += [v["query"] for v in dashboard["templating"]["list"] if v["type"] == "query"]
    exported = exporter_sources(repo_root)
    names = {re.sub(r"_(total|bucket)$", "", m) for q in queries for m in re.findall(r"tessera_[a-z_]+", q)}
    assert names, "the dashboard queries no Tessera metric"
    missing = sorted(n for n in names if f'"{n}"' not in exported)
    assert not missing, f"dashboard queries metrics nobody exports: {missing}"
