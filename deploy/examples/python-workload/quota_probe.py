"""What a framework sees of its GPU share: NVML's and the driver's total memory, then blocks of
CHUNK MiB (argument 1, default 256) allocated through the driver until it refuses one.

Prints ``key=value`` lines (``nvml_total_mib``, ``driver_total_mib``, ``allocations_ok``,
``refused_with``), frees what it holds and then idles, so that its report stays in the pod's log.
"""

from __future__ import annotations

import sys
import time

import pynvml
from cuda.bindings import driver as cuda

MIB = 2**20
# A bound on the loop should the driver never refuse (no quota, a huge GPU).
MAX_BLOCKS = 4096


def checked(result: tuple[object, ...], call: str) -> tuple[object, ...]:
    if result[0] != cuda.CUresult.CUDA_SUCCESS:
        sys.exit(f"{call} failed: {result[0]!r}")
    return result


def main(chunk_mib: int) -> None:
    pynvml.nvmlInit()
    memory = pynvml.nvmlDeviceGetMemoryInfo(pynvml.nvmlDeviceGetHandleByIndex(0))
    print(f"device={pynvml.nvmlDeviceGetName(pynvml.nvmlDeviceGetHandleByIndex(0))}")
    print(f"nvml_total_mib={memory.total // MIB}")
    checked(cuda.cuInit(0), "cuInit")
    _, device = checked(cuda.cuDeviceGet(0), "cuDeviceGet")
    _, ctx = checked(cuda.cuDevicePrimaryCtxRetain(device), "cuDevicePrimaryCtxRetain")
    checked(cuda.cuCtxSetCurrent(ctx), "cuCtxSetCurrent")
    _, _, total = checked(cuda.cuMemGetInfo(), "cuMemGetInfo")
    print(f"driver_total_mib={int(total) // MIB}")
    held = []
    refused = None
    while refused is None and len(held) < MAX_BLOCKS:
        err, pointer = cuda.cuMemAlloc(chunk_mib * MIB)
        if err == cuda.CUresult.CUDA_SUCCESS:
            held.append(pointer)
        else:
            refused = err
    print(f"chunk_mib={chunk_mib}")
    print(f"allocations_ok={len(held)}")
    print(f"refused_with={refused.name if refused is not None else 'nothing'}", flush=True)
    for pointer in held:
        cuda.cuMemFree(pointer)
    while True:
        time.sleep(3600)


if __name__ == "__main__":
    main(int(sys.argv[1]) if len(sys.argv) > 1 else 256)
