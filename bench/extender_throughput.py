"""Scheduling throughput through the real kube-scheduler on 1,000 fake nodes, with and without the
extender, measured in one run.

The same pods in every phase: ``vgpu: 1, vgpu-memory: 4096, vgpu-cores: 20``. Each fake node
advertises its 8 GPUs' worth of all three resources (64 slices, 8 x the model's memory, 800 cores).

* without: kube-scheduler with no extender; its in-tree fit counts the three resources per node (all
  a stock scheduler can do with them: no per-GPU accounting), the default binder binds.
* with: deploy/scheduler-config.yaml (extender filter + bind; memory and cores ignored by the
  in-tree fit, placed per GPU by the extender).

* with, device plugin writing: the same, and a stand-in for the device plugin marks each bound pod
  ``allocated`` as soon as the watch shows it (a kubelet would admit it, the device plugin serve it).
  That is node-side work, not scheduling, but it is one more write per pod for the API server the
  schedulers share the cores with, and it lets the in-flight rule see pods served.

In the first two phases no node writes anything (fake nodes, no kubelet): bound pods stay in flight
and the in-flight rule holds each node to one allocation key per GPU count.

Each phase creates the pods at once (8 client threads) and times from the first create to the last
pod seen bound (a watch on the namespace). Every scheduler gets ``clientConnection.qps: 500`` so the
client-side rate limiter (default 50/s, which the default binder goes through but the extender's own
client does not) does not decide the comparison. Phases alternate for ``--rounds`` rounds; each
ratio is that of the same round's phase without the extender, and the run's figure is their median.

    .venv/bin/python -m bench.extender_throughput [--nodes 1000] [--pods 1000] [--rounds 5]
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import threading
import time
import urllib.request
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import yaml
from kubernetes import client, config
from kubernetes.watch import Watch

from bench.fleet import GPUS_PER_NODE, make_nodes, pod_body
from sandbox.controlplane import ControlPlane, ManagedProcess, free_port
from tessera.contract import KEYS, Phase

REPO = Path(__file__).resolve().parents[1]

QPS = 500
# (label, with the extender, device plugin stand-in writing)
PHASES = (
    ("without extender", False, False),
    ("with extender", True, False),
    ("with extender, device plugin writing", True, True),
)


def scheduler_config(extender_url: str | None) -> str:
    cfg = yaml.safe_load((REPO / "deploy" / "scheduler-config.yaml").read_text())
    cfg["clientConnection"] = {"kubeconfig": "{kubeconfig}", "qps": QPS, "burst": 2 * QPS}
    cfg["leaderElection"] = {"leaderElect": False}
    if extender_url is None:
        del cfg["extenders"]
    else:
        cfg["extenders"][0]["urlPrefix"] = extender_url
    return str(yaml.safe_dump(cfg))


def timed_phase(
    api: client.ApiClient,
    namespace: str,
    count: int,
    *,
    device_plugin: bool,
    args_timeout: float = 600,
) -> float:
    """Pods per second from the first create to the last bound."""
    core = client.CoreV1Api(api)
    core.create_namespace({"metadata": {"name": namespace}})
    bound: set[str] = set()
    done = threading.Event()
    watch = Watch()

    admitting = ThreadPoolExecutor(4)
    served: set[str] = set()

    def admit(name: str) -> None:
        # What the device plugin does once the kubelet admits the pod and calls Allocate.
        patch = {"metadata": {"annotations": {KEYS.allocation_phase: Phase.ALLOCATED.value}}}
        core.patch_namespaced_pod(name, namespace, patch)

    def follow() -> None:
        while not done.is_set():  # a watch the server ends early starts again (from a fresh list)
            try:
                for event in watch.stream(core.list_namespaced_pod, namespace, timeout_seconds=600):
                    obj = event["object"]
                    if not obj.spec.node_name:
                        continue
                    bound.add(obj.metadata.name)
                    phase = (obj.metadata.annotations or {}).get(KEYS.allocation_phase)
                    if device_plugin and phase == Phase.ALLOCATING and obj.metadata.name not in served:
                        served.add(obj.metadata.name)
                        admitting.submit(admit, obj.metadata.name)
                    if len(bound) >= count:
                        done.set()
                        return
            except Exception as e:
                print(f"{namespace}: watch ended ({e}); watching again", file=sys.stderr)

    follower = threading.Thread(target=follow, daemon=True)
    follower.start()
    time.sleep(0.5)
    started = time.perf_counter()
    with ThreadPoolExecutor(8) as pool:
        list(pool.map(lambda i: core.create_namespaced_pod(namespace, pod_body(f"p-{i:05d}")), range(count)))
    if not done.wait(args_timeout):
        listed = sum(1 for p in core.list_namespaced_pod(namespace).items if p.spec.node_name)
        print(f"{namespace}: the API server lists {listed} pods bound", file=sys.stderr)
        raise RuntimeError(f"{namespace}: only {len(bound)} of {count} pods bound after {args_timeout:.0f} s")
    elapsed = time.perf_counter() - started
    watch.stop()
    admitting.shutdown(wait=True)
    return count / elapsed


def cpu_seconds(process: ManagedProcess) -> float:
    """User + system CPU time of a child process so far (Linux /proc)."""
    assert process.popen is not None
    fields = Path(f"/proc/{process.popen.pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def start_extender(plane: ControlPlane) -> str:
    port = free_port()
    process = ManagedProcess(
        "tessera-extender",
        [
            sys.executable,
            "-m",
            "extender.main",
            f"--listen=127.0.0.1:{port}",
            f"--kubeconfig={plane.kubeconfig}",
            f"--speed-profiles={REPO / 'deploy' / 'speed-profiles.yaml'}",
            "--heartbeat-timeout=3600",
            "--log-level=warning",
            "--metrics-authorization=none",  # this benchmark reads the counters it runs up, on loopback
        ],
        plane.work_dir / "logs" / "tessera-extender.log",
    )
    plane.processes.append(process)
    process.start()
    url = f"http://127.0.0.1:{port}"

    deadline = time.monotonic() + 120
    while time.monotonic() < deadline:
        try:
            with urllib.request.urlopen(f"{url}/readyz", timeout=2) as response:
                if response.status == 200:
                    return url
        except OSError:
            time.sleep(0.3)
    raise RuntimeError(f"extender not ready:\n{process.log_tail()}")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--nodes", type=int, default=1000)
    parser.add_argument("--pods", type=int, default=1000)
    parser.add_argument("--rounds", type=int, default=5)
    args = parser.parse_args()
    with (
        tempfile.TemporaryDirectory(prefix="tessera-bench-") as work,
        ControlPlane(work_dir=Path(work)) as plane,
    ):
        api = config.new_client_from_config(config_file=str(plane.kubeconfig))
        core = client.CoreV1Api(api)
        started = time.perf_counter()
        make_nodes(core, range(args.nodes))
        print(
            f"{args.nodes} nodes x {GPUS_PER_NODE} GPUs created in {time.perf_counter() - started:.0f} s",
            flush=True,
        )
        extender_url = start_extender(plane)
        rows = []
        for round_ in range(args.rounds):
            rates: dict[str, float] = {}
            for label, extended, device_plugin in PHASES:
                url = extender_url if extended else None
                scheduler = plane.start_scheduler(scheduler_config(url), name=f"sched-{round_}-{len(rates)}")
                # Every process of the run (etcd, kube-apiserver, kube-scheduler, the extender) and
                # this one (the clients creating pods, the watch, the device plugin's stand-in).
                watched = [p for p in plane.processes if p.popen is not None and p.popen.poll() is None]
                before = [cpu_seconds(p) for p in watched]
                own_before = sum(os.times()[:2])
                namespace = f"phase-{round_}-{len(rates)}"
                try:
                    rates[label] = timed_phase(api, namespace, args.pods, device_plugin=device_plugin)
                    # CPU until the last pod is bound (the pods' deletion below is not counted).
                    used = {
                        p.name: (cpu_seconds(p) - b) * 1000 / args.pods
                        for p, b in zip(watched, before, strict=True)
                    }
                    used["benchmark clients"] = (sum(os.times()[:2]) - own_before) * 1000 / args.pods
                finally:
                    plane.stop_process(scheduler)
                    core.delete_collection_namespaced_pod(namespace, grace_period_seconds=0)
                shares = ", ".join(f"{name} {ms:.1f}" for name, ms in used.items())
                print(
                    f"round {round_ + 1}, {label}: {rates[label]:.1f} pods/s; "
                    f"CPU ms per pod: {shares}; total {sum(used.values()):.1f}",
                    flush=True,
                )
            rows.append(rates)
        with urllib.request.urlopen(f"{extender_url}/metrics", timeout=5) as response:
            refused = [
                line
                for line in response.read().decode().splitlines()
                if line.startswith(
                    (
                        "tessera_extender_bind_failures_total",
                        "tessera_extender_binds_total",
                        "tessera_extender_request_seconds_sum",
                        "tessera_extender_request_seconds_count",
                    )
                )
            ]
        print("extender: " + "; ".join(refused))
        print(f"\n{args.nodes} nodes, {args.pods} pods per phase")
        print("| round | " + " | ".join(f"{label}, pods/s" for label, _, _ in PHASES) + " | ratios |")
        print("|---:|" + "---:|" * (len(PHASES) + 1))
        for i, rates in enumerate(rows):
            without = rates[PHASES[0][0]]
            ratios = " / ".join(f"{rates[label] / without:.2f}" for label, _, _ in PHASES[1:])
            print(f"| {i + 1} | " + " | ".join(f"{rate:.1f}" for rate in rates.values()) + f" | {ratios} |")
        # Single rounds swing with the 2-core machine's speed from second to second: the median of
        # the rounds' ratios is the run's figure.
        medians = " / ".join(
            f"{statistics.median(r[label] / r[PHASES[0][0]] for r in rows):.2f}" for label, _, _ in PHASES[1:]
        )
        print(
            "| median | "
            + " | ".join(f"{statistics.median(r[label] for r in rows):.1f}" for label, _, _ in PHASES)
            + f" | {medians} |"
        )
        api.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
