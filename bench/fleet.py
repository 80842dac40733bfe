"""The extender benchmarks' fake GPU fleet: nodes of 8 GPUs each, A100 / V100 / T4 by thirds."""

from __future__ import annotations

from tessera.contract import GpuInfo

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
            memory_mib=memory,
            sm_count=80,
            compute_capability="8.0",
            numa_node=g // 4,
            split=SPLIT,
        )
        for g in range(GPUS_PER_NODE)
    ]
