"""The extender benchmarks' fake GPU fleet: nodes of 8 GPUs each, A100 / V100 / T4 by thirds, made
as Node objects without a kubelet, and the one pod shape the benchmarks schedule."""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor
from typing import Any

from sandbox.controlplane import fake_node_body
from tessera.contract import KEYS, GpuInfo, dump_inventory, format_time, now

MODELS = [("NVIDIA A100-SXM4-40GB", 40960), ("Tesla V100-SXM2-16GB", 16384), ("Tesla T4", 15360)]
GPUS_PER_NODE = 8
SPLIT = 8


def node_model(i: int) -> tuple[str, int]:
    """(GPU model, memory in MiB) of the fleet's node number ``i``."""
    return MODELS[i % len(MODELS)]


def node_inventory(name: str, i: int) -> list[GpuInfo]:
    """The device plugin's inventory of node number ``i``, called ``name``."""
    model, memory = node_model(i)
    return [
        GpuInfo(
            uuid=f"GPU-{name}-{g}",
            index=g,
            model=model,
            total_memory_mib=memory,
            sm_count=80,
            compute_capability="8.0",
            numa_node=g // 4,
            split=SPLIT,
        )
        for g in range(GPUS_PER_NODE)
    ]


def node_name(i: int) -> str:
    return f"bench-{i:04d}"


def node_body(i: int) -> dict[str, Any]:
    """Node number ``i`` of the fleet as the API takes it, with its status (capacity, Ready), its
    inventory and a fresh heartbeat."""
    name = node_name(i)
    _, memory = node_model(i)
    capacity = {
        KEYS.vgpu: str(GPUS_PER_NODE * SPLIT),
        KEYS.vgpu_memory: str(GPUS_PER_NODE * memory),
        KEYS.vgpu_cores: str(GPUS_PER_NODE * 100),
        "cpu": "64",
        "memory": "512Gi",
        "pods": "250",
    }
    annotations = {
        KEYS.node_gpus: dump_inventory(node_inventory(name, i)),
        KEYS.node_heartbeat: format_time(now()),
    }
    return fake_node_body(name, capacity, annotations)


def make_nodes(core: Any, numbers: range) -> None:
    """Create the fleet's nodes ``numbers`` through ``core`` (the official client's CoreV1Api)."""

    def make(i: int) -> None:
        body = node_body(i)
        status = body.pop("status")
        core.create_node(body)
        core.patch_node_status(node_name(i), {"status": status})

    with ThreadPoolExecutor(8) as pool:
        list(pool.map(make, numbers))


def pod_body(name: str) -> dict[str, Any]:
    """The benchmarks' pod: one container asking one GPU share of 4096 MiB and 20 cores."""
    limits = {KEYS.vgpu: "1", KEYS.vgpu_memory: "4096", KEYS.vgpu_cores: "20"}
    return {
        "metadata": {"name": name, "labels": {"app": "bench"}},
        "spec": {
            "schedulerName": "tessera-scheduler",
            "containers": [{"name": "main", "image": "local/cuda:latest", "resources": {"limits": limits}}],
        },
    }
