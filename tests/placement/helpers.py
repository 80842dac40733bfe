"""Small builders for placement tests."""

from __future__ import annotations

from tessera.contract import GpuInfo, PodPreferences, Policy
from tessera.placement import ContainerShape, NodeState, PodShape, build_node


def gpus(
    node: str,
    *,
    model: str = "Tesla V100-SXM2-16GB",
    memory_mib: int = 16384,
    count: int = 4,
    split: int = 4,
    numa: list[int] | None = None,
    nvlink: list[list[int]] | None = None,
    unhealthy: tuple[int, ...] = (),
) -> list[GpuInfo]:
    uuids = [f"GPU-{node}-{i}" for i in range(count)]
    peers: dict[int, tuple[str, ...]] = {}
    for island in nvlink or []:
        for i in island:
            peers[i] = tuple(uuids[j] for j in island if j != i)
    return [
        GpuInfo(
            uuid=uuids[i],
            index=i,
            model=model,
            total_memory_mib=memory_mib,
            sm_count=80,
            compute_capability="7.0",
            numa_node=None if numa is None else numa[i],
            nvlink_peers=peers.get(i, ()),
            health="Unhealthy" if i in unhealthy else "Healthy",
            split=split,
        )
        for i in range(count)
    ]


def node(name: str, **kwargs: object) -> NodeState:
    return build_node(name, gpus(name, **kwargs))  # type: ignore[arg-type]


def shape(
    *containers: tuple[int, int | None, int | None],
    models: tuple[str, ...] = (),
    exclude: tuple[str, ...] = (),
    workload: str | None = None,
    min_speed: float | None = None,
    policy: Policy | None = None,
) -> PodShape:
    return PodShape(
        containers=tuple(ContainerShape(*c) for c in containers),
        preferences=PodPreferences(
            models=models, models_exclude=exclude, workload=workload, min_speed=min_speed, policy=policy
        ),
    )
