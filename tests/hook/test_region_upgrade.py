"""A region written by an older hook (layout version 1, whose lock was a pthread mutex) is started
afresh by a newer hook once none of its processes lives (a container restarted onto a new hook), and
refused while one does (fail closed: the two hooks' locks would not exclude each other)."""

from __future__ import annotations

import fcntl
import os
import struct

from tests.hook.conftest import MIB, Clients, FakeGpus
from tests.processes import Processes

REGION_MAGIC = 0x3147455253534554  # "TESSREG1", hook/src/region.h
SLOT_LOCK_BASE = 1 << 30  # hook/src/region.h: a live process holds byte SLOT_LOCK_BASE + its slot
REGION_VERSION = 4  # hook/src/region.h


def write_version_1_region(gpu: FakeGpus) -> None:
    # magic, version, devices, procs_hw: one slot in use, of a process that may or may not live.
    gpu.region.write_bytes(struct.pack("<QIII", REGION_MAGIC, 1, 0, 1) + bytes(4096))


def test_an_older_hooks_region_without_live_processes_starts_afresh(
    gpu: FakeGpus, clients: Clients, processes: Processes
) -> None:
    write_version_1_region(gpu)
    result = processes.run(
        [clients.dynamic, "dlsym", "alloc", "256m", "info"], gpu.env(TESSERA_MEMORY_LIMIT="1g")
    )
    assert result.lines == ["ok 0", f"info {768 * MIB} {1024 * MIB}"], result.stderr  # free, total
    assert struct.unpack_from("<QI", gpu.region.read_bytes())[1] == REGION_VERSION


def test_an_older_hooks_region_with_a_live_process_is_refused(
    gpu: FakeGpus, clients: Clients, processes: Processes
) -> None:
    write_version_1_region(gpu)
    fd = os.open(gpu.region, os.O_RDWR)
    try:
        # This test process stands for a live process of the older hook, holding slot 0.
        fcntl.fcntl(
            fd, fcntl.F_OFD_SETLK, struct.pack("hhqqi4x", fcntl.F_WRLCK, os.SEEK_SET, SLOT_LOCK_BASE, 1, 0)
        )
        result = processes.run(
            [clients.dynamic, "dlsym", "alloc", "256m"], gpu.env(TESSERA_MEMORY_LIMIT="1g")
        )
    finally:
        os.close(fd)
    assert result.lines == ["error CUDA_ERROR_OUT_OF_MEMORY"], result.stderr
    assert f"not a Tessera region of version {REGION_VERSION}" in result.stderr
    assert struct.unpack_from("<QI", gpu.region.read_bytes())[1] == 1
