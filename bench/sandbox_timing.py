"""Sandbox timings: `tessera sandbox up` (Tessera installed by its chart) until ready, then pod
create until its container runs, through the chart-installed scheduler, extender and node agent.

    sudo .venv/bin/python bench/sandbox_timing.py [--ups 3] [--pods 5] [--dir /tmp/tessera-bench]

Brings a sandbox up (``--ups`` times, each followed by `down`, all timed: the builds and image
imports are warm from the second), and in the last one creates ``--pods`` GPU pods one after
another (the 1024 MiB / 30 % pod of deploy/examples/shared-gpu.yaml under new names) and
measures, for each, the time from the create call to (a) the pod bound by the extender, (b) the
pod Running (container started), (c) the probe's report in the log. Deletes each pod before the
next. Then `down`, timed too. Prints a Markdown table for docs/benchmarks.md. Numbers depend on
the machine's load; each run lists its environment.
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

from sandbox import cluster

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


def _delete(core: client.CoreV1Api, name: str) -> None:
    core.delete_namespaced_pod(name, "default", grace_period_seconds=0)
    while True:
        try:
            core.read_namespaced_pod(name, "default")
        except client.ApiException as e:
            if e.status == 404:
                return
            raise
        time.sleep(0.2)


def _row(label: str, values: list[float]) -> str:
    median, low, high = statistics.median(values), min(values), max(values)
    return f"| {label} | {median:.2f} | {low:.2f} | {high:.2f} | {len(values)} |"


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--pods", type=int, default=5)
    parser.add_argument("--ups", type=int, default=1, help="up/down cycles; pods run in the last")
    parser.add_argument("--dir", type=Path, default=Path("/tmp/tessera-bench"))
    args = parser.parse_args()
    up_seconds: list[float] = []
    down_seconds: list[float] = []
    left: list[str] = []
    for _ in range(args.ups - 1):
        began = time.monotonic()
        cluster.up(cluster.Options(root=args.dir), report=lambda m: print(f"up: {m}", file=sys.stderr))
        up_seconds.append(time.monotonic() - began)
        began = time.monotonic()
        left += cluster.down(args.dir, report=lambda _: None)
        down_seconds.append(time.monotonic() - began)
    began = time.monotonic()
    state = cluster.up(cluster.Options(root=args.dir), report=lambda m: print(f"up: {m}", file=sys.stderr))
    up_seconds.append(time.monotonic() - began)
    timings: list[tuple[float, float, float]] = []
    try:
        api = config.new_client_from_config(config_file=state.kubeconfig)
        core = client.CoreV1Api(api)
        for i in range(args.pods):
            name = f"bench-{i}"
            timings.append(_time_pod(core, name))
            _delete(core, name)
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
    print(_row("`sandbox down` (clean)", down_seconds))
    if left:
        print(f"down left: {left}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
