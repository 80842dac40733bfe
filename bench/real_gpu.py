"""The hook on a real NVIDIA GPU: what the frameworks see under a memory quota, the share of GPU time
a compute quota gives, how contexts of several processes share the GPU, and which mechanism keeps a
latency-critical service fast beside batch work. Each probe is a fresh process
(`bench/gpu_probes.py`), under the hook or not; the hook runs standalone (environment variables,
docs/hook.md), so nothing is installed on the machine.

    python3 -m bench.real_gpu --hook hook/build/libvgpu.so [--checks ...] [--json OUT]

Checks (comma-separated; the default, DEFAULT_CHECKS, takes about 6 minutes on an H200):
  env           the machine: GPU, driver, compute policy, MPS
  memory        PyTorch (three allocators), cuda-bindings, CuPy, JAX under the memory quota
  launch        the cost of a launch, hooked and not (not in the default)
  compute       the compute quota's share (30%, 60%, elastic, pairs) (not in the default)
  timing        how contexts share the GPU: a service beside batch kernels of several lengths, the
                driver's time-slice setting, a stream's queue depth (driver probes)
  qos           the QoS candidates: latency-critical beside batch, unhooked and best-effort,
                time-sliced and under MPS with priorities and thread shares (driver probes;
                `qos-torch`, not in the default: the same with PyTorch matrix products)
  mps           MPS mode as the node agent sets it up, through the hook (`mps-torch`: PyTorch)
  workloads     CUDA graphs, torch.compile, Triton, JAX and CuPy under the quotas, against unhooked
  transformers  a GPT-2-sized transformers model: training and generate under the memory quota

The driver probes' checks (`timing`, `qos`, `mps`) run on the fake GPU too:
`tests/fakegpu/test_real_gpu_replay.py` replays them. Prints one JSON object per run as it finishes
(and appends it to --json), then a Markdown summary."""

from __future__ import annotations

import argparse
import json
import os
import select
import shutil
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

PROBES = Path(__file__).with_name("gpu_probes.py")
# What the real-GPU checks need, in under 8 minutes on one H100 or H200 (docs/benchmarks.md).
DEFAULT_CHECKS = "env,timing,qos,mps,mps-torch,memory,workloads,transformers"
Result = dict[str, Any]
Env = dict[str, str]


def plain_env(**probe: object) -> Env:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("TESSERA_", "PROBE_", "CUDA_MPS_"))}
    env.pop("LD_PRELOAD", None)
    env.update({f"PROBE_{k.upper()}": str(v) for k, v in probe.items()})
    return env


@dataclass
class Bench:
    hook: Path
    work: Path
    out: Path | None
    results: dict[str, Result] = field(default_factory=dict)
    regions: int = 0
    mps: Env = field(default_factory=dict)
    calibration: Env = field(default_factory=dict)
    workloads: tuple[str, ...] = (
        "torch_graph",
        "torch_compile",
        "triton_compute",
        "jax_compute",
        "cupy_compute",
    )

    def calibrate(self) -> None:
        """Once: the driver probes' iterations per microsecond, unhooked (gpu_probes.DriverKernel)."""
        if not self.calibration:
            result = self.record("driver kernels calibrated", run("driver_calibrate", plain_env()))
            self.calibration = {
                f"PROBE_{k.upper()}": str(v) for k, v in result.items() if k.endswith("_per_us")
            }

    def driver(self, **probe: object) -> Env:
        return {**plain_env(**probe), **self.calibration}

    def hooked(self, env: Env, **settings: object) -> Env:
        """`env` under the hook, with a region of its own (one container)."""
        self.regions += 1
        hooked = {**env, "LD_PRELOAD": str(self.hook)}
        hooked["TESSERA_REGION"] = str(self.work / f"region-{self.regions}")
        hooked.update({f"TESSERA_{k.upper()}": str(v) for k, v in settings.items()})
        return hooked

    def record(self, name: str, result: Result) -> Result:
        shown = {k: v for k, v in result.items() if k not in ("trace", "window", "start")}
        self.results[name] = shown
        line = json.dumps({name: shown})
        print(line, flush=True)
        if self.out:
            with self.out.open("a") as log:
                log.write(line + "\n")
        return result


def start(probe: str, env: Env) -> subprocess.Popen[str]:
    return subprocess.Popen(
        [sys.executable, str(PROBES), probe],
        env={**env, "PYTHONUNBUFFERED": "1"},
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )


def wait_warm(process: subprocess.Popen[str], timeout: float = 120) -> bool:
    """Until the batch prints `warm` (or ends: then its result says why)."""
    assert process.stdout is not None
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        ready, _, _ = select.select([process.stdout], [], [], 1.0)
        if ready:
            line = process.stdout.readline()
            if not line or line.startswith("warm"):
                return bool(line)
    return False


def finish(process: subprocess.Popen[str], timeout: float = 180) -> Result:
    try:
        out, err = process.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        process.kill()
        out, err = process.communicate()
        return {"error": f"timed out after {timeout} s", "stderr": err[-600:]}
    lines = [line for line in out.splitlines() if line.startswith("{")]
    if process.returncode != 0 or not lines:
        return {"error": f"exit {process.returncode}", "stderr": err[-800:]}
    result: Result = json.loads(lines[-1])
    hook_lines = [line for line in err.splitlines() if "tessera-hook" in line]
    if hook_lines:
        result["hook_messages"] = hook_lines[:5]
    return result


def run(probe: str, env: Env) -> Result:
    return finish(start(probe, env))


def rate_between(points: list[tuple[float, int]], begin: float, end: float) -> float | None:
    inside = [(t, n) for t, n in points if begin <= t <= end]
    if len(inside) < 2 or inside[-1][0] <= inside[0][0]:
        return None
    (t0, n0), (t1, n1) = inside[0], inside[-1]
    return round((n1 - n0) / (t1 - t0), 2)


def beside(bench: Bench, name: str, batch: tuple[str, Env], foreground: tuple[str, Env]) -> None:
    """A batch running flat out, then a foreground probe beside it (a service, or a standard
    container's own loop): the foreground's result, and the batch's rate inside the foreground's
    window against its rate before it, alone."""
    trace = bench.work / f"trace-{len(bench.results)}"
    batch_process = start(batch[0], {**batch[1], "PROBE_TRACE": str(trace), "PROBE_SECONDS": "120"})
    if not wait_warm(batch_process):
        bench.record(f"{name}: batch", finish(batch_process))
        return
    time.sleep(1.5)  # a stretch of the batch alone
    shown = bench.record(name, finish(start(*foreground)))
    batch_process.terminate()
    _, err = batch_process.communicate(timeout=30)
    points = [(float(t), int(n)) for t, n in (line.split() for line in trace.read_text().splitlines())]
    window = shown.get("window")
    if not points or not window:
        bench.record(f"{name}: batch", {"error": "no trace or window", "stderr": err[-600:]})
        return
    alone = rate_between(points, points[0][0], window[0])
    with_neighbour = rate_between(points, window[0], window[1])
    bench.record(
        f"{name}: batch",
        {
            "alone_steps_per_s": alone,
            "beside_steps_per_s": with_neighbour,
            "beside_over_alone": round(with_neighbour / alone, 3) if alone and with_neighbour else None,
        },
    )


def tool(name: str) -> str | None:
    return shutil.which(name) or next(
        (str(p) for p in (Path("/usr/local/nvidia/bin") / name, Path("/usr/bin") / name) if p.exists()),
        None,
    )


def shell(*command: str) -> str:
    try:
        done = subprocess.run(command, capture_output=True, text=True, timeout=60, check=False)
    except (OSError, subprocess.TimeoutExpired) as exc:
        return f"{type(exc).__name__}: {exc}"
    return (done.stdout + done.stderr).strip()[-1500:]


@contextmanager
def mps_daemon(bench: Bench) -> Iterator[bool]:
    """An MPS control daemon of its own pipe and log directories (as the node agent runs one per
    GPU); clients reach it through CUDA_MPS_PIPE_DIRECTORY."""
    control = tool("nvidia-cuda-mps-control")
    if control is None:
        bench.record("mps", {"error": "nvidia-cuda-mps-control not found"})
        yield False
        return
    pipe, log = bench.work / "mps-pipe", bench.work / "mps-log"
    pipe.mkdir(exist_ok=True)
    log.mkdir(exist_ok=True)
    env = {**os.environ, "CUDA_MPS_PIPE_DIRECTORY": str(pipe), "CUDA_MPS_LOG_DIRECTORY": str(log)}
    started = subprocess.run(
        [control, "-d"], env=env, capture_output=True, text=True, timeout=60, check=False
    )
    bench.record("mps daemon", {"rc": started.returncode, "output": (started.stdout + started.stderr)[-300:]})
    bench.mps = {"CUDA_MPS_PIPE_DIRECTORY": str(pipe), "CUDA_MPS_LOG_DIRECTORY": str(log)}
    try:
        yield started.returncode == 0
    finally:
        subprocess.run(
            [control], input="quit\n", env=env, capture_output=True, text=True, timeout=60, check=False
        )
        time.sleep(1)
        logs = "".join(f.read_text()[-400:] for f in sorted(log.glob("*.log")))
        bench.record("mps daemon stopped", {"log_tail": logs[-800:]})
        bench.mps = {}


# --- the checks ---


def check_env(bench: Bench) -> None:
    smi = tool("nvidia-smi")
    bench.record(
        "env",
        {
            "gpu": shell(
                smi,
                "--query-gpu=name,driver_version,memory.total,compute_mode,clocks.max.sm",
                "--format=csv,noheader",
            )
            if smi
            else "no nvidia-smi",
            "compute_policy": shell(smi, "compute-policy", "-l") if smi else "",
            "mps_control": tool("nvidia-cuda-mps-control"),
            "python": sys.version.split()[0],
            "versions": shell(
                sys.executable,
                "-c",
                "import importlib.metadata as m\n"
                "for n in ('torch', 'triton', 'jax', 'cupy-cuda13x', 'cuda-bindings',\n"
                "          'nvidia-ml-py', 'transformers'):\n"
                "  try: print(n, m.version(n))\n"
                "  except Exception: print(n, '-')",
            ),
        },
    )


def check_memory(bench: Bench, quota: str) -> None:
    for allocator in ("", "expandable_segments:True", "backend:cudaMallocAsync"):
        env = plain_env()
        if allocator:
            env["PYTORCH_CUDA_ALLOC_CONF"] = allocator
        bench.record(
            f"torch_memory {allocator or 'default'} hooked",
            run("torch_memory", bench.hooked(env, memory_limit=quota)),
        )
    for probe in ("driver_memory", "cupy_memory", "jax_memory"):
        bench.record(f"{probe} hooked", run(probe, bench.hooked(plain_env(), memory_limit=quota)))
    bench.record("torch_memory unhooked", run("torch_memory", plain_env()))


def check_launch(bench: Bench) -> None:
    bench.record("torch_launch unhooked", run("torch_launch", plain_env()))
    bench.record("torch_launch hooked, no compute quota", run("torch_launch", bench.hooked(plain_env())))
    bench.record(
        "torch_launch hooked, 100% compute quota", run("torch_launch", bench.hooked(plain_env(), cores=100))
    )


def check_compute(bench: Bench) -> None:
    bench.record("torch_compute unhooked", run("torch_compute", plain_env()))
    for cores in (30, 60):
        bench.record(f"torch_compute {cores}%", run("torch_compute", bench.hooked(plain_env(), cores=cores)))
    bench.record(
        "torch_compute 30% elastic", run("torch_compute", bench.hooked(plain_env(), cores=30, elastic=1))
    )
    pair = [start("torch_compute", bench.hooked(plain_env(), cores=c)) for c in (30, 60)]
    bench.record("torch_compute 30% beside 60%", finish(pair[0]))
    bench.record("torch_compute 60% beside 30%", finish(pair[1]))


def check_timing(bench: Bench, smi: str | None) -> None:
    """How the GPU shares itself between contexts, unhooked: a 250 us service every 3 ms alone and
    beside batch kernels of 500, 2000 and 8000 us (does it wait for the kernel, or for a time
    slice?), the driver's shorter time slice, and how far a stream's launches run ahead."""
    bench.calibrate()
    service = ("driver_service", bench.driver(seconds=3))
    bench.record("timing service alone", run(*service))
    for kernel_us in (500, 2000, 8000):
        beside(
            bench,
            f"timing service beside {kernel_us} us batch kernels",
            ("driver_batch", bench.driver(kernel_us=kernel_us)),
            service,
        )
    if smi and "Timeslice" in shell(smi, "compute-policy", "-l"):
        for level in ("1",):
            bench.record(
                f"timeslice set {level}", {"output": shell(smi, "compute-policy", f"--set-timeslice={level}")}
            )
            beside(
                bench,
                f"timing service beside 8000 us kernels, timeslice {level}",
                ("driver_batch", bench.driver(kernel_us=8000)),
                service,
            )
        bench.record("timeslice restored", {"output": shell(smi, "compute-policy", "--set-timeslice=0")})
    bench.record("timing queue depth", run("driver_queue", bench.driver()))


def check_qos(bench: Bench, backend: str) -> None:
    """A latency-critical service beside batch work flat out: unhooked batch (no classes), the
    best-effort class (today's yield rule), then under MPS: client priority below normal for the
    batch, and its active-thread percentage; and a standard container's share beside the batch."""
    coordination = bench.work / f"coordination-{backend}"
    coordination.mkdir(exist_ok=True)
    classes = {"coordination": str(coordination)}
    service_probe, batch_probe, standard_probe = (
        ("torch_latency", "torch_compute", "torch_compute")
        if backend == "torch"
        else ("driver_service", "driver_batch", "driver_batch")
    )
    tag = f"qos {backend}"
    if backend == "driver":
        bench.calibrate()
    base = bench.driver if backend == "driver" else plain_env

    def service(**mps: str) -> tuple[str, Env]:
        env = bench.hooked(
            {**base(seconds=3), **bench.mps, **mps}, cores=30, qos="latency-critical", **classes
        )
        return service_probe, env

    def batch(hooked: bool = False, **mps: str) -> tuple[str, Env]:
        env = {**base(), **bench.mps, **mps}
        return batch_probe, (bench.hooked(env, cores=10, qos="best-effort", **classes) if hooked else env)

    def standard(**mps: str) -> tuple[str, Env]:
        env = bench.hooked(
            {**base(seconds=3, kernel_us=1000), **bench.mps, **mps}, cores=30, qos="standard", **classes
        )
        return standard_probe, env

    def scenario(where: str) -> None:
        bench.record(f"{tag}{where}: latency-critical alone", run(*service()))
        beside(bench, f"{tag}{where}: latency-critical beside unhooked batch", batch(), service())
        if not bench.mps or backend == "driver":
            beside(
                bench,
                f"{tag}{where}: latency-critical beside best-effort batch",
                batch(hooked=True),
                service(),
            )
        if bench.mps:
            below = {"CUDA_MPS_CLIENT_PRIORITY": "1"}
            if backend == "driver":  # the sweep; PyTorch's products confirm the middle of it
                beside(
                    bench,
                    f"{tag}{where}: latency-critical beside batch at priority below normal",
                    batch(**below),
                    service(),
                )
            for percentage in ("50", "25") if backend == "driver" else ("50",):
                limited = {**below, "CUDA_MPS_ACTIVE_THREAD_PERCENTAGE": percentage}
                beside(
                    bench,
                    f"{tag}{where}: latency-critical beside batch below normal, {percentage}% threads",
                    batch(**limited),
                    service(),
                )
            limited = {**below, "CUDA_MPS_ACTIVE_THREAD_PERCENTAGE": "50"}
            bench.record(f"{tag}{where}: standard 30% alone", run(*standard()))
            beside(
                bench,
                f"{tag}{where}: standard 30% beside batch below normal, 50% threads",
                batch(**limited),
                standard(),
            )
        else:
            bench.record(f"{tag}{where}: standard 30% alone", run(*standard()))
            beside(
                bench, f"{tag}{where}: standard 30% beside best-effort batch", batch(hooked=True), standard()
            )

    scenario("")
    with mps_daemon(bench) as up:
        if up:
            scenario(" under MPS")


def check_mps(bench: Bench, backend: str) -> None:
    """MPS mode as the node agent sets it up: the hook makes each container an MPS client from its
    limits (TESSERA_MPS standalone), latency-critical and standard at normal priority with every
    thread, best-effort below normal with a share of the threads, over what the container's own
    environment says (the batch's claims 100% and normal priority)."""
    if backend == "driver":
        bench.calibrate()
    with mps_daemon(bench) as up:
        if not up:
            return
        pipe = bench.mps["CUDA_MPS_PIPE_DIRECTORY"]
        log = {"CUDA_MPS_LOG_DIRECTORY": bench.mps["CUDA_MPS_LOG_DIRECTORY"]}
        tenant = {"CUDA_MPS_ACTIVE_THREAD_PERCENTAGE": "100", "CUDA_MPS_CLIENT_PRIORITY": "0"}
        base = bench.driver if backend == "driver" else plain_env
        service_probe, batch_probe = (
            ("torch_latency", "torch_compute") if backend == "torch" else ("driver_service", "driver_batch")
        )
        guaranteed = f"{pipe} threads 100 priority 0"

        def service() -> tuple[str, Env]:
            env = {**base(seconds=3), **log}
            return service_probe, bench.hooked(env, cores=30, qos="latency-critical", mps=guaranteed)

        def batch(threads: int) -> tuple[str, Env]:
            env = {**base(), **log, **tenant}
            return batch_probe, bench.hooked(
                env, cores=10, qos="best-effort", mps=f"{pipe} threads {threads} priority 1"
            )

        def standard() -> tuple[str, Env]:
            env = {**base(seconds=3, kernel_us=1000), **log}
            return batch_probe, bench.hooked(env, cores=30, qos="standard", mps=guaranteed)

        tag = f"mps mode {backend}"
        bench.record(f"{tag}: latency-critical alone", run(*service()))
        beside(bench, f"{tag}: latency-critical beside best-effort batch, 50% threads", batch(50), service())
        if backend == "torch":
            bench.record(f"{tag}: standard 30% alone", run(*standard()))
            beside(bench, f"{tag}: standard 30% beside best-effort batch, 40% threads", batch(40), standard())


def check_workloads(bench: Bench, quota: str) -> None:
    for probe in bench.workloads:
        bench.record(f"{probe} unhooked", run(probe, plain_env(seconds=3)))
        bench.record(
            f"{probe} 30%", run(probe, bench.hooked(plain_env(seconds=3), memory_limit=quota, cores=30))
        )


def check_transformers(bench: Bench, quota: str) -> None:
    bench.record("transformers unhooked", run("transformers", plain_env(oom=0)))
    bench.record("transformers hooked", run("transformers", bench.hooked(plain_env(), memory_limit=quota)))


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--hook", type=Path, default=Path("hook/build/libvgpu.so"))
    parser.add_argument("--quota-mib", type=int, default=4096)
    parser.add_argument("--json", type=Path, help="append each result here, one JSON line each")
    parser.add_argument(
        "--checks",
        default=DEFAULT_CHECKS,
    )
    parser.add_argument("--workloads", help="comma-separated probes of the workloads check (default all)")
    args = parser.parse_args()
    checks = args.checks.split(",")
    known = {
        "env",
        "memory",
        "launch",
        "compute",
        "timing",
        "qos",
        "qos-torch",
        "mps",
        "mps-torch",
        "workloads",
        "transformers",
    }
    if unknown := set(checks) - known:
        parser.error(f"--checks: unknown {sorted(unknown)}; known: {sorted(known)}")
    quota = f"{args.quota_mib}m"
    began = time.monotonic()
    with tempfile.TemporaryDirectory(prefix="tessera-real-gpu-") as work:
        bench = Bench(args.hook.resolve(), Path(work), args.json)
        if args.workloads:
            bench.workloads = tuple(args.workloads.split(","))
        smi = tool("nvidia-smi")
        steps: dict[str, Callable[[], None]] = {
            "env": lambda: check_env(bench),
            "memory": lambda: check_memory(bench, quota),
            "launch": lambda: check_launch(bench),
            "compute": lambda: check_compute(bench),
            "timing": lambda: check_timing(bench, smi),
            "qos": lambda: check_qos(bench, "driver"),
            "qos-torch": lambda: check_qos(bench, "torch"),
            "mps": lambda: check_mps(bench, "driver"),
            "mps-torch": lambda: check_mps(bench, "torch"),
            "workloads": lambda: check_workloads(bench, quota),
            "transformers": lambda: check_transformers(bench, quota),
        }
        for check in checks:
            steps[check]()
        bench.record("elapsed", {"seconds": round(time.monotonic() - began, 1), "checks": args.checks})
    print("\n| run | result |\n|---|---|")
    for name, result in bench.results.items():
        print(f"| {name} | {', '.join(f'{k}: {v}' for k, v in result.items())} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
