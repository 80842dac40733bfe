"""`tessera status` and `kubectl tessera status` against the real kube-apiserver: fake nodes with a
Tessera inventory, pods bound with allocations, a Pending pod with the extender's FailedScheduling
event, and a node agent's metrics through the API server's pod proxy."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import threading
from collections.abc import Callable, Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

import pytest
from kubernetes import client
from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.core import GaugeMetricFamily
from prometheus_client.registry import Collector

from deviceplugin.metrics import GPU_LABELS
from nodeagent.containermetrics import CONTAINER_LABELS
from sandbox.controlplane import ControlPlane
from tessera import cli
from tessera.cli.status.gather import NO_TOKEN_THROUGH_PROXY
from tessera.contract import (
    KEYS,
    MIB,
    Allocation,
    ContainerAllocation,
    GpuGrant,
    GpuUsage,
    NodeGpuUsage,
    Phase,
    dump_allocation,
    dump_gpu_usage,
    format_time,
    now,
)
from tests.extender.helpers import gpu_pod, inventory, node_object
from tests.scraping import host_address

pytestmark = pytest.mark.k8s

MODEL = "NVIDIA A100-SXM4-40GB"
GIB = 2**30


def run_status(capsys: pytest.CaptureFixture[str], *args: str) -> tuple[int, str, str]:
    code = cli.main(["status", *args])
    out, err = capsys.readouterr()
    return code, out, err


def bound_pod(
    namespace: str, name: str, node: str, grants: dict[str, list[tuple[str, int, int]]]
) -> dict[str, Any]:
    allocation = Allocation(
        node=node,
        containers=tuple(
            ContainerAllocation(
                name=c, gpus=tuple(GpuGrant(uuid=u, memory_quota_mib=m, cores=k) for u, m, k in g)
            )
            for c, g in grants.items()
        ),
    )
    body = gpu_pod(
        name,
        namespace=namespace,
        annotations={KEYS.allocation: dump_allocation(allocation), KEYS.allocation_phase: Phase.ALLOCATED},
    )
    body["spec"]["nodeName"] = node
    body["spec"]["containers"] = [
        {"name": c, "image": "local/cuda:latest", "resources": {"limits": {KEYS.vgpu: str(len(g))}}}
        for c, g in grants.items()
    ]
    return body


@pytest.fixture
def cluster(kube: client.ApiClient, namespace: str, create_fake_node: Callable[..., str]) -> dict[str, Any]:
    """node-a: 2 GPUs (4 slices each), a trainer pod on GPU 0 and an infer pod on both; node-b: no
    Tessera inventory; a pod Pending with the extender's reason."""
    core = client.CoreV1Api(kube)
    gpus = inventory("node-a", MODEL, 40960, count=2, split=4)
    node = node_object("node-a", gpus, now())
    create_fake_node("node-a", {KEYS.vgpu: "8"}, node["metadata"]["annotations"])
    create_fake_node("node-b", {"cpu": "4"})
    a, b = gpus[0].uuid, gpus[1].uuid
    core.create_namespaced_pod(
        namespace, bound_pod(namespace, "trainer", "node-a", {"main": [(a, 8192, 30)]})
    )
    core.create_namespaced_pod(
        namespace, bound_pod(namespace, "infer", "node-a", {"main": [(a, 4096, 20), (b, 4096, 20)]})
    )
    pending = core.create_namespaced_pod(namespace, gpu_pod("huge", namespace=namespace, memory=81920))
    reason = "0/2 nodes are available: 1 node has no Tessera GPU inventory, 1 node lacks GPU memory (needs 81920 MiB)."
    core.create_namespaced_event(
        namespace,
        {
            "metadata": {"name": "huge.failed", "namespace": namespace},
            "involvedObject": {
                "kind": "Pod",
                "namespace": namespace,
                "name": "huge",
                "uid": pending.metadata.uid,
            },
            "reason": "FailedScheduling",
            "message": reason,
            "type": "Warning",
            "lastTimestamp": format_time(now()),
        },
    )
    return {"namespace": namespace, "a": a, "b": b, "reason": reason}


def test_status_reports_nodes_gpus_pods_and_pending_reasons(
    control_plane: ControlPlane, cluster: dict[str, Any], capsys: pytest.CaptureFixture[str]
) -> None:
    code, out, err = run_status(
        capsys, f"--kubeconfig={control_plane.kubeconfig}", "-o", "json", "--no-metrics"
    )
    assert code == 0, err
    report = json.loads(out)
    assert [n["name"] for n in report["nodes"]] == ["node-a"]
    [node] = report["nodes"]
    assert node["error"] is None and 0 <= node["heartbeat_age_seconds"] < 60
    first, second = node["gpus"]
    assert (first["uuid"], first["model"], first["memory_bytes"]) == (cluster["a"], MODEL, 40960 * MIB)
    assert (first["memory_allocated_bytes"], first["cores_allocated_percent"]) == (12288 * MIB, 50)
    assert (first["slices_used"], first["slices_total"]) == (2, 4)
    assert {(p["pod"], p["memory_bytes"], p["cores_percent"], p["phase"]) for p in first["pods"]} == {
        ("trainer", 8192 * MIB, 30, "allocated"),
        ("infer", 4096 * MIB, 20, "allocated"),
    }
    assert (second["slices_used"], second["memory_allocated_bytes"]) == (1, 4096 * MIB)
    assert report["pending"] == [
        {"namespace": cluster["namespace"], "pod": "huge", "reason": cluster["reason"]}
    ]
    assert report["problems"] == []

    # The table, as kubectl runs the plugin: no colours when not on a TTY.
    plugin = shutil.which("kubectl-tessera", path=str(Path(sys.executable).parent))
    assert plugin, "kubectl-tessera is not installed (pip install -e .)"
    table = subprocess.run(
        [plugin, "status", f"--kubeconfig={control_plane.kubeconfig}", "--no-metrics"],
        capture_output=True,
        text=True,
        check=False,
        timeout=60,
    )
    assert table.returncode == 0, table.stderr
    assert "\033[" not in table.stdout
    lines = table.stdout.splitlines()
    assert lines[0].split()[:4] == ["NODE", "/", "GPU", "/"]
    gpu_line = next(line for line in lines if cluster["a"] in line)
    assert (
        "12.0 / 40.0" in gpu_line and "50 / 100" in gpu_line and "2 / 4" in gpu_line and "Healthy" in gpu_line
    )
    assert any(f"{cluster['namespace']}/trainer (main)" in line and "8.0" in line for line in lines)
    assert "PENDING" in lines and any("huge" in line and cluster["reason"] in line for line in lines)
    # Colours when asked (as on a TTY).
    code, out, _ = run_status(
        capsys, f"--kubeconfig={control_plane.kubeconfig}", "--no-metrics", "--color=always"
    )
    assert code == 0 and "\033[32mHealthy" in out


class _AgentMetrics(Collector):
    def __init__(self, node: str, uuid: str, namespace: str) -> None:
        self.labels = (node, uuid, MODEL)
        self.namespace = namespace

    def collect(self) -> Iterator[GaugeMetricFamily]:
        used = GaugeMetricFamily("tessera_gpu_memory_used_bytes", "", labels=GPU_LABELS)
        used.add_metric(self.labels, 9 * GIB)
        util = GaugeMetricFamily("tessera_gpu_utilization_ratio", "", labels=GPU_LABELS)
        util.add_metric(self.labels, 0.42)
        container = GaugeMetricFamily("tessera_container_memory_used_bytes", "", labels=CONTAINER_LABELS)
        container.add_metric((self.namespace, "trainer", "main", "", *self.labels), 6 * GIB)
        yield from (used, util, container)


def test_status_adds_use_from_the_node_agents_metrics(
    control_plane: ControlPlane,
    kube: client.ApiClient,
    cluster: dict[str, Any],
    capsys: pytest.CaptureFixture[str],
) -> None:
    registry = CollectorRegistry()
    registry.register(_AgentMetrics("node-a", cluster["a"], cluster["namespace"]))

    refused: list[str | None] = []  # as an agent with metricsAccess.authorization: 401 without a token

    class Handler(BaseHTTPRequestHandler):
        def do_GET(self) -> None:
            body = generate_latest(registry)
            if refused:
                refused.append(self.headers.get("Authorization"))
                self.send_response(401)
            else:
                self.send_response(200 if self.path == "/metrics" else 404)
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, *args: object) -> None:
            pass

    # On every address: the API server proxies to this machine's own, not to loopback.
    server = ThreadingHTTPServer(("0.0.0.0", 0), Handler)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        core = client.CoreV1Api(kube)
        namespace = cluster["namespace"]
        port = server.server_address[1]
        core.create_namespaced_pod(
            namespace,
            {
                "metadata": {
                    "name": "agent-a",
                    "labels": {"app.kubernetes.io/name": "tessera-device-plugin"},
                },
                "spec": {
                    "nodeName": "node-a",
                    "containers": [
                        {
                            "name": "device-plugin",
                            "image": "tessera:0.1.0",
                            "ports": [{"name": "metrics", "containerPort": port}],
                        }
                    ],
                },
            },
        )
        address = host_address()
        core.patch_namespaced_pod_status(
            "agent-a",
            namespace,
            {"status": {"phase": "Running", "podIP": address, "podIPs": [{"ip": address}]}},
        )
        code, out, err = run_status(capsys, f"--kubeconfig={control_plane.kubeconfig}", "-o", "json")
        assert code == 0, err
        [node] = json.loads(out)["nodes"]
        assert node["metrics"] == "ok", node["metrics"]
        first = node["gpus"][0]
        assert (first["memory_used_bytes"], first["utilization_ratio"]) == (9 * GIB, 0.42)
        used = {p["pod"]: p["memory_used_bytes"] for p in first["pods"]}
        assert used == {"trainer": 6 * GIB, "infer": None}
        # An agent serving authorized scrapes only: the pod proxy forwards no token, status says so,
        # and shows the use the agent publishes on the Node instead.
        refused.append("refusing")
        usage = NodeGpuUsage(
            time=format_time(now()),
            gpus=(
                GpuUsage(
                    uuid=cluster["a"], memory_used_mib=5120, guaranteed_used_mib=5120, utilization_percent=37
                ),
            ),
        )
        core.patch_node("node-a", {"metadata": {"annotations": {KEYS.node_gpu_usage: dump_gpu_usage(usage)}}})
        code, out, err = run_status(capsys, f"--kubeconfig={control_plane.kubeconfig}", "-o", "json")
        assert code == 0, err
        [node] = json.loads(out)["nodes"]
        assert node["metrics"] == NO_TOKEN_THROUGH_PROXY
        assert refused[1:] == [None]
        first = node["gpus"][0]
        assert (first["memory_used_bytes"], first["utilization_ratio"]) == (5120 * MIB, 0.37)
        core.patch_node("node-a", {"metadata": {"annotations": {KEYS.node_gpu_usage: None}}})
    finally:
        server.shutdown()
        server.server_close()
        thread.join(timeout=10)
    # The agent gone (its server stopped), status still answers and says why there is no use.
    code, out, err = run_status(
        capsys, f"--kubeconfig={control_plane.kubeconfig}", "-o", "json", "--metrics-timeout=2"
    )
    assert code == 0, err
    [node] = json.loads(out)["nodes"]
    assert node["metrics"].startswith("not reachable"), node["metrics"]
    assert node["gpus"][0]["memory_used_bytes"] is None


def test_bad_kubeconfig_context_or_server_is_a_clear_error(
    control_plane: ControlPlane, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    code, out, err = run_status(capsys, f"--kubeconfig={tmp_path / 'missing'}")
    assert (code, out) == (
        1,
        "",
    ) and err == f"tessera status: kubeconfig {tmp_path / 'missing'}: no such file\n"
    code, _, err = run_status(capsys, f"--kubeconfig={control_plane.kubeconfig}", "--context=nope")
    assert code == 1 and "context 'nope'" in err and "nope" in err.splitlines()[-1]
    unreachable = tmp_path / "unreachable.kubeconfig"
    unreachable.write_text(
        control_plane.kubeconfig.read_text().replace(
            next(
                line.split("server:")[1].strip()
                for line in control_plane.kubeconfig.read_text().splitlines()
                if "server:" in line
            ),
            "https://127.0.0.1:1",
        )
    )
    code, _, err = run_status(capsys, f"--kubeconfig={unreachable}")
    assert code == 1 and err.startswith("tessera status: listing nodes from https://127.0.0.1:1:"), err
    assert "Traceback" not in err
    # The same through the installed command (a new process: exit status and stderr only).
    result = subprocess.run(
        [str(Path(sys.executable).parent / "tessera"), "status", f"--kubeconfig={unreachable}"],
        capture_output=True,
        text=True,
        check=False,
        timeout=60,
        env={**os.environ, "NO_COLOR": "1"},
    )
    assert result.returncode == 1 and "Traceback" not in result.stderr, result.stderr
