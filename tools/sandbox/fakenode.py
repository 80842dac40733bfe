"""Extra nodes for the sandbox: Node objects with a GPU inventory but no kubelet, so that scheduling
across several nodes is visible. Pods bound to one stay Pending (nothing runs them).

One process per fake node keeps what a device plugin and a kubelet would keep fresh: the heartbeat
annotation (the extender ignores nodes with a stale one) and the node's Ready condition with its
lastHeartbeatTime, every HEARTBEAT_SECONDS. kube-controller-manager's node-lifecycle controller takes
a changed lastHeartbeatTime as a kubelet's Lease renewal: the node stays Ready and untainted while
its process runs; once the process is gone for the controller's grace (50 s) the node is marked not
ready and tainted, and its pods are evicted per their tolerations.

Run as ``python -m sandbox.fakenode --kubeconfig FILE --node NAME --gpu a100 --gpu t4``.
"""

from __future__ import annotations

import argparse
import signal
import sys
import threading
import uuid
from collections.abc import Sequence
from dataclasses import dataclass
from types import FrameType

from kubernetes import client, config

from sandbox.controlplane import fake_node_body
from tessera.contract import KEYS, GpuInfo, dump_inventory, format_time, now

SPLIT = 10
HEARTBEAT_SECONDS = 10.0


@dataclass(frozen=True, slots=True)
class GpuModel:
    model: str
    total_memory_mib: int
    sm_count: int
    compute_capability: str


# Sizes as NVML reports them.
PRESETS = {
    "a100": GpuModel("NVIDIA A100-SXM4-40GB", 40960, 108, "8.0"),
    "a100-80": GpuModel("NVIDIA A100-SXM4-80GB", 81920, 108, "8.0"),
    "h100": GpuModel("NVIDIA H100 80GB HBM3", 81559, 132, "9.0"),
    "l4": GpuModel("NVIDIA L4", 23034, 58, "8.9"),
    "t4": GpuModel("Tesla T4", 15360, 40, "7.5"),
    "v100": GpuModel("Tesla V100-SXM2-16GB", 16160, 80, "7.0"),
}


def inventory(node: str, models: Sequence[str]) -> tuple[GpuInfo, ...]:
    """The node's GPUs; UUIDs derive from the node name and index, so they are stable."""
    gpus = []
    for index, name in enumerate(models):
        preset = PRESETS.get(name)
        if preset is None:
            raise ValueError(f"--gpu: {name!r} is not one of {', '.join(sorted(PRESETS))}")
        gpus.append(
            GpuInfo(
                uuid=f"GPU-{uuid.uuid5(uuid.NAMESPACE_DNS, f'{node}.{index}.tessera-sandbox')}",
                index=index,
                model=preset.model,
                total_memory_mib=preset.total_memory_mib,
                sm_count=preset.sm_count,
                compute_capability=preset.compute_capability,
                pci_bus_id=f"00000000:{0x10 + index:02x}:00.0",
                split=SPLIT,
            )
        )
    return tuple(gpus)


def capacity(gpus: Sequence[GpuInfo]) -> dict[str, str]:
    return {
        "cpu": "8",
        "memory": "32Gi",
        "pods": "110",
        KEYS.vgpu: str(sum(g.split for g in gpus)),
    }


def _annotations(gpus: Sequence[GpuInfo]) -> dict[str, str]:
    return {KEYS.node_gpus: dump_inventory(list(gpus)), KEYS.node_heartbeat: format_time(now())}


def _ready_status(gpus: Sequence[GpuInfo]) -> dict[str, object]:
    status = fake_node_body("-", capacity(gpus))["status"]
    assert isinstance(status, dict)
    stamp = format_time(now())
    for condition in status["conditions"]:
        condition["lastHeartbeatTime"] = stamp
    return status


def keep_alive(core: client.CoreV1Api, node: str, gpus: Sequence[GpuInfo], stop: threading.Event) -> None:
    try:
        core.read_node(node)
    except client.ApiException as e:
        if e.status != 404:
            raise
        body = fake_node_body(node, capacity(gpus), _annotations(gpus))
        body.pop("status")
        core.create_node(body)
    while True:
        core.patch_node(node, {"metadata": {"annotations": _annotations(gpus)}})
        core.patch_node_status(node, {"status": _ready_status(gpus)})
        if stop.wait(HEARTBEAT_SECONDS):
            return


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="tessera-sandbox-fakenode")
    parser.add_argument("--kubeconfig", required=True)
    parser.add_argument("--node", required=True)
    parser.add_argument("--gpu", action="append", required=True, help=f"one of {', '.join(sorted(PRESETS))}")
    args = parser.parse_args(argv)
    try:
        gpus = inventory(args.node, args.gpu)
    except ValueError as e:
        parser.error(str(e))
    stop = threading.Event()

    def on_signal(_signum: int, _frame: FrameType | None) -> None:
        stop.set()

    signal.signal(signal.SIGTERM, on_signal)
    signal.signal(signal.SIGINT, on_signal)
    api = config.new_client_from_config(config_file=args.kubeconfig)
    try:
        keep_alive(client.CoreV1Api(api), args.node, gpus, stop)
    finally:
        api.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
