"""Answers, for each GPU UUID read from stdin (one a line), ``<free bytes> <used bytes>`` as
nvidia-ml-py reports them (nvmlDeviceGetMemoryInfo): the node agent's NVML reading of a GPU's free
memory, for tests whose agent runs in the test process, asked many times a second."""

from __future__ import annotations

import sys

import pynvml

pynvml.nvmlInit()
try:
    for line in sys.stdin:
        info = pynvml.nvmlDeviceGetMemoryInfo(pynvml.nvmlDeviceGetHandleByUUID(line.strip()))
        print(info.free, info.used, flush=True)
finally:
    pynvml.nvmlShutdown()
