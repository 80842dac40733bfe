"""A real Prometheus (the project's build, hack/prometheus-binaries.sh) scrapes the real exporters,
loads the alerts, and answers every query the dashboard makes.

The targets are the node agent's collector and the extender's registry, each on its own HTTP server
as the components serve them, given statically: the target labels Kubernetes discovery would attach
(the agent's own ``namespace``, ``pod``, ``container``) are static labels here, exactly the collision
``honor_labels`` decides. The same target is scraped twice, with and without it, to show what each
does to the workload's labels. Discovery itself is proved in the sandbox
(tests/sandbox/test_monitoring.py).
"""

from __future__ import annotations

import contextlib
import subprocess
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import yaml
from prometheus_client import CollectorRegistry, start_http_server

from deviceplugin.metrics import AgentCollector, PluginMetrics
from draplugin.metrics import ClaimCollector
from extender.metrics import Metrics
from nodeagent.health import HealthBook
from nodeagent.nvml import GpuReading
from nodeagent.records import GpuQuota, PreparedRecord, ServedRecord, dump_record
from nodeagent.statedir import StateDir
from sandbox import monitoring
from sandbox.controlplane import free_port
from tessera.contract import GpuGrant, GpuInfo
from tests.monitoring.dashboard_queries import Prometheus, panel_queries, variable_values

pytestmark = pytest.mark.prometheus

NODE = "node-1"
MODEL = "NVIDIA A100-SXM4-40GB"
GPUS = ("GPU-aaaaaaaa-0000-0000-0000-000000000000", "GPU-bbbbbbbb-0000-0000-0000-000000000000")
# What Kubernetes discovery attaches to the agent's target (its own pod).
AGENT_TARGET_LABELS = {
    "namespace": "kube-system",
    "pod": "tessera-device-plugin-x7k2p",
    "container": "device-plugin",
}
# Dashboard variables, as a user would pick them: one namespace, every node, GPU and pod.
VARIABLES = {
    "$node": NODE,
    "$gpu": "|".join(GPUS),
    "$namespace": "ml",
    "$pod": ".*",
    "$__rate_interval": "30s",
}


@pytest.fixture(scope="module")
def exporters(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[int, int]]:
    """The node agent's and the extender's /metrics on loopback ports."""
    state = StateDir(tmp_path_factory.mktemp("exporters") / "state")
    for pod, grants in (
        ("train", (GpuGrant(uuid=GPUS[0], memory_quota_mib=8192, cores=30),)),
        ("infer", (GpuGrant(uuid=GPUS[1], memory_quota_mib=4096, cores=20),)),
    ):
        where = state.container(f"uid-{pod}", "main")
        state.write_record(
            where, ServedRecord(namespace="ml", pod=pod, pod_uid=f"uid-{pod}", container="main", gpus=grants)
        )
    inventory = tuple(
        GpuInfo(
            uuid=u,
            index=i,
            model=MODEL,
            total_memory_mib=40960,
            sm_count=108,
            compute_capability="8.0",
            split=10,
        )
        for i, u in enumerate(GPUS)
    )
    agent = CollectorRegistry()
    agent.register(
        AgentCollector(
            NODE,
            lambda: inventory,
            lambda uuid: GpuReading(uuid, 40960 * 2**20, 2**30, 0.25),
            state,
            processes=lambda uuid: (),
            pod_of_pid=lambda pid: None,
        )
    )
    plugin = PluginMetrics(agent)
    plugin.allocate_latency.observe(0.004)
    plugin.registered.set(1)
    metrics = Metrics()
    for verb in ("filter", "prioritize", "bind"):
        metrics.latency.labels(verb).observe(0.002)
        metrics.requests.labels(verb, "200").inc()
    metrics.pods_filtered.labels("feasible").inc()
    metrics.node_rejections.labels("memory").inc()
    metrics.binds.labels("bound").inc()
    metrics.bind_failures.labels("conflict").inc()
    metrics.nodes.set(1)
    servers = [start_http_server(0, "127.0.0.1", registry=r) for r in (agent, metrics.registry)]
    try:
        yield servers[0][0].server_port, servers[1][0].server_port
    finally:
        for server, thread in servers:
            server.shutdown()
            thread.join(timeout=10)


@contextlib.contextmanager
def running_prometheus(directory: Path, rule_file: Path, jobs: list[dict[str, Any]]) -> Iterator[Prometheus]:
    """Prometheus scraping ``jobs`` every second, with ``rule_file``; stopped on exit."""
    binary = str(monitoring.binary("prometheus"))
    config = {
        "global": {"scrape_interval": "1s", "evaluation_interval": "1s"},
        "rule_files": [str(rule_file)],
        "scrape_configs": jobs,
    }
    (directory / "prometheus.yml").write_text(yaml.safe_dump(config))
    port = free_port()
    log_path = directory / "prometheus.log"
    with log_path.open("w") as log:
        process = subprocess.Popen(
            [
                binary,
                f"--config.file={directory / 'prometheus.yml'}",
                f"--storage.tsdb.path={directory / 'tsdb'}",
                f"--web.listen-address=127.0.0.1:{port}",
            ],
            stdout=log,
            stderr=subprocess.STDOUT,
        )
        try:
            server = Prometheus(f"http://127.0.0.1:{port}")
            deadline = time.monotonic() + 60
            while True:
                assert process.poll() is None, log_path.read_text()
                try:
                    # Every target scraped a few times: enough samples for rate() over the dashboard's
                    # window.
                    if len(server.query("count_over_time(up[1m]) >= 4")) == len(jobs):
                        break
                except OSError:
                    pass
                assert time.monotonic() < deadline, log_path.read_text()
                time.sleep(0.5)
            yield server
        finally:
            process.terminate()
            try:
                process.wait(timeout=30)
            except subprocess.TimeoutExpired:
                process.kill()
                process.wait(timeout=30)


def agent_job(name: str, port: int, *, honor_labels: bool) -> dict[str, Any]:
    return {
        "job_name": name,
        "honor_labels": honor_labels,
        "static_configs": [{"targets": [f"127.0.0.1:{port}"], "labels": AGENT_TARGET_LABELS}],
    }


@pytest.fixture(scope="module")
def prometheus(
    tmp_path_factory: pytest.TempPathFactory, repo_root: Path, exporters: tuple[int, int]
) -> Iterator[Prometheus]:
    """Scraping as the shipped configurations do (honor_labels, the alerts' job names)."""
    agent_port, extender_port = exporters
    jobs = [
        agent_job("tessera-device-plugin", agent_port, honor_labels=True),
        {
            "job_name": "tessera-extender",
            "honor_labels": True,
            "static_configs": [{"targets": [f"127.0.0.1:{extender_port}"]}],
        },
    ]
    rules = repo_root / "deploy" / "prometheus" / "tessera-alerts.yaml"
    with running_prometheus(tmp_path_factory.mktemp("prometheus"), rules, jobs) as server:
        yield server


def test_honor_labels_keeps_the_workloads_labels(
    tmp_path: Path, repo_root: Path, exporters: tuple[int, int]
) -> None:
    jobs = [
        agent_job("with-honor-labels", exporters[0], honor_labels=True),
        agent_job("without-honor-labels", exporters[0], honor_labels=False),
    ]
    rules = repo_root / "deploy" / "prometheus" / "tessera-alerts.yaml"
    with running_prometheus(tmp_path, rules, jobs) as prometheus:
        honored = prometheus.query('tessera_container_memory_quota_bytes{job="with-honor-labels"}')
        renamed = prometheus.query('tessera_container_memory_quota_bytes{job="without-honor-labels"}')
    assert {(s["metric"]["namespace"], s["metric"]["pod"], s["metric"]["container"]) for s in honored} == {
        ("ml", "train", "main"),
        ("ml", "infer", "main"),
    }
    assert not any(k.startswith("exported_") for s in honored for k in s["metric"])
    # Without it the target's labels win and the workload's are renamed: filters on namespace miss.
    assert {s["metric"]["namespace"] for s in renamed} == {"kube-system"}
    assert {s["metric"]["exported_namespace"] for s in renamed} == {"ml"}


def test_every_dashboard_query_answers_with_data(prometheus: Prometheus) -> None:
    answered = 0
    for query in panel_queries(VARIABLES):
        assert prometheus.query(query.expr), f"panel {query.panel!r}: no data for {query.expr}"
        answered += 1
    assert answered >= 20
    assert variable_values(prometheus, VARIABLES) == {
        "node": {NODE},
        "gpu": set(GPUS),
        "namespace": {"ml"},
        "pod": {"train", "infer"},
    }


def test_the_alerts_load_and_evaluate(prometheus: Prometheus, repo_root: Path) -> None:
    rules_file = repo_root / "deploy" / "prometheus" / "tessera-alerts.yaml"
    deadline = time.monotonic() + 30
    while True:
        groups = prometheus.get("/api/v1/rules")["groups"]
        rules = {r["name"]: r for g in groups for r in g["rules"]}
        if (
            all(r.get("lastEvaluation", "0001").startswith("20") for r in rules.values())
            or time.monotonic() > deadline
        ):
            break
        time.sleep(0.5)
    assert len(rules) == sum(len(g["rules"]) for g in yaml.safe_load(rules_file.read_text())["groups"])
    assert {name: r["health"] for name, r in rules.items()} == dict.fromkeys(rules, "ok")
    # Nothing is wrong with these exporters: no alert fires (the tripwires least of all).
    assert prometheus.get("/api/v1/alerts")["alerts"] == []


def test_a_dra_claims_series_keep_its_labels_and_none_of_the_drivers_pod(
    tmp_path: Path, repo_root: Path
) -> None:
    """The DRA driver's series of a pod's own claim that one container uses name them; those of a
    claim any pod may share have empty pod and container labels, which Prometheus keeps absent under
    honor_labels: never the driver pod's own name in their place."""
    state = StateDir(tmp_path / "state")
    for name, pod, containers in (("solo", "train", ("main",)), ("shared", "", ())):
        where = state.claim(f"uid-{name}")
        where.root.mkdir(parents=True)
        record = PreparedRecord(
            namespace="ml",
            name=name,
            uid=f"uid-{name}",
            devices=(),
            quotas=(GpuQuota(uuid=GPUS[0], memory_quota_bytes=2**30, cores=10),),
            pod=pod,
            containers=containers,
        )
        where.prepared.write_text(dump_record(record))
    inventory = (
        GpuInfo(
            uuid=GPUS[0],
            index=0,
            model=MODEL,
            total_memory_mib=40960,
            sm_count=108,
            compute_capability="8.0",
            split=1,
        ),
    )
    registry = CollectorRegistry()
    book = HealthBook((GPUS[0],), 1.0)
    registry.register(ClaimCollector(NODE, inventory, state, health=book.state, reading=lambda uuid: None))
    server, thread = start_http_server(0, "127.0.0.1", registry=registry)
    target = {"namespace": "kube-system", "pod": "tessera-dra-x7k2p", "container": "driver"}
    job = {
        "job_name": "tessera-dra",
        "honor_labels": True,
        "static_configs": [{"targets": [f"127.0.0.1:{server.server_port}"], "labels": target}],
    }
    try:
        with running_prometheus(
            tmp_path, repo_root / "deploy" / "prometheus" / "tessera-alerts.yaml", [job]
        ) as p:
            found = p.query("tessera_container_memory_quota_bytes")
            allocated = p.query("tessera_gpu_memory_allocated_bytes")
    finally:
        server.shutdown()
        thread.join(timeout=10)
    by_claim = {s["metric"]["claim"]: s["metric"] for s in found}
    assert set(by_claim) == {"solo", "shared"}
    assert {k: by_claim["solo"][k] for k in ("namespace", "pod", "container")} == {
        "namespace": "ml",
        "pod": "train",
        "container": "main",
    }
    assert by_claim["shared"]["namespace"] == "ml"
    assert "pod" not in by_claim["shared"] and "container" not in by_claim["shared"], by_claim["shared"]
    # The GPU's series, as the device plugin's: the dashboard's GPU panels and the tripwires read them.
    [gpu] = allocated
    assert gpu["metric"]["UUID"] == GPUS[0] and gpu["metric"]["job"] == "tessera-dra"
    assert float(gpu["value"][1]) == 2 * 2**30
