"""Pure logic: what the kubelet is told to give a container, and the files behind it."""

from __future__ import annotations

import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from deviceplugin.matching import InFlight
from deviceplugin.mps_daemon import MpsPaths
from nodeagent.mounts import VISIBLE_DEVICES_ENV, MountSpec, coordination_mounts, hook_mounts
from nodeagent.records import ServedRecord
from nodeagent.statedir import ContainerDir, StateDir
from tessera.contract import (
    CONTAINER_DEVICE_LIST_DIR,
    CONTAINER_MPS_PIPE_DIR,
    CONTAINER_MPS_SHM_DIR,
    Allocation,
    DeviceListStrategy,
    GpuGrant,
    QosClass,
)


@dataclass(frozen=True, slots=True)
class ContainerAnswer:
    """One ``ContainerAllocateResponse``, plus the files the agent writes before answering."""

    envs: dict[str, str]
    mounts: tuple[MountSpec, ...]
    where: ContainerDir
    qos: QosClass
    slots: tuple[Path, ...]  # the container's coordination slots, one per GPU, created zeroed
    record: ServedRecord


def mps_mounts(paths: MpsPaths) -> tuple[MountSpec, ...]:
    """What a container on a node in MPS mode gets besides: the daemon's pipe directory, through
    which its processes connect (read-write), and the /dev/shm the daemon's server shares with its
    clients (read-write; NVIDIA's device plugin and DRA driver mount the daemon's /dev/shm alike)."""
    return (
        MountSpec(CONTAINER_MPS_PIPE_DIR, str(paths.pipe), read_only=False),
        MountSpec(CONTAINER_MPS_SHM_DIR, str(paths.shm), read_only=False),
    )


def device_list(
    uuids: Sequence[str], strategy: DeviceListStrategy
) -> tuple[dict[str, str], tuple[MountSpec, ...]]:
    """How the container's GPUs are named to the NVIDIA container toolkit: the environment and the
    mounts (``volume-mounts``: /dev/null at <CONTAINER_DEVICE_LIST_DIR>/<uuid>, as NVIDIA's device
    plugin does)."""
    if strategy == DeviceListStrategy.VOLUME_MOUNTS:
        mounts = tuple(
            MountSpec(f"{CONTAINER_DEVICE_LIST_DIR}/{uuid}", "/dev/null", read_only=True) for uuid in uuids
        )
        return {VISIBLE_DEVICES_ENV: CONTAINER_DEVICE_LIST_DIR}, mounts
    return {VISIBLE_DEVICES_ENV: ",".join(uuids)}, ()


def answer_for(
    container: InFlight,
    device_ids: Sequence[str],
    state: StateDir,
    where: ContainerDir,
    hook_library: Path,
    *,
    mps: MpsPaths | None = None,
    devices: DeviceListStrategy = DeviceListStrategy.ENVVAR,
) -> ContainerAnswer:
    """The answer for ``container``, its files in ``where`` (:meth:`StateDir.unused_container`);
    ``mps``: the node's MPS daemon's directories on a node in MPS mode (None: time-sliced);
    ``devices``: how its GPUs are named to the container toolkit."""
    uuids = [g.uuid for g in container.grants]
    envs, device_mounts = device_list(uuids, devices)
    slots = tuple(
        state.coordination_slot(uuid, container.qos, container.pod.uid, where.root.name) for uuid in uuids
    )
    return ContainerAnswer(
        envs=envs,
        mounts=(
            *device_mounts,
            *hook_mounts(where, state, hook_library),
            *coordination_mounts(state, list(zip(uuids, slots, strict=True))),
            *(mps_mounts(mps) if mps is not None else ()),
        ),
        where=where,
        qos=container.qos,
        slots=slots,
        record=ServedRecord(
            namespace=container.pod.namespace,
            pod=container.pod.name,
            pod_uid=container.pod.uid,
            container=container.container,
            gpus=container.grants,
            device_ids=tuple(device_ids),
            qos=container.qos,
            served_at=time.time(),
            mps=mps is not None,
        ),
    )


def resized_grants(record: ServedRecord, allocation: Allocation) -> tuple[GpuGrant, ...] | None:
    """The served container's grants as ``allocation`` has them now, when a live resize changed
    their quotas; None when nothing changed, or when the allocation no longer names the same GPUs
    (the extender never moves a container: such an allocation is not a resize)."""
    container = allocation.for_container(record.container)
    if container is None or container.gpus == record.gpus:
        return None
    if [g.uuid for g in container.gpus] != [g.uuid for g in record.gpus]:
        return None
    return container.gpus
