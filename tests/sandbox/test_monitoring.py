"""Monitoring end to end: `up --monitoring` runs Prometheus on the host, which finds Tessera's pods by
Kubernetes discovery against the sandbox's API server (the shipped scrape jobs, honor_labels) and
loads the chart's alerts. Two pods share the A100: one launches kernels past its 30 % compute quota
(throttled), one allocates past its 1 GiB memory quota (refused). Then every query of every panel of
the dashboard, with its variables filled in, must answer with series whose values are the truth this
test knows, and the refusals alert must fire on the real Prometheus.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import pytest
from kubernetes.stream import stream

from sandbox import gpu
from tessera.contract import KEYS, MIB
from tests.monitoring.dashboard_queries import Prometheus, panel_queries, variable_values
from tests.sandbox.conftest import FIRST, Sandbox
from tests.waiting import wait_for

pytestmark = pytest.mark.sandbox

A100, T4 = gpu.SANDBOX_GPUS
PYTHON_IMAGE = "docker.io/library/tessera-example-python:0.1.0"
PROBE_IMAGE = "docker.io/local/vgpu-probe:tessera-0.1"
# (pod, memory MiB, cores %): the compute pod is held to 30 % of the A100's time, the memory pod
# to 1 GiB, where vgpu-probe's fifth 256 MiB block is refused.
COMPUTE = ("compute-30", 2048, 30)
MEMORY = ("memory-1g", 1024, 20)
PROBE_BLOCKS_OK = 4
# 10 ms kernels back to back through cuda-bindings (the fake driver runs `sleep_us_<N>` for N us):
# without a quota the GPU would be busy all the time; the hook holds it to 30 %.
LAUNCHER = """
import sys
from cuda.bindings import driver as cuda

def ok(result):
    if result[0] != cuda.CUresult.CUDA_SUCCESS:
        sys.exit(repr(result[0]))
    return result[1:]

ok(cuda.cuInit(0))
(device,) = ok(cuda.cuDeviceGet(0))
(context,) = ok(cuda.cuDevicePrimaryCtxRetain(device))
ok(cuda.cuCtxSetCurrent(context))
(module,) = ok(cuda.cuModuleLoadData(b"any image"))
(kernel,) = ok(cuda.cuModuleGetFunction(module, b"sleep_us_10000"))
print("launching", flush=True)
while True:
    ok(cuda.cuLaunchKernel(kernel, 1, 1, 1, 1, 1, 1, 0, 0, 0, 0))
    ok(cuda.cuCtxSynchronize())
"""
# Scrapes of the workload running, after its last event, for the rates of its steady state.
STEADY_SECONDS = 60


def _pod(name: str, memory_mib: int, cores: int, image: str, command: list[str]) -> dict[str, Any]:
    return {
        "apiVersion": "v1",
        "kind": "Pod",
        "metadata": {"name": name, "annotations": {KEYS.gpu_models: "A100"}},
        "spec": {
            "schedulerName": "tessera-scheduler",
            "terminationGracePeriodSeconds": 2,
            "restartPolicy": "Never",
            "containers": [
                {
                    "name": "main",
                    "image": image,
                    "imagePullPolicy": "Never",
                    "command": command,
                    "resources": {
                        "limits": {
                            KEYS.vgpu: "1",
                            KEYS.vgpu_memory: str(memory_mib),
                            KEYS.vgpu_cores: str(cores),
                        }
                    },
                }
            ],
        },
    }


# First on the shared sandbox: the dashboard's numbers are the truth of this module's pods alone.
SHARED_SANDBOX_TURN = FIRST


@pytest.fixture(scope="module")
def monitored(shared_sandbox: Sandbox) -> Sandbox:
    return shared_sandbox


@dataclass(frozen=True)
class Workload:
    prometheus: Prometheus
    began: float
    """When it began (time.time()): the dashboard's rate window is the time since."""

    def window(self) -> str:
        return f"{math.ceil(time.time() - self.began)}s"


@pytest.fixture(scope="module")
def workload(monitored: Sandbox) -> Workload:
    """The two pods running, the refusals caused after Prometheus saw the counter at 0, and enough
    scrapes since for every rate."""
    sbx = monitored
    prometheus = Prometheus(sbx.state.prometheus_url)
    # Every target scraped inside the window before the workload: its counters' first samples there
    # are the zeros they start at, so that rates and increases count everything the workload does.
    wait_for(lambda: len(prometheus.query("up == 1")) == 3, timeout=60, what="3 targets scraped, up")
    began = time.time()
    wait_for(
        lambda: len(prometheus.query(f"timestamp(up) > {began}")) == 3,
        timeout=60,
        what="every target scraped once more",
    )
    # One after the other: a pod filtered while another's bind is in flight is rejected for it once
    # (the in-flight rule), a rejection this test does not want to count.
    name, memory, cores = COMPUTE
    sbx.core.create_namespaced_pod(
        "default", _pod(name, memory, cores, PYTHON_IMAGE, ["python3", "-c", LAUNCHER])
    )
    sbx.wait_pod(name, "Running")
    assert "launching" in sbx.logs(name, until="launching")
    name, memory, cores = MEMORY
    idle = ["/bin/sh", "-c", "trap 'exit 0' TERM; while :; do sleep 3600 & wait $!; done"]
    sbx.core.create_namespaced_pod("default", _pod(name, memory, cores, PROBE_IMAGE, idle))
    sbx.wait_pod(name, "Running")
    refused = f'tessera_container_allocations_refused_total{{pod="{MEMORY[0]}"}}'
    wait_for(lambda: _values(prometheus, refused) == [0.0], timeout=60, what=f"{refused} scraped at 0")
    report = stream(
        sbx.core.connect_get_namespaced_pod_exec,
        MEMORY[0],
        "default",
        command=["vgpu-probe", "256"],
        stderr=True,
        stdin=False,
        stdout=True,
        tty=False,
    )
    assert f"allocations_ok={PROBE_BLOCKS_OK}" in report and "refused_with=2" in report, report
    wait_for(lambda: _values(prometheus, refused) == [1.0], timeout=60, what=f"{refused} scraped at 1")
    time.sleep(STEADY_SECONDS)
    return Workload(prometheus, began)


def _values(prometheus: Prometheus, expr: str) -> list[float]:
    return [float(s["value"][1]) for s in prometheus.query(expr)]


def test_prometheus_discovers_tessera_pods_through_the_api_server(
    monitored: Sandbox, workload: Workload
) -> None:
    sbx = monitored
    targets = workload.prometheus.get("/api/v1/targets", state="active")["activeTargets"]
    by_job: dict[str, list[dict[str, Any]]] = {}
    for target in targets:
        by_job.setdefault(target["labels"]["job"], []).append(target)
    # The DaemonSet's one pod, and the extender beside kube-scheduler in both tessera-scheduler pods.
    assert {job: len(found) for job, found in by_job.items()} == {
        "tessera-device-plugin": 1,
        "tessera-extender": 2,
    }
    for target in targets:
        assert target["health"] == "up", target
        # Found by pod discovery, at the pod's IP on the sandbox's bridge.
        assert target["discoveredLabels"]["__meta_kubernetes_pod_node_name"] == sbx.state.node
        assert target["scrapeUrl"].startswith("http://10.244.77."), target["scrapeUrl"]


Check = Callable[[float, dict[str, str]], bool]


def _truth(slices: int, calls: dict[str, float]) -> dict[tuple[str, str], Check]:
    """What each panel query must answer, per series (its value and labels), keyed by panel title
    and legend, with ``slices`` the node advertises and the extender's ``calls`` by verb in the
    window. Every query of the dashboard must be here: a new panel needs its truth."""
    a100_quota = (COMPUTE[1] + MEMORY[1]) * MIB
    capacity = (A100.total_memory_mib + T4.total_memory_mib) * MIB
    compute_ratio = COMPUTE[2] / 100

    def per_gpu(on_a100: float, on_t4: float) -> Check:
        return lambda v, m: math.isclose(v, on_a100 if m["UUID"] == A100.uuid else on_t4, rel_tol=1e-9)

    def per_pod(compute: Check, memory: Check) -> Check:
        return lambda v, m: compute(v, m) if m["pod"] == COMPUTE[0] else memory(v, m)

    def equals(x: float) -> Check:
        return lambda v, m: math.isclose(v, x, rel_tol=1e-9)

    def between(low: float, high: float) -> Check:
        return lambda v, m: low <= v <= high

    zero = equals(0)
    positive: Check = lambda v, m: v > 0  # noqa: E731
    return {
        ("Unhealthy GPUs", "unhealthy"): zero,
        ("Slices in use / advertised", "in use"): equals(2),
        ("Slices in use / advertised", "advertised"): equals(slices),
        ("GPU memory allocated", "allocated"): equals(a100_quota / capacity),
        ("GPU cores allocated", "allocated"): equals((COMPUTE[2] + MEMORY[2]) / 100 / 2),
        ("GPU memory allocated against capacity", "{{Hostname}} {{UUID}} allocated"): per_gpu(a100_quota, 0),
        ("GPU memory allocated against capacity", "{{Hostname}} {{UUID}} capacity"): per_gpu(
            A100.total_memory_mib * MIB, T4.total_memory_mib * MIB
        ),
        ("GPU cores allocated", "{{Hostname}} {{UUID}}"): per_gpu((COMPUTE[2] + MEMORY[2]) / 100, 0),
        ("GPU memory in use (driver)", "{{Hostname}} {{UUID}} used"): lambda v, m: 0 <= v <= a100_quota,
        ("GPU memory in use (driver)", "{{Hostname}} {{UUID}} total"): per_gpu(
            A100.total_memory_mib * MIB, T4.total_memory_mib * MIB
        ),
        ("GPU utilization", "{{Hostname}} {{UUID}}"): between(0, 1),
        # The launcher holds no memory of its own; the probe freed its blocks.
        ("Container GPU memory: used against quota", "{{namespace}}/{{pod}} {{container}} used"): zero,
        ("Container GPU memory: used against quota", "{{namespace}}/{{pod}} {{container}} peak"): per_pod(
            zero, equals(PROBE_BLOCKS_OK * 256 * MIB)
        ),
        ("Container GPU memory: used against quota", "{{namespace}}/{{pod}} {{container}} quota"): per_pod(
            equals(COMPUTE[1] * MIB), equals(MEMORY[1] * MIB)
        ),
        # Held to its quota: busy about 30 % of the time (the token bucket's burst allowed for).
        ("Container GPU time: achieved against quota", "{{namespace}}/{{pod}} {{container}} achieved"): (
            per_pod(between(0.5 * compute_ratio, 1.2 * compute_ratio), zero)
        ),
        ("Container GPU time: achieved against quota", "{{namespace}}/{{pod}} {{container}} quota"): per_pod(
            equals(compute_ratio), equals(MEMORY[2] / 100)
        ),
        ("Time throttled by the compute quota", "{{namespace}}/{{pod}} {{container}}"): per_pod(
            positive, zero
        ),
        # One refusal caused; increase() extrapolates to the window's edges by at most a scrape.
        ("Allocations refused by the memory quota", "{{namespace}}/{{pod}} {{container}}"): per_pod(
            zero, between(1, 1.5)
        ),
        ("Pods over their quotas by the driver", "{{namespace}}/{{pod}} {{UUID}}"): zero,
        ("Allocate latency p99", "p99"): lambda v, m: 0 < v <= 10,
        ("Allocate refusals by status", "{{code}}"): zero,
        ("Agents registered with their kubelet", "registered"): equals(1),
        ("Agents registered with their kubelet", "agents"): equals(1),
        # A verb kube-scheduler did not call in the window has no p99 (NaN); one it called has one.
        ("Extender latency p99 by verb", "{{verb}}"): lambda v, m: (
            0 < v <= 5 if calls[m["verb"]] else math.isnan(v)
        ),
        ("Extender binds, failures and resizes", "{{result}}"): lambda v, m: (
            v > 0 if m["result"] == "bound" else v == 0
        ),
        ("Extender binds, failures and resizes", "failed: {{reason}}"): zero,
        ("Extender binds, failures and resizes", "resize: {{result}}"): zero,  # none asked
        ("Filter decisions and Pending reasons", "{{result}}"): lambda v, m: (
            v > 0 if m["result"] == "feasible" else v == 0
        ),
        ("Filter decisions and Pending reasons", "rejected: {{reason}}"): zero,
        ("Nodes with a Tessera inventory", "nodes"): equals(1),
    }


def test_every_dashboard_query_answers_with_the_truth(monitored: Sandbox, workload: Workload) -> None:
    sbx = monitored
    prometheus = workload.prometheus
    # Rates and increases over the workload's whole span, as a user looking at its time range would.
    window = workload.window()
    variables = {
        "$node": sbx.state.node,
        "$gpu": f"{A100.uuid}|{T4.uuid}",
        "$namespace": "default",
        "$pod": ".*",
        "$__rate_interval": window,
    }
    node = sbx.core.read_node(sbx.state.node)
    counted = prometheus.query(f"sum by (verb) (increase(tessera_extender_request_seconds_count[{window}]))")
    calls = {s["metric"]["verb"]: float(s["value"][1]) for s in counted}
    assert calls["filter"] > 0 and calls["bind"] > 0, calls
    truth = _truth(int(node.status.allocatable[KEYS.vgpu]), calls)
    asked = set()
    wrong = []
    for query in panel_queries(variables):
        key = (query.panel, query.legend)
        assert key in truth, f"no truth for panel {query.panel!r}, query {query.legend!r}: {query.expr}"
        asked.add(key)
        result = prometheus.query(query.expr)
        assert result, f"panel {query.panel!r}: no series for {query.expr}"
        for series in result:
            value = float(series["value"][1])
            if not truth[key](value, series["metric"]):
                wrong.append(f"{query.panel!r} {series['metric']} = {value} ({query.expr})")
    assert not wrong, "\n".join(wrong)
    assert asked == set(truth)
    assert variable_values(prometheus, variables) == {
        "node": {sbx.state.node},
        "gpu": {A100.uuid, T4.uuid},
        "namespace": {"default"},
        "pod": {COMPUTE[0], MEMORY[0]},
    }


def test_the_refusals_alert_fires_and_no_other(workload: Workload) -> None:
    prometheus = workload.prometheus

    def firing() -> list[dict[str, Any]]:
        return [a for a in prometheus.get("/api/v1/alerts")["alerts"] if a["state"] == "firing"]

    alerts = wait_for(firing, timeout=60, what="an alert firing")
    assert [(a["labels"]["alertname"], a["labels"]["pod"]) for a in alerts] == [
        ("TesseraContainerAllocationsRefused", MEMORY[0])
    ]
    rules = [r for g in prometheus.get("/api/v1/rules")["groups"] for r in g["rules"]]
    assert {r["health"] for r in rules} == {"ok"}
