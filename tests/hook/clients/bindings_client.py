"""The hook test client in Python, through NVIDIA's driver bindings (cuda-bindings).

Runs the commands given as arguments and prints one line per command, like hook_client.c:
``alloc|managed|create|async <MiB>`` -> ``ok <index>`` or ``error <CUDA error name>``;
``free <index>``; ``info`` -> ``info <free> <total>``; ``total`` -> ``total <bytes>``.
"""

from __future__ import annotations

import sys

from cuda.bindings import driver as cuda

MIB = 2**20


def check(result: tuple[object, ...]) -> tuple[object, ...]:
    if result[0] != cuda.CUresult.CUDA_SUCCESS:
        print(f"fatal {result[0]!r}", flush=True)
        sys.exit(2)
    return result


def main(argv: list[str]) -> None:
    check(cuda.cuInit(0))
    _, device = check(cuda.cuDeviceGet(0))
    _, ctx = check(cuda.cuDevicePrimaryCtxRetain(device))
    check(cuda.cuCtxSetCurrent(ctx))
    held: list[tuple[str, object]] = []
    args = iter(argv)
    for command in args:
        if command == "info":
            _, free, total = check(cuda.cuMemGetInfo())
            print(f"info {free} {total}")
        elif command == "total":
            _, total = check(cuda.cuDeviceTotalMem(device))
            print(f"total {total}")
        elif command == "free":
            how, value = held[int(next(args))]
            if how == "create":
                (err,) = cuda.cuMemRelease(value)
            elif how == "async":
                (err,) = cuda.cuMemFreeAsync(value, 0)
                cuda.cuStreamSynchronize(0)
            else:
                (err,) = cuda.cuMemFree(value)
            print("ok" if err == cuda.CUresult.CUDA_SUCCESS else f"error {err.name}")
        else:
            size = int(next(args)) * MIB
            if command == "alloc":
                err, value = cuda.cuMemAlloc(size)
            elif command == "managed":
                err, value = cuda.cuMemAllocManaged(size, cuda.CUmemAttach_flags.CU_MEM_ATTACH_GLOBAL)
            elif command == "async":
                err, value = cuda.cuMemAllocAsync(size, 0)
                cuda.cuStreamSynchronize(0)
            elif command == "create":
                prop = cuda.CUmemAllocationProp()
                prop.type = cuda.CUmemAllocationType.CU_MEM_ALLOCATION_TYPE_PINNED
                prop.location.type = cuda.CUmemLocationType.CU_MEM_LOCATION_TYPE_DEVICE
                prop.location.id = int(device)
                err, value = cuda.cuMemCreate(size, prop, 0)
            else:
                raise SystemExit(f"unknown command {command!r}")
            if err == cuda.CUresult.CUDA_SUCCESS:
                held.append((command, value))
                print(f"ok {len(held) - 1}")
            else:
                print(f"error {err.name}")
        sys.stdout.flush()


if __name__ == "__main__":
    main(sys.argv[1:])
