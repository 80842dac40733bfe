"""The GPU side of the sandbox: the fake GPUs, the extender, the tessera-scheduler profile and the
device plugin, all run as processes beside the real kubelet.

The fake GPUs are the only simulated thing. Their description (two GPUs: an A100 40 GB and a T4
16 GB) is one file; the fake ``libcuda.so.1`` / ``libnvidia-ml.so.1`` built by ``make -C
tools/fakegpu`` read it, on the host (the device plugin's NVML) and inside containers (where the
sandbox's containerd places the driver like the NVIDIA container toolkit does). Every process of
every container that uses one fake GPU shares that GPU's state files, as they would share the device.
"""

from __future__ import annotations

import os
import shutil
import sys
import urllib.error
import urllib.request
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import yaml

from fakegpu import BUILD_DIR, CONFIG_ENV, HOOK_LIBRARY, STATE_ENV, FakeGpuSpec, write_config
from sandbox.containerd import BindMount
from sandbox.controlplane import LOOPBACK
from sandbox.images import DRIVER_LIBRARY_DIR
from sandbox.layout import Layout
from sandbox.processes import Started, start

REPO = Path(__file__).resolve().parents[2]
SCHEDULER_CONFIG = REPO / "deploy" / "scheduler-config.yaml"
DRIVER_SONAMES = ("libcuda.so.1", "libnvidia-ml.so.1")

# Inside containers: where the sandbox mounts the fake GPUs' description and their shared state.
CONTAINER_GPU_CONFIG = "/etc/tessera-fakegpu/gpus.conf"
CONTAINER_GPU_STATE = "/run/tessera-fakegpu"

SANDBOX_GPUS = (
    FakeGpuSpec(
        model="NVIDIA A100-SXM4-40GB",
        uuid="GPU-6a1e0b7c-0000-4000-8000-00000000a100",
        memory_mib=40960,
        sm_count=108,
        compute_capability="8.0",
        pci_bus_id="0000:3b:00.0",
        numa_node=0,
    ),
    # NVML reports a T4 (sold as 16 GB) with 15360 MiB.
    FakeGpuSpec(
        model="Tesla T4",
        uuid="GPU-7b2f1c8d-0000-4000-8000-000000000074",
        memory_mib=15360,
        sm_count=40,
        compute_capability="7.5",
        pci_bus_id="0000:af:00.0",
        numa_node=0,
    ),
)


@dataclass(frozen=True, slots=True)
class GpuFiles:
    """Host paths of what the GPU side uses, copied into the sandbox directory at `up` so that a
    rebuild in the work tree never changes the driver under running containers."""

    driver: Path
    config: Path
    state: Path
    hook: Path
    agent_state: Path

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

    def host_env(self) -> dict[str, str]:
        """For host processes using the fake driver (the device plugin's NVML)."""
        return {CONFIG_ENV: str(self.config), STATE_ENV: str(self.state), "LD_LIBRARY_PATH": str(self.driver)}


def missing_builds() -> list[str]:
    """What `make native` has not built yet."""
    wanted = [BUILD_DIR / s for s in DRIVER_SONAMES] + [HOOK_LIBRARY]
    return [f"{p} (run `make native`)" for p in wanted if not p.exists()]


def files_for(layout: Layout) -> GpuFiles:
    return GpuFiles(
        driver=layout.gpu / "driver",
        config=layout.gpu / "gpus.conf",
        state=layout.gpu / "state",
        hook=layout.gpu / "libvgpu.so",
        agent_state=layout.gpu / "agent",
    )


def prepare(layout: Layout, gpus: tuple[FakeGpuSpec, ...] = SANDBOX_GPUS) -> GpuFiles:
    files = files_for(layout)
    for directory in (files.driver, files.state, files.agent_state):
        directory.mkdir(parents=True, exist_ok=True)
    # Every container's processes write the GPU state (the device is shared by all of them).
    files.state.chmod(0o1777)
    for soname in DRIVER_SONAMES:
        shutil.copy2(BUILD_DIR / soname, files.driver / soname)
    shutil.copy2(HOOK_LIBRARY, files.hook)
    write_config(files.config, gpus)
    return files


# --------------------------------------------------------------------------------------------------
# The extender and the scheduler profile that calls it.


def start_extender(layout: Layout, kubeconfig: Path, port: int) -> Started:
    argv = [
        sys.executable,
        "-m",
        "extender.main",
        f"--listen={LOOPBACK}:{port}",
        f"--kubeconfig={kubeconfig}",
    ]
    return start("tessera-extender", argv, layout.log("tessera-extender"), cwd=REPO)


def extender_ready(port: int) -> bool:
    try:
        with urllib.request.urlopen(f"http://{LOOPBACK}:{port}/readyz", timeout=2) as response:
            return bool(response.status == 200)
    except (urllib.error.URLError, OSError):
        return False


def extender_node_count(url: str) -> float:
    """Nodes with a GPU inventory that the extender holds (its ``tessera_extender_nodes`` gauge);
    -1 while it cannot be read."""
    try:
        with urllib.request.urlopen(f"{url}/metrics", timeout=2) as response:
            text = response.read().decode()
    except (urllib.error.URLError, OSError):
        return -1
    for line in text.splitlines():
        if line.startswith("tessera_extender_nodes "):
            return float(line.split()[1])
    return -1


def scheduler_config(template: Mapping[str, Any], extender_url: str) -> str:
    """deploy/scheduler-config.yaml with every extender pointed at the sandbox's extender. The
    ``{kubeconfig}`` placeholder is filled in by :meth:`ControlPlane.start_scheduler`."""
    config = yaml.safe_load(yaml.safe_dump(dict(template)))
    config.setdefault("clientConnection", {})["kubeconfig"] = "{kubeconfig}"
    config["leaderElection"] = {"leaderElect": False}
    extenders = config.get("extenders") or []
    if not extenders:
        raise ValueError(f"{SCHEDULER_CONFIG}: no extenders configured")
    for extender in extenders:
        extender["urlPrefix"] = extender_url
    dumped: str = yaml.safe_dump(config, sort_keys=False)
    return dumped


# --------------------------------------------------------------------------------------------------
# The device plugin.


def start_device_plugin(layout: Layout, files: GpuFiles, kubeconfig: Path, node: str) -> Started:
    argv = [
        sys.executable,
        "-m",
        "deviceplugin.main",
        f"--node-name={node}",
        f"--kubeconfig={kubeconfig}",
        f"--hook-library={files.hook}",
        f"--state-dir={files.agent_state}",
        "--metrics-port=0",
        "--heartbeat-seconds=10",
    ]
    env = {**os.environ, **files.host_env()}
    return start("tessera-device-plugin", argv, layout.log("tessera-device-plugin"), env=env, cwd=REPO)
