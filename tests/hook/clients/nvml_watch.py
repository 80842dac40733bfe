"""Watches GPU 0's memory use as the driver (NVML) sees it until a line arrives on stdin, then prints
the largest used value seen and how many samples were taken: ``<max used bytes> <samples>``."""

from __future__ import annotations

import sys
import threading

import pynvml

pynvml.nvmlInit()
handle = pynvml.nvmlDeviceGetHandleByIndex(0)
done = threading.Event()
threading.Thread(target=lambda: (sys.stdin.readline(), done.set()), daemon=True).start()
print("watching", flush=True)
largest, samples = 0, 0
while not done.is_set():
    largest = max(largest, pynvml.nvmlDeviceGetMemoryInfo(handle).used)
    samples += 1
print(largest, samples, flush=True)
pynvml.nvmlShutdown()
