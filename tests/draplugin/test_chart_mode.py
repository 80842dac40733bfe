"""The chart's node agent in DRA mode: the driver instead of the device plugin, its DeviceClass, and
nothing more than the verbs it uses."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import yaml
from kubernetes import client

from tessera.contract import KEYS, keys_for
from tests.foundation.test_chart import helm

pytestmark = pytest.mark.k8s


def rendered(repo_root: Path, *values: str) -> list[dict[str, Any]]:
    args = [a for v in values for a in ("--set", v)]
    return [
        d
        for d in yaml.safe_load_all(helm("template", "t", str(repo_root / "charts" / "tessera"), *args))
        if d
    ]


def test_dra_mode_runs_the_driver_instead_of_the_device_plugin(repo_root: Path) -> None:
    docs = rendered(repo_root, "mode=dra")
    workloads = {d["metadata"]["name"]: d for d in docs if d["kind"] in ("DaemonSet", "Deployment")}
    assert set(workloads) == {"tessera-dra", "tessera-scheduler"}
    pod = workloads["tessera-dra"]["spec"]["template"]["spec"]
    [driver] = pod["containers"]
    assert driver["command"] == ["tessera-dra"]
    assert "--kubelet-dir=/var/lib/kubelet" in driver["args"]
    assert "--cdi-dir=/var/run/cdi" in driver["args"]
    assert "--state-dir=/var/lib/tessera" in driver["args"]
    assert "--hook-library=/usr/local/tessera/libvgpu.so" in driver["args"]
    assert {"--qos-latency-critical-priority=1000000", "--qos-best-effort-priority=0"} <= set(driver["args"])
    assert [c["name"] for c in pod["initContainers"]] == ["install-hook"]
    mounts = {m["mountPath"] for m in driver["volumeMounts"]}
    assert {"/var/lib/kubelet/plugins", "/var/lib/kubelet/plugins_registry", "/var/run/cdi"} <= mounts
    [device_class] = [d for d in docs if d["kind"] == "DeviceClass"]
    assert device_class["metadata"]["name"] == KEYS.dra_device_class
    assert device_class["spec"]["selectors"] == [
        {"cel": {"expression": f'device.driver == "{KEYS.dra_driver}"'}}
    ]
    assert device_class["spec"]["extendedResourceName"] == KEYS.whole_gpu
    [role] = [d for d in docs if d["kind"] == "ClusterRole" and d["metadata"]["name"] == "t-dra"]
    assert role["rules"] == [
        # The pods a claim is reserved for: their priority grants its QoS class; a Warning event on
        # them when the class it asked for is lowered.
        {"apiGroups": [""], "resources": ["pods"], "verbs": ["get"]},
        {"apiGroups": [""], "resources": ["events"], "verbs": ["create"]},
        {"apiGroups": ["resource.k8s.io"], "resources": ["resourceclaims"], "verbs": ["get"]},
        {
            "apiGroups": ["resource.k8s.io"],
            "resources": ["resourceslices"],
            "verbs": ["get", "create", "update"],
        },
    ]
    assert workloads["tessera-dra"]["spec"]["updateStrategy"] == {"type": "RollingUpdate"}
    on_delete = rendered(repo_root, "mode=dra", "devicePlugin.updateStrategy.type=OnDelete")
    [daemonset] = [
        d for d in on_delete if d["metadata"]["name"] == "tessera-dra" and d["kind"] == "DaemonSet"
    ]
    assert daemonset["spec"]["updateStrategy"] == {"type": "OnDelete"}
    default = rendered(repo_root)
    assert not [d for d in default if d["kind"] == "DeviceClass" or d["metadata"]["name"] == "tessera-dra"]


def test_dra_mode_follows_the_domain(repo_root: Path) -> None:
    keys = keys_for("gpu.example.com")
    docs = rendered(repo_root, "mode=dra", f"domain={keys.domain}")
    [device_class] = [d for d in docs if d["kind"] == "DeviceClass"]
    assert device_class["metadata"]["name"] == keys.dra_device_class
    assert (
        device_class["spec"]["selectors"][0]["cel"]["expression"] == f'device.driver == "{keys.dra_driver}"'
    )
    [daemonset] = [d for d in docs if d["kind"] == "DaemonSet"]
    assert f"--domain={keys.domain}" in daemonset["spec"]["template"]["spec"]["containers"][0]["args"]


def test_the_whole_gpu_resource_is_a_switch_and_an_api_server_without_it_drops_it(
    repo_root: Path, kube: client.ApiClient
) -> None:
    """dra.wholeGpuResource=false: the DeviceClass names no extended resource. The pinned 1.34 API
    server (DRAExtendedResource alpha, off) accepts the class that names one and drops the field."""
    [off] = [
        d for d in rendered(repo_root, "mode=dra", "dra.wholeGpuResource=false") if d["kind"] == "DeviceClass"
    ]
    assert "extendedResourceName" not in off["spec"]
    [on] = [d for d in rendered(repo_root, "mode=dra") if d["kind"] == "DeviceClass"]
    stored = client.CustomObjectsApi(kube).create_cluster_custom_object(
        "resource.k8s.io", "v1", "deviceclasses", on, dry_run="All"
    )
    assert stored["spec"]["selectors"] == on["spec"]["selectors"]
    assert "extendedResourceName" not in stored["spec"]


def required_terms(workload: dict[str, Any]) -> list[dict[str, Any]]:
    affinity = workload["spec"]["template"]["spec"]["affinity"]["nodeAffinity"]
    terms: list[dict[str, Any]] = affinity["requiredDuringSchedulingIgnoredDuringExecution"][
        "nodeSelectorTerms"
    ]
    return terms


def test_mixed_mode_runs_each_agent_on_its_node_pool_and_never_both_on_a_node(repo_root: Path) -> None:
    """mode=mixed: the DRA driver where the node's <domain>/mode label says dra, the device plugin on
    every other node; in the single modes an agent keeps off nodes labelled for the other one, so two
    releases of different modes do not meet on a node either (docs/dra.md, "One mode per node")."""
    key = KEYS.node_mode
    workloads = {
        d["metadata"]["name"]: d for d in rendered(repo_root, "mode=mixed") if d["kind"] == "DaemonSet"
    }
    assert set(workloads) == {"tessera-device-plugin", "tessera-dra"}
    assert required_terms(workloads["tessera-dra"]) == [
        {"matchExpressions": [{"key": key, "operator": "In", "values": ["dra"]}]}
    ]
    assert required_terms(workloads["tessera-device-plugin"]) == [
        {"matchExpressions": [{"key": key, "operator": "NotIn", "values": ["dra"]}]}
    ]
    [dra_only] = [d for d in rendered(repo_root, "mode=dra") if d["kind"] == "DaemonSet"]
    assert required_terms(dra_only) == [
        {"matchExpressions": [{"key": key, "operator": "NotIn", "values": ["deviceplugin"]}]}
    ]


def test_the_users_node_affinity_keeps_every_term_and_gains_the_mode(repo_root: Path) -> None:
    prefix = (
        "devicePlugin.affinity.nodeAffinity.requiredDuringSchedulingIgnoredDuringExecution.nodeSelectorTerms"
    )
    docs = rendered(
        repo_root,
        "mode=mixed",
        "domain=gpu.example.com",
        f"{prefix}[0].matchExpressions[0].key=pool",
        f"{prefix}[0].matchExpressions[0].operator=Exists",
        f"{prefix}[1].matchFields[0].key=metadata.name",
        f"{prefix}[1].matchFields[0].operator=In",
        f"{prefix}[1].matchFields[0].values[0]=gpu-7",
    )
    [dra] = [d for d in docs if d["kind"] == "DaemonSet" and d["metadata"]["name"] == "tessera-dra"]
    mode = {"key": keys_for("gpu.example.com").node_mode, "operator": "In", "values": ["dra"]}
    assert required_terms(dra) == [
        {"matchExpressions": [{"key": "pool", "operator": "Exists"}, mode]},
        {
            "matchFields": [{"key": "metadata.name", "operator": "In", "values": ["gpu-7"]}],
            "matchExpressions": [mode],
        },
    ]


def test_the_driver_takes_the_extenders_qos_values(repo_root: Path) -> None:
    """One rule for pods and claims: extender.qos sets both binaries' flags alike."""
    values = (
        "mode=mixed",
        "extender.qos.latencyCriticalPriority=5000",
        "extender.qos.bestEffortPriority=-1",
        "extender.qos.latencyCriticalNamespaces={serving,infra}",
    )
    docs = rendered(repo_root, *values)
    [dra] = [d for d in docs if d["kind"] == "DaemonSet" and d["metadata"]["name"] == "tessera-dra"]
    [scheduler] = [
        d for d in docs if d["kind"] == "Deployment" and d["metadata"]["name"] == "tessera-scheduler"
    ]
    qos_args = [
        "--qos-latency-critical-priority=5000",
        "--qos-best-effort-priority=-1",
        "--qos-latency-critical-namespaces=serving,infra",
    ]
    [driver] = dra["spec"]["template"]["spec"]["containers"]
    [extender] = [c for c in scheduler["spec"]["template"]["spec"]["containers"] if c["name"] == "extender"]
    for args in (driver["args"], extender["args"]):
        assert [a for a in args if a.startswith("--qos-")] == qos_args
