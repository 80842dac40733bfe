"""Pure logic: what the kubelet is told to give a container, and the files behind it."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from deviceplugin.matching import InFlight
from deviceplugin.statedir import ContainerDir, ServedRecord, StateDir
from hook.limits import DeviceLimit
from tessera.contract import (
    CONTAINER_HOOK_LIBRARY,
    CONTAINER_LD_SO_PRELOAD,
    CONTAINER_LIMITS_FILE,
    CONTAINER_STATE_DIR,
)

VISIBLE_DEVICES_ENV = "NVIDIA_VISIBLE_DEVICES"


@dataclass(frozen=True, slots=True)
class MountSpec:
    container_path: str
    host_path: str
    read_only: bool


@dataclass(frozen=True, slots=True)
class ContainerAnswer:
    """One ``ContainerAllocateResponse``, plus the files the agent writes before answering."""

    envs: dict[str, str]
    mounts: tuple[MountSpec, ...]
    where: ContainerDir
    limits: tuple[DeviceLimit, ...]
    record: ServedRecord


def answer_for(
    container: InFlight, device_ids: Sequence[str], state: StateDir, hook_library: Path
) -> ContainerAnswer:
    where = state.container(container.pod.uid, container.container)
    return ContainerAnswer(
        envs={VISIBLE_DEVICES_ENV: ",".join(g.uuid for g in container.grants)},
        mounts=(
            MountSpec(CONTAINER_LIMITS_FILE, str(where.limits), read_only=True),
            MountSpec(CONTAINER_STATE_DIR, str(where.state), read_only=False),
            MountSpec(CONTAINER_HOOK_LIBRARY, str(hook_library), read_only=True),
            MountSpec(CONTAINER_LD_SO_PRELOAD, str(state.ld_so_preload), read_only=True),
        ),
        where=where,
        limits=tuple(DeviceLimit.from_grant(g) for g in container.grants),
        record=ServedRecord(
            namespace=container.pod.namespace,
            pod=container.pod.name,
            pod_uid=container.pod.uid,
            container=container.container,
            gpus=container.grants,
            device_ids=tuple(device_ids),
        ),
    )
