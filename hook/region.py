"""Reads a container's shared accounting region (the file named ``region`` in its limits file).

The layout is owned by the C hook; this module asks ``libvgpu.so`` (``vgpu_region_read``) for a
consistent snapshot, in which the memory of processes that died and were not yet reclaimed is
already left out.

The file lives in a directory the container can write, and the node agent reads it as root: the
reader never follows a symbolic link, never blocks (a FIFO in its place fails at once), reads only a
regular file and only the region's size, and trusts no count in it (``hook/src/snapshot.c``).
"""

from __future__ import annotations

import ctypes
import errno
import os
from dataclasses import dataclass
from pathlib import Path

from hook._library import load_library
from hook.limits import MAX_DEVICES, MAX_UUID_LENGTH

NS_PER_SECOND = 1e9


class RegionError(RuntimeError):
    """The region file cannot be read; the message names the path and the reason."""


# What vgpu_region_read's own errors mean (hook/src/snapshot.h); others are the system's.
_REASONS = {
    errno.EPROTO: "not a Tessera region of this version",
    errno.ELOOP: "a symbolic link, not followed",
    errno.EINVAL: "not a regular file",
}


class _DeviceUsageC(ctypes.Structure):
    # Mirrors struct vgpu_device_usage in hook/src/snapshot.h (tests/hook/test_constants.py checks
    # every field's offset and size).
    _fields_ = (
        ("uuid", ctypes.c_char * (MAX_UUID_LENGTH + 1)),
        ("memory_used", ctypes.c_uint64),
        ("memory_quota", ctypes.c_uint64),
        ("busy_ns", ctypes.c_uint64),
        ("throttled_ns", ctypes.c_uint64),
        ("launches", ctypes.c_uint64),
        ("memory_peak", ctypes.c_uint64),
        ("refused", ctypes.c_uint64),
        ("memory_waiting", ctypes.c_uint64),
        ("cores", ctypes.c_uint32),
        ("elastic", ctypes.c_uint32),
        ("processes", ctypes.c_uint32),
        ("reserved", ctypes.c_uint32),
    )


@dataclass(frozen=True, slots=True)
class DeviceUsage:
    """One physical GPU as one container uses it."""

    uuid: str
    memory_used_bytes: int
    memory_quota_bytes: int
    # The most the container has held on the GPU (since its region was created), and how many of its
    # allocations the quota refused.
    memory_peak_bytes: int
    allocations_refused: int
    # Of memory_used_bytes, what allocations within quota wait for: the driver had no memory left
    # (best-effort neighbours borrow it; hook/src/shortfall.c).
    memory_waiting_bytes: int
    # Percent of the GPU's time; 0 = no compute quota.
    cores: int
    elastic: bool
    # Device time charged to the container's kernel launches, and time its launches were held back.
    busy_seconds: float
    throttled_seconds: float
    launches: int
    # Live processes holding memory on this GPU.
    processes: int


@dataclass(frozen=True, slots=True)
class RegionUsage:
    devices: tuple[DeviceUsage, ...]
    # Live processes attached to the region.
    live_processes: int

    def device(self, uuid: str) -> DeviceUsage | None:
        return next((d for d in self.devices if d.uuid == uuid), None)


def device_usage_size() -> int:
    """sizeof(struct vgpu_device_usage) as compiled into libvgpu.so."""
    return int(load_library().vgpu_device_usage_size())


def read_region(path: Path) -> RegionUsage:
    library = load_library()
    read = library.vgpu_region_read
    read.argtypes = (
        ctypes.c_char_p,
        ctypes.POINTER(_DeviceUsageC),
        ctypes.c_int,
        ctypes.POINTER(ctypes.c_int),
    )
    read.restype = ctypes.c_int
    out = (_DeviceUsageC * MAX_DEVICES)()
    live = ctypes.c_int(0)
    count = read(os.fsencode(path), out, MAX_DEVICES, ctypes.byref(live))
    if count < 0:
        raise RegionError(f"region {path}: {_REASONS.get(-count) or os.strerror(-count)}")
    return RegionUsage(
        devices=tuple(
            DeviceUsage(
                uuid=d.uuid.decode(errors="replace"),
                memory_used_bytes=d.memory_used,
                memory_quota_bytes=d.memory_quota,
                memory_peak_bytes=d.memory_peak,
                allocations_refused=d.refused,
                memory_waiting_bytes=d.memory_waiting,
                cores=d.cores,
                elastic=bool(d.elastic),
                busy_seconds=d.busy_ns / NS_PER_SECOND,
                throttled_seconds=d.throttled_ns / NS_PER_SECOND,
                launches=d.launches,
                processes=d.processes,
            )
            for d in out[:count]
        ),
        live_processes=live.value,
    )
