"""The DRA path's latency: a claim (and its pod) created -> allocated by kube-scheduler, and the
driver's NodePrepareResources / NodeUnprepareResources round trips.

Runs a real Kubernetes 1.37 control plane (etcd, kube-apiserver, kube-scheduler, the ResourceClaim
controller of kube-controller-manager; ``K8S_VERSION=v1.37.2 hack/k8s-binaries.sh``), a node without
a kubelet, the real ``tessera-dra`` on fake GPUs (tools/fakegpu) and the kubelet stand-in the tests
use (``sandbox.dra_standin``, real gRPC over unix sockets).

Each round creates ``--claims`` claims of 1 GiB / 5 cores on the A100s with one pod each, all at
once; timed per claim: from its create call until a watch sees its allocation. Then each claim is
prepared (one NodePrepareResources per claim, as the kubelet calls it for one pod) and, after the
pods are deleted, unprepared. Timed: each RPC from the call to its answer.

    .venv/bin/python bench/dra_latency.py [--rounds 5] [--claims 16]

Reported: p50 / p99 / max in ms.
"""

from __future__ import annotations

import argparse
import shutil
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

import yaml
from kubernetes import client, config, watch

import fakegpu
from sandbox.controlplane import (
    CONTROLLERS,
    DRA_K8S_VERSION,
    ControlPlane,
    ManagedProcess,
    bin_dir_for,
    fake_node_body,
)
from sandbox.dra_standin import claim, register
from tessera.cliargs import positive_int
from tessera.contract import KEYS

ROOT = Path(__file__).resolve().parents[1]
NODE = "bench-dra-node"
NAMESPACE = "bench"
GROUP, VERSION = "resource.k8s.io", "v1"
SCHEDULER_CONFIG = (
    "apiVersion: kubescheduler.config.k8s.io/v1\nkind: KubeSchedulerConfiguration\n"
    "clientConnection:\n  kubeconfig: {kubeconfig}\n"
)


def percentiles(samples: list[float]) -> str:
    ordered = sorted(samples)
    p50 = ordered[(len(ordered) - 1) // 2]
    p99 = ordered[min(len(ordered) - 1, round(0.99 * (len(ordered) - 1)))]
    return f"{p50:.1f} | {p99:.1f} | {ordered[-1]:.1f}"


class Allocations:
    """When a watch first saw each claim allocated (monotonic seconds)."""

    def __init__(self, api: client.ApiClient) -> None:
        self._objects = client.CustomObjectsApi(api)
        self.seen: dict[str, float] = {}
        self._changed = threading.Condition()
        self._watch = watch.Watch()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def _run(self) -> None:
        for event in self._watch.stream(
            self._objects.list_namespaced_custom_object, GROUP, VERSION, NAMESPACE, "resourceclaims"
        ):
            item = event["object"]
            if (item.get("status") or {}).get("allocation"):
                with self._changed:
                    self.seen.setdefault(item["metadata"]["name"], time.monotonic())
                    self._changed.notify_all()

    def wait(self, names: list[str], timeout: float = 120.0) -> None:
        with self._changed:
            if not self._changed.wait_for(lambda: all(n in self.seen for n in names), timeout):
                missing = [n for n in names if n not in self.seen]
                raise SystemExit(f"claims never allocated: {missing}")

    def stop(self) -> None:
        self._watch.stop()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=positive_int, default=5)
    parser.add_argument("--claims", type=positive_int, default=16)
    args = parser.parse_args()

    work = Path(tempfile.mkdtemp(prefix="bench-dra-"))
    kubelet_dir = Path(tempfile.mkdtemp(prefix="dra-", dir="/tmp"))
    fakegpu.build()
    fakegpu.build_hook()
    specs = [
        fakegpu.example_gpu(i, model="NVIDIA A100-SXM4-80GB", memory_mib=81920, numa_node=0) for i in range(4)
    ]
    gpu_config = fakegpu.write_config(work / "gpus.conf", specs)
    (work / "fakegpu-state").mkdir()
    plane = ControlPlane(work_dir=work / "plane", bin_dir=bin_dir_for(DRA_K8S_VERSION))
    driver: ManagedProcess | None = None
    try:
        plane.start()
        plane.start_scheduler(SCHEDULER_CONFIG)
        plane.start_controller_manager(controllers=(*CONTROLLERS, "resourceclaim-controller"))
        api = config.new_client_from_config(config_file=str(plane.kubeconfig))
        core, objects = client.CoreV1Api(api), client.CustomObjectsApi(api)
        body = fake_node_body(NODE, {"cpu": "64", "memory": "256Gi", "pods": "500"})
        status = body.pop("status")
        core.create_node(body)
        core.patch_node_status(NODE, {"status": status})
        core.create_namespace({"metadata": {"name": NAMESPACE}})
        [device_class] = [
            d
            for d in yaml.safe_load_all((ROOT / "deploy" / "dra-driver.yaml").read_text())
            if d["kind"] == "DeviceClass"
        ]
        objects.create_cluster_custom_object(GROUP, VERSION, "deviceclasses", device_class)
        driver = ManagedProcess(
            "tessera-dra",
            [
                str(Path(sys.executable).parent / "tessera-dra"),
                f"--node-name={NODE}",
                f"--kubeconfig={plane.kubeconfig}",
                f"--kubelet-dir={kubelet_dir}",
                f"--cdi-dir={work / 'cdi'}",
                f"--state-dir={work / 'state'}",
                f"--hook-library={fakegpu.HOOK_LIBRARY}",
                f"--speed-profiles={ROOT / 'deploy' / 'speed-profiles.yaml'}",
            ],
            work / "tessera-dra.log",
            env=fakegpu.client_env(gpu_config, work / "fakegpu-state"),
        )
        driver.start()
        kubelet = register(kubelet_dir / "plugins_registry" / f"{KEYS.dra_driver}-reg.sock", KEYS.dra_driver)
        slice_name = f"{NODE}-{KEYS.dra_driver}"
        deadline = time.monotonic() + 60
        while True:
            try:
                objects.get_cluster_custom_object(GROUP, VERSION, "resourceslices", slice_name)
                break
            except client.ApiException:
                if time.monotonic() > deadline:
                    raise SystemExit(f"no ResourceSlice:\n{driver.log_tail()}") from None
                time.sleep(0.1)
        allocations = Allocations(api)
        allocate_ms: list[float] = []
        prepare_ms: list[float] = []
        unprepare_ms: list[float] = []
        for round_number in range(args.rounds):
            names = [f"r{round_number}-c{n}" for n in range(args.claims)]
            created: dict[str, float] = {}
            for name in names:
                request = {
                    "deviceClassName": KEYS.dra_device_class,
                    "capacity": {"requests": {"memory": "1Gi", "cores": "5"}},
                }
                claim_body: dict[str, Any] = {
                    "apiVersion": f"{GROUP}/{VERSION}",
                    "kind": "ResourceClaim",
                    "metadata": {"name": name},
                    "spec": {"devices": {"requests": [{"name": "gpu", "exactly": request}]}},
                }
                created[name] = time.monotonic()
                objects.create_namespaced_custom_object(
                    GROUP, VERSION, NAMESPACE, "resourceclaims", claim_body
                )
                core.create_namespaced_pod(
                    NAMESPACE,
                    {
                        "metadata": {"name": name},
                        "spec": {
                            "resourceClaims": [{"name": "gpu", "resourceClaimName": name}],
                            "containers": [
                                {
                                    "name": "main",
                                    "image": "example.invalid/none",
                                    "resources": {"claims": [{"name": "gpu"}]},
                                }
                            ],
                        },
                    },
                )
            allocations.wait(names)
            allocate_ms += [(allocations.seen[n] - created[n]) * 1000 for n in names]
            refs = []
            for name in names:
                uid = objects.get_namespaced_custom_object(GROUP, VERSION, NAMESPACE, "resourceclaims", name)[
                    "metadata"
                ]["uid"]
                ref = claim(NAMESPACE, name, uid)
                refs.append(ref)
                started = time.monotonic()
                answer = kubelet.prepare(ref)
                prepare_ms.append((time.monotonic() - started) * 1000)
                if answer.claims[uid].error:
                    raise SystemExit(answer.claims[uid].error)
            for name, ref in zip(names, refs, strict=True):
                core.delete_namespaced_pod(name, NAMESPACE, grace_period_seconds=0)
                started = time.monotonic()
                kubelet.unprepare(ref)
                unprepare_ms.append((time.monotonic() - started) * 1000)
                objects.delete_namespaced_custom_object(GROUP, VERSION, NAMESPACE, "resourceclaims", name)
        allocations.stop()
        kubelet.close()
        print(f"Kubernetes {DRA_K8S_VERSION}; {args.rounds} rounds x {args.claims} claims created at once")
        print("| step | n | p50 ms | p99 ms | max ms |")
        print("| --- | --- | --- | --- | --- |")
        print(f"| claim + pod created -> claim allocated | {len(allocate_ms)} | {percentiles(allocate_ms)} |")
        print(f"| NodePrepareResources | {len(prepare_ms)} | {percentiles(prepare_ms)} |")
        print(f"| NodeUnprepareResources | {len(unprepare_ms)} | {percentiles(unprepare_ms)} |")
    finally:
        if driver is not None:
            driver.stop()
        plane.stop()
        shutil.rmtree(kubelet_dir, ignore_errors=True)
        shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    main()
