"""What `bench/real_gpu.py` runs in each child process: one probe, under the hook or not, printing
one JSON line (and, for the batch probes, a `warm` line once past their warm-up, so the parent can
start a neighbour against a batch already running).

Two kinds of probe:
- driver probes (`driver_*`) use cuda-bindings alone and a `sleep_us_<N>` kernel: on the fake GPU the
  name says how long it runs; on a real GPU the same name is a PTX loop of dependent multiply-adds
  calibrated at start to run N us alone. They run on both, which is how the fake GPU's time model is
  held to the real GPU's numbers (`tests/fakegpu/test_real_gpu_replay.py`).
- framework probes (PyTorch, CUDA graphs, torch.compile, Triton, JAX, CuPy, transformers) need NVIDIA's
  runtime, so a real GPU only (docs/fakegpu.md, "Not modelled").

    python3 -m bench.gpu_probes PROBE      (the environment carries its settings: PROBE_*)"""

# Each probe imports its framework itself: it runs in its own process, and a machine may lack some.
# ruff: noqa: PLC0415

from __future__ import annotations

import contextlib
import ctypes
import gc
import json
import os
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from typing import Any

BLOCK = 256 << 20
MIB = 1 << 20
Result = dict[str, Any]


def setting(name: str, default: str) -> str:
    return os.environ.get(f"PROBE_{name}", default)


def seconds() -> float:
    return float(setting("SECONDS", "6"))


def announce_warm() -> None:
    """Tell the parent the batch is past its start-up (see `bench/real_gpu.py` `Pair`)."""
    print("warm", time.monotonic(), flush=True)


# --- measuring a loop of GPU work ---


class Sampler:
    """NVML's GPU utilization (the share of time a kernel ran) and SM clock every 50 ms. A GPU busy
    30% of the time clocks higher than one busy all the time, so work per second overstates a share
    of time; the utilization is the share itself."""

    def __init__(self) -> None:
        import pynvml

        pynvml.nvmlInit()
        self._nvml = pynvml
        self._gpu = pynvml.nvmlDeviceGetHandleByIndex(0)
        self.clocks: list[int] = []
        self.busy: list[int] = []
        self._running = threading.Event()
        self._thread = threading.Thread(target=self._sample, daemon=True)

    def _sample(self) -> None:
        while self._running.is_set():
            with contextlib.suppress(self._nvml.NVMLError):  # the fake GPU has no clocks
                self.clocks.append(self._nvml.nvmlDeviceGetClockInfo(self._gpu, self._nvml.NVML_CLOCK_SM))
            self.busy.append(self._nvml.nvmlDeviceGetUtilizationRates(self._gpu).gpu)
            time.sleep(0.05)

    def __enter__(self) -> Sampler:
        self._running.set()
        self._thread.start()
        return self

    def __exit__(self, *_: object) -> None:
        self._running.clear()
        self._thread.join()

    def summary(self) -> Result:
        # the first second of samples covers NVML's averaging window reaching into the warm-up
        settled = self.busy[20:] or self.busy
        return {
            "mean_gpu_utilization": round(sum(settled) / max(1, len(settled)), 1),
            "mean_sm_clock_mhz": round(sum(self.clocks) / max(1, len(self.clocks))),
        }


def run_loop(step: Callable[[], None], sync: Callable[[], None], per_step: int = 4) -> Result:
    """`step` back to back for PROBE_SECONDS after one warm second, synchronising every `per_step`
    steps. With PROBE_TRACE=<file>, each synchronisation's monotonic time and step count are
    appended to it as they happen, so the parent can take the rate inside a neighbour's window and
    stop the batch whenever it likes."""
    warm_until = time.monotonic() + 1.0
    while time.monotonic() < warm_until:
        step()
        sync()
    announce_warm()
    trace_path = setting("TRACE", "")
    trace = open(trace_path, "a", buffering=1) if trace_path else None  # noqa: SIM115
    sampler = Sampler() if setting("NVML", "1") == "1" else None
    start = time.monotonic()
    count = 0
    if sampler:
        sampler.__enter__()
    try:
        while time.monotonic() - start < seconds():
            for _ in range(per_step):
                step()
            sync()
            count += per_step
            if trace:
                trace.write(f"{time.monotonic():.5f} {count}\n")
    finally:
        if sampler:
            sampler.__exit__()
        if trace:
            trace.close()
    end = time.monotonic()
    elapsed = end - start
    result: Result = {
        "steps_per_s": round(count / elapsed, 2),
        "seconds": round(elapsed, 2),
        "window": [start, end],
    }
    if sampler:
        result.update(sampler.summary())
    return result


def latencies(request: Callable[[], None], gap_s: float) -> Result:
    """A latency-critical service: one request every `gap_s`, each timed from its launch to its
    completion on the host (the wait a client would see), for PROBE_SECONDS."""
    timings: list[float] = []
    start = time.monotonic()
    while time.monotonic() - start < seconds():
        began = time.perf_counter()
        request()
        timings.append((time.perf_counter() - began) * 1000)
        time.sleep(gap_s)
    end = time.monotonic()
    timings.sort()
    return {
        "requests": len(timings),
        "p50_ms": round(timings[len(timings) // 2], 3),
        "p90_ms": round(timings[min(len(timings) - 1, int(0.90 * len(timings)))], 3),
        "p99_ms": round(timings[min(len(timings) - 1, int(0.99 * len(timings)))], 3),
        "max_ms": round(timings[-1], 3),
        "window": [start, end],
    }


# --- driver probes: cuda-bindings and a `sleep_us_<N>` kernel, on the fake GPU and a real one ---

# One thread's loop of dependent multiply-adds, `iters` long; the store that can never happen (x
# never reaches 12345.0 from 1.0 times a number just above 1 in so few steps) keeps the loop alive.
PTX = """.version 7.0
.target sm_70
.address_size 64
.visible .entry {name}(.param .u64 iters, .param .u64 out)
{{
  .reg .pred %p<2>;
  .reg .f32 %f<3>;
  .reg .b64 %rd<4>;
  ld.param.u64 %rd1, [iters];
  mov.f32 %f1, 0f3F800000;
  mov.f32 %f2, 0f3F800001;
  mov.u64 %rd2, 0;
LOOP:
  fma.rn.f32 %f1, %f1, %f2, 0f358637BD;
  add.u64 %rd2, %rd2, 1;
  setp.lt.u64 %p1, %rd2, %rd1;
  @%p1 bra LOOP;
  setp.neu.f32 %p1, %f1, 0f4640E400;
  @%p1 bra DONE;
  ld.param.u64 %rd3, [out];
  st.global.f32 [%rd3], %f1;
DONE:
  ret;
}}
"""


class DriverKernel:
    """A `sleep_us_<us>` kernel on device 0's primary context: `blocks_per_sm` blocks of `threads`
    threads per SM."""

    def __init__(self, us: int, blocks_per_sm: int, threads: int, shape: str) -> None:
        from cuda.bindings import driver

        self.driver = driver
        self.check(driver.cuInit(0))
        device = self.check(driver.cuDeviceGet(0))
        self.sms = int(
            self.check(
                driver.cuDeviceGetAttribute(
                    driver.CUdevice_attribute.CU_DEVICE_ATTRIBUTE_MULTIPROCESSOR_COUNT, device
                )
            )
        )
        context = self.check(driver.cuDevicePrimaryCtxRetain(device))
        self.check(driver.cuCtxSetCurrent(context))
        self.stream = self.check(driver.cuStreamCreate(0))
        self.name = f"sleep_us_{us}"
        module = self.check(driver.cuModuleLoadData(PTX.format(name=self.name).encode() + b"\0"))
        self.function = self.check(driver.cuModuleGetFunction(module, self.name.encode()))
        self.out = int(self.check(driver.cuMemAlloc(4)))
        self.grid = blocks_per_sm * self.sms
        self.threads = threads
        # A hooked probe under a compute quota cannot time itself (its launches wait): it takes the
        # iterations per microsecond an unhooked `driver_calibrate` measured for its shape.
        per_us = os.environ.get(f"PROBE_{shape.upper()}_ITERS_PER_US")
        self.iters = max(1, round(float(per_us) * us)) if per_us else 1 << 12
        if per_us is None:
            self.calibrate(us)
        self.calibrated_us = round(min(self.timed() for _ in range(3)), 1)

    def check(self, result: Any) -> Any:
        if not isinstance(result, tuple):
            result = (result,)
        if result[0] != self.driver.CUresult.CUDA_SUCCESS:
            raise RuntimeError(f"{result[0].name}")
        return result[1] if len(result) == 2 else None

    def launch(self) -> None:
        params = ((self.iters, self.out), (ctypes.c_uint64, ctypes.c_uint64))
        self.check(
            self.driver.cuLaunchKernel(
                self.function, self.grid, 1, 1, self.threads, 1, 1, 0, self.stream, params, 0
            )
        )

    def sync(self) -> None:
        self.check(self.driver.cuStreamSynchronize(self.stream))

    def timed(self) -> float:
        """One launch alone, in us by the host clock."""
        began = time.perf_counter()
        self.launch()
        self.sync()
        return (time.perf_counter() - began) * 1e6

    def calibrate(self, us: int) -> None:
        """Scale `iters` until one launch takes `us` alone (a real GPU; on the fake the name decides
        and this ends at once). Twice from the best of five, since a cold GPU clocks up meanwhile."""
        for _ in range(3):
            best = min(self.timed() for _ in range(5))
            if abs(best - us) < 0.05 * us:
                break
            self.iters = max(1, int(self.iters * us / max(best, 1.0)))


SERVICE_SHAPE = (1, 256, "service")  # one block of 256 threads per SM
BATCH_SHAPE = (2, 1024, "batch")  # every thread slot of every SM


def probe_driver_calibrate() -> Result:
    """Iterations per microsecond of each shape's kernel, alone (1000 us kernels)."""
    return {
        f"{shape}_iters_per_us": round(DriverKernel(1000, blocks, threads, shape).iters / 1000, 4)
        for blocks, threads, shape in (SERVICE_SHAPE, BATCH_SHAPE)
    }


def probe_driver_service() -> Result:
    """One PROBE_KERNEL_US kernel every PROBE_GAP_MS."""
    kernel = DriverKernel(int(setting("KERNEL_US", "250")), *SERVICE_SHAPE)
    for _ in range(20):
        kernel.timed()
    result = latencies(kernel.timed, float(setting("GAP_MS", "3")) / 1000)
    return {**result, "kernel_us_alone": kernel.calibrated_us}


def probe_driver_batch() -> Result:
    """PROBE_KERNEL_US kernels filling every thread slot, back to back, four per synchronisation."""
    kernel = DriverKernel(int(setting("KERNEL_US", "2000")), *BATCH_SHAPE)
    result = run_loop(kernel.launch, kernel.sync)
    return {**result, "kernel_us_alone": kernel.calibrated_us}


def probe_driver_queue() -> Result:
    """How far a stream's launches run ahead of the GPU: PROBE_LAUNCHES launches of a 200 us kernel
    without synchronising. Until the queue is full a launch returns in microseconds; from then on
    each waits for room, about one kernel's time: the number of launches before the first one that
    took over half a kernel is the queue's depth (the first of 16 in a row, which a host that
    descheduled the probe once does not make)."""
    kernel = DriverKernel(200, *SERVICE_SHAPE)
    kernel.sync()
    count = int(setting("LAUNCHES", "3000"))
    host_us: list[float] = []
    for _ in range(count):
        began = time.perf_counter()
        kernel.launch()
        host_us.append((time.perf_counter() - began) * 1e6)
    kernel.sync()
    first_wait = next((i for i in range(count - 16) if sorted(host_us[i : i + 16])[0] > 100), None)
    fast = sorted(host_us[: first_wait or count])
    return {
        "launches": count,
        "launches_before_the_first_wait": first_wait,
        "median_launch_us_before_it": round(fast[len(fast) // 2], 2) if fast else None,
        "kernel_us_alone": kernel.calibrated_us,
    }


# --- framework probes: a real GPU only ---


def probe_torch_memory() -> Result:
    """Allocate 256 MiB tensors until the quota refuses; free one, allocate again; meanwhile ask
    NVML (in this process) and nvidia-smi (a child sharing the container's region) what they see.
    PYTORCH_CUDA_ALLOC_CONF picks the allocator (expandable segments, cudaMallocAsync)."""
    import pynvml
    import torch

    free, total = torch.cuda.mem_get_info()
    blocks: list[Any] = []
    error = ""
    while len(blocks) < 4096:
        try:
            blocks.append(torch.empty(BLOCK, dtype=torch.uint8, device="cuda"))
        except torch.OutOfMemoryError as exc:
            error = str(exc).splitlines()[0][:160]
            break
    held = len(blocks)
    pynvml.nvmlInit()
    info = pynvml.nvmlDeviceGetMemoryInfo(pynvml.nvmlDeviceGetHandleByIndex(0))
    smi = subprocess.run(
        ["nvidia-smi", "--query-gpu=memory.total,memory.used", "--format=csv,noheader,nounits"],
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    blocks.pop()
    torch.cuda.empty_cache()
    try:
        blocks.append(torch.empty(BLOCK, dtype=torch.uint8, device="cuda"))
        again = True
    except torch.OutOfMemoryError:
        again = False
    return {
        "allocator": os.environ.get("PYTORCH_CUDA_ALLOC_CONF", "default"),
        "mem_get_info_total_mib": total // MIB,
        "mem_get_info_free_mib": free // MIB,
        "blocks_256mib": held,
        "refusal": error,
        "allocates_after_a_free": again,
        "nvml_total_mib": info.total // MIB,
        "nvml_used_mib": info.used // MIB,
        "nvidia_smi_total_used_mib": smi.stdout.strip() or smi.stderr.strip()[:200],
    }


def probe_driver_memory() -> Result:
    """cuda-bindings, the driver API as NVIDIA's Python bindings reach it (cuGetProcAddress_v2)."""
    from cuda.bindings import driver

    def check(result: tuple[Any, ...]) -> Any:
        if result[0] != driver.CUresult.CUDA_SUCCESS:
            raise RuntimeError(result[0].name)
        return result[1] if len(result) == 2 else result[1:]

    check(driver.cuInit(0))
    device = check(driver.cuDeviceGet(0))
    context = check(driver.cuDevicePrimaryCtxRetain(device))
    check(driver.cuCtxSetCurrent(context))
    free, total = check(driver.cuMemGetInfo())
    pointers: list[Any] = []
    refusal = ""
    while len(pointers) < 4096:
        err, pointer = driver.cuMemAlloc(BLOCK)
        if err != driver.CUresult.CUDA_SUCCESS:
            refusal = err.name
            break
        pointers.append(pointer)
    held = len(pointers)
    (err,) = driver.cuMemFree(pointers.pop())
    check((err, None))
    err, pointer = driver.cuMemAlloc(BLOCK)
    return {
        "mem_get_info_total_mib": int(total) // MIB,
        "mem_get_info_free_mib": int(free) // MIB,
        "blocks_256mib": held,
        "refusal": refusal,
        "allocates_after_a_free": err == driver.CUresult.CUDA_SUCCESS,
    }


def probe_cupy_memory() -> Result:
    import cupy

    free, total = cupy.cuda.runtime.memGetInfo()
    blocks: list[Any] = []
    refusal = ""
    while len(blocks) < 4096:
        try:
            blocks.append(cupy.empty(BLOCK, dtype=cupy.uint8))
        except cupy.cuda.memory.OutOfMemoryError as exc:
            refusal = str(exc)[:160]
            break
    return {
        "mem_get_info_total_mib": total // MIB,
        "mem_get_info_free_mib": free // MIB,
        "blocks_256mib": len(blocks),
        "refusal": refusal,
    }


def probe_jax_memory() -> Result:
    """JAX preallocates a fraction of what the driver says is free: under the hook, of the quota."""
    import jax
    import jax.numpy as jnp

    device = jax.devices("gpu")[0]
    stats = device.memory_stats() or {}
    blocks: list[Any] = []
    refusal = ""
    while len(blocks) < 4096:
        try:
            blocks.append(jnp.zeros(BLOCK // 4, dtype=jnp.float32, device=device).block_until_ready())
        except Exception as exc:  # XlaRuntimeError: RESOURCE_EXHAUSTED
            refusal = str(exc).splitlines()[0][:160]
            break
    return {
        "bytes_limit_mib": int(stats.get("bytes_limit", 0)) // MIB,
        "blocks_256mib": len(blocks),
        "refusal": refusal,
    }


def probe_torch_compute() -> Result:
    """PROBE_MATRIX x PROBE_MATRIX bf16 products back to back."""
    import torch

    size = int(setting("MATRIX", "8192"))
    a = torch.randn(size, size, dtype=torch.bfloat16, device="cuda")
    b = torch.randn(size, size, dtype=torch.bfloat16, device="cuda")
    return run_loop(lambda: torch.matmul(a, b), torch.cuda.synchronize)


def probe_torch_latency() -> Result:
    """A latency-critical service: one PROBE_MATRIX product every PROBE_GAP_MS."""
    import torch

    size = int(setting("MATRIX", "4096"))
    a = torch.randn(size, size, dtype=torch.bfloat16, device="cuda")
    for _ in range(20):
        torch.matmul(a, a)
    torch.cuda.synchronize()

    def request() -> None:
        torch.matmul(a, a)
        torch.cuda.synchronize()

    return latencies(request, float(setting("GAP_MS", "3")) / 1000)


def probe_torch_launch() -> Result:
    """The cost of a tiny kernel launch as PyTorch pays it (host time per launch, async)."""
    import torch

    x = torch.zeros(1, device="cuda")
    for _ in range(2000):
        x.add_(1)
    torch.cuda.synchronize()
    samples = []
    for _ in range(5):
        start = time.perf_counter_ns()
        for _ in range(20000):
            x.add_(1)
        samples.append((time.perf_counter_ns() - start) / 20000)
        torch.cuda.synchronize()
    return {"ns_per_launch_best_of_5": min(samples)}


def probe_torch_graph() -> Result:
    """A CUDA graph of four 8192 x 8192 products, replayed back to back: one launch (cuGraphLaunch)
    for four kernels, the path a compute quota must still hold."""
    import torch

    a = torch.randn(8192, 8192, dtype=torch.bfloat16, device="cuda")
    out = torch.empty_like(a)
    stream = torch.cuda.Stream()
    with torch.cuda.stream(stream):
        for _ in range(3):
            torch.matmul(a, a, out=out)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for _ in range(4):
            torch.matmul(a, a, out=out)
    return run_loop(graph.replay, torch.cuda.synchronize, per_step=1)


def probe_torch_compile() -> Result:
    """torch.compile(mode="reduce-overhead"): Inductor's kernels (Triton) replayed as CUDA graphs."""
    import torch

    a = torch.randn(8192, 8192, dtype=torch.bfloat16, device="cuda")

    @torch.compile(mode="reduce-overhead")
    def layer(x: Any) -> Any:
        return torch.relu(x @ x) * 0.5

    began = time.monotonic()
    for _ in range(3):
        layer(a)
    torch.cuda.synchronize()
    compile_s = time.monotonic() - began
    return {**run_loop(lambda: layer(a), torch.cuda.synchronize), "compile_s": round(compile_s, 1)}


def probe_triton_compute() -> Result:
    """A Triton kernel of its own (a multiply-add loop over a 64 MiB buffer): Triton's launcher
    reaches the driver through its own compiled stub, not through PyTorch."""
    import torch
    import triton
    import triton.language as tl

    # Triton reads the function's source: annotations would name globals it cannot see.
    @triton.jit  # type: ignore[misc]
    def spin(x_ptr, steps: tl.constexpr, block: tl.constexpr):  # type: ignore[no-untyped-def]
        offsets = tl.program_id(0) * block + tl.arange(0, block)
        x = tl.load(x_ptr + offsets)
        for _ in range(steps):
            x = x * 1.0001 + 0.0001
        tl.store(x_ptr + offsets, x)

    x = torch.ones(16 << 20, device="cuda")
    grid = (x.numel() // 1024,)
    return run_loop(lambda: spin[grid](x, steps=512, block=1024), torch.cuda.synchronize)


def probe_jax_compute() -> Result:
    import jax
    import jax.numpy as jnp

    a = jnp.ones((8192, 8192), dtype=jnp.bfloat16)
    product = jax.jit(lambda m: m @ m)
    last: list[Any] = [product(a)]

    def step() -> None:
        last[0] = product(a)

    def sync() -> None:
        last[0].block_until_ready()

    return run_loop(step, sync)


def probe_cupy_compute() -> Result:
    import cupy

    a = cupy.ones((8192, 8192), dtype=cupy.float16)
    return run_loop(lambda: a @ a, cupy.cuda.Device().synchronize)


def probe_transformers() -> Result:
    """A GPT-2-sized model from its config (random weights, nothing fetched): training steps of
    growing batches (sequence 512) until the quota refuses one with the framework's own
    out-of-memory error, then after freeing a training step and `generate` again; and the time per
    step at batch 2 (PROBE_OOM=0 skips the search: the unhooked GPU would take a while to fill)."""
    import torch
    from transformers import GPT2Config, GPT2LMHeadModel

    torch.manual_seed(0)
    model = GPT2LMHeadModel(GPT2Config()).cuda()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4)

    def train(batch: int) -> None:
        tokens = torch.randint(0, 50257, (batch, 512), device="cuda")
        loss = model(tokens, labels=tokens).loss
        loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)

    train(2)
    torch.cuda.synchronize()
    began = time.perf_counter()
    for _ in range(5):
        train(2)
    torch.cuda.synchronize()
    result: Result = {"ms_per_step_batch_2": round((time.perf_counter() - began) * 200, 1)}
    if setting("OOM", "1") == "1":
        batch, largest, refusal = 4, 2, ""
        while batch <= 256:
            try:
                train(batch)
                torch.cuda.synchronize()
                largest = batch
                batch *= 2
            except torch.OutOfMemoryError as exc:
                refusal = f"{type(exc).__name__}: {str(exc).splitlines()[0][:140]}"
                break
        optimizer.zero_grad(set_to_none=True)
        gc.collect()
        torch.cuda.empty_cache()
        result.update(largest_batch_that_fit=largest, refusal=refusal)
    train(1)
    prompt = torch.randint(0, 50257, (1, 16), device="cuda")
    generated = model.generate(prompt, max_new_tokens=24, do_sample=False, pad_token_id=0)
    torch.cuda.synchronize()
    result.update(
        trains_again_after_freeing=True,
        generated_tokens=int(generated.shape[1] - prompt.shape[1]),
        max_memory_allocated_mib=torch.cuda.max_memory_allocated() // MIB,
        total_seen_mib=torch.cuda.mem_get_info()[1] // MIB,
    )
    return result


PROBES: dict[str, Callable[[], Result]] = {
    name.removeprefix("probe_"): function
    for name, function in globals().items()
    if name.startswith("probe_") and callable(function)
}


def main() -> int:
    if len(sys.argv) != 2 or sys.argv[1] not in PROBES:
        print(f"usage: gpu_probes.py {{{','.join(sorted(PROBES))}}}", file=sys.stderr)
        return 2
    print(json.dumps(PROBES[sys.argv[1]]()), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
