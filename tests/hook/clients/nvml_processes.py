"""Prints ``<pid> <used bytes>`` for each compute process nvidia-ml-py reports on the GPU with the UUID
given as argument (nvmlDeviceGetComputeRunningProcesses): the node agent's view of a GPU."""

from __future__ import annotations

import sys

import pynvml

pynvml.nvmlInit()
try:
    handle = pynvml.nvmlDeviceGetHandleByUUID(sys.argv[1])
    for process in pynvml.nvmlDeviceGetComputeRunningProcesses(handle):
        print(process.pid, process.usedGpuMemory or 0)
finally:
    pynvml.nvmlShutdown()
