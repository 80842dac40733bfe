"""The GPU side of the sandbox: the fake GPUs and the fake driver that containers get (Tessera itself
is installed by its chart, sandbox.install).

The fake GPUs are the only simulated thing. Their description (two GPUs: an A100 40 GB and a T4
16 GB) is one file; the fake ``libcuda.so.1`` / ``libnvidia-ml.so.1`` built by ``make -C
tools/fakegpu`` read it, on the host (the device plugin's NVML) and inside containers (where the
sandbox's containerd places the driver like the NVIDIA container toolkit does). Every process of
every container that uses one fake GPU shares that GPU's state files, as they would share the device.
"""

from __future__ import annotations

import shutil
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from fakegpu import BUILD_DIR, CONFIG_ENV, STATE_ENV, FakeGpuSpec, write_config
from sandbox import fakenode
from sandbox.containerd import BindMount
from sandbox.images import DRIVER_LIBRARY_DIR
from sandbox.layout import Layout

REPO = Path(__file__).resolve().parents[2]
DRIVER_SONAMES = ("libcuda.so.1", "libnvidia-ml.so.1")

# Inside containers: where the sandbox mounts the fake GPUs' description and their shared state.
CONTAINER_GPU_CONFIG = "/etc/tessera-fakegpu/gpus.conf"
CONTAINER_GPU_STATE = "/run/tessera-fakegpu"

SANDBOX_GPUS = (
    FakeGpuSpec(
        model="NVIDIA A100-SXM4-40GB",
        uuid="GPU-6a1e0b7c-0000-4000-8000-00000000a100",
        total_memory_mib=40960,
        sm_count=108,
        compute_capability="8.0",
        pci_bus_id="0000:3b:00.0",
        numa_node=0,
    ),
    # NVML reports a T4 (sold as 16 GB) with 15360 MiB.
    FakeGpuSpec(
        model="Tesla T4",
        uuid="GPU-7b2f1c8d-0000-4000-8000-000000000074",
        total_memory_mib=15360,
        sm_count=40,
        compute_capability="7.5",
        pci_bus_id="0000:af:00.0",
        numa_node=0,
    ),
)


def node_gpus(node: str, models: Sequence[str]) -> tuple[FakeGpuSpec, ...]:
    """A further node's fake GPUs, by preset name (sandbox.fakenode.PRESETS), with the stable UUIDs a
    fake node of that name would have."""
    return tuple(
        FakeGpuSpec(
            model=g.model,
            uuid=g.uuid,
            total_memory_mib=g.total_memory_mib,
            sm_count=g.sm_count,
            compute_capability=g.compute_capability,
            pci_bus_id=g.pci_bus_id,
            numa_node=0,
        )
        for g in fakenode.inventory(node, models)
    )


@dataclass(frozen=True, slots=True)
class GpuFiles:
    """Host paths of what the GPU side uses, copied into the sandbox directory at `up` so that a
    rebuild in the work tree never changes the driver under running containers."""

    driver: Path
    config: Path
    state: Path

    def container_mounts(self) -> list[BindMount]:
        """The driver libraries where the NVIDIA container toolkit puts them, the GPUs' description,
        and their shared state (the one writable part, like the device itself)."""
        return [
            *(BindMount(f"{DRIVER_LIBRARY_DIR}/{s}", self.driver / s) for s in DRIVER_SONAMES),
            BindMount(CONTAINER_GPU_CONFIG, self.config),
            BindMount(CONTAINER_GPU_STATE, self.state, read_only=False),
        ]

    def container_env(self) -> dict[str, str]:
        return {CONFIG_ENV: CONTAINER_GPU_CONFIG, STATE_ENV: CONTAINER_GPU_STATE}


def missing_builds() -> list[str]:
    """What `make native` has not built yet (the fake driver; the hook comes with Tessera's image)."""
    wanted = [BUILD_DIR / s for s in DRIVER_SONAMES]
    return [f"{p} (run `make native`)" for p in wanted if not p.exists()]


def files_for(layout: Layout) -> GpuFiles:
    return GpuFiles(
        driver=layout.gpu / "driver",
        config=layout.gpu / "gpus.conf",
        state=layout.gpu / "state",
    )


def prepare(layout: Layout, gpus: tuple[FakeGpuSpec, ...] = SANDBOX_GPUS) -> GpuFiles:
    """The node's fake GPUs and driver (paths as the node sees them; written where the host keeps
    them, ``layout.place``)."""
    files = files_for(layout)
    for directory in (files.driver, files.state):
        layout.place(directory).mkdir(parents=True, exist_ok=True)
    # Every container's processes write the GPU state (the device is shared by all of them).
    layout.place(files.state).chmod(0o1777)
    for soname in DRIVER_SONAMES:
        shutil.copy2(BUILD_DIR / soname, layout.place(files.driver) / soname)
    write_config(layout.place(files.config), gpus)
    return files
