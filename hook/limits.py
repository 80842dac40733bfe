"""The limits file: the hook's only source of quotas inside a Kubernetes container.

The device plugin writes it on the node and mounts it read-only at
:data:`tessera.contract.CONTAINER_LIMITS_FILE`. The format (``docs/hook.md``) is line based::

    # comment
    version 2
    region /var/run/tessera/state/region
    elastic 0
    qos standard
    coordination /var/run/tessera/coordination
    device GPU-8f6d... memory 4294967296 cores 30
    oversubscribed GPU-8f6d... wait 5000
    mps /var/run/tessera/mps threads 50 priority 1

``memory`` is in bytes; ``cores`` is the percent of the GPU's time, 0 meaning no compute quota;
``qos`` the container's class and ``coordination`` where its GPUs' coordination areas are mounted
(both new in version 2). ``oversubscribed`` (version 3) marks a GPU whose memory best-effort
neighbours borrow: an allocation within quota that the driver refuses for lack of memory waits up to
``wait`` milliseconds for the node agent to evict them. ``mps`` (version 4) makes the container's
processes clients of the GPU's MPS control daemon at that pipe directory, with that share of the
GPU's threads and client priority (docs/hook.md, "MPS mode"). ``libvgpu.so`` parses it
(``hook/src/limits.c``); this module only writes it.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from tessera.contract import CONTAINER_STATE_DIR, MAX_CORES, MIB, ContractError, GpuGrant, QosClass
from tessera.files import write_atomically

# The hook's copies of these are in hook/src/contract.h (VGPU_LIMITS_VERSION, VGPU_MAX_DEVICES,
# VGPU_UUID_LEN, which counts the NUL) and hook/Makefile (REGION_FILE); tests/hook/test_constants.py
# fails when they differ. The hook still reads version 1 (no qos, no coordination): the file of a
# container started before an upgrade. A file is written as version 3 only when it has an
# `oversubscribed` line, and as version 4 only when it has an `mps` line, so that an older hook still
# reads every file it can act on (and refuses, failing closed, one it cannot).
LIMITS_FORMAT_VERSION = 4
MPS_VERSION = 4
OVERSUBSCRIBED_VERSION = 3
LIMITS_VERSION_WITHOUT_OVERSUBSCRIBED = 2
# hook/src/contract.h VGPU_MAX_SHORTFALL_WAIT_MS: the longest wait of an `oversubscribed` line.
MAX_SHORTFALL_WAIT_MS = 600_000
# The shared accounting region of one container's processes, inside its state directory.
CONTAINER_REGION_FILE = f"{CONTAINER_STATE_DIR}/region"
MAX_DEVICES = 16
MAX_UUID_LENGTH = 79


@dataclass(frozen=True, slots=True)
class DeviceLimit:
    """The quotas of one container on one physical GPU, named by its NVML UUID."""

    uuid: str
    memory_quota_bytes: int
    # Percent of the GPU's time, 1..100; 0 = no compute quota (launches are never throttled).
    cores: int
    # Best-effort neighbours borrow the GPU's memory: how long an allocation within quota that the
    # driver refuses for lack of memory waits for their eviction, in ms; 0 = not oversubscribed.
    shortfall_wait_ms: int = 0

    @classmethod
    def from_grant(cls, grant: GpuGrant) -> DeviceLimit:
        return cls(uuid=grant.uuid, memory_quota_bytes=grant.memory_quota_mib * MIB, cores=grant.cores)

    def validate(self) -> None:
        if not self.uuid or len(self.uuid) > MAX_UUID_LENGTH or any(c.isspace() for c in self.uuid):
            raise ContractError(
                f"limits: uuid {self.uuid!r} must be 1..{MAX_UUID_LENGTH} characters without spaces"
            )
        if isinstance(self.memory_quota_bytes, bool) or self.memory_quota_bytes <= 0:
            raise ContractError(
                f"limits: device {self.uuid}: memory_quota_bytes {self.memory_quota_bytes!r} must be > 0"
            )
        if isinstance(self.cores, bool) or not 0 <= self.cores <= MAX_CORES:
            raise ContractError(f"limits: device {self.uuid}: cores {self.cores!r} is outside 0..{MAX_CORES}")
        wait = self.shortfall_wait_ms
        if isinstance(wait, bool) or not 0 <= wait <= MAX_SHORTFALL_WAIT_MS:
            raise ContractError(
                f"limits: device {self.uuid}: shortfall_wait_ms {wait!r} "
                f"is outside 0..{MAX_SHORTFALL_WAIT_MS}"
            )


@dataclass(frozen=True, slots=True)
class MpsClient:
    """How a container's processes join its GPU's MPS control daemon (docs/hook.md, "MPS mode")."""

    pipe_directory: str
    # Percent of each GPU's threads (SMs) its kernels may use, 1..100.
    threads: int
    # 0: normal, 1: below normal (CUDA_MPS_CLIENT_PRIORITY).
    priority: int

    def line(self) -> str:
        if isinstance(self.threads, bool) or not 1 <= self.threads <= MAX_CORES:
            raise ContractError(f"limits: mps threads {self.threads!r} is outside 1..{MAX_CORES}")
        if self.priority not in (0, 1) or isinstance(self.priority, bool):
            raise ContractError(f"limits: mps priority {self.priority!r} is not 0 or 1")
        pipe = _absolute("mps pipe directory", self.pipe_directory)
        return f"mps {pipe} threads {self.threads} priority {self.priority}"


def _absolute(what: str, path: str) -> str:
    if not path.startswith("/") or any(c.isspace() for c in path):
        raise ContractError(f"limits: {what} {path!r} must be an absolute path without spaces")
    return path


def render_limits(
    devices: Sequence[DeviceLimit],
    *,
    elastic: bool = False,
    region: str = CONTAINER_REGION_FILE,
    qos: QosClass = QosClass.STANDARD,
    coordination: str | None = None,
    mps: MpsClient | None = None,
) -> str:
    """The text of a limits file; raises :class:`ContractError` naming the bad field.

    ``coordination``: where the container's GPUs' coordination areas are mounted; None, no line
    (the container then takes no part in the QoS classes: it neither yields nor is yielded to)."""
    if not 1 <= len(devices) <= MAX_DEVICES:
        raise ContractError(f"limits: {len(devices)} devices, expected 1..{MAX_DEVICES}")
    uuids = [d.uuid for d in devices]
    if len(set(uuids)) != len(uuids):
        raise ContractError(f"limits: device uuids must be distinct, got {uuids}")
    for device in devices:
        device.validate()
    oversubscribed = [d for d in devices if d.shortfall_wait_ms]
    version = (
        MPS_VERSION
        if mps is not None
        else OVERSUBSCRIBED_VERSION
        if oversubscribed
        else LIMITS_VERSION_WITHOUT_OVERSUBSCRIBED
    )
    lines = [
        "# Tessera limits, written by the device plugin; format in docs/hook.md",
        f"version {version}",
        f"region {_absolute('region', region)}",
        f"elastic {int(elastic)}",
        f"qos {qos.value}",
        *([f"coordination {_absolute('coordination', coordination)}"] if coordination is not None else []),
        *(f"device {d.uuid} memory {d.memory_quota_bytes} cores {d.cores}" for d in devices),
        *(f"oversubscribed {d.uuid} wait {d.shortfall_wait_ms}" for d in oversubscribed),
        *([mps.line()] if mps is not None else []),
    ]
    return "\n".join(lines) + "\n"


def write_limits(
    path: Path,
    devices: Sequence[DeviceLimit],
    *,
    elastic: bool = False,
    region: str = CONTAINER_REGION_FILE,
    qos: QosClass = QosClass.STANDARD,
    coordination: str | None = None,
    mps: MpsClient | None = None,
) -> None:
    """Writes the limits file atomically (readers see the old or the new file) and read-only (0444)."""
    text = render_limits(devices, elastic=elastic, region=region, qos=qos, coordination=coordination, mps=mps)
    write_atomically(path, text, mode=0o444)
