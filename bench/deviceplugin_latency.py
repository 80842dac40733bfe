"""The device plugin's Allocate latency and its re-registration time after a kubelet restart.

Runs the real ``tessera-device-plugin`` on 4 fake GPUs (tools/fakegpu) against the real
kube-apiserver (etcd + apiserver from hack/k8s-binaries.sh) and the kubelet stand-in
(``sandbox.kubelet_standin``, as in the tests).

- Allocate: rounds of ``--pods`` pods bound to the node at once (phase ``allocating``, one GPU each, the
  same key, as the in-flight rule allows), then admitted ``--concurrency`` at a time (each admission
  GetPreferredAllocation, then Allocate of a free slice of the GPU it names, as the kubelet does;
  ``--concurrency 1`` admits them one by one, as one kubelet does). Timed: each RPC round trip seen by
  the kubelet side, from the call to its answer.
- Re-registration: ``--restarts`` times, the stand-in deletes every socket in the plugin dir and
  serves a new ``kubelet.sock`` (as a restarting kubelet does); timed until the plugin's new
  ``Register`` arrives.

    .venv/bin/python -m bench.deviceplugin_latency [--rounds 10] [--pods 20] [--concurrency 1]
        [--restarts 30]

Reported: p50 / p99 / max in ms, and the CPU time each process spent per admission while the
admissions ran (from ``/proc/<pid>/stat`` and, for the benchmark's own kubelet side, ``getrusage``):
on a machine with few cores the kubelet side shares them, so an admission's latency is bounded below
by the CPU all of them need divided by the cores.
"""

from __future__ import annotations

import argparse
import os
import resource
import shutil
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from kubernetes import client, config

import fakegpu
from sandbox.controlplane import ControlPlane, ManagedProcess, fake_node_body
from sandbox.kubelet_standin import KubeletStandIn
from tessera.contract import (
    KEYS,
    Allocation,
    ContainerAllocation,
    GpuGrant,
    Phase,
    dump_allocation,
    format_time,
    now,
)

NODE = "bench-gpu-node"
NAMESPACE = "bench"


def percentiles(samples: list[float]) -> str:
    ordered = sorted(samples)
    p99 = ordered[min(len(ordered) - 1, round(0.99 * (len(ordered) - 1)))]
    return f"{statistics.median(ordered):.1f} | {p99:.1f} | {ordered[-1]:.1f}"


def cpu_seconds(pid: int) -> float:
    """User + system CPU time of a process, all its threads."""
    fields = Path(f"/proc/{pid}/stat").read_text().rpartition(")")[2].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def own_cpu_seconds() -> float:
    usage = resource.getrusage(resource.RUSAGE_SELF)
    return usage.ru_utime + usage.ru_stime


class CpuMeter:
    """CPU time per process, summed over the intervals between :meth:`begin` and :meth:`end`."""

    def __init__(self, pids: dict[str, int]) -> None:
        self.pids = pids
        self.spent: dict[str, float] = dict.fromkeys([*pids, "kubelet side (this benchmark)"], 0.0)
        self._at: dict[str, float] = {}

    def _now(self) -> dict[str, float]:
        now = {name: cpu_seconds(pid) for name, pid in self.pids.items()}
        now["kubelet side (this benchmark)"] = own_cpu_seconds()
        return now

    def begin(self) -> None:
        self._at = self._now()

    def end(self) -> None:
        for name, value in self._now().items():
            self.spent[name] += value - self._at[name]


def bound_pod(name: str, gpu: str) -> dict[str, object]:
    allocation = Allocation(
        node=NODE,
        containers=(
            ContainerAllocation(name="main", gpus=(GpuGrant(uuid=gpu, memory_quota_mib=2048, cores=10),)),
        ),
    )
    return {
        "metadata": {
            "name": name,
            "annotations": {
                KEYS.allocation: dump_allocation(allocation),
                KEYS.allocation_phase: Phase.ALLOCATING.value,
                KEYS.bind_time: format_time(now()),
            },
        },
        "spec": {
            "nodeName": NODE,
            "containers": [{"name": "main", "image": "app", "resources": {"limits": {KEYS.vgpu: "1"}}}],
        },
    }


class Admissions:
    """Admits containers as the kubelet does, from several threads at once: GetPreferredAllocation among
    the free slices, then Allocate of a free slice of the GPU it names; each RPC timed."""

    def __init__(self, kubelet: KubeletStandIn) -> None:
        self.kubelet = kubelet
        self.lock = threading.Lock()
        self.allocate_ms: list[float] = []
        self.preferred_ms: list[float] = []

    def free(self) -> list[str]:
        with self.lock:
            in_use = set(self.kubelet.in_use)
        return sorted(d for d, h in self.kubelet.devices().items() if h == "Healthy" and d not in in_use)

    def admit(self, name: str) -> None:
        """Admit pod ``name``'s container; the stand-in's pod-resources API then names it as the
        holder of the slice (the agent matched some pod of the same key: it learns which from there)."""
        start = time.perf_counter()
        preferred = self.kubelet.preferred(self.free(), [], 1)
        preferred_ms = (time.perf_counter() - start) * 1000
        gpu = preferred[0].split("::")[0]
        with self.lock:  # a free slice of that GPU, taken at once (another admission runs beside)
            slice_ = next(
                d
                for d in sorted(self.kubelet.devices())
                if d.startswith(f"{gpu}::") and d not in self.kubelet.in_use
            )
            self.kubelet.in_use.add(slice_)
        start = time.perf_counter()
        self.kubelet.allocate([slice_])
        allocate_ms = (time.perf_counter() - start) * 1000
        self.kubelet.assign((NAMESPACE, name, "main"), [slice_])
        with self.lock:
            self.preferred_ms.append(preferred_ms)
            self.allocate_ms.append(allocate_ms)


def positive(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        value = 0
    if value < 1:
        raise argparse.ArgumentTypeError(f"{text!r} is not a positive integer")
    return value


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=positive, default=10)
    parser.add_argument("--pods", type=positive, default=20, help="pods in flight at once per round")
    parser.add_argument(
        "--concurrency",
        type=positive,
        default=1,
        help="admissions (GetPreferredAllocation + Allocate) run at once (default 1: one by one, as "
        "one kubelet admits pods; 20: every pod of a round at once)",
    )
    parser.add_argument("--restarts", type=int, default=30)
    args = parser.parse_args()

    fakegpu.build()
    hook_library = fakegpu.build_hook()
    work = Path(tempfile.mkdtemp(prefix="dp-bench-"))
    plugin_dir = Path(tempfile.mkdtemp(prefix="dpb-", dir="/tmp"))
    plane = ControlPlane(work_dir=work / "control-plane")
    kubelet = KubeletStandIn(plugin_dir)
    plugin: ManagedProcess | None = None
    try:
        plane.start()
        api = config.new_client_from_config(config_file=str(plane.kubeconfig))
        core = client.CoreV1Api(api)
        body = fake_node_body(NODE, {"cpu": "8", "memory": "32Gi", "pods": "500"})
        status = body.pop("status")
        core.create_node(body)
        core.patch_node_status(NODE, {"status": status})
        core.create_namespace({"metadata": {"name": NAMESPACE}})

        specs = [fakegpu.example_gpu(i) for i in range(4)]
        gpus = fakegpu.write_config(work / "gpus.conf", specs)
        env = fakegpu.client_env(gpus, work / "fakegpu-state")
        kubelet.start()
        split = max(10, args.pods)
        plugin = ManagedProcess(
            "tessera-device-plugin",
            [
                str(Path(sys.executable).parent / "tessera-device-plugin"),
                f"--node-name={NODE}",
                f"--plugin-dir={plugin_dir}",
                f"--state-dir={work / 'state'}",
                f"--kubeconfig={plane.kubeconfig}",
                f"--split={split}",
                "--metrics-port=0",
                f"--pod-resources-socket={kubelet.pod_resources_socket}",
                f"--hook-library={hook_library}",
            ],
            work / "device-plugin.log",
            env=env,
        )
        plugin.start()
        kubelet.wait_for(lambda k: bool(k.registrations and len(k.devices()) == 4 * split), timeout=60)

        admissions = Admissions(kubelet)
        pids = {p.name: p.popen.pid for p in plane.processes if p.popen is not None}
        assert plugin.popen is not None
        meter = CpuMeter({"tessera-device-plugin": plugin.popen.pid, **pids})
        with ThreadPoolExecutor(max_workers=args.concurrency) as pool:
            for round_ in range(args.rounds):
                gpu = specs[round_ % 4].uuid
                names = [f"r{round_}-p{i}" for i in range(args.pods)]
                for name in names:
                    core.create_namespaced_pod(NAMESPACE, bound_pod(name, gpu))
                # Every pod seen by the agent's cache before the admissions, as a kubelet sees a pod
                # bound before it admits it: the creations' own work is not timed.
                time.sleep(0.5)
                meter.begin()
                for future in [pool.submit(admissions.admit, name) for name in names]:
                    future.result()
                meter.end()
                for name in names:
                    core.delete_namespaced_pod(name, NAMESPACE, grace_period_seconds=0)
                kubelet.in_use.clear()
                kubelet.forget_assignments()
        allocate_ms, preferred_ms = admissions.allocate_ms, admissions.preferred_ms

        reregister_ms: list[float] = []
        for _ in range(args.restarts):
            before = len(kubelet.registrations)
            restarted_at = kubelet.restart()
            kubelet.wait_for(lambda k: len(k.registrations) > before, timeout=30)  # noqa: B023
            reregister_ms.append((kubelet.current.at - restarted_at) * 1000)
            kubelet.wait_for(lambda k: len(k.devices()) == 4 * split)

        cpu = subprocess.run(["nproc"], capture_output=True, text=True, check=False).stdout.strip()
        print(
            f"machine: {cpu} cores; {args.rounds} rounds x {args.pods} pods in flight, admitted "
            f"{args.concurrency} at a time; {args.restarts} restarts"
        )
        print("| operation | samples | p50 ms | p99 ms | max ms |")
        print("|---|---|---|---|---|")
        print(f"| GetPreferredAllocation | {len(preferred_ms)} | {percentiles(preferred_ms)} |")
        print(f"| Allocate | {len(allocate_ms)} | {percentiles(allocate_ms)} |")
        print(f"| new kubelet.sock -> Register | {len(reregister_ms)} | {percentiles(reregister_ms)} |")
        admitted = len(allocate_ms)
        print("\nCPU per admission (GetPreferredAllocation + Allocate) while the admissions ran, ms:")
        print("| process | CPU ms per admission |")
        print("|---|---|")
        for name, spent in meter.spent.items():
            print(f"| {name} | {spent * 1000 / admitted:.2f} |")
        print(f"| all | {sum(meter.spent.values()) * 1000 / admitted:.2f} |")
    finally:
        if plugin is not None:
            plugin.stop()
        kubelet.stop()
        plane.stop()
        shutil.rmtree(plugin_dir, ignore_errors=True)
        shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    main()
