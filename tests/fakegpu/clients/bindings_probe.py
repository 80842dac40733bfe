"""Uses the fake GPU through NVIDIA's driver bindings (cuda-bindings) and prints one JSON object:
the devices it sees, then, on device argv[1], 256 MiB allocations until the first failure, one free
and one more allocation, cuMemGetInfo at each point, and a host-device-host copy of 4 KiB."""

from __future__ import annotations

import json
import sys
from typing import Any

from cuda.bindings import driver as cuda

MIB = 2**20


def ok(result: tuple[Any, ...]) -> tuple[Any, ...]:
    if result[0] != cuda.CUresult.CUDA_SUCCESS:
        print(json.dumps({"error": result[0].name}), flush=True)
        sys.exit(0)
    return result


def devices() -> list[dict[str, Any]]:
    found = []
    for ordinal in range(ok(cuda.cuDeviceGetCount())[1]):
        device = ok(cuda.cuDeviceGet(ordinal))[1]
        name = ok(cuda.cuDeviceGetName(128, device))[1]
        found.append(
            {
                "name": name.split(b"\0", 1)[0].decode(),
                "uuid": bytes(ok(cuda.cuDeviceGetUuid(device))[1].bytes).hex(),
                "total": ok(cuda.cuDeviceTotalMem(device))[1],
                "pci": ok(cuda.cuDeviceGetPCIBusId(32, device))[1].split(b"\0", 1)[0].decode(),
                "sms": ok(
                    cuda.cuDeviceGetAttribute(
                        cuda.CUdevice_attribute.CU_DEVICE_ATTRIBUTE_MULTIPROCESSOR_COUNT, device
                    )
                )[1],
            }
        )
    return found


def main(ordinal: int) -> None:
    ok(cuda.cuInit(0))
    report: dict[str, Any] = {"devices": devices()}
    device = ok(cuda.cuDeviceGet(ordinal))[1]
    ctx = ok(cuda.cuDevicePrimaryCtxRetain(device))[1]
    ok(cuda.cuCtxSetCurrent(ctx))
    report["info_before"] = list(ok(cuda.cuMemGetInfo())[1:])
    held = []
    while True:
        err, pointer = cuda.cuMemAlloc(256 * MIB)
        if err != cuda.CUresult.CUDA_SUCCESS:
            report["first_failure"] = err.name
            break
        held.append(pointer)
    report["allocated"] = len(held)
    report["info_full"] = list(ok(cuda.cuMemGetInfo())[1:])
    ok(cuda.cuMemFree(held.pop()))
    err, pointer = cuda.cuMemAlloc(256 * MIB)
    report["after_free"] = err.name
    held.append(pointer)
    data = bytes(range(256)) * 16
    ok(cuda.cuMemcpyHtoD(held[0], data, len(data)))
    back = bytearray(len(data))
    ok(cuda.cuMemcpyDtoH(back, held[0], len(data)))
    report["copy_roundtrip"] = bytes(back) == data
    for pointer in held:
        ok(cuda.cuMemFree(pointer))
    report["info_after"] = list(ok(cuda.cuMemGetInfo())[1:])
    print(json.dumps(report), flush=True)


if __name__ == "__main__":
    main(int(sys.argv[1]) if len(sys.argv) > 1 else 0)
