"""The fake GPU for tests, the sandbox and the benches: builds the fake libcuda.so.1 /
libnvidia-ml.so.1 (and the hook that runs over them), writes their config (the one writer of that
file) and drives the test-side controls (XID events, lost GPUs). See docs/fakegpu.md.

Typical use::

    build_dir = build()
    write_config(tmp / "gpus.conf", [example_gpu(0), example_gpu(1, memory_mib=8192)])
    env = client_env(tmp / "gpus.conf", tmp / "state")
    subprocess.run([str(cuclient()), "info"], env=env)
"""

from __future__ import annotations

import fcntl
import os
import re
import subprocess
import sys
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path

from hook._library import BUILD_LIBRARY

HERE = Path(__file__).resolve().parent
BUILD_DIR = HERE / "build"
# The MPS control daemon's stand-in, alone there: put BIN_DIR on a PATH to find it as the real one.
BIN_DIR = BUILD_DIR / "bin"
# The hook as `make -C hook` builds it, and that directory.
HOOK_LIBRARY = BUILD_LIBRARY
HOOK_DIR = HOOK_LIBRARY.parent.parent
# The environment variables the fake driver reads: its config file and its shared state directory.
CONFIG_ENV = "FAKEGPU_CONFIG"
STATE_ENV = "FAKEGPU_STATE"

_UUID = re.compile(r"^GPU-[0-9a-fA-F]{8}-[0-9a-fA-F]{4}-[0-9a-fA-F]{4}-[0-9a-fA-F]{4}-[0-9a-fA-F]{12}$")
_PCI = re.compile(r"^([0-9a-fA-F]{1,8}:)?[0-9a-fA-F]{1,2}:[0-9a-fA-F]{1,2}\.[0-7]$")
# What the fake driver's parser accepts: major 1-99, minor 0-9.
_COMPUTE_CAPABILITY = re.compile(r"^[1-9][0-9]?\.[0-9]$")


@dataclass(frozen=True)
class FakeGpuSpec:
    """One fake GPU, as the config file describes it. The fields are named as in
    `tessera.contract.GpuInfo`, which the node agent fills from what the fake NVML reports."""

    model: str
    uuid: str
    total_memory_mib: int
    sm_count: int
    compute_capability: str  # "major.minor", as in GpuInfo
    pci_bus_id: str
    numa_node: int | None = None
    nvlink_peers: tuple[str, ...] = ()
    pci_device_id: int | None = None
    # The scheduler model (docs/fakegpu.md, "Time model"); None: the driver line's, else the default.
    timeslice_us: int | None = None
    switch_us: int | None = None

    def config_line(self) -> str:
        """The `gpu ...` line of the config file; ValueError naming the field if a value is bad."""
        if not self.model or any(c in self.model for c in '"\n'):
            raise ValueError(f"FakeGpuSpec.model: bad value {self.model!r}")
        if not _UUID.match(self.uuid):
            raise ValueError(f"FakeGpuSpec.uuid: bad value {self.uuid!r}")
        if self.total_memory_mib <= 0:
            raise ValueError(f"FakeGpuSpec.total_memory_mib: bad value {self.total_memory_mib!r}")
        if self.sm_count <= 0:
            raise ValueError(f"FakeGpuSpec.sm_count: bad value {self.sm_count!r}")
        if not _COMPUTE_CAPABILITY.match(self.compute_capability):
            raise ValueError(f"FakeGpuSpec.compute_capability: bad value {self.compute_capability!r}")
        if not _PCI.match(self.pci_bus_id):
            raise ValueError(f"FakeGpuSpec.pci_bus_id: bad value {self.pci_bus_id!r}")
        if self.numa_node is not None and not 0 <= self.numa_node <= 1023:
            raise ValueError(f"FakeGpuSpec.numa_node: bad value {self.numa_node!r}")
        for peer in self.nvlink_peers:
            if not _UUID.match(peer):
                raise ValueError(f"FakeGpuSpec.nvlink_peers: bad value {peer!r}")
        fields = [
            f'name="{self.model}"',
            f"uuid={self.uuid}",
            f"memory={self.total_memory_mib}MiB",
            f"sms={self.sm_count}",
            f"cc={self.compute_capability}",
            f"pci={self.pci_bus_id}",
        ]
        if self.numa_node is not None:
            fields.append(f"numa={self.numa_node}")
        if self.nvlink_peers:
            fields.append("nvlink=" + ",".join(self.nvlink_peers))
        if self.pci_device_id is not None:
            fields.append(f"pci_device_id={self.pci_device_id:#x}")
        fields.extend(_sched_fields("FakeGpuSpec", self.timeslice_us, self.switch_us))
        return "gpu " + " ".join(fields)


def _sched_fields(owner: str, timeslice_us: int | None, switch_us: int | None) -> list[str]:
    """The scheduler model's fields, checked as the fake driver checks them."""
    fields = []
    if timeslice_us is not None:
        if not 1 <= timeslice_us <= 10_000_000:
            raise ValueError(f"{owner}.timeslice_us: bad value {timeslice_us!r}")
        fields.append(f"timeslice_us={timeslice_us}")
    if switch_us is not None:
        if not 0 <= switch_us <= 1_000_000:
            raise ValueError(f"{owner}.switch_us: bad value {switch_us!r}")
        fields.append(f"switch_us={switch_us}")
    return fields


def gpu_uuid(index: int) -> str:
    """A well-formed, deterministic UUID for the index-th fake GPU of a test."""
    return f"GPU-{index:08x}-0000-4000-8000-{index:012x}"


def example_gpu(
    index: int,
    *,
    model: str = "NVIDIA A100-SXM4-80GB",
    memory_mib: int = 81920,
    sm_count: int = 108,
    compute_capability: str = "8.0",
    numa_node: int | None = None,
    nvlink_peers: tuple[str, ...] = (),
) -> FakeGpuSpec:
    """A GPU with a UUID and PCI bus id derived from its index (bus 0x10 + index)."""
    return FakeGpuSpec(
        model=model,
        uuid=gpu_uuid(index),
        total_memory_mib=memory_mib,
        sm_count=sm_count,
        compute_capability=compute_capability,
        pci_bus_id=f"0000:{0x10 + index:02x}:00.0",
        numa_node=numa_node,
        nvlink_peers=nvlink_peers,
    )


def find_headers_dir(header: str) -> Path:
    """The include directory of `header` (cuda.h, cudaTypedefs.h, nvml.h) in NVIDIA's PyPI packages."""
    done = subprocess.run(
        [sys.executable, str(HERE / "scripts" / "find_headers.py"), header],
        capture_output=True,
        text=True,
        check=False,
    )
    if done.returncode != 0:
        raise RuntimeError(done.stderr.strip())
    return Path(done.stdout.strip())


def make(directory: Path, *, timeout: float = 900) -> None:
    """Runs ``make -s -C directory`` with this interpreter (its venv has NVIDIA's header packages),
    one build of a directory at a time across processes; RuntimeError with make's output if it fails."""
    build_dir = directory / "build"
    build_dir.mkdir(exist_ok=True)
    with open(build_dir / ".lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        result = subprocess.run(
            ["make", "-s", "-C", str(directory), f"PYTHON={sys.executable}"],
            capture_output=True,
            text=True,
            timeout=timeout,
            check=False,
        )
    if result.returncode != 0:
        raise RuntimeError(f"make -C {directory} failed:\n{result.stdout}{result.stderr}")


def build() -> Path:
    """Builds the fake driver (make -C tools/fakegpu); returns the build dir."""
    make(HERE)
    return BUILD_DIR


def build_hook() -> Path:
    """Builds the hook (make -C hook); returns its libvgpu.so."""
    make(HOOK_DIR)
    return HOOK_LIBRARY


def cuclient() -> Path:
    """The driver-API test client (see the comment at the top of clients/cuclient.c)."""
    return BUILD_DIR / "cuclient"


def mps_control() -> Path:
    """The stand-in for nvidia-cuda-mps-control (`-d` starts MPS on the fake GPU, `quit` on stdin
    stops it; clients whose CUDA_MPS_PIPE_DIRECTORY names its directory are MPS clients)."""
    return BIN_DIR / "nvidia-cuda-mps-control"


def render_config(
    specs: Sequence[FakeGpuSpec],
    *,
    driver_version: str | None = None,
    cuda_version: int | None = None,
    util_window_ms: int | None = None,
    timeslice_us: int | None = None,
    switch_us: int | None = None,
) -> str:
    """The config file describing `specs` (format in docs/fakegpu.md); ValueError naming the field
    and value if one is bad."""
    if not specs:
        raise ValueError("render_config: specs: at least one GPU is needed")
    lines = ["# fake GPUs (docs/fakegpu.md)"]
    driver = []
    if driver_version is not None:
        if not re.match(r"^[0-9][0-9.]*$", driver_version):
            raise ValueError(f"render_config: driver_version: bad value {driver_version!r}")
        driver.append(f"version={driver_version}")
    if cuda_version is not None:
        driver.append(f"cuda={cuda_version}")
    if util_window_ms is not None:
        driver.append(f"util_window_ms={util_window_ms}")
    driver.extend(_sched_fields("render_config", timeslice_us, switch_us))
    if driver:
        lines.append("driver " + " ".join(driver))
    lines.extend(spec.config_line() for spec in specs)
    return "\n".join(lines) + "\n"


def write_config(
    path: Path,
    specs: Sequence[FakeGpuSpec],
    *,
    driver_version: str | None = None,
    cuda_version: int | None = None,
    util_window_ms: int | None = None,
    timeslice_us: int | None = None,
    switch_us: int | None = None,
) -> Path:
    """Writes the config file describing `specs` (see render_config); returns its path."""
    text = render_config(
        specs,
        driver_version=driver_version,
        cuda_version=cuda_version,
        util_window_ms=util_window_ms,
        timeslice_us=timeslice_us,
        switch_us=switch_us,
    )
    path.write_text(text)
    return path


def client_env(config: Path, state: Path, base: Mapping[str, str] | None = None) -> dict[str, str]:
    """Environment for a process that should load the fake driver: `base` (default os.environ) plus
    LD_LIBRARY_PATH, FAKEGPU_CONFIG and FAKEGPU_STATE."""
    env = dict(os.environ if base is None else base)
    library_path = env.get("LD_LIBRARY_PATH")
    env["LD_LIBRARY_PATH"] = f"{BUILD_DIR}:{library_path}" if library_path else str(BUILD_DIR)
    env[CONFIG_ENV] = str(config)
    env[STATE_ENV] = str(state)
    return env


def _control(state: Path, uuid: str, kind: str) -> Path:
    if not _UUID.match(uuid):
        raise ValueError(f"uuid: bad value {uuid!r}")
    state.mkdir(parents=True, exist_ok=True)
    return state / f"{uuid}.{kind}"


def inject_xid(state: Path, uuid: str, xid: int) -> None:
    """Raises XID error `xid` on the GPU: NVML event sets registered for it report it."""
    if xid < 0:
        raise ValueError(f"inject_xid: xid: bad value {xid!r}")
    fd = os.open(_control(state, uuid, "xid"), os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o666)
    try:
        os.write(fd, f"{xid}\n".encode())  # one small append: readers never see half a line
    finally:
        os.close(fd)


def set_lost(state: Path, uuid: str, lost: bool) -> None:
    """Marks the GPU as fallen off the bus (NVML answers NVML_ERROR_GPU_IS_LOST for it) or recovers it."""
    marker = _control(state, uuid, "lost")
    if lost:
        marker.touch()
    else:
        marker.unlink(missing_ok=True)
