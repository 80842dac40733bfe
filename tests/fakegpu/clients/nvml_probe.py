"""Queries NVML through nvidia-ml-py (pynvml) and prints one JSON object per command, for the fake
GPU's tests (run it with fakegpu.client_env so the fake libnvidia-ml.so.1 is loaded).

Commands: ``inventory``; ``memory I``; ``processes I``; ``utilization I``; ``process-utilization I``;
``xid-wait I TIMEOUT_MS`` (prints ``{"registered": ...}`` once the event set listens, then the event
or ``{"timeout": true}``); ``lost I`` (the NVML error of a few queries on GPU I, or "ok").
"""

from __future__ import annotations

import json
import sys
from typing import Any

import pynvml as nvml


def emit(value: object) -> None:
    print(json.dumps(value), flush=True)


def gpu(index: int) -> Any:
    return nvml.nvmlDeviceGetHandleByIndex(index)


def nvlinks(handle: Any) -> list[str]:
    peers = []
    for link in range(nvml.NVML_NVLINK_MAX_LINKS):
        try:
            if nvml.nvmlDeviceGetNvLinkState(handle, link) != nvml.NVML_FEATURE_ENABLED:
                break
        except nvml.NVMLError_NotSupported:
            break
        peers.append(nvml.nvmlDeviceGetNvLinkRemotePciInfo(handle, link).busId)
    return peers


def numa(handle: Any) -> int | None:
    try:
        return int(nvml.nvmlDeviceGetNumaNodeId(handle))
    except nvml.NVMLError_NotSupported:
        return None


def inventory() -> dict[str, Any]:
    gpus = []
    for index in range(nvml.nvmlDeviceGetCount()):
        handle = gpu(index)
        memory = nvml.nvmlDeviceGetMemoryInfo(handle)
        gpus.append(
            {
                "index": nvml.nvmlDeviceGetIndex(handle),
                "name": nvml.nvmlDeviceGetName(handle),
                "uuid": nvml.nvmlDeviceGetUUID(handle),
                "memory_total": memory.total,
                "memory_used": memory.used,
                "pci": nvml.nvmlDeviceGetPciInfo(handle).busId,
                "cc": list(nvml.nvmlDeviceGetCudaComputeCapability(handle)),
                "sms": nvml.nvmlDeviceGetAttributes(handle).multiprocessorCount,
                "numa": numa(handle),
                "nvlinks": nvlinks(handle),
            }
        )
    return {
        "driver": nvml.nvmlSystemGetDriverVersion(),
        "cuda": nvml.nvmlSystemGetCudaDriverVersion(),
        "gpus": gpus,
    }


def xid_wait(index: int, timeout_ms: int) -> None:
    events = nvml.nvmlEventSetCreate()
    handle = gpu(index)
    nvml.nvmlDeviceRegisterEvents(handle, nvml.nvmlEventTypeXidCriticalError, events)
    emit({"registered": nvml.nvmlDeviceGetUUID(handle)})
    try:
        data = nvml.nvmlEventSetWait(events, timeout_ms)
    except nvml.NVMLError_Timeout:
        emit({"timeout": True})
    else:
        emit({"xid": data.eventData, "uuid": nvml.nvmlDeviceGetUUID(data.device), "type": data.eventType})
    finally:
        nvml.nvmlEventSetFree(events)


def lost(index: int) -> dict[str, str]:
    try:
        handle = gpu(index)
        nvml.nvmlDeviceGetMemoryInfo(handle)
        nvml.nvmlDeviceGetUtilizationRates(handle)
    except nvml.NVMLError as error:
        return {"error": nvml.nvmlErrorString(error.value), "code": str(error.value)}
    return {"error": "ok"}


def main(args: list[str]) -> None:
    nvml.nvmlInit()
    it = iter(args)
    for command in it:
        if command == "inventory":
            emit(inventory())
        elif command == "memory":
            memory = nvml.nvmlDeviceGetMemoryInfo(gpu(int(next(it))))
            emit({"total": memory.total, "used": memory.used, "free": memory.free})
        elif command == "processes":
            procs = nvml.nvmlDeviceGetComputeRunningProcesses(gpu(int(next(it))))
            emit([{"pid": p.pid, "used": p.usedGpuMemory} for p in procs])
        elif command == "utilization":
            rates = nvml.nvmlDeviceGetUtilizationRates(gpu(int(next(it))))
            emit({"gpu": rates.gpu, "memory": rates.memory})
        elif command == "process-utilization":
            try:
                samples = nvml.nvmlDeviceGetProcessUtilization(gpu(int(next(it))), 0)
            except nvml.NVMLError_NotFound:
                samples = []
            emit([{"pid": s.pid, "sm": s.smUtil} for s in samples])
        elif command == "xid-wait":
            xid_wait(int(next(it)), int(next(it)))
        elif command == "lost":
            emit(lost(int(next(it))))
        else:
            raise SystemExit(f"nvml_probe: unknown command {command!r}")
    nvml.nvmlShutdown()


if __name__ == "__main__":
    main(sys.argv[1:])
