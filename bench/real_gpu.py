"""The hook on a real NVIDIA GPU: what PyTorch, CuPy, JAX, cuda-bindings, NVML and nvidia-smi see
under a memory quota, and the share of GPU time a compute quota gives, hooked against unhooked.

The fake GPU cannot run NVIDIA's CUDA runtime (docs/hook.md), so this is the only place the hook
meets `libcudart` and the frameworks built on it. Needs an NVIDIA GPU with its driver, PyTorch,
cuda-bindings and nvidia-ml-py; CuPy and JAX are used when present. The hook runs standalone
(environment variables, docs/hook.md), so nothing is installed on the machine.

    python3 bench/real_gpu.py --hook hook/build/libvgpu.so [--quota-mib 4096] [--seconds 6] [--json OUT]

Prints one JSON object per check as it finishes, then a Markdown summary (docs/benchmarks.md)."""

# Each probe imports its framework itself: it runs in its own process, and a machine may lack some.
# ruff: noqa: PLC0415

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

BLOCK = 256 << 20
MIB = 1 << 20
Result = dict[str, Any]


# --- probes: each runs in its own process, under the hook or not, and prints one JSON line ---


def probe_torch_memory() -> Result:
    """Allocate 256 MiB tensors until the quota refuses; free one, allocate again; meanwhile ask
    NVML (in this process) and nvidia-smi (a child sharing the container's region) what they see."""
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
    """Matrix products back to back for PROBE_SECONDS (after one warm second): products per second,
    and NVML's GPU utilization (the share of time a kernel ran) and SM clock sampled every 50 ms. A
    GPU busy 30% of the time clocks higher than one busy all the time, so products per second
    overstate a share of time; the utilization is the share itself."""
    import threading

    import pynvml
    import torch

    seconds = float(os.environ.get("PROBE_SECONDS", "6"))
    size = int(os.environ.get("PROBE_MATRIX", "8192"))
    pynvml.nvmlInit()
    gpu = pynvml.nvmlDeviceGetHandleByIndex(0)
    clocks: list[int] = []
    busy: list[int] = []
    running = threading.Event()

    def sample_clock() -> None:
        while running.is_set():
            clocks.append(pynvml.nvmlDeviceGetClockInfo(gpu, pynvml.NVML_CLOCK_SM))
            busy.append(pynvml.nvmlDeviceGetUtilizationRates(gpu).gpu)
            time.sleep(0.05)

    a = torch.randn(size, size, dtype=torch.bfloat16, device="cuda")
    b = torch.randn(size, size, dtype=torch.bfloat16, device="cuda")
    warm_until = time.monotonic() + 1.0
    while time.monotonic() < warm_until:
        torch.matmul(a, b)
        torch.cuda.synchronize()
    running.set()
    sampler = threading.Thread(target=sample_clock, daemon=True)
    sampler.start()
    start = time.monotonic()
    count = 0
    while time.monotonic() - start < seconds:
        for _ in range(4):
            torch.matmul(a, b)
        torch.cuda.synchronize()
        count += 4
    elapsed = time.monotonic() - start
    running.clear()
    sampler.join()
    return {
        "products_per_s": count / elapsed,
        # the first second of samples covers NVML's averaging window reaching into the warm-up
        "mean_gpu_utilization": sum(busy[20:]) / max(1, len(busy[20:])),
        "mean_sm_clock_mhz": sum(clocks) / max(1, len(clocks)),
        "seconds": elapsed,
    }


def probe_torch_latency() -> Result:
    """A latency-critical service: one PROBE_MATRIX product every PROBE_GAP_MS, each timed from its
    launch to its completion on the host (the wait a request would see), for PROBE_SECONDS."""
    import torch

    seconds = float(os.environ.get("PROBE_SECONDS", "6"))
    size = int(os.environ.get("PROBE_MATRIX", "4096"))
    gap = float(os.environ.get("PROBE_GAP_MS", "3")) / 1000
    a = torch.randn(size, size, dtype=torch.bfloat16, device="cuda")
    for _ in range(20):
        torch.matmul(a, a)
    torch.cuda.synchronize()
    latencies: list[float] = []
    start = time.monotonic()
    while time.monotonic() - start < seconds:
        began = time.perf_counter()
        torch.matmul(a, a)
        torch.cuda.synchronize()
        latencies.append((time.perf_counter() - began) * 1000)
        time.sleep(gap)
    latencies.sort()
    return {
        "requests": len(latencies),
        "p50_ms": latencies[len(latencies) // 2],
        "p99_ms": latencies[min(len(latencies) - 1, int(0.99 * len(latencies)))],
    }


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


PROBES: dict[str, Callable[[], Result]] = {
    "torch_memory": probe_torch_memory,
    "driver_memory": probe_driver_memory,
    "cupy_memory": probe_cupy_memory,
    "jax_memory": probe_jax_memory,
    "torch_compute": probe_torch_compute,
    "torch_launch": probe_torch_launch,
    "torch_latency": probe_torch_latency,
}


# --- the parent: runs each probe with and without the hook ---


def hook_env(hook: Path, region: Path | None, **settings: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("TESSERA_")}
    env["LD_PRELOAD"] = str(hook)
    if region is not None:
        env["TESSERA_REGION"] = str(region)
    env.update({f"TESSERA_{k.upper()}": v for k, v in settings.items()})
    return env


def plain_env() -> dict[str, str]:
    return {k: v for k, v in os.environ.items() if not k.startswith("TESSERA_") and k != "LD_PRELOAD"}


def start(probe: str, env: dict[str, str]) -> subprocess.Popen[str]:
    env = {**env, "PYTHONUNBUFFERED": "1"}
    return subprocess.Popen(
        [sys.executable, __file__, "--probe", probe],
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )


def finish(process: subprocess.Popen[str], timeout: float = 90) -> Result:
    try:
        out, err = process.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        process.kill()
        out, err = process.communicate()
        return {"error": f"timed out after {timeout} s", "stderr": err[-600:]}
    lines = [line for line in out.splitlines() if line.startswith("{")]
    if process.returncode != 0 or not lines:
        return {"error": f"exit {process.returncode}", "stderr": err[-600:]}
    result: Result = json.loads(lines[-1])
    hook_lines = [line for line in err.splitlines() if "tessera-hook" in line]
    if hook_lines:
        result["hook_messages"] = hook_lines[:5]
    return result


def run(probe: str, env: dict[str, str]) -> Result:
    return finish(start(probe, env))


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--probe", choices=sorted(PROBES), help=argparse.SUPPRESS)
    parser.add_argument("--hook", type=Path, default=Path("hook/build/libvgpu.so"))
    parser.add_argument("--quota-mib", type=int, default=4096)
    parser.add_argument("--seconds", type=float, default=6.0, help="timed seconds per compute probe")
    parser.add_argument("--json", type=Path, help="also write every result here")
    parser.add_argument(
        "--checks",
        default="memory,launch,compute,qos",
        help="comma-separated: memory, launch, compute, qos",
    )
    args = parser.parse_args()
    if args.probe:
        print(json.dumps(PROBES[args.probe]()))
        return 0

    hook = args.hook.resolve()
    quota = f"{args.quota_mib}m"
    os.environ["PROBE_SECONDS"] = str(args.seconds)
    results: dict[str, Result] = {}

    def record(name: str, result: Result) -> Result:
        results[name] = result
        print(json.dumps({name: result}), flush=True)
        return result

    with tempfile.TemporaryDirectory(prefix="tessera-real-gpu-") as work:
        regions = iter(Path(work) / f"region-{i}" for i in range(100))
        checks = set(args.checks.split(","))
        if "memory" in checks:
            for probe in ("torch_memory", "driver_memory", "cupy_memory", "jax_memory"):
                record(f"{probe} hooked", run(probe, hook_env(hook, next(regions), memory_limit=quota)))
            record("torch_memory unhooked", run("torch_memory", plain_env()))
        if "launch" in checks:
            launch(record, hook, regions)
        if "compute" in checks:
            compute(record, hook, regions)
        if "qos" in checks:
            qos(record, hook, regions, Path(work) / "coordination")

    if args.json:
        args.json.write_text(json.dumps(results, indent=2))
    print("\n| check | result |\n|---|---|")
    for name, result in results.items():
        print(f"| {name} | {', '.join(f'{k}: {v}' for k, v in result.items())} |")
    return 0


Record = Callable[[str, Result], Result]


def launch(record: Record, hook: Path, regions: Iterator[Path]) -> None:
    record("torch_launch unhooked", run("torch_launch", plain_env()))
    record("torch_launch hooked, no compute quota", run("torch_launch", hook_env(hook, next(regions))))
    record(
        "torch_launch hooked, 100% compute quota",
        run("torch_launch", hook_env(hook, next(regions), cores="100")),
    )


def compute(record: Record, hook: Path, regions: Iterator[Path]) -> None:
    record("torch_compute unhooked", run("torch_compute", plain_env()))
    for cores in ("30", "60"):
        record(f"torch_compute {cores}%", run("torch_compute", hook_env(hook, next(regions), cores=cores)))
    record(
        "torch_compute 30% elastic",
        run("torch_compute", hook_env(hook, next(regions), cores="30", elastic="1")),
    )
    pair = [
        start("torch_compute", hook_env(hook, next(regions), cores="30")),
        start("torch_compute", hook_env(hook, next(regions), cores="60")),
    ]
    record("torch_compute 30% beside 60%", finish(pair[0]))
    record("torch_compute 60% beside 30%", finish(pair[1]))
    pair = [start("torch_compute", plain_env()), start("torch_compute", plain_env())]
    record("torch_compute unhooked pair (first)", finish(pair[0]))
    record("torch_compute unhooked pair (second)", finish(pair[1]))
    small = {"PROBE_MATRIX": "2048"}
    record("torch_compute 2048 unhooked", run("torch_compute", {**plain_env(), **small}))
    record(
        "torch_compute 2048 30%", run("torch_compute", {**hook_env(hook, next(regions), cores="30"), **small})
    )


def qos(record: Record, hook: Path, regions: Iterator[Path], coordination: Path) -> None:
    """A latency-critical service (30% quota) alone, then beside a batch job running 8192 x 8192
    products flat out: unhooked (no classes), and as a best-effort container (10% of compute, the
    least a pod asks; best-effort takes what the others leave idle)."""
    coordination.mkdir()
    classes = {"coordination": str(coordination)}

    def service() -> subprocess.Popen[str]:
        return start(
            "torch_latency", hook_env(hook, next(regions), cores="30", qos="latency-critical", **classes)
        )

    record("qos latency-critical alone", finish(service()))
    for batch_name, batch_env in (
        ("unhooked batch", plain_env()),
        ("best-effort batch", hook_env(hook, next(regions), cores="10", qos="best-effort", **classes)),
    ):
        batch = start("torch_compute", {**batch_env, "PROBE_SECONDS": "12"})
        time.sleep(5)  # the batch is past its start-up and warm-up
        record(f"qos latency-critical beside {batch_name}", finish(service()))
        record(f"qos {batch_name}", finish(batch))


if __name__ == "__main__":
    sys.exit(main())
