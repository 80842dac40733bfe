"""Prints what nvidia-ml-py reports for GPU 0 in this (hooked) process: ``<total> <used> <free>``
through nvmlDeviceGetMemoryInfo, then the same through nvmlDeviceGetMemoryInfo_v2."""

from __future__ import annotations

import pynvml

pynvml.nvmlInit()
try:
    handle = pynvml.nvmlDeviceGetHandleByIndex(0)
    v1 = pynvml.nvmlDeviceGetMemoryInfo(handle)
    print(v1.total, v1.used, v1.free)
    v2 = pynvml.nvmlDeviceGetMemoryInfo(handle, version=pynvml.nvmlMemory_v2)
    print(v2.total, v2.used, v2.free)
finally:
    pynvml.nvmlShutdown()
