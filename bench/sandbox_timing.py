"""Sandbox timings: `tessera sandbox up` (Tessera installed by its chart) until ready, then pod
create until its container runs, through the chart-installed scheduler, extender and node agent.

    sudo .venv/bin/python -m bench.sandbox_timing [--ups 3] [--pods 5] [--bursts 0] [--burst 20]
        [--dir /tmp/tessera-bench] [--nodes 1] [--idle 30]

Brings a sandbox up (``--ups`` times, each followed by `down`, all timed: the builds and image
imports are warm from the second), and in the last one creates ``--pods`` GPU pods one after
another (the 1024 MiB / 30 % pod of deploy/examples/shared-gpu.yaml under new names) and
measures, for each, the time from the create call to (a) the pod bound by the extender, (b) the
pod Running (container started), (c) the probe's report in the log. Deletes each pod before the
next. Then ``--bursts`` times, ``--burst`` small idle GPU pods created at once (as a Deployment
scaled up does): each burst until all run, then deleted. For the bursts the real kubelet's own
histogram of its Allocate calls (``kubelet_device_plugin_alloc_duration_seconds``: the round trip
the kubelet waits on, read from its metrics port) and the node agent's
(``tessera_device_plugin_allocate_seconds``) are read before and after, and the Allocate calls
counted per bucket: the kubelet admits a node's pods one at a time, so this is the latency of 20
admissions at once as a GPU node sees them, with every container start, phase write and watch
event of the burst competing for the same cores. Before the pods, each node's footprint: the
resident memory of its processes (kubelet, containerd, kube-proxy, shims, pods: the node agent's and
the scheduler's among them) and their CPU over ``--idle`` seconds of an idle cluster. Then `down`,
timed too. Prints Markdown tables
for docs/benchmarks.md. Numbers depend on the machine's load; each run lists its environment.
"""

from __future__ import annotations

import argparse
import os
import platform
import statistics
import sys
import time
from pathlib import Path
from typing import Any

import yaml
from kubernetes import client, config
from prometheus_client.parser import text_string_to_metric_families

from sandbox import cluster, install, kubelet, nodelife, record
from sandbox.layout import Layout
from tessera.contract import KEYS

EXAMPLE = Path(__file__).resolve().parents[1] / "deploy" / "examples" / "shared-gpu.yaml"


def _pod(name: str) -> dict[str, Any]:
    pod = next(d for d in yaml.safe_load_all(EXAMPLE.read_text()) if d["metadata"]["name"] == "quota-1g")
    return {**pod, "metadata": {**pod["metadata"], "name": name}}


def _time_pod(core: client.CoreV1Api, name: str, timeout: float = 120) -> tuple[float, float, float]:
    began = time.monotonic()
    core.create_namespaced_pod("default", _pod(name))
    bound = running = None
    while time.monotonic() - began < timeout:
        pod = core.read_namespaced_pod(name, "default")
        now = time.monotonic() - began
        if bound is None and pod.spec.node_name:
            bound = now
        if running is None and pod.status.phase == "Running":
            running = now
        if running is not None and "refused_with=" in core.read_namespaced_pod_log(name, "default"):
            assert bound is not None
            return bound, running, time.monotonic() - began
        time.sleep(0.05)
    raise RuntimeError(f"pod {name} not running with a probe report after {timeout}s")


def _burst_pod(name: str) -> dict[str, Any]:
    """A small share (512 MiB, 5 % of the cores, any GPU model) whose container only waits: 20 of
    them fit the sandbox's GPUs, and the burst times admissions, not the probe."""
    pod = _pod(name)
    container = {
        **pod["spec"]["containers"][0],
        "command": ["/bin/sh", "-c", "trap 'exit 0' TERM; while :; do sleep 3600 & wait $!; done"],
        "resources": {"limits": {KEYS.vgpu: "1", KEYS.vgpu_memory: "512", KEYS.vgpu_cores: "5"}},
    }
    return {**pod, "metadata": {"name": name}, "spec": {**pod["spec"], "containers": [container]}}


Buckets = dict[float, float]  # upper bound in seconds -> calls at or under it (cumulative)


def _histogram(text: str, name: str) -> Buckets:
    """The cumulative bucket counts of histogram ``name`` (every label set summed)."""
    counts: Buckets = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            if sample.name == f"{name}_bucket":
                bound = float(sample.labels["le"])
                counts[bound] = counts.get(bound, 0.0) + sample.value
    return counts


def _kubelet_allocations(port: int) -> Buckets:
    text = kubelet.metrics(port)
    if text is None:
        raise RuntimeError(f"the kubelet's metrics on port {port} cannot be read")
    return _histogram(text, "kubelet_device_plugin_alloc_duration_seconds")


def _agent_allocations(api: client.ApiClient, node: str) -> Buckets:
    return _histogram(install.agent_metrics(api, node), "tessera_device_plugin_allocate_seconds")


def _burst(core: client.CoreV1Api, names: list[str], timeout: float = 300) -> float:
    """Creates the pods at once and waits until all run; seconds from the first create."""
    began = time.monotonic()
    for name in names:
        core.create_namespaced_pod("default", _burst_pod(name))
    while time.monotonic() - began < timeout:
        pods = [p for p in core.list_namespaced_pod("default").items if p.metadata.name in names]
        if len(pods) == len(names) and all(p.status.phase == "Running" for p in pods):
            return time.monotonic() - began
        if failed := [p.metadata.name for p in pods if p.status.phase == "Failed"]:
            raise RuntimeError(f"burst pods failed: {failed}")
        time.sleep(0.2)
    raise RuntimeError(f"burst of {len(names)} pods not all Running after {timeout}s")


def _bucket_rows(label: str, before: Buckets, after: Buckets) -> list[str]:
    calls = after[float("inf")] - before.get(float("inf"), 0.0)
    rows = []
    for bound in sorted(b for b in after if b != float("inf")):
        under = after[bound] - before.get(bound, 0.0)
        rows.append(
            f"| {label} | <= {bound * 1000:g} ms | {under:.0f} of {calls:.0f} | {100 * under / calls:.1f} % |"
        )
        if under == calls:
            break
    return rows


def _delete(core: client.CoreV1Api, name: str) -> None:
    core.delete_namespaced_pod(name, "default", grace_period_seconds=0)
    _wait_gone(core, name)


def _wait_gone(core: client.CoreV1Api, name: str) -> None:
    while True:
        try:
            core.read_namespaced_pod(name, "default")
        except client.ApiException as e:
            if e.status == 404:
                return
            raise
        time.sleep(0.2)


def _rss_kib(pid: int) -> int:
    try:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith("VmRSS:"):
                return int(line.split()[1])
    except OSError:
        pass
    return 0


def _cpu_ticks(pid: int) -> int:
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    except OSError:
        return 0
    return int(fields[11]) + int(fields[12])  # utime, stime


def _footprint(root: Path, state: record.SandboxState, idle_seconds: float) -> list[str]:
    """Each node's processes (its kubelet, containerd, kube-proxy, shims and pods, the node agent's
    among them; sandbox.nodelife.node_processes): resident memory, and CPU while the cluster idles."""
    layout = Layout(root)
    names = [state.node, *(n.name for n in state.nodes)]
    listed = {name: nodelife.node_processes(layout, state, name) for name in names}
    before = {name: {pid: _cpu_ticks(pid) for pid in listed[name]()} for name in names}
    time.sleep(idle_seconds)
    rows = []
    hz = os.sysconf("SC_CLK_TCK")
    for name in names:
        pids = listed[name]()
        rss = sum(_rss_kib(pid) for pid in pids) / 1024
        used = sum(_cpu_ticks(pid) - before[name].get(pid, 0) for pid in pids) / hz
        rows.append(f"| {name} | {len(pids)} | {rss:.0f} | {100 * used / idle_seconds:.1f} % |")
    return rows


def _row(label: str, values: list[float]) -> str:
    median, low, high = statistics.median(values), min(values), max(values)
    return f"| {label} | {median:.2f} | {low:.2f} | {high:.2f} | {len(values)} |"


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--pods", type=int, default=5)
    parser.add_argument("--ups", type=int, default=1, help="up/down cycles; pods run in the last")
    parser.add_argument("--bursts", type=int, default=0, help="bursts of --burst pods created at once")
    parser.add_argument("--burst", type=int, default=20)
    parser.add_argument("--dir", type=Path, default=Path("/tmp/tessera-bench"))
    parser.add_argument("--nodes", type=int, default=1, help="nodes of the sandbox (up --nodes)")
    parser.add_argument("--idle", type=float, default=30.0, help="seconds of idle to measure CPU over")
    args = parser.parse_args()
    options = cluster.Options(root=args.dir, nodes=args.nodes)
    up_seconds: list[float] = []
    down_seconds: list[float] = []
    left: list[str] = []
    for _ in range(args.ups - 1):
        began = time.monotonic()
        cluster.up(options, report=lambda m: print(f"up: {m}", file=sys.stderr))
        up_seconds.append(time.monotonic() - began)
        began = time.monotonic()
        left += cluster.down(args.dir, report=lambda _: None)
        down_seconds.append(time.monotonic() - began)
    began = time.monotonic()
    state = cluster.up(options, report=lambda m: print(f"up: {m}", file=sys.stderr))
    up_seconds.append(time.monotonic() - began)
    timings: list[tuple[float, float, float]] = []
    burst_seconds: list[float] = []
    footprint: list[str] = []
    try:
        footprint = _footprint(args.dir, state, args.idle)
        api = config.new_client_from_config(config_file=state.kubeconfig)
        core = client.CoreV1Api(api)
        for i in range(args.pods):
            name = f"bench-{i}"
            timings.append(_time_pod(core, name))
            _delete(core, name)
        before = (_kubelet_allocations(state.kubelet_port), _agent_allocations(api, state.node))
        for b in range(args.bursts):
            names = [f"burst-{b}-{i:02d}" for i in range(args.burst)]
            burst_seconds.append(_burst(core, names))
            for name in names:
                core.delete_namespaced_pod(name, "default", grace_period_seconds=0)
            for name in names:
                _wait_gone(core, name)
        after = (_kubelet_allocations(state.kubelet_port), _agent_allocations(api, state.node))
        api.close()
    finally:
        began = time.monotonic()
        left += cluster.down(args.dir, report=lambda _: None)
        down_seconds.append(time.monotonic() - began)
    day = time.strftime("%Y-%m-%d")
    print(f"Environment: {platform.node()}, {os.cpu_count()} CPUs, Linux {platform.release()}, {day}")
    print()
    print("| step | median s | min s | max s | n |")
    print("|---|---|---|---|---|")
    print(_row("`sandbox up` until ready (helm install, GPU slices, both extenders synced)", up_seconds))
    print(_row("pod create -> bound by the extender", [t[0] for t in timings]))
    print(_row("pod create -> Running (after Allocate, container started)", [t[1] for t in timings]))
    print(_row("pod create -> probe report in the log", [t[2] for t in timings]))
    if burst_seconds:
        print(_row(f"{args.burst} pods created at once -> all Running", burst_seconds))
    print(_row("`sandbox down` (clean)", down_seconds))
    if burst_seconds:
        print()
        print("| Allocate, seen by | within | calls | share |")
        print("|---|---|---|---|")
        for label, was, now in zip(("the kubelet", "the node agent"), before, after, strict=True):
            print("\n".join(_bucket_rows(label, was, now)))
    print()
    print(f"| node | processes | resident MiB | CPU over {args.idle:.0f} s idle (of one core) |")
    print("|---|---|---|---|")
    print("\n".join(footprint))
    if left:
        print(f"down left: {left}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
