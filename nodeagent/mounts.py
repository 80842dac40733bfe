"""What every container with a GPU share is given, by either agent: the hook's files, its GPUs'
coordination areas and the variable that names its GPUs to the NVIDIA container toolkit."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from nodeagent.statedir import ContainerDir, StateDir
from tessera.contract import (
    CONTAINER_COORDINATION_DIR,
    CONTAINER_HOOK_LIBRARY,
    CONTAINER_LD_SO_PRELOAD,
    CONTAINER_LIMITS_DIR,
    CONTAINER_STATE_DIR,
    COORDINATION_SLOT_SUFFIX,
)

VISIBLE_DEVICES_ENV = "NVIDIA_VISIBLE_DEVICES"


@dataclass(frozen=True, slots=True)
class MountSpec:
    container_path: str
    host_path: str
    read_only: bool


def hook_mounts(where: ContainerDir, state: StateDir, hook_library: Path) -> tuple[MountSpec, ...]:
    """What every container with a GPU share gets: its limits (read-only), its accounting state,
    the hook and the preload entry that loads it. The device plugin and the DRA driver both mount
    these."""
    return (
        MountSpec(CONTAINER_LIMITS_DIR, str(where.limits_dir), read_only=True),
        MountSpec(CONTAINER_STATE_DIR, str(where.state), read_only=False),
        MountSpec(CONTAINER_HOOK_LIBRARY, str(hook_library), read_only=True),
        MountSpec(CONTAINER_LD_SO_PRELOAD, str(state.ld_so_preload), read_only=True),
    )


def coordination_mounts(state: StateDir, slots: Sequence[tuple[str, Path]]) -> tuple[MountSpec, ...]:
    """For each (GPU UUID, slot): the GPU's coordination area read-only (every slot on it, by class:
    no container can move its own to another class), and the container's own slot writable."""
    return tuple(
        mount
        for uuid, slot in slots
        for mount in (
            MountSpec(
                f"{CONTAINER_COORDINATION_DIR}/{uuid}", str(state.coordination_area(uuid)), read_only=True
            ),
            MountSpec(
                f"{CONTAINER_COORDINATION_DIR}/{uuid}{COORDINATION_SLOT_SUFFIX}", str(slot), read_only=False
            ),
        )
    )
