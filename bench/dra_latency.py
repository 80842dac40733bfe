"""The DRA path's latency on a real node: a claim (and its pod) created -> the pod Running, and how long
the driver takes to answer the kubelet's NodePrepareResources / NodeUnprepareResources.

Brings up the DRA sandbox (``tessera sandbox up --mode dra``: Kubernetes 1.37's control plane and
kubelet, the containerd 2 that hack/k8s-binaries.sh builds, Tessera's chart in DRA mode on the fake
GPUs) in its own directory, and brings it down at the end. Root; run it under the sandbox lock.

Each round creates ``--claims`` claims of 1 GiB / 5 cores on the A100, each with a pod (the probe
image idling), one after the other; timed per pod from its claim's create call until a watch sees the
pod Running (kube-scheduler's allocation, the kubelet's prepare through the driver, containerd's
container with the claim's CDI device). Then the pods and claims are deleted and the kubelet
unprepares them. The driver logs how long each call took (``NodePrepareResources: 1 claim(s) in
X ms``, from the request to the answer inside the driver); those lines are read from its pod's log.

    flock /tmp/tessera-sandbox.lock .venv/bin/python -m bench.dra_latency [--rounds 3] [--claims 16]

Reported: p50 / p99 / max in ms.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import re
import shutil
import threading
import time
from pathlib import Path
from typing import Any

import urllib3
from kubernetes import client, config, watch

from sandbox import cluster, install
from sandbox.controlplane import DRA_K8S_VERSION
from sandbox.images import PROBE_IMAGE
from tessera.cliargs import positive_int
from tessera.contract import KEYS

NAMESPACE = "default"
GROUP, VERSION = "resource.k8s.io", "v1"
DRIVER_TIMING = re.compile(r"(NodePrepareResources|NodeUnprepareResources): 1 claim\(s\) in ([0-9.]+) ms")


def percentiles(samples: list[float]) -> str:
    ordered = sorted(samples)
    p50 = ordered[(len(ordered) - 1) // 2]
    p99 = ordered[min(len(ordered) - 1, round(0.99 * (len(ordered) - 1)))]
    return f"{p50:.1f} | {p99:.1f} | {ordered[-1]:.1f}"


class Running:
    """When a watch first saw each pod Running (monotonic seconds)."""

    def __init__(self, api: client.ApiClient) -> None:
        self._core = client.CoreV1Api(api)
        self.seen: dict[str, float] = {}
        self._changed = threading.Condition()
        self._watch = watch.Watch()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def _run(self) -> None:
        # A watch cut short (stop(), or the API server gone) ends the thread; wait() then names
        # the pods never seen Running.
        with contextlib.suppress(urllib3.exceptions.HTTPError):
            for event in self._watch.stream(self._core.list_namespaced_pod, NAMESPACE):
                pod = event["object"]
                if pod.status.phase == "Running":
                    with self._changed:
                        self.seen.setdefault(pod.metadata.name, time.monotonic())
                        self._changed.notify_all()

    def wait(self, names: list[str], timeout: float = 300.0) -> None:
        with self._changed:
            if not self._changed.wait_for(lambda: all(n in self.seen for n in names), timeout):
                missing = [n for n in names if n not in self.seen]
                raise SystemExit(f"pods never Running: {missing}")

    def stop(self) -> None:
        self._watch.stop()


def claim_body(name: str) -> dict[str, Any]:
    request = {
        "deviceClassName": KEYS.dra_device_class,
        "capacity": {"requests": {"memory": "1Gi", "cores": "5"}},
    }
    return {
        "apiVersion": f"{GROUP}/{VERSION}",
        "kind": "ResourceClaim",
        "metadata": {"name": name},
        "spec": {"devices": {"requests": [{"name": "gpu", "exactly": request}]}},
    }


def pod_body(name: str) -> dict[str, Any]:
    container = {
        "name": "idle",
        "image": PROBE_IMAGE,
        "imagePullPolicy": "Never",
        "command": ["/bin/sh", "-c", "trap 'exit 0' TERM; while :; do sleep 3600 & wait $!; done"],
        "resources": {"claims": [{"name": "gpu"}]},
    }
    return {
        "metadata": {"name": name},
        "spec": {
            "terminationGracePeriodSeconds": 1,
            "resourceClaims": [{"name": "gpu", "resourceClaimName": name}],
            "containers": [container],
        },
    }


def wait_gone(list_names: Any, what: str, timeout: float = 300.0) -> None:
    deadline = time.monotonic() + timeout
    while list_names():
        if time.monotonic() > deadline:
            raise SystemExit(f"{what} still there after {timeout:.0f}s: {list_names()}")
        time.sleep(0.5)


def driver_timings(api: client.ApiClient, node: str) -> dict[str, list[float]]:
    found: dict[str, list[float]] = {"NodePrepareResources": [], "NodeUnprepareResources": []}
    core = client.CoreV1Api(api)
    for pod in install.agent_pods(api, node):
        text = core.read_namespaced_pod_log(pod.metadata.name, install.NAMESPACE)
        for call, ms in DRIVER_TIMING.findall(text):
            found[call].append(float(ms))
    return found


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=positive_int, default=3)
    parser.add_argument("--claims", type=positive_int, default=16)
    args = parser.parse_args()

    root = Path(f"/tmp/tessera-bench-dra-{os.getpid()}")
    try:
        state = cluster.up(cluster.dra(cluster.Options(root=root)), report=lambda _: None)
        with contextlib.closing(config.new_client_from_config(config_file=state.kubeconfig)) as api:
            core, objects = client.CoreV1Api(api), client.CustomObjectsApi(api)
            runtime = core.read_node(state.node).status.node_info.container_runtime_version
            running = Running(api)
            to_running_ms: list[float] = []
            for round_number in range(args.rounds):
                names = [f"r{round_number}-c{n}" for n in range(args.claims)]
                created: dict[str, float] = {}
                for name in names:
                    created[name] = time.monotonic()
                    objects.create_namespaced_custom_object(
                        GROUP, VERSION, NAMESPACE, "resourceclaims", claim_body(name)
                    )
                    core.create_namespaced_pod(NAMESPACE, pod_body(name))
                running.wait(names)
                to_running_ms += [(running.seen[n] - created[n]) * 1000 for n in names]
                for name in names:
                    core.delete_namespaced_pod(name, NAMESPACE)
                wait_gone(lambda: core.list_namespaced_pod(NAMESPACE).items, "pods")
                for name in names:
                    objects.delete_namespaced_custom_object(GROUP, VERSION, NAMESPACE, "resourceclaims", name)
                wait_gone(
                    lambda: objects.list_namespaced_custom_object(
                        GROUP, VERSION, NAMESPACE, "resourceclaims"
                    )["items"],
                    "claims",
                )
            running.stop()
            timings = driver_timings(api, state.node)
        print(
            f"Kubernetes {DRA_K8S_VERSION} (kubelet and control plane), {runtime}; "
            f"{args.rounds} rounds x {args.claims} claims, one after the other"
        )
        print("| step | n | p50 ms | p99 ms | max ms |")
        print("| --- | --- | --- | --- | --- |")
        print(f"| claim + pod created -> pod Running | {len(to_running_ms)} | {percentiles(to_running_ms)} |")
        for call, samples in timings.items():
            print(f"| {call} in the driver | {len(samples)} | {percentiles(samples)} |")
    finally:
        cluster.down(root, report=lambda _: None)
        shutil.rmtree(root, ignore_errors=True)


if __name__ == "__main__":
    main()
